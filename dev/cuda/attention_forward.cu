// Attention forward benchmark (llmc/ops/attention.cuh): causal attention over packed documents, GQA, ALiBi.
//   version 1  attention_detail::forward_simple: fp32 math on CUDA cores, 16 queries per block, keys
//              staged 32 at a time as fp32 in shared memory, one lane per key for the dot products and
//              one lane per head dim for the accumulation. Correct and memory-lean, but every
//              multiply-add reads shared memory: far from the tensor-core roofline. It stays the path
//              for head sizes other than 64 and 128.
//   version 2  attention_detail::forward_flash: FlashAttention-2 style. 64 queries per block (16 per
//              warp, Q fragments in registers), 64-key tiles double-buffered by cp.async, S = Q K^T and
//              O += P V on the bf16 tensor cores (mma.sync m16n8k16, fp32 accumulation), online softmax
//              on the fp32 C fragments, P handed from the S fragments to the PV product in registers.
//              Key tiles outside [min doc_start of the query tile, its last query] are never visited
//              and fully visible tiles skip the mask, so packed rows cost ~ the sum of their documents'
//              squares. What attention_forward runs for hs 64 and 128.
// 1. validates both versions against the CPU twin (llmc/ops/cpu/attention.h) on small shapes (hs 64 and
//    128, rows of 3-token documents / one document / the benchmark's packed rows, ragged T, GQA, ALiBi):
//    out relative L2 and max-norm <= 1e-2, lse <= 1e-3, two runs bitwise equal; exits 1 on a mismatch
// 2. times B*T = 65536 tokens, n_head 16, hs 64 and 128, T = 1024 .. 8192, GQA ratios 1 / 4 / 8, on
//    packed rows (random document lengths uniform in [1, T/4), mean ~T/8, the row starting
//    mid-document) and unpacked rows (one document per row: plain causal). Version 1 only on a few
//    shapes (it is ~20x slower).
// FLOPs count only the visible (unmasked) score elements: 4 * hs * n_head * sum_i (i - doc_start[i] + 1)
// (2 hs for q.k and 2 hs for p v per visible pair; the softmax is not counted), so packed and unpacked
// rows are compared on useful work. "packed speed-up" is time(unpacked) / time(packed) on the same
// shape; the ratio of their FLOPs (the best a kernel that skips all masked work can do) is printed next
// to it.
// 3. --stages: the flash forward's two variants forced side by side (attention_detail::flash_plan), validated
//    as in 1., timed at hs 64 / 128, T 1024 / 4096, GQA 4 (a few seconds on an H200, at its occupancy).
// Build: nvcc -O3 -std=c++17 -arch=sm_90 --use_fast_math -I. dev/cuda/attention_forward.cu -lcublasLt -lcublas -o attention_forward
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

typedef void (*ForwardFn)(floatX*, float*, const floatX*, const int*, int, int, int, int, int, int, int);
struct Version {
    const char* name;
    ForwardFn fn;
};
static const Version default_versions[] = {{"v1 simple", attention_detail::forward_simple},
                                           {"v2 flash ", attention_detail::forward_flash}};

// --stages: the flash forward's two variants (attention_detail::flash_plan) forced, side by side: 1-stage
// (single-buffered key/value tiles) and 2-stage (double-buffered, what an H100/H200 runs)
template <int STAGES>
static void forward_stages(floatX* out, float* lse, const floatX* qkv, const int* ds, int B, int T, int NH, int KVH,
                           int hs, int alibi_nh, int head0) {
    attention_detail::FlashOverrideGuard g(0, STAGES);
    attention_detail::forward_flash(out, lse, qkv, ds, B, T, NH, KVH, hs, alibi_nh, head0);
}
static const Version stage_versions[] = {{"1-stage  ", forward_stages<1>}, {"2-stage  ", forward_stages<2>}};
static const Version (*versions_in_use)[2] = &default_versions;  // the pair validate() and run_bench() use

