// Mixture-of-experts benchmark (llmc/ops/moe.cuh + the batched matmuls of llmc/ops/matmul.cuh).
//   1. validates every op against its CPU twin (llmc/ops/cpu/moe.h, llmc/ops/cpu/matmul.h) on random inputs:
//      the routing must be identical (integers), the float ops within bf16 tolerance; exits 1 on a
//      mismatch
//   2. routing at n = B*T = 65536 tokens (B = 64, T = 1024), C = 1024, c = 2, E = 8, 16, 32, 64:
//      moe_router_forward (bytes = x + Wr read once + scores written once), moe_select for both
//      groupings (time only: a handful of small kernels), moe_router_backward (bytes = dx read and
//      written, x, Wr, scores, dscores read, drouter_w read and written; the fp32 scratch is not counted)
//   3. the MoE FFN against a dense SwiGLU FFN with the same active FLOPs at n = 65536, C = 1024,
//      expert hidden He = 2816, c = 2 (group = micro-batch), E = 8, 16, 64:
//        MoE    gather -> fc [E, cap, C] x [E, 2He, C]^T (batched) -> SwiGLU -> proj [E, cap, He] x
//               [E, C, He]^T (batched) -> combine; backward: combine, proj, SwiGLU, fc backward, gather
//        dense  the same SwiGLU FFN on all n tokens with hidden H = c * He = 5632
//      Matching: every expert takes cap = n c / E tokens (an integer here), so the experts process
//      E * cap = c * n token rows of width He: 6 * (c n) * C * He FLOPs forward, exactly the dense
//      FFN's 6 * n * C * (c He). "ratio" = MoE throughput / dense throughput (target >= 80%), for the
//      FFN alone and with the routing (router forward + select + router backward) added to the MoE.
//      The memory-bound pieces (gather, combine, their backwards) are also printed with their GB/s.
// Build: nvcc -O3 -std=c++17 -arch=sm_90 --use_fast_math -I. dev/cuda/moe.cu -lcublasLt -lcublas -o moe
#include <cmath>
#include <cstdlib>
#include <vector>
#include "dev/cuda/common.cuh"
#include "llmc/ops/cpu/matmul.h"
#include "llmc/ops/cpu/moe.h"
#include "llmc/ops/matmul.cuh"
#include "llmc/ops/mlp.cuh"
#include "llmc/ops/moe.cuh"

using namespace bench;  // the validation helpers (host_random, to_device_floatX, ...): dev/cuda/common.cuh

// ------------------------------------------------------------------------------------------------
// validation

static bool same_ints(const char* what, const std::vector<int>& got, const std::vector<int>& want) {
    size_t bad = 0;
    for (size_t i = 0; i < got.size(); i++) bad += got[i] != want[i];
    printf("  %-14s %zu of %zu differ  %s\n", what, bad, got.size(), bad ? "MISMATCH" : "ok");
    return bad == 0;
}

