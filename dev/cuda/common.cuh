// Shared by the dev/cuda benchmarks: event timing (median of repeats after warm-up), the measured
// ceilings of this GPU (device-to-device copy bandwidth, bf16 cuBLASLt matmul rate), and a
// one-line result printer. Each benchmark validates its kernels against the CPU twin
// (llmc/cpu/<op>.h) before timing them.
#pragma once
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>
#include "llmc/cuda_common.cuh"
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

}  // namespace bench
