// GPU mixture-of-experts ops (llmc/ops/moe.cuh) and the batched matmuls (llmc/ops/matmul.cuh) vs their CPU
// twins (llmc/ops/cpu/moe.h, llmc/ops/cpu/matmul.h).
//  - routing (moe_select) must be IDENTICAL to cpu::moe_select (integers), ties included: random
//    continuous scores, scores with bitwise-equal values planted exactly at each expert's threshold,
//    scores from a handful of levels (ties everywhere), all-equal scores, exact zeros; both groupings,
//    n up to 65536, E in {4, 6, 8, 64}, c in {1, 2} (and c = 4 with E = 4: every token taken)
//  - the float ops on the same bf16-rounded inputs (outputs poisoned first, so an element a kernel
//    skips is a NaN): bf16 outputs relative L2 <= FLOATX_TOL and max-norm <= 1e-2 (one bf16 rounding of
//    the result is <= 2^-8 of its magnitude, so a single wrong element in a ragged edge fails); fp32
//    outputs (scores, dscores) max-norm <= 1e-5: the GPU sums the same exact bf16 products in fp32 in
//    another order (~1e-7 relative) and uses the fast exp (a few ulp), 1e-5 leaves a 10x margin and
//    still catches any dropped term (O(1/sqrt(C)) >= 1e-2)
//  - every op twice on the same inputs: bitwise equal (memcmp)
#pragma once
#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <vector>
#include "test/gpu/harness.cuh"
#include "llmc/ops/cpu/matmul.h"
#include "llmc/ops/cpu/moe.h"
#include "llmc/ops/matmul.cuh"
#include "llmc/ops/moe.cuh"

