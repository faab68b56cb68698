// Matmul benchmark (llmc/ops/matmul.cuh: cuBLASLt, bf16 in/out, fp32 accumulation).
//   1. validates matmul_forward / matmul_backward against the CPU twin (llmc/ops/cpu/matmul.h) on
//      random bf16-rounded inputs, a GPT-like and two ragged shapes; exits 1 on a mismatch
//   2. measures the achievable bf16 matmul rate: a square 8192^3 GEMM in each of the three layouts
//      the linear layer uses (TN forward, NN dinp, NT dweight); the fastest is "the ceiling"
//      (~790 TFLOP/s on an H200, against 989 dense bf16 on paper)
//   3. times the linear layers of GPT-2 small (C = 768) and a C = 2048 model at B*T = 65536 tokens,
//      plus the tied lm head (768 -> 50304, no bias): forward with the bias epilogue, the dinp and the
//      dweight products of the backward each alone, the dbias column sum (memory-bound: bytes = dout
//      read once + dbias read and written once; the fp32 partials, < 1% of it, are not counted), and
//      the whole backward. TFLOP/s count 2 * BT * C * OC per product; "%" is of the measured ceiling.
// `matmul splitk` (a few seconds): only the split-K dweight of issue 35 (llmc/ops/matmul.cuh). It
//   validates the split path against the CPU twin at BT = MATMUL_SPLITK_MIN_BT + 37, measures the
//   ceiling, then times dweight += dout^T inp at GPT-2 124M's (d12) widths at B 32 x T 1024 and at
//   d30's (C 1920) at the same BT, unsplit (one GEMM) against chunks of 8192, 4096 and 2048 rows
//   (the GEMM of the partials plus the sum kernel), with each one's 128 x 128 output tiles x P and
//   the waves that makes on this GPU's SMs; then the sum kernel alone at the trainer's P (bandwidth).
//   The trainer's rule (op_scratch.h matmul_splitk_wanted: chunks of MATMUL_SPLITK_ROWS from
//   MATMUL_SPLITK_MIN_BT, where the weight has fewer tiles than half the SMs) is marked "<- trainer".
// Build: make dev/cuda/bin/matmul (or nvcc -O3 -std=c++17 -arch=sm_90 --use_fast_math -I.
//   dev/cuda/matmul.cu -lcublasLt -lcublas -o matmul); run: dev/cuda/bin/matmul [splitk]
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "dev/cuda/common.cuh"
#include "llmc/ops/cpu/matmul.h"
#include "llmc/ops/matmul.cuh"

using namespace bench;  // the validation helpers (host_random, to_device_floatX, ...): dev/cuda/common.cuh

// ------------------------------------------------------------------------------------------------
// validation

static bool validate(int BT, int C, int OC) {
    printf("validate BT=%d C=%d OC=%d\n", BT, C, OC);
    Rng rng(1234 + BT + C + OC);
    const float mean = 0.05f;  // not centred, except dout
    std::vector<float> inp = host_random((size_t)BT * C, rng, 1.0f, mean);
    std::vector<float> weight = host_random((size_t)OC * C, rng, 1.0f / std::sqrt((float)C), mean);
    std::vector<float> bias = host_random(OC, rng, 1.0f, mean);
    std::vector<float> dout = host_random((size_t)BT * OC, rng, 1.0f / std::sqrt((float)BT), 0.0f);  // zero mean: colsums ~ prefill
    std::vector<float> dweight = host_random((size_t)OC * C, rng, 1.0f, mean);  // prefill: += is checked
    std::vector<float> dbias = host_random(OC, rng, 1.0f, mean);
    floatX *d_inp = to_device_floatX(inp), *d_weight = to_device_floatX(weight), *d_bias = to_device_floatX(bias),
           *d_dout = to_device_floatX(dout);
    float *d_dweight = to_device(dweight), *d_dbias = to_device(dbias);  // fp32 gradients
    floatX *d_out, *d_dinp;
    cudaCheck(cudaMalloc(&d_out, (size_t)BT * OC * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_dinp, (size_t)BT * C * sizeof(floatX)));
    cudaCheck(cudaMemset(d_out, 0xFF, (size_t)BT * OC * sizeof(floatX)));  // NaN poison
    cudaCheck(cudaMemset(d_dinp, 0xFF, (size_t)BT * C * sizeof(floatX)));

    std::vector<float> out((size_t)BT * OC), dinp((size_t)BT * C);
    cpu::matmul_forward<float>(out.data(), inp.data(), weight.data(), bias.data(), BT, C, OC);
    cpu::matmul_backward<float>(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(), weight.data(), BT,
                                C, OC);
    cuda_scratch_reserve(matmul_backward_scratch_bytes(BT, C, OC));
    matmul_forward(d_out, d_inp, d_weight, d_bias, BT, C, OC);
    matmul_backward(d_dinp, d_dweight, d_dbias, d_dout, d_inp, d_weight, BT, C, OC);
    const double tol = 1e-2;      // bf16 output rounding: ~1e-3 relative L2, <= 2^-8 per element
    const double f32_tol = 1e-5;  // fp32 gradients: the same products, summed in another order
    bool ok = compare("out", to_host_floatX(d_out, out.size()), out, tol);
    ok &= compare("dinp", to_host_floatX(d_dinp, dinp.size()), dinp, tol);
    ok &= compare("dweight", to_host(d_dweight, dweight.size()), dweight, f32_tol);
    ok &= compare("dbias", to_host(d_dbias, dbias.size()), dbias, f32_tol);
    for (floatX* p : {d_inp, d_weight, d_bias, d_dout, d_out, d_dinp}) cudaCheck(cudaFree(p));
    for (float* p : {d_dweight, d_dbias}) cudaCheck(cudaFree(p));
    return ok;
}

