// AdamW on the GPU, the twin of llmc/ops/cpu/adamw.h (PyTorch's AdamW, decoupled weight decay):
//   g = grad * grad_scale                                  (grad_scale: global-norm clipping)
//   p = master (fp32), or the bf16 param when master_params == nullptr
//   p -= lr * weight_decay * p
//   m = beta1 m + (1 - beta1) g          v = beta2 v + (1 - beta2) g^2        (overwritten)
//   p -= lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)          (t: 1-based step)
//   master = p (when present);  param = stochastic_round_floatX(p)             (overwritten)
//
// Exactness. Every fp32 operation is spelled with an IEEE round-to-nearest intrinsic (__fmul_rn,
// __fdiv_rn, __fsqrt_rn, ...) in the CPU twin's evaluation order, and the bias corrections
// 1 - beta^t are computed on the host with the twin's own expression. So master, m and v are the
// CPU twin's values bit for bit (when the host compiler does not contract a*b+c into an fma and no
// value is denormal), and they do not depend on --use_fast_math / -fmad, which would otherwise turn
// the divisions and the sqrt into approximations and fuse multiply-adds differently in different
// kernels. (Only -ftz, part of --use_fast_math, still applies: denormal m, v, p flush to zero.)
//
// Stochastic rounding of the bf16 param: element i gets the 32 random bits
//   llmc_hash(lo32(x) ^ llmc_hash(hi32(x) ^ 0x9e3779b9)),  x = seed + i   (64-bit sum)
// a pure function of (seed, i): runs are reproducible, and a launch over a slice that starts at
// element `offset` of a larger buffer, given seed + offset, writes exactly what the launch over
// the whole buffer writes there (so per-tensor or per-ZeRO-shard calls can match one flat call).
// The trainer should draw an unrelated 64-bit seed per step (e.g. a hash of (run seed, step)):
// seeds of consecutive steps that differ by less than n would reuse bits of neighbouring elements.
//
// Gradients are fp32: the trainer sums each micro-batch's bf16 gradient into an fp32 accumulator
// (grad_accumulate, llmc/ops/accumulate.cuh) and the optimizer reads that sum, never rounded to bf16.
//
// Parallel decomposition: purely elementwise, memory bound (30 bytes per element with master
// weights: read grad 4 + master 4 + m 4 + v 4, write param 2 + master 4 + m 4 + v 4; 24 without).
// Vector path: a thread owns 8 consecutive elements per iteration of a grid-stride loop: two 16-byte
// loads each of fp32 grads, master, m, v (one 16-byte load of bf16 params without master); the
// same stores. Loads and stores use the streaming hints (__ldcs/__stcs): the optimizer state is
// touched once per step and is far larger than L2. The n % 8 tail elements go one each to the
// first threads of the grid. The grid is one wave of resident blocks. Scalar path (some pointer not
// 16-byte aligned, e.g. a slice at an odd offset; for the fp32 grads that includes an offset of 2
// floats): one element per thread per iteration, the same per-element code, so the two paths give
// bitwise-identical results.
//
// Many tensors at once (adamw_update_pieces, the trainer's step: a piece per tensor slice of
// what the rank updates): up to ADAMW_MAX_PIECES pieces per launch, their pointers, sizes, seeds
// and decay a kernel parameter (the piece table); each piece is cut into chunks of ADAMW_CHUNK
// elements, one block per chunk (a block finds its piece in the table's prefix of chunks). A
// chunk's threads take its elements as above: 8 at a time when the piece's pointers are all
// 16-byte aligned, else one at a time. Each element gets the bits adamw_random_bits(seed + offset,
// i) and the arithmetic of adamw_element, so a piece's result is bitwise adamw_update on it alone:
// the chunking changes nothing.
//
// Scratch: none.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include "llmc/ops/cuda_common.cuh"
#include "llmc/ops/cpu/adamw.h"  // AdamwPiece (the twin's piece, shared)