namespace moe_test {
using namespace gpu_test;

constexpr double MAX_TOL = 1e-2;   // max-norm of bf16 outputs
constexpr double FP32_TOL = 1e-5;  // max-norm of fp32 outputs (see the top)

// ------------------------------------------------------------------------------------------------
// score generators (rows need not sum to 1 for the selection; the router tests use real softmaxes)

enum class Ties { none, at_threshold, levels, all_equal, zeros };

// softmax of normal(0, 2) logits: scores spread over several binades (all radix digits matter)
inline std::vector<float> softmax_scores(size_t n, int E, uint64_t seed) {
    Rng rng(seed);
    std::vector<float> s(n * E);
    for (size_t i = 0; i < n; i++) {
        float* r = s.data() + i * E;
        float mx = -INFINITY, sum = 0.0f;
        for (int e = 0; e < E; e++) mx = std::max(mx, r[e] = rng.normal(0.0f, 2.0f));
        for (int e = 0; e < E; e++) sum += (r[e] = std::exp(r[e] - mx));
        for (int e = 0; e < E; e++) r[e] /= sum;
    }
    return s;
}

// ties of the requested kind applied to (a copy of) continuous scores
inline std::vector<float> with_ties(std::vector<float> s, int B, int T, int E, float c, bool by_position, Ties ties,
                                    uint64_t seed) {
    const size_t n = (size_t)B * T;
    Rng rng(seed);
    switch (ties) {
        case Ties::none: break;
        case Ties::levels:  // 5 distinct values: thousands of ties everywhere, and at every threshold
            for (float& v : s) v = (float)(1 + rng.below(5)) * 0.125f;
            break;
        case Ties::all_equal:  // the lowest indices win
            for (float& v : s) v = 0.25f;
            break;
        case Ties::zeros:  // a third exact zeros (and some -0): ties at the bottom, -0 == +0 as on the CPU
            for (float& v : s) {
                const uint64_t r = rng.below(6);
                if (r == 0) v = 0.0f;
                if (r == 1) v = -0.0f;
            }
            break;
        case Ties::at_threshold: {
            // per routing group and expert: copy the k-th best value onto several random members
            // (bitwise-equal scores straddling the cut; only the token index decides among them)
            const int cap = cpu::moe_capacity(B, T, E, c, by_position);
            const int groups = by_position ? T : 1, members = by_position ? B : (int)n;
            const int k = by_position ? cap / T : cap;
            if (k <= 0) break;
            std::vector<float> col(members);
            for (int g = 0; g < groups; g++)
                for (int e = 0; e < E; e++) {
                    auto idx = [&](int m) { return by_position ? ((size_t)m * T + g) : (size_t)m; };
                    for (int m = 0; m < members; m++) col[m] = s[idx(m) * E + e];
                    std::nth_element(col.begin(), col.begin() + (k - 1), col.end(), std::greater<float>());
                    const float kth = col[k - 1];
                    const int copies = std::max(2, members / 16);
                    for (int j = 0; j < copies; j++) s[idx((int)rng.below(members)) * E + e] = kth;
                }
            break;
        }
    }
    return s;
}
inline std::vector<float> make_scores(int B, int T, int E, float c, bool by_position, Ties ties, uint64_t seed) {
    return with_ties(softmax_scores((size_t)B * T, E, seed), B, T, E, c, by_position, ties, seed + 7);
}

inline void check_select(const std::vector<float>& scores, int B, int T, int E, float c, bool by_position) {
    const int n = B * T, cap = cpu::moe_capacity(B, T, E, c, by_position);
    INFO("moe_select B=" << B << " T=" << T << " E=" << E << " c=" << c << " by_position=" << by_position
                         << " cap=" << cap);
    std::vector<int> want_tokens((size_t)E * cap), want_slots((size_t)n * E);
    cpu::moe_select<float>(want_tokens.data(), want_slots.data(), scores.data(), B, T, E, c, by_position);

    auto d_scores = to_device(scores);
    DeviceBuffer<int> d_tokens((size_t)E * cap), d_slots((size_t)n * E);
    cuda_scratch_reserve(moe_scratch_bytes(B, T, 1, E));
    std::vector<int> runs_tokens[2], runs_slots[2];
    for (int run = 0; run < 2; run++) {
        d_tokens.poison();
        d_slots.poison();
        moe_select(d_tokens, d_slots, d_scores->ptr, B, T, E, c, by_position);
        runs_tokens[run] = download(d_tokens);
        runs_slots[run] = download(d_slots);
    }
    const std::vector<int>& got_tokens = runs_tokens[0];
    const std::vector<int>& got_slots = runs_slots[0];
    size_t bad_tokens = 0, bad_slots = 0, first_tok = 0, first_slot = 0;
    for (size_t r = 0; r < want_tokens.size(); r++)
        if (got_tokens[r] != want_tokens[r] && bad_tokens++ == 0) first_tok = r;
    for (size_t r = 0; r < want_slots.size(); r++)
        if (got_slots[r] != want_slots[r] && bad_slots++ == 0) first_slot = r;
    INFO("first expert_tokens mismatch at " << first_tok << " (expert " << first_tok / std::max(cap, 1) << "): got "
                                            << (bad_tokens ? got_tokens[first_tok] : 0) << " want "
                                            << (bad_tokens ? want_tokens[first_tok] : 0));
    INFO("first token_slots mismatch at token " << first_slot / E << " expert " << first_slot % E << ": got "
                                                << (bad_slots ? got_slots[first_slot] : 0) << " want "
                                                << (bad_slots ? want_slots[first_slot] : 0));
    CHECK(bad_tokens == 0);
    CHECK(bad_slots == 0);
    CHECK(same_bytes(runs_tokens[0], runs_tokens[1]));
    CHECK(same_bytes(runs_slots[0], runs_slots[1]));
}

// every grouping x capacity x tie pattern on one set of continuous scores per (B, T, E)
inline void check_select_all(int B, int T, int E, uint64_t seed) {
    const std::vector<float> base = softmax_scores((size_t)B * T, E, seed);
    for (float c : {1.0f, 2.0f})
        for (bool pos : {false, true})
            for (Ties ties : {Ties::none, Ties::at_threshold, Ties::levels}) {
                CAPTURE((int)ties);
                check_select(with_ties(base, B, T, E, c, pos, ties, seed + 7), B, T, E, c, pos);
            }
}

// ------------------------------------------------------------------------------------------------
// a routing (from the CPU selection) and the float ops' inputs

struct Routing {
    int B, T, E, C, n, cap;
    std::vector<float> scores;
    std::vector<int> expert_tokens, token_slots;
    Routing(int B_, int T_, int E_, int C_, float c, bool by_position, uint64_t seed)
        : B(B_), T(T_), E(E_), C(C_), n(B_ * T_) {
        cap = cpu::moe_capacity(B, T, E, c, by_position);
        scores = softmax_scores(n, E, seed);
        expert_tokens.resize((size_t)E * cap);
        token_slots.resize((size_t)n * E);
        cpu::moe_select<float>(expert_tokens.data(), token_slots.data(), scores.data(), B, T, E, c, by_position);
    }
    bool taken(int i, int e) const { return token_slots[(size_t)i * E + e] >= 0; }
    bool taken(int i) const {  // by any expert
        for (int e = 0; e < E; e++)
            if (taken(i, e)) return true;
        return false;
    }
};

struct OpShape {
    int B, T, E, C;
    float c;
    bool by_position;
};
inline std::ostream& operator<<(std::ostream& os, const OpShape& s) {
    return os << "B=" << s.B << " T=" << s.T << " E=" << s.E << " C=" << s.C << " c=" << s.c
              << " by_position=" << s.by_position;
}
// ragged C (scalar paths: 7, 37, 769), vector paths (768), E below / at / above a warp, groups both ways
inline std::vector<OpShape> op_shapes() {
    return {{1, 5, 4, 7, 1.0f, false},    {3, 37, 8, 37, 2.0f, false},  {4, 300, 8, 768, 1.0f, true},
            {2, 150, 64, 769, 2.0f, false}, {8, 64, 6, 768, 2.0f, true},  {5, 101, 33, 64, 1.0f, false},
            {2, 257, 64, 768, 2.0f, true}};
}

// Routing of one side (want: the CPU on fp32 activations) against the other (got: the GPU on bf16
// ones). bf16 rounding moves scores by ~1e-3, so near-tied choices may flip: expert e's list holds i on
// one side and j on the other. Such a flip is legitimate only if i's and j's scores are within the
// noise of the threshold. For every expert and routing group, with kth = the weakest score `want`
// took and next = the strongest it left: a token only `want` took has gap s - next, a token only
// `got` took has gap kth - s (both >= 0, and below twice the score noise for a genuine flip).
struct RoutingDiff {
    int flips = 0;          // tokens one side took and the other did not, per expert, counted once per pair
    double worst_gap = 0;   // the largest gap of a flipped token (see above)
    std::vector<char> both; // [n, E]: expert e took token i on both sides
};
inline RoutingDiff compare_routing(const std::vector<int>& want_tokens, const std::vector<int>& got_tokens,
                                   const std::vector<float>& want_scores, int B, int T, int E, int cap,
                                   bool by_position) {
    const int n = B * T, groups = by_position ? T : 1;
    RoutingDiff d;
    d.both.assign((size_t)n * E, 0);
    std::vector<char> in_want(n), in_got(n);
    for (int e = 0; e < E; e++) {
        std::fill(in_want.begin(), in_want.end(), 0);
        std::fill(in_got.begin(), in_got.end(), 0);
        for (int r = 0; r < cap; r++) {
            const int a = want_tokens[(size_t)e * cap + r], b = got_tokens[(size_t)e * cap + r];
            REQUIRE((a >= 0 && a < n && b >= 0 && b < n));
            in_want[a] = 1;
            in_got[b] = 1;
        }
        for (int g = 0; g < groups; g++) {
            auto member = [&](int i) { return !by_position || i % T == g; };
            double kth = INFINITY, next = -INFINITY;
            for (int i = 0; i < n; i++) {
                if (!member(i)) continue;
                const double sc = want_scores[(size_t)i * E + e];
                if (in_want[i]) kth = std::min(kth, sc);
                else next = std::max(next, sc);
            }
            for (int i = 0; i < n; i++) {
                if (!member(i)) continue;
                const double sc = want_scores[(size_t)i * E + e];
                if (in_want[i] && in_got[i]) d.both[(size_t)i * E + e] = 1;
                if (in_want[i] && !in_got[i]) {
                    d.flips++;
                    d.worst_gap = std::max(d.worst_gap, sc - next);
                }
                if (!in_want[i] && in_got[i]) d.worst_gap = std::max(d.worst_gap, kth - sc);
            }
        }
    }
    return d;
}

}  // namespace moe_test