// ------------------------------------------------------------------------------------------------
// timing

// the achievable bf16 GEMM rate: 8192^3 in the three layouts of the linear layer, best of them
static double measure_ceiling() {
    const int N = 8192;
    const size_t n = (size_t)N * N;
    floatX *a = alloc_random(n, 1, 1.0f), *b = alloc_random(n, 2, 1.0f / 90.0f), *d = alloc_random(n, 3, 1.0f);
    const double flops = 2.0 * N * N * N;
    struct Layout {
        const char* name;
        bool transa, transb;
    } layouts[] = {{"8192^3 TN (forward layout)", true, false},
                   {"8192^3 NN (dinp layout)", false, false},
                   {"8192^3 NT (dweight layout)", false, true}};
    double best = 0;
    for (const Layout& l : layouts) {
        float ms = bench::time_ms([&] { matmul_detail::gemm(l.name, d, a, b, nullptr, N, N, N, l.transa, l.transb, 0.0f, N, N, N); },
                                  10, 30);
        bench::print_flops(l.name, ms, flops, 0);
        best = std::max(best, flops / (ms * 1e-3));
    }
    for (floatX* p : {a, b, d}) cudaCheck(cudaFree(p));
    printf("measured bf16 matmul ceiling: %.1f TFLOP/s (the best of the three; H200 dense bf16 spec: 989)\n\n",
           best / 1e12);
    return best;
}

static void bench_shape(const char* name, int BT, int C, int OC, bool has_bias, double peak) {
    floatX* inp = alloc_random((size_t)BT * C, 10, 1.0f);
    floatX* weight = alloc_random((size_t)OC * C, 11, 1.0f / std::sqrt((float)C));
    floatX* bias = has_bias ? alloc_random(OC, 12, 1.0f) : nullptr;
    floatX* out = alloc_random((size_t)BT * OC, 13, 1.0f);
    floatX* dout = alloc_random((size_t)BT * OC, 14, 1.0f / std::sqrt((float)BT));
    floatX* dinp = alloc_random((size_t)BT * C, 15, 1.0f);
    float* dweight = alloc_zeros_f32((size_t)OC * C);
    float* dbias = has_bias ? alloc_zeros_f32(OC) : nullptr;
    cuda_scratch_reserve(matmul_backward_scratch_bytes(BT, C, OC));
    const double flops = 2.0 * BT * C * OC;
    char what[128];
    printf("%s: BT=%d C=%d OC=%d%s\n", name, BT, C, OC, has_bias ? "" : " (no bias)");

    float ms = bench::time_ms([&] { matmul_forward(out, inp, weight, bias, BT, C, OC); }, 3, 20);
    snprintf(what, sizeof(what), "  forward%s", has_bias ? " (+bias epilogue)" : "");
    bench::print_flops(what, ms, flops, peak);

    ms = bench::time_ms([&] { matmul_detail::gemm("dinp", dinp, weight, dout, nullptr, C, BT, OC, false, false, 0.0f, BT, C, OC); },
                        3, 20);
    bench::print_flops("  backward dinp = dout W", ms, flops, peak);

    ms = bench::time_ms([&] { matmul_detail::gemm("dweight", dweight, inp, dout, nullptr, C, OC, BT, false, true, 1.0f, BT, C, OC); },
                        3, 20);
    bench::print_flops("  backward dweight += dout^T inp (fp32 C = D)", ms, flops, peak);
    if (matmul_splitk_chunks(BT) > 1) {
        ms = bench::time_ms([&] { matmul_detail::dweight_grad(dweight, dout, inp, BT, C, OC, MATMUL_SPLITK_ROWS); }, 3, 20);
        snprintf(what, sizeof(what), "  backward dweight, split-K P=%d (the trainer's)", matmul_splitk_chunks(BT));
        bench::print_flops(what, ms, flops, peak);
    }

    if (has_bias) {
        ms = bench::time_ms([&] { matmul_detail::bias_grad(dbias, dout, BT, OC); }, 3, 20);
        bench::print_bandwidth("  backward dbias += colsum(dout)", ms, (double)BT * OC * sizeof(floatX) + 2.0 * OC * sizeof(float));
    }

    ms = bench::time_ms([&] { matmul_backward(dinp, dweight, dbias, dout, inp, weight, BT, C, OC); }, 3, 20);
    bench::print_flops("  backward, all of it", ms, 2 * flops, peak);

    for (floatX* p : {inp, weight, bias, out, dout, dinp})
        if (p) cudaCheck(cudaFree(p));
    for (float* p : {dweight, dbias})
        if (p) cudaCheck(cudaFree(p));
}

