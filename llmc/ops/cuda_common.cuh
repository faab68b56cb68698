// What every CUDA file shares: error checking, the element type, the stream, the SM count and a
// kernel's one-wave grid (wave_blocks), the dispatch of a runtime size to a kernel template instance
// (with_pow2), a scratch arena sized once at start-up (kernels never cudaMalloc inside a training
// step), floatX helpers (conversions, stochastic rounding; namespace floatx8: 16-byte vectors of 8
// floatX <-> fp32).
//
// floatX, the element type of params, activations and gradients: bf16 by default (sm_80 and later);
// fp16 in the build with -DLLMC_FP16 (make PRECISION=fp16: cards without bf16, sm_75 T4 / RTX 20xx;
// the loss scaler keeps gradients in fp16's range, llmc/loss_scaler.h). Every kernel compiles for both:
// the type-specific intrinsics live only here (floatX_to_float, float_to_floatX, floatX_bits, ...).
//
// Conventions of the GPU ops (llmc/ops/<op>.cuh), the twins of llmc/ops/cpu/<op>.h:
//  - same function name and argument order as the CPU reference; tensors are floatX (bf16 / fp16),
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
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include "llmc/utils.h"

#ifdef LLMC_FP16
typedef __half floatX;
#define LLMC_PRECISION "fp16"
#define CUDA_R_FLOATX CUDA_R_16F  // floatX to cuBLASLt
#else
typedef __nv_bfloat16 floatX;
#define LLMC_PRECISION "bf16"
#define CUDA_R_FLOATX CUDA_R_16BF
#endif

// fp32 <-> floatX (round to nearest even) and floatX's 16 bits, on the host and the device
__host__ __device__ inline float floatX_to_float(floatX x) {
#ifdef LLMC_FP16
    return __half2float(x);
#else
    return __bfloat162float(x);
#endif
}
__host__ __device__ inline floatX float_to_floatX(float x) {
#ifdef LLMC_FP16
    return __float2half_rn(x);
#else
    return __float2bfloat16_rn(x);
#endif
}
__host__ __device__ inline uint16_t floatX_bits(floatX x) {
#ifdef LLMC_FP16
    return __half_as_ushort(x);
#else
    return __bfloat16_as_ushort(x);
#endif
}
__host__ __device__ inline floatX floatX_from_bits(uint16_t b) {
#ifdef LLMC_FP16
    return __ushort_as_half(b);
#else
    return __ushort_as_bfloat16(b);
#endif
}

// Resident threads per SM of the architecture a device pass compiles for (sm_75: 1024; sm_86, sm_89:
// 1536; sm_80, sm_90: 2048), for __launch_bounds__ minimums that the architecture can hold: ptxas
// ignores (with a warning) a minimum of blocks whose threads exceed it. The host pass sees 2048 (unused).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define LLMC_MAX_THREADS_SM 1024
#elif defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 870 || __CUDA_ARCH__ == 890)
#define LLMC_MAX_THREADS_SM 1536
#else
#define LLMC_MAX_THREADS_SM 2048
#endif
// a __launch_bounds__ minimum of `blocks` blocks of `threads`, capped at what one SM holds
#define LLMC_MIN_BLOCKS(threads, blocks) \
    ((blocks) * (threads) <= LLMC_MAX_THREADS_SM ? (blocks) : LLMC_MAX_THREADS_SM / (threads))

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

// Stochastic rounding fp32 -> floatX (unbiased in expectation): add uniform random bits below the
// floatX mantissa before truncating. random is a 32-bit hash of (seed, index). Integer and exact fp32
// operations only, so the host computes the same bits (--offload optimizer rounds on the CPU,
// llmc/parallel/offload.h).
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
__host__ __device__ inline floatX stochastic_round_floatX(float x, uint32_t random) {
    uint32_t bits = llmc_float_bits(x);
    if ((bits & 0x7f800000u) == 0x7f800000u) return float_to_floatX(x);  // inf / nan unchanged
#ifdef LLMC_FP16
    // fp16 keeps 10 of fp32's 23 mantissa bits: random bits below them, then truncate (the result is an
    // fp16 value, so the final conversion is exact; past 65504 it becomes inf, as any rounding would).
    // Below 2^-14 fp16 is subnormal with a fixed step of 2^-24: floor(|x| 2^24 + u) 2^-24, u in [0, 1)
    // with 16 random bits (|x| 2^24 < 1024: the sum is exact to 2^-13, the bias of that rounding 2^-14 ulp)
    if ((bits & 0x7fffffffu) < 0x38800000u) {
        const float a = fabsf(x) * 16777216.f;
        const float q = floorf(a + (float)(random & 0xffffu) * (1.f / 65536.f));
        return float_to_floatX(copysignf(q * 5.9604644775390625e-8f, x));
    }
    bits += random & 0x1fffu;
    bits &= 0xffffe000u;
#else
    bits += random & 0xffffu;  // bf16: the high 16 bits of the fp32
    bits &= 0xffff0000u;
#endif
    return float_to_floatX(llmc_bits_float(bits));
}

