// Tests of the mixture-of-experts FFN (expert-choice routing, Zhou et al. 2022; llmc/ops/cpu/moe.h) and
// of MoE models (train_gpt.cu):
//  - moe_capacity arithmetic for both routing groups (ceil of the exact decimal quotient, capped at
//    the group size),
//  - moe_select against an independent brute force (rank counting) on random scores and on scores
//    with deliberate exact ties, including ties straddling the k-th place,
//  - router / gather / combine forwards against naive definitions (NaN-poisoned outputs),
//  - every backward, and a whole MoE layer composed from the ops exactly as gpt_backward composes
//    it, against central finite differences in double with the selection held fixed,
//  - matmul_forward_batched / matmul_backward_batched against per-batch matmul_forward/backward,
//  - bitwise independence of the OpenMP thread count,
//  - model level: MoE models overfit a batch, parameter table and weight decay, the training-log
//    routing statistics, the active parameter count, checkpoint resume and refusal of a
//    different expert configuration on resume.
#define LLMC_CPU
#define LLMC_NO_MAIN
#include "../train_gpt.cu"
#include "test_util.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <omp.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <type_traits>

namespace {

using std::vector;

// ------------------------------------------------------------------------------------------------
// helpers: test_util.h (the same conventions as test_ops.cpp; train_gpt.cu has its own Rng)

using TestRng = test_util::Rng;
using test_util::check_bitwise;
using test_util::check_close;
using test_util::dot;
using test_util::fd_check;
using test_util::fwd_rtol;
using test_util::nan_vec;
using test_util::rand_vec;
using test_util::same_across_thread_counts;
using test_util::sub;
using test_util::tname;
using test_util::to_d;

// ------------------------------------------------------------------------------------------------
// naive definitions, straight from the spec

// k per routing group, from the spec: batch min(n, ceil(n c / E)), position min(B, ceil(B c / E)) per t
// The spec of the capacity, computed independently of moe_group_capacity: c is the decimal the user
// typed, i.e. the shortest decimal that reads back as the float c ("1.2" for 1.2f), taken as the
// exact fraction p / 10^q; then k = min(m, ceil(m p / (E 10^q))) in integers.
int spec_group_k(int B, int T, int E, float c, bool by_pos) {
    const long long m = by_pos ? B : (long long)B * T;
    char text[64];
    for (int digits = 1; digits <= 9; digits++) {
        snprintf(text, sizeof(text), "%.*e", digits - 1, (double)c);
        if (std::strtof(text, nullptr) == c) break;
    }
    // text is "d.ddde[+-]xx": mantissa digits and a power of ten
    long long p = 0;
    int q = 0, exp10 = 0;
    const char* s = text;
    for (; *s && *s != 'e'; s++)
        if (*s >= '0' && *s <= '9') { p = p * 10 + (*s - '0'); q += (s > text + 1); }
    if (*s == 'e') exp10 = std::atoi(s + 1);
    q -= exp10;  // c = p * 10^-q
    long long num = m * p, den = (long long)E;
    for (; q > 0; q--) den *= 10;
    for (; q < 0; q++) num *= 10;
    const long long k = (num + den - 1) / den;
    return (int)std::min(m, k);
}

struct Routing {
    int cap = 0;
    vector<int> expert_tokens, token_slots;  // [E, cap], [n, E]
    int straddling_ties = 0;  // groups where the k-th and (k+1)-th candidates have the same score
};

// Brute force by rank counting: candidate i of a group is taken by expert e iff fewer than k
// candidates of the group beat it (higher score, or the same score and a lower token index).
template <class S>
Routing brute_select(const vector<S>& scores, int B, int T, int E, float c, bool by_pos) {
    const int n = B * T, k = spec_group_k(B, T, E, c, by_pos);
    Routing r;
    r.cap = by_pos ? T * k : k;
    r.token_slots.assign((size_t)n * E, -1);
    for (int e = 0; e < E; e++) {
        vector<int> taken;
        vector<vector<int>> groups;
        if (by_pos) {
            for (int t = 0; t < T; t++) {
                groups.emplace_back();
                for (int b = 0; b < B; b++) groups.back().push_back(b * T + t);
            }
        } else {
            groups.emplace_back(n);
            std::iota(groups.back().begin(), groups.back().end(), 0);
        }
        for (const vector<int>& g : groups) {
            vector<int> rank_of(g.size());
            for (size_t a = 0; a < g.size(); a++) {
                int rank = 0;
                const S sa = scores[(size_t)g[a] * E + e];
                for (size_t b = 0; b < g.size(); b++) {
                    const S sb = scores[(size_t)g[b] * E + e];
                    if (sb > sa || (sb == sa && g[b] < g[a])) rank++;
                }
                rank_of[a] = rank;
                if (rank < k) taken.push_back(g[a]);
            }
            // a tie across the boundary: the k-th and (k+1)-th best have equal scores
            if (k < (int)g.size()) {
                S kth = 0, next = 0;
                for (size_t a = 0; a < g.size(); a++) {
                    if (rank_of[a] == k - 1) kth = scores[(size_t)g[a] * E + e];
                    if (rank_of[a] == k) next = scores[(size_t)g[a] * E + e];
                }
                r.straddling_ties += kth == next;
            }
        }
        std::sort(taken.begin(), taken.end());
        REQUIRE(taken.size() == (size_t)r.cap);
        for (int j = 0; j < r.cap; j++) {
            r.expert_tokens.push_back(taken[j]);
            r.token_slots[(size_t)taken[j] * E + e] = j;
        }
    }
    return r;
}

// softmax over e of x_i . w_e, in double
vector<double> naive_router(const vector<double>& x, const vector<double>& w, int n, int C, int E) {
    vector<double> s((size_t)n * E);
    for (int i = 0; i < n; i++) {
        double mx = -INFINITY;
        for (int e = 0; e < E; e++) {
            double d = 0;
            for (int c = 0; c < C; c++) d += x[(size_t)i * C + c] * w[(size_t)e * C + c];
            s[(size_t)i * E + e] = d;
            mx = std::max(mx, d);
        }
        double z = 0;
        for (int e = 0; e < E; e++) z += std::exp(s[(size_t)i * E + e] - mx);
        for (int e = 0; e < E; e++) s[(size_t)i * E + e] = std::exp(s[(size_t)i * E + e] - mx) / z;
    }
    return s;
}

// out_i = sum over the experts e that took i of S[i, e] * FFN_e(x_i), FFN_e(x) = proj_e(silu(x W1_e^T + b1_e)
// * (x W3_e^T + b3_e)) + bproj_e; fc rows 0..He-1 of expert e are W1 (gate), rows He..2He-1 W3 (up)
vector<double> naive_moe(const vector<double>& x, const vector<double>& S, const Routing& rt, const vector<double>& fcw,
                         const vector<double>& fcb, const vector<double>& pw, const vector<double>& pb, int n, int C,
                         int E, int He) {
    vector<double> out((size_t)n * C, 0.0), h(He);
    for (int i = 0; i < n; i++)
        for (int e = 0; e < E; e++) {
            if (rt.token_slots[(size_t)i * E + e] < 0) continue;
            for (int j = 0; j < He; j++) {
                double a = fcb[(size_t)e * 2 * He + j], u = fcb[(size_t)e * 2 * He + He + j];
                for (int c = 0; c < C; c++) {
                    a += fcw[((size_t)e * 2 * He + j) * C + c] * x[(size_t)i * C + c];
                    u += fcw[((size_t)e * 2 * He + He + j) * C + c] * x[(size_t)i * C + c];
                }
                h[j] = a / (1.0 + std::exp(-a)) * u;
            }
            for (int c = 0; c < C; c++) {
                double y = pb[(size_t)e * C + c];
                for (int j = 0; j < He; j++) y += pw[((size_t)e * C + c) * He + j] * h[j];
                out[(size_t)i * C + c] += S[(size_t)i * E + e] * y;
            }
        }
    return out;
}

// scores with lots of exact ties: every value from a coarse grid
template <class S>
vector<S> grid_scores(TestRng& r, size_t n, const vector<double>& grid) {
    vector<S> s(n);
    for (auto& v : s) v = (S)grid[r.randint(0, (int)grid.size() - 1)];
    return s;
}

// softmax rows of random logits (continuous scores, no ties)
template <class S>
vector<S> softmax_scores(TestRng& r, int n, int E) {
    vector<double> logits = rand_vec<double>(r, (size_t)n * E, 0.0, 3.0);
    vector<S> s((size_t)n * E);
    for (int i = 0; i < n; i++) {
        double z = 0;
        for (int e = 0; e < E; e++) z += std::exp(logits[(size_t)i * E + e]);
        for (int e = 0; e < E; e++) s[(size_t)i * E + e] = (S)(std::exp(logits[(size_t)i * E + e]) / z);
    }
    return s;
}

std::string group_name(bool by_pos) { return by_pos ? "position" : "batch"; }

// Runs moe_select (on outputs poisoned with -7) and checks it against the brute force and the
// invariants of the two routing tables. Returns the brute-force routing.
template <class S>
Routing check_select(const std::string& what, const vector<S>& scores, int B, int T, int E, float c, bool by_pos) {
    const int n = B * T;
    const Routing ref = brute_select(scores, B, T, E, c, by_pos);
    const int cap = cpu::moe_capacity(B, T, E, c, by_pos);
    REQUIRE_MESSAGE(cap == ref.cap, what << ": moe_capacity " << cap << ", spec " << ref.cap);
    vector<int> et((size_t)E * cap, -7), ts((size_t)n * E, -7);
    cpu::moe_select(et.data(), ts.data(), scores.data(), B, T, E, c, by_pos);
    // expert_tokens equal to the brute force
    int first_bad = -1;
    for (size_t r = 0; r < et.size(); r++)
        if (et[r] != ref.expert_tokens[r]) { first_bad = (int)r; break; }
    CHECK_MESSAGE(first_bad < 0, what << ": moe_select expert_tokens differs from the brute force at expert "
                                      << first_bad / std::max(cap, 1) << ", slot " << first_bad % std::max(cap, 1)
                                      << ": got token " << (first_bad >= 0 ? et[first_bad] : 0) << ", expected "
                                      << (first_bad >= 0 ? ref.expert_tokens[first_bad] : 0));
    // ascending (strictly) inside each expert's list, all in range
    int unordered = 0, out_of_range = 0;
    for (int e = 0; e < E; e++)
        for (int j = 0; j < cap; j++) {
            const int i = et[(size_t)e * cap + j];
            out_of_range += i < 0 || i >= n;
            if (j > 0) unordered += !(et[(size_t)e * cap + j - 1] < i);
        }
    CHECK_MESSAGE(out_of_range == 0, what << ": moe_select expert_tokens: " << out_of_range << " entries outside [0, n)");
    CHECK_MESSAGE(unordered == 0, what << ": moe_select expert_tokens: " << unordered
                                       << " entries not in strictly ascending token order");
    // token_slots: slot j of token i in expert e iff expert_tokens[e][j] == i, -1 elsewhere
    int inconsistent = 0, bad_load = 0;
    for (int e = 0; e < E; e++) {
        int load = 0;
        for (int i = 0; i < n; i++) {
            const int j = ts[(size_t)i * E + e];
            if (j == -1) continue;
            load++;
            inconsistent += !(j >= 0 && j < cap && et[(size_t)e * cap + j] == i);
        }
        for (int j = 0; j < cap; j++) {
            const int i = et[(size_t)e * cap + j];
            if (i >= 0 && i < n) inconsistent += ts[(size_t)i * E + e] != j;
        }
        bad_load += load != cap;
    }
    CHECK_MESSAGE(inconsistent == 0, what << ": moe_select token_slots inconsistent with expert_tokens in "
                                          << inconsistent << " places");
    CHECK_MESSAGE(bad_load == 0, what << ": moe_select: " << bad_load << " experts do not take exactly capacity "
                                      << cap << " tokens");
    check_bitwise(what + ": moe_select token_slots vs brute force", ts, ref.token_slots);
    if (by_pos) {  // never across positions: exactly kp tokens of every position in every expert
        const int kp = cap / T;
        int bad = 0;
        for (int e = 0; e < E; e++) {
            vector<int> per_t(T, 0);
            for (int j = 0; j < cap; j++) {
                const int i = et[(size_t)e * cap + j];
                if (i >= 0 && i < n) per_t[i % T]++;
            }
            for (int t = 0; t < T; t++) bad += per_t[t] != kp;
        }
        CHECK_MESSAGE(bad == 0, what << ": moe_select (position): " << bad
                                     << " (expert, position) pairs without exactly kp = " << kp << " tokens");
    }
    return ref;
}

// ------------------------------------------------------------------------------------------------
// one MoE layer composed from the ops, the way gpt_forward / gpt_backward run an MoE layer

template <class F>
struct MoeLayer {
    int B = 0, T = 0, C = 0, E = 0, He = 0, n = 0, cap = 0;
    float cf = 1;
    bool by_pos = false;
    vector<F> x, rw, fcw, fcb, pw, pb;  // input [n, C] and parameters
    vector<int> et, ts;                 // routing [E, cap], [n, E]
    vector<F> scores, xe, fch, act, ye, out;

