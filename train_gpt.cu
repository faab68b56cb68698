/*
train_gpt.cu: GPT training in one translation unit, read it top to bottom: the model's structs,
its forward and backward, the step, the update, and train_main. The other chapters are headers in
llmc/gpt/, included where the story needs them:
  backend.h  which ops and which memory (the CPU reference or CUDA)
  config.h   the config and its parameter table (names, shapes, init, weight decay), the segments
  layout.h   a rank's part of the model (tensor / expert slices, pipeline stage, ZeRO shards):
             host arithmetic, and the Layout value the allocation is planned from
  hooks.h    the named entry points between the model math and the layouts
  plan.h     the memory plan and the allocation
  state.h    the state in the table's layout, checkpoints, llm.c files
  flags.h, metrics.h, sample.h, report.h, driver.h: the run (the command line, measurements,
             sampling, reports, and the steps train_main is made of)

The same file builds two programs:
  train_gpt_cpu  g++ -x c++ -DLLMC_CPU: fp32 everywhere, ops from llmc/ops/cpu/<op>.h (the reference)
  train_gpt      nvcc: ops from llmc/ops/<op>.cuh (bf16 activations, fp32 master weights)
Every op has one signature shared by both, so the model code below is written once.
*/
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <numeric>
#include <string>
#include <vector>
#include <sys/resource.h>
#include <sys/stat.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "llmc/utils.h"
#include "llmc/rand.h"
#include "llmc/io/dataloader.h"
#include "llmc/io/tokenizer.h"
#include "llmc/io/mc_file.h"
#include "llmc/io/llmc_format.h"
#include "llmc/schedulers.h"
#include "llmc/parallel/comm.h"
#include "llmc/io/checkpoint.h"
#include "llmc/io/logger.h"
#include "llmc/memory_guard.h"
#include "llmc/outlier.h"
#include "llmc/loss_scaler.h"
#include "llmc/io/run_dir.h"
#include "llmc/io/run_stop.h"

// Multi-process: the rank grid and collectives (llmc/parallel/comm.h), ZeRO sharding, the memory arenas,
// the optimizer's offload, the pipeline schedules, tensor parallelism's canonical reductions.
#include "llmc/parallel/zero.h"
#include "llmc/memory.h"
#include "llmc/ops/op_scratch.h"
#include "llmc/parallel/offload.h"
#include "llmc/parallel/pipeline.h"
#include "llmc/parallel/tensor_parallel.h"

#include "llmc/gpt/backend.h"  // the ops and the memory of this build

#include "llmc/gpt/config.h"  // GPTConfig, the parameter table, the segments
#include "llmc/gpt/layout.h"  // a rank's slice, the pipeline partition, the ZeRO layout: host arithmetic

// ----------------------------------------------------------------------------------------------
// The model

// Activations saved by the forward for the backward, per layer, for up to B*T tokens.
struct LayerActs {
    floatX* ln1;                        // LN1 output
    float *ln1_mean, *ln1_rstd;         // its statistics (fp32 in every build)
    floatX *qkv, *atty;                 // attention input and output
    float* att_lse;                     // per (row, head, query) log-sum-exp of the scores
    floatX* residual2;                  // x + attn(LN1(x))
    floatX* ln2;
    float *ln2_mean, *ln2_rstd;
    floatX *fch, *fch_act;              // fc output (pre-activation) and the activation; in an MoE
                                        // layer the experts' ones, stacked [E, capacity, ...]
    // MoE layers only: routing (llmc/ops/cpu/moe.h) and the experts' input and output rows
    float* moe_scores;                  // [BT, E] softmax of the router
    int *expert_tokens, *token_slots;   // [E, capacity], [BT, E]
    floatX *expert_in, *expert_out;     // [E, capacity, C]
    floatX *residual3;                  // block output
};

// A layer's output gradients that its weight gradients need: what a zero-bubble pipeline keeps
// from the input-gradient half of the backward (B) to the weight-gradient half (W).
struct LayerGrads {
    floatX* d_ffn_out;     // of the FFN branch's output (dense: the block output; MoE: the experts' output rows)
    floatX* d_fch;         // of fc's output (pre-activation)
    floatX* d_ln2;         // of LN2's output
    float* d_moe_scores;   // MoE: of the router's scores
    floatX* d_attn_out;    // of the attention projection's output (the gradient at residual2)
    floatX *d_qkv, *d_ln1;
};

// One micro-batch in flight in one chunk (from its forward to its weight gradients).
struct ChunkSlot {
    int mb = -1;                   // the micro-batch it holds, -1 free
    std::vector<LayerActs> acts;   // the chunk's layers
    floatX* input = nullptr;       // [BT, C] the residual stream entering the chunk (vs 0: the embedding)
    floatX* d_stream = nullptr;    // [BT, C] gradient of the residual stream: at the chunk's output, then its input
    int *inputs = nullptr, *targets = nullptr, *doc_start = nullptr;  // the micro-batch, where the ops run
    const int* host_targets = nullptr;
};
// The B -> W stash of one micro-batch in one chunk (zero-bubble schedules only).
struct ChunkStash {
    int mb = -1;
    std::vector<LayerGrads> layers;
};

// A micro-batch as the trainer read it (host memory).
struct MicroBatch {
    const int *inputs = nullptr, *targets = nullptr, *doc_start = nullptr;
};

// Where a forward without targets hands its logits, one token chunk at a time (the lm head keeps
// only a chunk): tokens [t0, t0 + n) of the micro-batch, logits [n, the rank's vocabulary slice]
// in the buffer the ops run in, valid until the call returns.
using LogitsSink = std::function<void(int t0, int n, const floatX* logits)>;

// The model on one rank. Its fields in four groups: the model (config, table, pointers into the
// flat buffers), the layout (this rank's slice, pipeline stage, ZeRO shards: llmc/gpt/layout.h
// decides them, gpt_allocate records them), the buffers (all taken once by gpt_allocate,
// llmc/gpt/plan.h), and the context of the call in progress (set by gpt_forward and
// gpt_pipeline_step, read by the ops below them).
struct GPT {
    // ---- the model
    GPTConfig config;
    std::vector<ParamTensor> table;  // the model's tensors: the layout-independent index space
    size_t n_params = 0;             // elements of the parameter table (with alignment padding): checkpoints
    size_t param_count = 0;          // the model's parameters (what is reported and counted for FLOPs)
    ModelTensors<floatX> p;          // pointers into params (stage 3: into the slots, while gathered)
    ModelTensors<float> g;           // ... and into the fp32 leaf gradients (stage 3: the slots)

    // ---- the layout
    // tensor parallel: this rank's slice of the model (local_param_table; one process: the table)
    LocalShape ls;
    std::vector<ParamTensor> local;
    std::vector<TablePiece> pieces;              // local elements -> table elements
    std::vector<CheckpointRange> table_padding;  // table padding this rank reports (zeros; tp > 1)
    ChunkSplit split_attn, split_ffn, split_expert, split_vocab, split_tokens;  // canonical reductions
    bool canonical = true;  // the CPU build's canonical chunks (llmc/parallel/tensor_parallel.h); a GPU plan: one per rank
    PipelinePlan pipe;      // this rank's pipeline stage and its chunks
    // the flat buffers of this stage's segments, laid out and sharded by `zero` (llmc/parallel/zero.h)
    ZeroLayout zero;
    std::vector<int> seg_local;  // model segment id -> its index in zero.segs (-1: another stage's)
    // the tied lm head's buffers (below) are laid out as the embedding segment: `head`
    ZeroLayout head;
    std::vector<UpdatePiece> update_pieces;      // what this rank's optimizer step updates
    std::vector<std::vector<int>> seg_pieces;    // per local segment, its update pieces
    std::vector<std::vector<int>> early_pieces;  // --offload: per local segment, update pieces to download early
    AccRanges norm_skip;                         // tensor-parallel replicas' gradients (not counted here)
    int recompute = 0;                           // -r: activation recomputation level (acts_for)
    int offload = OFFLOAD_NONE;  // --offload optimizer: master, adam m/v in host arenas (llmc/parallel/offload.h)
    int max_B = 0, max_T = 0;    // the micro-batch the activations are allocated for
    int logits_chunk = 1;        // tokens per lm-head chunk (logits_chunk_tokens; m.logits holds one chunk)
    // planning only: the data-, tensor- and expert-parallel ranks to plan for (rank 0's share), and
    // the element size of params, leaf grads and activations (2 plans the GPU build's bf16)
    int plan_dp = 0, plan_tp = 0, plan_ep = 0;
    size_t elem_bytes = sizeof(floatX);

