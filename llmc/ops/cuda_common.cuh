// What every CUDA file shares: error checking, the element type, the stream, the SM count and a
// kernel's one-wave grid (wave_blocks), the dispatch of a runtime size to a kernel template instance
// (with_pow2), a scratch arena sized once at start-up (kernels never cudaMalloc inside a training
// step), bf16 helpers (stochastic rounding; namespace bf16x8: 16-byte vectors of 8 bf16 <-> fp32).
//
// Conventions of the GPU ops (llmc/ops/<op>.cuh), the twins of llmc/ops/cpu/<op>.h:
//  - same function name and argument order as the CPU reference; tensors are floatX (bf16),
//    statistics (LayerNorm mean/rstd, attention log-sum-exp, losses) are float; all pointers
//    are device pointers unless the name says host_
//  - "overwritten" vs "accumulated (+=)" outputs exactly as the CPU twin documents
//  - every launch is followed by cudaCheckLaunch(); work goes on llmc_stream()
//  - deterministic: no float atomics whose order can change between runs
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <utility>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include "llmc/utils.h"

typedef __nv_bfloat16 floatX;

inline void cuda_check(cudaError_t err, const char* file, int line) {
    if (err != cudaSuccess) LLMC_FAIL("CUDA error at %s:%d: %s", file, line, cudaGetErrorString(err));
}
#define cudaCheck(err) cuda_check((err), __FILE__, __LINE__)

// What the host asks of the GPU, counted (the trainer prints them per step, test_gpu bounds them):
// launches = every cudaCheckLaunch(), i.e. each of our kernel launches and each library call that
// is followed by one (a cuBLASLt matmul, a cub sort: one each, whatever kernels they run inside);
// host_syncs = every time the host waits for the GPU's work (llmc_stream_sync, which the copies to
// the host use, and the offload's event waits); stream_syncs = the llmc_stream_sync calls alone
// (after one, everything queued before it is done). Memsets and async copies are neither.
struct GpuCounters {
    uint64_t launches = 0, host_syncs = 0, stream_syncs = 0;
};
inline GpuCounters& gpu_counters() {
    static GpuCounters c;
    return c;
}
// after every kernel launch: a bad launch configuration fails here, not somewhere later
#define cudaCheckLaunch() (gpu_counters().launches++, cuda_check(cudaGetLastError(), __FILE__, __LINE__))

// One stream for all work (cudaStreamPerThread keeps the default-stream semantics simple).
inline cudaStream_t llmc_stream() { return cudaStreamPerThread; }
// The host waits for everything queued on the stream (counted: a host sync)
inline void llmc_stream_sync() {
    gpu_counters().host_syncs++;
    gpu_counters().stream_syncs++;
    cudaCheck(cudaStreamSynchronize(llmc_stream()));
}

// The current device's streaming multiprocessors (asked once: a process uses one device).
inline int sm_count() {
    static int n = 0;
    if (n == 0) {
        int dev;
        cudaCheck(cudaGetDevice(&dev));
        cudaCheck(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    }
    return n;
}
// Blocks of `kernel` (threads per block, smem_bytes of dynamic shared memory) resident on the whole
// GPU at once: one wave, at least one block per SM.
template <typename Kernel>
inline size_t wave_blocks(Kernel kernel, int threads, size_t smem_bytes = 0) {
    int per_sm = 0;
    cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem_bytes));
    return (size_t)sm_count() * (size_t)std::max(1, per_sm);
}

// Runtime size -> kernel template instance: calls f(std::integral_constant<int, P>{}) for the
// smallest P of LO, 2 LO, 4 LO, ..., HI with x <= P (P = HI when x > HI), so that f can launch the
// instance compiled for P, e.g.
//   with_pow2<1, 4>(k, [&](auto kc) { my_kernel<decltype(kc)::value><<<grid, block>>>(...); });
template <int LO, int HI, typename F>
inline void with_pow2(int x, F&& f) {
    if constexpr (LO >= HI) {
        f(std::integral_constant<int, HI>{});
    } else {
        if (x <= LO) f(std::integral_constant<int, LO>{});
        else with_pow2<2 * LO, HI>(x, std::forward<F>(f));
    }
}

// Scratch arena: handed out by ops that need temporary space (the partial sums of deterministic
// reductions; sizes in llmc/ops/op_scratch.h). An op asking for more than the arena holds fails with a
// clear message instead of allocating. The trainer binds a part of its memory plan (the MEM_SCRATCH
// arena, llmc/memory.h) with cuda_scratch_bind; tests and benchmarks reserve their own with
// cuda_scratch_reserve (grown on demand, owned here), which binding nullptr returns to.
struct CudaScratch {
    char* base = nullptr;  // the bound arena
    size_t bytes = 0;
    char* owned = nullptr;  // cuda_scratch_reserve's
    size_t owned_bytes = 0;
};
inline CudaScratch& cuda_scratch_arena() {
    static CudaScratch s;
    return s;
}
inline void cuda_scratch_bind(void* base, size_t bytes) {
    CudaScratch& s = cuda_scratch_arena();
    s.base = base ? (char*)base : s.owned;
    s.bytes = base ? bytes : s.owned_bytes;
}
inline void cuda_scratch_reserve(size_t bytes) {
    CudaScratch& s = cuda_scratch_arena();
    if (bytes > s.owned_bytes) {
        if (s.owned) cudaCheck(cudaFree(s.owned));
        cudaCheck(cudaMalloc(&s.owned, bytes));
        s.owned_bytes = bytes;
    }
    cuda_scratch_bind(nullptr, 0);
}
// The arena is shared: a pointer is valid until the next op asks for scratch.
template <typename T>
inline T* cuda_scratch(size_t count, const char* who) {
    CudaScratch& s = cuda_scratch_arena();
    LLMC_CHECK(count * sizeof(T) <= s.bytes, "%s needs %zu bytes of scratch, the arena holds %zu (llmc/ops/op_scratch.h)",
               who, count * sizeof(T), s.bytes);
    return (T*)s.base;
}

