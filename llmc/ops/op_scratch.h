// The CUDA ops' device scratch and the cuBLASLt workspace, as host arithmetic.
//
// Some CUDA ops need temporary device memory: the partial sums of their deterministic two-stage
// reductions, the buffers of a radix sort. They take it from one scratch arena (cuda_scratch,
// llmc/ops/cuda_common.cuh), and cuBLASLt takes one workspace. The memory plan (llmc/memory.h, kind
// MEM_SCRATCH) counts both, in the CUDA build and in the CPU build's `--plan --device h200`, so
// their sizes are host arithmetic here, from the shapes and the GPU's SM count; the ops' headers
// take their scratch layouts from these functions.
//
// Two needs depend on what only the GPU knows, and are bounds here that the op checks when it runs:
// the layernorm backward's grid follows an occupancy query, and cub's radix sort sizes its own
// temporaries. Everything else is exact.
#pragma once
#include <algorithm>
#include <cstddef>
#include "llmc/utils.h"

// ------------------------------------------------------------------------------------------------
// matmul (llmc/ops/matmul.cuh): the dbias column sum's stage-1 partials, one fp32 row per 256-row chunk

constexpr int MATMUL_DBIAS_ROWS_PER_CHUNK = 256;
// cuBLASLt's workspace: plenty for Hopper's split-K and stream-K kernels (the heuristic is asked for
// algorithms within it, so the choice of algorithm does not depend on free memory)
constexpr size_t MATMUL_WORKSPACE_BYTES = 32ull << 20;

inline size_t matmul_scratch_bytes(int BT, int OC) {
    return (size_t)ceil_div(BT, MATMUL_DBIAS_ROWS_PER_CHUNK) * OC * sizeof(float);
}
// the batched form (one dbias per batch; row chunks never cross a batch)
inline size_t matmul_batched_scratch_bytes(int n_batch, int BT, int OC) {
    return (size_t)n_batch * ceil_div(BT, MATMUL_DBIAS_ROWS_PER_CHUNK) * OC * sizeof(float);
}

