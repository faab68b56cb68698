// Sum of squares of a bf16 or fp32 buffer (the gradient, for global-norm clipping), the twin of
// llmc/ops/cpu/global_norm.h: returns sum_i values[i]^2 as a host double. The trainer calls the fp32
// overload on its fp32 gradient accumulator (llmc/ops/accumulate.cuh); the bf16 one serves bf16 buffers.
//
// Accuracy, bf16 values: a bf16 has an 8-bit significand, so its square is exact in fp32; a thread sums the 8
// squares of one 16-byte vector in fp32 (relative error < 8 * 2^-24 for these positive terms) and
// adds that to a double accumulator. Everything after that is double. The trainer calls this once
// on the whole flat gradient buffer (up to ~2e9 elements): size_t indexing throughout, and a
// thread's double accumulator keeps the long per-thread sums (thousands of vectors) exact enough.
//
// Accuracy, fp32 values: the square of an fp32 (24-bit significand) is not exact in fp32 but is exact in
// double (48 <= 53 bits), so every element is widened to double, squared and added in double: the
// only roundings are the double additions, as in the twin (which squares in double too). The
// vectors are 16-byte float4 (4 elements); the head and tail (< 4 elements each) as below.
//
// Determinism: a fixed partition that depends only on n (and on the pointer's alignment, which is
// fixed for a given buffer, not on the GPU model), no atomics.
//   pass 1: grid = min(GN_MAX_BLOCKS, ceil(n / (GN_THREADS * V))) blocks of GN_THREADS threads,
//           V = 8 (bf16) or 4 (fp32), the elements of one 16-byte vector.
//           The 16-byte aligned middle of the buffer is a sequence of vectors of V elements; thread
//           t (global index) owns vectors t, t + stride, t + 2 stride, ... (grid-stride loop,
//           GN_UNROLL loads issued together) and adds their sums (bf16: the fp32 8-sum; fp32: the 4
//           double squares in memory order) to its double in that order. The < V elements before
//           the aligned middle (head) and after it (tail) go to the first threads of block 0.
//           Each block reduces its threads' doubles with a fixed shuffle tree and writes its
//           partial to scratch[blockIdx.x]. GN_MAX_BLOCKS = 528 is 4 blocks per SM of
//           an H200, so for large n the whole grid is resident (no second, partial wave) and holds
//           528 * 256 * 4 * 16 B = 8.6 MB of loads in flight, more than HBM latency x bandwidth.
//   pass 2: one block of GN_FINISH_THREADS threads: thread b loads partial b (0 past the grid), the
//           same fixed tree in double; the total goes to scratch[GN_MAX_BLOCKS].
// global_norm_squared copies the double back and synchronizes the stream.
//
// Many ranges at once (global_norm_squared_ranges, fp32: the trainer's gradient norm over every
// segment's slice of the accumulator): each range gets exactly the partition above (its own pass-1
// grid of gn_grid(n, 4) blocks, its own pass 2), so every range's sum is bitwise what
// global_norm_squared gives it alone; but up to GN_MAX_RANGES ranges go in one launch of each pass
// (the ranges are kernel parameters: a pass-1 block finds its range in the table's prefix of
// grids), their sums are copied into pinned host memory as they finish, and the host waits once:
// the optimizer step's one host sync (the clipping scale must be known on the host before the
// update).
// (bf16: a square above fp32 range, |x| > 1.8e19, becomes inf: such a gradient is broken anyway.)
//
// Scratch: global_norm_scratch_bytes() (op_scratch.h): (GN_MAX_BLOCKS + 1) doubles for one buffer;
// GN_MAX_RANGES x (GN_MAX_BLOCKS + 1) for the ranges of one launch, whatever n.
#pragma once
#include <algorithm>
#include <cstdint>
#include "llmc/ops/cuda_common.cuh"
#include "llmc/ops/op_scratch.h"  // GN_MAX_BLOCKS, global_norm_scratch_bytes

