// Fused softmax + cross-entropy + dlogits on the GPU: the twin of llmc/ops/cpu/classifier.h.
//   over the real vocabulary (the first V of Vp padded columns) of row n, target t = targets[n]:
//   lse = log sum_v exp(x_v)   (the sum in double)   losses[n] = lse - x_t   (0 when t == -1)
//   when dloss != 0, the row is overwritten in place with dlogits:
//   dx_v = d * (exp(x_v - lse) - [v == t]) for v < V, 0 for the padded columns; d = dloss (0 if t == -1)
//   so the probabilities are never stored.
//
// Parallel decomposition: one block per row. A thread owns the 16-byte vectors (8 columns) c, c +
// blockDim.x, ... of the row (single columns when Vp % 8 != 0 or the buffer is not 16-byte
// aligned). Pass 1 keeps an online (max, sum of exp relative to that max) per thread over the
// first V columns (the max fp32, the sum in double, as in the CPU twin: in fp32 the many tiny
// terms of a peaked distribution would fall below half an ulp of a thread's running sum), UNROLL vectors loaded at a time; the block combines these pairs (warp
// butterfly, then the warps in order: fixed, so deterministic, and every thread gets the same lse,
// in double, subtracted as an fp32 pair hi + lo).
// Pass 2 re-reads the row (a block's row was read a moment ago: up to ~100 KB per row and at most
// 2 x 132 rows in flight, so it is served from the 50 MB L2) and writes the dlogits. The target
// logit is read before the block's barriers, so before anyone overwrites it.
// Scratch: none.
//
// ---- loss_sum: a micro-batch's per-token losses summed in double into one device double, so that
// the host reads all the step's sums at once after the step (no host sync per micro-batch). One
// block of LOSS_SUM_THREADS: thread t adds losses t, t + blockDim, ... in order, then a fixed
// shuffle tree and the warps in order (deterministic; not the CPU twin's token order, so equal to
// it within double rounding).
//
// ---- Vocab-parallel cross-entropy (tensor parallelism): classifier_max, _sumexp, _target, _backward ----
// The twins of the CPU ops of the same names (llmc/ops/cpu/classifier.h has the math and how the caller
// reduces between them). A rank holds ld columns of each logits row (global columns v0 .. v0 + ld), the
// first n_real of them real tokens; the statistics are fp32 arrays of N. bf16 logits, fp32 math, except
// the sums of exponentials (double, rounded once) and the loss ((max - x_t) + log(sum) in double).
// Parallel decomposition: one warp per row (8 rows per block of 256 threads), except classifier_target
// (one thread per row). A lane owns the 8-column groups lane, lane + 32, ... of the row's column range
// (relative to its start) and visits them in increasing order, loading UNROLL groups ahead (16-byte loads
// when ld % 8 == 0, the buffer and the range start are 16-byte aligned; else single columns, the same
// order); sums are then added over the lanes in a fixed tree (shfl_down 16, 8, 4, 2, 1). So each result
// depends only on the values of the range, never on ld, v0 or the load width: a fixed vocab chunk gives
// the same sum on any rank that holds it (deterministic, no atomics).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include "llmc/ops/cuda_common.cuh"

namespace classifier_detail {

constexpr int MAX_THREADS = 512;  // per block (a row); 2 blocks per SM fit the register file

using namespace floatx8;  // aligned16, load_floatX / store_floatX, ... (llmc/ops/cuda_common.cuh)

// (m, s) <- the pair for the union of two sets of logits, each given as (max, sum exp(x - max));
// an empty set is (-inf, 0). Symmetric, so a butterfly gives every lane the same bits.
__device__ inline void combine(float& m, double& s, float m2, double s2) {
    const float mm = fmaxf(m, m2);
    const double a = m == -INFINITY ? 0.0 : s * (double)expf(m - mm);
    const double b = m2 == -INFINITY ? 0.0 : s2 * (double)expf(m2 - mm);
    m = mm;
    s = a + b;
}

// f(x) for every logit x of the UNROLL loaded vectors raw[u] (columns c0 + u * step ..) whose column is < V
template <int VEC, int UNROLL, typename F>
__device__ inline void for_each_real(const Packed<VEC> (&raw)[UNROLL], int c0, int step, int V, F&& f) {
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        const int c = c0 + u * step;
        float x[VEC];
        unpack<VEC>(x, raw[u]);
#pragma unroll
        for (int i = 0; i < VEC; i++)
            if (c + i < V) f(x[i]);
    }
}

