// Matmul (the linear layer) on the GPU, the twin of llmc/ops/cpu/matmul.h:
//   forward    out[BT, OC]  = inp[BT, C] W[OC, C]^T + bias[OC]     (overwritten; bias may be null)
//   backward   dinp[BT, C]  = dout[BT, OC] W[OC, C]                (overwritten)
//              dweight[OC, C] += dout^T inp                        (fp32, accumulated)
//              dbias[OC]      += sum over rows of dout             (fp32, accumulated; may be null)
// The weight gradients are fp32 and each call adds to them once: dw[i] = dw[i] + S[i], S the call's
// sum computed apart from dw's prior content (the gradient-path contract, llmc/ops/cpu/matmul.h).
// The three products run on cuBLASLt with floatX (bf16, or fp16: CUDA_R_FLOATX) inputs A, B and fp32 accumulation
// (CUBLAS_COMPUTE_32F, fp32 alpha/beta); out and dinp are floatX, dweight is an fp32 C = D (floatX A/B,
// fp32 C/D is one of cuBLASLt's supported type combinations). The forward bias is fused into the
// GEMM epilogue (CUBLASLT_EPILOGUE_BIAS); dweight's += is beta = 1 in the same call: the kernel's
// fp32 accumulator holds S, the epilogue adds C once. dbias needs +=, which the BGRAD epilogues
// cannot do (they overwrite, and want a bf16 or D-typed vector), so it is our own deterministic
// column-sum kernel (below), which also adds once.
//
// Row-major <-> cuBLAS column-major. A row-major tensor X[R, K] is, byte for byte, the column-major
// matrix X^T of shape [K, R] with leading dimension K. So every product is computed transposed:
//   forward  out^T[OC, BT] = W[OC, C] inp^T[C, BT]
//            A = weight, stored col-major [C, OC] (ld C), op T  -> [OC, C]     m = OC
//            B = inp,    stored col-major [C, BT] (ld C), op N  -> [C, BT]     n = BT, k = C
//            D = out,    col-major [OC, BT] (ld OC); bias[OC] has D's row count, as the epilogue wants
//   dinp     dinp^T[C, BT] = W^T[C, OC] dout^T[OC, BT]
//            A = weight, stored col-major [C, OC] (ld C), op N                 m = C
//            B = dout,   stored col-major [OC, BT] (ld OC), op N               n = BT, k = OC
//            D = dinp,   col-major [C, BT] (ld C), beta = 0
//   dweight  dweight^T[C, OC] += inp^T[C, BT] dout[BT, OC]
//            A = inp,    stored col-major [C, BT] (ld C), op N                 m = C
//            B = dout,   stored col-major [OC, BT] (ld OC), op T -> [BT, OC]   n = OC, k = BT
//            C = D = dweight, col-major [C, OC] (ld C), beta = 1
//
// Alignment. cuBLASLt needs element-aligned pointers (2 bytes for bf16) and ld >= rows (true by
// construction: ld is the row length). Its fast Hopper kernels (TMA + wgmma) also want 16-byte
// aligned pointers and leading dims that are multiples of 8 elements; for ragged shapes (C = 37) the
// heuristic picks slower kernels, it does not fail. We tell the heuristic the real alignment of every
// pointer (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*; the default assumption is 256 bytes, which a pointer
// into a packed parameter buffer may not meet) and make it part of the cache key. The bias pointer
// of the epilogue must be 16-byte aligned: checked, with a clear failure (misaligned bias vectors
// have been reported to break the epilogue), so the trainer must place every bias at a 16-byte
// aligned offset (rounding each parameter tensor's offset up to a multiple of 8 elements does it).
//
// Setup and caching. One cuBLASLt handle, created by matmul_setup() (idempotent; the ops call it),
// and one 32 MiB workspace (MATMUL_WORKSPACE_BYTES, llmc/ops/op_scratch.h): the trainer binds one from
// its memory plan (matmul_bind_workspace), so no allocation happens inside a step; without one,
// matmul_setup allocates its own. matmul_teardown() frees them. The matmul descriptor, the three
// layouts and the heuristic's algorithm are cached per (product, shape, alignments) in a small
// std::map: the FIRST call of each shape creates them and queries the heuristic (host-side work, no
// allocation); every later call only sets the bias pointer and launches.
//
// Determinism. cuBLAS is bitwise reproducible run to run for a fixed algorithm on the same GPU, and
// the cached algorithm is fixed per shape. For out and dinp we restrict split-K to reductions in fp32
// (CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE, plus none): that keeps the fp32 accumulation promise
// (the INPLACE and OUTPUT_TYPE schemes add partial sums in bf16) and stages partials in the
// workspace, summed in a fixed order. The fp32 dweight plans take no split-K at all (the contract's
// "one add of an independent sum"; INPLACE would add partials into C itself): the heuristic is asked
// for up to MATMUL_HEURISTIC_RESULTS algorithms and the first whose configuration reads
// CUBLASLT_ALGO_CONFIG_SPLITK_NUM = 1 and REDUCTION_SCHEME = NONE is taken; if it offers none, its
// first is reconfigured to SPLITK_NUM 1 / NONE and must pass cublasLtMatmulAlgoCheck, else the
// first call of that shape fails naming it. matmul_fp32_plans_max_split_k() reads the cached plans'
// splits back (test/gpu/matmul.cuh asserts 1).
//
// Our own split-K of the fp32 dweight (issue 35). Without cuBLASLt's split-K a GPT-2-width dweight
// has too few output tiles for the GPU (768 x 768: 36 tiles of 128 x 128 on 132 SMs, 13% of the
// GEMM rate at BT 32768), so from BT >= MATMUL_SPLITK_MIN_BT rows (llmc/ops/op_scratch.h) K = BT is
// cut into P = ceil(BT / MATMUL_SPLITK_ROWS) contiguous row chunks, the last one shorter when BT is
// not a multiple (P depends on BT alone: the same for every C, OC, SM count and layout):
//   1. partials[p] [OC, C] = dout[chunk p]^T inp[chunk p], p < BT / ROWS: ONE strided-batched
//      cuBLASLt call (batch strides ROWS * C, ROWS * OC, C * OC; beta 0, so the scratch's prior
//      content never matters; no cuBLASLt split-K, like every fp32 plan); the shorter last chunk,
//      if any, is one more plain GEMM into partials[P - 1]
//   2. matmul_dweight_reduce: dweight = dweight + (((partials[0] + partials[1]) + ...) + partials[P-1])
//      per element, in chunk order, one vectorized elementwise kernel (the twin of
//      cpu::matmul_dweight_reduce). The chunks are summed BEFORE the one add into dweight, so the
//      contract (dw + S, S independent of dw's prior content) holds for the split path too:
//      accumulating into a zeroed leaf and folding it gives the same bits as accumulating in place.
// The partials [P][OC * C] fp32 come from the op scratch arena (matmul_splitk_scratch_bytes; the
// trainer's plan counts the model's largest, llmc/gpt/plan.h); a smaller arena fails naming the
// shape. Bitwise reproducible run to run: a fixed chunking, fixed cached algorithms, a fixed order.
// The MoE experts' batched dweight (matmul_backward_batched) does not split.
//
// dbias column sum, two stages with a fixed partition (deterministic, fp32 throughout, one add):
//   stage 1: grid (column strips, row chunks of 256 rows). A block is 32 x 8 threads; thread (tx, ty)
//            owns VEC consecutive columns (VEC = 8: one 16-byte load of bf16 per row, when OC % 8 == 0
//            and dout is 16-byte aligned; VEC = 1 otherwise) and sums rows ty, ty + 8, ... of its
//            chunk in order; the 8 row-strands are combined in shared memory in order ty = 0..7 and
//            the block writes one fp32 partial per column: partial[chunk][OC].
//   stage 2: thread (tx, ty) of a 32 x 8 block sums chunks ty, ty + 8, ... of column blockIdx.x*32+tx;
//            the 8 strands are combined in order and added to the fp32 dbias (one add, __fadd_rn).
// Scratch (cuda_scratch): matmul_backward with dbias needs ceil(BT / 256) * OC floats
// (matmul_scratch_bytes), with dweight at BT >= MATMUL_SPLITK_MIN_BT P * C * OC floats
// (matmul_splitk_scratch_bytes; both from the arena's start, one after the other:
// matmul_backward_scratch_bytes is the larger); the forward and the rest of the backward need none.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <tuple>
#include <cublasLt.h>
#include "llmc/ops/cuda_common.cuh"
#include "llmc/ops/op_scratch.h"  // MATMUL_WORKSPACE_BYTES, the dbias chunk rows and scratch sizes