// ------------------------------------------------------------------------------------------------
// selection

TEST_CASE("moe_select: identical to cpu::moe_select, both groupings, ties at the threshold") {
    using namespace moe_test;
    struct BT {
        int B, T;
    };
    uint64_t seed = 7000;
    for (BT bt : {BT{1, 1}, BT{1, 7}, BT{3, 37}, BT{4, 1000}, BT{2, 4097}, BT{16, 300}})
        for (int E : {4, 6, 8, 64}) check_select_all(bt.B, bt.T, E, seed += 10);
}

TEST_CASE("moe_select: n = 65536 (both B x T layouts), E in {4, 8, 64}, c in {1, 2}") {
    using namespace moe_test;
    struct BT {
        int B, T;
    };
    uint64_t seed = 8000;
    for (BT bt : {BT{8, 8192}, BT{64, 1024}})
        for (int E : {4, 8, 64}) check_select_all(bt.B, bt.T, E, seed += 10);
}

TEST_CASE("moe_select: degenerate scores and capacities") {
    using namespace moe_test;
    uint64_t seed = 9000;
    for (bool pos : {false, true}) {
        for (Ties ties : {Ties::all_equal, Ties::zeros}) {
            CAPTURE((int)ties);
            check_select(make_scores(4, 1000, 8, 2.0f, pos, ties, seed++), 4, 1000, 8, 2.0f, pos);
            check_select(make_scores(64, 1024, 64, 1.0f, pos, ties, seed++), 64, 1024, 64, 1.0f, pos);
        }
        // every token taken by every expert (k = n, kp = B), and one expert
        check_select(make_scores(3, 37, 4, 4.0f, pos, Ties::none, seed++), 3, 37, 4, 4.0f, pos);
        check_select(make_scores(3, 37, 1, 1.0f, pos, Ties::at_threshold, seed++), 3, 37, 1, 1.0f, pos);
        // tiny capacity (1 token per expert / per position)
        check_select(make_scores(8, 513, 64, 0.01f, pos, Ties::at_threshold, seed++), 8, 513, 64, 0.01f, pos);
    }
}

// ------------------------------------------------------------------------------------------------
// router

