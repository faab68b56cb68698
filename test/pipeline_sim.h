// An event simulation of the pipeline executor (llmc/parallel/pipeline.h) over a schedule: the proof that a
// schedule cannot deadlock and its bubble under given costs. Used by test/test_pipeline.cpp and
// dev/pipeline_sim.cpp; the trainer runs the real executor instead.
#pragma once
#include <algorithm>
#include <string>
#include <vector>
#include "llmc/parallel/pipeline.h"

// Simulation of the executor: each stage runs its list in order; F, B, W take cost_f, cost_b,
// cost_w (per chunk: callers pass a stage's cost / V for interleaved); a send is non-blocking and
// free, its message available at once (latency 0); a recv blocks until its message was sent.
// Stages are advanced in turn, each as far as it can go, until all finish (a stage's clock only
// depends on its own list and on the send times it waits for, so the result does not depend on
// the turn order: it is the event-queue result). Checks on the way, each an LlmcError that says
// what was found: every send has exactly one matching recv with consistent peers and vice versa;
// every (micro-batch, chunk) runs F, B, W exactly once per stage, B after F, W after B, a recv
// before the compute that consumes it, a send after the compute that produced it; a deadlock
// names every blocked stage, what it waits for and from whom.
struct PipeSim {
    std::vector<double> busy, idle, finish;  // per stage; idle = makespan - busy (waits + tail)
    std::vector<std::vector<double>> t0, t1;  // per stage, per action: start and end (a recv: its wait)
    double makespan = 0;
    double bubble() const {  // idle / (P * makespan), over all stages
        double total = 0;
        for (double x : idle) total += x;
        return makespan > 0 ? total / (makespan * (double)idle.size()) : 0;
    }
};

