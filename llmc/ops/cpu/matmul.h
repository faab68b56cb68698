// CPU reference matmul for y = x W^T + b (PyTorch Linear layout: W is [OC, C]).
// All three products go through one packed, cache-blocked kernel:
//   Cm[m, n] (+)= sum_k A(m, k) * B(k, n)     A and B read through strides (sam, sak), (sbk, sbn)
// Per k block of KC, the block's A is copied into MR-row panels and its B into NR-column panels
// (zero-padded at the edges), so the register tile reads contiguous memory whatever the strides
// (a weight-gradient product reads dout column-wise; a 4 KB row stride aliases in the cache).
// Every output element gets the same arithmetic wherever its tile falls and whatever the shape:
//   a_b = 0; a_b += A(m, k) B(k, n) for the KC k's of block b in order
//   S = (((base + a_0) + a_1) + ...)        base: the bias or 0
// and Cm = S (overwrite) or Cm = Cm + S with base 0 (accumulate: one addition into Cm per call, so
// accumulating into acc gives bitwise acc + the product computed alone, which is what lets gradient
// accumulation over micro-batches be reproduced by any parallel layout). So the result of an
// element does not depend on the matrix's shape (a tensor-parallel rank's slice of a matmul gives
// bitwise the elements of the whole matmul), on the tile sizes MR x NR (chosen per instruction set
// below: an AVX2 and an AVX-512 machine agree), or on the number of OpenMP threads (each element is
// owned by one thread). T is the operands' type, G the output's: the same in a forward product;
// a weight gradient is G = float (double in the finite-difference tests).
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
// An accumulating product of more than one k block keeps its running sums S in a scratch (added
// into Cm with the last block) of at most this many elements: a taller Cm is done in row groups.
constexpr long PARTIAL_ELEMS = 1 << 20;

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

// where a block's sums acc land in Cm's tile c (p: the same tile of the running sums' scratch)
enum class Base {
    kOut,      // c = c + acc       (a later block; or an accumulating product of one block)
    kBias,     // c = bias + acc    (the first block of a forward with a bias)
    kZero,     // c = 0 + acc       (the first block, no bias: the same additions as a zero-filled c)
    kPartial,  // c = c + (p + acc) (the last block of an accumulating product of several blocks)
};

template <Base base, typename T, typename G>
inline void store_tile(G* __restrict Cm, int ldc, const G* __restrict p, const T (&acc)[MR][NR], int mr, int nr,
                       const T* __restrict bias) {
    auto one = [&](int r, int j) {
        G* c = Cm + (size_t)r * ldc;
        if constexpr (base == Base::kOut) c[j] = c[j] + (G)acc[r][j];
        if constexpr (base == Base::kBias) c[j] = (G)bias[j] + (G)acc[r][j];
        if constexpr (base == Base::kZero) c[j] = G(0) + (G)acc[r][j];
        if constexpr (base == Base::kPartial) c[j] = c[j] + (p[(size_t)r * ldc + j] + (G)acc[r][j]);
    };
    if (mr == MR && nr == NR) {
        for (int r = 0; r < MR; r++) {
#pragma omp simd
            for (int j = 0; j < NR; j++) one(r, j);
        }
        return;
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nr; j++) one(r, j);
}

// acc = A panel (element (r, k) at ap[r * a_rs + k * a_ks]) x bp [kc][NR]; then Cm's mr x nr corner
// as base says
template <typename T, typename G>
inline void micro_tile(G* __restrict Cm, int ldc, const G* __restrict p, const T* __restrict ap, long a_rs,
                       long a_ks, const T* __restrict bp, int kc, int mr, int nr, Base base,
                       const T* __restrict bias) {
    T acc[MR][NR] = {};
    for (int k = 0; k < kc; k++) {
        const T* b = bp + (size_t)k * NR;
        for (int r = 0; r < MR; r++) {
            const T a = ap[r * a_rs + k * a_ks];
#pragma omp simd
            for (int j = 0; j < NR; j++) acc[r][j] += a * b[j];
        }
    }
    switch (base) {  // one loop per case: the vector loop has no branch
        case Base::kOut: store_tile<Base::kOut>(Cm, ldc, p, acc, mr, nr, bias); break;
        case Base::kBias: store_tile<Base::kBias>(Cm, ldc, p, acc, mr, nr, bias); break;
        case Base::kZero: store_tile<Base::kZero>(Cm, ldc, p, acc, mr, nr, bias); break;
        case Base::kPartial: store_tile<Base::kPartial>(Cm, ldc, p, acc, mr, nr, bias); break;
    }
}