inline void matmul_cublas_check(cublasStatus_t status, const char* file, int line) {
    if (status != CUBLAS_STATUS_SUCCESS)
        LLMC_FAIL("cuBLAS error at %s:%d: %s", file, line, cublasLtGetStatusString(status));
}
#ifndef cublasCheck
#define cublasCheck(status) matmul_cublas_check((status), __FILE__, __LINE__)
#endif

// heuristic results asked for where split-K is excluded (the fp32 dweight plans): the first
// without split-K among them is taken
constexpr int MATMUL_HEURISTIC_RESULTS = 8;


// ------------------------------------------------------------------------------------------------
// dbias kernels

// End of stage 1 (a 32 x 8 block; thread (tx, ty) holds the sums acc of its row-strand ty for columns
// strip_col0 + tx * VEC ..): the 8 row-strands are combined in shared memory in the fixed order
// ty = 0..7, every thread of the block finishing columns, into partial_row[strip_col0 ..] (< OC).
template <int VEC>
__device__ inline void matmul_dbias_combine_strands(float* partial_row, const float (&acc)[VEC], int strip_col0,
                                                    int OC) {
    const int tx = threadIdx.x, ty = threadIdx.y;
    __shared__ float strand[8][32 * VEC];
#pragma unroll
    for (int v = 0; v < VEC; v++) strand[ty][tx * VEC + v] = acc[v];
    __syncthreads();
    for (int c = ty * 32 + tx; c < 32 * VEC; c += 256) {
        float s = 0.0f;
#pragma unroll
        for (int y = 0; y < 8; y++) s += strand[y][c];
        if (strip_col0 + c < OC) partial_row[strip_col0 + c] = s;
    }
}

template <int VEC>
__global__ void __launch_bounds__(256) matmul_dbias_partial_kernel(float* __restrict__ partial,
                                                                  const floatX* __restrict__ dout, int BT, int OC) {
    static_assert(VEC == 1 || VEC == 8, "VEC is one bf16 or one 16-byte vector of 8");
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int strip_col0 = blockIdx.x * (32 * VEC);
    const int col = strip_col0 + tx * VEC;  // with VEC = 8, OC % 8 == 0: col < OC means all 8 are inside
    const int chunk = blockIdx.y;
    const int row_end = min(BT, (chunk + 1) * MATMUL_DBIAS_ROWS_PER_CHUNK);

    float acc[VEC];
#pragma unroll
    for (int v = 0; v < VEC; v++) acc[v] = 0.0f;

    if (col < OC) {
        const size_t stride = (size_t)8 * OC;  // 8 row-strands per block
        const floatX* p = dout + (size_t)(chunk * MATMUL_DBIAS_ROWS_PER_CHUNK + ty) * OC + col;
        int r = chunk * MATMUL_DBIAS_ROWS_PER_CHUNK + ty;
        if constexpr (VEC == 8) {
            // four rows in flight per thread, added in row order
            for (; r + 24 < row_end; r += 32, p += 4 * stride) {
                uint4 raw[4];
#pragma unroll
                for (int u = 0; u < 4; u++) raw[u] = __ldg(reinterpret_cast<const uint4*>(p + u * stride));
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    float f[8];
                    floatx8::unpack8(f, raw[u]);
#pragma unroll
                    for (int v = 0; v < 8; v++) acc[v] += f[v];
                }
            }
            for (; r < row_end; r += 8, p += stride) {
                float f[8];
                floatx8::unpack8(f, __ldg(reinterpret_cast<const uint4*>(p)));
#pragma unroll
                for (int v = 0; v < 8; v++) acc[v] += f[v];
            }
        } else {
            for (; r + 24 < row_end; r += 32, p += 4 * stride) {
                floatX x[4];
#pragma unroll
                for (int u = 0; u < 4; u++) x[u] = p[u * stride];
#pragma unroll
                for (int u = 0; u < 4; u++) acc[0] += floatX_to_float(x[u]);
            }
            for (; r < row_end; r += 8, p += stride) acc[0] += floatX_to_float(*p);
        }
    }

    matmul_dbias_combine_strands<VEC>(partial + (size_t)chunk * OC, acc, strip_col0, OC);
}