inline PipeSim pipe_simulate(const std::vector<std::vector<PipeAction>>& schedule, int P, int V,
                             double cost_f, double cost_b, double cost_w) {
    LLMC_CHECK(P >= 1 && V >= 1 && (int)schedule.size() == P, "pipe_simulate: %zu stage lists for P=%d (V=%d)",
               schedule.size(), P, V);
    LLMC_CHECK(cost_f >= 0 && cost_b >= 0 && cost_w >= 0 && cost_f + cost_b + cost_w < 1e300,
               "pipe_simulate: costs must be finite and >= 0, got F=%g B=%g W=%g", cost_f, cost_b, cost_w);
    const int L = V * P;
    int M = 0;
    for (int s = 0; s < P; s++)
        for (const PipeAction& a : schedule[s]) {
            LLMC_CHECK(a.mb >= 0 && a.chunk >= 0 && a.chunk < V && a.op >= PIPE_F && a.op <= PIPE_RECV_GRAD,
                       "pipe_simulate: stage %d has %s(mb %d, chunk %d): bad op, mb or chunk (V=%d)", s,
                       pipe_op_name(a.op), a.mb, a.chunk, V);
            M = std::max(M, a.mb + 1);
        }
    checked_product({2, L, M}, 1 << 28, "pipe_simulate: message slots (2 * V * P * micro-batches)");
    // Messages: slot (dir, sender virtual stage, mb); dir 0 = activation (vs -> vs+1), 1 = grad (vs -> vs-1).
    auto slot = [&](int dir, int sender_vs, int mb) { return ((size_t)dir * L + sender_vs) * M + mb; };
    const size_t nslots = (size_t)2 * L * M;
    std::vector<int> sends(nslots, 0), recvs(nslots, 0);
    std::vector<double> sent_at(nslots, -1);
    auto describe = [&](int s, const PipeAction& a) {
        return strfmt("%s(mb %d, chunk %d) on stage %d", pipe_op_name(a.op), a.mb, a.chunk, s);
    };
    // For a send/recv: its slot, after checking the peer is the stage of the neighbouring virtual stage.
    auto message_slot = [&](int s, const PipeAction& a) {
        const int vs = a.chunk * P + s;
        const bool is_send = a.op == PIPE_SEND_ACT || a.op == PIPE_SEND_GRAD;
        const int dir = (a.op == PIPE_SEND_ACT || a.op == PIPE_RECV_ACT) ? 0 : 1;
        const int other_vs = vs + ((dir == 0) == is_send ? 1 : -1);  // the vs at the other end
        LLMC_CHECK(other_vs >= 0 && other_vs < L, "pipe_simulate: %s: virtual stage %d has no neighbour %d",
                   describe(s, a).c_str(), vs, other_vs);
        LLMC_CHECK(a.peer == other_vs % P, "pipe_simulate: %s names peer %d, but virtual stage %d is on stage %d",
                   describe(s, a).c_str(), a.peer, other_vs, other_vs % P);
        return slot(dir, is_send ? vs : other_vs, a.mb);
    };
    for (int s = 0; s < P; s++)
        for (const PipeAction& a : schedule[s]) {
            if (a.op == PIPE_SEND_ACT || a.op == PIPE_SEND_GRAD) sends[message_slot(s, a)]++;
            if (a.op == PIPE_RECV_ACT || a.op == PIPE_RECV_GRAD) recvs[message_slot(s, a)]++;
        }
    for (int s = 0; s < P; s++)
        for (const PipeAction& a : schedule[s]) {
            if (a.op < PIPE_SEND_ACT) continue;
            const size_t k = message_slot(s, a);
            LLMC_CHECK(sends[k] <= 1 && recvs[k] <= 1, "pipe_simulate: %s: the message is sent %d times and received %d times",
                       describe(s, a).c_str(), sends[k], recvs[k]);
            LLMC_CHECK(sends[k] == recvs[k], "pipe_simulate: %s has no matching %s on stage %d",
                       describe(s, a).c_str(),
                       a.op == PIPE_SEND_ACT ? "RECV_ACT" : a.op == PIPE_RECV_ACT ? "SEND_ACT"
                       : a.op == PIPE_SEND_GRAD ? "RECV_GRAD" : "SEND_GRAD", a.peer);
        }
    // Run. Per stage and (mb, chunk): 1 = F done, 2 = B done, 3 = W done; and whether its input
    // activation / gradient was received.
    PipeSim r;
    r.busy.assign(P, 0); r.idle.assign(P, 0); r.finish.assign(P, 0);
    r.t0.resize(P); r.t1.resize(P);
    std::vector<std::vector<int>> state(P, std::vector<int>((size_t)M * V, 0)), got(P, std::vector<int>((size_t)M * V, 0));
    std::vector<size_t> pc(P, 0);
    std::vector<double> clock(P, 0);
    for (int s = 0; s < P; s++) { r.t0[s].assign(schedule[s].size(), 0); r.t1[s].assign(schedule[s].size(), 0); }
    for (bool progress = true; progress;) {
        progress = false;
        for (int s = 0; s < P; s++) {
            for (; pc[s] < schedule[s].size(); pc[s]++) {
                const PipeAction& a = schedule[s][pc[s]];
                const int u = a.mb * V + a.chunk, vs = a.chunk * P + s;
                int& st = state[s][u];
                const bool is_compute = a.op == PIPE_F || a.op == PIPE_B || a.op == PIPE_W;
                double start = clock[s], cost = 0;
                if (a.op == PIPE_RECV_ACT || a.op == PIPE_RECV_GRAD) {
                    const size_t k = message_slot(s, a);
                    if (sent_at[k] < 0) break;  // blocked: try the other stages
                    cost = std::max(0.0, sent_at[k] - start);  // the wait (idle, not busy)
                    got[s][u] |= a.op == PIPE_RECV_ACT ? 1 : 2;
                } else if (a.op == PIPE_SEND_ACT || a.op == PIPE_SEND_GRAD) {
                    LLMC_CHECK(st >= (a.op == PIPE_SEND_ACT ? 1 : 2),
                               "pipe_simulate: %s before the %s that produces it", describe(s, a).c_str(),
                               a.op == PIPE_SEND_ACT ? "F" : "B");
                    sent_at[message_slot(s, a)] = start;
                } else {
                    const int want = a.op == PIPE_F ? 0 : a.op == PIPE_B ? 1 : 2;
                    LLMC_CHECK(st == want, "pipe_simulate: %s %s", describe(s, a).c_str(),
                               st > want ? "runs twice" : a.op == PIPE_B ? "before its F" : "before its B");
                    LLMC_CHECK(a.op != PIPE_F || vs == 0 || (got[s][u] & 1), "pipe_simulate: %s before its RECV_ACT",
                               describe(s, a).c_str());
                    LLMC_CHECK(a.op != PIPE_B || vs == L - 1 || (got[s][u] & 2), "pipe_simulate: %s before its RECV_GRAD",
                               describe(s, a).c_str());
                    st = want + 1;
                    cost = a.op == PIPE_F ? cost_f : a.op == PIPE_B ? cost_b : cost_w;
                }
                r.t0[s][pc[s]] = start;
                r.t1[s][pc[s]] = clock[s] = start + cost;
                if (is_compute) r.busy[s] += cost;
                progress = true;
            }
        }
    }
    std::string blocked;
    for (int s = 0; s < P; s++)
        if (pc[s] < schedule[s].size()) {
            const PipeAction& a = schedule[s][pc[s]];
            const int p = a.peer;  // only recvs block; the peer is a valid stage (checked above)
            blocked += strfmt("%sstage %d waits in %s (action %zu) for stage %d, which %s", blocked.empty() ? "" : "; ",
                              s, describe(s, a).c_str(), pc[s], p,
                              pc[p] < schedule[p].size() ? ("waits in " + describe(p, schedule[p][pc[p]])).c_str()
                                                         : "has finished without sending it");
        }
    LLMC_CHECK(blocked.empty(), "pipe_simulate: deadlock: %s", blocked.c_str());
    for (int s = 0; s < P; s++)
        for (int u = 0; u < M * V; u++)
            LLMC_CHECK(state[s][u] == 3, "pipe_simulate: stage %d never runs %s of mb %d, chunk %d", s,
                       state[s][u] == 0 ? "F" : state[s][u] == 1 ? "B" : "W", u / V, u % V);
    for (int s = 0; s < P; s++) r.makespan = std::max(r.makespan, r.finish[s] = clock[s]);
    for (int s = 0; s < P; s++) r.idle[s] = r.makespan - r.busy[s];
    return r;
}