// one MoE layer's ops on a small shape, every output against the CPU twin
static bool validate_ops(int B, int T, int C, int E, float c, bool by_position) {
    const int n = B * T, cap = cpu::moe_capacity(B, T, E, c, by_position);
    const size_t rows = (size_t)E * cap;
    printf("validate B=%d T=%d C=%d E=%d c=%.1f group=%s (cap %d)\n", B, T, C, E, c, by_position ? "position" : "batch",
           cap);
    Rng rng(4242 + n + C + E);
    const std::vector<float> x = host_random((size_t)n * C, rng, 1.0f, 0.1f);
    const std::vector<float> w = host_random((size_t)E * C, rng, 2.0f / std::sqrt((float)C));
    const std::vector<float> ye = host_random(rows * C, rng, 1.0f);
    const std::vector<float> dout = host_random((size_t)n * C, rng, 1.0f);
    const std::vector<float> dx0 = host_random((size_t)n * C, rng, 1.0f / std::sqrt((float)E));
    const std::vector<float> dw0 = host_random((size_t)E * C, rng, std::sqrt((float)n) / E);

    // CPU: router, selection, combine, combine backward, router backward, gather, gather backward
    std::vector<float> scores((size_t)n * E), out((size_t)n * C), dye(rows * C), dscores((size_t)n * E);
    std::vector<float> xe(rows * C), dx = dx0, dw = dw0;
    std::vector<int> tokens(rows), slots((size_t)n * E);
    cpu::moe_router_forward<float, float>(scores.data(), x.data(), w.data(), n, C, E);
    // the GPU's scores may differ in the last bits; select on the GPU's own scores on both sides
    float* d_scores = dev_alloc<float>((size_t)n * E);
    floatX *d_x = to_device_floatX(x), *d_w = to_device_floatX(w);
    cudaCheck(cudaMemset(d_scores, 0xFF, (size_t)n * E * sizeof(float)));
    moe_router_forward(d_scores, d_x, d_w, n, C, E);
    bool ok = compare("scores", to_host(d_scores, (size_t)n * E), scores, 1e-5);
    scores = to_host(d_scores, (size_t)n * E);
    cpu::moe_select<float>(tokens.data(), slots.data(), scores.data(), B, T, E, c, by_position);
    cpu::moe_gather<float>(xe.data(), x.data(), tokens.data(), E, cap, C);
    cpu::moe_combine_forward<float, float>(out.data(), ye.data(), scores.data(), slots.data(), n, E, cap, C);
    cpu::moe_combine_backward<float, float>(dye.data(), dscores.data(), dout.data(), ye.data(), scores.data(),
                                            tokens.data(), slots.data(), n, E, cap, C);
    cpu::moe_gather_backward<float>(dx.data(), dye.data(), slots.data(), n, E, cap, C);  // dye stands in for dxe
    cpu::moe_router_backward<float, float>(dx.data(), dw.data(), dscores.data(), scores.data(), x.data(), w.data(), n,
                                           C, E);

    int *d_tokens = dev_alloc<int>(rows), *d_slots = dev_alloc<int>((size_t)n * E);
    floatX *d_xe = dev_alloc<floatX>(rows * C), *d_ye = to_device_floatX(ye), *d_out = dev_alloc<floatX>((size_t)n * C);
    floatX *d_dout = to_device_floatX(dout), *d_dye = dev_alloc<floatX>(rows * C), *d_dx = to_device_floatX(dx0);
    float* d_dw = to_device(dw0);  // the fp32 router gradient
    float* d_dscores = dev_alloc<float>((size_t)n * E);
    cudaCheck(cudaMemset(d_tokens, 0xFF, rows * sizeof(int)));
    cudaCheck(cudaMemset(d_slots, 0xFF, (size_t)n * E * sizeof(int)));
    cudaCheck(cudaMemset(d_xe, 0xFF, rows * C * sizeof(floatX)));
    cudaCheck(cudaMemset(d_out, 0xFF, (size_t)n * C * sizeof(floatX)));
    cudaCheck(cudaMemset(d_dye, 0xFF, rows * C * sizeof(floatX)));
    cudaCheck(cudaMemset(d_dscores, 0xFF, (size_t)n * E * sizeof(float)));
    cuda_scratch_reserve(moe_scratch_bytes(B, T, C, E));
    moe_select(d_tokens, d_slots, d_scores, B, T, E, c, by_position);
    ok &= same_ints("expert_tokens", to_host(d_tokens, rows), tokens);
    ok &= same_ints("token_slots", to_host(d_slots, (size_t)n * E), slots);
    // the remaining ops on the CPU's routing (identical if the checks above passed)
    cudaCheck(cudaMemcpy(d_tokens, tokens.data(), rows * sizeof(int), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d_slots, slots.data(), (size_t)n * E * sizeof(int), cudaMemcpyHostToDevice));
    moe_gather(d_xe, d_x, d_tokens, E, cap, C);
    moe_combine_forward(d_out, d_ye, d_scores, d_slots, n, E, cap, C);
    moe_combine_backward(d_dye, d_dscores, d_dout, d_ye, d_scores, d_tokens, d_slots, n, E, cap, C);
    moe_gather_backward(d_dx, d_dye, d_slots, n, E, cap, C);
    moe_router_backward(d_dx, d_dw, d_dscores, d_scores, d_x, d_w, n, C, E);
    ok &= compare("xe", to_host_floatX(d_xe, rows * C), xe, 0.0);
    ok &= compare("out", to_host_floatX(d_out, (size_t)n * C), out, 1e-2);
    ok &= compare("dye", to_host_floatX(d_dye, rows * C), dye, 1e-2);
    ok &= compare("dscores", to_host(d_dscores, (size_t)n * E), dscores, 1e-4);
    ok &= compare("dx", to_host_floatX(d_dx, (size_t)n * C), dx, 1e-2);
    ok &= compare("drouter_w", to_host(d_dw, (size_t)E * C), dw, 1e-5);  // fp32 sums, reordered
    for (void* p : {(void*)d_scores, (void*)d_x, (void*)d_w, (void*)d_tokens, (void*)d_slots, (void*)d_xe, (void*)d_ye,
                    (void*)d_out, (void*)d_dout, (void*)d_dye, (void*)d_dx, (void*)d_dw, (void*)d_dscores})
        cudaCheck(cudaFree(p));
    return ok;
}

