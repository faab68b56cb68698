// Causal self-attention over packed documents with grouped-query heads and ALiBi.
//   qkv row (one token): [q heads: n_head*hs | k heads: n_kv_head*hs | v heads: n_kv_head*hs]
//   query head h reads kv head h / (n_head / n_kv_head)
//   score(i, j) = q_i.k_j / sqrt(hs) - slope_h * (i - j)     (ALiBi term only when alibi_n_head > 0)
//   slope_h = alibi_slope(head0 + h, alibi_n_head): the slope of the head's GLOBAL index in a model of
//   alibi_n_head heads (0: no ALiBi). head0 = 0, alibi_n_head = n_head for the whole model.
//   key j is visible to query i iff doc_start[i] <= j <= i   (own document, causal)
// Tensor parallelism (Megatron): a rank holding the query heads [head0, head0 + n_head) of the model
// and the kv heads they read calls the op with its local n_head, n_kv_head (qkv rows hold only its
// heads), head0 and the model's head count as alibi_n_head. Heads are independent, so each local head
// gives bitwise the full model's result for that head; a kv head read by several ranks (n_kv_head <
// tp) gets its dK/dV as the sum of their partial results.
// Like a flash-attention kernel, the forward keeps only the per-row log-sum-exp of the scores and
// the backward recomputes the probabilities from it, so the CPU reference has the same signature
// and the same saved state as the GPU kernel, and no T x T buffer.
#pragma once
#include <algorithm>
#include <cmath>
#include <vector>

#include "vec_math.h"

