// LayerNorm on the GPU: the twin of llmc/ops/cpu/layernorm.h.
//   forward   mean = sum_c x_c / C,  rstd = 1 / sqrt(sum_c (x_c - mean)^2 / C + 1e-5)  (biased variance)
//             out_c = (x_c - mean) * rstd * w_c + b_c                                  (mean, rstd saved, fp32)
//   fused     residual = bf16(inp1 + inp2), then the forward of that bf16 residual (what the backward
//             will read back), in one kernel and one pass over memory
//   backward  xhat = (x - mean) * rstd, g = dout * w
//             dinp += rstd * (g - mean_c(g) - xhat * mean_c(g * xhat))
//             dweight += sum_rows dout * xhat,  dbias += sum_rows dout   (fp32, one add per element)
//
// Parallel decomposition (all kernels): a row of C channels is spread over blockDim.x threads (one
// warp, or several for wide rows), thread x owning K groups of VEC consecutive channels,
// c = VEC * (x + k * blockDim.x); VEC = 8 (16-byte loads) when C % 8 == 0 and the pointers are
// 16-byte aligned, VEC = 1 otherwise; K = 1 while the row fits in 1024 threads (512 for the 16-byte
// backward, which keeps more per thread), else 2 or 4: C <= 32768 / 16384 (16-byte forward /
// backward), C <= 4096 (scalar). A block holds blockDim.y such rows side by side. The row's values
// stay in registers between the reductions, so each input is read once; row sums are warp
// shuffles, plus one shared-memory step across the row's warps (fixed order, so every thread gets
// the same bits).
//  forward   one row per row-group; mean and variance by two reductions (two-pass variance in
//            registers, no E[x^2] - mean^2 cancellation).
//  backward  a fixed grid of G blocks (one resident wave: G = SMs x blocks per SM, capped by the
//            number of row groups) each owning a contiguous range of rows, walked blockDim.y rows at
//            a time. A thread's weights stay in registers and its dweight/dbias partials accumulate
//            in fp32 registers over all of its rows; at the end the row groups of a block fold
//            together in order 0, 1, 2, ... through shared memory and the block writes one partial
//            row [2][C] to scratch. A second kernel sums the G partials of each channel in a fixed
//            order (32 strided lanes, then those 32 in order) and adds the total to the fp32
//            dweight/dbias once (dw = dw + S, the gradient-path contract): no atomics, so the
//            result is bitwise reproducible.
//
// Scratch: layernorm_forward / fused: none; layernorm_backward: G * 2 * C floats,
//   bounded by layernorm_scratch_bytes(N, C) (llmc/ops/op_scratch.h: G <= 16 blocks per SM: 13 MB at C = 768).
//
// RMSNorm (llmc/ops/rmsnorm.cuh) runs these kernels with the template flag RMS: the same rows, blocks,
// grid and fixed-order sums, without the mean (m = 0: one reduction in the forward, sum_c x_c^2, and
// one in the backward, mean_c(g * xhat)), the bias and dbias (partials [G][1][C]).
#pragma once
#include <algorithm>
#include <cstdint>
#include "llmc/ops/cuda_common.cuh"
#include "llmc/ops/op_scratch.h"  // layernorm_scratch_bytes: the backward's scratch bound

namespace layernorm_detail {

constexpr float EPS = 1e-5f;
constexpr int FWD_THREADS = 256;  // target threads per forward block
constexpr int BWD_THREADS = 256;  // target threads per backward block
constexpr int FWD_MAX_X = 1024;   // most threads across one row, forward
constexpr int BWD_MAX_X = 512;    // ... backward, 16-byte path (more state per thread: <= 128 registers)

using namespace floatx8;  // aligned16, load_floatX / store_floatX, ... (llmc/ops/cuda_common.cuh)

__device__ inline float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;  // (a butterfly: every lane holds the same bits, a + b == b + a exactly)
}