    MoeLayer() = default;
    MoeLayer(TestRng& r, int B_, int T_, int C_, int E_, int He_, float cf_, bool by_pos_)
        : B(B_), T(T_), C(C_), E(E_), He(He_), n(B_ * T_), cf(cf_), by_pos(by_pos_) {
        cap = cpu::moe_capacity(B, T, E, cf, by_pos);
        x = rand_vec<F>(r, (size_t)n * C);
        rw = rand_vec<F>(r, (size_t)E * C);
        fcw = rand_vec<F>(r, (size_t)E * 2 * He * C);
        fcb = rand_vec<F>(r, (size_t)E * 2 * He);
        pw = rand_vec<F>(r, (size_t)E * C * He);
        pb = rand_vec<F>(r, (size_t)E * C);
        et.assign((size_t)E * cap, -7);
        ts.assign((size_t)n * E, -7);
    }
    // the router, then the selection (once; later forwards keep it)
    void select() {
        scores = nan_vec<F>((size_t)n * E);
        cpu::moe_router_forward(scores.data(), x.data(), rw.data(), n, C, E);
        cpu::moe_select(et.data(), ts.data(), scores.data(), B, T, E, cf, by_pos);
    }
    // router -> (fixed selection) -> gather -> fc -> swiglu -> proj -> combine
    void forward() {
        scores = nan_vec<F>((size_t)n * E);
        xe = nan_vec<F>((size_t)E * cap * C);
        fch = nan_vec<F>((size_t)E * cap * 2 * He);
        act = nan_vec<F>((size_t)E * cap * He);
        ye = nan_vec<F>((size_t)E * cap * C);
        out = nan_vec<F>((size_t)n * C);
        cpu::moe_router_forward(scores.data(), x.data(), rw.data(), n, C, E);
        cpu::moe_gather(xe.data(), x.data(), et.data(), E, cap, C);
        cpu::matmul_forward_batched(fch.data(), xe.data(), fcw.data(), fcb.data(), E, cap, C, 2 * He);
        cpu::swiglu_forward(act.data(), fch.data(), E * cap, He);
        cpu::matmul_forward_batched(ye.data(), act.data(), pw.data(), pb.data(), E, cap, He, C);
        cpu::moe_combine_forward(out.data(), ye.data(), scores.data(), ts.data(), n, E, cap, C);
    }
    // gpt_backward's MoE branch: dx overwritten (buffer_zero, then gather_backward and router_backward
    // accumulate), parameter gradients accumulate. One buffer for d(expert output) then d(expert input).
    void backward(vector<F>& dx, vector<F>& drw, vector<F>& dfcw, vector<F>& dfcb, vector<F>& dpw, vector<F>& dpb,
                  const vector<F>& dout) {
        vector<F> d_expert_io = nan_vec<F>((size_t)E * cap * C), d_scores = nan_vec<F>((size_t)n * E);
        vector<F> d_act = nan_vec<F>((size_t)E * cap * He), d_fch = nan_vec<F>((size_t)E * cap * 2 * He);
        cpu::moe_combine_backward(d_expert_io.data(), d_scores.data(), dout.data(), ye.data(), scores.data(), et.data(),
                                  ts.data(), n, E, cap, C);
        cpu::matmul_backward_batched(d_act.data(), dpw.data(), dpb.data(), d_expert_io.data(), act.data(), pw.data(), E,
                                     cap, He, C);
        cpu::swiglu_backward(d_fch.data(), d_act.data(), fch.data(), E * cap, He);
        cpu::matmul_backward_batched(d_expert_io.data(), dfcw.data(), dfcb.data(), d_fch.data(), xe.data(), fcw.data(),
                                     E, cap, C, 2 * He);
        dx.assign((size_t)n * C, F(0));
        cpu::moe_gather_backward(dx.data(), d_expert_io.data(), ts.data(), n, E, cap, C);
        cpu::moe_router_backward(dx.data(), drw.data(), d_scores.data(), scores.data(), x.data(), rw.data(), n, C, E);
    }
};

// A routing shape (B x T tokens of C channels, E experts, capacity factor c, grouped by position or
// by micro-batch) and the expert choice of random softmax scores on it: what the op tests route with.
struct RouteCase {
    int B, T, C, E;
    float c;
    bool by_pos;
};
std::ostream& operator<<(std::ostream& os, const RouteCase& cs) {
    return os << "B " << cs.B << ", T " << cs.T << ", C " << cs.C << ", E " << cs.E << ", c " << cs.c << ", "
              << group_name(cs.by_pos);
}
template <class S>
struct Routed {
    int n, cap;
    vector<S> scores;    // [n, E]
    vector<int> et, ts;  // moe_select's expert_tokens [E, cap], token_slots [n, E]
};
template <class S>
Routed<S> route_random(TestRng& r, const RouteCase& cs) {
    Routed<S> rt;
    rt.n = cs.B * cs.T;
    rt.cap = cpu::moe_capacity(cs.B, cs.T, cs.E, cs.c, cs.by_pos);
    rt.scores = softmax_scores<S>(r, rt.n, cs.E);
    rt.et.resize((size_t)cs.E * rt.cap);
    rt.ts.resize((size_t)rt.n * cs.E);
    cpu::moe_select(rt.et.data(), rt.ts.data(), rt.scores.data(), cs.B, cs.T, cs.E, cs.c, cs.by_pos);
    return rt;
}

struct SelCase {
    int B, T, E;
    float c;
};
// incl. E = 1 (one expert: k = n c), c so large that k caps at the group (every expert takes
// every token), B = 1 (position groups of one token), and ceil not floor
const SelCase sel_cases[] = {{2, 8, 4, 1.0f},  {3, 5, 4, 1.5f}, {4, 6, 1, 1.0f},  {4, 6, 1, 0.3f},
                             {2, 7, 3, 2.0f},  {4, 4, 4, 100},  {5, 3, 8, 0.5f},  {1, 10, 2, 1.0f},
                             {23, 2, 4, 1.5f}, {8, 16, 6, 1.25f}, {4, 32, 4, 2.0f}, {3, 4, 5, 5.0f}};

}  // namespace

// ------------------------------------------------------------------------------------------------
// capacity and selection

TEST_CASE("moe_capacity: ceil of n c / E with c the typed decimal, capped at the group size, both groupings") {
    struct Case {
        int B, T, E;
        float c;
        int batch, position;
    };
    const Case cases[] = {
        {23, 2, 4, 1.5f, 18, 18},     // 46 * 1.5 / 4 = 17.25 -> 18 (ceil, not floor); per position 8.625 -> 9, 2 * 9
        {2, 8, 4, 1.0f, 4, 8},        // 16 / 4 = 4 exactly; per position ceil(0.5) = 1, 8 * 1
        {2, 8, 4, 2.0f, 8, 8},        // per position 1 exactly
        {4, 32, 4, 2.0f, 64, 64},     // the model tests' shape
        {4, 32, 4, 1.5f, 48, 64},     // position: ceil(1.5) = 2 per position
        {4, 6, 1, 1.0f, 24, 24},      // one expert, c = 1: every token
        {4, 6, 1, 2.0f, 24, 24},      // capped at n = 24 and at B = 4 per position
        {4, 4, 4, 100.0f, 16, 16},    // capped
        {5, 3, 8, 0.5f, 1, 3},        // 15 * 0.5 / 8 = 0.9375 -> 1; position ceil(0.3125) = 1, 3 * 1
        {3, 4, 5, 5.0f, 12, 12},      // exactly n and B
        {1, 10, 2, 1.0f, 5, 10},      // B = 1: a position group holds one token
        // c is read as the typed decimal, not as the float's binary value (which is a little more or
        // less): exact quotients must not round up to the next integer
        {10, 1, 11, 1.1f, 1, 1},      // 1.1f = 1.100000024: 10 * 1.1 / 11 = 1 exactly, not 2
        {5, 64, 4, 1.2f, 96, 128},    // 320 * 1.2 / 4 = 96 exactly (the float gives 96.0000038: not 97)
        {10, 1, 4, 1.2f, 3, 3},       // per position 10 * 1.2 / 4 = 3 exactly, not 4
        {10, 7, 4, 1.2f, 21, 21},     // 70 * 1.2 / 4 = 21; per position 3, 7 * 3
        {10, 3, 7, 0.7f, 3, 3},       // 0.7f = 0.699999988 (below): 30 * 0.7 / 7 = 3; per position 1
        {6, 5, 3, 0.1f, 1, 5},        // 0.1f: 30 * 0.1 / 3 = 1; per position 6 * 0.1 / 3 = 0.2 -> 1, 5 * 1
        {25, 4, 8, 1.3f, 17, 20},     // 100 * 1.3 / 8 = 16.25 -> 17 (real fractions still round up); 4.0625 -> 5
        {1000, 1000, 3, 1.5f, 500000, 500000},  // large n: exact 500000
        {3, 7, 2, 1.0f, 11, 14},      // 21 / 2 = 10.5 -> 11; per position 1.5 -> 2
    };
    for (const Case& cs : cases) {
        CAPTURE(cs.B);
        CAPTURE(cs.T);
        CAPTURE(cs.E);
        CAPTURE(cs.c);
        CHECK_MESSAGE(cpu::moe_capacity(cs.B, cs.T, cs.E, cs.c, false) == cs.batch, "moe_capacity (batch)");
        CHECK_MESSAGE(cpu::moe_capacity(cs.B, cs.T, cs.E, cs.c, true) == cs.position, "moe_capacity (position)");
        CHECK(cs.batch == spec_group_k(cs.B, cs.T, cs.E, cs.c, false));
        CHECK(cs.position == cs.T * spec_group_k(cs.B, cs.T, cs.E, cs.c, true));
    }
    // the model's config forwards to it with its own fields
    GPTConfig c;
    c.n_expert = 4;
    c.capacity_factor = 1.5f;
    c.moe_group = MOE_GROUP_BATCH;
    CHECK(c.moe_capacity(23, 2) == 18);
    CHECK(c.moe_capacity(4, 32) == 48);
    c.moe_group = MOE_GROUP_POSITION;
    CHECK(c.moe_capacity(4, 32) == 64);
}

