// GELU benchmark (gelu_forward / gelu_backward of llmc/ops/mlp.cuh, GPT-2's tanh approximation).
//   1. validates both against the CPU twin (llmc/ops/cpu/mlp.h) on random bf16-rounded inputs (a length
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
#include "llmc/ops/cpu/mlp.h"
#include "llmc/ops/mlp.cuh"

using namespace bench;  // the validation helpers (host_random, to_device_floatX, ...): dev/cuda/common.cuh

static bool validate(long N) {
    Rng rng(5 + N);
    const std::vector<float> inp = host_random(N, rng, 2.0f, -0.1f), dout = host_random(N, rng);
    std::vector<float> out(N), dinp(N);
    cpu::gelu_forward<float>(out.data(), inp.data(), N);
    cpu::gelu_backward<float>(dinp.data(), dout.data(), inp.data(), N);
    floatX *d_inp = to_device_floatX(inp), *d_dout = to_device_floatX(dout), *d_out = to_device_floatX(out),
           *d_dinp = to_device_floatX(dinp);
    cudaCheck(cudaMemset(d_out, 0xFF, N * sizeof(floatX)));  // NaN: unwritten outputs fail
    cudaCheck(cudaMemset(d_dinp, 0xFF, N * sizeof(floatX)));
    gelu_forward(d_out, d_inp, N);
    gelu_backward(d_dinp, d_dout, d_inp, N);
    const double e_out = rel_l2(to_host_floatX(d_out, N), out), e_dinp = rel_l2(to_host_floatX(d_dinp, N), dinp);
    const bool ok = e_out <= 1e-2 && e_dinp <= 1e-2;
    printf("validate N=%ld: out %.2e, dinp %.2e (rel L2): %s\n", N, e_out, e_dinp, ok ? "ok" : "MISMATCH");
    for (floatX* p : {d_inp, d_dout, d_out, d_dinp}) cudaCheck(cudaFree(p));
    return ok;
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
    require_valid(ok);
    run_bench(65536L * 3072, "B*T = 65536, 4C = 3072");
    run_bench(65536L * 8192, "B*T = 65536, 4C = 8192");
    return 0;
}
