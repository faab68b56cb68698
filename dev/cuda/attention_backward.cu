// Attention backward benchmark (llmc/ops/attention.cuh): causal attention over packed documents, GQA, ALiBi.
// Both versions first compute D = rowsum(dO * O) (one thread per (token, head), into scratch), then:
//   version 1  attention_detail::backward_simple: fp32 CUDA-core kernels, a dQ kernel over 16-query
//              blocks and a dK/dV kernel over 16-key blocks that loops over the group's query heads
//              (the GQA sum in registers, deterministic); operands staged as fp32 in shared memory,
//              every multiply-add reads shared memory. The path for head sizes other than 64 and 128.
//   version 2  attention_detail::backward_flash: FlashAttention-2 style on the bf16 tensor cores
//              (mma.sync m16n8k16, fp32 accumulation), P recomputed from the saved lse:
//              dQ kernel, block = 64 queries: per 64-key tile S = Q K^T, dP = dO V^T, dS, dQ += dS K;
//              dK/dV kernel, block = 64 keys: per query head of the group and per 64-query tile that can
//              see the keys (32 queries a step) S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q,
//              accumulated in registers in a fixed order (no atomics: deterministic). Tiles that no
//              query / key of the block can see are skipped. What attention_backward runs for hs 64, 128.
// 1. validates both versions against the CPU twin (llmc/ops/cpu/attention.h) on small shapes (hs 64 and
//    128, rows of 3-token documents / one document / the benchmark's packed rows, ragged T, GQA, ALiBi),
//    on the CPU's own bf16 out and lse: dq, dk, dv relative L2 and max-norm <= 1e-2, two runs bitwise
//    equal; exits 1 on a mismatch
// 2. times B*T = 65536 tokens, n_head 16, hs 64 and 128, T = 1024 .. 8192, GQA ratios 1 / 4 / 8, on
//    packed rows (random document lengths uniform in [1, T/4), mean ~T/8) and unpacked rows (one
//    document per row). Version 1 only on a few shapes (it is ~20x slower).
// FLOPs: 2.5x the forward's, FlashAttention-2's convention: 10 * hs * n_head * sum_i (i - doc_start[i] + 1)
// over the visible pairs only = five products of 2 hs flops per visible pair (the recomputed Q K^T,
// dP = dO V^T, dV += P^T dO, dK += dS^T Q, dQ += dS K); the recomputation is counted, D = dO.O and the
// element-wise softmax work are not. "packed speed-up" is time(unpacked) / time(packed) on the same
// shape, next to the ratio of their visible work.
// 3. --stages: the flash kernels' two variants forced side by side (see attention_detail::flash_plan):
//    2-stage (double-buffered tiles) vs 1-stage (single-buffered: a 99 KB card's hs 128 backward), both
//    validated as in 1., then timed at hs 64 / 128, T 1024 / 4096, GQA 4 (~10 s on an H200). Both run at
//    the H200's occupancy: the 1-stage kernels' extra blocks per SM on smaller cards are not emulated.
//    LLMC_ATTENTION_SMEM_LIMIT=101376 (no flag) runs the whole benchmark with an RTX 3090/4090's choice.
// Build: nvcc -O3 -std=c++17 -arch=sm_90 --use_fast_math -I. dev/cuda/attention_backward.cu -lcublasLt -lcublas -o attention_backward
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include "dev/cuda/attention_bench.cuh"
#include "llmc/ops/cpu/attention.h"
#include "llmc/ops/attention.cuh"

using namespace bench;  // the validation helpers (host_random, to_device_floatX, ...): dev/cuda/common.cuh
using namespace attention_bench;  // validation_doc_start, time_versions, run_all

typedef void (*BackwardFn)(floatX*, const floatX*, const floatX*, const floatX*, const float*, const int*, int, int,
                           int, int, int, int, int);
struct Version {
    const char* name;
    BackwardFn fn;
};
static const Version default_versions[] = {{"v1 simple", attention_detail::backward_simple},
                                           {"v2 flash ", attention_detail::backward_flash}};

