// Gradient accumulation in fp32 on the GPU, the twin of llmc/ops/cpu/accumulate.h:
//   acc[i] += (float)x[i]        acc: fp32 [n] (accumulated), x: bf16 [n] (the micro-batch's leaf
//                                gradient, read only)
// The trainer calls this after each micro-batch's backward, in micro-batch order, so the step's
// gradient is summed in fp32 (Megatron's main_grad) and only the per-micro-batch leaf is bf16.
//
// Exactness: bf16 -> fp32 is exact (a 16-bit shift), and the one addition is spelled __fadd_rn
// (IEEE round to nearest, never fused or approximated whatever -fmad / --use_fast_math say), so
// every element is the CPU twin's value bit for bit. (Only -ftz, part of --use_fast_math, differs:
// a denormal acc or sum flushes to zero here.)
//
// Parallel decomposition: purely elementwise, memory bound: 10 bytes per element (read x 2 + acc
// 4, write acc 4), no reuse. Vector path (acc and x both 16-byte aligned): a thread owns 8
// consecutive elements per iteration of a grid-stride loop: one 16-byte load of 8 bf16, two 16-byte
// loads and two 16-byte stores of fp32 acc; the n % 8 tail elements go one each to the first
// threads of the grid. Scalar path (either pointer not 16-byte aligned, e.g. a slice at an odd
// offset): one element per thread per iteration. Both paths evaluate the same per-element addition,
// so they give identical bits. Streaming hints (__ldcs/__stcs): the buffers are touched once per
// call and are far larger than L2. The grid is one wave of resident blocks.
//
// Scratch: none.
#pragma once
#include <algorithm>
#include <cstdint>
#include "llmc/ops/cuda_common.cuh"

constexpr int ACCUMULATE_THREADS = 256;

// VEC8: acc and x 16-byte aligned; a thread owns elements 8j..8j+7 (one iteration per j).
// !VEC8: a thread owns element j.
template <bool VEC8>
__global__ void __launch_bounds__(ACCUMULATE_THREADS) grad_accumulate_kernel(float* acc, const floatX* x, size_t n) {
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    if constexpr (!VEC8) {
        for (size_t i = tid; i < n; i += stride) acc[i] = __fadd_rn(acc[i], __bfloat162float(x[i]));
        return;
    }
    const size_t n8 = n / 8;
    for (size_t j = tid; j < n8; j += stride) {
        const size_t i0 = j * 8;
        float g[8];
        bf16x8::unpack8(g, __ldcs(reinterpret_cast<const uint4*>(x + i0)));
        float4 a0 = __ldcs(reinterpret_cast<const float4*>(acc + i0));
        float4 a1 = __ldcs(reinterpret_cast<const float4*>(acc + i0 + 4));
        a0.x = __fadd_rn(a0.x, g[0]);
        a0.y = __fadd_rn(a0.y, g[1]);
        a0.z = __fadd_rn(a0.z, g[2]);
        a0.w = __fadd_rn(a0.w, g[3]);
        a1.x = __fadd_rn(a1.x, g[4]);
        a1.y = __fadd_rn(a1.y, g[5]);
        a1.z = __fadd_rn(a1.z, g[6]);
        a1.w = __fadd_rn(a1.w, g[7]);
        __stcs(reinterpret_cast<float4*>(acc + i0), a0);
        __stcs(reinterpret_cast<float4*>(acc + i0 + 4), a1);
    }
    // the last n % 8 elements (fewer than a block's threads: block 0 owns them)
    const size_t i = n8 * 8 + tid;
    if (tid < n - n8 * 8) acc[i] = __fadd_rn(acc[i], __bfloat162float(x[i]));
}

// Blocks of one kernel instantiation that fit on the whole GPU at once (cached per instantiation).
template <bool VEC8>
inline size_t grad_accumulate_wave_blocks() {
    static size_t blocks = 0;
    if (blocks == 0) {
        int dev = 0, sms = 0, per_sm = 0;
        cudaCheck(cudaGetDevice(&dev));
        cudaCheck(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
        cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, grad_accumulate_kernel<VEC8>,
                                                                ACCUMULATE_THREADS, 0));
        blocks = (size_t)sms * (size_t)(per_sm > 0 ? per_sm : 1);
    }
    return blocks;
}

// Runs the vector path (vec8 = true; acc and x must be 16-byte aligned) or the scalar path.
// grad_accumulate picks; dev/cuda/accumulate.cu times both.
inline void grad_accumulate_launch(bool vec8, float* acc, const floatX* x, size_t n) {
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

// acc: fp32 [n], accumulated (+=); x: bf16 [n], read only. Device pointers.
inline void grad_accumulate(float* acc, const floatX* x, size_t n) {
    using bf16x8::aligned16;
    grad_accumulate_launch(aligned16(acc) && aligned16(x), acc, x, n);
}

// acc += x with both fp32: once per step, the tied embedding's two accumulators (the lm head's and
// the token embedding's). One addition per element, rounded to nearest: the CPU twin's bits.
__global__ void grad_accumulate_fp32_kernel(float* acc, const float* x, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        acc[i] = __fadd_rn(acc[i], x[i]);
}
inline void grad_accumulate(float* acc, const float* x, size_t n) {
    if (n == 0) return;
    const size_t blocks = std::min((n + ACCUMULATE_THREADS - 1) / ACCUMULATE_THREADS, (size_t)65535);
    grad_accumulate_fp32_kernel<<<(unsigned)blocks, ACCUMULATE_THREADS, 0, llmc_stream()>>>(acc, x, n);
    cudaCheckLaunch();
}

// Tensor-parallel reductions (llmc/parallel/tensor_parallel.h; CPU twins in llmc/ops/cpu/accumulate.h): the bias
// of a row-parallel layer, added once after the reduction (out[r, o] += bias[o], one thread per
// element, fp32 add rounded once to bf16), and the running maximum of the vocab-parallel softmax.
__global__ void add_bias_kernel(floatX* out, const floatX* bias, size_t n, int OC) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16_rn(__bfloat162float(out[i]) + __bfloat162float(bias[i % OC]));
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
