// GPU grad_accumulate (llmc/ops/accumulate.cuh) vs the CPU twin (llmc/ops/cpu/accumulate.h): fp32
// leaves into an fp32 accumulator. Exact equality: each element is one fp32 addition rounded to
// nearest on both sides, so any difference in any bit is a bug (a wrong element, a missed or
// doubled element, an addition done in lower precision). Elements outside [0, n) of the accumulator
// and of the leaf are poisoned and must come back untouched (a read of the leaf's poison would make
// a NaN inside).
#pragma once
#include <cstring>
#include <vector>
#include "test/gpu/harness.cuh"
#include "llmc/ops/cpu/accumulate.h"
#include "llmc/ops/accumulate.cuh"

namespace accumulate_test {
using namespace gpu_test;

constexpr size_t PAD = 9;  // poisoned fp32 elements after the accumulator's last element

// An fp32 accumulator of n elements placed `offset` elements into its allocation, the allocation
// poisoned (NaN bytes) first, so that writes before or after [0, n) show.
struct DevAcc {
    DeviceBuffer<float> buf;
    size_t n, offset;
    DevAcc(const std::vector<float>& h, size_t off) : buf(off + h.size() + PAD), n(h.size()), offset(off) {
        buf.poison();
        if (n) cudaCheck(cudaMemcpy(ptr(), h.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    }
    float* ptr() const { return buf.ptr + offset; }
    std::vector<float> all() const { return download(buf); }
};

// The poison (0xFFFFFFFF) still in place outside [offset, offset + n)?
inline size_t touched_outside(const std::vector<float>& all, size_t offset, size_t n) {
    size_t bad = 0;
    for (size_t i = 0; i < all.size(); i++) {
        if (i >= offset && i < offset + n) continue;
        uint32_t u;
        std::memcpy(&u, &all[i], 4);
        bad += u != 0xffffffffu;
    }
    return bad;
}

// Three accumulations (three micro-batches) into a random fp32 accumulator; the leaves x are at
// x_offset elements into their (poisoned) allocation, the accumulator at acc_offset.
inline void check_against_cpu(size_t n, size_t acc_offset, size_t x_offset) {
    CAPTURE(n);
    CAPTURE(acc_offset);
    CAPTURE(x_offset);
    // the accumulator: full fp32 values, never zero
    std::vector<float> want = random_vector(n, 500 + n + acc_offset, 0.1f);
    DevAcc acc(want, acc_offset);
    for (int micro = 0; micro < 3; micro++) {
        // leaves of varying scale, so that the sums round (the fp32 addition is not exact)
        const std::vector<float> x = random_vector(n, 900 + 7 * n + micro, 0.01f * (micro + 1));
        DevAcc dx(x, x_offset);
        grad_accumulate(acc.ptr(), dx.ptr(), n);
        cpu::grad_accumulate<float>(want.data(), x.data(), n);
        CHECK(touched_outside(dx.all(), x_offset, n) == 0);
    }
    const std::vector<float> all = acc.all();
    size_t differ = 0;
    for (size_t i = 0; i < n; i++) differ += std::memcmp(&all[acc_offset + i], &want[i], 4) != 0;
    INFO("elements that differ from the CPU twin (bitwise): " << differ << " of " << n);
    CHECK(differ == 0);
    INFO("poisoned elements outside [0, n) that were written");
    CHECK(touched_outside(all, acc_offset, n) == 0);
}

TEST_CASE("grad_accumulate: bitwise equal to the CPU twin (vector and scalar paths, odd n, offsets)") {
    // (acc, x) offsets in elements: (0, 0) and (4, 8) are 16-byte aligned (vector path, the second
    // not at the allocation's start); the others leave one or both pointers misaligned (scalar path)
    const size_t offsets[][2] = {{0, 0}, {4, 8}, {1, 1}, {0, 1}, {1, 0}, {4, 4}, {2, 8}};
    for (size_t n : {(size_t)0, (size_t)1, (size_t)7, (size_t)8, (size_t)9, (size_t)1003, (size_t)(1 << 20) + 5})
        for (const auto& o : offsets) check_against_cpu(n, o[0], o[1]);
}

// The vector and scalar paths on the same inputs: identical bits (so which one a slice takes does
// not change training), and the large grid-stride case (more vectors than one wave of threads).
TEST_CASE("grad_accumulate: vector and scalar paths write identical bits (large n)") {
    const size_t n = (size_t)(1 << 24) + 3;
    const std::vector<float> a = random_vector(n, 61, 0.1f), x = random_vector(n, 62, 0.05f);
    DevAcc va(a, 0), sa(a, 0), dx(x, 0);
    grad_accumulate_launch(true, va.ptr(), dx.ptr(), n);
    grad_accumulate_launch(false, sa.ptr(), dx.ptr(), n);
    const std::vector<float> v = va.all(), s = sa.all();
    CHECK(same_bytes(v, s));
    std::vector<float> want = a;
    cpu::grad_accumulate<float>(want.data(), x.data(), n);
    CHECK(std::memcmp(v.data(), want.data(), n * 4) == 0);
    CHECK(touched_outside(v, 0, n) == 0);
}

// small shapes for compute-sanitizer: the vector and scalar paths
TEST_CASE("sanitizer: grad_accumulate fp32, vector and scalar paths, small n") {
    for (size_t n : {(size_t)9, (size_t)1003}) {
        check_against_cpu(n, 0, 0);
        check_against_cpu(n, 1, 0);
        check_against_cpu(n, 0, 1);
    }
}

}  // namespace accumulate_test