// --stages: the two variants of the flash kernels (attention_detail::flash_plan) forced, side by side: 2-stage
// (double-buffered tiles, what an H100/H200 runs) and 1-stage (single-buffered, what a 99 KB card runs at
// hs 128 backward); any LLMC_ATTENTION_SMEM_LIMIT is ignored here (the forced variant must fit the device)
template <int STAGES>
static void backward_stages(floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out, const float* lse,
                            const int* ds, int B, int T, int NH, int KVH, int hs, int alibi_nh, int head0) {
    attention_detail::FlashOverrideGuard g(0, STAGES);
    attention_detail::backward_flash(dqkv, dout, qkv, out, lse, ds, B, T, NH, KVH, hs, alibi_nh, head0);
}
static const Version stage_versions[] = {{"1-stage  ", backward_stages<1>}, {"2-stage  ", backward_stages<2>}};
static const Version (*versions_in_use)[2] = &default_versions;  // the pair validate() and run_bench() use

// the columns [begin, end) of every row of a [rows, row_len] tensor (the q, k or v part of dqkv)
static std::vector<float> columns(const std::vector<float>& x, size_t rows, int row_len, int begin, int end) {
    std::vector<float> r;
    r.reserve(rows * (end - begin));
    for (size_t i = 0; i < rows; i++)
        for (int c = begin; c < end; c++) r.push_back(x[i * row_len + c]);
    return r;
}

static bool validate(int B, int T, int NH, int KVH, int hs, bool alibi) {
    Rng rng(11 + T + hs);
    const int row = (NH + 2 * KVH) * hs, C = NH * hs;
    const size_t BT = (size_t)B * T;
    const std::vector<float> qkv = host_random(BT * row, rng, 1.5f, 0.1f), dout = host_random(BT * C, rng, 1.0f, 0.05f);
    const std::vector<int> ds = validation_doc_start(B, T, 200);
    std::vector<float> out((size_t)BT * C), lse((size_t)B * NH * T);
    const int alibi_nh = alibi ? NH : 0;  // ALiBi over the NH heads, or none
    cpu::attention_forward<float>(out.data(), lse.data(), qkv.data(), ds.data(), B, T, NH, KVH, hs, alibi_nh, 0);
    for (float& x : out) x = floatX_to_float(float_to_floatX(x));  // the GPU saves a bf16 out
    std::vector<float> dqkv_ref(qkv.size());
    cpu::attention_backward<float>(dqkv_ref.data(), dout.data(), qkv.data(), out.data(), lse.data(), ds.data(), B, T,
                                   NH, KVH, hs, alibi_nh, 0);
    floatX *d_qkv = to_device_floatX(qkv), *d_dout = to_device_floatX(dout), *d_out = to_device_floatX(out);
    float* d_lse = to_device(lse);
    int* d_ds = to_device(ds);
    floatX *d_dqkv = dev_alloc<floatX>(qkv.size()), *d_dqkv2 = dev_alloc<floatX>(qkv.size());
    cuda_scratch_reserve(attention_scratch_bytes(B, T, NH));
    const int q_end = NH * hs, k_end = (NH + KVH) * hs;
    bool ok = true;
    for (const Version& v : *versions_in_use) {
        printf("validate %s B=%d T=%d n_head=%d n_kv_head=%d hs=%d alibi=%d\n", v.name, B, T, NH, KVH, hs, alibi);
        cudaCheck(cudaMemset(d_dqkv, 0xFF, qkv.size() * sizeof(floatX)));  // NaN: unwritten outputs fail
        v.fn(d_dqkv, d_dout, d_qkv, d_out, d_lse, d_ds, B, T, NH, KVH, hs, alibi_nh, 0);
        v.fn(d_dqkv2, d_dout, d_qkv, d_out, d_lse, d_ds, B, T, NH, KVH, hs, alibi_nh, 0);
        const std::vector<float> got = to_host_floatX(d_dqkv, qkv.size()), got2 = to_host_floatX(d_dqkv2, qkv.size());
        // relative L2 and max-norm of each part: dq and dk are small where documents are 1..3 tokens long
        // (p ~ 1, dp ~ D), so the max-norm of the whole part, not of each element, is the scale
        ok = compare("dq", columns(got, BT, row, 0, q_end), columns(dqkv_ref, BT, row, 0, q_end), 1e-2) && ok;
        ok = compare("dk", columns(got, BT, row, q_end, k_end), columns(dqkv_ref, BT, row, q_end, k_end), 1e-2) && ok;
        ok = compare("dv", columns(got, BT, row, k_end, row), columns(dqkv_ref, BT, row, k_end, row), 1e-2) && ok;
        const bool same = got == got2;
        printf("  deterministic  %s\n", same ? "yes" : "NO");
        ok = ok && same;
    }
    for (void* p : {(void*)d_qkv, (void*)d_dout, (void*)d_out, (void*)d_lse, (void*)d_ds, (void*)d_dqkv, (void*)d_dqkv2})
        cudaCheck(cudaFree(p));
    return ok;
}