namespace cpu {

// ALiBi slopes (Press et al. 2022, "Train Short, Test Long"): for n a power of two the geometric
// sequence 2^(-8(h+1)/n); otherwise the m = 2^floor(log2 n) slopes of m heads followed by every
// other slope (indices 0, 2, 4, ...) of the 2m-head sequence, the first n - m of them.
inline double alibi_slope(int h, int n_head) {
    int m = 1;
    while (m * 2 <= n_head) m *= 2;
    if (h < m) return std::pow(2.0, -8.0 * (h + 1) / m);
    return std::pow(2.0, -8.0 * (2 * (h - m) + 1) / (2 * m));
}

namespace attention_detail {
constexpr int QB = 8;   // query rows per block: the scores of a block are a QB x keys product
constexpr int JW = 16;  // keys per score tile (two 8-float vectors)
constexpr int RB = 4;   // rows per P V / dS K register tile
constexpr int DW = 32;  // head-dim columns per P V / dS K register tile
inline int round_up(int n, int w) { return (n + w - 1) / w * w; }

// s[r][j] = sum_d x[r][d] kt[d][j] for the QB rows of x ([QB][ldx], rows past the block zero) and
// the key tiles [jt0, jhi) (kt: [hs][ldk], columns past T zero). Each score is one chain of
// multiply-adds in d order whatever the tile: the same arithmetic as a plain dot product loop.
template <typename T>
inline void score_tiles(T* __restrict s, int lds, const T* __restrict x, int ldx, const T* __restrict kt, int ldk,
                        int hs, int jt0, int jhi) {
    for (int jt = jt0; jt < jhi; jt += JW) {
        T acc[QB][JW] = {};
        for (int d = 0; d < hs; d++) {
            const T* k = kt + (size_t)d * ldk + jt;
            for (int r = 0; r < QB; r++) {
                const T xd = x[r * ldx + d];
#pragma omp simd
                for (int j = 0; j < JW; j++) acc[r][j] += xd * k[j];
            }
        }
        for (int r = 0; r < QB; r++)
#pragma omp simd
            for (int j = 0; j < JW; j++) s[r * lds + jt + j] = acc[r][j];
    }
}

// acc[r][0..DW) = sum_{j in [j0, j1)} w[r][j] y[j][dc .. dc + DW) for RB rows of w ([.][ldw]) and
// y ([T][ldy], ldy a multiple of DW): the P V product of the forward, dS K of the backward
template <typename T>
inline void weighted_rows(T (&acc)[RB][DW], const T* __restrict w, int ldw, const T* __restrict y, int ldy, int dc,
                          int j0, int j1) {
    for (int r = 0; r < RB; r++)
        for (int d = 0; d < DW; d++) acc[r][d] = 0;
    for (int j = j0; j < j1; j++) {
        const T* yr = y + (size_t)j * ldy + dc;
        for (int r = 0; r < RB; r++) {
            const T wr = w[r * ldw + j];
#pragma omp simd
            for (int d = 0; d < DW; d++) acc[r][d] += wr * yr[d];
        }
    }
}
}  // namespace attention_detail

// Work per (row b, query head h): K of the head's kv head transposed and V copied into contiguous
// scratch, then blocks of QB queries against the keys [doc_start of the block's first query, the
// block's last query]: scores as a small matrix product, the masked softmax row by row (exp_fast:
// vectorised, masked entries exactly 0), P V as another. A head's results depend only on its own
// inputs (tensor-parallel head slices are bitwise the full model's heads) and not on which thread
// runs it (tasks are whole heads, so the schedule can be dynamic).
template <typename T>
void attention_forward(T* out, T* lse, const T* qkv, const int* doc_start, int B, int T_, int n_head,
                       int n_kv_head, int hs, int alibi_n_head, int head0) {
    using namespace attention_detail;
    const int row = (n_head + 2 * n_kv_head) * hs, group = n_head / n_kv_head;
    const T scale = T(1) / std::sqrt(T(hs));
    const int Tp = round_up(T_, JW), hsp = round_up(hs, DW);
#pragma omp parallel
    {
        std::vector<T> kt((size_t)hs * Tp, T(0)), v((size_t)T_ * hsp, T(0)), p((size_t)QB * Tp), x((size_t)QB * hs);
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < n_head; h++) {
                const T* base = qkv + (size_t)b * T_ * row;
                const int* ds = doc_start + (size_t)b * T_;
                const int kh = h / group;
                const T slope = alibi_n_head > 0 ? T(alibi_slope(head0 + h, alibi_n_head)) : T(0);
                for (int j = 0; j < T_; j++) {
                    const T* k = base + (size_t)j * row + (n_head + kh) * hs;
                    const T* vj = base + (size_t)j * row + (n_head + n_kv_head + kh) * hs;
                    for (int d = 0; d < hs; d++) {
                        kt[(size_t)d * Tp + j] = k[d];
                        v[(size_t)j * hsp + d] = vj[d];
                    }
                }
                for (int i0 = 0; i0 < T_; i0 += QB) {
                    const int nq = std::min(QB, T_ - i0), jhi = i0 + nq;
                    int jlo = ds[i0];
                    for (int r = 1; r < nq; r++) jlo = std::min(jlo, ds[i0 + r]);
                    const int jt0 = jlo / JW * JW, jt1 = round_up(jhi, JW);
                    for (int r = 0; r < QB; r++)
                        for (int d = 0; d < hs; d++)
                            x[r * hs + d] = r < nq ? base[(size_t)(i0 + r) * row + h * hs + d] : T(0);
                    score_tiles(p.data(), Tp, x.data(), hs, kt.data(), Tp, hs, jt0, jhi);
                    T inv_sum[QB];
                    for (int r = 0; r < QB; r++) {
                        T* pr = p.data() + (size_t)r * Tp;
                        if (r >= nq) {
                            std::fill(pr + jt0, pr + jt1, T(0));
                            inv_sum[r] = 0;
                            continue;
                        }
                        const int i = i0 + r, j0 = ds[i];
                        T mx = -INFINITY;
#pragma omp simd reduction(max : mx)
                        for (int j = jt0; j < jt1; j++) {
                            const T sj = pr[j] * scale - slope * T(i - j);
                            pr[j] = sj;
                            if (j >= j0 && j <= i) mx = std::max(mx, sj);
                        }
                        T part[JW] = {};  // fixed lanes: the sum's order does not depend on the vector width
                        for (int jt = jt0; jt < jt1; jt += JW)
#pragma omp simd
                            for (int l = 0; l < JW; l++) {
                                const int j = jt + l;
                                const T e = exp_fast(pr[j] - mx);
                                pr[j] = (j >= j0 && j <= i) ? e : T(0);
                                part[l] += pr[j];
                            }
                        T sum = 0;
                        for (int l = 0; l < JW; l++) sum += part[l];
                        lse[((size_t)b * n_head + h) * T_ + i] = mx + std::log(sum);
                        inv_sum[r] = T(1) / sum;
                    }
                    for (int r0 = 0; r0 < nq; r0 += RB)
                        for (int dc = 0; dc < hs; dc += DW) {
                            T acc[RB][DW];
                            weighted_rows(acc, p.data() + (size_t)r0 * Tp, Tp, v.data(), hsp, dc, jlo, jhi);
                            for (int r = r0; r < std::min(nq, r0 + RB); r++) {
                                T* o = out + ((size_t)b * T_ + i0 + r) * n_head * hs + h * hs;
                                for (int d = dc; d < std::min(hs, dc + DW); d++) o[d] = acc[r - r0][d - dc] * inv_sum[r];
                            }
                        }
                }
            }
    }
}