// routing alone at a large n: identical to the CPU selection
static bool validate_select(int B, int T, int E, float c, bool by_position) {
    const int n = B * T, cap = cpu::moe_capacity(B, T, E, c, by_position);
    printf("validate moe_select B=%d T=%d E=%d c=%.1f group=%s\n", B, T, E, c, by_position ? "position" : "batch");
    Rng rng(99 + n + E);
    std::vector<float> scores((size_t)n * E);
    for (int i = 0; i < n; i++) {  // softmax of N(0, 2^2) logits, then some bitwise ties
        float* r = scores.data() + (size_t)i * E;
        float mx = -INFINITY, sum = 0;
        for (int e = 0; e < E; e++) mx = std::max(mx, r[e] = rng.normal(0.0f, 2.0f));
        for (int e = 0; e < E; e++) sum += (r[e] = std::exp(r[e] - mx));
        for (int e = 0; e < E; e++) r[e] /= sum;
    }
    for (int k = 0; k < n / 8; k++) scores[rng.below((uint64_t)n * E)] = 0.125f;
    std::vector<int> tokens((size_t)E * cap), slots((size_t)n * E);
    cpu::moe_select<float>(tokens.data(), slots.data(), scores.data(), B, T, E, c, by_position);
    float* d_scores = to_device(scores);
    int *d_tokens = dev_alloc<int>(tokens.size()), *d_slots = dev_alloc<int>(slots.size());
    cudaCheck(cudaMemset(d_tokens, 0xFF, tokens.size() * sizeof(int)));
    cudaCheck(cudaMemset(d_slots, 0xFF, slots.size() * sizeof(int)));
    cuda_scratch_reserve(moe_scratch_bytes(B, T, 1, E));
    moe_select(d_tokens, d_slots, d_scores, B, T, E, c, by_position);
    bool ok = same_ints("expert_tokens", to_host(d_tokens, tokens.size()), tokens);
    ok &= same_ints("token_slots", to_host(d_slots, slots.size()), slots);
    for (void* p : {(void*)d_scores, (void*)d_tokens, (void*)d_slots}) cudaCheck(cudaFree(p));
    return ok;
}