TEST_CASE("moe_router_forward matches the CPU twin; moe_select on its scores matches the CPU selection") {
    using namespace moe_test;
    struct Shape {
        int n, C, E, offset;
    };
    uint64_t seed = 10000;
    for (Shape s : {Shape{1, 7, 4, 0}, Shape{37, 37, 6, 0}, Shape{1000, 768, 8, 0}, Shape{4099, 769, 64, 0},
                    Shape{300, 768, 1, 0}, Shape{513, 768, 33, 1}, Shape{700, 64, 128, 0}, Shape{2048, 1024, 16, 0},
                    Shape{999, 1024, 64, 1}, Shape{129, 200, 100, 0}, Shape{64, 768, 2, 0}}) {
        CAPTURE(s.n);
        CAPTURE(s.C);
        CAPTURE(s.E);
        CAPTURE(s.offset);
        const std::vector<float> x = floatX_round(random_vector((size_t)s.n * s.C, seed++, 1.0f, 0.1f));
        // logits ~ N(0, 2^2): a peaked softmax, as a trained router
        const std::vector<float> w = floatX_round(random_vector((size_t)s.E * s.C, seed++, 2.0f / std::sqrt((float)s.C)));
        std::vector<float> want((size_t)s.n * s.E);
        cpu::moe_router_forward<float, float>(want.data(), x.data(), w.data(), s.n, s.C, s.E);

        DevFloatX d_x(x, s.offset), d_w(w, s.offset);
        DeviceBuffer<float> d_scores((size_t)s.n * s.E);
        std::vector<float> got[2];
        for (int run = 0; run < 2; run++) {
            d_scores.poison();
            moe_router_forward(d_scores, d_x.ptr(), d_w.ptr(), s.n, s.C, s.E);
            got[run] = download(d_scores);
        }
        CHECK_CLOSE("scores rel_max", rel_max(got[0], want), FP32_TOL);
        CHECK(same_bytes(got[0], got[1]));
        // rows sum to 1
        double worst = 0;
        for (int i = 0; i < s.n; i++) {
            double sum = 0;
            for (int e = 0; e < s.E; e++) sum += got[0][(size_t)i * s.E + e];
            worst = std::max(worst, std::fabs(sum - 1.0));
        }
        CHECK(worst < 1e-5);
        // the selection on the GPU's own scores (the trainer's path): B x T = n with B = 1
        check_select(got[0], 1, s.n, s.E, 2.0f, false);
    }
}

TEST_CASE("moe_router_backward matches the CPU twin (dx accumulated, fp32 drouter_w with one add)") {
    using namespace moe_test;
    struct Shape {
        int n, C, E, offset;
    };
    uint64_t seed = 11000;
    for (Shape s : {Shape{1, 7, 4, 0}, Shape{37, 37, 6, 0}, Shape{1000, 768, 8, 0}, Shape{4099, 769, 64, 0},
                    Shape{300, 768, 1, 0}, Shape{513, 768, 33, 1}, Shape{2100, 64, 128, 0}, Shape{5000, 1024, 16, 0},
                    Shape{129, 200, 100, 0}}) {
        CAPTURE(s.n);
        CAPTURE(s.C);
        CAPTURE(s.E);
        CAPTURE(s.offset);
        const size_t nE = (size_t)s.n * s.E;
        const std::vector<float> scores = softmax_scores(s.n, s.E, seed++);
        std::vector<float> dscores = random_vector(nE, seed++);
        Rng rng(seed++);
        for (float& d : dscores)
            if (rng.below(3) == 0) d = 0.0f;  // pairs not taken have dscores 0
        const std::vector<float> x = floatX_round(random_vector((size_t)s.n * s.C, seed++, 1.0f, 0.1f));
        const std::vector<float> w = floatX_round(random_vector((size_t)s.E * s.C, seed++));
        // prefills of the size of the increments: dlogit ~ 1/E, so dx gains ~ 1/sqrt(E) and
        // drouter_w ~ sqrt(n)/E; a lost += or a lost term is then an O(1) relative error
        const std::vector<float> dx0 = floatX_round(random_vector((size_t)s.n * s.C, seed++, 1.0f / std::sqrt((float)s.E)));
        const std::vector<float> dw0 = random_vector((size_t)s.E * s.C, seed++, std::sqrt((float)s.n) / (float)s.E);
        std::vector<float> want_dx = dx0, want_dw = dw0;
        cpu::moe_router_backward<float, float>(want_dx.data(), want_dw.data(), dscores.data(), scores.data(), x.data(),
                                               w.data(), s.n, s.C, s.E);

        auto d_scores = to_device(scores), d_dscores = to_device(dscores);
        DevFloatX d_x(x, s.offset), d_w(w, s.offset), d_dx(dx0, s.offset);
        gpu_test::DevF32 d_dw(dw0, s.offset);
        cuda_scratch_reserve(moe_scratch_bytes(1, s.n, s.C, s.E));
        std::vector<floatX> raw_dx[2];
        std::vector<float> raw_dw[2];
        for (int run = 0; run < 2; run++) {
            d_dx.upload(dx0);
            d_dw.upload(dw0);
            moe_router_backward(d_dx.ptr(), d_dw.ptr(), d_dscores->ptr, d_scores->ptr, d_x.ptr(), d_w.ptr(), s.n, s.C,
                                s.E);
            raw_dx[run] = d_dx.raw();
            raw_dw[run] = d_dw.get();
        }
        const std::vector<float> got_dx = d_dx.get(), got_dw = d_dw.get();
        CHECK_CLOSE("dx rel_l2", rel_l2(got_dx, want_dx), FLOATX_TOL);
        CHECK_CLOSE("dx rel_max", rel_max(got_dx, want_dx), MAX_TOL);
        gpu_test::check_f32("drouter_w", got_dw, want_dw);
        CHECK(same_bytes(raw_dx[0], raw_dx[1]));
        CHECK(same_bytes(raw_dw[0], raw_dw[1]));
        // one add of a sum independent of the destination: the same call into a zero drouter_w
        d_dx.upload(dx0);
        gpu_test::DevF32 z_dw(std::vector<float>((size_t)s.E * s.C, 0.0f), s.offset);
        moe_router_backward(d_dx.ptr(), z_dw.ptr(), d_dscores->ptr, d_scores->ptr, d_x.ptr(), d_w.ptr(), s.n, s.C, s.E);
        gpu_test::check_single_add("drouter_w", dw0, got_dw, z_dw.get());
    }
}