// Sums a and b over the threads of this row (same threadIdx.y); every thread gets the results.
// Every thread of the block must call it (it has barriers when a row spans several warps).
__device__ inline void row_sum2(float& a, float& b) {
    __shared__ float red[2][32];  // [y * warps per row + warp]: blockDim <= 1024 threads = 32 warps
    a = warp_sum(a);
    b = warp_sum(b);
    const int nw = blockDim.x / 32;
    if (nw == 1) return;  // uniform across the block
    const int base = threadIdx.y * nw;
    __syncthreads();  // the previous call's readers are done with red
    if (threadIdx.x % 32 == 0) {
        red[0][base + threadIdx.x / 32] = a;
        red[1][base + threadIdx.x / 32] = b;
    }
    __syncthreads();
    a = 0.0f;
    b = 0.0f;
    for (int w = 0; w < nw; w++) {
        a += red[0][base + w];
        b += red[1][base + w];
    }
}

// row_sum2 for one value (RMSNorm's single reductions)
__device__ inline float row_sum1(float a) {
    __shared__ float red1[32];
    a = warp_sum(a);
    const int nw = blockDim.x / 32;
    if (nw == 1) return a;
    const int base = threadIdx.y * nw;
    __syncthreads();
    if (threadIdx.x % 32 == 0) red1[base + threadIdx.x / 32] = a;
    __syncthreads();
    a = 0.0f;
    for (int w = 0; w < nw; w++) a += red1[base + w];
    return a;
}

// One row per row group. FUSED: inp1 + inp2 -> residual (bf16) first, then the LayerNorm of it.
// (residual, inp1, inp2 are not __restrict__: residual == inp1 is allowed, each element being read
// and then written by the same thread.) RMS: RMSNorm instead (llmc/ops/rmsnorm.cuh): no mean (the
// first reduction and `mean` skipped, m = 0), no bias; eps is LayerNorm's EPS or RMSNorm's argument.
template <int VEC, int K, bool FUSED, bool RMS>
__global__ void __launch_bounds__(FWD_MAX_X)
    layernorm_forward_kernel(floatX* residual, floatX* __restrict__ out, float* __restrict__ mean,
                             float* __restrict__ rstd, const floatX* inp1, const floatX* inp2,
                             const floatX* __restrict__ weight, const floatX* __restrict__ bias, int N, int C,
                             float eps) {
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    const bool row_ok = row < N;  // the threads of a missing row still take part in the barriers
    const size_t off = (size_t)row * C;
    float x[K][VEC];
    float sum = 0.0f, unused = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int c = VEC * (threadIdx.x + k * blockDim.x);
        if (row_ok && c < C) {
            load_floatX<VEC>(x[k], inp1 + off + c);
            if constexpr (FUSED) {
                float y[VEC];
                load_floatX<VEC>(y, inp2 + off + c);
#pragma unroll
                for (int i = 0; i < VEC; i++) x[k][i] = floatX_to_float(float_to_floatX(x[k][i] + y[i]));
                store_floatX<VEC>(residual + off + c, x[k]);  // exact: already bf16 values
            }
            if constexpr (!RMS) {
#pragma unroll
                for (int i = 0; i < VEC; i++) sum += x[k][i];
            }
        }
    }
    float m = 0.0f;  // RMSNorm: the sum of squares below is then sum_c x_c^2
    if constexpr (!RMS) {
        row_sum2(sum, unused);
        m = sum / C;
    }
    float var = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int c = VEC * (threadIdx.x + k * blockDim.x);
        if (row_ok && c < C) {
#pragma unroll
            for (int i = 0; i < VEC; i++) {
                const float d = x[k][i] - m;
                var += d * d;
            }
        }
    }
    if constexpr (RMS) var = row_sum1(var);
    else row_sum2(var, unused);
    const float s = rsqrtf(var / C + eps);
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int c = VEC * (threadIdx.x + k * blockDim.x);
        if (row_ok && c < C) {
            float w[VEC], b[VEC], y[VEC];
            load_floatX<VEC>(w, weight + c);
            if constexpr (!RMS) {
                load_floatX<VEC>(b, bias + c);
#pragma unroll
                for (int i = 0; i < VEC; i++) y[i] = (x[k][i] - m) * s * w[i] + b[i];
            } else {
#pragma unroll
                for (int i = 0; i < VEC; i++) y[i] = x[k][i] * s * w[i];
            }
            store_floatX<VEC>(out + off + c, y);
        }
    }
    if (row_ok && threadIdx.x == 0) {
        if constexpr (!RMS) mean[row] = m;
        rstd[row] = s;
    }
}