// ------------------------------------------------------------------------------------------------
// split-K dweight (issue 35)

// matmul_backward's dweight at a BT where the trainer splits, against the CPU twin (fp32: 1e-5)
static bool validate_splitk(int BT, int C, int OC) {
    printf("validate split-K dweight BT=%d (P=%d) C=%d OC=%d\n", BT, matmul_splitk_chunks(BT), C, OC);
    Rng rng(4321 + BT + C + OC);
    std::vector<float> inp = host_random((size_t)BT * C, rng, 1.0f, 0.05f);
    std::vector<float> dout = host_random((size_t)BT * OC, rng, 1.0f / std::sqrt((float)BT), 0.0f);
    std::vector<float> dweight = host_random((size_t)OC * C, rng, 1.0f, 0.05f);  // prefill: += is checked
    floatX *d_inp = to_device_floatX(inp), *d_dout = to_device_floatX(dout);
    float* d_dweight = to_device(dweight);
    cpu::matmul_backward<float>((float*)nullptr, dweight.data(), (float*)nullptr, dout.data(), inp.data(),
                                (const float*)nullptr, BT, C, OC);
    cuda_scratch_reserve(matmul_backward_scratch_bytes(BT, C, OC));
    cudaCheck(cudaMemset(cuda_scratch_arena().base, 0xFF, cuda_scratch_arena().bytes));  // NaN partials
    matmul_backward(nullptr, d_dweight, nullptr, d_dout, d_inp, nullptr, BT, C, OC, /*split_k*/ true);
    const bool ok = compare("dweight (split-K)", to_host(d_dweight, dweight.size()), dweight, 1e-5);
    for (floatX* p : {d_inp, d_dout}) cudaCheck(cudaFree(p));
    cudaCheck(cudaFree(d_dweight));
    return ok;
}