static bool validate_batched(int n_batch, int BT, int C, int OC) {
    printf("validate matmul batched n_batch=%d BT=%d C=%d OC=%d\n", n_batch, BT, C, OC);
    Rng rng(77 + BT + C + OC);
    const size_t nb = n_batch;
    const std::vector<float> inp = host_random(nb * BT * C, rng, 1.0f, 0.1f);
    const std::vector<float> weight = host_random(nb * OC * C, rng, 1.0f / std::sqrt((float)C));
    const std::vector<float> bias = host_random(nb * OC, rng, 1.0f);
    const std::vector<float> dout = host_random(nb * BT * OC, rng, 1.0f / std::sqrt((float)BT));
    std::vector<float> dweight = host_random(nb * OC * C, rng, 1.0f), dbias = host_random(nb * OC, rng, 1.0f);
    floatX *d_inp = to_device_floatX(inp), *d_w = to_device_floatX(weight), *d_b = to_device_floatX(bias),
           *d_dout = to_device_floatX(dout);
    float *d_dw = to_device(dweight), *d_db = to_device(dbias);  // fp32 gradients
    floatX *d_out = dev_alloc<floatX>(nb * BT * OC), *d_dinp = dev_alloc<floatX>(nb * BT * C);
    cudaCheck(cudaMemset(d_out, 0xFF, nb * BT * OC * sizeof(floatX)));
    cudaCheck(cudaMemset(d_dinp, 0xFF, nb * BT * C * sizeof(floatX)));
    std::vector<float> out(nb * BT * OC), dinp(nb * BT * C);
    cpu::matmul_forward_batched<float>(out.data(), inp.data(), weight.data(), bias.data(), n_batch, BT, C, OC);
    cpu::matmul_backward_batched<float>(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                                        weight.data(), n_batch, BT, C, OC);
    cuda_scratch_reserve(matmul_batched_scratch_bytes(n_batch, BT, OC));
    matmul_forward_batched(d_out, d_inp, d_w, d_b, n_batch, BT, C, OC);
    matmul_backward_batched(d_dinp, d_dw, d_db, d_dout, d_inp, d_w, n_batch, BT, C, OC);
    bool ok = compare("out", to_host_floatX(d_out, out.size()), out, 1e-2);
    ok &= compare("dinp", to_host_floatX(d_dinp, dinp.size()), dinp, 1e-2);
    ok &= compare("dweight", to_host(d_dw, dweight.size()), dweight, 1e-5);  // fp32 sums, reordered
    ok &= compare("dbias", to_host(d_db, dbias.size()), dbias, 1e-5);
    for (floatX* p : {d_inp, d_w, d_b, d_dout, d_out, d_dinp}) cudaCheck(cudaFree(p));
    for (float* p : {d_dw, d_db}) cudaCheck(cudaFree(p));
    return ok;
}

// ------------------------------------------------------------------------------------------------
// timing

static void bench_routing(int B, int T, int C, int E, float c) {
    const int n = B * T;
    floatX* x = alloc_random((size_t)n * C, 1, 1.0f);
    floatX* w = alloc_random((size_t)E * C, 2, 2.0f / std::sqrt((float)C));
    floatX* dx = alloc_random((size_t)n * C, 3, 1.0f);
    float* dw = alloc_zeros_f32((size_t)E * C);
    float *scores = dev_alloc<float>((size_t)n * E), *dscores = dev_alloc<float>((size_t)n * E);
    const int cap_b = cpu::moe_capacity(B, T, E, c, false), cap_p = cpu::moe_capacity(B, T, E, c, true);
    int *tokens = dev_alloc<int>((size_t)E * std::max(cap_b, cap_p)), *slots = dev_alloc<int>((size_t)n * E);
    cuda_scratch_reserve(moe_scratch_bytes(B, T, C, E));
    moe_router_forward(scores, x, w, n, C, E);
    cudaCheck(cudaMemcpy(dscores, scores, (size_t)n * E * sizeof(float), cudaMemcpyDeviceToDevice));
    printf("routing: n=%d (B=%d T=%d) C=%d E=%d c=%.1f\n", n, B, T, C, E, c);
    const double nC = (double)n * C * sizeof(floatX), nE = (double)n * E * sizeof(float), EC = (double)E * C * sizeof(floatX),
                 EC32 = (double)E * C * sizeof(float);  // the fp32 router gradient
    float ms_fwd = bench::time_ms([&] { moe_router_forward(scores, x, w, n, C, E); });
    bench::print_bandwidth("  moe_router_forward", ms_fwd, nC + EC + nE);
    float ms_sb = bench::time_ms([&] { moe_select(tokens, slots, scores, B, T, E, c, false); });
    printf("  %-46s %9.3f ms\n", "moe_select (group = batch, radix select)", ms_sb);
    float ms_sp = bench::time_ms([&] { moe_select(tokens, slots, scores, B, T, E, c, true); });
    printf("  %-46s %9.3f ms\n", "moe_select (group = position)", ms_sp);
    float ms_bwd = bench::time_ms([&] { moe_router_backward(dx, dw, dscores, scores, x, w, n, C, E); });
    bench::print_bandwidth("  moe_router_backward", ms_bwd, 3 * nC + EC + 2 * EC32 + 2 * nE);
    printf("  %-46s %9.3f ms\n", "router forward + select (batch)", ms_fwd + ms_sb);
    for (void* p : {(void*)x, (void*)w, (void*)dx, (void*)dw, (void*)scores, (void*)dscores, (void*)tokens, (void*)slots})
        cudaCheck(cudaFree(p));
}

