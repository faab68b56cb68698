// The attention-forward ladder: causal attention over packed documents with grouped-query heads and
// ALiBi (llmc/ops/cpu/attention.h defines it: query i sees keys doc_start[i] <= j <= i; query head h
// reads kv head h / (n_head / n_kv_head); out [B, T, n_head hs], lse [B, n_head, T] the log-sum-exp
// of the scores, kept for the backward). Three kernels, simplest first, each validated against the
// CPU reference and timed in the same program.
//   kernel 1  naive: one thread per (row, head, query), three passes over its visible keys straight
//             from global memory (the max of the scores, the sum of exponentials, the weighted sum of
//             the values), each recomputing q.k. No reuse of a key between the queries that read it.
//   kernel 2  attention_detail::forward_simple (llmc/ops/attention.cuh): 16 queries per block share each
//             32-key tile staged in shared memory as fp32, and one pass with an online softmax (the
//             running max rescales the running sum and output); fp32 math on the CUDA cores. The
//             trainer's path for head sizes other than 64 and 128.
//   kernel 3  production: attention_forward, FlashAttention-2 style for hs 64 / 128 (64-query tiles,
//             Q K^T and P V on the bf16 tensor cores, cp.async double-buffered key tiles, tiles outside
//             the documents skipped).
// GPU-unverified: written and compiled without a GPU (CI has none); the first run on a device is
// its check (validation exits 1 on a mismatch before anything is timed). dev/cuda/attention_forward.cu
// benchmarks kernels 2 and 3 over many shapes.
// Build: make dev/cuda/bin/ladder_attention
#include <cmath>
#include <cstdlib>
#include <vector>
#include "dev/cuda/common.cuh"
#include "llmc/ops/cpu/attention.h"
#include "llmc/ops/attention.cuh"

using namespace bench;

constexpr int NAIVE_MAX_HS = 128;  // the naive kernel's output row lives in registers / local memory

// ALiBi slope of head h of n (cpu::alibi_slope's formula, in float)
__device__ float naive_alibi_slope(int h, int n) {
    int m = 1;
    while (m * 2 <= n) m *= 2;
    return h < m ? exp2f(-8.0f * (h + 1) / m) : exp2f(-8.0f * (2 * (h - m) + 1) / (2 * m));
}

__global__ void attention_naive(floatX* out, float* lse, const floatX* qkv, const int* doc_start, int B, int T, int NH,
                                int KVH, int hs, int alibi_n_head, int head0) {
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= B * NH * T) return;
    const int i = idx % T, h = idx / T % NH, b = idx / (T * NH);
    const int row = (NH + 2 * KVH) * hs, kh = h / (NH / KVH);
    const floatX* base = qkv + (size_t)b * T * row;
    const floatX* q = base + (size_t)i * row + h * hs;
    const float scale = rsqrtf((float)hs), slope = alibi_n_head > 0 ? naive_alibi_slope(head0 + h, alibi_n_head) : 0.0f;
    auto score = [&](int j) {
        const floatX* k = base + (size_t)j * row + (NH + kh) * hs;
        float dot = 0.0f;
        for (int d = 0; d < hs; d++) dot += floatX_to_float(q[d]) * floatX_to_float(k[d]);
        return dot * scale - slope * (float)(i - j);
    };
    const int j0 = doc_start[b * T + i];
    float mx = -INFINITY, sum = 0.0f;
    for (int j = j0; j <= i; j++) mx = fmaxf(mx, score(j));
    for (int j = j0; j <= i; j++) sum += expf(score(j) - mx);
    const float l = mx + logf(sum);
    lse[((size_t)b * NH + h) * T + i] = l;
    float o[NAIVE_MAX_HS];
    for (int d = 0; d < hs; d++) o[d] = 0.0f;
    for (int j = j0; j <= i; j++) {
        const float p = expf(score(j) - l);
        const floatX* v = base + (size_t)j * row + (NH + KVH + kh) * hs;
        for (int d = 0; d < hs; d++) o[d] += p * floatX_to_float(v[d]);
    }
    floatX* y = out + ((size_t)b * T + i) * NH * hs + h * hs;
    for (int d = 0; d < hs; d++) y[d] = float_to_floatX(o[d]);
}