TEST_CASE_TEMPLATE("moe_select: vs brute force on random and tied scores, both groupings", S, float, double) {
    TestRng r(11);
    int straddling = 0, all_taken_cases = 0;
    for (const SelCase& cs : sel_cases)
        for (int by_pos = 0; by_pos < 2; by_pos++)
            for (int kind = 0; kind < 4; kind++) {
                const int n = cs.B * cs.T;
                vector<S> scores;
                const char* kind_name = "";
                switch (kind) {
                    case 0: scores = softmax_scores<S>(r, n, cs.E), kind_name = "softmax rows"; break;
                    case 1: scores = grid_scores<S>(r, (size_t)n * cs.E, {0.1, 0.2, 0.3}), kind_name = "grid {.1,.2,.3}"; break;
                    case 2: scores = grid_scores<S>(r, (size_t)n * cs.E, {0.25, 0.5}), kind_name = "grid {.25,.5}"; break;
                    default: scores.assign((size_t)n * cs.E, (S)0.25), kind_name = "all equal"; break;
                }
                std::ostringstream what;
                what << "moe_select<" << tname<S>() << "> B=" << cs.B << " T=" << cs.T << " E=" << cs.E << " c=" << cs.c
                     << " group=" << group_name(by_pos) << " scores=" << kind_name;
                Routing ref = check_select(what.str(), scores, cs.B, cs.T, cs.E, cs.c, by_pos != 0);
                straddling += ref.straddling_ties;
                if (ref.cap == n) all_taken_cases++;
                if (kind == 3) {  // all equal: the lowest token indices of each group win
                    const int k = spec_group_k(cs.B, cs.T, cs.E, cs.c, by_pos != 0);
                    for (int e = 0; e < cs.E; e++) {
                        vector<int> expect;
                        if (by_pos) {
                            for (int b = 0; b < k; b++)
                                for (int t = 0; t < cs.T; t++) expect.push_back(b * cs.T + t);
                            std::sort(expect.begin(), expect.end());
                        } else {
                            for (int i = 0; i < k; i++) expect.push_back(i);
                        }
                        vector<int> got(ref.expert_tokens.begin() + (size_t)e * ref.cap,
                                        ref.expert_tokens.begin() + (size_t)(e + 1) * ref.cap);
                        CHECK_MESSAGE(got == expect, what.str() << ": brute force itself: expert " << e
                                                                << " should take the lowest indices");
                    }
                }
            }
    // the cases did exercise ties at the k-th place and experts that take every token
    CHECK(straddling > 50);
    CHECK(all_taken_cases >= 4);
}

TEST_CASE("moe_select: hand-worked cases with ties at the k-th place") {
    // batch: n = 8, E = 2, c = 1 -> k = 4
    //   expert 0 scores by token: .3 .2 .2 .1 .2 .3 .2 .1 -> 0, 5 (.3), then the .2s 1, 2 (lower indices
    //   win over 4, 6) -> {0, 1, 2, 5}; expert 1: all .5 -> {0, 1, 2, 3}
    {
        const float s0[8] = {.3f, .2f, .2f, .1f, .2f, .3f, .2f, .1f};
        vector<float> scores(16);
        for (int i = 0; i < 8; i++) scores[i * 2] = s0[i], scores[i * 2 + 1] = .5f;
        vector<int> et(8, -7), ts(16, -7);
        cpu::moe_select(et.data(), ts.data(), scores.data(), 2, 4, 2, 1.0f, false);
        CHECK(et == vector<int>({0, 1, 2, 5, 0, 1, 2, 3}));
        CHECK(ts == vector<int>({0, 0, 1, 1, 2, 2, -1, 3, -1, -1, 3, -1, -1, -1, -1, -1}));
    }
    // position: B = 4, T = 2, E = 2, c = 1 -> kp = 2, capacity 4; position 0 holds tokens 0 2 4 6,
    // position 1 tokens 1 3 5 7
    //   expert 0: t=0 scores .2 .3 .2 .2 -> 2, then 0 (over 4, 6); t=1 .1 .1 .3 .1 -> 5, then 1 -> {0, 1, 2, 5}
    //   expert 1: .7 everywhere except token 6 (.9) -> t=0: 6, 0; t=1: 1, 3 -> {0, 1, 3, 6}
    {
        const float s0[8] = {.2f, .1f, .3f, .1f, .2f, .3f, .2f, .1f};
        vector<float> scores(16);
        for (int i = 0; i < 8; i++) scores[i * 2] = s0[i], scores[i * 2 + 1] = i == 6 ? .9f : .7f;
        vector<int> et(8, -7), ts(16, -7);
        cpu::moe_select(et.data(), ts.data(), scores.data(), 4, 2, 2, 1.0f, true);
        CHECK(et == vector<int>({0, 1, 2, 5, 0, 1, 3, 6}));
        CHECK(ts == vector<int>({0, 0, 1, 1, 2, -1, -1, 2, -1, -1, 3, -1, -1, 3, -1, -1}));
    }
}

// ------------------------------------------------------------------------------------------------
// forwards

TEST_CASE_TEMPLATE("moe_router_forward: softmax of x . router_w^T vs naive, rows sum to 1", T, float, double) {
    struct Case {
        int n, C, E;
        double hi;  // magnitude of x and w: 4 gives logits of a few hundred (max subtraction needed)
    };
    const Case cases[] = {{12, 5, 4, 1}, {33, 17, 1, 1}, {64, 32, 8, 1}, {7, 3, 16, 1}, {9, 16, 4, 4}};
    TestRng r(12);
    for (const Case& cs : cases) {
        CAPTURE(cs.n);
        CAPTURE(cs.C);
        CAPTURE(cs.E);
        CAPTURE(cs.hi);
        auto x = rand_vec<T>(r, (size_t)cs.n * cs.C, 0.1, cs.hi), w = rand_vec<T>(r, (size_t)cs.E * cs.C, 0.1, cs.hi);
        auto s = nan_vec<T>((size_t)cs.n * cs.E);
        cpu::moe_router_forward(s.data(), x.data(), w.data(), cs.n, cs.C, cs.E);
        const auto ref = naive_router(to_d(x), to_d(w), cs.n, cs.C, cs.E);
        const std::string op = std::string("moe_router_forward<") + tname<T>() + "> scores";
        // large logits: float rounding of the logit (~|logit| 6e-8) moves the softmax by as much
        const double tol = cs.hi > 1 ? (std::is_same<T, float>::value ? 1e-3 : 1e-10) : fwd_rtol<T>();
        check_close(op, s, ref, tol, 1.0);
        vector<double> row_sum(cs.n, 0.0), ones(cs.n, 1.0);
        for (int i = 0; i < cs.n; i++)
            for (int e = 0; e < cs.E; e++) row_sum[i] += (double)s[(size_t)i * cs.E + e];
        check_close(op + " row sums", row_sum, ones, std::is_same<T, float>::value ? 1e-6 : 1e-14, 0.0);
        if (cs.E == 1) check_bitwise(op + " (one expert: exactly 1)", s, vector<T>(cs.n, T(1)));
    }
    // logits of about +-900 (exp overflows even in double): the max must be subtracted
    {
        const int n = 6, C = 16, E = 4;
        vector<T> x((size_t)n * C), w((size_t)E * C);
        for (auto& v : x) v = (T)r.uni(5, 10);
        for (int e = 0; e < E; e++)
            for (int c = 0; c < C; c++) w[(size_t)e * C + c] = (T)((e % 2 ? -1 : 1) * r.uni(5, 10));
        auto s = nan_vec<T>((size_t)n * E);
        cpu::moe_router_forward(s.data(), x.data(), w.data(), n, C, E);
        check_close(std::string("moe_router_forward<") + tname<T>() + "> scores, logits ~ +-900", s,
                    naive_router(to_d(x), to_d(w), n, C, E), std::is_same<T, float>::value ? 1e-3 : 1e-10, 1.0);
    }
}