// one MoE FFN (E experts, hidden He) against the dense SwiGLU FFN of hidden c * He on n tokens
static void bench_ffn(int B, int T, int C, int He, int E, float c, double& ratio_ffn, double& ratio_all) {
    const int n = B * T, cap = cpu::moe_capacity(B, T, E, c, false), H = (int)std::lround(c * He);
    const size_t rows = (size_t)E * cap;
    printf("MoE FFN: n=%d C=%d He=%d E=%d c=%.1f cap=%d (expert rows %zu)  vs dense SwiGLU H=%d\n", n, C, He, E, c,
           cap, rows, H);
    // MoE tensors
    floatX* x = alloc_random((size_t)n * C, 10, 1.0f);
    floatX* wr = alloc_random((size_t)E * C, 11, 2.0f / std::sqrt((float)C));
    floatX* w1 = alloc_random((size_t)E * 2 * He * C, 12, 1.0f / std::sqrt((float)C));
    floatX* b1 = alloc_random((size_t)E * 2 * He, 13, 0.1f);
    floatX* w2 = alloc_random((size_t)E * C * He, 14, 1.0f / std::sqrt((float)He));
    floatX* b2 = alloc_random((size_t)E * C, 15, 0.1f);
    float *dw1 = alloc_zeros_f32((size_t)E * 2 * He * C), *db1 = alloc_zeros_f32((size_t)E * 2 * He);
    float *dw2 = alloc_zeros_f32((size_t)E * C * He), *db2 = alloc_zeros_f32((size_t)E * C);
    float* dwr = alloc_zeros_f32((size_t)E * C);
    floatX *xe = dev_alloc<floatX>(rows * C), *h = dev_alloc<floatX>(rows * 2 * He), *a = dev_alloc<floatX>(rows * He);
    floatX *ye = dev_alloc<floatX>(rows * C), *out = dev_alloc<floatX>((size_t)n * C);
    floatX* dout = alloc_random((size_t)n * C, 21, 1.0f);
    floatX *dye = dev_alloc<floatX>(rows * C), *da = dev_alloc<floatX>(rows * He), *dh = dev_alloc<floatX>(rows * 2 * He);
    floatX *dxe = dev_alloc<floatX>(rows * C), *dx = alloc_random((size_t)n * C, 22, 1.0f);
    float *scores = dev_alloc<float>((size_t)n * E), *dscores = dev_alloc<float>((size_t)n * E);
    int *tokens = dev_alloc<int>(rows), *slots = dev_alloc<int>((size_t)n * E);
    cuda_scratch_reserve(std::max({moe_scratch_bytes(B, T, C, E), matmul_batched_scratch_bytes(E, cap, 2 * He),
                                   matmul_batched_scratch_bytes(E, cap, C)}));
    moe_router_forward(scores, x, wr, n, C, E);
    moe_select(tokens, slots, scores, B, T, E, c, false);

    auto moe_forward = [&] {
        moe_gather(xe, x, tokens, E, cap, C);
        matmul_forward_batched(h, xe, w1, b1, E, cap, C, 2 * He);
        swiglu_forward(a, h, (int)rows, He);
        matmul_forward_batched(ye, a, w2, b2, E, cap, He, C);
        moe_combine_forward(out, ye, scores, slots, n, E, cap, C);
    };
    auto moe_backward = [&] {
        moe_combine_backward(dye, dscores, dout, ye, scores, tokens, slots, n, E, cap, C);
        matmul_backward_batched(da, dw2, db2, dye, a, w2, E, cap, He, C);
        swiglu_backward(dh, da, h, (int)rows, He);
        matmul_backward_batched(dxe, dw1, db1, dh, xe, w1, E, cap, C, 2 * He);
        moe_gather_backward(dx, dxe, slots, n, E, cap, C);
    };
    auto routing = [&] {
        moe_router_forward(scores, x, wr, n, C, E);
        moe_select(tokens, slots, scores, B, T, E, c, false);
    };
    const double flops_fwd = 6.0 * rows * C * He;
    float ms_mf = bench::time_ms(moe_forward, 2, 10);
    float ms_mb = bench::time_ms(moe_backward, 2, 10);
    float ms_route = bench::time_ms(routing, 2, 10);
    float ms_rb = bench::time_ms([&] { moe_router_backward(dx, dwr, dscores, scores, x, wr, n, C, E); }, 2, 10);
    // the memory-bound pieces
    const double rowsC = (double)rows * C * 2, nC = (double)n * C * 2, nE4 = (double)n * E * 4;
    float ms = bench::time_ms([&] { moe_gather(xe, x, tokens, E, cap, C); }, 2, 10);
    bench::print_bandwidth("  moe_gather", ms, 2 * rowsC + rows * 4.0);
    ms = bench::time_ms([&] { moe_combine_forward(out, ye, scores, slots, n, E, cap, C); }, 2, 10);
    bench::print_bandwidth("  moe_combine_forward", ms, rowsC + nC + 2 * nE4);
    ms = bench::time_ms([&] { moe_combine_backward(dye, dscores, dout, ye, scores, tokens, slots, n, E, cap, C); }, 2, 10);
    bench::print_bandwidth("  moe_combine_backward", ms, 2 * rowsC + nC + 3 * nE4);
    ms = bench::time_ms([&] { moe_gather_backward(dx, dxe, slots, n, E, cap, C); }, 2, 10);
    bench::print_bandwidth("  moe_gather_backward", ms, rowsC + 2 * nC + nE4);
    for (void* p : {(void*)xe, (void*)h, (void*)a, (void*)ye, (void*)dye, (void*)da, (void*)dh, (void*)dxe})
        cudaCheck(cudaFree(p));

    // the dense FFN on all n tokens
    floatX* dW1 = alloc_random((size_t)2 * H * C, 30, 1.0f / std::sqrt((float)C));
    floatX* dB1 = alloc_random((size_t)2 * H, 31, 0.1f);
    floatX* dW2 = alloc_random((size_t)C * H, 32, 1.0f / std::sqrt((float)H));
    floatX* dB2 = alloc_random(C, 33, 0.1f);
    float *gW1 = alloc_zeros_f32((size_t)2 * H * C), *gB1 = alloc_zeros_f32((size_t)2 * H);
    float *gW2 = alloc_zeros_f32((size_t)C * H), *gB2 = alloc_zeros_f32(C);
    floatX *dh_ = dev_alloc<floatX>((size_t)n * 2 * H), *da_ = dev_alloc<floatX>((size_t)n * H);
    floatX *ddh = dev_alloc<floatX>((size_t)n * 2 * H), *dda = dev_alloc<floatX>((size_t)n * H);
    floatX* dout_ = dev_alloc<floatX>((size_t)n * C);
    cuda_scratch_reserve(matmul_scratch_bytes(n, 2 * H));
    auto dense_forward = [&] {
        matmul_forward(dh_, x, dW1, dB1, n, C, 2 * H);
        swiglu_forward(da_, dh_, n, H);
        matmul_forward(dout_, da_, dW2, dB2, n, H, C);
    };
    auto dense_backward = [&] {
        matmul_backward(dda, gW2, gB2, dout, da_, dW2, n, H, C);
        swiglu_backward(ddh, dda, dh_, n, H);
        matmul_backward(dx, gW1, gB1, ddh, x, dW1, n, C, 2 * H);  // (dx overwritten: fine for timing)
    };
    float ms_df = bench::time_ms(dense_forward, 2, 10);
    float ms_db = bench::time_ms(dense_backward, 2, 10);
    const double dense_flops_fwd = 6.0 * n * C * H;

    bench::print_flops("  MoE FFN forward", ms_mf, flops_fwd, 0);
    bench::print_flops("  MoE FFN backward", ms_mb, 2 * flops_fwd, 0);
    bench::print_flops("  dense FFN forward", ms_df, dense_flops_fwd, 0);
    bench::print_flops("  dense FFN backward", ms_db, 2 * dense_flops_fwd, 0);
    printf("  %-46s %9.3f ms (+ router backward %.3f ms)\n", "routing: router forward + select", ms_route, ms_rb);
    auto tput = [](double flops, double ms) { return flops / ms; };
    const double r_fwd = tput(flops_fwd, ms_mf) / tput(dense_flops_fwd, ms_df);
    const double r_bwd = tput(2 * flops_fwd, ms_mb) / tput(2 * dense_flops_fwd, ms_db);
    ratio_ffn = tput(3 * flops_fwd, ms_mf + ms_mb) / tput(3 * dense_flops_fwd, ms_df + ms_db);
    ratio_all = tput(3 * flops_fwd, ms_mf + ms_mb + ms_route + ms_rb) / tput(3 * dense_flops_fwd, ms_df + ms_db);
    printf("  ratio MoE / dense throughput: forward %.1f%%  backward %.1f%%  fwd+bwd %.1f%%  with routing %.1f%%  %s\n",
           100 * r_fwd, 100 * r_bwd, 100 * ratio_ffn, 100 * ratio_all, ratio_ffn >= 0.8 ? "(>= 80%: ok)" : "(< 80%)");

    for (void* p : {(void*)x, (void*)wr, (void*)w1, (void*)b1, (void*)w2, (void*)b2, (void*)dw1, (void*)db1, (void*)dw2,
                    (void*)db2, (void*)dwr, (void*)out, (void*)dout, (void*)dx, (void*)scores, (void*)dscores,
                    (void*)tokens, (void*)slots, (void*)dW1, (void*)dB1, (void*)dW2, (void*)dB2, (void*)gW1, (void*)gB1,
                    (void*)gW2, (void*)gB2, (void*)dh_, (void*)da_, (void*)ddh, (void*)dda, (void*)dout_})
        cudaCheck(cudaFree(p));
}

