// The FFN nonlinearities. SwiGLU (Shazeer 2020): h = silu(a) * u where the fc output row is
// [a (H gate features) | u (H up features)], silu(a) = a * sigmoid(a). GELU: GPT-2's tanh
// approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
#pragma once
#include <algorithm>
#include <cmath>

#include "vec_math.h"

namespace cpu {

// One parallel region per op, rows shared out statically; each loop is an `omp simd` loop whose
// exp is exp_fast (llmc/cpu/vec_math.h: under 1 ulp in float), so it runs at memory speed. The
// sigmoid is 1 / (1 + exp(-a)) and 1 - sigmoid(a) = exp(-a) sigmoid(a): no cancellation anywhere.
template <typename T>
void swiglu_forward(T* out, const T* inp, int N, int H) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const T* a = inp + (size_t)n * 2 * H;
        const T* u = a + H;
        T* o = out + (size_t)n * H;
#pragma omp simd
        for (int i = 0; i < H; i++) o[i] = a[i] / (T(1) + exp_fast(-a[i])) * u[i];
    }
}

// dinp [N, 2H] overwritten
template <typename T>
void swiglu_backward(T* dinp, const T* dout, const T* inp, int N, int H) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const T* a = inp + (size_t)n * 2 * H;
        const T* u = a + H;
        const T* g = dout + (size_t)n * H;
        T* da = dinp + (size_t)n * 2 * H;
        T* du = da + H;
#pragma omp simd
        for (int i = 0; i < H; i++) {
            const T e = exp_fast(-a[i]), sig = T(1) / (T(1) + e);
            da[i] = g[i] * u[i] * sig * (T(1) + a[i] * e * sig);
            du[i] = g[i] * a[i] * sig;
        }
    }
}

#define LLMC_GELU_SCALE 0.7978845608028654  // sqrt(2 / pi)

// GELU through the identity 0.5 (1 + tanh(z)) = sigmoid(2 z), z = sqrt(2/pi) (x + 0.044715 x^3):
// gelu(x) = x / (1 + exp(-2 z)), exact in real arithmetic, and without the cancellation of
// 1 + tanh(z) for negative x. The derivative: s + 2 x s (1 - s) z' with s = sigmoid(2 z).
// Float error (against the double formula, scripts/bench_cpu.sh): see docs/CPU_PERFORMANCE.md.
template <typename T>
void gelu_forward(T* out, const T* inp, long N) {
    constexpr long CHUNK = 4096;  // elements per task: whole vectors, few tasks
#pragma omp parallel for schedule(static)
    for (long c = 0; c < N; c += CHUNK) {
        const long end = std::min(N, c + CHUNK);
#pragma omp simd
        for (long i = c; i < end; i++) {
            const T x = inp[i], z = T(LLMC_GELU_SCALE) * (x + T(0.044715) * x * x * x);
            out[i] = x / (T(1) + exp_fast(T(-2) * z));
        }
    }
}

// dinp overwritten
template <typename T>
void gelu_backward(T* dinp, const T* dout, const T* inp, long N) {
    constexpr long CHUNK = 4096;
#pragma omp parallel for schedule(static)
    for (long c = 0; c < N; c += CHUNK) {
        const long end = std::min(N, c + CHUNK);
#pragma omp simd
        for (long i = c; i < end; i++) {
            const T x = inp[i], z = T(LLMC_GELU_SCALE) * (x + T(0.044715) * x * x * x);
            const T e = exp_fast(T(-2) * z), s = T(1) / (T(1) + e);
            const T dz = T(LLMC_GELU_SCALE) * (T(1) + T(3 * 0.044715) * x * x);
            dinp[i] = dout[i] * (s + T(2) * x * s * (e * s) * dz);
        }
    }
}

}  // namespace cpu
