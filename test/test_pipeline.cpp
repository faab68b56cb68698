// Tests of the pipeline-parallel schedules (llmc/parallel/pipeline.h), for every kind over a range of
// (P, M, V): per-stage order (F before B before W, each exactly once, W's in increasing micro-batch
// order, recv right before and send right after its compute), send/recv pairing re-derived here
// independently of the simulator, a deadlock-free event simulation, the exact in-flight and
// weight-gradient-stash bounds, the simulated bubble equal to the closed form under the costs it
// assumes, golden orders for small cases, and clear errors for bad arguments and broken schedules.
#include "pipeline_sim.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

namespace {

using Schedule = std::vector<std::vector<PipeAction>>;

struct Case { PipeKind kind; int P, M, V; };

// Every configuration the tests sweep: P 1..8; M from the least allowed to 4P (every value for
// gpipe, 1f1b, zb1, so non-multiples of P too; multiples of P for interleaved with V >= 2).
std::vector<Case> all_cases() {
    std::vector<Case> out;
    for (int P = 1; P <= 8; P++) {
        for (int M = 1; M <= 4 * P; M++) out.push_back({PIPE_GPIPE, P, M, 1});
        for (int M = P; M <= 4 * P; M++) {
            out.push_back({PIPE_1F1B, P, M, 1});
            out.push_back({PIPE_ZB1, P, M, 1});
            out.push_back({PIPE_INTERLEAVED, P, M, 1});
        }
        if (P >= 2)
            for (int V = 2; V <= 4; V++)
                for (int M = P; M <= 4 * P; M += P) out.push_back({PIPE_INTERLEAVED, P, M, V});
    }
    return out;
}

std::string case_name(const Case& c) {
    return strfmt("%s P=%d M=%d V=%d", pipe_kind_name(c.kind), c.P, c.M, c.V);
}

// The compute ops of one stage as "F0 B0 W0 ..." (chunk appended as ".c" when V > 1).
std::string compute_order(const std::vector<PipeAction>& acts, int V) {
    std::string s;
    for (const PipeAction& a : acts) {
        if (!is_compute(a.op)) continue;
        if (!s.empty()) s += ' ';
        s += strfmt("%s%d", pipe_op_name(a.op), a.mb);
        if (V > 1) s += strfmt(".%d", a.chunk);
    }
    return s;
}

// In-flight bound of each kind, on stage s (exact: the schedules reach it).
int expected_in_flight(const Case& c, int s) {
    switch (c.kind) {
        case PIPE_GPIPE: return c.M;
        case PIPE_1F1B: return s == c.P - 1 ? 1 : std::min(c.P - s + 1, c.M);  // one warm-up forward more but on the last
        case PIPE_INTERLEAVED:
            if (c.V == 1) return s == c.P - 1 ? 1 : std::min(c.P - s + 1, c.M);
            return std::min(c.V * c.M, 2 * (c.P - s - 1) + (c.V - 1) * c.P + 1);
        case PIPE_ZB1: return c.P;  // the same on every stage: stage 0's peak in PipeDream-Flush
    }
    return -1;
}

}  // namespace

TEST_CASE("pipeline: schedule names") {
    for (PipeKind k : {PIPE_GPIPE, PIPE_1F1B, PIPE_INTERLEAVED, PIPE_ZB1}) CHECK(parse_pipe_kind(pipe_kind_name(k)) == k);
    CHECK(parse_pipe_kind("zb1") == PIPE_ZB1);
    CHECK_THROWS_WITH_AS(parse_pipe_kind("1F1B"), doctest::Contains("--pp_schedule: unknown schedule '1F1B'"), LlmcError);
    CHECK_THROWS_WITH_AS(parse_pipe_kind(""), doctest::Contains("expected gpipe, 1f1b, interleaved or zb1"), LlmcError);
}

