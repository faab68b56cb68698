// RMSNorm benchmark (llmc/ops/rmsnorm.cuh: layernorm's kernels with the RMS flag).
//   1. validates rmsnorm_forward, fused_residual_rmsnorm_forward and rmsnorm_backward against the CPU
//      twin (llmc/ops/cpu/rmsnorm.h) on random bf16-rounded inputs (C = 768, a ragged 769 and 2048; the
//      fused one against the CPU RMSNorm of the rounded residual, as the GPU defines it), the backward
//      twice (bitwise determinism); exits 1 on a mismatch
//   2. times N = B*T = 65536 rows at C = 768, 1024, 2048, 4096, next to layernorm's kernels on the
//      same shape (what the RMS flag saves: one reduction in each direction, the bias, dbias)
// Bytes counted (floatX tensors of N x C, fp32 statistics, the weights once):
//   forward   inp read, out written, rstd written
//   fused     inp1, inp2 read, residual and out written, rstd written
//   backward  dout, inp read, dinp read and written (+=), rstd read, dweight read and written (fp32)
//             (the fp32 per-block partials, ~1% of it, are not counted)
// The roofline: the measured device-to-device copy bandwidth (bench::print_bandwidth's "% of copy").
// Build: make dev/cuda/bin/rmsnorm (or nvcc -O3 -std=c++17 -arch=sm_90a --use_fast_math -I. dev/cuda/rmsnorm.cu
//        -lcublasLt -lcublas -o rmsnorm). GPU-unverified: written in a session without a GPU (compiles).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>
#include "dev/cuda/common.cuh"
#include "llmc/ops/cpu/rmsnorm.h"
#include "llmc/ops/rmsnorm.cuh"

using namespace bench;  // the validation helpers (host_random, to_device_floatX, ...): dev/cuda/common.cuh

constexpr float EPS = 1e-5f;

static bool validate(int N, int C) {
    Rng rng(199 + C);
    const size_t nc = (size_t)N * C;
    const std::vector<float> x = host_random(nc, rng, 1.0f, 2.0f), x2 = host_random(nc, rng, 0.5f);
    const std::vector<float> w = host_random(C, rng, 0.3f, 1.0f);
    const std::vector<float> dout = host_random(nc, rng), dinp0 = host_random(nc, rng);
    const std::vector<float> dw0 = host_random(C, rng);
    // CPU: plain forward of x; fused: residual, then the forward of the rounded residual; backward on x
    std::vector<float> y(nc), rstd(N), res(nc), y2(nc), rstd2(N);
    cpu::rmsnorm_forward<float>(y.data(), rstd.data(), x.data(), w.data(), N, C, EPS);
    for (size_t i = 0; i < nc; i++) res[i] = floatX_to_float(float_to_floatX(x[i] + x2[i]));
    cpu::rmsnorm_forward<float>(y2.data(), rstd2.data(), res.data(), w.data(), N, C, EPS);
    std::vector<float> dinp = dinp0, dw = dw0;
    cpu::rmsnorm_backward<float, float>(dinp.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);

    cuda_scratch_reserve(rmsnorm_scratch_bytes(N, C));
    floatX *d_x = to_device_floatX(x), *d_x2 = to_device_floatX(x2), *d_w = to_device_floatX(w);
    floatX *d_dout = to_device_floatX(dout), *d_y = to_device_floatX(y), *d_res = to_device_floatX(res);
    float* d_rstd = to_device(rstd);
    cudaCheck(cudaMemset(d_y, 0xFF, nc * sizeof(floatX)));  // NaN: unwritten outputs fail
    cudaCheck(cudaMemset(d_rstd, 0xFF, N * sizeof(float)));
    rmsnorm_forward(d_y, d_rstd, d_x, d_w, N, C, EPS);
    printf("validate N=%d C=%d\n", N, C);
    bool ok = compare("fwd out", to_host_floatX(d_y, nc), y, 1e-2);
    ok = compare("fwd rstd", to_host(d_rstd, N), rstd, 1e-4) && ok;
    cudaCheck(cudaMemset(d_y, 0xFF, nc * sizeof(floatX)));
    cudaCheck(cudaMemset(d_res, 0xFF, nc * sizeof(floatX)));
    cudaCheck(cudaMemset(d_rstd, 0xFF, N * sizeof(float)));
    fused_residual_rmsnorm_forward(d_res, d_y, d_rstd, d_x, d_x2, d_w, N, C, EPS);
    ok = compare("fused res", to_host_floatX(d_res, nc), res, 1e-2) && ok;
    ok = compare("fused out", to_host_floatX(d_y, nc), y2, 1e-2) && ok;
    ok = compare("fused rstd", to_host(d_rstd, N), rstd2, 1e-4) && ok;
    // backward with the CPU statistics of x, twice
    cudaCheck(cudaMemcpy(d_rstd, rstd.data(), N * sizeof(float), cudaMemcpyHostToDevice));
    std::vector<float> got[2][2];
    for (int rep = 0; rep < 2; rep++) {
        floatX* d_dinp = to_device_floatX(dinp0);
        float* d_dw = to_device(dw0);  // fp32 gradient
        rmsnorm_backward(d_dinp, d_dw, d_dout, d_x, d_w, d_rstd, N, C);
        got[rep][0] = to_host_floatX(d_dinp, nc);
        got[rep][1] = to_host(d_dw, C);
        cudaCheck(cudaFree(d_dinp));
        cudaCheck(cudaFree(d_dw));
    }
    ok = compare("bwd dinp", got[0][0], dinp, 1e-2) && ok;
    ok = compare("bwd dweight", got[0][1], dw, 1e-5) && ok;  // fp32 sums (reordered)
    const bool same = got[0][0] == got[1][0] && got[0][1] == got[1][1];
    printf("  backward deterministic: %s\n", same ? "yes" : "NO");
    for (void* p : {(void*)d_x, (void*)d_x2, (void*)d_w, (void*)d_dout, (void*)d_y, (void*)d_res, (void*)d_rstd})
        cudaCheck(cudaFree(p));
    return ok && same;
}

