// GPU rmsnorm_forward / fused_residual_rmsnorm_forward / rmsnorm_backward (llmc/ops/rmsnorm.cuh) vs the
// CPU twin (llmc/ops/cpu/rmsnorm.h).
//
// Tolerances as test/gpu/layernorm.cuh (the same kernels with the RMS flag): floatX outputs with
// check_floatX (bf16 1e-2, fp16 2e-3: one rounding plus fp32 reordering), rstd (fp32) relative max
// <= 1e-4 (tree vs sequential fp32 sums and rsqrtf), the fp32 weight gradient with check_f32 (1e-5) and
// the gradient-path contract bitwise (check_single_add). Inputs have an offset (mean ~2, std ~1), so a
// padded lane counted into the sum of squares or a wrong C in the mean moves rstd far beyond 1e-4.
#pragma once
#include <cstring>
#include <memory>
#include <string>
#include <vector>
#include "test/gpu/harness.cuh"
#include "llmc/ops/cpu/rmsnorm.h"
#include "llmc/ops/rmsnorm.cuh"

namespace rmsnorm_test {
using namespace gpu_test;

constexpr double STAT_TOL = 1e-4;

// one forward shape (plain and fused), `shift` elements into every allocation (1: the scalar path)
inline void check_forward(int C, int N, size_t shift, float eps) {
    CAPTURE(C);
    CAPTURE(N);
    CAPTURE(shift);
    CAPTURE(eps);
    const size_t nc = (size_t)N * C;
    const uint64_t seed = 900 + C * 7 + N + shift;
    const std::vector<float> x = floatX_round(random_vector(nc, seed, 1.0f, 2.0f));
    const std::vector<float> x2 = floatX_round(random_vector(nc, seed + 1, 0.5f, -0.3f));
    const std::vector<float> w = floatX_round(random_vector(C, seed + 2, 0.3f, 1.0f));
    DevFloatX d_x(x, shift), d_x2(x2, shift), d_w(w, shift), d_out(x, shift), d_res(x, shift);
    DeviceBuffer<float> d_rstd(N);

    // plain forward
    std::vector<float> want(nc), want_rstd(N);
    cpu::rmsnorm_forward<float>(want.data(), want_rstd.data(), x.data(), w.data(), N, C, eps);
    d_out.poison();
    d_rstd.poison();
    rmsnorm_forward(d_out.ptr(), d_rstd, d_x.ptr(), d_w.ptr(), N, C, eps);
    check_floatX("out", d_out.get(), want);
    CHECK_CLOSE("rstd", rel_max(download(d_rstd), want_rstd), STAT_TOL);

    // fused: residual = floatX(x + x2), normalised as stored, as the backward sees it
    std::vector<float> want_res(nc);
    cpu::fused_residual_rmsnorm_forward<float>(want_res.data(), want.data(), want_rstd.data(), x.data(), x2.data(),
                                               w.data(), N, C, eps);
    const std::vector<float> res_rounded = floatX_round(want_res);
    cpu::rmsnorm_forward<float>(want.data(), want_rstd.data(), res_rounded.data(), w.data(), N, C, eps);
    d_out.poison();
    d_res.poison();
    d_rstd.poison();
    fused_residual_rmsnorm_forward(d_res.ptr(), d_out.ptr(), d_rstd, d_x.ptr(), d_x2.ptr(), d_w.ptr(), N, C, eps);
    // the same fp32 sum of two floatX values, rounded once: bitwise floatX(x + x2)
    const std::vector<float> got_res = d_res.get();
    CHECK(std::memcmp(got_res.data(), res_rounded.data(), nc * sizeof(float)) == 0);
    check_floatX("residual", got_res, want_res);
    check_floatX("fused out", d_out.get(), want);
    CHECK_CLOSE("fused rstd", rel_max(download(d_rstd), want_rstd), STAT_TOL);
}

TEST_CASE("rmsnorm_forward and fused_residual_rmsnorm_forward match the CPU twin (ragged C, N, scalar path)") {
    for (int C : {7, 37, 768, 769, 1100, 3000, 4104, 8200})
        for (int N : {1, 5, 300})
            for (size_t shift : {(size_t)0, (size_t)1}) {
                if (shift == 1 && C > 4096) continue;  // the scalar path stops at C = 4096
                check_forward(C, N, shift, 1e-5f);
            }
    check_forward(768, 37, 0, 1e-6f);  // eps is the op's argument
    check_forward(37, 37, 1, 1e-6f);
}

// one backward shape on prefilled (accumulated) gradients
inline void check_backward(int C, int N, size_t shift) {
    CAPTURE(C);
    CAPTURE(N);
    CAPTURE(shift);
    const size_t nc = (size_t)N * C;
    const uint64_t seed = 1300 + C * 7 + N + shift;
    const float eps = 1e-5f;
    const std::vector<float> x = floatX_round(random_vector(nc, seed, 1.0f, 2.0f));
    const std::vector<float> w = floatX_round(random_vector(C, seed + 1, 0.3f, 1.0f));
    const std::vector<float> dout = floatX_round(random_vector(nc, seed + 3));
    // the prefills: dinp (the residual gradient so far), dweight of earlier micro-steps (fp32)
    const std::vector<float> dinp0 = floatX_round(random_vector(nc, seed + 4));
    const std::vector<float> dw0 = random_vector(C, seed + 5);
    // rstd from the CPU forward (the saved statistic both sides use)
    std::vector<float> y(nc), rstd(N);
    cpu::rmsnorm_forward<float>(y.data(), rstd.data(), x.data(), w.data(), N, C, eps);
    std::vector<float> want_dinp = dinp0, want_dw = dw0;
    cpu::rmsnorm_backward<float, float>(want_dinp.data(), want_dw.data(), dout.data(), x.data(), w.data(), rstd.data(),
                                        N, C);

    cuda_scratch_reserve(rmsnorm_scratch_bytes(N, C));
    DevFloatX d_x(x, shift), d_w(w, shift), d_dout(dout, shift), d_dinp(dinp0, shift);
    DevF32 d_dw(dw0, shift);
    DeviceBuffer<float> d_rstd(N);
    upload(d_rstd, rstd);
    rmsnorm_backward(d_dinp.ptr(), d_dw.ptr(), d_dout.ptr(), d_x.ptr(), d_w.ptr(), d_rstd, N, C);
    check_floatX("dinp", d_dinp.get(), want_dinp);
    check_f32("dweight", d_dw.get(), want_dw);

    // the split backward (zero-bubble pipeline): dinp alone (dweight untouched), then dweight alone
    // (weight not needed, dinp untouched): bitwise the one-call results
    const std::vector<float> one_dinp = d_dinp.get(), one_dw = d_dw.get();
    DevFloatX s_dinp(dinp0, shift);
    DevF32 s_dw(dw0, shift);
    rmsnorm_backward(s_dinp.ptr(), nullptr, d_dout.ptr(), d_x.ptr(), d_w.ptr(), d_rstd, N, C);
    CHECK(std::memcmp(s_dinp.get().data(), one_dinp.data(), nc * sizeof(float)) == 0);
    CHECK(std::memcmp(s_dw.get().data(), dw0.data(), C * sizeof(float)) == 0);
    rmsnorm_backward(nullptr, s_dw.ptr(), d_dout.ptr(), d_x.ptr(), nullptr, d_rstd, N, C);
    CHECK(std::memcmp(s_dw.get().data(), one_dw.data(), C * sizeof(float)) == 0);
    CHECK(std::memcmp(s_dinp.get().data(), one_dinp.data(), nc * sizeof(float)) == 0);
    // one add of a sum independent of the destination: into zeros, then dw0 + that
    DevF32 z_dw(std::vector<float>(C, 0.0f), shift);
    rmsnorm_backward(nullptr, z_dw.ptr(), d_dout.ptr(), d_x.ptr(), nullptr, d_rstd, N, C);
    check_single_add("dweight", dw0, one_dw, z_dw.get());
}

TEST_CASE("rmsnorm_backward accumulates like the CPU twin (ragged C, N, scalar path)") {
    for (int C : {7, 37, 768, 769, 1100, 3000, 4104, 8200})  // 8200: the 16-byte path's K 4
        for (int N : {1, 5, 300})
            for (size_t shift : {(size_t)0, (size_t)1}) {
                if (shift == 1 && C > 4096) continue;  // the scalar path stops at C = 4096
                check_backward(C, N, shift);
            }
}

// small shapes for compute-sanitizer (scripts/device_check.sh: test_gpu -tc='sanitizer*')
TEST_CASE("sanitizer: rmsnorm forward, fused forward and backward on small shapes") {
    for (int C : {37, 768})
        for (size_t shift : {(size_t)0, (size_t)1}) {
            check_forward(C, 5, shift, 1e-5f);
            check_backward(C, 5, shift);
        }
}

TEST_CASE("rmsnorm_backward is bitwise deterministic") {
    const int N = 4096 + 3, C = 768;
    const size_t nc = (size_t)N * C;
    const std::vector<float> x = random_vector(nc, 81, 1.0f, 0.5f);
    const std::vector<float> w = random_vector(C, 82, 0.3f, 1.0f);
    const std::vector<float> dout = random_vector(nc, 84), dinp0 = random_vector(nc, 85);
    const std::vector<float> dw0 = random_vector(C, 86);
    std::vector<float> y(nc), rstd(N);
    const std::vector<float> xr = floatX_round(x), wr = floatX_round(w);
    cpu::rmsnorm_forward<float>(y.data(), rstd.data(), xr.data(), wr.data(), N, C, 1e-5f);
    cuda_scratch_reserve(rmsnorm_scratch_bytes(N, C));
    std::unique_ptr<DeviceBuffer<floatX>> d_x(to_device_floatX(x)), d_w(to_device_floatX(w)), d_dout(to_device_floatX(dout));
    DeviceBuffer<float> d_rstd(N);
    upload(d_rstd, rstd);
    std::vector<std::vector<floatX>> dinp_runs;
    std::vector<std::vector<float>> dw_runs;
    for (int rep = 0; rep < 2; rep++) {
        std::unique_ptr<DeviceBuffer<floatX>> d_dinp(to_device_floatX(dinp0));
        std::unique_ptr<DeviceBuffer<float>> d_dw(to_device(dw0));
        rmsnorm_backward(*d_dinp, *d_dw, *d_dout, *d_x, *d_w, d_rstd, N, C);
        dinp_runs.push_back(download(*d_dinp));
        dw_runs.push_back(download(*d_dw));
    }
    CHECK(same_bytes(dinp_runs[0], dinp_runs[1]));
    CHECK(same_bytes(dw_runs[0], dw_runs[1]));
}

}  // namespace rmsnorm_test

