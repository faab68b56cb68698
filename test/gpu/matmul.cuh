// GPU matmul (llmc/ops/matmul.cuh) vs the CPU twin (llmc/ops/cpu/matmul.h) in fp32 on the same bf16-rounded
// inputs. out and dinp: the GPU rounds them to bf16 (relative error <= 2^-9 per element, ~1e-3
// relative L2), and sums in a different order in fp32 (~1e-6), so:
//  - relative L2 <= gpu_test::FLOATX_TOL (1e-2)
//  - max-norm: max |got - want| / max |want| <= 1e-2: every element is within one bf16 rounding of
//    its exact value (<= 2^-8 of its own magnitude), so a single wrong or unwritten element in a
//    ragged edge, which relative L2 over a big tensor could hide, fails here.
// dweight and dbias are fp32 (the gradient-path contract): the same bf16-exact products summed in
// fp32 on both sides, so gpu_test::F32_TOL (1e-5); and bitwise, the op into the prefill equals the
// prefill + the op into zeros (one add per element), and no cached dweight plan splits K.
// From MATMUL_SPLITK_MIN_BT rows the dweight takes our own split over K (P chunk partials in the scratch
// arena, summed in chunk order, then one add): the same checks hold, the scratch is poisoned (NaN)
// before every backward (an unwritten partial shows), and the split matches the one-GEMM dweight
// within F32_TOL, the run-to-run bits, and its sum kernel the CPU twin bitwise.
// Scales are chosen so that every term matters: W ~ N(0, 1/C) makes out ~ N(0, 1) next to bias ~
// N(0, 1); dout ~ N(0, 1/BT) makes dout^T inp and the column sums ~ N(0, 1) next to the prefill ~
// N(0, 1) of the accumulated dweight and dbias (a missing bias or a lost += is an O(1) error).
#pragma once
#include <cstring>
#include <vector>
#include "test/gpu/harness.cuh"
#include "llmc/ops/cpu/matmul.h"
#include "llmc/ops/matmul.cuh"

