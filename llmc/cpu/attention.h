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

template <typename T>
void attention_forward(T* out, T* lse, const T* qkv, const int* doc_start, int B, int T_, int n_head,
                       int n_kv_head, int hs, int alibi_n_head, int head0) {
    const int row = (n_head + 2 * n_kv_head) * hs, group = n_head / n_kv_head;
    const T scale = T(1) / std::sqrt(T(hs));
#pragma omp parallel
    {
        std::vector<T> s(T_);
#pragma omp for collapse(3) schedule(static)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < n_head; h++)
                for (int i = 0; i < T_; i++) {
                    const T* base = qkv + (size_t)b * T_ * row;
                    const T* q = base + (size_t)i * row + h * hs;
                    const int kh = h / group;
                    const T slope = alibi_n_head > 0 ? T(alibi_slope(head0 + h, alibi_n_head)) : T(0);
                    const int j0 = doc_start[b * T_ + i];
                    T mx = -INFINITY;
                    for (int j = j0; j <= i; j++) {
                        const T* k = base + (size_t)j * row + (n_head + kh) * hs;
                        T dot = 0;
                        for (int d = 0; d < hs; d++) dot += q[d] * k[d];
                        s[j] = dot * scale - slope * T(i - j);
                        mx = std::max(mx, s[j]);
                    }
                    T sum = 0;
                    for (int j = j0; j <= i; j++) sum += std::exp(s[j] - mx);
                    const T l = mx + std::log(sum);
                    lse[((size_t)b * n_head + h) * T_ + i] = l;
                    T* o = out + ((size_t)b * T_ + i) * n_head * hs + h * hs;
                    for (int d = 0; d < hs; d++) o[d] = 0;
                    for (int j = j0; j <= i; j++) {
                        const T p = std::exp(s[j] - l);
                        const T* v = base + (size_t)j * row + (n_head + n_kv_head + kh) * hs;
                        for (int d = 0; d < hs; d++) o[d] += p * v[d];
                    }
                }
    }
}

// dqkv overwritten. One task per (row, kv head) owns dK/dV of that kv head and dQ of the query
// heads that read it, so GQA sums over the group happen in a fixed order without atomics.
template <typename T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const T* lse,
                        const int* doc_start, int B, int T_, int n_head, int n_kv_head, int hs, int alibi_n_head,
                        int head0) {
    const int row = (n_head + 2 * n_kv_head) * hs, group = n_head / n_kv_head;
    const T scale = T(1) / std::sqrt(T(hs));
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++)
        for (int kh = 0; kh < n_kv_head; kh++) {
            const T* base = qkv + (size_t)b * T_ * row;
            T* dbase = dqkv + (size_t)b * T_ * row;
            for (int t = 0; t < T_; t++) {
                for (int h = kh * group; h < (kh + 1) * group; h++)
                    std::fill_n(dbase + (size_t)t * row + h * hs, hs, T(0));
                std::fill_n(dbase + (size_t)t * row + (n_head + kh) * hs, hs, T(0));
                std::fill_n(dbase + (size_t)t * row + (n_head + n_kv_head + kh) * hs, hs, T(0));
            }
            for (int h = kh * group; h < (kh + 1) * group; h++) {
                const T slope = alibi_n_head > 0 ? T(alibi_slope(head0 + h, alibi_n_head)) : T(0);
                for (int i = 0; i < T_; i++) {
                    const T* q = base + (size_t)i * row + h * hs;
                    T* dq = dbase + (size_t)i * row + h * hs;
                    const T* dO = dout + ((size_t)b * T_ + i) * n_head * hs + h * hs;
                    const T* O = out + ((size_t)b * T_ + i) * n_head * hs + h * hs;
                    const T l = lse[((size_t)b * n_head + h) * T_ + i];
                    T D = 0;  // sum_j p_ij dp_ij = dO_i . O_i
                    for (int d = 0; d < hs; d++) D += dO[d] * O[d];
                    for (int j = doc_start[b * T_ + i]; j <= i; j++) {
                        const T* k = base + (size_t)j * row + (n_head + kh) * hs;
                        const T* v = base + (size_t)j * row + (n_head + n_kv_head + kh) * hs;
                        T* dk = dbase + (size_t)j * row + (n_head + kh) * hs;
                        T* dv = dbase + (size_t)j * row + (n_head + n_kv_head + kh) * hs;
                        T dot = 0, dp = 0;
                        for (int d = 0; d < hs; d++) { dot += q[d] * k[d]; dp += dO[d] * v[d]; }
                        const T p = std::exp(dot * scale - slope * T(i - j) - l);
                        const T ds = p * (dp - D) * scale;
                        for (int d = 0; d < hs; d++) {
                            dq[d] += ds * k[d];
                            dk[d] += ds * q[d];
                            dv[d] += p * dO[d];
                        }
                    }
                }
            }
        }
}

}  // namespace cpu
