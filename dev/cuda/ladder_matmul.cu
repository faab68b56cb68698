// The matmul ladder, the first op family to read: out[BT, OC] = inp[BT, C] W[OC, C]^T + bias, bf16
// in and out, fp32 accumulation. Three kernels, simplest first, each validated against the CPU
// reference (llmc/ops/cpu/matmul.h) and timed on one GPT-sized shape in the same program.
//   kernel 1  naive: one thread per output element, a dot product of length C straight from global
//             memory. The lanes of a warp read 32 different rows of W, C elements apart: every load
//             is its own transaction, and every input is read OC (or BT) times from DRAM / L2.
//   kernel 2  shared-memory tiles: a 32 x 32 block of threads computes a 32 x 32 tile of out; the
//             block stages 32 x 32 tiles of inp and W in shared memory, each loaded by consecutive
//             lanes at consecutive k (coalesced), so each element fetched from global memory serves 32
//             multiply-adds. Still CUDA-core fp32 math, one output per thread.
//   kernel 3  production: llmc/ops/matmul.cuh (cuBLASLt on the bf16 tensor cores, the bias fused in the
//             epilogue) - what the trainer runs.
// GPU-unverified: written and compiled without a GPU (CI has none); the first run on a device is
// its check (validation exits 1 on a mismatch before anything is timed).
// Build: make dev/cuda/bin/ladder_matmul (nvcc -O3 -std=c++17 -arch=sm_90 --use_fast_math -I. ... -lcublasLt)
#include <cmath>
#include <cstdlib>
#include <vector>
#include "dev/cuda/common.cuh"
#include "llmc/ops/cpu/matmul.h"
#include "llmc/ops/matmul.cuh"

using namespace bench;

__global__ void matmul_naive(floatX* out, const floatX* inp, const floatX* w, const floatX* bias, int BT, int C, int OC) {
    const int o = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y * blockDim.y + threadIdx.y;
    if (o >= OC || t >= BT) return;
    float acc = bias ? floatX_to_float(bias[o]) : 0.0f;
    for (int k = 0; k < C; k++) acc += floatX_to_float(inp[(size_t)t * C + k]) * floatX_to_float(w[(size_t)o * C + k]);
    out[(size_t)t * OC + o] = float_to_floatX(acc);
}

constexpr int TILE = 32;
__global__ void matmul_tiled(floatX* out, const floatX* inp, const floatX* w, const floatX* bias, int BT, int C, int OC) {
    __shared__ float a[TILE][TILE + 1], b[TILE][TILE + 1];  // +1: lanes reading a column hit distinct banks
    const int tx = threadIdx.x, ty = threadIdx.y, t0 = blockIdx.y * TILE, o0 = blockIdx.x * TILE;
    float acc = 0.0f;
    for (int k0 = 0; k0 < C; k0 += TILE) {
        const int k = k0 + tx;
        a[ty][tx] = t0 + ty < BT && k < C ? floatX_to_float(inp[(size_t)(t0 + ty) * C + k]) : 0.0f;
        b[ty][tx] = o0 + ty < OC && k < C ? floatX_to_float(w[(size_t)(o0 + ty) * C + k]) : 0.0f;
        __syncthreads();
        for (int kk = 0; kk < TILE; kk++) acc += a[ty][kk] * b[tx][kk];
        __syncthreads();
    }
    const int t = t0 + ty, o = o0 + tx;
    if (t < BT && o < OC) out[(size_t)t * OC + o] = float_to_floatX(acc + (bias ? floatX_to_float(bias[o]) : 0.0f));
}

static void run_kernel(int k, floatX* out, const floatX* inp, const floatX* w, const floatX* bias, int BT, int C, int OC) {
    if (k == 3) {
        matmul_forward(out, inp, w, bias, BT, C, OC);
        return;
    }
    const dim3 block(k == 1 ? 32 : TILE, k == 1 ? 8 : TILE);
    const dim3 grid(ceil_div(OC, (int)block.x), ceil_div(BT, k == 1 ? 8 : TILE));
    if (k == 1) matmul_naive<<<grid, block>>>(out, inp, w, bias, BT, C, OC);
    else matmul_tiled<<<grid, block>>>(out, inp, w, bias, BT, C, OC);
    cudaCheck(cudaGetLastError());
}

static const char* names[] = {"", "kernel 1 naive", "kernel 2 shared-memory tiles", "kernel 3 cuBLASLt (production)"};

static bool validate(int BT, int C, int OC) {
    Rng rng(7 + BT + C + OC);
    const std::vector<float> inp = host_random((size_t)BT * C, rng), w = host_random((size_t)OC * C, rng, 1.0f / std::sqrt((float)C));
    const std::vector<float> bias = host_random(OC, rng, 0.1f);
    std::vector<float> want((size_t)BT * OC);
    cpu::matmul_forward<float>(want.data(), inp.data(), w.data(), bias.data(), BT, C, OC);
    floatX *d_inp = to_device_floatX(inp), *d_w = to_device_floatX(w), *d_bias = to_device_floatX(bias);
    floatX* d_out = dev_alloc<floatX>(want.size());
    bool ok = true;
    for (int k = 1; k <= 3; k++) {
        printf("validate %s BT=%d C=%d OC=%d\n", names[k], BT, C, OC);
        cudaCheck(cudaMemset(d_out, 0xFF, want.size() * sizeof(floatX)));  // NaN: an unwritten output fails
        run_kernel(k, d_out, d_inp, d_w, d_bias, BT, C, OC);
        ok = compare("out", to_host_floatX(d_out, want.size()), want, 1e-2) && ok;
    }
    for (void* p : {(void*)d_inp, (void*)d_w, (void*)d_bias, (void*)d_out}) cudaCheck(cudaFree(p));
    return ok;
}

int main() {
    print_header("ladder_matmul");
    matmul_setup();
    bool ok = validate(257, 200, 300);  // ragged: no dimension a multiple of a tile
    ok = validate(64, 768, 2304) && ok;
    require_valid(ok);
    const int BT = 4096, C = 768, OC = 3072;  // GPT-2 small's fc layer, 4096 tokens
    printf("BT %d, C %d, OC %d: TFLOP/s of 2 BT C OC\n", BT, C, OC);
    floatX *inp = alloc_random((size_t)BT * C, 1, 1.0f), *w = alloc_random((size_t)OC * C, 2, 0.03f);
    floatX *bias = alloc_random(OC, 3, 0.1f), *out = dev_alloc<floatX>((size_t)BT * OC);
    for (int k = 1; k <= 3; k++) {
        const float ms = time_ms([&] { run_kernel(k, out, inp, w, bias, BT, C, OC); }, 2, k == 1 ? 5 : 20);
        print_flops(names[k], ms, 2.0 * BT * C * OC, 0);
    }
    for (void* p : {(void*)inp, (void*)w, (void*)bias, (void*)out}) cudaCheck(cudaFree(p));
    return 0;
}
