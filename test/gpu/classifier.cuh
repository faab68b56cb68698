// GPU fused_classifier (llmc/ops/classifier.cuh) vs the CPU twin (llmc/ops/cpu/classifier.h), and the
// vocab-parallel ops (classifier_max, _sumexp, _target, _backward) vs theirs (at the end).
//
// Tolerances. losses (fp32): relative max <= 1e-4: both sides read the same bf16 logits; they differ
// by the order of the fp32 sum of exp (tree vs sequential, ~sqrt(V) * 2^-24 relative: 2e-6 at
// V = 1000) and the fast-math exp/log (a few ulp), which move a loss of ~4..9 by ~1e-6; 1e-4 is
// stricter than the brief's 1e-3 with a wide margin. dlogits (bf16): relative L2 <= 1e-2, over the
// whole [N, Vp] buffer and, separately, over the non-target columns only (the probabilities, which
// the target's p - 1 would otherwise dominate). Padded columns, ignored rows (target -1) must be
// exactly 0; with dloss == 0 the logits must come back untouched.
#pragma once
#include <cstring>
#include <functional>
#include <memory>
#include <vector>
#include "test/gpu/harness.cuh"
#include "llmc/ops/cpu/classifier.h"
#include "llmc/ops/classifier.cuh"

namespace classifier_test {
using namespace gpu_test;

constexpr double LOSS_TOL = 1e-4;

// N rows of Vp bf16-exact logits, spread (std 3) so the softmax is far from uniform, the padded columns
// [V, Vp) holding large junk that must not reach the softmax (a stray 50 would dominate the sum); and
// N targets in [0, V) with ignored (padding, -1) positions, the last real column and column 0 among them
inline std::vector<float> classifier_logits(int N, int V, int Vp, uint64_t seed) {
    std::vector<float> logits = random_vector((size_t)N * Vp, seed, 3.0f, 0.5f);
    for (int n = 0; n < N; n++)
        for (int v = V; v < Vp; v++) logits[(size_t)n * Vp + v] = 50.0f + v % 7;
    return floatX_round(logits);
}
inline std::vector<int> classifier_targets(int N, int V, uint64_t seed) {
    Rng rng(seed);
    std::vector<int> targets(N);
    for (int n = 0; n < N; n++) {
        targets[n] = (int)rng.below(V);
        if (n % 7 == 3) targets[n] = -1;
        if (n % 11 == 1) targets[n] = V - 1;
        if (n % 13 == 2) targets[n] = 0;
    }
    return targets;
}

inline void check_classifier(int N, int V, int Vp, float dloss, uint64_t seed) {
    CAPTURE(N);
    CAPTURE(V);
    CAPTURE(Vp);
    CAPTURE(dloss);
    const size_t total = (size_t)N * Vp;
    const std::vector<float> logits = classifier_logits(N, V, Vp, seed);
    const std::vector<int> targets = classifier_targets(N, V, seed + 1);

    std::vector<float> want = logits, want_losses(N);
    cpu::fused_classifier<float>(want.data(), want_losses.data(), targets.data(), dloss, N, V, Vp);

    std::unique_ptr<DeviceBuffer<floatX>> d_logits(to_device_floatX(logits));
    DeviceBuffer<int> d_targets(N);
    upload(d_targets, targets);
    DeviceBuffer<float> d_losses(N);
    d_losses.poison();
    fused_classifier(*d_logits, d_losses, d_targets, dloss, N, V, Vp);
    const std::vector<float> got_losses = download(d_losses);
    const std::vector<float> got = download_floatX(*d_logits);
    CHECK_CLOSE("losses", rel_max(got_losses, want_losses), LOSS_TOL);
    for (int n = 0; n < N; n++)
        if (targets[n] < 0) CHECK(got_losses[n] == 0.0f);

    if (dloss == 0.0f) {
        CHECK(std::memcmp(got.data(), logits.data(), total * sizeof(float)) == 0);  // untouched
        return;
    }
    check_floatX("dlogits", got, want);
    std::vector<float> got_p = got, want_p = want;  // the non-target columns alone
    for (int n = 0; n < N; n++)
        if (targets[n] >= 0) got_p[(size_t)n * Vp + targets[n]] = want_p[(size_t)n * Vp + targets[n]] = 0.0f;
    check_floatX("dlogits without the targets", got_p, want_p);
    size_t bad_zeros = 0;
    for (int n = 0; n < N; n++)
        for (int v = 0; v < Vp; v++)
            if ((v >= V || targets[n] < 0) && got[(size_t)n * Vp + v] != 0.0f) bad_zeros++;
    CHECK(bad_zeros == 0);  // padded columns and ignored rows are exactly 0
}

TEST_CASE("fused_classifier matches the CPU twin (ragged V, padded Vp, ignored targets, dloss = 0)") {
    for (int N : {1, 5, 300}) {
        for (float dloss : {0.37f, 0.0f}) {
            check_classifier(N, 257, 384, dloss, 1000 + N);
            check_classifier(N, 1000, 1024, dloss, 1100 + N);
            check_classifier(N, 100, 101, dloss, 1200 + N);  // Vp % 8 != 0: the scalar path
            check_classifier(N, 700, 701, dloss, 1250 + N);  // scalar, several columns per thread
            check_classifier(N, 384, 384, dloss, 1300 + N);  // no padding
        }
    }
    // GPT-2's vocabulary: several loop trips per thread
    check_classifier(5, 50257, 50304, 1.0f / 5, 1400);
}

// ---- vocab-parallel cross-entropy: classifier_max / _sumexp / _target / _backward vs the CPU ops ----
// The logits [N, Vp] are cut into `slices` rank slices of ld = Vp / slices columns, each its own device
// buffer (offset 1: only 2-byte aligned, the scalar loads). Per slice, against the CPU ops on the same
// bf16 values: the max and the target logit bitwise (exact in both); the sum of exp of every chunk of
// CH columns (fp32, relative max <= LOSS_TOL), and bitwise equal to the GPU's sum of the same chunk
// read from the whole unsplit row (the order depends on the chunk alone); the backward, given the same
// global statistics on both sides: losses (relative max <= LOSS_TOL) and dlogits (bf16 checks), padding
// columns and ignored rows exactly 0, logits untouched when dloss == 0. Outputs are poisoned first.
inline void check_vocab_parallel(int N, int V, int Vp, int slices, int CH, float dloss, size_t offset,
                                 uint64_t seed) {
    CAPTURE(N);
    CAPTURE(V);
    CAPTURE(Vp);
    CAPTURE(slices);
    CAPTURE(CH);
    CAPTURE(dloss);
    CAPTURE(offset);
    REQUIRE(Vp % slices == 0);
    const int ld = Vp / slices, n_chunks = Vp / CH;
    REQUIRE(ld % CH == 0);
    const std::vector<float> logits = classifier_logits(N, V, Vp, seed);
    const std::vector<int> targets = classifier_targets(N, V, seed + 1);
    DeviceBuffer<int> d_targets(N);
    upload(d_targets, targets);
    const DevFloatX d_full(logits);  // the unsplit rows (aligned)
    auto n_real = [&](int k) { return std::max(0, std::min(ld, V - k * ld)); };

    std::vector<std::vector<float>> local(slices);
    std::vector<std::unique_ptr<DevFloatX>> d_local;
    std::vector<float> mx(N, -INFINITY), tgt(N, 0.0f);
    for (int k = 0; k < slices; k++) {
        INFO("slice " << k);
        local[k].resize((size_t)N * ld);
        for (int n = 0; n < N; n++) std::copy_n(&logits[(size_t)n * Vp + k * ld], ld, &local[k][(size_t)n * ld]);
        d_local.push_back(std::make_unique<DevFloatX>(local[k], offset));
        std::vector<float> want_mx(N), want_tgt(N);
        cpu::classifier_max<float>(want_mx.data(), local[k].data(), N, ld, n_real(k));
        cpu::classifier_target<float>(want_tgt.data(), local[k].data(), targets.data(), N, ld, k * ld, n_real(k));
        DeviceBuffer<float> d_mx(N), d_tgt(N);
        d_mx.poison();
        d_tgt.poison();
        classifier_max(d_mx, d_local[k]->ptr(), N, ld, n_real(k));
        classifier_target(d_tgt, d_local[k]->ptr(), d_targets, N, ld, k * ld, n_real(k));
        CHECK_MESSAGE(same_bytes(download(d_mx), want_mx), "classifier_max differs from the CPU");
        CHECK_MESSAGE(same_bytes(download(d_tgt), want_tgt), "classifier_target differs from the CPU");
        for (int n = 0; n < N; n++) {
            mx[n] = std::max(mx[n], want_mx[n]);
            tgt[n] += want_tgt[n];
        }
    }
    DeviceBuffer<float> d_gmx(N), d_gsum(N), d_gtgt(N);
    upload(d_gmx, mx);
    upload(d_gtgt, tgt);
    std::vector<std::vector<float>> chunk(n_chunks);
    for (int g = 0; g < n_chunks; g++) {
        INFO("chunk " << g);
        const int k = g * CH / ld, c0 = g * CH - k * ld, c1 = std::min(c0 + CH, n_real(k));
        chunk[g].resize(N);
        cpu::classifier_sumexp<float>(chunk[g].data(), local[k].data(), mx.data(), N, ld, c0, c1);
        DeviceBuffer<float> d_sum(N), d_sum_full(N);
        d_sum.poison();
        d_sum_full.poison();
        classifier_sumexp(d_sum, d_local[k]->ptr(), d_gmx, N, ld, c0, c1);
        classifier_sumexp(d_sum_full, d_full.ptr(), d_gmx, N, Vp, k * ld + c0, k * ld + std::max(c0, c1));
        const std::vector<float> got = download(d_sum);
        CHECK_CLOSE("classifier_sumexp", rel_max(got, chunk[g]), LOSS_TOL);
        CHECK_MESSAGE(same_bytes(got, download(d_sum_full)),
                      "classifier_sumexp of a chunk differs between its slice and the unsplit row");
    }
    std::vector<float> sum(N);  // the chunk sums added in a fixed pairwise tree (as the CPU test)
    std::function<float(int, int, int)> tree = [&](int n, int lo, int hi) -> float {
        return hi - lo == 1 ? chunk[lo][n] : tree(n, lo, lo + (hi - lo) / 2) + tree(n, lo + (hi - lo) / 2, hi);
    };
    for (int n = 0; n < N; n++) sum[n] = tree(n, 0, n_chunks);
    upload(d_gsum, sum);

    for (int k = 0; k < slices; k++) {
        INFO("slice " << k);
        std::vector<float> want = local[k], want_losses(N);
        cpu::classifier_backward<float>(want.data(), want_losses.data(), mx.data(), sum.data(), tgt.data(),
                                        targets.data(), dloss, N, ld, k * ld, n_real(k));
        DeviceBuffer<float> d_losses(N);
        d_losses.poison();
        classifier_backward(d_local[k]->ptr(), d_losses, d_gmx, d_gsum, d_gtgt, d_targets, dloss, N, ld, k * ld,
                            n_real(k));
        const std::vector<float> got_losses = download(d_losses), got = d_local[k]->get();
        CHECK_CLOSE("classifier_backward losses", rel_max(got_losses, want_losses), LOSS_TOL);
        for (int n = 0; n < N; n++)
            if (targets[n] < 0) CHECK(got_losses[n] == 0.0f);
        if (dloss == 0.0f) {
            CHECK(std::memcmp(got.data(), local[k].data(), got.size() * sizeof(float)) == 0);  // untouched
            continue;
        }
        size_t bad_zeros = 0, nonzero_ref = 0;
        for (int n = 0; n < N; n++)
            for (int v = 0; v < ld; v++) {
                const bool zero = v >= n_real(k) || targets[n] < 0;
                if (zero && got[(size_t)n * ld + v] != 0.0f) bad_zeros++;
                nonzero_ref += !zero;
            }
        CHECK(bad_zeros == 0);  // padding columns and ignored rows are exactly 0
        if (nonzero_ref > 0) check_floatX("classifier_backward dlogits", got, want);
    }
}

TEST_CASE("vocab-parallel classifier ops match the CPU twins (1, 2, 4, 8 slices, padding-only slice, scalar path)") {
    for (int N : {1, 37})
        for (float dloss : {0.37f, 0.0f}) {
            for (int slices : {1, 2, 4, 8}) {  // V 300 of 384: slice 7 of 8 is padding only
                check_vocab_parallel(N, 300, 384, slices, 16, dloss, 0, 2000 + N + slices);
                check_vocab_parallel(N, 300, 384, slices, 16, dloss, 1, 2100 + N + slices);  // 2-byte aligned
            }
            check_vocab_parallel(N, 90, 100, 2, 10, dloss, 0, 2200 + N);  // ld 50, chunks of 10: scalar loads
        }
    // GPT-2's vocabulary over 8 ranks (6288 columns each), chunks of 3144: several loop trips per lane
    check_vocab_parallel(4, 50257, 50304, 8, 3144, 1.0f / 4, 0, 2300);
    // all targets ignored: zero losses and gradients
    {
        const int N = 9, V = 300, ld = 96;  // slice 1 of 4 of V 300 / Vp 384
        std::vector<float> logits = floatX_round(random_vector((size_t)N * ld, 2400, 3.0f, 0.5f));
        const std::vector<int> targets(N, -1);
        const std::vector<float> mx(N, 4.0f), sum(N, 30.0f), tgt(N, 0.0f);
        const DevFloatX d_logits(logits);
        DeviceBuffer<int> d_targets(N);
        upload(d_targets, targets);
        DeviceBuffer<float> d_mx(N), d_sum(N), d_tgt(N), d_losses(N);
        upload(d_mx, mx);
        upload(d_sum, sum);
        upload(d_tgt, tgt);
        d_losses.poison();
        classifier_backward(d_logits.ptr(), d_losses, d_mx, d_sum, d_tgt, d_targets, 0.5f, N, ld, ld,
                            std::min(ld, V - ld));
        CHECK(same_bytes(download(d_losses), std::vector<float>(N, 0.0f)));
        CHECK(same_bytes(d_logits.get(), std::vector<float>((size_t)N * ld, 0.0f)));
    }
}

// small shapes for compute-sanitizer: the fused classifier and the vocab-parallel ops (max, sum of
// exponentials, target logit, backward) over 2 and 8 slices (one of padding only), and the scalar path
TEST_CASE("sanitizer: fused classifier and vocab-parallel classifier ops on small shapes") {
    check_classifier(5, 300, 384, 0.2f, 2500);
    for (int slices : {2, 8}) check_vocab_parallel(5, 300, 384, slices, 16, 0.2f, 0, 2510 + slices);
    check_vocab_parallel(3, 90, 100, 2, 10, 0.2f, 1, 2520);  // 2-byte aligned, ld 50: scalar loads
}

}  // namespace classifier_test

