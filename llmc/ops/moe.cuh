// Mixture-of-experts FFN with expert-choice routing on the GPU: the twin of llmc/ops/cpu/moe.h (its top
// comment has the math). With n = B*T tokens, E experts and cap = cpu::moe_capacity(...) tokens per
// expert, one MoE layer is
//   scores [n, E] = softmax(x Wr^T) (fp32)  ->  moe_select: expert_tokens [E, cap], token_slots [n, E]
//   -> moe_gather xe [E, cap, C] -> the experts as strided-batched matmuls (matmul_forward_batched in
//   llmc/ops/matmul.cuh) + SwiGLU -> ye [E, cap, C] -> moe_combine_forward out [n, C]
// and the backward runs the same ops' twins in reverse. Every launcher has the name and argument order
// of its CPU twin; scores are float, tensors floatX, routing int, all device pointers.
//
// Who owns what (every output element is written by one thread, sums in a fixed order: deterministic)
//  moe_router_forward  a block owns 64..512 tokens and stages 32-channel slices of Wr (fp32,
//      transposed) and of x (bf16, loaded by all threads as 16-byte vectors where possible) in shared
//      memory; a LANE owns one expert (two for E > 32, four for E > 64) of a group of 8 tokens and runs
//      each dot product over C in channel order (fp32 FMA of exact bf16 products, as the CPU); the
//      softmax is then a shuffle reduction over the lanes of the group (E <= 32: 32 / E groups share
//      a warp). E <= 128.
//  moe_select, group = micro-batch: per expert the k-th largest score by radix select on the bits of
//      the fp32 scores (a monotone uint32 key; -0 counts as +0 as in the CPU's float compare): 4
//      passes of an 8-bit digit, high to low; a pass builds the digit histogram of the keys that match
//      the prefix chosen so far (shared-memory counts, then integer atomics into a global histogram,
//      whose result does not depend on their order) and one warp per expert picks the digit holding
//      the k-th key. This yields the threshold key K and krem = how many keys equal to K to take;
//      taken(i) = key > K, or key == K and fewer than krem equal keys have a lower index (the CPU's
//      tie rule: higher score, then lower index). Then a deterministic compaction: per chunk of 256
//      tokens count (> K) and (== K) [count kernel], per expert exclusive scans over the chunks
//      [scan kernel, cub::BlockScan], and each chunk writes its tokens in index order [write kernel]:
//      expert_tokens ascending, token_slots[i, e] = slot or -1 (every entry written once).
//  moe_select, group = position: one thread per (b, t, e) ranks its score among the B scores of
//      position t (O(B) compares; B is a micro-batch size), writes taken 0/1 into token_slots, and the
//      same count / scan / write kernels turn the flags into slots.
//  moe_gather          a warp copies one row of xe (16-byte vectors).
//  moe_gather_backward, moe_combine_forward   a warp owns one token row: a ballot over its E slots
//      lists the experts that took it, added in expert order (fp32, one bf16 rounding).
//  moe_combine_backward   a warp owns one token: for each expert that took it (expert order) it writes
//      that expert's dye row (gate * dout) and reduces dout . ye (lanes, then a fixed shuffle tree)
//      into dscores; dscores of the pairs not taken are set to 0.
//  moe_router_backward    (a) a warp owns 4 tokens: dlogit = s (ds - s.ds) (kept in scratch for (b)
//      and in shared memory), then dx[i, c] += sum_e dlogit[i, e] Wr[e, c], lanes over channels, in
//      expert order. (b) drouter_w += dlogit^T x in two stages with a fixed partition: stage 1 blocks
//      own 128 channels x all experts x a 2048-token chunk (32-token tiles of dlogit and x in shared
//      memory; a thread owns E/8 experts x 4 channels and sums its chunk in token order); stage 2: a
//      thread per (e, c) adds the chunk partials in chunk order and adds the total to the fp32
//      drouter_w once.
//
// Scratch (cuda_scratch; moe_scratch_bytes(B, T, C, E) in llmc/ops/op_scratch.h is the largest; n = B*T):
//   moe_select            (1024 + 2) * E + 2 * E * ceil(n / 256) ints
//   moe_router_backward   n * E + ceil(n / 2048) * E * C floats
//   the others            none
// (the batched expert matmuls' dbias needs matmul_batched_scratch_bytes(E, cap, OC), llmc/ops/op_scratch.h)
#pragma once
#include <algorithm>
#include <cstdint>
#include <cub/block/block_scan.cuh>
#include "llmc/ops/cuda_common.cuh"
#include "llmc/ops/op_scratch.h"  // RW_TOKENS, SEL_RUN, SEL_CHUNK and the scratch sizes
#include "llmc/ops/cpu/moe.h"

namespace moe_detail {

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
constexpr unsigned FULL_MASK = 0xffffffffu;

constexpr int ROUTER_KC = 32;         // channels of Wr and x in shared memory at a time (forward)
constexpr int ROUTER_RT = 8;          // tokens of one lane group (forward)
constexpr int ROUTER_MAX_EXPERTS = 128;
constexpr int RB_RT = 4;              // tokens of one warp (backward, dx)
constexpr int RW_SUB = 32;            // tokens staged in shared memory at a time
constexpr int RW_COLS = 128;          // channels of one drouter_w stage-1 block (32 lanes x 4)
constexpr int HIST_TOKENS = 1024;     // tokens of one histogram block

using namespace floatx8;  // aligned16, load_floatX / store_floatX, ... (llmc/ops/cuda_common.cuh)

__device__ inline float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(FULL_MASK, v, off);
    return v;
}

