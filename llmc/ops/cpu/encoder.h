// Token (+ learned position) embedding. With pos=learned the position of token t is its offset
// inside its document, t - doc_start[t], so a packed row behaves like its documents run alone.
// wpe == nullptr means no learned positions (ALiBi models).
//   forward   out[i,:] = (v_i in range ? wte[v_i - vocab_begin,:] : 0) + (wpe ? wpe[p_i,:] : 0)
//   backward  dwte[v - vocab_begin,:] += sum_{i : v_i == v} dout[i,:] for v in range,
//             dwpe[p,:] += sum_{i : p_i == p} dout[i,:] (every token)
//   v_i = tokens[i], p_i = i % T - doc_start[i]; "in range": vocab_begin <= v_i < vocab_begin + vocab_count.
// Vocab-parallel embedding (tensor parallelism): rank r holds the rows [vocab_begin, vocab_begin +
// vocab_count) of wte as its local table; the full embedding is the sum over ranks of their outputs
// (the tokens outside a rank's range give exact zeros there, so the sum is bitwise the one-rank
// result when wpe is added by one rank only), and each rank's dwte rows are the full table's rows.
// Without tensor parallelism: vocab_begin = 0, vocab_count = the number of rows of wte.
#pragma once
#include <algorithm>

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

// dwte (local rows), dwpe accumulate. Threads own channel ranges and visit tokens in order, so the
// sum order of a repeated token's gradients is fixed (deterministic, no atomics).
template <typename T>
void encoder_backward(T* dwte, T* dwpe, const T* dout, const int* tokens, const int* doc_start,
                      int B, int T_, int C, int vocab_begin, int vocab_count) {
    constexpr int CB = 32;
#pragma omp parallel for schedule(static)
    for (int c0 = 0; c0 < C; c0 += CB) {
        int c1 = std::min(C, c0 + CB);
        for (int bt = 0; bt < B * T_; bt++) {
            const T* d = dout + (size_t)bt * C;
            if (in_vocab_range(tokens[bt], vocab_begin, vocab_count)) {
                T* e = dwte + (size_t)(tokens[bt] - vocab_begin) * C;
                for (int c = c0; c < c1; c++) e[c] += d[c];
            }
            if (dwpe) {
                T* p = dwpe + (size_t)(bt % T_ - doc_start[bt]) * C;
                for (int c = c0; c < c1; c++) p[c] += d[c];
            }
        }
    }
}

}  // namespace cpu