// Stage 2, for the single and the batched products: grid (column strips of 32, batch: 1 for the single
// product), block 32 x 8: thread (tx, ty) sums chunks ty, ty + 8, ... of its column of partial[b]
// [nchunks][OC]; the 8 strands are combined in order and added to the fp32 dbias[b] once.
__global__ void __launch_bounds__(256) matmul_dbias_finish_kernel(float* __restrict__ dbias,
                                                                 const float* __restrict__ partial, int nchunks, int OC) {
    const int tx = threadIdx.x, ty = threadIdx.y, b = blockIdx.y;
    const int col = blockIdx.x * 32 + tx;
    const float* p = partial + (size_t)b * nchunks * OC;
    float s = 0.0f;
    if (col < OC) {
#pragma unroll 4
        for (int k = ty; k < nchunks; k += 8) s += p[(size_t)k * OC + col];
    }
    __shared__ float strand[8][32];
    strand[ty][tx] = s;
    __syncthreads();
    if (ty == 0 && col < OC) {
        float t = 0.0f;
#pragma unroll
        for (int y = 0; y < 8; y++) t += strand[y][tx];
        float* db = dbias + (size_t)b * OC + col;
        *db = __fadd_rn(*db, t);
    }
}

// ------------------------------------------------------------------------------------------------
// split-K dweight, step 2 (the twin of cpu::matmul_dweight_reduce):
//   dweight[i] = dweight[i] + (((partials[0][i] + partials[1][i]) + partials[2][i]) + ...)
// one thread per element (VEC = 1) or per 16-byte vector of 4 (VEC = 4: n % 4 == 0 and both pointers
// 16-byte aligned), grid-stride. Every element gets the same additions in the same order on both
// paths (__fadd_rn: never contracted), so the bits depend on neither the path nor the grid.
// Memory-bound: P + 2 floats per element; the partials are read once, with streaming loads (__ldcs:
// evict-first, they are dead after this), 4 chunks in flight per thread (the unrolled loads do not
// depend on the running sum).
__device__ inline float4 matmul_add4(float4 a, float4 b) {
    return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
}
template <int VEC>
__global__ void __launch_bounds__(256) matmul_dweight_reduce_kernel(float* __restrict__ dweight,
                                                                   const float* __restrict__ partials, int P, size_t n) {
    static_assert(VEC == 1 || VEC == 4, "VEC is one float or one 16-byte vector of 4");
    const size_t nv = n / VEC;  // VEC = 4 only when n % 4 == 0
    for (size_t v = (size_t)blockIdx.x * blockDim.x + threadIdx.x; v < nv; v += (size_t)gridDim.x * blockDim.x) {
        if constexpr (VEC == 4) {
            const float4* p = reinterpret_cast<const float4*>(partials) + v;
            float4 s = __ldcs(p);
#pragma unroll 4
            for (int c = 1; c < P; c++) s = matmul_add4(s, __ldcs(p + (size_t)c * nv));
            float4* d = reinterpret_cast<float4*>(dweight) + v;
            *d = matmul_add4(*d, s);
        } else {
            const float* p = partials + v;
            float s = __ldcs(p);
#pragma unroll 4
            for (int c = 1; c < P; c++) s = __fadd_rn(s, __ldcs(p + (size_t)c * nv));
            dweight[v] = __fadd_rn(dweight[v], s);
        }
    }
}

// ------------------------------------------------------------------------------------------------
// cuBLASLt state and the per-shape plan cache

namespace matmul_detail {

// the largest power of two dividing the address, capped at 256 (cuBLASLt's default assumption)
inline uint32_t pointer_alignment(const void* p) {
    uintptr_t a = (uintptr_t)p;
    uint32_t align = 256;
    while (align > 1 && (a % align) != 0) align >>= 1;
    return align;
}

struct GemmKey {
    bool transa, transb, bias, d_fp32;
    int m, n, k;
    uint32_t align_a, align_b, align_d, align_bias;
    bool operator<(const GemmKey& o) const {
        return std::tie(transa, transb, bias, d_fp32, m, n, k, align_a, align_b, align_d, align_bias) <
               std::tie(o.transa, o.transb, o.bias, o.d_fp32, o.m, o.n, o.k, o.align_a, o.align_b, o.align_d,
                        o.align_bias);
    }
};

struct GemmPlan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;  // C uses D's layout (same buffer)
    cublasLtMatmulAlgo_t algo;
};

struct State {
    cublasLtHandle_t handle = nullptr;
    void* workspace = nullptr;        // the bound one: the trainer's (matmul_bind_workspace) or owned
    void* owned_workspace = nullptr;  // matmul_setup's, when nothing else is bound
    std::map<GemmKey, GemmPlan> plans;
};
inline State& state() {
    static State s;
    return s;
}

}  // namespace matmul_detail

inline void matmul_setup() {
    matmul_detail::State& s = matmul_detail::state();
    if (!s.handle) cublasCheck(cublasLtCreate(&s.handle));
    if (s.workspace) return;
    if (!s.owned_workspace) cudaCheck(cudaMalloc(&s.owned_workspace, MATMUL_WORKSPACE_BYTES));
    s.workspace = s.owned_workspace;
}
// The workspace the matmuls use from now on: MATMUL_WORKSPACE_BYTES of the caller's memory (the
// trainer's memory plan), or nullptr for matmul_setup's own.
inline void matmul_bind_workspace(void* workspace) {
    matmul_detail::State& s = matmul_detail::state();
    s.workspace = workspace ? workspace : s.owned_workspace;
}

inline void matmul_teardown() {
    matmul_detail::State& s = matmul_detail::state();
    if (!s.handle) return;
    llmc_stream_sync();  // no matmul may still use the workspace
    for (auto& kv : s.plans) {
        cublasCheck(cublasLtMatrixLayoutDestroy(kv.second.a));
        cublasCheck(cublasLtMatrixLayoutDestroy(kv.second.b));
        cublasCheck(cublasLtMatrixLayoutDestroy(kv.second.d));
        cublasCheck(cublasLtMatmulDescDestroy(kv.second.desc));
    }
    s.plans.clear();
    if (s.owned_workspace) cudaCheck(cudaFree(s.owned_workspace));
    s.workspace = s.owned_workspace = nullptr;
    cublasCheck(cublasLtDestroy(s.handle));
    s.handle = nullptr;
}

// number of cached plans (a test checks that repeated calls of one shape add none)
inline size_t matmul_cached_plans() { return matmul_detail::state().plans.size(); }