TEST_CASE("pipeline: every schedule is well formed, pairs its messages, runs without deadlock, within its bounds") {
    for (const Case& c : all_cases()) {
        INFO(case_name(c));
        const Schedule sched = pipeline_schedule(c.kind, c.P, c.M, c.V);
        REQUIRE((int)sched.size() == c.P);
        const int L = c.V * c.P;
        // (dir, mb, sender stage, sender chunk, receiver stage, receiver chunk), from each end
        std::vector<std::array<int, 6>> from_sends, from_recvs;
        for (int s = 0; s < c.P; s++) {
            INFO("stage " << s);
            const std::vector<PipeAction>& acts = sched[s];
            std::vector<int> pos_f(c.M * c.V, -1), pos_b(c.M * c.V, -1), pos_w(c.M * c.V, -1);
            std::vector<int> last_w(c.V, -1);
            for (int i = 0; i < (int)acts.size(); i++) {
                const PipeAction& a = acts[i];
                REQUIRE(a.mb >= 0);
                REQUIRE(a.mb < c.M);
                REQUIRE(a.chunk >= 0);
                REQUIRE(a.chunk < c.V);
                const int u = a.mb * c.V + a.chunk, vs = a.chunk * c.P + s;
                if (is_compute(a.op)) CHECK(a.peer == -1);
                std::vector<int>& pos = a.op == PIPE_F ? pos_f : a.op == PIPE_B ? pos_b : pos_w;
                if (is_compute(a.op)) {
                    CHECK(pos[u] == -1);  // exactly once
                    pos[u] = i;
                }
                if (a.op == PIPE_W) {  // increasing micro-batch order per chunk
                    CHECK(a.mb > last_w[a.chunk]);
                    last_w[a.chunk] = a.mb;
                }
                // a recv sits right before its consumer, a send right after its producer (or, where
                // pipe_make_rendezvous_safe deferred it, in a later group: after its producer)
                const bool deferrable = c.kind == PIPE_INTERLEAVED && c.V > 1;
                auto next = [&]() { return i + 1 < (int)acts.size() ? acts[i + 1] : PipeAction{PIPE_W, -1, -1, -1}; };
                auto prev = [&]() { return i > 0 ? acts[i - 1] : PipeAction{PIPE_W, -1, -1, -1}; };
                if (a.op == PIPE_RECV_ACT) CHECK((next().op == PIPE_F && next().mb == a.mb && next().chunk == a.chunk));
                if (a.op == PIPE_RECV_GRAD) CHECK((next().op == PIPE_B && next().mb == a.mb && next().chunk == a.chunk));
                if (a.op == PIPE_SEND_ACT)
                    CHECK(((deferrable && pos_f[u] >= 0) || (prev().op == PIPE_F && prev().mb == a.mb && prev().chunk == a.chunk)));
                if (a.op == PIPE_SEND_GRAD)
                    CHECK(((deferrable && pos_b[u] >= 0) || (prev().op == PIPE_B && prev().mb == a.mb && prev().chunk == a.chunk)));
                // and every compute that needs one has it
                if (a.op == PIPE_F) CHECK((vs == 0 || prev().op == PIPE_RECV_ACT));
                if (a.op == PIPE_F) CHECK((vs == L - 1 || deferrable || next().op == PIPE_SEND_ACT));
                if (a.op == PIPE_B) CHECK((vs == L - 1 || prev().op == PIPE_RECV_GRAD));
                if (a.op == PIPE_B) CHECK((vs == 0 || deferrable || next().op == PIPE_SEND_GRAD));
                // the other end of each message, derived from the virtual-stage chain
                const int nxt = (s + 1) % c.P, prv = (s + c.P - 1) % c.P;
                if (a.op == PIPE_SEND_ACT) {
                    CHECK(a.peer == nxt);
                    from_sends.push_back({0, a.mb, s, a.chunk, nxt, a.chunk + (s == c.P - 1)});
                }
                if (a.op == PIPE_RECV_ACT) {
                    CHECK(a.peer == prv);
                    from_recvs.push_back({0, a.mb, prv, a.chunk - (s == 0), s, a.chunk});
                }
                if (a.op == PIPE_SEND_GRAD) {
                    CHECK(a.peer == prv);
                    from_sends.push_back({1, a.mb, s, a.chunk, prv, a.chunk - (s == 0)});
                }
                if (a.op == PIPE_RECV_GRAD) {
                    CHECK(a.peer == nxt);
                    from_recvs.push_back({1, a.mb, nxt, a.chunk + (s == c.P - 1), s, a.chunk});
                }
            }
            for (int u = 0; u < c.M * c.V; u++) {
                INFO("mb " << u / c.V << " chunk " << u % c.V);
                REQUIRE(pos_f[u] >= 0);
                CHECK(pos_f[u] < pos_b[u]);
                CHECK(pos_b[u] < pos_w[u]);
                if (c.kind != PIPE_ZB1) {  // W right after its B (only its SEND_GRAD between)
                    int next_compute = pos_b[u] + 1;
                    while (!is_compute(acts[next_compute].op)) next_compute++;
                    CHECK(next_compute == pos_w[u]);
                }
            }
            CHECK(pipe_max_in_flight(acts) == expected_in_flight(c, s));
            CHECK(pipe_max_w_pending(acts) == (c.kind == PIPE_ZB1 ? s + 1 : 1));
        }
        // every message has exactly one sender and one receiver
        std::sort(from_sends.begin(), from_sends.end());
        std::sort(from_recvs.begin(), from_recvs.end());
        CHECK(std::adjacent_find(from_sends.begin(), from_sends.end()) == from_sends.end());
        CHECK(from_sends == from_recvs);
        CHECK((int)from_sends.size() == 2 * c.M * (L - 1));
        // cross-stage dependencies and deadlock freedom: the event simulation
        PipeSim sim;
        REQUIRE_NOTHROW(sim = pipe_simulate(sched, c.P, c.V, 1.0 / c.V, 1.0 / c.V, 1.0 / c.V));
        CHECK(sim.makespan > 0);
    }
}