// gemm_team on M rows; partial: an M x N scratch when accumulating over several k blocks, else null
template <typename T, typename G>
void gemm_rows(G* Cm, const T* A, long sam, long sak, const T* Bm, long sbk, long sbn, int M, int N, int K,
               bool accumulate, const T* bias, Packs<T>& packs, G* partial) {
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
                if (!accumulate) Cm[(size_t)m * N + n] = bias ? (G)bias[n] : G(0);
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
        // the running sums go to Cm, or to the scratch until the last block adds them into Cm
        const bool first = k0 == 0, last = k0 + KC >= K;
        G* dst = partial && !last ? partial : Cm;
        const Base base = partial ? (first ? Base::kZero : last ? Base::kPartial : Base::kOut)
                                  : (!first || accumulate) ? Base::kOut : bias ? Base::kBias : Base::kZero;
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
                    const size_t at = (size_t)m0 * N + n0;
                    G* c = dst + at;
                    const G* pt = partial ? partial + at : nullptr;
                    const T* bias_n = bias ? bias + n0 : nullptr;
                    if (pack_a)
                        micro_tile(c, N, pt, ap_all + (size_t)mp * MR * KC, 1, MR, bp, kc, mr, nr, base, bias_n);
                    else if (mr == MR)
                        micro_tile(c, N, pt, A + m0 * sam + k0 * sak, sam, 1, bp, kc, mr, nr, base, bias_n);
                    else
                        micro_tile(c, N, pt, edge_a, 1, MR, bp, kc, mr, nr, base, bias_n);
                }
            }
    }
}
// the rows of a row group of an accumulating product (whole tasks, the scratch within PARTIAL_ELEMS)
inline int partial_rows(int N) { return (int)std::max<long>(MC, PARTIAL_ELEMS / std::max(N, 1) / MC * MC); }

// the scratch gemm_team needs for an accumulating M x N x K product (grows only; before the region)
template <typename G>
void reserve_partial(std::vector<G>& partial, int M, int N, int K) {
    if (K > KC) partial.resize(std::max(partial.size(), (size_t)std::min(M, partial_rows(N)) * N));
}

// Cm [M, N] = (accumulate ? Cm + S : S), S = (bias or 0) + A(M x K) B(K x N) (see the top of the
// file), inside an OpenMP parallel region (every thread of the team calls it; orphaned worksharing
// loops, so an op runs several products in one region). packs: reserved for M, N by the caller,
// shared by the team; partial: reserve_partial's scratch when accumulating. A row group's elements
// get the arithmetic of the whole product's (every element's sums are its own), so the groups leave
// the result as it is.
template <typename T, typename G>
void gemm_team(G* Cm, const T* A, long sam, long sak, const T* Bm, long sbk, long sbn, int M, int N, int K,
               bool accumulate, const T* bias, Packs<T>& packs, std::vector<G>& partial) {
    if (!accumulate || K <= KC) {  // the k blocks' sums go straight into Cm: the first one onto its base
        gemm_rows<T, G>(Cm, A, sam, sak, Bm, sbk, sbn, M, N, K, accumulate, bias, packs, nullptr);
        return;
    }
    const int rows = partial_rows(N);
    for (int m0 = 0; m0 < M; m0 += rows)
        gemm_rows<T, G>(Cm + (size_t)m0 * N, A + m0 * sam, sam, sak, Bm, sbk, sbn, std::min(rows, M - m0), N, K, true,
                        nullptr, packs, partial.data());
}
static_assert(MC % MR == 0, "a task's rows are whole panels");
}  // namespace gemm_detail

// Cm [M, N] = (accumulate ? Cm + S : S), S = A(M x K) * Bm[K, N]
template <typename T>
void gemm(T* Cm, const T* A, long sam, long sak, const T* Bm, int M, int N, int K, bool accumulate) {
    static thread_local gemm_detail::Packs<T> packs;  // (thread_local: the team uses the caller's)
    static thread_local std::vector<T> partial;
    packs.reserve(M, N);
    if (accumulate) gemm_detail::reserve_partial(partial, M, N, K);
    gemm_detail::Packs<T>* p = &packs;
    std::vector<T>* q = &partial;
#pragma omp parallel
    gemm_detail::gemm_team<T, T>(Cm, A, sam, sak, Bm, N, 1, M, N, K, accumulate, nullptr, *p, *q);
}

// out[BT, OC] = inp[BT, C] W[OC, C]^T + bias[OC] (bias may be null)
template <typename T>
void matmul_forward(T* out, const T* inp, const T* weight, const T* bias, int BT, int C, int OC) {
    static thread_local gemm_detail::Packs<T> packs;
    static thread_local std::vector<T> unused;  // (no scratch without accumulation)
    packs.reserve(BT, OC);
    gemm_detail::Packs<T>* p = &packs;
    std::vector<T>* q = &unused;
    // B(k = c, n = o) = W[o, c]: the packing reads W's rows, no transposed copy
#pragma omp parallel
    gemm_detail::gemm_team<T, T>(out, inp, C, 1, weight, 1, C, BT, OC, C, false, bias, *p, *q);
}