namespace matmul_detail {

// A plan's matmul descriptor: fp32 compute and scale type, op(A) op(B), and with a bias the BIAS
// epilogue on a bf16 vector (the pointer is set too: the heuristic reads its alignment from it)
inline cublasLtMatmulDesc_t make_matmul_desc(bool transa, bool transb, const floatX* bias) {
    cublasLtMatmulDesc_t desc;
    cublasCheck(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t opa = transa ? CUBLAS_OP_T : CUBLAS_OP_N, opb = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
    cublasLtEpilogue_t epilogue = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    if (bias) {
        int32_t bias_type = CUDA_R_FLOATX;
        cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                   sizeof(bias_type)));
        cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    }
    return desc;
}

// an algorithm's configured K splits (1: none)
inline int algo_split_k(const cublasLtMatmulAlgo_t& algo) {
    int32_t splits = 1;
    size_t written = 0;
    cublasCheck(cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof(splits),
                                                     &written));
    return splits;
}
inline uint32_t algo_reduction(const cublasLtMatmulAlgo_t& algo) {
    uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
    size_t written = 0;
    cublasCheck(cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                                     sizeof(scheme), &written));
    return scheme;
}

// The heuristic's algorithm for a plan's descriptor and layouts under our preferences: the
// workspace, split-K partials in fp32 (or no split-K), the operands' alignments in bytes (C is D).
// no_split_k (the fp32 dweight plans): the first of its results without split-K, else its first
// reconfigured to one K split, if cublasLtMatmulAlgoCheck accepts that (see the top of the file).
// found == 0 (or a status other than success): there is none.
inline cublasStatus_t find_algo(const GemmPlan& p, uint32_t align_a, uint32_t align_b, uint32_t align_d,
                                bool no_split_k, cublasLtMatmulHeuristicResult_t& result, int& found) {
    cublasLtMatmulPreference_t pref;
    cublasCheck(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t ws = MATMUL_WORKSPACE_BYTES;
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;  // split-K partials in fp32 (or no split-K)
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction,
                                                     sizeof(reduction)));
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                                     sizeof(uint32_t)));
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                                                     sizeof(uint32_t)));
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d,
                                                     sizeof(uint32_t)));
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d,
                                                     sizeof(uint32_t)));
    cublasLtMatmulHeuristicResult_t results[MATMUL_HEURISTIC_RESULTS] = {};
    found = 0;
    cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(state().handle, p.desc, p.a, p.b, p.d, p.d, pref,
                                                           no_split_k ? MATMUL_HEURISTIC_RESULTS : 1, results, &found);
    cublasCheck(cublasLtMatmulPreferenceDestroy(pref));
    if (status != CUBLAS_STATUS_SUCCESS || found == 0) return status;
    result = results[0];
    if (!no_split_k) return status;
    for (int i = 0; i < found; i++)
        if (algo_split_k(results[i].algo) == 1 && algo_reduction(results[i].algo) == CUBLASLT_REDUCTION_SCHEME_NONE) {
            result = results[i];
            return status;
        }
    const int32_t one = 1;
    const uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
    cublasCheck(cublasLtMatmulAlgoConfigSetAttribute(&result.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof(one)));
    cublasCheck(cublasLtMatmulAlgoConfigSetAttribute(&result.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &none,
                                                     sizeof(none)));
    status = cublasLtMatmulAlgoCheck(state().handle, p.desc, p.a, p.b, p.d, p.d, &result.algo, &result);
    if (status != CUBLAS_STATUS_SUCCESS) found = 0;
    return status;
}

// D = op(A) op(B) (+ bias) + beta * D with a plan's algorithm, on llmc_stream(); the bias pointer
// must have the alignment the plan was made with (it is in the plan's key)
inline cublasStatus_t run_plan(GemmPlan& p, void* d, const floatX* a, const floatX* b, const floatX* bias,
                               float beta) {
    State& s = state();
    if (bias)
        cublasCheck(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    const float alpha = 1.0f;
    return cublasLtMatmul(s.handle, p.desc, &alpha, a, p.a, b, p.b, &beta, d, p.d, d, p.d, &p.algo, s.workspace,
                          MATMUL_WORKSPACE_BYTES, llmc_stream());
}

// D's element type: floatX (out, dinp) or fp32 (dweight, with no split-K)
inline cudaDataType d_type(const floatX*) { return CUDA_R_FLOATX; }
inline cudaDataType d_type(const float*) { return CUDA_R_32F; }

// D[m, n] (column-major, ld m) = op(A) op(B) (+ bias[m] broadcast over columns) + beta * D
//   A stored [k, m] (ld k) if transa else [m, k] (ld m); B stored [n, k] (ld n) if transb else [k, n] (ld k)
//   A, B bf16; D bf16 or fp32 (DT)
// `what`, BT, C, OC only name the caller's shape in error messages.
template <typename DT>
inline void gemm(const char* what, DT* d, const floatX* a, const floatX* b, const floatX* bias, int m, int n, int k,
                 bool transa, bool transb, float beta, int BT, int C, int OC) {
    LLMC_CHECK(m > 0 && n > 0 && k > 0, "%s: empty shape (BT=%d, C=%d, OC=%d)", what, BT, C, OC);
    matmul_setup();
    State& s = state();
    constexpr bool d_fp32 = std::is_same<DT, float>::value;
    GemmKey key{transa, transb, bias != nullptr, d_fp32, m, n, k, pointer_alignment(a), pointer_alignment(b),
                pointer_alignment(d), bias ? pointer_alignment(bias) : 0u};
    LLMC_CHECK(key.align_a >= 2 && key.align_b >= 2 && key.align_d >= sizeof(DT),
               "%s: tensors must be element-aligned (BT=%d, C=%d, OC=%d; pointers %p %p %p)", what, BT, C, OC,
               (const void*)a, (const void*)b, (void*)d);
    LLMC_CHECK(!bias || key.align_bias >= 16,
               "%s: the bias pointer %p must be 16-byte aligned for the cuBLASLt bias epilogue (BT=%d, C=%d, OC=%d)",
               what, (const void*)bias, BT, C, OC);

    auto it = s.plans.find(key);
    if (it == s.plans.end()) {
        // first call of this shape: descriptors, layouts and the heuristic query (host-side work)
        GemmPlan p;
        p.desc = make_matmul_desc(transa, transb, bias);
        cublasCheck(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_FLOATX, transa ? k : m, transa ? m : k, transa ? k : m));
        cublasCheck(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_FLOATX, transb ? n : k, transb ? k : n, transb ? n : k));
        cublasCheck(cublasLtMatrixLayoutCreate(&p.d, d_type(d), m, n, m));
        cublasLtMatmulHeuristicResult_t result;
        int found;
        const cublasStatus_t status = find_algo(p, key.align_a, key.align_b, key.align_d, d_fp32, result, found);
        if (status != CUBLAS_STATUS_SUCCESS || found == 0) {
            cublasLtMatrixLayoutDestroy(p.a);
            cublasLtMatrixLayoutDestroy(p.b);
            cublasLtMatrixLayoutDestroy(p.d);
            cublasLtMatmulDescDestroy(p.desc);
            LLMC_FAIL("%s: cuBLASLt found no algorithm (%s) for BT=%d, C=%d, OC=%d: D[%d, %d] = op%s(A) op%s(B), k=%d, "
                      "bias %s, D %s%s, alignments A %u B %u D %u bias %u bytes",
                      what, status != CUBLAS_STATUS_SUCCESS ? cublasLtGetStatusString(status) : "no result", BT, C,
                      OC, m, n, transa ? "T" : "N", transb ? "T" : "N", k, bias ? "yes" : "no",
                      d_fp32 ? "fp32" : LLMC_PRECISION, d_fp32 ? " without split-K" : "", key.align_a, key.align_b,
                      key.align_d, key.align_bias);
        }
        p.algo = result.algo;
        it = s.plans.emplace(key, p).first;
    }
    const cublasStatus_t status = run_plan(it->second, d, a, b, bias, beta);
    LLMC_CHECK(status == CUBLAS_STATUS_SUCCESS, "%s: cublasLtMatmul failed (%s) for BT=%d, C=%d, OC=%d", what,
               cublasLtGetStatusString(status), BT, C, OC);
    cudaCheckLaunch();
}