// ---- the peaked 50257-way distribution against float64 (the twin of test_ops.cpp's test) ----
// A trained GPT-2's next-token distribution: most logits 15-25 nats below the max, a few plausible
// tokens. Losses (fp32): within 1e-7 relative of float64, worst row (the sum of exponentials in
// double, the loss (max - x_t) + log(sum) in double; the fast-math exp's few-ulp errors average out in
// the sum). dlogits: the GPU stores them in floatX (bf16: 2^-9 relative), so a 1e-7 bound on the
// gradient is a bound on the fp32 value before that rounding, which is what is checked: every
// dlogit must be the floatX rounding (to nearest) of the float64 value, except where the float64
// value lies within the fp32 computation's error of a rounding midpoint, window = |dlogit| (8e-7 +
// 3e-7 |x - lse|) (the fast-math exp: 2 + 1.17 |x - lse| ulp; the argument's rounding; lse, the
// products), and at most 5% of the columns may fall in such a window (~0.3% in bf16, ~3% in fp16).
// (An fp32 lse, off by up to 5e-7, shows here only as a rare extra flip of a rounding: the CPU test
// is the one that sees the lse's precision, at 1e-7.) Both the fused kernel and the vocab-parallel ops
// (the engine's 8 canonical vocabulary chunks on one rank, the chunk sums added in the CPU tree).
namespace classifier_test {

// x rounded to floatX (to nearest even), and its distance to the nearest rounding midpoint
inline double floatX_rn(double x, double* to_midpoint) {
    constexpr bool bf16 = std::is_same<floatX, __nv_bfloat16>::value;
    constexpr int bits = bf16 ? 8 : 11, emin = bf16 ? -126 : -14;  // significand bits, the least normal exponent
    if (x == 0.0) { *to_midpoint = INFINITY; return 0.0; }
    const double q = std::ldexp(1.0, std::max(std::ilogb(x), emin) - (bits - 1));  // the spacing at x
    const double y = x / q, fl = std::floor(y);
    *to_midpoint = std::fabs(y - fl - 0.5) * q;
    return std::nearbyint(y) * q;
}

struct PeakedCheck {
    size_t near_midpoint = 0, wrong = 0, cols = 0;
    std::string first_wrong;
};
// the dlogits (floatX, as floats) of rows [0, N) vs the float64 ones, see the top of this section
inline PeakedCheck check_peaked_dlogits(const std::vector<float>& got, const std::vector<double>& want,
                                        const std::vector<double>& arg, int N, int V, int Vp) {
    PeakedCheck c;
    for (int n = 0; n < N; n++)
        for (int v = 0; v < Vp; v++) {
            const size_t i = (size_t)n * Vp + v;
            auto wrong = [&] {
                if (c.wrong++ > 0) return;
                char where[160];
                snprintf(where, sizeof(where), "row %d column %d: got %.9g, float64 %.9g", n, v, got[i],
                         v < V ? want[i] : 0.0);
                c.first_wrong = where;
            };
            if (v >= V) {  // padding: exactly 0
                if (got[i] != 0.0f) wrong();
                continue;
            }
            c.cols++;
            double to_mid;
            const double rn = floatX_rn(want[i], &to_mid);
            if (to_mid <= std::fabs(want[i]) * (8e-7 + 3e-7 * std::fabs(arg[i]))) c.near_midpoint++;
            else if ((double)got[i] != rn) wrong();
        }
    return c;
}

TEST_CASE("classifier: loss and dlogits on a peaked 50257-way distribution vs float64 (fused, vocab-parallel)") {
    const int N = 8, V = 50257, Vp = 50304, CH = Vp / 8;
    const float dloss = 1.0f / N;
    Rng rng(50257);
    std::vector<float> logits((size_t)N * Vp);
    std::vector<int> targets(N);
    for (int n = 0; n < N; n++) {
        float* x = &logits[(size_t)n * Vp];
        for (int v = 0; v < Vp; v++) x[v] = v < V ? rng.normal(-12.0f, 2.5f) : 50.0f + v % 7;  // padding: junk
        x[rng.below(V)] = 7.0f;
        for (int k = 0; k < 40; k++) x[rng.below(V)] = 1.0f + 5.0f * rng.uniform();  // the plausible few
        targets[n] = (int)rng.below(V);
        x[targets[n]] = 3.0f + 2.0f * rng.uniform();  // a loss of about 2-4 nats
    }
    logits = DevTensor<floatX>(logits).get();  // floatX-exact: what the device holds
    std::vector<double> want(N), want_d((size_t)N * Vp, 0.0), arg((size_t)N * Vp, 0.0);
    for (int n = 0; n < N; n++) {
        const float* x = &logits[(size_t)n * Vp];
        const double mx = *std::max_element(x, x + V);
        double s = 0;
        for (int v = 0; v < V; v++) s += std::exp((double)x[v] - mx);
        const double lse = mx + std::log(s);
        want[n] = lse - x[targets[n]];
        for (int v = 0; v < V; v++) {
            arg[(size_t)n * Vp + v] = (double)x[v] - lse;
            want_d[(size_t)n * Vp + v] = (double)dloss * (std::exp((double)x[v] - lse) - (v == targets[n] ? 1.0 : 0.0));
        }
    }
    DeviceBuffer<int> d_targets(N);
    upload(d_targets, targets);
    auto losses_error = [&](const std::vector<float>& got) {
        double e = 0;
        for (int n = 0; n < N; n++) e = std::max(e, std::fabs(got[n] - want[n]) / want[n]);
        return e;
    };
    auto report = [&](const char* what, const std::vector<float>& got_losses, const std::vector<float>& got) {
        const double le = losses_error(got_losses);
        const PeakedCheck c = check_peaked_dlogits(got, want_d, arg, N, V, Vp);
        MESSAGE(what << ": losses within " << le << " relative of float64; dlogits: " << c.wrong << " of " << c.cols
                     << " not the floatX rounding of float64, " << c.near_midpoint << " near a midpoint (not checked)");
        CHECK_CLOSE(std::string(what) + " losses vs float64", le, 1e-7);
        CHECK_MESSAGE(c.wrong == 0, what << ": the first wrong dlogit: " << c.first_wrong);
        CHECK(c.near_midpoint <= c.cols / 20);
    };
    {  // the fused kernel (the GPU trainer without --tp)
        DevTensor<floatX> d_logits(logits);
        DeviceBuffer<float> d_losses(N);
        d_losses.poison();
        fused_classifier(d_logits.ptr(), d_losses, d_targets, dloss, N, V, Vp);
        report("fused_classifier", download(d_losses), d_logits.get());
    }
    {  // the vocab-parallel ops on one rank: max, the 8 chunk sums, the target logit, backward
        DevTensor<floatX> d_logits(logits);
        DeviceBuffer<float> d_mx(N), d_tgt(N), d_sum(N), d_losses(N);
        classifier_max(d_mx, d_logits.ptr(), N, Vp, V);
        classifier_target(d_tgt, d_logits.ptr(), d_targets, N, Vp, 0, V);
        std::vector<std::vector<float>> chunk(Vp / CH);
        for (int g = 0; g < Vp / CH; g++) {
            classifier_sumexp(d_sum, d_logits.ptr(), d_mx, N, Vp, std::min(g * CH, V), std::min(g * CH + CH, V));
            chunk[g] = download(d_sum);
        }
        std::function<float(int, int, int)> tree = [&](int n, int lo, int hi) -> float {
            return hi - lo == 1 ? chunk[lo][n] : tree(n, lo, lo + (hi - lo) / 2) + tree(n, lo + (hi - lo) / 2, hi);
        };
        std::vector<float> sum(N);
        for (int n = 0; n < N; n++) sum[n] = tree(n, 0, Vp / CH);
        upload(d_sum, sum);
        d_losses.poison();
        classifier_backward(d_logits.ptr(), d_losses, d_mx, d_sum, d_tgt, d_targets, dloss, N, Vp, 0, V);
        report("vocab-parallel classifier ops", download(d_losses), d_logits.get());
    }
}

}  // namespace classifier_test

