// CPU reference matmul for y = x W^T + b (PyTorch Linear layout: W is [OC, C]).
// All three products go through one packed, cache-blocked kernel:
//   Cm[m, n] (+)= sum_k A(m, k) * B(k, n)     A and B read through strides (sam, sak), (sbk, sbn)
// Per k block of KC, the block's A is copied into MR-row panels and its B into NR-column panels
// (zero-padded at the edges), so the register tile reads contiguous memory whatever the strides
// (a weight-gradient product reads dout column-wise; a 4 KB row stride aliases in the cache).
// Every output element gets the same arithmetic wherever its tile falls and whatever the shape:
//   acc = 0; acc += A(m, k) B(k, n) for the KC k's of a block in order; Cm = Cm + acc
// block by block, Cm starting at its old value (accumulate), the bias or 0. So the result of an
// element does not depend on the matrix's shape (a tensor-parallel rank's slice of a matmul gives
// bitwise the elements of the whole matmul), on the tile sizes MR x NR (chosen per instruction set
// below: an AVX2 and an AVX-512 machine agree), or on the number of OpenMP threads (each element is
// owned by one thread).
#pragma once
#include <algorithm>
#include <cstddef>
#include <vector>

namespace cpu {

namespace gemm_detail {
constexpr int KC = 256;  // the k block: part of the arithmetic above (never tuned per machine)
#ifdef __AVX512F__
constexpr int MR = 6, NR = 32;  // 24 accumulators of 8 floats: AVX-512 has 32 vector registers
#else
constexpr int MR = 6, NR = 16;  // 12 accumulators: fits AVX2's 16 registers
#endif
constexpr int MC = 96;  // at most this many rows of A per task: MC x KC of packed A stays in the L2 cache

// The packed blocks of one gemm (caller-owned, so one allocation serves an op's several products).
template <typename T>
struct Packs {
    std::vector<T> a, b;
    T edge_a[MR * KC];  // the last A panel of a row-major A, zero-padded
    void reserve(int M, int N) {  // grows only
        a.resize(std::max(a.size(), (size_t)((M + MR - 1) / MR) * MR * KC));
        b.resize(std::max(b.size(), (size_t)((N + NR - 1) / NR) * NR * KC));
    }
};

// acc = A panel (element (r, k) at ap[r * a_rs + k * a_ks]) x bp [kc][NR]; Cm's mr x nr corner =
// base + acc (base: Cm, the bias row or 0)
template <typename T>
inline void micro_tile(T* __restrict Cm, int ldc, const T* __restrict ap, long a_rs, long a_ks,
                       const T* __restrict bp, int kc, int mr, int nr, int base_mode, const T* __restrict bias) {
    T acc[MR][NR] = {};
    for (int k = 0; k < kc; k++) {
        const T* b = bp + (size_t)k * NR;
        for (int r = 0; r < MR; r++) {
            const T a = ap[r * a_rs + k * a_ks];
#pragma omp simd
            for (int j = 0; j < NR; j++) acc[r][j] += a * b[j];
        }
    }
    // base_mode 0: Cm + acc; 1: bias + acc; 2: 0 + acc (the same additions as a zero-filled Cm)
    if (mr == MR && nr == NR) {
        for (int r = 0; r < MR; r++) {
            T* c = Cm + (size_t)r * ldc;
#pragma omp simd
            for (int j = 0; j < NR; j++)
                c[j] = (base_mode == 0 ? c[j] : base_mode == 1 ? bias[j] : T(0)) + acc[r][j];
        }
        return;
    }
    for (int r = 0; r < mr; r++) {
        T* c = Cm + (size_t)r * ldc;
        for (int j = 0; j < nr; j++) c[j] = (base_mode == 0 ? c[j] : base_mode == 1 ? bias[j] : T(0)) + acc[r][j];
    }
}

// Cm [M, N] = (accumulate ? Cm : bias or 0) + A(M x K) B(K x N), inside an OpenMP parallel region
// (every thread of the team calls it; orphaned worksharing loops, so an op runs several products
// in one region). packs: reserved for M, N by the caller, shared by the team.
template <typename T>
void gemm_team(T* Cm, const T* A, long sam, long sak, const T* Bm, long sbk, long sbn, int M, int N, int K,
               bool accumulate, const T* bias, Packs<T>& packs) {
    const bool pack_a = sak != 1;
    T* ap_all = packs.a.data();
    T* bp_all = packs.b.data();
    T* edge_a = packs.edge_a;
    const int m_panels = (M + MR - 1) / MR, n_panels = (N + NR - 1) / NR;
    // tasks of equal size: M = 128 as 2 x 11 panels rather than 16 + 6 (the threads' loads balance)
    const int m_chunks = (m_panels + MC / MR - 1) / (MC / MR), chunk_panels = (m_panels + m_chunks - 1) / m_chunks;
    if (K == 0) {  // no k block: the result is the base alone
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++)
                if (!accumulate) Cm[(size_t)m * N + n] = bias ? bias[n] : T(0);
        return;
    }
    for (int k0 = 0; k0 < K; k0 += KC) {
        const int kc = std::min(KC, K - k0);
#pragma omp for schedule(static) nowait
        for (int np = 0; np < n_panels; np++) {
            T* bp = bp_all + (size_t)np * NR * KC;
            const int n0 = np * NR, nr = std::min(NR, N - n0);
            if (sbn == 1) {
                for (int k = 0; k < kc; k++) {
                    const T* src = Bm + (k0 + k) * sbk + n0;
                    for (int j = 0; j < nr; j++) bp[k * NR + j] = src[j];
                    for (int j = nr; j < NR; j++) bp[k * NR + j] = T(0);
                }
            } else {
                for (int j = 0; j < nr; j++) {
                    const T* src = Bm + (n0 + j) * sbn + k0 * sbk;
                    for (int k = 0; k < kc; k++) bp[k * NR + j] = src[k * sbk];
                }
                for (int k = 0; k < kc; k++)
                    for (int j = nr; j < NR; j++) bp[k * NR + j] = T(0);
            }
        }
        // A is packed only when it is read column-wise (the weight gradient's dout^T: its rows are
        // OC apart, a 4 KB stride at OC = 1024); a row-major A is read in place (MR rows, contiguous
        // k), except for the last panel's missing rows, which come from a zero-padded copy
        if (pack_a) {
#pragma omp for schedule(static)
            for (int mp = 0; mp < m_panels; mp++) {
                T* ap = ap_all + (size_t)mp * MR * KC;
                const int m0 = mp * MR, mr = std::min(MR, M - m0);
                for (int k = 0; k < kc; k++) {
                    const T* src = A + (k0 + k) * sak + m0 * sam;
                    for (int r = 0; r < mr; r++) ap[k * MR + r] = src[r * sam];
                    for (int r = mr; r < MR; r++) ap[k * MR + r] = T(0);
                }
            }
        } else {
#pragma omp single
            {
                const int m0 = (m_panels - 1) * MR, mr = M - m0;
                for (int k = 0; k < kc; k++)
                    for (int r = 0; r < MR; r++) edge_a[k * MR + r] = r < mr ? A[(m0 + r) * sam + (k0 + k) * sak] : T(0);
            }
        }
        const int base_mode = (k0 > 0 || accumulate) ? 0 : bias ? 1 : 2;
        // a task: up to MC rows of A (in L2) times one B panel (in L1); every element is owned by one
        // task, so a dynamic schedule (which balances the threads when other jobs share the cores)
        // leaves the result as it is
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int mc = 0; mc < m_chunks; mc++)
            for (int np = 0; np < n_panels; np++) {
                const int n0 = np * NR, nr = std::min(NR, N - n0);
                const T* bp = bp_all + (size_t)np * NR * KC;
                const int mp_end = std::min(m_panels, (mc + 1) * chunk_panels);
                for (int mp = mc * chunk_panels; mp < mp_end; mp++) {
                    const int m0 = mp * MR, mr = std::min(MR, M - m0);
                    T* c = Cm + (size_t)m0 * N + n0;
                    const T* bias_n = bias ? bias + n0 : nullptr;
                    if (pack_a)
                        micro_tile(c, N, ap_all + (size_t)mp * MR * KC, 1, MR, bp, kc, mr, nr, base_mode, bias_n);
                    else if (mr == MR)
                        micro_tile(c, N, A + m0 * sam + k0 * sak, sam, 1, bp, kc, mr, nr, base_mode, bias_n);
                    else
                        micro_tile(c, N, edge_a, 1, MR, bp, kc, mr, nr, base_mode, bias_n);
                }
            }
    }
}
static_assert(MC % MR == 0, "a task's rows are whole panels");
}  // namespace gemm_detail