// dbias[OC] += column sums of dout[BT, OC] (fp32; two deterministic stages through cuda_scratch, one add)
inline void bias_grad(float* dbias, const floatX* dout, int BT, int OC) {
    LLMC_CHECK(BT > 0 && OC > 0, "matmul_backward dbias: empty shape (BT=%d, OC=%d)", BT, OC);
    const int nchunks = ceil_div(BT, MATMUL_DBIAS_ROWS_PER_CHUNK);
    LLMC_CHECK(nchunks <= 65535, "matmul_backward dbias: BT=%d exceeds the grid's %d rows", BT,
               65535 * MATMUL_DBIAS_ROWS_PER_CHUNK);
    float* partial = cuda_scratch<float>((size_t)nchunks * OC, "matmul_backward (dbias)");
    const dim3 block(32, 8);
    if (OC % 8 == 0 && pointer_alignment(dout) >= 16) {
        matmul_dbias_partial_kernel<8><<<dim3(ceil_div(OC, 256), nchunks), block, 0, llmc_stream()>>>(partial, dout, BT, OC);
    } else {
        matmul_dbias_partial_kernel<1><<<dim3(ceil_div(OC, 32), nchunks), block, 0, llmc_stream()>>>(partial, dout, BT, OC);
    }
    cudaCheckLaunch();
    matmul_dbias_finish_kernel<<<ceil_div(OC, 32), block, 0, llmc_stream()>>>(dbias, partial, nchunks, OC);
    cudaCheckLaunch();
}

}  // namespace matmul_detail

// dweight[i] = dweight[i] + (((partials[0][i] + partials[1][i]) + ...) + partials[P-1][i]) for i < n:
// the split-K dweight's sum of its P chunk partials [P][n] (fp32, one add into dweight; the twin of
// cpu::matmul_dweight_reduce, bitwise)
inline void matmul_dweight_reduce(float* dweight, const float* partials, int P, size_t n) {
    LLMC_CHECK(P >= 1, "matmul_dweight_reduce: P=%d partials", P);
    if (n == 0) return;
    using matmul_detail::pointer_alignment;
    const bool vec4 = n % 4 == 0 && pointer_alignment(dweight) >= 16 && pointer_alignment(partials) >= 16;
    const size_t work = vec4 ? n / 4 : n;
    // a grid-stride loop: up to 256K blocks of 256 (past that each thread takes a few elements)
    const unsigned blocks = (unsigned)std::min<size_t>((work + 255) / 256, (size_t)1 << 18);
    if (vec4) matmul_dweight_reduce_kernel<4><<<blocks, 256, 0, llmc_stream()>>>(dweight, partials, P, n);
    else matmul_dweight_reduce_kernel<1><<<blocks, 256, 0, llmc_stream()>>>(dweight, partials, P, n);
    cudaCheckLaunch();
}

namespace matmul_detail {

// (defined with the batched products below)
template <typename DT>
bool gemm_batched(const char* what, DT* d, const floatX* a, const floatX* b, const floatX* bias, int m, int n, int k,
                  bool transa, bool transb, float beta, int batch, int BT, int C, int OC);

// dweight[OC, C] += dout[BT, OC]^T inp[BT, C] (fp32, one add). rows_per_chunk <= 0, or >= BT: one
// GEMM with beta = 1. Otherwise the split of the top of the file: P = ceil(BT / rows_per_chunk)
// partials in the scratch arena, then matmul_dweight_reduce. matmul_backward passes
// MATMUL_SPLITK_ROWS from MATMUL_SPLITK_MIN_BT on, 0 below (matmul_splitk_chunks); other values are
// for tests and benchmarks (dev/cuda/matmul.cu splitk compares chunk sizes).
inline void dweight_grad(float* dweight, const floatX* dout, const floatX* inp, int BT, int C, int OC,
                         int rows_per_chunk) {
    const int P = rows_per_chunk > 0 ? ceil_div(BT, rows_per_chunk) : 1;
    if (P <= 1) {
        gemm("matmul_backward (dweight)", dweight, inp, dout, nullptr, /*m*/ C, /*n*/ OC, /*k*/ BT, /*transa*/ false,
             /*transb*/ true, /*beta*/ 1.0f, BT, C, OC);
        return;
    }
    const size_t n = (size_t)C * OC, bytes = (size_t)P * n * sizeof(float);
    LLMC_CHECK(bytes <= cuda_scratch_arena().bytes,
               "matmul_backward (dweight split-K): BT=%d in %d chunks of %d rows, C=%d, OC=%d needs %zu bytes of "
               "partials, the scratch arena holds %zu (llmc/ops/op_scratch.h matmul_splitk_scratch_bytes; the "
               "trainer's plan counts the model's largest dweight)",
               BT, P, rows_per_chunk, C, OC, bytes, cuda_scratch_arena().bytes);
    float* partials = cuda_scratch<float>((size_t)P * n, "matmul_backward (dweight split-K partials)");
    const int full = BT / rows_per_chunk, tail = BT - full * rows_per_chunk;
    // the full chunks: chunk p is rows [p R, (p + 1) R) of inp and dout, i.e. column-major A [C, R]
    // and B^T [OC, R] at batch strides R C and R OC, into D = partials[p] [C, OC] (beta 0)
    gemm_batched("matmul_backward (dweight split-K chunks)", partials, inp, dout, nullptr, /*m*/ C, /*n*/ OC,
                 /*k*/ rows_per_chunk, /*transa*/ false, /*transb*/ true, /*beta*/ 0.0f, full, BT, C, OC);
    if (tail > 0) {  // the shorter last chunk
        const size_t row0 = (size_t)full * rows_per_chunk;
        gemm("matmul_backward (dweight split-K last chunk)", partials + (size_t)full * n, inp + row0 * C,
             dout + row0 * OC, nullptr, /*m*/ C, /*n*/ OC, /*k*/ tail, false, true, 0.0f, BT, C, OC);
    }
    matmul_dweight_reduce(dweight, partials, P, n);
}

// LLMC_DWEIGHT_SPLIT=0 in the environment turns the split off: a benchmark's before / after on one
// binary (scripts/device_check.sh). The split changes the fp32 rounding, so a run and its resume
// must agree on it.
inline bool dweight_split_enabled() {
    static const bool on = [] {
        const char* e = getenv("LLMC_DWEIGHT_SPLIT");
        return !(e && e[0] == '0' && e[1] == 0);
    }();
    return on;
}

}  // namespace matmul_detail