TEST_CASE_TEMPLATE("moe_gather / moe_combine_forward: vs naive; untaken tokens give 0, gates are S[i, e]", F, float,
                   double) {
    const RouteCase cases[] = {{2, 8, 5, 4, 0.5f, false}, {3, 6, 7, 3, 2.0f, false}, {4, 5, 6, 4, 0.5f, true},
                               {4, 5, 3, 2, 1.5f, true},  {2, 4, 4, 1, 0.5f, false}, {3, 3, 5, 3, 100, false}};
    TestRng r(13);
    int untaken_total = 0, multi_total = 0;
    for (const RouteCase& cs : cases) {
        CAPTURE(cs);
        const auto [n, cap, scores, et, ts] = route_random<F>(r, cs);
        const int C = cs.C, E = cs.E;
        const Routing rt = brute_select(scores, cs.B, cs.T, E, cs.c, cs.by_pos);
        REQUIRE(et == rt.expert_tokens);  // (moe_select is tested above)
        const std::string tn = tname<F>();

        // gather: row r of xe is row expert_tokens[r] of x, exactly
        auto x = rand_vec<F>(r, (size_t)n * C);
        auto xe = nan_vec<F>((size_t)E * cap * C);
        cpu::moe_gather(xe.data(), x.data(), et.data(), E, cap, C);
        vector<F> xe_ref;
        for (int row : rt.expert_tokens) xe_ref.insert(xe_ref.end(), x.begin() + (size_t)row * C, x.begin() + (size_t)(row + 1) * C);
        check_bitwise("moe_gather<" + tn + "> xe", xe, xe_ref);

        // combine: out_i = sum over the experts that took i of S[i, e] ye[e, slot]
        auto ye = rand_vec<F>(r, (size_t)E * cap * C);
        auto out = nan_vec<F>((size_t)n * C);
        cpu::moe_combine_forward(out.data(), ye.data(), scores.data(), ts.data(), n, E, cap, C);
        vector<double> ref((size_t)n * C, 0.0);
        int untaken = 0, multi = 0;
        for (int i = 0; i < n; i++) {
            int taken = 0;
            for (int e = 0; e < E; e++) {
                const int j = rt.token_slots[(size_t)i * E + e];
                if (j < 0) continue;
                taken++;
                for (int c = 0; c < C; c++)
                    ref[(size_t)i * C + c] += (double)scores[(size_t)i * E + e] * (double)ye[((size_t)e * cap + j) * C + c];
            }
            untaken += taken == 0;
            multi += taken > 1;
            if (taken == 0) {
                vector<F> row(out.begin() + (size_t)i * C, out.begin() + (size_t)(i + 1) * C);
                check_bitwise("moe_combine_forward<" + tn + "> out of untaken token " + std::to_string(i), row,
                              vector<F>(C, F(0)));
            }
        }
        untaken_total += untaken;
        multi_total += multi;
        check_close("moe_combine_forward<" + tn + "> out", out, ref, fwd_rtol<F>());

        // gates: with every expert output row all ones, out_i[c] = sum of S[i, e] over the experts that took i
        vector<F> ones((size_t)E * cap * C, F(1));
        out = nan_vec<F>((size_t)n * C);
        cpu::moe_combine_forward(out.data(), ones.data(), scores.data(), ts.data(), n, E, cap, C);
        vector<double> gate_sum((size_t)n * C, 0.0);
        for (int i = 0; i < n; i++)
            for (int e = 0; e < E; e++)
                if (rt.token_slots[(size_t)i * E + e] >= 0)
                    for (int c = 0; c < C; c++) gate_sum[(size_t)i * C + c] += (double)scores[(size_t)i * E + e];
        check_close("moe_combine_forward<" + tn + "> gates (expert outputs all 1)", out, gate_sum, fwd_rtol<F>());
    }
    CHECK(untaken_total > 0);  // the cases do have tokens no expert took
    CHECK(multi_total > 0);    // and tokens several experts took
}

TEST_CASE_TEMPLATE("MoE layer forward (router, select, gather, experts, combine) vs the naive definition", F, float,
                   double) {
    struct Case {
        int B, T, C, E, He;
        float c;
        bool by_pos;
    };
    const Case cases[] = {{2, 6, 5, 3, 4, 1.5f, false}, {3, 4, 6, 4, 3, 2.0f, true}, {4, 8, 8, 4, 6, 1.0f, false},
                          {4, 3, 4, 2, 5, 0.5f, true},  {2, 5, 3, 1, 4, 0.7f, false}};
    TestRng r(14);
    for (const Case& cs : cases) {
        CAPTURE(cs.B);
        CAPTURE(cs.T);
        CAPTURE(cs.E);
        CAPTURE(cs.c);
        CAPTURE(cs.by_pos);
        MoeLayer<F> L(r, cs.B, cs.T, cs.C, cs.E, cs.He, cs.c, cs.by_pos);
        L.select();
        L.forward();
        // the routing of the op's own scores (so that a near tie cannot flip between float and double)
        const Routing rt = brute_select(L.scores, cs.B, cs.T, cs.E, cs.c, cs.by_pos);
        REQUIRE(L.et == rt.expert_tokens);
        const auto S = naive_router(to_d(L.x), to_d(L.rw), L.n, cs.C, cs.E);
        const auto ref = naive_moe(to_d(L.x), S, rt, to_d(L.fcw), to_d(L.fcb), to_d(L.pw), to_d(L.pb), L.n, cs.C,
                                   cs.E, cs.He);
        check_close(std::string("MoE layer<") + tname<F>() + "> out", L.out, ref, 10 * fwd_rtol<F>());
    }
}

// ------------------------------------------------------------------------------------------------
// backwards vs finite differences (double), the selection held fixed

TEST_CASE("moe_combine_backward: dye and dscores vs finite differences (double), both overwritten") {
    const RouteCase cases[] = {{2, 6, 5, 3, 1.5f, false}, {4, 3, 4, 4, 1.0f, true}, {3, 4, 3, 2, 0.5f, false}};
    TestRng r(21);
    for (const RouteCase& cs : cases) {
        CAPTURE(cs);
        Routed<double> rt = route_random<double>(r, cs);  // (the loss lambda captures the tables)
        const int n = rt.n, cap = rt.cap, C = cs.C, E = cs.E;
        auto& scores = rt.scores;
        const vector<int> &et = rt.et, &ts = rt.ts;
        auto ye = rand_vec<double>(r, (size_t)E * cap * C), R = rand_vec<double>(r, (size_t)n * C);
        auto loss = [&] {
            vector<double> out((size_t)n * C);
            cpu::moe_combine_forward(out.data(), ye.data(), scores.data(), ts.data(), n, E, cap, C);
            return dot(out, R);
        };
        auto dye = nan_vec<double>((size_t)E * cap * C), ds = nan_vec<double>((size_t)n * E);
        cpu::moe_combine_backward(dye.data(), ds.data(), R.data(), ye.data(), scores.data(), et.data(), ts.data(), n, E,
                                  cap, C);
        fd_check("moe_combine_backward<double> dye", ye, dye, loss);
        fd_check("moe_combine_backward<double> dscores", scores, ds, loss);
        int nonzero_untaken = 0;
        for (size_t k = 0; k < ds.size(); k++) nonzero_untaken += ts[k] < 0 && ds[k] != 0.0;
        CHECK_MESSAGE(nonzero_untaken == 0, "moe_combine_backward<double> dscores: " << nonzero_untaken
                                                                                     << " untaken (token, expert) pairs not exactly 0");
    }
}

TEST_CASE("moe_gather_backward: dx accumulates, vs finite differences (double)") {
    const RouteCase cases[] = {{2, 6, 5, 3, 1.5f, false}, {4, 3, 4, 4, 2.0f, true}, {3, 4, 3, 2, 0.5f, false}};
    TestRng r(22);
    for (const RouteCase& cs : cases) {
        CAPTURE(cs);
        const Routed<double> rt = route_random<double>(r, cs);
        const int n = rt.n, cap = rt.cap, C = cs.C, E = cs.E;
        const vector<int> &et = rt.et, &ts = rt.ts;
        auto x = rand_vec<double>(r, (size_t)n * C), R = rand_vec<double>(r, (size_t)E * cap * C);
        auto loss = [&] {
            vector<double> xe((size_t)E * cap * C);
            cpu::moe_gather(xe.data(), x.data(), et.data(), E, cap, C);
            return dot(xe, R);
        };
        const auto prefill = rand_vec<double>(r, (size_t)n * C);
        auto dx = prefill;
        cpu::moe_gather_backward(dx.data(), R.data(), ts.data(), n, E, cap, C);
        fd_check("moe_gather_backward<double> dx (minus prefill)", x, sub(dx, prefill), loss);
    }
}

TEST_CASE("moe_router_backward: dx and drouter_w accumulate, vs finite differences (double)") {
    struct Case {
        int n, C, E;
    };
    const Case cases[] = {{12, 5, 4}, {7, 3, 1}, {9, 6, 8}, {5, 16, 2}};
    TestRng r(23);
    for (const Case& cs : cases) {
        CAPTURE(cs.n);
        CAPTURE(cs.C);
        CAPTURE(cs.E);
        auto x = rand_vec<double>(r, (size_t)cs.n * cs.C), w = rand_vec<double>(r, (size_t)cs.E * cs.C),
             R = rand_vec<double>(r, (size_t)cs.n * cs.E);
        vector<double> s((size_t)cs.n * cs.E);
        auto loss = [&] {
            cpu::moe_router_forward(s.data(), x.data(), w.data(), cs.n, cs.C, cs.E);
            return dot(s, R);
        };
        loss();
        const auto px = rand_vec<double>(r, x.size()), pw = rand_vec<double>(r, w.size());
        auto dx = px, dw = pw;
        cpu::moe_router_backward(dx.data(), dw.data(), R.data(), s.data(), x.data(), w.data(), cs.n, cs.C, cs.E);
        fd_check("moe_router_backward<double> dx (minus prefill)", x, sub(dx, px), loss);
        fd_check("moe_router_backward<double> drouter_w (minus prefill)", w, sub(dw, pw), loss);
        if (cs.E == 1) {  // the softmax of one logit is constant: no gradient at all
            check_bitwise("moe_router_backward<double> dx with one expert (prefill unchanged)", dx, px);
            check_bitwise("moe_router_backward<double> drouter_w with one expert (prefill unchanged)", dw, pw);
        }
    }
}

TEST_CASE("MoE layer backward composed as in gpt_backward vs finite differences (double), selection fixed") {
    struct Case {
        int B, T, C, E, He;
        float c;
        bool by_pos;
    };
    const Case cases[] = {{2, 6, 5, 3, 4, 1.5f, false}, {3, 4, 6, 4, 3, 2.0f, true}, {4, 3, 4, 2, 5, 0.5f, true},
                          {2, 5, 3, 1, 4, 0.7f, false}, {2, 4, 4, 4, 2, 100, false}};
    TestRng r(24);
    for (const Case& cs : cases) {
        CAPTURE(cs.B);
        CAPTURE(cs.T);
        CAPTURE(cs.C);
        CAPTURE(cs.E);
        CAPTURE(cs.He);
        CAPTURE(cs.c);
        CAPTURE(cs.by_pos);
        MoeLayer<double> L(r, cs.B, cs.T, cs.C, cs.E, cs.He, cs.c, cs.by_pos);
        L.select();  // once: later forwards reuse expert_tokens / token_slots
        L.forward();
        const auto R = rand_vec<double>(r, L.out.size());
        auto loss = [&] {
            L.forward();
            return dot(L.out, R);
        };
        // parameter gradients accumulate: prefilled
        const auto p_rw = rand_vec<double>(r, L.rw.size()), p_fcw = rand_vec<double>(r, L.fcw.size()),
                   p_fcb = rand_vec<double>(r, L.fcb.size()), p_pw = rand_vec<double>(r, L.pw.size()),
                   p_pb = rand_vec<double>(r, L.pb.size());
        auto drw = p_rw, dfcw = p_fcw, dfcb = p_fcb, dpw = p_pw, dpb = p_pb;
        vector<double> dx;
        L.forward();
        L.backward(dx, drw, dfcw, dfcb, dpw, dpb, R);
        fd_check("MoE layer dx", L.x, dx, loss);
        fd_check("MoE layer drouter_w (minus prefill)", L.rw, sub(drw, p_rw), loss);
        fd_check("MoE layer d fc.w (minus prefill)", L.fcw, sub(dfcw, p_fcw), loss);
        fd_check("MoE layer d fc.b (minus prefill)", L.fcb, sub(dfcb, p_fcb), loss);
        fd_check("MoE layer d proj.w (minus prefill)", L.pw, sub(dpw, p_pw), loss);
        fd_check("MoE layer d proj.b (minus prefill)", L.pb, sub(dpb, p_pb), loss);
    }
}

