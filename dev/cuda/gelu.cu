// GELU benchmark (gelu_forward / gelu_backward of llmc/mlp.cuh, GPT-2's tanh approximation).
//   1. validates both against the CPU twin (llmc/cpu/mlp.h) on random bf16-rounded inputs (a length
//      that is a multiple of 8, the 16-byte path, and a ragged one, the scalar path); exits 1 on a
//      mismatch
//   2. times N = B*T * 4C elements at B*T = 65536 for C = 768 (4C = 3072) and C = 2048 (8192).
// Bytes counted (bf16): forward inp read + out written = 4 N bytes; backward inp, dout read + dinp
// written = 6 N bytes.
// Build: nvcc -O3 -std=c++17 -arch=sm_90 --use_fast_math -I. dev/cuda/gelu.cu -lcublasLt -lcublas -o gelu
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>
#include "dev/cuda/common.cuh"
#include "llmc/cpu/mlp.h"
#include "llmc/mlp.cuh"

static std::vector<float> host_random(size_t n, Rng& rng, float std = 1.0f, float mean = 0.0f) {
    std::vector<float> v(n);
    for (float& x : v) {
        x = __bfloat162float(__float2bfloat16(rng.normal(mean, std)));
        if (x == 0.0f) x = 1e-3f;
    }
    return v;
}
static floatX* to_device_bf16(const std::vector<float>& v) {
    std::vector<floatX> h(v.size());
    for (size_t i = 0; i < v.size(); i++) h[i] = __float2bfloat16(v[i]);
    floatX* d;
    cudaCheck(cudaMalloc(&d, std::max<size_t>(1, h.size()) * sizeof(floatX)));
    cudaCheck(cudaMemcpy(d, h.data(), h.size() * sizeof(floatX), cudaMemcpyHostToDevice));
    return d;
}
static std::vector<float> to_host(const floatX* d, size_t n) {
    cudaCheck(cudaDeviceSynchronize());
    std::vector<floatX> h(n);
    cudaCheck(cudaMemcpy(h.data(), d, n * sizeof(floatX), cudaMemcpyDeviceToHost));
    std::vector<float> v(n);
    for (size_t i = 0; i < n; i++) v[i] = __bfloat162float(h[i]);
    return v;
}
static double rel_l2(const std::vector<float>& got, const std::vector<float>& want) {
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); i++) {
        if (!std::isfinite(got[i])) return INFINITY;
        num += (double)(got[i] - want[i]) * (got[i] - want[i]);
        den += (double)want[i] * want[i];
    }
    return std::sqrt(num / std::max(den, 1e-30));
}

static bool validate(long N) {
    Rng rng(5 + N);
    const std::vector<float> inp = host_random(N, rng, 2.0f, -0.1f), dout = host_random(N, rng);
    std::vector<float> out(N), dinp(N);
    cpu::gelu_forward<float>(out.data(), inp.data(), N);
    cpu::gelu_backward<float>(dinp.data(), dout.data(), inp.data(), N);
    floatX *d_inp = to_device_bf16(inp), *d_dout = to_device_bf16(dout), *d_out = to_device_bf16(out),
           *d_dinp = to_device_bf16(dinp);
    cudaCheck(cudaMemset(d_out, 0xFF, N * sizeof(floatX)));  // NaN: unwritten outputs fail
    cudaCheck(cudaMemset(d_dinp, 0xFF, N * sizeof(floatX)));
    gelu_forward(d_out, d_inp, N);
    gelu_backward(d_dinp, d_dout, d_inp, N);
    const double e_out = rel_l2(to_host(d_out, N), out), e_dinp = rel_l2(to_host(d_dinp, N), dinp);
    const bool ok = e_out <= 1e-2 && e_dinp <= 1e-2;
    printf("validate N=%ld: out %.2e, dinp %.2e (rel L2): %s\n", N, e_out, e_dinp, ok ? "ok" : "MISMATCH");
    for (floatX* p : {d_inp, d_dout, d_out, d_dinp}) cudaCheck(cudaFree(p));
    return ok;
}

// device buffer of n bf16 values uniform in (-scale, scale), from a hash of the index
__global__ void fill_uniform_kernel(floatX* p, size_t n, uint32_t seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint32_t h = llmc_hash((uint32_t)i ^ llmc_hash(seed + (uint32_t)(i >> 32)));
        p[i] = __float2bfloat16(((h >> 8) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * scale);
    }
}
static floatX* alloc_random(size_t n, uint32_t seed, float scale) {
    floatX* p;
    cudaCheck(cudaMalloc(&p, n * sizeof(floatX)));
    fill_uniform_kernel<<<1024, 256, 0, llmc_stream()>>>(p, n, seed, scale);
    cudaCheckLaunch();
    return p;
}

static void run_bench(long N, const char* what) {
    floatX *inp = alloc_random(N, 1, 3.0f), *out = alloc_random(N, 2, 1.0f), *dout = alloc_random(N, 3, 1.0f),
           *dinp = alloc_random(N, 4, 1.0f);
    printf("N = %ld elements (%s)\n", N, what);
    float ms = bench::time_ms([&] { gelu_forward(out, inp, N); });
    bench::print_bandwidth("  gelu_forward", ms, 4.0 * N);
    ms = bench::time_ms([&] { gelu_backward(dinp, dout, inp, N); });
    bench::print_bandwidth("  gelu_backward", ms, 6.0 * N);
    for (floatX* p : {inp, out, dout, dinp}) cudaCheck(cudaFree(p));
}

int main() {
    bench::print_header("gelu");
    bool ok = validate(64L * 3072);
    ok = validate(300L * 3072 + 5) && ok;
    if (!ok) {
        printf("validation FAILED\n");
        return 1;
    }
    run_bench(65536L * 3072, "B*T = 65536, 4C = 3072");
    run_bench(65536L * 8192, "B*T = 65536, 4C = 8192");
    return 0;
}
