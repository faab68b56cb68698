// Pipeline parallelism: the schedule as data, and the one executor that runs it.
#pragma once
#include <chrono>
#include <functional>
#include <string>
#include <vector>
#include "comm.h"
#include "utils.h"

// ---- schedule (placeholder until the schedule generators land) ----
enum PipeKind { PIPE_GPIPE = 0, PIPE_1F1B = 1, PIPE_INTERLEAVED = 2, PIPE_ZB1 = 3 };
enum PipeOp { PIPE_F, PIPE_B, PIPE_W, PIPE_SEND_ACT, PIPE_RECV_ACT, PIPE_SEND_GRAD, PIPE_RECV_GRAD };
struct PipeAction {
    PipeOp op;
    int mb;
    int chunk;
    int peer;
};
inline PipeKind parse_pipe_kind(const std::string& s) {
    if (s == "gpipe") return PIPE_GPIPE;
    if (s == "1f1b") return PIPE_1F1B;
    if (s == "interleaved") return PIPE_INTERLEAVED;
    if (s == "zb1") return PIPE_ZB1;
    LLMC_FAIL("--pp_schedule: expected gpipe, 1f1b, interleaved or zb1, got '%s'", s.c_str());
}
inline const char* pipe_kind_name(PipeKind k) {
    static const char* names[] = {"gpipe", "1f1b", "interleaved", "zb1"};
    return names[k];
}
inline std::vector<std::vector<PipeAction>> pipeline_schedule(PipeKind kind, int P, int M, int V) {
    LLMC_CHECK(V == 1, "placeholder: V 1 only");
    std::vector<std::vector<PipeAction>> out(P);
    for (int s = 0; s < P; s++) {
        auto& a = out[s];
        auto fwd = [&](int mb) {
            if (s > 0) a.push_back({PIPE_RECV_ACT, mb, 0, s - 1});
            a.push_back({PIPE_F, mb, 0, -1});
            if (s < P - 1) a.push_back({PIPE_SEND_ACT, mb, 0, s + 1});
        };
        auto bwd = [&](int mb) {
            if (s < P - 1) a.push_back({PIPE_RECV_GRAD, mb, 0, s + 1});
            a.push_back({PIPE_B, mb, 0, -1});
            if (s > 0) a.push_back({PIPE_SEND_GRAD, mb, 0, s - 1});
            a.push_back({PIPE_W, mb, 0, -1});
        };
        if (kind == PIPE_GPIPE) {
            for (int mb = 0; mb < M; mb++) fwd(mb);
            for (int mb = 0; mb < M; mb++) bwd(mb);
        } else {
            const int warm = std::min(P - s - 1, M);
            for (int mb = 0; mb < warm; mb++) fwd(mb);
            for (int k = 0; k < M - warm; k++) {
                fwd(warm + k);
                bwd(k);
            }
            for (int mb = M - warm; mb < M; mb++) bwd(mb);
        }
    }
    return out;
}

// ---- executor ----
// The model's side of the executor: the three computations of one (micro-batch, chunk), and where
// each transfer's bytes are.
struct PipeModel {
    std::function<void(int mb, int chunk)> forward;
    // backward input gradients; with_weights: also the weight gradients (the W that follows at once)
    std::function<void(int mb, int chunk, bool with_weights)> backward;
    // the weight gradients; already_done: the backward did them (only release what the pair held)
    std::function<void(int mb, int chunk, bool already_done)> weights;
    std::function<P2POp(const PipeAction& a)> transfer;  // buffer, bytes, peer, tag of a send or receive
    std::function<void()> sync;                          // wait for the queued device work (timing)
};

// One executed action, for --pp_trace: times from the step's start on this rank.
struct PipeEvent {
    PipeOp op;
    int mb, chunk;
    double t0_ms, t1_ms;
};
struct PipeTimes {
    double compute_ms = 0, wait_ms = 0, total_ms = 0;  // wait: inside transfers (the bubble, as seen here)
};

inline bool is_compute(PipeOp op) { return op == PIPE_F || op == PIPE_B || op == PIPE_W; }
// the W at k directly follows its own B (no computation between): that B computed it
inline bool previous_compute_is_b(const std::vector<PipeAction>& actions, size_t k) {
    for (size_t j = k; j-- > 0;)
        if (is_compute(actions[j].op))
            return actions[j].op == PIPE_B && actions[j].mb == actions[k].mb && actions[j].chunk == actions[k].chunk;
    return false;
}

// Runs one stage's action list. Transfers between two computations form one group (p2p_group:
// all posted at once, all complete before the next computation), which is how the schedules are
// checked for deadlock freedom (pipe_simulate's rendezvous mode). A B whose W follows it with no
// computation in between is run as one backward with the weight gradients (no stash). measure: time
// every action (on the GPU this waits for the device after each one).
inline PipeTimes pipeline_execute(const std::vector<PipeAction>& actions, const CommGroup& pp, const PipeModel& model,
                                  bool measure, std::vector<PipeEvent>* trace) {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    auto now_ms = [&] { return std::chrono::duration<double, std::milli>(clock::now() - start).count(); };
    PipeTimes times;
    std::vector<P2POp> group;
    std::vector<const PipeAction*> group_actions;
    auto flush = [&] {
        if (group.empty()) return;
        const double t0 = measure ? now_ms() : 0;
        p2p_group(pp, group);
        if (measure) {
            model.sync();
            const double t1 = now_ms();
            times.wait_ms += t1 - t0;
            if (trace)
                for (const PipeAction* a : group_actions)
                    trace->push_back({a->op, a->mb, a->chunk, t0, t1});
        }
        group.clear();
        group_actions.clear();
    };
    for (size_t k = 0; k < actions.size(); k++) {
        const PipeAction& a = actions[k];
        if (!is_compute(a.op)) {
            group.push_back(model.transfer(a));
            group_actions.push_back(&a);
            continue;
        }
        flush();
        bool fused = false;
        if (a.op == PIPE_B)
            for (size_t j = k + 1; j < actions.size(); j++) {
                const PipeAction& n = actions[j];
                if (is_compute(n.op)) {
                    fused = n.op == PIPE_W && n.mb == a.mb && n.chunk == a.chunk;
                    break;
                }
            }
        const double t0 = measure ? now_ms() : 0;
        if (a.op == PIPE_F) model.forward(a.mb, a.chunk);
        else if (a.op == PIPE_B) model.backward(a.mb, a.chunk, fused);
        else model.weights(a.mb, a.chunk, previous_compute_is_b(actions, k));
        if (measure) {
            model.sync();
            const double t1 = now_ms();
            times.compute_ms += t1 - t0;
            if (trace) trace->push_back({a.op, a.mb, a.chunk, t0, t1});
        }
    }
    flush();
    times.total_ms = now_ms();
    return times;
}
inline double pipe_bubble_formula(PipeKind kind, int P, int M, int V) {
    (void)kind;
    (void)V;
    return (double)(P - 1) / (M + P - 1);
}
