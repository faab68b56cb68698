// Fused classifier benchmark (llmc/ops/classifier.cuh: softmax + cross-entropy + dlogits in place).
//   1. validates fused_classifier against the CPU twin (llmc/ops/cpu/classifier.h) on random
//      bf16-rounded logits (GPT-2's V = 50257 padded to 50304, and V = 257 padded to 384), some targets
//      -1, with dloss != 0 (training) and dloss = 0 (losses only); exits 1 on a mismatch
//   2. times N = 8192 rows of V = 50257 / Vp = 50304 (B*T = 65536 rows would be 6.6 GB of logits; a
//      row's cost does not depend on N) and N = 65536 rows of V = 257 / Vp = 384.
// Bytes counted: training  logits [N, Vp] read once + dlogits [N, Vp] written (the second read of a
// row, served by L2, is not counted) + targets and losses; losses only: the V real columns read.
// Build: nvcc -O3 -std=c++17 -arch=sm_90 --use_fast_math -I. dev/cuda/classifier.cu -lcublasLt -lcublas -o classifier
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>
#include "dev/cuda/common.cuh"
#include "llmc/ops/cpu/classifier.h"
#include "llmc/ops/classifier.cuh"

using namespace bench;  // the validation helpers (host_random, to_device_floatX, ...): dev/cuda/common.cuh

static std::vector<int> make_targets(int N, int V, Rng& rng) {
    std::vector<int> t(N);
    for (int n = 0; n < N; n++) t[n] = n % 9 == 4 ? -1 : (int)rng.below(V);
    return t;
}

static bool validate(int N, int V, int Vp, float dloss) {
    Rng rng(31 + V);
    const size_t total = (size_t)N * Vp;
    std::vector<float> logits(total);
    for (int n = 0; n < N; n++)
        for (int v = 0; v < Vp; v++)
            logits[(size_t)n * Vp + v] = v < V ? floatX_to_float(float_to_floatX(rng.normal(0.0f, 3.0f))) : 40.0f;
    const std::vector<int> targets = make_targets(N, V, rng);
    std::vector<float> want = logits, want_losses(N);
    cpu::fused_classifier<float>(want.data(), want_losses.data(), targets.data(), dloss, N, V, Vp);

    floatX* d_logits = to_device_floatX(logits);
    int* d_targets = to_device(targets);
    float* d_losses = dev_alloc<float>(N);
    cudaCheck(cudaMemset(d_losses, 0xFF, N * sizeof(float)));  // NaN: unwritten losses fail
    fused_classifier(d_logits, d_losses, d_targets, dloss, N, V, Vp);
    const double e_loss = rel_max(to_host(d_losses, N), want_losses);
    const double e_d = rel_l2(to_host_floatX(d_logits, total), want);
    const bool ok = e_loss <= 1e-4 && e_d <= 1e-2;
    printf("validate N=%d V=%d Vp=%d dloss=%g: losses %.2e (rel max), %s %.2e (rel L2): %s\n", N, V, Vp, dloss, e_loss,
           dloss != 0.0f ? "dlogits" : "logits untouched", e_d, ok ? "ok" : "MISMATCH");
    cudaCheck(cudaFree(d_logits));
    cudaCheck(cudaFree(d_losses));
    cudaCheck(cudaFree(d_targets));
    return ok;
}

// logits: bf16 values uniform in (-scale, scale) over the first V columns of each row, from a hash
__global__ void fill_logits_kernel(floatX* p, size_t n, int V, int Vp, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint32_t h = llmc_hash((uint32_t)i ^ llmc_hash((uint32_t)(i >> 32)));
        p[i] = (int)(i % Vp) < V ? float_to_floatX(((h >> 8) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * scale)
                                 : float_to_floatX(0.0f);
    }
}

static void run_bench(int N, int V, int Vp) {
    const size_t total = (size_t)N * Vp;
    floatX* logits;
    float* losses;
    cudaCheck(cudaMalloc(&logits, total * sizeof(floatX)));
    cudaCheck(cudaMalloc(&losses, N * sizeof(float)));
    Rng rng(5);
    const std::vector<int> targets = make_targets(N, V, rng);
    int* d_targets;
    cudaCheck(cudaMalloc(&d_targets, N * sizeof(int)));
    cudaCheck(cudaMemcpy(d_targets, targets.data(), N * sizeof(int), cudaMemcpyHostToDevice));
    fill_logits_kernel<<<2048, 256, 0, llmc_stream()>>>(logits, total, V, Vp, 4.0f);
    cudaCheckLaunch();
    const double small = (double)N * (sizeof(int) + sizeof(float));
    printf("N = %d rows, V = %d (padded %d)\n", N, V, Vp);
    // losses only first, on the real logits; then training (each call rewrites the buffer with dlogits,
    // which the next call reads as logits: the same work)
    float ms = bench::time_ms([&] { fused_classifier(logits, losses, d_targets, 0.0f, N, V, Vp); });
    bench::print_bandwidth("  losses only (dloss = 0)", ms, (double)N * V * sizeof(floatX) + small);
    ms = bench::time_ms([&] { fused_classifier(logits, losses, d_targets, 1.0f / N, N, V, Vp); });
    bench::print_bandwidth("  losses + dlogits in place", ms, 2.0 * total * sizeof(floatX) + small);
    cudaCheck(cudaFree(logits));
    cudaCheck(cudaFree(losses));
    cudaCheck(cudaFree(d_targets));
}

int main() {
    bench::print_header("classifier");
    bool ok = true;
    for (float dloss : {1.0f / 64, 0.0f}) {
        ok = validate(64, 50257, 50304, dloss) && ok;
        ok = validate(300, 257, 384, dloss) && ok;
    }
    require_valid(ok);
    run_bench(8192, 50257, 50304);
    run_bench(65536, 257, 384);
    return 0;
}