    // ---- the buffers (llmc/memory.h: every one from `mem`; mem.plan_only: only counted)
    MemoryArenas mem;
    floatX* params = nullptr;    // stage 0-2: every segment (padded space); stage 3: this rank's shard
    float* grad_acc = nullptr;   // fp32 gradient of the step (stages 0-1: m.g points into it)
    float* master = nullptr;     // fp32 master weights when params are not fp32 (the CUDA build), or offloaded
    float *adam_m = nullptr, *adam_v = nullptr;
    float* grad_staging = nullptr;  // offload: host fp32 [state_elems], the gradients down, the params up
    float* comm_scratch = nullptr;  // a segment reduction's receive buffer (dp > 1)
    SegmentSlots<floatX> param_slots;  // stage 3: gathered segments
    SegmentSlots<float> grad_slots;    // stages 2-3: a micro-batch's segment gradients until reduced
    ZeroInFlight zs;                   // the step's ZeRO communication in flight, the segments' progress
    // The tied lm head (on the last stage) and its gradient, which joins the embedding's as `tied`
    // says (llmc/gpt/layout.h; hooks.h tied_embedding_sum); with pp > 1 the last stage keeps a copy of
    // the embedding's weights, refreshed after every update.
    TiedSum tied = TIED_PER_RANK;
    float* head_leaf = nullptr;      // [head_leaf_elems] the head's gradient of one micro-batch
    size_t head_leaf_elems = 0;      // tied: head.padded_total; untied: the rank's lm_head
    floatX* head_params = nullptr;   // [head.padded] pp > 1 only
    float* head_acc = nullptr;       // [head_acc_elems] the head's gradient of the rank's micro-batches
                                     // (per step: its slice of the reduced sum)
    // --grad_blocks > 1 (one process): the step's gradient over the blocks done so far
    int grad_blocks = 1;
    float* grad_total = nullptr;  // [zero.acc_elems()]
    bool blocks_folded = false;   // grad_total holds a block this step
    std::vector<std::vector<ChunkSlot>> slots;     // [chunk][k]: activations of micro-batches in flight
    std::vector<floatX*> d_stream_spare;           // [chunk]: a d_stream while a leaving unit's gradient is sent (release_slot)
    std::vector<std::vector<ChunkStash>> stashes;  // [chunk][k]: zero-bubble B -> W stash
    LayerGrads layer_douts{};  // one layer's output gradients, when its weight gradients follow at once
    LayerActs recomp{};        // -r 1 / 2: one layer's activations that the slots do not keep
    float* rope_cos_sin = nullptr;  // --pos rope: the cos / sin table of every position a forward can hold
    floatX* lnf = nullptr;     // the last stage's head: the final LN's output of one micro-batch,
    floatX* logits = nullptr;  // the logits (then dlogits) of one token chunk [logits_chunk, vocab slice]
    float *lnf_mean = nullptr, *lnf_rstd = nullptr, *losses = nullptr;
    // backward scratch, reused by every layer
    floatX *d_ln = nullptr, *d_atty = nullptr, *d_fch_act = nullptr, *scratch = nullptr;
    floatX* d_expert_in = nullptr;  // MoE: gradient of the experts' input rows
    floatX* ep_buf = nullptr;       // --ep: [E, capacity, C] rows on their way to or from the experts' owners
    // tensor-parallel reductions (llmc/parallel/tensor_parallel.h) and their operands
    TpScratch<floatX> tpx;
    TpScratch<float> tpf;
    floatX *tp_copy_a = nullptr, *tp_copy_b = nullptr;  // a leaf's slices of a matmul's operands
    size_t tp_copy_a_elems = 0, tp_copy_b_elems = 0;  // their capacities (gather_columns checks them)
    // a kv head shared by tp ranks: its group's attention-backward operands (shared_kv_attention_backward)
    floatX *kv_send = nullptr, *kv_recv = nullptr, *kv_qkv = nullptr, *kv_dqkv = nullptr, *kv_dout = nullptr,
           *kv_out = nullptr;
    float *kv_lse_recv = nullptr, *kv_lse = nullptr;
    floatX* tp_full = nullptr;      // [B*T, C] --sp: a gathered stream gradient; MoE: the combined output
    float* tp_ln_grads = nullptr;   // [2C] a LayerNorm's weight and bias gradients (fp32)
    floatX* ln_full[2] = {};        // [B*T, C] --sp: a block's LN1 and LN2 outputs, gathered (ln_gathered)
    CommRequest ln_gathering[2];    // their gathers started ahead of their use (ln_gather_start)
    float *ce_max = nullptr, *ce_sum = nullptr, *ce_target = nullptr;  // [logits_chunk] vocab-parallel softmax
    void* op_scratch = nullptr;     // the CUDA ops' scratch and the cuBLASLt workspace (MEM_SCRATCH)
    size_t op_scratch_bytes = 0;
    double* loss_sums = nullptr;  // [pipe.M] each micro-batch's loss sum (the head's stage; read once per step)
    const double* loss_download = nullptr;  // their host copy (download_async)
    int loss_download_n = 0;
    double activation_bytes = 0;

    // ---- the call in progress: the micro-batches the forwards read (B x T tokens each), their loss
    // scale, the last stage's losses; the latest forward's slot per chunk (MoE statistics)
    int B = 0, T = 0;
    std::vector<MicroBatch> batches;
    float dloss_scale = 0.0f;
    std::vector<double> mb_loss;
    std::vector<int> mb_valid;  // the real targets of each micro-batch (the head's stage)
    std::vector<const ChunkSlot*> last_forward;
    PipeAction next_pass{PIPE_F, -1, -1, -1};  // in a step's schedule, the stage's pass after the running one (hooks.h)
    LogitsSink logits_sink;  // a forward without targets: where each token chunk's logits go
};

// The CUDA ops take their scratch and the matmul workspace from the model that runs them (a test
// may keep several models): bound where a model's forward, backward or update starts.
static void bind_op_scratch(const GPT& m) {
    if (m.op_scratch) backend_bind_scratch(m.op_scratch, m.op_scratch_bytes);
}

// The model's normalisation, by --norm: LayerNorm (GPT-2: weight and bias, eps 1e-5) or RMSNorm
// (Llama: weight only, no mean, eps --norm_eps; `mean` and `bias` are not used). Over the rank's
// stream rows, C = n_embd.
static void norm_forward(const GPT& m, floatX* out, float* mean, float* rstd, const floatX* inp, const floatX* w,
                         const floatX* b, int N) {
    const GPTConfig& c = m.config;
    if (c.rmsnorm()) rmsnorm_forward(out, rstd, inp, w, N, c.n_embd, c.norm_eps);
    else layernorm_forward(out, mean, rstd, inp, w, b, N, c.n_embd);
}
static void fused_residual_norm_forward(const GPT& m, floatX* residual, floatX* out, float* mean, float* rstd,
                                        const floatX* inp1, const floatX* inp2, const floatX* w, const floatX* b, int N) {
    const GPTConfig& c = m.config;
    if (c.rmsnorm()) fused_residual_rmsnorm_forward(residual, out, rstd, inp1, inp2, w, N, c.n_embd, c.norm_eps);
    else fused_residual_layernorm_forward(residual, out, mean, rstd, inp1, inp2, w, b, N, c.n_embd);
}
// the input gradient (dinp +=); the weight gradients are norm_weight_grads' (hooks.h)
static void norm_backward(const GPT& m, floatX* dinp, const floatX* dout, const floatX* inp, const floatX* w,
                          const float* mean, const float* rstd, int N) {
    const GPTConfig& c = m.config;
    if (c.rmsnorm()) rmsnorm_backward(dinp, (float*)nullptr, dout, inp, w, rstd, N, c.n_embd);
    else layernorm_backward(dinp, (float*)nullptr, (float*)nullptr, dout, inp, w, mean, rstd, N, c.n_embd);
}

#include "llmc/gpt/hooks.h"  // the named entry points of ZeRO, tensor, expert and pipeline parallelism

// ---- forward and backward of one chunk (a pipeline stage's contiguous blocks) ----

// The lm head of the last virtual stage, on the final LayerNorm's output, over token chunks of
// m.logits_chunk tokens (the logits buffer holds one chunk, never the micro-batch; the same chunks
// in every layout). Per chunk: its logits; with targets the per-token losses; with a loss scale its
// backward at once, in place, so no logits wait for a later backward: dlogits -> the chunk's part
// of the head's weight gradient (folded into head_leaf in chunk order) and of the gradient at the
// final LayerNorm's output. Without targets each chunk's logits go to m.logits_sink. Then once:
// the losses summed into m.loss_sums[mb] on the device (take_losses reads the step's sums at once:
// no host sync per micro-batch), head_grads_ready (head_leaf on its way to wte), and the final
// LayerNorm's backward (its weight gradients folded too) into the slot's d_stream.
static void head_forward(GPT& m, ChunkSlot& s, const floatX* x_final) {
    const GPTConfig& c = m.config;
    const int BT = m.B * m.T, C = c.n_embd, Vl = m.ls.vocab, rows = stream_rows(m);
    const floatX* wte = head_weights(m);  // (the untied head's own matrix with --tie_embeddings 0)
    sp_gather(m, m.lnf, C);
    int n_valid = 0;
    for (int i = 0; s.host_targets && i < BT; i++) n_valid += s.host_targets[i] >= 0;
    const float dloss = n_valid > 0 ? m.dloss_scale / n_valid : 0.0f;
    const bool backward = s.host_targets && m.dloss_scale != 0.0f;
    if (backward) buffer_zero(m.head_leaf, m.head_leaf_elems * sizeof(float));
    for (int t0 = 0; t0 < BT; t0 += m.logits_chunk) {
        const int n = std::min(m.logits_chunk, BT - t0);
        const floatX* x = m.lnf + (size_t)t0 * C;
        matmul_forward(m.logits, x, wte, (const floatX*)nullptr, n, C, Vl);
        if (!s.host_targets) {
            if (m.logits_sink) m.logits_sink(t0, n, m.logits);
            continue;
        }
        vocab_parallel_loss(m, s.targets + t0, m.losses + t0, n, dloss);  // m.logits: dlogits now
        if (!backward) continue;
        // (tensor parallel: the input gradient's reduction in flight behind the weight gradient)
        TpSumPending<floatX> dx = vocab_parallel_dinp_start(m, m.d_ln + (size_t)t0 * C, m.logits, wte, n);
        matmul_backward((floatX*)nullptr, m.head_leaf, (float*)nullptr, m.logits, x, (const floatX*)nullptr, n, C, Vl,
                        /*split_k*/ false);  // tiles enough unsplit (llmc/ops/op_scratch.h)
        tp_finish(dx);
    }
    if (s.host_targets) {
        loss_sum(m.loss_sums + s.mb, m.losses, BT);  // (deterministic: a fixed order)
        m.mb_valid[s.mb] = n_valid;
    }
    if (backward) {
        const int final_ln = c.n_layer + 1;
        const floatX* d_lnf = m.d_ln + sp_row0(m) * C;  // this rank's stream rows
        if (c.tie_embeddings) head_grads_ready(m);
        grads_needed(m, final_ln);
        // an untied head's gradient is the final segment's: the micro-batch's, added once
        if (!c.tie_embeddings) grad_accumulate(m.g.lm_head, m.head_leaf, (size_t)Vl * C);
        buffer_zero(s.d_stream, (size_t)rows * C * sizeof(floatX));
        norm_backward(m, s.d_stream, d_lnf, x_final, m.p.lnfw, m.lnf_mean, m.lnf_rstd, rows);
        norm_weight_grads(m, m.g.lnfw, m.g.lnfb, d_lnf, x_final, m.lnf_mean, m.lnf_rstd);
        grads_ready(m, final_ln);
    }
    head_done(m);
}
// The mean losses of micro-batches [0, n) of the latest forwards (the head's stage): their device
// sums queued for the host (queue_losses), then, after a host sync, divided by their real targets
// (take_losses: it syncs only if nothing has since).
static void queue_losses(GPT& m, int n) {
    m.loss_download = (const double*)download_async(m.loss_sums, n * sizeof(double));
    m.loss_download_n = n;
}
static std::vector<double> take_losses(GPT& m) {
    download_wait();
    std::vector<double> loss(m.loss_download_n);
    for (int k = 0; k < m.loss_download_n; k++)
        loss[k] = m.mb_valid[k] > 0 ? (float)(m.loss_download[k] / m.mb_valid[k]) : 0.0f;
    return loss;
}