// The fp32 weight gradient's deterministic split over K = BT (issue 35; llmc/ops/matmul.cuh). A
// dweight[OC, C] has few output tiles at GPT-2 widths (768 x 768: 36 tiles of 128 x 128 for 132 SMs),
// and cuBLASLt's own split-K is excluded for it, so from MATMUL_SPLITK_MIN_BT rows on the rows are cut
// into P = ceil(BT / MATMUL_SPLITK_ROWS) contiguous chunks (the last one shorter when BT is not a
// multiple): P fp32 partial products [P][OC * C] in this scratch, then one kernel adds them in chunk
// order. P depends on BT alone (and these two constants): never on C, OC, the SM count or the layout,
// so a tensor-parallel rank's slice of a weight gradient gets, element for element, the arithmetic of
// the whole one. Below MATMUL_SPLITK_MIN_BT (tests, small micro-batches, an lm head chunk of 1024
// tokens) there is no split and no scratch; nor for the lm head (below).
//   ROWS 4096: a chunk is still a long K (64 steps of 64 per tile). The price: each chunk's partial
//     is written by the GEMM and read by the sum, 8 bytes of HBM per element per chunk against its
//     8192 flops (~2 ps at 4.8 TB/s vs ~11 ps at 750 TFLOP/s): at most ~10-15% of a dweight GEMM
//     that had enough tiles already (d30's widest; the GEMM's writes partly overlap its math), for
//     a 2-8x shorter GEMM where the tiles were too few. The rule cannot look at the shape (above).
//   MIN_BT 16384 (P >= 4): d12 at B 32 x T 1024 splits 8 ways (the 768 x 768 dweight's 36 tiles
//     become 288); d30 at B 8 x T 1024 (BT 8192: its narrowest dweight, 1920 x 1920, already has
//     225 tiles) does not pay the partials' traffic for a 2-way split it does not need.
// dev/cuda/matmul.cu splitk measures both choices (unsplit vs chunks of 8192 / 4096 / 2048 rows).
constexpr int MATMUL_SPLITK_ROWS = 4096;
constexpr int MATMUL_SPLITK_MIN_BT = 4 * MATMUL_SPLITK_ROWS;
// the K chunks of a dweight over BT rows (1: no split)
inline int matmul_splitk_chunks(int BT) { return BT >= MATMUL_SPLITK_MIN_BT ? ceil_div(BT, MATMUL_SPLITK_ROWS) : 1; }
// the partials of one dweight[OC, C] over BT rows (0 without a split)
inline size_t matmul_splitk_scratch_bytes(int BT, int C, int OC) {
    const int P = matmul_splitk_chunks(BT);
    return P > 1 ? (size_t)P * C * OC * sizeof(float) : 0;
}
// what one matmul_backward with dweight and dbias asks of the arena (the dbias partials and the
// split-K partials are used one after the other, both from the arena's start)
inline size_t matmul_backward_scratch_bytes(int BT, int C, int OC) {
    return std::max(matmul_scratch_bytes(BT, OC), matmul_splitk_scratch_bytes(BT, C, OC));
}
// Where the split pays: a dweight's tiles. The rule must not look at the layout, so the caller decides
// from the WHOLE weight (global_C x global_OC before --tp cuts it) and the card (the same on every
// rank): split from MATMUL_SPLITK_MIN_BT rows on, and only where the whole weight has fewer 128 x 128
// output tiles than half the GPU's SMs. The H200 (132 SMs) at BT 32768, chunks of 4096 rows
// (dev/cuda/matmul.cu splitk, 2026-12-04): 768 x 768 (36 tiles) 0.276 -> 0.074 ms; 768 x 2304 (108)
// 0.212 -> 0.197; 2048 x 768 (96) 0.156 -> 0.172 (+10%); 768 x 3072 (144) 0.222 -> 0.241 (+9%);
// d30's 1920-wide (225+ tiles) +3-20%: where cuBLASLt's own tiles already fill the GPU, the
// partials' traffic costs more than the waves gain. Half the SMs keeps only the clear wins.
inline bool matmul_splitk_wanted(int BT, long global_C, long global_OC, int sm_count) {
    return matmul_splitk_chunks(BT) > 1 && 2 * ceil_div(global_C, 128L) * ceil_div(global_OC, 128L) < sm_count;
}
// The lm head's dweight (C x vocab, train_gpt.cu head_forward: matmul_backward per token chunk of
// m.logits_chunk) never splits (its call passes split_k = false): it has tiles enough unsplit (768 x
// 50304: 2358 of 128 x 128), and with its chunk the whole micro-batch (the device-sized default:
// 32768 tokens at d12 B 32 on an H200) a split would cost 8 x 768 x 50304 x 4 = 1.24 GB of partials
// and ~2.5 GB of traffic per micro-batch for nothing.

// ------------------------------------------------------------------------------------------------
// attention (llmc/ops/attention.cuh): the backward's D = rowsum(dO * O), one float per (query, head)

inline size_t attention_scratch_bytes(int B, int T, int n_head) { return (size_t)B * n_head * T * sizeof(float); }

// ------------------------------------------------------------------------------------------------
// global norm (llmc/ops/global_norm.cuh): pass 1's partials in double, and the totals, for the
// GN_MAX_RANGES ranges of one multi-range launch

constexpr int GN_MAX_BLOCKS = 528;  // pass 1 grid cap: 4 blocks on each of the H200's 132 SMs, all resident
constexpr int GN_MAX_RANGES = 64;   // ranges per multi-range launch (its table is a 2.6 KB kernel parameter)
inline size_t global_norm_scratch_bytes() { return (size_t)GN_MAX_RANGES * (GN_MAX_BLOCKS + 1) * sizeof(double); }

// ------------------------------------------------------------------------------------------------
// layernorm (llmc/ops/layernorm.cuh): the backward's per-block partial [2][C] rows. Its grid is one
// resident wave (SMs x the occupancy query's blocks per SM), at most one block per row. A backward
// block has more than 128 threads (row_shape: x * y > BWD_THREADS / 2 = 128), and an SM holds at most
// 2048 threads (Hopper, Ampere), so at most 16 blocks per SM: the bound.