// A uint32 key that orders like the float: larger score <=> larger key (non-NaN). Positive floats
// order like their bits with the sign bit set; negative ones like their complement. -0 becomes +0,
// because the CPU's compare calls them equal (a tie, decided by the index).
__device__ inline uint32_t score_key(float s) {
    uint32_t u = __float_as_uint(s);
    if (u == 0x80000000u) u = 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// ------------------------------------------------------------------------------------------------
// router forward: scores = softmax(x Wr^T)

template <int EMAX, int VEC>
__global__ void __launch_bounds__(THREADS) moe_router_forward_kernel(float* __restrict__ scores,
                                                                    const floatX* __restrict__ x,
                                                                    const floatX* __restrict__ router_w, int n, int C,
                                                                    int E) {
    constexpr int LPG = EMAX < 32 ? EMAX : 32;  // lanes of one token group: one per expert
    constexpr int G = 32 / LPG;                 // token groups per warp
    constexpr int EPL = EMAX / LPG;             // experts per lane (lane el owns el, el + 32, ...)
    constexpr int TOKENS = WARPS * G * ROUTER_RT;
    constexpr int XS_LD = ROUTER_KC + 8;  // bf16 row pitch of the x tile (80 bytes: 16-byte rows, see below)
    // Wr^T slice [k][e] in fp32; the +1 makes the transposing stores (consecutive k) conflict-free
    __shared__ float wt[ROUTER_KC][EMAX + 1];
    // x tile [token][k], zero-padded past n and C
    __shared__ __align__(16) floatX xs[TOKENS][XS_LD];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int grp = lane / LPG, el = lane % LPG;
    // token r of this lane group is tile row r * WARPS * G + warp * G + grp: the G groups of a warp read
    // consecutive rows, 80 bytes = 20 banks apart, so their 16-byte reads never share a bank
    const int row0 = warp * G + grp;
    const int tok0 = blockIdx.x * TOKENS;

    float acc[ROUTER_RT][EPL];
#pragma unroll
    for (int r = 0; r < ROUTER_RT; r++)
#pragma unroll
        for (int p = 0; p < EPL; p++) acc[r][p] = 0.0f;

    for (int k0 = 0; k0 < C; k0 += ROUTER_KC) {
        const int kc = min(ROUTER_KC, C - k0);
        __syncthreads();  // every warp is done with the previous tiles
        for (int idx = threadIdx.x; idx < ROUTER_KC * EMAX; idx += THREADS) {
            const int e = idx / ROUTER_KC, k = idx % ROUTER_KC;  // consecutive threads: consecutive k of a row
            wt[k][e] = (e < E && k < kc) ? floatX_to_float(router_w[(size_t)e * C + k0 + k]) : 0.0f;
        }
        // the x tile: every thread loads distinct, coalesced pieces (many bytes in flight per SM)
        if constexpr (VEC == 8) {  // C % 8 == 0: a vector is wholly inside or wholly outside C
            for (int idx = threadIdx.x; idx < TOKENS * (ROUTER_KC / 8); idx += THREADS) {
                const int t = idx / (ROUTER_KC / 8), k = (idx % (ROUTER_KC / 8)) * 8, i = tok0 + t;
                uint4 v = make_uint4(0u, 0u, 0u, 0u);
                if (i < n && k < kc) v = *reinterpret_cast<const uint4*>(x + (size_t)i * C + k0 + k);
                *reinterpret_cast<uint4*>(&xs[t][k]) = v;
            }
        } else {
            for (int idx = threadIdx.x; idx < TOKENS * ROUTER_KC; idx += THREADS) {
                const int t = idx / ROUTER_KC, k = idx % ROUTER_KC, i = tok0 + t;
                xs[t][k] = (i < n && k < kc) ? x[(size_t)i * C + k0 + k] : float_to_floatX(0.0f);
            }
        }
        __syncthreads();
        // 8 channels at a time (the padding is zeros): Wr values in registers, reused by RT tokens
        for (int k = 0; k < kc; k += 8) {
            float w[8][EPL];
#pragma unroll
            for (int v = 0; v < 8; v++)
#pragma unroll
                for (int p = 0; p < EPL; p++) w[v][p] = wt[k + v][el + p * LPG];
#pragma unroll
            for (int r = 0; r < ROUTER_RT; r++) {
                float xv[8];
                load_floatX<8>(xv, &xs[r * WARPS * G + row0][k]);
#pragma unroll
                for (int v = 0; v < 8; v++)
#pragma unroll
                    for (int p = 0; p < EPL; p++) acc[r][p] = fmaf(xv[v], w[v][p], acc[r][p]);
            }
        }
    }

    // softmax over the experts of each token: a max and a sum over the LPG lanes of the group (the
    // xor offsets stay inside the group); every lane takes part in the shuffles
#pragma unroll
    for (int r = 0; r < ROUTER_RT; r++) {
        float m = -INFINITY;
#pragma unroll
        for (int p = 0; p < EPL; p++)
            if (el + p * LPG < E) m = fmaxf(m, acc[r][p]);
#pragma unroll
        for (int off = LPG / 2; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, off));
        float ex[EPL], sum = 0.0f;
#pragma unroll
        for (int p = 0; p < EPL; p++) {
            ex[p] = el + p * LPG < E ? expf(acc[r][p] - m) : 0.0f;
            sum += ex[p];
        }
#pragma unroll
        for (int off = LPG / 2; off > 0; off /= 2) sum += __shfl_xor_sync(FULL_MASK, sum, off);
        const int i = tok0 + r * WARPS * G + row0;
        if (i < n) {
#pragma unroll
            for (int p = 0; p < EPL; p++)
                if (el + p * LPG < E) scores[(size_t)i * E + el + p * LPG] = ex[p] / sum;
        }
    }
}

// ------------------------------------------------------------------------------------------------
// selection, group = micro-batch: radix select of the k-th largest key per expert

