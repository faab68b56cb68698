// Fused softmax + cross-entropy + dlogits on the GPU: the twin of llmc/cpu/classifier.h.
//   over the real vocabulary (the first V of Vp padded columns) of row n, target t = targets[n]:
//   lse = log sum_v exp(x_v)   (fp32)     losses[n] = lse - x_t   (0 when t == -1)
//   when dloss != 0, the row is overwritten in place with dlogits:
//   dx_v = d * (exp(x_v - lse) - [v == t]) for v < V, 0 for the padded columns; d = dloss (0 if t == -1)
//   so the probabilities are never stored.
//
// Parallel decomposition: one block per row. A thread owns the 16-byte vectors (8 columns) c, c +
// blockDim.x, ... of the row (single columns when Vp % 8 != 0 or the buffer is not 16-byte
// aligned). Pass 1 keeps an online (max, sum of exp relative to that max) per thread in fp32 over
// the first V columns, UNROLL vectors loaded at a time; the block combines these pairs (warp
// butterfly, then the warps in order: fixed, so deterministic, and every thread gets the same lse).
// Pass 2 re-reads the row (a block's row was read a moment ago: up to ~100 KB per row and at most
// 2 x 132 rows in flight, so it is served from the 50 MB L2) and writes the dlogits. The target
// logit is read before the block's barriers, so before anyone overwrites it.
// Scratch: none.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include "cuda_common.cuh"

namespace classifier_detail {

constexpr int MAX_THREADS = 512;  // per block (a row); 2 blocks per SM fit the register file

using namespace bf16x8;  // aligned16, load_bf16 / store_bf16, ... (llmc/cuda_common.cuh)

// (m, s) <- the pair for the union of two sets of logits, each given as (max, sum exp(x - max));
// an empty set is (-inf, 0). Symmetric, so a butterfly gives every lane the same bits.
__device__ inline void combine(float& m, float& s, float m2, float s2) {
    const float mm = fmaxf(m, m2);
    const float a = m == -INFINITY ? 0.0f : s * expf(m - mm);
    const float b = m2 == -INFINITY ? 0.0f : s2 * expf(m2 - mm);
    m = mm;
    s = a + b;
}

// UNROLL: vectors loaded together per thread (4 for wide rows; 1 when a thread has at most one
// vector, which keeps the registers low enough for full occupancy with small vocabularies)
template <int VEC, int UNROLL>
__global__ void __launch_bounds__(MAX_THREADS, UNROLL == 1 ? 4 : 2)
    fused_classifier_kernel(floatX* logits, float* __restrict__ losses, const int* __restrict__ targets,
                            float dloss, int V, int Vp) {
    __shared__ float warp_m[32], warp_s[32];
    floatX* x = logits + (size_t)blockIdx.x * Vp;
    const int tgt = targets[blockIdx.x];
    const float x_tgt = (threadIdx.x == 0 && tgt >= 0) ? __bfloat162float(x[tgt]) : 0.0f;
    const int step = VEC * blockDim.x;  // columns between a thread's consecutive vectors

    // pass 1: online max and sum of exp over this thread's columns < V
    float m = -INFINITY, s = 0.0f;
    for (int c0 = VEC * threadIdx.x; c0 < V; c0 += UNROLL * step) {
        Packed<VEC> raw[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++)  // (c + VEC <= Vp: whole vectors only when Vp % 8 == 0)
            if (c0 + u * step < V) raw[u] = load_packed<VEC>(x + c0 + u * step);
        float mx = m;  // finite after this: column c0 < V is one of them
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int c = c0 + u * step;
            float f[VEC];
            unpack<VEC>(f, raw[u]);
#pragma unroll
            for (int i = 0; i < VEC; i++)
                if (c + i < V) mx = fmaxf(mx, f[i]);
        }
        s *= expf(m - mx);  // rescale to the new max (exp(-inf) = 0 for the empty start)
        m = mx;
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int c = c0 + u * step;
            float f[VEC];
            unpack<VEC>(f, raw[u]);
#pragma unroll
            for (int i = 0; i < VEC; i++)
                if (c + i < V) s += expf(f[i] - m);
        }
    }
    // block reduction of (m, s): butterfly in each warp, then the warps in order
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        combine(m, s, m2, s2);
    }
    if (threadIdx.x % 32 == 0) {
        warp_m[threadIdx.x / 32] = m;
        warp_s[threadIdx.x / 32] = s;
    }
    __syncthreads();  // also: every thread has read its logits (and thread 0 the target) from here on
    m = -INFINITY;
    s = 0.0f;
    for (int w = 0; w < (int)blockDim.x / 32; w++) combine(m, s, warp_m[w], warp_s[w]);
    const float lse = m + logf(s);
    if (threadIdx.x == 0) losses[blockIdx.x] = tgt >= 0 ? lse - x_tgt : 0.0f;
    if (dloss == 0.0f) return;

    // pass 2: dlogits in place (padded columns 0)
    const float d = tgt >= 0 ? dloss : 0.0f;
    for (int c0 = VEC * threadIdx.x; c0 < Vp; c0 += UNROLL * step) {
        Packed<VEC> raw[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++)  // all loads of the batch before any store (same buffer)
            if (c0 + u * step < V) raw[u] = load_packed<VEC>(x + c0 + u * step);
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int c = c0 + u * step;
            if (c >= Vp) break;
            float f[VEC];
            if (c < V) unpack<VEC>(f, raw[u]);
#pragma unroll
            for (int i = 0; i < VEC; i++) {
                const int col = c + i;
                f[i] = col < V ? d * (expf(f[i] - lse) - (col == tgt ? 1.0f : 0.0f)) : 0.0f;
            }
            store_bf16<VEC>(x + c, f);
        }
    }
}

}  // namespace classifier_detail

// logits [N, Vp]: read, and overwritten with dlogits when dloss != 0; losses [N] overwritten;
// targets [N] in [0, V) or -1. Scratch: none.
inline void fused_classifier(floatX* logits, float* losses, const int* targets, float dloss, int N, int V, int Vp) {
    using namespace classifier_detail;
    if (N == 0) return;
    LLMC_CHECK(V > 0 && V <= Vp, "fused_classifier: need 0 < V <= Vp, got V = %d, Vp = %d", V, Vp);
    const bool vec = Vp % 8 == 0 && aligned16(logits);
    const int units = vec ? Vp / 8 : Vp;
    const int threads = std::min(MAX_THREADS, ceil_div(units, 32) * 32);
    const bool wide = units > threads;  // more than one vector (or column) per thread
    if (vec && wide)
        fused_classifier_kernel<8, 4><<<N, threads, 0, llmc_stream()>>>(logits, losses, targets, dloss, V, Vp);
    else if (vec)
        fused_classifier_kernel<8, 1><<<N, threads, 0, llmc_stream()>>>(logits, losses, targets, dloss, V, Vp);
    else if (wide)
        fused_classifier_kernel<1, 4><<<N, threads, 0, llmc_stream()>>>(logits, losses, targets, dloss, V, Vp);
    else
        fused_classifier_kernel<1, 1><<<N, threads, 0, llmc_stream()>>>(logits, losses, targets, dloss, V, Vp);
    cudaCheckLaunch();
}