static void run_bench(int N, int C) {
    const size_t nc = (size_t)N * C;
    cuda_scratch_reserve(std::max(rmsnorm_scratch_bytes(N, C), layernorm_scratch_bytes(N, C)));
    floatX *inp = alloc_random(nc, 1, 1.0f), *inp2 = alloc_random(nc, 2, 1.0f), *res = alloc_random(nc, 3, 1.0f);
    floatX *out = alloc_random(nc, 4, 1.0f), *dout = alloc_random(nc, 5, 1.0f), *dinp = alloc_random(nc, 6, 1.0f);
    floatX *w = alloc_random(C, 7, 0.1f, 1.0f), *b = alloc_random(C, 8, 0.1f);
    float *dw = alloc_zeros_f32(C), *db = alloc_zeros_f32(C);
    float *mean, *rstd;
    cudaCheck(cudaMalloc(&mean, N * sizeof(float)));
    cudaCheck(cudaMalloc(&rstd, N * sizeof(float)));
    const double t = nc * sizeof(floatX), stat = (double)N * sizeof(float), wb = (double)C * sizeof(floatX);
    printf("N = %d rows, C = %d\n", N, C);
    rmsnorm_forward(out, rstd, inp, w, N, C, EPS);  // real statistics for the backward
    float ms = bench::time_ms([&] { rmsnorm_forward(out, rstd, inp, w, N, C, EPS); });
    bench::print_bandwidth("  rmsnorm_forward", ms, 2 * t + stat + wb);
    ms = bench::time_ms([&] { fused_residual_rmsnorm_forward(res, out, rstd, inp, inp2, w, N, C, EPS); });
    bench::print_bandwidth("  fused_residual_rmsnorm_forward", ms, 4 * t + stat + wb);
    ms = bench::time_ms([&] { rmsnorm_backward(dinp, dw, dout, inp, w, rstd, N, C); });
    bench::print_bandwidth("  rmsnorm_backward", ms, 4 * t + stat + wb + 2 * C * sizeof(float));
    // layernorm on the same shape, for comparison (its statistics: mean and rstd; w, b; dw, db)
    layernorm_forward(out, mean, rstd, inp, w, b, N, C);
    ms = bench::time_ms([&] { layernorm_forward(out, mean, rstd, inp, w, b, N, C); });
    bench::print_bandwidth("  (layernorm_forward)", ms, 2 * t + 2 * stat + 2 * wb);
    ms = bench::time_ms([&] { layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, N, C); });
    bench::print_bandwidth("  (layernorm_backward)", ms, 4 * t + 2 * stat + wb + 4 * C * sizeof(float));
    for (void* p : {(void*)inp, (void*)inp2, (void*)res, (void*)out, (void*)dout, (void*)dinp, (void*)w, (void*)b,
                    (void*)dw, (void*)db, (void*)mean, (void*)rstd})
        cudaCheck(cudaFree(p));
}

int main() {
    bench::print_header("rmsnorm");
    bool ok = validate(300, 768);
    ok = validate(300, 769) && ok;
    ok = validate(1000, 2048) && ok;
    require_valid(ok);
    for (int C : {768, 1024, 2048, 4096}) run_bench(65536, C);
    return 0;
}
