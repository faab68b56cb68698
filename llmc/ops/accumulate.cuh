// Gradient accumulation in fp32 on the GPU, the twin of llmc/ops/cpu/accumulate.h:
//   acc[i] += x[i]        acc: fp32 [n] (accumulated), x: fp32 [n] (read only)
// Its callers: the fold of a micro-batch's fp32 leaf gradient into the owners' accumulators
// (zero.h's reduce_scatter_add, in global micro-batch order), the tied embedding's two accumulators
// once per step (the lm head's into the token embedding's), and the tensor-parallel sums of fp32
// partials (LayerNorm weight gradients, the vocab-parallel softmax's sums).
//
// Exactness: the one addition is spelled __fadd_rn (IEEE round to nearest, never fused or
// approximated whatever -fmad / --use_fast_math say), so every element is the CPU twin's value bit
// for bit. (Only -ftz, part of --use_fast_math, differs: a denormal acc or sum flushes to zero here.)
//
// Parallel decomposition: purely elementwise, memory bound: 12 bytes per element (read x 4 + acc
// 4, write acc 4), no reuse. Vector path (acc and x both 16-byte aligned): a thread owns 8
// consecutive elements per iteration of a grid-stride loop: two 16-byte loads of x, two of acc and
// two 16-byte stores; the n % 8 tail elements go one each to the first threads of the grid. Scalar
// path (either pointer not 16-byte aligned, e.g. a slice at an odd offset): one element per thread
// per iteration. Both paths evaluate the same per-element addition, so they give identical bits.
// Streaming hints (__ldcs/__stcs): the buffers are touched once per call and are far larger than
// L2. The grid is one wave of resident blocks.
//
// Scratch: none.
#pragma once
#include <algorithm>
#include <cstdint>
#include "llmc/ops/cuda_common.cuh"

constexpr int ACCUMULATE_THREADS = 256;

__device__ inline float4 add4_rn(float4 a, float4 b) {
    return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
}

// VEC8: acc and x 16-byte aligned; a thread owns elements 8j..8j+7 (one iteration per j).
// !VEC8: a thread owns element j.
template <bool VEC8>
__global__ void __launch_bounds__(ACCUMULATE_THREADS) grad_accumulate_kernel(float* acc, const float* x, size_t n) {
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    if constexpr (!VEC8) {
        for (size_t i = tid; i < n; i += stride) acc[i] = __fadd_rn(acc[i], x[i]);
        return;
    }
    const size_t n8 = n / 8;
    for (size_t j = tid; j < n8; j += stride) {
        const size_t i0 = j * 8;
        const float4 g0 = __ldcs(reinterpret_cast<const float4*>(x + i0));
        const float4 g1 = __ldcs(reinterpret_cast<const float4*>(x + i0 + 4));
        const float4 a0 = __ldcs(reinterpret_cast<const float4*>(acc + i0));
        const float4 a1 = __ldcs(reinterpret_cast<const float4*>(acc + i0 + 4));
        __stcs(reinterpret_cast<float4*>(acc + i0), add4_rn(a0, g0));
        __stcs(reinterpret_cast<float4*>(acc + i0 + 4), add4_rn(a1, g1));
    }
    // the last n % 8 elements (fewer than a block's threads: block 0 owns them)
    const size_t i = n8 * 8 + tid;
    if (tid < n - n8 * 8) acc[i] = __fadd_rn(acc[i], x[i]);
}

// Blocks of one kernel instantiation that fit on the whole GPU at once (cached per instantiation).
template <bool VEC8>
inline size_t grad_accumulate_wave_blocks() {
    static const size_t blocks = wave_blocks(grad_accumulate_kernel<VEC8>, ACCUMULATE_THREADS);
    return blocks;
}

// Runs the vector path (vec8 = true; acc and x must be 16-byte aligned) or the scalar path.
// grad_accumulate picks; dev/cuda/accumulate.cu times both.
inline void grad_accumulate_launch(bool vec8, float* acc, const float* x, size_t n) {
    if (n == 0) return;
    const size_t work = vec8 ? std::max<size_t>(n / 8, 1) : n;  // >= 1: the tail needs a thread
    const size_t needed = (work + ACCUMULATE_THREADS - 1) / ACCUMULATE_THREADS;
    if (vec8) {
        const size_t grid = std::min(needed, grad_accumulate_wave_blocks<true>());
        grad_accumulate_kernel<true><<<(unsigned)grid, ACCUMULATE_THREADS, 0, llmc_stream()>>>(acc, x, n);
    } else {
        const size_t grid = std::min(needed, grad_accumulate_wave_blocks<false>());
        grad_accumulate_kernel<false><<<(unsigned)grid, ACCUMULATE_THREADS, 0, llmc_stream()>>>(acc, x, n);
    }
    cudaCheckLaunch();
}

// acc: fp32 [n], accumulated (+=); x: fp32 [n], read only. Device pointers.
inline void grad_accumulate(float* acc, const float* x, size_t n) {
    using floatx8::aligned16;
    grad_accumulate_launch(aligned16(acc) && aligned16(x), acc, x, n);
}

// Tensor-parallel reductions (llmc/parallel/tensor_parallel.h; CPU twins in llmc/ops/cpu/accumulate.h): the bias
// of a row-parallel layer, added once after the reduction (out[r, o] += bias[o], one thread per
// element, fp32 add rounded once to bf16), and the running maximum of the vocab-parallel softmax.
__global__ void add_bias_kernel(floatX* out, const floatX* bias, size_t n, int OC) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = float_to_floatX(floatX_to_float(out[i]) + floatX_to_float(bias[i % OC]));
}
inline void add_bias(floatX* out, const floatX* bias, int rows, int OC) {
    const size_t n = (size_t)rows * OC;
    if (n == 0) return;
    const size_t blocks = std::min((n + ACCUMULATE_THREADS - 1) / ACCUMULATE_THREADS, (size_t)65535);
    add_bias_kernel<<<(unsigned)blocks, ACCUMULATE_THREADS, 0, llmc_stream()>>>(out, bias, n, OC);
    cudaCheckLaunch();
}
__global__ void max_into_kernel(float* a, const float* b, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        a[i] = fmaxf(a[i], b[i]);
}
inline void max_into(float* a, const float* b, size_t n) {
    if (n == 0) return;
    const size_t blocks = std::min((n + ACCUMULATE_THREADS - 1) / ACCUMULATE_THREADS, (size_t)65535);
    max_into_kernel<<<(unsigned)blocks, ACCUMULATE_THREADS, 0, llmc_stream()>>>(a, b, n);
    cudaCheckLaunch();
}