// Rows [blockIdx.x * rows_per_block, + rows_per_block) of the backward; partials [gridDim.x][NP][C]
// (NP = 2: dweight, dbias; RMS: NP = 1, dweight alone). Dynamic shared memory: NP * blockDim.x * K * VEC
// floats when blockDim.y > 1 (the fold), else none. RMS: RMSNorm's backward (mean null, m = 0, no
// mean_c(g) term, no dbias).
// A thread keeps w, dweight and dbias partials in fp32 (3 K VEC registers) and the row's dout, inp
// and old dinp packed as bf16 while the row sums are formed. DINP false: dinp is null and only the
// partials are formed (the zero-bubble pipeline's weight-gradient half); a template parameter, not a
// run-time test, so that the full backward keeps its register count (a run-time `if (dinp)` costs
// the 16-byte path 16-17 registers: 64 -> 80 at K 1, 104 -> 121 at K 2, and a block per SM).
template <int VEC, int K, bool DINP, bool RMS>
__global__ void __launch_bounds__(VEC == 8 ? BWD_MAX_X : 1024)
    layernorm_backward_kernel(floatX* __restrict__ dinp, float* __restrict__ partials, const floatX* __restrict__ dout,
                              const floatX* __restrict__ inp, const floatX* __restrict__ weight,
                              const float* __restrict__ mean, const float* __restrict__ rstd, int N, int C,
                              int rows_per_block) {
    // K 4 (the widest rows) cannot keep the packed row and the weights in registers beside the fp32
    // partials (176 > 128 registers at VEC 8: it spilled): there each pass reads them (from L1/L2)
    constexpr bool KEEP_ROW = K < 4;
    extern __shared__ float fold[];
    const int row_begin = blockIdx.x * rows_per_block;
    const int row_end = min(N, row_begin + rows_per_block);
    float w[K][VEC], dw[K][VEC], db[K][VEC];
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int c = VEC * (threadIdx.x + k * blockDim.x);
        if (DINP && KEEP_ROW && c < C) load_floatX<VEC>(w[k], weight + c);  // weight serves dinp only
#pragma unroll
        for (int i = 0; i < VEC; i++) dw[k][i] = db[k][i] = 0.0f;
    }
    // the same trip count for every thread of the block (barriers in row_sum2)
    for (int r0 = row_begin; r0 < row_end; r0 += blockDim.y) {
        const int row = r0 + threadIdx.y;
        const bool row_ok = row < row_end;
        const size_t off = (size_t)row * C;
        const float m = (row_ok && !RMS) ? mean[row] : 0.0f, s = row_ok ? rstd[row] : 0.0f;
        Packed<VEC> pd[K], px[K], pold[K];
        float sum_g = 0.0f, sum_gx = 0.0f;
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int c = VEC * (threadIdx.x + k * blockDim.x);
            if (row_ok && c < C) {
                if (DINP && !KEEP_ROW) load_floatX<VEC>(w[k], weight + c);
                pd[k] = load_packed<VEC>(dout + off + c);
                px[k] = load_packed<VEC>(inp + off + c);
                if (DINP && KEEP_ROW) pold[k] = load_packed<VEC>(dinp + off + c);  // issued before the barriers
                float d[VEC], x[VEC];
                unpack<VEC>(d, pd[k]);
                unpack<VEC>(x, px[k]);
#pragma unroll
                for (int i = 0; i < VEC; i++) {
                    const float g = d[i] * w[k][i];
                    if constexpr (!RMS) sum_g += g;
                    sum_gx += g * ((x[i] - m) * s);
                }
            }
        }
        if constexpr (RMS) sum_gx = row_sum1(sum_gx);
        else row_sum2(sum_g, sum_gx);
        const float mg = RMS ? 0.0f : sum_g / C, mgx = sum_gx / C;
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int c = VEC * (threadIdx.x + k * blockDim.x);
            if (row_ok && c < C) {
                if (!KEEP_ROW) {
                    if (DINP) load_floatX<VEC>(w[k], weight + c);
                    pd[k] = load_packed<VEC>(dout + off + c);
                    px[k] = load_packed<VEC>(inp + off + c);
                    if (DINP) pold[k] = load_packed<VEC>(dinp + off + c);
                }
                float d[VEC], x[VEC], old[VEC];
                unpack<VEC>(d, pd[k]);
                unpack<VEC>(x, px[k]);
                if (DINP) unpack<VEC>(old, pold[k]);
#pragma unroll
                for (int i = 0; i < VEC; i++) {
                    const float xh = (x[i] - m) * s;
                    if (DINP) old[i] += s * (d[i] * w[k][i] - mg - xh * mgx);
                    dw[k][i] += d[i] * xh;
                    if constexpr (!RMS) db[k][i] += d[i];
                }
                if (DINP) store_floatX<VEC>(dinp + off + c, old);
            }
        }
    }
    // fold the row groups into group 0, in order y = 1, 2, ... (fixed: deterministic)
    const int stride = blockDim.x * K * VEC;  // floats per partial in `fold`
    for (int y = 1; y < (int)blockDim.y; y++) {
        if ((int)threadIdx.y == y) {
#pragma unroll
            for (int k = 0; k < K; k++)
#pragma unroll
                for (int i = 0; i < VEC; i++) {
                    const int j = (k * VEC + i) * blockDim.x + threadIdx.x;  // consecutive threads, consecutive banks
                    fold[j] = dw[k][i];
                    if constexpr (!RMS) fold[stride + j] = db[k][i];
                }
        }
        __syncthreads();
        if (threadIdx.y == 0) {
#pragma unroll
            for (int k = 0; k < K; k++)
#pragma unroll
                for (int i = 0; i < VEC; i++) {
                    const int j = (k * VEC + i) * blockDim.x + threadIdx.x;
                    dw[k][i] += fold[j];
                    if constexpr (!RMS) db[k][i] += fold[stride + j];
                }
        }
        __syncthreads();
    }
    if (threadIdx.y != 0) return;
    constexpr int NP = RMS ? 1 : 2;
    float* pw = partials + (size_t)blockIdx.x * NP * C;
    float* pb = pw + C;
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int c = VEC * (threadIdx.x + k * blockDim.x);
        if (c < C) {
#pragma unroll
            for (int i = 0; i < VEC; i++) {
                pw[c + i] = dw[k][i];
                if constexpr (!RMS) pb[c + i] = db[k][i];
            }
        }
    }
}