// UNROLL: vectors loaded together per thread (4 for wide rows; 1 when a thread has at most one
// vector, which keeps the registers low enough for full occupancy with small vocabularies: 4 blocks of
// 512 on sm_80 / sm_90, 3 on sm_86 / sm_89, 2 on sm_75). UNROLL 4: 2 blocks per SM, 1 on sm_75 (whose
// 2 blocks of 512 would cap it at 64 registers: <8, 4> spilled 16 bytes there)
template <int VEC, int UNROLL>
__global__ void __launch_bounds__(MAX_THREADS, UNROLL == 1 ? LLMC_MIN_BLOCKS(MAX_THREADS, 4)
                                                           : (LLMC_MAX_THREADS_SM > 1024 ? 2 : 1))
    fused_classifier_kernel(floatX* logits, float* __restrict__ losses, const int* __restrict__ targets,
                            float dloss, int V, int Vp) {
    __shared__ float warp_m[32];
    __shared__ double warp_s[32];
    floatX* x = logits + (size_t)blockIdx.x * Vp;
    const int tgt = targets[blockIdx.x];
    const float x_tgt = (threadIdx.x == 0 && tgt >= 0) ? floatX_to_float(x[tgt]) : 0.0f;
    const int step = VEC * blockDim.x;  // columns between a thread's consecutive vectors

    // pass 1: online max and sum of exp over this thread's columns < V
    float m = -INFINITY;
    double s = 0.0;
    for (int c0 = VEC * threadIdx.x; c0 < V; c0 += UNROLL * step) {
        Packed<VEC> raw[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++)  // (c + VEC <= Vp: whole vectors only when Vp % 8 == 0)
            if (c0 + u * step < V) raw[u] = load_packed<VEC>(x + c0 + u * step);
        float mx = m;  // finite after this: column c0 < V is one of them
        for_each_real<VEC, UNROLL>(raw, c0, step, V, [&](float x) { mx = fmaxf(mx, x); });
        s *= (double)expf(m - mx);  // rescale to the new max (exp(-inf) = 0 for the empty start)
        m = mx;
        for_each_real<VEC, UNROLL>(raw, c0, step, V, [&](float x) { s += expf(x - m); });
    }
    // block reduction of (m, s): butterfly in each warp, then the warps in order
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const double s2 = __shfl_xor_sync(0xffffffffu, s, o);
        combine(m, s, m2, s2);
    }
    if (threadIdx.x % 32 == 0) {
        warp_m[threadIdx.x / 32] = m;
        warp_s[threadIdx.x / 32] = s;
    }
    __syncthreads();  // also: every thread has read its logits (and thread 0 the target) from here on
    m = -INFINITY;
    s = 0.0;
    for (int w = 0; w < (int)blockDim.x / 32; w++) combine(m, s, warp_m[w], warp_s[w]);
    // lse in double, subtracted as the fp32 pair hi + lo (two fp32 adds a column): an fp32 lse (~10) is off by
    // up to 5e-7, which every probability of the row would inherit as a relative error
    const double lse = (double)m + log(s);
    const float lse_hi = (float)lse, lse_lo = (float)(lse - lse_hi);
    if (threadIdx.x == 0) losses[blockIdx.x] = tgt >= 0 ? (float)(((double)m - x_tgt) + log(s)) : 0.0f;
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
                f[i] = col < V ? d * (expf((f[i] - lse_hi) - lse_lo) - (col == tgt ? 1.0f : 0.0f)) : 0.0f;
            }
            store_floatX<VEC>(x + c, f);
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

