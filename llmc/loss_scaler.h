// Loss scaling for fp16 training (Micikevicius et al. 2018, "Mixed Precision Training"): the
// backward starts from the loss's gradient times `scale`, so that small activation gradients stay
// above fp16's smallest normal (6e-5) instead of flushing to zero; the optimizer divides it back out.
// Dynamic scaling behaves as PyTorch's GradScaler: start at 2^16; a step whose gradient is not
// finite (an fp16 overflow) is skipped and the scale halves; after `window` steps in a row with a
// finite gradient the scale doubles. As DeepSpeed does, the scale never goes below 1: an overflow
// there is a real divergence, which the trainer counts as a bad step (--max_bad_steps).
//
// Why it costs nothing: the overflow flag is the gradient norm the step computes anyway (one
// reduction over every rank, in the step's one host sync), so every rank sees the same norm and
// takes the same decision; and with a power-of-two scale the scaling is exact in fp32 and bf16
// (only the exponent moves), so a scaled run gives the unscaled run's bits wherever nothing
// overflows or falls below the normal range.
#pragma once
#include <cmath>
#include <string>

struct LossScaler {
    bool dynamic = false;
    float scale = 1.0f;    // the loss's gradient is multiplied by this (1: off)
    int window = 2000;     // finite steps in a row before a dynamic scale doubles
    int clean_steps = 0;   // finite steps since the last overflow or growth
    static constexpr float init_scale = 65536.0f, min_scale = 1.0f;

    bool on() const { return dynamic || scale != 1.0f; }

    // After a step whose scaled gradient norm was computed: returns whether the step may update.
    // An overflow (a non-finite norm) is skipped; a dynamic scale halves (above min_scale) or, with
    // growth due, doubles. *counts_bad: the skip is a divergence, not an overflow the scale absorbs.
    bool after_step(bool grads_finite, bool* counts_bad) {
        *counts_bad = false;
        if (!grads_finite) {
            clean_steps = 0;
            if (dynamic && scale > min_scale) scale = std::fmax(min_scale, scale * 0.5f);
            else *counts_bad = true;
            return false;
        }
        if (dynamic && ++clean_steps >= window) {
            clean_steps = 0;
            if (std::isfinite(scale * 2.0f)) scale *= 2.0f;
        }
        return true;
    }
};
