// Helpers for the GPU tests (test/test_gpu.cu includes this, then one test/gpu/<family>.cuh per
// kernel family). Pattern of every kernel test:
//   1. random inputs on the host (never zero: normal(0,1) + small offsets), fp32
//   2. the CPU twin (cpu::<op>, llmc/ops/cpu/<op>.h) on the bf16-rounded inputs, in fp32
//   3. inputs to the device as bf16, outputs poisoned first (NaN bytes), the GPU op, copy back
//   4. compare with check_floatX (bf16 outputs: relative L2 <= 1e-2 AND max-norm error, so one wrong
//      row cannot hide in a large tensor's norm) or rel_max (fp32 statistics: ~1e-5..1e-3)
// The weight gradients (fp32, accumulated with one add per element: the gradient-path contract)
// are checked on a random NON-zero destination with check_f32 (F32_TOL: both sides sum the same
// bf16-exact products in fp32, only the order differs) and, bitwise, with check_single_add: the op
// into a prefill acc equals acc + (the op into zeros), elementwise in fp32 (DevF32 buffers).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>
#include <doctest/doctest.h>
#include "llmc/ops/cuda_common.cuh"
#include "llmc/rand.h"

namespace gpu_test {

inline std::vector<float> random_vector(size_t n, uint64_t seed, float std = 1.0f, float offset = 0.0f) {
    Rng rng(seed);
    std::vector<float> v(n);
    for (float& x : v) {
        x = rng.normal(offset, std);
        if (x == 0.0f) x = 1e-3f;  // never exactly zero
    }
    return v;
}

// round through floatX (bf16 / fp16), so the CPU reference sees exactly what the GPU sees
inline std::vector<float> floatX_round(const std::vector<float>& v) {
    std::vector<float> r(v.size());
    for (size_t i = 0; i < v.size(); i++) r[i] = floatX_to_float(float_to_floatX(v[i]));
    return r;
}

// device buffer, freed on scope exit
template <typename T>
struct DeviceBuffer {
    T* ptr = nullptr;
    size_t n = 0;
    explicit DeviceBuffer(size_t count) : n(count) { cudaCheck(cudaMalloc(&ptr, std::max<size_t>(1, n) * sizeof(T))); }
    ~DeviceBuffer() { cudaFree(ptr); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    operator T*() const { return ptr; }
    void poison() { cudaCheck(cudaMemset(ptr, 0xFF, n * sizeof(T))); }  // 0xFFFF is a NaN in bf16 and in fp16, 0xFFFFFFFF in fp32
};

// fp32 <-> floatX host vectors (round to nearest even)
inline std::vector<floatX> to_floatX(const std::vector<float>& v) {
    std::vector<floatX> h(v.size());
    for (size_t i = 0; i < v.size(); i++) h[i] = float_to_floatX(v[i]);
    return h;
}
inline std::vector<float> from_floatX(const std::vector<floatX>& h) {
    std::vector<float> v(h.size());
    for (size_t i = 0; i < h.size(); i++) v[i] = floatX_to_float(h[i]);
    return v;
}

// a device copy of h (of v as bf16)
template <typename T>
inline std::unique_ptr<DeviceBuffer<T>> to_device(const std::vector<T>& h) {
    auto d = std::make_unique<DeviceBuffer<T>>(h.size());
    if (!h.empty()) cudaCheck(cudaMemcpy(d->ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}
inline std::unique_ptr<DeviceBuffer<floatX>> to_device_floatX(const std::vector<float>& v) {
    return to_device(to_floatX(v));
}

template <typename T>
inline void upload(DeviceBuffer<T>& d, const std::vector<T>& h) {
    REQUIRE(h.size() == d.n);
    cudaCheck(cudaMemcpy(d.ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}
inline void upload_floatX(DeviceBuffer<floatX>& d, const std::vector<float>& v) { upload(d, to_floatX(v)); }

template <typename T>
inline std::vector<T> download(const DeviceBuffer<T>& d) {
    cudaCheck(cudaDeviceSynchronize());
    std::vector<T> h(d.n);
    cudaCheck(cudaMemcpy(h.data(), d.ptr, d.n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}
inline std::vector<float> download_floatX(const DeviceBuffer<floatX>& d) { return from_floatX(download(d)); }

// A device tensor of n elements (T: bf16 or fp32, read and written as fp32 host vectors) placed
// `offset` elements into its allocation: offset 1 makes the pointer 2 (bf16) or 4 (fp32) mod 16 bytes,
// which forces the scalar (non 16-byte) paths even when the length is a multiple of the vector width;
// offset 0 keeps cudaMalloc's 256-byte alignment. Poisoned (NaN) at creation, the elements before
// the tensor included. DevFloatX: the activations; DevF32: the weight gradients.
template <typename T>
struct DevTensor {
    DeviceBuffer<T> buf;
    size_t n, offset;
    DevTensor(size_t count, size_t off = 0) : buf(count + off), n(count), offset(off) { buf.poison(); }
    DevTensor(const std::vector<float>& v, size_t off = 0) : DevTensor(v.size(), off) { upload(v); }
    T* ptr() const { return buf.ptr + offset; }
    void upload(const std::vector<float>& v) {
        REQUIRE(v.size() == n);
        if constexpr (std::is_same_v<T, float>) {
            cudaCheck(cudaMemcpy(ptr(), v.data(), n * sizeof(T), cudaMemcpyHostToDevice));
        } else {
            const std::vector<T> h = to_floatX(v);
            cudaCheck(cudaMemcpy(ptr(), h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
        }
    }
    std::vector<T> raw() const {  // the bits, for bitwise comparisons
        cudaCheck(cudaDeviceSynchronize());
        std::vector<T> h(n);
        cudaCheck(cudaMemcpy(h.data(), ptr(), n * sizeof(T), cudaMemcpyDeviceToHost));
        return h;
    }
    std::vector<float> get() const {
        if constexpr (std::is_same_v<T, float>) return raw();
        else return from_floatX(raw());
    }
    void poison() { buf.poison(); }
};
using DevFloatX = DevTensor<floatX>;
using DevF32 = DevTensor<float>;

// bitwise equal (the determinism checks: two runs of an op on the same inputs)
template <typename T>
inline bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// ||got - want|| / ||want||; any NaN (an element the kernel did not write) gives +inf
inline double rel_l2(const std::vector<float>& got, const std::vector<float>& want) {
    REQUIRE(got.size() == want.size());
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); i++) {
        if (!std::isfinite(got[i])) return INFINITY;
        num += (double)(got[i] - want[i]) * (got[i] - want[i]);
        den += (double)want[i] * want[i];
    }
    return std::sqrt(num / std::max(den, 1e-30));
}

// max |got - want| / max |want|; NaN gives +inf
inline double rel_max(const std::vector<float>& got, const std::vector<float>& want) {
    REQUIRE(got.size() == want.size());
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); i++) {
        if (!std::isfinite(got[i])) return INFINITY;
        num = std::max(num, (double)std::fabs(got[i] - want[i]));
        den = std::max(den, (double)std::fabs(want[i]));
    }
    return num / std::max(den, 1e-30);
}

// CHECK with the tensor name and the error in the message
#define CHECK_CLOSE(what, err, tol)                                              \
    do {                                                                         \
        double e_ = (err);                                                       \
        INFO((what) << ": error " << e_ << " (tolerance " << (tol) << ")");      \
        CHECK(e_ <= (tol));                                                      \
    } while (0)

// Tolerances of floatX outputs, per precision. bf16: relative L2 1e-2; the max-norm error
// max |got - want| / max |want| of one op's outputs: every element is within one bf16 rounding
// (2^-8 of its magnitude at most) plus fp32 reordering of its sums, so 1e-2 holds, while a single
// wrong or unwritten element of typical size is an O(0.1..1) error here (relative L2 over n elements
// only sees it as ~1/sqrt(n)). fp16 (the -DLLMC_FP16 build) keeps 3 more mantissa bits (a rounding is
// 2^-11 at most, 8x finer), so 2e-3 for both: the same margin over the roundings at about 1/5 of bf16's
// tolerance.
#ifdef LLMC_FP16
constexpr double FLOATX_TOL = 2e-3;
constexpr double FLOATX_MAX_TOL = 2e-3;
#else
constexpr double FLOATX_TOL = 1e-2;
constexpr double FLOATX_MAX_TOL = 1e-2;
#endif

// The floatX comparison used by every GPU test: relative L2 over the tensor and the worst element
// relative to the tensor's largest magnitude, both reported under the tensor's name.
inline void check_floatX(const std::string& what, const std::vector<float>& got, const std::vector<float>& want,
                       double l2_tol = FLOATX_TOL, double max_tol = FLOATX_MAX_TOL) {
    const double l2 = rel_l2(got, want), mx = rel_max(got, want);
    INFO(what << ": rel_l2 " << l2 << " (tolerance " << l2_tol << "), rel_max " << mx << " (tolerance " << max_tol
              << ")");
    CHECK(l2 <= l2_tol);
    CHECK(mx <= max_tol);
}

// fp32 outputs summed from bf16-exact inputs in fp32 on both sides (the weight gradients): the
// sums differ only by fp32 reordering (~k * 2^-24 of the terms' magnitude at worst, far less for
// random signs), so 1e-5 relative; a lost prefill or a bf16 rounding is O(1) or ~4e-3 here.
constexpr double F32_TOL = 1e-5;
inline void check_f32(const std::string& what, const std::vector<float>& got, const std::vector<float>& want,
                      double tol = F32_TOL) {
    const double l2 = rel_l2(got, want), mx = rel_max(got, want);
    INFO(what << ": rel_l2 " << l2 << ", rel_max " << mx << " (tolerance " << tol << ")");
    CHECK(l2 <= tol);
    CHECK(mx <= tol);
}

// The contract's single add, bitwise: got_acc (the op into the prefill acc0) == acc0 + got_zero
// (the same op into zeros), one fp32 addition per element
inline void check_single_add(const std::string& what, const std::vector<float>& acc0, const std::vector<float>& got_acc,
                             const std::vector<float>& got_zero) {
    REQUIRE(acc0.size() == got_acc.size());
    REQUIRE(acc0.size() == got_zero.size());
    size_t differ = 0;
    for (size_t i = 0; i < acc0.size(); i++) {
        const float want = acc0[i] + got_zero[i];
        differ += std::memcmp(&want, &got_acc[i], sizeof(float)) != 0;
    }
    INFO(what << ": op(acc) vs acc + op(0), elements that differ bitwise: " << differ << " of " << acc0.size());
    CHECK(differ == 0);
}

}  // namespace gpu_test
