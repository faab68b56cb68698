// Global gradient norm benchmark (llmc/ops/global_norm.cuh): sum of squares of a bf16 buffer and of an
// fp32 buffer (the fp32 gradient accumulator) of GPT-2 small (124M) and XL (1.5B) parameter counts.
// bf16: 16-byte loads, 4 in flight per thread, fp32 8-sums into per-thread doubles; fp32: 16-byte
// float4 loads, 4 in flight, each square in double; both the same fixed two-pass reduction (see
// the header). Timed twice: the two kernels alone (global_norm_squared_launch, result left on the
// device), and the full global_norm_squared, which adds the 8-byte copy to the host and the stream
// sync. Bytes counted: the buffer read once, 2n (bf16) or 4n (fp32); the partials, 4 KB, are
// negligible.
//   nvcc -O3 -std=c++17 -arch=sm_90 --use_fast_math -I. dev/cuda/global_norm.cu -lcublasLt -lcublas -o global_norm
#include <cstring>
#include <vector>
#include "dev/cuda/common.cuh"
#include "llmc/ops/cpu/global_norm.h"
#include "llmc/ops/global_norm.cuh"

template <typename T>
__global__ void fill_values(T* values, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint32_t h = llmc_hash((uint32_t)i ^ 0x2545f491u);
        values[i] = (T)(((h >> 8) * (1.0f / 16777216.0f) - 0.5f) * 0.01f);
    }
}

// fp32 values vs the CPU twin (both square in double: tolerance 1e-11, see test/gpu/global_norm.cuh)
static int validate_fp32() {
    int failures = 0;
    for (size_t n : {(size_t)1, (size_t)3, (size_t)1001, (size_t)(1 << 20) + 3, (size_t)(1 << 24) + 7}) {
        for (size_t offset : {(size_t)0, (size_t)1, (size_t)2, (size_t)3}) {
            Rng rng(n + offset + 12345);
            std::vector<float> h(n + offset);
            for (float& x : h) x = rng.normal(0.1f, 1.0f);
            float* d;
            cudaCheck(cudaMalloc(&d, (n + offset) * sizeof(float)));
            cudaCheck(cudaMemcpy(d, h.data(), (n + offset) * sizeof(float), cudaMemcpyHostToDevice));
            const double want = cpu::global_norm_squared<float>(h.data() + offset, n);
            const double got = global_norm_squared(d + offset, n), again = global_norm_squared(d + offset, n);
            const double err = std::fabs(got - want) / want;
            if (!(err <= 1e-11)) {
                printf("MISMATCH fp32 n=%zu offset=%zu: got %.17g want %.17g (rel err %g)\n", n, offset, got, want,
                       err);
                failures++;
            }
            if (memcmp(&got, &again, sizeof(double)) != 0) {
                printf("NOT DETERMINISTIC fp32 n=%zu offset=%zu: %.17g vs %.17g\n", n, offset, got, again);
                failures++;
            }
            cudaCheck(cudaFree(d));
        }
    }
    return failures;
}

int main() {
    bench::print_header("global_norm_squared");
    cuda_scratch_reserve(global_norm_scratch_bytes());
    int failures = 0;
    // validation vs the CPU twin (fp32 on the same bf16 values), ragged sizes and a misaligned start
    for (size_t n : {(size_t)1, (size_t)7, (size_t)1000, (size_t)(1 << 20) + 3, (size_t)(1 << 24) + 7}) {
        for (size_t offset : {(size_t)0, (size_t)3}) {
            Rng rng(n + offset);
            std::vector<floatX> h(n + offset);
            std::vector<float> x(n);
            for (size_t i = 0; i < n + offset; i++) h[i] = float_to_floatX(rng.normal(0.1f, 1.0f));
            for (size_t i = 0; i < n; i++) x[i] = floatX_to_float(h[offset + i]);
            floatX* d;
            cudaCheck(cudaMalloc(&d, (n + offset) * sizeof(floatX)));
            cudaCheck(cudaMemcpy(d, h.data(), (n + offset) * sizeof(floatX), cudaMemcpyHostToDevice));
            const double want = cpu::global_norm_squared<float>(x.data(), n);
            const double got = global_norm_squared(d + offset, n), again = global_norm_squared(d + offset, n);
            const double err = std::fabs(got - want) / want;
            if (!(err <= 1e-6)) {
                printf("MISMATCH n=%zu offset=%zu: got %.17g want %.17g (rel err %g)\n", n, offset, got, want, err);
                failures++;
            }
            if (memcmp(&got, &again, sizeof(double)) != 0) {
                printf("NOT DETERMINISTIC n=%zu offset=%zu: %.17g vs %.17g\n", n, offset, got, again);
                failures++;
            }
            cudaCheck(cudaFree(d));
        }
    }
    failures += validate_fp32();
    if (failures) {
        printf("global_norm: %d validation failures\n", failures);
        return 1;
    }
    printf("validation vs CPU twin: ok (bf16 rel err <= 1e-6, fp32 <= 1e-11, bitwise repeatable)\n");

    const size_t sizes[2] = {124475904, 1557611200};  // GPT-2 small and XL (padded vocab)
    floatX* values;
    cudaCheck(cudaMalloc(&values, sizes[1] * sizeof(floatX)));
    fill_values<floatX><<<132 * 16, 256, 0, llmc_stream()>>>(values, sizes[1]);
    cudaCheckLaunch();
    // the result slot after the partials (global_norm_squared_launch must not overwrite it)
    double* d_out = cuda_scratch<double>(GN_MAX_BLOCKS + 1, "bench") + GN_MAX_BLOCKS;
    for (size_t n : sizes) {
        const int repeats = n > 500000000 ? 20 : 50;
        char what[128];
        float ms = bench::time_ms([&] { global_norm_squared_launch(values, n, d_out); }, 3, repeats);
        snprintf(what, sizeof(what), "global_norm kernels n=%.0fM", n / 1e6);
        bench::print_bandwidth(what, ms, 2.0 * n);
        ms = bench::time_ms([&] { (void)global_norm_squared(values, n); }, 3, repeats);
        snprintf(what, sizeof(what), "global_norm_squared (+copy, sync) n=%.0fM", n / 1e6);
        bench::print_bandwidth(what, ms, 2.0 * n);
    }
    cudaCheck(cudaFree(values));

    float* values32;
    cudaCheck(cudaMalloc(&values32, sizes[1] * sizeof(float)));
    fill_values<float><<<132 * 16, 256, 0, llmc_stream()>>>(values32, sizes[1]);
    cudaCheckLaunch();
    for (size_t n : sizes) {
        const int repeats = n > 500000000 ? 20 : 50;
        char what[128];
        float ms = bench::time_ms([&] { global_norm_squared_launch(values32, n, d_out); }, 3, repeats);
        snprintf(what, sizeof(what), "global_norm fp32 kernels n=%.0fM", n / 1e6);
        bench::print_bandwidth(what, ms, 4.0 * n);
        ms = bench::time_ms([&] { (void)global_norm_squared(values32, n); }, 3, repeats);
        snprintf(what, sizeof(what), "global_norm_squared fp32 (+copy, sync) n=%.0fM", n / 1e6);
        bench::print_bandwidth(what, ms, 4.0 * n);
    }
    cudaCheck(cudaFree(values32));
    return 0;
}