namespace matmul_test {

using gpu_test::FLOATX_TOL;
using gpu_test::DevFloatX;
using gpu_test::DeviceBuffer;

constexpr double MAX_TOL = 1e-2;

// host inputs of one shape, already rounded through bf16
struct Inputs {
    int BT, C, OC;
    std::vector<float> inp, weight, bias, dout, dweight0, dbias0;
    Inputs(int BT_, int C_, int OC_, uint64_t seed) : BT(BT_), C(C_), OC(OC_) {
        using gpu_test::floatX_round;
        using gpu_test::random_vector;
        inp = floatX_round(random_vector((size_t)BT * C, seed + 1, 1.0f, 0.1f));
        weight = floatX_round(random_vector((size_t)OC * C, seed + 2, 1.0f / std::sqrt((float)C)));
        bias = floatX_round(random_vector(OC, seed + 3, 1.0f, 0.2f));
        // zero mean: a mean would add BT * mean to every column sum and drown the prefill
        dout = floatX_round(random_vector((size_t)BT * OC, seed + 4, 1.0f / std::sqrt((float)BT)));
        dweight0 = random_vector((size_t)OC * C, seed + 5);  // fp32 gradients: full fp32 values
        dbias0 = random_vector(OC, seed + 6);
    }
};

// the same shape's device tensors; the bias vectors always start 256-byte aligned (the epilogue's
// documented requirement is 16 bytes), the others `offset` elements into their allocation
struct Device {
    DevFloatX inp, weight, out, dout, dinp;
    gpu_test::DevF32 dweight;
    DeviceBuffer<floatX> bias;
    DeviceBuffer<float> dbias;
    Device(const Inputs& in, int offset)
        : inp((size_t)in.BT * in.C, offset), weight((size_t)in.OC * in.C, offset), out((size_t)in.BT * in.OC, offset),
          dout((size_t)in.BT * in.OC, offset), dinp((size_t)in.BT * in.C, offset),
          dweight((size_t)in.OC * in.C, offset), bias(in.OC), dbias(in.OC) {
        inp.upload(in.inp);
        weight.upload(in.weight);
        dout.upload(in.dout);
        gpu_test::upload_floatX(bias, in.bias);
        reset_grads(in);
    }
    // overwritten outputs poisoned, accumulated ones set to their prefill
    void reset_grads(const Inputs& in) {
        out.poison();
        dinp.poison();
        dweight.upload(in.dweight0);
        gpu_test::upload(dbias, in.dbias0);
    }
    void zero_grads() {
        cudaCheck(cudaMemset(dweight.ptr(), 0, dweight.n * sizeof(float)));
        cudaCheck(cudaMemset(dbias.ptr, 0, dbias.n * sizeof(float)));
    }
};

// the scratch arena reserved for one backward of this shape (the dbias partials, the split-K
// partials) and poisoned with NaN: the split's partials are written with beta = 0, never read first
inline void reserve_poisoned_scratch(int BT, int C, int OC) {
    cuda_scratch_reserve(matmul_backward_scratch_bytes(BT, C, OC));
    const CudaScratch& arena = cuda_scratch_arena();
    if (arena.bytes > 0) cudaCheck(cudaMemset(arena.base, 0xFF, arena.bytes));
}

inline void check_forward(const Inputs& in, bool with_bias, int offset) {
    INFO("matmul_forward BT=" << in.BT << " C=" << in.C << " OC=" << in.OC << " bias=" << with_bias
                              << " offset=" << offset);
    std::vector<float> want((size_t)in.BT * in.OC);
    cpu::matmul_forward<float>(want.data(), in.inp.data(), in.weight.data(), with_bias ? in.bias.data() : nullptr,
                               in.BT, in.C, in.OC);
    Device d(in, offset);
    matmul_forward(d.out.ptr(), d.inp.ptr(), d.weight.ptr(), with_bias ? d.bias.ptr : nullptr, in.BT, in.C, in.OC);
    cudaCheck(cudaDeviceSynchronize());
    std::vector<float> got = d.out.get();
    CHECK_CLOSE("out rel_l2", gpu_test::rel_l2(got, want), FLOATX_TOL);
    CHECK_CLOSE("out rel_max", gpu_test::rel_max(got, want), MAX_TOL);
}

// (split_k where BT splits: the op's split path, whose shorter fp32 sums stay within F32_TOL of the
// CPU; one GEMM over K >= 16384 does not: 1.3e-5 to 3.3e-5 on the H200, 2026-12-04, compared with
// the split path in the split-K test at 4 x F32_TOL)
inline void check_backward(const Inputs& in, bool with_dbias, int offset) {
    INFO("matmul_backward BT=" << in.BT << " C=" << in.C << " OC=" << in.OC << " dbias=" << with_dbias
                               << " offset=" << offset);
    const bool split_k = matmul_splitk_chunks(in.BT) > 1;
    std::vector<float> dinp((size_t)in.BT * in.C), dweight = in.dweight0, dbias = in.dbias0;
    cpu::matmul_backward<float>(dinp.data(), dweight.data(), with_dbias ? dbias.data() : nullptr, in.dout.data(),
                                in.inp.data(), in.weight.data(), in.BT, in.C, in.OC);
    Device d(in, offset);
    reserve_poisoned_scratch(in.BT, in.C, in.OC);
    matmul_backward(d.dinp.ptr(), d.dweight.ptr(), with_dbias ? d.dbias.ptr : nullptr, d.dout.ptr(), d.inp.ptr(),
                    d.weight.ptr(), in.BT, in.C, in.OC, split_k);
    cudaCheck(cudaDeviceSynchronize());
    std::vector<float> got_dinp = d.dinp.get(), got_dweight = d.dweight.get();
    CHECK_CLOSE("dinp rel_l2", gpu_test::rel_l2(got_dinp, dinp), FLOATX_TOL);
    CHECK_CLOSE("dinp rel_max", gpu_test::rel_max(got_dinp, dinp), MAX_TOL);
    gpu_test::check_f32("dweight", got_dweight, dweight);
    std::vector<float> got_dbias = gpu_test::download(d.dbias);
    // without dbias the prefill must be untouched (bitwise)
    gpu_test::check_f32("dbias", got_dbias, dbias, with_dbias ? gpu_test::F32_TOL : 0.0);
    CHECK(matmul_fp32_plans_max_split_k() == 1);
    // one add of a sum that does not depend on the destination: the same op into zeros
    Device z(in, offset);
    z.zero_grads();
    matmul_backward(nullptr, z.dweight.ptr(), with_dbias ? z.dbias.ptr : nullptr, z.dout.ptr(), z.inp.ptr(), nullptr,
                    in.BT, in.C, in.OC, split_k);
    gpu_test::check_single_add("dweight", in.dweight0, got_dweight, z.dweight.get());
    if (with_dbias) gpu_test::check_single_add("dbias", in.dbias0, got_dbias, gpu_test::download(z.dbias));

    // the split backward (zero-bubble pipeline): dinp alone, then dweight + dbias alone, each call
    // leaving the other outputs untouched: bitwise the one-call results
    Device s(in, offset);
    matmul_backward(s.dinp.ptr(), nullptr, nullptr, s.dout.ptr(), s.inp.ptr(), s.weight.ptr(), in.BT, in.C, in.OC);
    cudaCheck(cudaDeviceSynchronize());
    CHECK(s.dinp.get() == got_dinp);
    CHECK(s.dweight.get() == Device(in, offset).dweight.get());  // untouched
    s.dinp.poison();
    const std::vector<float> poisoned = s.dinp.get();
    matmul_backward(nullptr, s.dweight.ptr(), with_dbias ? s.dbias.ptr : nullptr, s.dout.ptr(), s.inp.ptr(), nullptr,
                    in.BT, in.C, in.OC, split_k);
    cudaCheck(cudaDeviceSynchronize());
    CHECK(gpu_test::same_bytes(s.dweight.get(), got_dweight));
    CHECK(gpu_test::same_bytes(gpu_test::download(s.dbias), got_dbias));
    CHECK(std::memcmp(s.dinp.get().data(), poisoned.data(), poisoned.size() * sizeof(float)) == 0);  // NaN != NaN
}

struct Shape {
    int BT, C, OC;
};
// ragged (nothing a multiple of a tile or vector), GPT-like, OC = 1, a wide-but-short dweight
// product that invites split-K (k = BT = 8192 against a 128 x 96 output), and OC % 8 == 0 with a
// partial 256-column strip and a partial 256-row chunk in the dbias kernel
inline std::vector<Shape> shapes() {
    return {{7, 37, 19}, {1000, 768, 2304}, {513, 129, 1}, {8192, 128, 96}, {300, 64, 296}, {1, 768, 768}};
}

// Split-K dweight shapes (BT >= MATMUL_SPLITK_MIN_BT): P = 4 whole chunks with the 16-byte sum kernel;
// a shorter last chunk (37 rows) after 6 whole ones; a ragged one (a last chunk of 1001 rows, C * OC
// odd: the scalar sum kernel) that also runs 2-byte aligned operands.
inline std::vector<Shape> split_shapes() {
    return {{MATMUL_SPLITK_MIN_BT, 128, 96},
            {MATMUL_SPLITK_MIN_BT + 2 * MATMUL_SPLITK_ROWS + 37, 64, 40},
            {MATMUL_SPLITK_MIN_BT + 1001, 37, 19}};
}

}  // namespace matmul_test

