// RMSNorm on the GPU: the twin of llmc/ops/cpu/rmsnorm.h.
//   forward   rstd = 1 / sqrt(sum_c x_c^2 / C + eps),  out_c = x_c * rstd * w_c        (rstd saved, fp32)
//   fused     residual = floatX(inp1 + inp2), then the forward of that rounded residual (what the
//             backward will read back), in one kernel and one pass over memory
//   backward  xhat = x * rstd, g = dout * w
//             dinp += rstd * (g - xhat * mean_c(g * xhat))
//             dweight += sum_rows dout * xhat                                 (fp32, one add per element)
//
// Parallel decomposition: LayerNorm's kernels (llmc/ops/layernorm.cuh) with their template flag RMS,
// so everything said there holds here: a row spread over blockDim.x threads (VEC = 8 channels per
// 16-byte access when C % 8 == 0 and the pointers are 16-byte aligned, else VEC = 1; K = 1, 2 or 4
// groups per thread), blockDim.y rows per block, the row kept in registers between the reductions,
// row sums by warp shuffles plus one fixed-order shared-memory step. RMS drops the mean: the forward
// has a single reduction (sum_c x_c^2, where LayerNorm has two), the backward a single one
// (sum_c g * xhat, where LayerNorm has two).
//  backward  the fixed grid of G blocks (one resident wave of the RMS kernel), each folding its rows'
//            dweight partials in fp32 registers, then its row groups in order through shared memory,
//            and writing one partial row [C]; layernorm_param_grad_kernel sums the G partials of a
//            channel in a fixed order and adds the total to the fp32 dweight once (no atomics:
//            bitwise reproducible; the split calls -- dinp alone, dweight alone -- use the same grid
//            and give the one call's bits).
//
// Scratch: rmsnorm_forward / fused: none; rmsnorm_backward: G * C floats, bounded by
//   rmsnorm_scratch_bytes(N, C) (llmc/ops/op_scratch.h: half of layernorm_scratch_bytes, which the
//   model's arena already takes).
#pragma once
#include "llmc/ops/cuda_common.cuh"
#include "llmc/ops/layernorm.cuh"  // the kernels (template flag RMS)
#include "llmc/ops/op_scratch.h"   // rmsnorm_scratch_bytes

// bytes of cuda_scratch that rmsnorm_backward may take for N rows of C channels on this GPU (the
// forwards take none): the plan's bound, which the backward checks
inline size_t rmsnorm_scratch_bytes(int N, int C) { return rmsnorm_scratch_bytes(N, C, sm_count()); }

// out [N, C] overwritten, rstd [N] (fp32) overwritten
inline void rmsnorm_forward(floatX* out, float* rstd, const floatX* inp, const floatX* weight, int N, int C,
                            float eps) {
    layernorm_detail::forward_launch<false, true>(nullptr, out, nullptr, rstd, inp, nullptr, weight, nullptr, N, C,
                                                  eps);
}

// residual = inp1 + inp2 (rounded to floatX), out = RMSNorm(residual); residual, out, rstd overwritten.
// residual must not overlap inp1 / inp2 except exactly (residual == inp1 is fine).
inline void fused_residual_rmsnorm_forward(floatX* residual, floatX* out, float* rstd, const floatX* inp1,
                                           const floatX* inp2, const floatX* weight, int N, int C, float eps) {
    layernorm_detail::forward_launch<true, true>(residual, out, nullptr, rstd, inp1, inp2, weight, nullptr, N, C,
                                                 eps);
}

// dinp += (the residual stream's gradient), dweight += (fp32, one add of the complete sum per element;
// deterministic). dinp may be null (weight is then not read) or dweight null: the input and the
// weight gradients in two calls. Scratch: rmsnorm_scratch_bytes(N, C).
inline void rmsnorm_backward(floatX* dinp, float* dweight, const floatX* dout, const floatX* inp, const floatX* weight,
                             const float* rstd, int N, int C) {
    layernorm_detail::backward_launch<true>(dinp, dweight, nullptr, dout, inp, weight, nullptr, rstd, N, C,
                                            rmsnorm_scratch_bytes(N, C));
}