// ------------------------------------------------------------------------------------------------
// gather / combine on a CPU routing

TEST_CASE("moe_gather (exact copy) and moe_gather_backward (dx +=) match the CPU twins") {
    using namespace moe_test;
    uint64_t seed = 12000;
    for (const OpShape& s : op_shapes())
        for (int offset : {0, 1}) {
            INFO(s << " offset=" << offset);
            Routing r(s.B, s.T, s.E, s.C, s.c, s.by_position, seed++);
            const size_t rows = (size_t)r.E * r.cap;
            const std::vector<float> x = floatX_round(random_vector((size_t)r.n * r.C, seed++, 1.0f, 0.1f));
            const std::vector<float> dxe = floatX_round(random_vector(rows * r.C, seed++));
            const std::vector<float> dx0 = floatX_round(random_vector((size_t)r.n * r.C, seed++));
            std::vector<float> want_xe(rows * r.C), want_dx = dx0;
            cpu::moe_gather<float>(want_xe.data(), x.data(), r.expert_tokens.data(), r.E, r.cap, r.C);
            cpu::moe_gather_backward<float>(want_dx.data(), dxe.data(), r.token_slots.data(), r.n, r.E, r.cap, r.C);

            auto d_tokens = to_device(r.expert_tokens), d_slots = to_device(r.token_slots);
            DevFloatX d_x(x, offset), d_xe(rows * r.C, offset), d_dxe(dxe, offset), d_dx(dx0, offset);
            std::vector<floatX> raw_xe[2], raw_dx[2];
            for (int run = 0; run < 2; run++) {
                d_xe.poison();
                d_dx.upload(dx0);
                moe_gather(d_xe.ptr(), d_x.ptr(), d_tokens->ptr, r.E, r.cap, r.C);
                moe_gather_backward(d_dx.ptr(), d_dxe.ptr(), d_slots->ptr, r.n, r.E, r.cap, r.C);
                raw_xe[run] = d_xe.raw();
                raw_dx[run] = d_dx.raw();
            }
            CHECK(d_xe.get() == want_xe);  // a copy of bf16 values: exact
            const std::vector<float> got_dx = d_dx.get();
            CHECK_CLOSE("dx rel_l2", rel_l2(got_dx, want_dx), FLOATX_TOL);
            CHECK_CLOSE("dx rel_max", rel_max(got_dx, want_dx), MAX_TOL);
            // rows of tokens no expert took are untouched, bit for bit
            bool untouched = true;
            for (int i = 0; i < r.n; i++)
                if (!r.taken(i))
                    for (int c = 0; c < r.C; c++) untouched &= got_dx[(size_t)i * r.C + c] == dx0[(size_t)i * r.C + c];
            CHECK(untouched);
            CHECK(same_bytes(raw_xe[0], raw_xe[1]));
            CHECK(same_bytes(raw_dx[0], raw_dx[1]));
        }
}

TEST_CASE("moe_combine_forward and moe_combine_backward match the CPU twins") {
    using namespace moe_test;
    uint64_t seed = 13000;
    for (const OpShape& s : op_shapes())
        for (int offset : {0, 1}) {
            INFO(s << " offset=" << offset);
            Routing r(s.B, s.T, s.E, s.C, s.c, s.by_position, seed++);
            const size_t rows = (size_t)r.E * r.cap;
            const std::vector<float> ye = floatX_round(random_vector(rows * r.C, seed++, 1.0f, 0.1f));
            const std::vector<float> dout = floatX_round(random_vector((size_t)r.n * r.C, seed++));
            std::vector<float> want_out((size_t)r.n * r.C), want_dye(rows * r.C), want_ds((size_t)r.n * r.E);
            cpu::moe_combine_forward<float, float>(want_out.data(), ye.data(), r.scores.data(), r.token_slots.data(),
                                                   r.n, r.E, r.cap, r.C);
            cpu::moe_combine_backward<float, float>(want_dye.data(), want_ds.data(), dout.data(), ye.data(),
                                                    r.scores.data(), r.expert_tokens.data(), r.token_slots.data(), r.n,
                                                    r.E, r.cap, r.C);

            auto d_scores = to_device(r.scores);
            auto d_tokens = to_device(r.expert_tokens), d_slots = to_device(r.token_slots);
            DevFloatX d_ye(ye, offset), d_dout(dout, offset), d_out((size_t)r.n * r.C, offset), d_dye(rows * r.C, offset);
            DeviceBuffer<float> d_ds((size_t)r.n * r.E);
            std::vector<floatX> raw_out[2], raw_dye[2];
            std::vector<float> got_ds[2];
            for (int run = 0; run < 2; run++) {
                d_out.poison();
                d_dye.poison();
                d_ds.poison();
                moe_combine_forward(d_out.ptr(), d_ye.ptr(), d_scores->ptr, d_slots->ptr, r.n, r.E, r.cap, r.C);
                moe_combine_backward(d_dye.ptr(), d_ds, d_dout.ptr(), d_ye.ptr(), d_scores->ptr, d_tokens->ptr,
                                     d_slots->ptr, r.n, r.E, r.cap, r.C);
                raw_out[run] = d_out.raw();
                raw_dye[run] = d_dye.raw();
                got_ds[run] = download(d_ds);
            }
            const std::vector<float> got_out = d_out.get(), got_dye = d_dye.get();
            CHECK_CLOSE("out rel_l2", rel_l2(got_out, want_out), FLOATX_TOL);
            CHECK_CLOSE("out rel_max", rel_max(got_out, want_out), MAX_TOL);
            CHECK_CLOSE("dye rel_l2", rel_l2(got_dye, want_dye), FLOATX_TOL);
            CHECK_CLOSE("dye rel_max", rel_max(got_dye, want_dye), MAX_TOL);
            CHECK_CLOSE("dscores rel_max", rel_max(got_ds[0], want_ds), FP32_TOL);
            // exact zeros: rows of tokens no expert took, dscores of pairs not taken
            bool zeros = true;
            for (int i = 0; i < r.n; i++) {
                for (int e = 0; e < r.E; e++)
                    if (!r.taken(i, e)) zeros &= got_ds[0][(size_t)i * r.E + e] == 0.0f;
                if (!r.taken(i))
                    for (int c = 0; c < r.C; c++) zeros &= got_out[(size_t)i * r.C + c] == 0.0f;
            }
            CHECK(zeros);
            CHECK(same_bytes(raw_out[0], raw_out[1]));
            CHECK(same_bytes(raw_dye[0], raw_dye[1]));
            CHECK(same_bytes(got_ds[0], got_ds[1]));
        }
}

