// The LayerNorm ladder: out = (x - mean) rstd w + b over each row of C channels (eps 1e-5, the
// biased variance), bf16 in and out, mean and rstd saved in fp32 for the backward. Three kernels,
// simplest first, each validated against the CPU reference (llmc/ops/cpu/layernorm.h) and timed in the
// same program. LayerNorm is memory-bound: the figure of merit is GB/s against the copy bandwidth.
//   kernel 1  naive: one thread per row, three passes over the row (mean, variance, output). Adjacent
//             threads walk rows C elements apart, so no load is coalesced, and one thread per row
//             leaves most of the GPU idle for small N.
//   kernel 2  one warp per row: the 32 lanes stride the row together (coalesced loads), the mean and
//             the variance are warp-shuffle reductions; still three passes over global memory (the
//             second and third mostly from L1/L2).
//   kernel 3  production: llmc/ops/layernorm.cuh (what the trainer runs: the row read once into
//             registers with 16-byte vector loads, the statistics from them).
// GPU-unverified: written and compiled without a GPU (CI has none); the first run on a device is
// its check (validation exits 1 on a mismatch before anything is timed).
// Build: make dev/cuda/bin/ladder_layernorm
#include <cmath>
#include <cstdlib>
#include <vector>
#include "dev/cuda/common.cuh"
#include "llmc/ops/cpu/layernorm.h"
#include "llmc/ops/layernorm.cuh"

using namespace bench;

__global__ void layernorm_naive(floatX* out, float* mean, float* rstd, const floatX* inp, const floatX* w,
                                const floatX* b, int N, int C) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const floatX* x = inp + (size_t)n * C;
    float m = 0.0f, v = 0.0f;
    for (int c = 0; c < C; c++) m += floatX_to_float(x[c]);
    m /= C;
    for (int c = 0; c < C; c++) {
        const float d = floatX_to_float(x[c]) - m;
        v += d * d;
    }
    const float s = rsqrtf(v / C + 1e-5f);
    for (int c = 0; c < C; c++)
        out[(size_t)n * C + c] =
            float_to_floatX((floatX_to_float(x[c]) - m) * s * floatX_to_float(w[c]) + floatX_to_float(b[c]));
    mean[n] = m;
    rstd[n] = s;
}

__device__ float warp_sum(float v) {
    for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}
__global__ void layernorm_warp(floatX* out, float* mean, float* rstd, const floatX* inp, const floatX* w, const floatX* b,
                               int N, int C) {
    const int n = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (n >= N) return;  // a whole warp leaves together: the shuffles below see all 32 lanes
    const floatX* x = inp + (size_t)n * C;
    float m = 0.0f, v = 0.0f;
    for (int c = lane; c < C; c += 32) m += floatX_to_float(x[c]);
    m = warp_sum(m) / C;
    for (int c = lane; c < C; c += 32) {
        const float d = floatX_to_float(x[c]) - m;
        v += d * d;
    }
    const float s = rsqrtf(warp_sum(v) / C + 1e-5f);
    for (int c = lane; c < C; c += 32)
        out[(size_t)n * C + c] =
            float_to_floatX((floatX_to_float(x[c]) - m) * s * floatX_to_float(w[c]) + floatX_to_float(b[c]));
    if (lane == 0) {
        mean[n] = m;
        rstd[n] = s;
    }
}

static void run_kernel(int k, floatX* out, float* mean, float* rstd, const floatX* x, const floatX* w, const floatX* b,
                       int N, int C) {
    if (k == 3) {
        layernorm_forward(out, mean, rstd, x, w, b, N, C);
        return;
    }
    if (k == 1) layernorm_naive<<<ceil_div(N, 128), 128>>>(out, mean, rstd, x, w, b, N, C);
    else layernorm_warp<<<ceil_div(N, 8), 256>>>(out, mean, rstd, x, w, b, N, C);  // 8 rows (warps) per block
    cudaCheck(cudaGetLastError());
}

static const char* names[] = {"", "kernel 1 naive (thread per row)", "kernel 2 warp per row", "kernel 3 production"};

static bool validate(int N, int C) {
    Rng rng(11 + N + C);
    const size_t nc = (size_t)N * C;
    const std::vector<float> x = host_random(nc, rng, 1.0f, 2.0f), w = host_random(C, rng, 0.3f, 1.0f), b = host_random(C, rng, 0.3f);
    std::vector<float> y(nc), mean(N), rstd(N);
    cpu::layernorm_forward<float>(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    floatX *d_x = to_device_floatX(x), *d_w = to_device_floatX(w), *d_b = to_device_floatX(b), *d_y = dev_alloc<floatX>(nc);
    float *d_mean = dev_alloc<float>(N), *d_rstd = dev_alloc<float>(N);
    bool ok = true;
    for (int k = 1; k <= 3; k++) {
        printf("validate %s N=%d C=%d\n", names[k], N, C);
        cudaCheck(cudaMemset(d_y, 0xFF, nc * sizeof(floatX)));  // NaN: an unwritten output fails
        cudaCheck(cudaMemset(d_mean, 0xFF, N * sizeof(float)));
        cudaCheck(cudaMemset(d_rstd, 0xFF, N * sizeof(float)));
        run_kernel(k, d_y, d_mean, d_rstd, d_x, d_w, d_b, N, C);
        ok = compare("out", to_host_floatX(d_y, nc), y, 1e-2) && ok;
        ok = compare("mean", to_host(d_mean, N), mean, 1e-3) && ok;
        ok = compare("rstd", to_host(d_rstd, N), rstd, 1e-3) && ok;
    }
    for (void* p : {(void*)d_x, (void*)d_w, (void*)d_b, (void*)d_y, (void*)d_mean, (void*)d_rstd}) cudaCheck(cudaFree(p));
    return ok;
}

int main() {
    print_header("ladder_layernorm");
    cuda_scratch_reserve(layernorm_scratch_bytes(65536, 1024));
    bool ok = validate(333, 768);
    ok = validate(64, 769) && ok;  // a ragged row: no vector load covers its end
    require_valid(ok);
    const int N = 65536, C = 768;
    printf("N %d rows, C %d: bytes = x read + out written (bf16) + mean, rstd written\n", N, C);
    floatX *x = alloc_random((size_t)N * C, 1, 1.0f), *w = alloc_random(C, 2, 0.3f, 1.0f), *b = alloc_random(C, 3, 0.3f);
    floatX* y = dev_alloc<floatX>((size_t)N * C);
    float *mean = dev_alloc<float>(N), *rstd = dev_alloc<float>(N);
    const double bytes = 2.0 * N * C * sizeof(floatX) + 2.0 * N * sizeof(float);
    for (int k = 1; k <= 3; k++)
        print_bandwidth(names[k], time_ms([&] { run_kernel(k, y, mean, rstd, x, w, b, N, C); }, 2, 20), bytes);
    for (void* p : {(void*)x, (void*)w, (void*)b, (void*)y, (void*)mean, (void*)rstd}) cudaCheck(cudaFree(p));
    return 0;
}