// The activations of block l for a slot, as the recomputation level keeps them (-r): what the
// slot stores, and the rest in the one-layer recompute buffers (m.recomp), which the backward
// fills again. -r 0: the slot keeps everything. -r 1 (selective, Korthikanti et al. 2022): the
// LayerNorm outputs and the FFN activation are recomputed from their stored inputs. -r 2 (full):
// the slot keeps the block outputs (each the next block's input) and the routing; the backward
// recomputes the whole block, one at a time.
static LayerActs acts_for(const GPT& m, const ChunkSlot& s, int chunk, int l) {
    const LayerActs& kept = s.acts[l - m.pipe.layer_begin(chunk)];
    if (m.recompute == 0) return kept;
    LayerActs a = m.recomp;
    a.residual3 = kept.residual3;
    a.moe_scores = kept.moe_scores;
    a.expert_tokens = kept.expert_tokens;
    a.token_slots = kept.token_slots;
    if (m.recompute == 1) {
        const floatX *ln1 = a.ln1, *ln2 = a.ln2, *fch_act = a.fch_act;
        a = kept;
        a.ln1 = (floatX*)ln1;
        a.ln2 = (floatX*)ln2;
        a.fch_act = (floatX*)fch_act;
    }
    return a;
}

static void block_forward_parts(GPT& m, int l, LayerActs& a, const floatX* x, const int* doc_start, ForwardParts& parts);
// Block l up to (not including) its final residual add: attention on LN1's output (a.ln1, all
// B*T tokens: gathered here with --sp), the residual add fused with LN2, the FFN branch (its
// output, the rank's stream rows, in m.scratch). The forward and the recompute (-r 2) run exactly
// this. Tensor parallel: the rank's heads and hidden units; the row-parallel projections' partial
// sums are reduced (--sp: reduce-scattered) over the tp group in canonical chunks; without --sp,
// a dense block runs in parts (block_forward_parts); with `carry` its parts' reductions stay in
// flight there (the caller lands them), else they complete here.
static void block_forward(GPT& m, int l, LayerActs& a, const floatX* x, const int* doc_start,
                          ForwardParts* carry = nullptr) {
    const GPTConfig& c = m.config;
    const LocalShape& ls = m.ls;
    const int B = m.B, T = m.T, BT = B * T, C = c.n_embd, rows = stream_rows(m);
    const size_t row0 = sp_row0(m);
    const LayerTensors<floatX>& w = m.p.layers[l];
    LLMC_CHECK(!carry || carry->K == 0 || forward_parts(m, l) > 0, "internal: parts in flight into block %d", l);
    if (forward_parts(m, l) > 0) {
        ForwardParts own;
        ForwardParts& parts = carry ? *carry : own;
        block_forward_parts(m, l, a, x, doc_start, parts);
        if (carry) return;
        parts.land = [&](int k) { row_parallel_finish(m, parts.into[k], w.fcprojb, 1, parts.rows, C, false); };
        parts_land_all(parts);
        return;
    }
    matmul_forward(a.qkv, ln_gathered(m, a.ln1, 0), w.qkvw, w.qkvb, BT, C, ls.qkv());
    if (c.pos == POS_ROPE) rope_forward(a.qkv, doc_start, m.rope_cos_sin, B, T, ls.n_head, ls.n_kv_head, ls.hs);
    attention_forward(a.atty, a.att_lse, a.qkv, doc_start, B, T, ls.n_head, ls.n_kv_head, ls.hs,
                      c.pos == POS_ALIBI ? c.n_head : 0, ls.head0);
    row_parallel_forward(m, m.scratch, a.atty, w.attprojw, w.attprojb, 1, BT, ls.n_head * ls.hs, C, m.split_attn, ls.sp);
    params_needed(m, l + 1, PART_FFN);  // (ZeRO: the FFN half's params come later than the attention's)
    fused_residual_norm_forward(m, a.residual2, a.ln2, a.ln2_mean, a.ln2_rstd, x, m.scratch, w.ln2w, w.ln2b, rows);
    const floatX* ln2 = ln_gathered(m, a.ln2, 1);
    if (c.is_moe(l)) {
        // expert choice: route (every tp rank the same, on all its tokens), gather each expert's
        // tokens, run the experts (this rank's hidden units of each) as one batch of matmuls per
        // source, reduce the experts' outputs over the tp group, add the gated outputs back per
        // token. --ep: the chosen rows travel to their expert's owner and back
        const int E = c.n_expert, He = ls.expert_hidden, cap = c.moe_capacity(B, T);
        moe_router_forward(a.moe_scores, ln2, w.routerw, BT, C, E);
        moe_select(a.expert_tokens, a.token_slots, a.moe_scores, B, T, E, c.capacity_factor,
                   c.moe_group == MOE_GROUP_POSITION);
        moe_gather(expert_dispatch_buffer(m, a.expert_in), ln2, a.expert_tokens, E, cap, C);
        // the own rows first, the others' slice by slice as they arrive (expert_dispatch_start)
        const int own = comm_world().ep.rank, Ne = ls.n_expert;
        std::vector<CommRequest> dispatch = expert_dispatch_start(m, a.expert_in, C);
        auto expert_fc = [&](int p, int j0, int n) {  // experts [j0, j0 + n) on source p's rows
            const size_t rows = ((size_t)p * Ne + j0) * cap;
            matmul_forward_batched(a.fch + rows * 2 * He, a.expert_in + rows * C, w.fcw + (size_t)j0 * 2 * He * C,
                                   w.fcb ? w.fcb + (size_t)j0 * 2 * He : nullptr, n, cap, C, 2 * He);
            swiglu_forward(a.fch_act + rows * He, a.fch + rows * 2 * He, n * cap, He);
        };
        auto expert_proj = [&](floatX* out, int p, int j0, int n) {
            const size_t rows = ((size_t)p * Ne + j0) * cap;
            row_parallel_forward(m, out + rows * C, a.fch_act + rows * He, w.fcprojw + (size_t)j0 * C * He,
                                 w.fcprojb ? w.fcprojb + (size_t)j0 * C : nullptr, n, cap, He, C, m.split_expert, false);
        };
        expert_fc(own, 0, Ne);
        // each slice of the others' rows through the experts and back as soon as it has arrived
        // (its outputs overwrite its own rows in m.ep_buf: the slices after it are still in flight
        // from other rows), the own rows' outputs computed last, in place
        std::vector<CommRequest> back;
        for (int j = 0; j < (int)dispatch.size(); j++) {
            comm_finish(dispatch[j]);
            for (int p = 0; p < ls.ep; p++)
                if (p != own) {
                    expert_fc(p, j, 1);
                    expert_proj(m.ep_buf, p, j, 1);
                }
            back.push_back(expert_return_start(m, a.expert_out, C, j));
        }
        expert_proj(a.expert_out, own, 0, Ne);
        for (CommRequest& r : back) comm_finish(r);
        floatX* out = ls.sp ? m.tp_full : m.scratch;
        moe_combine_forward(out, a.expert_out, a.moe_scores, a.token_slots, BT, E, cap, C);
        if (ls.sp) copy_buffer(m.scratch, out + row0 * C, (size_t)rows * C * sizeof(floatX));
    } else {
        const int H = ls.ffn;
        matmul_forward(a.fch, ln2, w.fcw, w.fcb, BT, C, ls.fc(c.mlp));
        if (c.mlp == MLP_SWIGLU) swiglu_forward(a.fch_act, a.fch, BT, H);
        else gelu_forward(a.fch_act, a.fch, (long)BT * H);
        row_parallel_forward(m, m.scratch, a.fch_act, w.fcprojw, w.fcprojb, 1, BT, H, C, m.split_ffn, ls.sp);
    }
}

// block_forward of a dense block under tensor parallelism (without --sp) in K parts of the
// micro-batch's sequences (forward_parts: 4 where B allows, else 2), each part's reductions in flight
// behind the next parts' compute (the decomposition of Wang et al. 2022, "Overlap communication with
// dependent computation via decomposition in large deep learning models"; Domino, Wang et al. 2024,
// slices the batch so). With two parts:
//   part 0: (its input landed) qkv, attention, the projection's leaves -> reduction A0 starts
//   part 1: (its input landed) qkv, attention, the projection's leaves -> A1 starts   (A0 in flight)
//   A0 done: part 0's residual + LN2, the FFN -> F0 starts                             (A1 in flight)
//   A1 done: part 1's residual + LN2, the FFN -> F1 starts                             (F0 in flight)
// and F0, F1 go on in flight into the next block, which lands each part just before it reads it
// (ForwardParts, llmc/gpt/hooks.h): only the model's or the chunk's end waits for the last one.
// Between two pieces of a part's work the oldest reduction in flight moves on to its all-gather.
// Every op is per row (a matmul's element does not depend on the rows beside it: llmc/ops/cpu/
// matmul.h) or per sequence (attention, RoPE), and each reduction sums its rows' leaves in the same
// tree: the bits of block_forward on the whole micro-batch.
static void block_forward_parts(GPT& m, int l, LayerActs& a, const floatX* x, const int* doc_start, ForwardParts& parts) {
    const GPTConfig& c = m.config;
    const LocalShape& ls = m.ls;
    parts_begin(m, parts, forward_parts(m, l));
    const int K = parts.K, Tp = parts.rows, Bp = m.B / K, T = m.T, C = c.n_embd, H = ls.ffn, qkv = ls.qkv();
    const int fc = ls.fc(c.mlp), A = ls.n_head * ls.hs;
    const LayerTensors<floatX>& w = m.p.layers[l];
    for (int k = 0; k < K; k++) {
        const size_t r0 = (size_t)k * Tp;
        const int* ds = doc_start + r0;
        floatX* q = a.qkv + r0 * qkv;
        parts_land(parts, k);  // (its LN1 rows, x's rows)
        matmul_forward(q, a.ln1 + r0 * C, w.qkvw, w.qkvb, Tp, C, qkv);
        if (c.pos == POS_ROPE) rope_forward(q, ds, m.rope_cos_sin, Bp, T, ls.n_head, ls.n_kv_head, ls.hs);
        parts_advance(parts);
        attention_forward(a.atty + r0 * A, a.att_lse + r0 * ls.n_head, q, ds, Bp, T, ls.n_head, ls.n_kv_head, ls.hs,
                          c.pos == POS_ALIBI ? c.n_head : 0, ls.head0);
        parts_start(parts, parts.attn[k], row_parallel_start(m, parts.lane[k], m.scratch + r0 * C, a.atty + r0 * A,
                                                             w.attprojw, 1, Tp, A, C, m.split_attn, false));
    }
    params_needed(m, l + 1, PART_FFN);  // (ZeRO: the FFN half's params come later than the attention's)
    for (int k = 0; k < K; k++) {
        const size_t r0 = (size_t)k * Tp;
        row_parallel_finish(m, parts.attn[k], w.attprojb, 1, Tp, C, false);
        fused_residual_norm_forward(m, a.residual2 + r0 * C, a.ln2 + r0 * C, a.ln2_mean + r0, a.ln2_rstd + r0, x + r0 * C,
                                    m.scratch + r0 * C, w.ln2w, w.ln2b, Tp);
        matmul_forward(a.fch + r0 * fc, a.ln2 + r0 * C, w.fcw, w.fcb, Tp, C, fc);
        parts_advance(parts);
        if (c.mlp == MLP_SWIGLU) swiglu_forward(a.fch_act + r0 * H, a.fch + r0 * fc, Tp, H);
        else gelu_forward(a.fch_act + r0 * H, a.fch + r0 * fc, (long)Tp * H);
        parts_start(parts, parts.into[k], row_parallel_start(m, parts.lane[k], m.scratch + r0 * C, a.fch_act + r0 * H,
                                                             w.fcprojw, 1, Tp, H, C, m.split_ffn, false));
        parts.landed[k] = false;
    }
}

