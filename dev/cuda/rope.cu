// RoPE benchmark (llmc/ops/rope.cuh): rope_forward / rope_backward, in place on the q and k heads of qkv.
//   1. validates both against the CPU twin (llmc/ops/cpu/rope.h) on small shapes (hs 64 and 128, GQA,
//      packed rows, llama3 scaling, hs 6 and an unaligned buffer for the scalar path): q / k relative
//      L2 and max-norm <= 1e-2 (one bf16 rounding of an fp32 rotation by the same table), v bitwise
//      untouched; exits 1 on a mismatch
//   2. times them on model shapes next to attention_forward (llmc/ops/attention.cuh) on the same qkv,
//      unpacked (one document per row) and packed (documents of mean ~T/8)
// Bytes counted: q and k read and written once, 2 x (n_head + n_kv_head) x hs x B*T x sizeof(floatX);
// doc_start (4 B per token) and the table (T x hs/2 x 8 B) once. The roofline is the measured
// device-to-device copy bandwidth ("% of copy").
//
// Fused into the attention's Q/K load, or a separate kernel? A separate in-place kernel, for now: it
// moves 2 x (n_head + n_kv_head) hs x BT x 2 bytes per call (bf16), once in the forward and once in the
// backward (on dqkv). At GPT-2 124M's shape (n_head = n_kv_head = 12, hs 64, B 32 x T 1024) that is
// 2 x 24 x 64 x 32768 x 2 = 201 MB: ~48 us per call at the ~4.2 TB/s copy bandwidth an H200 measured
// (dev/cuda/RESULTS.md), ~1.2 ms per step over 12 layers, forward and backward (~2.6% of a ~44 ms d12
// step). The attention forward of that layer does 4 x 64 x 12 x (32 x 1024 x 1025 / 2) = 51.6 GFLOP:
// ~0.2-0.3 ms at 200-250 TFLOP/s, so the separate kernel would be ~15-25% on top of the attention
// forward it feeds. Fusing removes those bytes but not for free: the rotated q / k must be what the
// backward's kernels see too, so either the forward writes them back anyway (the same traffic as the
// separate kernel) or all three flash kernels (forward, dq, dkdv) rotate on every Q / K tile load --
// K tiles are loaded once per query tile that sees them, so the rotation's math repeats ~T/128 times,
// in kernels already at their register budgets (168 at hs 64, bounded for 3 blocks per SM) -- and the
// dq / dkdv kernels apply the transposed rotation before storing. Decide on the measured ratio: this
// benchmark prints rope's time next to attention_forward's for the same shape. GPU-unverified: the
// figures above are arithmetic, written in a session without a GPU; this file compiles, it has not run.
// Build: make dev/cuda/bin/rope (or nvcc -O3 -std=c++17 -arch=sm_90a --use_fast_math -I. dev/cuda/rope.cu
//        -lcublasLt -lcublas -o rope)
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "dev/cuda/common.cuh"
#include "llmc/ops/cpu/rope.h"
#include "llmc/ops/rope.cuh"
#include "llmc/ops/attention.cuh"

using namespace bench;  // the validation helpers (host_random, to_device_floatX, make_doc_start, ...)

struct Shape {
    int B, T, nh, nkv, hs;
};

static cpu::RopeSpec spec_for(bool llama3) {
    cpu::RopeSpec spec;
    if (llama3) {
        spec.theta = 500000.0;
        spec.scaling = cpu::ROPE_SCALING_LLAMA3;
        spec.factor = 32.0;
        spec.original_max_pos = 64;  // small, so that the validation's T sees all three regimes
    }
    return spec;
}

// one shape, forward and backward; offset: elements into the device allocation (1: the scalar path)
static bool validate(const Shape& s, bool packed, bool llama3, size_t offset) {
    Rng rng(300 + s.hs + s.T + s.nh + offset);
    const int BT = s.B * s.T, half = s.hs / 2;
    const size_t row = (size_t)(s.nh + 2 * s.nkv) * s.hs, qk = (size_t)(s.nh + s.nkv) * s.hs, n = BT * row;
    std::vector<float> cs((size_t)s.T * half * 2);
    cpu::rope_table(cs.data(), s.T, s.hs, spec_for(llama3));
    const std::vector<int> ds = make_doc_start(s.B, s.T, packed, 5 + s.T);
    const std::vector<float> x = host_random(n, rng);
    float* d_cs = to_device(cs);
    int* d_ds = to_device(ds);
    floatX* d_buf = dev_alloc<floatX>(n + offset);
    printf("validate B=%d T=%d n_head=%d n_kv_head=%d hs=%d %s%s%s\n", s.B, s.T, s.nh, s.nkv, s.hs,
           packed ? "packed" : "unpacked", llama3 ? ", llama3" : "", offset ? ", unaligned (scalar path)" : "");
    bool ok = true;
    for (int dir = 0; dir < 2; dir++) {
        std::vector<float> want = x;
        if (dir == 0) cpu::rope_forward<float>(want.data(), ds.data(), cs.data(), s.B, s.T, s.nh, s.nkv, s.hs);
        else cpu::rope_backward<float>(want.data(), ds.data(), cs.data(), s.B, s.T, s.nh, s.nkv, s.hs);
        floatX* d_qkv = d_buf + offset;
        std::vector<floatX> h(n);
        for (size_t i = 0; i < n; i++) h[i] = float_to_floatX(x[i]);
        cudaCheck(cudaMemcpy(d_qkv, h.data(), n * sizeof(floatX), cudaMemcpyHostToDevice));
        if (dir == 0) rope_forward(d_qkv, d_ds, d_cs, s.B, s.T, s.nh, s.nkv, s.hs);
        else rope_backward(d_qkv, d_ds, d_cs, s.B, s.T, s.nh, s.nkv, s.hs);
        const std::vector<float> got = to_host_floatX(d_qkv, n);
        std::vector<float> got_qk, want_qk;
        size_t v_changed = 0;
        for (int bt = 0; bt < BT; bt++)
            for (size_t c = 0; c < row; c++) {
                const size_t a = bt * row + c;
                if (c < qk) {
                    got_qk.push_back(got[a]);
                    want_qk.push_back(want[a]);
                } else {
                    v_changed += got[a] != x[a];
                }
            }
        ok = compare(dir == 0 ? "forward q, k" : "backward dq, dk", got_qk, want_qk, 1e-2) && ok;
        printf("  %-14s %zu value-head elements changed: %s\n", dir == 0 ? "forward v" : "backward dv", v_changed,
               v_changed == 0 ? "ok" : "MISMATCH");
        ok = ok && v_changed == 0;
    }
    for (void* p : {(void*)d_cs, (void*)d_ds, (void*)d_buf}) cudaCheck(cudaFree(p));
    return ok;
}

