// Causal self-attention over packed documents with grouped-query heads and ALiBi, on the GPU: the
// twin of llmc/ops/cpu/attention.h (same names, argument order and saved state).
//   qkv row (one token): [q heads: n_head*hs | k heads: n_kv_head*hs | v heads: n_kv_head*hs]
//   query head h reads kv head h / (n_head / n_kv_head)
//   s_ij = q_i.k_j / sqrt(hs) - slope_h * (i - j)   (ALiBi term only when alibi_n_head > 0)
//   slope_h = alibi_slope(head0 + h, alibi_n_head): the slope of the GLOBAL head index head0 + h in a model
//   of alibi_n_head heads (0: no ALiBi); head0 = 0, alibi_n_head = n_head for the whole model. Tensor
//   parallel ranks pass their local heads [head0, head0 + n_head) (and the kv heads they read) with the
//   model's head count: every head is independent, a kv head shared by ranks sums their dK/dV partials.
//   key j is visible to query i iff doc_start[i] <= j <= i   (own document, causal)
//   forward   lse_i = log sum_j exp(s_ij)   (fp32, natural log)      out_i = sum_j exp(s_ij - lse_i) v_j
//   backward  p_ij = exp(s_ij - lse_i) recomputed from lse, D_i = dO_i . O_i, dS_ij = p_ij (dO_i.v_j - D_i)
//             dq_i = scale sum_j dS_ij k_j,  dk_j = scale sum_i dS_ij q_i,  dv_j = sum_i p_ij dO_i
//             (dk, dv also summed over the query heads of the kv head's group)
// Two implementations; attention_forward / attention_backward pick one by head size:
//   hs 64, 128   the flash path: fused FlashAttention-2 style kernels on the floatX tensor cores
//   other hs     the simple path: fp32 math on CUDA cores (correct, memory-lean, ~10x slower)
// Both are callable directly (attention_detail::forward_simple / forward_flash, backward_*) for the
// tests and the benchmarks (dev/cuda/attention_forward.cu, attention_backward.cu).
//
// ---- The flash path (hs = 64, 128) ----
// Every product is mma.sync.m16n8k16 (floatX x floatX -> fp32; fp16 on sm_75: two m16n8k8) on fragments loaded from shared memory by
// ldmatrix; tiles come in by cp.async (16-byte copies, double-buffered so the copy of tile k+1 overlaps
// the math of tile k; single-buffered where the device's shared memory calls for it: flash_plan). Tiles
// are 64 rows x hs, padded rows in smem (hs + 8 floatX: conflict-free
// ldmatrix). A block is 4 warps; a warp owns 16 rows of its block's 64 and keeps its accumulators in
// registers. Scores live in registers only: nothing T x T ever reaches memory.
//  forward   block = (b, query head h, 64 queries). Q fragments stay in registers; for each 64-key tile:
//            S = Q K^T (fp32 C fragments), scaled into log2 units plus the ALiBi term (from i, j and the
//            slope, in registers), masked; online softmax (running row max m, rescale of O and of the
//            running sum l); P rounded to floatX goes straight from the C fragments of S into A fragments
//            (same register layout) for O += P V. At the end O / l and lse = (m + log2 l) ln 2.
//  backward  D = rowsum(dO * O) first (one thread per (token, head), into scratch), then two kernels,
//            each owning what it writes, so nothing is accumulated across blocks (no atomics,
//            deterministic):
//   dQ       block = (b, h, 64 queries), loops over the key tiles: S = Q K^T and dP = dO V^T recomputed,
//            P = exp2(S' - lse'), dS = P (dP - D) scale, dQ += dS K.
//   dK/dV    block = (b, kv head, 64 keys), loops over the query heads of the group and, for each, over
//            the 64-query tiles that can see one of its keys, 32 queries per step: S^T = K Q^T,
//            dP^T = V dO^T, P^T, dS^T as above, dV += P^T dO, dK += dS^T Q. The GQA sum over the group
//            happens in registers, in a fixed order.
// Masking. A query tile visits keys [min doc_start of its queries, its last query] (those are exactly
// the keys some query of the tile sees), a key tile the queries [its first key, last i with
// doc_start[i] <= its last key]; a warp skips a tile none of its rows can see, and tiles wholly
// visible to a warp skip the per-element mask. So a packed row of short documents costs about the
// sum of its documents' squares, not T^2 / 2.
//
// ---- The simple path (other head sizes) ----
// A block is 4 warps. Tiles of K/V (forward, dQ) or of Q/dO (dK/dV) are staged in shared memory as
// fp32, CHUNK = 32 rows at a time, so that each lane owns one row of the chunk for the dot products
// (lane j computes q.k_j reading its own padded smem row with float4 loads, conflict-free), and then
// owns head dims d = lane, lane + 32, ... for the accumulations (o += p_j v_j, dq += dS_j k_j,
// dk += dS_i q_i, dv += p_i dO_i, with p_j broadcast by shuffle).
//  forward    block = (b, query head h, tile of 16 queries), 4 query rows per warp. Per row an online
//             softmax over the chunks: running max m (warp-uniform), a per-lane partial of the sum
//             of exp (rescaled with m, summed over the warp once at the end) and o[hs] spread over
//             the lanes. Keys staged: [min doc_start of the tile, last query of the tile].
//  backward   three kernels on llmc_stream():
//   delta     one thread per (token, head): D = dO.O into scratch (fp32 [B, n_head, T], like lse).
//   dQ        block = (b, h, tile of 16 queries), the forward's loop; each query row owns its dq.
//   dK/dV     block = (b, kv head, tile of 16 keys), 4 key rows per warp. It loops over the query
//             heads of the group and then over the queries that can see one of its keys, in chunks
//             of 32: queries [first key, last query whose doc_start <= last key]. Each key row owns
//             its dk, dv and sums over (head, query) in a fixed order: no atomics, deterministic
//             (the same order as the CPU reference, in fact).
// Masking. A query only visits key chunks that meet [doc_start[i], i] and a key row only query
// chunks holding a query that sees it (warp-uniform skips), so packed short documents are cheap.
// Rows past the end of the staged range are zero-filled and masked lanes get p = 0 explicitly, so
// nothing uninitialised or infinite reaches a product (both paths).
//
// Preconditions: 0 <= doc_start[i] <= i (every query sees at least itself, as the loader builds it);
// hs a multiple of 8 (16-byte floatX vectors) in [8, 128]; n_kv_head divides n_head; qkv, out, dout,
// dqkv 16-byte aligned. The kernels do not assume doc_start is non-decreasing (it is, by
// construction), only the work they skip is tighter when it is.
//
// Scratch (cuda_scratch): attention_forward none; attention_backward B * n_head * T floats (D), both
// paths: attention_scratch_bytes(B, T, n_head) (llmc/ops/op_scratch.h).
// Shared memory (dynamic): flash forward 5 tiles of 64 x (hs + 8) floatX (45 KB at hs 64, 85 KB at 128),
// flash dQ and dK/dV 6 tiles (54 KB, 102 KB; dK/dV + 1.5 KB static), or with single-buffered streamed
// tiles (the 1-stage variants, chosen per device: see flash_plan below) 3 and 4 tiles (27 / 51 KB,
// 36 / 68 KB; dK/dV + 0.8 KB static); simple forward
// 32(hs+4) + 32 hs + 16 hs floats (41.5 KB at hs = 128), simple dQ and dK/dV 2 * 32(hs+4) + 2 * 16 hs
// floats (49 KB) plus 400 B static.
#pragma once
#include <climits>
#include <initializer_list>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include "llmc/ops/cuda_common.cuh"
#include "llmc/ops/op_scratch.h"  // attention_scratch_bytes


namespace attention_detail {

// ================================================================================================
// The simple path (any hs, multiple of 8, up to 128)
// ================================================================================================

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int QTILE = 16;            // query rows per block (forward, dQ)
constexpr int KTILE = 16;            // key rows per block (dK/dV)
constexpr int ROWS_PER_WARP = 4;     // QTILE / WARPS == KTILE / WARPS
constexpr int CHUNK = 32;            // rows staged per step: one per lane
constexpr int MAX_HS = 128;
constexpr int SLOTS = MAX_HS / 32;   // head dims a lane owns: d = lane + 32 k, k < SLOTS, d < hs
constexpr unsigned FULL = 0xffffffffu;
static_assert(QTILE == WARPS * ROWS_PER_WARP && KTILE == WARPS * ROWS_PER_WARP, "tiles split evenly over the warps");
// __launch_bounds__ minimum of resident blocks for the three simple kernels: 4 blocks of 128 threads cap
// them at 128 registers. Without a minimum, ptxas (CUDA 13) aimed at 72..80 registers and spilled on
// sm_80 / sm_86 / sm_89 (attention_dkdv_kernel 12 B stored + 36 B loaded, attention_forward_kernel 8 B);
// with it they take 93..127 registers and spill nothing on sm_80, 86, 89 and 90. Their shared memory
// (up to 49 KB at hs 128) admits 2..4 blocks per SM anyway, so the bound costs no occupancy.
constexpr int SIMPLE_MIN_BLOCKS = 4;

// ALiBi slope of head h (cpu::alibi_slope, same formula, computed in double then rounded to float as
// the CPU reference does): m = 2^floor(log2 n); heads h < m: 2^(-8(h+1)/m); the others take every
// other slope of the 2m-head sequence.
__host__ __device__ inline float alibi_slope_f(int h, int n_head) {
    int m = 1;
    while (m * 2 <= n_head) m *= 2;
    if (h < m) return (float)exp2(-8.0 * (h + 1) / m);
    return (float)exp2(-8.0 * (2 * (h - m) + 1) / (2 * m));
}

__device__ inline float warp_max(float x) {
    for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(FULL, x, off));
    return x;
}
__device__ inline float warp_sum(float x) {
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(FULL, x, off);
    return x;
}

// The first key that some query of the block's tile [q0, q0 + nq) can see: the smallest doc_start of
// the tile (integer atomicMin in shared memory: order-free). Ends with a barrier.
__device__ inline int tile_kv_lo(const int* ds, int q0, int nq) {
    __shared__ int kv_lo_s;
    const int tid = threadIdx.x;
    if (tid == 0) kv_lo_s = INT_MAX;
    __syncthreads();
    if (tid < nq) atomicMin(&kv_lo_s, ds[q0 + tid]);
    __syncthreads();
    return kv_lo_s;
}

// 8 consecutive floatX values (one 16-byte load) as fp32 (floatx8::unpack8, llmc/ops/cuda_common.cuh)
__device__ inline void load_floatX8(float f[8], const floatX* p) {
    floatx8::unpack8(*reinterpret_cast<float(*)[8]>(f), *reinterpret_cast<const uint4*>(p));
}

// Stages `rows` rows of hs floatX values (row r at src + r * src_stride) into shared memory as fp32
// rows of dst_stride floats, 16 bytes (8 values) per thread per step; rows >= n_valid are zeros
// (they stand for positions outside the range and must not bring garbage into masked products).
__device__ inline void stage_rows(float* dst, int dst_stride, const floatX* src, size_t src_stride, int rows,
                                  int n_valid, int hs) {
    const int vecs = hs / 8;
    for (int idx = threadIdx.x; idx < rows * vecs; idx += blockDim.x) {
        const int r = idx / vecs, c = (idx % vecs) * 8;
        float4* d = reinterpret_cast<float4*>(dst + r * dst_stride + c);
        float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (r < n_valid) load_floatX8(f, src + r * src_stride + c);
        d[0] = make_float4(f[0], f[1], f[2], f[3]);
        d[1] = make_float4(f[4], f[5], f[6], f[7]);
    }
}

