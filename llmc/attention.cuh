// Causal self-attention over packed documents with grouped-query heads and ALiBi, on the GPU: the
// twin of llmc/cpu/attention.h (same names, argument order and saved state).
//   qkv row (one token): [q heads: n_head*hs | k heads: n_kv_head*hs | v heads: n_kv_head*hs]
//   query head h reads kv head h / (n_head / n_kv_head)
//   s_ij = q_i.k_j / sqrt(hs) - slope_h * (i - j)   (ALiBi term only when alibi)
//   key j is visible to query i iff doc_start[i] <= j <= i   (own document, causal)
//   forward   lse_i = log sum_j exp(s_ij)   (fp32, natural log)      out_i = sum_j exp(s_ij - lse_i) v_j
//   backward  p_ij = exp(s_ij - lse_i) recomputed from lse, D_i = dO_i . O_i, dS_ij = p_ij (dO_i.v_j - D_i)
//             dq_i = scale sum_j dS_ij k_j,  dk_j = scale sum_i dS_ij q_i,  dv_j = sum_i p_ij dO_i
//             (dk, dv also summed over the query heads of the kv head's group)
// This is the plain, certainly-correct version for the training path (a fused tensor-core flash
// kernel is a separate, later task): fp32 math on CUDA cores, bf16 loads/stores, no T x T buffer.
//
// Parallel decomposition. A block is 4 warps. Tiles of K/V (forward, dQ) or of Q/dO (dK/dV) are
// staged in shared memory as fp32, CHUNK = 32 rows at a time, so that each lane owns one row of the
// chunk for the dot products (lane j computes q.k_j reading its own padded smem row with float4
// loads, conflict-free), and then owns head dims d = lane, lane + 32, ... for the accumulations
// (o += p_j v_j, dq += dS_j k_j, dk += dS_i q_i, dv += p_i dO_i, with p_j broadcast by shuffle).
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
// nothing uninitialised or infinite reaches a product.
// Preconditions: 0 <= doc_start[i] <= i (every query sees at least itself, as the loader builds it);
// hs a multiple of 8 (16-byte bf16 vectors) in [8, 128]; n_kv_head divides n_head; qkv, out, dout,
// dqkv 16-byte aligned. The kernels do not assume doc_start is non-decreasing (it is, by
// construction), only the work they skip is tighter when it is.
//
// Scratch (cuda_scratch): attention_forward none; attention_backward B * n_head * T floats (D),
// attention_scratch_bytes(B, T, n_head, n_kv_head, hs).
// Shared memory (dynamic, fp32): forward 32(hs+4) + 32 hs + 16 hs floats (41.5 KB at hs = 128),
// dQ 2 * 32(hs+4) + 2 * 16 hs (49 KB), dK/dV 2 * 32(hs+4) + 2 * 16 hs (49 KB) plus 400 B static.
// Speed: every multiply-add reads shared memory (K/Q rows per lane, V/dO by head dim), so expect
// roughly 10 TFLOP/s on an H200 (an estimate, not measured): correct and memory-lean, not fast.
#pragma once
#include <climits>
#include <initializer_list>
#include <cmath>
#include <cstdint>
#include "llmc/cuda_common.cuh"

inline size_t attention_scratch_bytes(int B, int T, int n_head, int n_kv_head, int hs) {
    (void)n_kv_head;
    (void)hs;
    return (size_t)B * n_head * T * sizeof(float);  // D = dO.O of attention_backward
}

namespace attention_detail {

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

// 8 consecutive bf16 values (one 16-byte load) as fp32. A bf16 is the high half of an fp32 and, little
// endian, the lower-addressed value of each 32-bit word is its low half: bit operations, no type punning.
__device__ inline void load_bf16x8(float f[8], const floatX* p) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        f[2 * k] = __uint_as_float(w[k] << 16);
        f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
}