constexpr int ADAMW_THREADS = 256;

// Everything the kernel needs per launch, the derived constants computed once on the host.
struct AdamwArgs {
    float lr, lr_wd;                // lr and lr * weight_decay (the twin multiplies them first)
    float beta1, one_minus_beta1;   // beta1 and 1 - beta1
    float beta2, one_minus_beta2;
    float bias1, bias2;             // 1 - beta1^t, 1 - beta2^t
    float eps, grad_scale;
    uint64_t seed;
};

inline AdamwArgs adamw_make_args(float lr, float beta1, float beta2, float eps, float weight_decay,
                                 float grad_scale, int t, uint64_t seed) {
    LLMC_CHECK(t >= 1, "adamw_update: the step t is 1-based, got %d", t);
    AdamwArgs a;
    a.lr = lr;
    a.lr_wd = lr * weight_decay;
    a.beta1 = beta1;
    a.one_minus_beta1 = 1.0f - beta1;
    a.beta2 = beta2;
    a.one_minus_beta2 = 1.0f - beta2;
    // the twin's own expression (float pow on the host), so the same bits
    a.bias1 = 1.0f - std::pow(beta1, (float)t);
    a.bias2 = 1.0f - std::pow(beta2, (float)t);
    a.eps = eps;
    a.grad_scale = grad_scale;
    a.seed = seed;
    return a;
}

// The 32 random bits of element i (see the header comment); the host's offloaded step
// (llmc/parallel/offload.h) draws the same bits.
__host__ __device__ inline uint32_t adamw_random_bits(uint64_t seed, size_t i) {
    const uint64_t x = seed + (uint64_t)i;
    return llmc_hash((uint32_t)x ^ llmc_hash((uint32_t)(x >> 32) ^ 0x9e3779b9u));
}

// One element of the update, in the twin's order of operations, each op rounded to nearest.
// Takes the starting p (master or bf16 param) and the raw gradient; updates m, v; returns the new p.
__device__ inline float adamw_element(float p, float grad, float& m, float& v, const AdamwArgs& a) {
    const float g = __fmul_rn(grad, a.grad_scale);
    p = __fsub_rn(p, __fmul_rn(a.lr_wd, p));
    m = __fadd_rn(__fmul_rn(a.beta1, m), __fmul_rn(a.one_minus_beta1, g));
    v = __fadd_rn(__fmul_rn(a.beta2, v), __fmul_rn(__fmul_rn(a.one_minus_beta2, g), g));
    const float denom = __fadd_rn(__fsqrt_rn(__fdiv_rn(v, a.bias2)), a.eps);
    return __fsub_rn(p, __fdiv_rn(__fmul_rn(a.lr, __fdiv_rn(m, a.bias1)), denom));
}

// element i alone (the scalar path and the tail of the vector path)
template <bool MASTER>
__device__ inline void adamw_update_one(floatX* params, float* master, const float* grads, float* m, float* v,
                                        size_t i, const AdamwArgs& a) {
    float p;
    if constexpr (MASTER) p = master[i];
    else p = floatX_to_float(params[i]);
    float mi = m[i], vi = v[i];
    p = adamw_element(p, grads[i], mi, vi, a);
    m[i] = mi;
    v[i] = vi;
    if constexpr (MASTER) master[i] = p;
    params[i] = stochastic_round_floatX(p, adamw_random_bits(a.seed, i));
}