// a.b over hs fp32 values in shared memory (16-byte aligned rows), summed in order d = 0..hs-1
__device__ inline float dot_smem(const float* a, const float* b, int hs) {
    float acc = 0.f;
#pragma unroll 4
    for (int d = 0; d < hs; d += 4) {
        const float4 x = *reinterpret_cast<const float4*>(a + d);
        const float4 y = *reinterpret_cast<const float4*>(b + d);
        acc = fmaf(x.x, y.x, acc);
        acc = fmaf(x.y, y.y, acc);
        acc = fmaf(x.z, y.z, acc);
        acc = fmaf(x.w, y.w, acc);
    }
    return acc;
}

// Smem row strides. Rows read one per lane (lane j reads row j with float4 loads) are padded to
// hs + 4 floats: hs % 8 == 0 makes the stride an odd multiple of 4 words modulo 32, so the 8 lanes
// of a quarter-warp hit 8 distinct 4-bank groups. Rows read by all lanes at once (broadcast) or by
// head dim (consecutive lanes, consecutive words) need no padding.
__host__ __device__ inline int padded(int hs) { return hs + 4; }

inline size_t forward_smem_bytes(int hs) { return sizeof(float) * ((size_t)CHUNK * padded(hs) + CHUNK * hs + QTILE * hs); }
inline size_t dq_smem_bytes(int hs) { return sizeof(float) * (2 * (size_t)CHUNK * padded(hs) + 2 * QTILE * hs); }
inline size_t dkdv_smem_bytes(int hs) { return sizeof(float) * (2 * (size_t)CHUNK * padded(hs) + 2 * KTILE * hs); }

// ------------------------------------------------------------------------------------------------
// forward: block (b, h, 16 queries); warp w owns query rows w, w + 4, w + 8, w + 12 of the tile
// (interleaved, so the causal growth of the work is spread evenly over the warps).

