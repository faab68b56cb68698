// The FFN nonlinearities on the GPU: the twin of llmc/cpu/mlp.h.
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
#include "cuda_common.cuh"

namespace mlp_detail {

constexpr int THREADS = 256;
constexpr float GELU_SCALE = 0.7978845608028654f;  // sqrt(2 / pi)

inline bool aligned16(const void* p) { return ((uintptr_t)p & 15) == 0; }

// bf16 <-> fp32 without type punning: a bf16 is the high half of an fp32, and in a 32-bit word of
// two packed bf16 the lower address is the low half
__device__ inline float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ inline float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ inline uint32_t pack_bf16(float lo, float hi) {
    return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
           ((uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}
__device__ inline void unpack8(float (&f)[8], const uint4& u) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        f[2 * k] = bf16_lo(w[k]);
        f[2 * k + 1] = bf16_hi(w[k]);
    }
}

// VEC consecutive bf16 <-> fp32; VEC == 8 is one 16-byte access (p must be 16-byte aligned)
template <int VEC>
__device__ inline void load_bf16(float (&f)[VEC], const floatX* p) {
    if constexpr (VEC == 8) {
        unpack8(f, *reinterpret_cast<const uint4*>(p));
    } else {
#pragma unroll
        for (int k = 0; k < VEC; k++) f[k] = __bfloat162float(p[k]);
    }
}
template <int VEC>
__device__ inline void store_bf16(floatX* p, const float (&f)[VEC]) {
    if constexpr (VEC == 8) {
        *reinterpret_cast<uint4*>(p) = make_uint4(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]),
                                                  pack_bf16(f[4], f[5]), pack_bf16(f[6], f[7]));
    } else {
#pragma unroll
        for (int k = 0; k < VEC; k++) p[k] = __float2bfloat16_rn(f[k]);
    }
}

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
    load_bf16<VEC>(a, a_ptr);
    load_bf16<VEC>(u, a_ptr + H);
#pragma unroll
    for (int k = 0; k < VEC; k++) o[k] = a[k] * sigmoid(a[k]) * u[k];
    store_bf16<VEC>(out + unit * VEC, o);
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
    load_bf16<VEC>(a, inp + off);
    load_bf16<VEC>(u, inp + off + H);
    load_bf16<VEC>(d, dout + unit * VEC);
#pragma unroll
    for (int k = 0; k < VEC; k++) {
        const float sig = sigmoid(a[k]);
        da[k] = d[k] * u[k] * sig * (1.0f + a[k] * (1.0f - sig));
        du[k] = d[k] * a[k] * sig;
    }
    store_bf16<VEC>(dinp + off, da);
    store_bf16<VEC>(dinp + off + H, du);
}

// GELU: one thread per VEC elements of the flat array (VEC divides N)
template <int VEC>
__global__ void gelu_forward_kernel(floatX* __restrict__ out, const floatX* __restrict__ inp, size_t n_units) {
    const size_t unit = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (unit >= n_units) return;
    float x[VEC];
    load_bf16<VEC>(x, inp + unit * VEC);
#pragma unroll
    for (int k = 0; k < VEC; k++) {
        const float v = x[k];
        x[k] = 0.5f * v * (1.0f + tanhf(GELU_SCALE * (v + 0.044715f * v * v * v)));
    }
    store_bf16<VEC>(out + unit * VEC, x);
}

template <int VEC>
__global__ void gelu_backward_kernel(floatX* __restrict__ dinp, const floatX* __restrict__ dout,
                                     const floatX* __restrict__ inp, size_t n_units) {
    const size_t unit = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (unit >= n_units) return;
    float x[VEC], d[VEC];
    load_bf16<VEC>(x, inp + unit * VEC);
    load_bf16<VEC>(d, dout + unit * VEC);
#pragma unroll
    for (int k = 0; k < VEC; k++) {
        const float v = x[k];
        const float th = tanhf(GELU_SCALE * (v + 0.044715f * v * v * v));
        const float dth = (1.0f - th * th) * GELU_SCALE * (1.0f + 3.0f * 0.044715f * v * v);
        d[k] *= 0.5f * (1.0f + th) + 0.5f * v * dth;
    }
    store_bf16<VEC>(dinp + unit * VEC, d);
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