// dqkv overwritten. One task per (row, kv head) owns dK/dV of that kv head and dQ of the query
// heads that read it, so GQA sums over the group happen in a fixed order (head, query block, query)
// without atomics. Per query block as in the forward: S = Q K^T and dP = dO V^T as small products,
// P = exp(S - lse) (0 where masked), dS = P (dP - D) / sqrt(hs) with D = dO . O, then dQ = dS K for
// the block and dK += dS^T Q, dV += P^T dO into the task's scratch rows.
template <typename T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const T* lse,
                        const int* doc_start, int B, int T_, int n_head, int n_kv_head, int hs, int alibi_n_head,
                        int head0) {
    using namespace attention_detail;
    const int row = (n_head + 2 * n_kv_head) * hs, group = n_head / n_kv_head;
    const T scale = T(1) / std::sqrt(T(hs));
    const int Tp = round_up(T_, JW), hsp = round_up(hs, DW);
#pragma omp parallel
    {
        std::vector<T> kt((size_t)hs * Tp, T(0)), vt((size_t)hs * Tp, T(0)), k((size_t)T_ * hsp, T(0)),
            dk((size_t)T_ * hsp), dv((size_t)T_ * hsp), p((size_t)QB * Tp), dp((size_t)QB * Tp),
            x((size_t)QB * hsp, T(0)), g((size_t)QB * hsp, T(0));
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int b = 0; b < B; b++)
            for (int kh = 0; kh < n_kv_head; kh++) {
                const T* base = qkv + (size_t)b * T_ * row;
                T* dbase = dqkv + (size_t)b * T_ * row;
                const int* ds = doc_start + (size_t)b * T_;
                for (int j = 0; j < T_; j++) {
                    const T* kj = base + (size_t)j * row + (n_head + kh) * hs;
                    const T* vj = base + (size_t)j * row + (n_head + n_kv_head + kh) * hs;
                    for (int d = 0; d < hs; d++) {
                        kt[(size_t)d * Tp + j] = kj[d];
                        vt[(size_t)d * Tp + j] = vj[d];
                        k[(size_t)j * hsp + d] = kj[d];
                    }
                }
                std::fill(dk.begin(), dk.end(), T(0));
                std::fill(dv.begin(), dv.end(), T(0));
                for (int h = kh * group; h < (kh + 1) * group; h++) {
                    const T slope = alibi_n_head > 0 ? T(alibi_slope(head0 + h, alibi_n_head)) : T(0);
                    for (int i0 = 0; i0 < T_; i0 += QB) {
                        const int nq = std::min(QB, T_ - i0), jhi = i0 + nq;
                        int jlo = ds[i0];
                        for (int r = 1; r < nq; r++) jlo = std::min(jlo, ds[i0 + r]);
                        const int jt0 = jlo / JW * JW, jt1 = round_up(jhi, JW);
                        T D[QB];
                        for (int r = 0; r < QB; r++) {
                            T* xr = x.data() + (size_t)r * hsp;
                            T* gr = g.data() + (size_t)r * hsp;
                            D[r] = 0;
                            if (r >= nq) {
                                std::fill(xr, xr + hs, T(0));
                                std::fill(gr, gr + hs, T(0));
                                continue;
                            }
                            const size_t t = (size_t)b * T_ + i0 + r;
                            const T* q = base + (size_t)(i0 + r) * row + h * hs;
                            const T* dO = dout + t * n_head * hs + h * hs;
                            const T* O = out + t * n_head * hs + h * hs;
                            for (int d = 0; d < hs; d++) {
                                xr[d] = q[d];
                                gr[d] = dO[d];
                                D[r] += dO[d] * O[d];  // sum_j p_ij dp_ij = dO_i . O_i
                            }
                        }
                        score_tiles(p.data(), Tp, x.data(), hsp, kt.data(), Tp, hs, jt0, jhi);
                        score_tiles(dp.data(), Tp, g.data(), hsp, vt.data(), Tp, hs, jt0, jhi);
                        for (int r = 0; r < QB; r++) {
                            T* pr = p.data() + (size_t)r * Tp;
                            T* dsr = dp.data() + (size_t)r * Tp;
                            if (r >= nq) {
                                std::fill(pr + jt0, pr + jt1, T(0));
                                std::fill(dsr + jt0, dsr + jt1, T(0));
                                continue;
                            }
                            const int i = i0 + r, j0 = ds[i];
                            const T l = lse[((size_t)b * n_head + h) * T_ + i], Dr = D[r];
#pragma omp simd
                            for (int j = jt0; j < jt1; j++) {
                                const T e = exp_fast(pr[j] * scale - slope * T(i - j) - l);
                                const T pj = (j >= j0 && j <= i) ? e : T(0);
                                pr[j] = pj;
                                dsr[j] = pj * (dsr[j] - Dr) * scale;
                            }
                        }
                        // dQ of the block's queries (each written once: its own head and row)
                        for (int r0 = 0; r0 < nq; r0 += RB)
                            for (int dc = 0; dc < hs; dc += DW) {
                                T acc[RB][DW];
                                weighted_rows(acc, dp.data() + (size_t)r0 * Tp, Tp, k.data(), hsp, dc, jlo, jhi);
                                for (int r = r0; r < std::min(nq, r0 + RB); r++) {
                                    T* dq = dbase + (size_t)(i0 + r) * row + h * hs;
                                    for (int d = dc; d < std::min(hs, dc + DW); d++) dq[d] = acc[r - r0][d - dc];
                                }
                            }
                        // dK += dS^T Q, dV += P^T dO over the block's keys
                        for (int j = jlo; j < jhi; j++)
                            for (int dc = 0; dc < hs; dc += DW) {
                                T* dkj = dk.data() + (size_t)j * hsp + dc;
                                T* dvj = dv.data() + (size_t)j * hsp + dc;
                                T ak[DW], av[DW];
                                for (int d = 0; d < DW; d++) {
                                    ak[d] = dkj[d];
                                    av[d] = dvj[d];
                                }
                                for (int r = 0; r < nq; r++) {
                                    const T dsj = dp[(size_t)r * Tp + j], pj = p[(size_t)r * Tp + j];
                                    const T* xr = x.data() + (size_t)r * hsp + dc;
                                    const T* gr = g.data() + (size_t)r * hsp + dc;
#pragma omp simd
                                    for (int d = 0; d < DW; d++) {
                                        ak[d] += dsj * xr[d];
                                        av[d] += pj * gr[d];
                                    }
                                }
                                for (int d = 0; d < DW; d++) {
                                    dkj[d] = ak[d];
                                    dvj[d] = av[d];
                                }
                            }
                    }
                }
                for (int j = 0; j < T_; j++) {
                    T* dkr = dbase + (size_t)j * row + (n_head + kh) * hs;
                    T* dvr = dbase + (size_t)j * row + (n_head + n_kv_head + kh) * hs;
                    for (int d = 0; d < hs; d++) {
                        dkr[d] = dk[(size_t)j * hsp + d];
                        dvr[d] = dv[(size_t)j * hsp + d];
                    }
                }
            }
    }
}

}  // namespace cpu