__global__ void __launch_bounds__(THREADS, SIMPLE_MIN_BLOCKS)
attention_forward_kernel(floatX* out, float* lse, const floatX* qkv, const int* doc_start, int T, int n_head,
                         int n_kv_head, int hs, float scale, int alibi_n_head, int head0) {
    extern __shared__ float4 smem_f4[];
    float* k_s = reinterpret_cast<float*>(smem_f4);   // [CHUNK][hs + 4] keys of the chunk
    float* v_s = k_s + CHUNK * padded(hs);            // [CHUNK][hs]     values of the chunk
    float* q_s = v_s + CHUNK * hs;                    // [QTILE][hs]     queries of the tile

    const int b = blockIdx.z, h = blockIdx.y;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * QTILE;  // last (heaviest) tiles are scheduled first
    const int nq = min(QTILE, T - q0);
    const int row = (n_head + 2 * n_kv_head) * hs, kh = h / (n_head / n_kv_head);
    const floatX* base = qkv + (size_t)b * T * row;
    const int* ds = doc_start + (size_t)b * T;
    const float slope = alibi_n_head > 0 ? alibi_slope_f(head0 + h, alibi_n_head) : 0.f;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    stage_rows(q_s, hs, base + (size_t)q0 * row + h * hs, row, QTILE, nq, hs);
    const int kv_lo = tile_kv_lo(ds, q0, nq), kv_hi = q0 + nq - 1;  // every key the tile can see

    int lo[ROWS_PER_WARP];
    float m[ROWS_PER_WARP], l[ROWS_PER_WARP], o[ROWS_PER_WARP][SLOTS];
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; r++) {
        const int qi = warp + WARPS * r;
        lo[r] = qi < nq ? ds[q0 + qi] : 0;
        m[r] = -INFINITY;
        l[r] = 0.f;
#pragma unroll
        for (int k = 0; k < SLOTS; k++) o[r][k] = 0.f;
    }

    for (int kc = kv_lo; kc <= kv_hi; kc += CHUNK) {
        const int nk = min(CHUNK, kv_hi + 1 - kc);
        __syncthreads();  // all warps are done with the previous chunk
        stage_rows(k_s, padded(hs), base + (size_t)kc * row + (n_head + kh) * hs, row, CHUNK, nk, hs);
        stage_rows(v_s, hs, base + (size_t)kc * row + (n_head + n_kv_head + kh) * hs, row, CHUNK, nk, hs);
        __syncthreads();
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; r++) {
            const int qi = warp + WARPS * r, i = q0 + qi;
            if (qi >= nq || kc > i || kc + nk - 1 < lo[r]) continue;  // warp-uniform: no visible key here
            const int j = kc + lane;  // the key this lane scores
            const bool valid = j >= lo[r] && j <= i;
            const float s = dot_smem(q_s + qi * hs, k_s + lane * padded(hs), hs) * scale - slope * (float)(i - j);
            // at least one lane is valid, so m_new is finite; on the first chunk m = -inf gives corr = 0
            const float m_new = fmaxf(m[r], warp_max(valid ? s : -INFINITY));
            const float corr = expf(m[r] - m_new);
            const float p = valid ? expf(s - m_new) : 0.f;
            m[r] = m_new;
            l[r] = l[r] * corr + p;  // this lane's share of the sum; the warp adds the shares at the end
#pragma unroll
            for (int k = 0; k < SLOTS; k++) o[r][k] *= corr;
            for (int jj = 0; jj < nk; jj++) {
                const float pj = __shfl_sync(FULL, p, jj);
#pragma unroll
                for (int k = 0; k < SLOTS; k++) {
                    const int d = lane + 32 * k;
                    if (d < hs) o[r][k] = fmaf(pj, v_s[jj * hs + d], o[r][k]);
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; r++) {
        const int qi = warp + WARPS * r, i = q0 + qi;
        if (qi >= nq) continue;
        const float sum = warp_sum(l[r]);
        if (lane == 0) lse[((size_t)b * n_head + h) * T + i] = m[r] + logf(sum);
        const float inv = 1.f / sum;
        floatX* o_row = out + ((size_t)b * T + i) * n_head * hs + h * hs;
#pragma unroll
        for (int k = 0; k < SLOTS; k++) {
            const int d = lane + 32 * k;
            if (d < hs) o_row[d] = float_to_floatX(o[r][k] * inv);
        }
    }
}

// ------------------------------------------------------------------------------------------------
// backward, stage 1: D[b, h, t] = dO . O, one thread per (token, head) (threads of a warp read
// neighbouring heads: contiguous memory), 16-byte loads, summed in order d = 0..hs-1.

__global__ void attention_delta_kernel(float* delta, const floatX* dout, const floatX* out, int B, int T, int n_head,
                                       int hs) {
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;  // (b * T + t) * n_head + h
    if (idx >= (size_t)B * T * n_head) return;
    const int h = (int)(idx % n_head);
    const size_t bt = idx / n_head;
    const int b = (int)(bt / T), t = (int)(bt % T);
    const floatX* dO = dout + idx * hs;  // [B, T, n_head, hs] is [B*T*n_head, hs]
    const floatX* O = out + idx * hs;
    float acc = 0.f;
    for (int c = 0; c < hs; c += 8) {
        float x[8], y[8];
        load_floatX8(x, dO + c);
        load_floatX8(y, O + c);
#pragma unroll
        for (int k = 0; k < 8; k++) acc = fmaf(x[k], y[k], acc);
    }
    delta[((size_t)b * n_head + h) * T + t] = acc;
}

// ------------------------------------------------------------------------------------------------
// backward, stage 2: dQ. Block (b, h, 16 queries), the forward's loop over key chunks; lane j scores
// key j (s and dp = dO.v_j), then the lanes own head dims of dq += dS_j k_j. Writes dq (overwrite).

__global__ void __launch_bounds__(THREADS, SIMPLE_MIN_BLOCKS)
attention_dq_kernel(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse, const float* delta,
                    const int* doc_start, int T, int n_head, int n_kv_head, int hs, float scale, int alibi_n_head,
                    int head0) {
    extern __shared__ float4 smem_f4[];
    float* k_s = reinterpret_cast<float*>(smem_f4);   // [CHUNK][hs + 4]
    float* v_s = k_s + CHUNK * padded(hs);            // [CHUNK][hs + 4] (read one row per lane for dO.v)
    float* q_s = v_s + CHUNK * padded(hs);            // [QTILE][hs]
    float* do_s = q_s + QTILE * hs;                   // [QTILE][hs]

    const int b = blockIdx.z, h = blockIdx.y;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * QTILE;
    const int nq = min(QTILE, T - q0);
    const int row = (n_head + 2 * n_kv_head) * hs, kh = h / (n_head / n_kv_head);
    const floatX* base = qkv + (size_t)b * T * row;
    const int* ds = doc_start + (size_t)b * T;
    const float slope = alibi_n_head > 0 ? alibi_slope_f(head0 + h, alibi_n_head) : 0.f;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    stage_rows(q_s, hs, base + (size_t)q0 * row + h * hs, row, QTILE, nq, hs);
    stage_rows(do_s, hs, dout + ((size_t)b * T + q0) * n_head * hs + h * hs, (size_t)n_head * hs, QTILE, nq, hs);
    const int kv_lo = tile_kv_lo(ds, q0, nq), kv_hi = q0 + nq - 1;

    int lo[ROWS_PER_WARP];
    float lse_r[ROWS_PER_WARP], D_r[ROWS_PER_WARP], dq[ROWS_PER_WARP][SLOTS];
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; r++) {
        const int qi = warp + WARPS * r;
        const size_t si = ((size_t)b * n_head + h) * T + q0 + qi;
        lo[r] = qi < nq ? ds[q0 + qi] : 0;
        lse_r[r] = qi < nq ? lse[si] : 0.f;
        D_r[r] = qi < nq ? delta[si] : 0.f;
#pragma unroll
        for (int k = 0; k < SLOTS; k++) dq[r][k] = 0.f;
    }

    for (int kc = kv_lo; kc <= kv_hi; kc += CHUNK) {
        const int nk = min(CHUNK, kv_hi + 1 - kc);
        __syncthreads();
        stage_rows(k_s, padded(hs), base + (size_t)kc * row + (n_head + kh) * hs, row, CHUNK, nk, hs);
        stage_rows(v_s, padded(hs), base + (size_t)kc * row + (n_head + n_kv_head + kh) * hs, row, CHUNK, nk, hs);
        __syncthreads();
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; r++) {
            const int qi = warp + WARPS * r, i = q0 + qi;
            if (qi >= nq || kc > i || kc + nk - 1 < lo[r]) continue;
            const int j = kc + lane;
            const bool valid = j >= lo[r] && j <= i;
            const float s = dot_smem(q_s + qi * hs, k_s + lane * padded(hs), hs) * scale - slope * (float)(i - j);
            const float dp = dot_smem(do_s + qi * hs, v_s + lane * padded(hs), hs);
            const float p = valid ? expf(s - lse_r[r]) : 0.f;
            const float dS = valid ? p * (dp - D_r[r]) * scale : 0.f;  // scale folded in, as the CPU does
            for (int jj = 0; jj < nk; jj++) {
                const float g = __shfl_sync(FULL, dS, jj);
#pragma unroll
                for (int k = 0; k < SLOTS; k++) {
                    const int d = lane + 32 * k;
                    if (d < hs) dq[r][k] = fmaf(g, k_s[jj * padded(hs) + d], dq[r][k]);
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; r++) {
        const int qi = warp + WARPS * r, i = q0 + qi;
        if (qi >= nq) continue;
        floatX* dq_row = dqkv + ((size_t)b * T + i) * row + h * hs;
#pragma unroll
        for (int k = 0; k < SLOTS; k++) {
            const int d = lane + 32 * k;
            if (d < hs) dq_row[d] = float_to_floatX(dq[r][k]);
        }
    }
}

// ------------------------------------------------------------------------------------------------
// backward, stage 3: dK and dV. Block (b, kv head, 16 keys); warp w owns key rows w, w+4, w+8, w+12.
// Loop: query heads of the group, then chunks of 32 queries from the first key of the tile to the
// last query that can see one of its keys; lane i scores query i of the chunk against the key row
// (s and dp = dO_i.v_j), then the lanes own head dims of dv += p_i dO_i and dk += dS_i q_i.

__global__ void __launch_bounds__(THREADS, SIMPLE_MIN_BLOCKS)
attention_dkdv_kernel(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse, const float* delta,
                      const int* doc_start, int T, int n_head, int n_kv_head, int hs, float scale, int alibi_n_head,
                      int head0) {
    extern __shared__ float4 smem_f4[];
    float* q_s = reinterpret_cast<float*>(smem_f4);   // [CHUNK][hs + 4] queries of the chunk
    float* do_s = q_s + CHUNK * padded(hs);           // [CHUNK][hs + 4] their output gradients
    float* k_s = do_s + CHUNK * padded(hs);           // [KTILE][hs]     keys of the tile
    float* v_s = k_s + KTILE * hs;                    // [KTILE][hs]     values of the tile
    __shared__ float lse_s[CHUNK], D_s[CHUNK];
    __shared__ int start_s[CHUNK];  // doc_start of the chunk's queries (INT_MAX past the range: sees nothing)
    __shared__ int i_last_s;

    const int b = blockIdx.z, kh = blockIdx.y;
    const int j0 = blockIdx.x * KTILE;  // first tiles see the most queries: scheduled first
    const int nk = min(KTILE, T - j0), j_last = j0 + nk - 1;
    const int group = n_head / n_kv_head;
    const int row = (n_head + 2 * n_kv_head) * hs;
    const floatX* base = qkv + (size_t)b * T * row;
    const int* ds = doc_start + (size_t)b * T;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    stage_rows(k_s, hs, base + (size_t)j0 * row + (n_head + kh) * hs, row, KTILE, nk, hs);
    stage_rows(v_s, hs, base + (size_t)j0 * row + (n_head + n_kv_head + kh) * hs, row, KTILE, nk, hs);
    // The queries that see a key of the tile satisfy j0 <= i and doc_start[i] <= j_last: visit
    // [j0, i_last] with i_last the largest such i (a full scan: no assumption on doc_start's order).
    if (threadIdx.x == 0) i_last_s = j0 - 1;
    __syncthreads();
    int cand = j0 - 1;
    for (int i = j0 + threadIdx.x; i < T; i += THREADS)
        if (ds[i] <= j_last) cand = i;  // i increases: the last hit is this thread's largest
    atomicMax(&i_last_s, cand);        // integer max: order-free
    __syncthreads();
    const int i_last = i_last_s;

    float dk[ROWS_PER_WARP][SLOTS], dv[ROWS_PER_WARP][SLOTS];
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; r++)
#pragma unroll
        for (int k = 0; k < SLOTS; k++) dk[r][k] = dv[r][k] = 0.f;

    for (int h = kh * group; h < (kh + 1) * group; h++) {
        const float slope = alibi_n_head > 0 ? alibi_slope_f(head0 + h, alibi_n_head) : 0.f;
        for (int ic = j0; ic <= i_last; ic += CHUNK) {
            const int nc = min(CHUNK, i_last + 1 - ic);
            __syncthreads();  // all warps are done with the previous chunk
            stage_rows(q_s, padded(hs), base + (size_t)ic * row + h * hs, row, CHUNK, nc, hs);
            stage_rows(do_s, padded(hs), dout + ((size_t)b * T + ic) * n_head * hs + h * hs, (size_t)n_head * hs,
                       CHUNK, nc, hs);
            if (threadIdx.x < CHUNK) {
                const bool in = threadIdx.x < nc;
                const size_t si = ((size_t)b * n_head + h) * T + ic + threadIdx.x;
                lse_s[threadIdx.x] = in ? lse[si] : 0.f;
                D_s[threadIdx.x] = in ? delta[si] : 0.f;
                start_s[threadIdx.x] = in ? ds[ic + threadIdx.x] : INT_MAX;
            }
            __syncthreads();
#pragma unroll
            for (int r = 0; r < ROWS_PER_WARP; r++) {
                const int kr = warp + WARPS * r, j = j0 + kr;
                const int i = ic + lane;  // the query this lane scores
                const bool valid = kr < nk && start_s[lane] <= j && j <= i;
                if (!__any_sync(FULL, valid)) continue;  // warp-uniform: no query of the chunk sees key j
                const float s = dot_smem(q_s + lane * padded(hs), k_s + kr * hs, hs) * scale - slope * (float)(i - j);
                const float dp = dot_smem(do_s + lane * padded(hs), v_s + kr * hs, hs);
                const float p = valid ? expf(s - lse_s[lane]) : 0.f;
                const float dS = valid ? p * (dp - D_s[lane]) * scale : 0.f;
                for (int ii = 0; ii < nc; ii++) {
                    const float pi = __shfl_sync(FULL, p, ii), g = __shfl_sync(FULL, dS, ii);
#pragma unroll
                    for (int k = 0; k < SLOTS; k++) {
                        const int d = lane + 32 * k;
                        if (d < hs) {
                            dv[r][k] = fmaf(pi, do_s[ii * padded(hs) + d], dv[r][k]);
                            dk[r][k] = fmaf(g, q_s[ii * padded(hs) + d], dk[r][k]);
                        }
                    }
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; r++) {
        const int kr = warp + WARPS * r, j = j0 + kr;
        if (kr >= nk) continue;
        floatX* dk_row = dqkv + ((size_t)b * T + j) * row + (n_head + kh) * hs;
        floatX* dv_row = dqkv + ((size_t)b * T + j) * row + (n_head + n_kv_head + kh) * hs;
#pragma unroll
        for (int k = 0; k < SLOTS; k++) {
            const int d = lane + 32 * k;
            if (d < hs) {
                dk_row[d] = float_to_floatX(dk[r][k]);
                dv_row[d] = float_to_floatX(dv[r][k]);
            }
        }
    }
}

inline void check_args(const char* who, int B, int T, int n_head, int n_kv_head, int hs, int alibi_n_head, int head0,
                       std::initializer_list<const void*> vec_ptrs) {
    LLMC_CHECK(B > 0 && T > 0, "%s: B = %d, T = %d must be positive", who, B, T);
    LLMC_CHECK(B <= 65535 && n_head <= 65535, "%s: B = %d and n_head = %d must be <= 65535 (grid dimensions)", who, B,
               n_head);
    LLMC_CHECK(n_head > 0 && n_kv_head > 0 && n_head % n_kv_head == 0,
               "%s: n_kv_head = %d must divide n_head = %d", who, n_kv_head, n_head);
    LLMC_CHECK(hs >= 8 && hs <= MAX_HS && hs % 8 == 0,
               "%s: head_size %d is not supported: the CUDA kernels need a multiple of 8 (16-byte floatX vectors) "
               "in [8, %d]", who, hs, MAX_HS);
    LLMC_CHECK(alibi_n_head == 0 || (alibi_n_head > 0 && head0 >= 0 && head0 + n_head <= alibi_n_head),
               "%s: local heads [%d, %d) must lie inside the model's %d ALiBi heads", who, head0, head0 + n_head,
               alibi_n_head);
    for (const void* p : vec_ptrs)
        LLMC_CHECK((uintptr_t)p % 16 == 0, "%s: tensor at %p is not 16-byte aligned (the kernels use 16-byte loads)",
                   who, p);
}

template <typename Kernel>
inline void set_smem(Kernel kernel, size_t bytes) {
    // above 48 KB a kernel must opt in to dynamic shared memory (cheap host call, repeated per launch)
    if (bytes > 48 * 1024) cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
}


// ================================================================================================
// The flash path (hs = 64, 128): floatX tensor cores, see the top of the file
// ================================================================================================

constexpr int FA_THREADS = 128;  // 4 warps
constexpr int FA_TILE = 64;      // rows of every staged tile: 64 queries (16 per warp) or 64 keys
constexpr int FA_PAD = 8;        // floatX of padding per smem row: a row is (hs + 8) * 2 = 16 (mod 128) bytes, so the
                                 // 8 row addresses of one ldmatrix matrix fall in 8 different 16-byte bank groups
constexpr int FA_SUB = 32;       // queries per step in the dK/dV kernel (S^T and dP^T: 16 registers each)
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

inline bool flash_supported(int hs) { return hs == 64 || hs == 128; }

// ---- PTX wrappers: the only code of the flash path with warp-collective or asynchronous semantics ----
__device__ inline uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// ldmatrix .x4: four 8x8 16-bit matrices, lanes 8m .. 8m+7 give the 16-byte row addresses of matrix m
// (layout of the result: see "fragment layouts" below). volatile: it reads shared memory, so it must
// not move across the barriers that publish that memory.
__device__ inline void ldsm_x4(uint32_t (&r)[4], const floatX* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}
__device__ inline void ldsm_x4_trans(uint32_t (&r)[4], const floatX* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}
// d = A B + d for one 16x8x16 tile: A 16x16 floatX (4 registers), B 16x8 floatX (2 registers), d 16x8 fp32.
// bf16 (sm_80+): one m16n8k16 .bf16; fp16 on sm_80+: one m16n8k16 .f16; fp16 on sm_75 (T4, RTX 20xx: no
// k16 shape) two m16n8k8 .f16, k 0..7 then 8..15: the k8 fragments are the halves of the k16 ones
// (A: a[0], a[1] columns 2t, 2t+1 and a[2], a[3] columns 2t+8, 2t+9; B: b0 rows 2t, 2t+1, b1 rows 2t+8, 2t+9).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800 && !defined(LLMC_FP16)
#error "bf16 tensor cores need sm_80 or newer: build for sm_75 with PRECISION=fp16 (-DLLMC_FP16)"
#endif
__device__ inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(LLMC_FP16) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(b0));
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[2]), "r"(a[3]), "r"(b1));
#else
#ifdef LLMC_FP16
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
#endif
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
// asynchronous 16-byte global -> shared copy (L2 only); valid = false reads nothing and writes 16 zero bytes.
// sm_75 has no cp.async: there the copies are plain (synchronous) loads and stores, commit and wait do
// nothing, and the barrier after the wait publishes the stores as it does the async copies. A plain copy
// completes earlier than the async one could, so every ordering the kernels keep for cp.async holds;
// what is lost is the overlap of a 2-stage kernel's copies with its math (flash_plan weighs occupancy).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define LLMC_NO_CP_ASYNC 1
#endif
__device__ inline void cp_async_16(void* dst, const void* src, bool valid) {
#ifdef LLMC_NO_CP_ASYNC
    *reinterpret_cast<uint4*>(dst) = valid ? *reinterpret_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
#endif
}
// the same for 4 bytes (lse, D, doc_start of a query tile, whose rows are not 16-byte aligned)
__device__ inline void cp_async_4(void* dst, const void* src, bool valid) {
#ifdef LLMC_NO_CP_ASYNC
    *reinterpret_cast<uint32_t*>(dst) = valid ? *reinterpret_cast<const uint32_t*>(src) : 0u;
#else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(valid ? 4 : 0)
                 : "memory");
#endif
}
__device__ inline void cp_async_commit() {
#ifndef LLMC_NO_CP_ASYNC
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// waits for all of this thread's copies; a __syncthreads() after it makes every thread's copies visible
__device__ inline void cp_async_wait_all() {
#ifndef LLMC_NO_CP_ASYNC
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}
// ---- end of PTX wrappers ----

// ---- fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type", and ldmatrix) ----
// lane = 4 g + t with g = groupID = lane >> 2, t = threadID_in_group = lane & 3. A .b32 register holds two
// floatX of neighbouring columns, the lower column in the low 16 bits.
//   A (16 x 16, .row):    a[0] = A[g][2t, 2t+1]   a[1] = A[g+8][2t, 2t+1]   a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
//   B (16 x 8, .col):     b[0] = B[2t, 2t+1][g]   b[1] = B[2t+8, 2t+9][g]
//   C, D (16 x 8, f32):   c[0], c[1] = C[g][2t], C[g][2t+1]   c[2], c[3] = C[g+8][2t], C[g+8][2t+1]
// ldmatrix.m8n8.x4.b16: lanes 8m .. 8m+7 address rows 0 .. 7 of matrix m; register m of every lane gets
// elements [g][2t], [g][2t+1] of matrix m, or with .trans elements [2t][g], [2t+1][g].
__host__ __device__ constexpr int frag_row(int lane) { return lane >> 2; }       // g: C rows g and g + 8
__host__ __device__ constexpr int frag_col(int lane) { return 2 * (lane & 3); }  // 2t: C columns 2t and 2t + 1
// Lane row / column offsets for an x4 load of the 16 x 16 block of a row-major smem matrix, matrices in
// the order (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15):
//  - plain ldmatrix: registers 0..3 are the A fragment of the block, a[m] = matrix m;
//  - .trans on a [k][n] matrix (rows are the k of the product): registers {0, 1} are the B fragment of
//    columns n = 0..7, registers {2, 3} that of columns n = 8..15.
__host__ __device__ constexpr int ldsm_a_row(int lane) { return lane & 15; }
__host__ __device__ constexpr int ldsm_a_col(int lane) { return (lane >> 4) * 8; }
// Lane offsets for a plain x4 load of the 16 x 16 block of an [n][k] matrix (rows are the n of the product,
// as K in Q K^T), matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15): registers
// {0, 1} are the B fragment of columns n = 0..7, registers {2, 3} that of columns n = 8..15.
__host__ __device__ constexpr int ldsm_b_row(int lane) { return (lane & 7) + ((lane >> 4) << 3); }
__host__ __device__ constexpr int ldsm_b_col(int lane) { return ((lane >> 3) & 1) * 8; }

// two fp32 -> one register of two floatX (round to nearest even), x in the low half (the lower column)
__device__ inline uint32_t pack_floatX2(float x, float y) {
#ifdef LLMC_FP16
    const __half2 v = __floats2half2_rn(x, y);
#else
    const __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
#endif
    return floatx8::pack_floatX_bits(v.x, v.y);
}
// The C fragments of two neighbouring n-blocks (columns 16k .. 16k+7 and 16k+8 .. 16k+15 of a 16-row
// product) hold, register for register, the A fragment of the 16-column block k: P and dS go from one
// product into the next without touching shared memory.
__device__ inline void c_to_a(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[0] = pack_floatX2(lo[0], lo[1]);  // [g][2t, 2t+1]
    a[1] = pack_floatX2(lo[2], lo[3]);  // [g+8][2t, 2t+1]
    a[2] = pack_floatX2(hi[0], hi[1]);  // [g][8+2t, 8+2t+1]
    a[3] = pack_floatX2(hi[2], hi[3]);  // [g+8][8+2t, 8+2t+1]
}

// acc[n] += (A B^T)[:, 8n .. 8n+7] over one 16-column k-step ks: a is the A fragment of the step, B a
// 8 NB x 16 KSTEPS block (rows at b_s) row-major in smem with row stride LD, read 16 rows at a time.
template <int NB, int LD>
__device__ inline void warp_mma_abt_step(float (&acc)[NB][4], const uint32_t (&a)[4], const floatX* b_s, int ks,
                                         int lane) {
    static_assert(NB % 2 == 0, "B is loaded 16 rows at a time");
#pragma unroll
    for (int nb = 0; nb < NB; nb += 2) {
        uint32_t b[4];
        ldsm_x4(b, b_s + (nb * 8 + ldsm_b_row(lane)) * LD + ks * 16 + ldsm_b_col(lane));
        mma_16816(acc[nb], a, b[0], b[1]);
        mma_16816(acc[nb + 1], a, b[2], b[3]);
    }
}
// acc += A B^T over all KSTEPS for A a 16 x 16 KSTEPS block (rows at a_s), row-major in smem like B: the
// products S = Q K^T, dP = dO V^T, S^T = K Q^T and dP^T = V dO^T.
template <int KSTEPS, int NB, int LD>
__device__ inline void warp_mma_abt(float (&acc)[NB][4], const floatX* a_s, const floatX* b_s, int lane) {
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ks++) {
        uint32_t a[4];
        ldsm_x4(a, a_s + ldsm_a_row(lane) * LD + ks * 16 + ldsm_a_col(lane));
        warp_mma_abt_step<NB, LD>(acc, a, b_s, ks, lane);
    }
}
// the same with A already in registers: a[ks] is the A fragment of columns 16 ks .. 16 ks + 15
template <int KSTEPS, int NB, int LD>
__device__ inline void warp_mma_abt_reg(float (&acc)[NB][4], const uint32_t (&a)[KSTEPS][4], const floatX* b_s,
                                        int lane) {
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ks++) warp_mma_abt_step<NB, LD>(acc, a[ks], b_s, ks, lane);
}
// acc[n] += (A B)[:, 8n .. 8n+7] for A a 16 x 16 KK block given as register fragments (a[k]: columns
// 16k .. 16k+15) and B a 16 KK x 8 NB block, row-major in smem at b_s (row stride LD), read with
// ldmatrix.trans: the products O += P V, dQ += dS K, dV += P^T dO and dK += dS^T Q.
template <int KK, int NB, int LD>
__device__ inline void warp_mma_ab(float (&acc)[NB][4], const uint32_t (&a)[KK][4], const floatX* b_s, int lane) {
    static_assert(NB % 2 == 0, "B is loaded 16 columns at a time");
#pragma unroll
    for (int kk = 0; kk < KK; kk++) {
#pragma unroll
        for (int nb = 0; nb < NB; nb += 2) {
            uint32_t b[4];
            ldsm_x4_trans(b, b_s + (kk * 16 + ldsm_a_row(lane)) * LD + nb * 8 + ldsm_a_col(lane));
            mma_16816(acc[nb], a[kk], b[0], b[1]);
            mma_16816(acc[nb + 1], a[kk], b[2], b[3]);
        }
    }
}