static void run_kernel(int k, floatX* out, float* lse, const floatX* qkv, const int* ds, int B, int T, int NH, int KVH,
                       int hs, int alibi_n_head) {
    if (k == 2) attention_detail::forward_simple(out, lse, qkv, ds, B, T, NH, KVH, hs, alibi_n_head, 0);
    else if (k == 3) attention_forward(out, lse, qkv, ds, B, T, NH, KVH, hs, alibi_n_head, 0);
    else {
        attention_naive<<<ceil_div(B * NH * T, 128), 128>>>(out, lse, qkv, ds, B, T, NH, KVH, hs, alibi_n_head, 0);
        cudaCheck(cudaGetLastError());
    }
}

static const char* names[] = {"", "kernel 1 naive", "kernel 2 shared-memory tiles, online softmax",
                              "kernel 3 flash, tensor cores (production)"};

static bool validate(int B, int T, int NH, int KVH, int hs) {
    Rng rng(5 + T + hs);
    const int row = (NH + 2 * KVH) * hs, C = NH * hs;
    const size_t BT = (size_t)B * T, n_lse = (size_t)B * NH * T;
    const std::vector<float> qkv = host_random(BT * row, rng, 1.5f, 0.1f);
    const std::vector<int> ds = make_doc_start(B, T, true, 17);  // packed rows, starting mid-document
    std::vector<float> out_ref(BT * C), lse_ref(n_lse);
    cpu::attention_forward<float>(out_ref.data(), lse_ref.data(), qkv.data(), ds.data(), B, T, NH, KVH, hs, NH, 0);
    floatX *d_qkv = to_device_floatX(qkv), *d_out = dev_alloc<floatX>(BT * C);
    float* d_lse = dev_alloc<float>(n_lse);
    int* d_ds = to_device(ds);
    bool ok = true;
    for (int k = 1; k <= 3; k++) {
        printf("validate %s B=%d T=%d n_head=%d n_kv_head=%d hs=%d alibi\n", names[k], B, T, NH, KVH, hs);
        cudaCheck(cudaMemset(d_out, 0xFF, BT * C * sizeof(floatX)));  // NaN: an unwritten output fails
        cudaCheck(cudaMemset(d_lse, 0xFF, n_lse * sizeof(float)));
        run_kernel(k, d_out, d_lse, d_qkv, d_ds, B, T, NH, KVH, hs, NH);
        ok = compare("out", to_host_floatX(d_out, BT * C), out_ref, 1e-2) && ok;
        ok = compare("lse", to_host(d_lse, n_lse), lse_ref, 1e-3) && ok;
    }
    for (void* p : {(void*)d_qkv, (void*)d_out, (void*)d_lse, (void*)d_ds}) cudaCheck(cudaFree(p));
    return ok;
}

int main() {
    print_header("ladder_attention");
    bool ok = validate(2, 130, 4, 2, 64);
    ok = validate(2, 97, 4, 1, 128) && ok;
    require_valid(ok);
    const int B = 8, T = 1024, NH = 16, KVH = 4, hs = 64, row = (NH + 2 * KVH) * hs;
    printf("B %d, T %d, n_head %d, n_kv_head %d, hs %d, packed rows: TFLOP/s over the visible scores (4 hs each)\n",
           B, T, NH, KVH, hs);
    const std::vector<int> ds = make_doc_start(B, T, true, 1000);
    floatX *qkv = alloc_random((size_t)B * T * row, 1, 2.0f), *out = dev_alloc<floatX>((size_t)B * T * NH * hs);
    float* lse = dev_alloc<float>((size_t)B * NH * T);
    int* d_ds = to_device(ds);
    const double flops = 4.0 * hs * NH * visible_pairs(ds, T);
    for (int k = 1; k <= 3; k++)
        print_flops(names[k], time_ms([&] { run_kernel(k, out, lse, qkv, d_ds, B, T, NH, KVH, hs, NH); }, 1, k == 1 ? 3 : 20),
                    flops, 0);
    for (void* p : {(void*)qkv, (void*)out, (void*)lse, (void*)d_ds}) cudaCheck(cudaFree(p));
    return 0;
}
