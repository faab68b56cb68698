// Pipeline-parallel schedules: for each pipeline stage, the ordered list of computations (F, B, W)
// and point-to-point messages it executes in one optimizer step; plus their memory bounds and the
// closed-form bubble fractions (pure host code), and the executor that runs a stage's list. An
// event simulation of the executor, for the tests and dev/pipeline_sim.cpp, is test/pipeline_sim.h.
//
// Terms. P pipeline stages (ranks of the pp group), M micro-batches per optimizer step (the gradient
// accumulation steps), V model chunks per stage (interleaved only, else 1). Chunk c on stage s is
// virtual stage vs = c*P + s; the model runs vs = 0 .. V*P-1 in order.
//   F(mb, c)  forward of virtual stage vs for micro-batch mb. vs == 0 reads the data; any other vs
//             first does RECV_ACT(mb, c) from the stage of vs-1; vs < V*P-1 then does SEND_ACT(mb, c)
//             to the stage of vs+1 (vs == V*P-1 computes the loss).
//   B(mb, c)  backward, input-gradient part. vs < V*P-1 first does RECV_GRAD(mb, c) from the stage
//             of vs+1; vs > 0 then does SEND_GRAD(mb, c) to the stage of vs-1.
//   W(mb, c)  backward, weight-gradient part (after B(mb, c)). On every stage and chunk the W's run
//             in increasing micro-batch order (the executor folds them into fp32 accumulators in
//             that order, for bitwise-reproducible gradients).
// Messages. `chunk` is always the local chunk of the stage that holds the action: on a send the
// sender's chunk, on a recv the receiver's (the chunk that will consume it). A message is
// identified by (direction, mb, virtual stage of the SENDER): SEND_ACT(mb, c) on stage s (sender
// vs = c*P+s) pairs with RECV_ACT(mb, c') on stage (s+1)%P where c'*P + (s+1)%P == vs+1, i.e.
// c' = c, or c+1 when s == P-1 (the wrap from the last stage to stage 0). SEND_GRAD(mb, c) on stage
// s pairs with RECV_GRAD(mb, c') on stage (s-1+P)%P with c' = c, or c-1 when s == 0. `peer` is the
// other stage of the pair (-1 on F, B, W).
// Ordering. Each recv sits right before the computation that consumes it and each send right after
// the one that produced it (before any W that follows it). With non-blocking (buffered) sends and
// blocking recvs this cannot deadlock: every recv waits only on a send that comes earlier in the
// sender's list, and pipe_simulate (test/pipeline_sim.h) proves it for a given schedule.
#pragma once
#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <vector>
#include "llmc/parallel/comm.h"
#include "llmc/utils.h"

enum PipeKind { PIPE_GPIPE = 0, PIPE_1F1B = 1, PIPE_INTERLEAVED = 2, PIPE_ZB1 = 3 };

inline PipeKind parse_pipe_kind(const std::string& s) {
    if (s == "gpipe") return PIPE_GPIPE;
    if (s == "1f1b") return PIPE_1F1B;
    if (s == "interleaved") return PIPE_INTERLEAVED;
    if (s == "zb1") return PIPE_ZB1;
    LLMC_FAIL("--pp_schedule: unknown schedule '%s', expected gpipe, 1f1b, interleaved or zb1", s.c_str());
}
inline const char* pipe_kind_name(PipeKind k) {
    switch (k) {
        case PIPE_GPIPE: return "gpipe";
        case PIPE_1F1B: return "1f1b";
        case PIPE_INTERLEAVED: return "interleaved";
        case PIPE_ZB1: return "zb1";
    }
    return "unknown";
}