// cp.async of FA_TILE rows of HS floatX (row r at src + r * stride) into smem rows of HS + FA_PAD; rows
// r >= n_valid (past the end of the sequence) become zeros and are not read: a masked product must not
// meet garbage (p = 0 times a NaN is a NaN).
// A thread copies the same column c of rows r0, r0 + RSTEP, ...: one source pointer advanced by RSTEP rows
// per copy, rather than a 64-bit row offset per copy, which the compiler hoisted out of the kernels' loops
// (16 registers held across the loop at hs 128: flash_dkdv_kernel<128, 1> spilled on sm_90).
template <int HS>
__device__ inline void load_tile_async(floatX* dst, const floatX* src, size_t stride, int n_valid, int tid) {
    constexpr int CHUNKS = HS / 8;  // 16-byte chunks per row
    constexpr int RSTEP = FA_THREADS / CHUNKS;  // rows between a thread's copies
    static_assert(FA_THREADS % CHUNKS == 0 && FA_TILE % RSTEP == 0, "the copies split evenly over the threads");
    const int r0 = tid / CHUNKS, c = (tid % CHUNKS) * 8;
    const floatX* p = src + (size_t)r0 * stride + c;
#pragma unroll
    for (int k = 0; k < FA_TILE / RSTEP; k++) {
        const int r = r0 + k * RSTEP;
        const bool ok = r < n_valid;
        cp_async_16(dst + r * (HS + FA_PAD) + c, ok ? p : src + c, ok);
        p += (size_t)RSTEP * stride;
    }
}

// Writes a warp's 16 x HS fp32 accumulators (acc[n]: C fragment of columns 8n .. 8n+7; row g scaled by
// mul0, row g + 8 by mul1) as floatX to the global rows dst + r * stride, r < n_rows, through the warp's
// own 16 smem rows at stage, so that the global stores are whole 16-byte vectors.
template <int HS>
__device__ inline void warp_store_rows(floatX* dst, size_t stride, int n_rows, const float (&acc)[HS / 8][4],
                                       float mul0, float mul1, floatX* stage, int lane) {
    constexpr int LD = HS + FA_PAD, CHUNKS = HS / 8;
    const int g = frag_row(lane), c2 = frag_col(lane);
#pragma unroll
    for (int nb = 0; nb < HS / 8; nb++) {
        *reinterpret_cast<uint32_t*>(stage + g * LD + nb * 8 + c2) = pack_floatX2(acc[nb][0] * mul0, acc[nb][1] * mul0);
        *reinterpret_cast<uint32_t*>(stage + (g + 8) * LD + nb * 8 + c2) =
            pack_floatX2(acc[nb][2] * mul1, acc[nb][3] * mul1);
    }
    __syncwarp();
#pragma unroll
    for (int k = 0; k < 16 * CHUNKS / 32; k++) {
        const int idx = lane + 32 * k, r = idx / CHUNKS, c = (idx % CHUNKS) * 8;
        if (r < n_rows)
            *reinterpret_cast<uint4*>(dst + r * stride + c) = *reinterpret_cast<const uint4*>(stage + r * LD + c);
    }
}

// The 16 query rows of a warp as seen from one thread: its two rows (C fragment rows g, g + 8), their
// doc_start (INT_MAX past the end of the sequence: such a row sees nothing), and over the warp the
// smallest and largest doc_start and the last row: enough to skip tiles and masks warp-uniformly.
struct WarpRows {
    int i[2], lo[2];
    int lo_min, lo_max, first, last;
};
__device__ inline WarpRows warp_rows(const int* ds, int T, int first, int lane) {
    WarpRows w;
    w.first = first;
    w.last = min(first + 15, T - 1);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        w.i[r] = first + frag_row(lane) + 8 * r;
        w.lo[r] = w.i[r] < T ? ds[w.i[r]] : INT_MAX;
    }
    w.lo_min = min(w.lo[0], w.lo[1]);
    w.lo_max = max(w.lo[0], w.lo[1]);
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {  // lanes with the same g hold the same rows: reduce over g only
        w.lo_min = min(w.lo_min, __shfl_xor_sync(FULL, w.lo_min, off));
        w.lo_max = max(w.lo_max, __shfl_xor_sync(FULL, w.lo_max, off));
    }
    return w;
}
// some row of the warp sees some key of [kc, kc + FA_TILE)
__device__ inline bool warp_sees(const WarpRows& w, int kc) { return w.lo_min < kc + FA_TILE && kc <= w.last; }
// every row of the warp sees every key of [kc, kc + FA_TILE) (all rows exist: lo_max is finite)
__device__ inline bool warp_sees_all(const WarpRows& w, int kc) { return w.lo_max <= kc && kc + FA_TILE - 1 <= w.first; }

// ------------------------------------------------------------------------------------------------
// flash forward: block (b, h, 64 queries), warp w owns query rows 16w .. 16w+15 of the tile. STAGES 2
// double-buffers the key/value tiles, 1 refills one buffer between steps (flash_plan picks).
// (__launch_bounds__: HS 64 within 168 registers, 3 blocks per SM; without, ptxas took up to 171 on
// sm_90 and 2 fit. HS 128: the explicit minimum of 1 stops ptxas guessing a lower target.)