// dweight[c] += sum_p partials[p][0][c], dbias[c] += sum_p partials[p][1][c] (fp32, one add). block (32, 32):
// lane x owns channel blockIdx.x * 32 + x, lane y sums partials y, y + 32, ...; then the 32 in order.
// grid (ceil(C / 32), NP): blockIdx.y 0 is dweight, 1 dbias; partials [n_parts][NP][C] (RMSNorm: NP 1,
// dweight alone, dbias unused).
template <int NP>
__global__ void layernorm_param_grad_kernel(float* __restrict__ dweight, float* __restrict__ dbias,
                                            const float* __restrict__ partials, int n_parts, int C) {
    __shared__ float red[32][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    const int which = blockIdx.y;
    float s = 0.0f;
    if (c < C)
        for (int p = threadIdx.y; p < n_parts; p += 32) s += partials[((size_t)p * NP + which) * C + c];
    red[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float t = 0.0f;
        for (int y = 0; y < 32; y++) t += red[y][threadIdx.x];
        float* dst = which == 0 ? dweight : dbias;
        dst[c] = __fadd_rn(dst[c], t);
    }
}

// The block shape for a row of C channels: VEC channels per access, K accesses per thread,
// x threads across the row (a multiple of 32), y rows per block (x * y <= target threads, y >= 1).
struct Shape {
    int vec, k, x, y;
};
inline Shape row_shape(int C, bool vec, int target_threads, int max_x, const char* who = "layernorm") {
    Shape s;
    s.vec = vec ? 8 : 1;
    const int units = ceil_div(C, s.vec);
    s.k = 1;
    while (ceil_div(units, s.k) > max_x) s.k *= 2;
    LLMC_CHECK(s.k <= 4, "%s: C = %d is too wide for the %s path (at most %d)", who, C,
               vec ? "16-byte" : "scalar (C % 8 != 0 or unaligned)", 4 * s.vec * max_x);
    s.x = ceil_div(ceil_div(units, s.k), 32) * 32;
    s.y = std::max(1, target_threads / s.x);
    return s;
}

// The backward kernel for a shape (launched, and queried for its occupancy)
template <bool DINP, bool RMS>
inline const void* backward_kernel_for(const Shape& s) {
    const void* kernel = nullptr;
    with_pow2<1, 4>(s.k, [&](auto k) {
        constexpr int K = decltype(k)::value;
        kernel = s.vec == 8 ? (const void*)layernorm_backward_kernel<8, K, DINP, RMS>
                            : (const void*)layernorm_backward_kernel<1, K, DINP, RMS>;
    });
    return kernel;
}
inline const void* backward_kernel_for(const Shape& s, bool dinp, bool rms = false) {
    if (rms) return dinp ? backward_kernel_for<true, true>(s) : backward_kernel_for<false, true>(s);
    return dinp ? backward_kernel_for<true, false>(s) : backward_kernel_for<false, false>(s);
}

// The backward's fixed partition: G blocks of rows_per_block rows (one resident wave). rms: RMSNorm's
// kernels (one partial row per block instead of two)
struct BackwardGrid {
    Shape shape;
    size_t smem;
    int blocks, rows_per_block;
};
inline BackwardGrid backward_grid(int N, int C, bool vec, bool rms = false) {
    BackwardGrid g;
    g.shape = row_shape(C, vec, BWD_THREADS, vec ? BWD_MAX_X : 1024, rms ? "rmsnorm" : "layernorm");
    const Shape& s = g.shape;
    g.smem = s.y > 1 ? (rms ? 1 : 2) * (size_t)s.x * s.k * s.vec * sizeof(float) : 0;
    const int groups = std::max(1, ceil_div(N, s.y));  // blocks with at least one row each
    const int blocks = std::min(groups, (int)wave_blocks(backward_kernel_for(s, true, rms), s.x * s.y, g.smem));
    g.rows_per_block = ceil_div(std::max(N, 1), blocks);
    g.blocks = ceil_div(std::max(N, 1), g.rows_per_block);
    return g;
}

// the forwards (RMS: mean and bias null)
template <bool FUSED, bool RMS>
inline void forward_launch(floatX* residual, floatX* out, float* mean, float* rstd, const floatX* inp1,
                           const floatX* inp2, const floatX* weight, const floatX* bias, int N, int C, float eps) {
    if (N == 0) return;
    const bool vec = C % 8 == 0 && aligned16(out) && aligned16(inp1) && aligned16(weight) && aligned16(bias) &&
                     (!FUSED || (aligned16(inp2) && aligned16(residual)));
    const Shape s = row_shape(C, vec, FWD_THREADS, FWD_MAX_X, RMS ? "rmsnorm" : "layernorm");
    const dim3 block(s.x, s.y);
    const int grid = ceil_div(N, s.y);
    cudaStream_t st = llmc_stream();
    with_pow2<1, 4>(s.k, [&](auto k) {
        constexpr int K = decltype(k)::value;
        if (s.vec == 8)
            layernorm_forward_kernel<8, K, FUSED, RMS><<<grid, block, 0, st>>>(residual, out, mean, rstd, inp1, inp2,
                                                                               weight, bias, N, C, eps);
        else
            layernorm_forward_kernel<1, K, FUSED, RMS><<<grid, block, 0, st>>>(residual, out, mean, rstd, inp1, inp2,
                                                                               weight, bias, N, C, eps);
    });
    cudaCheckLaunch();
}

// the backward (RMS: mean and dbias null, one partial row per block); scratch_bound: the plan's bound
// for this op (llmc/ops/op_scratch.h), which the grid must stay within
template <bool RMS>
inline void backward_launch(floatX* dinp, float* dweight, float* dbias, const floatX* dout, const floatX* inp,
                            const floatX* weight, const float* mean, const float* rstd, int N, int C,
                            size_t scratch_bound) {
    if (N == 0 || C == 0) return;
    const char* who = RMS ? "rmsnorm_backward" : "layernorm_backward";
    constexpr int NP = RMS ? 1 : 2;  // partial rows per block
    const bool vec = C % 8 == 0 && aligned16(dinp) && aligned16(dout) && aligned16(inp) && aligned16(weight);
    // one grid for both halves (the full kernel's occupancy): the weight-gradient half alone must sum
    // its partials exactly as the full backward does (a layout moves bytes, not math)
    const BackwardGrid g = backward_grid(N, C, vec, RMS);
    const Shape& s = g.shape;
    LLMC_CHECK((size_t)g.blocks * NP * C * sizeof(float) <= scratch_bound,
               "internal: %s's grid of %d blocks exceeds the bound of llmc/ops/op_scratch.h", who, g.blocks);
    float* partials = cuda_scratch<float>((size_t)g.blocks * NP * C, who);
    using Kernel = void (*)(floatX*, float*, const floatX*, const floatX*, const floatX*, const float*, const float*,
                            int, int, int);
    const Kernel kernel = (Kernel)backward_kernel_for(s, dinp != nullptr, RMS);
    kernel<<<g.blocks, dim3(s.x, s.y), g.smem, llmc_stream()>>>(dinp, partials, dout, inp, weight, mean, rstd, N, C,
                                                                g.rows_per_block);
    cudaCheckLaunch();
    if (!dweight) return;  // the input gradient alone (the zero-bubble pipeline's B)
    layernorm_param_grad_kernel<NP><<<dim3(ceil_div(C, 32), NP), dim3(32, 32), 0, llmc_stream()>>>(dweight, dbias,
                                                                                                  partials, g.blocks, C);
    cudaCheckLaunch();
}

}  // namespace layernorm_detail