TEST_CASE("pipeline: the simulated bubble equals the closed form under the costs it assumes") {
    for (const Case& c : all_cases()) {
        INFO(case_name(c));
        const Schedule sched = pipeline_schedule(c.kind, c.P, c.M, c.V);
        const double formula = pipe_bubble_formula(c.kind, c.P, c.M, c.V);
        // gpipe/1f1b/interleaved: any F and B with W = 0; zb1: F = B = W. Costs per chunk.
        std::vector<std::array<double, 3>> costs;
        if (c.kind == PIPE_ZB1) costs = {{1, 1, 1}, {0.25, 0.25, 0.25}};
        else costs = {{1, 1, 0}, {1, 2, 0}, {1, 3.5, 0}};
        for (const auto& k : costs) {
            INFO("F=" << k[0] << " B=" << k[1] << " W=" << k[2]);
            const PipeSim sim = pipe_simulate(sched, c.P, c.V, k[0] / c.V, k[1] / c.V, k[2] / c.V);
            CHECK(std::fabs(sim.bubble() - formula) <= 1e-12);
            for (int s = 0; s < c.P; s++) CHECK(std::fabs(sim.idle[s] / sim.makespan - formula) <= 1e-12);
            // busy time is the work; the makespan follows from the bubble
            CHECK(std::fabs(sim.busy[0] - c.M * (k[0] + k[1] + k[2])) <= 1e-9);
        }
        if (c.kind != PIPE_ZB1) {  // W > 0 right after its B: off the critical path, idle (P-1)(F+B)
            const PipeSim sim = pipe_simulate(sched, c.P, c.V, 1.0 / c.V, 2.0 / c.V, 1.5 / c.V);
            for (int s = 0; s < c.P; s++) CHECK(std::fabs(sim.idle[s] - (c.P - 1) * 3.0 / c.V) <= 1e-9);
        }
    }
}

TEST_CASE("pipeline: zb1 idles less than 1f1b when the backward is split") {
    for (int P = 2; P <= 8; P++)
        for (int M = P; M <= 4 * P; M++) {
            INFO("P=" << P << " M=" << M);
            const PipeSim zb = pipe_simulate(pipeline_schedule(PIPE_ZB1, P, M, 1), P, 1, 1, 1, 1);
            const PipeSim ob = pipe_simulate(pipeline_schedule(PIPE_1F1B, P, M, 1), P, 1, 1, 1, 1);
            CHECK(zb.makespan < ob.makespan);
            CHECK(zb.makespan == 3 * M + P - 1);  // (P-1)(F+B-W) idle per stage
            CHECK(ob.makespan == 3 * M + 2 * (P - 1));  // the grad goes out before W: (P-1)(F+B)
        }
}

