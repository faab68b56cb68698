// Gradient accumulation into fp32 on the GPU: acc[i] += (float)x[i] for bf16 x. One thread per
// element (grid-stride), so every element is added exactly once, in a fixed order.
#pragma once
#include "cuda_common.cuh"

__global__ void grad_accumulate_kernel(float* acc, const floatX* x, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        acc[i] += __bfloat162float(x[i]);
}

inline void grad_accumulate(float* acc, const floatX* x, size_t n) {
    if (n == 0) return;
    const int threads = 256;
    const size_t blocks = std::min<size_t>((n + threads - 1) / threads, 65535);
    grad_accumulate_kernel<<<(unsigned)blocks, threads, 0, llmc_stream()>>>(acc, x, n);
    cudaCheckLaunch();
}