// loss_sum: a micro-batch's losses summed on the device (the trainer reads the step's sums once):
// double sums of the same floats in another fixed order, so the CPU twin's within 1e-12 relative,
// and bitwise the same on a second run
TEST_CASE("loss_sum: the device sum of the losses vs the CPU twin, deterministic") {
    using namespace gpu_test;
    for (int n : {1, 37, 1024, 1025, 65536 + 3}) {
        CAPTURE(n);
        std::vector<float> losses = random_vector(n, 700 + n, 1.0f, 3.0f);
        for (float& l : losses) l = std::fabs(l);
        DevF32 d(losses, 0);
        DeviceBuffer<double> out(2);
        out.poison();
        loss_sum(out.ptr, d.ptr(), n);
        loss_sum(out.ptr + 1, d.ptr(), n);
        const std::vector<double> got = download(out);
        double want = 0;
        cpu::loss_sum(&want, losses.data(), n);
        CHECK(std::fabs(got[0] - want) / want < 1e-12);
        CHECK(std::memcmp(&got[0], &got[1], sizeof(double)) == 0);
    }
}

TEST_CASE("sanitizer: loss_sum, small n") {
    gpu_test::DevF32 d(std::vector<float>(37, 1.5f), 1);
    gpu_test::DeviceBuffer<double> out(1);
    loss_sum(out.ptr, d.ptr(), 37);
    CHECK(gpu_test::download(out)[0] == 37 * 1.5);
}
