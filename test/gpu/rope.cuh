// GPU rope_forward / rope_backward (llmc/ops/rope.cuh) vs the CPU twin (llmc/ops/cpu/rope.h).
//
// The op is in place, so its output cannot be poisoned first; instead the elements it must not touch
// (the value heads) are checked bitwise, the DevTensor's elements before the tensor (shift 1) are NaN
// and stay so, and an element the kernel skipped keeps its input, which differs from the rotated value
// by ~|x| |sin(angle)|: far beyond the tolerance at positions > 0. Both sides rotate the same floatX
// inputs by the same fp32 table (cpu::rope_table, uploaded), in fp32: the GPU rounds each output to
// floatX once, so check_floatX's tolerances (bf16 1e-2, fp16 2e-3, as the layernorm tests) hold with a
// wide margin (one rounding is 2^-9 / 2^-12 relative).
#pragma once
#include <cstring>
#include <memory>
#include <string>
#include <vector>
#include "test/gpu/harness.cuh"
#include "llmc/ops/cpu/rope.h"
#include "llmc/ops/rope.cuh"

namespace rope_test {
using namespace gpu_test;

// doc_start of B rows of T tokens: packed rows of random document lengths in [1, 12] (row 0 starts
// mid-document: all zeros until its first boundary), or one document per row
inline std::vector<int> doc_starts(int B, int T, bool packed, uint64_t seed) {
    Rng rng(seed);
    std::vector<int> ds((size_t)B * T, 0);
    if (!packed) return ds;
    for (int b = 0; b < B; b++) {
        int start = 0, next = 1 + (int)rng.below(12);
        for (int t = 0; t < T; t++) {
            if (t == next) {
                start = t;
                next = t + 1 + (int)rng.below(12);
            }
            ds[(size_t)b * T + t] = start;
        }
    }
    return ds;
}

struct Shape {
    int B, T, nh, nkv, hs;
};

// forward and backward of one shape against the CPU twin, `shift` elements into the qkv allocation
// (1: the scalar path even where hs % 16 == 0)
inline void check_rope(const Shape& s, bool packed, bool llama3, size_t shift) {
    CAPTURE(s.B);
    CAPTURE(s.T);
    CAPTURE(s.nh);
    CAPTURE(s.nkv);
    CAPTURE(s.hs);
    CAPTURE(packed);
    CAPTURE(llama3);
    CAPTURE(shift);
    const int BT = s.B * s.T, half = s.hs / 2;
    const size_t row = (size_t)(s.nh + 2 * s.nkv) * s.hs, qk = (size_t)(s.nh + s.nkv) * s.hs, n = BT * row;
    const uint64_t seed = 2000 + s.hs * 13 + s.T + s.nh * 3 + s.nkv + packed * 7 + llama3 * 11 + shift;
    cpu::RopeSpec spec;
    if (llama3) {
        spec.theta = 500000.0;
        spec.scaling = cpu::ROPE_SCALING_LLAMA3;
        spec.factor = 32.0;
        spec.original_max_pos = 64;  // all three regimes at these head sizes
    }
    std::vector<float> cs((size_t)s.T * half * 2);
    cpu::rope_table(cs.data(), s.T, s.hs, spec);
    const std::vector<int> ds = doc_starts(s.B, s.T, packed, seed);
    const std::vector<float> x = floatX_round(random_vector(n, seed + 1));
    auto d_cs = to_device(cs);
    auto d_ds = to_device(ds);

    for (int dir = 0; dir < 2; dir++) {
        CAPTURE(dir);  // 0 forward, 1 backward
        std::vector<float> want = x;
        if (dir == 0) cpu::rope_forward<float>(want.data(), ds.data(), cs.data(), s.B, s.T, s.nh, s.nkv, s.hs);
        else cpu::rope_backward<float>(want.data(), ds.data(), cs.data(), s.B, s.T, s.nh, s.nkv, s.hs);
        DevFloatX d_qkv(x, shift);
        if (dir == 0) rope_forward(d_qkv.ptr(), *d_ds, *d_cs, s.B, s.T, s.nh, s.nkv, s.hs);
        else rope_backward(d_qkv.ptr(), *d_ds, *d_cs, s.B, s.T, s.nh, s.nkv, s.hs);
        const std::vector<float> got = d_qkv.get();
        // q and k: the rotation; v: untouched, bitwise
        std::vector<float> got_qk, want_qk;
        size_t v_changed = 0;
        for (int bt = 0; bt < BT; bt++)
            for (size_t c = 0; c < row; c++) {
                const size_t a = bt * row + c;
                if (c < qk) {
                    got_qk.push_back(got[a]);
                    want_qk.push_back(want[a]);
                } else {
                    v_changed += std::memcmp(&got[a], &x[a], sizeof(float)) != 0;
                }
            }
        check_floatX(dir == 0 ? "rope_forward q, k" : "rope_backward dq, dk", got_qk, want_qk);
        INFO("value-head elements changed: " << v_changed);
        CHECK(v_changed == 0);
        if (shift > 0) {  // the element before the tensor: still the poison
            const std::vector<floatX> all = download(d_qkv.buf);
            CHECK(std::isnan(floatX_to_float(all[0])));
        }
    }
}

TEST_CASE("rope_forward / rope_backward match the CPU twin (hs 64 and 128, GQA, packed rows, scalar path)") {
    const Shape shapes[] = {
        {2, 37, 4, 4, 64},     // MHA, hs 64 (16-byte path: 4 units per head)
        {3, 29, 8, 2, 64},     // GQA 4
        {2, 100, 12, 4, 128},  // GQA 3, hs 128
        {1, 257, 6, 1, 128},   // multi-query, T ragged
        {2, 19, 5, 5, 6},      // hs 6: odd half (scalar)
        {2, 23, 3, 1, 24},     // hs 24: half 12, not a multiple of 8 (scalar)
        {1, 5, 64, 64, 128},   // 128 heads x 8 units = 1024 threads across a token
        {1, 3, 96, 48, 128},   // 1152 units per token: the block's x loops
    };
    for (const Shape& s : shapes)
        for (bool packed : {false, true})
            for (size_t shift : {(size_t)0, (size_t)1}) check_rope(s, packed, /*llama3=*/packed, shift);
}

// small shapes for compute-sanitizer (scripts/device_check.sh: test_gpu -tc='sanitizer*')
TEST_CASE("sanitizer: rope forward and backward on small shapes") {
    for (size_t shift : {(size_t)0, (size_t)1}) {
        check_rope({2, 9, 4, 2, 64}, true, false, shift);
        check_rope({1, 7, 3, 1, 6}, true, true, shift);
    }
}

// Tensor parallelism: a rank's local heads (its q heads, its k heads, its v heads) rotated with the
// local counts give the bits of those heads in the full op
TEST_CASE("rope on a rank's head slice (tensor parallel) gives the full op's bits for those heads") {
    const int B = 2, T = 33, nh = 8, nkv = 4, hs = 64, tp = 2;
    const size_t row = (size_t)(nh + 2 * nkv) * hs;
    cpu::RopeSpec spec;
    std::vector<float> cs((size_t)T * hs);
    cpu::rope_table(cs.data(), T, hs, spec);
    const std::vector<int> ds = doc_starts(B, T, true, 77);
    const std::vector<float> x = floatX_round(random_vector((size_t)B * T * row, 78));
    auto d_cs = to_device(cs);
    auto d_ds = to_device(ds);
    DevFloatX full(x);
    rope_forward(full.ptr(), *d_ds, *d_cs, B, T, nh, nkv, hs);
    const std::vector<floatX> full_bits = full.raw();
    const int lnh = nh / tp, lnkv = nkv / tp;
    const size_t lrow = (size_t)(lnh + 2 * lnkv) * hs;
    for (int rank = 0; rank < tp; rank++) {
        CAPTURE(rank);
        auto slice = [&](const auto& v) {
            std::vector<std::decay_t<decltype(v[0])>> s((size_t)B * T * lrow);
            for (int bt = 0; bt < B * T; bt++) {
                auto src = v.begin() + bt * row;
                auto dst = s.begin() + bt * lrow;
                std::copy_n(src + (size_t)rank * lnh * hs, (size_t)lnh * hs, dst);
                std::copy_n(src + (size_t)(nh + rank * lnkv) * hs, (size_t)lnkv * hs, dst + (size_t)lnh * hs);
                std::copy_n(src + (size_t)(nh + nkv + rank * lnkv) * hs, (size_t)lnkv * hs, dst + (size_t)(lnh + lnkv) * hs);
            }
            return s;
        };
        DevFloatX local(slice(x));
        rope_forward(local.ptr(), *d_ds, *d_cs, B, T, lnh, lnkv, hs);
        CHECK(same_bytes(local.raw(), slice(full_bits)));
    }
}

}  // namespace rope_test