// What the backward of block l needs that -r did not keep, computed again from what it kept
// (bitwise what the forward computed: the same ops on the same inputs). The block's params must be
// in place.
static void recompute_block(GPT& m, int l, LayerActs& a, const floatX* x, const int* doc_start) {
    const GPTConfig& c = m.config;
    const int BT = m.B * m.T, rows = stream_rows(m);
    const LayerTensors<floatX>& w = m.p.layers[l];
    if (m.recompute == 0) return;
    norm_forward(m, a.ln1, a.ln1_mean, a.ln1_rstd, x, w.ln1w, w.ln1b, rows);
    if (m.recompute == 2) {
        block_forward(m, l, a, x, doc_start);
        return;
    }
    norm_forward(m, a.ln2, a.ln2_mean, a.ln2_rstd, a.residual2, w.ln2w, w.ln2b, rows);
    if (c.is_moe(l)) swiglu_forward(a.fch_act, a.fch, c.n_expert * c.moe_capacity(m.B, m.T), m.ls.expert_hidden);
    else if (c.mlp == MLP_SWIGLU) swiglu_forward(a.fch_act, a.fch, BT, m.ls.ffn);
    else gelu_forward(a.fch_act, a.fch, (long)BT * m.ls.ffn);
}

// Forward of a chunk's blocks for the slot's micro-batch (the embedding first on virtual stage 0,
// the head and loss last on the last one: the loss sum on the device, see head_forward).
static void chunk_forward(GPT& m, int chunk, ChunkSlot& s) {
    const GPTConfig& c = m.config;
    const PipelinePlan& pp = m.pipe;
    const int B = m.B, T = m.T, C = c.n_embd, L = c.n_layer, rows = stream_rows(m);
    const size_t row0 = sp_row0(m);
    const int l0 = pp.layer_begin(chunk), l1 = pp.layer_end(chunk);
    const int embedding = 0, final_ln = L + 1;  // segments; block l is segment l + 1
    m.last_forward[chunk] = &s;
    // tensor parallel: the blocks' parts in flight from one block into the next (block_forward_parts)
    ForwardParts parts;
    std::function<void(int)> embed_start;
    if (pp.first_vs(chunk)) {
        // vocab-parallel embedding: each rank adds its vocabulary rows (zeros for the others'
        // tokens, tp rank 0 the positions), the tp group sums (exact: one non-zero term per part);
        // where the first block runs in parts, each part's sum in flight until that block reads it
        params_needed(m, embedding);
        params_prefetch(m, l0 + 1);
        const ChunkSplit one = rank_leaf(tp_group());
        const int K = forward_parts_carry(m, l0) ? forward_parts(m, l0) : 1, Bp = B / K, n = Bp * T;
        if (K > 1) parts_begin(m, parts, K);
        // (a part's sum starts as the one before it lands: the link carries them in the order the
        // block reads them)
        embed_start = [&m, &s, &parts, one, Bp, n, T, C](int k) {
            const size_t r0 = (size_t)k * n;
            auto leaf = [&](int, floatX* dst) {
                encoder_forward(dst, s.inputs + r0, s.doc_start + r0, m.p.wte, m.ls.rank == 0 ? m.p.wpe : (const floatX*)nullptr,
                                n / T, T, C, m.ls.vocab0, m.ls.vocab);
            };
            if (parts.K == 0) {
                tp_sum(tp_group(), one, m.tpx, s.input, (size_t)n * C, !m.ls.sp, leaf, tp_add, tp_copy);
                return;
            }
            parts_start(parts, parts.into[k], tp_sum_start(tp_group(), one, parts.lane[k], s.input + r0 * C, (size_t)n * C,
                                                           true, leaf, tp_add, tp_copy));
            parts.landed[k] = false;
        };
        embed_start(0);
        for (int k = 1; k < parts.K; k++) parts.landed[k] = false;
        // (else the tied head reads it again: head_done)
        if (!pp.last_vs(chunk) || !c.tie_embeddings) params_done(m, embedding);
    }
    // ZeRO-3: each segment's gather runs one segment ahead, behind the compute of the one before
    params_needed(m, l0 + 1, PART_ATTENTION);
    params_prefetch(m, l0 + 2 <= l1 || l1 == L ? l0 + 2 : -1);
    LayerActs a = acts_for(m, s, chunk, l0);
    const LayerTensors<floatX>& w0 = m.p.layers[l0];
    if (parts.K) {
        parts.land = [&m, &parts, &s, &embed_start, a, w0, C](int k) {
            const size_t r0 = (size_t)k * parts.rows;
            tp_finish(parts.into[k]);
            if (k + 1 < parts.K) embed_start(k + 1);
            norm_forward(m, a.ln1 + r0 * C, a.ln1_mean + r0, a.ln1_rstd + r0, s.input + r0 * C, w0.ln1w, w0.ln1b, parts.rows);
        };
    } else {
        norm_forward(m, a.ln1, a.ln1_mean, a.ln1_rstd, s.input, w0.ln1w, w0.ln1b, rows);
    }
    for (int l = l0; l < l1; l++) {
        const bool chunk_end = l + 1 == l1, model_end = l + 1 == L;
        const floatX* x = l == l0 ? s.input : s.acts[l - l0 - 1].residual3;
        block_forward(m, l, a, x, s.doc_start, forward_parts_carry(m, l) ? &parts : nullptr);
        if (!chunk_end || model_end) params_needed(m, l + 2, PART_ATTENTION);  // the next block (its LN1 ends this one), or the final LN
        // the residual add is fused with the next LayerNorm: the next block's LN1, or the final LN;
        // where the chunk ends before the model does, the next LN1 is on the next stage. On rows
        // [r0, r0 + n): all of them, or a part as it lands
        const LayerActs next = model_end || chunk_end ? LayerActs{} : acts_for(m, s, chunk, l + 1);
        const LayerTensors<floatX>* wn = model_end || chunk_end ? nullptr : &m.p.layers[l + 1];
        auto block_end = [&m, a, next, wn, model_end, chunk_end, row0, C](size_t r0, int n) {
            if (model_end) {
                fused_residual_norm_forward(m, a.residual3 + r0 * C, m.lnf + (row0 + r0) * C, m.lnf_mean + r0,
                                            m.lnf_rstd + r0, a.residual2 + r0 * C, m.scratch + r0 * C, m.p.lnfw, m.p.lnfb, n);
            } else if (chunk_end) {
                residual_forward(a.residual3 + r0 * C, a.residual2 + r0 * C, m.scratch + r0 * C, (long)n * C);
            } else {
                fused_residual_norm_forward(m, a.residual3 + r0 * C, next.ln1 + r0 * C, next.ln1_mean + r0, next.ln1_rstd + r0,
                                            a.residual2 + r0 * C, m.scratch + r0 * C, wn->ln1w, wn->ln1b, n);
            }
        };
        if (parts.K) {
            const floatX* bias = m.p.layers[l].fcprojb;
            parts.land = [&m, &parts, block_end, bias, C](int k) {
                row_parallel_finish(m, parts.into[k], bias, 1, parts.rows, C, false);
                block_end((size_t)k * parts.rows, parts.rows);
            };
            if (model_end || chunk_end || !forward_parts_carry(m, l + 1)) parts_land_all(parts);
        } else {
            block_end(0, rows);
        }
        if (!model_end && !chunk_end) a = next;
        forward_block_done(m, chunk, s.mb, l);
        // what the next block's iteration needs: its successor, or the final LN
        if (l + 2 < l1 || (l + 2 == l1 && l1 == L)) params_prefetch(m, l + 3);
    }
    if (!pp.last_vs(chunk)) return;
    head_forward(m, s, s.acts.back().residual3);
    params_done(m, final_ln);
}