static bool validate(int B, int T, int NH, int KVH, int hs, bool alibi) {
    Rng rng(7 + T + hs);
    const int row = (NH + 2 * KVH) * hs, C = NH * hs;
    const size_t BT = (size_t)B * T, n_lse = (size_t)B * NH * T;
    const std::vector<float> qkv = host_random(BT * row, rng, 1.5f, 0.1f);
    const std::vector<int> ds = validation_doc_start(B, T, 100);
    std::vector<float> out_ref(BT * C), lse_ref(n_lse);
    const int alibi_nh = alibi ? NH : 0;  // ALiBi over the NH heads, or none
    cpu::attention_forward<float>(out_ref.data(), lse_ref.data(), qkv.data(), ds.data(), B, T, NH, KVH, hs, alibi_nh, 0);
    floatX *d_qkv = to_device_floatX(qkv), *d_out = dev_alloc<floatX>(BT * C), *d_out2 = dev_alloc<floatX>(BT * C);
    int* d_ds = to_device(ds);
    float *d_lse = dev_alloc<float>(n_lse), *d_lse2 = dev_alloc<float>(n_lse);
    bool ok = true;
    for (const Version& v : *versions_in_use) {
        printf("validate %s B=%d T=%d n_head=%d n_kv_head=%d hs=%d alibi=%d\n", v.name, B, T, NH, KVH, hs, alibi);
        cudaCheck(cudaMemset(d_out, 0xFF, BT * C * sizeof(floatX)));  // NaN: unwritten outputs fail
        cudaCheck(cudaMemset(d_lse, 0xFF, n_lse * sizeof(float)));
        v.fn(d_out, d_lse, d_qkv, d_ds, B, T, NH, KVH, hs, alibi_nh, 0);
        v.fn(d_out2, d_lse2, d_qkv, d_ds, B, T, NH, KVH, hs, alibi_nh, 0);
        const std::vector<float> out = to_host_floatX(d_out, BT * C), out2 = to_host_floatX(d_out2, BT * C);
        const std::vector<float> lse = to_host(d_lse, n_lse), lse2 = to_host(d_lse2, n_lse);
        ok = compare("out", out, out_ref, 1e-2) && ok;
        ok = compare("lse", lse, lse_ref, 1e-3) && ok;
        const bool same = out == out2 && std::memcmp(lse.data(), lse2.data(), n_lse * sizeof(float)) == 0;
        printf("  deterministic  %s\n", same ? "yes" : "NO");
        ok = ok && same;
    }
    for (void* p : {(void*)d_qkv, (void*)d_ds, (void*)d_out, (void*)d_out2, (void*)d_lse, (void*)d_lse2})
        cudaCheck(cudaFree(p));
    return ok;
}

static void run_bench(int hs, int T, int ratio, bool with_v1) {
    const int NH = 16, KVH = NH / ratio, B = 65536 / T;
    const int row = (NH + 2 * KVH) * hs, C = NH * hs;
    const size_t BT = (size_t)B * T;
    floatX *qkv = alloc_random(BT * row, 1 + hs + T, 2.0f), *out = dev_alloc<floatX>(BT * C);
    float* lse = dev_alloc<float>(BT * NH);
    // forward FLOPs: 4 hs per visible pair
    time_versions(*versions_in_use, B, T, NH, hs, 4.0, with_v1, [](const int*) {}, [&](int v, const int* d_ds) {
        (*versions_in_use)[v].fn(out, lse, qkv, d_ds, B, T, NH, KVH, hs, NH, 0);
    });
    cudaCheck(cudaFree(qkv));
    cudaCheck(cudaFree(out));
    cudaCheck(cudaFree(lse));
}

// --stages: validation of both forced variants (the four shapes), then hs 64 and 128 at T 1024 and 4096, GQA 4
static int run_stages() {
    bench::print_header("attention_forward --stages (flash 1-stage vs 2-stage, forced)");
    versions_in_use = &stage_versions;
    bool ok = true;
    ok = validate(3, 300, 4, 1, 64, true) && ok;
    ok = validate(3, 257, 6, 2, 128, true) && ok;
    ok = validate(2, 130, 4, 4, 64, false) && ok;
    ok = validate(3, 200, 8, 1, 128, false) && ok;
    require_valid(ok);
    printf("B*T = 65536 tokens, n_head 16, alibi; TFLOP/s over visible score elements (4 hs per pair);\n"
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
    return run_all("attention_forward", "4 hs per pair", validate, run_bench);
}
