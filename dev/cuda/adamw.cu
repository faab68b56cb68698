// AdamW update benchmark (llmc/ops/adamw.cuh), GPT-2 small (124M) and XL (1.5B) parameter counts.
//   version 1: one element per thread (the scalar path adamw_update takes for misaligned slices):
//              2- and 4-byte accesses, each warp access a 64- or 128-byte transaction
//   version 2: 8 elements per thread, every access 16 bytes wide (the path for aligned buffers):
//              4-8x fewer load/store instructions in flight for the same bytes
// Both evaluate the same per-element code, so their outputs must agree bit for bit; both are
// checked against the CPU twin (llmc/ops/cpu/adamw.h) first.
// The grads are fp32 (the trainer's fp32 gradient accumulator). Bytes counted per element: with fp32
// master weights, read grad 4 + master 4 + m 4 + v 4 and write param 2 + master 4 + m 4 + v 4 = 30;
// without (bf16 params only): read grad 4 + param 2 + m 4 + v 4, write param 2 + m 4 + v 4 = 24.
//   nvcc -O3 -std=c++17 -arch=sm_90 --use_fast_math -I. dev/cuda/adamw.cu -lcublasLt -lcublas -o adamw
#include <cstring>
#include <vector>
#include "dev/cuda/common.cuh"
#include "llmc/ops/cpu/adamw.h"
#include "llmc/ops/adamw.cuh"

using namespace bench;  // the validation helpers (host_random, to_device_floatX, ...): dev/cuda/common.cuh

// The CPU twin is gaining a trailing seed argument (meaningless for fp32 params): call whichever
// signature llmc/ops/cpu/adamw.h has (the int overload exists only when the 14-argument call compiles).
template <typename T>
auto cpu_adamw_call(int, T* p, const float* g, float* m, float* v, size_t n, float lr, float b1, float b2, float eps,
                    float wd, float gs, int t) -> decltype(cpu::adamw_update(p, (float*)nullptr, g, m, v, n, lr, b1, b2,
                                                                             eps, wd, gs, t, (uint64_t)0), void()) {
    cpu::adamw_update(p, (float*)nullptr, g, m, v, n, lr, b1, b2, eps, wd, gs, t, (uint64_t)0);
}
template <typename T>
void cpu_adamw_call(long, T* p, const float* g, float* m, float* v, size_t n, float lr, float b1, float b2, float eps,
                    float wd, float gs, int t) {
    cpu::adamw_update(p, (float*)nullptr, g, m, v, n, lr, b1, b2, eps, wd, gs, t);
}

static float bf16_to_float(floatX x) { return floatX_to_float(x); }

// q is x rounded to one of its two bf16 neighbours (x itself if it is a bf16)
static bool is_bf16_neighbour(float q, float x) {
    uint32_t bx, bq;
    memcpy(&bx, &x, 4);
    memcpy(&bq, &q, 4);
    const uint32_t lo = bx & 0xffff0000u;
    if ((bx & 0xffffu) == 0) return bq == bx;
    return bq == lo || bq == lo + 0x10000u;
}

static int failures = 0;
#define EXPECT(cond, ...)                                  \
    do {                                                   \
        if (!(cond)) {                                     \
            printf("MISMATCH: " __VA_ARGS__);              \
            printf("\n");                                  \
            failures++;                                    \
        }                                                  \
    } while (0)

// deterministic pseudo-random device state for timing (no host round trip for 28 GB)
__global__ void fill_state(floatX* params, float* master, float* grads, float* m, float* v, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint32_t h1 = llmc_hash((uint32_t)i * 4 + 1), h2 = llmc_hash((uint32_t)i * 4 + 2);
        const float u1 = (h1 >> 8) * (1.0f / 16777216.0f) - 0.5f, u2 = (h2 >> 8) * (1.0f / 16777216.0f) - 0.5f;
        master[i] = 0.04f * u1;
        params[i] = float_to_floatX(master[i]);
        grads[i] = u2;
        m[i] = 0.1f * u2;
        v[i] = 0.01f * u2 * u2 + 1e-6f;
    }
}

struct Hyper {
    float lr = 1e-2f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, wd = 0.1f, grad_scale = 0.7f;
    int t = 7;
    uint64_t seed = 0x5eed;
};