// elements i0 .. i0 + 7 (every pointer 16-byte aligned): one 16-byte access per 4 fp32 / 8 bf16
template <bool MASTER>
__device__ inline void adamw_update8(floatX* params, float* master, const float* grads, float* m, float* v,
                                     size_t i0, const AdamwArgs& a) {
    float p[8], g[8], mm[8], vv[8];
    const float4 g0 = __ldcs(reinterpret_cast<const float4*>(grads + i0));
    const float4 g1 = __ldcs(reinterpret_cast<const float4*>(grads + i0 + 4));
    g[0] = g0.x; g[1] = g0.y; g[2] = g0.z; g[3] = g0.w;
    g[4] = g1.x; g[5] = g1.y; g[6] = g1.z; g[7] = g1.w;
    if constexpr (MASTER) {
        const float4 p0 = __ldcs(reinterpret_cast<const float4*>(master + i0));
        const float4 p1 = __ldcs(reinterpret_cast<const float4*>(master + i0 + 4));
        p[0] = p0.x; p[1] = p0.y; p[2] = p0.z; p[3] = p0.w;
        p[4] = p1.x; p[5] = p1.y; p[6] = p1.z; p[7] = p1.w;
    } else {
        floatx8::unpack8(p, __ldcs(reinterpret_cast<const uint4*>(params + i0)));
    }
    const float4 m0 = __ldcs(reinterpret_cast<const float4*>(m + i0));
    const float4 m1 = __ldcs(reinterpret_cast<const float4*>(m + i0 + 4));
    const float4 v0 = __ldcs(reinterpret_cast<const float4*>(v + i0));
    const float4 v1 = __ldcs(reinterpret_cast<const float4*>(v + i0 + 4));
    mm[0] = m0.x; mm[1] = m0.y; mm[2] = m0.z; mm[3] = m0.w;
    mm[4] = m1.x; mm[5] = m1.y; mm[6] = m1.z; mm[7] = m1.w;
    vv[0] = v0.x; vv[1] = v0.y; vv[2] = v0.z; vv[3] = v0.w;
    vv[4] = v1.x; vv[5] = v1.y; vv[6] = v1.z; vv[7] = v1.w;
#pragma unroll
    for (int k = 0; k < 8; k++) p[k] = adamw_element(p[k], g[k], mm[k], vv[k], a);
    __stcs(reinterpret_cast<float4*>(m + i0), make_float4(mm[0], mm[1], mm[2], mm[3]));
    __stcs(reinterpret_cast<float4*>(m + i0 + 4), make_float4(mm[4], mm[5], mm[6], mm[7]));
    __stcs(reinterpret_cast<float4*>(v + i0), make_float4(vv[0], vv[1], vv[2], vv[3]));
    __stcs(reinterpret_cast<float4*>(v + i0 + 4), make_float4(vv[4], vv[5], vv[6], vv[7]));
    if constexpr (MASTER) {
        __stcs(reinterpret_cast<float4*>(master + i0), make_float4(p[0], p[1], p[2], p[3]));
        __stcs(reinterpret_cast<float4*>(master + i0 + 4), make_float4(p[4], p[5], p[6], p[7]));
    }
    uint32_t out[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const floatX lo = stochastic_round_floatX(p[2 * k], adamw_random_bits(a.seed, i0 + 2 * k));
        const floatX hi = stochastic_round_floatX(p[2 * k + 1], adamw_random_bits(a.seed, i0 + 2 * k + 1));
        out[k] = floatx8::pack_floatX_bits(lo, hi);
    }
    __stcs(reinterpret_cast<uint4*>(params + i0), make_uint4(out[0], out[1], out[2], out[3]));
}

// VEC8: all pointers 16-byte aligned; a thread owns elements 8j..8j+7 (one iteration per j).
// !VEC8: a thread owns element j.
template <bool MASTER, bool VEC8>
__global__ void __launch_bounds__(ADAMW_THREADS)
    adamw_kernel(floatX* params, float* master, const float* grads, float* m, float* v, size_t n, AdamwArgs a) {
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    if constexpr (!VEC8) {
        for (size_t i = tid; i < n; i += stride) adamw_update_one<MASTER>(params, master, grads, m, v, i, a);
        return;
    }
    const size_t n8 = n / 8;
    for (size_t j = tid; j < n8; j += stride) adamw_update8<MASTER>(params, master, grads, m, v, j * 8, a);
    // the last n % 8 elements (fewer than a block's threads: block 0 owns them)
    if (tid < n - n8 * 8) adamw_update_one<MASTER>(params, master, grads, m, v, n8 * 8 + tid, a);
}