// dinp[BT, C] = dout W (overwritten); dweight += dout^T inp; dbias += column sums of dout, each
// weight-gradient element with one addition of its complete sum (so accumulating into acc gives
// bitwise acc + the gradient computed alone). Any of the three may be null: the zero-bubble
// pipeline computes the input gradient (dinp) and the weight gradients (dweight, dbias) in two
// calls of this same function, at different times. G: the gradients' type (float; double in the
// finite-difference tests).
// The last parameter mirrors the CUDA op's split_k (whether its fp32 dweight may take the split over
// K, llmc/ops/matmul.cuh): the signatures stay one, and here it changes nothing (no split).
template <typename T, typename G>
void matmul_backward(T* dinp, G* dweight, G* dbias, const T* dout, const T* inp, const T* weight, int BT, int C,
                     int OC, bool /*split_k*/ = false) {
    static thread_local gemm_detail::Packs<T> packs;
    static thread_local std::vector<T> unused;
    static thread_local std::vector<G> partial;
    if (dinp) packs.reserve(BT, C);
    if (dweight) {
        packs.reserve(OC, C);
        gemm_detail::reserve_partial(partial, OC, C, BT);
    }
    gemm_detail::Packs<T>* p = &packs;
    std::vector<T>* u = &unused;
    std::vector<G>* q = &partial;
#pragma omp parallel
    {
        if (dinp) gemm_detail::gemm_team<T, T>(dinp, dout, OC, 1, weight, C, 1, BT, C, OC, false, nullptr, *p, *u);
        if (dweight) gemm_detail::gemm_team<T, G>(dweight, dout, 1, OC, inp, C, 1, OC, C, BT, true, nullptr, *p, *q);
        if (dbias) {  // a thread's OB columns summed over the rows in order, then added once
            constexpr int OB = 64;
#pragma omp for schedule(static)
            for (int o0 = 0; o0 < OC; o0 += OB) {
                const int o1 = std::min(OC, o0 + OB);
                G sum[OB] = {};
                for (int bt = 0; bt < BT; bt++)
                    for (int o = o0; o < o1; o++) sum[o - o0] += (G)dout[(size_t)bt * OC + o];
                for (int o = o0; o < o1; o++) dbias[o] += sum[o - o0];
            }
        }
    }
}

}  // namespace cpu

namespace cpu {

// The second half of the GPU's split-K weight gradient (llmc/ops/matmul.cuh, issue 35): the P
// partial products partials[p][n] of K chunks p = 0..P-1 (in row order), summed in chunk order and
// added to the accumulator once (the gradient-path contract: dweight + S, S independent of dweight):
//   dweight[i] = dweight[i] + (((partials[0][i] + partials[1][i]) + partials[2][i]) + ...)
// Each element is P fp32 additions rounded to nearest in that order: the GPU twin produces the same
// bits. The CPU build does not split (its gemm's arithmetic is fixed per element, above); this is the
// kernel's oracle.
inline void matmul_dweight_reduce(float* dweight, const float* partials, int P, size_t n) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float s = partials[i];
        for (int p = 1; p < P; p++) s = s + partials[(size_t)p * n + i];
        dweight[i] = dweight[i] + s;
    }
}

// n_batch independent products with contiguous operands (the experts of an MoE layer):
// out[b] [BT, OC] = inp[b] [BT, C] weight[b] [OC, C]^T + bias[b] [OC]
template <typename T>
void matmul_forward_batched(T* out, const T* inp, const T* weight, const T* bias, int n_batch, int BT, int C, int OC) {
    for (int b = 0; b < n_batch; b++)
        matmul_forward(out + (size_t)b * BT * OC, inp + (size_t)b * BT * C, weight + (size_t)b * OC * C,
                       bias ? bias + (size_t)b * OC : nullptr, BT, C, OC);
}

// the backward of each product, as matmul_backward: dinp overwritten, dweight and dbias += (one addition
// of the complete sum per element); each may be null
template <typename T, typename G>
void matmul_backward_batched(T* dinp, G* dweight, G* dbias, const T* dout, const T* inp, const T* weight, int n_batch,
                             int BT, int C, int OC) {
    for (int b = 0; b < n_batch; b++)
        matmul_backward(dinp ? dinp + (size_t)b * BT * C : nullptr, dweight ? dweight + (size_t)b * OC * C : nullptr,
                        dbias ? dbias + (size_t)b * OC : nullptr,
                        dout + (size_t)b * BT * OC, inp + (size_t)b * BT * C, weight + (size_t)b * OC * C, BT, C, OC);
}

}  // namespace cpu