// Cm [M, N] = (accumulate ? Cm : 0) + A(M x K) * Bm[K, N]
template <typename T>
void gemm(T* Cm, const T* A, long sam, long sak, const T* Bm, int M, int N, int K, bool accumulate) {
    static thread_local gemm_detail::Packs<T> packs;  // (thread_local: the team uses the caller's)
    packs.reserve(M, N);
    gemm_detail::Packs<T>* p = &packs;
#pragma omp parallel
    gemm_detail::gemm_team<T>(Cm, A, sam, sak, Bm, N, 1, M, N, K, accumulate, nullptr, *p);
}

// out[BT, OC] = inp[BT, C] W[OC, C]^T + bias[OC] (bias may be null)
template <typename T>
void matmul_forward(T* out, const T* inp, const T* weight, const T* bias, int BT, int C, int OC) {
    static thread_local gemm_detail::Packs<T> packs;
    packs.reserve(BT, OC);
    gemm_detail::Packs<T>* p = &packs;
    // B(k = c, n = o) = W[o, c]: the packing reads W's rows, no transposed copy
#pragma omp parallel
    gemm_detail::gemm_team<T>(out, inp, C, 1, weight, 1, C, BT, OC, C, false, bias, *p);
}

// dinp[BT, C] = dout W (overwritten); dweight += dout^T inp; dbias += column sums of dout. Any of the
// three may be null: the zero-bubble pipeline computes the input gradient (dinp) and the weight
// gradients (dweight, dbias) in two calls of this same function, at different times.
template <typename T>
void matmul_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                     int BT, int C, int OC) {
    static thread_local gemm_detail::Packs<T> packs;
    if (dinp) packs.reserve(BT, C);
    if (dweight) packs.reserve(OC, C);
    gemm_detail::Packs<T>* p = &packs;
#pragma omp parallel
    {
        if (dinp) gemm_detail::gemm_team<T>(dinp, dout, OC, 1, weight, C, 1, BT, C, OC, false, nullptr, *p);
        if (dweight) gemm_detail::gemm_team<T>(dweight, dout, 1, OC, inp, C, 1, OC, C, BT, true, nullptr, *p);
        if (dbias) {
            constexpr int OB = 64;
#pragma omp for schedule(static)
            for (int o0 = 0; o0 < OC; o0 += OB) {
                const int o1 = std::min(OC, o0 + OB);
                for (int bt = 0; bt < BT; bt++)
                    for (int o = o0; o < o1; o++) dbias[o] += dout[(size_t)bt * OC + o];
            }
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
