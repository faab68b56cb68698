// Token (+ learned position) embedding. With pos=learned the position of token t is its offset
// inside its document, t - doc_start[t], so a packed row behaves like its documents run alone.
// wpe == nullptr means no learned positions (ALiBi models).
//   forward   out[i,:] = (v_i in range ? wte[v_i - vocab_begin,:] : 0) + (wpe ? wpe[p_i,:] : 0)
//   backward  dwte[v - vocab_begin,:] += sum_{i : v_i == v} dout[i,:] for v in range,
//             dwpe[p,:] += sum_{i : p_i == p} dout[i,:] (every token), each sum in increasing i
//             and added once
//   v_i = tokens[i], p_i = i % T - doc_start[i]; "in range": vocab_begin <= v_i < vocab_begin + vocab_count.
// Vocab-parallel embedding (tensor parallelism): rank r holds the rows [vocab_begin, vocab_begin +
// vocab_count) of wte as its local table; the full embedding is the sum over ranks of their outputs
// (the tokens outside a rank's range give exact zeros there, so the sum is bitwise the one-rank
// result when wpe is added by one rank only), and each rank's dwte rows are the full table's rows.
// Without tensor parallelism: vocab_begin = 0, vocab_count = the number of rows of wte.
#pragma once
#include <algorithm>
#include <vector>

namespace cpu {

inline bool in_vocab_range(int token, int vocab_begin, int vocab_count) {
    return token >= vocab_begin && token - vocab_begin < vocab_count;
}

template <typename T>
void encoder_forward(T* out, const int* tokens, const int* doc_start, const T* wte, const T* wpe,
                     int B, int T_, int C, int vocab_begin, int vocab_count) {
#pragma omp parallel for schedule(static)
    for (int bt = 0; bt < B * T_; bt++) {
        const bool in = in_vocab_range(tokens[bt], vocab_begin, vocab_count);
        const T* e = in ? wte + (size_t)(tokens[bt] - vocab_begin) * C : nullptr;
        const T* p = wpe ? wpe + (size_t)(bt % T_ - doc_start[bt]) * C : nullptr;
        T* o = out + (size_t)bt * C;
        for (int c = 0; c < C; c++) o[c] = (e ? e[c] : T(0)) + (p ? p[c] : T(0));
    }
}

namespace encoder_detail {
// the tokens bt in [0, n) with key(bt) >= 0, ordered by key and, within a key, by bt (a stable sort);
// starts: where each key's run begins, plus n_listed at the end
template <typename Key>
void group_by_key(std::vector<int>& order, std::vector<int>& starts, int n, Key key) {
    order.clear();
    for (int bt = 0; bt < n; bt++)
        if (key(bt) >= 0) order.push_back(bt);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return key(a) < key(b); });
    starts.clear();
    for (size_t i = 0; i < order.size(); i++)
        if (i == 0 || key(order[i]) != key(order[i - 1])) starts.push_back((int)i);
    starts.push_back((int)order.size());
}

// rows[key, c0 .. c1) += the sum over a run's tokens (in token order) of dout[bt, c0 .. c1), once per run
template <typename T, typename G, typename Key>
void add_runs(G* rows, const T* dout, const std::vector<int>& order, const std::vector<int>& starts, Key key,
              int C, int c0, int c1) {
    constexpr int CB = 32;
    for (size_t g = 0; g + 1 < starts.size(); g++) {
        G sum[CB] = {};
        for (int i = starts[g]; i < starts[g + 1]; i++) {
            const T* d = dout + (size_t)order[i] * C;
            for (int c = c0; c < c1; c++) sum[c - c0] += (G)d[c];
        }
        G* row = rows + (size_t)key(order[starts[g]]) * C;
        for (int c = c0; c < c1; c++) row[c] += sum[c - c0];
    }
}
}  // namespace encoder_detail

// dwte (local rows), dwpe accumulate: each row gets one addition of the complete sum of its tokens'
// gradients (so accumulating into acc gives bitwise acc + the gradient computed alone). The tokens
// are grouped by row (token id, position), in token order within a row; threads own channel ranges
// of 32 and sum every row's tokens in that order, so the sums do not depend on the thread count
// (deterministic, no atomics). G: the gradients' type (float; double in the finite-difference tests).
template <typename T, typename G>
void encoder_backward(G* dwte, G* dwpe, const T* dout, const int* tokens, const int* doc_start,
                      int B, int T_, int C, int vocab_begin, int vocab_count) {
    constexpr int CB = 32;
    const int n = B * T_;
    auto row_of_token = [&](int bt) {
        return in_vocab_range(tokens[bt], vocab_begin, vocab_count) ? tokens[bt] - vocab_begin : -1;
    };
    auto position = [&](int bt) { return bt % T_ - doc_start[bt]; };
    static thread_local std::vector<int> te_order, te_starts, pe_order, pe_starts;
    encoder_detail::group_by_key(te_order, te_starts, n, row_of_token);
    if (dwpe) encoder_detail::group_by_key(pe_order, pe_starts, n, position);
    const std::vector<int>&to = te_order, &ts = te_starts, &po = pe_order, &ps = pe_starts;
#pragma omp parallel for schedule(static)
    for (int c0 = 0; c0 < C; c0 += CB) {
        const int c1 = std::min(C, c0 + CB);
        encoder_detail::add_runs(dwte, dout, to, ts, row_of_token, C, c0, c1);
        if (dwpe) encoder_detail::add_runs(dwpe, dout, po, ps, position, C, c0, c1);
    }
}

}  // namespace cpu