// The experts' weight gradients from the rows of source rank p, into leaf p (--ep: the rows of ep
// rank p go to leaf p, which folds as that rank's micro-batch (stages 2-3) or its step's
// micro-batches (stages 0-1, a leaf accumulator per source) would: zero.h's reduce_scatter_add /
// _sum). Each leaf is a sum of its own: the sources may come in any order.
static void expert_weight_grads(GPT& m, int l, const LayerActs& a, const LayerGrads& d, int p) {
    const GPTConfig& c = m.config;
    const LocalShape& ls = m.ls;
    const int C = c.n_embd, He = ls.expert_hidden, cap = c.moe_capacity(m.B, m.T);
    const LayerTensors<float>& dw = m.g.layers[l];
    const int seg = m.seg_local[c.n_layer + 2 + l];
    const size_t rows = (size_t)p * ls.n_expert * cap, at = m.zero.leaf_at(seg, p);
    auto leaf = [&](float* g) { return g ? g + at : nullptr; };  // (no biases: --bias qkv / none)
    matmul_backward_batched((floatX*)nullptr, dw.fcprojw + at, leaf(dw.fcprojb), d.d_ffn_out + rows * C,
                            a.fch_act + rows * He, (const floatX*)nullptr, ls.n_expert, cap, He, C);
    matmul_backward_batched((floatX*)nullptr, dw.fcw + at, leaf(dw.fcb), d.d_fch + rows * 2 * He,
                            a.expert_in + rows * C, (const floatX*)nullptr, ls.n_expert, cap, C, 2 * He);
}
// Weight gradients of block l's FFN branch, from its output gradients d (ffn_weight_grads: and
// LN2's). behind: the reduction of d.d_ln2 (tensor parallel) in flight, moved on between the matmuls.
// done_source: an MoE layer's source whose experts' gradients layer_backward computed already (-1: none).
static void ffn_weight_matmuls(GPT& m, int l, const LayerActs& a, const LayerGrads& d,
                               TpSumPending<floatX>* behind = nullptr, int done_source = -1) {
    const GPTConfig& c = m.config;
    const LocalShape& ls = m.ls;
    const int BT = m.B * m.T, C = c.n_embd;
    const LayerTensors<float>& dw = m.g.layers[l];
    if (c.is_moe(l)) {
        const int E = c.n_expert;
        for (int p = 0; p < ls.ep; p++)
            if (p != done_source) expert_weight_grads(m, l, a, d, p);
        moe_router_backward((floatX*)nullptr, dw.routerw, d.d_moe_scores, a.moe_scores, ln_gathered(m, a.ln2, 1),
                            (const floatX*)nullptr, BT, C, E);
    } else {
        auto proj = [&] {
            matmul_backward((floatX*)nullptr, dw.fcprojw, dw.fcprojb, d.d_ffn_out, a.fch_act, (const floatX*)nullptr, BT,
                            ls.ffn, C, dense_dweight_split(c, ls, BT, DW_FC_PROJ));
        };
        auto fc = [&] {
            matmul_backward((floatX*)nullptr, dw.fcw, dw.fcb, d.d_fch, ln_gathered(m, a.ln2, 1), (const floatX*)nullptr, BT,
                            C, ls.fc(c.mlp), dense_dweight_split(c, ls, BT, DW_FC));
        };
        // the reduction behind moves on after the larger matmul (fc's: as large, or twice with
        // SwiGLU), so its exchange has arrived; --sp: after the projection's, which hides LN2's
        // gather that fc's reads (each weight's sum is its own: the order of the two is free)
        const bool fc_first = behind && !ls.sp;
        if (fc_first) fc();
        else proj();
        if (behind) tp_advance(*behind);
        if (fc_first) proj();
        else fc();
    }
}
static void ffn_norm_grads(GPT& m, int l, const LayerActs& a, const LayerGrads& d) {
    const LayerTensors<float>& dw = m.g.layers[l];
    norm_weight_grads(m, dw.ln2w, dw.ln2b, d.d_ln2, a.residual2, a.ln2_mean, a.ln2_rstd);
}
static void ffn_weight_grads(GPT& m, int l, const LayerActs& a, const LayerGrads& d) {
    ffn_weight_matmuls(m, l, a, d);
    ffn_norm_grads(m, l, a, d);
}
// Weight gradients of block l's attention branch (attn_weight_grads: and LN1's; x: the block's
// input). behind: the reduction of d.d_ln1, as ffn_weight_matmuls'.
static void attn_weight_matmuls(GPT& m, int l, const LayerActs& a, const LayerGrads& d,
                                TpSumPending<floatX>* behind = nullptr) {
    const LocalShape& ls = m.ls;
    const int BT = m.B * m.T, C = m.config.n_embd;
    const LayerTensors<float>& dw = m.g.layers[l];
    const GPTConfig& c = m.config;
    // (each dweight splits over B*T where its whole weight has too few tiles: dense_dweight_split)
    auto proj = [&] {
        matmul_backward((floatX*)nullptr, dw.attprojw, dw.attprojb, d.d_attn_out, a.atty, (const floatX*)nullptr, BT,
                        ls.n_head * ls.hs, C, dense_dweight_split(c, ls, BT, DW_ATTN_PROJ));
    };
    auto qkv = [&] {
        matmul_backward((floatX*)nullptr, dw.qkvw, dw.qkvb, d.d_qkv, ln_gathered(m, a.ln1, 0), (const floatX*)nullptr, BT,
                        C, ls.qkv(), dense_dweight_split(c, ls, BT, DW_QKV));
    };
    const bool qkv_first = behind && !ls.sp;  // (as ffn_weight_matmuls: qkv's is the larger)
    if (qkv_first) qkv();
    else proj();
    if (behind) tp_advance(*behind);
    if (qkv_first) proj();
    else qkv();
}
static void attn_norm_grads(GPT& m, int l, const LayerActs& a, const LayerGrads& d, const floatX* x) {
    const LayerTensors<float>& dw = m.g.layers[l];
    norm_weight_grads(m, dw.ln1w, dw.ln1b, d.d_ln1, x, a.ln1_mean, a.ln1_rstd);
}
static void attn_weight_grads(GPT& m, int l, const LayerActs& a, const LayerGrads& d, const floatX* x) {
    attn_weight_matmuls(m, l, a, d);
    attn_norm_grads(m, l, a, d, x);
}

static void layer_backward_halves(GPT& m, int l, const LayerActs& a, const floatX* x, const int* doc_start,
                                  floatX* dres, LayerGrads& d, bool stash);
// The input-gradient half of block l's backward: dres (the residual stream's gradient at the block
// output, the rank's stream rows) becomes the gradient at its input; the output gradients the
// weight gradients need go to d (stash: copies of the stream's, which changes; otherwise d aliases
// it, and the weight gradients are computed at once, before the stream changes). With --sp the
// branch outputs' gradients are gathered over the tp group first (the backward of the
// reduce-scatter) and the column-parallel input gradients reduce-scattered back to stream rows.
// Tensor parallel without --sp, a dense block: in two halves (layer_backward_halves).
static void layer_backward(GPT& m, int l, const LayerActs& a, const floatX* x, const int* doc_start, floatX* dres,
                           LayerGrads& d, bool stash) {
    const GPTConfig& c = m.config;
    const LocalShape& ls = m.ls;
    const int B = m.B, T = m.T, BT = B * T, C = c.n_embd, rows = stream_rows(m);
    const size_t row0 = sp_row0(m);
    const LayerTensors<floatX>& w = m.p.layers[l];
    const size_t stream_bytes = (size_t)rows * C * sizeof(floatX);
    if (forward_parts(m, l) > 0 && comm_world().tp_kv.size == 1) {
        layer_backward_halves(m, l, a, x, doc_start, dres, d, stash);
        return;
    }
    // the gradient at a branch output for all B*T tokens: the stream's (copied when stashed)
    auto branch_grad = [&](floatX* stash_buf) -> floatX* {
        if (ls.sp) return sp_gather_from(m, stash ? stash_buf : m.tp_full, dres);
        if (!stash) return dres;
        copy_buffer(stash_buf, dres, stream_bytes);
        return stash_buf;
    };
    // what d_ln2 waits for, in flight behind the weight gradients: tensor parallel, its reduction (an
    // MoE layer's are done in its expert loop); expert parallel, the experts' input gradients' return
    TpSumPending<floatX> dln2;
    std::vector<CommRequest> moe_back;
    if (c.is_moe(l)) {
        const int E = c.n_expert, He = ls.expert_hidden, cap = c.moe_capacity(B, T);
        const floatX* dout = ls.sp ? sp_gather_from(m, m.tp_full, dres) : dres;
        // the experts' rows' output gradients go to the owners (--ep) and their input gradients back
        moe_combine_backward(expert_dispatch_buffer(m, d.d_ffn_out), d.d_moe_scores, dout, a.expert_out, a.moe_scores,
                             a.expert_tokens, a.token_slots, BT, E, cap, C);
        // (as in the forward: the own rows first, the others' slice by slice, back the own last)
        const int own = comm_world().ep.rank, Ne = ls.n_expert;
        std::vector<CommRequest> dispatch = expert_dispatch_start(m, d.d_ffn_out, C);
        auto expert_proj_dinp = [&](int p, int j0, int n) {  // experts [j0, j0 + n) on source p's rows
            const size_t rows = ((size_t)p * Ne + j0) * cap;
            matmul_backward_batched(m.d_fch_act + rows * He, (float*)nullptr, (float*)nullptr, d.d_ffn_out + rows * C,
                                    a.fch_act + rows * He, w.fcprojw + (size_t)j0 * C * He, n, cap, He, C);
            swiglu_backward(d.d_fch + rows * 2 * He, m.d_fch_act + rows * He, a.fch + rows * 2 * He, n * cap, He);
        };
        expert_proj_dinp(own, 0, Ne);
        // the own rows' weight gradients too, behind the dispatch (the others' behind the return)
        if (ls.ep > 1 && !stash) expert_weight_grads(m, l, a, d, own);
        for (int j = 0; j < (int)dispatch.size(); j++) {
            comm_finish(dispatch[j]);
            for (int p = 0; p < ls.ep; p++)
                if (p != own) expert_proj_dinp(p, j, 1);
        }
        auto expert_fc_dinp = [&](floatX* out, int p, int j0, int n) {
            const size_t rows = ((size_t)p * Ne + j0) * cap;
            column_parallel_dinp(m, out + rows * C, d.d_fch + rows * 2 * He, w.fcw + (size_t)j0 * 2 * He * C, n, cap, C,
                                 2 * He, m.split_expert, [&](int k) { return fc_leaf_rows(m, k, true); }, false);
        };
        for (int j = 0; j < Ne && ls.ep > 1; j++) {
            for (int p = 0; p < ls.ep; p++)
                if (p != own) expert_fc_dinp(m.ep_buf, p, j, 1);
            moe_back.push_back(expert_return_start(m, m.d_expert_in, C, j));
        }
        expert_fc_dinp(m.d_expert_in, own, 0, Ne);
    } else {
        const int H = ls.ffn;
        d.d_ffn_out = branch_grad(d.d_ffn_out);
        matmul_backward(m.d_fch_act, (float*)nullptr, (float*)nullptr, d.d_ffn_out, a.fch_act, w.fcprojw, BT, H, C);
        if (c.mlp == MLP_SWIGLU) swiglu_backward(d.d_fch, m.d_fch_act, a.fch, BT, H);
        else gelu_backward(d.d_fch, m.d_fch_act, a.fch, (long)BT * H);
        if (!stash) ln_gather_start(m, a.ln2, 1);  // (--sp: fc's weight gradient input, behind the matmul below)
        dln2 = column_parallel_dinp_start(m, m.tpx, d.d_ln2, d.d_fch, w.fcw, 1, BT, C, ls.fc(c.mlp), m.split_ffn,
                                          [&](int j) { return fc_leaf_rows(m, j, false); }, ls.sp);
    }
    if (!stash) ffn_weight_matmuls(m, l, a, d, &dln2, c.is_moe(l) && ls.ep > 1 ? comm_world().ep.rank : -1);
    tp_finish(dln2);
    if (c.is_moe(l)) {
        for (CommRequest& r : moe_back) comm_finish(r);
        // every rank has the whole d_ln2 (all tokens); with --sp it keeps its rows
        const int E = c.n_expert, cap = c.moe_capacity(B, T);
        floatX* d_ln2_all = ls.sp ? m.tp_full : d.d_ln2;
        buffer_zero(d_ln2_all, (size_t)BT * C * sizeof(floatX));
        moe_gather_backward(d_ln2_all, m.d_expert_in, a.token_slots, BT, E, cap, C);
        moe_router_backward(d_ln2_all, (float*)nullptr, d.d_moe_scores, a.moe_scores, ln_gathered(m, a.ln2, 1), w.routerw,
                            BT, C, E);
        if (ls.sp) copy_buffer(d.d_ln2, d_ln2_all + row0 * C, stream_bytes);
    }
    if (!stash) {
        ffn_norm_grads(m, l, a, d);
        ffn_grads_ready(m, l);  // (ZeRO: the FFN half's reduction runs behind the attention's backward)
    }
    norm_backward(m, dres, d.d_ln2, a.residual2, w.ln2w, a.ln2_mean, a.ln2_rstd, rows);
    // dres = dL/d residual2 now; the attention branch
    d.d_attn_out = branch_grad(d.d_attn_out);
    matmul_backward(m.d_atty, (float*)nullptr, (float*)nullptr, d.d_attn_out, a.atty, w.attprojw, BT,
                    ls.n_head * ls.hs, C);
    tp_attention_backward(m, d.d_qkv, m.d_atty, a, doc_start);
    if (c.pos == POS_ROPE) rope_backward(d.d_qkv, doc_start, m.rope_cos_sin, B, T, ls.n_head, ls.n_kv_head, ls.hs);
    if (!stash) ln_gather_start(m, a.ln1, 0);
    TpSumPending<floatX> dln1 = column_parallel_dinp_start(m, m.tpx, d.d_ln1, d.d_qkv, w.qkvw, 1, BT, C, ls.qkv(),
                                                           m.split_attn, [&](int j) { return qkv_leaf_rows(m, j); }, ls.sp);
    if (!stash) attn_weight_matmuls(m, l, a, d, &dln1);
    tp_finish(dln1);
    if (!stash) attn_norm_grads(m, l, a, d, x);
    norm_backward(m, dres, d.d_ln1, x, w.ln1w, a.ln1_mean, a.ln1_rstd, rows);
}