// sm_75 (the fp16 build on a T4 / RTX 20xx): its 64 KB of shared memory per SM holds at most 2 blocks
// of the smallest variant (27 KB), so the bound is 2 at HS 64 (255 registers: at 168, flash_dq_kernel<64, 1>
// spilled 104 bytes), 1 at HS 128
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define FA_MIN_BLOCKS(HS) ((HS) == 64 ? 2 : 1)
#else
#define FA_MIN_BLOCKS(HS) ((HS) == 64 ? 3 : 1)
#endif
template <int HS, int STAGES>
__global__ void __launch_bounds__(FA_THREADS, FA_MIN_BLOCKS(HS))
flash_forward_kernel(floatX* out, float* lse, const floatX* qkv, const int* doc_start, int T, int n_head,
                     int n_kv_head, float scale_log2, int alibi_n_head, int head0) {
    constexpr int LD = HS + FA_PAD, TILE = FA_TILE * LD, KSTEPS = HS / 16, DB = HS / 8;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    floatX* q_s = reinterpret_cast<floatX*>(fa_smem);  // [64][LD] queries, later each warp's output staging
    floatX* k_s = q_s + TILE;                            // [STAGES][64][LD] key tiles
    floatX* v_s = k_s + STAGES * TILE;                   // [STAGES][64][LD] value tiles
    static_assert(STAGES == 1 || STAGES == 2, "single- or double-buffered key/value tiles");

    const int b = blockIdx.z, h = blockIdx.y;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * FA_TILE;  // last (heaviest) tiles are scheduled first
    const int nq = min(FA_TILE, T - q0), q_hi = q0 + nq - 1;
    const int row = (n_head + 2 * n_kv_head) * HS, kh = h / (n_head / n_kv_head);
    const floatX* base = qkv + (size_t)b * T * row;
    const floatX* k_g = base + (n_head + kh) * HS;  // key j at k_g + j * row
    const floatX* v_g = base + (n_head + n_kv_head + kh) * HS;
    const int* ds = doc_start + (size_t)b * T;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const float slope_log2 = alibi_n_head > 0 ? alibi_slope_f(head0 + h, alibi_n_head) * LOG2E : 0.f;

    load_tile_async<HS>(q_s, base + (size_t)q0 * row + h * HS, row, nq, tid);
    const int kv_lo = tile_kv_lo(ds, q0, nq);  // keys [kv_lo, q_hi]: each seen by some query of the tile
    const int n_tiles = (q_hi - kv_lo) / FA_TILE + 1;
    load_tile_async<HS>(k_s, k_g + (size_t)kv_lo * row, row, T - kv_lo, tid);
    load_tile_async<HS>(v_s, v_g + (size_t)kv_lo * row, row, T - kv_lo, tid);
    cp_async_commit();

    const WarpRows w = warp_rows(ds, T, q0 + warp * 16, lane);
    const int c2 = frag_col(lane);
    cp_async_wait_all();
    __syncthreads();
    uint32_t qf[KSTEPS][4];  // the warp's 16 query rows as A fragments, for the whole loop
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ks++)
        ldsm_x4(qf[ks], q_s + (warp * 16 + ldsm_a_row(lane)) * LD + ks * 16 + ldsm_a_col(lane));

    float o[DB][4] = {};
    float m[2] = {-INFINITY, -INFINITY};  // running row max, log2 units
    float l[2] = {0.f, 0.f};              // running sum of exp2(x - m) over this thread's columns
    for (int it = 0; it < n_tiles; it++) {
        const int kc = kv_lo + it * FA_TILE, buf = STAGES == 2 ? it & 1 : 0, kn = kc + FA_TILE;
        if (STAGES == 2 && it + 1 < n_tiles) {  // the other buffer was released by the barrier ending the last step
            load_tile_async<HS>(k_s + (buf ^ 1) * TILE, k_g + (size_t)kn * row, row, T - kn, tid);
            load_tile_async<HS>(v_s + (buf ^ 1) * TILE, v_g + (size_t)kn * row, row, T - kn, tid);
            cp_async_commit();
        }
        if (STAGES == 1 && it > 0) {  // one buffer, released by the barrier that ended the last step: refill, wait
            load_tile_async<HS>(k_s, k_g + (size_t)kc * row, row, T - kc, tid);
            load_tile_async<HS>(v_s, v_g + (size_t)kc * row, row, T - kc, tid);
            cp_async_commit();
            cp_async_wait_all();
            __syncthreads();
        }
        if (warp_sees(w, kc)) {  // warp-uniform
            float s[FA_TILE / 8][4] = {};
            warp_mma_abt_reg<KSTEPS, FA_TILE / 8, LD>(s, qf, k_s + buf * TILE, lane);
            // x = s * scale * log2(e) - slope * log2(e) * (i - j): the score in log2 units
            const bool all = warp_sees_all(w, kc);
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int nb = 0; nb < FA_TILE / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = e >> 1, j = kc + nb * 8 + c2 + (e & 1);
                    float x = fmaf(s[nb][e], scale_log2, -slope_log2 * (float)(w.i[r] - j));
                    if (!all && (j < w.lo[r] || j > w.i[r])) x = -INFINITY;
                    s[nb][e] = x;
                    mx[r] = fmaxf(mx[r], x);
                }
            float m_use[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {  // the 4 lanes of a quad share rows g, g + 8
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL, mx[r], 2));
                const float m_new = fmaxf(m[r], mx[r]);
                // no visible key so far (m_new = -inf): exponents against 0 keep p = 0 and alpha = 0, no NaN
                m_use[r] = m_new == -INFINITY ? 0.f : m_new;
                const float alpha = exp2f(m[r] - m_use[r]);  // 0 on the first visible tile (m = -inf)
                m[r] = m_new;
                l[r] *= alpha;
#pragma unroll
                for (int nb = 0; nb < DB; nb++) {
                    o[nb][2 * r] *= alpha;
                    o[nb][2 * r + 1] *= alpha;
                }
            }
#pragma unroll
            for (int nb = 0; nb < FA_TILE / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float p = exp2f(s[nb][e] - m_use[e >> 1]);
                    s[nb][e] = p;
                    l[e >> 1] += p;
                }
            uint32_t pa[FA_TILE / 16][4];
#pragma unroll
            for (int k = 0; k < FA_TILE / 16; k++) c_to_a(pa[k], s[2 * k], s[2 * k + 1]);
            warp_mma_ab<FA_TILE / 16, DB, LD>(o, pa, v_s + buf * TILE, lane);
        }
        cp_async_wait_all();
        __syncthreads();
    }

    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(FULL, l[r], 1);
        l[r] += __shfl_xor_sync(FULL, l[r], 2);
        inv[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;  // l = 0 only for rows past the end (not stored)
        if (c2 == 0 && w.i[r] < T) lse[((size_t)b * n_head + h) * T + w.i[r]] = (m[r] + log2f(l[r])) * LN2;
    }
    // the warp's own rows of q_s (only this warp ever read them) stage its output
    warp_store_rows<HS>(out + ((size_t)b * T + w.first) * n_head * HS + h * HS, (size_t)n_head * HS, T - w.first, o,
                        inv[0], inv[1], q_s + warp * 16 * LD, lane);
}

// ------------------------------------------------------------------------------------------------
// flash backward, dQ: block (b, h, 64 queries), warp w owns query rows 16w .. 16w+15; the forward's loop
// over key tiles (STAGES as there), writes dq (overwrite). Registers bounded as the forward's.

template <int HS, int STAGES>
__global__ void __launch_bounds__(FA_THREADS, FA_MIN_BLOCKS(HS))
flash_dq_kernel(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse, const float* delta,
                const int* doc_start, int T, int n_head, int n_kv_head, float scale, float scale_log2,
                int alibi_n_head, int head0) {
    constexpr int LD = HS + FA_PAD, TILE = FA_TILE * LD, KSTEPS = HS / 16, DB = HS / 8;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    floatX* q_s = reinterpret_cast<floatX*>(fa_smem);  // [64][LD] queries, later each warp's dq staging
    floatX* do_s = q_s + TILE;                           // [64][LD] their output gradients
    floatX* k_s = do_s + TILE;                           // [STAGES][64][LD] key tiles
    floatX* v_s = k_s + STAGES * TILE;                   // [STAGES][64][LD] value tiles
    static_assert(STAGES == 1 || STAGES == 2, "single- or double-buffered key/value tiles");

    const int b = blockIdx.z, h = blockIdx.y;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * FA_TILE;
    const int nq = min(FA_TILE, T - q0), q_hi = q0 + nq - 1;
    const int row = (n_head + 2 * n_kv_head) * HS, kh = h / (n_head / n_kv_head);
    const floatX* base = qkv + (size_t)b * T * row;
    const floatX* k_g = base + (n_head + kh) * HS;
    const floatX* v_g = base + (n_head + n_kv_head + kh) * HS;
    const int* ds = doc_start + (size_t)b * T;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const float slope_log2 = alibi_n_head > 0 ? alibi_slope_f(head0 + h, alibi_n_head) * LOG2E : 0.f;

    load_tile_async<HS>(q_s, base + (size_t)q0 * row + h * HS, row, nq, tid);
    load_tile_async<HS>(do_s, dout + ((size_t)b * T + q0) * n_head * HS + h * HS, (size_t)n_head * HS, nq, tid);
    const int kv_lo = tile_kv_lo(ds, q0, nq);
    const int n_tiles = (q_hi - kv_lo) / FA_TILE + 1;
    load_tile_async<HS>(k_s, k_g + (size_t)kv_lo * row, row, T - kv_lo, tid);
    load_tile_async<HS>(v_s, v_g + (size_t)kv_lo * row, row, T - kv_lo, tid);
    cp_async_commit();

    const WarpRows w = warp_rows(ds, T, q0 + warp * 16, lane);
    const int c2 = frag_col(lane);
    float lse2[2], dlt[2];  // lse in log2 units and D of this thread's two rows
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const bool in = w.i[r] < T;
        const size_t si = ((size_t)b * n_head + h) * T + (in ? w.i[r] : 0);
        lse2[r] = in ? lse[si] * LOG2E : 0.f;
        dlt[r] = in ? delta[si] : 0.f;
    }
    cp_async_wait_all();
    __syncthreads();

    float dq[DB][4] = {};
    for (int it = 0; it < n_tiles; it++) {
        const int kc = kv_lo + it * FA_TILE, buf = STAGES == 2 ? it & 1 : 0, kn = kc + FA_TILE;
        if (STAGES == 2 && it + 1 < n_tiles) {
            load_tile_async<HS>(k_s + (buf ^ 1) * TILE, k_g + (size_t)kn * row, row, T - kn, tid);
            load_tile_async<HS>(v_s + (buf ^ 1) * TILE, v_g + (size_t)kn * row, row, T - kn, tid);
            cp_async_commit();
        }
        if (STAGES == 1 && it > 0) {  // one buffer, released by the barrier that ended the last step: refill, wait
            load_tile_async<HS>(k_s, k_g + (size_t)kc * row, row, T - kc, tid);
            load_tile_async<HS>(v_s, v_g + (size_t)kc * row, row, T - kc, tid);
            cp_async_commit();
            cp_async_wait_all();
            __syncthreads();
        }
        if (warp_sees(w, kc)) {
            float s[FA_TILE / 8][4] = {}, dp[FA_TILE / 8][4] = {};
            warp_mma_abt<KSTEPS, FA_TILE / 8, LD>(s, q_s + warp * 16 * LD, k_s + buf * TILE, lane);
            warp_mma_abt<KSTEPS, FA_TILE / 8, LD>(dp, do_s + warp * 16 * LD, v_s + buf * TILE, lane);
            const bool all = warp_sees_all(w, kc);
#pragma unroll
            for (int nb = 0; nb < FA_TILE / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = e >> 1, j = kc + nb * 8 + c2 + (e & 1);
                    float p = exp2f(fmaf(s[nb][e], scale_log2, -slope_log2 * (float)(w.i[r] - j)) - lse2[r]);
                    if (!all && (j < w.lo[r] || j > w.i[r])) p = 0.f;
                    dp[nb][e] = p * (dp[nb][e] - dlt[r]) * scale;  // dS, with the scale folded in (as the CPU)
                }
            uint32_t dsa[FA_TILE / 16][4];
#pragma unroll
            for (int k = 0; k < FA_TILE / 16; k++) c_to_a(dsa[k], dp[2 * k], dp[2 * k + 1]);
            warp_mma_ab<FA_TILE / 16, DB, LD>(dq, dsa, k_s + buf * TILE, lane);
        }
        cp_async_wait_all();
        __syncthreads();
    }
    warp_store_rows<HS>(dqkv + ((size_t)b * T + w.first) * row + h * HS, row, T - w.first, dq, 1.f, 1.f,
                        q_s + warp * 16 * LD, lane);
}