TEST_CASE_TEMPLATE("matmul_forward_batched / matmul_backward_batched: equal to per-batch matmul_forward/backward", T,
                   float, double) {
    struct Case {
        int nb, BT, C, OC;
    };
    const Case cases[] = {{3, 7, 5, 19}, {2, 20, 33, 17}, {1, 6, 16, 16}, {4, 13, 37, 8}, {5, 1, 3, 2}};
    TestRng r(25);
    const std::string tn = tname<T>();
    for (const Case& cs : cases)
        for (int with_bias = 0; with_bias < 2; with_bias++) {
            CAPTURE(cs.nb);
            CAPTURE(cs.BT);
            CAPTURE(cs.C);
            CAPTURE(cs.OC);
            CAPTURE(with_bias);
            const size_t in_n = (size_t)cs.BT * cs.C, out_n = (size_t)cs.BT * cs.OC, w_n = (size_t)cs.OC * cs.C;
            auto x = rand_vec<T>(r, cs.nb * in_n), W = rand_vec<T>(r, cs.nb * w_n), b = rand_vec<T>(r, (size_t)cs.nb * cs.OC);
            const T* bias = with_bias ? b.data() : nullptr;
            auto out = nan_vec<T>(cs.nb * out_n), out_ref = nan_vec<T>(cs.nb * out_n);
            cpu::matmul_forward_batched(out.data(), x.data(), W.data(), bias, cs.nb, cs.BT, cs.C, cs.OC);
            for (int k = 0; k < cs.nb; k++)
                cpu::matmul_forward(out_ref.data() + k * out_n, x.data() + k * in_n, W.data() + k * w_n,
                                    with_bias ? b.data() + (size_t)k * cs.OC : nullptr, cs.BT, cs.C, cs.OC);
            check_bitwise("matmul_forward_batched<" + tn + "> out", out, out_ref);
            // and against the naive product
            vector<double> naive(cs.nb * out_n);
            for (int k = 0; k < cs.nb; k++)
                for (int i = 0; i < cs.BT; i++)
                    for (int o = 0; o < cs.OC; o++) {
                        double s = with_bias ? (double)b[(size_t)k * cs.OC + o] : 0.0;
                        for (int c = 0; c < cs.C; c++)
                            s += (double)x[k * in_n + (size_t)i * cs.C + c] * (double)W[k * w_n + (size_t)o * cs.C + c];
                        naive[k * out_n + (size_t)i * cs.OC + o] = s;
                    }
            check_close("matmul_forward_batched<" + tn + "> out vs naive", out, naive, fwd_rtol<T>());

            auto dout = rand_vec<T>(r, cs.nb * out_n);
            const auto dW0 = rand_vec<T>(r, cs.nb * w_n), db0 = rand_vec<T>(r, (size_t)cs.nb * cs.OC);
            auto dx = nan_vec<T>(cs.nb * in_n), dx_ref = nan_vec<T>(cs.nb * in_n);
            auto dW = dW0, dW_ref = dW0, db = db0, db_ref = db0;
            cpu::matmul_backward_batched(dx.data(), dW.data(), with_bias ? db.data() : nullptr, dout.data(), x.data(),
                                         W.data(), cs.nb, cs.BT, cs.C, cs.OC);
            for (int k = 0; k < cs.nb; k++)
                cpu::matmul_backward(dx_ref.data() + k * in_n, dW_ref.data() + k * w_n,
                                     with_bias ? db_ref.data() + (size_t)k * cs.OC : nullptr, dout.data() + k * out_n,
                                     x.data() + k * in_n, W.data() + k * w_n, cs.BT, cs.C, cs.OC);
            check_bitwise("matmul_backward_batched<" + tn + "> dinp", dx, dx_ref);
            check_bitwise("matmul_backward_batched<" + tn + "> dweight (accumulated)", dW, dW_ref);
            check_bitwise("matmul_backward_batched<" + tn + "> dbias (accumulated)", db, db_ref);
            if (!with_bias) check_bitwise("matmul_backward_batched<" + tn + "> dbias untouched when null", db, db0);
        }
}

// ------------------------------------------------------------------------------------------------
// determinism

TEST_CASE("MoE ops: bitwise identical results with 1, 2 and 3 OpenMP threads") {
    const int B = 4, T = 64, C = 48, E = 8, n = B * T;
    TestRng r(31);
    const auto x = rand_vec<float>(r, (size_t)n * C), w = rand_vec<float>(r, (size_t)E * C);
    const auto tied = grid_scores<float>(r, (size_t)n * E, {0.1, 0.2, 0.3});
    vector<float> scores((size_t)n * E);
    cpu::moe_router_forward(scores.data(), x.data(), w.data(), n, C, E);
    same_across_thread_counts<float>("moe_router_forward", [&] {
        vector<float> s = nan_vec<float>((size_t)n * E);
        cpu::moe_router_forward(s.data(), x.data(), w.data(), n, C, E);
        return vector<vector<float>>{s};
    });
    for (int by_pos = 0; by_pos < 2; by_pos++) {
        CAPTURE(by_pos);
        const float cf = 1.5f;
        const int cap = cpu::moe_capacity(B, T, E, cf, by_pos);
        for (const vector<float>* sc : {(const vector<float>*)&scores, &tied})
            same_across_thread_counts<int>("moe_select (" + group_name(by_pos) + ")", [&] {
                vector<int> et((size_t)E * cap, -7), ts((size_t)n * E, -7);
                cpu::moe_select(et.data(), ts.data(), sc->data(), B, T, E, cf, by_pos);
                return vector<vector<int>>{et, ts};
            });
        vector<int> et((size_t)E * cap), ts((size_t)n * E);
        cpu::moe_select(et.data(), ts.data(), scores.data(), B, T, E, cf, by_pos);
        const auto ye = rand_vec<float>(r, (size_t)E * cap * C), dout = rand_vec<float>(r, (size_t)n * C);
        const auto dxe = rand_vec<float>(r, (size_t)E * cap * C), prefill = rand_vec<float>(r, (size_t)n * C);
        const auto ds = rand_vec<float>(r, (size_t)n * E), pw = rand_vec<float>(r, (size_t)E * C);
        same_across_thread_counts<float>("moe_gather_backward", [&] {
            auto dx = prefill;
            cpu::moe_gather_backward(dx.data(), dxe.data(), ts.data(), n, E, cap, C);
            return vector<vector<float>>{dx};
        });
        same_across_thread_counts<float>("moe_combine_forward", [&] {
            auto out = nan_vec<float>((size_t)n * C);
            cpu::moe_combine_forward(out.data(), ye.data(), scores.data(), ts.data(), n, E, cap, C);
            return vector<vector<float>>{out};
        });
        same_across_thread_counts<float>("moe_combine_backward", [&] {
            auto dye = nan_vec<float>((size_t)E * cap * C), dsc = nan_vec<float>((size_t)n * E);
            cpu::moe_combine_backward(dye.data(), dsc.data(), dout.data(), ye.data(), scores.data(), et.data(),
                                      ts.data(), n, E, cap, C);
            return vector<vector<float>>{dye, dsc};
        });
        same_across_thread_counts<float>("moe_router_backward", [&] {
            auto dx = prefill, dw = pw;
            cpu::moe_router_backward(dx.data(), dw.data(), ds.data(), scores.data(), x.data(), w.data(), n, C, E);
            return vector<vector<float>>{dx, dw};
        });
    }
}

// ------------------------------------------------------------------------------------------------
// model level (train_gpt.cu)

namespace {

GPTConfig moe_model_config(int n_expert, int moe_every, int group, float cf = 2.0f, int expert_hidden = 0,
                           int n_layer = 2) {
    GPTConfig c;
    c.vocab_size = 257;
    c.n_layer = n_layer;
    c.n_embd = 32;
    c.n_head = 4;
    c.n_kv_head = 2;
    c.max_seq_len = 64;
    c.mlp = MLP_SWIGLU;
    c.pos = POS_ALIBI;
    c.n_expert = n_expert;
    c.moe_every = moe_every;
    c.moe_group = group;
    c.capacity_factor = cf;
    c.expert_hidden = expert_hidden;
    c.finalize();
    return c;
}

// shards, temp dirs, running the trainer: test_util.h (as test_model.cpp)
using test_util::read_file;
using test_util::run_train;
using test_util::synthetic_tokens;
using test_util::write_shard;

// one fixed batch [B, T]: inputs, next-token targets, doc_start. memorizable: without EOTs and with
// distinct first tokens, every row is one document and no two tokens share a context, so the loss
// can go to 0 (an EOT sees only itself: several EOTs with different successors set a floor)
struct FixedBatch {
    int B, T;
    std::vector<int> in, tgt, ds;
    FixedBatch(int B_, int T_, uint64_t seed, bool memorizable = false)
        : B(B_), T(T_), in(B_ * T_), tgt(B_ * T_), ds(B_ * T_) {
        std::vector<int> tokens = synthetic_tokens(B * T + 1, seed);
        if (memorizable) {
            for (size_t i = 0; i < tokens.size(); i++)
                if (tokens[i] == 256) tokens[i] = 'A' + (int)(i % 26);
            for (int b = 0; b < B; b++) tokens[(size_t)b * T] = '0' + b;
        }
        for (int i = 0; i < B * T; i++) in[i] = tokens[i], tgt[i] = tokens[i + 1];
        for (int b = 0; b < B; b++) compute_doc_start(ds.data() + b * T, in.data() + b * T, T, 256);
    }
};

// the OpenMP thread count 1 for a scope
struct OneThread {
    int saved = omp_get_max_threads();
    OneThread() { omp_set_num_threads(1); }
    ~OneThread() { omp_set_num_threads(saved); }
};

const ParamTensor* find_param(const GPT& m, const std::string& name) {
    for (const ParamTensor& p : m.table)
        if (p.name == name) return &p;
    return nullptr;
}

size_t param_offset(const GPT& m, const std::string& name) {
    const ParamTensor* p = find_param(m, name);
    REQUIRE_MESSAGE(p, name << " missing from the parameter table");
    return p->offset;
}

// the routing statistics recomputed here from the token_slots of the last forward
MoeStats my_moe_stats(const GPT& m) {
    const GPTConfig& c = m.config;
    const int n = m.B * m.T, E = c.n_expert;
    MoeStats st;
    st.load_min = INT32_MAX;
    st.load_max = -1;
    int layers = 0;
    for (int l = 0; l < c.n_layer; l++) {
        if (!c.is_moe(l)) continue;
        layers++;
        const int* ts = gpt_layer_acts(m, l).token_slots;
        for (int e = 0; e < E; e++) {
            int load = 0;
            for (int i = 0; i < n; i++) load += ts[(size_t)i * E + e] >= 0;
            st.load_min = std::min(st.load_min, load);
            st.load_max = std::max(st.load_max, load);
        }
        for (int i = 0; i < n; i++) {
            int k = 0;
            for (int e = 0; e < E; e++) k += ts[(size_t)i * E + e] >= 0;
            st.frac[std::min(k, 2)] += 1.0 / n;
        }
    }
    for (double& f : st.frac) f /= std::max(layers, 1);
    return st;
}

void check_moe_stats(const GPT& m, const std::string& what) {
    const MoeStats st = gpt_moe_stats(m), mine = my_moe_stats(m);
    const int cap = m.config.moe_capacity(m.B, m.T);
    CHECK_MESSAGE(std::fabs(st.frac[0] + st.frac[1] + st.frac[2] - 1.0) < 1e-12,
                  what << ": gpt_moe_stats fractions sum to " << st.frac[0] + st.frac[1] + st.frac[2]);
    for (int k = 0; k < 3; k++)
        CHECK_MESSAGE(std::fabs(st.frac[k] - mine.frac[k]) < 1e-12,
                      what << ": gpt_moe_stats frac[" << k << "] " << st.frac[k] << ", recounted " << mine.frac[k]);
    CHECK_MESSAGE(st.load_min == cap, what << ": gpt_moe_stats load_min " << st.load_min << ", capacity " << cap);
    CHECK_MESSAGE(st.load_max == cap, what << ": gpt_moe_stats load_max " << st.load_max << ", capacity " << cap);
    CHECK(mine.load_min == cap);
    CHECK(mine.load_max == cap);
}

}  // namespace

