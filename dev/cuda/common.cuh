// Shared by the dev/cuda benchmarks: event timing (median of repeats after warm-up), the measured
// ceilings of this GPU (device-to-device copy bandwidth, bf16 cuBLASLt matmul rate), a one-line
// result printer, and the validation helpers. Each benchmark validates its kernels against the CPU
// twin (llmc/ops/cpu/<op>.h) before timing them: random bf16-rounded inputs on the host (host_random),
// the twin in fp32, the same values on the device (to_device_floatX), outputs poisoned with NaN bytes
// first, then back to the host (to_host_floatX) and compared (rel_l2, rel_max, compare); a failed
// validation ends the program with exit status 1 (require_valid). Timing runs on device buffers
// filled by a hash (alloc_random: no host round trip for gigabytes).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>
#include "llmc/ops/cuda_common.cuh"
#include "llmc/rand.h"

namespace bench {

// median milliseconds of fn() over `repeats` runs (after `warmup`), timed with CUDA events
inline float time_ms(const std::function<void()>& fn, int warmup = 5, int repeats = 50) {
    for (int i = 0; i < warmup; i++) fn();
    cudaCheck(cudaDeviceSynchronize());
    cudaEvent_t start, stop;
    cudaCheck(cudaEventCreate(&start));
    cudaCheck(cudaEventCreate(&stop));
    std::vector<float> t(repeats);
    for (int i = 0; i < repeats; i++) {
        cudaCheck(cudaEventRecord(start, llmc_stream()));
        fn();
        cudaCheck(cudaEventRecord(stop, llmc_stream()));
        cudaCheck(cudaEventSynchronize(stop));
        cudaCheck(cudaEventElapsedTime(&t[i], start, stop));
    }
    cudaCheck(cudaEventDestroy(start));
    cudaCheck(cudaEventDestroy(stop));
    std::sort(t.begin(), t.end());
    return t[repeats / 2];
}

// Measured device-to-device copy bandwidth in bytes/s (bytes read + bytes written), 1 GiB buffers
inline double copy_bandwidth() {
    static double measured = 0;
    if (measured > 0) return measured;
    const size_t bytes = 1ull << 30;
    void *a, *b;
    cudaCheck(cudaMalloc(&a, bytes));
    cudaCheck(cudaMalloc(&b, bytes));
    cudaCheck(cudaMemset(a, 1, bytes));
    float ms = time_ms([&] { cudaCheck(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, llmc_stream())); }, 3, 20);
    cudaCheck(cudaFree(a));
    cudaCheck(cudaFree(b));
    measured = 2.0 * bytes / (ms * 1e-3);
    return measured;
}

inline void print_header(const char* name) {
    cudaDeviceProp p;
    cudaCheck(cudaGetDeviceProperties(&p, 0));
    printf("== %s on %s (sm_%d%d), measured copy bandwidth %.0f GB/s\n", name, p.name, p.major, p.minor,
           copy_bandwidth() / 1e9);
}

// a memory-bound result: bytes moved (each input read once, each output written once)
inline void print_bandwidth(const std::string& what, float ms, double bytes) {
    double bw = bytes / (ms * 1e-3);
    printf("%-48s %9.3f ms %8.0f GB/s %5.1f%% of copy\n", what.c_str(), ms, bw / 1e9, 100.0 * bw / copy_bandwidth());
}

// a compute-bound result
inline void print_flops(const std::string& what, float ms, double flops, double peak_flops) {
    double f = flops / (ms * 1e-3);
    printf("%-48s %9.3f ms %8.1f TFLOP/s", what.c_str(), ms, f / 1e12);
    if (peak_flops > 0) printf(" %5.1f%% of measured matmul", 100.0 * f / peak_flops);
    printf("\n");
}

// ------------------------------------------------------------------------------------------------
// validation

// n values normal(mean, std) rounded through bf16 (the CPU twin sees exactly what the GPU sees);
// an exact zero becomes 1e-3
inline std::vector<float> host_random(size_t n, Rng& rng, float std = 1.0f, float mean = 0.0f) {
    std::vector<float> v(n);
    for (float& x : v) {
        x = floatX_to_float(float_to_floatX(rng.normal(mean, std)));
        if (x == 0.0f) x = 1e-3f;
    }
    return v;
}