// The plan's arena covers rmsnorm_scratch_bytes(N, C, SMs) (llmc/ops/op_scratch.h: one partial row per
// block, at most 16 blocks per SM, half of layernorm's bound); the RMS backward's real grid comes from its
// own kernels' occupancy: it must stay within the bound on this GPU, for both paths and every width.
TEST_CASE("rmsnorm_backward: its grid's scratch is within the plan's bound (llmc/ops/op_scratch.h)") {
    using namespace layernorm_detail;
    for (int C : {8, 37, 64, 256, 768, 1024, 2048, 4096, 8192, 16384})
        for (int N : {1, 7, 1000, 4096, 65536, 1 << 20})
            for (bool vec : {false, true}) {
                if (vec ? (C % 8 != 0 || C > 4 * 8 * BWD_MAX_X) : C > 4096) continue;
                CAPTURE(C);
                CAPTURE(N);
                CAPTURE(vec);
                const BackwardGrid g = backward_grid(N, C, vec, true);
                CHECK(g.shape.x * g.shape.y > 128);  // the bound's premise
                CHECK((size_t)g.blocks * C * sizeof(float) <= rmsnorm_scratch_bytes(N, C, sm_count()));
                CHECK(rmsnorm_scratch_bytes(N, C, sm_count()) <= layernorm_scratch_bytes(N, C, sm_count()));
            }
}
