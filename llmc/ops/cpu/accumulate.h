// Gradient accumulation in fp32 (Megatron's main_grad): each micro-batch's backward writes its
// gradient in the params' type T (the "leaf"), and the step's gradient is the sum of the leaves
// added in micro-batch order into an fp32 accumulator, which the optimizer reads. Summing in fp32
// keeps the small late contributions that a bf16 running sum would round away.
//   acc[i] += (float)x[i]        (acc accumulated, x read only)
// Each element is one fp32 addition, rounded to nearest: the result does not depend on the thread
// count, and the GPU twin (llmc/ops/accumulate.cuh) produces the same bits.
#pragma once
#include <cstddef>

namespace cpu {

template <typename T>
void grad_accumulate(float* acc, const T* x, size_t n) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) acc[i] += (float)x[i];
}

// Tensor-parallel reductions (llmc/parallel/tensor_parallel.h): a row-parallel layer's bias, added once
// after its partial sums are reduced, and the running maximum of the vocab-parallel softmax.
//   out[r, o] += bias[o]         a[i] = max(a[i], b[i])
template <typename T>
void add_bias(T* out, const T* bias, int rows, int OC) {
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < OC; o++) out[(size_t)r * OC + o] += bias[o];
}
inline void max_into(float* a, const float* b, size_t n) {
    for (size_t i = 0; i < n; i++) a[i] = a[i] < b[i] ? b[i] : a[i];
}

}  // namespace cpu