// layer_backward of a dense block under tensor parallelism (without --sp, each kv head on one rank)
// in two halves of the micro-batch's sequences, as block_forward_parts: half 0's input-gradient
// reduction in flight behind half 1's input-gradient compute, half 1's behind the weight gradients
// (whole: a weight gradient sums over every token, in its order), each branch in turn.
static void layer_backward_halves(GPT& m, int l, const LayerActs& a, const floatX* x, const int* doc_start,
                                  floatX* dres, LayerGrads& d, bool stash) {
    const GPTConfig& c = m.config;
    const LocalShape& ls = m.ls;
    const int Bh = m.B / 2, T = m.T, Th = Bh * T, BT = m.B * T, C = c.n_embd, H = ls.ffn, fc = ls.fc(c.mlp);
    const int qkv = ls.qkv(), A = ls.n_head * ls.hs;
    const LayerTensors<floatX>& w = m.p.layers[l];
    TpScratch<floatX> second = tp_scratch_lane(m.tpx, (size_t)Th * C, ls.tp, 1);
    auto branch_grad = [&](floatX* stash_buf) -> floatX* {  // (layer_backward's, without --sp)
        if (!stash) return dres;
        copy_buffer(stash_buf, dres, (size_t)BT * C * sizeof(floatX));
        return stash_buf;
    };
    TpSumPending<floatX> red[2];
    d.d_ffn_out = branch_grad(d.d_ffn_out);
    for (int h = 0; h < 2; h++) {
        const size_t r0 = (size_t)h * Th;
        matmul_backward(m.d_fch_act + r0 * H, (float*)nullptr, (float*)nullptr, d.d_ffn_out + r0 * C, a.fch_act + r0 * H,
                        w.fcprojw, Th, H, C);
        if (c.mlp == MLP_SWIGLU) swiglu_backward(d.d_fch + r0 * fc, m.d_fch_act + r0 * H, a.fch + r0 * fc, Th, H);
        else gelu_backward(d.d_fch + r0 * fc, m.d_fch_act + r0 * H, a.fch + r0 * fc, (long)Th * H);
        tp_advance(red[1 - h]);
        red[h] = column_parallel_dinp_start(m, h ? second : m.tpx, d.d_ln2 + r0 * C, d.d_fch + r0 * fc, w.fcw, 1, Th, C,
                                            fc, m.split_ffn, [&](int j) { return fc_leaf_rows(m, j, false); }, false);
    }
    if (!stash) ffn_weight_matmuls(m, l, a, d, &red[1]);
    // LN2's backward per row: half 0's behind half 1's reduction (after the weight gradients,
    // which read dres: d aliases it)
    auto ln2_backward = [&](int h) {
        const size_t r0 = (size_t)h * Th;
        norm_backward(m, dres + r0 * C, d.d_ln2 + r0 * C, a.residual2 + r0 * C, w.ln2w, a.ln2_mean + r0, a.ln2_rstd + r0, Th);
    };
    tp_finish(red[0]);
    ln2_backward(0);
    tp_finish(red[1]);
    if (!stash) {
        ffn_norm_grads(m, l, a, d);
        ffn_grads_ready(m, l);  // (ZeRO: the FFN half's reduction runs behind the attention's backward)
    }
    ln2_backward(1);
    d.d_attn_out = branch_grad(d.d_attn_out);
    for (int h = 0; h < 2; h++) {
        const size_t r0 = (size_t)h * Th;
        const int* ds = doc_start + r0;
        floatX* dq = d.d_qkv + r0 * qkv;
        matmul_backward(m.d_atty + r0 * A, (float*)nullptr, (float*)nullptr, d.d_attn_out + r0 * C, a.atty + r0 * A,
                        w.attprojw, Th, A, C);
        attention_backward(dq, m.d_atty + r0 * A, a.qkv + r0 * qkv, a.atty + r0 * A, a.att_lse + r0 * ls.n_head, ds, Bh, T,
                           ls.n_head, ls.n_kv_head, ls.hs, c.pos == POS_ALIBI ? c.n_head : 0, ls.head0);
        if (c.pos == POS_ROPE) rope_backward(dq, ds, m.rope_cos_sin, Bh, T, ls.n_head, ls.n_kv_head, ls.hs);
        tp_advance(red[1 - h]);
        red[h] = column_parallel_dinp_start(m, h ? second : m.tpx, d.d_ln1 + r0 * C, dq, w.qkvw, 1, Th, C, qkv,
                                            m.split_attn, [&](int j) { return qkv_leaf_rows(m, j); }, false);
    }
    if (!stash) attn_weight_matmuls(m, l, a, d, &red[1]);
    auto ln1_backward = [&](int h) {
        const size_t r0 = (size_t)h * Th;
        norm_backward(m, dres + r0 * C, d.d_ln1 + r0 * C, x + r0 * C, w.ln1w, a.ln1_mean + r0, a.ln1_rstd + r0, Th);
    };
    tp_finish(red[0]);
    ln1_backward(0);
    tp_finish(red[1]);
    if (!stash) attn_norm_grads(m, l, a, d, x);
    ln1_backward(1);
}

// the embedding's weight gradients (the token and position tables), from the gradient at its
// output (all tokens: gathered with --sp; each rank adds its vocabulary rows' part)
static void embedding_weight_grads(GPT& m, const ChunkSlot& s) {
    grads_needed(m, 0);
    const floatX* dout = m.ls.sp ? sp_gather_from(m, m.tp_full, s.d_stream) : s.d_stream;
    encoder_backward(m.g.wte, m.g.wpe, dout, s.inputs, s.doc_start, m.B, m.T, m.config.n_embd, m.ls.vocab0, m.ls.vocab);
    grads_ready(m, 0);
}

// B: the chunk's backward from the gradient at its output (slot.d_stream) to the gradient at its
// input (left in slot.d_stream: sent to the previous stage, or the embedding's on virtual stage 0).
// with_weights: the weight gradients too, layer by layer (each block's leaf folded as it completes);
// otherwise their inputs go to a stash for chunk_weights.
static void chunk_backward(GPT& m, int chunk, int mb, bool with_weights) {
    const PipelinePlan& pp = m.pipe;
    ChunkSlot& s = slot_for(m, chunk, mb);
    ChunkStash* st = with_weights ? nullptr : &stash_for(m, chunk, mb);
    const int l0 = pp.layer_begin(chunk), l1 = pp.layer_end(chunk);
    for (int l = l1 - 1; l >= l0; l--) {
        params_needed(m, l + 1);
        backward_block_prefetch(m, chunk, l);
        if (with_weights) grads_needed(m, l + 1);
        const floatX* x = l == l0 ? s.input : s.acts[l - l0 - 1].residual3;
        LayerActs a = acts_for(m, s, chunk, l);
        recompute_block(m, l, a, x, s.doc_start);
        LayerGrads scratch = m.layer_douts;  // (a copy: the dense branches point it at the stream)
        layer_backward(m, l, a, x, s.doc_start, s.d_stream, st ? st->layers[l - l0] : scratch, st != nullptr);
        backward_block_done(m, chunk, l);
        if (with_weights) grads_ready(m, l + 1);
    }
    if (with_weights && pp.first_vs(chunk)) embedding_weight_grads(m, s);
}

// W: the weight gradients of a chunk from its stash (zero-bubble schedules), each block's leaf
// folded as it completes. already_done: the backward computed them (the schedule ran W right
// after B).
static void chunk_weights(GPT& m, int chunk, int mb, bool already_done) {
    const PipelinePlan& pp = m.pipe;
    ChunkSlot& s = slot_for(m, chunk, mb);
    if (!already_done) {
        ChunkStash& st = stash_for(m, chunk, mb);
        const int l0 = pp.layer_begin(chunk), l1 = pp.layer_end(chunk);
        for (int l = l1 - 1; l >= l0; l--) {
            const floatX* x = l == l0 ? s.input : s.acts[l - l0 - 1].residual3;
            LayerActs a = acts_for(m, s, chunk, l);
            if (m.recompute > 0) {  // the weight gradients read activations too: recompute them again
                params_needed(m, l + 1);
                recompute_block(m, l, a, x, s.doc_start);
                params_done(m, l + 1);
            }
            grads_needed(m, l + 1);
            ffn_weight_grads(m, l, a, st.layers[l - l0]);
            ffn_grads_ready(m, l);
            attn_weight_grads(m, l, a, st.layers[l - l0], x);
            grads_ready(m, l + 1);
        }
        if (pp.first_vs(chunk)) embedding_weight_grads(m, s);
        st.mb = -1;
    }
}
// the micro-batch has left the chunk (after its last action: its W, or a send deferred past it);
// where its gradient may still be on its way to the previous stage, the slot takes the spare
// d_stream and the gradient's buffer becomes the spare (the executor completes that send before
// the buffer is written again: PipeModel::d_stream)
static void release_slot(GPT& m, int chunk, int mb) {
    ChunkSlot& s = slot_for(m, chunk, mb);
    s.mb = -1;
    if (m.d_stream_spare[chunk]) std::swap(s.d_stream, m.d_stream_spare[chunk]);
}

