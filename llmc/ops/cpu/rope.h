// Rotary position embedding (RoPE; Su et al. 2021, "RoFormer"), in the rotate-half pairing of
// Llama / Hugging Face: channel i of a head is paired with channel i + hs/2, i < hs/2, and the pair
// is rotated by the angle p * inv_freq_i, p the token's position:
//   forward   x'_i = x_i cos - x_{i+hs/2} sin,   x'_{i+hs/2} = x_{i+hs/2} cos + x_i sin
//   backward  the rotation by -angle (a rotation's transpose is its inverse), in place on dqkv
// on the query and key heads of a qkv row [q: n_head hs | k: n_kv_head hs | v: n_kv_head hs]; the
// value heads are not touched. As with learned positions, p = t - doc_start[t] (the position inside
// the token's document), so a packed row behaves like its documents run alone.
//   inv_freq_i = theta^(-2i / hs), then (rope_scaling llama3, Llama-3.1's long-context recipe) by
//   the wavelength w = 2 pi / inv_freq_i: w < orig / high_ff: kept; w > orig / low_ff: / factor;
//   between: (1 - s) inv_freq_i / factor + s inv_freq_i, s = (orig / w - low_ff) / (high_ff - low_ff).
// The cos / sin table [n_pos][hs/2][2] is computed once on the host in double precision
// (rope_table) and is the input of both builds, so the CPU and GPU ops rotate by the same floats.
// Tensor parallelism: the op is per head and independent of the head's index: a rank calls it with
// its local head counts.
#pragma once
#include <cmath>
#include <vector>

namespace cpu {

enum RopeScaling { ROPE_SCALING_NONE = 0, ROPE_SCALING_LLAMA3 = 1 };
struct RopeSpec {
    double theta = 10000.0;
    int scaling = ROPE_SCALING_NONE;
    double factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
    int original_max_pos = 8192;
};

// the hs/2 inverse frequencies of a head of hs channels
inline std::vector<double> rope_inv_freq(int hs, const RopeSpec& r) {
    std::vector<double> f(hs / 2);
    const double pi = 3.14159265358979323846;
    for (int i = 0; i < hs / 2; i++) {
        double inv = std::pow(r.theta, -2.0 * i / hs);
        if (r.scaling == ROPE_SCALING_LLAMA3) {
            const double wavelen = 2 * pi / inv, orig = r.original_max_pos;
            if (wavelen > orig / r.low_freq_factor) {
                inv /= r.factor;
            } else if (wavelen >= orig / r.high_freq_factor) {
                const double s = (orig / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
                inv = (1 - s) * inv / r.factor + s * inv;
            }
        }
        f[i] = inv;
    }
    return f;
}

// cos_sin[(p * hs/2 + i) * 2 + {0, 1}] = {cos, sin}(p * inv_freq_i), p in [0, n_pos)
inline void rope_table(float* cos_sin, int n_pos, int hs, const RopeSpec& r) {
    const std::vector<double> inv = rope_inv_freq(hs, r);
    const int half = hs / 2;
    for (int p = 0; p < n_pos; p++)
        for (int i = 0; i < half; i++) {
            const double a = p * inv[i];
            cos_sin[((size_t)p * half + i) * 2] = (float)std::cos(a);
            cos_sin[((size_t)p * half + i) * 2 + 1] = (float)std::sin(a);
        }
}

namespace rope_detail {
// rotates the q and k heads of every token of [B*T] qkv rows; sign -1: the inverse rotation
template <typename T>
inline void rotate(T* qkv, const int* doc_start, const float* cos_sin, int B, int T_, int n_head, int n_kv_head,
                   int hs, float sign) {
    const int half = hs / 2, heads = n_head + n_kv_head;
    const size_t row = (size_t)(n_head + 2 * n_kv_head) * hs;
#pragma omp parallel for schedule(static)
    for (int bt = 0; bt < B * T_; bt++) {
        const int p = bt % T_ - doc_start[bt];
        const float* cs = cos_sin + (size_t)p * half * 2;
        for (int h = 0; h < heads; h++) {
            T* x = qkv + bt * row + (size_t)h * hs;
            for (int i = 0; i < half; i++) {
                const T c = (T)cs[2 * i], s = (T)(sign * cs[2 * i + 1]);
                const T x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c - x2 * s;
                x[i + half] = x2 * c + x1 * s;
            }
        }
    }
}
}  // namespace rope_detail

// in place on qkv [B*T, (n_head + 2 n_kv_head) hs]; cos_sin: rope_table of at least T positions
template <typename T>
void rope_forward(T* qkv, const int* doc_start, const float* cos_sin, int B, int T_, int n_head, int n_kv_head, int hs) {
    rope_detail::rotate(qkv, doc_start, cos_sin, B, T_, n_head, n_kv_head, hs, 1.0f);
}
// in place on dqkv: the gradient at the rotation's output becomes the gradient at its input
template <typename T>
void rope_backward(T* dqkv, const int* doc_start, const float* cos_sin, int B, int T_, int n_head, int n_kv_head,
                   int hs) {
    rope_detail::rotate(dqkv, doc_start, cos_sin, B, T_, n_head, n_kv_head, hs, -1.0f);
}

}  // namespace cpu
