// LayerNorm benchmark (llmc/ops/layernorm.cuh).
//   1. validates layernorm_forward, fused_residual_layernorm_forward and layernorm_backward against
//      the CPU twin (llmc/ops/cpu/layernorm.h) on random bf16-rounded inputs (C = 768 and a ragged 769;
//      the fused one against the CPU LayerNorm of the bf16-rounded residual, as the GPU defines it),
//      the backward twice (bitwise determinism); exits 1 on a mismatch
//   2. times N = B*T = 65536 rows at C = 768, 1024, 2048.
// Bytes counted (bf16 tensors of N x C, fp32 statistics, the weights once):
//   forward   inp read, out written, mean/rstd written
//   fused     inp1, inp2 read, residual and out written, mean/rstd written
//   backward  dout, inp read, dinp read and written (+=), mean/rstd read, dweight/dbias read and written
//             (the fp32 per-block partials, ~1% of it, are not counted)
// Build: nvcc -O3 -std=c++17 -arch=sm_90 --use_fast_math -I. dev/cuda/layernorm.cu -lcublasLt -lcublas -o layernorm
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>
#include "dev/cuda/common.cuh"
#include "llmc/ops/cpu/layernorm.h"
#include "llmc/ops/layernorm.cuh"

using namespace bench;  // the validation helpers (host_random, to_device_floatX, ...): dev/cuda/common.cuh

static bool validate(int N, int C) {
    Rng rng(99 + C);
    const size_t nc = (size_t)N * C;
    const std::vector<float> x = host_random(nc, rng, 1.0f, 2.0f), x2 = host_random(nc, rng, 0.5f);
    const std::vector<float> w = host_random(C, rng, 0.3f, 1.0f), b = host_random(C, rng, 0.3f);
    const std::vector<float> dout = host_random(nc, rng), dinp0 = host_random(nc, rng);
    const std::vector<float> dw0 = host_random(C, rng), db0 = host_random(C, rng);
    // CPU: plain forward of x; fused: residual, then the forward of the bf16-rounded residual; backward on x
    std::vector<float> y(nc), mean(N), rstd(N), res(nc), y2(nc), mean2(N), rstd2(N);
    cpu::layernorm_forward<float>(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    for (size_t i = 0; i < nc; i++) res[i] = floatX_to_float(float_to_floatX(x[i] + x2[i]));
    cpu::layernorm_forward<float>(y2.data(), mean2.data(), rstd2.data(), res.data(), w.data(), b.data(), N, C);
    std::vector<float> dinp = dinp0, dw = dw0, db = db0;
    cpu::layernorm_backward<float>(dinp.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(),
                                   rstd.data(), N, C);

    cuda_scratch_reserve(layernorm_scratch_bytes(N, C));
    floatX *d_x = to_device_floatX(x), *d_x2 = to_device_floatX(x2), *d_w = to_device_floatX(w), *d_b = to_device_floatX(b);
    floatX *d_dout = to_device_floatX(dout), *d_y = to_device_floatX(y), *d_res = to_device_floatX(res);
    float *d_mean = to_device(mean), *d_rstd = to_device(rstd);
    cudaCheck(cudaMemset(d_y, 0xFF, nc * sizeof(floatX)));  // NaN: unwritten outputs fail
    cudaCheck(cudaMemset(d_mean, 0xFF, N * sizeof(float)));
    cudaCheck(cudaMemset(d_rstd, 0xFF, N * sizeof(float)));
    layernorm_forward(d_y, d_mean, d_rstd, d_x, d_w, d_b, N, C);
    double e[9];
    e[0] = rel_l2(to_host_floatX(d_y, nc), y);
    e[1] = std::max(rel_max(to_host(d_mean, N), mean), rel_max(to_host(d_rstd, N), rstd));
    cudaCheck(cudaMemset(d_y, 0xFF, nc * sizeof(floatX)));
    cudaCheck(cudaMemset(d_res, 0xFF, nc * sizeof(floatX)));
    fused_residual_layernorm_forward(d_res, d_y, d_mean, d_rstd, d_x, d_x2, d_w, d_b, N, C);
    e[2] = rel_l2(to_host_floatX(d_res, nc), res);
    e[3] = rel_l2(to_host_floatX(d_y, nc), y2);
    e[4] = std::max(rel_max(to_host(d_mean, N), mean2), rel_max(to_host(d_rstd, N), rstd2));
    // backward with the CPU statistics of x, twice
    cudaCheck(cudaMemcpy(d_mean, mean.data(), N * sizeof(float), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d_rstd, rstd.data(), N * sizeof(float), cudaMemcpyHostToDevice));
    std::vector<float> got[2][3];
    for (int rep = 0; rep < 2; rep++) {
        floatX* d_dinp = to_device_floatX(dinp0);
        float *d_dw = to_device(dw0), *d_db = to_device(db0);  // fp32 gradients
        layernorm_backward(d_dinp, d_dw, d_db, d_dout, d_x, d_w, d_mean, d_rstd, N, C);
        got[rep][0] = to_host_floatX(d_dinp, nc);
        got[rep][1] = to_host(d_dw, C);
        got[rep][2] = to_host(d_db, C);
        cudaCheck(cudaFree(d_dinp));
        for (float* p : {d_dw, d_db}) cudaCheck(cudaFree(p));
    }
    e[5] = rel_l2(got[0][0], dinp);
    e[6] = rel_l2(got[0][1], dw);
    e[7] = rel_l2(got[0][2], db);
    const bool same = got[0][0] == got[1][0] && got[0][1] == got[1][1] && got[0][2] == got[1][2];
    const bool ok = e[0] <= 1e-2 && e[1] <= 1e-4 && e[2] <= 1e-2 && e[3] <= 1e-2 && e[4] <= 1e-4 && e[5] <= 1e-2 &&
                    e[6] <= 1e-5 && e[7] <= 1e-5 && same;  // dw, db: fp32 sums (reordered)
    printf("validate N=%d C=%d: fwd out %.1e stats %.1e | fused res %.1e out %.1e stats %.1e | bwd dinp %.1e dw %.1e "
           "db %.1e deterministic %s: %s\n",
           N, C, e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7], same ? "yes" : "NO", ok ? "ok" : "MISMATCH");
    for (void* p : {(void*)d_x, (void*)d_x2, (void*)d_w, (void*)d_b, (void*)d_dout, (void*)d_y, (void*)d_res,
                    (void*)d_mean, (void*)d_rstd})
        cudaCheck(cudaFree(p));
    return ok;
}