// ------------------------------------------------------------------------------------------------
// batched matmuls (the expert FFNs)

namespace moe_test {

struct BatchedShape {
    int n_batch, BT, C, OC;
};
// OC % 8 == 0 (bias epilogue with a batch stride) and ragged OC (the bias fill kernel), partial
// 256-row dbias chunks, one batch, BT = 1
inline std::vector<BatchedShape> batched_shapes() {
    return {{3, 7, 37, 19}, {4, 64, 768, 256}, {8, 300, 64, 296}, {2, 513, 129, 1}, {1, 1000, 768, 2304},
            {5, 1, 40, 48}, {16, 257, 96, 40}};
}

inline void check_batched(const BatchedShape& s, bool with_bias, int offset, int bias_offset, uint64_t seed) {
    INFO("batched n_batch=" << s.n_batch << " BT=" << s.BT << " C=" << s.C << " OC=" << s.OC << " bias=" << with_bias
                            << " offset=" << offset << " bias_offset=" << bias_offset);
    const size_t nb = s.n_batch;
    const std::vector<float> inp = floatX_round(random_vector(nb * s.BT * s.C, seed + 1, 1.0f, 0.1f));
    const std::vector<float> weight = floatX_round(random_vector(nb * s.OC * s.C, seed + 2, 1.0f / std::sqrt((float)s.C)));
    const std::vector<float> bias = floatX_round(random_vector(nb * s.OC, seed + 3, 1.0f, 0.2f));
    // dout ~ N(0, 1/BT): dweight and dbias increments ~ N(0, 1), like their prefills
    const std::vector<float> dout = floatX_round(random_vector(nb * s.BT * s.OC, seed + 4, 1.0f / std::sqrt((float)s.BT)));
    const std::vector<float> dweight0 = random_vector(nb * s.OC * s.C, seed + 5);  // fp32 gradients
    const std::vector<float> dbias0 = random_vector(nb * s.OC, seed + 6);

    std::vector<float> want_out(nb * s.BT * s.OC), want_dinp(nb * s.BT * s.C), want_dw = dweight0, want_db = dbias0;
    cpu::matmul_forward_batched<float>(want_out.data(), inp.data(), weight.data(), with_bias ? bias.data() : nullptr,
                                       s.n_batch, s.BT, s.C, s.OC);
    cpu::matmul_backward_batched<float>(want_dinp.data(), want_dw.data(), with_bias ? want_db.data() : nullptr,
                                        dout.data(), inp.data(), weight.data(), s.n_batch, s.BT, s.C, s.OC);

    DevFloatX d_inp(inp, offset), d_w(weight, offset), d_out(want_out.size(), offset), d_dout(dout, offset),
        d_dinp(want_dinp.size(), offset), d_b(bias, bias_offset);
    gpu_test::DevF32 d_dw(dweight0, offset), d_db(dbias0, bias_offset);
    cuda_scratch_reserve(matmul_batched_scratch_bytes(s.n_batch, s.BT, s.OC));
    std::vector<floatX> raw[2][2];
    std::vector<float> raw_grads[2][2];
    for (int run = 0; run < 2; run++) {
        d_out.poison();
        d_dinp.poison();
        d_dw.upload(dweight0);
        d_db.upload(dbias0);
        matmul_forward_batched(d_out.ptr(), d_inp.ptr(), d_w.ptr(), with_bias ? d_b.ptr() : nullptr, s.n_batch, s.BT,
                               s.C, s.OC);
        matmul_backward_batched(d_dinp.ptr(), d_dw.ptr(), with_bias ? d_db.ptr() : nullptr, d_dout.ptr(), d_inp.ptr(),
                                d_w.ptr(), s.n_batch, s.BT, s.C, s.OC);
        raw[run][0] = d_out.raw();
        raw[run][1] = d_dinp.raw();
        raw_grads[run][0] = d_dw.get();
        raw_grads[run][1] = d_db.get();
    }
    const std::vector<float> out = d_out.get(), dinp = d_dinp.get(), dw = d_dw.get(), db = d_db.get();
    CHECK_CLOSE("out rel_l2", rel_l2(out, want_out), FLOATX_TOL);
    CHECK_CLOSE("out rel_max", rel_max(out, want_out), MAX_TOL);
    CHECK_CLOSE("dinp rel_l2", rel_l2(dinp, want_dinp), FLOATX_TOL);
    CHECK_CLOSE("dinp rel_max", rel_max(dinp, want_dinp), MAX_TOL);
    gpu_test::check_f32("dweight", dw, want_dw);
    // without dbias the prefill stays bitwise
    gpu_test::check_f32("dbias", db, want_db, with_bias ? gpu_test::F32_TOL : 0.0);
    CHECK(matmul_fp32_plans_max_split_k() == 1);
    // one add of sums independent of the destination: the weight gradients alone into zeros
    gpu_test::DevF32 z_dw(std::vector<float>(dw.size(), 0.0f), offset), z_db(std::vector<float>(db.size(), 0.0f), bias_offset);
    matmul_backward_batched(nullptr, z_dw.ptr(), with_bias ? z_db.ptr() : nullptr, d_dout.ptr(), d_inp.ptr(), nullptr,
                            s.n_batch, s.BT, s.C, s.OC);
    gpu_test::check_single_add("dweight", dweight0, dw, z_dw.get());
    if (with_bias) gpu_test::check_single_add("dbias", dbias0, db, z_db.get());
    // every batch on its own (a wrong batch stride cannot hide in the whole tensor's norm)
    for (int b = 0; b < s.n_batch; b++) {
        CAPTURE(b);
        auto slice = [&](const std::vector<float>& v, size_t per) {
            return std::vector<float>(v.begin() + b * per, v.begin() + (b + 1) * per);
        };
        const size_t po = (size_t)s.BT * s.OC, pi = (size_t)s.BT * s.C, pw = (size_t)s.OC * s.C;
        CHECK_CLOSE("out[b] rel_l2", rel_l2(slice(out, po), slice(want_out, po)), FLOATX_TOL);
        CHECK_CLOSE("dinp[b] rel_l2", rel_l2(slice(dinp, pi), slice(want_dinp, pi)), FLOATX_TOL);
        CHECK_CLOSE("dweight[b] rel_l2", rel_l2(slice(dw, pw), slice(want_dw, pw)), gpu_test::F32_TOL);
        if (with_bias) CHECK_CLOSE("dbias[b] rel_l2", rel_l2(slice(db, s.OC), slice(want_db, s.OC)), gpu_test::F32_TOL);
    }
    for (int k = 0; k < 2; k++) CHECK(same_bytes(raw[0][k], raw[1][k]));
    for (int k = 0; k < 2; k++) CHECK(same_bytes(raw_grads[0][k], raw_grads[1][k]));
}

}  // namespace moe_test