TEST_CASE("pipeline: golden orders for small cases") {
    // 1F1B, P=4, M=8: warm-up P-s forwards (the last stage none), steady pairs, cool-down backwards
    Schedule s = pipeline_schedule(PIPE_1F1B, 4, 8, 1);
    CHECK(compute_order(s[0], 1) == "F0 F1 F2 F3 F4 B0 W0 F5 B1 W1 F6 B2 W2 F7 B3 W3 B4 W4 B5 W5 B6 W6 B7 W7");
    CHECK(compute_order(s[2], 1) == "F0 F1 F2 B0 W0 F3 B1 W1 F4 B2 W2 F5 B3 W3 F6 B4 W4 F7 B5 W5 B6 W6 B7 W7");
    CHECK(compute_order(s[3], 1) == "F0 B0 W0 F1 B1 W1 F2 B2 W2 F3 B3 W3 F4 B4 W4 F5 B5 W5 F6 B6 W6 F7 B7 W7");
    // GPipe: all forwards, then backwards in increasing micro-batch order
    s = pipeline_schedule(PIPE_GPIPE, 2, 3, 1);
    CHECK(compute_order(s[1], 1) == "F0 F1 F2 B0 W0 B1 W1 B2 W2");
    // ZB-H1, P=3, M=4: stage s holds back s W's; the cool-down and the tail run them
    s = pipeline_schedule(PIPE_ZB1, 3, 4, 1);
    CHECK(compute_order(s[0], 1) == "F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3");
    CHECK(compute_order(s[1], 1) == "F0 F1 B0 F2 B1 W0 F3 B2 W1 B3 W2 W3");
    CHECK(compute_order(s[2], 1) == "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3");
    // interleaved, P=2, M=4, V=2 (Megatron's order: groups of P micro-batches per chunk)
    s = pipeline_schedule(PIPE_INTERLEAVED, 2, 4, 2);
    CHECK(compute_order(s[0], 2) == "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 W0.1 F3.0 B1.1 W1.1 F2.1 B0.0 W0.0 F3.1 B1.0 W1.0 "
                                    "B2.1 W2.1 B3.1 W3.1 B2.0 W2.0 B3.0 W3.0");
    // the messages around one compute of the wrap: stage 0 chunk 1 receives from stage 1 chunk 0
    // (virtual stage 1 -> 2), and its backward sends the grad back to stage 1 chunk 0
    const std::vector<PipeAction>& a = s[0];
    auto it = std::find_if(a.begin(), a.end(), [](const PipeAction& x) { return x.op == PIPE_F && x.chunk == 1; });
    REQUIRE(it != a.begin());
    CHECK((it[-1].op == PIPE_RECV_ACT && it[-1].mb == 0 && it[-1].chunk == 1 && it[-1].peer == 1));
    CHECK((it[1].op == PIPE_SEND_ACT && it[1].mb == 0 && it[1].chunk == 1 && it[1].peer == 1));
    const std::vector<PipeAction>& b = s[1];
    auto jt = std::find_if(b.begin(), b.end(), [](const PipeAction& x) { return x.op == PIPE_F && x.chunk == 0; });
    CHECK((jt[1].op == PIPE_SEND_ACT && jt[1].chunk == 0 && jt[1].peer == 0));
    // one stage: no messages at all
    for (PipeKind k : {PIPE_GPIPE, PIPE_1F1B, PIPE_ZB1}) {
        const Schedule one = pipeline_schedule(k, 1, 3, 1);
        for (const PipeAction& x : one[0]) CHECK(is_compute(x.op));
    }
    // interleaved with V = 1 is plain 1F1B
    CHECK(compute_order(pipeline_schedule(PIPE_INTERLEAVED, 4, 6, 1)[1], 1) ==
          compute_order(pipeline_schedule(PIPE_1F1B, 4, 6, 1)[1], 1));
}