// grid (ceil(n / HIST_TOKENS), ceil(E / 8)): a block counts the digit `pass` of the keys of 8 experts
// over HIST_TOKENS tokens that match the expert's prefix (the digits chosen by the earlier passes).
// Thread t reads expert t % 8 of tokens t / 8, t / 8 + 32, ...: a warp reads 4 whole 32-byte runs.
__global__ void __launch_bounds__(THREADS) moe_select_histogram_kernel(int* __restrict__ hist,
                                                                      const float* __restrict__ scores,
                                                                      const uint32_t* __restrict__ prefix, int n,
                                                                      int E, int pass) {
    __shared__ int sh[8][257];  // padded: the 8 experts' bins of one digit fall in different banks
    __shared__ uint32_t s_prefix[8];
    const int e0 = blockIdx.y * 8;
    for (int k = threadIdx.x; k < 8 * 257; k += THREADS) (&sh[0][0])[k] = 0;
    if (threadIdx.x < 8) s_prefix[threadIdx.x] = (pass > 0 && e0 + (int)threadIdx.x < E) ? prefix[e0 + threadIdx.x] : 0u;
    __syncthreads();

    const int el = threadIdx.x % 8, e = e0 + el;
    const int tok0 = blockIdx.x * HIST_TOKENS, tok_end = min(n, tok0 + HIST_TOKENS);
    const int digit_shift = 24 - 8 * pass;
    if (e < E) {
        const uint32_t pre = s_prefix[el];
        for (int i = tok0 + (int)threadIdx.x / 8; i < tok_end; i += THREADS / 8) {
            const uint32_t key = score_key(scores[(size_t)i * E + e]);
            // pass 0 takes every key; later passes the keys whose higher digits equal the prefix
            if (pass == 0 || (key >> (digit_shift + 8)) == (pre >> (digit_shift + 8)))
                atomicAdd(&sh[el][(key >> digit_shift) & 255u], 1);
        }
    }
    __syncthreads();
    for (int k = threadIdx.x; k < 8 * 256; k += THREADS) {
        const int kel = k / 256, d = k % 256;
        const int count = sh[kel][d];
        if (count != 0 && e0 + kel < E) atomicAdd(&hist[((size_t)pass * E + e0 + kel) * 256 + d], count);
    }
}

// one warp per expert: the digit of this pass holding the wanted key. Lane l looks at digits
// 255 - 8l ... 248 - 8l (high to low); a shuffle scan gives the count of keys above its digits.
// State: prefix[e] (the digits so far, in place) and krem[e] (how many of the keys matching the
// prefix are still to be taken: at the start cap, at the end the number of keys == K to take).
__global__ void moe_select_digit_kernel(uint32_t* prefix, int* krem, const int* __restrict__ hist, int E, int cap,
                                        int pass) {
    const int e = blockIdx.x, lane = threadIdx.x;
    const uint32_t pre = pass > 0 ? prefix[e] : 0u;
    const int want = pass > 0 ? krem[e] : cap;  // 1 <= want <= number of keys matching the prefix
    const int* h = hist + ((size_t)pass * E + e) * 256;
    int cnt[8], local = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        cnt[j] = h[255 - 8 * lane - j];
        local += cnt[j];
    }
    int incl = local;
#pragma unroll
    for (int off = 1; off < 32; off *= 2) {
        const int v = __shfl_up_sync(FULL_MASK, incl, off);
        if (lane >= off) incl += v;
    }
    int above = incl - local;  // keys (matching the prefix) with a larger digit than this lane's first
    // exactly one (lane, j) has above < want <= above + cnt[j]: the counts only grow
#pragma unroll
    for (int j = 0; j < 8; j++) {
        if (above < want && above + cnt[j] >= want) {
            prefix[e] = pre | ((uint32_t)(255 - 8 * lane - j) << (24 - 8 * pass));
            krem[e] = want - above;
        }
        above += cnt[j];
    }
}

// ------------------------------------------------------------------------------------------------
// selection, group = position: taken flags (0/1) into token_slots

// grid (T, ceil(E / 8)); thread (e = tid % 8, b = tid / 8 + 32 j) ranks its score among the B scores
// of position t (higher first, then lower b, i.e. lower token index) and takes it if rank < kp.
// The 8 experts of one token are one 32-byte read, shared by the 4 rows of a warp.
__global__ void __launch_bounds__(THREADS) moe_select_position_kernel(int* token_slots, const float* __restrict__ scores,
                                                                     int B, int T, int E, int kp) {
    const int t = blockIdx.x, e = blockIdx.y * 8 + threadIdx.x % 8;
    if (e >= E) return;  // (no block-level synchronization below)
    for (int b = threadIdx.x / 8; b < B; b += THREADS / 8) {
        const float s = scores[((size_t)b * T + t) * E + e];
        int rank = 0;
        for (int b2 = 0; b2 < B; b2++) {
            const float s2 = scores[((size_t)b2 * T + t) * E + e];
            rank += (s2 > s) || (s2 == s && b2 < b);
        }
        token_slots[((size_t)b * T + t) * E + e] = rank < kp ? 1 : 0;
    }
}

// ------------------------------------------------------------------------------------------------
// compaction (both groupings): block = (chunk of SEL_CHUNK tokens, 8 experts), thread (el = tid % 8,
// run g = tid / 8) owns tokens chunk * SEL_CHUNK + g * SEL_RUN + j, j < SEL_RUN, of expert e0 + el.
// Index order inside a chunk is (g, j). Classification of a (token, expert) pair:
//   batch:     gt = key > K[e], eq = key == K[e]  (eq pairs are taken while their rank < krem[e])
//   position:  gt = the flag in token_slots, eq never

template <bool POSITION>
__device__ inline void moe_select_classify(unsigned& gt_bits, unsigned& eq_bits, const float* scores,
                                           const int* flags, uint32_t threshold, int e, int E, int t0, int n) {
    gt_bits = eq_bits = 0u;
    if (e >= E) return;
#pragma unroll
    for (int j = 0; j < SEL_RUN; j++) {
        const int i = t0 + j;
        if (i < n) {
            const size_t idx = (size_t)i * E + e;
            if constexpr (POSITION) {
                gt_bits |= (flags[idx] != 0 ? 1u : 0u) << j;
            } else {
                const uint32_t key = score_key(scores[idx]);
                gt_bits |= (key > threshold ? 1u : 0u) << j;
                eq_bits |= (key == threshold ? 1u : 0u) << j;
            }
        }
    }
}