// block l's activations from the latest forward (this stage's layers; tests)
[[maybe_unused]] static const LayerActs& gpt_layer_acts(const GPT& m, int l) {
    for (int ch = 0; ch < m.pipe.V; ch++)
        if (l >= m.pipe.layer_begin(ch) && l < m.pipe.layer_end(ch) && m.last_forward[ch])
            return m.last_forward[ch]->acts[l - m.pipe.layer_begin(ch)];
    LLMC_FAIL("internal: layer %d has no forward on this stage", l);
}

// Forward of one micro-batch through the pipeline (every stage calls it; activations flow stage
// to stage). With targets, returns the mean loss over targets != -1 on the last stage (0 on the
// others); with dloss_scale != 0 the head's backward runs too and gpt_backward can follow (one
// stage). Without targets the last stage hands the logits, token chunk by token chunk, to `sink`.
static float gpt_forward(GPT& m, const int* inputs, const int* targets, const int* doc_start, int B, int T,
                         float dloss_scale = 0.0f, const LogitsSink& sink = LogitsSink()) {
    // a forward's buffers hold max_B x max_T tokens in any shape (the sampler's one long row); the
    // experts' capacity depends on the shape, so an MoE model keeps to max_B and max_T
    LLMC_CHECK((int64_t)B * T <= (int64_t)m.max_B * m.max_T &&
                   (m.config.pos != POS_LEARNED || T <= m.config.max_seq_len) &&
                   (m.config.n_expert == 0 || (B <= m.max_B && T <= m.max_T)),
               "internal: a forward of %dx%d tokens does not fit the buffers of %dx%d (or the position table)", B, T,
               m.max_B, m.max_T);
    bind_op_scratch(m);
    LLMC_CHECK(!m.ls.sp || ((int64_t)B * T) % m.ls.tp == 0, "--sp: a forward of %dx%d tokens does not split over --tp %d",
               B, T, m.ls.tp);
    m.B = B;
    m.T = T;
    m.batches = {MicroBatch{inputs, targets, doc_start}};
    m.dloss_scale = targets ? dloss_scale : 0.0f;
    m.logits_sink = sink;
    release_all_slots(m);
    const PipelinePlan& pp = m.pipe;
    float loss = 0.0f;
    for (int c = 0; c < pp.V; c++) {
        const int vs = pp.vs(c);
        if (!pp.first_vs(c)) p2p_group(comm_world().pp, {pipe_transfer(m, {PIPE_RECV_ACT, 0, c, (vs - 1) % pp.P})});
        chunk_forward(m, c, slot_for(m, c, 0));
        if (pp.last_vs(c)) {
            if (targets) {
                queue_losses(m, 1);
                loss = (float)take_losses(m)[0];
            }
        } else p2p_group(comm_world().pp, {pipe_transfer(m, {PIPE_SEND_ACT, 0, c, (vs + 1) % pp.P})});
    }
    return loss;
}

// Every token's logits of a forward without targets, on the host: [B*T, the rank's vocabulary
// slice] (for tests and tools; the lm head itself never holds them whole).
[[maybe_unused]] static std::vector<floatX> gpt_logits(GPT& m, const int* inputs, const int* doc_start, int B, int T) {
    const size_t Vl = m.ls.vocab;
    std::vector<floatX> out((size_t)B * T * Vl);
    gpt_forward(m, inputs, nullptr, doc_start, B, T, 0.0f, [&](int t0, int n, const floatX* chunk) {
        copy_from_buffer(out.data() + t0 * Vl, chunk, n * Vl * sizeof(floatX));
    });
    return out;
}

// Backward of the last gpt_forward (one stage; it must have been given dloss_scale != 0): this
// micro-batch's parameter gradients are written segment by segment and each is added, once
// complete, into the fp32 accumulators (zero them once per optimizer step with gpt_zero_grad).
[[maybe_unused]] static void gpt_backward(GPT& m) {
    LLMC_CHECK(m.pipe.P == 1 && m.dloss_scale != 0.0f, "internal: gpt_backward needs one stage and a forward with a loss scale");
    chunk_backward(m, 0, 0, true);
    release_slot(m, 0, 0);
}

// One optimizer step's forwards and backwards over the step's micro-batches, in the order of this
// stage's schedule (llmc/parallel/pipeline.h); the last stage's losses land in m.mb_loss.
static PipeTimes gpt_pipeline_step(GPT& m, const std::vector<MicroBatch>& batches, int B, int T, float dloss_scale,
                                   bool measure, std::vector<PipeEvent>* trace) {
    LLMC_CHECK((int)batches.size() == m.pipe.M, "internal: %zu micro-batches for a schedule of %d", batches.size(), m.pipe.M);
    bind_op_scratch(m);
    m.B = B;
    m.T = T;
    m.batches = batches;
    m.dloss_scale = dloss_scale;
    m.logits_sink = LogitsSink();
    m.mb_loss.assign(batches.size(), 0.0);
    release_all_slots(m);
    PipeModel pm;
    pm.forward = [&](int mb, int c) { pass_begin(m, PIPE_F, mb, c); chunk_forward(m, c, slot_for(m, c, mb)); };
    pm.backward = [&](int mb, int c, bool with_weights) { pass_begin(m, PIPE_B, mb, c); chunk_backward(m, c, mb, with_weights); };
    pm.weights = [&](int mb, int c, bool done) { pass_begin(m, PIPE_W, mb, c); chunk_weights(m, c, mb, done); };
    pm.release = [&](int mb, int c) {
        release_slot(m, c, mb);
        grad_block_done(m, mb);
    };
    pm.transfer = [&](const PipeAction& a) { return pipe_transfer(m, a); };
    pm.d_stream = [&](int mb, int c) { return (const void*)slot_for(m, c, mb).d_stream; };
    pm.sync = backend_sync;
    zero_step_begin(m);
    const PipeTimes times = pipeline_execute(m.pipe.schedule[m.pipe.stage], comm_world().pp, pm, measure, trace);
    zero_step_end(m);
    if (m.pipe.has_head()) queue_losses(m, (int)batches.size());  // read after the norm's host sync: gpt_step_losses
    return times;
}

// the step's gradient starts at zero (and so do its reductions)
static void gpt_zero_grad(GPT& m) {
    zero_drain(m);  // (what a backward whose norm was never taken left in flight; the segments' progress)
    zero_clear_grads(m);
    if (m.head_acc) buffer_zero(m.head_acc, head_acc_elems(m) * sizeof(float));
    grad_blocks_reset(m);
}

struct OptimizerConfig {
    float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f, grad_clip = 1.0f;
};

// The optimizer step, after the step's last backward, in two parts so the training loop can
// look at the norm (and the loss) before deciding to update: a step with a non-finite loss or
// norm is skipped (see train_main).
// gpt_grad_norm: (ZeRO stages 0-1) completes the segments' reductions, adds the lm head's part of
// the tied embedding's gradient where it comes after them and the blocks' sum (--grad_blocks);
// returns the norm of the whole model's gradient, every stage's (collective over the world). At
// stage 0 the all-gathers of the reduced slices are still in flight: the norm reads only the
// rank's own, and each segment's update waits for its gather (zero_update). poison: the tests'
// fault injection, an inf in this rank's gradient (as an fp16 overflow on one rank leaves).
static float gpt_grad_norm(GPT& m, bool poison = false) {
    bind_op_scratch(m);
    zero_reduce_finish(m);
    tied_embedding_sum(m);
    grad_blocks_finish(m);
    if (poison) {
        const size_t at = first_counted_grad(m.zero, m.norm_skip);
        const float inf = INFINITY;
        if (at != SIZE_MAX) copy_to_buffer(m.grad_acc + at, &inf, sizeof(inf));
    }
    return (float)std::sqrt(grad_norm_squared(m.zero, m.grad_acc, m.norm_skip, norm_per_chunk, add_squares, squares_of));
}
// gpt_apply_update: global-norm clipping (PyTorch's rule: scale = min(1, clip / (norm + 1e-6)),
// norm the unscaled gradient's) and AdamW on what this rank updates, the gradient divided by the
// loss scale it was computed with (llmc/loss_scaler.h) in the same multiply; stages 1-2 then start the all-gather of the updated
// parameters (each segment's completes at its first use: params_needed); at stage 0 with dp > 1
// each segment's update runs at its first use, when its gradient's all-gather is in; the last
// pipeline stage gets the tied embedding's new weights. step is 0-based.
static void gpt_apply_update(GPT& m, const OptimizerConfig& o, float lr, int step, float norm, float loss_scale = 1.0f) {
    bind_op_scratch(m);
    zero_settle_params(m);  // -z 1/2's param gathers in flight (only without a forward since), the tied head's copy
    params_drop_all(m);  // -z 3: the slots hold the params before the update
    const float clip = o.grad_clip > 0 ? std::min(1.0f, o.grad_clip / (norm + 1e-6f)) : 1.0f;
    const float scale = clip / loss_scale;  // (exact for a power-of-two loss scale)
    // stochastic rounding of bf16 params: a fresh seed per step; element i of the table draws its
    // bits from step_seed + i, so the result does not depend on how tensors are split or sharded
    const uint64_t step_seed = Rng(0xADA3ull ^ ((uint64_t)step * 0x9E3779B97F4A7C15ull)).next_u64();
    if (m.offload == OFFLOAD_OPTIMIZER) {  // the same step on the CPU, the state in host memory (llmc/parallel/offload.h)
        zero_settle(m);  // (-z 0's gradient gathers)
        offload_adamw_step<OffloadCopies>(m.update_pieces, m.params, m.grad_acc, m.master, m.adam_m, m.adam_v, m.grad_staging, lr,
                           o.beta1, o.beta2, o.eps, o.weight_decay, scale, step + 1, step_seed);
        zero_gather_params(m);
    } else {  // the pieces in a few calls (the GPU's: a few multi-tensor launches each), -z 1/2's gathers behind them
        zero_update(m, [&m, o, lr, step, scale, step_seed](const std::vector<int>& which) {
            std::vector<cpu::AdamwPiece> pieces;
            for (int k : which) {
                const UpdatePiece& u = m.update_pieces[k];
                pieces.push_back({u.param_index, u.state_index, u.acc_index, u.n, u.table_offset, u.decay});
            }
            if (!pieces.empty())
                adamw_update_pieces(m.params, m.master, m.grad_acc, m.adam_m, m.adam_v, pieces.data(), (int)pieces.size(), lr,
                                    o.beta1, o.beta2, o.eps, o.weight_decay, scale, step + 1, step_seed);
        });
    }
    tied_embedding_refresh(m);
}
[[maybe_unused]] static float gpt_update(GPT& m, const OptimizerConfig& o, float lr, int step) {
    const float norm = gpt_grad_norm(m);
    gpt_apply_update(m, o, lr, step, norm);
    zero_settle(m);
    return norm;
}