TEST_CASE("MoE models overfit a single batch (moe_every 1 and 2, routing group batch and position)") {
    // a model this small gains nothing from threads (and OpenMP barriers cost more than the work on
    // a busy machine); the result does not depend on the thread count (tested above for the MoE ops)
    OneThread one_thread;
    const float lr = 7e-3f;
    const int B = 4, T = 32;
    FixedBatch batch(B, T, 5, true);
    struct Variant {
        int moe_every, group;
    };
    for (Variant v : {Variant{1, MOE_GROUP_BATCH}, Variant{2, MOE_GROUP_POSITION}, Variant{1, MOE_GROUP_POSITION},
                      Variant{2, MOE_GROUP_BATCH}}) {
        CAPTURE(v.moe_every);
        CAPTURE(v.group);
        GPTConfig c = moe_model_config(4, v.moe_every, v.group);
        GPT m;
        gpt_allocate(m, c, B, T);
        gpt_init_params(m, 1);
        OptimizerConfig opt;
        opt.weight_decay = 0.0f;
        float loss = 0;
        int step = 0;
        for (; step < 400; step++) {
            gpt_zero_grad(m);
            loss = gpt_forward(m, batch.in.data(), batch.tgt.data(), batch.ds.data(), B, T, 1.0f);
            if (step == 0) {  // a sane start, and every expert tensor receives a finite, non-zero gradient
                CHECK(std::fabs(loss - std::log(257.0f)) < 0.5f);
                check_moe_stats(m, "step 0");
            }
            if (loss < 0.1f) break;
            gpt_backward(m);
            if (step == 0) {
                int moe_tensors = 0;
                const std::vector<float> grads = gpt_grads(m);
                for (const ParamTensor& p : m.table) {
                    if (p.name.find(".moe.") == std::string::npos) continue;
                    moe_tensors++;
                    double sq = 0;
                    bool finite = true;
                    for (size_t i = 0; i < p.numel; i++) {
                        finite = finite && std::isfinite(grads[p.offset + i]);
                        sq += (double)grads[p.offset + i] * grads[p.offset + i];
                    }
                    CHECK_MESSAGE(finite, p.name << ": non-finite gradient");
                    CHECK_MESSAGE(sq > 0, p.name << ": gradient is exactly zero");
                }
                CHECK(moe_tensors == 5 * (v.moe_every == 1 ? 2 : 1));
            }
            gpt_update(m, opt, step < 10 ? lr * (step + 1) / 10 : lr, step);
        }
        MESSAGE("MoE overfit (moe_every " << v.moe_every << ", group " << group_name(v.group == MOE_GROUP_POSITION)
                                          << "): loss " << loss << " after " << step << " steps");
        CHECK(loss < 0.1f);
        check_moe_stats(m, "after overfitting");
        gpt_free(m);
    }
}

TEST_CASE("gpt_backward's MoE branch equals the ops composed in double on the model's own activations") {
    // The last block's FFN is an MoE layer. From the model's saved activations and routing, the
    // gradient reaching the block output (through the tied lm head and the final LayerNorm) and then
    // the MoE layer's backward are recomputed in double; gpt_backward's gradients of the layer's
    // tensors and of its ln2 (which sees the MoE layer's dx) must match to float rounding.
    OneThread one_thread;  // (a tiny model: see the overfit test)
    const int B = 4, T = 16, BT = B * T;
    FixedBatch batch(B, T, 17);
    struct Variant {
        int moe_every, group;
        float c;
    };
    for (Variant v : {Variant{1, MOE_GROUP_BATCH, 1.5f}, Variant{2, MOE_GROUP_POSITION, 1.5f},
                      Variant{1, MOE_GROUP_POSITION, 3.0f}, Variant{2, MOE_GROUP_BATCH, 0.5f}}) {
        CAPTURE(v.moe_every);
        CAPTURE(v.group);
        CAPTURE(v.c);
        const GPTConfig c = moe_model_config(4, v.moe_every, v.group, v.c, 24);
        const int C = c.n_embd, E = c.n_expert, He = c.expert_hidden, Vp = c.padded_vocab_size, l = c.n_layer - 1;
        REQUIRE(c.is_moe(l));
        GPT m;
        gpt_allocate(m, c, B, T);
        gpt_init_params(m, 5);
        {  // non-zero biases and a sharper router, so that every term of the backward matters
            TestRng r(51);
            std::vector<float> p(m.n_params), zeros(m.n_params, 0.0f);
            gpt_get_state(m, p.data(), nullptr, nullptr);
            for (const ParamTensor& t : m.table) {
                const bool bias = t.name.substr(t.name.size() - 2) == ".b";
                const bool router = t.name.find("router") != std::string::npos;
                for (size_t i = 0; i < t.numel; i++) {
                    if (bias) p[t.offset + i] = (float)r.nz(0.01, 0.1);
                    if (router) p[t.offset + i] *= 20.0f;
                }
            }
            gpt_set_state(m, p.data(), zeros.data(), zeros.data());
        }
        gpt_zero_grad(m);
        REQUIRE(m.logits_chunk >= BT);  // one lm-head chunk: m.logits keeps the whole micro-batch's dlogits
        gpt_forward(m, batch.in.data(), batch.tgt.data(), batch.ds.data(), B, T, 1.0f);  // m.logits: dlogits
        const LayerActs& a = gpt_layer_acts(m, l);
        auto dvec = [](const float* p, size_t n) { return vector<double>(p, p + n); };
        // d(block output) = LN_f backward of (dlogits wte)
        const vector<double> dlogits = dvec(m.logits, (size_t)BT * Vp), wte = dvec(m.p.wte, (size_t)Vp * C);
        vector<double> dlnf((size_t)BT * C, 0.0);
        for (int i = 0; i < BT; i++)
            for (int v2 = 0; v2 < Vp; v2++) {
                const double g = dlogits[(size_t)i * Vp + v2];
                if (g != 0.0)
                    for (int k = 0; k < C; k++) dlnf[(size_t)i * C + k] += g * wte[(size_t)v2 * C + k];
            }
        vector<double> dres((size_t)BT * C, 0.0), scratch_w(C, 0.0), scratch_b(C, 0.0);
        cpu::layernorm_backward(dres.data(), scratch_w.data(), scratch_b.data(), dlnf.data(),
                                dvec(a.residual3, (size_t)BT * C).data(), dvec(m.p.lnfw, C).data(),
                                dvec(m.lnf_mean, BT).data(), dvec(m.lnf_rstd, BT).data(), BT, C);
        // the MoE layer in double: the model's input (ln2), parameters and routing
        MoeLayer<double> L;
        L.B = B, L.T = T, L.C = C, L.E = E, L.He = He, L.n = BT, L.cf = c.capacity_factor;
        L.by_pos = c.moe_group == MOE_GROUP_POSITION;
        L.cap = c.moe_capacity(B, T);
        const LayerTensors<floatX>& w = m.p.layers[l];
        L.x = dvec(a.ln2, (size_t)BT * C);
        L.rw = dvec(w.routerw, (size_t)E * C);
        L.fcw = dvec(w.fcw, (size_t)E * 2 * He * C);
        L.fcb = dvec(w.fcb, (size_t)E * 2 * He);
        L.pw = dvec(w.fcprojw, (size_t)E * C * He);
        L.pb = dvec(w.fcprojb, (size_t)E * C);
        L.et.assign(a.expert_tokens, a.expert_tokens + (size_t)E * L.cap);
        L.ts.assign(a.token_slots, a.token_slots + (size_t)BT * E);
        L.forward();
        check_close("model forward: moe_scores of the last layer vs double", dvec(a.moe_scores, (size_t)BT * E), L.scores,
                    1e-5);
        check_close("model forward: expert_out of the last layer vs double", dvec(a.expert_out, (size_t)E * L.cap * C),
                    L.ye, 1e-4);
        vector<double> dx, drw(L.rw.size(), 0.0), dfcw(L.fcw.size(), 0.0), dfcb(L.fcb.size(), 0.0),
            dpw(L.pw.size(), 0.0), dpb(L.pb.size(), 0.0);
        L.backward(dx, drw, dfcw, dfcb, dpw, dpb, dres);
        // ln2 of the block: d residual2 = dres + LN2 backward of the MoE layer's dx
        vector<double> dres2 = dres, dln2w(C, 0.0), dln2b(C, 0.0);
        cpu::layernorm_backward(dres2.data(), dln2w.data(), dln2b.data(), dx.data(),
                                dvec(a.residual2, (size_t)BT * C).data(), dvec(w.ln2w, C).data(),
                                dvec(a.ln2_mean, BT).data(), dvec(a.ln2_rstd, BT).data(), BT, C);
        gpt_backward(m);
        const std::string h = "h" + std::to_string(l) + ".";
        const std::pair<std::string, const vector<double>*> expect[] = {
            {h + "moe.router.w", &drw}, {h + "moe.fc.w", &dfcw}, {h + "moe.fc.b", &dfcb}, {h + "moe.proj.w", &dpw},
            {h + "moe.proj.b", &dpb},   {h + "ln2.w", &dln2w},  {h + "ln2.b", &dln2b}};
        const std::vector<float> grads = gpt_grads(m);
        for (const auto& [name, ref] : expect) {
            const ParamTensor* p = find_param(m, name);
            REQUIRE(p);
            REQUIRE(p->numel == ref->size());
            check_close("gpt_backward grad of " + name + " vs the double composition", dvec(grads.data() + p->offset, p->numel),
                        *ref, 1e-4);
        }
        gpt_free(m);
    }
}