int main() {
    try {
        bench::print_header("mixture of experts (expert-choice routing)");
        matmul_setup();
        bool ok = validate_ops(4, 300, 768, 8, 2.0f, false);
        ok &= validate_ops(3, 37, 37, 6, 1.0f, true);
        ok &= validate_ops(2, 257, 769, 64, 2.0f, false);
        ok &= validate_select(64, 1024, 8, 2.0f, false);
        ok &= validate_select(64, 1024, 64, 2.0f, false);
        ok &= validate_select(64, 1024, 64, 2.0f, true);
        ok &= validate_batched(4, 300, 256, 512);
        ok &= validate_batched(3, 37, 37, 19);
        require_valid(ok);
        printf("\n");
        const int B = 64, T = 1024, C = 1024, He = 2816;
        const float c = 2.0f;
        for (int E : {8, 16, 32, 64}) bench_routing(B, T, C, E, c);
        printf("\n");
        double worst = 1e9;
        for (int E : {8, 16, 64}) {
            double r_ffn, r_all;
            bench_ffn(B, T, C, He, E, c, r_ffn, r_all);
            worst = std::min(worst, r_ffn);
        }
        printf("\nworst MoE / dense FFN throughput ratio: %.1f%% (target >= 80%%)\n", 100 * worst);
        matmul_teardown();
    } catch (const LlmcError& e) {
        fprintf(stderr, "%s\n", e.what());
        return 1;
    }
    return 0;
}