// Stages `rows` rows of hs bf16 values (row r at src + r * src_stride) into shared memory as fp32
// rows of dst_stride floats, 16 bytes (8 values) per thread per step; rows >= n_valid are zeros
// (they stand for positions outside the range and must not bring garbage into masked products).
__device__ inline void stage_rows(float* dst, int dst_stride, const floatX* src, size_t src_stride, int rows,
                                  int n_valid, int hs) {
    const int vecs = hs / 8;
    for (int idx = threadIdx.x; idx < rows * vecs; idx += blockDim.x) {
        const int r = idx / vecs, c = (idx % vecs) * 8;
        float4* d = reinterpret_cast<float4*>(dst + r * dst_stride + c);
        float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (r < n_valid) load_bf16x8(f, src + r * src_stride + c);
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

__global__ void __launch_bounds__(THREADS)
attention_forward_kernel(floatX* out, float* lse, const floatX* qkv, const int* doc_start, int T, int n_head,
                         int n_kv_head, int hs, float scale, bool alibi) {
    extern __shared__ float4 smem_f4[];
    float* k_s = reinterpret_cast<float*>(smem_f4);   // [CHUNK][hs + 4] keys of the chunk
    float* v_s = k_s + CHUNK * padded(hs);            // [CHUNK][hs]     values of the chunk
    float* q_s = v_s + CHUNK * hs;                    // [QTILE][hs]     queries of the tile
    __shared__ int kv_lo_s;

    const int b = blockIdx.z, h = blockIdx.y;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * QTILE;  // last (heaviest) tiles are scheduled first
    const int nq = min(QTILE, T - q0);
    const int row = (n_head + 2 * n_kv_head) * hs, kh = h / (n_head / n_kv_head);
    const floatX* base = qkv + (size_t)b * T * row;
    const int* ds = doc_start + (size_t)b * T;
    const float slope = alibi ? alibi_slope_f(h, n_head) : 0.f;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    stage_rows(q_s, hs, base + (size_t)q0 * row + h * hs, row, QTILE, nq, hs);
    if (threadIdx.x == 0) kv_lo_s = INT_MAX;
    __syncthreads();
    if (threadIdx.x < nq) atomicMin(&kv_lo_s, ds[q0 + threadIdx.x]);  // integer min: order-free
    __syncthreads();
    const int kv_lo = kv_lo_s, kv_hi = q0 + nq - 1;  // every key some query of the tile can see

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
            if (d < hs) o_row[d] = __float2bfloat16(o[r][k] * inv);
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
        load_bf16x8(x, dO + c);
        load_bf16x8(y, O + c);
#pragma unroll
        for (int k = 0; k < 8; k++) acc = fmaf(x[k], y[k], acc);
    }
    delta[((size_t)b * n_head + h) * T + t] = acc;
}

// ------------------------------------------------------------------------------------------------
// backward, stage 2: dQ. Block (b, h, 16 queries), the forward's loop over key chunks; lane j scores
// key j (s and dp = dO.v_j), then the lanes own head dims of dq += dS_j k_j. Writes dq (overwrite).

__global__ void __launch_bounds__(THREADS)
attention_dq_kernel(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse, const float* delta,
                    const int* doc_start, int T, int n_head, int n_kv_head, int hs, float scale, bool alibi) {
    extern __shared__ float4 smem_f4[];
    float* k_s = reinterpret_cast<float*>(smem_f4);   // [CHUNK][hs + 4]
    float* v_s = k_s + CHUNK * padded(hs);            // [CHUNK][hs + 4] (read one row per lane for dO.v)
    float* q_s = v_s + CHUNK * padded(hs);            // [QTILE][hs]
    float* do_s = q_s + QTILE * hs;                   // [QTILE][hs]
    __shared__ int kv_lo_s;

    const int b = blockIdx.z, h = blockIdx.y;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * QTILE;
    const int nq = min(QTILE, T - q0);
    const int row = (n_head + 2 * n_kv_head) * hs, kh = h / (n_head / n_kv_head);
    const floatX* base = qkv + (size_t)b * T * row;
    const int* ds = doc_start + (size_t)b * T;
    const float slope = alibi ? alibi_slope_f(h, n_head) : 0.f;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    stage_rows(q_s, hs, base + (size_t)q0 * row + h * hs, row, QTILE, nq, hs);
    stage_rows(do_s, hs, dout + ((size_t)b * T + q0) * n_head * hs + h * hs, (size_t)n_head * hs, QTILE, nq, hs);
    if (threadIdx.x == 0) kv_lo_s = INT_MAX;
    __syncthreads();
    if (threadIdx.x < nq) atomicMin(&kv_lo_s, ds[q0 + threadIdx.x]);
    __syncthreads();
    const int kv_lo = kv_lo_s, kv_hi = q0 + nq - 1;

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
            if (d < hs) dq_row[d] = __float2bfloat16(dq[r][k]);
        }
    }
}

// ------------------------------------------------------------------------------------------------
// backward, stage 3: dK and dV. Block (b, kv head, 16 keys); warp w owns key rows w, w+4, w+8, w+12.
// Loop: query heads of the group, then chunks of 32 queries from the first key of the tile to the
// last query that can see one of its keys; lane i scores query i of the chunk against the key row
// (s and dp = dO_i.v_j), then the lanes own head dims of dv += p_i dO_i and dk += dS_i q_i.