// ------------------------------------------------------------------------------------------------
// flash backward, dK and dV: block (b, kv head, 64 keys), warp w owns key rows 16w .. 16w+15. Loop: the
// query heads of the group, and for each the 64-query tiles from the block's first key to the last query
// that sees one of its keys (double-buffered at STAGES 2, one buffer refilled between steps at 1), 32
// queries per step. Writes dk, dv (overwrite).

// (HS 64: at most 168 registers, so that 3 blocks of 128 threads fit an SM's 64K registers;
// unbounded, ptxas took 172 and 2 fit. HS 128 takes ~250: 2 blocks' worth, a minimum of 1 lets ptxas
// use them rather than guess a lower target. The forward and dQ kernels have the same bounds.)
template <int HS, int STAGES>
__global__ void __launch_bounds__(FA_THREADS, FA_MIN_BLOCKS(HS))
flash_dkdv_kernel(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse, const float* delta,
                  const int* doc_start, int T, int n_head, int n_kv_head, float scale, float scale_log2,
                  int alibi_n_head, int head0) {
    constexpr int LD = HS + FA_PAD, TILE = FA_TILE * LD, KSTEPS = HS / 16, DB = HS / 8, NQ = FA_SUB / 8;
    static_assert(FA_SUB == 32, "a step has one query per lane");
    extern __shared__ __align__(16) unsigned char fa_smem[];
    floatX* k_s = reinterpret_cast<floatX*>(fa_smem);  // [64][LD] keys of the block, later dk staging
    floatX* v_s = k_s + TILE;                            // [64][LD] values of the block, later dv staging
    floatX* q_s = v_s + TILE;                            // [STAGES][64][LD] query tiles
    floatX* do_s = q_s + STAGES * TILE;                  // [STAGES][64][LD] their output gradients
    static_assert(STAGES == 1 || STAGES == 2, "single- or double-buffered query/dO tiles");
    __shared__ float lse_s[STAGES][FA_TILE], dlt_s[STAGES][FA_TILE];
    __shared__ int ds_s[STAGES][FA_TILE];  // doc_start of the tile's queries (0 past the end: masked by i < T)
    __shared__ int i_last_s;
    __shared__ float slope_s[STAGES];  // the step's ALiBi slope (x log2 e), written with its tiles: no
                                  // registers held across the step for the head's slope (HS 128 spilled)

    const int b = blockIdx.z, kh = blockIdx.y;
    const int j0 = blockIdx.x * FA_TILE;  // the first key tiles see the most queries: scheduled first
    const int nk = min(FA_TILE, T - j0), j_last = j0 + nk - 1;
    const int group = n_head / n_kv_head, row = (n_head + 2 * n_kv_head) * HS;
    const floatX* base = qkv + (size_t)b * T * row;
    const int* ds = doc_start + (size_t)b * T;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

    load_tile_async<HS>(k_s, base + (size_t)j0 * row + (n_head + kh) * HS, row, nk, tid);
    load_tile_async<HS>(v_s, base + (size_t)j0 * row + (n_head + n_kv_head + kh) * HS, row, nk, tid);
    // The queries that see a key of the block are among [j0, i_last], i_last the largest i with
    // doc_start[i] <= j_last: scanned from the end of the row, 128 rows at a time (the first block with a
    // hit holds the largest; no assumption on the order of doc_start).
    if (tid == 0) i_last_s = j_last;  // the last key sees itself
    __syncthreads();
    for (int c = T - 1; c > j_last; c -= FA_THREADS) {
        const int i = c - tid;
        const bool hit = i > j_last && ds[i] <= j_last;
        if (hit) atomicMax(&i_last_s, i);  // integer max: order-free
        if (__syncthreads_or(hit)) break;  // block-uniform; the barrier also publishes the atomics
    }
    const int i_last = i_last_s;
    const int n_qt = (i_last - j0) / FA_TILE + 1, n_steps = group * n_qt;

    // step u: query head kh * group + u / n_qt, query tile j0 + (u % n_qt) * 64, into buffer buf
    auto load_step = [&](int u, int buf) {
        const int h = kh * group + u / n_qt, ic = j0 + (u % n_qt) * FA_TILE, nv = T - ic;
        // (HS 64: the address from the kernel's parameters each time, no 64-bit base held across the
        // loop, keeps it within 168 registers without a spill; HS 128 spilled that way, not the other)
        const floatX* q_rows = HS == 64 ? qkv + ((size_t)blockIdx.z * T + ic) * row : base + (size_t)ic * row;
        load_tile_async<HS>(q_s + buf * TILE, q_rows + h * HS, row, nv, tid);
        load_tile_async<HS>(do_s + buf * TILE, dout + ((size_t)b * T + ic) * n_head * HS + h * HS,
                            (size_t)n_head * HS, nv, tid);
        const int t = tid % FA_TILE;
        const bool ok = t < nv;
        if (tid < FA_TILE) {
            const size_t si = ((size_t)b * n_head + h) * T + ic + (ok ? t : 0);
            cp_async_4(&lse_s[buf][t], lse + si, ok);
            cp_async_4(&dlt_s[buf][t], delta + si, ok);
        } else {
            cp_async_4(&ds_s[buf][t], ds + ic + (ok ? t : 0), ok);
        }
        if (tid == FA_THREADS - 1) slope_s[buf] = alibi_n_head > 0 ? alibi_slope_f(head0 + h, alibi_n_head) * LOG2E : 0.f;
    };
    load_step(0, 0);
    cp_async_commit();

    // this thread's two keys (C fragment rows g, g + 8 of the warp's 16)
    const int jw = j0 + warp * 16, jw_last = min(jw + 15, T - 1), c2 = frag_col(lane);
    float dk[DB][4] = {}, dv[DB][4] = {};
    cp_async_wait_all();
    __syncthreads();

    for (int u = 0; u < n_steps; u++) {
        const int buf = STAGES == 2 ? u & 1 : 0, ic = j0 + (u % n_qt) * FA_TILE;
        if (STAGES == 2 && u + 1 < n_steps) {  // the other buffer was released by the barrier ending the last step
            load_step(u + 1, buf ^ 1);
            cp_async_commit();
        }
        if (STAGES == 1 && u > 0) {  // one buffer, released by the barrier that ended the last step: refill, wait
            load_step(u, 0);
            cp_async_commit();
            cp_async_wait_all();
            __syncthreads();
        }
        const float slope_log2 = slope_s[buf];
        const floatX* qt = q_s + buf * TILE;
        const floatX* dot = do_s + buf * TILE;
#pragma unroll 1
        for (int c0 = 0; c0 < FA_TILE; c0 += FA_SUB) {
            // lane l looks at query ic + c0 + l: does any see a key of the warp, do all see all of them?
            const int iq = ic + c0 + lane, dsq = ds_s[buf][c0 + lane];
            const bool q_in = iq < T;
            if (!__any_sync(FULL, jw < T && q_in && iq >= jw && dsq <= jw_last)) continue;  // warp-uniform
            const bool all = __all_sync(FULL, q_in && dsq <= jw) && ic + c0 >= jw + 15 && jw + 15 < T;
            float s[NQ][4] = {}, dp[NQ][4] = {};
            warp_mma_abt<KSTEPS, NQ, LD>(s, k_s + warp * 16 * LD, qt + c0 * LD, lane);
            warp_mma_abt<KSTEPS, NQ, LD>(dp, v_s + warp * 16 * LD, dot + c0 * LD, lane);
#pragma unroll
            for (int nb = 0; nb < NQ; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int c = c0 + nb * 8 + c2 + (e & 1), i = ic + c, j = jw + frag_row(lane) + 8 * (e >> 1);
                    const float x = fmaf(s[nb][e], scale_log2, -slope_log2 * (float)(i - j));
                    float p = exp2f(x - lse_s[buf][c] * LOG2E);
                    if (!all && !(i < T && j < T && ds_s[buf][c] <= j && j <= i)) p = 0.f;
                    s[nb][e] = p;
                    dp[nb][e] = p * (dp[nb][e] - dlt_s[buf][c]) * scale;
                }
            uint32_t pa[NQ / 2][4], dsa[NQ / 2][4];
#pragma unroll
            for (int k = 0; k < NQ / 2; k++) {
                c_to_a(pa[k], s[2 * k], s[2 * k + 1]);
                c_to_a(dsa[k], dp[2 * k], dp[2 * k + 1]);
            }
            warp_mma_ab<NQ / 2, DB, LD>(dv, pa, dot + c0 * LD, lane);
            warp_mma_ab<NQ / 2, DB, LD>(dk, dsa, qt + c0 * LD, lane);
        }
        cp_async_wait_all();
        __syncthreads();
    }
    // the warp's own rows of k_s and v_s (only this warp ever read them) stage dk and dv
    floatX* drow = dqkv + ((size_t)b * T + jw) * row;
    warp_store_rows<HS>(drow + (n_head + kh) * HS, row, T - jw, dk, 1.f, 1.f, k_s + warp * 16 * LD, lane);
    warp_store_rows<HS>(drow + (n_head + n_kv_head + kh) * HS, row, T - jw, dv, 1.f, 1.f, v_s + warp * 16 * LD, lane);
}

// ================================================================================================
// host side
// ================================================================================================

// Dynamic shared memory of the flash kernels: the forward holds Q plus STAGES K and V tiles, dQ and dK/dV two
// resident tiles (Q and dO, or K and V) plus STAGES tiles of each streamed operand.
// (scripts/kernel_resources.sh checks these sizes per architecture at build time, with these constants)
static_assert(FA_TILE == 64 && FA_PAD == 8 && sizeof(floatX) == 2 && CHUNK == 32 && QTILE == 16 && KTILE == 16,
              "scripts/kernel_resources.sh's shared-memory check assumes these tiles: change it with them");
inline size_t flash_forward_smem_bytes(int hs, int stages) {
    return (size_t)(1 + 2 * stages) * FA_TILE * (hs + FA_PAD) * sizeof(floatX);
}
inline size_t flash_backward_smem_bytes(int hs, int stages) {
    return (size_t)(2 + 2 * stages) * FA_TILE * (hs + FA_PAD) * sizeof(floatX);
}