// bytes of cuda_scratch that layernorm_backward may take for N rows of C channels on this GPU (the
// forwards take none): the plan's bound (llmc/ops/op_scratch.h), which the backward checks
inline size_t layernorm_scratch_bytes(int N, int C) { return layernorm_scratch_bytes(N, C, sm_count()); }

// out [N, C] overwritten, mean, rstd [N] (fp32) overwritten
inline void layernorm_forward(floatX* out, float* mean, float* rstd, const floatX* inp, const floatX* weight,
                              const floatX* bias, int N, int C) {
    layernorm_detail::forward_launch<false, false>(nullptr, out, mean, rstd, inp, nullptr, weight, bias, N, C,
                                                   layernorm_detail::EPS);
}

// residual = inp1 + inp2 (rounded to bf16), out = LN(residual); residual, out, mean, rstd overwritten.
// residual must not overlap inp1 / inp2 except exactly (residual == inp1 is fine).
inline void fused_residual_layernorm_forward(floatX* residual, floatX* out, float* mean, float* rstd,
                                             const floatX* inp1, const floatX* inp2, const floatX* weight,
                                             const floatX* bias, int N, int C) {
    layernorm_detail::forward_launch<true, false>(residual, out, mean, rstd, inp1, inp2, weight, bias, N, C,
                                                  layernorm_detail::EPS);
}