TEST_CASE("MoE routing statistics of the training log (gpt_moe_stats)") {
    OneThread one_thread;  // (a tiny model: see the overfit test)
    const int B = 4, T = 32;
    FixedBatch batch(B, T, 9);
    struct Case {
        int E, moe_every, group;
        float c;
        double frac0_min;  // fractions known from the config alone (-1: none)
        int exact;         // -1: no exact value; k: every token taken by exactly min(k, 2) experts
    };
    const Case cases[] = {
        {1, 1, MOE_GROUP_BATCH, 1.0f, -1, 1},       // one expert takes every token: all by exactly 1
        {4, 1, MOE_GROUP_BATCH, 4.0f, -1, 2},       // capacity n: every expert takes every token
        {4, 2, MOE_GROUP_POSITION, 4.0f, -1, 2},    // capacity B per position: the same
        {4, 1, MOE_GROUP_BATCH, 2.0f, -1, -1},
        {4, 2, MOE_GROUP_POSITION, 2.0f, -1, -1},
        {2, 1, MOE_GROUP_BATCH, 0.5f, 0.5, -1},     // 2 x 32 slots for 128 tokens: at least half untaken
        {4, 1, MOE_GROUP_POSITION, 1.0f, 0.0, -1},  // one of the 4 tokens of each position per expert
    };
    for (const Case& cs : cases) {
        CAPTURE(cs.E);
        CAPTURE(cs.moe_every);
        CAPTURE(cs.group);
        CAPTURE(cs.c);
        GPT m;
        gpt_allocate(m, moe_model_config(cs.E, cs.moe_every, cs.group, cs.c), B, T);
        gpt_init_params(m, 3);
        gpt_forward(m, batch.in.data(), batch.tgt.data(), batch.ds.data(), B, T);
        check_moe_stats(m, "forward");
        const MoeStats st = gpt_moe_stats(m);
        if (cs.exact >= 0)
            for (int k = 0; k < 3; k++) CHECK(st.frac[k] == (k == cs.exact ? 1.0 : 0.0));
        if (cs.frac0_min >= 0) CHECK(st.frac[0] >= cs.frac0_min - 1e-12);
        CHECK(st.load_min == m.config.moe_capacity(B, T));
        gpt_free(m);
    }
}

TEST_CASE("MoE parameter table: names in the documented order, shapes, init, weight decay flags") {
    struct Case {
        int n_layer, moe_every, E, He;
    };
    for (Case cs : {Case{4, 2, 4, 48}, Case{2, 1, 3, 0}, Case{3, 3, 2, 16}, Case{2, 1, 0, 0}}) {
        CAPTURE(cs.n_layer);
        CAPTURE(cs.moe_every);
        CAPTURE(cs.E);
        GPTConfig c = moe_model_config(cs.E, cs.moe_every, MOE_GROUP_BATCH, 2.0f, cs.He, cs.n_layer);
        const int C = 32, He = cs.He ? cs.He : c.ffn_hidden, E = cs.E;
        CHECK(c.ffn_hidden == 96);
        CHECK(c.expert_hidden == (cs.E ? He : c.ffn_hidden));
        struct Expect {
            std::string name;
            std::vector<int> shape;
            bool decay;
            ParamTensor::Init init;
            float std;
        };
        const float proj_std = 0.02f / std::sqrt(2.0f * cs.n_layer);
        std::vector<Expect> expect = {{"wte", {384, C}, true, ParamTensor::NORMAL, 0.02f}};
        int moe_layers = 0;
        for (int l = 0; l < cs.n_layer; l++) {
            const std::string h = "h" + std::to_string(l) + ".";
            std::vector<Expect> block = {{h + "ln1.w", {C}, false, ParamTensor::ONES, 0},
                                         {h + "ln1.b", {C}, false, ParamTensor::ZEROS, 0},
                                         {h + "attn.qkv.w", {64, C}, true, ParamTensor::NORMAL, 0.02f},
                                         {h + "attn.qkv.b", {64}, false, ParamTensor::ZEROS, 0},
                                         {h + "attn.proj.w", {C, C}, true, ParamTensor::NORMAL, proj_std},
                                         {h + "attn.proj.b", {C}, false, ParamTensor::ZEROS, 0},
                                         {h + "ln2.w", {C}, false, ParamTensor::ONES, 0},
                                         {h + "ln2.b", {C}, false, ParamTensor::ZEROS, 0}};
            expect.insert(expect.end(), block.begin(), block.end());
            const bool moe = E > 0 && (l + 1) % cs.moe_every == 0;
            CHECK(c.is_moe(l) == moe);
            moe_layers += moe;
            if (moe) {
                std::vector<Expect> ffn = {{h + "moe.router.w", {E, C}, true, ParamTensor::NORMAL, 0.02f},
                                           {h + "moe.fc.w", {E, 2 * He, C}, true, ParamTensor::NORMAL, 0.02f},
                                           {h + "moe.fc.b", {E, 2 * He}, false, ParamTensor::ZEROS, 0},
                                           {h + "moe.proj.w", {E, C, He}, true, ParamTensor::NORMAL, proj_std},
                                           {h + "moe.proj.b", {E, C}, false, ParamTensor::ZEROS, 0}};
                expect.insert(expect.end(), ffn.begin(), ffn.end());
            } else {
                std::vector<Expect> ffn = {{h + "mlp.fc.w", {192, C}, true, ParamTensor::NORMAL, 0.02f},
                                           {h + "mlp.fc.b", {192}, false, ParamTensor::ZEROS, 0},
                                           {h + "mlp.proj.w", {C, 96}, true, ParamTensor::NORMAL, proj_std},
                                           {h + "mlp.proj.b", {C}, false, ParamTensor::ZEROS, 0}};
                expect.insert(expect.end(), ffn.begin(), ffn.end());
            }
        }
        expect.push_back({"lnf.w", {C}, false, ParamTensor::ONES, 0});
        expect.push_back({"lnf.b", {C}, false, ParamTensor::ZEROS, 0});

        const std::vector<ParamTensor> table = build_param_table(c);
        REQUIRE_MESSAGE(table.size() == expect.size(), "parameter table has " << table.size() << " tensors, expected "
                                                                              << expect.size());
        size_t end = 0;
        for (size_t k = 0; k < table.size(); k++) {
            const ParamTensor& p = table[k];
            const Expect& x = expect[k];
            CAPTURE(k);
            CHECK_MESSAGE(p.name == x.name, "tensor #" << k << " is " << p.name << ", expected " << x.name);
            CHECK_MESSAGE(p.shape == x.shape, p.name << ": shape differs");
            CHECK_MESSAGE(p.decay == x.decay, p.name << ": weight decay flag " << p.decay << ", expected " << x.decay);
            CHECK_MESSAGE(p.init == x.init, p.name << ": init kind");
            if (x.init == ParamTensor::NORMAL) CHECK_MESSAGE(p.init_std == doctest::Approx(x.std), p.name << ": init std");
            size_t numel = 1;
            for (int d : x.shape) numel *= (size_t)d;
            CHECK(p.numel == numel);
            CHECK_MESSAGE(p.offset >= end, p.name << ": overlaps the previous tensor");
            CHECK(p.offset % 8 == 0);
            end = p.offset + p.numel;
        }
        // the layer pointers of an allocated model point at these tensors; dense layers have no router
        GPT m;
        gpt_allocate(m, c, 2, 8);
        for (int l = 0; l < cs.n_layer; l++) {
            CAPTURE(l);
            const std::string h = "h" + std::to_string(l) + ".";
            const std::string ffn = c.is_moe(l) ? h + "moe." : h + "mlp.";
            const LayerTensors<floatX>& w = m.p.layers[l];
            CHECK(w.fcw == m.params + gpt_padded_index(m, param_offset(m, ffn + "fc.w")));
            CHECK(w.fcb == m.params + gpt_padded_index(m, param_offset(m, ffn + "fc.b")));
            CHECK(w.fcprojw == m.params + gpt_padded_index(m, param_offset(m, ffn + "proj.w")));
            CHECK(w.fcprojb == m.params + gpt_padded_index(m, param_offset(m, ffn + "proj.b")));
            CHECK(m.g.layers[l].fcw == m.grad_acc + gpt_padded_index(m, param_offset(m, ffn + "fc.w")));
            if (c.is_moe(l)) {
                CHECK(w.routerw == m.params + gpt_padded_index(m, param_offset(m, h + "moe.router.w")));
                CHECK(m.g.layers[l].routerw == m.grad_acc + gpt_padded_index(m, param_offset(m, h + "moe.router.w")));
            } else {
                CHECK(w.routerw == nullptr);
            }
        }
        gpt_free(m);
        MESSAGE("table checked: " << cs.n_layer << " layers, " << moe_layers << " MoE");
    }
}