// ------------------------------------------------------------------------------------------------
// floatx8: the 16-byte vector paths of the kernels. VEC = 8 consecutive floatX move as one uint4 (one
// 16-byte access: the pointer must be 16-byte aligned, see aligned16); VEC = 1 is the scalar
// fallback (element by element, any alignment). No type punning: in a 32-bit word of two packed
// floatX the lower address is the low half; a bf16 is the high half of the fp32 with the same value
// (bf16 -> fp32 a 16-bit shift), an fp16 widens exactly by cvt. Rounding fp32 -> floatX is to nearest
// even (float_to_floatX) everywhere here; pack_floatX_bits packs values that are floatX already.
// The op headers pull these in with `using namespace floatx8;` inside their <op>_detail namespace.
namespace floatx8 {

inline bool aligned16(const void* p) { return ((uintptr_t)p & 15) == 0; }

// the low / high floatX of a 32-bit word, as fp32 (exact)
__device__ inline float floatX_lo(uint32_t w) {
#ifdef LLMC_FP16
    return __half2float(__ushort_as_half((unsigned short)(w & 0xffffu)));
#else
    return __uint_as_float(w << 16);
#endif
}
__device__ inline float floatX_hi(uint32_t w) {
#ifdef LLMC_FP16
    return __half2float(__ushort_as_half((unsigned short)(w >> 16)));
#else
    return __uint_as_float(w & 0xffff0000u);
#endif
}
// two floatX into one word, as they lie in memory (lo at the lower address)
__host__ __device__ inline uint32_t pack_floatX_bits(floatX lo, floatX hi) {
    return (uint32_t)floatX_bits(lo) | ((uint32_t)floatX_bits(hi) << 16);
}
// two fp32, each rounded to the nearest floatX, into one word
__host__ __device__ inline uint32_t pack_floatX(float lo, float hi) {
    return pack_floatX_bits(float_to_floatX(lo), float_to_floatX(hi));
}
// the 8 floatX of a 16-byte word as fp32, in memory order
__device__ inline void unpack8(float (&f)[8], const uint4& u) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        f[2 * k] = floatX_lo(w[k]);
        f[2 * k + 1] = floatX_hi(w[k]);
    }
}

// VEC consecutive floatX <-> fp32; VEC == 8 is one 16-byte access (p must be 16-byte aligned)
template <int VEC>
__device__ inline void load_floatX(float (&f)[VEC], const floatX* p) {
    if constexpr (VEC == 8) {
        const uint4 u = *reinterpret_cast<const uint4*>(p);  // (a copy: one 16-byte load, never four of 4)
        unpack8(f, u);
    } else {
#pragma unroll
        for (int k = 0; k < VEC; k++) f[k] = floatX_to_float(p[k]);
    }
}
template <int VEC>
__device__ inline void store_floatX(floatX* p, const float (&f)[VEC]) {
    if constexpr (VEC == 8) {
        *reinterpret_cast<uint4*>(p) = make_uint4(pack_floatX(f[0], f[1]), pack_floatX(f[2], f[3]),
                                                  pack_floatX(f[4], f[5]), pack_floatX(f[6], f[7]));
    } else {
#pragma unroll
        for (int k = 0; k < VEC; k++) p[k] = float_to_floatX(f[k]);
    }
}

// VEC floatX exactly as stored (one 16-byte word for VEC == 8; VEC == 1 only), unpacked to fp32 where
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
    else f[0] = floatX_to_float(u);
}

}  // namespace floatx8