namespace classifier_detail {

constexpr int TP_WARPS = 8;  // rows (warps) per block of the vocab-parallel kernels
constexpr int TP_UNROLL = 4; // 8-column groups loaded ahead per lane

// the 8 values of the group at p (columns [col, col + 8) of the range, col < end); lanes past `end` give
// `fill`. VEC 8: one 16-byte load (in bounds: the group starts before end <= ld, ld % 8 == 0).
template <int VEC>
__device__ inline void load_group(float (&f)[8], const floatX* p, int col, int end, float fill) {
    if constexpr (VEC == 8) {
        unpack8(f, *reinterpret_cast<const uint4*>(p));
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (col + i >= end) f[i] = fill;
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) f[i] = col + i < end ? floatX_to_float(p[i]) : fill;
    }
}

// the TP_UNROLL groups of a lane's step (group u at column g0 + u * 256), columns >= end (and whole
// groups past it) as `fill`
template <int VEC>
__device__ inline void load_groups(float (&f)[TP_UNROLL][8], const floatX* x, int g0, int end, float fill) {
#pragma unroll
    for (int u = 0; u < TP_UNROLL; u++) {
        const int col = g0 + u * 256;
        if (col < end) load_group<VEC>(f[u], x + col, col, end, fill);
        else
#pragma unroll
            for (int i = 0; i < 8; i++) f[u][i] = fill;
    }
}

__device__ inline float warp_tree_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_down_sync(0xffffffffu, x, o));
    return x;  // lane 0 holds the result
}
__device__ inline double warp_tree_sum(double x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
    return x;  // lane 0 holds the result
}

// mx[n] = max of row n over [0, n_cols)
template <int VEC>
__global__ void __launch_bounds__(TP_WARPS * 32)
    classifier_max_kernel(float* __restrict__ mx, const floatX* __restrict__ logits, int N, int ld, int n_cols) {
    const int n = blockIdx.x * TP_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (n >= N) return;  // warp-uniform
    const floatX* x = logits + (size_t)n * ld;
    float m = -INFINITY;
    for (int g0 = 8 * lane; g0 < n_cols; g0 += TP_UNROLL * 256) {
        float f[TP_UNROLL][8];
        load_groups<VEC>(f, x, g0, n_cols, -INFINITY);
#pragma unroll
        for (int u = 0; u < TP_UNROLL; u++)
#pragma unroll
            for (int i = 0; i < 8; i++) m = fmaxf(m, f[u][i]);
    }
    m = warp_tree_max(m);
    if (lane == 0) mx[n] = m;
}

// sum[n] = sum over [c0, c1) of row n of exp(x - mx[n]); groups relative to c0
template <int VEC>
__global__ void __launch_bounds__(TP_WARPS * 32)
    classifier_sumexp_kernel(float* __restrict__ sum, const floatX* __restrict__ logits, const float* __restrict__ mx,
                             int N, int ld, int c0, int c1) {
    const int n = blockIdx.x * TP_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (n >= N) return;  // warp-uniform
    const floatX* x = logits + (size_t)n * ld;
    const float m = mx[n];
    double s = 0.0;  // double: see fused_classifier_kernel
    for (int g0 = c0 + 8 * lane; g0 < c1; g0 += TP_UNROLL * 256) {
        float f[TP_UNROLL][8];
        load_groups<VEC>(f, x, g0, c1, -INFINITY);  // exp(-inf) = 0 past c1
#pragma unroll
        for (int u = 0; u < TP_UNROLL; u++)
#pragma unroll
            for (int i = 0; i < 8; i++)
                if (g0 + u * 256 + i < c1) s += expf(f[u][i] - m);
    }
    s = warp_tree_sum(s);
    if (lane == 0) sum[n] = (float)s;
}

