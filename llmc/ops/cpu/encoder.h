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
// The tokens bt in [0, n) grouped by key(bt) in [0, n_keys) (-1: skipped), by a counting sort: stable,
// so a group lists its tokens in increasing bt. Group g: key runs[g].key, tokens order[runs[g].begin ..
// runs[g + 1].begin) (a last entry closes the list).
struct Run {
    int key, begin;
};
template <typename Key>
void group_by_key(std::vector<int>& order, std::vector<Run>& runs, std::vector<int>& next, int n, int n_keys, Key key) {
    next.assign((size_t)n_keys + 1, 0);
    for (int bt = 0; bt < n; bt++)
        if (key(bt) >= 0) next[key(bt) + 1]++;
    runs.clear();
    for (int k = 0; k < n_keys; k++) {
        if (next[k + 1] > 0) runs.push_back({k, next[k]});
        next[k + 1] += next[k];
    }
    runs.push_back({-1, next[n_keys]});
    order.resize(next[n_keys]);
    for (int bt = 0; bt < n; bt++)
        if (key(bt) >= 0) order[next[key(bt)]++] = bt;
}

// rows[key, c0 .. c1) += the sum over a group's tokens (in token order) of dout[bt, c0 .. c1), once per group
template <typename T, typename G>
void add_runs(G* rows, const T* dout, const std::vector<int>& order, const std::vector<Run>& runs, int C, int c0,
              int c1) {
    constexpr int CB = 32;
    for (size_t g = 0; g + 1 < runs.size(); g++) {
        G sum[CB] = {};
        for (int i = runs[g].begin; i < runs[g + 1].begin; i++) {
            const T* d = dout + (size_t)order[i] * C;
            for (int c = c0; c < c1; c++) sum[c - c0] += (G)d[c];
        }
        G* row = rows + (size_t)runs[g].key * C;
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
    static thread_local std::vector<int> te_order, pe_order, scratch;
    static thread_local std::vector<encoder_detail::Run> te_runs, pe_runs;
    encoder_detail::group_by_key(te_order, te_runs, scratch, n, vocab_count, row_of_token);
    if (dwpe) encoder_detail::group_by_key(pe_order, pe_runs, scratch, n, T_, position);
    const std::vector<int>&to = te_order, &po = pe_order;
    const std::vector<encoder_detail::Run>&tr = te_runs, &pr = pe_runs;
#pragma omp parallel for schedule(static)
    for (int c0 = 0; c0 < C; c0 += CB) {
        const int c1 = std::min(C, c0 + CB);
        encoder_detail::add_runs(dwte, dout, to, tr, C, c0, c1);
        if (dwpe) encoder_detail::add_runs(dwpe, dout, po, pr, C, c0, c1);
    }
}

}  // namespace cpu
