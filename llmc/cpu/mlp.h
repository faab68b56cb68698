// The FFN nonlinearities. SwiGLU (Shazeer 2020): h = silu(a) * u where the fc output row is
// [a (H gate features) | u (H up features)], silu(a) = a * sigmoid(a). GELU: GPT-2's tanh
// approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
#pragma once
#include <cmath>

namespace cpu {

template <typename T>
void swiglu_forward(T* out, const T* inp, int N, int H) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const T* a = inp + (size_t)n * 2 * H;
        const T* u = a + H;
        for (int i = 0; i < H; i++) out[(size_t)n * H + i] = a[i] / (T(1) + std::exp(-a[i])) * u[i];
    }
}

// dinp [N, 2H] overwritten
template <typename T>
void swiglu_backward(T* dinp, const T* dout, const T* inp, int N, int H) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const T* a = inp + (size_t)n * 2 * H;
        const T* u = a + H;
        T* da = dinp + (size_t)n * 2 * H;
        T* du = da + H;
        for (int i = 0; i < H; i++) {
            T d = dout[(size_t)n * H + i];
            T sig = T(1) / (T(1) + std::exp(-a[i]));
            T silu = a[i] * sig;
            da[i] = d * u[i] * sig * (T(1) + a[i] * (T(1) - sig));
            du[i] = d * silu;
        }
    }
}

#define LLMC_GELU_SCALE 0.7978845608028654  // sqrt(2 / pi)

template <typename T>
void gelu_forward(T* out, const T* inp, long N) {
#pragma omp parallel for schedule(static)
    for (long i = 0; i < N; i++) {
        T x = inp[i];
        out[i] = T(0.5) * x * (T(1) + std::tanh(T(LLMC_GELU_SCALE) * (x + T(0.044715) * x * x * x)));
    }
}

// dinp overwritten
template <typename T>
void gelu_backward(T* dinp, const T* dout, const T* inp, long N) {
#pragma omp parallel for schedule(static)
    for (long i = 0; i < N; i++) {
        T x = inp[i];
        T th = std::tanh(T(LLMC_GELU_SCALE) * (x + T(0.044715) * x * x * x));
        T dth = (T(1) - th * th) * T(LLMC_GELU_SCALE) * (T(1) + T(3 * 0.044715) * x * x);
        dinp[i] = dout[i] * (T(0.5) * (T(1) + th) + T(0.5) * x * dth);
    }
}

}  // namespace cpu