// both versions, with and without master weights, vs the CPU twin on random data (fp32 grads that
// are not bf16 values: rounding them to bf16 (up to 2^-9 relative) would move m and v by ~1e-4
// relative, far outside the 1e-6 tolerance)
static void validate(size_t n) {
    Rng rng(17);
    std::vector<float> master(n), grads(n), m(n), v(n);
    for (size_t i = 0; i < n; i++) {
        master[i] = rng.normal(0.0f, 0.5f);
        grads[i] = rng.normal(0.0f, 1.0f);
        if (grads[i] == 0.0f) grads[i] = 1e-3f;  // never zero
        m[i] = rng.normal(0.0f, 0.1f);
        const float r = rng.normal(0.0f, 0.1f);
        v[i] = r * r + 1e-4f;
    }
    std::vector<floatX> params_bf16(n);
    for (size_t i = 0; i < n; i++) params_bf16[i] = float_to_floatX(master[i]);
    floatX* d_params = dev_alloc<floatX>(n);
    float* d_grads = to_device(grads);
    float *d_master = dev_alloc<float>(n), *d_m = dev_alloc<float>(n), *d_v = dev_alloc<float>(n);
    const Hyper h;
    const AdamwArgs a = adamw_make_args(h.lr, h.beta1, h.beta2, h.eps, h.wd, h.grad_scale, h.t, h.seed);
    for (bool with_master : {true, false}) {
        // the twin on fp32 params = the GPU's starting point
        std::vector<float> p(n), cm = m, cv = v;
        for (size_t i = 0; i < n; i++) p[i] = with_master ? master[i] : bf16_to_float(params_bf16[i]);
        cpu_adamw_call<float>(0, p.data(), grads.data(), cm.data(), cv.data(), n, h.lr, h.beta1, h.beta2, h.eps, h.wd,
                              h.grad_scale, h.t);
        std::vector<floatX> out_params[2];
        for (int version = 1; version <= 2; version++) {
            cudaCheck(cudaMemcpy(d_params, params_bf16.data(), n * sizeof(floatX), cudaMemcpyHostToDevice));
            cudaCheck(cudaMemcpy(d_master, master.data(), n * sizeof(float), cudaMemcpyHostToDevice));
            cudaCheck(cudaMemcpy(d_m, m.data(), n * sizeof(float), cudaMemcpyHostToDevice));
            cudaCheck(cudaMemcpy(d_v, v.data(), n * sizeof(float), cudaMemcpyHostToDevice));
            adamw_launch(version == 2, d_params, with_master ? d_master : nullptr, d_grads, d_m, d_v, n, a);
            cudaCheck(cudaDeviceSynchronize());
            std::vector<float> gm(n), gv(n), gmaster(n);
            std::vector<floatX>& gp = out_params[version - 1];
            gp.resize(n);
            cudaCheck(cudaMemcpy(gm.data(), d_m, n * sizeof(float), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(gv.data(), d_v, n * sizeof(float), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(gmaster.data(), d_master, n * sizeof(float), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(gp.data(), d_params, n * sizeof(floatX), cudaMemcpyDeviceToHost));
            const char* what = with_master ? "with master" : "bf16 only";
            // same expression, same order, IEEE intrinsics: equal up to host fma contraction
            EXPECT(rel_max(gm, cm) <= 1e-6, "v%d %s: m rel err %g", version, what, rel_max(gm, cm));
            EXPECT(rel_max(gv, cv) <= 1e-6, "v%d %s: v rel err %g", version, what, rel_max(gv, cv));
            if (with_master)
                EXPECT(rel_max(gmaster, p) <= 1e-6, "v%d: master rel err %g", version, rel_max(gmaster, p));
            size_t bad = 0, rounded_up = 0;
            for (size_t i = 0; i < n; i++) {
                const float q = bf16_to_float(gp[i]);
                bad += !is_bf16_neighbour(q, with_master ? gmaster[i] : p[i]);
                rounded_up += std::fabs(q) > std::fabs(p[i]);
            }
            EXPECT(bad == 0, "v%d %s: %zu params are not bf16 neighbours of the fp32 result", version, what, bad);
            // stochastic rounding goes away from zero with probability f, ~1/2 on average
            EXPECT(rounded_up > n / 3 && rounded_up < 2 * n / 3, "v%d %s: %zu of %zu rounded up", version, what,
                   rounded_up, n);
        }
        EXPECT(memcmp(out_params[0].data(), out_params[1].data(), n * sizeof(floatX)) == 0,
               "%s: versions 1 and 2 wrote different bf16 params", with_master ? "with master" : "bf16 only");
    }
    cudaCheck(cudaFree(d_params));
    cudaCheck(cudaFree(d_grads));
    cudaCheck(cudaFree(d_master));
    cudaCheck(cudaFree(d_m));
    cudaCheck(cudaFree(d_v));
}

int main() {
    bench::print_header("adamw_update");
    validate((1 << 20) + 5);  // ragged: not a multiple of 8
    if (failures) {
        printf("adamw: %d validation failures\n", failures);
        return 1;
    }
    printf("validation vs CPU twin: ok (n = 2^20 + 5, both versions, with and without master weights)\n");

    const size_t sizes[2] = {124475904, 1557611200};  // GPT-2 small and XL (padded vocab)
    const size_t n_max = sizes[1];
    floatX* params = dev_alloc<floatX>(n_max);
    float *grads = dev_alloc<float>(n_max), *master = dev_alloc<float>(n_max);
    float *m = dev_alloc<float>(n_max), *v = dev_alloc<float>(n_max);
    fill_state<<<132 * 16, 256, 0, llmc_stream()>>>(params, master, grads, m, v, n_max);
    cudaCheckLaunch();
    const Hyper h;
    const AdamwArgs a = adamw_make_args(1e-4f, h.beta1, h.beta2, h.eps, h.wd, 1.0f, 100, h.seed);
    for (size_t n : sizes) {
        const int repeats = n > 500000000 ? 10 : 50;
        for (bool with_master : {true, false})
            for (int version = 1; version <= 2; version++) {
                float ms = bench::time_ms(
                    [&] { adamw_launch(version == 2, params, with_master ? master : nullptr, grads, m, v, n, a); }, 3,
                    repeats);
                char what[128];
                snprintf(what, sizeof(what), "adamw v%d n=%.0fM %s", version, n / 1e6,
                         with_master ? "fp32 master" : "bf16 only");
                bench::print_bandwidth(what, ms, (double)n * (with_master ? 30 : 24));
            }
    }
    cudaCheck(cudaFree(params));
    cudaCheck(cudaFree(grads));
    cudaCheck(cudaFree(master));
    cudaCheck(cudaFree(m));
    cudaCheck(cudaFree(v));
    return 0;
}