TEST_CASE("matmul_forward vs cpu, with and without bias") {
    matmul_setup();
    uint64_t seed = 100;
    for (const matmul_test::Shape& s : matmul_test::shapes()) {
        matmul_test::Inputs in(s.BT, s.C, s.OC, seed += 10);
        matmul_test::check_forward(in, true, 0);
        matmul_test::check_forward(in, false, 0);
    }
}

TEST_CASE("matmul_backward vs cpu: dinp overwritten, fp32 dweight and dbias accumulated with one add") {
    matmul_setup();
    uint64_t seed = 200;
    for (const matmul_test::Shape& s : matmul_test::shapes()) {
        matmul_test::Inputs in(s.BT, s.C, s.OC, seed += 10);
        matmul_test::check_backward(in, true, 0);
    }
    matmul_test::Inputs in(7, 37, 19, 299);
    matmul_test::check_backward(in, false, 0);  // dbias = nullptr
}

TEST_CASE("matmul: pointers only 2-byte aligned (cuBLASLt alignment preferences, scalar dbias path)") {
    // every tensor but the bias vectors one element into its allocation; OC % 8 == 0 would take the
    // 16-byte dbias path if dout were aligned
    for (const matmul_test::Shape& s : {matmul_test::Shape{64, 768, 256}, matmul_test::Shape{7, 37, 19}}) {
        matmul_test::Inputs in(s.BT, s.C, s.OC, 300 + s.C);
        matmul_test::check_forward(in, true, 1);
        matmul_test::check_backward(in, true, 1);
    }
}