// ---- Which variant runs: chosen per kernel from the device's limits, once per (device, override) ----
// Every flash kernel comes in two variants with the same math in the same order (so bitwise the same
// results): STAGES 2 double-buffers the streamed tiles (the cp.async copy of tile k+1 overlaps the math of
// tile k, FlashAttention-2's pipelining: Dao, "FlashAttention-2", 2023, sec. 3.3), STAGES 1 holds one
// buffer and refills it between steps (copy latency exposed, 2 tiles less shared memory). Sizes (KB =
// 1024 B; dK/dV adds 1.5 KB / 0.8 KB of static smem):
//            hs 64: 2-stage  1-stage     hs 128: 2-stage  1-stage
//   forward          45 KB    27 KB               85 KB    51 KB
//   dQ, dK/dV        54 KB    36 KB              102 KB    68 KB
// Rule, per kernel: a variant is eligible if its dynamic + static smem fits the device's per-block
// opt-in limit (cudaDevAttrMaxSharedMemoryPerBlockOptin); of the eligible ones the one with more
// resident blocks per SM wins (registers, smem per SM incl. the 1 KB the driver reserves per block,
// threads, blocks), the 2-stage one on a tie (at equal occupancy it is 5..7% faster on the H200). With
// the registers of CUDA 13 (hs 64 <= 168: 3 blocks/SM, hs 128: 2 blocks/SM by registers) that gives:
//   H100/H200 (227 KB/block, 228 KB/SM)  every kernel 2-stage (as before the 1-stage variants existed)
//   A100 (163 KB, 164 KB)                forward hs 64 2-stage; the others 1-stage: dQ, dK/dV hs 64 3
//                                        blocks/SM instead of 2, hs 128 2 instead of 1
//   RTX 3090/4090, L4 (99 KB, 100 KB)    hs 64 1-stage (forward 3 blocks/SM instead of 2, backward 2
//                                        instead of 1); hs 128 forward 2-stage (1 block either way),
//                                        backward 1-stage (the 2-stage one, 102 KB, does not fit)
// (Two blocks of a 1-stage kernel overlap one block's copies with the other's math, which the 2-stage
// kernel does inside one block: the rule prefers the occupancy. Only the equal-occupancy case is
// measured (H200, dev/cuda/attention_{forward,backward}.cu --stages: 1-stage 0.91..0.96x of 2-stage);
// the occupancy trade on a 3090/4090/A100 is the rule's judgement until measured there.) No variant fitting is an error, never a silent
// fallback. attention_kernels_summary(hs) says what was chosen.
// Overrides (tests, benchmarks): LLMC_ATTENTION_SMEM_LIMIT=<bytes> (read once) or flash_override(limit,
// stages) emulate a card with that per-block limit (per-SM = limit + the reserved 1 KB, as on sm_80..90:
// 101376 is an RTX 3090/4090 / L4, 166912 an A100) when below the device's; flash_override's stages 1 or
// 2 force that variant for every flash kernel (an error where it does not fit).
struct FlashDevice {
    int device = -1, cc = 0;
    size_t smem_block = 0, smem_sm = 0, reserved = 0;  // bytes (after the emulated limit, if any)
    size_t device_smem_block = 0;                      // the card's own per-block limit
    int regs_sm = 0, threads_sm = 0, blocks_sm = 0;
};
struct FlashVariant {
    int stages = 0;       // 1 or 2
    size_t smem = 0;      // dynamic + static bytes per block
    int regs = 0, blocks_per_sm = 0;
    int ptx = 0;          // the PTX version its code came from (cudaFuncAttributes::ptxVersion): < 80 is the
                          // sm_75 code path (the fp16 build's SASS for sm_75, or its PTX JIT-compiled for this card)
};
struct FlashPlan {
    FlashDevice dev;
    FlashVariant fwd, dq, dkdv;
    size_t alt_smem[3] = {0, 0, 0};  // the bytes of the variant not chosen (fwd, dq, dkdv), for the summary
    bool alt_fits[3] = {false, false, false};
};
struct FlashOverrideState {
    size_t smem_limit = 0;   // 0: the device's (or LLMC_ATTENTION_SMEM_LIMIT's)
    int stages = 0;          // 0: automatic
    unsigned generation = 1; // bumped by every flash_override: invalidates the cached plans
};
inline FlashOverrideState& flash_override_state() {
    static FlashOverrideState st;
    return st;
}
// Tests and benchmarks: smem_limit > 0 emulates a card with that per-block limit (0: the device's, or
// LLMC_ATTENTION_SMEM_LIMIT's); stages 1 or 2 forces that variant of every flash kernel (0: the rule above).
inline void flash_override(size_t smem_limit, int stages) {
    LLMC_CHECK(stages >= 0 && stages <= 2, "flash_override: stages %d (0 automatic, 1 or 2)", stages);
    FlashOverrideState& st = flash_override_state();
    st.smem_limit = smem_limit;
    st.stages = stages;
    st.generation++;
}
// sets an override for its scope and restores the previous one when it leaves (also on an exception)
struct FlashOverrideGuard {
    size_t prev_limit;
    int prev_stages;
    FlashOverrideGuard(size_t smem_limit, int stages)
        : prev_limit(flash_override_state().smem_limit), prev_stages(flash_override_state().stages) {
        flash_override(smem_limit, stages);
    }
    ~FlashOverrideGuard() { flash_override(prev_limit, prev_stages); }
    FlashOverrideGuard(const FlashOverrideGuard&) = delete;
    FlashOverrideGuard& operator=(const FlashOverrideGuard&) = delete;
};

inline size_t env_smem_limit() {
    static const size_t v = [] {
        const char* e = getenv("LLMC_ATTENTION_SMEM_LIMIT");
        if (!e || !*e) return (size_t)0;
        char* end = nullptr;
        const long long x = strtoll(e, &end, 10);
        LLMC_CHECK(end && *end == '\0' && x > 0, "LLMC_ATTENTION_SMEM_LIMIT=%s: expected a positive byte count", e);
        return (size_t)x;
    }();
    return v;
}