// ------------------------------------------------------------------------------------------------
// the ops (same names and argument order as llmc/ops/cpu/matmul.h)

// out[BT, OC] = inp[BT, C] W[OC, C]^T + bias[OC] (bias may be null); out overwritten
inline void matmul_forward(floatX* out, const floatX* inp, const floatX* weight, const floatX* bias, int BT, int C,
                           int OC) {
    matmul_detail::gemm("matmul_forward", out, weight, inp, bias, /*m*/ OC, /*n*/ BT, /*k*/ C, /*transa*/ true,
                        /*transb*/ false, /*beta*/ 0.0f, BT, C, OC);
}

// dinp[BT, C] = dout W (overwritten); dweight[OC, C] += dout^T inp and dbias[OC] += column sums of
// dout (fp32, one add each). Each may be null: the zero-bubble pipeline asks for dinp and for
// (dweight, dbias) in two calls. split_k = true splits dweight over K = BT in chunks of
// MATMUL_SPLITK_ROWS from MATMUL_SPLITK_MIN_BT rows on (the partials in the scratch arena); false keeps
// it in one GEMM whatever BT. The choice is the caller's fixed rule on the whole weight, never the
// layout's (matmul_splitk_wanted; the model's dense layers: dense_dweight_split in llmc/gpt/plan.h,
// whose memory plan counts the partials of exactly those).
inline void matmul_backward(floatX* dinp, float* dweight, float* dbias, const floatX* dout, const floatX* inp,
                            const floatX* weight, int BT, int C, int OC, bool split_k = false) {
    if (dbias) matmul_detail::bias_grad(dbias, dout, BT, OC);
    if (dinp)
        matmul_detail::gemm("matmul_backward (dinp)", dinp, weight, dout, nullptr, /*m*/ C, /*n*/ BT, /*k*/ OC,
                            /*transa*/ false, /*transb*/ false, /*beta*/ 0.0f, BT, C, OC);
    if (dweight)  // split over K from MATMUL_SPLITK_MIN_BT rows on (a rule on BT alone: op_scratch.h)
        matmul_detail::dweight_grad(dweight, dout, inp, BT, C, OC,
                                    split_k && matmul_splitk_chunks(BT) > 1 && matmul_detail::dweight_split_enabled()
                                        ? MATMUL_SPLITK_ROWS
                                        : 0);
}

// ------------------------------------------------------------------------------------------------
// Batched products: n_batch independent linear layers with contiguous operands (the experts of an
// MoE layer, llmc/ops/moe.cuh), the twins of cpu::matmul_forward_batched / cpu::matmul_backward_batched:
//   forward    out[b] [BT, OC] = inp[b] [BT, C] W[b] [OC, C]^T + bias[b] [OC]   (overwritten)
//   backward   dinp[b] = dout[b] W[b] (overwritten), dweight[b] += dout[b]^T inp[b], dbias[b] += colsum
//              (dweight, dbias fp32, one add each, as matmul_backward)
// One strided-batched cuBLASLt call per product (CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT and
// STRIDED_BATCH_OFFSET; the batch strides are the packed sizes of one batch's matrices), with the
// same column-major view, split-K rules (none for the fp32 dweight) and alignment preferences as the
// single products above; the experts' dweight does not take the single product's own split over BT
// either (the experts' capacity rows are few, and n_batch of them already give the GPU its tiles);
// the alignment of a batched operand is that of its base pointer AND of its batch stride in bytes.
// Forward bias: the BIAS epilogue with CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE = OC when every
// batch's bias vector is 16-byte aligned (base aligned, OC % 8 == 0) and the heuristic offers an
// algorithm for it; otherwise a small kernel writes the broadcast bias into out and the product
// adds to it (beta = 1). Both are deterministic.
// dbias: the same two-stage column sum as bias_grad, with the batch as a grid dimension (row chunks
// of 256 never cross a batch): scratch n_batch * ceil(BT / 256) * OC floats
// (matmul_batched_scratch_bytes); the forward and the backward without dbias need none.
// The batched plans live in their own cache (released at program exit; matmul_teardown leaves them,
// they hold no device memory and stay valid for a new handle).

// out[r, o] = bias[r / BT, o] for the n_rows = n_batch * BT rows (the forward's fallback bias path)
__global__ void matmul_bias_fill_batched_kernel(floatX* __restrict__ out, const floatX* __restrict__ bias, size_t n_rows,
                                                int BT, int OC) {
    const size_t total = n_rows * OC;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
        const size_t row = idx / OC;
        const int o = (int)(idx - row * OC);
        out[idx] = bias[(row / BT) * OC + o];
    }
}