static void run_bench(const Shape& s) {
    const int BT = s.B * s.T, half = s.hs / 2;
    const size_t row = (size_t)(s.nh + 2 * s.nkv) * s.hs, n = BT * row;
    std::vector<float> cs((size_t)s.T * half * 2);
    cpu::rope_table(cs.data(), s.T, s.hs, spec_for(false));
    const std::vector<int> ds_unpacked = make_doc_start(s.B, s.T, false, 1), ds_packed = make_doc_start(s.B, s.T, true, 2);
    float* d_cs = to_device(cs);
    int *d_ds = to_device(ds_unpacked), *d_dsp = to_device(ds_packed);
    floatX* qkv = alloc_random(n, 11, 1.0f);
    floatX* out = dev_alloc<floatX>((size_t)BT * s.nh * s.hs);
    float* lse = dev_alloc<float>((size_t)s.B * s.nh * s.T);
    const double bytes = 2.0 * (s.nh + s.nkv) * s.hs * (double)BT * sizeof(floatX) + 4.0 * BT + (double)cs.size() * 4;
    printf("B = %d, T = %d, n_head %d, n_kv_head %d, hs %d: q and k are %.1f MB\n", s.B, s.T, s.nh, s.nkv, s.hs,
           (double)(s.nh + s.nkv) * s.hs * BT * sizeof(floatX) / 1e6);
    const float fwd = bench::time_ms([&] { rope_forward(qkv, d_ds, d_cs, s.B, s.T, s.nh, s.nkv, s.hs); });
    bench::print_bandwidth("  rope_forward", fwd, bytes);
    const float bwd = bench::time_ms([&] { rope_backward(qkv, d_ds, d_cs, s.B, s.T, s.nh, s.nkv, s.hs); });
    bench::print_bandwidth("  rope_backward", bwd, bytes);
    // the attention forward this rotation feeds, on the same qkv (no ALiBi: a RoPE model has none)
    for (int packed = 0; packed < 2; packed++) {
        const int* ds = packed ? d_dsp : d_ds;
        const double flops = 4.0 * s.hs * s.nh * visible_pairs(packed ? ds_packed : ds_unpacked, s.T);
        const float att = bench::time_ms([&] { attention_forward(out, lse, qkv, ds, s.B, s.T, s.nh, s.nkv, s.hs, 0, 0); },
                                         3, 10);
        bench::print_flops(packed ? "  attention_forward (packed)" : "  attention_forward (unpacked)", att, flops, 0);
        printf("  rope_forward / attention_forward %s: %.1f%%\n", packed ? "packed" : "unpacked", 100.0 * fwd / att);
    }
    for (void* p : {(void*)d_cs, (void*)d_ds, (void*)d_dsp, (void*)qkv, (void*)out, (void*)lse}) cudaCheck(cudaFree(p));
}

int main() {
    bench::print_header("rope");
    bool ok = true;
    ok = validate({2, 37, 4, 4, 64}, true, false, 0) && ok;
    ok = validate({3, 29, 8, 2, 128}, true, true, 0) && ok;
    ok = validate({2, 100, 12, 4, 64}, false, false, 1) && ok;  // unaligned: the scalar path
    ok = validate({2, 19, 5, 5, 6}, true, false, 0) && ok;     // hs 6: the scalar path
    require_valid(ok);
    // GPT-2 124M's attention (d12, B 32 x T 1024), a GQA 4 model at hs 128, and Llama-3-8B's heads
    // (32 query, 8 key/value heads of 128) at T 8192
    const Shape shapes[] = {{32, 1024, 12, 12, 64}, {16, 4096, 16, 4, 128}, {8, 8192, 32, 8, 128}};
    for (const Shape& s : shapes) run_bench(s);
    return 0;
}
