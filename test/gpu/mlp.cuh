// GPU swiglu_forward / swiglu_backward / gelu_forward / gelu_backward (llmc/ops/mlp.cuh) vs the CPU
// twin (llmc/ops/cpu/mlp.h). Outputs are overwritten: they are poisoned first, so an element the kernel
// skips is a NaN and fails rel_l2. Tolerance FLOATX_TOL (one bf16 rounding of the result, ~2e-3).
#pragma once
#include <memory>
#include <vector>
#include "test/gpu/harness.cuh"
#include "llmc/ops/cpu/mlp.h"
#include "llmc/ops/mlp.cuh"

namespace mlp_test {
using namespace gpu_test;

TEST_CASE("swiglu forward and backward match the CPU twin (ragged H, N, scalar path)") {
    for (int H : {11, 1536})
        for (int N : {1, 5, 300})
            for (size_t shift : {(size_t)0, (size_t)1}) {
                CAPTURE(H);
                CAPTURE(N);
                CAPTURE(shift);
                const size_t nh = (size_t)N * H;
                const uint64_t seed = 900 + H + N + shift;
                // gate values over [-6, 6]-ish (both tails of the sigmoid), up and dout around 1
                const std::vector<float> inp = floatX_round(random_vector(2 * nh, seed, 2.5f, 0.2f));
                const std::vector<float> dout = floatX_round(random_vector(nh, seed + 1));
                std::vector<float> want(nh), want_dinp(2 * nh);
                cpu::swiglu_forward<float>(want.data(), inp.data(), N, H);
                cpu::swiglu_backward<float>(want_dinp.data(), dout.data(), inp.data(), N, H);

                DevFloatX d_inp(inp, shift), d_dout(dout, shift), d_out(want, shift), d_dinp(want_dinp, shift);
                d_out.poison();
                d_dinp.poison();
                swiglu_forward(d_out.ptr(), d_inp.ptr(), N, H);
                swiglu_backward(d_dinp.ptr(), d_dout.ptr(), d_inp.ptr(), N, H);
                check_floatX("out", d_out.get(), want);
                const std::vector<float> got_dinp = d_dinp.get();
                check_floatX("dinp", got_dinp, want_dinp);
                // the gate and up halves separately (a swap of the two halves must not hide in the norm)
                std::vector<float> got_da, got_du, want_da, want_du;
                for (int n = 0; n < N; n++)
                    for (int i = 0; i < H; i++) {
                        const size_t a = (size_t)n * 2 * H + i;
                        got_da.push_back(got_dinp[a]);
                        want_da.push_back(want_dinp[a]);
                        got_du.push_back(got_dinp[a + H]);
                        want_du.push_back(want_dinp[a + H]);
                    }
                check_floatX("dgate", got_da, want_da);
                check_floatX("dup", got_du, want_du);
            }
}

TEST_CASE("gelu forward and backward match the CPU twin (ragged N, scalar path)") {
    for (long N : {1L, 5L, 300L * 11, 300L * 3072, 300L * 3072 + 5})
        for (size_t shift : {(size_t)0, (size_t)1}) {
            CAPTURE(N);
            CAPTURE(shift);
            const uint64_t seed = 950 + N + shift;
            const std::vector<float> inp = floatX_round(random_vector(N, seed, 2.0f, -0.1f));
            const std::vector<float> dout = floatX_round(random_vector(N, seed + 1));
            std::vector<float> want(N), want_dinp(N);
            cpu::gelu_forward<float>(want.data(), inp.data(), N);
            cpu::gelu_backward<float>(want_dinp.data(), dout.data(), inp.data(), N);

            DevFloatX d_inp(inp, shift), d_dout(dout, shift), d_out(want, shift), d_dinp(want_dinp, shift);
            d_out.poison();
            d_dinp.poison();
            gelu_forward(d_out.ptr(), d_inp.ptr(), N);
            gelu_backward(d_dinp.ptr(), d_dout.ptr(), d_inp.ptr(), N);
            check_floatX("out", d_out.get(), want);
            check_floatX("dinp", d_dinp.get(), want_dinp);
        }
}

}  // namespace mlp_test
