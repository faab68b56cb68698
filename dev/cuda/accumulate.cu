// fp32 gradient accumulation benchmark (llmc/ops/accumulate.cuh): acc[i] += x[i], acc and x fp32 (the
// leaf gradients are fp32), at GPT-2 small (124M) and XL (1.5B) parameter counts.
//   version 1: one element per thread (the scalar path grad_accumulate takes for misaligned slices)
//   version 2: 8 elements per thread, every access 16 bytes wide (the path for aligned buffers)
// Both evaluate the same per-element addition, so they must agree bit for bit; both are checked
// against the CPU twin (llmc/ops/cpu/accumulate.h) first, bitwise (the addition rounds the same way on
// both sides).
// Bytes counted per element: read x 4 + acc 4, write acc 4 = 12. Reported as GB/s, as a fraction
// of the measured copy bandwidth, and as a fraction of the H200's nominal 4.8 TB/s HBM3e.
//   nvcc -O3 -std=c++17 -arch=sm_90 --use_fast_math -I. dev/cuda/accumulate.cu -lcublasLt -lcublas -o accumulate
#include <cstring>
#include <vector>
#include "dev/cuda/common.cuh"
#include "llmc/ops/cpu/accumulate.h"
#include "llmc/ops/accumulate.cuh"

using namespace bench;

constexpr double H200_HBM_BYTES_PER_S = 4.8e12;

// deterministic pseudo-random fp32 accumulator for timing (no host round trip for 6 GB)
__global__ void fill_acc(float* acc, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint32_t h = llmc_hash((uint32_t)i * 2 + 1);
        acc[i] = ((h >> 8) * (1.0f / 16777216.0f) - 0.5f) * 0.01f;
    }
}

// both versions vs the CPU twin at (acc, x) element offsets; returns true when all bits agree
static bool validate(size_t n, size_t acc_off, size_t x_off) {
    Rng rng(n + 31 * acc_off + x_off);
    std::vector<float> acc(n), x = host_random(n, rng, 0.02f);
    for (float& a : acc) {
        a = rng.normal(0.0f, 0.1f);  // full fp32 values: the addition rounds
        if (a == 0.0f) a = 1e-3f;
    }
    std::vector<float> want = acc;
    cpu::grad_accumulate<float>(want.data(), x.data(), n);
    std::vector<float> xb(x_off + n);
    for (size_t i = 0; i < n; i++) xb[x_off + i] = x[i];
    float* d_x = to_device(xb);
    float* d_acc = dev_alloc<float>(acc_off + n);
    bool ok = true;
    std::vector<float> out[2];
    for (int version = 1; version <= 2; version++) {
        const bool vec8 = version == 2;
        if (vec8 && !(floatx8::aligned16(d_acc + acc_off) && floatx8::aligned16(d_x + x_off))) continue;
        cudaCheck(cudaMemcpy(d_acc + acc_off, acc.data(), n * sizeof(float), cudaMemcpyHostToDevice));
        grad_accumulate_launch(vec8, d_acc + acc_off, d_x + x_off, n);
        out[version - 1] = to_host(d_acc + acc_off, n);
        size_t differ = 0;
        for (size_t i = 0; i < n; i++) differ += memcmp(&out[version - 1][i], &want[i], 4) != 0;
        if (differ) {
            printf("MISMATCH v%d n=%zu offsets (%zu, %zu): %zu of %zu elements differ from the CPU twin\n", version,
                   n, acc_off, x_off, differ, n);
            ok = false;
        }
    }
    cudaCheck(cudaFree(d_x));
    cudaCheck(cudaFree(d_acc));
    return ok;
}

int main() {
    bench::print_header("grad_accumulate");
    bool ok = true;
    for (size_t n : {(size_t)1, (size_t)7, (size_t)1003, (size_t)(1 << 20) + 5})
        for (size_t off : {(size_t)0, (size_t)1}) ok = validate(n, off, off) && ok;
    require_valid(ok);
    printf("validation vs CPU twin: ok (bitwise, both versions, ragged n, misaligned offsets)\n");

    const size_t sizes[2] = {124475904, 1557611200};  // GPT-2 small and XL (padded vocab)
    const size_t n_max = sizes[1];
    float* acc = dev_alloc<float>(n_max);
    float* x = dev_alloc<float>(n_max);
    fill_acc<<<132 * 16, 256, 0, llmc_stream()>>>(acc, n_max);
    cudaCheckLaunch();
    fill_acc<<<132 * 16, 256, 0, llmc_stream()>>>(x, n_max);
    cudaCheckLaunch();
    for (size_t n : sizes) {
        const int repeats = n > 500000000 ? 20 : 50;
        for (int version = 1; version <= 2; version++) {
            const float ms = bench::time_ms([&] { grad_accumulate_launch(version == 2, acc, x, n); }, 3, repeats);
            char what[128];
            snprintf(what, sizeof(what), "grad_accumulate v%d n=%.0fM", version, n / 1e6);
            const double bytes = 12.0 * n;
            bench::print_bandwidth(what, ms, bytes);
            printf("%-48s %5.1f%% of the H200's 4.8 TB/s\n", "", 100.0 * bytes / (ms * 1e-3) / H200_HBM_BYTES_PER_S);
        }
    }
    cudaCheck(cudaFree(acc));
    cudaCheck(cudaFree(x));
    return 0;
}