__global__ void classifier_target_kernel(float* __restrict__ tgt, const floatX* __restrict__ logits,
                                         const int* __restrict__ targets, int N, int ld, int v0, int n_cols) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const int t = targets[n] - v0;
    tgt[n] = targets[n] >= 0 && t >= 0 && t < n_cols ? floatX_to_float(logits[(size_t)n * ld + t]) : 0.0f;
}

// losses, and the dlogits of the rank's columns in place (padding columns [n_real, ld) get 0)
template <int VEC>
__global__ void __launch_bounds__(TP_WARPS * 32)
    classifier_backward_kernel(floatX* logits, float* __restrict__ losses, const float* __restrict__ mx,
                               const float* __restrict__ sum, const float* __restrict__ tgt,
                               const int* __restrict__ targets, float dloss, int N, int ld, int v0, int n_real) {
    const int n = blockIdx.x * TP_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (n >= N) return;  // warp-uniform
    const int target = targets[n];
    float lse_hi = 0.0f, lse_lo = 0.0f;  // lse in double, subtracted as hi + lo (see fused_classifier)
    if (lane == 0) {  // (lane 0 alone, then broadcast: the double math in every lane cost 7 registers)
        const double lse = (double)mx[n] + log((double)sum[n]);
        lse_hi = (float)lse, lse_lo = (float)(lse - lse_hi);
        losses[n] = target < 0 ? 0.0f : (float)(((double)mx[n] - tgt[n]) + log((double)sum[n]));
    }
    lse_hi = __shfl_sync(0xffffffffu, lse_hi, 0);
    lse_lo = __shfl_sync(0xffffffffu, lse_lo, 0);
    if (dloss == 0.0f) return;
    const float d = target < 0 ? 0.0f : dloss;
    const int t = target < 0 ? -1 : target - v0;
    floatX* x = logits + (size_t)n * ld;
    for (int g0 = 8 * lane; g0 < ld; g0 += TP_UNROLL * 256) {
        float f[TP_UNROLL][8];
#pragma unroll
        for (int u = 0; u < TP_UNROLL; u++) {  // all loads of the batch before any store (same buffer)
            const int col = g0 + u * 256;
            if (col < n_real) load_group<VEC>(f[u], x + col, col, n_real, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < TP_UNROLL; u++) {
            const int col = g0 + u * 256;
            if (col >= ld) break;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int v = col + i;
                f[u][i] = v < n_real ? d * (expf((f[u][i] - lse_hi) - lse_lo) - (v == t ? 1.0f : 0.0f)) : 0.0f;
            }
            if constexpr (VEC == 8) {
                store_floatX<8>(x + col, f[u]);
            } else {
#pragma unroll
                for (int i = 0; i < 8; i++)
                    if (col + i < ld) x[col + i] = float_to_floatX(f[u][i]);
            }
        }
    }
}

inline int tp_blocks(int N) { return ceil_div(N, TP_WARPS); }

}  // namespace classifier_detail

// mx [N] = the max of each row of logits [N, ld] over its first n_cols columns (-inf when n_cols == 0)
inline void classifier_max(float* mx, const floatX* logits, int N, int ld, int n_cols) {
    using namespace classifier_detail;
    if (N == 0) return;
    LLMC_CHECK(ld > 0 && n_cols >= 0 && n_cols <= ld, "classifier_max: need 0 <= n_cols <= ld, got %d, %d", n_cols,
               ld);
    const bool vec = ld % 8 == 0 && aligned16(logits);
    if (vec) classifier_max_kernel<8><<<tp_blocks(N), TP_WARPS * 32, 0, llmc_stream()>>>(mx, logits, N, ld, n_cols);
    else classifier_max_kernel<1><<<tp_blocks(N), TP_WARPS * 32, 0, llmc_stream()>>>(mx, logits, N, ld, n_cols);
    cudaCheckLaunch();
}

