// Gradient accumulation into fp32: acc[i] += x[i]. Each element is owned by one thread, so the
// result does not depend on the thread count.
#pragma once
#include <cstddef>

namespace cpu {

template <typename T>
void grad_accumulate(float* acc, const T* x, size_t n) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) acc[i] += (float)x[i];
}

}  // namespace cpu
