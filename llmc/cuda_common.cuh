// What every CUDA file shares: error checking, the element type, the stream, a scratch arena
// sized once at start-up (kernels never cudaMalloc inside a training step), bf16 helpers.
//
// Conventions of the GPU ops (llmc/<op>.cuh), the twins of llmc/cpu/<op>.h:
//  - same function name and argument order as the CPU reference; tensors are floatX (bf16),
//    statistics (LayerNorm mean/rstd, attention log-sum-exp, losses) are float; all pointers
//    are device pointers unless the name says host_
//  - "overwritten" vs "accumulated (+=)" outputs exactly as the CPU twin documents
//  - every launch is followed by cudaCheckLaunch(); work goes on llmc_stream()
//  - deterministic: no float atomics whose order can change between runs
#pragma once
#include <cstdint>
#include <cstdio>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include "utils.h"

typedef __nv_bfloat16 floatX;

inline void cuda_check(cudaError_t err, const char* file, int line) {
    if (err != cudaSuccess) LLMC_FAIL("CUDA error at %s:%d: %s", file, line, cudaGetErrorString(err));
}
#define cudaCheck(err) cuda_check((err), __FILE__, __LINE__)
// after every kernel launch: a bad launch configuration fails here, not somewhere later
#define cudaCheckLaunch() cuda_check(cudaGetLastError(), __FILE__, __LINE__)

// One stream for all work (cudaStreamPerThread keeps the default-stream semantics simple).
inline cudaStream_t llmc_stream() { return cudaStreamPerThread; }

// Scratch arena: reserved once (cuda_scratch_reserve at start-up, sized for the largest op), then
// handed out by ops that need temporary space (partial sums of deterministic reductions). An op
// asking for more than was reserved fails with a clear message instead of allocating.
struct CudaScratch {
    char* base = nullptr;
    size_t bytes = 0;
};
inline CudaScratch& cuda_scratch_arena() {
    static CudaScratch s;
    return s;
}
inline void cuda_scratch_reserve(size_t bytes) {
    CudaScratch& s = cuda_scratch_arena();
    if (bytes <= s.bytes) return;
    if (s.base) cudaCheck(cudaFree(s.base));
    cudaCheck(cudaMalloc(&s.base, bytes));
    s.bytes = bytes;
}
// The arena is shared: a pointer is valid until the next op asks for scratch.
template <typename T>
inline T* cuda_scratch(size_t count, const char* who) {
    CudaScratch& s = cuda_scratch_arena();
    LLMC_CHECK(count * sizeof(T) <= s.bytes, "%s needs %zu bytes of scratch, %zu were reserved (cuda_scratch_reserve)",
               who, count * sizeof(T), s.bytes);
    return (T*)s.base;
}

// Stochastic rounding fp32 -> bf16 (unbiased in expectation): add uniform random bits below the
// bf16 mantissa before truncating. random is a 32-bit hash of (seed, index).
__device__ inline uint32_t llmc_hash(uint32_t x) {
    x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
    return x;
}
__device__ inline floatX stochastic_round_bf16(float x, uint32_t random) {
    uint32_t bits = __float_as_uint(x);
    if ((bits & 0x7f800000u) == 0x7f800000u) return __float2bfloat16_rn(x);  // inf / nan unchanged
    bits += random & 0xffffu;
    bits &= 0xffff0000u;
    return __float2bfloat16_rn(__uint_as_float(bits));
}