static void run_bench(int N, int C) {
    const size_t nc = (size_t)N * C;
    cuda_scratch_reserve(layernorm_scratch_bytes(N, C));
    floatX *inp = alloc_random(nc, 1, 1.0f), *inp2 = alloc_random(nc, 2, 1.0f), *res = alloc_random(nc, 3, 1.0f);
    floatX *out = alloc_random(nc, 4, 1.0f), *dout = alloc_random(nc, 5, 1.0f), *dinp = alloc_random(nc, 6, 1.0f);
    floatX *w = alloc_random(C, 7, 0.1f, 1.0f), *b = alloc_random(C, 8, 0.1f);
    float *dw = alloc_zeros_f32(C), *db = alloc_zeros_f32(C);
    float *mean, *rstd;
    cudaCheck(cudaMalloc(&mean, N * sizeof(float)));
    cudaCheck(cudaMalloc(&rstd, N * sizeof(float)));
    layernorm_forward(out, mean, rstd, inp, w, b, N, C);  // real statistics for the backward
    const double t = nc * sizeof(floatX), stats = 2.0 * N * sizeof(float), wb = 2.0 * C * sizeof(floatX);
    printf("N = %d rows, C = %d\n", N, C);
    float ms = bench::time_ms([&] { layernorm_forward(out, mean, rstd, inp, w, b, N, C); });
    bench::print_bandwidth("  layernorm_forward", ms, 2 * t + stats + wb);
    ms = bench::time_ms([&] { fused_residual_layernorm_forward(res, out, mean, rstd, inp, inp2, w, b, N, C); });
    bench::print_bandwidth("  fused_residual_layernorm_forward", ms, 4 * t + stats + wb);
    ms = bench::time_ms([&] { layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, N, C); });
    bench::print_bandwidth("  layernorm_backward", ms, 4 * t + stats + wb + 4 * wb);  // w; dw, db fp32 read + written
    for (void* p : {(void*)inp, (void*)inp2, (void*)res, (void*)out, (void*)dout, (void*)dinp, (void*)w, (void*)b,
                    (void*)dw, (void*)db, (void*)mean, (void*)rstd})
        cudaCheck(cudaFree(p));
}

int main() {
    bench::print_header("layernorm");
    bool ok = validate(300, 768);
    ok = validate(300, 769) && ok;
    ok = validate(1000, 2048) && ok;
    require_valid(ok);
    for (int C : {768, 1024, 2048}) run_bench(65536, C);
    return 0;
}
