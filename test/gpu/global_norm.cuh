// GPU global_norm_squared (llmc/global_norm.cuh) vs the CPU twin (llmc/cpu/global_norm.h).
#pragma once
#include <cstring>
#include <memory>
#include <vector>
#include "test/gpu/harness.cuh"
#include "llmc/cpu/global_norm.h"
#include "llmc/global_norm.cuh"

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
            const std::vector<float> x = bf16_round(random_vector(n, 300 + n + offset, 1.0f, 0.1f));
            // offset elements in front: a start that is not 16-byte aligned (head elements)
            std::vector<float> padded(offset, 1e3f);
            padded.insert(padded.end(), x.begin(), x.end());
            std::unique_ptr<DeviceBuffer<floatX>> d(to_device_bf16(padded));
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
    upload_bf16(d, std::vector<float>(8, -3.0f));
    CHECK(global_norm_squared(d.ptr + 5, 1) == 9.0);
    CHECK(global_norm_squared(d.ptr, 8) == 72.0);
}

TEST_CASE("global_norm: bitwise deterministic") {
    cuda_scratch_reserve(global_norm_scratch_bytes());
    const size_t n = (1 << 22) + 11;
    const std::vector<float> x = random_vector(n, 99, 1.0f);
    std::unique_ptr<DeviceBuffer<floatX>> d(to_device_bf16(x));
    const double a = global_norm_squared(d->ptr, n);
    for (int rep = 0; rep < 3; rep++) {
        const double b = global_norm_squared(d->ptr, n);
        CHECK(std::memcmp(&a, &b, sizeof(double)) == 0);
    }
    // without the first element: another (misaligned) partition, the same sum less one square
    const double x0 = __bfloat162float(__float2bfloat16(x[0]));
    const double c = global_norm_squared(d->ptr + 1, n - 1);
    CHECK(std::fabs(c - (a - x0 * x0)) / a < 1e-6);
}

}  // namespace global_norm_test