// Blocks of one kernel instantiation that fit on the whole GPU at once (cached per instantiation).
template <bool MASTER, bool VEC8>
inline size_t adamw_wave_blocks() {
    static const size_t blocks = wave_blocks(adamw_kernel<MASTER, VEC8>, ADAMW_THREADS);
    return blocks;
}

template <bool MASTER, bool VEC8>
inline void adamw_launch_kernel(floatX* params, float* master, const float* grads, float* m, float* v, size_t n,
                                const AdamwArgs& a) {
    const size_t work = VEC8 ? std::max<size_t>(n / 8, 1) : n;  // >= 1: the tail needs a thread
    const size_t needed = (work + ADAMW_THREADS - 1) / ADAMW_THREADS;
    const size_t grid = std::min(needed, adamw_wave_blocks<MASTER, VEC8>());
    adamw_kernel<MASTER, VEC8><<<(unsigned)grid, ADAMW_THREADS, 0, llmc_stream()>>>(params, master, grads, m, v, n, a);
    cudaCheckLaunch();
}

// Runs the vector path (vec8 = true; every pointer must be 16-byte aligned) or the scalar path.
// adamw_update picks; dev/cuda/adamw.cu times both.
inline void adamw_launch(bool vec8, floatX* params, float* master_params, const float* grads, float* m, float* v,
                         size_t n, const AdamwArgs& a) {
    if (n == 0) return;
    if (master_params) {
        if (vec8) adamw_launch_kernel<true, true>(params, master_params, grads, m, v, n, a);
        else adamw_launch_kernel<true, false>(params, master_params, grads, m, v, n, a);
    } else {
        if (vec8) adamw_launch_kernel<false, true>(params, master_params, grads, m, v, n, a);
        else adamw_launch_kernel<false, false>(params, master_params, grads, m, v, n, a);
    }
}

// params: bf16 [n]; master_params: fp32 [n] or nullptr; grads (read only), m, v: fp32 [n]. params,
// master_params, m, v overwritten in place.
inline void adamw_update(floatX* params, float* master_params, const float* grads, float* m, float* v, size_t n,
                         float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale, int t,
                         uint64_t seed) {
    const AdamwArgs a = adamw_make_args(lr, beta1, beta2, eps, weight_decay, grad_scale, t, seed);
    using floatx8::aligned16;
    const bool vec8 = aligned16(params) && aligned16(grads) && aligned16(m) && aligned16(v) &&
                      (master_params == nullptr || aligned16(master_params));
    adamw_launch(vec8, params, master_params, grads, m, v, n, a);
}

// ------------------------------------------------------------------------------------------------
// the multi-tensor step (see the top of the file)

constexpr int ADAMW_MAX_PIECES = 48;  // per launch: the table is ~3.3 KB, within the 4 KB of kernel parameters
constexpr size_t ADAMW_CHUNK = (size_t)ADAMW_THREADS * 8 * 8;  // elements per block: 8 vectors of 8 per thread

struct AdamwTable {
    floatX* params[ADAMW_MAX_PIECES];
    float *master[ADAMW_MAX_PIECES], *m[ADAMW_MAX_PIECES], *v[ADAMW_MAX_PIECES];
    const float* grads[ADAMW_MAX_PIECES];
    size_t n[ADAMW_MAX_PIECES];
    uint64_t seed[ADAMW_MAX_PIECES];  // the launch's seed + the piece's table offset
    float lr_wd[ADAMW_MAX_PIECES];    // lr * weight_decay, or 0 for a piece that does not decay
    bool vec8[ADAMW_MAX_PIECES];
    int chunk0[ADAMW_MAX_PIECES + 1];  // piece k has blocks [chunk0[k], chunk0[k + 1])
};