TEST_CASE("matmul: bitwise deterministic, plans cached per shape") {
    for (const matmul_test::Shape& s : {matmul_test::Shape{1000, 768, 2304}, matmul_test::Shape{8192, 128, 96},
                                        matmul_test::Shape{513, 129, 1}}) {
        INFO("BT=" << s.BT << " C=" << s.C << " OC=" << s.OC);
        matmul_test::Inputs in(s.BT, s.C, s.OC, 400 + s.C);
        matmul_test::Device d(in, 0);
        matmul_test::reserve_poisoned_scratch(s.BT, s.C, s.OC);
        std::vector<floatX> out[2], dinp[2];
        std::vector<float> dweight[2], dbias[2];
        size_t plans_after_first = 0;
        for (int run = 0; run < 2; run++) {
            d.reset_grads(in);
            matmul_forward(d.out.ptr(), d.inp.ptr(), d.weight.ptr(), d.bias.ptr, s.BT, s.C, s.OC);
            matmul_backward(d.dinp.ptr(), d.dweight.ptr(), d.dbias.ptr, d.dout.ptr(), d.inp.ptr(), d.weight.ptr(), s.BT,
                            s.C, s.OC);
            out[run] = d.out.raw();
            dinp[run] = d.dinp.raw();
            dweight[run] = d.dweight.get();
            dbias[run] = gpu_test::download(d.dbias);
            if (run == 0) plans_after_first = matmul_cached_plans();
        }
        CHECK(gpu_test::same_bytes(out[0], out[1]));
        CHECK(gpu_test::same_bytes(dinp[0], dinp[1]));
        CHECK(gpu_test::same_bytes(dweight[0], dweight[1]));
        CHECK(gpu_test::same_bytes(dbias[0], dbias[1]));
        CHECK(matmul_cached_plans() == plans_after_first);  // the second step made no heuristic query
    }
}

TEST_CASE("matmul: misaligned bias fails clearly; teardown then lazy setup gives the same bits") {
    matmul_test::Inputs in(7, 37, 19, 500);
    matmul_test::Device d(in, 0);
    CHECK_THROWS_AS(matmul_forward(d.out.ptr(), d.inp.ptr(), d.weight.ptr(), d.bias.ptr + 1, in.BT, in.C, in.OC),
                    LlmcError);

    matmul_forward(d.out.ptr(), d.inp.ptr(), d.weight.ptr(), d.bias.ptr, in.BT, in.C, in.OC);
    std::vector<floatX> before = d.out.raw();
    matmul_teardown();
    CHECK(matmul_cached_plans() == 0);
    matmul_teardown();  // idempotent
    d.out.poison();
    matmul_forward(d.out.ptr(), d.inp.ptr(), d.weight.ptr(), d.bias.ptr, in.BT, in.C, in.OC);  // sets up again
    CHECK(gpu_test::same_bytes(before, d.out.raw()));
    matmul_setup();  // idempotent
}