constexpr int LAYERNORM_MAX_BWD_BLOCKS_PER_SM = 16;
inline size_t layernorm_scratch_bytes(int N, int C, int sm_count) {
    const size_t blocks = std::min<size_t>(std::max(N, 1), (size_t)sm_count * LAYERNORM_MAX_BWD_BLOCKS_PER_SM);
    return blocks * 2 * C * sizeof(float);
}
// rmsnorm (llmc/ops/rmsnorm.cuh): layernorm's kernels without dbias, so one partial row [C] per block,
// under the same grid bound: half of layernorm_scratch_bytes, which op_scratch_bytes already covers
inline size_t rmsnorm_scratch_bytes(int N, int C, int sm_count) {
    const size_t blocks = std::min<size_t>(std::max(N, 1), (size_t)sm_count * LAYERNORM_MAX_BWD_BLOCKS_PER_SM);
    return blocks * C * sizeof(float);
}

// ------------------------------------------------------------------------------------------------
// encoder (llmc/ops/encoder.cuh): the backward sorts (key, row) pairs (four int arrays of n = B*T), sums
// runs of CHUNK sorted rows into 2*C-float partials, and gives cub its temporaries. cub's onesweep
// radix sort of n 4-byte keys with 4-byte values takes: a second keys and values buffer (8n), the
// lookback (one 256-digit counter row per tile of >= 256 items: <= 4n + 1 KiB), the bins and counters
// (<= 32 passes x 257 ints) and six 256-byte alignments: below 12n + 64 KiB, which the op checks.

namespace encoder_detail {
constexpr int CHUNK = 64;  // sorted entries per block in the backward
inline size_t align256(size_t b) { return (b + 255) & ~(size_t)255; }
inline size_t cub_sort_bytes_bound(size_t n) { return 12 * n + (64 << 10); }
struct Scratch {  // byte offsets into the arena
    size_t keys_in, keys_out, vals_in, vals_out, partials, cub, cub_bytes, total;
};
inline Scratch scratch_layout(int B, int T, int C) {
    const size_t n = (size_t)B * T, n_chunks = (n + CHUNK - 1) / CHUNK, ints = align256(n * sizeof(int));
    Scratch s;
    s.keys_in = 0;
    s.keys_out = ints;
    s.vals_in = 2 * ints;
    s.vals_out = 3 * ints;
    s.partials = 4 * ints;
    s.cub = s.partials + align256(n_chunks * 2 * C * sizeof(float));
    s.cub_bytes = cub_sort_bytes_bound(n);
    s.total = s.cub + align256(s.cub_bytes);
    return s;
}
}  // namespace encoder_detail
inline size_t encoder_scratch_bytes(int B, int T, int C) { return encoder_detail::scratch_layout(B, T, C).total; }

// ------------------------------------------------------------------------------------------------
// mixture of experts (llmc/ops/moe.cuh): the selection's histograms and compaction offsets, the router
// backward's dlogits and drouter_w chunk partials (n = B*T tokens, E experts)

namespace moe_detail {
constexpr int RW_TOKENS = 2048;          // tokens of one drouter_w stage-1 chunk
constexpr int SEL_RUN = 8;               // consecutive tokens a thread classifies in the compaction
constexpr int SEL_CHUNK = 32 * SEL_RUN;  // tokens of one compaction chunk (32 runs x 8 experts per block)
inline size_t align_up(size_t bytes) { return (bytes + 255) & ~(size_t)255; }
inline size_t select_scratch_bytes(int n, int E) {
    const size_t nchunks = (size_t)ceil_div(n, SEL_CHUNK);
    return align_up((size_t)4 * E * 256 * sizeof(int)) + align_up((size_t)E * sizeof(uint32_t)) +
           align_up((size_t)E * sizeof(int)) + 2 * align_up(nchunks * E * sizeof(int));
}
inline size_t router_backward_scratch_bytes(int n, int C, int E) {
    return align_up((size_t)n * E * sizeof(float)) + (size_t)ceil_div(n, RW_TOKENS) * E * C * sizeof(float);
}
}  // namespace moe_detail
// the largest single MoE op at this shape
inline size_t moe_scratch_bytes(int B, int T, int C, int E) {
    const int n = B * T;
    return std::max(moe_detail::select_scratch_bytes(n, E), moe_detail::router_backward_scratch_bytes(n, C, E));
}

