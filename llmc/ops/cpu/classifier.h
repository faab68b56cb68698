// Fused softmax + cross-entropy + dlogits over the real vocabulary (the first V of Vp padded
// columns). Targets equal to -1 are ignored. losses[n] gets the per-token loss (0 when ignored);
// when dloss != 0 the logits are overwritten in place with dloss * (softmax - onehot) (padded and
// ignored positions get 0), so the probabilities are never stored separately.
// Precision: the sum of exponentials is accumulated in double (at least), the loss computed as
// (max - x_t) + log(sum) in double. In fp32, on a peaked distribution over a GPT-2-sized vocabulary
// most terms exp(x - max) fall below half an ulp of a running sum near 1 and are dropped: a loss
// biased low by ~1e-5 relative and a first gradient ~3e-4 off. In double they are kept. The dlogits
// use lse = max + log(sum) and exp(x - lse) in double too: within 1e-7 relative of float64 at V 50257
// (test_ops.cpp), where an fp32 lse gave 3e-7.
// (Tensor parallelism splits this over the vocabulary: the four classifier_* ops below.)
#pragma once
#include <algorithm>
#include <cmath>
#include <type_traits>

namespace cpu {

// the accumulator of a sum of exponentials: double for float (and bf16) values, else T
template <typename T>
using Wide = std::conditional_t<(sizeof(T) < sizeof(double)), double, T>;

template <typename T>
void fused_classifier(T* logits, T* losses, const int* targets, T dloss, int N, int V, int Vp) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        T* x = logits + (size_t)n * Vp;
        const int tgt = targets[n];
        T mx = -INFINITY;
        for (int v = 0; v < V; v++) mx = std::max(mx, x[v]);
        Wide<T> sum = 0;
        for (int v = 0; v < V; v++) sum += std::exp(x[v] - mx);
        // lse and exp(x - lse) in double: an fp32 lse (~10) is off by up to half its ulp, 5e-7, which
        // every probability of the row inherits as a relative error
        const Wide<T> lse = (Wide<T>)mx + std::log(sum);
        losses[n] = tgt < 0 ? T(0) : (T)(((Wide<T>)mx - x[tgt]) + std::log(sum));
        if (dloss != T(0)) {
            const T d = tgt < 0 ? T(0) : dloss;
            for (int v = 0; v < V; v++) x[v] = d * ((T)std::exp((Wide<T>)x[v] - lse) - (v == tgt ? T(1) : T(0)));
            for (int v = V; v < Vp; v++) x[v] = 0;
        }
    }
}

// ---- Vocab-parallel cross-entropy (tensor parallelism, Megatron style) ----
// A rank holds ld columns of the logits rows: columns v0 .. v0 + ld of the global padded vocabulary
// (its slice of the tied lm head), of which the first n_real = clamp(V - v0, 0, ld) are real tokens
// and the rest padding. With x_v the logits of row n and t = targets[n] (-1: ignored):
//   M = max_v x_v,  S = sum_v exp(x_v - M),  lse = M + log S,  loss = lse - x_t,
//   dx_v = d (exp(x_v - lse) - [v == t]),  d = dloss (0 when t == -1)
// over the real columns of all ranks, in four ops with reductions between them (the caller's):
//   1. classifier_max     each rank's max of its real columns;          all-reduce max  -> M (exact)
//   2. classifier_sumexp  sum of exp(x - M) per fixed vocab chunk;      chunk sums added in a fixed
//      tree over the global chunk index (all-gather of the chunk sums)  -> S, bitwise the same for
//      any split of the vocabulary into slices of whole chunks
//   3. classifier_target  x_t on the rank that holds t, 0 elsewhere;    all-reduce sum  -> x_t (exact:
//      one non-zero term)
//   4. classifier_backward  losses (every rank the same) and, when dloss != 0, the rank's dlogits in
//      place (its padding columns 0).
// Statistics (mx, sum, tgt, losses) are fp32 in both builds; a chunk's sum is accumulated in double
// and rounded once, the loss is (M - x_t) + log S in double, and lse = M + log S and exp(x - lse) in
// double (why: fused_classifier). One row per thread here, rows independent, so the results do not
// depend on the thread count.

// mx[n] = max of row n over columns [0, n_cols) (-INFINITY when n_cols == 0)
template <typename T>
void classifier_max(float* mx, const T* logits, int N, int ld, int n_cols) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const T* x = logits + (size_t)n * ld;
        float m = -INFINITY;
        for (int v = 0; v < n_cols; v++) m = std::max(m, (float)x[v]);
        mx[n] = m;
    }
}

// sum[n] = sum over columns [c0, c1) of row n of exp(x - mx[n]), in increasing column order in double,
// rounded once (0 when c1 <= c0)
template <typename T>
void classifier_sumexp(float* sum, const T* logits, const float* mx, int N, int ld, int c0, int c1) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const T* x = logits + (size_t)n * ld;
        double s = 0.0;
        for (int v = c0; v < c1; v++) s += std::exp((float)x[v] - mx[n]);
        sum[n] = (float)s;
    }
}

// tgt[n] = the logit of global column targets[n] when it lies in [v0, v0 + n_cols), else 0 (also for
// ignored targets, -1)
template <typename T>
void classifier_target(float* tgt, const T* logits, const int* targets, int N, int ld, int v0, int n_cols) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const int t = targets[n] - v0;
        tgt[n] = targets[n] >= 0 && t >= 0 && t < n_cols ? (float)logits[(size_t)n * ld + t] : 0.0f;
    }
}

// mx, sum, tgt: the global statistics (after the reductions). losses[n] = (mx - tgt[n]) + log(sum) in
// double (0 for ignored targets), lse = mx + log(sum). When dloss != 0 the logits are overwritten with the dlogits of the
// rank's columns: d (exp(x - lse) - onehot) for columns [0, n_real), onehot at targets[n] - v0 when
// that is one of them, d = dloss (0 for ignored targets); 0 for the padding columns [n_real, ld).
template <typename T>
void classifier_backward(T* logits, float* losses, const float* mx, const float* sum, const float* tgt,
                         const int* targets, float dloss, int N, int ld, int v0, int n_real) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const double lse = (double)mx[n] + std::log((double)sum[n]);  // double: see fused_classifier
        losses[n] = targets[n] < 0 ? 0.0f : (float)(((double)mx[n] - tgt[n]) + std::log((double)sum[n]));
        if (dloss == 0.0f) continue;
        T* x = logits + (size_t)n * ld;
        const float d = targets[n] < 0 ? 0.0f : dloss;
        const int t = targets[n] < 0 ? -1 : targets[n] - v0;
        for (int v = 0; v < n_real; v++)
            x[v] = (T)(d * ((float)std::exp((double)x[v] - lse) - (v == t ? 1.0f : 0.0f)));
        for (int v = std::max(n_real, 0); v < ld; v++) x[v] = T(0);
    }
}

// *out = sum of losses[0, n) in double, in token order (a micro-batch's loss sum; the trainer divides
// by the number of real targets after the step, when it reads every micro-batch's sum at once)
inline void loss_sum(double* out, const float* losses, int n) {
    double s = 0;
    for (int i = 0; i < n; i++) s += losses[i];
    *out = s;
}

}  // namespace cpu