constexpr int GN_THREADS = 256;        // pass 1 block size
constexpr int GN_UNROLL = 4;           // 16-byte loads in flight per thread
constexpr int GN_FINISH_THREADS = 1024;
static_assert(GN_MAX_BLOCKS <= GN_FINISH_THREADS, "pass 2 has one thread per partial");

// Sum of x over the block, returned to thread 0 (fixed order: shuffle tree in each warp, then the
// warp sums in warp order by the same tree in warp 0). blockDim.x a multiple of 32, <= 1024.
__device__ inline double gn_block_sum(double x) {
    __shared__ double warp_sums[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
    for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
    if (lane == 0) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        x = lane < n_warps ? warp_sums[lane] : 0.0;
        for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
    }
    return x;
}

__device__ inline float gn_square(floatX x) {
    const float f = floatX_to_float(x);
    return f * f;
}

// fp32 sum of the squares of the 8 bf16 in a 16-byte vector, in memory order
__device__ inline float gn_sum8(const uint4& raw) {
    float f[8];
    floatx8::unpack8(f, raw);
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; k++) s = fmaf(f[k], f[k], s);
    return s;
}

// Each square is exact in double, so (x * x) + acc rounds once whether or not the compiler fuses it
// into an fma: the result does not depend on -fmad.
__device__ inline double gn_square_f64(float x) {
    const double d = (double)x;
    return d * d;
}