// ------------------------------------------------------------------------------------------------
// The model's arena: the largest op of a rank's step. The shapes are the rank's (tensor parallel:
// its heads and widths): B x T tokens of C channels, n_head local query heads, max_linear_out the
// widest linear layer with a bias; MoE: n_expert experts, expert_rows (capacity) tokens each, of
// hidden width expert_hidden. sm_count: the GPU's (132 on the H100 / H200 SXM).
inline size_t op_scratch_bytes(int B, int T, int C, int n_head, int max_linear_out, int n_expert, int expert_rows,
                               int expert_hidden, int sm_count) {
    const int BT = B * T;
    size_t need = std::max({encoder_scratch_bytes(B, T, C), layernorm_scratch_bytes(BT, C, sm_count),
                            matmul_scratch_bytes(BT, max_linear_out), attention_scratch_bytes(B, T, n_head),
                            global_norm_scratch_bytes()});
    if (n_expert > 0)
        need = std::max({need, moe_scratch_bytes(B, T, C, n_expert),
                         matmul_batched_scratch_bytes(n_expert, expert_rows, 2 * expert_hidden),
                         matmul_batched_scratch_bytes(n_expert, expert_rows, C)});
    return need;
}

// ------------------------------------------------------------------------------------------------
// Headroom: what a CUDA rank's device memory holds beyond the plan's buffers that no plan can count
// exactly, kept free by the memory guard, --plan --device and --max_fit (and printed with them):
//   modules   CUDA loads a kernel's module at its first launch (lazy loading, the default), and
//             cuBLASLt its kernels and its handle's state: an allowance of 512 MiB
//   NCCL      each communicator of more than one rank holds its channels' buffers (NCCL_BUFFSIZE,
//             4 MiB by default, per channel, peer and protocol) and its proxy state: 256 MiB each
// The CUDA context is not in it: it exists before the free memory is read (cudaMemGetInfo), and the
// --device figures (h200, h100) are that free memory. The device check prints what a run really grew
// by next to its plan ("memory after step 1"), the evidence these allowances are checked against.
constexpr double HEADROOM_MODULES_BYTES = 512.0 * 1048576.0;
constexpr double HEADROOM_NCCL_COMM_BYTES = 256.0 * 1048576.0;

// the NCCL communicators of a rank of the grid pp x dp x tp (ep experts groups inside dp): the dp,
// pp, tp, expert and expert-data-parallel groups that have more than one rank (the kv-head group of
// --tp > n_kv_head is small and counted in the tp allowance)
inline int nccl_communicators(int dp, int pp, int tp, int ep) {
    return (dp > 1) + (pp > 1) + (tp > 1) + (ep > 1) + (ep > 1 && dp / ep > 1);
}
inline double device_headroom_bytes(int dp, int pp, int tp, int ep) {
    return HEADROOM_MODULES_BYTES + nccl_communicators(dp, pp, tp, ep) * HEADROOM_NCCL_COMM_BYTES;
}
inline std::string device_headroom_text(int dp, int pp, int tp, int ep) {
    const int n = nccl_communicators(dp, pp, tp, ep);
    return strfmt("%.2f GiB kept free for what the plan cannot count (lazily loaded modules and cuBLASLt %.0f MiB%s)",
                  device_headroom_bytes(dp, pp, tp, ep) / 1073741824.0, HEADROOM_MODULES_BYTES / 1048576.0,
                  n > 0 ? strfmt(", NCCL %d communicator%s x %.0f MiB", n, n == 1 ? "" : "s",
                                 HEADROOM_NCCL_COMM_BYTES / 1048576.0).c_str() : "");
}