// dweight[OC, C] += dout^T inp over BT rows: one GEMM vs chunks of 8192 / 4096 / 2048 rows
static void bench_splitk_shape(const char* name, int BT, int C, int OC, double peak, int sms) {
    floatX* inp = alloc_random((size_t)BT * C, 20, 1.0f);
    floatX* dout = alloc_random((size_t)BT * OC, 21, 1.0f / std::sqrt((float)BT));
    float* dweight = alloc_zeros_f32((size_t)OC * C);
    const double flops = 2.0 * BT * C * OC;
    const long tiles = (long)ceil_div(C, 128) * ceil_div(OC, 128);
    // the trainer's choice for a whole (unsplit by --tp) weight of this shape on this GPU
    const int trainer_rows = matmul_splitk_wanted(BT, C, OC, sms) ? MATMUL_SPLITK_ROWS : 0;
    printf("%s: BT=%d C=%d OC=%d (dweight %.1f MB fp32)\n", name, BT, C, OC, 4.0 * C * OC / 1e6);
    for (int rows : {0, 8192, 4096, 2048}) {
        const int P = rows > 0 ? ceil_div(BT, rows) : 1;
        if (rows > 0 && P < 2) continue;
        cuda_scratch_reserve((size_t)P * C * OC * sizeof(float));
        const float ms = bench::time_ms([&] { matmul_detail::dweight_grad(dweight, dout, inp, BT, C, OC, rows); }, 3, 20);
        char what[160];
        snprintf(what, sizeof(what), "  %-18s P=%-3d %5ld tiles %5.2f waves", rows > 0 ? strfmt("chunks of %d", rows).c_str()
                 : "unsplit (1 GEMM)", P, tiles * P, (double)(tiles * P) / sms);
        const double f = flops / (ms * 1e-3);
        printf("%-56s %8.3f ms %7.1f TFLOP/s %5.1f%% of ceiling%s\n", what, ms, f / 1e12, 100.0 * f / peak,
               rows == trainer_rows ? "  <- trainer" : "");
    }
    if (trainer_rows > 0) {  // the sum kernel alone: P partials read, dweight read and written
        const int P = matmul_splitk_chunks(BT);
        float* partials = cuda_scratch<float>((size_t)P * C * OC, "bench");
        const float ms = bench::time_ms([&] { matmul_dweight_reduce(dweight, partials, P, (size_t)C * OC); }, 3, 20);
        char what[96];
        snprintf(what, sizeof(what), "  of which the sum of P=%d partials", P);
        bench::print_bandwidth(what, ms, (P + 2.0) * C * OC * sizeof(float));
    }
    for (floatX* p : {inp, dout}) cudaCheck(cudaFree(p));
    cudaCheck(cudaFree(dweight));
}

static int run_splitk() {
    bench::print_header("split-K fp32 dweight (issue 35)");
    matmul_setup();
    require_valid(validate_splitk(MATMUL_SPLITK_MIN_BT + 37, 128, 96));
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    printf("trainer's rule: chunks of %d rows from BT >= %d where the whole weight has fewer 128 x 128 tiles than "
           "half the %d SMs\n\n", MATMUL_SPLITK_ROWS, MATMUL_SPLITK_MIN_BT, prop.multiProcessorCount);
    const double peak = measure_ceiling();
    const int BT = 32 * 1024;  // B 32 x T 1024
    struct Shape {
        const char* name;
        int C, OC;
    } shapes[] = {
        {"d12 qkv", 768, 2304},          {"d12 attn proj", 768, 768},       {"d12 fc (gelu)", 768, 3072},
        {"d12 fc proj (gelu)", 3072, 768}, {"d12 fc (swiglu)", 768, 4096},   {"d12 fc proj (swiglu)", 2048, 768},
        {"d30 qkv", 1920, 5760},         {"d30 attn proj", 1920, 1920},     {"d30 fc (swiglu)", 1920, 10240},
        {"d30 fc proj (swiglu)", 5120, 1920},
    };
    for (const Shape& s : shapes) bench_splitk_shape(s.name, BT, s.C, s.OC, peak, prop.multiProcessorCount);
    matmul_teardown();
    return 0;
}

int main(int argc, char** argv) {
    try {
        if (argc > 1 && std::strcmp(argv[1], "splitk") == 0) return run_splitk();
        LLMC_CHECK(argc == 1, "usage: %s [splitk]", argv[0]);
        bench::print_header("matmul (cuBLASLt, bf16 in/out, fp32 accumulate)");
        matmul_setup();
        bool ok = validate(256, 768, 2304);
        ok &= validate(100, 37, 19);
        ok &= validate(257, 129, 1);
        require_valid(ok);
        printf("\n");
        const double peak = measure_ceiling();
        const int BT = 65536;
        struct Shape {
            const char* name;
            int C, OC;
            bool bias;
        } shapes[] = {
            {"C=768 qkv", 768, 3 * 768, true},          {"C=768 attn proj", 768, 768, true},
            {"C=768 fc", 768, 4 * 768, true},           {"C=768 fc proj", 4 * 768, 768, true},
            {"C=768 lm head (tied)", 768, 50304, false}, {"C=2048 qkv", 2048, 3 * 2048, true},
            {"C=2048 attn proj", 2048, 2048, true},     {"C=2048 fc", 2048, 4 * 2048, true},
            {"C=2048 fc proj", 4 * 2048, 2048, true},
        };
        for (const Shape& s : shapes) bench_shape(s.name, BT, s.C, s.OC, s.bias, peak);
        matmul_teardown();
    } catch (const LlmcError& e) {
        fprintf(stderr, "%s\n", e.what());
        return 1;
    }
    return 0;
}