enum PipeOp { PIPE_F, PIPE_B, PIPE_W, PIPE_SEND_ACT, PIPE_RECV_ACT, PIPE_SEND_GRAD, PIPE_RECV_GRAD };
inline const char* pipe_op_name(PipeOp op) {
    static const char* names[] = {"F", "B", "W", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD"};
    return (int)op >= 0 && (int)op < 7 ? names[op] : "?";
}

struct PipeAction {
    PipeOp op;
    int mb;     // micro-batch 0..M-1
    int chunk;  // local model chunk 0..V-1 on this stage; virtual stage = chunk * P + stage
    int peer;   // for send/recv: the other pipeline stage (rank in the pp group); -1 otherwise
};

// Throws LlmcError naming the flag when (kind, P, M, V) is not a schedule this file can build.
inline void pipe_check_args(PipeKind kind, int P, int M, int V) {
    const char* name = pipe_kind_name(kind);
    LLMC_CHECK(kind >= PIPE_GPIPE && kind <= PIPE_ZB1, "--pp_schedule: unknown schedule %d", (int)kind);
    LLMC_CHECK(P >= 1, "--pp %d: the number of pipeline stages must be at least 1", P);
    LLMC_CHECK(M >= 1, "micro-batches per step (gradient accumulation steps) must be at least 1, got %d", M);
    LLMC_CHECK(V >= 1, "--pp_virtual %d: the number of model chunks per stage must be at least 1", V);
    LLMC_CHECK(V == 1 || kind == PIPE_INTERLEAVED,
               "--pp_virtual %d: several model chunks per stage need --pp_schedule interleaved "
               "(--pp_schedule %s runs one chunk per stage: use --pp_virtual 1)", V, name);
    checked_product({P, M, V}, 1 << 24, "--pp * --pp_virtual * micro-batches per step");
    if (kind == PIPE_1F1B || kind == PIPE_ZB1 || (kind == PIPE_INTERLEAVED && V == 1))
        LLMC_CHECK(M >= P, "--pp_schedule %s with --pp %d needs at least %d micro-batches per step "
                   "(gradient accumulation steps), got %d", name, P, P, M);
    if (kind == PIPE_INTERLEAVED && V > 1) {
        LLMC_CHECK(P >= 2, "--pp_schedule interleaved with --pp_virtual %d needs --pp >= 2, got --pp %d", V, P);
        LLMC_CHECK(M % P == 0, "--pp_schedule interleaved with --pp_virtual %d needs the micro-batches per step "
                   "(gradient accumulation steps) to be a multiple of --pp %d, got %d", V, P, M);
    }
}

// Appends the computations of one stage with their messages around them (see the header comment).
struct PipeStageBuilder {
    int P, V, s;
    std::vector<PipeAction> out;
    int vs(int c) const { return c * P + s; }
    void F(int mb, int c) {
        if (vs(c) > 0) out.push_back({PIPE_RECV_ACT, mb, c, (s + P - 1) % P});
        out.push_back({PIPE_F, mb, c, -1});
        if (vs(c) < V * P - 1) out.push_back({PIPE_SEND_ACT, mb, c, (s + 1) % P});
    }
    void B(int mb, int c) {
        if (vs(c) < V * P - 1) out.push_back({PIPE_RECV_GRAD, mb, c, (s + 1) % P});
        out.push_back({PIPE_B, mb, c, -1});
        if (vs(c) > 0) out.push_back({PIPE_SEND_GRAD, mb, c, (s + P - 1) % P});
    }
    void W(int mb, int c) { out.push_back({PIPE_W, mb, c, -1}); }
    void BW(int mb, int c) { B(mb, c); W(mb, c); }
};

// GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline
// Parallelism"): all M forwards, then all M backwards. The backwards run in increasing micro-batch
// order (either order has the same bubble; increasing keeps the W fold order increasing), each W
// right after its B. Up to M micro-batches in flight.
inline void pipe_build_gpipe(PipeStageBuilder& b, int M) {
    for (int mb = 0; mb < M; mb++) b.F(mb, 0);
    for (int mb = 0; mb < M; mb++) b.BW(mb, 0);
}

// 1F1B, PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training"):
// warm-up forwards, then pairs (forward of the next micro-batch, backward of the oldest), then the
// cool-down backwards. PipeDream-Flush's warm-up, P-s-1 forwards on stage s, leaves no slack in the
// steady state: the activation stage s sends after F(k) is consumed by stage s+1 as soon as it has
// finished B(k-1), and the gradient it sends back is awaited the moment stage s finishes F(k+1),
// so every transfer's time adds to each micro-batch's. One more warm-up forward on every stage but
// the last (P-s, the last stage 0) puts one micro-batch of compute between a transfer and its use
// (Megatron's interleaved schedule keeps a warm-up two micro-batches deeper per stage for the same
// reason): at most P-s+1 micro-batches in flight on stage s < P-1, 1 on the last. The backwards
// (and so the gradient folds) keep PipeDream-Flush's order; without transfer costs the bubble is
// the same, (P-1)/(M+P-1).
inline int pipe_1f1b_warmup(int P, int M, int s) { return std::min(s == P - 1 ? 0 : P - s, M); }
inline void pipe_build_1f1b(PipeStageBuilder& b, int P, int M) {
    const int warm = pipe_1f1b_warmup(P, M, b.s);
    for (int mb = 0; mb < warm; mb++) b.F(mb, 0);
    for (int i = 0; i < M - warm; i++) { b.F(warm + i, 0); b.BW(i, 0); }
    for (int mb = M - warm; mb < M; mb++) b.BW(mb, 0);
}

// Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
// Clusters Using Megatron-LM", SC21): V chunks per stage. The V*M (micro-batch, chunk) units are
// taken in groups of P micro-batches: forward unit k is micro-batch (k / (P*V))*P + k%P on chunk
// (k % (P*V)) / P; backward unit k the same micro-batch on chunk V-1 minus that. Stage s runs
// 2*(P-s-1) + (V-1)*P warm-up forward units (all V*M when that is more), then (forward, backward)
// pairs, then the cool-down backwards. At most min(V*M, 2*(P-s-1) + (V-1)*P + 1) units in flight.
// Needs M % P == 0, as Megatron does.
inline int pipe_interleaved_warmup(int P, int M, int V, int s) { return std::min(V * M, 2 * (P - s - 1) + (V - 1) * P); }
inline void pipe_build_interleaved(PipeStageBuilder& b, int P, int M, int V) {
    const int units = V * M, warm = pipe_interleaved_warmup(P, M, V, b.s);
    auto mb_of = [&](int k) { return (k / (P * V)) * P + k % P; };
    auto chunk_of = [&](int k) { return (k % (P * V)) / P; };
    for (int k = 0; k < warm; k++) b.F(mb_of(k), chunk_of(k));
    for (int k = 0; k < units - warm; k++) {
        b.F(mb_of(warm + k), chunk_of(warm + k));
        b.BW(mb_of(k), V - 1 - chunk_of(k));
    }
    for (int k = units - warm; k < units; k++) b.BW(mb_of(k), V - 1 - chunk_of(k));
}

// ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", the handcrafted memory-efficient
// schedule): the backward is split into B (input gradient, on the critical path between stages)
// and W (weight gradient, free to move). Warm-up as PipeDream-Flush (P-s-1 forwards), then (F, B)
// pairs in which stage s holds back s W's: the W of micro-batch i-s follows B(i). In the cool-down
// each B is followed by the oldest pending W, and the s W's still pending close the step, filling
// the tail bubble. Every stage keeps up to P micro-batches whose W has not run (the paper: all
// stages hold the same number in flight, so the peak, stage 0's, equals PipeDream-Flush's). W's
// stay in increasing micro-batch order. With equal F, B, W costs the bubble per stage is (P-1)(F+B-W), 1/3 of 1F1B's.
inline void pipe_build_zb1(PipeStageBuilder& b, int P, int M) {
    const int warm = std::min(P - b.s - 1, M);
    int next_w = 0;
    for (int mb = 0; mb < warm; mb++) b.F(mb, 0);
    for (int i = 0; i < M - warm; i++) {
        b.F(warm + i, 0);
        b.B(i, 0);
        if (i >= b.s) b.W(next_w++, 0);
    }
    for (int mb = M - warm; mb < M; mb++) { b.B(mb, 0); b.W(next_w++, 0); }
    while (next_w < M) b.W(next_w++, 0);
}

// Per pipeline stage (0..P-1), the ordered list of actions it executes for one optimizer step.
// V must be 1 unless kind is interleaved; interleaved with V == 1 is plain 1F1B.
inline bool is_compute(PipeOp op) { return op == PIPE_F || op == PIPE_B || op == PIPE_W; }
// The W at k directly follows its own B (no computation between): the executor runs that B with
// its weight gradients and the W only releases the micro-batch, so it is no computation either.
inline bool previous_compute_is_b(const std::vector<PipeAction>& actions, size_t k) {
    for (size_t j = k; j-- > 0;)
        if (is_compute(actions[j].op))
            return actions[j].op == PIPE_B && actions[j].mb == actions[k].mb && actions[j].chunk == actions[k].chunk;
    return false;
}

// the B at k is followed by its own W with no computation between (the two run as one backward)
inline bool next_compute_is_own_w(const std::vector<PipeAction>& actions, size_t k) {
    for (size_t j = k + 1; j < actions.size(); j++)
        if (is_compute(actions[j].op))
            return actions[j].op == PIPE_W && actions[j].mb == actions[k].mb && actions[j].chunk == actions[k].chunk;
    return false;
}
inline bool is_group_boundary(const std::vector<PipeAction>& actions, size_t k) {
    return is_compute(actions[k].op) && !(actions[k].op == PIPE_W && previous_compute_is_b(actions, k));
}
// The computation that follows the one at k (a W that its B ran is none): its index, -1 at the end;
// what ZeRO-3 keeps a pass's gathered parameters for (llmc/gpt/hooks.h)
inline int next_computation(const std::vector<PipeAction>& actions, size_t k) {
    for (size_t j = k + 1; j < actions.size(); j++)
        if (is_group_boundary(actions, j)) return (int)j;
    return -1;
}
// the index of computation (op, mb, chunk) in a stage's actions, -1: none
inline int find_computation(const std::vector<PipeAction>& actions, PipeOp op, int mb, int chunk) {
    for (size_t k = 0; k < actions.size(); k++)
        if (actions[k].op == op && actions[k].mb == mb && actions[k].chunk == chunk) return (int)k;
    return -1;
}

// ---------------------------------------------------------------------------------------------
// Rendezvous groups. The executor runs each run of consecutive transfers as one group (p2p_group:
// all posted together, returning when all completed; a send completes only once its receive is
// posted, as NCCL's and MPI's large messages do). A stage at a computation moves on; at a group (the
// transfers up to the next computation; a W run by its B is none, is_group_boundary) it posts every
// transfer and moves past the group once each transfer's other side has been posted. This returns
// the stages that can never move on (with the start of the group each is stuck in): empty when the
// schedule cannot deadlock this way.
struct PipeStuck {
    int stage;
    size_t group;                  // index of the group's first action
    std::vector<size_t> unmatched;  // its transfers whose other side is never posted
};
inline std::vector<PipeStuck> pipe_rendezvous_stuck(const std::vector<std::vector<PipeAction>>& schedule, int P, int V) {
    int M = 0;
    for (const auto& list : schedule)
        for (const PipeAction& a : list) M = std::max(M, a.mb + 1);
    const int L = V * P;
    auto slot = [&](int s, const PipeAction& a) {  // (dir, sender vs, mb, end): as in pipe_simulate
        const int vs = a.chunk * P + s;
        const bool send = a.op == PIPE_SEND_ACT || a.op == PIPE_SEND_GRAD;
        const int dir = (a.op == PIPE_SEND_ACT || a.op == PIPE_RECV_ACT) ? 0 : 1;
        const int sender = send ? vs : vs + (dir == 0 ? -1 : 1);
        return (((size_t)dir * L + sender) * M + a.mb) * 2 + (send ? 0 : 1);
    };
    std::vector<char> posted((size_t)2 * L * M * 2, 0);
    std::vector<size_t> pc(P, 0), group_end(P, 0);
    for (bool progress = true; progress;) {
        progress = false;
        for (int s = 0; s < P; s++) {
            const auto& list = schedule[s];
            while (pc[s] < list.size()) {
                if (is_group_boundary(list, pc[s])) { pc[s]++; progress = true; continue; }
                if (group_end[s] <= pc[s]) {  // post the group
                    size_t e = pc[s];
                    for (; e < list.size() && !is_group_boundary(list, e); e++)
                        if (!is_compute(list[e].op)) posted[slot(s, list[e])] = 1;
                    group_end[s] = e;
                    progress = true;
                }
                bool done = true;
                for (size_t k = pc[s]; k < group_end[s]; k++)
                    if (!is_compute(list[k].op)) done = done && posted[slot(s, list[k]) ^ 1];
                if (!done) break;
                pc[s] = group_end[s];
                progress = true;
            }
        }
    }
    std::vector<PipeStuck> stuck;
    for (int s = 0; s < P; s++)
        if (pc[s] < schedule[s].size()) {
            PipeStuck st{s, pc[s], {}};
            for (size_t k = pc[s]; k < group_end[s]; k++)
                if (!is_compute(schedule[s][k].op) && !posted[slot(s, schedule[s][k]) ^ 1]) st.unmatched.push_back(k);
            stuck.push_back(st);
        }
    return stuck;
}
inline void pipe_check_rendezvous(const std::vector<std::vector<PipeAction>>& schedule, int P, int V) {
    std::string blocked;
    for (const PipeStuck& st : pipe_rendezvous_stuck(schedule, P, V))
        blocked += strfmt("%sstage %d at action %zu (%s mb %d)", blocked.empty() ? "" : ", ", st.stage, st.group,
                          pipe_op_name(schedule[st.stage][st.group].op), schedule[st.stage][st.group].mb);
    LLMC_CHECK(blocked.empty(), "pipeline schedule deadlocks when transfers are rendezvous groups: %s", blocked.c_str());
}

// Makes a schedule deadlock-free for rendezvous groups: while some stage is stuck in a group whose
// only unmatched transfers are sends, those sends move into that stage's next group (after the next
// computation), where the peer's receive has been posted by then. (Two stages that each send to the
// other before receiving, as interleaved 1F1B's ring does with two stages, deadlock otherwise.) A
// deferred send only goes out later; its data stays in its slot until it has (pipe_last_use).
inline void pipe_make_rendezvous_safe(std::vector<std::vector<PipeAction>>& schedule, int P, int V) {
    for (int round = 0; round < 1 << 20; round++) {
        const std::vector<PipeStuck> stuck = pipe_rendezvous_stuck(schedule, P, V);
        if (stuck.empty()) return;
        bool moved = false;
        for (const PipeStuck& st : stuck) {
            std::vector<PipeAction>& list = schedule[st.stage];
            bool only_sends = !st.unmatched.empty();
            for (size_t k : st.unmatched) only_sends = only_sends && (list[k].op == PIPE_SEND_ACT || list[k].op == PIPE_SEND_GRAD);
            if (!only_sends) continue;
            size_t boundary = st.group;  // the computation that ends this group
            while (boundary < list.size() && !is_group_boundary(list, boundary)) boundary++;
            if (boundary == list.size()) continue;
            std::vector<PipeAction> deferred;
            for (size_t j = st.unmatched.size(); j-- > 0;) {
                deferred.insert(deferred.begin(), list[st.unmatched[j]]);
                list.erase(list.begin() + st.unmatched[j]);
                boundary--;
            }
            list.insert(list.begin() + boundary + 1, deferred.begin(), deferred.end());
            moved = true;
            break;
        }
        LLMC_CHECK(moved, "internal: the pipeline schedule cannot be made deadlock-free for rendezvous transfers");
    }
}

// The index of the last action of each (micro-batch, chunk) on a stage (its W, or a send deferred
// past it): until then the slot holding its activations and gradients is in use.
inline std::vector<std::vector<size_t>> pipe_last_use(const std::vector<PipeAction>& actions, int V) {
    std::vector<std::vector<size_t>> last(V);
    for (size_t k = 0; k < actions.size(); k++) {
        const PipeAction& a = actions[k];
        if ((int)last[a.chunk].size() <= a.mb) last[a.chunk].resize(a.mb + 1, 0);
        last[a.chunk][a.mb] = k;
    }
    return last;
}

inline std::vector<std::vector<PipeAction>> pipeline_schedule(PipeKind kind, int P, int M, int V) {
    pipe_check_args(kind, P, M, V);
    std::vector<std::vector<PipeAction>> sched(P);
    for (int s = 0; s < P; s++) {
        PipeStageBuilder b{P, V, s, {}};
        switch (kind) {
            case PIPE_GPIPE: pipe_build_gpipe(b, M); break;
            case PIPE_1F1B: pipe_build_1f1b(b, P, M); break;
            case PIPE_INTERLEAVED:
                if (V == 1) pipe_build_1f1b(b, P, M);
                else pipe_build_interleaved(b, P, M, V);
                break;
            case PIPE_ZB1: pipe_build_zb1(b, P, M); break;
        }
        sched[s] = std::move(b.out);
    }
    pipe_make_rendezvous_safe(sched, P, V);
    return sched;
}

// In-flight activations on one stage: the most (micro-batch, chunk) units whose F ran and whose W
// has not yet run (the activation sets the executor must keep), and the most whose B ran and whose
// W has not yet run (the weight-gradient stash).
inline int pipe_max_in_flight(const std::vector<PipeAction>& stage_actions) {
    int now = 0, most = 0;
    for (const PipeAction& a : stage_actions) {
        now += a.op == PIPE_F ? 1 : a.op == PIPE_W ? -1 : 0;
        most = std::max(most, now);
    }
    return most;
}
inline int pipe_max_w_pending(const std::vector<PipeAction>& stage_actions) {
    int now = 0, most = 0;
    for (const PipeAction& a : stage_actions) {
        now += a.op == PIPE_B ? 1 : a.op == PIPE_W ? -1 : 0;
        most = std::max(most, now);
    }
    return most;
}

// The closed-form bubble fraction: idle / makespan, the same on every stage. Cost assumptions:
// every stage has the same costs, communication is free, and
//  - gpipe, 1f1b: exact for any F and B costs with W = 0 (the whole backward counted in B):
//    (P-1)/(M+P-1).
//  - interleaved: exact for any F, B with W = 0, each chunk costing 1/V of a stage:
//    (P-1)/(V*M+P-1). (The SC21 paper states the bubble relative to the ideal time instead:
//    idle/ideal = (P-1)/(V*M); the two are the same quantity, x/(1+x) vs x.) V == 1: 1F1B's.
//  - zb1: exact for F = B = W: idle per stage (P-1)(F+B-W) = (P-1)F over the makespan
//    3*M*F + (P-1)F, so (P-1)/(3M+P-1). (The paper's bubble rate, relative to ideal: (P-1)/(3M).)
// With W > 0 run right after its B, gpipe/1f1b/interleaved idle less than the formula says: the
// grad is sent before the W runs, so W is off the critical path and the idle per stage is
// (P-1)(F+B)/V rather than (P-1)(F+B+W)/V (stage costs; V = 1 but for interleaved).
inline double pipe_bubble_formula(PipeKind kind, int P, int M, int V) {
    pipe_check_args(kind, P, M, V);
    switch (kind) {
        case PIPE_GPIPE:
        case PIPE_1F1B: return double(P - 1) / double(M + P - 1);
        case PIPE_INTERLEAVED: return double(P - 1) / double(V * M + P - 1);
        case PIPE_ZB1: return double(P - 1) / double(3 * M + P - 1);
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// The executor

// The model's side of the executor: the three computations of one (micro-batch, chunk), and where
// each transfer's bytes are.
struct PipeModel {
    std::function<void(int mb, int chunk)> forward;
    // backward input gradients; with_weights: also the weight gradients (the W that follows at once)
    std::function<void(int mb, int chunk, bool with_weights)> backward;
    // the weight gradients; already_done: the backward did them (only release the stash)
    std::function<void(int mb, int chunk, bool already_done)> weights;
    std::function<void(int mb, int chunk)> release;  // after its last action (pipe_last_use): its slot is free
    std::function<P2POp(const PipeAction& a)> transfer;  // buffer, bytes, peer, tag of a send or receive
    // the unit's gradient buffer: what a receive of its gradient, its backward and (on the last
    // virtual stage) its forward write, and its gradient send reads
    std::function<const void*(int mb, int chunk)> d_stream;
    std::function<void()> sync;  // wait for the queued device work (timing)
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

// Runs one stage's action list. The transfers between two computations are posted together (the
// schedule's group, as pipe_simulate's rendezvous mode checks them); the receives complete before the
// next computation, which consumes them. The sends stay in flight: a send does not wait for its
// receiver to reach its group, only for the moment its buffer can change. An activation (the chunk's
// output) is consumed by the receiver before this stage gets the unit's gradient back: it completes
// at the unit's backward or release, by then at no wait. A gradient (the unit's d_stream) completes
// right before that buffer is written again: by a receive of gradients, a backward, or a forward of
// the last virtual stage (its head writes d_stream), of the unit that holds the buffer next (the
// model may hand a leaving unit's d_stream to a later one: PipeModel::d_stream says which). That
// cannot deadlock: the receiver of a gradient waits only for transfers posted earlier in this
// stage's list and, before its own backward, for its own gradient sends, a chain that ends at
// virtual stage 0, which sends none. (The NCCL build runs each group as one request instead:
// COMM_SENDS_IN_FLIGHT.) A B whose W follows it with no computation in between is run as one
// backward with the weight gradients (no stash). measure: time every action (on the GPU this waits
// for the device after each one); a transfer's event spans its wait.
inline PipeTimes pipeline_execute(const std::vector<PipeAction>& actions, const CommGroup& pp, const PipeModel& model,
                                  bool measure, std::vector<PipeEvent>* trace) {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    auto now_ms = [&] { return std::chrono::duration<double, std::milli>(clock::now() - start).count(); };
    PipeTimes times;
    std::vector<P2POp> sends, recvs;
    std::vector<const PipeAction*> send_actions, recv_actions;
    struct InFlight {
        CommRequest req;
        const PipeAction* a;
        const void* buf;  // what it reads
    };
    std::vector<InFlight> in_flight;
    int V = 1;
    for (const PipeAction& a : actions) V = std::max(V, a.chunk + 1);
    const std::vector<std::vector<size_t>> last = pipe_last_use(actions, V);
    // completes a request, timed; acts: the transfers it carries (the trace)
    auto finish = [&](CommRequest& req, const std::vector<const PipeAction*>& acts) {
        const double t0 = measure ? now_ms() : 0;
        comm_finish(req);
        if (measure) {
            model.sync();
            const double t1 = now_ms();
            times.wait_ms += t1 - t0;
            if (trace)
                for (const PipeAction* a : acts) trace->push_back({a->op, a->mb, a->chunk, t0, t1});
        }
    };
    // completes the sends that match
    auto finish_sends = [&](auto&& which) {
        for (InFlight& f : in_flight)
            if (f.req.active() && which(f)) finish(f.req, {f.a});
        in_flight.erase(std::remove_if(in_flight.begin(), in_flight.end(), [](const InFlight& f) { return !f.req.active(); }),
                        in_flight.end());
    };
    // the sends reading buf complete (it is written next)
    auto free_buffer = [&](const void* buf) { finish_sends([&](const InFlight& f) { return f.buf == buf; }); };
    // the unit left its slot, whose activations the next unit overwrites: its activation sends complete
    auto unit_left = [&](int mb, int chunk) {
        finish_sends([&](const InFlight& f) { return f.a->mb == mb && f.a->chunk == chunk && f.a->op == PIPE_SEND_ACT; });
    };
    std::vector<std::pair<int, int>> left_in_group;  // released inside the group, before its sends were posted
    std::vector<const PipeAction*> to_release;      // after the current group or computation
    auto release = [&] {
        for (const PipeAction* a : to_release) {
            model.release(a->mb, a->chunk);
            unit_left(a->mb, a->chunk);
        }
        to_release.clear();
    };
    auto flush = [&] {
        if (!COMM_SENDS_IN_FLIGHT) {  // (NCCL) the group as one request, complete before the next computation
            recvs.insert(recvs.begin(), sends.begin(), sends.end());
            recv_actions.insert(recv_actions.begin(), send_actions.begin(), send_actions.end());
            sends.clear();
            send_actions.clear();
        }
        for (size_t k = 0; k < sends.size(); k++)
            in_flight.push_back({p2p_start(pp, {sends[k]}), send_actions[k], sends[k].buf});
        sends.clear();
        send_actions.clear();
        for (const auto& u : left_in_group) unit_left(u.first, u.second);
        left_in_group.clear();
        if (!recvs.empty()) {
            for (const P2POp& op : recvs)
                if (!op.send) free_buffer(op.buf);
            CommRequest r = p2p_start(pp, recvs);
            finish(r, recv_actions);
            recvs.clear();
            recv_actions.clear();
        }
        release();
    };
    const bool last_stage = pp.rank == pp.size - 1;
    for (size_t k = 0; k < actions.size(); k++) {
        const PipeAction& a = actions[k];
        const bool last_use = last[a.chunk][a.mb] == k;
        if (!is_compute(a.op)) {
            const bool send = a.op == PIPE_SEND_ACT || a.op == PIPE_SEND_GRAD;
            (send ? sends : recvs).push_back(model.transfer(a));
            (send ? send_actions : recv_actions).push_back(&a);
            if (last_use) to_release.push_back(&a);  // once the group has been posted
            continue;
        }
        if (!is_group_boundary(actions, k)) {
            // a W its B already ran: nothing to compute, inside the group. Its slot is free at once:
            // a receive later in the group that takes it over writes only the slot's input (and
            // batch), never what a send of this group reads (the chunk's output, d_stream)
            model.weights(a.mb, a.chunk, true);
            if (last_use) {
                model.release(a.mb, a.chunk);
                left_in_group.push_back({a.mb, a.chunk});
            }
            continue;
        }
        std::vector<const PipeAction*> mine;
        if (last_use) mine.push_back(&a);
        flush();
        if (a.op == PIPE_B || (a.op == PIPE_F && last_stage && a.chunk == V - 1)) free_buffer(model.d_stream(a.mb, a.chunk));
        if (a.op == PIPE_B)  // (the recomputation rewrites the unit's output)
            finish_sends([&](const InFlight& f) { return f.a->mb == a.mb && f.a->chunk == a.chunk; });
        const bool fused = a.op == PIPE_B && next_compute_is_own_w(actions, k);
        const double t0 = measure ? now_ms() : 0;
        if (a.op == PIPE_F) model.forward(a.mb, a.chunk);
        else if (a.op == PIPE_B) model.backward(a.mb, a.chunk, fused);
        else model.weights(a.mb, a.chunk, false);
        if (measure) {
            model.sync();
            const double t1 = now_ms();
            times.compute_ms += t1 - t0;
            if (trace) trace->push_back({a.op, a.mb, a.chunk, t0, t1});
        }
        comm_progress();
        for (const PipeAction* r : mine) {
            model.release(r->mb, r->chunk);
            unit_left(r->mb, r->chunk);
        }
    }
    flush();
    finish_sends([](const InFlight&) { return true; });
    times.total_ms = now_ms();
    return times;
}
