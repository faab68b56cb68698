// The FFN nonlinearities on the GPU: the twin of llmc/ops/cpu/mlp.h.
//   SwiGLU  inp row n = [a (H gate features) | u (H up features)],  out[n, i] = silu(a_i) * u_i,
//           silu(a) = a * sig(a), sig(a) = 1 / (1 + exp(-a))
//           backward: da = dout * u * sig * (1 + a (1 - sig)),  du = dout * silu(a)   (dinp overwritten)
//   GELU    GPT-2's tanh approximation: out = 0.5 x (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2/pi)
//           backward: dinp = dout * (0.5 (1 + th) + 0.5 x (1 - th^2) k (1 + 3 * 0.044715 x^2))
//
// Purely element-wise and memory bound: one thread per 8 consecutive elements of a row (16-byte
// loads and stores, fp32 math) when the row length is a multiple of 8 and the pointers are 16-byte
// aligned, else one thread per element. No reductions, so nothing to make deterministic.
// Scratch: none.
#pragma once
#include <cstdint>
#include "llmc/ops/cuda_common.cuh"

namespace mlp_detail {

constexpr int THREADS = 256;
constexpr float GELU_SCALE = 0.7978845608028654f;  // sqrt(2 / pi)

using namespace floatx8;  // aligned16, load_floatX / store_floatX, ... (llmc/ops/cuda_common.cuh)

__device__ inline float sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }

// one thread per VEC outputs of a row (VEC divides H); n_units = N * H / VEC
template <int VEC>
__global__ void swiglu_forward_kernel(floatX* __restrict__ out, const floatX* __restrict__ inp, int H,
                                      size_t n_units) {
    const size_t unit = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (unit >= n_units) return;
    const int per_row = H / VEC;
    const size_t n = unit / per_row;
    const int i = (int)(unit % per_row) * VEC;
    const floatX* a_ptr = inp + n * 2 * H + i;
    float a[VEC], u[VEC], o[VEC];
    load_floatX<VEC>(a, a_ptr);
    load_floatX<VEC>(u, a_ptr + H);
#pragma unroll
    for (int k = 0; k < VEC; k++) o[k] = a[k] * sigmoid(a[k]) * u[k];
    store_floatX<VEC>(out + unit * VEC, o);
}

template <int VEC>
__global__ void swiglu_backward_kernel(floatX* __restrict__ dinp, const floatX* __restrict__ dout,
                                       const floatX* __restrict__ inp, int H, size_t n_units) {
    const size_t unit = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (unit >= n_units) return;
    const int per_row = H / VEC;
    const size_t n = unit / per_row;
    const int i = (int)(unit % per_row) * VEC;
    const size_t off = n * 2 * H + i;
    float a[VEC], u[VEC], d[VEC], da[VEC], du[VEC];
    load_floatX<VEC>(a, inp + off);
    load_floatX<VEC>(u, inp + off + H);
    load_floatX<VEC>(d, dout + unit * VEC);
#pragma unroll
    for (int k = 0; k < VEC; k++) {
        const float sig = sigmoid(a[k]);
        da[k] = d[k] * u[k] * sig * (1.0f + a[k] * (1.0f - sig));
        du[k] = d[k] * a[k] * sig;
    }
    store_floatX<VEC>(dinp + off, da);
    store_floatX<VEC>(dinp + off + H, du);
}

// GELU: one thread per VEC elements of the flat array (VEC divides N)
template <int VEC>
__global__ void gelu_forward_kernel(floatX* __restrict__ out, const floatX* __restrict__ inp, size_t n_units) {
    const size_t unit = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (unit >= n_units) return;
    float x[VEC];
    load_floatX<VEC>(x, inp + unit * VEC);
#pragma unroll
    for (int k = 0; k < VEC; k++) {
        const float v = x[k];
        x[k] = 0.5f * v * (1.0f + tanhf(GELU_SCALE * (v + 0.044715f * v * v * v)));
    }
    store_floatX<VEC>(out + unit * VEC, x);
}