// counts[e][chunk] of gt and eq pairs
template <bool POSITION>
__global__ void __launch_bounds__(THREADS) moe_select_count_kernel(int* __restrict__ gt_count, int* __restrict__ eq_count,
                                                                  const float* scores, const int* flags,
                                                                  const uint32_t* threshold, int n, int E,
                                                                  int nchunks) {
    const int el = threadIdx.x % 8, g = threadIdx.x / 8;
    const int e = blockIdx.y * 8 + el, chunk = blockIdx.x;
    unsigned gt, eq;
    moe_select_classify<POSITION>(gt, eq, scores, flags, (!POSITION && e < E) ? threshold[e] : 0u, e, E,
                                  chunk * SEL_CHUNK + g * SEL_RUN, n);
    __shared__ int s_gt[32][8], s_eq[32][8];
    s_gt[g][el] = __popc(gt);
    s_eq[g][el] = __popc(eq);
    __syncthreads();
    if (g == 0 && e < E) {
        int a = 0, b = 0;
        for (int k = 0; k < 32; k++) {
            a += s_gt[k][el];
            b += s_eq[k][el];
        }
        gt_count[(size_t)e * nchunks + chunk] = a;
        eq_count[(size_t)e * nchunks + chunk] = b;
    }
}

// one block per expert, in place: eq_count[c] -> eq pairs in chunks before c; gt_count[c] -> taken
// pairs in chunks before c (the chunk's first slot), where chunk c takes gt + min(eq, remaining krem)
__global__ void __launch_bounds__(THREADS) moe_select_scan_kernel(int* gt_count, int* eq_count, const int* krem,
                                                                 int nchunks) {
    using Scan = cub::BlockScan<int, THREADS>;
    __shared__ typename Scan::TempStorage tmp;
    const int e = blockIdx.x;
    const int want = krem ? krem[e] : 0;
    int* gt = gt_count + (size_t)e * nchunks;
    int* eq = eq_count + (size_t)e * nchunks;
    int eq_carry = 0, take_carry = 0;
    for (int base = 0; base < nchunks; base += THREADS) {
        const int c = base + threadIdx.x;
        const int g = c < nchunks ? gt[c] : 0, q = c < nchunks ? eq[c] : 0;
        int eq_before, eq_total;
        Scan(tmp).ExclusiveSum(q, eq_before, eq_total);
        __syncthreads();  // tmp is reused
        eq_before += eq_carry;
        eq_carry += eq_total;
        const int take = g + min(max(want - eq_before, 0), q);
        int slot0, take_total;
        Scan(tmp).ExclusiveSum(take, slot0, take_total);
        __syncthreads();
        slot0 += take_carry;
        take_carry += take_total;
        if (c < nchunks) {
            gt[c] = slot0;
            eq[c] = eq_before;
        }
    }
}