TEST_CASE("MoE weight decay in the optimizer: router.w, fc.w, proj.w decayed; the [E, ...] biases not") {
    GPTConfig c = moe_model_config(4, 2, MOE_GROUP_BATCH, 2.0f, 48);  // layer 0 dense, layer 1 MoE
    GPT m;
    gpt_allocate(m, c, 2, 8);
    // every parameter non-zero, zero gradients: AdamW moves only by the decoupled decay p -= lr wd p
    TestRng r(41);
    std::vector<float> p0 = rand_vec<float>(r, m.n_params), zeros(m.n_params, 0.0f);
    gpt_set_state(m, p0.data(), zeros.data(), zeros.data());
    gpt_zero_grad(m);
    OptimizerConfig opt;
    opt.weight_decay = 0.5f;
    const float lr = 0.1f;
    gpt_update(m, opt, lr, 0);
    std::vector<float> p1(m.n_params);
    gpt_get_state(m, p1.data(), nullptr, nullptr);
    for (std::string name : {"h1.moe.router.w", "h1.moe.fc.w", "h1.moe.proj.w", "h0.mlp.fc.w", "h1.moe.fc.b",
                                    "h1.moe.proj.b", "h0.mlp.fc.b", "h1.ln2.w"}) {
        const ParamTensor* p = find_param(m, name);
        REQUIRE_MESSAGE(p, name << " missing from the parameter table");
        const bool decayed = name.substr(name.size() - 2) == ".w" && p->shape.size() >= 2;
        CHECK_MESSAGE(p->decay == decayed, name << ": decay flag");
        std::vector<float> got(p1.begin() + p->offset, p1.begin() + p->offset + p->numel);
        std::vector<double> expect(p->numel);
        for (size_t i = 0; i < p->numel; i++) expect[i] = (double)p0[p->offset + i] * (decayed ? 1.0 - lr * 0.5 : 1.0);
        if (decayed)
            check_close(name + " after one AdamW step with zero gradient (decayed)", got, expect, 1e-6);
        else
            check_close(name + " after one AdamW step with zero gradient (not decayed: unchanged)", got, expect, 0.0);
    }
    gpt_free(m);
}

TEST_CASE("MoE active_param_count: below param_count, equal to the count by hand") {
    const int B = 4, T = 32;
    // C 32, 4 heads of 8, 2 kv heads: qkv 64 channels; ffn_hidden 96; padded vocab 384
    const double C = 32, qkv = 64, H = 96, Vp = 384;
    const double block = 2 * C + qkv * C + qkv + C * C + C + 2 * C;  // ln1, attn.qkv, attn.proj, ln2
    const double dense_ffn = 2 * H * C + 2 * H + C * H + C;
    auto expert = [&](double He) { return 2 * He * C + 2 * He + C * He + C; };
    struct Case {
        int E, moe_every, group;
        float c;
        int He;
        double experts_per_token;  // E * capacity / n, by hand
    };
    const Case cases[] = {
        {4, 1, MOE_GROUP_BATCH, 2.0f, 48, 2.0},      // capacity 64 of 128 tokens, 4 experts
        {4, 2, MOE_GROUP_BATCH, 2.0f, 0, 2.0},       // only layer 1; He = ffn_hidden
        {4, 1, MOE_GROUP_POSITION, 2.0f, 96, 2.0},   // 2 of the 4 tokens per position
        {4, 1, MOE_GROUP_BATCH, 1.5f, 48, 1.5},      // capacity 48
        {4, 1, MOE_GROUP_POSITION, 1.5f, 48, 2.0},   // ceil(4 * 1.5 / 4) = 2 per position: rounds up
        {8, 1, MOE_GROUP_BATCH, 1.0f, 0, 1.0},       // capacity 16
    };
    for (const Case& cs : cases) {
        CAPTURE(cs.E);
        CAPTURE(cs.moe_every);
        CAPTURE(cs.group);
        CAPTURE(cs.c);
        CAPTURE(cs.He);
        GPT m;
        gpt_allocate(m, moe_model_config(cs.E, cs.moe_every, cs.group, cs.c, cs.He), B, T);
        const double He = cs.He ? cs.He : H, E = cs.E;
        double total = Vp * C + 2 * C, active = Vp * C + 2 * C;
        for (int l = 0; l < 2; l++) {
            total += block;
            active += block;
            if ((l + 1) % cs.moe_every == 0) {
                total += E * C + E * expert(He);
                active += E * C + cs.experts_per_token * expert(He);
            } else {
                total += dense_ffn;
                active += dense_ffn;
            }
        }
        CHECK(E * m.config.moe_capacity(B, T) / (B * T) == cs.experts_per_token);
        CHECK((double)m.param_count == total);
        CHECK(active_param_count(m, B, T) == active);
        CHECK(active_param_count(m, B, T) < (double)m.param_count);
        gpt_free(m);
    }
    // one expert per token of dense size (He = ffn_hidden, c = 1): active = the dense model + the routers
    for (int moe_every : {1, 2}) {
        GPT dense, moe;
        gpt_allocate(dense, moe_model_config(0, 1, MOE_GROUP_BATCH), B, T);
        gpt_allocate(moe, moe_model_config(4, moe_every, MOE_GROUP_BATCH, 1.0f), B, T);
        const int moe_layers = moe_every == 1 ? 2 : 1;
        CHECK(active_param_count(dense, B, T) == (double)dense.param_count);
        CHECK(active_param_count(moe, B, T) == (double)dense.param_count + moe_layers * 4 * C);
        gpt_free(dense);
        gpt_free(moe);
    }
}

namespace {

struct MoeTrainFixture {
    std::string dir = test_util::make_temp_dir("llmc_moe_test_");
    MoeTrainFixture() {
        write_shard(dir + "/tr_000.bin", synthetic_tokens(6000, 1));
        write_shard(dir + "/tr_001.bin", synthetic_tokens(3000, 2));
        write_shard(dir + "/va_000.bin", synthetic_tokens(2000, 3));
    }
    ~MoeTrainFixture() { std::filesystem::remove_all(dir); }
    // the run's shape; the MoE flags separately (a resume may leave them to the checkpoint)
    std::vector<std::string> base(const std::string& out, int max_steps) const {
        return {"--train", dir + "/tr_*.bin", "--val", dir + "/va_*.bin", "--out_dir", dir + "/" + out, "--n_layer", "2",
                "--n_embd", "32", "--n_head", "4", "--n_kv_head", "2", "-b", "4", "-t", "32", "-d", "256",
                "--max_steps", std::to_string(max_steps), "--warmup", "2", "--val_every", "3", "--val_batches", "2",
                "--sample_len", "16", "--ckpt_every", "4"};
    }
    static std::vector<std::string> moe_flags() {
        return {"--n_expert", "4", "--moe_every", "1", "--moe_group", "position", "--capacity_factor", "1.5",
                "--expert_hidden", "48"};
    }
    std::vector<std::string> args(const std::string& out, int max_steps,
                                  std::vector<std::string> extra = moe_flags()) const {
        std::vector<std::string> a = base(out, max_steps);
        a.insert(a.end(), extra.begin(), extra.end());
        return a;
    }
};

// the training-step lines of a log.jsonl, by step, without the timing fields
std::map<int, std::string> moe_logged_steps(const std::string& path) {
    std::map<int, std::string> out;
    std::ifstream f(path);
    std::string line;
    while (std::getline(f, line)) {
        size_t p = line.find("\"loss\":");
        if (p == std::string::npos) continue;
        int step = std::stoi(line.substr(line.find("\"step\":") + 7));
        size_t q = line.find("\"moe_frac_0\"");
        out[step] = line.substr(p, line.find("\"lr\"") - p) + (q == std::string::npos ? "" : line.substr(q));
    }
    return out;
}

double json_field(const std::string& line, const std::string& name) {
    size_t p = line.find("\"" + name + "\":");
    REQUIRE_MESSAGE(p != std::string::npos, "log line lacks " << name << ": " << line);
    return std::strtod(line.c_str() + p + name.size() + 3, nullptr);
}

}  // namespace

TEST_CASE("MoE training run: log fields, bitwise-identical resume, a different expert config is refused") {
    OneThread one_thread;  // (a tiny model: see the overfit test)
    MoeTrainFixture fx;
    REQUIRE(run_train(fx.args("full", 8)) == 0);
    const std::string full = read_file(fx.dir + "/full/ckpt_000000008.bin");
    CHECK(full.size() > 1000);
    Checkpoint ck = load_checkpoint(fx.dir + "/full/ckpt_000000004.bin");
    CHECK(ck.get_int("config.n_expert", "") == 4);
    CHECK(ck.get_int("config.moe_every", "") == 1);
    CHECK(ck.get_int("config.moe_group", "") == MOE_GROUP_POSITION);
    CHECK(ck.get_int("config.expert_hidden", "") == 48);
    CHECK(ck.get_float("config.capacity_factor", "") == 1.5);

    // the log: per step the routing of the last micro-batch; capacity = 32 * ceil(4 * 1.5 / 4) = 64
    auto l_full = moe_logged_steps(fx.dir + "/full/log.jsonl");
    REQUIRE(l_full.size() == 8);
    {
        std::ifstream f(fx.dir + "/full/log.jsonl");
        std::string line;
        int n_steps = 0;
        while (std::getline(f, line)) {
            if (line.find("\"loss\":") == std::string::npos) continue;
            n_steps++;
            CAPTURE(line);
            const double f0 = json_field(line, "moe_frac_0"), f1 = json_field(line, "moe_frac_1"),
                         f2 = json_field(line, "moe_frac_2plus");
            CHECK(std::fabs(f0 + f1 + f2 - 1.0) < 1e-7);
            CHECK(f0 >= 0);
            CHECK(f1 >= 0);
            CHECK(f2 >= 0);
            CHECK(json_field(line, "moe_load_min") == 64);
            CHECK(json_field(line, "moe_load_max") == 64);
        }
        CHECK(n_steps == 8);
    }

    // resume from step 4 with the same flags, and with the MoE flags left to the checkpoint
    for (int with_flags = 1; with_flags >= 0; with_flags--) {
        CAPTURE(with_flags);
        const std::string out = with_flags ? "resumed" : "resumed_noflags";
        std::vector<std::string> a = with_flags ? fx.args(out, 8) : fx.base(out, 8);
        a.push_back("--resume");
        a.push_back(fx.dir + "/full/ckpt_000000004.bin");
        REQUIRE(run_train(a) == 0);
        CHECK(read_file(fx.dir + "/" + out + "/ckpt_000000008.bin") == full);
        auto l_res = moe_logged_steps(fx.dir + "/" + out + "/log.jsonl");
        CHECK(l_res.size() == 4);
        for (auto& [step, text] : l_res) {
            CAPTURE(step);
            CHECK(text == l_full[step]);
        }
    }

    // a different expert configuration is refused, naming the field
    const std::string ck4 = fx.dir + "/full/ckpt_000000004.bin";
    auto refused = [&](std::vector<std::string> moe, const char* needle) {
        CAPTURE(needle);
        std::vector<std::string> a = fx.args("refused", 8, moe);
        a.push_back("--resume");
        a.push_back(ck4);
        CHECK_THROWS_WITH_AS(run_train(a), doctest::Contains(needle), LlmcError);
    };
    refused({"--n_expert", "2"}, "checkpoint has n_expert = 4 but the flags ask for 2");
    refused({"--n_expert", "0"}, "checkpoint has n_expert = 4 but the flags ask for 0");
    refused({"--moe_every", "2"}, "moe_every");
    refused({"--moe_group", "batch"}, "moe_group");
    refused({"--expert_hidden", "32"}, "expert_hidden");
    refused({"--capacity_factor", "2"}, "capacity_factor");
}
