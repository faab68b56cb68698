// Learning-rate schedules. Steps are 0-based. Every schedule starts with a linear warmup
// lr_max * (step + 1) / warmup, then over p in [0, 1] from the end of warmup to max_steps:
//   cosine:   lr_min + (lr_max - lr_min) * (1 + cos(pi p)) / 2
//   linear:   lr_max + (lr_min - lr_max) * p
//   constant: lr_max
//   wsd:      warmup-stable-decay: lr_max until the last decay_frac * max_steps steps, then linear
//             to lr_min over those steps
// with lr_min = final_frac * lr_max.
#pragma once
#include <cmath>
#include <string>
#include "utils.h"

struct LRSchedule {
    std::string kind = "cosine";
    float lr_max = 1e-3f, final_frac = 0.1f, wsd_decay_frac = 0.2f;
    int warmup = 0, max_steps = 1;

    void validate() const {
        LLMC_CHECK(kind == "cosine" || kind == "linear" || kind == "constant" || kind == "wsd",
                   "--schedule: '%s' is not one of cosine, linear, constant, wsd", kind.c_str());
        LLMC_CHECK(warmup >= 0, "--warmup: must be >= 0, got %d", warmup);
        LLMC_CHECK(final_frac >= 0 && final_frac <= 1, "--final_lr_frac: must be in [0, 1], got %g", final_frac);
        LLMC_CHECK(wsd_decay_frac > 0 && wsd_decay_frac <= 1, "--wsd_decay_frac: must be in (0, 1], got %g", wsd_decay_frac);
    }

    float at(int step) const {
        const float lr_min = final_frac * lr_max;
        if (step < warmup) return lr_max * (step + 1) / warmup;
        if (step >= max_steps) return kind == "constant" ? lr_max : lr_min;
        if (kind == "constant") return lr_max;
        if (kind == "wsd") {
            int decay_steps = std::max(1, (int)std::lround(wsd_decay_frac * max_steps));
            int decay_start = std::max(warmup, max_steps - decay_steps);
            if (step < decay_start) return lr_max;
            float p = (float)(step - decay_start) / std::max(1, max_steps - decay_start);
            return lr_max + (lr_min - lr_max) * p;
        }
        float p = (float)(step - warmup) / std::max(1, max_steps - warmup);
        if (kind == "linear") return lr_max + (lr_min - lr_max) * p;
        return lr_min + 0.5f * (lr_max - lr_min) * (1.0f + std::cos((float)M_PI * p));
    }
};