__global__ void __launch_bounds__(THREADS)
attention_dkdv_kernel(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse, const float* delta,
                      const int* doc_start, int T, int n_head, int n_kv_head, int hs, float scale, bool alibi) {
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
        const float slope = alibi ? alibi_slope_f(h, n_head) : 0.f;
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
                dk_row[d] = __float2bfloat16(dk[r][k]);
                dv_row[d] = __float2bfloat16(dv[r][k]);
            }
        }
    }
}

inline void check_args(const char* who, int B, int T, int n_head, int n_kv_head, int hs,
                       std::initializer_list<const void*> vec_ptrs) {
    LLMC_CHECK(B > 0 && T > 0, "%s: B = %d, T = %d must be positive", who, B, T);
    LLMC_CHECK(B <= 65535 && n_head <= 65535, "%s: B = %d and n_head = %d must be <= 65535 (grid dimensions)", who, B,
               n_head);
    LLMC_CHECK(n_head > 0 && n_kv_head > 0 && n_head % n_kv_head == 0,
               "%s: n_kv_head = %d must divide n_head = %d", who, n_kv_head, n_head);
    LLMC_CHECK(hs >= 8 && hs <= MAX_HS && hs % 8 == 0,
               "%s: head_size %d is not supported: the CUDA kernels need a multiple of 8 (16-byte bf16 vectors) "
               "in [8, %d]", who, hs, MAX_HS);
    for (const void* p : vec_ptrs)
        LLMC_CHECK((uintptr_t)p % 16 == 0, "%s: tensor at %p is not 16-byte aligned (the kernels use 16-byte loads)",
                   who, p);
}

template <typename Kernel>
inline void set_smem(Kernel kernel, size_t bytes) {
    // above 48 KB a kernel must opt in to dynamic shared memory (cheap host call, repeated per launch)
    if (bytes > 48 * 1024) cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
}

}  // namespace attention_detail

// out [B, T, n_head*hs] and lse [B, n_head, T] overwritten; qkv [B, T, (n_head + 2 n_kv_head) hs];
// doc_start [B*T] (device, row-relative indices).
inline void attention_forward(floatX* out, float* lse, const floatX* qkv, const int* doc_start, int B, int T,
                              int n_head, int n_kv_head, int hs, bool alibi) {
    using namespace attention_detail;
    check_args("attention_forward", B, T, n_head, n_kv_head, hs, {out, qkv});
    const size_t smem = forward_smem_bytes(hs);
    set_smem(attention_forward_kernel, smem);
    const dim3 grid((T + QTILE - 1) / QTILE, n_head, B);
    attention_forward_kernel<<<grid, THREADS, smem, llmc_stream()>>>(out, lse, qkv, doc_start, T, n_head, n_kv_head,
                                                                     hs, 1.0f / sqrtf((float)hs), alibi);
    cudaCheckLaunch();
}

// dqkv [B, T, (n_head + 2 n_kv_head) hs] overwritten; dout, out [B, T, n_head*hs]; lse [B, n_head, T]
// as saved by attention_forward. Scratch: attention_scratch_bytes(...).
inline void attention_backward(floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out, const float* lse,
                               const int* doc_start, int B, int T, int n_head, int n_kv_head, int hs, bool alibi) {
    using namespace attention_detail;
    check_args("attention_backward", B, T, n_head, n_kv_head, hs, {dqkv, dout, qkv, out});
    float* delta = cuda_scratch<float>((size_t)B * n_head * T, "attention_backward");
    const float scale = 1.0f / sqrtf((float)hs);

    const size_t n_rows = (size_t)B * T * n_head;
    attention_delta_kernel<<<(unsigned)((n_rows + 255) / 256), 256, 0, llmc_stream()>>>(delta, dout, out, B, T, n_head, hs);
    cudaCheckLaunch();

    const size_t dq_smem = dq_smem_bytes(hs);
    set_smem(attention_dq_kernel, dq_smem);
    const dim3 dq_grid((T + QTILE - 1) / QTILE, n_head, B);
    attention_dq_kernel<<<dq_grid, THREADS, dq_smem, llmc_stream()>>>(dqkv, dout, qkv, lse, delta, doc_start, T, n_head,
                                                                      n_kv_head, hs, scale, alibi);
    cudaCheckLaunch();

    const size_t kv_smem = dkdv_smem_bytes(hs);
    set_smem(attention_dkdv_kernel, kv_smem);
    const dim3 kv_grid((T + KTILE - 1) / KTILE, n_kv_head, B);
    attention_dkdv_kernel<<<kv_grid, THREADS, kv_smem, llmc_stream()>>>(dqkv, dout, qkv, lse, delta, doc_start, T,
                                                                        n_head, n_kv_head, hs, scale, alibi);
    cudaCheckLaunch();
}
