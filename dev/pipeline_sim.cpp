// Prints a pipeline schedule (llmc/parallel/pipeline.h) and its simulated bubble, and can write the
// simulated step as a --pp_trace style JSONL file for scripts/plot_pipeline.py.
//   g++ -O2 -std=c++17 -I. dev/pipeline_sim.cpp -o /tmp/pipeline_sim
//   /tmp/pipeline_sim zb1 4 8 1 [cost_f cost_b cost_w] [--trace FILE] [--dp D]
// Costs are per stage (each chunk costs 1/V of them); times in the trace are in those units, as ms.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include "test/pipeline_sim.h"

int main(int argc, char** argv) {
    std::vector<std::string> pos;
    std::string trace;
    int dp = 1;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (a == "--trace" && i + 1 < argc) trace = argv[++i];
        else if (a == "--dp" && i + 1 < argc) dp = (int)parse_int64(argv[++i], "dp", 1, 64);
        else pos.push_back(a);
    }
    if (pos.size() != 4 && pos.size() != 7) {
        fprintf(stderr, "usage: %s KIND P M V [COST_F COST_B COST_W] [--trace FILE] [--dp D]\n", argv[0]);
        return 2;
    }
    try {
        const PipeKind kind = parse_pipe_kind(pos[0]);
        const int P = (int)parse_int64(pos[1], "pp", 1, 1024), M = (int)parse_int64(pos[2], "micro", 1, 1 << 20);
        const int V = (int)parse_int64(pos[3], "pp_virtual", 1, 64);
        double c[3] = {1, 2, 0};
        if (pos.size() == 7)
            for (int k = 0; k < 3; k++) c[k] = parse_double(pos[4 + k], "cost");
        const auto sched = pipeline_schedule(kind, P, M, V);
        const PipeSim sim = pipe_simulate(sched, P, V, c[0] / V, c[1] / V, c[2] / V);
        printf("%s P=%d M=%d V=%d, costs per stage F=%g B=%g W=%g\n", pipe_kind_name(kind), P, M, V, c[0], c[1], c[2]);
        for (int s = 0; s < P; s++) {
            printf("stage %d (in flight %d, W pending %d, idle %g):", s, pipe_max_in_flight(sched[s]),
                   pipe_max_w_pending(sched[s]), sim.idle[s]);
            for (const PipeAction& a : sched[s])
                if (a.op <= PIPE_W) printf(V > 1 ? " %s%d.%d" : " %s%d", pipe_op_name(a.op), a.mb, a.chunk);
            printf("\n");
        }
        printf("makespan %g, simulated bubble %.6f, formula %.6f\n", sim.makespan, sim.bubble(),
               pipe_bubble_formula(kind, P, M, V));
        if (!trace.empty()) {
            FILE* f = fopen_or_fail(trace, "w");
            for (int d = 0; d < dp; d++)
                for (int s = 0; s < P; s++)
                    for (size_t i = 0; i < sched[s].size(); i++) {
                        const PipeAction& a = sched[s][i];
                        const char* op = a.op <= PIPE_W ? pipe_op_name(a.op)
                                         : (a.op == PIPE_SEND_ACT || a.op == PIPE_SEND_GRAD) ? "send" : "recv";
                        fprintf(f, "{\"rank\": %d, \"stage\": %d, \"dp\": %d, \"op\": \"%s\", \"mb\": %d, \"chunk\": %d, "
                                "\"t0_ms\": %.6f, \"t1_ms\": %.6f}\n", d * P + s, s, d, op, a.mb, a.chunk,
                                sim.t0[s][i], sim.t1[s][i]);
                    }
            fclose(f);
        }
    } catch (const LlmcError& e) {
        fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
    return 0;
}
