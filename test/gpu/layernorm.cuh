// GPU layernorm_forward / fused_residual_layernorm_forward / layernorm_backward (llmc/ops/layernorm.cuh)
// vs the CPU twin (llmc/ops/cpu/layernorm.h).
//
// Tolerances. bf16 outputs: relative L2 <= 1e-2 (FLOATX_TOL; one bf16 rounding is ~2e-3). mean and
// rstd (fp32): relative max <= 1e-4. Both sides see the same bf16 inputs, so they differ only by the
// order of the fp32 sums (the CPU sums sequentially, the GPU in a tree: a random-walk error of
// ~sqrt(C) * 2^-24 relative, 4e-6 at C = 4104) and rsqrtf (2 ulp): 1e-4 keeps a wide margin and is
// stricter than the brief's 1e-3. Inputs have an offset (mean ~2, std ~1) so that a masking error
// (a padded lane counted as a 0 in the variance) shows: it moves rstd by ~2/C, > 4e-4 here.
#pragma once
#include <cstring>
#include <memory>
#include <string>
#include <vector>
#include "test/gpu/harness.cuh"
#include "llmc/ops/cpu/layernorm.h"
#include "llmc/ops/layernorm.cuh"

namespace layernorm_test {
using namespace gpu_test;

constexpr double STAT_TOL = 1e-4;

// one forward shape (plain and fused), `shift` elements into every allocation (1: the scalar path)
inline void check_forward(int C, int N, size_t shift) {
    CAPTURE(C);
    CAPTURE(N);
    CAPTURE(shift);
    const size_t nc = (size_t)N * C;
    const uint64_t seed = 100 + C * 7 + N + shift;
    const std::vector<float> x = floatX_round(random_vector(nc, seed, 1.0f, 2.0f));
    const std::vector<float> x2 = floatX_round(random_vector(nc, seed + 1, 0.5f, -0.3f));
    const std::vector<float> w = floatX_round(random_vector(C, seed + 2, 0.3f, 1.0f));
    const std::vector<float> b = floatX_round(random_vector(C, seed + 3, 0.3f));
    DevFloatX d_x(x, shift), d_x2(x2, shift), d_w(w, shift), d_b(b, shift), d_out(x, shift), d_res(x, shift);
    DeviceBuffer<float> d_mean(N), d_rstd(N);

    // plain forward
    std::vector<float> want(nc), want_mean(N), want_rstd(N);
    cpu::layernorm_forward<float>(want.data(), want_mean.data(), want_rstd.data(), x.data(), w.data(),
                                  b.data(), N, C);
    d_out.poison();
    d_mean.poison();
    d_rstd.poison();
    layernorm_forward(d_out.ptr(), d_mean, d_rstd, d_x.ptr(), d_w.ptr(), d_b.ptr(), N, C);
    check_floatX("out", d_out.get(), want);
    CHECK_CLOSE("mean", rel_max(download(d_mean), want_mean), STAT_TOL);
    CHECK_CLOSE("rstd", rel_max(download(d_rstd), want_rstd), STAT_TOL);

    // fused: residual = bf16(x + x2), normalised as stored (bf16), as the backward sees it
    std::vector<float> want_res(nc);
    cpu::fused_residual_layernorm_forward<float>(want_res.data(), want.data(), want_mean.data(),
                                                 want_rstd.data(), x.data(), x2.data(), w.data(),
                                                 b.data(), N, C);
    const std::vector<float> res_bf16 = floatX_round(want_res);
    cpu::layernorm_forward<float>(want.data(), want_mean.data(), want_rstd.data(), res_bf16.data(),
                                  w.data(), b.data(), N, C);
    d_out.poison();
    d_res.poison();
    d_mean.poison();
    d_rstd.poison();
    fused_residual_layernorm_forward(d_res.ptr(), d_out.ptr(), d_mean, d_rstd, d_x.ptr(), d_x2.ptr(),
                                     d_w.ptr(), d_b.ptr(), N, C);
    // the same fp32 sum of two bf16 values, rounded once: bitwise bf16(x + x2)
    const std::vector<float> got_res = d_res.get();
    CHECK(std::memcmp(got_res.data(), res_bf16.data(), nc * sizeof(float)) == 0);
    check_floatX("residual", got_res, want_res);
    check_floatX("fused out", d_out.get(), want);
    CHECK_CLOSE("fused mean", rel_max(download(d_mean), want_mean), STAT_TOL);
    CHECK_CLOSE("fused rstd", rel_max(download(d_rstd), want_rstd), STAT_TOL);

    // the plain residual add (a pipeline stage's end): bitwise the fused kernel's residual
    std::vector<float> want_sum(nc);
    cpu::residual_forward<float>(want_sum.data(), x.data(), x2.data(), (long)nc);
    d_res.poison();
    residual_forward(d_res.ptr(), d_x.ptr(), d_x2.ptr(), (long)nc);
    const std::vector<float> got_sum = d_res.get();
    CHECK(std::memcmp(got_sum.data(), res_bf16.data(), nc * sizeof(float)) == 0);
    check_floatX("residual_forward", got_sum, want_sum);
}

TEST_CASE("layernorm_forward and fused_residual_layernorm_forward match the CPU twin (ragged C, N, scalar path)") {
    for (int C : {7, 37, 768, 769, 1100, 3000, 4104, 8200})
        for (int N : {1, 5, 300})
            for (size_t shift : {(size_t)0, (size_t)1}) {
                if (shift == 1 && C > 4096) continue;  // the scalar path stops at C = 4096
                check_forward(C, N, shift);
            }
}

// one backward shape on prefilled (accumulated) gradients
inline void check_backward(int C, int N, size_t shift) {
    CAPTURE(C);
    CAPTURE(N);
    CAPTURE(shift);
    const size_t nc = (size_t)N * C;
    const uint64_t seed = 500 + C * 7 + N + shift;
    const std::vector<float> x = floatX_round(random_vector(nc, seed, 1.0f, 2.0f));
    const std::vector<float> w = floatX_round(random_vector(C, seed + 1, 0.3f, 1.0f));
    const std::vector<float> b = floatX_round(random_vector(C, seed + 2, 0.3f));
    const std::vector<float> dout = floatX_round(random_vector(nc, seed + 3));
    // the prefills: dinp (the residual gradient so far), dweight and dbias of earlier micro-steps
    const std::vector<float> dinp0 = floatX_round(random_vector(nc, seed + 4));
    // (fp32 gradients: full fp32 values)
    const std::vector<float> dw0 = random_vector(C, seed + 5);
    const std::vector<float> db0 = random_vector(C, seed + 6);
    // mean, rstd from the CPU forward (the saved statistics both sides use)
    std::vector<float> y(nc), mean(N), rstd(N);
    cpu::layernorm_forward<float>(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    std::vector<float> want_dinp = dinp0, want_dw = dw0, want_db = db0;
    cpu::layernorm_backward<float>(want_dinp.data(), want_dw.data(), want_db.data(), dout.data(), x.data(),
                                   w.data(), mean.data(), rstd.data(), N, C);

    cuda_scratch_reserve(layernorm_scratch_bytes(N, C));
    DevFloatX d_x(x, shift), d_w(w, shift), d_dout(dout, shift), d_dinp(dinp0, shift);
    DevF32 d_dw(dw0, shift), d_db(db0, shift);
    DeviceBuffer<float> d_mean(N), d_rstd(N);
    upload(d_mean, mean);
    upload(d_rstd, rstd);
    layernorm_backward(d_dinp.ptr(), d_dw.ptr(), d_db.ptr(), d_dout.ptr(), d_x.ptr(), d_w.ptr(), d_mean,
                       d_rstd, N, C);
    check_floatX("dinp", d_dinp.get(), want_dinp);
    check_f32("dweight", d_dw.get(), want_dw);
    check_f32("dbias", d_db.get(), want_db);

    // the split backward (zero-bubble pipeline): dinp alone (weight gradients untouched), then the
    // weight gradients alone (weight not needed, dinp untouched): bitwise the one-call results
    const std::vector<float> one_dinp = d_dinp.get(), one_dw = d_dw.get(), one_db = d_db.get();
    DevFloatX s_dinp(dinp0, shift);
    DevF32 s_dw(dw0, shift), s_db(db0, shift);
    layernorm_backward(s_dinp.ptr(), nullptr, nullptr, d_dout.ptr(), d_x.ptr(), d_w.ptr(), d_mean, d_rstd, N, C);
    CHECK(std::memcmp(s_dinp.get().data(), one_dinp.data(), nc * sizeof(float)) == 0);
    CHECK(std::memcmp(s_dw.get().data(), dw0.data(), C * sizeof(float)) == 0);
    layernorm_backward(nullptr, s_dw.ptr(), s_db.ptr(), d_dout.ptr(), d_x.ptr(), nullptr, d_mean, d_rstd, N, C);
    CHECK(std::memcmp(s_dw.get().data(), one_dw.data(), C * sizeof(float)) == 0);
    CHECK(std::memcmp(s_db.get().data(), one_db.data(), C * sizeof(float)) == 0);
    CHECK(std::memcmp(s_dinp.get().data(), one_dinp.data(), nc * sizeof(float)) == 0);
    // one add of a sum independent of the destination: into zeros, then dw0 + that
    DevF32 z_dw(std::vector<float>(C, 0.0f), shift), z_db(std::vector<float>(C, 0.0f), shift);
    layernorm_backward(nullptr, z_dw.ptr(), z_db.ptr(), d_dout.ptr(), d_x.ptr(), nullptr, d_mean, d_rstd, N, C);
    check_single_add("dweight", dw0, one_dw, z_dw.get());
    check_single_add("dbias", db0, one_db, z_db.get());
}

TEST_CASE("layernorm_backward accumulates like the CPU twin (ragged C, N, scalar path)") {
    for (int C : {7, 37, 768, 769, 1100, 3000, 4104, 8200})  // 8200: the 16-byte path's K 4 (row read twice)
        for (int N : {1, 5, 300})
            for (size_t shift : {(size_t)0, (size_t)1}) {
                if (shift == 1 && C > 4096) continue;  // the scalar path stops at C = 4096
                check_backward(C, N, shift);
            }
}

// small shapes for compute-sanitizer (scripts/device_check.sh: test_gpu -tc='sanitizer*'): the vector
// and the scalar paths, a ragged C, more rows than one block
TEST_CASE("sanitizer: layernorm forward, fused forward and backward on small shapes") {
    for (int C : {37, 768})
        for (size_t shift : {(size_t)0, (size_t)1}) {
            check_forward(C, 5, shift);
            check_backward(C, 5, shift);
        }
}

TEST_CASE("layernorm_backward is bitwise deterministic") {
    const int N = 4096 + 3, C = 768;
    const size_t nc = (size_t)N * C;
    const std::vector<float> x = random_vector(nc, 71, 1.0f, 0.5f);
    const std::vector<float> w = random_vector(C, 72, 0.3f, 1.0f), b = random_vector(C, 73, 0.3f);
    const std::vector<float> dout = random_vector(nc, 74), dinp0 = random_vector(nc, 75);
    const std::vector<float> dw0 = random_vector(C, 76), db0 = random_vector(C, 77);
    std::vector<float> y(nc), mean(N), rstd(N);
    const std::vector<float> xr = floatX_round(x), wr = floatX_round(w), br = floatX_round(b);
    cpu::layernorm_forward<float>(y.data(), mean.data(), rstd.data(), xr.data(), wr.data(), br.data(), N, C);
    cuda_scratch_reserve(layernorm_scratch_bytes(N, C));
    std::unique_ptr<DeviceBuffer<floatX>> d_x(to_device_floatX(x)), d_w(to_device_floatX(w)), d_dout(to_device_floatX(dout));
    DeviceBuffer<float> d_mean(N), d_rstd(N);
    upload(d_mean, mean);
    upload(d_rstd, rstd);
    std::vector<std::vector<floatX>> dinp_runs;
    std::vector<std::vector<float>> runs[2];
    for (int rep = 0; rep < 2; rep++) {
        std::unique_ptr<DeviceBuffer<floatX>> d_dinp(to_device_floatX(dinp0));
        std::unique_ptr<DeviceBuffer<float>> d_dw(to_device(dw0)), d_db(to_device(db0));
        layernorm_backward(*d_dinp, *d_dw, *d_db, *d_dout, *d_x, *d_w, d_mean, d_rstd, N, C);
        dinp_runs.push_back(download(*d_dinp));
        runs[0].push_back(download(*d_dw));
        runs[1].push_back(download(*d_db));
    }
    CHECK(same_bytes(dinp_runs[0], dinp_runs[1]));
    for (int k = 0; k < 2; k++) {
        CAPTURE(k);
        CHECK(same_bytes(runs[k][0], runs[k][1]));
    }
}

}  // namespace layernorm_test

// The memory plan reserves layernorm_scratch_bytes(N, C, SMs) (llmc/ops/op_scratch.h, host arithmetic: at
// most 16 blocks per SM); the backward's real grid comes from the occupancy query: it must stay
// within the bound on this GPU, for both paths and every width the kernels take.
TEST_CASE("layernorm_backward: its grid's scratch is within the plan's bound (llmc/ops/op_scratch.h)") {
    using namespace layernorm_detail;
    for (int C : {8, 37, 64, 256, 768, 1024, 2048, 4096, 8192, 16384})
        for (int N : {1, 7, 1000, 4096, 65536, 1 << 20})
            for (bool vec : {false, true}) {
                if (vec ? (C % 8 != 0 || C > 4 * 8 * BWD_MAX_X) : C > 4096) continue;
                CAPTURE(C);
                CAPTURE(N);
                CAPTURE(vec);
                const BackwardGrid g = backward_grid(N, C, vec);
                CHECK(g.shape.x * g.shape.y > 128);  // the bound's premise
                CHECK((size_t)g.blocks * 2 * C * sizeof(float) <= layernorm_scratch_bytes(N, C, sm_count()));
            }
}