TEST_CASE("pipeline: bad arguments are refused with the flag named") {
    auto refuses = [](PipeKind k, int P, int M, int V, const char* needle) {
        INFO(pipe_kind_name(k) << " P=" << P << " M=" << M << " V=" << V);
        CHECK_THROWS_WITH_AS(pipeline_schedule(k, P, M, V), doctest::Contains(needle), LlmcError);
        CHECK_THROWS_WITH_AS(pipe_bubble_formula(k, P, M, V), doctest::Contains(needle), LlmcError);
    };
    refuses(PIPE_1F1B, 0, 4, 1, "--pp 0: the number of pipeline stages must be at least 1");
    refuses(PIPE_GPIPE, -1, 4, 1, "--pp -1");
    refuses(PIPE_GPIPE, 2, 0, 1, "micro-batches per step (gradient accumulation steps) must be at least 1, got 0");
    refuses(PIPE_1F1B, 4, 3, 1, "--pp_schedule 1f1b with --pp 4 needs at least 4 micro-batches per step "
                                "(gradient accumulation steps), got 3");
    refuses(PIPE_ZB1, 8, 7, 1, "--pp_schedule zb1 with --pp 8 needs at least 8 micro-batches per step");
    refuses(PIPE_INTERLEAVED, 4, 2, 1, "--pp_schedule interleaved with --pp 4 needs at least 4 micro-batches");
    refuses(PIPE_1F1B, 4, 8, 2, "--pp_virtual 2: several model chunks per stage need --pp_schedule interleaved");
    refuses(PIPE_ZB1, 4, 8, 3, "--pp_virtual 3");
    refuses(PIPE_GPIPE, 4, 8, 2, "--pp_virtual 2");
    refuses(PIPE_INTERLEAVED, 4, 8, 0, "--pp_virtual 0: the number of model chunks per stage must be at least 1");
    refuses(PIPE_INTERLEAVED, 4, 6, 2, "needs the micro-batches per step (gradient accumulation steps) to be a multiple "
                                       "of --pp 4, got 6");
    refuses(PIPE_INTERLEAVED, 4, 2, 2, "a multiple of --pp 4, got 2");
    refuses(PIPE_INTERLEAVED, 1, 4, 2, "--pp_schedule interleaved with --pp_virtual 2 needs --pp >= 2, got --pp 1");
    refuses(PIPE_GPIPE, 4096, 8192, 1, "too large");
    // and what is allowed
    CHECK_NOTHROW(pipeline_schedule(PIPE_GPIPE, 4, 1, 1));  // gpipe takes any M
    CHECK_NOTHROW(pipeline_schedule(PIPE_1F1B, 4, 5, 1));   // 1f1b and zb1: any M >= P
    CHECK_NOTHROW(pipeline_schedule(PIPE_ZB1, 4, 5, 1));
}

TEST_CASE("pipeline: the simulator refuses broken schedules, saying what is wrong") {
    const Schedule good = pipeline_schedule(PIPE_1F1B, 2, 2, 1);
    auto without = [&](int s, PipeOp op) {
        Schedule b = good;
        auto it = std::find_if(b[s].begin(), b[s].end(), [&](const PipeAction& a) { return a.op == op; });
        b[s].erase(it);
        return b;
    };
    CHECK_THROWS_WITH_AS(pipe_simulate(without(1, PIPE_RECV_ACT), 2, 1, 1, 1, 1),
                         doctest::Contains("SEND_ACT(mb 0, chunk 0) on stage 0 has no matching RECV_ACT on stage 1"), LlmcError);
    CHECK_THROWS_WITH_AS(pipe_simulate(without(1, PIPE_SEND_GRAD), 2, 1, 1, 1, 1),
                         doctest::Contains("RECV_GRAD(mb 0, chunk 0) on stage 0 has no matching SEND_GRAD on stage 1"), LlmcError);
    CHECK_THROWS_WITH_AS(pipe_simulate(without(0, PIPE_W), 2, 1, 1, 1, 1),
                         doctest::Contains("stage 0 never runs W of mb 0, chunk 0"), LlmcError);
    Schedule b = good;
    b[0][1].peer = 0;  // stage 0 runs F(0), then SEND_ACT(0) to stage 1
    CHECK_THROWS_WITH_AS(pipe_simulate(b, 2, 1, 1, 1, 1), doctest::Contains("names peer 0, but virtual stage 1 is on stage 1"),
                         LlmcError);
    // W before B
    b = good;
    auto w = std::find_if(b[1].begin(), b[1].end(), [](const PipeAction& a) { return a.op == PIPE_W; });
    std::rotate(b[1].begin(), w, w + 1);
    CHECK_THROWS_WITH_AS(pipe_simulate(b, 2, 1, 1, 1, 1), doctest::Contains("W(mb 0, chunk 0) on stage 1 before its B"), LlmcError);
    // a deadlock: stage 0 waits for a grad before it sends the activation that grad depends on
    const Schedule dead = {
        {{PIPE_F, 0, 0, -1}, {PIPE_RECV_GRAD, 0, 0, 1}, {PIPE_B, 0, 0, -1}, {PIPE_SEND_ACT, 0, 0, 1}, {PIPE_W, 0, 0, -1}},
        {{PIPE_RECV_ACT, 0, 0, 0}, {PIPE_F, 0, 0, -1}, {PIPE_B, 0, 0, -1}, {PIPE_SEND_GRAD, 0, 0, 0}, {PIPE_W, 0, 0, -1}},
    };
    CHECK_THROWS_WITH_AS(pipe_simulate(dead, 2, 1, 1, 1, 1),
                         doctest::Contains("deadlock: stage 0 waits in RECV_GRAD(mb 0, chunk 0) on stage 0 (action 1) for "
                                           "stage 1, which waits in RECV_ACT(mb 0, chunk 0) on stage 1; stage 1 waits in "
                                           "RECV_ACT"),
                         LlmcError);
    CHECK_THROWS_WITH_AS(pipe_simulate(good, 2, 1, 1, -1, 1), doctest::Contains("costs must be finite and >= 0"), LlmcError);
    // the wrong number of stage lists
    CHECK_THROWS_WITH_AS(pipe_simulate(good, 3, 1, 1, 1, 1), doctest::Contains("2 stage lists for P=3"), LlmcError);
}