TEST_CASE("matmul_forward_batched / matmul_backward_batched match the CPU twins") {
    matmul_setup();
    uint64_t seed = 14000;
    for (const moe_test::BatchedShape& s : moe_test::batched_shapes()) {
        moe_test::check_batched(s, true, 0, 0, seed += 10);
        moe_test::check_batched(s, false, 0, 0, seed += 10);
    }
}

TEST_CASE("matmul batched: 2-byte aligned operands, a bias that is not 16-byte aligned (fill-kernel path)") {
    uint64_t seed = 15000;
    for (const moe_test::BatchedShape& s : {moe_test::BatchedShape{4, 64, 768, 256}, moe_test::BatchedShape{3, 7, 37, 19}}) {
        moe_test::check_batched(s, true, 1, 0, seed += 10);
        moe_test::check_batched(s, true, 0, 1, seed += 10);
    }
}

// ------------------------------------------------------------------------------------------------
// the routing chain on bf16 activations vs the CPU on fp32 ones (as in the trainer test)

namespace moe_test {

// GPU: router on bf16(x), selection, gather, combine (identity experts: ye = the gathered rows); CPU:
// the same on fp32 x. The routing is compared set by set (compare_routing: flips bounded,
// each within twice the measured score noise of its threshold, few of them); the outputs of tokens whose experts
// agree on both sides are compared (bf16), the others are left out.
inline void check_routing_chain(int B, int T, int C, int E, float c, bool by_position, uint64_t seed) {
    INFO("routing chain B=" << B << " T=" << T << " C=" << C << " E=" << E << " c=" << c
                            << " by_position=" << by_position);
    const int n = B * T, cap = cpu::moe_capacity(B, T, E, c, by_position);
    const std::vector<float> x = random_vector((size_t)n * C, seed, 1.0f, 0.1f);  // fp32: the CPU's view
    const std::vector<float> w = floatX_round(random_vector((size_t)E * C, seed + 1, 2.0f / std::sqrt((float)C)));
    std::vector<float> want_scores((size_t)n * E), want_out((size_t)n * C), want_xe((size_t)E * cap * C);
    std::vector<int> want_tokens((size_t)E * cap), want_slots((size_t)n * E);
    cpu::moe_router_forward<float, float>(want_scores.data(), x.data(), w.data(), n, C, E);
    cpu::moe_select<float>(want_tokens.data(), want_slots.data(), want_scores.data(), B, T, E, c, by_position);
    cpu::moe_gather<float>(want_xe.data(), x.data(), want_tokens.data(), E, cap, C);
    cpu::moe_combine_forward<float, float>(want_out.data(), want_xe.data(), want_scores.data(), want_slots.data(), n,
                                           E, cap, C);

    DevFloatX d_x(x), d_w(w), d_xe((size_t)E * cap * C), d_out((size_t)n * C);
    DeviceBuffer<float> d_scores((size_t)n * E);
    DeviceBuffer<int> d_tokens((size_t)E * cap), d_slots((size_t)n * E);
    d_scores.poison();
    d_tokens.poison();
    d_slots.poison();
    cuda_scratch_reserve(moe_scratch_bytes(B, T, C, E));
    moe_router_forward(d_scores, d_x.ptr(), d_w.ptr(), n, C, E);
    moe_select(d_tokens, d_slots, d_scores, B, T, E, c, by_position);
    moe_gather(d_xe.ptr(), d_x.ptr(), d_tokens, E, cap, C);
    moe_combine_forward(d_out.ptr(), d_xe.ptr(), d_scores, d_slots, n, E, cap, C);
    const std::vector<float> got_scores = download(d_scores), got_out = d_out.get();
    const std::vector<int> got_tokens = download(d_tokens);

    // scores from bf16 inputs: ~1e-3 of the largest (logits ~ N(0, 4), inputs rounded to 2^-9)
    CHECK_CLOSE("scores rel_max (bf16 inputs)", rel_max(got_scores, want_scores), 2e-2);
    double noise = 0;
    for (size_t i = 0; i < got_scores.size(); i++)
        noise = std::max(noise, (double)std::fabs(got_scores[i] - want_scores[i]));
    const RoutingDiff d = compare_routing(want_tokens, got_tokens, want_scores, B, T, E, cap, by_position);
    INFO(d.flips << " flips, worst gap " << d.worst_gap << ", score noise " << noise);
    MESSAGE("routing chain B=" << B << " T=" << T << " E=" << E << ": " << d.flips << " flips of " << E * cap
                               << " choices, worst gap " << d.worst_gap << ", score noise " << noise);
    // the gap check catches a mis-sorted selection; the count (2% of the E x cap choices, at least 4)
    // catches a broken one whose errors happen to be small: genuine near-ties are far rarer
    CHECK(d.flips <= std::max(4, E * cap / 50));
    CHECK(d.worst_gap <= 2 * noise);
    // outputs of the tokens whose experts agree
    std::vector<float> got_same, want_same;
    for (int i = 0; i < n; i++) {
        bool same = true;
        for (int e = 0; e < E; e++) same &= (want_slots[(size_t)i * E + e] >= 0) == (bool)d.both[(size_t)i * E + e];
        for (int e = 0; e < E; e++) {  // and no expert the GPU alone took
            bool got_taken = false;
            for (int r = 0; r < cap; r++) got_taken |= got_tokens[(size_t)e * cap + r] == i;
            same &= got_taken == (bool)d.both[(size_t)i * E + e];
        }
        if (!same) continue;
        got_same.insert(got_same.end(), got_out.begin() + (size_t)i * C, got_out.begin() + (size_t)(i + 1) * C);
        want_same.insert(want_same.end(), want_out.begin() + (size_t)i * C, want_out.begin() + (size_t)(i + 1) * C);
    }
    CHECK(got_same.size() >= (size_t)(n - 2 * d.flips) * C);  // a flip leaves out at most its 2 tokens
    // the CPU's x is not rounded: one more bf16 rounding on top of the output's (2 x FLOATX_MAX_TOL)
    check_floatX("out of the tokens routed alike", got_same, want_same, FLOATX_TOL, 2 * FLOATX_MAX_TOL);
}

}  // namespace moe_test