template <int VEC>
__global__ void gelu_backward_kernel(floatX* __restrict__ dinp, const floatX* __restrict__ dout,
                                     const floatX* __restrict__ inp, size_t n_units) {
    const size_t unit = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (unit >= n_units) return;
    float x[VEC], d[VEC];
    load_floatX<VEC>(x, inp + unit * VEC);
    load_floatX<VEC>(d, dout + unit * VEC);
#pragma unroll
    for (int k = 0; k < VEC; k++) {
        const float v = x[k];
        const float th = tanhf(GELU_SCALE * (v + 0.044715f * v * v * v));
        const float dth = (1.0f - th * th) * GELU_SCALE * (1.0f + 3.0f * 0.044715f * v * v);
        d[k] *= 0.5f * (1.0f + th) + 0.5f * v * dth;
    }
    store_floatX<VEC>(dinp + unit * VEC, d);
}

inline unsigned blocks_for(size_t n_units) { return (unsigned)((n_units + THREADS - 1) / THREADS); }

}  // namespace mlp_detail

// out [N, H] overwritten; inp [N, 2H] = [gate | up]
inline void swiglu_forward(floatX* out, const floatX* inp, int N, int H) {
    using namespace mlp_detail;
    const bool vec = H % 8 == 0 && aligned16(out) && aligned16(inp);
    const size_t n_units = (size_t)N * H / (vec ? 8 : 1);
    if (n_units == 0) return;
    if (vec) swiglu_forward_kernel<8><<<blocks_for(n_units), THREADS, 0, llmc_stream()>>>(out, inp, H, n_units);
    else swiglu_forward_kernel<1><<<blocks_for(n_units), THREADS, 0, llmc_stream()>>>(out, inp, H, n_units);
    cudaCheckLaunch();
}

// dinp [N, 2H] overwritten; dout [N, H]; inp [N, 2H]
inline void swiglu_backward(floatX* dinp, const floatX* dout, const floatX* inp, int N, int H) {
    using namespace mlp_detail;
    const bool vec = H % 8 == 0 && aligned16(dinp) && aligned16(dout) && aligned16(inp);
    const size_t n_units = (size_t)N * H / (vec ? 8 : 1);
    if (n_units == 0) return;
    if (vec)
        swiglu_backward_kernel<8><<<blocks_for(n_units), THREADS, 0, llmc_stream()>>>(dinp, dout, inp, H, n_units);
    else
        swiglu_backward_kernel<1><<<blocks_for(n_units), THREADS, 0, llmc_stream()>>>(dinp, dout, inp, H, n_units);
    cudaCheckLaunch();
}

// out [N] overwritten
inline void gelu_forward(floatX* out, const floatX* inp, long N) {
    using namespace mlp_detail;
    const bool vec = N % 8 == 0 && aligned16(out) && aligned16(inp);
    const size_t n_units = (size_t)N / (vec ? 8 : 1);
    if (n_units == 0) return;
    if (vec) gelu_forward_kernel<8><<<blocks_for(n_units), THREADS, 0, llmc_stream()>>>(out, inp, n_units);
    else gelu_forward_kernel<1><<<blocks_for(n_units), THREADS, 0, llmc_stream()>>>(out, inp, n_units);
    cudaCheckLaunch();
}

// dinp [N] overwritten
inline void gelu_backward(floatX* dinp, const floatX* dout, const floatX* inp, long N) {
    using namespace mlp_detail;
    const bool vec = N % 8 == 0 && aligned16(dinp) && aligned16(dout) && aligned16(inp);
    const size_t n_units = (size_t)N / (vec ? 8 : 1);
    if (n_units == 0) return;
    if (vec) gelu_backward_kernel<8><<<blocks_for(n_units), THREADS, 0, llmc_stream()>>>(dinp, dout, inp, n_units);
    else gelu_backward_kernel<1><<<blocks_for(n_units), THREADS, 0, llmc_stream()>>>(dinp, dout, inp, n_units);
    cudaCheckLaunch();
}
