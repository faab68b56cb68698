// CPU reference matmul for y = x W^T + b (PyTorch Linear layout: W is [OC, C]).
// All three products go through one cache-blocked kernel:
//   Cm[m, n] (+)= sum_k A(m, k) * Bm[k, n]     with A read through strides (sam, sak)
// and Bm row-major, so the innermost loop runs over contiguous n and vectorizes without a float
// reduction. Each output element is owned by one thread and summed in a fixed k order, so the
// result does not depend on the number of OpenMP threads (the CPU build is bitwise reproducible).
#pragma once
#include <algorithm>
#include <cstddef>
#include <vector>

namespace cpu {

template <typename T, int MR, int NR>
inline void gemm_tile_full(T* __restrict Cm, int ldc, const T* __restrict A, long sam, long sak,
                           const T* __restrict Bm, int ldb, int k0, int kc) {
    // MR x NR accumulators live in vector registers: one broadcast of A and one row of B per k
    T acc[MR][NR] = {};
    for (int k = k0; k < k0 + kc; k++) {
        const T* b = Bm + (size_t)k * ldb;
        for (int r = 0; r < MR; r++) {
            T a = A[r * sam + k * sak];
#pragma omp simd
            for (int j = 0; j < NR; j++) acc[r][j] += a * b[j];
        }
    }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NR; j++) Cm[(size_t)r * ldc + j] += acc[r][j];
}

// A tile at the matrix's edge (mr < MR rows or nr < NR columns) runs the full tile's kernel on a
// zero-padded copy, so every output element is computed by exactly the same arithmetic wherever its
// tile falls: the result of an element does not depend on the matrix's shape (a tensor-parallel
// rank's slice of a matmul gives bitwise the same elements as the whole matmul).
template <typename T, int MR, int NR, int KC>
inline void gemm_tile_edge(T* Cm, int ldc, const T* A, long sam, long sak, const T* Bm, int ldb, int k0, int kc,
                           int mr, int nr) {
    T a[MR * KC] = {}, b[KC * NR] = {}, c[MR * NR] = {};
    for (int r = 0; r < mr; r++)
        for (int k = 0; k < kc; k++) a[r * KC + k] = A[r * sam + (long)(k0 + k) * sak];
    for (int k = 0; k < kc; k++)
        for (int j = 0; j < nr; j++) b[k * NR + j] = Bm[(size_t)(k0 + k) * ldb + j];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nr; j++) c[r * NR + j] = Cm[(size_t)r * ldc + j];
    gemm_tile_full<T, MR, NR>(c, NR, a, KC, 1, b, NR, 0, kc);
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nr; j++) Cm[(size_t)r * ldc + j] = c[r * NR + j];
}

// Cm [M, N] = (accumulate ? Cm : 0) + A(M x K) * Bm[K, N]
template <typename T>
void gemm(T* Cm, const T* A, long sam, long sak, const T* Bm, int M, int N, int K, bool accumulate) {
    constexpr int MR = 6, NR = 16, MC = 96, KC = 256;
    if (!accumulate) {
#pragma omp parallel for schedule(static)
        for (long i = 0; i < (long)M * N; i++) Cm[i] = 0;
    }
    int m_chunks = (M + MC - 1) / MC, n_tiles = (N + NR - 1) / NR;
#pragma omp parallel for collapse(2) schedule(static)
    for (int mc = 0; mc < m_chunks; mc++) {
        for (int nt = 0; nt < n_tiles; nt++) {
            int n0 = nt * NR, nr = std::min(NR, N - n0);
            int m_end = std::min(M, (mc + 1) * MC);
            for (int k0 = 0; k0 < K; k0 += KC) {
                int kc = std::min(KC, K - k0);
                for (int m0 = mc * MC; m0 < m_end; m0 += MR) {
                    int mr = std::min(MR, m_end - m0);
                    if (mr == MR && nr == NR)
                        gemm_tile_full<T, MR, NR>(Cm + (size_t)m0 * N + n0, N, A + m0 * sam, sam, sak,
                                                  Bm + n0, N, k0, kc);
                    else
                        gemm_tile_edge<T, MR, NR, KC>(Cm + (size_t)m0 * N + n0, N, A + m0 * sam, sam, sak, Bm + n0, N,
                                                      k0, kc, mr, nr);
                }
            }
        }
    }
}

// out[BT, OC] = inp[BT, C] W[OC, C]^T + bias[OC] (bias may be null)
template <typename T>
void matmul_forward(T* out, const T* inp, const T* weight, const T* bias, int BT, int C, int OC) {
    // the kernel wants the right operand contiguous in n = OC: transpose W once per call (O(OC*C),
    // small next to the O(BT*OC*C) product)
    static thread_local std::vector<T> weight_t;
    weight_t.resize((size_t)OC * C);
    T* wt = weight_t.data();  // (thread_local: OpenMP workers must use the caller's buffer)
#pragma omp parallel for schedule(static)
    for (int i = 0; i < C; i++)
        for (int o = 0; o < OC; o++) wt[(size_t)i * OC + o] = weight[(size_t)o * C + i];
    if (bias) {
#pragma omp parallel for schedule(static)
        for (int bt = 0; bt < BT; bt++)
            for (int o = 0; o < OC; o++) out[(size_t)bt * OC + o] = bias[o];
    }
    gemm<T>(out, inp, C, 1, wt, BT, OC, C, bias != nullptr);
}

// dinp[BT, C] = dout W (overwritten); dweight += dout^T inp; dbias += column sums of dout. Any of the
// three may be null: the zero-bubble pipeline computes the input gradient (dinp) and the weight
// gradients (dweight, dbias) in two calls of this same function, at different times.
template <typename T>
void matmul_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                     int BT, int C, int OC) {
    if (dinp) gemm<T>(dinp, dout, OC, 1, weight, BT, C, OC, false);
    if (dweight) gemm<T>(dweight, dout, 1, OC, inp, OC, C, BT, true);
    if (dbias) {
        constexpr int OB = 64;
#pragma omp parallel for schedule(static)
        for (int o0 = 0; o0 < OC; o0 += OB) {
            int o1 = std::min(OC, o0 + OB);
            for (int bt = 0; bt < BT; bt++)
                for (int o = o0; o < o1; o++) dbias[o] += dout[(size_t)bt * OC + o];
        }
    }
}

}  // namespace cpu

namespace cpu {

// n_batch independent products with contiguous operands (the experts of an MoE layer):
// out[b] [BT, OC] = inp[b] [BT, C] weight[b] [OC, C]^T + bias[b] [OC]
template <typename T>
void matmul_forward_batched(T* out, const T* inp, const T* weight, const T* bias, int n_batch, int BT, int C, int OC) {
    for (int b = 0; b < n_batch; b++)
        matmul_forward(out + (size_t)b * BT * OC, inp + (size_t)b * BT * C, weight + (size_t)b * OC * C,
                       bias ? bias + (size_t)b * OC : nullptr, BT, C, OC);
}

// the backward of each product, as matmul_backward: dinp overwritten, dweight and dbias +=; each may be null
template <typename T>
void matmul_backward_batched(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight, int n_batch,
                             int BT, int C, int OC) {
    for (int b = 0; b < n_batch; b++)
        matmul_backward(dinp ? dinp + (size_t)b * BT * C : nullptr, dweight ? dweight + (size_t)b * OC * C : nullptr,
                        dbias ? dbias + (size_t)b * OC : nullptr,
                        dout + (size_t)b * BT * OC, inp + (size_t)b * BT * C, weight + (size_t)b * OC * C, BT, C, OC);
}

}  // namespace cpu