TEST_CASE("pipeline: simulated times of a tiny gpipe") {
    // P=2, M=2, F=1, B=2, W=0.5: stage 0 F0 [0,1] F1 [1,2]; stage 1 F0 [1,2] F1 [2,3] B0 [3,5] W0 [5,5.5]
    // B1 [5.5,7.5] W1 [7.5,8]
    const Schedule s = pipeline_schedule(PIPE_GPIPE, 2, 2, 1);
    const PipeSim sim = pipe_simulate(s, 2, 1, 1, 2, 0.5);
    CHECK(sim.finish[1] == 8.0);
    CHECK(sim.finish[0] == 10.0);  // B0 [5,7] W0 [7,7.5] B1 [7.5,9.5] W1 [9.5,10]
    CHECK(sim.makespan == 10.0);
    CHECK(sim.busy[0] == 2 * 3.5);
    CHECK(sim.idle[1] == 3.0);
    // a recv's interval is its wait: stage 0 waits for the first grad from t=2 to t=5
    REQUIRE(s[0][4].op == PIPE_RECV_GRAD);
    CHECK(sim.t0[0][4] == 2.0);
    CHECK(sim.t1[0][4] == 5.0);
    CHECK(sim.t0[0][5] == 5.0);  // and B(0) starts when the grad arrives
}

// The executor runs consecutive transfers as one rendezvous group (p2p_group): every schedule must
// also be deadlock-free that way, and a schedule that only works with buffered sends is caught.
TEST_CASE("pipeline: every schedule is deadlock-free with rendezvous transfer groups (the executor's semantics)") {
    for (const Case& c : all_cases()) {
        INFO(case_name(c));
        CHECK_NOTHROW(pipe_check_rendezvous(pipeline_schedule(c.kind, c.P, c.M, c.V), c.P, c.V));
    }
    // two stages that each send before receiving, in separate groups: fine when buffered, a
    // deadlock as rendezvous (a compute between the send and the receive splits the groups)
    Schedule bad(2);
    bad[0] = {{PIPE_F, 0, 0, -1}, {PIPE_SEND_ACT, 0, 0, 1}, {PIPE_W, 9, 0, -1}, {PIPE_RECV_GRAD, 0, 0, 1}};
    bad[1] = {{PIPE_RECV_ACT, 0, 0, 0}, {PIPE_F, 0, 0, -1}, {PIPE_B, 0, 0, -1}, {PIPE_SEND_GRAD, 0, 0, 0}};
    CHECK_NOTHROW(pipe_check_rendezvous(bad, 2, 1));  // stage 1 receives first: no cycle
    bad[1] = {{PIPE_SEND_GRAD, 0, 0, 0}, {PIPE_B, 0, 0, -1}, {PIPE_RECV_ACT, 0, 0, 0}};
    CHECK_THROWS_WITH_AS(pipe_check_rendezvous(bad, 2, 1), doctest::Contains("deadlocks"), LlmcError);
}
