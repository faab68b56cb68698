// SwiGLU benchmark (swiglu_forward / swiglu_backward of llmc/ops/mlp.cuh).
//   1. validates both against the CPU twin (llmc/ops/cpu/mlp.h) on random bf16-rounded inputs (H = 2048,
//      the 16-byte path, and a ragged H = 11, the scalar path); exits 1 on a mismatch
//   2. times N = B*T = 65536 rows at H = 2048 (the SwiGLU width of a C = 768 model: 8/3 C rounded up)
//      and H = 5472 (C = 2048).
// Bytes counted (bf16): forward  inp [N, 2H] read + out [N, H] written = 6 N H bytes
//                       backward inp [N, 2H] + dout [N, H] read, dinp [N, 2H] written = 10 N H bytes
// Build: nvcc -O3 -std=c++17 -arch=sm_90 --use_fast_math -I. dev/cuda/swiglu.cu -lcublasLt -lcublas -o swiglu
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>
#include "dev/cuda/common.cuh"
#include "llmc/ops/cpu/mlp.h"
#include "llmc/ops/mlp.cuh"

using namespace bench;  // the validation helpers (host_random, to_device_floatX, ...): dev/cuda/common.cuh

static bool validate(int N, int H) {
    Rng rng(7 + H);
    const size_t nh = (size_t)N * H;
    const std::vector<float> inp = host_random(2 * nh, rng, 2.5f, 0.2f), dout = host_random(nh, rng);
    std::vector<float> out(nh), dinp(2 * nh);
    cpu::swiglu_forward<float>(out.data(), inp.data(), N, H);
    cpu::swiglu_backward<float>(dinp.data(), dout.data(), inp.data(), N, H);
    floatX *d_inp = to_device_floatX(inp), *d_dout = to_device_floatX(dout), *d_out = to_device_floatX(out),
           *d_dinp = to_device_floatX(dinp);
    cudaCheck(cudaMemset(d_out, 0xFF, nh * sizeof(floatX)));  // NaN: unwritten outputs fail
    cudaCheck(cudaMemset(d_dinp, 0xFF, 2 * nh * sizeof(floatX)));
    swiglu_forward(d_out, d_inp, N, H);
    swiglu_backward(d_dinp, d_dout, d_inp, N, H);
    const double e_out = rel_l2(to_host_floatX(d_out, nh), out), e_dinp = rel_l2(to_host_floatX(d_dinp, 2 * nh), dinp);
    const bool ok = e_out <= 1e-2 && e_dinp <= 1e-2;
    printf("validate N=%d H=%d: out %.2e, dinp %.2e (rel L2): %s\n", N, H, e_out, e_dinp, ok ? "ok" : "MISMATCH");
    for (floatX* p : {d_inp, d_dout, d_out, d_dinp}) cudaCheck(cudaFree(p));
    return ok;
}

static void run_bench(int N, int H) {
    const size_t nh = (size_t)N * H;
    floatX *inp = alloc_random(2 * nh, 1, 3.0f), *out = alloc_random(nh, 2, 1.0f), *dout = alloc_random(nh, 3, 1.0f),
           *dinp = alloc_random(2 * nh, 4, 1.0f);
    printf("N = %d rows, H = %d\n", N, H);
    float ms = bench::time_ms([&] { swiglu_forward(out, inp, N, H); });
    bench::print_bandwidth("  swiglu_forward", ms, 6.0 * nh);
    ms = bench::time_ms([&] { swiglu_backward(dinp, dout, inp, N, H); });
    bench::print_bandwidth("  swiglu_backward", ms, 10.0 * nh);
    for (floatX* p : {inp, out, dout, dinp}) cudaCheck(cudaFree(p));
}

int main() {
    bench::print_header("swiglu");
    bool ok = validate(64, 2048);
    ok = validate(300, 11) && ok;
    require_valid(ok);
    for (int H : {2048, 5472}) run_bench(65536, H);
    return 0;
}