template <bool MASTER>
__global__ void __launch_bounds__(ADAMW_THREADS) adamw_pieces_kernel(const AdamwTable t, AdamwArgs a) {
    int k = 0;
    while ((int)blockIdx.x >= t.chunk0[k + 1]) k++;
    a.seed = t.seed[k];
    a.lr_wd = t.lr_wd[k];
    const size_t begin = (size_t)(blockIdx.x - t.chunk0[k]) * ADAMW_CHUNK;
    const size_t end = t.n[k] < begin + ADAMW_CHUNK ? t.n[k] : begin + ADAMW_CHUNK;
    floatX* params = t.params[k];
    float *master = t.master[k], *m = t.m[k], *v = t.v[k];
    const float* grads = t.grads[k];
    if (t.vec8[k]) {  // (uniform over the block) begin is a multiple of 8
        const size_t n8 = begin + (end - begin) / 8 * 8;
        for (size_t i0 = begin + 8 * threadIdx.x; i0 < n8; i0 += 8 * ADAMW_THREADS)
            adamw_update8<MASTER>(params, master, grads, m, v, i0, a);
        if (n8 + threadIdx.x < end) adamw_update_one<MASTER>(params, master, grads, m, v, n8 + threadIdx.x, a);
    } else {
        for (size_t i = begin + threadIdx.x; i < end; i += ADAMW_THREADS)
            adamw_update_one<MASTER>(params, master, grads, m, v, i, a);
    }
}

// adamw_update on each of pieces[0, count) (indices into the flat buffers, as the CPU twin), in
// ceil(count / ADAMW_MAX_PIECES) launches; master_params null or not for all of them
inline void adamw_update_pieces(floatX* params, float* master_params, const float* grads, float* m, float* v,
                                const cpu::AdamwPiece* pieces, int count, float lr, float beta1, float beta2, float eps,
                                float weight_decay, float grad_scale, int t, uint64_t seed) {
    const AdamwArgs a = adamw_make_args(lr, beta1, beta2, eps, weight_decay, grad_scale, t, seed);
    using floatx8::aligned16;
    for (int k0 = 0; k0 < count;) {
        AdamwTable tab;
        int n_pieces = 0;
        tab.chunk0[0] = 0;
        for (; k0 < count && n_pieces < ADAMW_MAX_PIECES; k0++) {
            const cpu::AdamwPiece& u = pieces[k0];
            if (u.n == 0) continue;
            const int j = n_pieces++;
            tab.params[j] = params + u.param;
            tab.master[j] = master_params ? master_params + u.state : nullptr;
            tab.grads[j] = grads + u.grad;
            tab.m[j] = m + u.state;
            tab.v[j] = v + u.state;
            tab.n[j] = u.n;
            tab.seed[j] = seed + u.offset;
            tab.lr_wd[j] = u.decay ? lr * weight_decay : 0.0f;  // (the host's product, as adamw_make_args)
            tab.vec8[j] = aligned16(tab.params[j]) && aligned16(tab.grads[j]) && aligned16(tab.m[j]) &&
                          aligned16(tab.v[j]) && (!tab.master[j] || aligned16(tab.master[j]));
            const size_t chunks = (u.n + ADAMW_CHUNK - 1) / ADAMW_CHUNK;
            LLMC_CHECK((size_t)tab.chunk0[j] + chunks <= (size_t)INT32_MAX, "adamw_update_pieces: %zu elements exceed the grid",
                       u.n);
            tab.chunk0[j + 1] = tab.chunk0[j] + (int)chunks;
        }
        if (n_pieces == 0) break;
        if (master_params) adamw_pieces_kernel<true><<<tab.chunk0[n_pieces], ADAMW_THREADS, 0, llmc_stream()>>>(tab, a);
        else adamw_pieces_kernel<false><<<tab.chunk0[n_pieces], ADAMW_THREADS, 0, llmc_stream()>>>(tab, a);
        cudaCheckLaunch();
    }
}
