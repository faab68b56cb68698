// AdamW (Loshchilov & Hutter 2019) with PyTorch's conventions: decoupled decay p -= lr*wd*p first,
// then the bias-corrected Adam step. t is the 1-based step. grad_scale multiplies the gradient
// (gradient clipping). grads are fp32 whatever T is: the optimizer reads the fp32 accumulator the
// micro-batches' gradients were summed into (grad_accumulate, llmc/ops/cpu/accumulate.h), so the
// summed gradient is never rounded to the params' type. master_params is the fp32 copy the GPU
// build keeps next to bf16 params; the CPU build trains fp32 params directly and passes nullptr.
// seed drives the stochastic rounding of bf16 params in the CUDA build (random bits of element i
// from seed + i); fp32 params need no rounding and ignore it.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>

namespace cpu {

template <typename T>
void adamw_update(T* params, float* master_params, const float* grads, float* m, float* v, size_t n,
                  float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale, int t,
                  uint64_t seed) {
    (void)master_params;
    (void)seed;
    const float c1 = 1.0f - std::pow(beta1, (float)t), c2 = 1.0f - std::pow(beta2, (float)t);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float g = grads[i] * grad_scale;
        float p = (float)params[i];
        p -= lr * weight_decay * p;
        m[i] = beta1 * m[i] + (1.0f - beta1) * g;
        v[i] = beta2 * v[i] + (1.0f - beta2) * g * g;
        p -= lr * (m[i] / c1) / (std::sqrt(v[i] / c2) + eps);
        params[i] = (T)p;
    }
}

// A piece of the optimizer step: n elements at param / state / grad (indices into the flat params,
// the master and moments, and the fp32 gradients), its offset in the parameter table (the
// stochastic-rounding seed of element i is seed + offset + i) and whether it decays.
struct AdamwPiece {
    size_t param, state, grad, n, offset;
    bool decay;
};
// adamw_update on each of pieces[0, count): the step over many tensors in one call (the GPU twin:
// a few multi-tensor launches); weight_decay applies to the pieces that decay
template <typename T>
void adamw_update_pieces(T* params, float* master_params, const float* grads, float* m, float* v,
                         const AdamwPiece* pieces, int count, float lr, float beta1, float beta2, float eps,
                         float weight_decay, float grad_scale, int t, uint64_t seed) {
    for (int k = 0; k < count; k++) {
        const AdamwPiece& u = pieces[k];
        adamw_update(params + u.param, master_params ? master_params + u.state : nullptr, grads + u.grad, m + u.state,
                     v + u.state, u.n, lr, beta1, beta2, eps, u.decay ? weight_decay : 0.0f, grad_scale, t,
                     seed + u.offset);
    }
}

}  // namespace cpu
