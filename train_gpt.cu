/*
train_gpt.cu: GPT training in one translation unit, read it top to bottom.

  1. the backend: which op implementations and which memory (CPU reference or CUDA)
  2. the model config and its parameter table (names, shapes, init, weight decay)
  3. the model: forward, backward, optimizer step
  4. the command line
  5. the training loop: data, evaluation, sampling, checkpoints, logs

The same file builds two programs:
  train_gpt_cpu  g++ -x c++ -DLLMC_CPU: fp32 everywhere, ops from llmc/cpu/<op>.h (the reference)
  train_gpt      nvcc: ops from llmc/<op>.cuh (bf16 activations, fp32 master weights)
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
#include "llmc/dataloader.h"
#include "llmc/tokenizer.h"
#include "llmc/llmc_format.h"
#include "llmc/schedulers.h"
#include "llmc/comm.h"
#include "llmc/checkpoint.h"
#include "llmc/logger.h"
#include "llmc/memory_guard.h"
#include "llmc/outlier.h"
#include "llmc/run_dir.h"
#include "llmc/run_stop.h"

// ----------------------------------------------------------------------------------------------
// 1. Backend

#ifdef LLMC_CPU
#include "llmc/cpu/encoder.h"
#include "llmc/cpu/layernorm.h"
#include "llmc/cpu/matmul.h"
#include "llmc/cpu/attention.h"
#include "llmc/cpu/mlp.h"
#include "llmc/cpu/classifier.h"
#include "llmc/cpu/adamw.h"
#include "llmc/cpu/global_norm.h"
#include "llmc/cpu/moe.h"
#include "llmc/cpu/accumulate.h"
using namespace cpu;
typedef float floatX;  // the element type of params, grads and activations
static const char* backend_name() { return "cpu (fp32 reference)"; }
static double peak_flops_per_s() { return 0; }  // unknown for a CPU: no MFU
// the ops run synchronously: the host clock times them exactly (pipeline idle fractions every step)
static constexpr bool host_timing_is_exact = true;
// where buffers live: host memory here, device memory in the CUDA build
// bytes handed out by buffer_alloc so far (the memory guard's test compares its estimate with it)
static size_t& buffer_bytes_allocated() {
    static size_t bytes = 0;
    return bytes;
}
// the host arenas of --offload optimizer (llmc/memory.h): host memory like the buffers, counted apart
static size_t& host_bytes_allocated() {
    static size_t bytes = 0;
    return bytes;
}
static void* counted_calloc(size_t& counter, size_t bytes) {
    counter += bytes;
    void* p = calloc(1, bytes);
    LLMC_CHECK(p, "out of memory allocating %zu bytes", bytes);
    return p;
}
static void* buffer_alloc(size_t bytes) { return counted_calloc(buffer_bytes_allocated(), bytes); }
static void buffer_free(void* p) { free(p); }
static void* host_buffer_alloc(size_t bytes) { return counted_calloc(host_bytes_allocated(), bytes); }
static void host_buffer_free(void* p) { free(p); }
static void buffer_zero(void* p, size_t bytes) { memset(p, 0, bytes); }
static void copy_to_buffer(void* dst, const void* src, size_t bytes) { memcpy(dst, src, bytes); }
static void copy_from_buffer(void* dst, const void* src, size_t bytes) { memcpy(dst, src, bytes); }
static void copy_buffer(void* dst, const void* src, size_t bytes) { memcpy(dst, src, bytes); }
// rows x width_bytes from src (rows src_pitch apart) to dst (dst_pitch apart)
static void copy_buffer_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width_bytes, size_t rows) {
    for (size_t r = 0; r < rows; r++) memcpy((char*)dst + r * dst_pitch, (const char*)src + r * src_pitch, width_bytes);
}
static void backend_sync() {}
// the ops' scratch and the matmul workspace: the CPU ops need none (their arena is empty)
static void backend_bind_scratch(void*, size_t) {}
// the SM count that the plan of a GPU's op scratch assumes (llmc/op_scratch.h): the GPUs of --plan
// --device (H100 / H200 SXM) have 132
static int plan_sm_count() { return 132; }
// memory the run's buffers can use: host memory (MemAvailable), for the memory guard
static double available_buffer_memory(std::string& source) { return available_host_memory(source); }
// what the process holds after a step, next to the plan: the buffers (all of them allocated up
// front) and the peak resident set (buffers + host staging + libraries)
static double device_bytes_in_use() { return (double)buffer_bytes_allocated(); }
static std::string measured_memory(double) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return strfmt("buffers %.2f MiB, process peak RSS %.2f MiB", buffer_bytes_allocated() / 1048576.0,
                  ru.ru_maxrss / 1024.0);
}
#else
// The CUDA build: bf16 params, grads and activations, fp32 master weights and Adam moments, fp32
// statistics. The ops (llmc/<op>.cuh) have the signatures of their CPU twins.
#include "llmc/cuda_common.cuh"
#include "llmc/encoder.cuh"
#include "llmc/layernorm.cuh"
#include "llmc/matmul.cuh"
#include "llmc/attention.cuh"
#include "llmc/mlp.cuh"
#include "llmc/classifier.cuh"
#include "llmc/adamw.cuh"
#include "llmc/global_norm.cuh"
#include "llmc/cpu/moe.h"  // for moe_capacity (host arithmetic)
#include "llmc/moe.cuh"
#include "llmc/accumulate.cuh"
static const char* backend_name() {
    static char name[320];
    cudaDeviceProp p;
    cudaCheck(cudaGetDeviceProperties(&p, 0));
    snprintf(name, sizeof(name), "cuda on %s (sm_%d%d), bf16 with fp32 master weights", p.name, p.major, p.minor);
    return name;
}
// dense bf16 tensor-core peak, for MFU; 0 (no MFU) where we do not know it
static double peak_flops_per_s() {
    cudaDeviceProp p;
    cudaCheck(cudaGetDeviceProperties(&p, 0));
    if (p.major == 9) return 989.4e12;  // H100 / H200 SXM
    if (p.major == 8 && p.minor == 0) return 312e12;  // A100
    return 0;
}
static size_t& buffer_bytes_allocated() {
    static size_t bytes = 0;
    return bytes;
}
static void* buffer_alloc(size_t bytes) {
    buffer_bytes_allocated() += bytes;
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, std::max<size_t>(bytes, 1));
    LLMC_CHECK(err == cudaSuccess, "out of GPU memory allocating %zu bytes (%s): reduce -b or the model size", bytes,
               cudaGetErrorString(err));
    cudaCheck(cudaMemset(p, 0, bytes));
    return p;
}
static void buffer_free(void* p) { cudaCheck(cudaFree(p)); }
// the host arenas of --offload optimizer (llmc/memory.h): pinned host memory, so the copies between
// them and the device run asynchronously at full bandwidth
static size_t& host_bytes_allocated() {
    static size_t bytes = 0;
    return bytes;
}
static void* host_buffer_alloc(size_t bytes) {
    host_bytes_allocated() += bytes;
    void* p = nullptr;
    cudaError_t err = cudaMallocHost(&p, std::max<size_t>(bytes, 1));
    LLMC_CHECK(err == cudaSuccess, "out of pinned host memory allocating %zu bytes for --offload optimizer (%s): "
               "shard the optimizer state over more ranks (--zero 1) or use --offload none", bytes,
               cudaGetErrorString(err));
    memset(p, 0, bytes);
    return p;
}
static void host_buffer_free(void* p) { cudaCheck(cudaFreeHost(p)); }
static double device_bytes_in_use() {
    size_t free_b = 0, total_b = 0;
    cudaCheck(cudaMemGetInfo(&free_b, &total_b));
    return (double)(total_b - free_b);
}
// what the device holds after a step, next to the plan: our buffers (the arenas), all that is in
// use on the device (with the CUDA context and the libraries' own), and how much that grew since
// before the model was allocated (in_use_before): what the plan is to be compared with
static std::string measured_memory(double in_use_before) {
    size_t free_b = 0, total_b = 0;
    cudaCheck(cudaMemGetInfo(&free_b, &total_b));
    const double in_use = device_bytes_in_use();
    return strfmt("buffers %.2f MiB, device memory in use %.2f MiB of %.2f MiB, grown by %.2f MiB since before the "
                  "model was allocated", buffer_bytes_allocated() / 1048576.0, in_use / 1048576.0, total_b / 1048576.0,
                  (in_use - in_use_before) / 1048576.0);
}
// free GPU memory now (cudaMemGetInfo), for the memory guard (LLMC_MEMORY_LIMIT overrides it)
static double available_buffer_memory(std::string& source) {
    size_t free_bytes = 0, total_bytes = 0;
    cudaCheck(cudaMemGetInfo(&free_bytes, &total_bytes));
    double limit = memory_limit_override();
    if (limit >= 0) { source = "LLMC_MEMORY_LIMIT"; return limit; }
    source = "free GPU memory (cudaMemGetInfo)";
    return (double)free_bytes;
}
static void buffer_zero(void* p, size_t bytes) { cudaCheck(cudaMemsetAsync(p, 0, bytes, llmc_stream())); }
static void copy_to_buffer(void* dst, const void* src, size_t bytes) {
    cudaCheck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, llmc_stream()));
    cudaCheck(cudaStreamSynchronize(llmc_stream()));  // src is pageable host memory the caller may reuse
}
static void copy_from_buffer(void* dst, const void* src, size_t bytes) {
    cudaCheck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, llmc_stream()));
    cudaCheck(cudaStreamSynchronize(llmc_stream()));
}
static void copy_buffer(void* dst, const void* src, size_t bytes) {
    cudaCheck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, llmc_stream()));
}
static void copy_buffer_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width_bytes, size_t rows) {
    if (rows == 0 || width_bytes == 0) return;
    cudaCheck(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width_bytes, rows, cudaMemcpyDeviceToDevice, llmc_stream()));
}
// the step time includes everything queued on the GPU
static void backend_sync() { cudaCheck(cudaStreamSynchronize(llmc_stream())); }
// kernels are queued: the host clock sees their time only after a sync, which would cost the overlap
// of host and device; the pipeline is timed (with syncs) only for --pp_trace
static constexpr bool host_timing_is_exact = false;
// The ops' scratch (cuda_scratch) and the cuBLASLt workspace from the model's MEM_SCRATCH arena
// (llmc/op_scratch.h: the workspace first, then the scratch); nullptr: the ops' own again.
static void backend_bind_scratch(void* arena, size_t bytes) {
    matmul_bind_workspace(arena);
    if (arena) matmul_setup();  // the handle (a workspace is bound: nothing is allocated)
    cuda_scratch_bind(arena ? (char*)arena + MATMUL_WORKSPACE_BYTES : nullptr,
                      arena ? bytes - MATMUL_WORKSPACE_BYTES : 0);
}
static int plan_sm_count() { return layernorm_detail::sm_count(); }
#endif

// Multi-process: the rank grid and collectives (llmc/comm.h), ZeRO sharding (llmc/zero.h).
#include "llmc/zero.h"
#include "llmc/memory.h"
#include "llmc/op_scratch.h"
#include "llmc/offload.h"
#include "llmc/pipeline.h"
#include "llmc/tensor_parallel.h"

// ----------------------------------------------------------------------------------------------
// 2. Config and parameters

enum MlpKind { MLP_SWIGLU = 0, MLP_GELU = 1 };
enum PosKind { POS_ALIBI = 0, POS_LEARNED = 1 };
enum MoeGroup { MOE_GROUP_BATCH = 0, MOE_GROUP_POSITION = 1 };

struct GPTConfig {
    int vocab_size = 257;          // real vocabulary (byte tokenizer: 256 bytes + EOT)
    int padded_vocab_size = 384;   // vocab_size rounded up to a multiple of 128 (derived)
    int n_layer = 4, n_embd = 128, n_head = 4, n_kv_head = 4;
    int ffn_hidden = 0;            // 0: derived (swiglu: 8/3 C rounded up to 32; gelu: 4 C)
    int max_seq_len = 1024;
    int mlp = MLP_SWIGLU, pos = POS_ALIBI;
    // mixture of experts (llmc/cpu/moe.h): n_expert 0 = dense; every moe_every-th block's FFN
    // (layers l with (l + 1) % moe_every == 0) is a set of SwiGLU experts of size expert_hidden
    int n_expert = 0, moe_every = 1, expert_hidden = 0;  // expert_hidden 0: ffn_hidden
    float capacity_factor = 2.0f;
    int moe_group = MOE_GROUP_BATCH;

    int head_size() const { return n_embd / n_head; }
    int qkv_channels() const { return (n_head + 2 * n_kv_head) * head_size(); }
    int fc_channels() const { return mlp == MLP_SWIGLU ? 2 * ffn_hidden : ffn_hidden; }
    bool is_moe(int layer) const { return n_expert > 0 && (layer + 1) % moe_every == 0; }
    int moe_capacity(int B, int T) const {
        return cpu::moe_capacity(B, T, n_expert, capacity_factor, moe_group == MOE_GROUP_POSITION);
    }

    // fills derived fields and rejects impossible shapes, naming the flag
    void finalize() {
        // Upper bounds first, far above any real model, so that every derived size below (and the
        // int arithmetic of the ops) is far from overflowing: e.g. --vocab_size 2147483647 would
        // wrap the padding to a multiple of 128, --n_embd 1073741856 the FFN width.
        const std::pair<const char*, std::pair<int, int>> bounds[] = {
            {"vocab_size", {vocab_size, 1 << 24}},   {"n_layer", {n_layer, 1024}},
            {"n_embd", {n_embd, 1 << 16}},           {"n_head", {n_head, 4096}},
            {"n_kv_head", {n_kv_head, 4096}},        {"ffn_hidden", {ffn_hidden, 1 << 20}},
            {"max_seq_len", {max_seq_len, 1 << 24}}, {"n_expert", {n_expert, 1024}},
            {"moe_every", {moe_every, 1024}},        {"expert_hidden", {expert_hidden, 1 << 20}}};
        for (const auto& [flag, vb] : bounds)
            LLMC_CHECK(vb.first <= vb.second, "--%s %d is too large: at most %d is supported", flag, vb.first, vb.second);
        LLMC_CHECK(vocab_size > 0, "--vocab_size: must be > 0, got %d", vocab_size);
        padded_vocab_size = ceil_div(vocab_size, 128) * 128;
        LLMC_CHECK(n_layer > 0, "--n_layer: must be > 0, got %d", n_layer);
        LLMC_CHECK(n_head > 0 && n_embd > 0 && n_embd % n_head == 0,
                   "--n_embd %d must be a positive multiple of --n_head %d", n_embd, n_head);
        LLMC_CHECK(n_kv_head > 0 && n_head % n_kv_head == 0,
                   "--n_kv_head %d must divide --n_head %d (grouped-query attention)", n_kv_head, n_head);
        LLMC_CHECK(mlp == MLP_SWIGLU || mlp == MLP_GELU, "--mlp: expected swiglu or gelu");
        LLMC_CHECK(pos == POS_ALIBI || pos == POS_LEARNED, "--pos: expected alibi or learned");
        if (ffn_hidden == 0) ffn_hidden = mlp == MLP_SWIGLU ? ceil_div(8 * n_embd / 3, 32) * 32 : 4 * n_embd;
        LLMC_CHECK(ffn_hidden > 0, "--ffn_hidden: must be > 0, got %d", ffn_hidden);
        LLMC_CHECK(max_seq_len > 0, "--max_seq_len: must be > 0, got %d", max_seq_len);
        LLMC_CHECK(n_expert >= 0, "--n_expert: must be >= 0, got %d", n_expert);
        LLMC_CHECK(moe_every >= 1, "--moe_every: must be >= 1, got %d", moe_every);
        LLMC_CHECK(std::isfinite(capacity_factor) && capacity_factor > 0, "--capacity_factor: must be a positive number, got %g",
                   capacity_factor);
        LLMC_CHECK(n_expert == 0 || moe_every <= n_layer,
                   "--moe_every %d is larger than --n_layer %d: no block would have an MoE layer", moe_every, n_layer);
        LLMC_CHECK(moe_group == MOE_GROUP_BATCH || moe_group == MOE_GROUP_POSITION, "--moe_group: expected batch or position");
        if (expert_hidden == 0) expert_hidden = ffn_hidden;
        LLMC_CHECK(expert_hidden > 0, "--expert_hidden: must be > 0, got %d", expert_hidden);
    }

    // Rejects a batch shape this model cannot run, naming the flags. Sizes in 64 bits: the ops
    // index tokens (B*T*ranks) and an MoE layer's expert rows with int.
    void check_batch(int64_t B, int64_t T, int64_t world = 1) const {
        LLMC_CHECK(B > 0, "--batch_size: must be > 0, got %lld", (long long)B);
        LLMC_CHECK(T > 0, "--seq_len: must be > 0, got %lld", (long long)T);
        // the learned position table has max_seq_len rows; a longer row would read and write past it
        LLMC_CHECK(pos != POS_LEARNED || T <= max_seq_len,
                   "--seq_len %lld is longer than --max_seq_len %d: with --pos learned the position table has "
                   "max_seq_len rows; lower -t or raise --max_seq_len", (long long)T, max_seq_len);
        checked_product({B, T, world}, INT32_MAX, "the tokens per micro-batch B*T*ranks");
        if (n_expert > 0)
            checked_product({(int64_t)n_expert, (int64_t)moe_capacity((int)B, (int)T)}, INT32_MAX,
                            "the MoE expert rows n_expert * capacity");
    }
};

// One row of the parameter table: every parameter lives at `offset` in one flat buffer (and its
// gradient and Adam moments at the same offset in theirs; the few padding elements between
// tensors stay zero). The order is the checkpoint order and
// the order of scripts/reference.py.
struct ParamTensor {
    std::string name;
    std::vector<int> shape;
    size_t offset = 0, numel = 0;
    enum Init { NORMAL, ZEROS, ONES } init = NORMAL;
    float init_std = 0.02f;
    bool decay = false;
};

static std::vector<ParamTensor> build_param_table(const GPTConfig& c) {
    std::vector<ParamTensor> table;
    size_t offset = 0;
    auto add = [&](const std::string& name, std::vector<int> shape, ParamTensor::Init init, float std = 0.02f) {
        ParamTensor p;
        p.name = name;
        p.shape = shape;
        p.numel = 1;
        for (int d : shape) p.numel *= (size_t)d;
        p.offset = offset;
        p.init = init;
        p.init_std = std;
        // AdamW weight decay: matrices only (embeddings and linear weights; not biases, not LN)
        p.decay = shape.size() >= 2 && (name == "wte" || name == "wpe" || name.substr(name.size() - 2) == ".w");
        offset += (p.numel + 7) / 8 * 8;  // every tensor 16-byte aligned in bf16 (cuBLASLt bias epilogue)
        table.push_back(p);
    };
    const int C = c.n_embd;
    // GPT-2 / nanoGPT init: residual-branch output projections scaled by 1/sqrt(2 n_layer)
    const float proj_std = 0.02f / std::sqrt(2.0f * c.n_layer);
    add("wte", {c.padded_vocab_size, C}, ParamTensor::NORMAL);
    if (c.pos == POS_LEARNED) add("wpe", {c.max_seq_len, C}, ParamTensor::NORMAL);
    for (int l = 0; l < c.n_layer; l++) {
        std::string h = "h" + std::to_string(l) + ".";
        add(h + "ln1.w", {C}, ParamTensor::ONES);
        add(h + "ln1.b", {C}, ParamTensor::ZEROS);
        add(h + "attn.qkv.w", {c.qkv_channels(), C}, ParamTensor::NORMAL);
        add(h + "attn.qkv.b", {c.qkv_channels()}, ParamTensor::ZEROS);
        add(h + "attn.proj.w", {C, c.n_head * c.head_size()}, ParamTensor::NORMAL, proj_std);
        add(h + "attn.proj.b", {C}, ParamTensor::ZEROS);
        add(h + "ln2.w", {C}, ParamTensor::ONES);
        add(h + "ln2.b", {C}, ParamTensor::ZEROS);
        if (c.is_moe(l)) {  // E SwiGLU experts, stacked
            const int E = c.n_expert, He = c.expert_hidden;
            add(h + "moe.router.w", {E, C}, ParamTensor::NORMAL);
            add(h + "moe.fc.w", {E, 2 * He, C}, ParamTensor::NORMAL);
            add(h + "moe.fc.b", {E, 2 * He}, ParamTensor::ZEROS);
            add(h + "moe.proj.w", {E, C, He}, ParamTensor::NORMAL, proj_std);
            add(h + "moe.proj.b", {E, C}, ParamTensor::ZEROS);
        } else {
            add(h + "mlp.fc.w", {c.fc_channels(), C}, ParamTensor::NORMAL);
            add(h + "mlp.fc.b", {c.fc_channels()}, ParamTensor::ZEROS);
            add(h + "mlp.proj.w", {C, c.ffn_hidden}, ParamTensor::NORMAL, proj_std);
            add(h + "mlp.proj.b", {C}, ParamTensor::ZEROS);
        }
    }
    add("lnf.w", {C}, ParamTensor::ONES);
    add("lnf.b", {C}, ParamTensor::ZEROS);
    return table;
}

// size of the flat buffers, including the alignment padding
static size_t count_params(const std::vector<ParamTensor>& table) {
    return table.back().offset + (table.back().numel + 7) / 8 * 8;
}

// Pointers into a flat buffer (params or grads) laid out by the table.
struct LayerTensors {
    floatX *ln1w = nullptr, *ln1b = nullptr, *qkvw = nullptr, *qkvb = nullptr, *attprojw = nullptr,
           *attprojb = nullptr, *ln2w = nullptr, *ln2b = nullptr;
    // dense FFN, or the stacked experts' of an MoE layer
    floatX *fcw = nullptr, *fcb = nullptr, *fcprojw = nullptr, *fcprojb = nullptr;
    floatX* routerw = nullptr;  // MoE layers only
};
struct ModelTensors {
    floatX *wte = nullptr, *wpe = nullptr, *lnfw = nullptr, *lnfb = nullptr;
    std::vector<LayerTensors> layers;
};

// The segments of the flat buffers (llmc/zero.h): the embedding, each block, the final LayerNorm,
// and each MoE layer's experts (sharded over the expert-dp group). Segment of layer l is 1 + l; the
// final LayerNorm's is n_layer + 1; layer l's experts' n_layer + 2 + l.
static bool is_expert_tensor(const std::string& name) {
    const size_t dot = name.find('.');
    return dot != std::string::npos && name.compare(dot + 1, 4, "moe.") == 0 && name.compare(dot + 1, 10, "moe.router") != 0;
}
static int segment_of(const std::string& name, int n_layer) {
    if (name == "wte" || name == "wpe") return 0;
    if (name[0] == 'h') return (is_expert_tensor(name) ? n_layer + 2 : 1) + std::stoi(name.substr(1, name.find('.') - 1));
    return n_layer + 1;
}
// the block a segment belongs to (-1: the embedding or the final LayerNorm)
static int segment_layer(int id, int n_layer) {
    return id >= 1 && id <= n_layer ? id - 1 : id >= n_layer + 2 ? id - n_layer - 2 : -1;
}
// every segment of the model, in table order (a segment's range runs to the next one's start);
// n_leaves: the experts' leaf gradients (expert parallelism: --ep)
static std::vector<SegmentSpec> segment_specs(const GPTConfig& c, const std::vector<ParamTensor>& table, int n_leaves = 1) {
    std::vector<SegmentSpec> specs;
    for (const ParamTensor& p : table) {
        const int s = segment_of(p.name, c.n_layer), l = segment_layer(s, c.n_layer);
        if (specs.empty() || specs.back().id != s) {
            SegmentSpec spec;
            spec.name = s == 0 ? "embedding" : s == c.n_layer + 1 ? "final" : "h" + std::to_string(l) + (s > c.n_layer ? ".experts" : "");
            spec.id = s;
            spec.begin = p.offset;
            spec.expert = s > c.n_layer + 1;
            spec.n_leaves = spec.expert ? n_leaves : 1;
            specs.push_back(spec);
        }
    }
    for (size_t k = 0; k < specs.size(); k++)
        specs[k].len = (k + 1 < specs.size() ? specs[k + 1].begin : count_params(table)) - specs[k].begin;
    return specs;
}

// Points the fields of the tensors of segment `seg` at base (the segment's first element), or
// at nullptr (stage 3: the segment is not gathered).
static void point_segment(ModelTensors& t, const GPTConfig& c, const std::vector<ParamTensor>& table,
                          const Segment& seg, floatX* base) {
    t.layers.resize(c.n_layer);
    for (const ParamTensor& p : table) {
        if (segment_of(p.name, c.n_layer) != seg.id) continue;
        floatX* ptr = base ? base + (p.offset - seg.begin) : nullptr;
        if (p.name == "wte") { t.wte = ptr; continue; }
        if (p.name == "wpe") { t.wpe = ptr; continue; }
        if (p.name == "lnf.w") { t.lnfw = ptr; continue; }
        if (p.name == "lnf.b") { t.lnfb = ptr; continue; }
        LayerTensors& L = t.layers[segment_layer(seg.id, c.n_layer)];
        const std::string f = p.name.substr(p.name.find('.') + 1);
        floatX** field = f == "ln1.w" ? &L.ln1w : f == "ln1.b" ? &L.ln1b : f == "attn.qkv.w" ? &L.qkvw
                       : f == "attn.qkv.b" ? &L.qkvb : f == "attn.proj.w" ? &L.attprojw : f == "attn.proj.b" ? &L.attprojb
                       : f == "ln2.w" ? &L.ln2w : f == "ln2.b" ? &L.ln2b : f == "moe.router.w" ? &L.routerw
                       : (f == "mlp.fc.w" || f == "moe.fc.w") ? &L.fcw : (f == "mlp.fc.b" || f == "moe.fc.b") ? &L.fcb
                       : (f == "mlp.proj.w" || f == "moe.proj.w") ? &L.fcprojw
                       : (f == "mlp.proj.b" || f == "moe.proj.b") ? &L.fcprojb : nullptr;
        LLMC_CHECK(field, "internal: parameter %s has no field", p.name.c_str());
        *field = ptr;
    }
}

// ----------------------------------------------------------------------------------------------
// A rank's slice of the model. Tensor parallelism (llmc/tensor_parallel.h): each tensor-parallel
// rank holds a slice of the split tensors and a copy of the others; expert parallelism (--ep): each
// rank of an ep group holds n_expert / ep of every MoE layer's experts. Its local table lays its tensors out as the table does
// (same order, local shapes); pieces map every local element to its place in the table, which
// stays the one layout-independent index space (init, checkpoints, exports).
//   attn.qkv   rows of the rank's query heads, then of the kv heads they read (column-parallel by
//              heads; a kv head shared by several ranks when --tp > n_kv_head is a replica there)
//   attn.proj  the columns of the rank's heads (row-parallel; its bias is a replica, added once
//              after the reduction)
//   mlp.fc     SwiGLU: the rank's hidden units of W1 and the same units of W3 (so silu(W1 x) * W3 x
//              is local); GELU: its hidden units. mlp.proj: those columns (row-parallel)
//   moe.*      the rank's experts (--ep), each split as the dense FFN; the router is a replica
//   wte        rows of the rank's vocabulary slice (vocab-parallel embedding and loss)
//   the rest   LayerNorms, row-parallel biases, wpe: replicas (tp rank 0 is their owner)
struct LocalShape {
    int tp = 1, rank = 0;
    bool sp = false;                 // --sp: LayerNorms and the residual stream hold B*T/tp tokens
    int n_head = 0, head0 = 0;       // local query heads, the first one's global index
    int n_kv_head = 0, kv0 = 0;      // local kv heads, the first one's global index
    bool kv_owner = true;            // false: the local kv heads are replicas (another rank owns them)
    int ffn = 0, expert_hidden = 0;  // local hidden units (dense FFN, per expert)
    int vocab = 0, vocab0 = 0;       // local rows of the padded vocabulary
    int ep = 1, ep_rank = 0;         // --ep: the expert-parallel group
    int n_expert = 0, expert0 = 0;   // local experts of each MoE layer, the first one's global index
    int hs = 0;
    int qkv() const { return (n_head + 2 * n_kv_head) * hs; }
    int fc(int mlp) const { return mlp == MLP_SWIGLU ? 2 * ffn : ffn; }
};

static LocalShape local_shape(const GPTConfig& c, int tp, int rank, bool sp, int ep = 1, int ep_rank = 0) {
    LLMC_CHECK(ep == 1 || c.n_expert > 0, "--ep %d: the model has no experts (give --n_expert)", ep);
    LLMC_CHECK(c.n_expert == 0 || c.n_expert % ep == 0, "--ep %d must divide --n_expert %d (each rank of an expert group "
               "holds n_expert / ep experts)", ep, c.n_expert);
    LLMC_CHECK(tp >= 1 && c.n_head % tp == 0, "--tp %d must divide --n_head %d (attention is split by heads)", tp, c.n_head);
    LLMC_CHECK(c.n_kv_head % tp == 0 || tp % c.n_kv_head == 0,
               "--tp %d: the kv heads (--n_kv_head %d) must split evenly over the tensor-parallel ranks, or each be "
               "shared by a whole number of them (tp a multiple of n_kv_head)", tp, c.n_kv_head);
    LLMC_CHECK(c.ffn_hidden % tp == 0, "--tp %d must divide the FFN width --ffn_hidden %d", tp, c.ffn_hidden);
    LLMC_CHECK(c.n_expert == 0 || c.expert_hidden % tp == 0, "--tp %d must divide the expert width --expert_hidden %d", tp,
               c.expert_hidden);
    LLMC_CHECK(c.padded_vocab_size % tp == 0, "--tp %d must divide the padded vocabulary %d (vocab-parallel embedding)", tp,
               c.padded_vocab_size);
    LocalShape s;
    s.tp = tp;
    s.rank = rank;
    s.sp = sp && tp > 1;
    s.hs = c.head_size();
    s.n_head = c.n_head / tp;
    s.head0 = rank * s.n_head;
    if (c.n_kv_head % tp == 0) {
        s.n_kv_head = c.n_kv_head / tp;
        s.kv0 = rank * s.n_kv_head;
    } else {  // tp / n_kv_head ranks read each kv head; the first of them owns it
        const int share = tp / c.n_kv_head;
        s.n_kv_head = 1;
        s.kv0 = rank / share;
        s.kv_owner = rank % share == 0;
    }
    s.ffn = c.ffn_hidden / tp;
    s.expert_hidden = c.expert_hidden / tp;
    s.vocab = c.padded_vocab_size / tp;
    s.vocab0 = rank * s.vocab;
    s.ep = ep;
    s.ep_rank = ep_rank;
    s.n_expert = c.n_expert / ep;
    s.expert0 = ep_rank * s.n_expert;
    return s;
}

// The canonical chunk count of the tensor-parallel reductions (llmc/tensor_parallel.h): the lcm of
// every tp that local_shape accepts, so that each of them splits the chunks evenly
static int tp_chunk_count(const GPTConfig& c) {
    int g = 1;
    for (int t = 2; t <= c.n_head; t++)
        if (c.n_head % t == 0 && (c.n_kv_head % t == 0 || t % c.n_kv_head == 0) && c.ffn_hidden % t == 0 &&
            (c.n_expert == 0 || c.expert_hidden % t == 0) && c.padded_vocab_size % t == 0)
            g = std::lcm(g, t);
    return g;
}
// the canonical token chunks of a micro-batch of n tokens (--sp splits them over the tp ranks)
static int tp_token_chunks(const GPTConfig& c, long n) { return (int)std::gcd(n, (long)tp_chunk_count(c)); }

// local elements [local, local + len) are table elements [global, global + len)
struct TablePiece {
    size_t local, global, len;
    bool owner;  // this rank reports them (checkpoints, norm); false: a tensor-parallel replica
};

// The local table (as build_param_table, with this rank's shapes) and its pieces in local order.
static std::vector<ParamTensor> local_param_table(const GPTConfig& c, const std::vector<ParamTensor>& table,
                                                  const LocalShape& s, std::vector<TablePiece>& pieces) {
    pieces.clear();
    std::vector<ParamTensor> local;
    size_t offset = 0;
    const int C = c.n_embd, hs = s.hs;
    for (const ParamTensor& g : table) {
        ParamTensor p = g;
        p.offset = offset;
        const std::string f = g.name.substr(g.name.find('.') + 1);
        // a piece of `rows` rows of `width` elements, at global row `row` of a matrix `stride` wide
        auto add = [&](size_t local_at, size_t row, size_t rows, size_t width, size_t col, size_t stride, bool owner) {
            for (size_t r = 0; r < rows; r++)
                pieces.push_back({p.offset + local_at + r * width, g.offset + (row + r) * stride + col, width, owner});
        };
        auto contiguous = [&](size_t local_at, size_t global_at, size_t n, bool owner) {
            pieces.push_back({p.offset + local_at, g.offset + global_at, n, owner});
        };
        const bool replica = s.tp > 1 && s.rank != 0, experts = f.compare(0, 4, "moe.") == 0 && f != "moe.router.w";
        if (s.tp == 1 && (s.ep == 1 || !experts)) {
            contiguous(0, 0, (g.numel + 7) / 8 * 8, true);  // with its padding: one process reports every element
        } else if (g.name == "wte") {
            p.shape = {s.vocab, C};
            contiguous(0, (size_t)s.vocab0 * C, (size_t)s.vocab * C, true);
        } else if (f == "attn.qkv.w" || f == "attn.qkv.b") {
            const size_t w = f == "attn.qkv.w" ? C : 1;
            p.shape = f == "attn.qkv.w" ? std::vector<int>{s.qkv(), C} : std::vector<int>{s.qkv()};
            const size_t q = (size_t)s.n_head * hs, kv = (size_t)s.n_kv_head * hs;
            contiguous(0, (size_t)s.head0 * hs * w, q * w, true);
            contiguous(q * w, ((size_t)c.n_head + s.kv0) * hs * w, kv * w, s.kv_owner);
            contiguous((q + kv) * w, ((size_t)c.n_head + c.n_kv_head + s.kv0) * hs * w, kv * w, s.kv_owner);
        } else if (f == "attn.proj.w") {
            p.shape = {C, s.n_head * hs};
            add(0, 0, C, (size_t)s.n_head * hs, (size_t)s.head0 * hs, (size_t)c.n_head * hs, true);
        } else if (f == "mlp.fc.w" || f == "mlp.fc.b" || f == "moe.fc.w" || f == "moe.fc.b") {
            const bool moe = f[0] == 'm' && f[1] == 'o', glu = moe || c.mlp == MLP_SWIGLU;
            const size_t w = f.back() == 'w' ? C : 1, E = moe ? s.n_expert : 1, e0 = moe ? s.expert0 : 0;
            const size_t H = moe ? c.expert_hidden : c.ffn_hidden, Hl = moe ? s.expert_hidden : s.ffn;
            const size_t rows_g = glu ? 2 * H : H, rows_l = glu ? 2 * Hl : Hl;  // per expert
            p.shape = moe ? (w == 1 ? std::vector<int>{(int)E, (int)rows_l} : std::vector<int>{(int)E, (int)rows_l, C})
                          : (w == 1 ? std::vector<int>{(int)rows_l} : std::vector<int>{(int)rows_l, C});
            for (size_t e = 0; e < E; e++) {
                contiguous(e * rows_l * w, ((e0 + e) * rows_g + (size_t)s.rank * Hl) * w, Hl * w, true);
                if (glu) contiguous((e * rows_l + Hl) * w, ((e0 + e) * rows_g + H + (size_t)s.rank * Hl) * w, Hl * w, true);
            }
        } else if (f == "mlp.proj.w" || f == "moe.proj.w") {
            const bool moe = f[0] == 'm' && f[1] == 'o';
            const size_t E = moe ? s.n_expert : 1, H = moe ? c.expert_hidden : c.ffn_hidden, e0 = moe ? s.expert0 : 0;
            const size_t Hl = moe ? s.expert_hidden : s.ffn;
            p.shape = moe ? std::vector<int>{(int)E, C, (int)Hl} : std::vector<int>{C, (int)Hl};
            add(0, e0 * C, E * C, Hl, (size_t)s.rank * Hl, H, true);
        } else if (f == "moe.proj.b") {  // the rank's experts' biases (replicas over tp)
            p.shape = {s.n_expert, C};
            contiguous(0, (size_t)s.expert0 * C, (size_t)s.n_expert * C, !replica);
            if (s.ep == 1) pieces.back().len = (g.numel + 7) / 8 * 8;  // with the table's padding
        } else {
            contiguous(0, 0, (g.numel + 7) / 8 * 8, !replica);
        }
        p.numel = 1;
        for (int d : p.shape) p.numel *= (size_t)d;
        offset += (p.numel + 7) / 8 * 8;
        local.push_back(p);
    }
    return local;
}

// ----------------------------------------------------------------------------------------------
// 3. The model

// The pipeline partition (llmc/pipeline.h runs the schedule). The model's blocks are cut into
// P * V contiguous virtual stages; pipeline stage s runs virtual stages s, P + s, 2P + s, ... (its
// chunks 0..V-1; V > 1 only for the interleaved schedule). Virtual stage 0 also holds the
// embedding, the last one the final LayerNorm, the lm head and the loss. One process is P = 1.
struct PipelinePlan {
    PipeKind kind = PIPE_1F1B;
    int P = 1, V = 1, M = 1, stage = 0;
    std::vector<int> first_layer;                   // P*V + 1 entries: virtual stage vs has [first_layer[vs], first_layer[vs+1])
    std::vector<std::vector<PipeAction>> schedule;  // every stage's actions for one step
    int n_vs() const { return P * V; }
    int vs(int chunk) const { return chunk * P + stage; }
    int layer_begin(int chunk) const { return first_layer[vs(chunk)]; }
    int layer_end(int chunk) const { return first_layer[vs(chunk) + 1]; }
    bool first_vs(int chunk) const { return vs(chunk) == 0; }
    bool last_vs(int chunk) const { return vs(chunk) == n_vs() - 1; }
    bool has_embedding() const { return stage == 0; }
    bool has_head() const { return stage == P - 1; }
    bool holds_layer(int l) const {
        for (int c = 0; c < V; c++) if (l >= layer_begin(c) && l < layer_end(c)) return true;
        return false;
    }
};

// Training FLOPs (forward + backward) of one micro-batch in block l: 6 per active parameter per
// token, plus the causal attention's 12 * n_head * head_size per score element (a full row's
// average, (T + 1) / 2 keys). The partition balances these.
static double block_flops(const GPTConfig& c, int l, int B, int T) {
    const double C = c.n_embd, BT = (double)B * T;
    double params = (double)c.qkv_channels() * C + C * c.n_head * c.head_size() + 4 * C;
    if (c.is_moe(l)) {
        const double per_token = (double)c.n_expert * c.moe_capacity(B, T) / BT;  // experts a token visits
        params += (double)c.n_expert * C + per_token * 3.0 * c.expert_hidden * C;
    } else {
        params += (double)c.fc_channels() * C + (double)c.ffn_hidden * C;
    }
    return 6.0 * params * BT + 12.0 * c.n_head * c.head_size() * BT * (T + 1) / 2.0;
}
static double head_flops(const GPTConfig& c, int B, int T) { return 6.0 * c.n_embd * c.padded_vocab_size * (double)B * T; }

// Cuts the blocks into P * V virtual stages: by hand (--pp_layers, one count per virtual stage), in
// equal parts (interleaved), or contiguous parts that minimise the largest cost (blocks, plus the
// lm head on the last one), by dynamic programming over the cut points.
static std::vector<int> pipeline_partition(const GPTConfig& c, int B, int T, int P, int V, PipeKind kind,
                                           const std::string& layers_flag) {
    const int L = c.n_layer, n = P * V;
    LLMC_CHECK(n <= L, "--pp %d%s: %d virtual stages for %d layers; every stage needs at least one layer (lower --pp%s)",
               P, V > 1 ? (" x --pp_virtual " + std::to_string(V)).c_str() : "", n, L, V > 1 ? " or --pp_virtual" : "");
    std::vector<int> first(n + 1, 0);
    if (!layers_flag.empty()) {
        std::vector<int> counts;
        size_t at = 0;
        while (at <= layers_flag.size()) {
            size_t comma = layers_flag.find(',', at);
            if (comma == std::string::npos) comma = layers_flag.size();
            counts.push_back((int)parse_int64(layers_flag.substr(at, comma - at), "pp_layers", 1, L));
            at = comma + 1;
        }
        LLMC_CHECK((int)counts.size() == n, "--pp_layers %s: %zu counts, expected one per virtual stage (%d)",
                   layers_flag.c_str(), counts.size(), n);
        for (int k = 0; k < n; k++) first[k + 1] = first[k] + counts[k];
        LLMC_CHECK(first[n] == L, "--pp_layers %s: the counts add up to %d, the model has --n_layer %d", layers_flag.c_str(),
                   first[n], L);
        return first;
    }
    if (kind == PIPE_INTERLEAVED) {
        LLMC_CHECK(L % P == 0 && (L / P) % V == 0,
                   "--pp_virtual %d: the interleaved schedule splits each stage's n_layer / pp = %d / %d layers into %d "
                   "equal chunks; choose --pp and --pp_virtual so that they divide it (or give --pp_layers)", V, L, P, V);
        for (int k = 0; k <= n; k++) first[k] = k * (L / n);
        return first;
    }
    std::vector<double> prefix(L + 1, 0);
    for (int l = 0; l < L; l++) prefix[l + 1] = prefix[l] + block_flops(c, l, B, T);
    const double head = head_flops(c, B, T), inf = 1e300;
    // best[k][i]: the smallest largest cost of the first k stages over layers [0, i)
    std::vector<std::vector<double>> best(n + 1, std::vector<double>(L + 1, inf));
    std::vector<std::vector<int>> cut(n + 1, std::vector<int>(L + 1, 0));
    best[0][0] = 0;
    for (int k = 1; k <= n; k++)
        for (int i = k; i <= L - (n - k); i++)
            for (int j = k - 1; j < i; j++) {
                const double cost = std::max(best[k - 1][j], prefix[i] - prefix[j] + (k == n ? head : 0.0));
                if (cost < best[k][i]) { best[k][i] = cost; cut[k][i] = j; }
            }
    first[n] = L;
    for (int k = n; k > 0; k--) first[k - 1] = cut[k][first[k]];
    return first;
}

static PipelinePlan pipeline_plan(const GPTConfig& c, int B, int T, int P, int V, int M, PipeKind kind,
                                  const std::string& layers_flag, int stage) {
    PipelinePlan p;
    p.kind = kind;
    p.P = P;
    p.V = V;
    p.M = M;
    p.stage = stage;
    LLMC_CHECK(V == 1 || kind == PIPE_INTERLEAVED, "--pp_virtual %d: only the interleaved schedule has virtual stages", V);
    p.first_layer = pipeline_partition(c, B, T, P, V, kind, layers_flag);
    p.schedule = pipeline_schedule(kind, P, M, V);
    return p;
}
static PipelinePlan single_stage_plan(const GPTConfig& c) {
    PipelinePlan p;
    p.first_layer = {0, c.n_layer};
    p.schedule = pipeline_schedule(PIPE_1F1B, 1, 1, 1);
    return p;
}

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
    // MoE layers only: routing (llmc/cpu/moe.h) and the experts' input and output rows
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

struct GPT {
    GPTConfig config;
    std::vector<ParamTensor> table;  // the model's tensors: the layout-independent index space
    // tensor parallel: this rank's slice of the model (local_param_table; one process: the table)
    LocalShape ls;
    std::vector<ParamTensor> local;
    std::vector<TablePiece> pieces;                 // local elements -> table elements
    std::vector<CheckpointRange> table_padding;     // table padding this rank reports (zeros; tp > 1)
    ChunkSplit split_attn, split_ffn, split_expert, split_vocab, split_tokens;  // canonical reductions
    bool canonical = true;  // the CPU build's canonical chunks (llmc/tensor_parallel.h); a GPU plan: one per rank
    size_t n_params = 0;     // elements of the parameter table (with alignment padding): checkpoints
    size_t param_count = 0;  // the model's parameters (what is reported and counted for FLOPs)
    PipelinePlan pipe;       // this rank's pipeline stage and its chunks
    // the flat buffers of this stage's segments, laid out and sharded by `zero` (llmc/zero.h)
    ZeroLayout zero;
    std::vector<int> seg_local;  // model segment id -> its index in zero.segs (-1: another stage's)
    floatX* params = nullptr;    // stage 0-2: every segment (padded space); stage 3: this rank's shard
    floatX* grads = nullptr;     // leaf gradients of one micro-batch (padded space; stage 3: slots)
    float* grad_acc = nullptr;   // fp32 sum of the leaves over the step's global micro-batches
    float* master = nullptr;     // fp32 master weights when params are not fp32 (the CUDA build), or offloaded
    float *adam_m = nullptr, *adam_v = nullptr;
    int offload = OFFLOAD_NONE;     // --offload optimizer: master, adam m/v in host arenas (llmc/offload.h)
    float* grad_staging = nullptr;  // offload: host fp32 [state_elems], the gradients down, the params up
    floatX* comm_scratch = nullptr;  // reduce_scatter_add's receive buffer (dp > 1)
    SegmentSlots<floatX> param_slots, grad_slots;  // stage 3: gathered segments
    std::vector<UpdatePiece> update_pieces;         // what this rank's optimizer step updates
    std::vector<std::vector<int>> early_pieces;     // --offload: per local segment, update pieces to download early
    std::vector<int> ready_count;                   // per local segment: grads_ready calls in this pipeline step
    bool count_ready = false;                       // in a pipeline step with --offload: count them
    AccRanges norm_skip;                            // tensor-parallel replicas' gradients (not counted here)
    ModelTensors p, g;  // pointers into params and grads (stage 3: into the slots, while gathered)
    // The tied lm head (on the last stage) and its gradient. Its gradient is summed over the step in
    // its own accumulator and added to the embedding's once per step (tied_embedding_sum); with
    // pp > 1 the last stage keeps a copy of the embedding's weights, refreshed after every update.
    // `head` is the embedding segment's layout, for these buffers' sizes.
    ZeroLayout head;
    floatX *head_leaf = nullptr, *head_params = nullptr;  // [head.padded]; head_params: pp > 1 only
    float* head_acc = nullptr;  // [shard]: this rank's slice (stage 0 with pp > 1: the receive buffer)

    int max_B = 0, max_T = 0;
    std::vector<std::vector<ChunkSlot>> slots;      // [chunk][k]: activations of micro-batches in flight
    std::vector<std::vector<ChunkStash>> stashes;   // [chunk][k]: zero-bubble B -> W stash
    std::vector<const ChunkSlot*> last_forward;     // [chunk]: the latest forward's slot (MoE statistics)
    LayerGrads layer_douts{};  // one layer's output gradients, when its weight gradients follow at once
    int recompute = 0;         // -r: activation recomputation level (acts_for)
    int plan_dp = 0;           // planning only: the data-parallel ranks to plan for (rank 0's share)
    size_t elem_bytes = sizeof(floatX);  // of params, leaf grads, activations (planning: 2 plans the GPU build's bf16)
    LayerActs recomp{};        // -r 1 / 2: one layer's activations that the slots do not keep
    floatX *lnf = nullptr, *logits = nullptr;       // the last stage's head (one micro-batch at a time)
    float *lnf_mean = nullptr, *lnf_rstd = nullptr, *losses = nullptr;
    // backward scratch, reused by every layer
    floatX *d_ln = nullptr, *d_atty = nullptr, *d_fch_act = nullptr, *scratch = nullptr;
    floatX* d_expert_in = nullptr;  // MoE: gradient of the experts' input rows
    floatX* ep_buf = nullptr;       // --ep: [E, capacity, C] rows on their way to or from the experts' owners
    // tensor-parallel reductions (llmc/tensor_parallel.h) and their operands
    TpScratch<floatX> tpx;
    TpScratch<float> tpf;
    floatX *tp_copy_a = nullptr, *tp_copy_b = nullptr;  // a leaf's slices of a matmul's operands
    // a kv head shared by tp ranks: its group's attention-backward operands (shared_kv_attention_backward)
    floatX *kv_send = nullptr, *kv_recv = nullptr, *kv_qkv = nullptr, *kv_dqkv = nullptr, *kv_dout = nullptr,
           *kv_out = nullptr;
    float *kv_lse_recv = nullptr, *kv_lse = nullptr;
    floatX* tp_full = nullptr;      // [B*T, C] --sp: a gathered stream gradient; MoE: the combined output
    floatX* tp_ln_grads = nullptr;  // [2C] a LayerNorm's weight and bias gradients
    floatX* ln_full[2] = {};        // [B*T, C] --sp: a block's LN1 and LN2 outputs, gathered (ln_gathered)
    float *ce_max = nullptr, *ce_sum = nullptr, *ce_target = nullptr;  // [B*T] vocab-parallel softmax
    int plan_tp = 0, plan_ep = 0;   // planning only: the tensor- and expert-parallel ranks to plan for
    void* op_scratch = nullptr;     // the CUDA ops' scratch and the cuBLASLt workspace (MEM_SCRATCH)
    size_t op_scratch_bytes = 0;
    std::vector<float> host_losses;
    double activation_bytes = 0;

    // the micro-batches the current forwards read, their loss scale, and the last stage's losses
    std::vector<MicroBatch> batches;
    float dloss_scale = 0.0f;
    std::vector<double> mb_loss;
    int B = 0, T = 0;

    MemoryArenas mem;  // every buffer above (llmc/memory.h); mem.plan_only: only count them
};

// Every buffer comes from here (llmc/memory.h): counted in the plan, carved from its kind's arena.
static void* take(GPT& m, MemKind kind, size_t bytes) {
    void* p = m.mem.take(kind, bytes);
    if (kind == MEM_ACTIVATIONS) m.activation_bytes = m.mem.planned[MEM_ACTIVATIONS];
    return p;
}
// The CUDA ops take their scratch and the matmul workspace from the model that runs them (a test
// may keep several models): bound where a model's forward, backward or update starts.
static void bind_op_scratch(const GPT& m) {
    if (m.op_scratch) backend_bind_scratch(m.op_scratch, m.op_scratch_bytes);
}
static floatX* take_act(GPT& m, size_t n) { return (floatX*)take(m, MEM_ACTIVATIONS, n * m.elem_bytes); }
static float* take_stats(GPT& m, size_t n) { return (float*)take(m, MEM_ACTIVATIONS, n * sizeof(float)); }
static int* take_ints(GPT& m, size_t n) { return (int*)take(m, MEM_ACTIVATIONS, n * sizeof(int)); }

// Stage 3 keeps this many gathered segments at once: parameters of the current and the next
// segment (a block's forward ends with the next block's LN1); leaf gradients of the segment in
// its backward (and one to spare).
constexpr int ZERO3_PARAM_SLOTS = 2, ZERO3_GRAD_SLOTS = 2;

// The layout of this stage's flat buffers for a ZeRO stage over the data-parallel group (zero.h).
static bool stage_holds_segment(const PipelinePlan& pp, int id, int n_layer) {
    return id == 0 ? pp.has_embedding() : id == n_layer + 1 ? pp.has_head() : pp.holds_layer(segment_layer(id, n_layer));
}
// Expert segments are sharded over the expert-dp group (edp) and have ep leaves.
static ZeroLayout gpt_zero_layout(const GPTConfig& c, const std::vector<ParamTensor>& table, int zero_stage,
                                  const CommGroup& dp, const CommGroup& edp, int ep, const PipelinePlan& pipe) {
    std::vector<SegmentSpec> mine;
    for (const SegmentSpec& s : segment_specs(c, table, ep))
        if (stage_holds_segment(pipe, s.id, c.n_layer)) mine.push_back(s);
    return zero_layout(mine, count_params(table), zero_stage, dp.size, dp.rank, edp.size, edp.rank);
}

// calls f(local, table, n, owner) for the runs of local elements [begin, begin + n) that are the
// table's (the local tables' alignment padding between tensors is no one's)
template <typename F>
static void for_each_table_run(const std::vector<TablePiece>& pieces, size_t begin, size_t n, const F& f) {
    size_t k = std::upper_bound(pieces.begin(), pieces.end(), begin, [](size_t v, const TablePiece& p) { return v < p.local; }) -
               pieces.begin();
    if (k > 0) k--;
    for (; k < pieces.size() && pieces[k].local < begin + n; k++) {
        const TablePiece& p = pieces[k];
        const size_t lo = std::max(begin, p.local), hi = std::min(begin + n, p.local + p.len);
        if (lo < hi) f(lo, p.global + (lo - p.local), hi - lo, p.owner);
    }
}
// The optimizer's pieces (local offsets) cut where the table's runs end, with table offsets: element
// i of the table draws its stochastic-rounding bits from step_seed + i in every layout.
static std::vector<UpdatePiece> table_update_pieces(const std::vector<UpdatePiece>& local, const std::vector<TablePiece>& pieces) {
    std::vector<UpdatePiece> out;
    for (const UpdatePiece& u : local)
        for_each_table_run(pieces, u.table_offset, u.n, [&](size_t lo, size_t global, size_t n, bool) {
            UpdatePiece v = u;
            const size_t d = lo - u.table_offset;
            v.param_index += d;
            v.state_index += d;
            v.acc_index += d;
            v.table_offset = global;
            v.n = n;
            out.push_back(v);
        });
    return out;
}
// tp > 1: the table's alignment padding after the split tensors of this stage belongs to no local
// tensor; dp rank 0 of tp rank 0 reports it (zeros), so that a checkpoint covers every element once
static std::vector<CheckpointRange> tp_table_padding(const GPT& m, const PipelinePlan& pp) {
    std::vector<CheckpointRange> out;
    if ((m.ls.tp == 1 && m.ls.ep == 1) || m.ls.rank != 0 || m.zero.rank != 0) return out;
    for (size_t k = 0; k < m.table.size(); k++) {
        const ParamTensor& t = m.table[k];
        const int seg = segment_of(t.name, m.config.n_layer);
        const bool here = stage_holds_segment(pp, seg, m.config.n_layer);
        const size_t end = t.offset + t.numel, next = (t.numel + 7) / 8 * 8 + t.offset;
        if (!here || end == next) continue;
        bool covered = false;  // replicas report their padding with the tensor
        for (const TablePiece& p : m.pieces)
            if (p.global <= end && end < p.global + p.len) covered = true;
        if (!covered) out.push_back({end, next - end});
    }
    return out;
}

// Micro-batches in flight per chunk in a stage's actions: activation slots (from a chunk's first
// action on a micro-batch to its last, pipe_last_use) and zero-bubble stashes (from a B whose W
// does not follow at once, to that W). The schedule decides the memory.
static void chunk_bounds(const std::vector<PipeAction>& actions, int V, std::vector<int>& slots, std::vector<int>& stashes) {
    slots.assign(V, 0);
    stashes.assign(V, 0);
    std::vector<int> live(V, 0), pending(V, 0);
    const std::vector<std::vector<size_t>> last = pipe_last_use(actions, V);
    std::vector<std::vector<bool>> seen(V);
    for (size_t k = 0; k < actions.size(); k++) {
        const PipeAction& a = actions[k];
        if ((int)seen[a.chunk].size() <= a.mb) seen[a.chunk].resize(a.mb + 1, false);
        if (!seen[a.chunk][a.mb]) { seen[a.chunk][a.mb] = true; slots[a.chunk] = std::max(slots[a.chunk], ++live[a.chunk]); }
        if (a.op == PIPE_B && !next_compute_is_own_w(actions, k))
            stashes[a.chunk] = std::max(stashes[a.chunk], ++pending[a.chunk]);
        if (a.op == PIPE_W && is_group_boundary(actions, k)) pending[a.chunk]--;
        if (last[a.chunk][a.mb] == k) live[a.chunk]--;
    }
    for (int c = 0; c < V; c++) slots[c] = std::max(slots[c], 1);  // forward-only passes (evaluation) use one
}

// Block l's activation buffers for B x T tokens: all of them (keep 0), all but the LayerNorm
// outputs and the FFN activation (keep 1: -r 1), only the block output and the routing (keep 2:
// -r 2); or the one-layer recompute buffers (l = -1, the largest FFN shapes given): what -r 1
// (keep 3) or -r 2 (keep 4) does not keep.
static LayerActs alloc_layer_acts(GPT& m, int l, int keep, size_t fc_max = 0, size_t act_max = 0, bool moe = false) {
    const GPTConfig& c = m.config;
    const LocalShape& ls = m.ls;
    // LayerNorm outputs and the tensor-parallel branches hold all B*T tokens; the residual stream
    // and the LayerNorm statistics the rank's stream rows (--sp: B*T / tp)
    const size_t BT = (size_t)m.max_B * m.max_T, C = c.n_embd, E = c.n_expert;
    const size_t rows = ls.sp ? BT / ls.tp : BT;
    const size_t expert_rows = c.n_expert > 0 ? E * c.moe_capacity(m.max_B, m.max_T) : 0, He = ls.expert_hidden;
    if (l >= 0) {
        moe = c.is_moe(l);
        fc_max = moe ? expert_rows * 2 * He : BT * ls.fc(c.mlp);
        act_max = moe ? expert_rows * He : BT * ls.ffn;
    }
    const bool slot = keep <= 2, all = keep == 0 || keep == 4;
    LayerActs a{};
    if (moe && slot) {  // the routing: every slot keeps it (small; the statistics read it)
        a.moe_scores = take_stats(m, BT * E);
        a.expert_tokens = take_ints(m, expert_rows);
        a.token_slots = take_ints(m, BT * E);
    }
    if (moe && (keep <= 1 || keep == 4)) {
        a.expert_in = take_act(m, expert_rows * C);
        a.expert_out = take_act(m, expert_rows * C);
    }
    if (all || keep == 3) a.ln1 = take_act(m, rows * C);
    if (keep <= 1 || keep == 4) {
        a.ln1_mean = take_stats(m, rows);
        a.ln1_rstd = take_stats(m, rows);
        a.qkv = take_act(m, BT * ls.qkv());
        a.atty = take_act(m, BT * ls.n_head * ls.hs);
        a.att_lse = take_stats(m, BT * ls.n_head);
        a.residual2 = take_act(m, rows * C);
        a.ln2_mean = take_stats(m, rows);
        a.ln2_rstd = take_stats(m, rows);
        a.fch = take_act(m, fc_max);
    }
    if (all || keep == 3) {
        a.ln2 = take_act(m, rows * C);
        a.fch_act = take_act(m, act_max);
    }
    if (slot) a.residual3 = take_act(m, rows * C);
    return a;
}

// The memory plan: everything is allocated here, once; the training step allocates nothing. With
// mem.plan_only set it counts the same buffers without allocating (gpt_memory_estimate).
static void gpt_allocate(GPT& m, const GPTConfig& config, int B, int T, int zero_stage = 0,
                         const PipelinePlan* pipe = nullptr, int recompute = 0, bool sp = false) {
    if (!m.mem.plan_only) {  // the arenas: one allocation per kind, at the plan's size
        GPT plan;
        plan.mem.plan_only = true;
        plan.offload = m.offload;
        gpt_allocate(plan, config, B, T, zero_stage, pipe, recompute, sp);
        m.mem.allocate_as(plan.mem);
    }
    CommGroup dp = comm_world().dp, tp = comm_world().tp, ep = comm_world().ep, edp = comm_world().edp;
    if (m.mem.plan_only && m.plan_dp > 0) dp = CommGroup{0, m.plan_dp};
    if (m.mem.plan_only && m.plan_tp > 0) tp = CommGroup{0, m.plan_tp};
    if (m.mem.plan_only && (m.plan_dp > 0 || m.plan_ep > 0)) {
        ep = CommGroup{0, std::max(1, m.plan_ep)};
        LLMC_CHECK(dp.size % ep.size == 0, "--ep %d must divide the %d data-parallel ranks", ep.size, dp.size);
        edp = CommGroup{0, dp.size / ep.size};
    }
    config.check_batch(B, T, dp.size);
    LLMC_CHECK(recompute >= 0 && recompute <= 2, "-r/--recompute: expected 0, 1 or 2, got %d", recompute);
    m.ls = local_shape(config, tp.size, tp.rank, sp, ep.size, ep.rank);
    LLMC_CHECK(m.mem.plan_only || tp.size <= config.n_kv_head || comm_world().tp_kv.size == tp.size / config.n_kv_head,
               "internal: the tp ranks sharing a kv head have no group (comm_make_kv_group)");
    LLMC_CHECK(!m.ls.sp || ((int64_t)B * T) % tp.size == 0,
               "--sp: the B*T = %lld tokens of a micro-batch must split evenly over --tp %d ranks", (long long)B * T, tp.size);
    // the canonical chunks of the CPU build make tensor parallelism bitwise (llmc/tensor_parallel.h)
    const bool canonical = m.elem_bytes == sizeof(float) && sizeof(floatX) == sizeof(float);
    m.canonical = canonical;
    const int G = tp_chunk_count(config), G_tok = tp_token_chunks(config, (long)B * T);
    m.split_attn = chunk_split(config.n_head, G, tp.size, tp.rank, canonical);  // query heads (their kv heads with the first)
    m.split_ffn = chunk_split(config.ffn_hidden, G, tp.size, tp.rank, canonical);
    m.split_expert = chunk_split(config.n_expert > 0 ? config.expert_hidden : G, G, tp.size, tp.rank, canonical);
    m.split_vocab = chunk_split(config.padded_vocab_size, G, tp.size, tp.rank, canonical);
    m.split_tokens = m.ls.sp ? chunk_split((long)B * T, G_tok, tp.size, tp.rank, canonical)
                              : chunk_split((long)B * T, G_tok, 1, 0, canonical);
    m.config = config;
    m.recompute = recompute;
    m.pipe = pipe ? *pipe : single_stage_plan(config);
    const PipelinePlan& pp = m.pipe;
    m.table = build_param_table(config);
    m.local = local_param_table(config, m.table, m.ls, m.pieces);
    m.n_params = count_params(m.table);
    for (const ParamTensor& t : m.table) m.param_count += t.numel;
    m.zero = gpt_zero_layout(config, m.local, zero_stage, dp, edp, ep.size, pp);
    const ZeroLayout& z = m.zero;
    m.seg_local.assign(2 * config.n_layer + 2, -1);
    for (int s = 0; s < (int)z.segs.size(); s++) m.seg_local[z.segs[s].id] = s;
    const size_t fx = m.elem_bytes;
    m.params = (floatX*)take(m, MEM_PARAMS, z.params_elems() * fx);
    m.grad_acc = (float*)take(m, MEM_GRADS, z.acc_elems() * sizeof(float));
    // --offload optimizer: the master (the CPU build too: a host copy of its fp32 params), the
    // moments and the gradient staging of what this rank updates go to the host arenas
    const bool host_state = m.offload == OFFLOAD_OPTIMIZER;
    if (m.elem_bytes != sizeof(float) || host_state)
        m.master = (float*)take(m, host_state ? MEM_HOST_MASTER : MEM_MASTER, z.state_elems() * sizeof(float));
    m.adam_m = (float*)take(m, host_state ? MEM_HOST_MOMENTS : MEM_MOMENTS, z.state_elems() * sizeof(float));
    m.adam_v = (float*)take(m, host_state ? MEM_HOST_MOMENTS : MEM_MOMENTS, z.state_elems() * sizeof(float));
    if (host_state) m.grad_staging = (float*)take(m, MEM_HOST_STAGING, z.state_elems() * sizeof(float));
    if (pp.has_head() || (pp.has_embedding() && pp.P > 1)) {
        const std::vector<SegmentSpec> all = segment_specs(config, m.local);
        m.head = zero_layout({all[0]}, count_params(m.local), zero_stage, dp.size, dp.rank);
        m.head_acc = (float*)take(m, MEM_GRADS, m.head.shard_len(0) * sizeof(float));
        if (pp.has_head()) m.head_leaf = (floatX*)take(m, MEM_GRADS, m.head.padded_total * fx);
        if (pp.has_head() && pp.P > 1) m.head_params = (floatX*)take(m, MEM_PARAMS, m.head.padded_total * fx);
    }
    const size_t scratch_elems = std::max(z.max_leaves, m.head.segs.empty() ? 0 : m.head.max_padded);
    if (dp.size > 1) m.comm_scratch = (floatX*)take(m, MEM_GRADS, scratch_elems * fx);
    if (z.params_sharded()) {
        // a block's forward holds its segments and the next block's (MoE: a block is two segments)
        const int param_slots = ZERO3_PARAM_SLOTS * (config.n_expert > 0 ? 2 : 1);
        const int grad_slots = ZERO3_GRAD_SLOTS;
        for (int k = 0; k < param_slots; k++) m.param_slots.buf.push_back((floatX*)take(m, MEM_PARAMS, z.max_padded * fx));
        for (int k = 0; k < grad_slots; k++) m.grad_slots.buf.push_back((floatX*)take(m, MEM_GRADS, z.max_leaves * fx));
        m.param_slots.holds.assign(param_slots, -1);
        m.grad_slots.holds.assign(grad_slots, -1);
        m.p.layers.resize(config.n_layer);  // pointers appear while a segment is gathered
        m.g.layers.resize(config.n_layer);
    } else {
        m.grads = (floatX*)take(m, MEM_GRADS, z.leaf_total * fx);
        m.p.layers.resize(config.n_layer);
        m.g.layers.resize(config.n_layer);
        if (!m.mem.plan_only)
            for (const Segment& s : z.segs) {
                point_segment(m.p, config, m.local, s, m.params + s.padded_offset);
                point_segment(m.g, config, m.local, s, m.grads + s.leaf_offset);
            }
    }
    std::vector<TensorRange> tensors;
    for (const ParamTensor& t : m.local) tensors.push_back({t.offset, t.numel, t.decay});
    m.update_pieces = table_update_pieces(zero_update_pieces(z, tensors), m.pieces);
    // --offload optimizer: the pieces whose gradient download can start at their segment's last
    // grads_ready of a step (llmc/offload.h): not the embedding's (the tied head adds to it after
    // the backward), not a segment that -z 0 replicates (the all-gather before the norm completes it)
    m.early_pieces.assign(z.segs.size(), {});
    m.ready_count.assign(z.segs.size(), 0);
    for (int k = 0; k < (int)m.update_pieces.size() && m.offload == OFFLOAD_OPTIMIZER; k++)
        for (int s = 0; s < (int)z.segs.size(); s++) {
            const size_t at = m.update_pieces[k].acc_index, own = z.acc_own(s);
            if (at < own || at >= own + z.shard_len(s)) continue;
            if (z.segs[s].id != 0 && (z.stage >= 1 || (z.segs[s].expert ? edp : dp).size == 1)) m.early_pieces[s].push_back(k);
            break;
        }
    m.table_padding = tp_table_padding(m, pp);
    for (int s = 0; s < (int)z.segs.size(); s++) {  // replicas: the grad norm counts them on their owner
        const Segment& seg = z.segs[s];
        const size_t lo = z.own_begin(s), hi = std::min(lo + z.shard_len(s), seg.len);
        if (lo < hi)
            for_each_table_run(m.pieces, seg.begin + lo, hi - lo, [&](size_t local, size_t, size_t n, bool owner) {
                const size_t at = z.acc_own(s) + (local - seg.begin - lo);
                if (!owner) m.norm_skip.push_back({at, at + n});
            });
    }

    const LocalShape& ls = m.ls;
    const size_t BT = (size_t)B * T, C = config.n_embd, E = config.n_expert, rows = ls.sp ? BT / ls.tp : BT;
    m.max_B = B;
    m.max_T = T;
    m.activation_bytes = 0;
    const bool moe = config.n_expert > 0;
    const size_t expert_rows = moe ? E * config.moe_capacity(B, T) : 0, He = ls.expert_hidden;
    auto fc_elems = [&](int l) { return config.is_moe(l) ? expert_rows * 2 * He : BT * ls.fc(config.mlp); };
    auto act_elems = [&](int l) { return config.is_moe(l) ? expert_rows * He : BT * ls.ffn; };
    // the activations of each chunk's layers, once per micro-batch the schedule keeps in flight
    std::vector<int> n_slots, n_stashes;
    chunk_bounds(pp.schedule[pp.stage], pp.V, n_slots, n_stashes);
    m.slots.assign(pp.V, {});
    m.stashes.assign(pp.V, {});
    m.last_forward.assign(pp.V, nullptr);
    for (int c = 0; c < pp.V; c++) {
        for (int k = 0; k < n_slots[c]; k++) {
            ChunkSlot s;
            for (int l = pp.layer_begin(c); l < pp.layer_end(c); l++)
                s.acts.push_back(alloc_layer_acts(m, l, recompute == 0 ? 0 : recompute == 1 ? 1 : 2));
            s.input = take_act(m, rows * C);
            s.d_stream = take_act(m, rows * C);
            s.inputs = (int*)take(m, MEM_BATCH, BT * sizeof(int));
            s.targets = (int*)take(m, MEM_BATCH, BT * sizeof(int));
            s.doc_start = (int*)take(m, MEM_BATCH, BT * sizeof(int));
            m.slots[c].push_back(s);
        }
        for (int k = 0; k < n_stashes[c]; k++) {
            ChunkStash st;
            for (int l = pp.layer_begin(c); l < pp.layer_end(c); l++) {
                LayerGrads d{};
                d.d_ffn_out = take_act(m, config.is_moe(l) ? expert_rows * C : BT * C);
                d.d_fch = take_act(m, fc_elems(l));
                d.d_ln2 = take_act(m, BT * C);
                if (config.is_moe(l)) d.d_moe_scores = take_stats(m, BT * E);
                d.d_attn_out = take_act(m, BT * C);
                d.d_qkv = take_act(m, BT * ls.qkv());
                d.d_ln1 = take_act(m, BT * C);
                st.layers.push_back(d);
            }
            m.stashes[c].push_back(st);
        }
    }
    // one layer's output gradients for a backward that computes the weight gradients at once (the
    // dense branch's and the attention projection's output gradients are the residual stream's)
    size_t fc_max = 0, act_max = 0;
    bool stage_moe = false;
    for (int l = 0; l < config.n_layer; l++)
        if (pp.holds_layer(l)) {
            fc_max = std::max(fc_max, fc_elems(l));
            act_max = std::max(act_max, act_elems(l));
            stage_moe = stage_moe || config.is_moe(l);
        }
    if (recompute > 0) m.recomp = alloc_layer_acts(m, -1, recompute == 1 ? 3 : 4, fc_max, act_max, stage_moe);
    if (stage_moe && m.ls.ep > 1) m.ep_buf = take_act(m, expert_rows * C);
    if (stage_moe) {
        m.layer_douts.d_ffn_out = take_act(m, expert_rows * C);
        m.layer_douts.d_moe_scores = take_stats(m, BT * E);
        m.d_expert_in = take_act(m, expert_rows * C);
    }
    m.layer_douts.d_fch = take_act(m, fc_max);
    m.layer_douts.d_ln2 = take_act(m, BT * C);
    m.layer_douts.d_qkv = take_act(m, BT * ls.qkv());
    m.layer_douts.d_ln1 = take_act(m, BT * C);
    m.d_fch_act = take_act(m, act_max);
    m.d_atty = take_act(m, BT * C);
    m.scratch = take_act(m, rows * C);  // a branch's output (the stream's rows)
    if (pp.has_head()) {
        m.lnf = take_act(m, BT * C);
        m.lnf_mean = take_stats(m, rows);
        m.lnf_rstd = take_stats(m, rows);
        m.logits = take_act(m, BT * ls.vocab);
        m.losses = take_stats(m, BT);
        m.ce_max = take_stats(m, BT);
        m.ce_sum = take_stats(m, BT);
        m.ce_target = take_stats(m, BT);
        m.d_ln = take_act(m, BT * C);
        m.host_losses.resize(BT);
    }
    // the tensor-parallel reductions' scratch (llmc/tensor_parallel.h): a subtree's temporaries
    // where a rank computes several canonical leaves, the parts and receive buffers of a group's
    // reduction, the leaves' operand slices
    int max_leaves = 1, levels = 0, nodes = 1;
    for (const ChunkSplit* sp : {&m.split_attn, &m.split_ffn, &m.split_expert, &m.split_vocab, &m.split_tokens}) {
        max_leaves = std::max(max_leaves, sp->count);
        levels = std::max(levels, tree_levels(sp->count));
        if (ls.tp > 1) nodes = std::max(nodes, split_nodes(*sp));
    }
    LLMC_CHECK(levels <= TP_MAX_LEVELS, "internal: %d canonical chunks per rank", max_leaves);
    const size_t red_x = std::max({BT * C, expert_rows * C, 2 * C}), red_f = BT;
    m.tpx.capacity = red_x;
    m.tpf.capacity = red_f;
    m.tpx.levels = m.tpf.levels = levels;
    m.tpx.nodes = m.tpf.nodes = nodes;
    for (int k = 0; k < levels; k++) {
        m.tpx.tmp[k] = take_act(m, red_x);
        m.tpf.tmp[k] = take_stats(m, red_f);
    }
    if (ls.tp > 1) {
        m.tpx.recv_capacity = nodes * red_x;
        m.tpf.recv_capacity = nodes * red_f * ls.tp;
        m.tpx.recv = take_act(m, m.tpx.recv_capacity);
        m.tpf.recv = take_stats(m, m.tpf.recv_capacity);
        if (nodes > 1) {
            m.tpx.extra = take_act(m, (nodes - 1) * red_x);
            m.tpf.extra = take_stats(m, (nodes - 1) * red_f);
        }
    }
    if (ls.sp) m.tpx.part = take_act(m, red_x);
    m.tp_ln_grads = take_act(m, 2 * C);
    if (ls.sp) {
        m.tp_full = take_act(m, BT * C);
        for (floatX*& buf : m.ln_full) buf = take_act(m, BT * C);
    }
    const int kv_share = ls.tp > config.n_kv_head ? ls.tp / config.n_kv_head : 1;
    if (max_leaves > 1 || kv_share > 1) {  // (a shared kv head: only its owner's qkv leaf has its rows)
        const size_t wide = std::max({(size_t)ls.qkv(), (size_t)ls.fc(config.mlp), (size_t)ls.vocab});
        m.tp_copy_a = take_act(m, std::max(BT * wide, expert_rows * 2 * He));
        m.tp_copy_b = take_act(m, std::max(C * wide, E * 2 * He * C));
    }
    if (kv_share > 1) {
        const size_t qw = (size_t)ls.n_head * ls.hs, gw = qw * kv_share;
        m.kv_send = take_act(m, BT * qw);
        m.kv_recv = take_act(m, BT * gw);
        m.kv_qkv = take_act(m, BT * (gw + 2 * ls.hs));
        m.kv_dqkv = take_act(m, BT * (gw + 2 * ls.hs));
        m.kv_dout = take_act(m, BT * gw);
        m.kv_out = take_act(m, BT * gw);
        m.kv_lse_recv = take_stats(m, BT * ls.n_head * kv_share);
        m.kv_lse = take_stats(m, BT * ls.n_head * kv_share);
    }
    // the CUDA ops' scratch and the cuBLASLt workspace for the rank's shapes (llmc/op_scratch.h),
    // wherever the plan is the CUDA build's (bf16); the CPU ops need none
    if (m.elem_bytes == 2) {
        const int widest_biased = std::max({(int)C, ls.qkv(), ls.fc(config.mlp)});
        m.op_scratch_bytes = MATMUL_WORKSPACE_BYTES +
                             op_scratch_bytes(B, T, (int)C, ls.n_head, widest_biased, (int)E,
                                              E > 0 ? config.moe_capacity(B, T) : 0, (int)He, plan_sm_count());
        m.op_scratch = take(m, MEM_SCRATCH, m.op_scratch_bytes);
    }
    m.mem.check_used();  // allocated == planned, byte for byte
    if (!m.mem.plan_only) bind_op_scratch(m);
}

// The memory guard: refuses, before anything big is allocated, a run whose buffers cannot fit,
// with the numbers and what to change. On the CPU the buffers and the host staging share host memory.
static void check_memory_fits(const GPTConfig& c, int B, int T, int zero_stage, const PipelinePlan& pipe, int recompute,
                              bool sp, int offload);

static void gpt_free(GPT& m) {
    backend_bind_scratch(nullptr, 0);  // the arena goes with the model
    m.mem.release();
    m = GPT();
}

// The elements per array of the host staging of gpt_set_state and gpt_write_state: a chunk, or a
// small model's size (verify_checkpoint reads at most 3x this many words at a time: 12 bytes each).
static size_t staging_cap(const GPT& m) {
    return std::min(staging_elems(), std::max({m.n_params, m.zero.max_padded, m.head.max_padded}));
}

// What gpt_allocate takes for (config, B, T, ZeRO stage, pipeline stage, -r, dp), without
// allocating: the memory guard compares it with the machine before the run starts, the start-up
// tables and --plan print it.
static MemoryEstimate gpt_memory_estimate(const GPTConfig& c, int B, int T, int zero_stage = 0,
                                          const PipelinePlan* pipe = nullptr, int recompute = 0, int plan_dp = 0,
                                          size_t elem_bytes = sizeof(floatX), int plan_tp = 0, bool sp = false,
                                          int plan_ep = 0, int offload = OFFLOAD_NONE) {
    GPT plan;
    plan.mem.plan_only = true;
    plan.plan_dp = plan_dp;
    plan.plan_tp = plan_tp;
    plan.plan_ep = plan_ep;
    plan.elem_bytes = elem_bytes;
    plan.offload = offload;
    gpt_allocate(plan, c, B, T, zero_stage, pipe, recompute, sp);
    MemoryEstimate e = MemoryEstimate::of(plan.mem);
    // host (pageable) staging: init, checkpoint loads and saves stream the state through one chunk
    // per array (gpt_set_state, gpt_write_state: params, adam m, adam v in fp32 and the params'
    // type; verify_checkpoint reads at most as many bytes), not the table; plus the batch vectors of
    // the step's micro-batches and the per-token losses. Not counted: --init_from and --export_llmc
    // (llm.c's GPT-2 files, at most 1.5B parameters) stage the whole table (a few fp32 copies).
    const double chunk = (double)staging_cap(plan), f = sizeof(float), fx = (double)elem_bytes, BT = (double)B * T;
    e.host = chunk * (3 * f + fx) + (3.0 * plan.pipe.M + 1) * BT * sizeof(int);
    return e;
}

// where the element at a table offset lives in the padded space (the full buffers at stages 0-2)
[[maybe_unused]] static size_t gpt_padded_index(const GPT& m, size_t table_offset) {
    const ZeroLayout& z = m.zero;
    for (int s = 0; s < (int)z.segs.size(); s++)
        if (table_offset >= z.segs[s].begin && table_offset < z.segs[s].begin + z.segs[s].len)
            return z.padded_index(s, table_offset - z.segs[s].begin);
    LLMC_FAIL("table offset %zu is not in this stage's parameters", table_offset);
}

// Model state, in the table's layout (init, checkpoints, llm.c files, tests) <-> wherever this rank
// keeps it. With master weights the fp32 values live in the master and params hold their rounding.
// Segment padding stays zero. Both directions stream: the state passes through host staging of at
// most staging_elems() elements per array (llmc/checkpoint.h), never the whole table.

// A source of model state: fills table elements [begin, begin + n) of the params, Adam m and Adam v
// (arrays of n floats; m and v are null where the caller keeps no moments). The init, a checkpoint
// file and whole-table arrays are sources.
using StateSource = std::function<void(size_t begin, size_t n, float* params, float* adam_m, float* adam_v)>;

// where segment-relative element rel of segment s lives in the params and the master/moment buffers
static size_t params_index(const ZeroLayout& z, int s, size_t rel) {
    return z.params_sharded() ? z.shard_index(s, rel) : z.padded_index(s, rel);
}
static size_t state_index(const ZeroLayout& z, int s, size_t rel) {
    return z.state_sharded() ? z.shard_index(s, rel) : z.padded_index(s, rel);
}

// Fills this rank's buffers from a source (not collective): per segment, the part its params
// hold (-z 3: the rank's slice; else the whole segment) and inside it the part its master and
// moments hold (-z 1..3: the slice), then the last stage's copy of the tied embedding (pp > 1). A
// chunk of local elements maps to table runs (tensor parallel: the rank's rows and columns; the
// local alignment padding between tensors is no one's and stays zero, as the segment padding).
static void gpt_set_state(GPT& m, const StateSource& src) {
    const size_t cap = staging_cap(m);
    std::vector<float> p(cap), mm(cap), v(cap);
    std::vector<floatX> px(cap);
    const bool host = m.offload == OFFLOAD_OPTIMIZER;  // the state in host arenas
    // one layout's segments: params of rel [lo, hi) into `params`; with_state: master and moments too
    auto load = [&](const ZeroLayout& z, floatX* params, bool params_sharded, bool with_state) {
        for (int s = 0; s < (int)z.segs.size(); s++) {
            const Segment& seg = z.segs[s];
            const size_t lo = params_sharded ? z.own_begin(s) : 0, hi = params_sharded ? lo + z.shard_len(s) : seg.padded;
            const size_t st_lo = z.state_sharded() ? z.own_begin(s) : 0;
            const size_t st_hi = !with_state ? st_lo : z.state_sharded() ? st_lo + z.shard_len(s) : seg.padded;
            for (size_t a = lo; a < hi; a += cap) {
                const size_t n = std::min(cap, hi - a), real = a < seg.len ? std::min(n, seg.len - a) : 0;
                std::fill(p.begin(), p.begin() + n, 0.0f);
                std::fill(mm.begin(), mm.begin() + n, 0.0f);
                std::fill(v.begin(), v.begin() + n, 0.0f);
                // the chunk's table runs, cut where the moments' part begins and ends
                if (real > 0)
                    for_each_table_run(m.pieces, seg.begin + a, real, [&](size_t local, size_t global, size_t len, bool) {
                        for (size_t rel = local - seg.begin, end = rel + len; rel < end;) {
                            const bool state = rel >= st_lo && rel < st_hi;
                            const size_t stop = std::min(end, state ? st_hi : rel < st_lo ? st_lo : end);
                            const size_t at = rel - a;
                            src(global + (rel - (local - seg.begin)), stop - rel, p.data() + at,
                                state ? mm.data() + at : nullptr, state ? v.data() + at : nullptr);
                            rel = stop;
                        }
                    });
#pragma omp parallel for schedule(static)
                for (size_t k = 0; k < n; k++) px[k] = (floatX)p[k];
                copy_to_buffer(params + (params_sharded ? z.shard_index(s, a) : z.padded_index(s, a)), px.data(),
                               n * sizeof(floatX));
                const size_t c0 = std::max(a, st_lo), c1 = std::min(a + n, st_hi);  // the moments' part of the chunk
                if (c0 >= c1) continue;
                const size_t at = state_index(z, s, c0), bytes = (c1 - c0) * sizeof(float);
                if (m.master) state_copy_in(host, m.master + at, p.data() + (c0 - a), bytes);
                state_copy_in(host, m.adam_m + at, mm.data() + (c0 - a), bytes);
                state_copy_in(host, m.adam_v + at, v.data() + (c0 - a), bytes);
            }
        }
    };
    load(m.zero, m.params, m.zero.params_sharded(), true);
    if (m.head_params) load(m.head, m.head_params, false, false);  // the last stage's copy of the tied embedding
}

// The whole state in the table's layout, the same arrays on every rank (tests, llm.c files).
static void gpt_set_state(GPT& m, const float* table_params, const float* table_m, const float* table_v) {
    gpt_set_state(m, [&](size_t begin, size_t n, float* p, float* mm, float* v) {
        std::copy(table_params + begin, table_params + begin + n, p);
        if (mm) std::copy(table_m + begin, table_m + begin + n, mm);
        if (v) std::copy(table_v + begin, table_v + begin + n, v);
    });
}

// This rank's own slice of every segment (the shard space, z.shard_total elements each): fp32
// params, adam m, adam v. At stage 0 every rank holds everything and reports its slice.
static void gpt_own_state(const GPT& m, float* params, float* adam_m, float* adam_v) {
    const ZeroLayout& z = m.zero;
    std::vector<float> st_m(z.state_elems()), st_v(z.state_elems()), st_p;
    const bool host = m.offload == OFFLOAD_OPTIMIZER;  // the state in host arenas
    state_copy_out(host, st_m.data(), m.adam_m, st_m.size() * 4);
    state_copy_out(host, st_v.data(), m.adam_v, st_v.size() * 4);
    if (m.master) {
        st_p.resize(z.state_elems());
        state_copy_out(host, st_p.data(), m.master, st_p.size() * 4);
    } else {
        std::vector<floatX> raw(z.params_elems());
        copy_from_buffer(raw.data(), m.params, raw.size() * sizeof(floatX));
        st_p.assign(raw.begin(), raw.end());
    }
    for (int s = 0; s < (int)z.segs.size(); s++)
        for (size_t rel = z.own_begin(s); rel < z.own_begin(s) + z.shard_len(s); rel++) {
            const size_t out = z.shard_index(s, rel);
            const size_t st = z.state_sharded() ? out : z.padded_index(s, rel);
            params[out] = st_p[m.master ? st : (z.params_sharded() ? out : z.padded_index(s, rel))];
            adam_m[out] = st_m[st];
            adam_v[out] = st_v[st];
        }
}

// calls f(rel, table, n) for this rank's own runs among the segment-relative elements [a, b) of its
// slice of segment s: the table's elements (not padding) that this rank reports, a tensor-parallel
// replica by its owner only
template <typename F>
static void for_each_own_run(const GPT& m, int s, size_t a, size_t b, const F& f) {
    const Segment& seg = m.zero.segs[s];
    b = std::min(b, seg.len);
    if (a >= b) return;
    for_each_table_run(m.pieces, seg.begin + a, b - a, [&](size_t local, size_t global, size_t n, bool owner) {
        if (owner) f(local - seg.begin, global, n);
    });
}
// the segment-relative range of this rank's own slice of segment s
static std::pair<size_t, size_t> own_slice(const ZeroLayout& z, int s) {
    return {z.own_begin(s), z.own_begin(s) + z.shard_len(s)};
}

// This rank's own slices (what it writes to a checkpoint, what a gather collects): the table ranges
// they cover and their values, from a shard-space array. A tensor-parallel replica is reported by
// its owner only; tp_table_padding's zeros are reported too, so every table element is someone's.
static void own_table_slices(const GPT& m, const float* shard_values, std::vector<CheckpointRange>& ranges,
                             std::vector<float>& values) {
    const ZeroLayout& z = m.zero;
    ranges.clear();
    values.clear();
    for (int s = 0; s < (int)z.segs.size(); s++) {
        const auto [lo, hi] = own_slice(z, s);
        for_each_own_run(m, s, lo, hi, [&](size_t rel, size_t global, size_t n) {
            if (!ranges.empty() && ranges.back().begin + ranges.back().n == global) ranges.back().n += n;
            else ranges.push_back({global, n});
            const float* v = shard_values + z.shard_index(s, rel);
            values.insert(values.end(), v, v + n);
        });
    }
    for (const CheckpointRange& pad : m.table_padding) {
        ranges.push_back(pad);
        values.insert(values.end(), pad.n, 0.0f);
    }
}

// This rank's part of a checkpoint being written (out, llmc/checkpoint.h), streamed: its own slices
// chunk by chunk, copied out of the buffers (fp32 params from the master, or the params themselves;
// the moments) into host staging, checked finite (a diverged state is never written: a later
// --resume would continue from it), each owned table run written at its place in the file. Host
// memory: one chunk per array.
static void gpt_write_state(const GPT& m, CheckpointWriter& out, int step) {
    const ZeroLayout& z = m.zero;
    const size_t cap = staging_cap(m);
    std::vector<float> st[3];
    for (auto& a : st) a.resize(cap);
    std::vector<floatX> raw(m.master ? 0 : cap);
    const bool host = m.offload == OFFLOAD_OPTIMIZER;  // the state in host arenas
    for (int s = 0; s < (int)z.segs.size(); s++) {
        const auto [lo, hi] = own_slice(z, s);
        for (size_t a = lo; a < std::min(hi, z.segs[s].len); a += cap) {
            const size_t n = std::min(cap, hi - a), at = state_index(z, s, a), bytes = n * sizeof(float);
            if (m.master) {
                state_copy_out(host, st[0].data(), m.master + at, bytes);
            } else {
                copy_from_buffer(raw.data(), m.params + params_index(z, s, a), n * sizeof(floatX));
                std::copy(raw.begin(), raw.begin() + n, st[0].begin());
            }
            state_copy_out(host, st[1].data(), m.adam_m + at, bytes);
            state_copy_out(host, st[2].data(), m.adam_v + at, bytes);
            for (int k = 0; k < 3; k++) {
                const size_t bad = first_non_finite(st[k].data(), n);
                if (bad == n) continue;
                LLMC_FAIL("step %d: refusing to write %s: a %s is %g (the model state is not finite: the run diverged); "
                          "resume from an earlier checkpoint with a lower --lr", step, out.path.c_str(),
                          k == 0 ? "parameter" : k == 1 ? "Adam m" : "Adam v", st[k][bad]);
            }
            for_each_own_run(m, s, a, a + n, [&](size_t rel, size_t global, size_t len) {
                for (int k = 0; k < 3; k++) out.write_range(k, global, len, st[k].data() + (rel - a));
            });
        }
    }
    const float zeros[8] = {};  // tp_table_padding: a tensor's alignment gap, under 8 elements
    for (const CheckpointRange& pad : m.table_padding)
        for (int k = 0; k < 3; k++) out.write_range(k, pad.begin, pad.n, zeros);
}

// Every rank's own slices (shard space) -> the whole table, on every rank of the world (collective):
// each rank sends its table ranges and their values (pipeline stages and tensor-parallel ranks hold
// different parts).
static void gather_to_table(const GPT& m, const float* own_shard, float* table_out) {
    const CommGroup& world = comm_world().world;
    std::vector<CheckpointRange> own;
    std::vector<float> vals;
    own_table_slices(m, own_shard, own, vals);
    std::vector<uint64_t> ranges;
    for (const CheckpointRange& rg : own) ranges.insert(ranges.end(), {rg.begin, rg.n});
    size_t max_vals = 0, max_ranges = 0;
    for (uint64_t n : host_gather_all<uint64_t>(world, vals.size())) max_vals = std::max(max_vals, (size_t)n);
    for (uint64_t n : host_gather_all<uint64_t>(world, ranges.size())) max_ranges = std::max(max_ranges, (size_t)n);
    std::vector<float> v(max_vals, 0.0f), all_v(max_vals * world.size);
    std::vector<uint64_t> r(max_ranges, 0), all_r(max_ranges * world.size);
    std::copy(vals.begin(), vals.end(), v.begin());
    std::copy(ranges.begin(), ranges.end(), r.begin());
    host_all_gather(world, v.data(), all_v.data(), max_vals * sizeof(float));
    host_all_gather(world, r.data(), all_r.data(), max_ranges * sizeof(uint64_t));
    for (int k = 0; k < world.size; k++) {
        size_t at = 0;
        for (size_t j = 0; j + 1 < max_ranges; j += 2) {
            const uint64_t begin = all_r[k * max_ranges + j], n = all_r[k * max_ranges + j + 1];
            for (uint64_t e = 0; e < n; e++) table_out[begin + e] = all_v[k * max_vals + at++];
        }
    }
}

// The whole state in table layout on every rank (collective): tests, exports.
[[maybe_unused]] static void gpt_get_state(const GPT& m, float* params, float* adam_m, float* adam_v) {
    std::vector<float> own[3];
    for (auto& v : own) v.resize(m.zero.shard_total);
    gpt_own_state(m, own[0].data(), own[1].data(), own[2].data());
    float* outs[3] = {params, adam_m, adam_v};
    for (int a = 0; a < 3; a++)
        if (outs[a]) gather_to_table(m, own[a].data(), outs[a]);
}

// The accumulated gradient of the step so far, in table layout, on every rank (collective; tests).
// In one stage the lm head's part of the tied embedding is added here as tied_embedding_sum will
// (with pp > 1, call it after tied_embedding_sum).
[[maybe_unused]] static std::vector<float> gpt_grads(const GPT& m) {
    const ZeroLayout& z = m.zero;
    std::vector<float> acc(z.acc_elems()), own(z.shard_total), out(m.n_params, 0.0f), head;
    copy_from_buffer(acc.data(), m.grad_acc, acc.size() * 4);
    if (m.pipe.P == 1 && m.head_acc) {
        head.resize(m.head.shard_len(0));
        copy_from_buffer(head.data(), m.head_acc, head.size() * 4);
    }
    for (int s = 0; s < (int)z.segs.size(); s++)
        for (size_t rel = z.own_begin(s); rel < z.own_begin(s) + z.shard_len(s); rel++) {
            float v = acc[z.acc_sharded() ? z.shard_index(s, rel) : z.padded_index(s, rel)];
            if (z.segs[s].id == 0 && !head.empty()) v += head[rel - z.own_begin(s)];
            own[z.shard_index(s, rel)] = v;
        }
    gather_to_table(m, own.data(), out.data());
    return out;
}

// The init (normal(0, init_std), ones, zeros by tensor; docs/ARCHITECTURE.md): table element i of a
// normal tensor is normal_at(seed, i) (llmc/rand.h), a value that depends only on (seed, i), so each
// rank computes just the parts it holds, in parallel, and every layout starts from the same bits.
// The wte rows past vocab_size (padding to a multiple of 128) start at zero: no token uses them, so
// their gradient is zero and AdamW (zero update, decay of zero) keeps them at zero. Moments: zero.
static void gpt_init_params(GPT& m, uint64_t seed) {
    const std::vector<ParamTensor>& table = m.table;
    const size_t wte_used = (size_t)m.config.vocab_size * m.config.n_embd;  // table[0] is wte
    gpt_set_state(m, [&](size_t begin, size_t n, float* p, float* mm, float* v) {
        std::fill(p, p + n, 0.0f);  // the alignment gaps between tensors, the unused wte rows
        if (mm) std::fill(mm, mm + n, 0.0f);
        if (v) std::fill(v, v + n, 0.0f);
        // the tensors that overlap [begin, begin + n): from the first one ending after begin
        size_t k = std::upper_bound(table.begin(), table.end(), begin,
                                    [](size_t b, const ParamTensor& t) { return b < t.offset + t.numel; }) - table.begin();
        for (; k < table.size() && table[k].offset < begin + n; k++) {
            const ParamTensor& t = table[k];
            const size_t lo = std::max(begin, t.offset), hi = std::min(begin + n, t.offset + (k == 0 ? wte_used : t.numel));
            if (t.init == ParamTensor::ONES) std::fill(p + (lo - begin), p + std::max(lo, hi) - begin, 1.0f);
            if (t.init != ParamTensor::NORMAL) continue;
            const float std = t.init_std;
#pragma omp parallel for schedule(static) if (hi > lo + 16384)
            for (size_t i = lo; i < hi; i++) p[i - begin] = normal_at(seed, i, 0.0f, std);
        }
    });
}

// ZeRO glue for the model code (llmc/zero.h), by model segment id. At stages 0-2 the parameters are
// always in place and the param calls do nothing; at stage 3 a segment is all-gathered into a slot
// before its first use and the slot is released after its last. grads_needed zeroes a segment's
// leaf gradient before its weight gradients are written; grads_ready sums it into the owners' fp32
// accumulators right after (on the GPU the next segment's work is queued behind it).
// the group a segment is sharded and reduced over: the experts' over the expert-dp ranks
static const CommGroup& seg_group(const ZeroLayout& z, int s) {
    return z.segs[s].expert ? comm_world().edp : comm_world().dp;
}
// the local segments of model segment seg: a block's, and its experts' in an MoE layer
struct LocalSegments {
    int s[2] = {-1, -1}, n = 0;
    const int* begin() const { return s; }
    const int* end() const { return s + n; }
};
static LocalSegments local_segments(const GPT& m, int seg) {
    LocalSegments out;
    out.s[out.n++] = m.seg_local[seg];
    const int l = segment_layer(seg, m.config.n_layer);
    if (seg >= 1 && seg <= m.config.n_layer && m.config.is_moe(l)) out.s[out.n++] = m.seg_local[m.config.n_layer + 2 + l];
    return out;
}
static void params_needed(GPT& m, int seg) {
    const ZeroLayout& z = m.zero;
    if (!z.params_sharded()) return;
    for (int s : local_segments(m, seg)) {
        if (m.param_slots.find(s)) continue;
        floatX* slot = m.param_slots.acquire(s, "parameter");
        floatX* own = slot + z.own_begin(s);
        copy_buffer(own, m.params + z.segs[s].shard_offset, z.shard_len(s) * sizeof(floatX));
        all_gather(seg_group(z, s), own, slot, z.shard_len(s) * sizeof(floatX));
        point_segment(m.p, m.config, m.local, z.segs[s], slot);
    }
}
static void params_done(GPT& m, int seg) {
    if (!m.zero.params_sharded()) return;
    for (int s : local_segments(m, seg)) {
        m.param_slots.release(s);
        point_segment(m.p, m.config, m.local, m.zero.segs[s], nullptr);
    }
}
static void grads_needed(GPT& m, int seg) {
    const ZeroLayout& z = m.zero;
    for (int s : local_segments(m, seg)) {
        const size_t bytes = z.segs[s].n_leaves * z.segs[s].padded * sizeof(floatX);
        if (!z.params_sharded()) {
            buffer_zero(m.grads + z.segs[s].leaf_offset, bytes);
            continue;
        }
        floatX* slot = m.grad_slots.acquire(s, "gradient");
        buffer_zero(slot, bytes);
        point_segment(m.g, m.config, m.local, z.segs[s], slot);
    }
}
static void grads_ready(GPT& m, int seg) {
    const ZeroLayout& z = m.zero;
    for (int s : local_segments(m, seg)) {
        const floatX* leaf = z.params_sharded() ? m.grad_slots.find(s) : m.grads + z.segs[s].leaf_offset;
        reduce_scatter_add(seg_group(z, s), m.grad_acc + z.acc_own(s), leaf, z.shard_len(s), m.comm_scratch,
                           z.segs[s].n_leaves);
        // the step's last micro-batch of this segment: its gradient is final, its download can start
        if (m.count_ready && ++m.ready_count[s] == (int)m.batches.size() && !m.early_pieces[s].empty())
            offload_download_early(m.update_pieces, m.early_pieces[s], m.grad_acc, m.grad_staging);
        if (z.params_sharded()) {
            m.grad_slots.release(s);
            point_segment(m.g, m.config, m.local, z.segs[s], nullptr);
        }
    }
}
// the tied lm head's weights: the embedding's in one stage, the last stage's copy with pp > 1
static const floatX* head_weights(GPT& m) {
    if (m.head_params) return m.head_params;
    params_needed(m, 0);
    return m.p.wte;
}
static void head_done(GPT& m) {
    if (!m.head_params) params_done(m, 0);
}

// ---- tensor-parallel glue (llmc/tensor_parallel.h) ----
// The residual stream of a micro-batch: all B*T tokens, or with --sp this rank's contiguous
// B*T/tp of them (rows [sp_row0, sp_row0 + stream_rows)).
static int stream_rows(const GPT& m) { return m.ls.sp ? m.B * m.T / m.ls.tp : m.B * m.T; }
static size_t sp_row0(const GPT& m) { return m.ls.sp ? (size_t)m.ls.rank * stream_rows(m) : 0; }
static const CommGroup& tp_group() { return comm_world().tp; }
static const CommGroup& tp_single() {
    static const CommGroup one;
    return one;
}
static void tp_add(floatX* a, const floatX* b, size_t n) { residual_forward(a, a, b, (long)n); }
static void tp_add_f(float* a, const float* b, size_t n) { grad_accumulate(a, b, n); }
static void tp_max_f(float* a, const float* b, size_t n) { max_into(a, b, n); }
static void tp_copy(floatX* d, const floatX* s, size_t n) { copy_buffer(d, s, n * sizeof(floatX)); }
static void tp_copy_f(float* d, const float* s, size_t n) { copy_buffer(d, s, n * sizeof(float)); }

// --sp: the full [B*T, width] buffer from each rank's rows (in place)
static void sp_gather(GPT& m, floatX* full, size_t width) {
    if (!m.ls.sp) return;
    const size_t n = (size_t)stream_rows(m) * width;
    all_gather(tp_group(), full + m.ls.rank * n, full, n * sizeof(floatX));
}
// The LayerNorm outputs feed column-parallel layers, which read all B*T tokens: with --sp each block
// keeps only its rows (Korthikanti et al. 2022) and gathers them where they are read, into one of
// two buffers (k: 0 LN1, 1 LN2), in the forward and again for the weight gradients.
static const floatX* ln_gathered(GPT& m, const floatX* local, int k) {
    if (!m.ls.sp) return local;
    const size_t n = (size_t)stream_rows(m) * m.config.n_embd;
    copy_buffer(m.ln_full[k] + m.ls.rank * n, local, n * sizeof(floatX));
    sp_gather(m, m.ln_full[k], m.config.n_embd);
    return m.ln_full[k];
}
// --sp: the full buffer of the stream's gradient, gathered from this rank's rows `local`
static floatX* sp_gather_from(GPT& m, floatX* full, const floatX* local) {
    const size_t n = (size_t)stream_rows(m) * m.config.n_embd;
    copy_buffer(full + m.ls.rank * n, local, n * sizeof(floatX));
    sp_gather(m, full, m.config.n_embd);
    return full;
}

// local columns (or rows) [at, at + n) of a split dimension
struct SplitRange {
    size_t at, n;
};
// a leaf's ranges (at most three: qkv's Q, K and V rows), without a heap allocation in the step
struct SplitRanges {
    SplitRange r[3] = {};
    int n = 0;
    SplitRanges(std::initializer_list<SplitRange> list) {
        LLMC_CHECK(list.size() <= 3, "internal: a leaf of %zu ranges", list.size());
        for (const SplitRange& x : list) r[n++] = x;
    }
    const SplitRange* begin() const { return r; }
    const SplitRange* end() const { return r + n; }
};
// columns `ranges` of src [rows, ld], side by side into dst [rows, their total]; returns the total
static size_t gather_columns(floatX* dst, const floatX* src, size_t rows, size_t ld, const SplitRanges& ranges) {
    size_t w = 0, at = 0;
    for (const SplitRange& r : ranges) w += r.n;
    for (const SplitRange& r : ranges) {
        copy_buffer_2d(dst + at, w * sizeof(floatX), src + r.at, ld * sizeof(floatX), r.n * sizeof(floatX), rows);
        at += r.n;
    }
    return w;
}
static bool covers(const SplitRanges& ranges, size_t n) {
    size_t at = 0;
    for (const SplitRange& r : ranges) {
        if (r.at != at) return false;
        at += r.n;
    }
    return at == n;
}

// Row-parallel linear: out = sum over the split input dimension K of inp[.., K] W[OC, K]^T, the
// canonical leaves being slices of K (one matmul each, on copies of the slice when it is not the
// rank's whole K), then + bias once. n_batch > 1: the experts of an MoE layer (inp [E, rows, K],
// W [E, OC, K], bias [E, OC]). scatter (--sp): this rank keeps its rows of the sum.
static void row_parallel_forward(GPT& m, floatX* out, const floatX* inp, const floatX* W, const floatX* bias, int n_batch,
                                 int rows, int K, int OC, const ChunkSplit& split, bool scatter) {
    if (!m.canonical && tp_group().size == 1) {  // the GPU build on one tp rank: one matmul, bias fused in
        matmul_forward_batched(out, inp, W, bias, n_batch, rows, K, OC);
        return;
    }
    const size_t per = (size_t)K / split.count, n = (size_t)n_batch * rows * OC;
    auto leaf = [&](int g, floatX* dst) {
        const SplitRanges r = {{(g - split.first) * per, per}};
        const floatX *a = inp, *b = W;
        if (!covers(r, K)) {
            gather_columns(m.tp_copy_a, inp, (size_t)n_batch * rows, K, r);
            gather_columns(m.tp_copy_b, W, (size_t)n_batch * OC, K, r);
            a = m.tp_copy_a;
            b = m.tp_copy_b;
        }
        matmul_forward_batched(dst, a, b, (const floatX*)nullptr, n_batch, rows, (int)per, OC);
    };
    tp_sum(tp_group(), split, m.tpx, out, n, !scatter, leaf, tp_add, tp_copy);
    if (!bias) return;
    const int out_rows = scatter ? rows / m.ls.tp : rows;
    for (int e = 0; e < n_batch; e++) add_bias(out + (size_t)e * out_rows * OC, bias + (size_t)e * OC, out_rows, OC);
}

// Input gradient of a column-parallel linear: dinp[.., C] = sum over the split output dimension OC
// of dout[.., OC] W[OC, C]; a leaf's output rows are `ranges(j)` for its j-th leaf on this rank.
template <typename Ranges>
static void column_parallel_dinp(GPT& m, floatX* dinp, const floatX* dout, const floatX* W, int n_batch, int rows, int C,
                                 int OC, const ChunkSplit& split, const Ranges& ranges, bool scatter) {
    const size_t n = (size_t)n_batch * rows * C;
    auto leaf = [&](int g, floatX* dst) {
        const SplitRanges r = ranges(g - split.first);
        if (covers(r, OC)) {
            matmul_backward_batched(dst, (floatX*)nullptr, (floatX*)nullptr, dout, (const floatX*)nullptr, W, n_batch, rows, C, OC);
            return;
        }
        const size_t w = gather_columns(m.tp_copy_a, dout, (size_t)n_batch * rows, OC, r);
        for (int e = 0; e < n_batch; e++) {
            size_t at = 0;
            for (const SplitRange& x : r) {
                copy_buffer(m.tp_copy_b + ((size_t)e * w + at) * C, W + ((size_t)e * OC + x.at) * C, x.n * C * sizeof(floatX));
                at += x.n;
            }
        }
        matmul_backward_batched(dst, (floatX*)nullptr, (floatX*)nullptr, m.tp_copy_a, (const floatX*)nullptr, m.tp_copy_b,
                                n_batch, rows, C, (int)w);
    };
    tp_sum(tp_group(), split, m.tpx, dinp, n, !scatter, leaf, tp_add, tp_copy);
}
// the output rows of leaf j of the attention's qkv (its query heads' rows, then its kv heads' K
// and V rows), of the FFN's fc (SwiGLU: the leaf's units of W1 and of W3), of the vocabulary
static SplitRanges qkv_leaf_rows(const GPT& m, int j) {
    // a leaf is a run of query heads and the kv heads whose first query head is among them (a kv
    // head shared by ranks: its owner's leaf)
    const LocalShape& s = m.ls;
    const int per = s.n_head / m.split_attn.count, group = m.config.n_head / m.config.n_kv_head;
    const int h0 = s.head0 + j * per, kv_lo = ceil_div(h0, group), kv_hi = ceil_div(h0 + per, group);
    const size_t hs = s.hs, q_all = (size_t)s.n_head * hs, kv_all = (size_t)s.n_kv_head * hs;
    const size_t kv = (size_t)(kv_hi - kv_lo) * hs, at = (size_t)(kv_lo - s.kv0) * hs;
    if (kv == 0) return {{(size_t)j * per * hs, (size_t)per * hs}};
    return {{(size_t)j * per * hs, (size_t)per * hs}, {q_all + at, kv}, {q_all + kv_all + at, kv}};
}
static SplitRanges fc_leaf_rows(const GPT& m, int j, bool moe) {
    const ChunkSplit& split = moe ? m.split_expert : m.split_ffn;
    const size_t all = moe ? m.ls.expert_hidden : m.ls.ffn, per = all / split.count;
    if (!moe && m.config.mlp != MLP_SWIGLU) return {{j * per, per}};
    return {{j * per, per}, {all + j * per, per}};
}

// LayerNorm weight and bias gradients, summed over canonical token chunks (the rank's stream rows:
// with --sp the tp group adds the chunks of every rank; otherwise every rank has all of them).
static void layernorm_weight_grads(GPT& m, floatX* dweight, floatX* dbias, const floatX* dout, const floatX* inp,
                                   const float* mean, const float* rstd) {
    const int C = m.config.n_embd;
    // the canonical token chunks of this micro-batch (B*T may be below the allocated maximum)
    const long n = (long)m.B * m.T;
    const int G = tp_token_chunks(m.config, n);
    const ChunkSplit split = m.ls.sp ? chunk_split(n, G, m.ls.tp, m.ls.rank, m.canonical)
                                     : chunk_split(n, G, 1, 0, m.canonical);
    const size_t per = (size_t)stream_rows(m) / split.count;
    auto leaf = [&](int g, floatX* dst) {
        const size_t t0 = (g - split.first) * per;
        buffer_zero(dst, 2 * (size_t)C * sizeof(floatX));
        layernorm_backward((floatX*)nullptr, dst, dst + C, dout + t0 * C, inp + t0 * C, (const floatX*)nullptr, mean + t0,
                           rstd + t0, (int)per, C);
    };
    tp_sum(m.ls.sp ? tp_group() : tp_single(), split, m.tpx, m.tp_ln_grads, 2 * (size_t)C, true, leaf, tp_add, tp_copy);
    tp_add(dweight, m.tp_ln_grads, C);
    tp_add(dbias, m.tp_ln_grads + C, C);
}

// ---- forward and backward of one chunk (a pipeline stage's contiguous blocks) ----

// A chunk's slot for a micro-batch: the one that holds it, or a free one (which then takes the
// micro-batch's tokens, targets and document starts).
static ChunkSlot& slot_for(GPT& m, int chunk, int mb) {
    std::vector<ChunkSlot>& pool = m.slots[chunk];
    for (ChunkSlot& s : pool)
        if (s.mb == mb) return s;
    for (ChunkSlot& s : pool)
        if (s.mb < 0) {
            s.mb = mb;
            const MicroBatch& b = m.batches[mb];
            const size_t n = (size_t)m.B * m.T * sizeof(int);
            copy_to_buffer(s.inputs, b.inputs, n);
            copy_to_buffer(s.doc_start, b.doc_start, n);
            if (b.targets) copy_to_buffer(s.targets, b.targets, n);
            s.host_targets = b.targets;
            return s;
        }
    LLMC_FAIL("internal: pipeline stage %d chunk %d has no free activation slot for micro-batch %d (%zu in flight)",
              m.pipe.stage, chunk, mb, pool.size());
}
static ChunkStash& stash_for(GPT& m, int chunk, int mb) {
    for (ChunkStash& s : m.stashes[chunk])
        if (s.mb == mb) return s;
    for (ChunkStash& s : m.stashes[chunk])
        if (s.mb < 0) { s.mb = mb; return s; }
    LLMC_FAIL("internal: pipeline stage %d chunk %d has no free weight-gradient stash for micro-batch %d", m.pipe.stage,
              chunk, mb);
}
static void release_all_slots(GPT& m) {
    for (auto& pool : m.slots) for (ChunkSlot& s : pool) s.mb = -1;
    for (auto& pool : m.stashes) for (ChunkStash& s : pool) s.mb = -1;
}

// The lm head of the last virtual stage, on the final LayerNorm's output: logits; with targets the
// per-token losses (returns the mean over targets != -1); with a loss scale also its backward at
// once, so that logits never wait for a later backward: dlogits -> the head's weight gradient
// (folded into head_acc) and the gradient at the final LayerNorm's output -> through the final
// LayerNorm (its weight gradients folded too) into the slot's d_stream.
// The vocab-parallel softmax cross-entropy over the rank's logits columns (n_real of them real):
// the max over every rank's columns, the sum of exponentials over canonical vocabulary chunks, the
// target's logit from the rank that holds it; then the losses (every rank the same) and, with a
// loss scale, the rank's dlogits in place.
static void vocab_parallel_loss(GPT& m, const ChunkSlot& s, float dloss, int n_real) {
    const LocalShape& ls = m.ls;
    const int BT = m.B * m.T, Vl = ls.vocab;
    const ChunkSplit one = rank_leaf(tp_group());
    tp_sum(tp_group(), one, m.tpf, m.ce_max, BT, true,
           [&](int, float* dst) { classifier_max(dst, m.logits, BT, Vl, n_real); }, tp_max_f, tp_copy_f);
    const ChunkSplit& split = m.split_vocab;
    const int per = Vl / split.count;
    tp_sum(tp_group(), split, m.tpf, m.ce_sum, BT, true, [&](int g, float* dst) {
        const int c0 = (g - split.first) * per;
        classifier_sumexp(dst, m.logits, m.ce_max, BT, Vl, std::min(c0, n_real), std::min(c0 + per, n_real));
    }, tp_add_f, tp_copy_f);
    tp_sum(tp_group(), one, m.tpf, m.ce_target, BT, true,
           [&](int, float* dst) { classifier_target(dst, m.logits, s.targets, BT, Vl, ls.vocab0, n_real); }, tp_add_f,
           tp_copy_f);
    classifier_backward(m.logits, m.losses, m.ce_max, m.ce_sum, m.ce_target, s.targets, dloss, BT, Vl, ls.vocab0, n_real);
}

static float head_forward(GPT& m, ChunkSlot& s, const floatX* x_final) {
    const GPTConfig& c = m.config;
    const LocalShape& ls = m.ls;
    const int BT = m.B * m.T, C = c.n_embd, Vl = ls.vocab, rows = stream_rows(m);
    const int n_real = std::max(0, std::min(Vl, c.vocab_size - ls.vocab0));  // this rank's real vocabulary columns
    const floatX* wte = head_weights(m);
    sp_gather(m, m.lnf, C);
    matmul_forward(m.logits, m.lnf, wte, (const floatX*)nullptr, BT, C, Vl);
    float loss = 0.0f;
    if (s.host_targets) {
        int n_valid = 0;
        for (int i = 0; i < BT; i++) n_valid += s.host_targets[i] >= 0;
        const float dloss = n_valid > 0 ? m.dloss_scale / n_valid : 0.0f;
        if (!m.canonical && ls.tp == 1) fused_classifier(m.logits, m.losses, s.targets, dloss, BT, c.vocab_size, Vl);
        else vocab_parallel_loss(m, s, dloss, n_real);  // (the GPU build on one tp rank: the fused kernel, one pass)
        copy_from_buffer(m.host_losses.data(), m.losses, BT * sizeof(float));
        double sum = 0;  // summed on the host in token order: deterministic
        for (int i = 0; i < BT; i++) sum += m.host_losses[i];
        loss = n_valid > 0 ? (float)(sum / n_valid) : 0.0f;
    }
    if (s.host_targets && m.dloss_scale != 0.0f) {
        // m.logits holds dlogits now: the head's weight gradient (this rank's vocabulary rows) and
        // the gradient at the final LayerNorm's output (summed over the vocabulary chunks)
        buffer_zero(m.head_leaf, m.head.padded_total * sizeof(floatX));
        matmul_backward((floatX*)nullptr, m.head_leaf, (floatX*)nullptr, m.logits, m.lnf, (const floatX*)nullptr, BT, C, Vl);
        reduce_scatter_add(comm_world().dp, m.head_acc, m.head_leaf, m.head.shard_len(0), m.comm_scratch);
        const size_t per = (size_t)Vl / m.split_vocab.count;
        column_parallel_dinp(m, m.d_ln, m.logits, wte, 1, BT, C, Vl, m.split_vocab,
                             [&](int j) { return SplitRanges{{j * per, per}}; }, ls.sp);
        const int final_ln = c.n_layer + 1;
        grads_needed(m, final_ln);
        buffer_zero(s.d_stream, (size_t)rows * C * sizeof(floatX));
        layernorm_backward(s.d_stream, (floatX*)nullptr, (floatX*)nullptr, m.d_ln, x_final, m.p.lnfw, m.lnf_mean, m.lnf_rstd,
                           rows, C);
        layernorm_weight_grads(m, m.g.lnfw, m.g.lnfb, m.d_ln, x_final, m.lnf_mean, m.lnf_rstd);
        grads_ready(m, final_ln);
    }
    head_done(m);
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

// Expert parallelism (--ep): an MoE layer's rows [E, cap, C] in expert order, the tokens this rank
// chose for every expert, go to the experts' owners (ep rank q owns experts [q E/ep, (q+1) E/ep),
// a contiguous block of the rows) with one all-to-all; the owner receives [ep][E/ep][cap][C], the
// rows of each source rank for its experts, and returns the outputs the same way. Every size is the
// capacity, known at start-up: no count is exchanged. Without --ep the rows stay in place.
static floatX* expert_dispatch_buffer(GPT& m, floatX* rows) { return m.ls.ep > 1 ? m.ep_buf : rows; }
static void expert_dispatch(GPT& m, floatX* received, int width) {
    if (m.ls.ep == 1) return;
    const size_t block = (size_t)m.ls.n_expert * m.config.moe_capacity(m.B, m.T) * width;
    all_to_all(comm_world().ep, m.ep_buf, received, block * sizeof(floatX));
}
static void expert_return(GPT& m, floatX* own_rows, int width) { expert_dispatch(m, own_rows, width); }

// Block l up to (not including) its final residual add: attention on LN1's output (a.ln1, all
// B*T tokens: gathered here with --sp), the residual add fused with LN2, the FFN branch (its
// output, the rank's stream rows, in m.scratch). The forward and the recompute (-r 2) run exactly
// this. Tensor parallel: the rank's heads and hidden units; the row-parallel projections' partial
// sums are reduced (--sp: reduce-scattered) over the tp group in canonical chunks.
static void block_forward(GPT& m, int l, LayerActs& a, const floatX* x, const int* doc_start) {
    const GPTConfig& c = m.config;
    const LocalShape& ls = m.ls;
    const int B = m.B, T = m.T, BT = B * T, C = c.n_embd, rows = stream_rows(m);
    const size_t row0 = sp_row0(m);
    const LayerTensors& w = m.p.layers[l];
    matmul_forward(a.qkv, ln_gathered(m, a.ln1, 0), w.qkvw, w.qkvb, BT, C, ls.qkv());
    attention_forward(a.atty, a.att_lse, a.qkv, doc_start, B, T, ls.n_head, ls.n_kv_head, ls.hs,
                      c.pos == POS_ALIBI ? c.n_head : 0, ls.head0);
    row_parallel_forward(m, m.scratch, a.atty, w.attprojw, w.attprojb, 1, BT, ls.n_head * ls.hs, C, m.split_attn, ls.sp);
    fused_residual_layernorm_forward(a.residual2, a.ln2, a.ln2_mean, a.ln2_rstd, x, m.scratch, w.ln2w, w.ln2b, rows, C);
    const floatX* ln2 = ln_gathered(m, a.ln2, 1);
    if (c.is_moe(l)) {
        // expert choice: route (every tp rank the same, on all its tokens), gather each expert's
        // tokens, run the experts (this rank's hidden units of each) as one batch of matmuls per
        // source, reduce the experts' outputs over the tp group, add the gated outputs back per
        // token. --ep: the chosen rows travel to their expert's owner and back (expert_dispatch)
        const int E = c.n_expert, He = ls.expert_hidden, cap = c.moe_capacity(B, T);
        moe_router_forward(a.moe_scores, ln2, w.routerw, BT, C, E);
        moe_select(a.expert_tokens, a.token_slots, a.moe_scores, B, T, E, c.capacity_factor,
                   c.moe_group == MOE_GROUP_POSITION);
        moe_gather(expert_dispatch_buffer(m, a.expert_in), ln2, a.expert_tokens, E, cap, C);
        expert_dispatch(m, a.expert_in, C);
        for (int p = 0; p < ls.ep; p++) {  // the rows from ep rank p, for this rank's experts
            const size_t rows = (size_t)p * ls.n_expert * cap;
            matmul_forward_batched(a.fch + rows * 2 * He, a.expert_in + rows * C, w.fcw, w.fcb, ls.n_expert, cap, C, 2 * He);
        }
        swiglu_forward(a.fch_act, a.fch, E * cap, He);
        floatX* ye = expert_dispatch_buffer(m, a.expert_out);
        for (int p = 0; p < ls.ep; p++) {
            const size_t rows = (size_t)p * ls.n_expert * cap;
            row_parallel_forward(m, ye + rows * C, a.fch_act + rows * He, w.fcprojw, w.fcprojb, ls.n_expert, cap, He, C,
                                 m.split_expert, false);
        }
        expert_return(m, a.expert_out, C);
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

// What the backward of block l needs that -r did not keep, computed again from what it kept
// (bitwise what the forward computed: the same ops on the same inputs). The block's params must be
// in place.
static void recompute_block(GPT& m, int l, LayerActs& a, const floatX* x, const int* doc_start) {
    const GPTConfig& c = m.config;
    const int BT = m.B * m.T, C = c.n_embd, rows = stream_rows(m);
    const LayerTensors& w = m.p.layers[l];
    if (m.recompute == 0) return;
    layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, w.ln1w, w.ln1b, rows, C);
    if (m.recompute == 2) {
        block_forward(m, l, a, x, doc_start);
        return;
    }
    layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.residual2, w.ln2w, w.ln2b, rows, C);
    if (c.is_moe(l)) swiglu_forward(a.fch_act, a.fch, c.n_expert * c.moe_capacity(m.B, m.T), m.ls.expert_hidden);
    else if (c.mlp == MLP_SWIGLU) swiglu_forward(a.fch_act, a.fch, BT, m.ls.ffn);
    else gelu_forward(a.fch_act, a.fch, (long)BT * m.ls.ffn);
}

// Forward of a chunk's blocks for the slot's micro-batch (the embedding first on virtual stage 0,
// the head and loss last on the last one); returns the loss there, 0 elsewhere.
static float chunk_forward(GPT& m, int chunk, ChunkSlot& s) {
    const GPTConfig& c = m.config;
    const PipelinePlan& pp = m.pipe;
    const int B = m.B, T = m.T, C = c.n_embd, L = c.n_layer, rows = stream_rows(m);
    const size_t row0 = sp_row0(m);
    const int l0 = pp.layer_begin(chunk), l1 = pp.layer_end(chunk);
    const int embedding = 0, final_ln = L + 1;  // segments; block l is segment l + 1
    m.last_forward[chunk] = &s;
    if (pp.first_vs(chunk)) {
        // vocab-parallel embedding: each rank adds its vocabulary rows (zeros for the others'
        // tokens, tp rank 0 the positions), the tp group sums (exact: one non-zero term per part)
        params_needed(m, embedding);
        const ChunkSplit one = rank_leaf(tp_group());
        tp_sum(tp_group(), one, m.tpx, s.input, (size_t)B * T * C, !m.ls.sp, [&](int, floatX* dst) {
            encoder_forward(dst, s.inputs, s.doc_start, m.p.wte, m.ls.rank == 0 ? m.p.wpe : (const floatX*)nullptr, B, T, C,
                            m.ls.vocab0, m.ls.vocab);
        }, tp_add, tp_copy);
        params_done(m, embedding);
    }
    params_needed(m, l0 + 1);
    LayerActs a = acts_for(m, s, chunk, l0);
    layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, s.input, m.p.layers[l0].ln1w, m.p.layers[l0].ln1b, rows, C);
    for (int l = l0; l < l1; l++) {
        const bool chunk_end = l + 1 == l1, model_end = l + 1 == L;
        if (!chunk_end || model_end) params_needed(m, l + 2);  // the next block (its LN1 ends this one), or the final LN
        const floatX* x = l == l0 ? s.input : s.acts[l - l0 - 1].residual3;
        block_forward(m, l, a, x, s.doc_start);
        // the residual add is fused with the next LayerNorm: the next block's LN1, or the final LN;
        // where the chunk ends before the model does, the next LN1 is on the next stage
        if (model_end) {
            fused_residual_layernorm_forward(a.residual3, m.lnf + row0 * C, m.lnf_mean, m.lnf_rstd, a.residual2, m.scratch,
                                             m.p.lnfw, m.p.lnfb, rows, C);
        } else if (chunk_end) {
            residual_forward(a.residual3, a.residual2, m.scratch, (long)rows * C);
        } else {
            LayerActs next = acts_for(m, s, chunk, l + 1);
            fused_residual_layernorm_forward(a.residual3, next.ln1, next.ln1_mean, next.ln1_rstd, a.residual2,
                                             m.scratch, m.p.layers[l + 1].ln1w, m.p.layers[l + 1].ln1b, rows, C);
            a = next;
        }
        params_done(m, l + 1);
    }
    if (!pp.last_vs(chunk)) return 0.0f;
    const float loss = head_forward(m, s, s.acts.back().residual3);
    params_done(m, final_ln);
    return loss;
}

// Weight gradients of block l's FFN branch and LN2, from its output gradients d.
static void ffn_weight_grads(GPT& m, int l, const LayerActs& a, const LayerGrads& d) {
    const GPTConfig& c = m.config;
    const LocalShape& ls = m.ls;
    const int BT = m.B * m.T, C = c.n_embd;
    const LayerTensors& dw = m.g.layers[l];
    if (c.is_moe(l)) {
        // the experts' weight gradients, one leaf per source rank (--ep: the rows of ep rank p go
        // to leaf p, which folds as that rank's micro-batch would: zero.h's reduce_scatter_add)
        const int E = c.n_expert, He = ls.expert_hidden, cap = c.moe_capacity(m.B, m.T);
        const size_t leaf = m.zero.segs[m.seg_local[c.n_layer + 2 + l]].padded;
        for (int p = 0; p < ls.ep; p++) {
            const size_t rows = (size_t)p * ls.n_expert * cap, at = p * leaf;
            matmul_backward_batched((floatX*)nullptr, dw.fcprojw + at, dw.fcprojb + at, d.d_ffn_out + rows * C,
                                    a.fch_act + rows * He, (const floatX*)nullptr, ls.n_expert, cap, He, C);
            matmul_backward_batched((floatX*)nullptr, dw.fcw + at, dw.fcb + at, d.d_fch + rows * 2 * He,
                                    a.expert_in + rows * C, (const floatX*)nullptr, ls.n_expert, cap, C, 2 * He);
        }
        moe_router_backward((floatX*)nullptr, dw.routerw, d.d_moe_scores, a.moe_scores, ln_gathered(m, a.ln2, 1),
                            (const floatX*)nullptr, BT, C, E);
    } else {
        matmul_backward((floatX*)nullptr, dw.fcprojw, dw.fcprojb, d.d_ffn_out, a.fch_act, (const floatX*)nullptr, BT,
                        ls.ffn, C);
        matmul_backward((floatX*)nullptr, dw.fcw, dw.fcb, d.d_fch, ln_gathered(m, a.ln2, 1), (const floatX*)nullptr, BT, C,
                        ls.fc(c.mlp));
    }
    layernorm_weight_grads(m, dw.ln2w, dw.ln2b, d.d_ln2, a.residual2, a.ln2_mean, a.ln2_rstd);
}
// Weight gradients of block l's attention branch and LN1 (x: the block's input).
static void attn_weight_grads(GPT& m, int l, const LayerActs& a, const LayerGrads& d, const floatX* x) {
    const LocalShape& ls = m.ls;
    const int BT = m.B * m.T, C = m.config.n_embd;
    const LayerTensors& dw = m.g.layers[l];
    matmul_backward((floatX*)nullptr, dw.attprojw, dw.attprojb, d.d_attn_out, a.atty, (const floatX*)nullptr, BT,
                    ls.n_head * ls.hs, C);
    matmul_backward((floatX*)nullptr, dw.qkvw, dw.qkvb, d.d_qkv, ln_gathered(m, a.ln1, 0), (const floatX*)nullptr, BT, C,
                    ls.qkv());
    layernorm_weight_grads(m, dw.ln1w, dw.ln1b, d.d_ln1, x, a.ln1_mean, a.ln1_rstd);
}

// The attention backward where a kv head is shared by several tp ranks (--tp > n_kv_head): the
// sharing ranks gather the group's query heads, outputs, output gradients and log-sum-exps, and
// each runs the whole group's backward as one process does, keeping its query heads' gradients and
// the whole kv head's. A kv head's gradient adds every query head's contribution in one order, so
// it is bitwise the one-process gradient (a sum of per-rank parts would not be); every sharing rank
// then has the same kv weight gradients, and only the owner's qkv leaf adds the kv rows' input
// gradient (qkv_leaf_rows).
static void shared_kv_attention_backward(GPT& m, floatX* dqkv, const floatX* dout, const LayerActs& a,
                                         const int* doc_start) {
    const CommGroup& g = comm_world().tp_kv;
    const LocalShape& ls = m.ls;
    const int B = m.B, T = m.T, share = g.size, gs = ls.n_head * share, hs = ls.hs;
    const size_t BT = (size_t)B * T, fx = sizeof(floatX), qw = (size_t)ls.n_head * hs, gw = qw * share;
    const size_t row_l = qw + 2 * hs, row_g = gw + 2 * hs;
    // [BT, qw] of every sharing rank -> columns [r qw, (r + 1) qw) of dst [BT, ld]
    auto gather_heads = [&](floatX* dst, size_t ld, const floatX* mine) {
        all_gather(g, mine, m.kv_recv, BT * qw * fx);
        for (int r = 0; r < share; r++)
            copy_buffer_2d(dst + r * qw, ld * fx, m.kv_recv + r * BT * qw, qw * fx, qw * fx, BT);
    };
    copy_buffer_2d(m.kv_send, qw * fx, a.qkv, row_l * fx, qw * fx, BT);
    gather_heads(m.kv_qkv, row_g, m.kv_send);
    copy_buffer_2d(m.kv_qkv + gw, row_g * fx, a.qkv + qw, row_l * fx, 2 * hs * fx, BT);  // the kv head's K and V
    gather_heads(m.kv_dout, gw, dout);
    gather_heads(m.kv_out, gw, a.atty);
    const size_t lse_l = (size_t)ls.n_head * T;  // [B, n_head, T] per rank -> [B, gs, T]
    all_gather(g, a.att_lse, m.kv_lse_recv, B * lse_l * sizeof(float));
    for (int r = 0; r < share; r++)
        copy_buffer_2d(m.kv_lse + r * lse_l, gs * T * sizeof(float), m.kv_lse_recv + r * B * lse_l, lse_l * sizeof(float),
                       lse_l * sizeof(float), B);
    const int group_head0 = ls.kv0 * (m.config.n_head / m.config.n_kv_head);
    attention_backward(m.kv_dqkv, m.kv_dout, m.kv_qkv, m.kv_out, m.kv_lse, doc_start, B, T, gs, 1, hs,
                       m.config.pos == POS_ALIBI ? m.config.n_head : 0, group_head0);
    copy_buffer_2d(dqkv, row_l * fx, m.kv_dqkv + g.rank * qw, row_g * fx, qw * fx, BT);
    copy_buffer_2d(dqkv + qw, row_l * fx, m.kv_dqkv + gw, row_g * fx, 2 * hs * fx, BT);
}

// The input-gradient half of block l's backward: dres (the residual stream's gradient at the block
// output, the rank's stream rows) becomes the gradient at its input; the output gradients the
// weight gradients need go to d (stash: copies of the stream's, which changes; otherwise d aliases
// it, and the weight gradients are computed at once, before the stream changes). With --sp the
// branch outputs' gradients are gathered over the tp group first (the backward of the
// reduce-scatter) and the column-parallel input gradients reduce-scattered back to stream rows.
static void layer_backward(GPT& m, int l, const LayerActs& a, const floatX* x, const int* doc_start, floatX* dres,
                           LayerGrads& d, bool stash) {
    const GPTConfig& c = m.config;
    const LocalShape& ls = m.ls;
    const int B = m.B, T = m.T, BT = B * T, C = c.n_embd, rows = stream_rows(m);
    const size_t row0 = sp_row0(m);
    const LayerTensors& w = m.p.layers[l];
    const size_t stream_bytes = (size_t)rows * C * sizeof(floatX);
    // the gradient at a branch output for all B*T tokens: the stream's (copied when stashed)
    auto branch_grad = [&](floatX* stash_buf) -> floatX* {
        if (ls.sp) return sp_gather_from(m, stash ? stash_buf : m.tp_full, dres);
        if (!stash) return dres;
        copy_buffer(stash_buf, dres, stream_bytes);
        return stash_buf;
    };
    if (c.is_moe(l)) {
        const int E = c.n_expert, He = ls.expert_hidden, cap = c.moe_capacity(B, T);
        const floatX* dout = ls.sp ? sp_gather_from(m, m.tp_full, dres) : dres;
        // the experts' rows' output gradients go to the owners (--ep) and their input gradients back
        moe_combine_backward(expert_dispatch_buffer(m, d.d_ffn_out), d.d_moe_scores, dout, a.expert_out, a.moe_scores,
                             a.expert_tokens, a.token_slots, BT, E, cap, C);
        expert_dispatch(m, d.d_ffn_out, C);
        floatX* dxe = expert_dispatch_buffer(m, m.d_expert_in);
        for (int p = 0; p < ls.ep; p++) {
            const size_t rows = (size_t)p * ls.n_expert * cap;
            matmul_backward_batched(m.d_fch_act + rows * He, (floatX*)nullptr, (floatX*)nullptr, d.d_ffn_out + rows * C,
                                    a.fch_act + rows * He, w.fcprojw, ls.n_expert, cap, He, C);
        }
        swiglu_backward(d.d_fch, m.d_fch_act, a.fch, E * cap, He);
        for (int p = 0; p < ls.ep; p++) {
            const size_t rows = (size_t)p * ls.n_expert * cap;
            column_parallel_dinp(m, dxe + rows * C, d.d_fch + rows * 2 * He, w.fcw, ls.n_expert, cap, C, 2 * He,
                                 m.split_expert, [&](int j) { return fc_leaf_rows(m, j, true); }, false);
        }
        expert_return(m, m.d_expert_in, C);
        // every rank has the whole d_ln2 (all tokens); with --sp it keeps its rows
        floatX* d_ln2_all = ls.sp ? m.tp_full : d.d_ln2;
        buffer_zero(d_ln2_all, (size_t)BT * C * sizeof(floatX));
        moe_gather_backward(d_ln2_all, m.d_expert_in, a.token_slots, BT, E, cap, C);
        moe_router_backward(d_ln2_all, (floatX*)nullptr, d.d_moe_scores, a.moe_scores, ln_gathered(m, a.ln2, 1), w.routerw,
                            BT, C, E);
        if (ls.sp) copy_buffer(d.d_ln2, d_ln2_all + row0 * C, stream_bytes);
    } else {
        const int H = ls.ffn;
        d.d_ffn_out = branch_grad(d.d_ffn_out);
        matmul_backward(m.d_fch_act, (floatX*)nullptr, (floatX*)nullptr, d.d_ffn_out, a.fch_act, w.fcprojw, BT, H, C);
        if (c.mlp == MLP_SWIGLU) swiglu_backward(d.d_fch, m.d_fch_act, a.fch, BT, H);
        else gelu_backward(d.d_fch, m.d_fch_act, a.fch, (long)BT * H);
        column_parallel_dinp(m, d.d_ln2, d.d_fch, w.fcw, 1, BT, C, ls.fc(c.mlp), m.split_ffn,
                             [&](int j) { return fc_leaf_rows(m, j, false); }, ls.sp);
    }
    if (!stash) ffn_weight_grads(m, l, a, d);
    layernorm_backward(dres, (floatX*)nullptr, (floatX*)nullptr, d.d_ln2, a.residual2, w.ln2w, a.ln2_mean, a.ln2_rstd,
                       rows, C);
    // dres = dL/d residual2 now; the attention branch
    d.d_attn_out = branch_grad(d.d_attn_out);
    matmul_backward(m.d_atty, (floatX*)nullptr, (floatX*)nullptr, d.d_attn_out, a.atty, w.attprojw, BT,
                    ls.n_head * ls.hs, C);
    if (comm_world().tp_kv.size > 1) shared_kv_attention_backward(m, d.d_qkv, m.d_atty, a, doc_start);
    else attention_backward(d.d_qkv, m.d_atty, a.qkv, a.atty, a.att_lse, doc_start, B, T, ls.n_head, ls.n_kv_head, ls.hs,
                            c.pos == POS_ALIBI ? c.n_head : 0, ls.head0);
    column_parallel_dinp(m, d.d_ln1, d.d_qkv, w.qkvw, 1, BT, C, ls.qkv(), m.split_attn,
                         [&](int j) { return qkv_leaf_rows(m, j); }, ls.sp);
    if (!stash) attn_weight_grads(m, l, a, d, x);
    layernorm_backward(dres, (floatX*)nullptr, (floatX*)nullptr, d.d_ln1, x, w.ln1w, a.ln1_mean, a.ln1_rstd, rows, C);
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
        if (with_weights) grads_needed(m, l + 1);
        const floatX* x = l == l0 ? s.input : s.acts[l - l0 - 1].residual3;
        LayerActs a = acts_for(m, s, chunk, l);
        recompute_block(m, l, a, x, s.doc_start);
        LayerGrads scratch = m.layer_douts;  // (a copy: the dense branches point it at the stream)
        layer_backward(m, l, a, x, s.doc_start, s.d_stream, st ? st->layers[l - l0] : scratch, st != nullptr);
        params_done(m, l + 1);
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
            attn_weight_grads(m, l, a, st.layers[l - l0], x);
            grads_ready(m, l + 1);
        }
        if (pp.first_vs(chunk)) embedding_weight_grads(m, s);
        st.mb = -1;
    }
}
// the micro-batch has left the chunk (after its last action: its W, or a send deferred past it)
static void release_slot(GPT& m, int chunk, int mb) { slot_for(m, chunk, mb).mb = -1; }

// block l's activations from the latest forward (this stage's layers; tests)
[[maybe_unused]] static const LayerActs& gpt_layer_acts(const GPT& m, int l) {
    for (int ch = 0; ch < m.pipe.V; ch++)
        if (l >= m.pipe.layer_begin(ch) && l < m.pipe.layer_end(ch) && m.last_forward[ch])
            return m.last_forward[ch]->acts[l - m.pipe.layer_begin(ch)];
    LLMC_FAIL("internal: layer %d has no forward on this stage", l);
}

// Where a pipeline transfer's bytes are: activations leave from the chunk's last block output and
// arrive in the slot's input; gradients leave and arrive in the slot's d_stream. A message is
// named by (micro-batch, direction, sending virtual stage).
constexpr int TIED_EMBEDDING_TAG = 32767;
static P2POp pipe_transfer(GPT& m, const PipeAction& a) {
    const PipelinePlan& pp = m.pipe;
    const int vs = pp.vs(a.chunk);
    const bool send = a.op == PIPE_SEND_ACT || a.op == PIPE_SEND_GRAD, act = a.op == PIPE_SEND_ACT || a.op == PIPE_RECV_ACT;
    const int sender = send ? vs : act ? vs - 1 : vs + 1, other = send ? (act ? vs + 1 : vs - 1) : sender;
    LLMC_CHECK(sender >= 0 && sender < pp.n_vs() && other >= 0 && other < pp.n_vs() && other % pp.P == a.peer,
               "internal: pipeline transfer of micro-batch %d from virtual stage %d does not match peer %d", a.mb, vs, a.peer);
    ChunkSlot& s = slot_for(m, a.chunk, a.mb);
    P2POp op;
    op.send = send;
    op.buf = a.op == PIPE_SEND_ACT ? (void*)s.acts.back().residual3 : a.op == PIPE_RECV_ACT ? (void*)s.input : (void*)s.d_stream;
    op.bytes = (size_t)stream_rows(m) * m.config.n_embd * sizeof(floatX);
    op.peer = a.peer;
    op.tag = ((a.mb * 2 + (act ? 0 : 1)) * pp.n_vs() + sender) % TIED_EMBEDDING_TAG;
    return op;
}

// Forward of one micro-batch through the pipeline (every stage calls it; activations flow stage
// to stage). With targets, returns the mean loss over targets != -1 on the last stage (0 on the
// others); with dloss_scale != 0 the head's backward runs too and gpt_backward can follow (one
// stage). Without targets it stops at the logits (the last stage's m.logits).
static float gpt_forward(GPT& m, const int* inputs, const int* targets, const int* doc_start, int B, int T,
                         float dloss_scale = 0.0f) {
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
    release_all_slots(m);
    const PipelinePlan& pp = m.pipe;
    float loss = 0.0f;
    for (int c = 0; c < pp.V; c++) {
        const int vs = pp.vs(c);
        if (!pp.first_vs(c)) p2p_group(comm_world().pp, {pipe_transfer(m, {PIPE_RECV_ACT, 0, c, (vs - 1) % pp.P})});
        const float l = chunk_forward(m, c, slot_for(m, c, 0));
        if (pp.last_vs(c)) loss = l;
        else p2p_group(comm_world().pp, {pipe_transfer(m, {PIPE_SEND_ACT, 0, c, (vs + 1) % pp.P})});
    }
    return loss;
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
// stage's schedule (llmc/pipeline.h); the last stage's losses land in m.mb_loss.
static PipeTimes gpt_pipeline_step(GPT& m, const std::vector<MicroBatch>& batches, int B, int T, float dloss_scale,
                                   bool measure, std::vector<PipeEvent>* trace) {
    LLMC_CHECK((int)batches.size() == m.pipe.M, "internal: %zu micro-batches for a schedule of %d", batches.size(), m.pipe.M);
    bind_op_scratch(m);
    m.B = B;
    m.T = T;
    m.batches = batches;
    m.dloss_scale = dloss_scale;
    m.mb_loss.assign(batches.size(), 0.0);
    release_all_slots(m);
    PipeModel pm;
    pm.forward = [&](int mb, int c) {
        const float loss = chunk_forward(m, c, slot_for(m, c, mb));
        if (m.pipe.last_vs(c)) m.mb_loss[mb] = loss;
    };
    pm.backward = [&](int mb, int c, bool with_weights) { chunk_backward(m, c, mb, with_weights); };
    pm.weights = [&](int mb, int c, bool done) { chunk_weights(m, c, mb, done); };
    pm.release = [&](int mb, int c) { release_slot(m, c, mb); };
    pm.transfer = [&](const PipeAction& a) { return pipe_transfer(m, a); };
    pm.sync = backend_sync;
    // --offload optimizer: each segment's gradient download starts at its last grads_ready
    std::fill(m.ready_count.begin(), m.ready_count.end(), 0);
    m.count_ready = m.offload == OFFLOAD_OPTIMIZER && dloss_scale != 0.0f;
    offload_early_reset(m.update_pieces.size());
    const PipeTimes times = pipeline_execute(m.pipe.schedule[m.pipe.stage], comm_world().pp, pm, measure, trace);
    m.count_ready = false;
    return times;
}

static void gpt_zero_grad(GPT& m) {
    buffer_zero(m.grad_acc, m.zero.acc_elems() * sizeof(float));
    if (m.head_acc) buffer_zero(m.head_acc, m.head.shard_len(0) * sizeof(float));
}

// The tied embedding (Press & Wolf 2017): the lm head's gradient of wte, summed over the step in
// head_acc, is added to the embedding's accumulator once per step, in every layout the same single
// fp32 addition per element (Megatron's rule for the embedding group: the first stage holds the
// embedding, the last the head; here the last stage sends its sum to the first, which owns wte's
// optimizer state, and gets the updated weights back after the step: tied_embedding_refresh).
static void tied_embedding_sum(GPT& m) {
    const PipelinePlan& pp = m.pipe;
    if (!pp.has_embedding() && !pp.has_head()) return;
    const size_t n = m.head.shard_len(0);
    if (pp.P > 1 && pp.has_head())
        p2p_group(comm_world().pp, {{true, m.head_acc, n * sizeof(float), 0, TIED_EMBEDDING_TAG}});
    if (!pp.has_embedding()) return;
    if (pp.P > 1) p2p_group(comm_world().pp, {{false, m.head_acc, n * sizeof(float), pp.P - 1, TIED_EMBEDDING_TAG}});
    grad_accumulate(m.grad_acc + m.zero.acc_own(m.seg_local[0]), m.head_acc, n);
}
static void tied_embedding_refresh(GPT& m) {
    const PipelinePlan& pp = m.pipe;
    if (pp.P == 1 || (!pp.has_embedding() && !pp.has_head())) return;
    const ZeroLayout& z = m.zero;
    const size_t n = m.head.shard_len(0), bytes = n * sizeof(floatX);
    if (pp.has_embedding())
        p2p_group(comm_world().pp, {{true, m.params + z.params_own(m.seg_local[0]), bytes, pp.P - 1, TIED_EMBEDDING_TAG}});
    if (pp.has_head()) {
        floatX* own = m.head_params + m.head.own_begin(0);
        p2p_group(comm_world().pp, {{false, own, bytes, 0, TIED_EMBEDDING_TAG}});
        if (comm_world().dp.size > 1) all_gather(comm_world().dp, own, m.head_params, bytes);
    }
}

struct OptimizerConfig {
    float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f, grad_clip = 1.0f;
};

// The optimizer step, after the step's last backward, in two parts so the training loop can
// look at the norm (and the loss) before deciding to update: a step with a non-finite loss or
// norm is skipped (see train_main).
// gpt_grad_norm: adds the lm head's part of the tied embedding's gradient, then (ZeRO stages 0-1)
// completes the all-reduce of the gradients (all-gather of the reduced slices); returns the norm
// of the whole model's gradient, every stage's (collective over the world).
static float gpt_grad_norm(GPT& m) {
    const ZeroLayout& z = m.zero;
    bind_op_scratch(m);
    tied_embedding_sum(m);
    if (!z.acc_sharded())
        for (int s = 0; s < (int)z.segs.size(); s++)
            if (seg_group(z, s).size > 1)
                all_gather(seg_group(z, s), m.grad_acc + z.acc_own(s), m.grad_acc + z.segs[s].padded_offset, z.shard_len(s) * 4);
    return (float)std::sqrt(grad_norm_squared(z, m.grad_acc, m.norm_skip));
}
// gpt_apply_update: global-norm clipping (PyTorch's rule: scale = min(1, clip / (norm + 1e-6)))
// and AdamW on what this rank updates; stages 1-2 then all-gather the updated parameters, and the
// last pipeline stage gets the tied embedding's new weights. step is 0-based.
static void gpt_apply_update(GPT& m, const OptimizerConfig& o, float lr, int step, float norm) {
    const ZeroLayout& z = m.zero;
    bind_op_scratch(m);
    float scale = o.grad_clip > 0 ? std::min(1.0f, o.grad_clip / (norm + 1e-6f)) : 1.0f;
    // stochastic rounding of bf16 params: a fresh seed per step; element i of the table draws its
    // bits from step_seed + i, so the result does not depend on how tensors are split or sharded
    const uint64_t step_seed = Rng(0xADA3ull ^ ((uint64_t)step * 0x9E3779B97F4A7C15ull)).next_u64();
    if (m.offload == OFFLOAD_OPTIMIZER)  // the same step on the CPU, the state in host memory (llmc/offload.h)
        offload_adamw_step(m.update_pieces, m.params, m.grad_acc, m.master, m.adam_m, m.adam_v, m.grad_staging, lr,
                           o.beta1, o.beta2, o.eps, o.weight_decay, scale, step + 1, step_seed);
    else
        for (const UpdatePiece& u : m.update_pieces)
            adamw_update(m.params + u.param_index, m.master ? m.master + u.state_index : nullptr,
                         m.grad_acc + u.acc_index, m.adam_m + u.state_index, m.adam_v + u.state_index, u.n, lr, o.beta1,
                         o.beta2, o.eps, u.decay ? o.weight_decay : 0.0f, scale, step + 1, step_seed + u.table_offset);
    if (z.stage == 1 || z.stage == 2)
        for (int s = 0; s < (int)z.segs.size(); s++)
            if (seg_group(z, s).size > 1)
                all_gather(seg_group(z, s), m.params + z.params_own(s), m.params + z.segs[s].padded_offset,
                           z.shard_len(s) * sizeof(floatX));
    tied_embedding_refresh(m);
}
[[maybe_unused]] static float gpt_update(GPT& m, const OptimizerConfig& o, float lr, int step) {
    const float norm = gpt_grad_norm(m);
    gpt_apply_update(m, o, lr, step, norm);
    return norm;
}

// Parameters that act on one token: all of them in a dense model (without the position table,
// which does no matmul); in an MoE layer the router plus, on average, E * capacity / tokens
// experts (about capacity_factor; more where the capacity rounds up) instead of all E.
static double active_param_count(const GPT& m, int B, int T) {
    const GPTConfig& c = m.config;
    double n = (double)m.param_count - (c.pos == POS_LEARNED ? (double)c.max_seq_len * c.n_embd : 0.0);
    if (c.n_expert > 0) {
        const double one_expert = 3.0 * c.expert_hidden * c.n_embd + 2.0 * c.expert_hidden + c.n_embd;
        const double experts_per_token = (double)c.n_expert * c.moe_capacity(B, T) / ((double)B * T);
        for (int l = 0; l < c.n_layer; l++)
            if (c.is_moe(l)) n += one_expert * (experts_per_token - c.n_expert);
    }
    return n;
}

// Model FLOPs of one training step (forward + backward), the nanoGPT/PaLM convention: 6 per
// active parameter per token for the matmuls, plus the attention term 12 * n_layer * n_head *
// head_size per unmasked score element (2 FLOPs each for QK^T and PV in the forward, twice that
// in the backward).
static double step_flops(const GPT& m, const int* doc_start, int B, int T, int grad_accum_steps) {
    const GPTConfig& c = m.config;
    double score_elements = 0;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) score_elements += t - doc_start[b * T + t] + 1;
    return grad_accum_steps *
           (6.0 * active_param_count(m, B, T) * B * T + 12.0 * c.n_layer * c.n_head * c.head_size() * score_elements);
}

// MoE routing of the latest forward, over the model's MoE layers: the fraction of tokens taken by
// 0, 1 and 2+ experts, and the fewest / most tokens any expert took (equal by construction in expert
// choice; measured, not assumed). Every stage measures its layers; the pp group combines them.
struct MoeStats {
    double frac[3] = {0, 0, 0};
    int load_min = 0, load_max = 0;
};
static MoeStats gpt_moe_stats(const GPT& m) {
    const GPTConfig& c = m.config;
    const PipelinePlan& pp = m.pipe;
    const int n = m.B * m.T, E = c.n_expert;
    double mine[6] = {0, 0, 0, 0, (double)n, 0};  // frac sums, layers, load min, load max
    std::vector<int> slots((size_t)n * E), load(E);
    for (int ch = 0; ch < pp.V; ch++) {
        const ChunkSlot* s = m.last_forward[ch];
        for (int l = pp.layer_begin(ch); s && l < pp.layer_end(ch); l++) {
            if (!c.is_moe(l)) continue;
            mine[3] += 1;
            copy_from_buffer(slots.data(), s->acts[l - pp.layer_begin(ch)].token_slots, slots.size() * sizeof(int));
            std::fill(load.begin(), load.end(), 0);
            for (int i = 0; i < n; i++) {
                int taken = 0;
                for (int e = 0; e < E; e++)
                    if (slots[(size_t)i * E + e] >= 0) { taken++; load[e]++; }
                mine[std::min(taken, 2)] += 1.0 / n;
            }
            mine[4] = std::min(mine[4], (double)*std::min_element(load.begin(), load.end()));
            mine[5] = std::max(mine[5], (double)*std::max_element(load.begin(), load.end()));
        }
    }
    std::vector<double> all(6 * pp.P);
    host_all_gather(comm_world().pp, mine, all.data(), sizeof(mine));
    MoeStats st;
    double layers = 0, lo = n, hi = 0;
    for (int s = 0; s < pp.P; s++) {
        for (int k = 0; k < 3; k++) st.frac[k] += all[6 * s + k];
        layers += all[6 * s + 3];
        if (all[6 * s + 3] > 0) { lo = std::min(lo, all[6 * s + 4]); hi = std::max(hi, all[6 * s + 5]); }
    }
    for (double& f : st.frac) f /= std::max(layers, 1.0);
    st.load_min = (int)lo;
    st.load_max = (int)hi;
    return st;
}

// Generates n_tokens after the prompt (temperature, top-k; top_k <= 0 means all), feeding the last
// max(max_seq_len, max_T) tokens (the model's context; ALiBi may train past max_seq_len), at most the
// tokens one training micro-batch's buffers hold (max_B x max_T) over the rows; an EOT starts a new
// document, as in training. MoE models sample `rows` independent sequences
// side by side so the routing groups look as in training (the B tokens of a position, or the
// B x length tokens of the batch); a dense model needs one row. Returns row 0. Collective: every
// stage runs its part of each forward; the last stage's logits go to every rank, which all draw
// the same token.
static std::vector<int> gpt_sample(GPT& m, const std::vector<int>& prompt, int n_tokens, float temperature, int top_k,
                                   int eot, Rng& rng) {
    const int V = m.config.vocab_size, Vl = m.ls.vocab, tp = m.ls.tp;
    const int rows = m.config.n_expert > 0 ? m.max_B : 1;
    const PipelinePlan& pp = m.pipe;
    std::vector<std::vector<int>> seqs(rows, prompt);
    std::vector<int> ctx, ctx_start;
    std::vector<std::pair<float, int>> cand(V);
    std::vector<floatX> mine((size_t)rows * Vl), slices((size_t)rows * Vl * tp), logits((size_t)rows * V),
        all_logits((size_t)rows * V * pp.P);
    // --sp splits a forward's tokens over the tp ranks: the context is a multiple of what makes
    // rows * T divide, left-padded with end-of-text (a new document: attention ignores the padding)
    int unit = 1;  // the smallest T with rows * T a multiple of tp
    while (m.ls.sp && ((int64_t)rows * unit) % tp != 0) unit++;
    const int max_ctx = (int)std::min<int64_t>(std::max(m.config.max_seq_len, m.max_T), (int64_t)m.max_B * m.max_T / rows);
    for (int i = 0; i < n_tokens; i++) {
        const int len = (int)seqs[0].size();  // all rows have the same length
        int T = ceil_div(std::min(len, max_ctx), unit) * unit;
        if (T > max_ctx) T -= unit;
        const int n_ctx = std::min(len, T);
        ctx.resize((size_t)rows * T);
        ctx_start.resize((size_t)rows * T);
        for (int r = 0; r < rows; r++) {
            std::fill(ctx.begin() + (size_t)r * T, ctx.begin() + (size_t)r * T + (T - n_ctx), eot);
            std::copy(seqs[r].end() - n_ctx, seqs[r].end(), ctx.begin() + (size_t)r * T + (T - n_ctx));
            compute_doc_start(ctx_start.data() + (size_t)r * T, ctx.data() + (size_t)r * T, T, eot);
        }
        gpt_forward(m, ctx.data(), nullptr, ctx_start.data(), rows, T);
        if (pp.has_head()) {  // the last position's logits: this rank's vocabulary columns, then all of them
            for (int r = 0; r < rows; r++)
                copy_from_buffer(mine.data() + (size_t)r * Vl, m.logits + ((size_t)r * T + T - 1) * Vl, Vl * sizeof(floatX));
            host_all_gather(comm_world().tp, mine.data(), slices.data(), mine.size() * sizeof(floatX));
            for (int r = 0; r < rows; r++)
                for (int v = 0; v < V; v++) logits[(size_t)r * V + v] = slices[((size_t)(v / Vl) * rows + r) * Vl + v % Vl];
        }
        host_all_gather(comm_world().pp, logits.data(), all_logits.data(), logits.size() * sizeof(floatX));
        const floatX* last = all_logits.data() + (size_t)(pp.P - 1) * rows * V;
        for (int r = 0; r < rows; r++) {
            for (int v = 0; v < V; v++) cand[v] = {(float)last[(size_t)r * V + v] / std::max(temperature, 1e-6f), v};
            int k = top_k > 0 ? std::min(top_k, V) : V;
            std::partial_sort(cand.begin(), cand.begin() + k, cand.end(),
                              [](const std::pair<float, int>& a, const std::pair<float, int>& b) {
                                  return a.first > b.first || (a.first == b.first && a.second < b.second);
                              });
            double sum = 0;
            for (int j = 0; j < k; j++) sum += std::exp((double)cand[j].first - cand[0].first);
            double u = rng.uniform() * sum, acc = 0;
            int next = cand[k - 1].second;
            for (int j = 0; j < k; j++) {
                acc += std::exp((double)cand[j].first - cand[0].first);
                if (u < acc) { next = cand[j].second; break; }
            }
            seqs[r].push_back(next);
        }
    }
    return std::vector<int>(seqs[0].begin() + prompt.size(), seqs[0].end());
}


// What a plan needs from the memory the buffers live in (on the CPU: with the host staging and the
// host arenas, all one memory), and, apart from it, from host memory (the CUDA build: the pageable
// staging and the pinned arenas of --offload optimizer).
static double plan_need_bytes(const MemoryEstimate& e) {
#ifdef LLMC_CPU
    return e.buffers() + e.host + e.host_arenas();
#else
    return e.buffers();
#endif
}
static double plan_host_bytes(const MemoryEstimate& e) { return e.host + e.host_arenas(); }

// The memory guard's verdict on a plan: returns, or throws with the numbers, the biggest part and
// what to change, that first. one_memory: the buffers and the host side share one memory (the CPU
// build: need plan_need_bytes <= avail); else the device buffers are compared with avail and the host
// side with host_avail (<= 0: unknown, not checked).
static void check_plan_fits(const MemoryEstimate& e, int B, int T, int offload, bool one_memory, double avail,
                            const std::string& source, double host_avail, const std::string& host_source) {
    const double MiB = 1048576.0, GiB = 1073741824.0;
    const bool offloaded = offload == OFFLOAD_OPTIMIZER;
    const std::string shard_state = "shard the optimizer state over more ranks with --zero 1 (each rank keeps only its "
                                    "slice" + std::string(offloaded ? ", and offloads only that" : "") + ")";
    if (!one_memory) {
        const double host_need = plan_host_bytes(e);
        LLMC_CHECK(host_avail <= 0 || host_need <= host_avail,
                   "memory: the host side of this run needs %.2f GiB (staging for init and checkpoints %.1f MiB%s) but %s "
                   "is %.2f GiB; %s, or shrink the model (--n_layer, --n_embd, --vocab_size)%s",
                   host_need / GiB, e.host / MiB,
                   offloaded ? strfmt(", --offload optimizer: master weights %.1f MiB, Adam moments %.1f MiB, gradient "
                                      "staging %.1f MiB", e.host_master / MiB, e.host_moments / MiB,
                                      e.host_staging / MiB).c_str() : "",
                   host_source.c_str(), host_avail / GiB, shard_state.c_str(),
                   offloaded ? "; or keep the optimizer state on the device (--offload none)" : "");
    }
    const double need = one_memory ? plan_need_bytes(e) : e.buffers();
    if (avail <= 0 || need <= avail) return;
    // the parts of what does not fit, the biggest first, each with what shrinks it
    const double state = e.master + e.moments + (one_memory ? e.host_master + e.host_moments : 0.0);
    const std::string acts = "activations grow with B*T: lower -b (batch size) or -t (sequence length), and keep the "
                             "tokens per step with -d/--total_batch_tokens (gradient accumulation), or recompute "
                             "activations (-r 1 or 2)";
    const std::string opt = offloaded || one_memory ? shard_state
                                                    : "--offload optimizer keeps the fp32 master weights and Adam moments "
                                                      "in host memory and runs AdamW on the CPU (ZeRO-Offload), or " +
                                                          shard_state;
    std::vector<std::pair<double, std::string>> parts = {
        {e.activations, "the activations (" + acts + ")"},
        {state, "the optimizer state, master weights and Adam moments (" + opt + ")"},
        {e.grads, "the gradients (--zero 2 shards the fp32 accumulators, --zero 3 the leaf gradients too; --pp splits "
                  "the layers)"},
        {e.params, "the parameters (--zero 3 shards them; --pp splits the layers)"},
        {e.scratch, "the op scratch and the cuBLASLt workspace (32 MiB plus the largest op's partial sums, which grow "
                    "with B*T)"}};
    std::stable_sort(parts.begin(), parts.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    LLMC_FAIL("memory: this run needs %.2f GiB (params %.1f MiB, grads %.1f MiB, master %.1f MiB, Adam moments %.1f "
              "MiB, activations %.1f MiB for B %d x T %d, op scratch %.1f MiB%s) but %s is %.2f GiB. The biggest part is %s; next %s. "
              "Or shard with --zero / split with --pp or --tp (--sp), or shrink the model (--n_layer, --n_embd, --vocab_size)",
              need / GiB, (e.params) / MiB, e.grads / MiB, (e.master + (one_memory ? e.host_master : 0)) / MiB,
              (e.moments + (one_memory ? e.host_moments : 0)) / MiB, e.activations / MiB, B, T, e.scratch / MiB,
              one_memory ? strfmt(", host staging %.1f MiB%s", e.host / MiB,
                                  offloaded ? strfmt(", offload gradient staging %.1f MiB", e.host_staging / MiB).c_str()
                                            : "").c_str()
                         : "",
              source.c_str(), avail / GiB, parts[0].second.c_str(), parts[1].second.c_str());
}
static void check_memory_fits(const GPTConfig& c, int B, int T, int zero_stage, const PipelinePlan& pipe, int recompute,
                              bool sp, int offload) {
    const MemoryEstimate e = gpt_memory_estimate(c, B, T, zero_stage, &pipe, recompute, 0, sizeof(floatX), 0, sp, 0, offload);
    std::string source, host_source;
    double avail = available_buffer_memory(source);
#ifdef LLMC_CPU
    check_plan_fits(e, B, T, offload, true, avail, source, -1, host_source);
#else
    const Comm& w = comm_world();
    if (avail > 0) {
        avail -= device_headroom_bytes(w.dp.size, w.pp.size, w.tp.size, w.ep.size);
        source += " less " + device_headroom_text(w.dp.size, w.pp.size, w.tp.size, w.ep.size);
    }
    const double host_avail = available_host_memory(host_source);
    check_plan_fits(e, B, T, offload, false, avail, source, host_avail, host_source);
#endif
}

// ----------------------------------------------------------------------------------------------
// 4. Command line

struct Option {
    const char* name;
    const char* short_name;  // llm.c's single-letter flag, or ""
    const char* default_value;
    const char* help;
};

static const Option OPTIONS[] = {
    {"train", "i", "data/fortunes/fortunes_train_*.bin", "train shard pattern (glob)"},
    {"val", "j", "data/fortunes/fortunes_val_*.bin", "val shard pattern (glob); empty: no validation"},
    {"out_dir", "o", "out", "output directory: log.jsonl, checkpoints"},
    {"model", "e", "", "preset dN (n_layer N, n_embd 64N, n_head N) or gpt2:124M|350M|774M|1558M (GPT-2's shapes, "
                       "vocab 50257, gelu, learned positions); explicit flags override it (default: none)"},
    {"vocab_size", "", "257", "real vocabulary size (padded to a multiple of 128 internally)"},
    {"n_layer", "", "4", "transformer blocks"},
    {"n_embd", "", "128", "channels"},
    {"n_head", "", "4", "query heads"},
    {"n_kv_head", "", "", "key/value heads (GQA; divides n_head; default n_head)"},
    {"ffn_hidden", "", "0", "FFN hidden size (0: swiglu 8/3 C rounded up to 32, gelu 4 C)"},
    {"max_seq_len", "", "1024", "maximum sequence length (size of the learned position table)"},
    {"mlp", "", "swiglu", "swiglu | gelu"},
    {"n_expert", "", "0", "experts per MoE layer (0: dense model)"},
    {"moe_every", "", "1", "every k-th block's FFN is an MoE layer (layers k-1, 2k-1, ...)"},
    {"expert_hidden", "", "0", "hidden size of each SwiGLU expert (0: ffn_hidden)"},
    {"capacity_factor", "", "2.0", "expert choice: each expert takes capacity_factor * tokens / n_expert tokens"},
    {"moe_group", "", "batch", "routing group: batch (the micro-batch, sees future tokens) | position (causal)"},
    {"pos", "", "alibi", "alibi | learned"},
    {"batch_size", "b", "16", "B: rows per micro-batch"},
    {"seq_len", "t", "256", "T: tokens per row"},
    {"total_batch_tokens", "d", "0", "tokens per optimizer step (a multiple of B*T; 0: B*T)"},
    {"lr", "l", "2e-3", "peak learning rate"},
    {"warmup", "u", "50", "warmup steps"},
    {"final_lr_frac", "q", "0.1", "final learning rate as a fraction of the peak"},
    {"schedule", "", "cosine", "cosine | linear | constant | wsd"},
    {"wsd_decay_frac", "", "0.2", "wsd: fraction of the steps spent decaying"},
    {"weight_decay", "c", "0.1", "AdamW weight decay (matrices: 2-D and stacked experts; not biases or LayerNorm)"},
    {"beta1", "", "0.9", "AdamW beta1"},
    {"beta2", "", "0.95", "AdamW beta2"},
    {"grad_clip", "", "1.0", "clip the global gradient norm to this (0: off)"},
    {"max_steps", "x", "1000", "optimizer steps"},
    {"val_every", "v", "100", "evaluate every N steps (0: only at the end)"},
    {"val_batches", "m", "20", "batches per evaluation"},
    {"sample_every", "s", "0", "print a sample every N steps (0: only at the end)"},
    {"sample_len", "g", "256", "tokens per sample"},
    {"temperature", "", "1.0", "sampling temperature"},
    {"top_k", "", "0", "sample from the k most likely tokens (0: all)"},
    {"ckpt_every", "n", "0", "write a checkpoint every N steps and at the end (0: only at the end; -1: never)"},
    {"resume", "y", "", "checkpoint to resume from: a file, or 'latest' (newest in out_dir; default: none)"},
    {"init_from", "", "", "start from the weights of an llm.c GPT-2 model file (the config is the file's; fresh "
                          "optimizer state; default: none)"},
    {"export_llmc", "", "", "at the end, also write the model as an llm.c GPT-2 model file (GPT-2 shapes only; "
                            "default: none)"},
    {"export_llmc_dtype", "", "fp32", "fp32 | bf16: the precision of --export_llmc (llm.c's version 3 or 5)"},
    {"tokenizer", "", "", "vocabulary file for decoding samples (default: tokenizer.bin or gpt2_tokenizer.bin next to "
                          "the train shards, else bytes or token ids)"},
    {"seed", "", "1337", "seed for init, data order and sampling (0 .. 2^64-1)"},
    {"overwrite", "", "0", "a fresh run may replace the checkpoints and log of an earlier run in out_dir (a switch)"},
    {"max_bad_steps", "", "5", "stop (exit 1) after this many consecutive steps with a non-finite loss or grad norm"},
    {"zero", "z", "0", "ZeRO stage over the data-parallel ranks: 0 all-reduce, 1 shard optimizer state, 2 also "
                       "gradients, 3 also parameters (gathered per block)"},
    {"recompute", "r", "0", "activation recomputation: 0 keep all, 1 recompute LayerNorm outputs and the FFN "
                            "activation, 2 recompute each block in the backward (same gradients)"},
    {"offload", "", "none", "none | optimizer: the fp32 master weights and AdamW moments of what this rank updates in "
                            "host memory, the AdamW step on the CPU (ZeRO-Offload; same results)"},
    {"plan", "", "0", "print the memory plan (every stage, -z and -r level) and whether it fits, then exit (a switch)"},
    {"plan_ranks", "", "", "--plan: plan for this many processes (default: the ones started)"},
    {"max_fit", "", "0", "--plan plus the largest -b and the largest dN model that fit, per -r level (a switch)"},
    {"device", "", "", "--plan: plan the CUDA build on this GPU (h200 | h100) instead of this machine"},
    {"pp", "", "1", "pipeline stages (the processes form pp x dp; micro-batches per step = the accumulation steps)"},
    {"pp_schedule", "", "1f1b", "pipeline schedule: gpipe | 1f1b | interleaved | zb1 (zero bubble, Qi et al. 2023)"},
    {"pp_virtual", "", "1", "interleaved: model chunks per stage"},
    {"pp_layers", "", "", "blocks per virtual stage, e.g. 3,5 (default: balanced by FLOPs)"},
    {"pp_trace", "", "", "write the executed pipeline timeline of the first step to this file (scripts/plot_pipeline.py)"},
    {"tp", "", "1", "tensor-parallel ranks per layer (neighbouring processes; divides n_head; the processes form "
                    "pp x dp x tp)"},
    {"ep", "", "1", "expert-parallel ranks: each MoE layer's experts are shared out over groups of ep data-parallel "
                    "ranks (divides dp and n_expert)"},
    {"sp", "", "0", "sequence parallel with --tp: LayerNorms and the residual stream hold B*T/tp tokens per rank (a switch)"},
    {"comm_timeout", "", "300", "seconds a collective or transfer may wait for other ranks before the job aborts naming "
                                "the ranks that did not arrive (10x for checkpoint I/O and the start-up; 0: none)"},
};

// flags that may be given without a value (--overwrite means --overwrite 1)
static bool is_switch(const char* name) {
    return strcmp(name, "overwrite") == 0 || strcmp(name, "plan") == 0 || strcmp(name, "max_fit") == 0 ||
           strcmp(name, "sp") == 0;
}

struct Args {
    std::map<std::string, std::string> value;
    std::map<std::string, bool> given;

    const std::string& str(const char* k) const { return value.at(k); }
    // strict parses (llmc/utils.h): the whole value, in range, or an error naming the flag
    int i(const char* k, int lo = INT32_MIN, int hi = INT32_MAX) const { return (int)parse_int64(value.at(k), k, lo, hi); }
    uint64_t u64(const char* k) const { return parse_uint64(value.at(k), k); }
    float f(const char* k) const {
        double v = parse_double(value.at(k), k);
        LLMC_CHECK(std::fabs(v) <= 3.4e38, "--%s: %s does not fit a 32-bit float", k, value.at(k).c_str());
        return (float)v;
    }
    bool flag(const char* k) const { return i(k, 0, 1) != 0; }
};

static void print_usage() {
    printf("usage: train_gpt [options]   (--name value, or llm.c's -x value)\n");
    for (const Option& o : OPTIONS) {
        char flags[64];
        snprintf(flags, sizeof(flags), "%s%s%s--%s", o.short_name[0] ? "-" : "", o.short_name,
                 o.short_name[0] ? ", " : "", o.name);
        if (o.default_value[0]) printf("  %-26s %s (default: %s)\n", flags, o.help, o.default_value);
        else printf("  %-26s %s\n", flags, o.help);
    }
}

// Returns false when -h was asked for.
static bool parse_args(int argc, char** argv, Args& args) {
    for (const Option& o : OPTIONS) args.value[o.name] = o.default_value;
    for (int k = 1; k < argc; k++) {
        std::string a = argv[k];
        if (a == "-h" || a == "--help") return false;
        const Option* found = nullptr;
        for (const Option& o : OPTIONS)
            if (a == std::string("--") + o.name || (o.short_name[0] && a == std::string("-") + o.short_name)) found = &o;
        LLMC_CHECK(found, "unknown flag '%s' (run with -h for the list)", a.c_str());
        if (is_switch(found->name) && !(k + 1 < argc && (!strcmp(argv[k + 1], "0") || !strcmp(argv[k + 1], "1")))) {
            args.value[found->name] = "1";
            args.given[found->name] = true;
            continue;
        }
        LLMC_CHECK(k + 1 < argc, "flag %s needs a value", a.c_str());
        args.value[found->name] = argv[++k];
        args.given[found->name] = true;
    }
    return true;
}

// GPT-2's shapes (n_layer, n_embd, n_head; vocab 50257, context 1024, GELU MLP of 4C, learned
// positions): the -e gpt2:SIZE presets, named by GPT-2's parameter counts.
struct Gpt2Preset {
    const char* name;
    int n_layer, n_embd, n_head;
};
static const Gpt2Preset GPT2_PRESETS[] = {
    {"gpt2:124M", 12, 768, 12}, {"gpt2:350M", 24, 1024, 16}, {"gpt2:774M", 36, 1280, 20}, {"gpt2:1558M", 48, 1600, 25}};

static bool is_gpt2_preset(const std::string& preset) {
    for (const Gpt2Preset& g : GPT2_PRESETS) if (preset == g.name) return true;
    return false;
}
// whether the --model preset sets this config field (so an explicit value for it may disagree)
static bool preset_sets(const Args& args, const std::string& field) {
    if (!args.given.count("model")) return false;
    if (field == "n_layer" || field == "n_embd" || field == "n_head") return true;
    return is_gpt2_preset(args.str("model")) &&
           (field == "vocab_size" || field == "max_seq_len" || field == "mlp" || field == "pos");
}

static GPTConfig config_from_args(const Args& args) {
    GPTConfig c;
    const std::string preset = args.str("model");
    const bool gpt2 = is_gpt2_preset(preset);
    if (gpt2) {
        for (const Gpt2Preset& g : GPT2_PRESETS)
            if (preset == g.name) { c.n_layer = g.n_layer; c.n_embd = g.n_embd; c.n_head = g.n_head; }
    } else if (!preset.empty()) {
        // strict: "d" then a number in range (sscanf's %d would overflow on d99999999999)
        LLMC_CHECK(preset.size() >= 2 && preset[0] == 'd' && isdigit((unsigned char)preset[1]),
                   "--model: '%s' is not a preset: expected dN (e.g. d4) or gpt2:124M, gpt2:350M, gpt2:774M, gpt2:1558M",
                   preset.c_str());
        const int n = (int)parse_int64(preset.substr(1), "model dN: N", 1, 1024);
        c.n_layer = n; c.n_embd = 64 * n; c.n_head = n;
    }
    auto take = [&](const char* k, int& field) { if (preset.empty() || args.given.count(k)) field = args.i(k); };
    take("n_layer", c.n_layer);
    take("n_embd", c.n_embd);
    take("n_head", c.n_head);
    // a GPT-2 preset also sets the vocabulary, the context and the block type
    auto from_gpt2 = [&](const char* k) { return gpt2 && !args.given.count(k); };
    c.vocab_size = from_gpt2("vocab_size") ? (int)GPT2_VOCAB_SIZE : args.i("vocab_size");
    c.n_kv_head = args.str("n_kv_head").empty() ? c.n_head : args.i("n_kv_head");
    c.ffn_hidden = args.i("ffn_hidden");
    c.max_seq_len = from_gpt2("max_seq_len") ? 1024 : args.i("max_seq_len");
    const std::string mlp = from_gpt2("mlp") ? "gelu" : args.str("mlp"), pos = from_gpt2("pos") ? "learned" : args.str("pos");
    LLMC_CHECK(mlp == "swiglu" || mlp == "gelu", "--mlp: expected swiglu or gelu, got '%s'", mlp.c_str());
    LLMC_CHECK(pos == "alibi" || pos == "learned", "--pos: expected alibi or learned, got '%s'", pos.c_str());
    c.mlp = mlp == "swiglu" ? MLP_SWIGLU : MLP_GELU;
    c.pos = pos == "alibi" ? POS_ALIBI : POS_LEARNED;
    c.n_expert = args.i("n_expert");
    c.moe_every = args.i("moe_every");
    c.expert_hidden = args.i("expert_hidden");
    c.capacity_factor = args.f("capacity_factor");
    const std::string group = args.str("moe_group");
    LLMC_CHECK(group == "batch" || group == "position", "--moe_group: expected batch or position, got '%s'", group.c_str());
    c.moe_group = group == "batch" ? MOE_GROUP_BATCH : MOE_GROUP_POSITION;
    c.finalize();
    return c;
}

// The config fields stored in (and checked against) checkpoints, with the flag that sets each.
static std::vector<std::pair<const char*, int*>> config_fields(GPTConfig& c) {
    return {{"vocab_size", &c.vocab_size}, {"n_layer", &c.n_layer},         {"n_embd", &c.n_embd},
            {"n_head", &c.n_head},         {"n_kv_head", &c.n_kv_head},     {"ffn_hidden", &c.ffn_hidden},
            {"max_seq_len", &c.max_seq_len}, {"mlp", &c.mlp},               {"pos", &c.pos},
            {"n_expert", &c.n_expert},     {"moe_every", &c.moe_every},     {"moe_group", &c.moe_group},
            {"expert_hidden", &c.expert_hidden}};
}

// an enum field's values by number (empty: a count)
static std::vector<const char*> config_enum_names(const std::string& field) {
    if (field == "mlp") return {"swiglu", "gelu"};
    if (field == "pos") return {"alibi", "learned"};
    if (field == "moe_group") return {"batch", "position"};
    return {};
}
static std::string config_value_text(const std::string& field, int v) {
    const std::vector<const char*> names = config_enum_names(field);
    return v >= 0 && v < (int)names.size() ? names[v] : std::to_string(v);
}
// A checkpoint's config: every field range-checked, by its name in the file, before it is
// narrowed to an int (llmc/checkpoint.h: checkpoint_int_field), then the config's own checks.
static GPTConfig config_from_checkpoint(const Checkpoint& ck, const std::string& path) {
    GPTConfig c;
    for (auto& [name, field] : config_fields(c)) {
        const std::string n = name;
        const bool may_be_0 = n == "ffn_hidden" || n == "n_expert" || n == "expert_hidden";
        *field = checkpoint_int_field(ck, "config." + n, path, may_be_0 ? 0 : 1, config_enum_names(n));
    }
    const double cf = ck.get_float("config.capacity_factor", path);
    LLMC_CHECK(std::isfinite(cf) && cf > 0 && cf <= 3.4e38, "%s: checkpoint field config.capacity_factor = %g is not a "
               "positive float (corrupt or written by another program)", path.c_str(), cf);
    c.capacity_factor = (float)cf;
    try {
        c.finalize();
    } catch (const LlmcError& e) {
        LLMC_FAIL("%s: the checkpoint's config (its config.* fields) is refused: %s", path.c_str(), e.what());
    }
    return c;
}

// What the run was started with beyond what a resume must keep (the config, the batch shape, the
// seed): stored in every checkpoint, so a resume says what it changes (llmc/checkpoint.h:
// checkpoint_run_changes) instead of changing it silently.
static std::vector<CheckpointField> run_settings(const Args& args, const DataLoader& train) {
    std::vector<CheckpointField> out;
    for (const char* flag : {"lr", "warmup", "final_lr_frac", "wsd_decay_frac", "weight_decay", "beta1", "beta2",
                             "grad_clip", "max_steps"})
        out.push_back({std::string("run.") + flag, 'f', 0, (double)args.f(flag)});
    uint64_t data = ckpt_hash_bytes(nullptr, 0);
    for (const ShardInfo& sh : train.shards) data = ckpt_splitmix(data ^ (uint64_t)file_fingerprint(sh.path));
    out.push_back({"run.train", 'i', (int64_t)(data >> 1), 0});
    return out;
}

// Optimizer values that would silently ruin a run (a negative lr ascends, beta >= 1 never
// forgets, a NaN clip disables clipping) are refused up front, naming the flag.
static void check_optimizer_flags(float lr, const OptimizerConfig& o) {
    LLMC_CHECK(std::isfinite(lr) && lr > 0, "--lr: must be a finite number > 0, got %g", lr);
    LLMC_CHECK(o.beta1 >= 0 && o.beta1 < 1, "--beta1: must be in [0, 1), got %g", o.beta1);
    LLMC_CHECK(o.beta2 >= 0 && o.beta2 < 1, "--beta2: must be in [0, 1), got %g", o.beta2);
    LLMC_CHECK(std::isfinite(o.eps) && o.eps > 0, "AdamW eps: must be > 0, got %g", o.eps);
    LLMC_CHECK(std::isfinite(o.weight_decay) && o.weight_decay >= 0, "--weight_decay: must be >= 0, got %g",
               o.weight_decay);
    LLMC_CHECK(std::isfinite(o.grad_clip) && o.grad_clip >= 0, "--grad_clip: must be a finite number >= 0 (0: off), got %g",
               o.grad_clip);
}

// ----------------------------------------------------------------------------------------------
// 5. Training

// Sum, in global order, of one value per rank per round (a loss: the last pipeline stage's ranks
// have them): rounds x dp values, ordered as the global micro-batch index round * dp + rank (the
// first `count` of them). Collective over the world.
static double sum_in_global_order(const std::vector<double>& mine, size_t count) {
    const Comm& cm = comm_world();
    std::vector<double> all(mine.size() * cm.world_size);
    host_all_gather(cm.world, mine.data(), all.data(), mine.size() * sizeof(double));
    // the last stage's tp rank 0 of dp rank d is world rank ((pp - 1) dp + d) tp
    const size_t last_stage = (size_t)(cm.n_stages - 1) * cm.dp.size;
    double sum = 0;
    for (size_t g = 0; g < count; g++)
        sum += all[(last_stage + g % cm.dp.size) * cm.tp.size * mine.size() + g / cm.dp.size];
    return sum;
}

// Mean loss over the first n_batches micro-batches of the val stream, split over the dp ranks
// (every rank runs the same number of forwards: ZeRO-3 gathers in them); the same for any layout.
static double evaluate(GPT& m, DataLoader& loader, int n_batches, std::vector<int>& in, std::vector<int>& tgt,
                       std::vector<int>& ds) {
    loader.reset(LoaderState{});
    const int rounds = ceil_div(n_batches, loader.world);
    std::vector<double> losses(rounds);
    for (int k = 0; k < rounds; k++) {
        loader.next_batch(in.data(), tgt.data(), ds.data());
        losses[k] = gpt_forward(m, in.data(), tgt.data(), ds.data(), loader.B, loader.T);
    }
    return sum_in_global_order(losses, n_batches) / n_batches;
}

static void print_sample(GPT& m, int n_tokens, float temperature, int top_k, const Tokenizer& tokenizer, Rng& rng) {
    std::vector<int> out = gpt_sample(m, {tokenizer.eot}, n_tokens, temperature, top_k, tokenizer.eot, rng);
    const std::string text = tokenizer.decode(out);  // whole UTF-8 characters only (llmc/tokenizer.h)
    if (comm_world().world_rank != 0) return;  // every rank samples (stage 3 gathers), rank 0 prints
    printf("---- sample ----\n%s\n----------------\n", text.c_str());
    fflush(stdout);
}

// The inputs of a memory plan: the model, the batch, and the layout of one rank.
struct PlanInputs {
    GPTConfig config;
    int B = 1, T = 1, zero_stage = 0, recompute = 0, dp = 1, tp = 1, ep = 1;
    bool sp = false;
    int offload = OFFLOAD_NONE;  // --offload
    PipelinePlan pipe;  // its stage is the rank's
    // --device: plan the CUDA build (bf16 params and activations, fp32 master) on a GPU of that
    // memory, from any machine; device_bytes 0: this build on this machine
    size_t elem_bytes = sizeof(floatX);
    double device_bytes = 0;
    std::string device_name;
    MemoryEstimate estimate(int zero, int stage, int r) const {
        PipelinePlan ps = pipe;
        ps.stage = stage;
        return gpt_memory_estimate(config, B, T, zero, &ps, r, dp, elem_bytes, tp, sp, ep, offload);
    }
    double need(const MemoryEstimate& e) const { return device_bytes > 0 ? e.buffers() : plan_need_bytes(e); }
    // the host side when it is apart from the buffers (the CUDA build, or --device), with --offload
    // optimizer (without it the plan is the device's alone); 0 where it is in need()
    bool host_apart() const {
#ifdef LLMC_CPU
        return device_bytes > 0;
#else
        return true;
#endif
    }
    double host_need(const MemoryEstimate& e) const {
        return offload == OFFLOAD_OPTIMIZER && host_apart() ? plan_host_bytes(e) : 0.0;
    }
};

// One rank's memory for every ZeRO stage (the current one marked): the plan of gpt_allocate.
static void print_memory_plan(const PlanInputs& in) {
    MemoryEstimate mem[4];
    for (int z = 0; z < 4; z++) mem[z] = in.estimate(z, in.pipe.stage, in.recompute);
    printf("memory per rank (MiB), dp %d%s%s%s, -r %d%s:  %10s %10s %10s %10s\n", in.dp,
           in.tp > 1 ? (", tp " + std::to_string(in.tp) + (in.sp ? " + sp" : "")).c_str() : "",
           in.ep > 1 ? (", ep " + std::to_string(in.ep)).c_str() : "",
           in.pipe.P > 1 ? (", pipeline stage " + std::to_string(in.pipe.stage)).c_str() : "", in.recompute,
           in.offload == OFFLOAD_OPTIMIZER ? ", --offload optimizer" : "",
           in.zero_stage == 0 ? "[-z 0]" : "-z 0", in.zero_stage == 1 ? "[-z 1]" : "-z 1",
           in.zero_stage == 2 ? "[-z 2]" : "-z 2", in.zero_stage == 3 ? "[-z 3]" : "-z 3");
    auto row = [&](const char* name, double MemoryEstimate::*field) {
        printf("  %-34s", name);
        for (int z = 0; z < 4; z++) printf(" %10.2f", (field ? mem[z].*field : mem[z].buffers()) / 1048576.0);
        printf("\n");
    };
    row("params (+ stage-3 slots)", &MemoryEstimate::params);
    row("grads (leaves, fp32 acc, comm)", &MemoryEstimate::grads);
    row("master weights (fp32)", &MemoryEstimate::master);
    row("adam moments (fp32)", &MemoryEstimate::moments);
    row("activations", &MemoryEstimate::activations);
    row("batch", &MemoryEstimate::batch);
    row("op scratch + cuBLASLt workspace", &MemoryEstimate::scratch);
    row("total", nullptr);
    if (in.offload != OFFLOAD_OPTIMIZER) return;
    row("host: master weights (fp32)", &MemoryEstimate::host_master);
    row("host: adam moments (fp32)", &MemoryEstimate::host_moments);
    row("host: gradient staging (fp32)", &MemoryEstimate::host_staging);
    printf("  %-34s", "host total (offload arenas)");
    for (int z = 0; z < 4; z++) printf(" %10.2f", mem[z].host_arenas() / 1048576.0);
    printf("\n");
}

// The pipeline at start-up: per stage its virtual stages' blocks, parameters, FLOPs per micro-batch,
// the micro-batches it keeps in flight and its activation memory (the plan for that stage), and the
// schedule's theoretical bubble.
static void print_pipeline(const PlanInputs& in) {
    const PipelinePlan& p = in.pipe;
    const GPTConfig& c = in.config;
    const int B = in.B, T = in.T;
    const std::vector<ParamTensor> table = build_param_table(c);
    printf("pipeline: %d stages, schedule %s", p.P, pipe_kind_name(p.kind));
    if (p.V > 1) printf(" with %d chunks per stage", p.V);
    printf(", %d micro-batches per step; theoretical bubble %.1f%% (idle / step time, unit costs)\n", p.M,
           100 * pipe_bubble_formula(p.kind, p.P, p.M, p.V));
    for (int s = 0; s < p.P; s++) {
        PipelinePlan ps = p;
        ps.stage = s;
        std::vector<int> n_slots, n_stashes;
        chunk_bounds(p.schedule[s], p.V, n_slots, n_stashes);
        double params = 0, flops = 0;
        std::string layers;
        for (int ch = 0; ch < p.V; ch++) {
            const int l0 = ps.layer_begin(ch), l1 = ps.layer_end(ch);
            layers += (ch ? "," : "") + std::to_string(l0) + "-" + std::to_string(l1 - 1);
            for (int l = l0; l < l1; l++) flops += block_flops(c, l, B, T);
        }
        for (const ParamTensor& t : table) {
            const int seg = segment_of(t.name, c.n_layer);
            if (stage_holds_segment(ps, seg, c.n_layer)) params += t.numel;
        }
        if (ps.has_head()) flops += head_flops(c, B, T);
        int in_flight = 0, stashed = 0;
        for (int ch = 0; ch < p.V; ch++) { in_flight += n_slots[ch]; stashed += n_stashes[ch]; }
        const MemoryEstimate e = in.estimate(in.zero_stage, s, in.recompute);
        printf("  stage %d: blocks %-12s%s%s params %10.0f | %.3g GFLOP per micro-batch | %d micro-batch%s in flight%s | "
               "activations %.2f MiB, total %.2f MiB\n", s, layers.c_str(), ps.has_embedding() ? " +embedding" : "",
               ps.has_head() ? " +head" : "", params, flops / 1e9, in_flight, in_flight == 1 ? "" : "es",
               stashed ? (" (+" + std::to_string(stashed) + " weight-gradient stashes)").c_str() : "",
               e.activations / 1048576.0, e.buffers() / 1048576.0);
    }
}

// --plan: the plan of every stage and -r level for the flags, whether it fits this machine's memory
// (or LLMC_MEMORY_LIMIT), and with --max_fit the largest micro-batch and the largest dN-shaped model
// that fit per -r level; nothing is allocated.
static void print_plan(const PlanInputs& in, bool max_fit) {
    std::string source = in.device_name, host_source = "host memory of the GPU machine: unknown, not checked";
    double avail = in.device_bytes > 0 ? in.device_bytes : available_buffer_memory(source);
    const double GiB = 1073741824.0;
    const bool headroom = in.elem_bytes == 2 && avail > 0;  // a GPU's plan (the CUDA build, or --device)
    if (headroom) avail -= device_headroom_bytes(in.dp, in.pipe.P, in.tp, in.ep);
    // --offload optimizer on the CUDA build: the host side is checked against this machine's host
    // memory; with --device it is reported (the GPU machine's host memory is not known here)
    const double host_avail = in.device_bytes > 0 ? -1 : available_host_memory(host_source);
    if (in.pipe.P > 1) print_pipeline(in);
    for (int s = 0; s < in.pipe.P; s++) {
        PlanInputs one = in;
        one.pipe.stage = s;
        print_memory_plan(one);
    }
    // the most any stage needs; host: the most any stage needs of host memory apart (and of that, in
    // the offload arenas)
    auto worst = [&](const PlanInputs& p, int r, double* host = nullptr, double* arenas = nullptr) {
        double need = 0, h = 0, a = 0;
        for (int s = 0; s < p.pipe.P; s++) {
            const MemoryEstimate e = p.estimate(p.zero_stage, s, r);
            need = std::max(need, p.need(e));
            if (p.host_need(e) > h) { h = p.host_need(e); a = e.host_arenas(); }
        }
        if (host) *host = h;
        if (arenas) *arenas = a;
        return need;
    };
    auto fits = [&](const PlanInputs& p, int r) {
        double h = 0;
        const double need = worst(p, r, &h);
        return need <= avail && (host_avail <= 0 || h <= host_avail);
    };
    const int procs = in.pipe.P * in.dp * in.tp;
    printf("plan: %d process%s (pp %d x dp %d x tp %d%s), -z %d%s; available: %s %.2f GiB\n", procs, procs == 1 ? "" : "es",
           in.pipe.P, in.dp, in.tp, in.sp ? " + sp" : "", in.zero_stage,
           in.offload == OFFLOAD_OPTIMIZER ? ", --offload optimizer" : "", source.c_str(), avail / GiB);
    if (headroom) printf("  available is after %s\n", device_headroom_text(in.dp, in.pipe.P, in.tp, in.ep).c_str());
    const bool host_line = in.offload == OFFLOAD_OPTIMIZER && in.host_apart();
    if (host_line) {
        if (host_avail > 0) printf("  host side: %s %.2f GiB\n", host_source.c_str(), host_avail / GiB);
        else printf("  host side: %s\n", host_source.c_str());
    }
    for (int r = 0; r <= 2; r++) {
        double host = 0, arenas = 0;
        const double need = worst(in, r, &host, &arenas);
        const bool ok = need <= avail && (host_avail <= 0 || host <= host_avail);
        printf("  -r %d: the largest stage needs %.3f GiB%s: %s\n", r, need / GiB,
               host_line ? strfmt(", and %.3f GiB of host memory per rank (offload arenas %.3f, staging for init and "
                                  "checkpoints %.3f)", host / GiB, arenas / GiB, (host - arenas) / GiB).c_str() : "",
               avail <= 0 ? "(no limit known)" : ok ? "fits" : "does NOT fit");
    }
    if (!max_fit || avail <= 0) return;
    for (int r = 0; r <= 2; r++) {
        int lo = 0, hi = 1;  // the largest B that fits: doubling, then bisection
        auto fits_b = [&](int b) {
            PlanInputs p = in;
            p.B = b;
            try { return fits(p, r); } catch (const LlmcError&) { return false; }
        };
        while (hi <= (1 << 20) && fits_b(hi)) { lo = hi; hi *= 2; }
        while (hi - lo > 1) { const int mid = (lo + hi) / 2; (fits_b(mid) ? lo : hi) = mid; }
        int best_n = 0;  // the largest dN of the flags' shape (n_layer N, n_embd 64 N, n_head N)
        for (int n = std::max(1, in.pipe.n_vs()); n <= 1024; n++) {
            PlanInputs p = in;
            p.config.n_layer = n;
            p.config.n_embd = 64 * n;
            p.config.n_head = n;
            p.config.n_kv_head = in.config.n_head % in.config.n_kv_head == 0 && n % (in.config.n_head / in.config.n_kv_head) == 0
                                     ? n / (in.config.n_head / in.config.n_kv_head) : n;
            p.config.ffn_hidden = 0;
            p.config.expert_hidden = 0;
            bool ok = false;
            try {
                p.config.finalize();
                p.pipe = pipeline_plan(p.config, p.B, p.T, in.pipe.P, in.pipe.V, in.pipe.M, in.pipe.kind, "", 0);
                ok = fits(p, r);
            } catch (const LlmcError&) { ok = false; }
            if (!ok) break;
            best_n = n;
        }
        printf("  -r %d: the largest micro-batch that fits is -b %d (T %d)", r, lo, in.T);
        if (best_n > 0) {
            GPTConfig d = in.config;
            d.n_layer = best_n; d.n_embd = 64 * best_n; d.n_head = best_n; d.n_kv_head = best_n;
            d.ffn_hidden = 0; d.expert_hidden = 0; d.finalize();
            printf("; the largest dN model at -b %d is d%d (%.0f M parameters)", in.B, best_n,
                   count_params(build_param_table(d)) / 1e6);
        }
        printf("\n");
    }
}

// Bytes this rank sends in one optimizer step, by collective, for the layout (what the counters
// in comm.h must show after a step without evaluation or sampling).
// The tensor-parallel bytes one rank sends per step (a second derivation of what the collectives
// count, from the model's structure): per micro-batch and block, Megatron's four all-reduces of
// B*T*C (attention and FFN outputs forward, their inputs' gradients backward) at 2 (tp-1)/tp of the
// bytes each, or with --sp the same bytes as four all-gathers and four reduce-scatters; MoE layers
// reduce the experts' rows instead of the FFN's tokens; recomputed forwards (-r) repeat theirs.
static void tp_comm_theory(const GPT& m, int grad_accum, double theory[COMM_N_OPS]) {
    const LocalShape& ls = m.ls;
    if (ls.tp == 1) return;
    const GPTConfig& c = m.config;
    const PipelinePlan& pp = m.pipe;
    const double P = ls.tp, f = (P - 1) / P, fx = sizeof(floatX), BT = (double)m.max_B * m.max_T;
    const double S = BT * c.n_embd * fx, expert = c.n_expert > 0 ? (double)c.n_expert * c.moe_capacity(m.max_B, m.max_T) * c.n_embd * fx : 0;
    double& a2a = theory[COMM_ALL_TO_ALL];
    double& ag = theory[COMM_ALL_GATHER];
    // a canonical reduction sends each of its tree nodes (the most a rank of the split holds:
    // llmc/tensor_parallel.h); an order-free one (max, embedding, target logit) one
    const double n_attn = split_nodes(m.split_attn), n_ffn = split_nodes(m.split_ffn),
                 n_expert = split_nodes(m.split_expert), n_vocab = split_nodes(m.split_vocab),
                 n_tok = split_nodes(m.split_tokens);
    auto all_reduce = [&](double bytes, double n_elems, double nodes) {
        if (std::fmod(n_elems, P) == 0) { a2a += nodes * f * bytes; ag += f * bytes; }
        else ag += nodes * (P - 1) * bytes;  // small vectors: all-gather of the partials
    };
    auto reduce = [&](double bytes, double nodes) {  // RS or AR
        if (ls.sp) a2a += nodes * f * bytes;
        else all_reduce(bytes, bytes / fx, nodes);
    };
    auto gather = [&](double bytes) { if (ls.sp) ag += f * bytes; };  // --sp only
    auto ln_grads = [&]() { if (ls.sp) all_reduce(2.0 * c.n_embd * fx, 2.0 * c.n_embd, n_tok); };
    // one forward of block l (the attention output and the FFN's; with --sp the LN outputs' gathers)
    auto block_fwd = [&](int l) {
        gather(S);
        reduce(S, n_attn);
        gather(S);
        if (c.is_moe(l)) all_reduce(expert, expert / fx, n_expert);
        else reduce(S, n_ffn);
    };
    // the backward's recomputation: -r 2 runs each block's forward again (-r 1 recomputes only
    // LayerNorms and activations: no communication); a W that does not follow its B recomputes once more
    std::vector<int> passes(pp.V, 0);
    const std::vector<PipeAction>& acts = pp.schedule[pp.stage];
    for (size_t k = 0; k < acts.size(); k++)
        if (acts[k].op == PIPE_B) passes[acts[k].chunk] += 1 + !next_compute_is_own_w(acts, k);
    const int kv_share = comm_world().tp_kv.size;
    for (int ch = 0; ch < pp.V; ch++) {
        const double a2a0 = a2a, ag0 = ag;
        for (int l = pp.layer_begin(ch); l < pp.layer_end(ch); l++) {
            block_fwd(l);
            // backward: the FFN's (MoE: the experts' input rows) and the attention's input gradients
            // (with --sp each gathers the branch's output gradient, and LN1 / LN2 again for the weight
            // gradients; MoE: LN2 once more for the router's input gradient)
            if (c.is_moe(l)) { gather(S); all_reduce(expert, expert / fx, n_expert); gather(S); }
            else { gather(S); reduce(S, n_ffn); }
            gather(S);
            reduce(S, n_attn);
            gather(S);
            gather(S);
            ln_grads();
            ln_grads();
            if (kv_share > 1)  // a shared kv head: the group's query heads, outputs, their gradients, lse
                ag += (kv_share - 1) * BT * ls.n_head * (3.0 * ls.hs * fx + 4.0);
        }
        if (pp.first_vs(ch)) { reduce(S, 1); gather(S); }  // the embedding; its backward gathers the stream (--sp)
        if (pp.last_vs(ch)) {
            gather(S);  // the final LN's output
            for (double nodes : {1.0, n_vocab, 1.0}) all_reduce(4.0 * BT, BT, nodes);  // softmax max, sum, target logit
            reduce(S, n_vocab);  // the gradient at the final LN
            ln_grads();
        }
        a2a = a2a0 + (a2a - a2a0) * grad_accum;  // per micro-batch, times the step's micro-batches
        ag = ag0 + (ag - ag0) * grad_accum;
        for (int r = 0; r < passes[ch]; r++)
            for (int l = pp.layer_begin(ch); l < pp.layer_end(ch); l++) {
                if (m.recompute == 2) block_fwd(l);
            }
    }
}

static void print_comm_volume(const GPT& m, int grad_accum) {
    const Comm& c = comm_world();
    const ZeroLayout& z = m.zero;
    const PipelinePlan& pp = m.pipe;
    const double share = (double)(z.dp - 1) / z.dp, fx = sizeof(floatX);
    const double head = pp.has_head() ? (double)m.head.padded_total : 0.0;
    double theory[COMM_N_OPS] = {};
    // ZeRO, per segment over its group (the experts' over the expert-dp ranks, one leaf per ep rank)
    theory[COMM_ALL_TO_ALL] = grad_accum * share * fx * head;
    for (int s = 0; s < (int)z.segs.size(); s++) {
        const Segment& seg = z.segs[s];
        const double sh = (double)(seg.dp - 1) / seg.dp, n = (double)seg.padded;
        const bool block = segment_layer(seg.id, m.config.n_layer) >= 0;
        theory[COMM_ALL_TO_ALL] += grad_accum * sh * fx * n * seg.n_leaves;    // reduce_scatter_add of the leaves
        if (z.stage <= 1) theory[COMM_ALL_GATHER] += sh * 4.0 * n;            // completes the all-reduce
        if (z.stage == 1 || z.stage == 2) theory[COMM_ALL_GATHER] += sh * fx * n;  // updated params
        if (z.stage == 3)  // per micro-batch: every segment in the forward (the embedding again for the head in one stage), blocks in the backward
            theory[COMM_ALL_GATHER] += grad_accum * sh * fx * n * (1 + block + (seg.id == 0 && pp.P == 1));
    }
    // expert parallel: each MoE layer's rows to the experts' owners and back, forward and backward
    // (and again in a recomputed forward, -r 2)
    if (m.ls.ep > 1) {
        const GPTConfig& cf = m.config;
        const double rows = (double)cf.n_expert * cf.moe_capacity(m.max_B, m.max_T) * cf.n_embd * fx;
        const double per_layer = (m.ls.ep - 1.0) / m.ls.ep * rows;
        std::vector<int> passes(pp.V, 0);  // backward passes per chunk (a split W recomputes once more)
        const std::vector<PipeAction>& acts = pp.schedule[pp.stage];
        for (size_t k = 0; k < acts.size(); k++)
            if (acts[k].op == PIPE_B) passes[acts[k].chunk] += 1 + !next_compute_is_own_w(acts, k);
        for (int ch = 0; ch < pp.V; ch++)
            for (int l = pp.layer_begin(ch); l < pp.layer_end(ch); l++)
                if (cf.is_moe(l))
                    theory[COMM_ALL_TO_ALL] += per_layer * (4.0 * grad_accum + (m.recompute == 2 ? 2.0 * passes[ch] : 0.0));
    }
    if (pp.P > 1) {
        const double act = (double)m.max_B * m.max_T / (m.ls.sp ? m.ls.tp : 1) * m.config.n_embd * fx;  // the stream's rows
        for (int ch = 0; ch < pp.V; ch++) theory[COMM_P2P] += grad_accum * act * (!pp.last_vs(ch) + !pp.first_vs(ch));
        if (pp.has_embedding()) theory[COMM_P2P] += fx * m.head.shard_len(0);     // the tied weights, to the last stage
        if (pp.has_head()) {
            theory[COMM_P2P] += 4.0 * m.head.shard_len(0);                         // the head's gradient, to the first
            theory[COMM_ALL_GATHER] += share * fx * m.head.padded_total;           // its copy of the new weights
        }
    }
    tp_comm_theory(m, grad_accum, theory);
    printf("communication per step, rank %d (sent bytes): ", c.world_rank);
    for (int k = 0; k < COMM_N_OPS; k++) {
        if (k == COMM_HOST) printf("%s %llu", comm_op_name(k), (unsigned long long)c.sent_bytes[k]);
        else printf("%s %llu (theory %.0f), ", comm_op_name(k), (unsigned long long)c.sent_bytes[k], theory[k]);
    }
    printf("\n");
}

// --pp_trace: every rank's executed actions of one step, gathered to rank 0 and written as JSON
// lines for scripts/plot_pipeline.py (times from the step's start; "recv"/"send" events are waits).
static void write_pipeline_trace(const std::string& path, const std::vector<PipeEvent>& events, const PipelinePlan& pp) {
    const Comm& cm = comm_world();
    std::vector<double> mine;
    for (const PipeEvent& e : events)
        mine.insert(mine.end(), {(double)e.op, (double)e.mb, (double)e.chunk, e.t0_ms, e.t1_ms});
    size_t longest = 0;
    for (uint64_t n : host_gather_all<uint64_t>(cm.world, mine.size())) longest = std::max(longest, (size_t)n);
    mine.resize(longest, -1.0);
    std::vector<double> all(longest * cm.world_size);
    host_all_gather(cm.world, mine.data(), all.data(), longest * sizeof(double));
    if (cm.world_rank != 0) return;
    FILE* f = fopen_or_fail(path, "w");
    static const char* ops[] = {"F", "B", "W", "send", "recv", "send", "recv"};
    for (int r = 0; r < cm.world_size; r++)
        for (size_t k = 0; k + 4 < longest; k += 5) {
            const double* e = all.data() + (size_t)r * longest + k;
            if (e[0] < 0) break;
            fprintf(f, "{\"rank\": %d, \"stage\": %d, \"dp\": %d, \"op\": \"%s\", \"mb\": %d, \"chunk\": %d, "
                       "\"t0_ms\": %.4f, \"t1_ms\": %.4f, \"schedule\": \"%s\"}\n",
                    r, r / cm.dp.size, r % cm.dp.size, ops[(int)e[0]], (int)e[1], (int)e[2], e[3], e[4], pipe_kind_name(pp.kind));
        }
    LLMC_CHECK(fclose(f) == 0, "%s: cannot write the pipeline trace", path.c_str());
    printf("wrote the pipeline timeline of step %s to %s\n", "1 of this run", path.c_str());
}

static std::string checkpoint_path(const std::string& out_dir, int step) {
    return out_dir + "/ckpt_" + std::to_string(1000000000 + step).substr(1) + ".bin";
}

// The newest checkpoint in out_dir that verifies, by the step stored inside; the ones that do not
// are skipped with a warning, and none that loads is an error. "" when out_dir holds no checkpoint
// yet (a run stopped before its first one): the caller starts afresh, so one command line serves
// every (re)start of a preemptible job. Collective: verify_checkpoint's verdict is the same on every rank.
static std::string latest_checkpoint(const std::string& out_dir, Checkpoint& ck) {
    std::vector<std::pair<int64_t, std::string>> found;
    const std::vector<std::string> files = glob_files(out_dir + "/ckpt_*.bin");
    if (files.empty()) {
        if (comm_world().world_rank == 0)
            printf("--resume latest: %s holds no checkpoint yet; starting from step 0\n", out_dir.c_str());
        return "";
    }
    for (const std::string& f : files) {
        int64_t step = checkpoint_step(f);
        if (step >= 0) found.push_back({step, f});
        else if (comm_world().world_rank == 0) fprintf(stderr, "warning: %s is not a readable checkpoint, skipped\n", f.c_str());
    }
    std::sort(found.begin(), found.end(), [](auto& a, auto& b) { return a.first > b.first; });
    for (auto& [step, path] : found) {
        try {
            ck = verify_checkpoint(comm_world().world, path);
            return path;
        } catch (const LlmcError& e) {
            if (comm_world().world_rank == 0) fprintf(stderr, "warning: skipping %s\n", e.what());
        }
    }
    LLMC_FAIL("--resume latest: no checkpoint in %s loads (looked for ckpt_*.bin)", out_dir.c_str());
}

// llm.c's GPT-2 model files (llmc/llmc_format.h) and our model: the config a file describes, our
// config in llm.c's terms (refused, naming the field, when it is not GPT-2's shape), and the
// conversions between the two parameter orders.
static TableIndex table_index(const std::vector<ParamTensor>& table) {
    TableIndex index;
    for (const ParamTensor& t : table) index[t.name] = {t.offset, t.numel};
    return index;
}
static GPTConfig config_from_llmc(const LlmcModelShape& s, const std::string& path) {
    GPTConfig c;
    c.vocab_size = s.vocab_size;
    c.n_layer = s.n_layer;
    c.n_embd = s.n_embd;
    c.n_head = c.n_kv_head = s.n_head;
    c.ffn_hidden = 4 * s.n_embd;
    c.max_seq_len = s.max_seq_len;
    c.mlp = MLP_GELU;
    c.pos = POS_LEARNED;
    c.n_expert = 0;
    c.finalize();
    LLMC_CHECK(c.padded_vocab_size == s.padded_vocab_size,
               "%s: the llm.c model pads vocab_size %d to %d rows, this engine pads it to %d (the next multiple of 128); "
               "the wte tables would not line up", path.c_str(), s.vocab_size, s.padded_vocab_size, c.padded_vocab_size);
    return c;
}
static LlmcModelShape llmc_shape_of(const GPTConfig& c) {
    const char* why = c.mlp != MLP_GELU ? "--mlp gelu (this model has swiglu)"
                      : c.pos != POS_LEARNED ? "--pos learned (this model has alibi)"
                      : c.n_kv_head != c.n_head ? "--n_kv_head equal to --n_head (this model has grouped-query attention)"
                      : c.ffn_hidden != 4 * c.n_embd ? "--ffn_hidden 4 * n_embd (this model's differs)"
                      : c.n_expert != 0 ? "a dense model (this one has experts)" : nullptr;
    LLMC_CHECK(!why, "--export_llmc: llm.c's GPT-2 format holds only GPT-2-shaped models: it needs %s; "
                     "scripts/export_hf.py exports any shape", why);
    LlmcModelShape s;
    s.max_seq_len = c.max_seq_len;
    s.vocab_size = c.vocab_size;
    s.n_layer = c.n_layer;
    s.n_head = c.n_head;
    s.n_embd = c.n_embd;
    s.padded_vocab_size = c.padded_vocab_size;
    return s;
}
// The weights of an llm.c file into the model (fresh optimizer state). The wte rows past
// vocab_size are zeroed: no token uses them (both engines skip them in the softmax) and our
// invariant keeps them zero.
static void gpt_load_llmc(GPT& m, const LlmcModelFile& f, const std::string& path) {
    std::vector<float> p = llmc_to_table(f.shape, f.params, table_index(m.table), m.n_params, path);
    const ParamTensor& wte = m.table[0];
    std::fill(p.begin() + wte.offset + (size_t)m.config.vocab_size * m.config.n_embd, p.begin() + wte.offset + wte.numel,
              0.0f);
    std::vector<float> zeros(m.n_params, 0.0f);
    gpt_set_state(m, p.data(), zeros.data(), zeros.data());
}
// Collective (every rank gathers the whole table), rank 0 writes.
static void gpt_export_llmc(const GPT& m, const std::string& path, bool bf16) {
    const LlmcModelShape shape = llmc_shape_of(m.config);
    std::vector<float> p(m.n_params);
    gpt_get_state(m, p.data(), nullptr, nullptr);
    const CommLongWork long_work;  // the others wait for rank 0's write
    if (comm_world().world_rank == 0) write_llmc_model(path, shape, table_to_llmc(shape, p.data(), table_index(m.table)), bf16);
    barrier(comm_world().dp);
}

// The whole training program; main() only maps errors to exit codes. Returns the exit code.
[[maybe_unused]] static int train_main(int argc, char** argv) {
    Comm& cm = comm_world();
    const bool rank0 = cm.world_rank == 0;  // prints, writes log.jsonl
    Args args;
    if (!parse_args(argc, argv, args)) { if (rank0) print_usage(); return 0; }
    comm_set_timeout(cm, args.f("comm_timeout"));
    GPTConfig config = config_from_args(args);
    const int B = args.i("batch_size", 1), T = args.i("seq_len", 1);
    LLMC_CHECK(B > 0, "--batch_size: must be > 0, got %d", B);
    LLMC_CHECK(T > 0, "--seq_len: must be > 0, got %d", T);
    const int zero_stage = args.i("zero", 0, 3);
    const int n_stages = args.i("pp", 1, 1024), tp = args.i("tp", 1, 1024), ep = args.i("ep", 1, 1024);
    const bool sp = args.flag("sp");
    LLMC_CHECK(!sp || tp > 1, "--sp: sequence parallelism splits the tokens over the tensor-parallel ranks; give --tp > 1");
    const bool planning = args.flag("plan") || args.flag("max_fit");  // a plan for --plan_ranks processes
    LLMC_CHECK(planning || cm.world_size % (n_stages * tp) == 0,
               "--pp %d --tp %d: the %d processes are not a multiple of pp * tp = %d (the grid is pp x dp x tp: start a "
               "multiple of %d processes)", n_stages, tp, cm.world_size, n_stages * tp, n_stages * tp);
    if (planning) comm_make_grid(cm, cm.world_size, 1);
    else comm_make_grid(cm, cm.world_size / (n_stages * tp), n_stages, tp, ep);
    const int local_ranks = launcher_local_size();
    if (rank0 && !planning && tp > 1 && local_ranks > 0 && local_ranks % tp != 0)
        fprintf(stderr, "warning: --tp %d with %d processes per node: some tensor-parallel groups span nodes (their "
                "collectives run on every layer's critical path); use a --tp that divides the processes per node\n",
                tp, local_ranks);
    const CommGroup& dp = cm.dp;
    const int world = dp.size;  // the data-parallel ranks: they split the batch
    // token counts in 64 bits: B*T*ranks must fit the ops' int indexing, the step may be larger
    const int64_t tokens_per_micro = checked_product({B, T, world}, INT32_MAX, "the tokens per micro-batch B*T*ranks");
    const int64_t total_batch_flag = parse_int64(args.str("total_batch_tokens"), "total_batch_tokens", 0, INT64_MAX);
    const int64_t total_batch = total_batch_flag > 0 ? total_batch_flag : tokens_per_micro;
    LLMC_CHECK(total_batch % tokens_per_micro == 0,
               "--total_batch_tokens %lld is not a multiple of B*T*ranks = %d*%d*%d = %lld", (long long)total_batch, B, T,
               world, (long long)tokens_per_micro);
    const int grad_accum = (int)checked_product({total_batch / tokens_per_micro}, INT32_MAX,
                                                "the gradient accumulation steps --total_batch_tokens / (B*T*ranks)");
    const int global_micro = grad_accum * world;  // micro-batches per step, over all ranks
    const int max_steps = args.i("max_steps", 0);
    const uint64_t seed = args.u64("seed");
    const int max_bad_steps = args.i("max_bad_steps", 1);
    LRSchedule sched;
    sched.kind = args.str("schedule");
    sched.lr_max = args.f("lr");
    sched.final_frac = args.f("final_lr_frac");
    sched.wsd_decay_frac = args.f("wsd_decay_frac");
    sched.warmup = args.i("warmup");
    sched.max_steps = max_steps;
    sched.validate();
    OptimizerConfig opt;
    opt.beta1 = args.f("beta1");
    opt.beta2 = args.f("beta2");
    opt.weight_decay = args.f("weight_decay");
    opt.grad_clip = args.f("grad_clip");
    check_optimizer_flags(sched.lr_max, opt);
    const int val_every = args.i("val_every", 0), val_batches = args.i("val_batches", 0);
    const int sample_every = args.i("sample_every", 0), sample_len = args.i("sample_len", 0), top_k = args.i("top_k", 0);
    const float temperature = args.f("temperature");
    LLMC_CHECK(temperature >= 0, "--temperature: must be >= 0, got %g", temperature);
    const int ckpt_every = args.i("ckpt_every", -1);
    const std::string out_dir = args.str("out_dir");
    // out_dir ownership (llmc/run_dir.h): one trainer at a time, and a fresh run does not mix with
    // an earlier run's checkpoints. Rank 0 alone creates the directory and holds the lock.
    RunDirLock out_dir_lock;
    if (rank0) {
        make_dirs(out_dir);
        out_dir_lock.acquire(out_dir);
        if (claim_out_dir(out_dir, !args.str("resume").empty(), args.flag("overwrite")))
            printf("--overwrite: removed the earlier run's checkpoints and log from %s\n", out_dir.c_str());
    }
    barrier(dp);

    LLMC_CHECK(args.str("init_from").empty() || args.str("resume").empty(),
               "--init_from %s and --resume %s: give one (a resumed run has its weights)", args.str("init_from").c_str(),
               args.str("resume").c_str());
    // resume: the checkpoint's config wins over defaults, and must agree with explicit flags. The
    // file is verified now (every rank a share of it); its arrays are read after the allocation.
    Checkpoint ck;
    std::string resume = args.str("resume");
    const bool resume_latest = resume == "latest";
    if (resume_latest) resume = latest_checkpoint(out_dir, ck);  // "": none yet, a fresh start
    if (!resume.empty()) {
        if (!resume_latest) ck = verify_checkpoint(cm.world, resume);
        GPTConfig stored = config_from_checkpoint(ck, resume);
        auto mine = config_fields(config), theirs = config_fields(stored);
        for (size_t k = 0; k < mine.size(); k++) {
            const std::string n = mine[k].first;
            LLMC_CHECK(!(args.given.count(n) || preset_sets(args, n)) || *mine[k].second == *theirs[k].second,
                       "%s: checkpoint has %s = %s but the flags ask for %s; drop the flag or start a new run",
                       resume.c_str(), n.c_str(), config_value_text(n, *theirs[k].second).c_str(),
                       config_value_text(n, *mine[k].second).c_str());
        }
        LLMC_CHECK(!args.given.count("capacity_factor") || stored.capacity_factor == config.capacity_factor,
                   "%s: checkpoint has capacity_factor = %g but the flags ask for %g", resume.c_str(),
                   stored.capacity_factor, config.capacity_factor);
        config = stored;
        // the global batch decides the math; how it is split over ranks does not
        const std::pair<const char*, int64_t> shape[] = {{"batch_size", B}, {"seq_len", T}, {"total_batch_tokens", total_batch}};
        for (auto& [name, v] : shape) {
            int64_t stored = ck.get_int(std::string("train.") + name, resume);
            LLMC_CHECK(stored == v, "%s: checkpoint was trained with --%s %lld, this run has %lld; resuming needs the same batch shape",
                       resume.c_str(), name, (long long)stored, (long long)v);
        }
        LLMC_CHECK((uint64_t)ck.get_int("train.seed", resume) == seed,
                   "%s: checkpoint was trained with --seed %lld, this run has %llu", resume.c_str(),
                   (long long)ck.get_int("train.seed", resume), (unsigned long long)seed);
        const int64_t step = ck.get_int("step", resume);
        LLMC_CHECK(step >= 0 && step <= max_steps, "%s: checkpoint step %lld is outside [0, --max_steps %d]",
                   resume.c_str(), (long long)step, max_steps);
    }

    // --init_from: an llm.c model file sets the config (explicit flags must agree) and the weights
    const std::string init_from = args.str("init_from");
    LlmcModelFile init_file;
    if (!init_from.empty()) {
        init_file = read_llmc_model(init_from);
        GPTConfig from_file = config_from_llmc(init_file.shape, init_from);
        auto mine = config_fields(config), theirs = config_fields(from_file);
        for (size_t k = 0; k < mine.size(); k++) {
            const std::string n = mine[k].first;
            LLMC_CHECK(!(args.given.count(n) || preset_sets(args, n)) || *mine[k].second == *theirs[k].second,
                       "%s: the llm.c model has %s = %d but the flags ask for %d; drop the flag (the file sets it)",
                       init_from.c_str(), n.c_str(), *theirs[k].second, *mine[k].second);
        }
        config = from_file;
    }
    const std::string export_llmc = args.str("export_llmc"), export_dtype = args.str("export_llmc_dtype");
    LLMC_CHECK(export_dtype == "fp32" || export_dtype == "bf16", "--export_llmc_dtype: expected fp32 or bf16, got '%s'",
               export_dtype.c_str());
    if (!export_llmc.empty()) llmc_shape_of(config);  // refuse a shape llm.c cannot hold now, not after training

    config.check_batch(B, T, world);  // after the resume: the checkpoint may have set the config
    // the pipeline: the schedule's micro-batches are the accumulation steps
    const PipeKind pp_kind = parse_pipe_kind(args.str("pp_schedule"));
    const int pp_virtual = args.i("pp_virtual", 1, 1024);
    const int recompute = args.i("recompute", 0, 2);
    const int offload = parse_offload(args.str("offload"));
    PlanInputs plan_inputs;  // the memory plan's inputs (the start-up tables, --plan)
    plan_inputs.config = config;
    plan_inputs.B = B;
    plan_inputs.T = T;
    plan_inputs.zero_stage = zero_stage;
    plan_inputs.recompute = recompute;
    plan_inputs.offload = offload;
    if (planning) {
        // a plan for --plan_ranks processes (default: this run's), nothing allocated
        const int ranks = args.str("plan_ranks").empty() ? cm.world_size : args.i("plan_ranks", 1, 1 << 20);
        LLMC_CHECK(ranks % (n_stages * tp) == 0, "--plan_ranks %d is not a multiple of --pp %d x --tp %d", ranks, n_stages, tp);
        plan_inputs.dp = ranks / (n_stages * tp);
        plan_inputs.tp = tp;
        plan_inputs.sp = sp;
        plan_inputs.ep = ep;
        const int64_t per_micro = (int64_t)B * T * plan_inputs.dp;
        LLMC_CHECK(total_batch_flag == 0 || total_batch_flag % per_micro == 0,
                   "--total_batch_tokens %lld is not a multiple of B*T*dp = %lld for --plan_ranks %d",
                   (long long)total_batch_flag, (long long)per_micro, ranks);
        const int plan_m = total_batch_flag > 0 ? (int)(total_batch_flag / per_micro) : 1;
        plan_inputs.pipe = pipeline_plan(config, B, T, n_stages, pp_virtual, plan_m, pp_kind, args.str("pp_layers"), 0);
        const std::string device = args.str("device");
        if (!device.empty()) {
            // the free memory cudaMemGetInfo reports on that GPU (after the CUDA context); the plan's
            // buffers and the headroom (llmc/op_scratch.h) must fit it
            LLMC_CHECK(device == "h200" || device == "h100", "--device: expected h200 or h100, got '%s'", device.c_str());
            plan_inputs.elem_bytes = 2;
            plan_inputs.device_bytes = (device == "h200" ? 139.8 : 79.1) * 1073741824.0;
            plan_inputs.device_name = device == "h200" ? "an H200 (CUDA build, bf16)" : "an H100 80GB (CUDA build, bf16)";
        }
        if (rank0) print_plan(plan_inputs, args.flag("max_fit"));
        return 0;
    }
    const PipelinePlan pipe = pipeline_plan(config, B, T, n_stages, pp_virtual, grad_accum, pp_kind, args.str("pp_layers"),
                                            cm.stage);
    plan_inputs.dp = world;
    plan_inputs.tp = tp;
    plan_inputs.sp = sp;
    plan_inputs.ep = ep;
    plan_inputs.pipe = pipe;
    check_memory_fits(config, B, T, zero_stage, pipe, recompute, sp, offload);  // before anything big is allocated

    DataLoader train_loader(args.str("train"), B, T, dp.rank, world, true, seed, config.vocab_size, "--train");
    const int eot = train_loader.eot;
    const std::vector<CheckpointField> settings = run_settings(args, train_loader);  // stored in checkpoints
    const ShardInfo& first_shard = train_loader.shards[0];
    const Tokenizer tokenizer = find_tokenizer(args.str("tokenizer"), first_shard.path, first_shard.vocab_size, eot,
                                               first_shard.llmc_format);
    const bool have_val = !args.str("val").empty() && val_batches > 0;
    DataLoader val_loader;
    if (have_val) {
        val_loader = DataLoader(args.str("val"), B, T, dp.rank, world, false, seed, config.vocab_size, "--val");
        int64_t avail = val_loader.batches_in_shard(0);
        LLMC_CHECK(val_batches <= avail, "--val_batches %d: the first val shard holds only %lld batches of %dx%d",
                   val_batches, (long long)avail, B, T);
    }

    GPT model;
    if (tp > config.n_kv_head && tp % config.n_kv_head == 0) comm_make_kv_group(cm, tp / config.n_kv_head);
    model.offload = offload;
    const double in_use_before_model = device_bytes_in_use();
    gpt_allocate(model, config, B, T, zero_stage, &pipe, recompute, sp);
    int start_step = 0;
    Rng sample_rng(seed ^ 0x5A5A5A5Aull);
    if (!resume.empty()) {
        LLMC_CHECK(ck.n_params == model.n_params, "%s: checkpoint holds %llu parameters, the config needs %zu",
                   resume.c_str(), (unsigned long long)ck.n_params, model.n_params);
        const CheckpointFile file(resume, ck);  // each rank reads the table ranges it holds
        gpt_set_state(model, [&](size_t begin, size_t n, float* p, float* m, float* v) {
            file.read(0, begin, n, p);
            if (m) file.read(1, begin, n, m);
            if (v) file.read(2, begin, n, v);
        });
        start_step = (int)ck.get_int("step", resume);
        train_loader.reset({ck.get_int("loader.epoch", resume), ck.get_int("loader.shard", resume),
                            ck.get_int("loader.batch", resume)});
        sample_rng.state = (uint64_t)ck.get_int("rng.sample", resume);
        if (rank0) printf("resumed from %s at step %d\n", resume.c_str(), start_step);
        for (const std::string& change : checkpoint_run_changes(ck, settings))
            if (rank0) printf("note: resuming with %s\n", change.c_str());
    } else {
        if (!init_from.empty()) {
            gpt_load_llmc(model, init_file, init_from);
            if (rank0) printf("initialized from %s (llm.c GPT-2 model, %s)\n", init_from.c_str(),
                              init_file.version == LLMC_MODEL_VERSION_BF16 ? "bf16" : "fp32");
            init_file = LlmcModelFile();  // the weights are in the model now
        } else {
            gpt_init_params(model, seed);
        }
    }

    if (rank0) {
        printf("backend: %s", backend_name());
#ifdef _OPENMP
        printf(", %d OpenMP threads", omp_get_max_threads());
#endif
        printf("\nlayout: %d rank%s (pp %d x dp %d x tp %d%s, ep %d), ZeRO stage %d, recompute -r %d, offload %s, "
               "collectives: %s\n", cm.world_size, cm.world_size > 1 ? "s" : "", n_stages, world, tp, sp ? " + sp" : "", ep,
               zero_stage, recompute, offload_name(offload),
               comm_backend_name());
        printf("model: n_layer %d, n_embd %d, n_head %d, n_kv_head %d, ffn_hidden %d (%s), pos %s, vocab %d (padded %d)\n",
               config.n_layer, config.n_embd, config.n_head, config.n_kv_head, config.ffn_hidden,
               config.mlp == MLP_SWIGLU ? "swiglu" : "gelu", config.pos == POS_ALIBI ? "alibi" : "learned",
               config.vocab_size, config.padded_vocab_size);
        if (config.n_expert > 0) {
            printf("mixture of experts: %d experts of hidden %d in layers", config.n_expert, config.expert_hidden);
            for (int l = 0; l < config.n_layer; l++) if (config.is_moe(l)) printf(" %d", l);
            printf(", capacity factor %g (%d tokens per expert per micro-batch), routing group %s\n",
                   config.capacity_factor, config.moe_capacity(B, T),
                   config.moe_group == MOE_GROUP_BATCH ? "batch" : "position");
            printf("parameters: %zu, active per token %.0f\n", model.param_count, active_param_count(model, B, T));
        } else {
            printf("parameters: %zu\n", model.param_count);
        }
        printf("batch: B %d x T %d x %d ranks x %d accumulation steps = %lld tokens per step\n", B, T, world,
               grad_accum, (long long)total_batch);
        if (n_stages > 1) print_pipeline(plan_inputs);
        print_memory_plan(plan_inputs);
        print_data_memory(train_loader, have_val ? &val_loader : nullptr);
        printf("train: %zu shard(s)%s, val: %s\n", train_loader.shards.size(),
               first_shard.llmc_format ? " (llm.c GPT-2 format)" : "", have_val ? "yes" : "no");
        printf("tokenizer: %s\n", tokenizer.source.c_str());
    }

    JsonlLogger log;  // a resume trims the log back to its step (llmc/logger.h says why)
    if (rank0) log.open_for_run(out_dir + "/log.jsonl", resume.empty() ? -1 : start_step);
    std::vector<int> in((size_t)B * T), tgt((size_t)B * T), ds((size_t)B * T);

    // collective: every rank writes the table ranges of its own slices, streamed, rank 0 the header last
    auto save = [&](int step) {
        Checkpoint out;
        for (auto& [name, field] : config_fields(config)) out.set_int(std::string("config.") + name, *field);
        out.set_float("config.capacity_factor", config.capacity_factor);
        out.set_int("train.batch_size", B);
        out.set_int("train.seq_len", T);
        out.set_int("train.total_batch_tokens", total_batch);
        out.set_int("train.seed", (int64_t)seed);
        out.set_int("step", step);
        out.set_int("loader.epoch", train_loader.state.epoch);
        out.set_int("loader.shard", train_loader.state.shard);
        out.set_int("loader.batch", train_loader.state.batch);
        out.set_int("rng.sample", (int64_t)sample_rng.state);
        for (const CheckpointField& f : settings) out.fields.push_back(f);
        const std::string path = checkpoint_path(out_dir, step);
        CheckpointWriter writer(cm.world, path, out, model.n_params);
        gpt_write_state(model, writer, step);  // refuses a non-finite state (each rank checks its slices)
        writer.finish();
        if (rank0) printf("saved %s\n", path.c_str());
    };

    const double peak = peak_flops_per_s();
    // the step's micro-batches, read before the pipeline runs them (stages need them at different times)
    std::vector<std::vector<int>> step_in(grad_accum, in), step_tgt(grad_accum, tgt), step_ds(grad_accum, ds);
    std::vector<MicroBatch> step_batches(grad_accum);
    const std::string pp_trace = args.str("pp_trace");
    // NaN/Inf policy: a step whose loss or gradient norm is not finite is skipped (no optimizer
    // update), counted and logged; max_bad_steps of them in a row stop the run (exit 1): it has
    // diverged, and the state is still the last good one (no checkpoint of a bad state is written).
    int bad_in_a_row = 0, bad_total = 0;
    LossOutlierDetector loss_spikes;  // z-score of the loss against the recent window (llmc/outlier.h)
    const auto run_t0 = std::chrono::steady_clock::now();  // elapsed and ETA of the step line
    for (int step = start_step; step < max_steps; step++) {
        auto t0 = std::chrono::steady_clock::now();
        comm_begin_step(cm, step + 1);
        comm_reset_counters(cm);
        if (const char* f = getenv("LLMC_FAULT_FAIL_RANK"))  // fault injection for the tests
            LLMC_CHECK(atoi(f) != cm.world_rank || step != start_step + 1, "fault injected on rank %d at step %d",
                       cm.world_rank, step + 1);
        gpt_zero_grad(model);
        double flops = 0;
        for (int micro = 0; micro < grad_accum; micro++) {
            train_loader.next_batch(step_in[micro].data(), step_tgt[micro].data(), step_ds[micro].data());
            step_batches[micro] = {step_in[micro].data(), step_tgt[micro].data(), step_ds[micro].data()};
            flops += step_flops(model, step_ds[micro].data(), B, T, 1) / (n_stages * tp);  // this rank's share
        }
        const bool tracing = !pp_trace.empty() && step == start_step;
        std::vector<PipeEvent> trace;
        if (tracing) barrier(cm.world);  // one time origin for every rank's timeline
        const PipeTimes pt = gpt_pipeline_step(model, step_batches, B, T, 1.0f / global_micro, tracing || host_timing_is_exact,
                                               tracing ? &trace : nullptr);
        if (tracing) write_pipeline_trace(pp_trace, trace, model.pipe);
        const double loss = sum_in_global_order(model.mb_loss, global_micro) / global_micro;
        float lr = sched.at(step);
        const float norm = gpt_grad_norm(model);
        const bool bad_step = !std::isfinite(loss) || !std::isfinite(norm);
        if (!bad_step) gpt_apply_update(model, opt, lr, step, norm);
        bad_in_a_row = bad_step ? bad_in_a_row + 1 : 0;
        bad_total += bad_step;
        const double loss_z = loss_spikes.update(loss);
        backend_sync();
        double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (rank0 && step == start_step && cm.world_size > 1) print_comm_volume(model, grad_accum);
        if (rank0 && step == start_step) {
            const MemoryEstimate e = gpt_memory_estimate(config, B, T, zero_stage, &pipe, recompute, 0, sizeof(floatX), 0, sp, 0, offload);
            printf("memory after step %d, rank 0: %s (plan: %.2f MiB of buffers)", step + 1, measured_memory(in_use_before_model).c_str(),
                   e.buffers() / 1048576.0);
            if (offload == OFFLOAD_OPTIMIZER)
                printf("; host arenas %.2f MiB (plan: %.2f MiB)", host_bytes_allocated() / 1048576.0,
                       e.host_arenas() / 1048576.0);
            printf("\n");
        }
        // the pipeline's idle fraction per stage: time waiting in transfers over the step
        std::vector<double> idle;
        if (n_stages > 1) idle = host_gather_all<double>(cm.pp, pt.total_ms > 0 ? pt.wait_ms / pt.total_ms : 0.0);
        double tok_s = total_batch / (ms / 1000.0);
        double mfu = peak > 0 ? flops / (ms / 1000.0) / peak : -1;  // per GPU: this rank's FLOPs
        MoeStats st;
        if (config.n_expert > 0) st = gpt_moe_stats(model);  // rank 0's last micro-batch
        if (rank0) {
            char mfu_text[32] = "n/a";
            if (mfu >= 0) snprintf(mfu_text, sizeof(mfu_text), "%.1f%%", 100 * mfu);
            printf("step %5d/%d | loss %.4f | norm %.4f | lr %.2e | %.1f ms | %.0f tok/s | MFU %s", step + 1, max_steps,
                   loss, norm, lr, ms, tok_s, mfu_text);
            // ETA from the mean wall time per step so far, evaluations and samples included
            const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_t0).count();
            const double eta = elapsed / (step + 1 - start_step) * (max_steps - step - 1);
            printf(" | %s elapsed, ETA %s", format_duration(elapsed).c_str(), format_duration(eta).c_str());
            if (std::isfinite(loss_z)) printf(" | z %+.1f%s", loss_z, loss_z > 5 ? " (loss spike)" : "");
            if (bad_step)
                printf(" | SKIPPED: non-finite loss or grad norm, no update (%d in a row, stop at %d)", bad_in_a_row,
                       max_bad_steps);
            std::vector<std::pair<const char*, double>> fields = {
                {"step", step + 1}, {"loss", loss}, {"grad_norm", norm}, {"lr", lr}, {"ms", ms}, {"tok_s", tok_s},
                {"loss_z", loss_z}, {"tokens", (double)(step + 1) * total_batch}, {"elapsed_s", elapsed}};
            if (mfu >= 0) fields.push_back({"mfu", mfu});
            if (bad_step) fields.insert(fields.end(), {{"skipped", 1}, {"bad_steps", (double)bad_total}});
            if (config.n_expert > 0) {
                printf(" | tokens by 0/1/2+ experts %.0f/%.0f/%.0f%% | expert load %d..%d", 100 * st.frac[0],
                       100 * st.frac[1], 100 * st.frac[2], st.load_min, st.load_max);
                fields.insert(fields.end(), {{"moe_frac_0", st.frac[0]}, {"moe_frac_1", st.frac[1]},
                                             {"moe_frac_2plus", st.frac[2]}, {"moe_load_min", (double)st.load_min},
                                             {"moe_load_max", (double)st.load_max}});
            }
            if (n_stages > 1 && host_timing_is_exact) {
                printf(" | idle");
                static const char* names[] = {"pp_idle_0", "pp_idle_1", "pp_idle_2", "pp_idle_3",
                                              "pp_idle_4", "pp_idle_5", "pp_idle_6", "pp_idle_7"};
                for (int s = 0; s < n_stages; s++) {
                    printf("%s%.0f%%", s ? "/" : " ", 100 * idle[s]);
                    if (s < 8) fields.push_back({names[s], idle[s]});
                }
            }
            if (cm.world_size > 1)
                printf(" | pp %d dp %d tp %d%s ep %d z%d", n_stages, world, tp, sp ? "+sp" : "", ep, zero_stage);
            printf("\n");
            fflush(stdout);
            log.write(fields);
        }
        LLMC_CHECK(bad_in_a_row < max_bad_steps,
                   "step %d: %d consecutive steps had a non-finite loss or gradient norm (--max_bad_steps %d): the run "
                   "diverged. Those steps were skipped and no checkpoint of a bad state was written; lower --lr (or "
                   "raise --warmup, or lower --grad_clip) and resume from the last checkpoint in %s",
                   step + 1, bad_in_a_row, max_bad_steps, out_dir.c_str());

        const bool last = step + 1 == max_steps;
        if (have_val && ((val_every > 0 && (step + 1) % val_every == 0) || last)) {
            double val_loss = evaluate(model, val_loader, val_batches, in, tgt, ds);
            if (rank0) {
                printf("step %5d/%d | val loss %.4f\n", step + 1, max_steps, val_loss);
                log.write({{"step", step + 1}, {"val_loss", val_loss}});
            }
        }
        if ((sample_every > 0 && (step + 1) % sample_every == 0) || (last && sample_len > 0))
            print_sample(model, sample_len, temperature, top_k, tokenizer, sample_rng);
        int stop_sig = 0, stop_rank = 0;  // a signal on any rank stops every rank after this step
        const bool stopping = !last && stop_agreed(cm.world, stop_sig, stop_rank);
        if (rank0 && stopping)
            printf("%s on rank %d: stopping after step %d\n", strsignal(stop_sig), stop_rank, step + 1);
        if ((ckpt_every > 0 && (step + 1) % ckpt_every == 0) || ((last || stopping) && ckpt_every >= 0)) {
            // not in the middle of a bad streak: --resume latest should land before the trouble began
            if (bad_in_a_row == 0) save(step + 1);
            else printf("checkpoint at step %d not written: the step was skipped as non-finite\n", step + 1);
        }
        comm_end_step(cm);
        if (stopping) {
            if (rank0) printf("stopped by signal at step %d; continue with --resume latest%s\n", step + 1,
                              ckpt_every < 0 ? " (--ckpt_every -1: no checkpoint was written)" : "");
            return STOP_EXIT_CODE;
        }
    }
    if (!export_llmc.empty()) {
        gpt_export_llmc(model, export_llmc, export_dtype == "bf16");
        if (rank0) printf("wrote %s (llm.c GPT-2 model, %s)\n", export_llmc.c_str(), export_dtype.c_str());
    }
    if (world > 1 && !model.zero.params_sharded()) {
        // replicated params must be bitwise the same on every rank that holds them: the dense
        // segments on the dp group, the experts on the expert-dp group
        const ZeroLayout& z = model.zero;
        std::vector<floatX> p(staging_cap(model));  // each segment's hash streams through one chunk
        uint64_t h[2] = {0, 0};
        for (const Segment& seg : z.segs) {
            uint64_t seg_hash = ckpt_hash_bytes(nullptr, 0);
            for (size_t a = 0; a < seg.padded; a += p.size()) {
                const size_t n = std::min(p.size(), seg.padded - a);
                copy_from_buffer(p.data(), model.params + seg.padded_offset + a, n * sizeof(floatX));
                seg_hash = ckpt_hash_bytes((const unsigned char*)p.data(), n * sizeof(floatX), seg_hash);
            }
            h[seg.expert] += seg_hash;
        }
        for (int e = 0; e < 2; e++)
            for (uint64_t other : host_gather_all<uint64_t>(e ? cm.edp : dp, h[e]))
                LLMC_CHECK(other == h[e], "rank %d: %s parameters differ between ranks at the end (hash %016llx vs %016llx)",
                           dp.rank, e ? "expert" : "dense", (unsigned long long)h[e], (unsigned long long)other);
        if (rank0) printf("params identical on all %d ranks (hash %016llx; experts on the ranks that hold them)\n", world, (unsigned long long)h[0]);
    }
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
        // SIGINT / SIGTERM: stop after the step with a checkpoint (llmc/run_stop.h); installed until
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