// out = bf16(inp1 + inp2), elementwise (the residual add where a pipeline stage ends; the same sum,
// rounded once, that fused_residual_layernorm_forward stores). A thread per element: memory-bound.
__global__ void residual_forward_kernel(floatX* out, const floatX* inp1, const floatX* inp2, long N) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) out[i] = float_to_floatX(floatX_to_float(inp1[i]) + floatX_to_float(inp2[i]));
}
inline void residual_forward(floatX* out, const floatX* inp1, const floatX* inp2, long N) {
    if (N == 0) return;
    LLMC_CHECK(ceil_div(N, 256L) <= INT32_MAX, "residual_forward: N = %ld is too large for the grid", N);
    residual_forward_kernel<<<(unsigned)ceil_div(N, 256L), 256, 0, llmc_stream()>>>(out, inp1, inp2, N);
    cudaCheckLaunch();
}

// dinp += (the residual stream's gradient), dweight +=, dbias += (fp32, one add each; deterministic). dinp may be null
// (weight is then not read), or dweight and dbias both null: input and weight gradients in two calls.
// Scratch: layernorm_scratch_bytes(N, C).
inline void layernorm_backward(floatX* dinp, float* dweight, float* dbias, const floatX* dout, const floatX* inp,
                               const floatX* weight, const float* mean, const float* rstd, int N, int C) {
    layernorm_detail::backward_launch<false>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C,
                                             layernorm_scratch_bytes(N, C));
}