// sum [N] = sum over the columns [c0, c1) of each row of exp(x - mx[n]) (0 when c1 <= c0); the order is
// fixed by the range alone (see the top of the file)
inline void classifier_sumexp(float* sum, const floatX* logits, const float* mx, int N, int ld, int c0, int c1) {
    using namespace classifier_detail;
    if (N == 0) return;
    LLMC_CHECK(ld > 0 && c0 >= 0 && c1 <= ld, "classifier_sumexp: columns [%d, %d) outside a row of %d", c0, c1, ld);
    const bool vec = ld % 8 == 0 && c0 % 8 == 0 && aligned16(logits);
    if (vec)
        classifier_sumexp_kernel<8><<<tp_blocks(N), TP_WARPS * 32, 0, llmc_stream()>>>(sum, logits, mx, N, ld, c0, c1);
    else
        classifier_sumexp_kernel<1><<<tp_blocks(N), TP_WARPS * 32, 0, llmc_stream()>>>(sum, logits, mx, N, ld, c0, c1);
    cudaCheckLaunch();
}

// tgt [N] = the logit of global column targets[n] when v0 <= targets[n] < v0 + n_cols, else 0
inline void classifier_target(float* tgt, const floatX* logits, const int* targets, int N, int ld, int v0,
                              int n_cols) {
    using namespace classifier_detail;
    if (N == 0) return;
    LLMC_CHECK(ld > 0 && n_cols >= 0 && n_cols <= ld, "classifier_target: need 0 <= n_cols <= ld, got %d, %d",
               n_cols, ld);
    classifier_target_kernel<<<ceil_div(N, 256), 256, 0, llmc_stream()>>>(tgt, logits, targets, N, ld, v0, n_cols);
    cudaCheckLaunch();
}

// losses [N] = mx + log(sum) - tgt (0 for targets -1); when dloss != 0, logits [N, ld] overwritten with
// d (softmax - onehot) over the first n_real columns and 0 over the padding [n_real, ld)
inline void classifier_backward(floatX* logits, float* losses, const float* mx, const float* sum, const float* tgt,
                                const int* targets, float dloss, int N, int ld, int v0, int n_real) {
    using namespace classifier_detail;
    if (N == 0) return;
    LLMC_CHECK(ld > 0 && n_real >= 0 && n_real <= ld, "classifier_backward: need 0 <= n_real <= ld, got %d, %d",
               n_real, ld);
    const bool vec = ld % 8 == 0 && aligned16(logits);
    if (vec)
        classifier_backward_kernel<8><<<tp_blocks(N), TP_WARPS * 32, 0, llmc_stream()>>>(
            logits, losses, mx, sum, tgt, targets, dloss, N, ld, v0, n_real);
    else
        classifier_backward_kernel<1><<<tp_blocks(N), TP_WARPS * 32, 0, llmc_stream()>>>(
            logits, losses, mx, sum, tgt, targets, dloss, N, ld, v0, n_real);
    cudaCheckLaunch();
}

// *out (device double) = sum of losses[0, n) (device floats), queued on llmc_stream()
constexpr int LOSS_SUM_THREADS = 1024;
__global__ void __launch_bounds__(LOSS_SUM_THREADS) loss_sum_kernel(double* out, const float* losses, int n) {
    __shared__ double warp_sums[32];
    double x = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) x += losses[i];
    for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = x;
    __syncthreads();
    if (threadIdx.x == 0) {
        double s = 0;
        for (int w = 0; w < (int)blockDim.x / 32; w++) s += warp_sums[w];
        *out = s;
    }
}
inline void loss_sum(double* out, const float* losses, int n) {
    loss_sum_kernel<<<1, LOSS_SUM_THREADS, 0, llmc_stream()>>>(out, losses, n);
    cudaCheckLaunch();
}