static void run_bench(int hs, int T, int ratio, bool with_v1) {
    const int NH = 16, KVH = NH / ratio, B = 65536 / T;
    const int row = (NH + 2 * KVH) * hs, C = NH * hs;
    const size_t BT = (size_t)B * T;
    floatX *qkv = alloc_random(BT * row, 1 + hs + T, 2.0f), *dout = alloc_random(BT * C, 7 + hs + T, 1.0f);
    floatX *dqkv = dev_alloc<floatX>(BT * row), *out = dev_alloc<floatX>(BT * C);
    float* lse = dev_alloc<float>(BT * NH);
    cuda_scratch_reserve(attention_scratch_bytes(B, T, NH));
    // backward FLOPs: 10 hs per visible pair (2.5x the forward's); the forward before each row kind
    // makes the real saved state
    time_versions(
        *versions_in_use, B, T, NH, hs, 10.0, with_v1,
        [&](const int* d_ds) { attention_forward(out, lse, qkv, d_ds, B, T, NH, KVH, hs, NH, 0); },
        [&](int v, const int* d_ds) {
            (*versions_in_use)[v].fn(dqkv, dout, qkv, out, lse, d_ds, B, T, NH, KVH, hs, NH, 0);
        });
    for (void* p : {(void*)qkv, (void*)dqkv, (void*)out, (void*)dout, (void*)lse}) cudaCheck(cudaFree(p));
}

// --stages: validation of both forced variants (the four shapes), then hs 64 and 128 at T 1024 and 4096, GQA 4
static int run_stages() {
    bench::print_header("attention_backward --stages (flash 2-stage vs 1-stage, forced)");
    versions_in_use = &stage_versions;
    bool ok = true;
    ok = validate(3, 300, 4, 1, 64, true) && ok;
    ok = validate(3, 257, 6, 2, 128, true) && ok;
    ok = validate(2, 130, 4, 4, 64, false) && ok;
    ok = validate(3, 200, 8, 1, 128, false) && ok;
    require_valid(ok);
    printf("B*T = 65536 tokens, n_head 16, alibi; TFLOP/s over visible score elements (10 hs per pair);\n"
           "the last line of each shape, \"v2 / v1 speed\", is 2-stage speed / 1-stage speed (1-stage: 3 runs)\n");
    for (int hs : {64, 128})
        for (int T : {1024, 4096}) {
            printf("hs %d T %d GQA 4 (n_kv_head 4, B %d)\n", hs, T, 65536 / T);
            run_bench(hs, T, 4, true);
        }
    return 0;
}

int main(int argc, char** argv) {
    // the variants this device (or LLMC_ATTENTION_SMEM_LIMIT's emulated card) runs
    printf("%s\n%s\n", attention_kernels_summary(64).c_str(), attention_kernels_summary(128).c_str());
    if (argc > 1 && std::string(argv[1]) == "--stages") return run_stages();
    if (argc > 1) {
        fprintf(stderr, "usage: %s [--stages]\n", argv[0]);
        return 2;
    }
    return run_all("attention_backward", "10 hs per pair, 2.5x the forward", validate, run_bench);
}