// Stage 1 of the batched dbias: grid (column strips, row chunks, batch), block 32 x 8. Thread (tx, ty)
// owns VEC consecutive columns and sums rows ty, ty + 8, ... of its chunk in order; the 8 strands are
// combined in order ty = 0..7 into partial[b][chunk][OC].
template <int VEC>
__global__ void __launch_bounds__(256) matmul_dbias_batched_partial_kernel(float* __restrict__ partial,
                                                                          const floatX* __restrict__ dout, int BT,
                                                                          int OC, int nchunks) {
    static_assert(VEC == 1 || VEC == 8, "VEC is one bf16 or one 16-byte vector of 8");
    const int tx = threadIdx.x, ty = threadIdx.y, chunk = blockIdx.y, b = blockIdx.z;
    const int strip_col0 = blockIdx.x * (32 * VEC);
    const int col = strip_col0 + tx * VEC;  // VEC = 8 only when OC % 8 == 0: col < OC covers all 8
    const floatX* d = dout + (size_t)b * BT * OC;
    const int row_end = min(BT, (chunk + 1) * MATMUL_DBIAS_ROWS_PER_CHUNK);

    float acc[VEC];
#pragma unroll
    for (int v = 0; v < VEC; v++) acc[v] = 0.0f;
    if (col < OC) {
#pragma unroll 4
        for (int r = chunk * MATMUL_DBIAS_ROWS_PER_CHUNK + ty; r < row_end; r += 8) {
            const floatX* p = d + (size_t)r * OC + col;
            if constexpr (VEC == 8) {
                float f[8];
                floatx8::unpack8(f, __ldg(reinterpret_cast<const uint4*>(p)));
#pragma unroll
                for (int v = 0; v < 8; v++) acc[v] += f[v];
            } else {
                acc[0] += floatX_to_float(*p);
            }
        }
    }
    matmul_dbias_combine_strands<VEC>(partial + ((size_t)b * nchunks + chunk) * OC, acc, strip_col0, OC);
}

// Stage 2: matmul_dbias_finish_kernel above, with the batch as grid dimension y.

