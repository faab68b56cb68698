// Rotary position embedding (RoPE) on the GPU: the twin of llmc/ops/cpu/rope.h.
//   forward   for each token (position p = t - doc_start[t], the position inside its document), each
//             query and key head (the value heads are not touched) and i < hs/2, the pair
//             (x_i, x_{i+hs/2}) (the rotate-half pairing) is rotated by the angle p * inv_freq_i:
//               x'_i        = x_i cos - x_{i+hs/2} sin
//               x'_{i+hs/2} = x_{i+hs/2} cos + x_i sin
//   backward  the transpose of that rotation, i.e. the rotation by -angle (sin -> -sin), applied in
//             place to dqkv: the gradient at the rotation's output becomes the gradient at its input
// cos / sin come from the table cos_sin[p][hs/2][2] (fp32, a device copy of cpu::rope_table, which the
// host computes in double: both builds rotate by the same floats). Math in fp32 from the floatX inputs,
// one rounding to floatX per output element.
//
// Parallel decomposition: a separate elementwise kernel, in place on the qkv buffer
// [B*T, (n_head + 2 n_kv_head) hs]. A thread owns VEC consecutive pairs of one head of one token:
// VEC = 8 (two 16-byte loads / stores of x_i.. and x_{i+hs/2}.., four 16-byte loads of the table)
// when hs % 16 == 0 and qkv and the table are 16-byte aligned, VEC = 1 otherwise. A token has
// U = (n_head + n_kv_head) * hs / (2 VEC) such units; a block is (min(U, 1024), max(1, 256 / x))
// threads: x across the token's units (looping when U > 1024), y tokens side by side; the grid covers
// the B*T tokens (no 64-bit division: the token is the block row). Memory-bound: each q / k element is
// read and written once, 2 x (n_head + n_kv_head) hs x B*T x sizeof(floatX) bytes per call; the table
// (T x hs/2 x 8 bytes) and doc_start (4 bytes per token) are read once per head and mostly hit in L1/L2.
// Tensor parallelism: the op is per head and independent of the head's index: a rank calls it with its
// local head counts.
//
// Scratch: none.
#pragma once
#include "llmc/ops/cuda_common.cuh"
#include "llmc/ops/cpu/rope.h"  // cpu::RopeSpec, cpu::rope_inv_freq, cpu::rope_table: the table, host arithmetic

namespace rope_detail {

using namespace floatx8;  // aligned16, load_floatX / store_floatX (llmc/ops/cuda_common.cuh)

constexpr int THREADS = 256;  // target threads per block
constexpr int MAX_X = 1024;   // most threads across one token

// units_per_head = hs / (2 VEC); row = (n_head + 2 n_kv_head) hs; sign +1 forward, -1 backward
template <int VEC>
__global__ void __launch_bounds__(MAX_X)
    rope_kernel(floatX* qkv, const int* __restrict__ doc_start, const float* __restrict__ cos_sin, int BT, int T,
                int units, int units_per_head, int half, int row, float sign) {
    const int bt = blockIdx.x * blockDim.y + threadIdx.y;
    if (bt >= BT) return;  // (no barriers in this kernel)
    const int p = bt % T - doc_start[bt];
    const float* cs = cos_sin + (size_t)p * half * 2;
    floatX* x = qkv + (size_t)bt * row;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
        const int h = u / units_per_head;
        const int i = (u - h * units_per_head) * VEC;
        floatX* p1 = x + (size_t)h * 2 * half + i;
        floatX* p2 = p1 + half;
        float x1[VEC], x2[VEC], c[VEC], s[VEC], y1[VEC], y2[VEC];
        load_floatX<VEC>(x1, p1);
        load_floatX<VEC>(x2, p2);
        if constexpr (VEC == 8) {
            const float4* t = reinterpret_cast<const float4*>(cs + 2 * i);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const float4 v = t[k];
                c[2 * k] = v.x;
                s[2 * k] = v.y;
                c[2 * k + 1] = v.z;
                s[2 * k + 1] = v.w;
            }
        } else {
            c[0] = cs[2 * i];
            s[0] = cs[2 * i + 1];
        }
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            const float sn = sign * s[k];
            y1[k] = x1[k] * c[k] - x2[k] * sn;
            y2[k] = x2[k] * c[k] + x1[k] * sn;
        }
        store_floatX<VEC>(p1, y1);
        store_floatX<VEC>(p2, y2);
    }
}

inline void rope_launch(floatX* qkv, const int* doc_start, const float* cos_sin, int B, int T, int n_head,
                        int n_kv_head, int hs, float sign, const char* who) {
    LLMC_CHECK(hs > 0 && hs % 2 == 0, "%s: the head size %d must be even (rotate-half pairs)", who, hs);
    LLMC_CHECK(n_head >= 0 && n_kv_head >= 0 && B >= 0 && T >= 0, "%s: negative shape", who);
    const int BT = B * T, half = hs / 2, heads = n_head + n_kv_head;
    if (BT == 0 || heads == 0) return;
    const bool vec = half % 8 == 0 && aligned16(qkv) && aligned16(cos_sin);
    const int VEC = vec ? 8 : 1;
    const int units_per_head = half / VEC, units = heads * units_per_head;
    const int row = (n_head + 2 * n_kv_head) * hs;
    const int bx = std::min(units, MAX_X), by = std::max(1, THREADS / bx);
    const dim3 block(bx, by);
    const int grid = ceil_div(BT, by);
    if (vec)
        rope_kernel<8><<<grid, block, 0, llmc_stream()>>>(qkv, doc_start, cos_sin, BT, T, units, units_per_head, half,
                                                          row, sign);
    else
        rope_kernel<1><<<grid, block, 0, llmc_stream()>>>(qkv, doc_start, cos_sin, BT, T, units, units_per_head, half,
                                                          row, sign);
    cudaCheckLaunch();
}

}  // namespace rope_detail

// In place on the query and key heads of qkv [B*T, (n_head + 2 n_kv_head) hs] (floatX); doc_start [B*T]
// (device, row-relative indices); cos_sin (device, fp32): cpu::rope_table of at least T positions.
inline void rope_forward(floatX* qkv, const int* doc_start, const float* cos_sin, int B, int T, int n_head,
                         int n_kv_head, int hs) {
    rope_detail::rope_launch(qkv, doc_start, cos_sin, B, T, n_head, n_kv_head, hs, 1.0f, "rope_forward");
}

// In place on dqkv (same layout): the gradient at the rotation's output becomes the gradient at its input
// (the value heads' gradients pass unchanged)
inline void rope_backward(floatX* dqkv, const int* doc_start, const float* cos_sin, int B, int T, int n_head,
                          int n_kv_head, int hs) {
    rope_detail::rope_launch(dqkv, doc_start, cos_sin, B, T, n_head, n_kv_head, hs, -1.0f, "rope_backward");
}