// device buffer of n elements (at least one, so that empty tensors get a valid pointer)
template <typename T>
inline T* dev_alloc(size_t n) {
    T* p;
    cudaCheck(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
    return p;
}
template <typename T>
inline T* to_device(const std::vector<T>& h) {
    T* d = dev_alloc<T>(h.size());
    cudaCheck(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}
inline floatX* to_device_floatX(const std::vector<float>& v) {
    std::vector<floatX> h(v.size());
    for (size_t i = 0; i < v.size(); i++) h[i] = float_to_floatX(v[i]);
    return to_device(h);
}
// after the device is done: n elements back to the host
template <typename T>
inline std::vector<T> to_host(const T* d, size_t n) {
    cudaCheck(cudaDeviceSynchronize());
    std::vector<T> h(n);
    cudaCheck(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}
inline std::vector<float> to_host_floatX(const floatX* d, size_t n) {
    const std::vector<floatX> h = to_host(d, n);
    std::vector<float> v(n);
    for (size_t i = 0; i < n; i++) v[i] = floatX_to_float(h[i]);
    return v;
}

// ||got - want|| / ||want||; a NaN (an element the kernel did not write) gives +inf
inline double rel_l2(const std::vector<float>& got, const std::vector<float>& want) {
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); i++) {
        if (!std::isfinite(got[i])) return INFINITY;
        num += (double)(got[i] - want[i]) * (got[i] - want[i]);
        den += (double)want[i] * want[i];
    }
    return std::sqrt(num / std::max(den, 1e-30));
}
// max |got - want| / max |want|; NaN gives +inf
inline double rel_max(const std::vector<float>& got, const std::vector<float>& want) {
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); i++) {
        if (!std::isfinite(got[i])) return INFINITY;
        num = std::max(num, (double)std::fabs(got[i] - want[i]));
        den = std::max(den, (double)std::fabs(want[i]));
    }
    return num / std::max(den, 1e-30);
}
// relative L2 and max-norm errors, both <= tol, printed as one line; a NaN counts as infinite
inline bool compare(const char* what, const std::vector<float>& got, const std::vector<float>& want, double tol) {
    const double l2 = rel_l2(got, want), mx = rel_max(got, want);
    const bool ok = l2 <= tol && mx <= tol;
    printf("  %-14s rel_l2 %.2e  rel_max %.2e  %s\n", what, l2, mx, ok ? "ok" : "MISMATCH");
    return ok;
}

// the end of a benchmark whose validation failed: no timing of wrong kernels
inline void require_valid(bool ok) {
    if (ok) return;
    printf("validation FAILED\n");
    std::exit(1);
}

// ------------------------------------------------------------------------------------------------
// timing inputs

// p[i] = bf16 of offset + u * scale, u uniform in (-1, 1) from a hash of (seed, i)
__global__ void fill_uniform_kernel(floatX* p, size_t n, uint32_t seed, float scale, float offset) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint32_t h = llmc_hash((uint32_t)i ^ llmc_hash(seed + (uint32_t)(i >> 32)));
        p[i] = float_to_floatX(((h >> 8) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * scale + offset);
    }
}
// device buffer of n bf16 values uniform in (offset - scale, offset + scale)
inline floatX* alloc_random(size_t n, uint32_t seed, float scale, float offset = 0.0f) {
    floatX* p = dev_alloc<floatX>(n);
    fill_uniform_kernel<<<1024, 256, 0, llmc_stream()>>>(p, n, seed, scale, offset);
    cudaCheckLaunch();
    return p;
}

// device buffer of n fp32 zeros (the weight gradients' accumulators in the timing runs)
inline float* alloc_zeros_f32(size_t n) {
    float* p = dev_alloc<float>(n);
    cudaCheck(cudaMemset(p, 0, n * sizeof(float)));
    return p;
}

// doc_start of B rows of T tokens: packed = documents of random length in [1, T/4) (mean ~T/8), the
// row starting inside a document; unpacked = one document per row
inline std::vector<int> make_doc_start(int B, int T, bool packed, uint64_t seed) {
    Rng rng(seed);
    std::vector<int> ds((size_t)B * T, 0);
    if (!packed) return ds;
    const int max_len = std::max(2, T / 4);
    for (int b = 0; b < B; b++) {
        int start = 0, next = 1 + (int)rng.below(max_len - 1);
        for (int t = 0; t < T; t++) {
            if (t == next) {
                start = t;
                next = t + 1 + (int)rng.below(max_len - 1);
            }
            ds[(size_t)b * T + t] = start;
        }
    }
    return ds;
}
// number of (query, key) pairs the document-causal mask lets through: sum over queries of
// i - doc_start[i] + 1 (the attention benchmarks count FLOPs over these only)
inline double visible_pairs(const std::vector<int>& ds, int T) {
    double pairs = 0;
    for (size_t t = 0; t < ds.size(); t++) pairs += (double)((int)(t % T) - ds[t] + 1);
    return pairs;
}

}  // namespace bench
