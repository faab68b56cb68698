// RMSNorm over the channel dimension (Zhang & Sennrich 2019; Llama's norm): no mean, no bias,
//   y = x * rstd * w,  rstd = 1 / sqrt(sum_c x_c^2 / C + eps)
// The twin of LayerNorm (llmc/ops/cpu/layernorm.h) in every other respect: the forward fused with
// the residual add before it, rstd saved for the backward, the backward adding into dinp (the
// residual stream's gradient) and the weight gradient added once per element.
//   backward  xhat = x * rstd, g = dout * w:  dinp += rstd * (g - xhat * mean_c(g * xhat)),
//             dweight += sum_rows dout * xhat
#pragma once
#include <algorithm>
#include <cmath>

namespace cpu {

namespace rmsnorm_detail {
template <typename T>
inline void normalize_row(T* y, T* rstd, const T* x, const T* weight, int C, float eps) {
    T ss = 0;
    for (int c = 0; c < C; c++) ss += x[c] * x[c];
    const T s = T(1) / std::sqrt(ss / C + T(eps));
    for (int c = 0; c < C; c++) y[c] = x[c] * s * weight[c];
    *rstd = s;
}
}  // namespace rmsnorm_detail

template <typename T>
void rmsnorm_forward(T* out, T* rstd, const T* inp, const T* weight, int N, int C, float eps) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        rmsnorm_detail::normalize_row(out + (size_t)n * C, rstd + n, inp + (size_t)n * C, weight, C, eps);
}

// residual = inp1 + inp2; out = RMSNorm(residual), row by row in one pass
template <typename T>
void fused_residual_rmsnorm_forward(T* residual, T* out, T* rstd, const T* inp1, const T* inp2, const T* weight, int N,
                                    int C, float eps) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        T* r = residual + (size_t)n * C;
        const T* a = inp1 + (size_t)n * C;
        const T* b = inp2 + (size_t)n * C;
        for (int c = 0; c < C; c++) r[c] = a[c] + b[c];
        rmsnorm_detail::normalize_row(out + (size_t)n * C, rstd + n, r, weight, C, eps);
    }
}

// dinp += dx; dweight += the complete sum over the rows per element, added once. dinp may be null
// (then weight is not read) or dweight null: the input and the weight gradients in two calls.
// G: the gradients' type (float; double in the finite-difference tests).
template <typename T, typename G>
void rmsnorm_backward(T* dinp, G* dweight, const T* dout, const T* inp, const T* weight, const T* rstd, int N, int C) {
    constexpr int CB = 32;
#pragma omp parallel
    {
        if (dinp) {
#pragma omp for schedule(static) nowait
            for (int n = 0; n < N; n++) {
                const T* d = dout + (size_t)n * C;
                const T* x = inp + (size_t)n * C;
                const T s = rstd[n];
                T gx_mean = 0;
                for (int c = 0; c < C; c++) gx_mean += d[c] * weight[c] * x[c] * s;
                gx_mean /= C;
                T* dx = dinp + (size_t)n * C;
                for (int c = 0; c < C; c++) dx[c] += s * (d[c] * weight[c] - x[c] * s * gx_mean);
            }
        }
        if (dweight) {
#pragma omp for schedule(static)
            for (int c0 = 0; c0 < C; c0 += CB) {
                const int c1 = std::min(C, c0 + CB);
                G sw[CB] = {};
                for (int n = 0; n < N; n++) {
                    const T* d = dout + (size_t)n * C;
                    const T* x = inp + (size_t)n * C;
                    for (int c = c0; c < c1; c++) sw[c - c0] += (G)(d[c] * x[c] * rstd[n]);
                }
                for (int c = c0; c < c1; c++) dweight[c] += sw[c - c0];
            }
        }
    }
}

}  // namespace cpu
