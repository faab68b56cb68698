// Token (+ learned position) embedding. With pos=learned the position of token t is its offset
// inside its document, t - doc_start[t], so a packed row behaves like its documents run alone.
// wpe == nullptr means no learned positions (ALiBi models).
#pragma once
#include <algorithm>

namespace cpu {

template <typename T>
void encoder_forward(T* out, const int* tokens, const int* doc_start, const T* wte, const T* wpe,
                     int B, int T_, int C) {
#pragma omp parallel for schedule(static)
    for (int bt = 0; bt < B * T_; bt++) {
        const T* e = wte + (size_t)tokens[bt] * C;
        const T* p = wpe ? wpe + (size_t)(bt % T_ - doc_start[bt]) * C : nullptr;
        T* o = out + (size_t)bt * C;
        for (int c = 0; c < C; c++) o[c] = e[c] + (p ? p[c] : T(0));
    }
}

// dwte, dwpe accumulate. Threads own channel ranges and visit tokens in order, so the sum order of
// a repeated token's gradients is fixed (deterministic, no atomics).
template <typename T>
void encoder_backward(T* dwte, T* dwpe, const T* dout, const int* tokens, const int* doc_start,
                      int B, int T_, int C) {
    constexpr int CB = 32;
#pragma omp parallel for schedule(static)
    for (int c0 = 0; c0 < C; c0 += CB) {
        int c1 = std::min(C, c0 + CB);
        for (int bt = 0; bt < B * T_; bt++) {
            const T* d = dout + (size_t)bt * C;
            T* e = dwte + (size_t)tokens[bt] * C;
            for (int c = c0; c < c1; c++) e[c] += d[c];
            if (dwpe) {
                T* p = dwpe + (size_t)(bt % T_ - doc_start[bt]) * C;
                for (int c = c0; c < c1; c++) p[c] += d[c];
            }
        }
    }
}

}  // namespace cpu