namespace matmul_detail {

// alignment of every batch's pointer base + i * stride (stride in elements of elem_bytes)
inline uint32_t batched_alignment(const void* base, int64_t stride, size_t elem_bytes = sizeof(floatX)) {
    uint32_t align = pointer_alignment(base);
    const uint64_t stride_bytes = (uint64_t)stride * elem_bytes;
    while (align > 1 && stride_bytes % align != 0) align >>= 1;
    return align;
}

struct BatchedGemmKey {
    bool transa, transb, bias, d_fp32;
    int m, n, k, batch;
    uint32_t align_a, align_b, align_d, align_bias;
    bool operator<(const BatchedGemmKey& o) const {
        return std::tie(transa, transb, bias, d_fp32, m, n, k, batch, align_a, align_b, align_d, align_bias) <
               std::tie(o.transa, o.transb, o.bias, o.d_fp32, o.m, o.n, o.k, o.batch, o.align_a, o.align_b, o.align_d,
                        o.align_bias);
    }
};

struct BatchedGemmPlan {
    GemmPlan p;
    bool found = false;  // false: cuBLASLt offers no algorithm (allowed only with the bias epilogue)
};

struct BatchedPlans {
    std::map<BatchedGemmKey, BatchedGemmPlan> plans;
    ~BatchedPlans() {  // host-side descriptors only, released at exit
        for (auto& kv : plans) {
            if (kv.second.p.a) cublasLtMatrixLayoutDestroy(kv.second.p.a);
            if (kv.second.p.b) cublasLtMatrixLayoutDestroy(kv.second.p.b);
            if (kv.second.p.d) cublasLtMatrixLayoutDestroy(kv.second.p.d);
            if (kv.second.p.desc) cublasLtMatmulDescDestroy(kv.second.p.desc);
        }
    }
};
inline BatchedPlans& batched_plans() {
    static BatchedPlans s;
    return s;
}

inline cublasLtMatrixLayout_t batched_layout(int rows, int cols, int batch, cudaDataType type = CUDA_R_FLOATX) {
    cublasLtMatrixLayout_t l;
    cublasCheck(cublasLtMatrixLayoutCreate(&l, type, rows, cols, rows));
    const int32_t count = batch;
    const int64_t stride = (int64_t)rows * cols;
    cublasCheck(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    cublasCheck(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
    return l;
}

// For each of `batch` products (operands packed back to back, batch strides m*k, k*n, m*n and m):
//   D[m, n] (column-major, ld m) = op(A) op(B) (+ bias[m] broadcast over columns) + beta * D
// with A, B stored as in gemm() above (D bf16 or fp32, as there). Returns false, having done nothing,
// only when a bias is given and cuBLASLt has no algorithm for the batched bias epilogue (the caller
// then adds the bias itself).
template <typename DT>
bool gemm_batched(const char* what, DT* d, const floatX* a, const floatX* b, const floatX* bias, int m, int n,
                  int k, bool transa, bool transb, float beta, int batch, int BT, int C, int OC) {
    LLMC_CHECK(m > 0 && n > 0 && k > 0 && batch > 0, "%s: empty shape (n_batch=%d, BT=%d, C=%d, OC=%d)", what, batch,
               BT, C, OC);
    matmul_setup();
    constexpr bool d_fp32 = std::is_same<DT, float>::value;
    BatchedGemmKey key{transa,
                       transb,
                       bias != nullptr,
                       d_fp32,
                       m,
                       n,
                       k,
                       batch,
                       batched_alignment(a, (int64_t)m * k),
                       batched_alignment(b, (int64_t)k * n),
                       batched_alignment(d, (int64_t)m * n, sizeof(DT)),
                       bias ? batched_alignment(bias, m) : 0u};
    LLMC_CHECK(key.align_a >= 2 && key.align_b >= 2 && key.align_d >= sizeof(DT),
               "%s: tensors must be element-aligned (n_batch=%d, BT=%d, C=%d, OC=%d; pointers %p %p %p)", what,
               batch, BT, C, OC, (const void*)a, (const void*)b, (void*)d);
    LLMC_CHECK(!bias || key.align_bias >= 16,
               "%s: every batch's bias must be 16-byte aligned for the epilogue (n_batch=%d, BT=%d, C=%d, OC=%d)", what,
               batch, BT, C, OC);

    auto& plans = batched_plans().plans;
    auto it = plans.find(key);
    if (it == plans.end()) {
        BatchedGemmPlan bp;
        GemmPlan& p = bp.p;
        p.desc = make_matmul_desc(transa, transb, bias);
        if (bias) {
            const int64_t bias_stride = m;
            cublasCheck(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &bias_stride,
                                                       sizeof(bias_stride)));
        }
        p.a = transa ? batched_layout(k, m, batch) : batched_layout(m, k, batch);
        p.b = transb ? batched_layout(n, k, batch) : batched_layout(k, n, batch);
        p.d = batched_layout(m, n, batch, d_type(d));
        cublasLtMatmulHeuristicResult_t result;
        int found;
        const cublasStatus_t status = find_algo(p, key.align_a, key.align_b, key.align_d, d_fp32, result, found);
        bp.found = status == CUBLAS_STATUS_SUCCESS && found > 0;
        if (bp.found) p.algo = result.algo;
        else if (!bias)
            LLMC_FAIL("%s: cuBLASLt found no algorithm (%s) for n_batch=%d, BT=%d, C=%d, OC=%d: D[%d, %d] = op%s(A) "
                      "op%s(B), k=%d, alignments A %u B %u D %u bytes",
                      what, status != CUBLAS_STATUS_SUCCESS ? cublasLtGetStatusString(status) : "no result", batch, BT,
                      C, OC, m, n, transa ? "T" : "N", transb ? "T" : "N", k, key.align_a, key.align_b, key.align_d);
        // (descriptors of a plan without algorithm are kept: the key is then answered "no" at once)
        it = plans.emplace(key, bp).first;
    }
    if (!it->second.found) return false;
    const cublasStatus_t status = run_plan(it->second.p, d, a, b, bias, beta);
    LLMC_CHECK(status == CUBLAS_STATUS_SUCCESS, "%s: cublasLtMatmul failed (%s) for n_batch=%d, BT=%d, C=%d, OC=%d",
               what, cublasLtGetStatusString(status), batch, BT, C, OC);
    cudaCheckLaunch();
    return true;
}

// dbias[b][OC] += column sums of dout[b] [BT, OC] for every batch b (fp32; two deterministic stages, one add)
inline void bias_grad_batched(float* dbias, const floatX* dout, int n_batch, int BT, int OC) {
    const int nchunks = ceil_div(BT, MATMUL_DBIAS_ROWS_PER_CHUNK);
    LLMC_CHECK(nchunks <= 65535 && n_batch <= 65535, "matmul_backward_batched dbias: n_batch=%d, BT=%d exceed the grid",
               n_batch, BT);
    float* partial = cuda_scratch<float>((size_t)n_batch * nchunks * OC, "matmul_backward_batched (dbias)");
    const dim3 block(32, 8);
    if (OC % 8 == 0 && pointer_alignment(dout) >= 16) {
        matmul_dbias_batched_partial_kernel<8><<<dim3(ceil_div(OC, 256), nchunks, n_batch), block, 0, llmc_stream()>>>(
            partial, dout, BT, OC, nchunks);
    } else {
        matmul_dbias_batched_partial_kernel<1><<<dim3(ceil_div(OC, 32), nchunks, n_batch), block, 0, llmc_stream()>>>(
            partial, dout, BT, OC, nchunks);
    }
    cudaCheckLaunch();
    matmul_dbias_finish_kernel<<<dim3(ceil_div(OC, 32), n_batch), block, 0, llmc_stream()>>>(dbias, partial, nchunks,
                                                                                           OC);
    cudaCheckLaunch();
}

}  // namespace matmul_detail

// out[b] [BT, OC] = inp[b] [BT, C] W[b] [OC, C]^T + bias[b] [OC] for b < n_batch (bias may be null); overwritten
inline void matmul_forward_batched(floatX* out, const floatX* inp, const floatX* weight, const floatX* bias,
                                   int n_batch, int BT, int C, int OC) {
    if ((size_t)n_batch * BT * OC == 0) return;  // nothing to write (an MoE layer with capacity 0)
    using namespace matmul_detail;
    if (bias && OC % 8 == 0 && pointer_alignment(bias) >= 16 &&
        gemm_batched("matmul_forward_batched", out, weight, inp, bias, /*m*/ OC, /*n*/ BT, /*k*/ C, true, false, 0.0f,
                     n_batch, BT, C, OC))
        return;
    float beta = 0.0f;
    if (bias) {  // fallback: out = broadcast bias, then out += product
        const size_t total = (size_t)n_batch * BT * OC;
        const unsigned blocks = (unsigned)((total + 255) / 256 < 65536 ? (total + 255) / 256 : 65536);
        matmul_bias_fill_batched_kernel<<<blocks, 256, 0, llmc_stream()>>>(out, bias, (size_t)n_batch * BT, BT, OC);
        cudaCheckLaunch();
        beta = 1.0f;
    }
    gemm_batched("matmul_forward_batched", out, weight, inp, nullptr, OC, BT, C, true, false, beta, n_batch, BT, C, OC);
}

// per batch b: dinp[b] = dout[b] W[b] (overwritten); dweight[b] += dout[b]^T inp[b]; dbias[b] += column
// sums of dout[b] (fp32, one add each; each may be null, as matmul_backward)
inline void matmul_backward_batched(floatX* dinp, float* dweight, float* dbias, const floatX* dout,
                                    const floatX* inp, const floatX* weight, int n_batch, int BT, int C, int OC) {
    if ((size_t)n_batch * BT == 0) return;  // no rows: dinp is empty, the += terms are zero
    using namespace matmul_detail;
    if (dbias) bias_grad_batched(dbias, dout, n_batch, BT, OC);
    if (dinp)
        gemm_batched("matmul_backward_batched (dinp)", dinp, weight, dout, nullptr, /*m*/ C, /*n*/ BT, /*k*/ OC, false,
                     false, 0.0f, n_batch, BT, C, OC);
    if (dweight)
        gemm_batched("matmul_backward_batched (dweight)", dweight, inp, dout, nullptr, /*m*/ C, /*n*/ OC, /*k*/ BT,
                     false, true, 1.0f, n_batch, BT, C, OC);
}

// The most K splits of any cached fp32 (dweight) plan, single or batched: 1 when none splits K (the
// contract of the top of the file; test/gpu/matmul.cuh checks it after the backward of each shape).
inline int matmul_fp32_plans_max_split_k() {
    using namespace matmul_detail;
    int most = 1;
    for (const auto& kv : state().plans)
        if (kv.first.d_fp32) most = std::max(most, algo_split_k(kv.second.algo));
    for (const auto& kv : batched_plans().plans)
        if (kv.first.d_fp32 && kv.second.found) most = std::max(most, algo_split_k(kv.second.p.algo));
    return most;
}
