// GPU AdamW (llmc/ops/adamw.cuh) vs the CPU twin (llmc/ops/cpu/adamw.h), and the stochastic rounding of
// the bf16 params: neighbours of the fp32 result, unbiased, reproducible per seed.
#pragma once
#include <cstdint>
#include <cstring>
#include <vector>
#include "test/gpu/harness.cuh"
#include "llmc/ops/cpu/adamw.h"
#include "llmc/ops/adamw.cuh"

namespace adamw_test {
using namespace gpu_test;

// The CPU twin is gaining a trailing `seed` argument (meaningless for fp32 params). Call whichever
// signature llmc/ops/cpu/adamw.h has: the first overload exists only when the 14-argument call
// compiles (and wins by the int/long tie-break), the second is the 13-argument form.
template <typename T>
auto cpu_adamw_call(int, T* params, const float* grads, float* m, float* v, size_t n, float lr, float b1, float b2,
                    float eps, float wd, float gs, int t, uint64_t seed)
    -> decltype(cpu::adamw_update(params, (float*)nullptr, grads, m, v, n, lr, b1, b2, eps, wd, gs, t, seed), void()) {
    cpu::adamw_update(params, (float*)nullptr, grads, m, v, n, lr, b1, b2, eps, wd, gs, t, seed);
}
template <typename T>
void cpu_adamw_call(long, T* params, const float* grads, float* m, float* v, size_t n, float lr, float b1, float b2,
                    float eps, float wd, float gs, int t, uint64_t) {
    cpu::adamw_update(params, (float*)nullptr, grads, m, v, n, lr, b1, b2, eps, wd, gs, t);
}
inline void cpu_adamw(float* params, const float* grads, float* m, float* v, size_t n, float lr, float b1, float b2,
                      float eps, float wd, float gs, int t) {
    cpu_adamw_call<float>(0, params, grads, m, v, n, lr, b1, b2, eps, wd, gs, t, 0);
}

struct Hyper {
    float lr = 1e-2f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, wd = 0.0f, grad_scale = 1.0f;
    int t = 1;
};

inline uint32_t bits(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return u;
}
inline float from_bits(uint32_t u) {
    float x;
    std::memcpy(&x, &u, 4);
    return x;
}
// floatX as fp32 bits (x normal in floatX): the fp32 mantissa bits below floatX's (bf16 7 kept: 16
// dropped; fp16 10 kept: 13 dropped); SR_ONE is one floatX ulp in those bits
#ifdef LLMC_FP16
constexpr int SR_KEPT = 10;
#else
constexpr int SR_KEPT = 7;
#endif
constexpr uint32_t SR_ONE = 1u << (23 - SR_KEPT), SR_LOW = SR_ONE - 1;
// Is q (a floatX value, as float) one of the two floatX values around x: x truncated toward zero, or
// the next floatX away from zero; exactly x when x is a floatX? (finite x, normal in floatX; sign-magnitude bits)
inline bool is_floatX_neighbour(float q, float x) {
    const uint32_t bx = bits(x), lo = bx & ~SR_LOW;
    if ((bx & SR_LOW) == 0) return bits(q) == bx;
    return bits(q) == lo || bits(q) == lo + SR_ONE;
}
// the spacing of floatX values at |x| (x normal): 2^(exponent - kept mantissa bits)
inline double floatX_ulp(float x) { return std::ldexp(1.0, std::ilogb(x) - SR_KEPT); }

// Optimizer state of n elements in host fp32, all nonzero; v > 0. The grads are full fp32 values
// (the fp32 gradient accumulator), deliberately not bf16-representable: a kernel that rounded them
// to bf16 (up to 2^-9 relative) would move m and v by ~1e-4 relative, far outside the tolerances.
struct State {
    std::vector<float> master, grads, m, v;
    State(size_t n, uint64_t seed) {
        master = random_vector(n, seed, 0.5f);
        grads = random_vector(n, seed + 1, 1.0f);
        m = random_vector(n, seed + 2, 0.1f);
        std::vector<float> r = random_vector(n, seed + 3, 0.1f);
        v.resize(n);
        for (size_t i = 0; i < n; i++) v[i] = r[i] * r[i] + 1e-4f;
    }
};

// Device copy of a State; `offset` elements of padding in front of every array (offset 1 makes
// every pointer misaligned: the scalar path).
struct DeviceState {
    size_t n, offset;
    DeviceBuffer<floatX> params;
    DeviceBuffer<float> grads, master, m, v;
    DeviceState(const State& s, size_t off)
        : n(s.m.size()), offset(off), params(n + off), grads(n + off), master(n + off), m(n + off), v(n + off) {
        put(grads, s.grads);
        put_floatX(params, s.master);  // the bf16 params the no-master path starts from: RN(master)
        put(master, s.master);
        put(m, s.m);
        put(v, s.v);
    }
    template <typename T>
    void put(DeviceBuffer<T>& d, const std::vector<T>& h) {
        cudaCheck(cudaMemcpy(d.ptr + offset, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
    }
    void put_floatX(DeviceBuffer<floatX>& d, const std::vector<float>& h) {
        std::vector<floatX> b(n);
        for (size_t i = 0; i < n; i++) b[i] = float_to_floatX(h[i]);
        cudaCheck(cudaMemcpy(d.ptr + offset, b.data(), n * sizeof(floatX), cudaMemcpyHostToDevice));
    }
    template <typename T>
    std::vector<T> get(const DeviceBuffer<T>& d) const {
        cudaCheck(cudaDeviceSynchronize());
        std::vector<T> h(n);
        cudaCheck(cudaMemcpy(h.data(), d.ptr + offset, n * sizeof(T), cudaMemcpyDeviceToHost));
        return h;
    }
    std::vector<float> get_params() const {
        std::vector<floatX> b = get(params);
        std::vector<float> f(n);
        for (size_t i = 0; i < n; i++) f[i] = floatX_to_float(b[i]);
        return f;
    }
    void update(bool with_master, const Hyper& h, uint64_t seed) {
        adamw_update(params.ptr + offset, with_master ? master.ptr + offset : nullptr, grads.ptr + offset,
                     m.ptr + offset, v.ptr + offset, n, h.lr, h.beta1, h.beta2, h.eps, h.wd, h.grad_scale, h.t, seed);
        cudaCheck(cudaDeviceSynchronize());
    }
};

// a and b (of the same n) hold bitwise the same fp32 state (m, v, master) and, with params, the same
// bf16 params (another seed rounds the params otherwise)
inline void check_same_state(const DeviceState& a, const DeviceState& b, bool params = true) {
    REQUIRE(a.n == b.n);
    const size_t n = a.n;
    if (params) CHECK(std::memcmp(a.get(a.params).data(), b.get(b.params).data(), n * sizeof(floatX)) == 0);
    CHECK(std::memcmp(a.get(a.m).data(), b.get(b.m).data(), n * sizeof(float)) == 0);
    CHECK(std::memcmp(a.get(a.v).data(), b.get(b.v).data(), n * sizeof(float)) == 0);
    CHECK(std::memcmp(a.get(a.master).data(), b.get(b.master).data(), n * sizeof(float)) == 0);
}

// One update on the GPU vs the CPU twin. Tolerance on master, m, v: the GPU evaluates the twin's
// expression in the twin's order with IEEE round-to-nearest intrinsics (independent of fast-math),
// so they agree bit for bit unless the host compiler fuses a*b+c into an fma; that costs at most
// a couple of fp32 ulps (~2.4e-7 relative to the largest element), hence 1e-6.
inline void check_against_cpu(size_t n, bool with_master, const Hyper& h, size_t offset) {
    CAPTURE(n);
    CAPTURE(with_master);
    CAPTURE(offset);
    CAPTURE(h.t);
    CAPTURE(h.wd);
    CAPTURE(h.grad_scale);
    CAPTURE(h.eps);
    State s(n, 1000 + n);
    DeviceState d(s, offset);
    if (with_master) d.params.poison();  // the master path only writes the bf16 params
    d.update(with_master, h, 0x1234abcdull + n);

    // the twin runs on fp32 params = the starting point of the GPU: the master, or the bf16 params
    std::vector<float> p = with_master ? s.master : floatX_round(s.master);
    std::vector<float> m = s.m, v = s.v;
    cpu_adamw(p.data(), s.grads.data(), m.data(), v.data(), n, h.lr, h.beta1, h.beta2, h.eps, h.wd, h.grad_scale, h.t);

    CHECK_CLOSE("m", rel_max(d.get(d.m), m), 1e-6);
    CHECK_CLOSE("v", rel_max(d.get(d.v), v), 1e-6);
    const std::vector<float> params = d.get_params();
    size_t not_neighbour = 0, not_nearest = 0;
    if (with_master) {
        const std::vector<float> master = d.get(d.master);
        CHECK_CLOSE("master", rel_max(master, p), 1e-6);
        // the update itself (lr-sized) must match too, not only the parameter it is added to
        std::vector<float> step_gpu(n), step_cpu(n);
        for (size_t i = 0; i < n; i++) {
            step_gpu[i] = master[i] - s.master[i];
            step_cpu[i] = p[i] - s.master[i];
        }
        // each step is a difference of two fp32 params of size ~1: an fp32 ulp (~2e-7) against the
        // largest of n steps ~lr = 1e-2 (n >= 1000 so that the largest step is not accidentally tiny)
        if (n >= 1000) CHECK_CLOSE("master - master_before", rel_max(step_gpu, step_cpu), 1e-4);
        for (size_t i = 0; i < n; i++) {
            not_neighbour += !is_floatX_neighbour(params[i], master[i]);
            not_nearest += params[i] != floatX_to_float(float_to_floatX(master[i]));
        }
    } else {
        // the GPU's fp32 p is not visible here: neighbour of the twin's p, with one fp32 ulp of slack
        for (size_t i = 0; i < n; i++) {
            not_neighbour += !(std::fabs((double)params[i] - p[i]) < floatX_ulp(p[i]) * (1.0 + 1e-4));
            not_nearest += params[i] != floatX_to_float(float_to_floatX(p[i]));
        }
    }
    INFO("bf16 params that are not a bf16 neighbour of the fp32 result: " << not_neighbour);
    CHECK(not_neighbour == 0);
    // stochastic, not round-to-nearest: P(SR != RN) = E[min(f, 1 - f)] ~ 1/4 for a fraction f
    // uniform in [0, 1); for n >= 1000 fewer than n/10 would be a > 10 sigma event
    if (n >= 1000) {
        INFO("params that differ from round-to-nearest: " << not_nearest << " of " << n);
        CHECK(not_nearest > n / 10);
    }
}

TEST_CASE("adamw: matches the CPU twin (master weights and bf16-only, ragged n, t, wd, grad_scale)") {
    std::vector<Hyper> hypers(4);
    hypers[1].t = 7;
    hypers[1].wd = 0.1f;
    hypers[2].t = 7;
    hypers[2].wd = 0.1f;
    hypers[2].grad_scale = 0.37f;
    hypers[3].t = 1;
    hypers[3].grad_scale = 2.5f;
    hypers[3].eps = 1e-2f;  // eps comparable to sqrt(v): its place in the formula shows
    for (size_t n : {(size_t)1, (size_t)7, (size_t)8, (size_t)1003, (size_t)(1 << 20) + 5})
        for (bool with_master : {true, false})
            for (const Hyper& h : hypers) check_against_cpu(n, with_master, h, 0);
}

TEST_CASE("adamw: misaligned pointers (scalar path) match the CPU twin") {
    Hyper h;
    h.t = 7;
    h.wd = 0.1f;
    h.grad_scale = 0.5f;
    for (size_t n : {(size_t)5, (size_t)1003, (size_t)65541})
        for (bool with_master : {true, false}) check_against_cpu(n, with_master, h, 1);
}

// Each element's random bits are a function of seed + index: a call on a slice [k, n) with
// seed + k must write what the whole-buffer call writes there, whether the slice takes the vector
// path (k % 8 == 0) or the scalar path (k odd: misaligned pointers). This also checks that the two
// paths compute identical bits.
TEST_CASE("adamw: slices with seed + offset reproduce the whole-buffer update bitwise") {
    const size_t n = 10007;
    Hyper h;
    h.t = 3;
    h.wd = 0.1f;
    h.grad_scale = 0.8f;
    const uint64_t seed = 0xfeedfacecafebeefull;
    for (bool with_master : {true, false}) {
        State s(n, 77);
        DeviceState whole(s, 0);
        whole.update(with_master, h, seed);
        for (size_t k : {(size_t)4096, (size_t)4097, (size_t)3}) {
            CAPTURE(with_master);
            CAPTURE(k);
            DeviceState parts(s, 0);
            floatX* pm = parts.params.ptr;
            float* ms = with_master ? parts.master.ptr : nullptr;
            adamw_update(pm, ms, parts.grads.ptr, parts.m.ptr, parts.v.ptr, k, h.lr, h.beta1, h.beta2, h.eps, h.wd,
                         h.grad_scale, h.t, seed);
            adamw_update(pm + k, ms ? ms + k : nullptr, parts.grads.ptr + k, parts.m.ptr + k, parts.v.ptr + k, n - k,
                         h.lr, h.beta1, h.beta2, h.eps, h.wd, h.grad_scale, h.t, seed + k);
            check_same_state(whole, parts);  // (without master weights, master is the untouched initial state)
        }
    }
}

// fp32 grads 8 bytes past a 16-byte boundary while every other pointer is aligned: the vector path
// would issue misaligned float4 loads (a launch error), so adamw_update must check the grads'
// alignment as fp32 and take the scalar path, which writes the same bits as the aligned call.
TEST_CASE("adamw: fp32 grads alone not 16-byte aligned take the scalar path, same bits") {
    const size_t n = 10007;
    Hyper h;
    h.t = 4;
    h.wd = 0.1f;
    h.grad_scale = 0.6f;
    const uint64_t seed = 0xabcdef12345ull;
    for (bool with_master : {true, false}) {
        CAPTURE(with_master);
        State s(n, 31);
        DeviceState aligned(s, 0), shifted(s, 0);
        aligned.update(with_master, h, seed);
        DeviceBuffer<float> g(n + 2);  // grads at g + 2: 8 mod 16 bytes
        cudaCheck(cudaMemcpy(g.ptr + 2, s.grads.data(), n * sizeof(float), cudaMemcpyHostToDevice));
        adamw_update(shifted.params.ptr, with_master ? shifted.master.ptr : nullptr, g.ptr + 2, shifted.m.ptr,
                     shifted.v.ptr, n, h.lr, h.beta1, h.beta2, h.eps, h.wd, h.grad_scale, h.t, seed);
        check_same_state(aligned, shifted);
    }
}

TEST_CASE("adamw: bitwise reproducible for a seed, params (only) change with the seed") {
    const size_t n = 100003;
    Hyper h;
    h.t = 7;
    h.wd = 0.1f;
    for (bool with_master : {true, false}) {
        CAPTURE(with_master);
        State s(n, 5);
        DeviceState a(s, 0), b(s, 0), c(s, 0);
        a.update(with_master, h, 42);
        b.update(with_master, h, 42);
        c.update(with_master, h, 43);
        check_same_state(a, b);
        // another seed: the same fp32 state, other rounding decisions. An element differs with
        // probability 2 f (1 - f) (~1/3 for uniform f); n/10 is far below that.
        check_same_state(a, c, false);
        const std::vector<floatX> pa = a.get(a.params), pc = c.get(c.params);
        size_t differ = 0;
        for (size_t i = 0; i < n; i++) differ += std::memcmp(&pa[i], &pc[i], sizeof(floatX)) != 0;
        INFO("params that differ between seeds 42 and 43: " << differ << " of " << n);
        CHECK(differ > n / 10);
    }
}

// Unbiasedness. p is the fp32 value to be rounded, the same for all N draws (every element has the
// same state), with fraction f = (|p| - lo) / ulp in [0, 1) (lo: p truncated to bf16). Rounding
// away from lo is a Bernoulli(f) draw, so the mean over N draws of |param - lo| / ulp has mean f
// and standard deviation sqrt(f (1 - f) / N) (<= 1.6e-3 for N = 1e5, i.e. we resolve the bias to a
// few 1e-3 ulp). Each value must pass |mean - f| < 5 sigma (false alarm ~6e-7 per check); all
// values of a test together pass sum of z^2 < 30 (~chi-square with 4-5 degrees of freedom: false
// alarm < 1e-4), which catches a small bias common to all of them.
inline double sr_z(float p, const std::vector<float>& rounded) {
    const float lo = from_bits(bits(p) & ~SR_LOW);
    const double ulp = std::fabs((double)from_bits((bits(p) & ~SR_LOW) + SR_ONE) - lo);
    double sum = 0;
    size_t bad = 0;
    for (float q : rounded) {
        bad += !is_floatX_neighbour(q, p);
        sum += std::fabs((double)q - lo) / ulp;
    }
    CHECK(bad == 0);
    const double f = (bits(p) & SR_LOW) / (double)SR_ONE, N = (double)rounded.size();
    const double mean = sum / N, sigma = std::sqrt(f * (1 - f) / N);
    INFO("p = " << p << " f = " << f << " mean rounded away from lo = " << mean << " sigma = " << sigma);
    if (f == 0) {  // p is a bf16: every draw must return it
        CHECK(sum == 0);
        return 0;
    }
    CHECK(std::fabs(mean - f) < 5 * sigma);
    return (mean - f) / sigma;
}

// n elements with one and the same state (starting value x as master and as RN(x) bf16 param)
inline State uniform_state(size_t n, float x) {
    State s(n, 1);
    for (size_t i = 0; i < n; i++) {
        s.master[i] = x;
        s.grads[i] = 0.75f;  // a bf16
        s.m[i] = 0.05f;
        s.v[i] = 0.01f;
    }
    return s;
}

// values with chosen fractions (master path with lr = 0 and no decay: p = x exactly)
inline std::vector<float> sr_values() {
    return {
        from_bits(0x3f800000u + (uint32_t)(0.3 * SR_ONE)),                // 1 + 0.3 ulp
        from_bits(0xbfc00000u + (uint32_t)(0.687 * SR_ONE)),              // -(1.5 + 0.687 ulp): rounds in magnitude
        from_bits(0x40000000u - SR_ONE + (uint32_t)(0.8 * SR_ONE)),       // just below 2: rounding up crosses into the next binade
        from_bits(0x3c23d70au),           // 0.01
    };
}

TEST_CASE("adamw: stochastic rounding is unbiased over indices (master and bf16-only paths)") {
    const size_t N = 100000;
    const uint64_t seed = 2024;
    // master path: lr = 0, no decay, so p - 0 * p = p and p - 0 * step = p: the params are roundings
    // of x itself
    {
        Hyper h;
        h.lr = 0.0f;
        double chi2 = 0;
        for (float x : sr_values()) {
            DeviceState d(uniform_state(N, x), 0);
            d.params.poison();
            d.update(true, h, seed);
            const std::vector<float> master = d.get(d.master);
            CHECK(std::memcmp(&master[0], &x, 4) == 0);
            const double z = sr_z(x, d.get_params());
            chi2 += z * z;
        }
        CHECK(chi2 < 30);
    }
    // bf16-only path: starts from the bf16 param b = RN(x) and takes a real step; the fp32 p it
    // rounds is read from the master path run on master = b (the same code on the same inputs)
    {
        Hyper h;
        h.t = 2;
        h.wd = 0.1f;
        double chi2 = 0;
        for (float x : {0.3f, -0.7f, 1.1f, -2.9f, 0.02f}) {
            const float b = floatX_to_float(float_to_floatX(x));
            DeviceState ref(uniform_state(N, b), 0);
            ref.update(true, h, seed);
            const std::vector<float> master = ref.get(ref.master);
            size_t same = 0;
            for (float q : master) same += std::memcmp(&q, &master[0], 4) == 0;
            REQUIRE(same == N);
            DeviceState d(uniform_state(N, b), 0);
            d.update(false, h, seed);
            const double z = sr_z(master[0], d.get_params());
            chi2 += z * z;
        }
        CHECK(chi2 < 30);
    }
}

TEST_CASE("adamw: stochastic rounding is unbiased over seeds") {
    // 400 seeds x 250 elements = 1e5 draws per value; the seeds are far apart (not seed + 1, which
    // would only shift the bits by one element)
    const size_t n = 250;
    Hyper h;
    h.lr = 0.0f;
    double chi2 = 0;
    for (float x : sr_values()) {
        std::vector<float> rounded;
        DeviceState d(uniform_state(n, x), 0);
        for (uint64_t k = 0; k < 400; k++) {
            d.update(true, h, 0x9e3779b97f4a7c15ull * (k + 1));
            const std::vector<float> p = d.get_params();
            rounded.insert(rounded.end(), p.begin(), p.end());
        }
        const double z = sr_z(x, rounded);
        chi2 += z * z;
    }
    CHECK(chi2 < 30);
}

// small shapes for compute-sanitizer: fp32 gradients on the vector and the scalar path (misaligned),
// with and without master weights
TEST_CASE("sanitizer: adamw with fp32 gradients, vector and scalar paths, small n") {
    Hyper h;
    h.t = 3;
    h.wd = 0.1f;
    for (size_t n : {(size_t)9, (size_t)1003})
        for (bool with_master : {true, false})
            for (size_t offset : {(size_t)0, (size_t)1}) check_against_cpu(n, with_master, h, offset);
}

// The multi-tensor step (adamw_update_pieces): pieces of a flat state, of ragged sizes (one element,
// a chunk and a bit, many chunks), 16-byte aligned and not (odd starts: the scalar path), decaying
// or not, with gaps between them and more pieces than one launch takes, updated in one call: every
// array bitwise what one adamw_update per piece (seed + its table offset, its weight decay) writes,
// the gaps untouched; and the CPU twin's m, v within the tolerance above.
inline void check_pieces(bool with_master, int n_pieces, uint64_t seed) {
    CAPTURE(with_master);
    CAPTURE(n_pieces);
    Rng rng(seed);
    std::vector<cpu::AdamwPiece> pieces;
    size_t at = 0;
    for (int k = 0; k < n_pieces; k++) {
        const size_t sizes[] = {1, 7, 8, 37, 1000, ADAMW_CHUNK + 5, 3 * ADAMW_CHUNK};
        const size_t n = sizes[rng.below(7)];
        at += rng.below(3);  // a gap of 0..2 elements: 16-byte aligned or not
        pieces.push_back({at, at, at, n, 17 * at + 5, rng.below(2) == 0});
        at += n;
    }
    const size_t total = at + 3;
    Hyper h;
    h.t = 4;
    h.wd = 0.1f;
    h.grad_scale = 0.7f;
    State st(total, seed + 1);
    DeviceState one(st, 0), per(st, 0);
    adamw_update_pieces(one.params.ptr, with_master ? one.master.ptr : nullptr, one.grads.ptr, one.m.ptr, one.v.ptr,
                        pieces.data(), (int)pieces.size(), h.lr, h.beta1, h.beta2, h.eps, h.wd, h.grad_scale, h.t, seed);
    for (const cpu::AdamwPiece& u : pieces)
        adamw_update(per.params.ptr + u.param, with_master ? per.master.ptr + u.state : nullptr, per.grads.ptr + u.grad,
                     per.m.ptr + u.state, per.v.ptr + u.state, u.n, h.lr, h.beta1, h.beta2, h.eps,
                     u.decay ? h.wd : 0.0f, h.grad_scale, h.t, seed + u.offset);
    CHECK(same_bytes(one.get(one.params), per.get(per.params)));
    CHECK(same_bytes(one.get(one.master), per.get(per.master)));
    CHECK(same_bytes(one.get(one.m), per.get(per.m)));
    CHECK(same_bytes(one.get(one.v), per.get(per.v)));
    // the gaps keep their state
    const std::vector<float> m1 = one.get(one.m);
    std::vector<char> inside(total, 0);
    for (const cpu::AdamwPiece& u : pieces) std::fill(inside.begin() + u.param, inside.begin() + u.param + u.n, 1);
    size_t touched = 0;
    for (size_t i = 0; i < total; i++) touched += !inside[i] && std::memcmp(&m1[i], &st.m[i], 4) != 0;
    CHECK(touched == 0);
    // the twin (fp32 params: the GPU's starting point, master or the bf16 params)
    std::vector<float> p = with_master ? st.master : floatX_round(st.master), m = st.m, v = st.v;
    cpu::adamw_update_pieces<float>(p.data(), nullptr, st.grads.data(), m.data(), v.data(), pieces.data(),
                                    (int)pieces.size(), h.lr, h.beta1, h.beta2, h.eps, h.wd, h.grad_scale, h.t, seed);
    CHECK_CLOSE("m (twin)", rel_max(m1, m), 1e-6);
    CHECK_CLOSE("v (twin)", rel_max(one.get(one.v), v), 1e-6);
}

TEST_CASE("adamw_update_pieces: bitwise one adamw_update per piece, gaps untouched, a few launches") {
    for (bool with_master : {true, false}) {
        check_pieces(with_master, 5, 71);
        check_pieces(with_master, ADAMW_MAX_PIECES + 13, 72);  // two launches
    }
}

TEST_CASE("sanitizer: adamw_update_pieces, aligned and odd pieces, two launches") {
    check_pieces(true, ADAMW_MAX_PIECES + 3, 81);
    check_pieces(false, 4, 82);
}

}  // namespace adamw_test