// Stochastic rounding fp32 -> bf16 (unbiased in expectation): add uniform random bits below the
// bf16 mantissa before truncating. random is a 32-bit hash of (seed, index). Integer operations
// only, so the host computes the same bits (--offload optimizer rounds on the CPU, llmc/parallel/offload.h).
__host__ __device__ inline uint32_t llmc_hash(uint32_t x) {
    x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
    return x;
}
__host__ __device__ inline uint32_t llmc_float_bits(float x) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(x);
#else
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    return u;
#endif
}
__host__ __device__ inline float llmc_bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
#endif
}
__host__ __device__ inline floatX stochastic_round_bf16(float x, uint32_t random) {
    uint32_t bits = llmc_float_bits(x);
    if ((bits & 0x7f800000u) == 0x7f800000u) return __float2bfloat16_rn(x);  // inf / nan unchanged
    bits += random & 0xffffu;
    bits &= 0xffff0000u;
    return __float2bfloat16_rn(llmc_bits_float(bits));
}

// ------------------------------------------------------------------------------------------------
// bf16x8: the 16-byte vector paths of the kernels. VEC = 8 consecutive bf16 move as one uint4 (one
// 16-byte access: the pointer must be 16-byte aligned, see aligned16); VEC = 1 is the scalar
// fallback (element by element, any alignment). No type punning: a bf16 is the high half of the
// fp32 with the same value (so bf16 -> fp32 is exact, a 16-bit shift), and in a 32-bit word of two
// packed bf16 the lower address is the low half. Rounding fp32 -> bf16 is to nearest even
// (__float2bfloat16_rn) everywhere here; pack_bf16_bits packs values that are bf16 already.
// The op headers pull these in with `using namespace bf16x8;` inside their <op>_detail namespace.
namespace bf16x8 {

inline bool aligned16(const void* p) { return ((uintptr_t)p & 15) == 0; }

// the low / high bf16 of a 32-bit word, as fp32 (exact)
__device__ inline float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ inline float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
// two bf16 into one word, as they lie in memory (lo at the lower address)
__device__ inline uint32_t pack_bf16_bits(floatX lo, floatX hi) {
    return (uint32_t)__bfloat16_as_ushort(lo) | ((uint32_t)__bfloat16_as_ushort(hi) << 16);
}
// two fp32, each rounded to the nearest bf16, into one word
__device__ inline uint32_t pack_bf16(float lo, float hi) {
    return pack_bf16_bits(__float2bfloat16_rn(lo), __float2bfloat16_rn(hi));
}
// the 8 bf16 of a 16-byte word as fp32, in memory order
__device__ inline void unpack8(float (&f)[8], const uint4& u) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        f[2 * k] = bf16_lo(w[k]);
        f[2 * k + 1] = bf16_hi(w[k]);
    }
}

// VEC consecutive bf16 <-> fp32; VEC == 8 is one 16-byte access (p must be 16-byte aligned)
template <int VEC>
__device__ inline void load_bf16(float (&f)[VEC], const floatX* p) {
    if constexpr (VEC == 8) {
        const uint4 u = *reinterpret_cast<const uint4*>(p);  // (a copy: one 16-byte load, never four of 4)
        unpack8(f, u);
    } else {
#pragma unroll
        for (int k = 0; k < VEC; k++) f[k] = __bfloat162float(p[k]);
    }
}
template <int VEC>
__device__ inline void store_bf16(floatX* p, const float (&f)[VEC]) {
    if constexpr (VEC == 8) {
        *reinterpret_cast<uint4*>(p) = make_uint4(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]),
                                                  pack_bf16(f[4], f[5]), pack_bf16(f[6], f[7]));
    } else {
#pragma unroll
        for (int k = 0; k < VEC; k++) p[k] = __float2bfloat16_rn(f[k]);
    }
}

// VEC bf16 exactly as stored (one 16-byte word for VEC == 8; VEC == 1 only), unpacked to fp32 where
// used: what a thread keeps in registers across barriers or loads ahead costs half the registers of
// fp32 copies
template <int VEC>
using Packed = std::conditional_t<VEC == 8, uint4, floatX>;
template <int VEC>
__device__ inline Packed<VEC> load_packed(const floatX* p) {
    return *reinterpret_cast<const Packed<VEC>*>(p);
}
template <int VEC>
__device__ inline void unpack(float (&f)[VEC], const Packed<VEC>& u) {
    if constexpr (VEC == 8) unpack8(f, u);
    else f[0] = __bfloat162float(u);
}

}  // namespace bf16x8