// writes token_slots for every (token, expert) of the chunk and expert_tokens for the taken ones.
// (position grouping: the flags read here live in token_slots; each thread reads its own entries
// before it overwrites them and no other thread touches them)
template <bool POSITION>
__global__ void __launch_bounds__(THREADS) moe_select_write_kernel(int* expert_tokens, int* token_slots,
                                                                  const float* scores, const uint32_t* threshold,
                                                                  const int* krem, const int* __restrict__ slot0,
                                                                  const int* __restrict__ eq_before, int n, int E,
                                                                  int cap, int nchunks) {
    const int el = threadIdx.x % 8, g = threadIdx.x / 8;
    const int e = blockIdx.y * 8 + el, chunk = blockIdx.x;
    const int t0 = chunk * SEL_CHUNK + g * SEL_RUN;
    unsigned gt, eq;
    moe_select_classify<POSITION>(gt, eq, scores, token_slots, (!POSITION && e < E) ? threshold[e] : 0u, e, E, t0, n);

    __shared__ int s_eq[32][8], s_take[32][8];
    s_eq[g][el] = __popc(eq);
    __syncthreads();
    unsigned take = gt;
    if (!POSITION && e < E) {
        int rank = eq_before[(size_t)e * nchunks + chunk];  // equal keys with a lower index
        for (int k = 0; k < g; k++) rank += s_eq[k][el];
        const int want = krem[e];
#pragma unroll
        for (int j = 0; j < SEL_RUN; j++)
            if ((eq >> j) & 1u) {
                if (rank < want) take |= 1u << j;
                rank++;
            }
    }
    s_take[g][el] = __popc(take);
    __syncthreads();
    if (e >= E) return;
    int slot = slot0[(size_t)e * nchunks + chunk];
    for (int k = 0; k < g; k++) slot += s_take[k][el];
#pragma unroll
    for (int j = 0; j < SEL_RUN; j++) {
        const int i = t0 + j;
        if (i < n) {
            if ((take >> j) & 1u) {
                if (slot < cap) expert_tokens[(size_t)e * cap + slot] = i;  // (slot < cap by construction)
                token_slots[(size_t)i * E + e] = slot++;
            } else {
                token_slots[(size_t)i * E + e] = -1;
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// gather / combine

// a warp per row r of xe: xe[r] = x[expert_tokens[r]]
template <int VEC>
__global__ void __launch_bounds__(THREADS) moe_gather_kernel(floatX* __restrict__ xe, const floatX* __restrict__ x,
                                                            const int* __restrict__ expert_tokens, int rows, int C) {
    const int lane = threadIdx.x % 32;
    const int r = blockIdx.x * WARPS + threadIdx.x / 32;
    if (r >= rows) return;
    const floatX* src = x + (size_t)expert_tokens[r] * C;
    floatX* dst = xe + (size_t)r * C;
#pragma unroll 4
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        if constexpr (VEC == 8) *reinterpret_cast<uint4*>(dst + c) = *reinterpret_cast<const uint4*>(src + c);
        else dst[c] = src[c];
    }
}

// The experts that took token i, in expert order, warp-uniformly: a ballot over 32 of its E slots
// (slots = token_slots + i * E) at a time lists the taken ones, and every lane calls f(e, slot, gate)
// for each, gate = scores_i[e] (scores_i = scores + i * E) when GATED, else 0.
template <bool GATED, typename F>
__device__ inline void for_each_taken_expert(const int* slots, const float* scores_i, int E, int lane, F&& f) {
    for (int q = 0; q < E; q += 32) {
        const int j = q + lane < E ? slots[q + lane] : -1;
        float s = 0.0f;
        if constexpr (GATED) s = j >= 0 ? scores_i[q + lane] : 0.0f;
        unsigned m = __ballot_sync(FULL_MASK, j >= 0);
        while (m) {
            const int l = __ffs(m) - 1;
            m &= m - 1;
            const int slot = __shfl_sync(FULL_MASK, j, l);
            float gate = 0.0f;
            if constexpr (GATED) gate = __shfl_sync(FULL_MASK, s, l);
            f(q + l, slot, gate);
        }
    }
}

// a warp per token i: dx[i] += dxe[e, slot] over the experts e that took i, in expert order.
// The channel loop has the same trip count on every lane (the ballots need the whole warp).
template <int VEC>
__global__ void __launch_bounds__(THREADS) moe_gather_backward_kernel(floatX* dx, const floatX* __restrict__ dxe,
                                                                     const int* __restrict__ token_slots, int n,
                                                                     int E, int cap, int C) {
    const int lane = threadIdx.x % 32;
    const int i = blockIdx.x * WARPS + threadIdx.x / 32;
    if (i >= n) return;  // whole warps
    const int* slots = token_slots + (size_t)i * E;
    for (int c0 = 0; c0 < C; c0 += 32 * VEC) {
        const int c = c0 + lane * VEC;
        const bool active = c < C;
        float acc[VEC];
        if (active) load_floatX<VEC>(acc, dx + (size_t)i * C + c);
        for_each_taken_expert<false>(slots, nullptr, E, lane, [&](int e, int slot, float) {
            if (active) {
                float d[VEC];
                load_floatX<VEC>(d, dxe + ((size_t)e * cap + slot) * C + c);
#pragma unroll
                for (int v = 0; v < VEC; v++) acc[v] += d[v];
            }
        });
        if (active) store_floatX<VEC>(dx + (size_t)i * C + c, acc);
    }
}

// a warp per token i: out[i] = sum over the experts e that took i (expert order) of scores[i, e] * ye[e, slot]
template <int VEC>
__global__ void __launch_bounds__(THREADS) moe_combine_forward_kernel(floatX* __restrict__ out,
                                                                     const floatX* __restrict__ ye,
                                                                     const float* __restrict__ scores,
                                                                     const int* __restrict__ token_slots, int n,
                                                                     int E, int cap, int C) {
    const int lane = threadIdx.x % 32;
    const int i = blockIdx.x * WARPS + threadIdx.x / 32;
    if (i >= n) return;
    const int* slots = token_slots + (size_t)i * E;
    for (int c0 = 0; c0 < C; c0 += 32 * VEC) {
        const int c = c0 + lane * VEC;
        const bool active = c < C;
        float acc[VEC];
#pragma unroll
        for (int v = 0; v < VEC; v++) acc[v] = 0.0f;
        for_each_taken_expert<true>(slots, scores + (size_t)i * E, E, lane, [&](int e, int slot, float gate) {
            if (active) {
                float y[VEC];
                load_floatX<VEC>(y, ye + ((size_t)e * cap + slot) * C + c);
#pragma unroll
                for (int v = 0; v < VEC; v++) acc[v] = fmaf(gate, y[v], acc[v]);
            }
        });
        if (active) store_floatX<VEC>(out + (size_t)i * C + c, acc);
    }
}

// a warp per token i: for each expert e that took it (expert order), dye[e, slot] = gate * dout[i] and
// dscores[i, e] = dout[i] . ye[e, slot]; dscores[i, e] = 0 where e did not take i
template <int VEC>
__global__ void __launch_bounds__(THREADS) moe_combine_backward_kernel(floatX* __restrict__ dye,
                                                                      float* __restrict__ dscores,
                                                                      const floatX* __restrict__ dout,
                                                                      const floatX* __restrict__ ye,
                                                                      const float* __restrict__ scores,
                                                                      const int* __restrict__ token_slots, int n,
                                                                      int E, int cap, int C) {
    const int lane = threadIdx.x % 32;
    const int i = blockIdx.x * WARPS + threadIdx.x / 32;
    if (i >= n) return;
    const int* slots = token_slots + (size_t)i * E;
    const floatX* d_row = dout + (size_t)i * C;
    for (int e = lane; e < E; e += 32)  // the pairs not taken
        if (slots[e] < 0) dscores[(size_t)i * E + e] = 0.0f;
    for_each_taken_expert<true>(slots, scores + (size_t)i * E, E, lane, [&](int e, int slot, float gate) {
        const size_t row = ((size_t)e * cap + slot) * C;
        float dot = 0.0f;
        for (int c = lane * VEC; c < C; c += 32 * VEC) {
            float d[VEC], y[VEC], g[VEC];
            load_floatX<VEC>(d, d_row + c);
            load_floatX<VEC>(y, ye + row + c);
#pragma unroll
            for (int v = 0; v < VEC; v++) {
                dot = fmaf(d[v], y[v], dot);
                g[v] = gate * d[v];
            }
            store_floatX<VEC>(dye + row + c, g);
        }
        dot = warp_sum(dot);  // every lane has the same total
        if (lane == 0) dscores[(size_t)i * E + e] = dot;
    });
}

// ------------------------------------------------------------------------------------------------
// router backward

// a warp per RB_RT tokens: dlogit = s (ds - s . ds) -> scratch and shared memory [RB_RT][E] of this
// warp; then dx[i, c] += sum_e dlogit[i, e] Wr[e, c] (lanes over channels, experts in order, fp32)
template <int VEC>
__global__ void __launch_bounds__(THREADS) moe_router_backward_dx_kernel(floatX* dx, float* __restrict__ dlogit,
                                                                        const float* __restrict__ dscores,
                                                                        const float* __restrict__ scores,
                                                                        const floatX* __restrict__ router_w, int n,
                                                                        int C, int E) {
    extern __shared__ float dl_smem[];  // [WARPS][RB_RT][E]
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int tok0 = (blockIdx.x * WARPS + warp) * RB_RT;
    if (tok0 >= n) return;  // whole warps; no block-level synchronization below
    float* dl = dl_smem + (size_t)warp * RB_RT * E;
    for (int r = 0; r < RB_RT; r++) {
        const int i = tok0 + r;
        if (i < n) {  // warp-uniform
            float dot = 0.0f;
            for (int e = lane; e < E; e += 32) dot += scores[(size_t)i * E + e] * dscores[(size_t)i * E + e];
            dot = warp_sum(dot);
            for (int e = lane; e < E; e += 32) {
                const float d = scores[(size_t)i * E + e] * (dscores[(size_t)i * E + e] - dot);
                dlogit[(size_t)i * E + e] = d;
                dl[r * E + e] = d;
            }
        } else {
            for (int e = lane; e < E; e += 32) dl[r * E + e] = 0.0f;
        }
    }
    __syncwarp();
    for (int c = lane * VEC; dx && c < C; c += 32 * VEC) {  // dx null: dlogit only (the split backward)
        float acc[RB_RT][VEC];
#pragma unroll
        for (int r = 0; r < RB_RT; r++) {
            if (tok0 + r < n) {
                load_floatX<VEC>(acc[r], dx + (size_t)(tok0 + r) * C + c);
            } else {
#pragma unroll
                for (int v = 0; v < VEC; v++) acc[r][v] = 0.0f;
            }
        }
        for (int e = 0; e < E; e++) {
            float w[VEC];
            load_floatX<VEC>(w, router_w + (size_t)e * C + c);
#pragma unroll
            for (int r = 0; r < RB_RT; r++) {
                const float d = dl[r * E + e];
#pragma unroll
                for (int v = 0; v < VEC; v++) acc[r][v] = fmaf(d, w[v], acc[r][v]);
            }
        }
#pragma unroll
        for (int r = 0; r < RB_RT; r++)
            if (tok0 + r < n) store_floatX<VEC>(dx + (size_t)(tok0 + r) * C + c, acc[r]);
    }
}

// drouter_w stage 1: grid (ceil(C / RW_COLS), ceil(n / RW_TOKENS)). Thread (te = tid / 32, tc = tid % 32)
// owns experts te * RE .. te * RE + RE - 1 (EMAX = 8 RE) and channels col0 + 4 tc .. + 3, summing its
// chunk's tokens in order: partial[chunk][e][c]. Zero padding (tokens past the chunk, experts >= E,
// channels >= C) adds exact zeros.
template <int RE, int VEC>
__global__ void __launch_bounds__(THREADS) moe_router_dw_partial_kernel(float* __restrict__ partial,
                                                                       const float* __restrict__ dlogit,
                                                                       const floatX* __restrict__ x, int n, int C,
                                                                       int E) {
    constexpr int EMAX = 8 * RE;
    __shared__ __align__(16) float dls[RW_SUB][EMAX];
    __shared__ __align__(16) float xs[RW_SUB][RW_COLS];
    const int tc = threadIdx.x % 32, te = threadIdx.x / 32;
    const int col0 = blockIdx.x * RW_COLS, chunk = blockIdx.y;
    const int tok_begin = chunk * RW_TOKENS, tok_end = min(n, tok_begin + RW_TOKENS);

    float acc[RE][4];
#pragma unroll
    for (int r = 0; r < RE; r++)
#pragma unroll
        for (int q = 0; q < 4; q++) acc[r][q] = 0.0f;

    for (int s0 = tok_begin; s0 < tok_end; s0 += RW_SUB) {
        __syncthreads();  // the previous tile is consumed
        for (int idx = threadIdx.x; idx < RW_SUB * EMAX; idx += THREADS) {
            const int t = idx / EMAX, e = idx % EMAX, i = s0 + t;
            dls[t][e] = (i < tok_end && e < E) ? dlogit[(size_t)i * E + e] : 0.0f;
        }
        if constexpr (VEC == 8) {
            for (int idx = threadIdx.x; idx < RW_SUB * RW_COLS / 8; idx += THREADS) {
                const int t = idx / (RW_COLS / 8), cv = (idx % (RW_COLS / 8)) * 8;
                const int i = s0 + t, c = col0 + cv;
                float f[8];
                if (i < tok_end && c < C) {  // C % 8 == 0: the whole vector is inside
                    load_floatX<8>(f, x + (size_t)i * C + c);
                } else {
#pragma unroll
                    for (int v = 0; v < 8; v++) f[v] = 0.0f;
                }
                *reinterpret_cast<float4*>(&xs[t][cv]) = make_float4(f[0], f[1], f[2], f[3]);
                *reinterpret_cast<float4*>(&xs[t][cv + 4]) = make_float4(f[4], f[5], f[6], f[7]);
            }
        } else {
            for (int idx = threadIdx.x; idx < RW_SUB * RW_COLS; idx += THREADS) {
                const int t = idx / RW_COLS, cc = idx % RW_COLS;
                const int i = s0 + t, c = col0 + cc;
                xs[t][cc] = (i < tok_end && c < C) ? floatX_to_float(x[(size_t)i * C + c]) : 0.0f;
            }
        }
        __syncthreads();
#pragma unroll 4
        for (int t = 0; t < RW_SUB; t++) {
            const float4 xv = *reinterpret_cast<const float4*>(&xs[t][tc * 4]);
#pragma unroll
            for (int r = 0; r < RE; r++) {
                const float d = dls[t][te * RE + r];  // the same for the whole warp: a broadcast
                acc[r][0] = fmaf(d, xv.x, acc[r][0]);
                acc[r][1] = fmaf(d, xv.y, acc[r][1]);
                acc[r][2] = fmaf(d, xv.z, acc[r][2]);
                acc[r][3] = fmaf(d, xv.w, acc[r][3]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RE; r++) {
        const int e = te * RE + r;
        if (e >= E) continue;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int c = col0 + tc * 4 + q;
            if (c < C) partial[((size_t)chunk * E + e) * C + c] = acc[r][q];
        }
    }
}

// drouter_w stage 2: a thread per (e, c) sums the chunk partials in chunk order, then one fp32 add
__global__ void __launch_bounds__(THREADS) moe_router_dw_finish_kernel(float* __restrict__ drouter_w,
                                                                      const float* __restrict__ partial, int nchunks,
                                                                      int E, int C) {
    const size_t idx = (size_t)blockIdx.x * THREADS + threadIdx.x, total = (size_t)E * C;
    if (idx >= total) return;
    float s = 0.0f;
    for (int k = 0; k < nchunks; k++) s += partial[(size_t)k * total + idx];
    drouter_w[idx] = __fadd_rn(drouter_w[idx], s);
}

}  // namespace moe_detail

// scores [n, E] (fp32, overwritten) = softmax over experts of x [n, C] . router_w [E, C]^T
inline void moe_router_forward(float* scores, const floatX* x, const floatX* router_w, int n, int C, int E) {
    using namespace moe_detail;
    LLMC_CHECK(n > 0 && C > 0 && E > 0 && E <= ROUTER_MAX_EXPERTS,
               "moe_router_forward: need n, C > 0 and 1 <= E <= %d (n=%d, C=%d, E=%d)", ROUTER_MAX_EXPERTS, n, C, E);
    const bool vec = C % 8 == 0 && aligned16(x);
    cudaStream_t st = llmc_stream();
    with_pow2<4, ROUTER_MAX_EXPERTS>(E, [&](auto emax) {  // the kernel for E <= EM experts
        constexpr int EM = decltype(emax)::value;
        // tokens per block: WARPS * (32 / lanes per group) * ROUTER_RT
        const unsigned grid = (unsigned)ceil_div(n, WARPS * (32 / std::min(EM, 32)) * ROUTER_RT);
        if (vec) moe_router_forward_kernel<EM, 8><<<grid, THREADS, 0, st>>>(scores, x, router_w, n, C, E);
        else moe_router_forward_kernel<EM, 1><<<grid, THREADS, 0, st>>>(scores, x, router_w, n, C, E);
    });
    cudaCheckLaunch();
}

// expert-choice selection over [B, T] tokens: expert_tokens [E, cap] (ascending token index) and
// token_slots [n, E] (slot or -1), both overwritten; identical to cpu::moe_select, ties included
inline void moe_select(int* expert_tokens, int* token_slots, const float* scores, int B, int T, int E,
                       float capacity_factor, bool group_by_position) {
    using namespace moe_detail;
    LLMC_CHECK(B > 0 && T > 0 && E > 0 && (size_t)B * T <= 0x7fffffff, "moe_select: bad shape (B=%d, T=%d, E=%d)", B,
               T, E);
    const int n = B * T;
    const int cap = cpu::moe_capacity(B, T, E, capacity_factor, group_by_position);
    cudaStream_t st = llmc_stream();
    if (cap <= 0) {  // no expert takes anything (capacity_factor 0)
        cudaCheck(cudaMemsetAsync(token_slots, 0xFF, (size_t)n * E * sizeof(int), st));  // all -1
        return;
    }
    const int nchunks = ceil_div(n, SEL_CHUNK);
    LLMC_CHECK(E <= 8 * 65535, "moe_select: E=%d exceeds the grid", E);
    char* base = (char*)cuda_scratch<char>(select_scratch_bytes(n, E), "moe_select");
    int* hist = (int*)base;
    base += align_up((size_t)4 * E * 256 * sizeof(int));
    uint32_t* prefix = (uint32_t*)base;
    base += align_up((size_t)E * sizeof(uint32_t));
    int* krem = (int*)base;
    base += align_up((size_t)E * sizeof(int));
    int* gt_count = (int*)base;
    base += align_up((size_t)nchunks * E * sizeof(int));
    int* eq_count = (int*)base;

    const dim3 chunk_grid(nchunks, ceil_div(E, 8));
    if (!group_by_position) {
        cudaCheck(cudaMemsetAsync(hist, 0, (size_t)4 * E * 256 * sizeof(int), st));
        const dim3 hist_grid(ceil_div(n, HIST_TOKENS), ceil_div(E, 8));
        for (int pass = 0; pass < 4; pass++) {
            moe_select_histogram_kernel<<<hist_grid, THREADS, 0, st>>>(hist, scores, prefix, n, E, pass);
            cudaCheckLaunch();
            moe_select_digit_kernel<<<E, 32, 0, st>>>(prefix, krem, hist, E, cap, pass);
            cudaCheckLaunch();
        }
        moe_select_count_kernel<false><<<chunk_grid, THREADS, 0, st>>>(gt_count, eq_count, scores, nullptr, prefix, n,
                                                                       E, nchunks);
        cudaCheckLaunch();
        moe_select_scan_kernel<<<E, THREADS, 0, st>>>(gt_count, eq_count, krem, nchunks);
        cudaCheckLaunch();
        moe_select_write_kernel<false><<<chunk_grid, THREADS, 0, st>>>(expert_tokens, token_slots, scores, prefix,
                                                                       krem, gt_count, eq_count, n, E, cap, nchunks);
        cudaCheckLaunch();
    } else {
        const int kp = cap / T;
        moe_select_position_kernel<<<dim3(T, ceil_div(E, 8)), THREADS, 0, st>>>(token_slots, scores, B, T, E, kp);
        cudaCheckLaunch();
        moe_select_count_kernel<true><<<chunk_grid, THREADS, 0, st>>>(gt_count, eq_count, nullptr, token_slots,
                                                                      nullptr, n, E, nchunks);
        cudaCheckLaunch();
        moe_select_scan_kernel<<<E, THREADS, 0, st>>>(gt_count, eq_count, nullptr, nchunks);
        cudaCheckLaunch();
        moe_select_write_kernel<true><<<chunk_grid, THREADS, 0, st>>>(expert_tokens, token_slots, nullptr, nullptr,
                                                                      nullptr, gt_count, eq_count, n, E, cap, nchunks);
        cudaCheckLaunch();
    }
}

// xe [E, cap, C] (overwritten) = rows of x [n, C] listed in expert_tokens
inline void moe_gather(floatX* xe, const floatX* x, const int* expert_tokens, int E, int cap, int C) {
    using namespace moe_detail;
    const int rows = E * cap;
    if (rows == 0 || C == 0) return;
    const unsigned grid = (unsigned)ceil_div(rows, WARPS);
    if (C % 8 == 0 && aligned16(xe) && aligned16(x))
        moe_gather_kernel<8><<<grid, THREADS, 0, llmc_stream()>>>(xe, x, expert_tokens, rows, C);
    else
        moe_gather_kernel<1><<<grid, THREADS, 0, llmc_stream()>>>(xe, x, expert_tokens, rows, C);
    cudaCheckLaunch();
}

// dx [n, C] += sum over the slots of token i of dxe [E, cap, C] (expert order)
inline void moe_gather_backward(floatX* dx, const floatX* dxe, const int* token_slots, int n, int E, int cap, int C) {
    using namespace moe_detail;
    if (n == 0 || C == 0 || E == 0) return;
    const unsigned grid = (unsigned)ceil_div(n, WARPS);
    if (C % 8 == 0 && aligned16(dx) && aligned16(dxe))
        moe_gather_backward_kernel<8><<<grid, THREADS, 0, llmc_stream()>>>(dx, dxe, token_slots, n, E, cap, C);
    else
        moe_gather_backward_kernel<1><<<grid, THREADS, 0, llmc_stream()>>>(dx, dxe, token_slots, n, E, cap, C);
    cudaCheckLaunch();
}

// out [n, C] (overwritten) = sum over the experts that took token i of scores[i, e] * ye [e, slot]; 0 if none
inline void moe_combine_forward(floatX* out, const floatX* ye, const float* scores, const int* token_slots, int n,
                                int E, int cap, int C) {
    using namespace moe_detail;
    if (n == 0 || C == 0) return;
    const unsigned grid = (unsigned)ceil_div(n, WARPS);
    if (C % 8 == 0 && aligned16(out) && aligned16(ye))
        moe_combine_forward_kernel<8><<<grid, THREADS, 0, llmc_stream()>>>(out, ye, scores, token_slots, n, E, cap, C);
    else
        moe_combine_forward_kernel<1><<<grid, THREADS, 0, llmc_stream()>>>(out, ye, scores, token_slots, n, E, cap, C);
    cudaCheckLaunch();
}

// dye [E, cap, C] = gate * dout (overwritten); dscores [n, E] = dout . ye for taken pairs, 0 elsewhere
// (overwritten). (expert_tokens is not needed: every row of dye is one taken (token, expert) pair,
// reached through token_slots.)
inline void moe_combine_backward(floatX* dye, float* dscores, const floatX* dout, const floatX* ye,
                                 const float* scores, const int* expert_tokens, const int* token_slots, int n, int E,
                                 int cap, int C) {
    using namespace moe_detail;
    (void)expert_tokens;
    if (n == 0 || E == 0) return;
    const unsigned grid = (unsigned)ceil_div(n, WARPS);
    if (C % 8 == 0 && aligned16(dye) && aligned16(dout) && aligned16(ye))
        moe_combine_backward_kernel<8><<<grid, THREADS, 0, llmc_stream()>>>(dye, dscores, dout, ye, scores,
                                                                            token_slots, n, E, cap, C);
    else
        moe_combine_backward_kernel<1><<<grid, THREADS, 0, llmc_stream()>>>(dye, dscores, dout, ye, scores,
                                                                            token_slots, n, E, cap, C);
    cudaCheckLaunch();
}

// through the softmax: dlogit = S (dS - sum_f S dS); drouter_w [E, C] += dlogit^T x (fp32, one add);
// dx [n, C] += dlogit router_w
inline void moe_router_backward(floatX* dx, float* drouter_w, const float* dscores, const float* scores,
                                const floatX* x, const floatX* router_w, int n, int C, int E) {
    using namespace moe_detail;
    LLMC_CHECK(n > 0 && C > 0 && E > 0 && E <= ROUTER_MAX_EXPERTS,
               "moe_router_backward: need n, C > 0 and 1 <= E <= %d (n=%d, C=%d, E=%d)", ROUTER_MAX_EXPERTS, n, C, E);
    const int nchunks = ceil_div(n, RW_TOKENS);
    LLMC_CHECK(nchunks <= 65535, "moe_router_backward: n=%d exceeds the grid", n);
    char* base = cuda_scratch<char>(router_backward_scratch_bytes(n, C, E), "moe_router_backward");
    float* dlogit = (float*)base;
    float* partial = (float*)(base + align_up((size_t)n * E * sizeof(float)));
    cudaStream_t st = llmc_stream();

    const unsigned dx_grid = (unsigned)ceil_div(n, WARPS * RB_RT);
    const size_t dx_smem = (size_t)WARPS * RB_RT * E * sizeof(float);
    if (C % 8 == 0 && aligned16(dx) && aligned16(router_w))
        moe_router_backward_dx_kernel<8><<<dx_grid, THREADS, dx_smem, st>>>(dx, dlogit, dscores, scores, router_w, n, C, E);
    else
        moe_router_backward_dx_kernel<1><<<dx_grid, THREADS, dx_smem, st>>>(dx, dlogit, dscores, scores, router_w, n, C, E);
    cudaCheckLaunch();
    if (!drouter_w) return;

    const bool vec = C % 8 == 0 && aligned16(x);
    const dim3 grid(ceil_div(C, RW_COLS), nchunks);
    with_pow2<1, ROUTER_MAX_EXPERTS / 8>(ceil_div(E, 8), [&](auto re) {  // RE experts per thread, 8 RE >= E
        constexpr int RE = decltype(re)::value;
        if (vec) moe_router_dw_partial_kernel<RE, 8><<<grid, THREADS, 0, st>>>(partial, dlogit, x, n, C, E);
        else moe_router_dw_partial_kernel<RE, 1><<<grid, THREADS, 0, st>>>(partial, dlogit, x, n, C, E);
    });
    cudaCheckLaunch();
    moe_router_dw_finish_kernel<<<(unsigned)ceil_div(E * C, THREADS), THREADS, 0, st>>>(drouter_w, partial, nchunks, E, C);
    cudaCheckLaunch();
}