TEST_CASE("matmul_backward split-K dweight: vs cpu, one add, bitwise run to run, vs one GEMM, scratch checked") {
    using namespace matmul_test;
    uint64_t seed = 700;
    for (const Shape& s : split_shapes()) {
        const int P = matmul_splitk_chunks(s.BT);
        const int offset = s.C % 8 == 0 ? 0 : 1;
        INFO("BT=" << s.BT << " C=" << s.C << " OC=" << s.OC << " P=" << P << " offset=" << offset);
        REQUIRE(P == (s.BT + MATMUL_SPLITK_ROWS - 1) / MATMUL_SPLITK_ROWS);
        REQUIRE(P >= 4);  // the split is taken at these BT
        Inputs in(s.BT, s.C, s.OC, seed += 10);
        // every output vs the CPU twin (dweight: F32_TOL), the single add, the zero-bubble split calls
        check_backward(in, true, offset);

        Device d(in, offset);
        auto dweight_after = [&](auto&& op) {  // dweight from its prefill, the scratch poisoned first
            d.reset_grads(in);
            reserve_poisoned_scratch(s.BT, s.C, s.OC);
            op();
            return d.dweight.get();
        };
        auto split = [&] {
            matmul_backward(nullptr, d.dweight.ptr(), nullptr, d.dout.ptr(), d.inp.ptr(), nullptr, s.BT, s.C, s.OC,
                            /*split_k*/ true);
        };
        const std::vector<float> first = dweight_after(split), second = dweight_after(split);
        CHECK(gpu_test::same_bytes(first, second));  // run to run
        // the one-GEMM dweight (split_k = false, and the internal entry with no chunking: the same)
        const std::vector<float> one_gemm = dweight_after([&] {
            matmul_backward(nullptr, d.dweight.ptr(), nullptr, d.dout.ptr(), d.inp.ptr(), nullptr, s.BT, s.C, s.OC,
                            /*split_k*/ false);
        });
        const std::vector<float> one_gemm_internal = dweight_after([&] {
            matmul_detail::dweight_grad(d.dweight.ptr(), d.dout.ptr(), d.inp.ptr(), s.BT, s.C, s.OC, 0);
        });
        CHECK(gpu_test::same_bytes(one_gemm, one_gemm_internal));
        // two fp32 summation orders of the same ~2e4 products, each within F32_TOL of the CPU: their
        // difference is within the sum of both (the H200, 2026-12-04: up to 1.7e-5 rel L2, 3.0e-5 max)
        gpu_test::check_f32("dweight split vs one GEMM", first, one_gemm, 4 * gpu_test::F32_TOL);
        CHECK(matmul_fp32_plans_max_split_k() == 1);  // no cuBLASLt split-K in the partials' batched plan

        // an arena one float short of the partials fails clearly, before any work; nothing written
        d.reset_grads(in);
        const CudaScratch arena = cuda_scratch_arena();
        const size_t need = matmul_splitk_scratch_bytes(s.BT, s.C, s.OC);
        REQUIRE(arena.bytes >= need);
        cuda_scratch_bind(arena.base, need - sizeof(float));
        CHECK_THROWS_AS(split(), LlmcError);
        cuda_scratch_bind(nullptr, 0);  // back to the reserved arena
        CHECK(gpu_test::same_bytes(d.dweight.get(), in.dweight0));
    }
}

TEST_CASE("matmul_dweight_reduce vs cpu::matmul_dweight_reduce: bitwise, 16-byte and scalar paths") {
    uint64_t seed = 800;
    for (int P : {1, 3, 8})
        for (size_t n : {(size_t)4096 + 64, (size_t)1001})
            for (int offset : {0, 1}) {
                INFO("P=" << P << " n=" << n << " offset=" << offset);
                const std::vector<float> partials = gpu_test::random_vector((size_t)P * n, seed += 10);
                std::vector<float> want = gpu_test::random_vector(n, seed + 5);
                gpu_test::DevF32 d_partials(partials, offset), d_dweight(want, offset);
                cpu::matmul_dweight_reduce(want.data(), partials.data(), P, n);
                matmul_dweight_reduce(d_dweight.ptr(), d_partials.ptr(), P, n);
                CHECK(gpu_test::same_bytes(d_dweight.get(), want));
            }
}

// small shapes for compute-sanitizer (scripts/device_check.sh: test_gpu -tc='sanitizer*'): the fp32
// dweight product, the 16-byte and the scalar dbias paths, aligned and 2-byte aligned operands
TEST_CASE("sanitizer: matmul forward and backward (fp32 dweight, dbias), small shapes") {
    for (const matmul_test::Shape& s : {matmul_test::Shape{7, 37, 19}, matmul_test::Shape{300, 64, 296}})
        for (int offset : {0, 1}) {
            matmul_test::Inputs in(s.BT, s.C, s.OC, 600 + s.C + offset);
            matmul_test::check_forward(in, true, offset);
            matmul_test::check_backward(in, true, offset);
        }
}

// the split-K dweight under compute-sanitizer: the partials' batched GEMM, the shorter last chunk,
// the sum kernel's 16-byte (C * OC = 960, aligned) and scalar (offset 1) paths
TEST_CASE("sanitizer: matmul split-K dweight (partials, last chunk, sum kernel)") {
    for (int offset : {0, 1}) {
        matmul_test::Inputs in(MATMUL_SPLITK_MIN_BT + 37, 40, 24, 900 + offset);
        matmul_test::check_backward(in, true, offset);
    }
}