// What pass 1 does with one element type T: its 16-byte vector Vec of V elements, adding a vector's
// squares to the thread's double (bf16: their fp32 sum gn_sum8, one double add; fp32: each square in
// double, in memory order) and a single element's square (the head and the tail).
template <typename T>
struct GnElem;
template <>
struct GnElem<floatX> {
    using Vec = uint4;
    static constexpr int V = 8;
    __device__ static Vec zero() { return make_uint4(0u, 0u, 0u, 0u); }
    __device__ static void add_vec(double& acc, const Vec& raw) { acc += (double)gn_sum8(raw); }
    __device__ static double square(floatX x) { return (double)gn_square(x); }
};
template <>
struct GnElem<float> {
    using Vec = float4;
    static constexpr int V = 4;
    __device__ static Vec zero() { return make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
    __device__ static void add_vec(double& acc, const Vec& raw) {
        acc += gn_square_f64(raw.x);
        acc += gn_square_f64(raw.y);
        acc += gn_square_f64(raw.z);
        acc += gn_square_f64(raw.w);
    }
    __device__ static double square(float x) { return gn_square_f64(x); }
};

// Block `block` of a pass-1 grid of `grid` blocks over one buffer: values[0, head) the unaligned head,
// values[head, head + V * n_vec) the 16-byte aligned vectors, then the tail. Its partial (to thread 0).
template <typename T>
__device__ inline double gn_block_partial(const T* values, size_t n, size_t head, size_t n_vec, unsigned block,
                                          unsigned grid) {
    using E = GnElem<T>;
    const size_t tid = (size_t)block * blockDim.x + threadIdx.x;
    const size_t stride = (size_t)grid * blockDim.x;
    const typename E::Vec* vec = reinterpret_cast<const typename E::Vec*>(values + head);
    double acc = 0.0;
    // GN_UNROLL independent 16-byte loads in flight per thread (vectors j, j + stride, ...), then
    // added in that order; a vector past the end counts as zeros (adding +0.0 changes nothing)
    for (size_t j = tid; j < n_vec; j += GN_UNROLL * stride) {
        typename E::Vec raw[GN_UNROLL];
#pragma unroll
        for (int u = 0; u < GN_UNROLL; u++) {
            const size_t jj = j + u * stride;
            raw[u] = jj < n_vec ? vec[jj] : E::zero();
        }
#pragma unroll
        for (int u = 0; u < GN_UNROLL; u++) E::add_vec(acc, raw[u]);
    }
    const size_t tail_start = head + E::V * n_vec;
    if (tid < head) acc += E::square(values[tid]);
    if (tid < n - tail_start) acc += E::square(values[tail_start + tid]);
    return gn_block_sum(acc);
}

template <typename T>
__global__ void __launch_bounds__(GN_THREADS)
    global_norm_partials_kernel(const T* values, size_t n, size_t head, size_t n_vec, double* partials) {
    const double block = gn_block_partial(values, n, head, n_vec, blockIdx.x, gridDim.x);
    if (threadIdx.x == 0) partials[blockIdx.x] = block;
}

// The ranges of one multi-range launch: range r has pass-1 blocks [block0[r], block0[r + 1]).
struct GnRanges {
    const float* values[GN_MAX_RANGES];
    size_t n[GN_MAX_RANGES], head[GN_MAX_RANGES], n_vec[GN_MAX_RANGES];
    int block0[GN_MAX_RANGES + 1];
    int count;
};
__global__ void __launch_bounds__(GN_THREADS) global_norm_ranges_partials_kernel(const GnRanges t, double* partials) {
    int r = 0;
    while ((int)blockIdx.x >= t.block0[r + 1]) r++;
    const unsigned block = blockIdx.x - t.block0[r], grid = t.block0[r + 1] - t.block0[r];
    const double sum = gn_block_partial(t.values[r], t.n[r], t.head[r], t.n_vec[r], block, grid);
    if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

__global__ void __launch_bounds__(GN_FINISH_THREADS)
    global_norm_finish_kernel(const double* partials, int n_partials, double* out) {
    const double x = (int)threadIdx.x < n_partials ? partials[threadIdx.x] : 0.0;
    const double total = gn_block_sum(x);
    if (threadIdx.x == 0) *out = total;
}
// pass 2 of the ranges: block r sums range r's partials (the same tree as above) into out[r]
__global__ void __launch_bounds__(GN_FINISH_THREADS)
    global_norm_ranges_finish_kernel(const GnRanges t, const double* partials, double* out) {
    const int r = blockIdx.x, n_partials = t.block0[r + 1] - t.block0[r];
    const double x = (int)threadIdx.x < n_partials ? partials[t.block0[r] + threadIdx.x] : 0.0;
    const double total = gn_block_sum(x);
    if (threadIdx.x == 0) out[r] = total;
}

// The elements before the first 16-byte boundary (fewer than one vector), capped at n.
template <typename T>
inline size_t gn_head(const T* values, size_t n) {
    LLMC_CHECK(((uintptr_t)values % sizeof(T)) == 0, "global_norm_squared: values must be %zu-byte aligned",
               sizeof(T));
    return std::min<size_t>(((16 - ((uintptr_t)values & 15)) & 15) / sizeof(T), n);
}
// pass 1 grid: one vector of V elements per thread, at most GN_MAX_BLOCKS blocks, at least one
inline int gn_grid(size_t n, size_t V) {
    const size_t per_block = (size_t)GN_THREADS * V;
    return (int)std::min<size_t>(GN_MAX_BLOCKS, std::max<size_t>(1, (n + per_block - 1) / per_block));
}

// Enqueues both passes on llmc_stream(); the sum lands in device memory at *d_out (no sync).
// d_out must not lie in the first GN_MAX_BLOCKS doubles of the scratch arena (the partials).
template <typename T>
inline void global_norm_squared_launch(const T* values, size_t n, double* d_out) {
    constexpr int V = GnElem<T>::V;
    double* partials = cuda_scratch<double>(GN_MAX_BLOCKS, "global_norm_squared");
    const size_t head = gn_head(values, n);
    const size_t n_vec = (n - head) / V;
    const int grid = gn_grid(n, V);
    global_norm_partials_kernel<T><<<grid, GN_THREADS, 0, llmc_stream()>>>(values, n, head, n_vec, partials);
    cudaCheckLaunch();
    global_norm_finish_kernel<<<1, GN_FINISH_THREADS, 0, llmc_stream()>>>(partials, grid, d_out);
    cudaCheckLaunch();
}

// Both passes, then the double back to the host (the stream is synchronized).
template <typename T>
inline double gn_to_host(const T* values, size_t n) {
    if (n == 0) return 0.0;
    double* scratch = cuda_scratch<double>(GN_MAX_BLOCKS + 1, "global_norm_squared");
    global_norm_squared_launch(values, n, scratch + GN_MAX_BLOCKS);
    double result = 0.0;
    cudaCheck(cudaMemcpyAsync(&result, scratch + GN_MAX_BLOCKS, sizeof(double), cudaMemcpyDeviceToHost,
                              llmc_stream()));
    cudaCheck(cudaStreamSynchronize(llmc_stream()));
    return result;
}

// values: bf16 [n] (device). Returns sum of values[i]^2; synchronizes the stream.
inline double global_norm_squared(const floatX* values, size_t n) { return gn_to_host(values, n); }
// values: fp32 [n] (device), e.g. the fp32 gradient accumulator. Returns sum of values[i]^2 (squares
// and sums in double); synchronizes the stream.
inline double global_norm_squared(const float* values, size_t n) { return gn_to_host(values, n); }

// sums[k] = sum of values[k][i]^2 over i < n[k] for k < count (fp32 device buffers; sums on the
// host), each bitwise global_norm_squared(values[k], n[k]): two launches per GN_MAX_RANGES ranges,
// the sums copied into pinned host memory behind them, one host sync for all.
inline void global_norm_squared_ranges(double* sums, const float* const* values, const size_t* n, int count) {
    if (count == 0) return;
    struct Pinned {  // the sums' landing place (pinned: the copies are queued; grown on demand)
        double* p = nullptr;
        int capacity = 0;
    };
    static Pinned pinned;
    if (count > pinned.capacity) {
        if (pinned.p) {
            llmc_stream_sync();  // (no queued copy may still write the old one)
            cudaCheck(cudaFreeHost(pinned.p));
        }
        pinned.capacity = std::max(count, 2 * pinned.capacity);
        cudaCheck(cudaMallocHost(&pinned.p, pinned.capacity * sizeof(double)));
    }
    double* partials = cuda_scratch<double>((size_t)GN_MAX_RANGES * (GN_MAX_BLOCKS + 1), "global_norm_squared_ranges");
    double* out = partials + (size_t)GN_MAX_RANGES * GN_MAX_BLOCKS;
    for (int k0 = 0; k0 < count; k0 += GN_MAX_RANGES) {
        GnRanges t;
        t.count = std::min(GN_MAX_RANGES, count - k0);
        t.block0[0] = 0;
        for (int r = 0; r < t.count; r++) {
            const float* v = values[k0 + r];
            t.values[r] = v;
            t.n[r] = n[k0 + r];
            t.head[r] = t.n[r] == 0 ? 0 : gn_head(v, t.n[r]);
            t.n_vec[r] = (t.n[r] - t.head[r]) / GnElem<float>::V;
            t.block0[r + 1] = t.block0[r] + (t.n[r] == 0 ? 1 : gn_grid(t.n[r], GnElem<float>::V));  // (n 0: zeros)
        }
        global_norm_ranges_partials_kernel<<<t.block0[t.count], GN_THREADS, 0, llmc_stream()>>>(t, partials);
        cudaCheckLaunch();
        global_norm_ranges_finish_kernel<<<t.count, GN_FINISH_THREADS, 0, llmc_stream()>>>(t, partials, out);
        cudaCheckLaunch();
        cudaCheck(cudaMemcpyAsync(pinned.p + k0, out, t.count * sizeof(double), cudaMemcpyDeviceToHost, llmc_stream()));
    }
    llmc_stream_sync();
    std::copy(pinned.p, pinned.p + count, sums);
}
