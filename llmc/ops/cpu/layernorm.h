// LayerNorm over the channel dimension: y = (x - mean) * rstd * w + b, rstd = 1/sqrt(var + 1e-5),
// biased variance. The forward is fused with the residual add that precedes it in a pre-norm
// block (residual = inp1 + inp2, then normalised), as the GPU kernel will do.
#pragma once
#include <algorithm>
#include <cmath>

namespace cpu {

namespace layernorm_detail {
template <typename T>
inline void normalize_row(T* y, T* mean, T* rstd, const T* x, const T* weight, const T* bias, int C) {
    T m = 0;
    for (int c = 0; c < C; c++) m += x[c];
    m /= C;
    T v = 0;
    for (int c = 0; c < C; c++) v += (x[c] - m) * (x[c] - m);
    v /= C;
    T s = T(1) / std::sqrt(v + T(1e-5));
    for (int c = 0; c < C; c++) y[c] = (x[c] - m) * s * weight[c] + bias[c];
    *mean = m;
    *rstd = s;
}
}  // namespace layernorm_detail

template <typename T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight, const T* bias,
                       int N, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        layernorm_detail::normalize_row(out + (size_t)n * C, mean + n, rstd + n, inp + (size_t)n * C, weight, bias, C);
}

// residual = inp1 + inp2; out = LN(residual), row by row in one pass
template <typename T>
void fused_residual_layernorm_forward(T* residual, T* out, T* mean, T* rstd, const T* inp1,
                                      const T* inp2, const T* weight, const T* bias, int N, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        T* r = residual + (size_t)n * C;
        const T* a = inp1 + (size_t)n * C;
        const T* b = inp2 + (size_t)n * C;
        for (int c = 0; c < C; c++) r[c] = a[c] + b[c];
        layernorm_detail::normalize_row(out + (size_t)n * C, mean + n, rstd + n, r, weight, bias, C);
    }
}

// out = inp1 + inp2: the residual add where a pipeline stage ends (the next LayerNorm is on the
// next stage; fused_residual_layernorm_forward computes exactly this sum before normalising)
template <typename T>
void residual_forward(T* out, const T* inp1, const T* inp2, long N) {
#pragma omp parallel for schedule(static)
    for (long i = 0; i < N; i++) out[i] = inp1[i] + inp2[i];
}

// dinp += dx (it is the residual stream's gradient); dweight += , dbias += with one addition of the
// complete sum over the rows per element (so accumulating into acc gives bitwise acc + the gradient
// computed alone). dinp may be null (then weight is not read) or dweight and dbias both null: the
// input and the weight gradients in two calls (the zero-bubble pipeline's split backward).
// G: the gradients' type (float; double in the finite-difference tests).
template <typename T, typename G>
void layernorm_backward(T* dinp, G* dweight, G* dbias, const T* dout, const T* inp, const T* weight,
                        const T* mean, const T* rstd, int N, int C) {
    constexpr int CB = 32;
#pragma omp parallel
    {
        if (dinp) {
#pragma omp for schedule(static) nowait
            for (int n = 0; n < N; n++) {
                const T* d = dout + (size_t)n * C;
                const T* x = inp + (size_t)n * C;
                T m = mean[n], s = rstd[n];
                // dx = s * (g - mean(g) - xhat * mean(g * xhat)), g = dout * w
                T g_mean = 0, gx_mean = 0;
                for (int c = 0; c < C; c++) {
                    T g = d[c] * weight[c];
                    g_mean += g;
                    gx_mean += g * (x[c] - m) * s;
                }
                g_mean /= C;
                gx_mean /= C;
                T* dx = dinp + (size_t)n * C;
                for (int c = 0; c < C; c++) dx[c] += s * (d[c] * weight[c] - g_mean - (x[c] - m) * s * gx_mean);
            }
        }
        // parameter gradients: threads own channel ranges and sum rows in order (deterministic),
        // then add the sums once; they write other buffers than the loop above, so no barrier
        // between the two
        if (dweight) {
#pragma omp for schedule(static)
            for (int c0 = 0; c0 < C; c0 += CB) {
                const int c1 = std::min(C, c0 + CB);
                G sw[CB] = {}, sb[CB] = {};
                for (int n = 0; n < N; n++) {
                    const T* d = dout + (size_t)n * C;
                    const T* x = inp + (size_t)n * C;
                    for (int c = c0; c < c1; c++) {
                        sw[c - c0] += (G)(d[c] * (x[c] - mean[n]) * rstd[n]);
                        sb[c - c0] += (G)d[c];
                    }
                }
                for (int c = c0; c < c1; c++) {
                    dweight[c] += sw[c - c0];
                    dbias[c] += sb[c - c0];
                }
            }
        }
    }
}

}  // namespace cpu