inline FlashDevice flash_device_limits(int device) {
    FlashDevice d;
    d.device = device;
    int v = 0, major = 0, minor = 0;
    cudaCheck(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    cudaCheck(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    d.cc = 10 * major + minor;
    cudaCheck(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    d.smem_block = d.device_smem_block = (size_t)v;
    cudaCheck(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    d.smem_sm = (size_t)v;
    cudaCheck(cudaDeviceGetAttribute(&v, cudaDevAttrReservedSharedMemoryPerBlock, device));
    d.reserved = (size_t)v;
    cudaCheck(cudaDeviceGetAttribute(&d.regs_sm, cudaDevAttrMaxRegistersPerMultiprocessor, device));
    cudaCheck(cudaDeviceGetAttribute(&d.threads_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device));
    cudaCheck(cudaDeviceGetAttribute(&d.blocks_sm, cudaDevAttrMaxBlocksPerMultiprocessor, device));
    const size_t limit = flash_override_state().smem_limit ? flash_override_state().smem_limit : env_smem_limit();
    if (limit > 0 && limit < d.smem_block) {  // emulate the smaller card: its per-SM capacity is limit + reserved
        d.smem_block = limit;
        d.smem_sm = std::min(d.smem_sm, limit + d.reserved);
    }
    return d;
}

// resident blocks per SM of a kernel at FA_THREADS threads and `dyn` bytes of dynamic smem (the occupancy
// calculator's rules: registers allocated per warp in units of 256, smem per block plus the reserved part)
template <typename Kernel>
inline FlashVariant flash_variant(const FlashDevice& d, Kernel kernel, int stages, size_t dyn) {
    cudaFuncAttributes a;
    cudaCheck(cudaFuncGetAttributes(&a, kernel));
    FlashVariant fv;
    fv.stages = stages;
    fv.smem = dyn + a.sharedSizeBytes;
    fv.regs = a.numRegs;
    fv.ptx = a.ptxVersion;
    const int warp_regs = (a.numRegs * 32 + 255) / 256 * 256, warps = FA_THREADS / 32;
    int blocks = warp_regs > 0 ? d.regs_sm / warp_regs / warps : d.blocks_sm;
    blocks = std::min(blocks, (int)(d.smem_sm / (fv.smem + d.reserved)));
    blocks = std::min(blocks, d.threads_sm / FA_THREADS);
    fv.blocks_per_sm = std::min(blocks, d.blocks_sm);
    return fv;
}

// picks the variant of one kernel (see the rule above); slot 0 forward, 1 dQ, 2 dK/dV
template <typename K1, typename K2>
inline FlashVariant flash_pick(FlashPlan& plan, int slot, const char* what, int hs, K1 k1, size_t dyn1, K2 k2,
                               size_t dyn2) {
    const FlashDevice& d = plan.dev;
    const FlashVariant v1 = flash_variant(d, k1, 1, dyn1), v2 = flash_variant(d, k2, 2, dyn2);
    const bool fit1 = v1.smem <= d.smem_block && v1.blocks_per_sm > 0, fit2 = v2.smem <= d.smem_block && v2.blocks_per_sm > 0;
    const int forced = flash_override_state().stages;
    LLMC_CHECK(forced != 2 || fit2, "attention %s hs %d: the 2-stage kernel (%zu B of shared memory) was forced but does "
               "not fit this device's %zu B per block", what, hs, v2.smem, d.smem_block);
    LLMC_CHECK(fit1, "attention %s hs %d: no flash variant fits the device's %zu B of shared memory per block (the "
               "1-stage kernel needs %zu B)%s", what, hs, d.smem_block, v1.smem,
               d.cc < 80 ? "; sm_75's 64 KB hold the flash kernels at head size 64 only (n_embd / n_head = 64)" : "");
    const bool two = forced == 2 || (forced == 0 && fit2 && v2.blocks_per_sm >= v1.blocks_per_sm);
    plan.alt_smem[slot] = two ? v1.smem : v2.smem;
    plan.alt_fits[slot] = two ? fit1 : fit2;
    return two ? v2 : v1;
}

template <int HS>
inline FlashPlan flash_make_plan(int device) {
    FlashPlan p;
    p.dev = flash_device_limits(device);
    p.fwd = flash_pick(p, 0, "forward", HS, flash_forward_kernel<HS, 1>, flash_forward_smem_bytes(HS, 1),
                       flash_forward_kernel<HS, 2>, flash_forward_smem_bytes(HS, 2));
    p.dq = flash_pick(p, 1, "backward dQ", HS, flash_dq_kernel<HS, 1>, flash_backward_smem_bytes(HS, 1),
                      flash_dq_kernel<HS, 2>, flash_backward_smem_bytes(HS, 2));
    p.dkdv = flash_pick(p, 2, "backward dK/dV", HS, flash_dkdv_kernel<HS, 1>, flash_backward_smem_bytes(HS, 1),
                        flash_dkdv_kernel<HS, 2>, flash_backward_smem_bytes(HS, 2));
    return p;
}

// The plan for head size HS on the current device: computed on first use and cached per device (up to 64
// devices) and override generation, so a launch costs a cudaGetDevice and a compare.
template <int HS>
inline const FlashPlan& flash_plan() {
    constexpr int MAX_DEVICES = 64;
    static FlashPlan plans[MAX_DEVICES];
    static unsigned generation[MAX_DEVICES] = {};
    int device = 0;
    cudaCheck(cudaGetDevice(&device));
    LLMC_CHECK(device >= 0 && device < MAX_DEVICES, "attention: device %d (at most %d)", device, MAX_DEVICES);
    const unsigned gen = flash_override_state().generation;
    if (generation[device] != gen) {
        plans[device] = flash_make_plan<HS>(device);
        generation[device] = gen;
    }
    return plans[device];
}
inline const FlashPlan& flash_plan(int hs) { return hs == 64 ? flash_plan<64>() : flash_plan<128>(); }

// version 1: the simple kernels
inline void forward_simple(floatX* out, float* lse, const floatX* qkv, const int* doc_start, int B, int T, int n_head,
                           int n_kv_head, int hs, int alibi_n_head, int head0) {
    check_args("attention_forward", B, T, n_head, n_kv_head, hs, alibi_n_head, head0, {out, qkv});
    const size_t smem = forward_smem_bytes(hs);
    set_smem(attention_forward_kernel, smem);
    const dim3 grid((T + QTILE - 1) / QTILE, n_head, B);
    attention_forward_kernel<<<grid, THREADS, smem, llmc_stream()>>>(out, lse, qkv, doc_start, T, n_head, n_kv_head,
                                                                     hs, 1.0f / sqrtf((float)hs), alibi_n_head, head0);
    cudaCheckLaunch();
}

// D = dO.O into scratch, the first stage of both backward versions
inline float* backward_delta(const floatX* dout, const floatX* out, int B, int T, int n_head, int hs) {
    float* delta = cuda_scratch<float>((size_t)B * n_head * T, "attention_backward");
    const size_t n_rows = (size_t)B * T * n_head;
    attention_delta_kernel<<<(unsigned)((n_rows + 255) / 256), 256, 0, llmc_stream()>>>(delta, dout, out, B, T, n_head, hs);
    cudaCheckLaunch();
    return delta;
}

inline void backward_simple(floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out, const float* lse,
                            const int* doc_start, int B, int T, int n_head, int n_kv_head, int hs, int alibi_n_head,
                            int head0) {
    check_args("attention_backward", B, T, n_head, n_kv_head, hs, alibi_n_head, head0, {dqkv, dout, qkv, out});
    const float* delta = backward_delta(dout, out, B, T, n_head, hs);
    const float scale = 1.0f / sqrtf((float)hs);

    const size_t dq_smem = dq_smem_bytes(hs);
    set_smem(attention_dq_kernel, dq_smem);
    const dim3 dq_grid((T + QTILE - 1) / QTILE, n_head, B);
    attention_dq_kernel<<<dq_grid, THREADS, dq_smem, llmc_stream()>>>(dqkv, dout, qkv, lse, delta, doc_start, T, n_head,
                                                                      n_kv_head, hs, scale, alibi_n_head, head0);
    cudaCheckLaunch();

    const size_t kv_smem = dkdv_smem_bytes(hs);
    set_smem(attention_dkdv_kernel, kv_smem);
    const dim3 kv_grid((T + KTILE - 1) / KTILE, n_kv_head, B);
    attention_dkdv_kernel<<<kv_grid, THREADS, kv_smem, llmc_stream()>>>(dqkv, dout, qkv, lse, delta, doc_start, T,
                                                                        n_head, n_kv_head, hs, scale, alibi_n_head,
                                                                        head0);
    cudaCheckLaunch();
}

// version 2: the flash kernels (hs 64 or 128), each in the variant flash_plan<HS>() chose
template <int HS, int STAGES>
inline void forward_flash_launch(floatX* out, float* lse, const floatX* qkv, const int* doc_start, int B, int T,
                                 int n_head, int n_kv_head, int alibi_n_head, int head0) {
    const size_t smem = flash_forward_smem_bytes(HS, STAGES);
    set_smem(flash_forward_kernel<HS, STAGES>, smem);
    const dim3 grid((T + FA_TILE - 1) / FA_TILE, n_head, B);
    flash_forward_kernel<HS, STAGES><<<grid, FA_THREADS, smem, llmc_stream()>>>(
        out, lse, qkv, doc_start, T, n_head, n_kv_head, LOG2E / sqrtf((float)HS), alibi_n_head, head0);
    cudaCheckLaunch();
}
template <int HS>
inline void forward_flash_hs(floatX* out, float* lse, const floatX* qkv, const int* doc_start, int B, int T,
                             int n_head, int n_kv_head, int alibi_n_head, int head0) {
    if (flash_plan<HS>().fwd.stages == 2)
        forward_flash_launch<HS, 2>(out, lse, qkv, doc_start, B, T, n_head, n_kv_head, alibi_n_head, head0);
    else
        forward_flash_launch<HS, 1>(out, lse, qkv, doc_start, B, T, n_head, n_kv_head, alibi_n_head, head0);
}
inline void forward_flash(floatX* out, float* lse, const floatX* qkv, const int* doc_start, int B, int T, int n_head,
                          int n_kv_head, int hs, int alibi_n_head, int head0) {
    check_args("attention_forward", B, T, n_head, n_kv_head, hs, alibi_n_head, head0, {out, qkv});
    LLMC_CHECK(flash_supported(hs), "attention_forward (flash): head_size %d, the tensor-core kernels take 64 or 128", hs);
    if (hs == 64) forward_flash_hs<64>(out, lse, qkv, doc_start, B, T, n_head, n_kv_head, alibi_n_head, head0);
    else forward_flash_hs<128>(out, lse, qkv, doc_start, B, T, n_head, n_kv_head, alibi_n_head, head0);
}

template <int HS, int STAGES>
inline void dq_flash_launch(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse, const float* delta,
                            const int* doc_start, int B, int T, int n_head, int n_kv_head, int alibi_n_head,
                            int head0) {
    const float scale = 1.0f / sqrtf((float)HS), scale_log2 = scale * LOG2E;
    const size_t smem = flash_backward_smem_bytes(HS, STAGES);
    set_smem(flash_dq_kernel<HS, STAGES>, smem);
    const dim3 grid((T + FA_TILE - 1) / FA_TILE, n_head, B);
    flash_dq_kernel<HS, STAGES><<<grid, FA_THREADS, smem, llmc_stream()>>>(
        dqkv, dout, qkv, lse, delta, doc_start, T, n_head, n_kv_head, scale, scale_log2, alibi_n_head, head0);
    cudaCheckLaunch();
}
template <int HS, int STAGES>
inline void dkdv_flash_launch(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                              const float* delta, const int* doc_start, int B, int T, int n_head, int n_kv_head,
                              int alibi_n_head, int head0) {
    const float scale = 1.0f / sqrtf((float)HS), scale_log2 = scale * LOG2E;
    const size_t smem = flash_backward_smem_bytes(HS, STAGES);
    set_smem(flash_dkdv_kernel<HS, STAGES>, smem);
    const dim3 grid((T + FA_TILE - 1) / FA_TILE, n_kv_head, B);
    flash_dkdv_kernel<HS, STAGES><<<grid, FA_THREADS, smem, llmc_stream()>>>(
        dqkv, dout, qkv, lse, delta, doc_start, T, n_head, n_kv_head, scale, scale_log2, alibi_n_head, head0);
    cudaCheckLaunch();
}
template <int HS>
inline void backward_flash_hs(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                              const float* delta, const int* doc_start, int B, int T, int n_head, int n_kv_head,
                              int alibi_n_head, int head0) {
    const FlashPlan& plan = flash_plan<HS>();
    if (plan.dq.stages == 2)
        dq_flash_launch<HS, 2>(dqkv, dout, qkv, lse, delta, doc_start, B, T, n_head, n_kv_head, alibi_n_head, head0);
    else
        dq_flash_launch<HS, 1>(dqkv, dout, qkv, lse, delta, doc_start, B, T, n_head, n_kv_head, alibi_n_head, head0);
    if (plan.dkdv.stages == 2)
        dkdv_flash_launch<HS, 2>(dqkv, dout, qkv, lse, delta, doc_start, B, T, n_head, n_kv_head, alibi_n_head, head0);
    else
        dkdv_flash_launch<HS, 1>(dqkv, dout, qkv, lse, delta, doc_start, B, T, n_head, n_kv_head, alibi_n_head, head0);
}
inline void backward_flash(floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out, const float* lse,
                           const int* doc_start, int B, int T, int n_head, int n_kv_head, int hs, int alibi_n_head,
                           int head0) {
    check_args("attention_backward", B, T, n_head, n_kv_head, hs, alibi_n_head, head0, {dqkv, dout, qkv, out});
    LLMC_CHECK(flash_supported(hs), "attention_backward (flash): head_size %d, the tensor-core kernels take 64 or 128",
               hs);
    const float* delta = backward_delta(dout, out, B, T, n_head, hs);
    if (hs == 64)
        backward_flash_hs<64>(dqkv, dout, qkv, lse, delta, doc_start, B, T, n_head, n_kv_head, alibi_n_head, head0);
    else
        backward_flash_hs<128>(dqkv, dout, qkv, lse, delta, doc_start, B, T, n_head, n_kv_head, alibi_n_head, head0);
}

}  // namespace attention_detail

// One line for the trainer's start-up: which attention kernels run at head size hs on the current device,
// their shared memory per block and resident blocks per SM, and why a smaller variant was chosen, e.g.
//   attention hs 128: flash bf16, sm_86 99 KB/block: fwd 2-stage 85.0 KB 1/SM, dQ 1-stage 68.0 KB 1/SM (2-stage
//   102.0 KB does not fit), dK/dV 1-stage 68.8 KB 1/SM (2-stage 103.5 KB does not fit)
inline std::string attention_kernels_summary(int hs) {
    using namespace attention_detail;
    char buf[512];
    if (!flash_supported(hs)) {
        snprintf(buf, sizeof buf, "attention hs %d: simple fp32 kernels (the flash kernels take hs 64, 128): fwd %.1f KB, "
                 "bwd %.1f KB per block", hs, forward_smem_bytes(hs) / 1024.0, dq_smem_bytes(hs) / 1024.0);
        return buf;
    }
    const FlashPlan& p = flash_plan(hs);
    const bool emulated = p.dev.smem_block < p.dev.device_smem_block;
    int n = snprintf(buf, sizeof buf, "attention hs %d: flash %s%s, sm_%d %.0f KB/block%s:", hs, LLMC_PRECISION,
                     p.fwd.ptx < 80 ? " (sm_75 code: 2 x m16n8k8 mma, no cp.async)" : "", p.dev.cc,
                     p.dev.smem_block / 1024.0, emulated ? " (emulated limit)" : "");
    const FlashVariant* vs[3] = {&p.fwd, &p.dq, &p.dkdv};
    const char* names[3] = {"fwd", "dQ", "dK/dV"};
    for (int k = 0; k < 3 && n > 0 && n < (int)sizeof buf; k++) {
        const FlashVariant& v = *vs[k];
        n += snprintf(buf + n, sizeof buf - n, "%s %s %d-stage %.1f KB %d/SM", k ? "," : "", names[k], v.stages,
                      v.smem / 1024.0, v.blocks_per_sm);
        if (n > 0 && n < (int)sizeof buf && v.stages == 1)
            n += snprintf(buf + n, sizeof buf - n, " (2-stage %.1f KB %s)", p.alt_smem[k] / 1024.0,
                          p.alt_fits[k] ? (attention_detail::flash_override_state().stages == 1
                                               ? "fits, 1-stage forced"
                                               : "fits, fewer blocks/SM")
                                        : "does not fit");
    }
    if (attention_detail::flash_override_state().stages == 2 && n > 0 && n < (int)sizeof buf)
        snprintf(buf + n, sizeof buf - n, " (2-stage forced)");
    return buf;
}

// out [B, T, n_head*hs] and lse [B, n_head, T] overwritten; qkv [B, T, (n_head + 2 n_kv_head) hs];
// doc_start [B*T] (device, row-relative indices). hs 64, 128: the flash kernels, else the simple ones.
// alibi_n_head: the model's head count for the ALiBi slopes (0: no ALiBi); head0: the global index of
// local head 0 (0 without tensor parallelism); [head0, head0 + n_head) must lie in [0, alibi_n_head).
inline void attention_forward(floatX* out, float* lse, const floatX* qkv, const int* doc_start, int B, int T,
                              int n_head, int n_kv_head, int hs, int alibi_n_head, int head0) {
    using namespace attention_detail;
    if (flash_supported(hs)) forward_flash(out, lse, qkv, doc_start, B, T, n_head, n_kv_head, hs, alibi_n_head, head0);
    else forward_simple(out, lse, qkv, doc_start, B, T, n_head, n_kv_head, hs, alibi_n_head, head0);
}

// dqkv [B, T, (n_head + 2 n_kv_head) hs] overwritten; dout, out [B, T, n_head*hs]; lse [B, n_head, T]
// as saved by attention_forward. Scratch: attention_scratch_bytes(B, T, n_head).
inline void attention_backward(floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out, const float* lse,
                               const int* doc_start, int B, int T, int n_head, int n_kv_head, int hs,
                               int alibi_n_head, int head0) {
    using namespace attention_detail;
    if (flash_supported(hs))
        backward_flash(dqkv, dout, qkv, out, lse, doc_start, B, T, n_head, n_kv_head, hs, alibi_n_head, head0);
    else
        backward_simple(dqkv, dout, qkv, out, lse, doc_start, B, T, n_head, n_kv_head, hs, alibi_n_head, head0);
}
