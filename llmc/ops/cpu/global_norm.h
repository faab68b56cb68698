// Sum of squares of a gradient buffer, accumulated in double over fixed-size chunks whose partial
// sums are added in chunk order: the result is independent of the thread count.
#pragma once
#include <cstddef>
#include <vector>

namespace cpu {

template <typename T>
double global_norm_squared(const T* values, size_t n) {
    constexpr size_t CHUNK = 1 << 14;
    const size_t n_chunks = (n + CHUNK - 1) / CHUNK;
    std::vector<double> partial(n_chunks);
#pragma omp parallel for schedule(static)
    for (size_t c = 0; c < n_chunks; c++) {
        double s = 0;
        for (size_t i = c * CHUNK; i < n && i < (c + 1) * CHUNK; i++) s += (double)values[i] * values[i];
        partial[c] = s;
    }
    double total = 0;
    for (double s : partial) total += s;
    return total;
}

// sums[k] = global_norm_squared(values[k], n[k]) for k < count (the GPU twin's batch of ranges)
inline void global_norm_squared_ranges(double* sums, const float* const* values, const size_t* n, int count) {
    for (int k = 0; k < count; k++) sums[k] = global_norm_squared(values[k], n[k]);
}

}  // namespace cpu