// ----------------------------------------------------------------------------------------------
// The run (llmc/gpt/): the plan and the allocation, the state and its files, the command line,
// measurements, sampling, reports, the driver's steps; then the training step and train_main
#include "llmc/gpt/plan.h"
#include "llmc/gpt/state.h"
#include "llmc/gpt/flags.h"
#include "llmc/gpt/metrics.h"
#include "llmc/gpt/sample.h"
#include "llmc/gpt/report.h"
#include "llmc/gpt/driver.h"

// One optimizer step of the run: the step's micro-batches from the loader, their forwards and
// backwards through the pipeline schedule (the loss's gradient times the loss scale), the loss in
// global micro-batch order, the gradient norm, and the update unless the loss or the norm is not
// finite (that step is skipped; a dynamic loss scale halves on an overflow, llmc/loss_scaler.h).
static StepResult train_step(const Run& r, GPT& model, DataLoader& loader, StepBatches& b, int step, bool trace,
                             LossOutlierDetector& loss_spikes, LossScaler& scaler) {
    Comm& cm = comm_world();
    const auto t0 = std::chrono::steady_clock::now();
    const BackendCounts counts0 = backend_counts();
    comm_begin_step(cm, step + 1);
    comm_reset_counters(cm);
    if (const char* f = getenv("LLMC_FAULT_FAIL_RANK"))  // fault injection for the tests
        LLMC_CHECK(atoi(f) != cm.world_rank || step != b.start_step + 1, "fault injected on rank %d at step %d",
                   cm.world_rank, step + 1);
    StepResult s;
    gpt_zero_grad(model);
    for (int micro = 0; micro < r.grad_accum; micro++) {
        loader.next_batch(b.in[micro].data(), b.tgt[micro].data(), b.ds[micro].data());
        b.batches[micro] = {b.in[micro].data(), b.tgt[micro].data(), b.ds[micro].data()};
        s.flops += step_flops(model, b.ds[micro].data(), r.B, r.T, 1) / (r.n_stages * r.tp);  // this rank's share
    }
    std::vector<PipeEvent> events;
    std::vector<CommInterval> comm_events;  // the traced step's collectives and transfers, to the norm
    if (trace) barrier(cm.world);  // one time origin for every rank's timeline
    const double origin_s = comm_now_s();
    cm.trace = trace ? &comm_events : nullptr;
    s.loss_scale = scaler.scale;
    s.times = gpt_pipeline_step(model, grad_block_order(b.batches, model.grad_blocks), r.B, r.T,
                                s.loss_scale / r.global_micro, trace || host_timing_is_exact, trace ? &events : nullptr);
    // the norm's sums come back to the host with the step's one host sync (the GPU build), which the
    // losses' copy was queued before
    const char* poison = getenv("LLMC_FAULT_INF_GRAD");  // "rank:step", fault injection for the tests
    const float scaled_norm =
        gpt_grad_norm(model, poison && strfmt("%d:%d", cm.world_rank, step + 1) == poison);
    s.norm = scaled_norm / s.loss_scale;
    cm.trace = nullptr;
    if (trace) write_pipeline_trace(r.pp_trace, events, comm_events, origin_s, model.pipe);
    if (model.pipe.has_head()) model.mb_loss = global_order_of(take_losses(model), model.grad_blocks);
    s.loss = sum_in_global_order(model.mb_loss, r.global_micro) / r.global_micro;
    s.lr = r.sched.at(step);
    bool diverged = false;  // a non-finite gradient the loss scale cannot absorb
    const bool grads_ok = scaler.after_step(std::isfinite(scaled_norm), &diverged);
    s.overflow = !grads_ok && !diverged;
    s.bad = !std::isfinite(s.loss) || diverged;
    s.skipped = s.bad || s.overflow;
    if (!s.skipped) gpt_apply_update(model, r.opt, s.lr, step, s.norm, s.loss_scale);
    s.loss_z = loss_spikes.update(s.loss);
    // (no sync here: the update runs while the host loads the next step, whose norm waits for it;
    // so a GPU step's time is from one step's queueing to the next's, right on average)
    s.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const BackendCounts counts1 = backend_counts();
    s.counts = {counts1.launches - counts0.launches, counts1.host_syncs - counts0.host_syncs};
    return s;
}

// The whole training program (its steps: llmc/gpt/driver.h); main() only maps errors to exit
// codes. Returns the exit code.
[[maybe_unused]] static int train_main(int argc, char** argv) {
    Comm& cm = comm_world();
    const bool rank0 = cm.world_rank == 0;  // prints, writes log.jsonl
    Run r;
    if (!run_from_flags(argc, argv, r)) return 0;
    RunDirLock out_dir_lock;
    if (!r.eval_only) claim_run_dir(r, out_dir_lock);  // (an evaluation writes nothing there)
    Checkpoint ck;               // --resume: verified now, read after the allocation
    LlmcModelFile init_file;     // --init_from
    settle_config(r, ck, init_file);
    if (r.planning) {
        print_plan_only(r);
        return 0;
    }
    const PipelinePlan pipe = pipeline_plan(r.config, r.B, r.T, r.n_stages, r.pp_virtual, r.grad_accum, r.pp_kind,
                                            r.args.str("pp_layers"), cm.stage);
    const Layout layout = layout_of(r, pipe);
    const PlanInputs plan = plan_inputs_of(r, pipe);
    check_memory_fits(r.config, r.B, r.T, layout);  // before anything big is allocated
    RunData data;
    open_data(r, data);

    GPT model;
    if (r.tp > r.config.n_kv_head && r.tp % r.config.n_kv_head == 0) comm_make_kv_group(cm, r.tp / r.config.n_kv_head);
    const double in_use_before_model = device_bytes_in_use();
    gpt_allocate(model, r.config, r.B, r.T, layout);
    Rng sample_rng(r.seed ^ 0x5A5A5A5Aull);
    LossScaler scaler = r.loss_scale;  // the flags', or the checkpoint's state (start_model)
    const int start_step = start_model(model, r, ck, init_file, data, sample_rng, scaler);
    if (rank0) print_startup(r, model, data, plan, scaler);
    std::vector<int> in((size_t)r.B * r.T), tgt((size_t)r.B * r.T), ds((size_t)r.B * r.T);  // evaluation
    if (r.eval_only) {
        evaluate_and_report(r, model, data, start_step, nullptr, in, tgt, ds);
        gpt_free(model);
        return 0;
    }

    JsonlLogger log;  // a resume trims the log back to its step (llmc/io/logger.h says why)
    if (rank0) log.open_for_run(r.out_dir + "/log.jsonl", r.resume.empty() ? -1 : start_step);
    StepBatches batches(r.grad_accum, (size_t)r.B * r.T, start_step);
    // NaN/Inf policy: a step whose loss or gradient norm is not finite is skipped (no optimizer
    // update), counted and logged; max_bad_steps of them in a row stop the run (exit 1): it has
    // diverged, and the state is still the last good one (no checkpoint of a bad state is written).
    int bad_in_a_row = 0, bad_total = 0;
    LossOutlierDetector loss_spikes;  // z-score of the loss against the recent window (llmc/outlier.h)
    const auto run_t0 = std::chrono::steady_clock::now();  // elapsed and ETA of the step line
    for (int step = start_step; step < r.max_steps; step++) {
        const bool trace = !r.pp_trace.empty() && step + 1 == r.max_steps;  // (warm: the first step pays first touches)
        const StepResult s = train_step(r, model, data.train, batches, step, trace, loss_spikes, scaler);
        bad_in_a_row = s.bad ? bad_in_a_row + 1 : 0;
        bad_total += s.bad;
        if (rank0 && step == start_step) print_first_step(r, model, layout, in_use_before_model, step);
        report_step(r, model, step, start_step, s, bad_in_a_row, bad_total, run_t0, log);
        LLMC_CHECK(bad_in_a_row < r.max_bad_steps,
                   "step %d: %d consecutive steps had a non-finite loss or gradient norm (--max_bad_steps %d): the run "
                   "diverged. Those steps were skipped and no checkpoint of a bad state was written; lower --lr (or "
                   "raise --warmup, or lower --grad_clip) and resume from the last checkpoint in %s",
                   step + 1, bad_in_a_row, r.max_bad_steps, r.out_dir.c_str());
        if (after_step(r, model, data, sample_rng, scaler, step, bad_in_a_row, log, in, tgt, ds)) return STOP_EXIT_CODE;
    }
    finish_run(r, model);
    gpt_free(model);
    return 0;
}

#ifndef LLMC_NO_MAIN
// Any rank's error stops the whole job, with the rank named. An error every rank hits (a bad
// flag, a bad layout) is printed once: ranks other than 0 wait a moment, and rank 0's abort
// ends them first.
static int fail(const char* what) {
    const Comm& c = comm_world();
    if (c.world_size > 1) {
        if (c.world_rank != 0) sleep(2);
        fprintf(stderr, "error (rank %d of %d): %s\n", c.world_rank, c.world_size, what);
        fflush(stderr);
        comm_abort(1);
    } else {
        fprintf(stderr, "error: %s\n", what);
    }
    return 1;
}

int main(int argc, char** argv) {
    try {
        comm_init(&argc, &argv);
        // SIGINT / SIGTERM: stop after the step with a checkpoint (llmc/io/run_stop.h); installed until
        // the process ends, so a signal that comes after the stop was agreed does not kill it
        const StopSignals stop_signals;
        int rc = train_main(argc, argv);
        comm_finalize();
        return rc;
    } catch (const LlmcError& e) {
        return fail(e.what());
    } catch (const std::exception& e) {
        return fail(strfmt("internal error: %s", e.what()).c_str());
    }
}
#endif