TEST_CASE("MoE routing chain on bf16 activations vs the CPU on fp32: bounded flips within the score noise") {
    using namespace moe_test;
    // bf16 noise flips a near-tie with probability ~ score noise / score spacing at the threshold
    check_routing_chain(4, 256, 768, 8, 1.0f, false, 16000);
    check_routing_chain(16, 128, 256, 4, 1.0f, true, 16100);
    check_routing_chain(8, 512, 128, 64, 2.0f, false, 16200);
}

// small shapes for compute-sanitizer (scripts/device_check.sh: test_gpu -tc='sanitizer*'): selection
// (both groupings, ties), router forward and backward paths through the chain, gather / combine and
// the batched expert matmuls
TEST_CASE("sanitizer: MoE select, router, gather, combine, batched matmul on small shapes") {
    using namespace moe_test;
    matmul_setup();
    check_select(make_scores(3, 37, 4, 1.0f, false, Ties::at_threshold, 17000), 3, 37, 4, 1.0f, false);
    check_select(make_scores(3, 37, 6, 2.0f, true, Ties::levels, 17001), 3, 37, 6, 2.0f, true);
    check_routing_chain(2, 40, 72, 4, 1.0f, false, 17002);
    check_batched({3, 7, 37, 19}, true, 0, 0, 17003);
    check_batched({2, 33, 64, 48}, true, 1, 0, 17004);
}
