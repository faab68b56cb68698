// GPU global_norm_squared (llmc/ops/global_norm.cuh) vs the CPU twin (llmc/ops/cpu/global_norm.h), for bf16
// values and for fp32 values (the fp32 gradient accumulator).
#pragma once
#include <cstring>
#include <memory>
#include <vector>
#include "test/gpu/harness.cuh"
#include "llmc/ops/cpu/global_norm.h"
#include "llmc/ops/global_norm.cuh"

namespace global_norm_test {
using namespace gpu_test;

// Tolerance 1e-6 relative: the squares of bf16 values are exact in fp32; the only fp32 roundings
// are the sums of 8 squares per 16-byte vector (positive terms: relative error < 8 * 2^-24 = 4.8e-7
// each, so < 4.8e-7 for the total), the rest is double, as in the twin.
TEST_CASE("global_norm: sum of squares matches the CPU twin (ragged n, misaligned start, large n)") {
    cuda_scratch_reserve(global_norm_scratch_bytes());
    for (size_t n : {(size_t)1, (size_t)7, (size_t)8, (size_t)1000, (size_t)(1 << 20) + 3, (size_t)(1 << 23) + 5})
        for (size_t offset : {(size_t)0, (size_t)1, (size_t)3}) {
            CAPTURE(n);
            CAPTURE(offset);
            const std::vector<float> x = floatX_round(random_vector(n, 300 + n + offset, 1.0f, 0.1f));
            // offset elements in front: a start that is not 16-byte aligned (head elements)
            std::vector<float> padded(offset, 1e3f);
            padded.insert(padded.end(), x.begin(), x.end());
            std::unique_ptr<DeviceBuffer<floatX>> d(to_device_floatX(padded));
            const double want = cpu::global_norm_squared<float>(x.data(), n);
            const double got = global_norm_squared(d->ptr + offset, n);
            INFO("got " << got << " want " << want);
            CHECK(std::isfinite(got));
            CHECK_CLOSE("sum of squares", std::fabs(got - want) / want, 1e-6);
        }
}

TEST_CASE("global_norm: n = 0 gives 0, and a single value its square") {
    cuda_scratch_reserve(global_norm_scratch_bytes());
    DeviceBuffer<floatX> d(8);
    CHECK(global_norm_squared(d.ptr, 0) == 0.0);
    upload_floatX(d, std::vector<float>(8, -3.0f));
    CHECK(global_norm_squared(d.ptr + 5, 1) == 9.0);
    CHECK(global_norm_squared(d.ptr, 8) == 72.0);
}

TEST_CASE("global_norm: bitwise deterministic") {
    cuda_scratch_reserve(global_norm_scratch_bytes());
    const size_t n = (1 << 22) + 11;
    const std::vector<float> x = random_vector(n, 99, 1.0f);
    std::unique_ptr<DeviceBuffer<floatX>> d(to_device_floatX(x));
    const double a = global_norm_squared(d->ptr, n);
    for (int rep = 0; rep < 3; rep++) {
        const double b = global_norm_squared(d->ptr, n);
        CHECK(std::memcmp(&a, &b, sizeof(double)) == 0);
    }
    // without the first element: another (misaligned) partition, the same sum less one square
    const double x0 = floatX_to_float(float_to_floatX(x[0]));
    const double c = global_norm_squared(d->ptr + 1, n - 1);
    CHECK(std::fabs(c - (a - x0 * x0)) / a < 1e-6);
}

// ------------------------------------------------------------------------------------------------
// fp32 values (the trainer's fp32 gradient accumulator): squares and sums in double on both sides

// n fp32 values at `offset` elements into a device allocation whose other elements are NaN: a read
// outside [0, n) makes the sum NaN. offset 1..3 gives a start that is not 16-byte aligned (head).
struct DevF32 {
    DeviceBuffer<float> buf;
    size_t offset;
    DevF32(const std::vector<float>& x, size_t off) : buf(off + x.size() + 5), offset(off) {
        buf.poison();
        if (!x.empty()) cudaCheck(cudaMemcpy(ptr(), x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
    }
    float* ptr() const { return buf.ptr + offset; }
};

// Tolerance 1e-11 relative: every square is exact in double on both sides (24-bit significands), so
// the two differ only in the order of the double additions of positive terms. Recursive summation
// of k positive terms is off by at most (k - 1) 2^-53 relative: the twin adds chunks of 16384 and
// then <= 513 chunk sums (< 1.9e-12 for n <= 2^23 + 5), the GPU a few dozen terms per thread and two
// trees (< 1e-14). An fp32 square or fp32 partial sum would be off by ~1e-8 on the small sizes.
TEST_CASE("global_norm fp32: sum of squares matches the CPU twin (n = 1..odd..large, misaligned starts)") {
    cuda_scratch_reserve(global_norm_scratch_bytes());
    for (size_t n : {(size_t)1, (size_t)2, (size_t)3, (size_t)4, (size_t)5, (size_t)7, (size_t)8, (size_t)1000,
                     (size_t)1001, (size_t)(1 << 20) + 3, (size_t)(1 << 23) + 5})
        for (size_t offset : {(size_t)0, (size_t)1, (size_t)2, (size_t)3}) {
            CAPTURE(n);
            CAPTURE(offset);
            // full fp32 values (not bf16-representable): their squares are not exact in fp32
            const std::vector<float> x = random_vector(n, 700 + n + offset, 1.0f, 0.1f);
            DevF32 d(x, offset);
            const double want = cpu::global_norm_squared<float>(x.data(), n);
            const double got = global_norm_squared(d.ptr(), n);
            INFO("got " << got << " want " << want);
            CHECK(std::isfinite(got));
            CHECK_CLOSE("sum of squares (fp32)", std::fabs(got - want) / want, 1e-11);
        }
}

// x = +-(1 + 2^-23): x^2 = 1 + 2^-22 + 2^-46 needs 47 bits, so it is not an fp32 but is a double,
// and k x^2 for k < 64 spans 52 bits: every partial sum of any grouping is exact in double. The
// GPU must return exactly k x^2 for every n and start, whatever its partition; an fp32 square
// (1 + 2^-22) or fp32 partial sum would show in the last bits.
TEST_CASE("global_norm fp32: exact for values whose squares need double (n = 0..60, every start)") {
    cuda_scratch_reserve(global_norm_scratch_bytes());
    const float x = 1.0f + std::ldexp(1.0f, -23);
    const double x2 = (double)x * (double)x;
    REQUIRE((double)(float)x2 != x2);  // the square is not an fp32
    for (size_t offset : {(size_t)0, (size_t)1, (size_t)2, (size_t)3})
        for (size_t n = 0; n <= 60; n++) {
            CAPTURE(offset);
            CAPTURE(n);
            std::vector<float> v(n);
            for (size_t i = 0; i < n; i++) v[i] = i % 3 == 1 ? -x : x;
            DevF32 d(v, offset);
            const double got = global_norm_squared(d.ptr(), n);
            INFO("got " << got << " want " << (double)n * x2);
            CHECK(got == (double)n * x2);
        }
}

TEST_CASE("global_norm fp32: bitwise deterministic, and n = 0 gives 0") {
    cuda_scratch_reserve(global_norm_scratch_bytes());
    const size_t n = (1 << 22) + 11;
    const std::vector<float> x = random_vector(n, 98, 1.0f);
    DevF32 d(x, 0);
    CHECK(global_norm_squared(d.ptr(), 0) == 0.0);
    const double a = global_norm_squared(d.ptr(), n);
    for (int rep = 0; rep < 3; rep++) {
        const double b = global_norm_squared(d.ptr(), n);
        CHECK(std::memcmp(&a, &b, sizeof(double)) == 0);
    }
    // without the first element: another (misaligned) partition, the same sum less one square
    const double c = global_norm_squared(d.ptr() + 1, n - 1);
    CHECK(std::fabs(c - (a - (double)x[0] * x[0])) / a < 1e-11);
}

// small shapes for compute-sanitizer: bf16 and fp32 values, aligned and misaligned starts
TEST_CASE("sanitizer: global_norm bf16 and fp32, small n, misaligned starts") {
    cuda_scratch_reserve(global_norm_scratch_bytes());
    for (size_t n : {(size_t)7, (size_t)1001})
        for (size_t offset : {(size_t)0, (size_t)3}) {
            const std::vector<float> x = random_vector(n, 900 + n + offset, 1.0f, 0.1f);
            DevF32 d(x, offset);
            const double want = cpu::global_norm_squared<float>(x.data(), n);
            CHECK_CLOSE("sum of squares (fp32)", std::fabs(global_norm_squared(d.ptr(), n) - want) / want, 1e-11);
            const std::vector<float> xb = floatX_round(x);
            std::vector<float> padded(offset, 1e3f);
            padded.insert(padded.end(), xb.begin(), xb.end());
            std::unique_ptr<DeviceBuffer<floatX>> db(to_device_floatX(padded));
            const double want_b = cpu::global_norm_squared<float>(xb.data(), n);
            CHECK_CLOSE("sum of squares", std::fabs(global_norm_squared(db->ptr + offset, n) - want_b) / want_b, 1e-6);
        }
}

// Many ranges at once (the trainer's gradient norm): each range's sum bitwise global_norm_squared
// of it alone (the same partition), over more ranges than one launch takes, aligned and not, ragged
// and large; one host sync for all of them; and the CPU twin within 1e-11.
inline void check_ranges(int count, uint64_t seed) {
    CAPTURE(count);
    cuda_scratch_reserve(global_norm_scratch_bytes());
    Rng rng(seed);
    std::vector<size_t> offsets, ns;
    size_t at = 0;
    for (int k = 0; k < count; k++) {
        const size_t sizes[] = {1, 3, 4, 1001, 70000, (size_t)(1 << 20) + 3};
        at += rng.below(4);  // misaligned starts
        offsets.push_back(at);
        ns.push_back(sizes[rng.below(k % 9 == 0 ? 6 : 5)]);
        at += ns.back();
    }
    const std::vector<float> x = random_vector(at, seed + 1, 1.0f, 0.1f);
    DevF32 d(x, 0);
    std::vector<const float*> ptrs;
    for (size_t o : offsets) ptrs.push_back(d.ptr() + o);
    std::vector<double> got(count), twin(count);
    // once before counting: a first call with more ranges than before grows the pinned landing
    // area (one more sync, once), as the trainer's first step does
    global_norm_squared_ranges(got.data(), ptrs.data(), ns.data(), count);
    const uint64_t syncs = gpu_counters().host_syncs;
    global_norm_squared_ranges(got.data(), ptrs.data(), ns.data(), count);
    CHECK(gpu_counters().host_syncs == syncs + 1);
    std::vector<const float*> hptrs;
    for (size_t o : offsets) hptrs.push_back(x.data() + o);
    cpu::global_norm_squared_ranges(twin.data(), hptrs.data(), ns.data(), count);
    for (int k = 0; k < count; k++) {
        CAPTURE(k);
        const double alone = global_norm_squared(ptrs[k], ns[k]);
        CHECK(std::memcmp(&alone, &got[k], sizeof(double)) == 0);
        CHECK(std::fabs(got[k] - twin[k]) / twin[k] < 1e-11);
    }
}

TEST_CASE("global_norm_squared_ranges: each range bitwise alone, two launches, one host sync") {
    check_ranges(7, 31);
    check_ranges(GN_MAX_RANGES + 9, 32);
}

TEST_CASE("sanitizer: global_norm_squared_ranges, small ranges, misaligned starts") { check_ranges(GN_MAX_RANGES + 2, 41); }

}  // namespace global_norm_test
