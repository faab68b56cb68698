// A chapter of train_gpt.cu (included once, there): the backend. Which op implementations the
// build runs (the CPU references of llmc/ops/cpu/ or the CUDA kernels of llmc/ops/*.cuh, same signatures)
// and where its buffers live (host memory, or device memory and pinned host memory): floatX, the
// buffer allocation and copies, the sync, the memory the run can use.

// ------------------------------------------------------------------------------------------------
// The GPUs this engine knows, in one table: --plan --device NAME plans the CUDA build on one of them
// from any machine (driver.h print_plan_only), and the CUDA build finds its own card here for MFU
// (peak_flops_per_s). Every figure is nominal, not read from a device:
//   total_mib    the card's memory as nvidia-smi prints it ("Total", MiB) for the usual variant (SXM
//                for the V100 / A100, ECC as shipped); it sizes the lm head's default token chunk
//                (llmc/gpt/layout.h logits_chunk_tokens reads the total, as run_device_total_bytes does
//                on a GPU). A card with ECC switched on, or another board of the same chip, reports a
//                little less.
//   free_gib     what cudaMemGetInfo reports free once the CUDA context exists: the memory a plan's
//                buffers and the headroom (llmc/ops/op_scratch.h) must fit. Measured on the H100 and
//                H200 (free_measured); elsewhere estimated as the total less 0.55 GiB for the context
//                (what the two measured cards lose, 0.55 and 0.60 GiB), rounded down to 0.1 GiB. A
//                GeForce card that also drives a display has less.
//   sms          streaming multiprocessors: the plan's op scratch (layernorm partials per SM) and the
//                split-K choice of the dense weight gradients (dense_dweight_split) depend on them
//   smem_optin   the most shared memory one block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin):
//                the attention kernels' tiles are chosen from it (llmc/ops/attention.cuh)
//   bf16         whether the tensor cores take bf16 (sm_80 and later); without it the card runs the
//                fp16 build (T4: make train_gpt PRECISION=fp16 GPU_ARCH=sm_75, with loss scaling; the
//                same 2-byte params and activations, so the same plan); the V100 runs neither
//   peak_tflops  the vendor datasheet's dense 16-bit tensor-core peak with fp32 accumulation (no
//                sparsity), the MFU denominator: the A100 / H100 / H200 SXM bf16 figures, the GeForce
//                cards' "FP16 tensor with FP32 accumulate" (half their fp16-accumulate rate), fp16 on
//                the T4 and V100 (no bf16)
//   match        a word of cudaDeviceProp.name that, with the compute capability and the SM count,
//                identifies the card on a GPU (driver-reported names: "NVIDIA A100-SXM4-80GB",
//                "NVIDIA GeForce RTX 4090", "NVIDIA RTX A6000", "NVIDIA L4", "Tesla T4", ...)
struct GpuCard {
    const char* name;         // --device NAME
    const char* description;  // what the plan calls it
    double total_mib;
    double free_gib;
    bool free_measured;
    int sms;
    int smem_optin_kib;
    int cc_major, cc_minor;
    bool bf16;
    double peak_tflops;
    const char* match;
    double total_bytes() const { return total_mib * 1048576.0; }
    double free_bytes() const { return free_gib * 1073741824.0; }
};
static const GpuCard GPU_CARDS[] = {
    // name      description                    total MiB  free GiB  meas.  SMs smem KiB  cc     bf16   TFLOP/s  match
    {"t4",       "a T4 16GB",                   15360,     14.4,     false,  40,  64,      7, 5, false,  65.0,    "T4"},
    {"v100-16",  "a V100 16GB",                 16160,     15.2,     false,  80,  96,      7, 0, false,  125.0,   "V100"},
    {"v100-32",  "a V100 32GB",                 32510,     31.1,     false,  80,  96,      7, 0, false,  125.0,   "V100"},
    {"a100-40",  "an A100 40GB",                40960,     39.4,     false, 108, 163,      8, 0, true,   312.0,   "A100"},
    {"a100-80",  "an A100 80GB",                81920,     79.4,     false, 108, 163,      8, 0, true,   312.0,   "A100"},
    {"l4",       "an L4 24GB",                  23034,     21.9,     false,  58,  99,      8, 9, true,   121.0,   "L4"},
    {"rtx3090",  "an RTX 3090 24GB",            24576,     23.4,     false,  82,  99,      8, 6, true,   71.0,    "3090"},
    {"rtx4090",  "an RTX 4090 24GB",            24564,     23.4,     false, 128,  99,      8, 9, true,   165.2,   "4090"},
    {"a6000",    "an RTX A6000 48GB",           49140,     47.4,     false,  84,  99,      8, 6, true,   154.8,   "A6000"},
    {"h100",     "an H100 80GB",                81559,     79.1,     true,  132, 227,      9, 0, true,   989.4,   "H100"},
    {"h200",     "an H200",                     143771,    139.8,    true,  132, 227,      9, 0, true,   989.4,   "H200"},
};
// the card --device names; an unknown name is refused with the accepted list
static const GpuCard& gpu_card(const std::string& name) {
    std::string names;
    for (const GpuCard& c : GPU_CARDS) {
        if (name == c.name) return c;
        names += std::string(names.empty() ? "" : ", ") + c.name;
    }
    LLMC_FAIL("--device: expected one of %s, got '%s'", names.c_str(), name.c_str());
}
// The table's card a GPU is (nullptr: none): the compute capability, the name's word (not followed
// by a letter or digit, so "L4" is not the L40S, "A100" not an A1000) and the SM count all agree.
// The SM count keeps out the boards of a chip that run fewer SMs at other clocks (the H100 PCIe's
// 114, the RTX 4090 D's 114), whose peak the table does not hold: no MFU rather than a wrong one. A
// MIG slice (its name says "MIG") runs a share of the card's SMs at the card's clocks: it is the card,
// and its peak that share of the card's (gpu_peak_flops).
inline const GpuCard* identify_gpu_card(const char* device_name, int cc_major, int cc_minor, int sms) {
    const std::string n = device_name;
    const bool mig = n.find("MIG") != std::string::npos;
    for (const GpuCard& c : GPU_CARDS) {
        if (c.cc_major != cc_major || c.cc_minor != cc_minor) continue;
        if (sms != c.sms && !(mig && sms < c.sms)) continue;
        for (size_t at = n.find(c.match); at != std::string::npos; at = n.find(c.match, at + 1)) {
            const size_t end = at + strlen(c.match);
            if (end == n.size() || !isalnum((unsigned char)n[end])) return &c;
        }
    }
    return nullptr;
}
// the dense 16-bit peak of a GPU (0: not in the table, no MFU); sms below the card's: a MIG slice
inline double gpu_peak_flops(const char* device_name, int cc_major, int cc_minor, int sms) {
    const GpuCard* c = identify_gpu_card(device_name, cc_major, cc_minor, sms);
    return c ? c->peak_tflops * 1e12 * std::min(1.0, (double)sms / c->sms) : 0.0;
}
// --plan --device NAME plans for the named card's SMs (plan_sm_count), not this machine's: set for
// the plan alone, then restored, because the CPU build's training also reads plan_sm_count (the
// split-K choice of the dense weight gradients, which the layouts must share)
static int& planned_card_sms() {
    static int n = 0;  // 0: no card named
    return n;
}
struct PlanCardScope {
    int was;
    explicit PlanCardScope(int sms) : was(planned_card_sms()) { planned_card_sms() = sms; }
    ~PlanCardScope() { planned_card_sms() = was; }
};

#ifdef LLMC_CPU
#include "llmc/ops/cpu/encoder.h"
#include "llmc/ops/cpu/layernorm.h"
#include "llmc/ops/cpu/rmsnorm.h"
#include "llmc/ops/cpu/rope.h"
#include "llmc/ops/cpu/matmul.h"
#include "llmc/ops/cpu/attention.h"
#include "llmc/ops/cpu/mlp.h"
#include "llmc/ops/cpu/classifier.h"
#include "llmc/ops/cpu/adamw.h"
#include "llmc/ops/cpu/global_norm.h"
#include "llmc/ops/cpu/moe.h"
#include "llmc/ops/cpu/accumulate.h"
using namespace cpu;
typedef float floatX;  // the element type of params, grads and activations
static const char* backend_name() { return "cpu (fp32 reference)"; }
// The OpenMP threads of one rank. Without OMP_NUM_THREADS every rank would start one thread per
// core, so N ranks on a node would run N threads per core; instead each of the node's local_ranks
// takes its share of the node's cores (as torchrun does), at least one, at most what its affinity
// mask allows. Returns what was done, for the start-up report ("" where nothing was changed).
static std::string backend_share_cores(int local_ranks) {
#ifdef _OPENMP
    if (getenv("OMP_NUM_THREADS") || local_ranks <= 1) return "";
    const int cores = (int)sysconf(_SC_NPROCESSORS_ONLN);
    const int threads = std::max(1, std::min(omp_get_num_procs(), cores / local_ranks));
    omp_set_num_threads(threads);
    return strfmt("the node's %d cores shared by its %d ranks; OMP_NUM_THREADS overrides", cores, local_ranks);
#else
    (void)local_ranks;
    return "";
#endif
}
// --offload optimizer's copies (llmc/parallel/offload.h): the "device" is host memory
using OffloadCopies = HostOffloadCopies;
// the gradient norm's sums (llmc/parallel/zero.h): fixed chunks, each a loop in double (bitwise the
// unsharded norm in every layout)
static constexpr bool norm_per_chunk = true;
static void add_squares(double& sum, const float* p, size_t n) {
    for (size_t i = 0; i < n; i++) sum += (double)p[i] * p[i];
}
static void squares_of(double* sums, const float* const* p, const size_t* n, int count) {
    cpu::global_norm_squared_ranges(sums, p, n, count);
}
static double peak_flops_per_s() { return 0; }  // unknown for a CPU: no MFU
static std::string attention_summary(int) { return ""; }  // one attention implementation on the CPU
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
// the host -> buffer copy of data the caller may reuse at once (what the GPU build queues)
static void copy_to_buffer_async(void* dst, const void* src, size_t bytes) { memcpy(dst, src, bytes); }
// buffer -> host: where the bytes are (here at once; the GPU build's after a host sync, download_wait)
static std::vector<char>& download_area() {
    static std::vector<char> area;
    return area;
}
static const void* download_async(const void* src, size_t bytes) {
    download_area().assign((const char*)src, (const char*)src + bytes);
    return download_area().data();
}
static void download_wait() {}
// the GPU build's launches and host syncs (llmc/ops/cuda_common.cuh); none here
struct BackendCounts {
    uint64_t launches = 0, host_syncs = 0;
};
static constexpr bool backend_counts_work = false;
static BackendCounts backend_counts() { return {}; }
// the ops' scratch and the matmul workspace: the CPU ops need none (their arena is empty)
static void backend_bind_scratch(void*, size_t) {}
// the SM count that the plan of a GPU's op scratch and split-K choices assumes (llmc/ops/op_scratch.h):
// the card --plan --device names, else an H100 / H200 SXM's 132 (the CPU runs and tests choose as on it)
static int plan_sm_count() { return planned_card_sms() > 0 ? planned_card_sms() : gpu_card("h100").sms; }
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
// The CUDA build: floatX (bf16; fp16 with -DLLMC_FP16) params, grads and activations, fp32 master weights and Adam moments, fp32
// statistics. The ops (llmc/ops/<op>.cuh) have the signatures of their CPU twins.
#include "llmc/ops/cuda_common.cuh"
#include "llmc/ops/encoder.cuh"
#include "llmc/ops/layernorm.cuh"
#include "llmc/ops/rmsnorm.cuh"
#include "llmc/ops/rope.cuh"
#include "llmc/ops/matmul.cuh"
#include "llmc/ops/attention.cuh"
#include "llmc/ops/mlp.cuh"
#include "llmc/ops/classifier.cuh"
#include "llmc/ops/adamw.cuh"
#include "llmc/ops/global_norm.cuh"
#include "llmc/ops/cpu/moe.h"  // for moe_capacity (host arithmetic)
#include "llmc/ops/cpu/rope.h"  // RopeSpec and the cos / sin table (host arithmetic)
#include "llmc/ops/moe.cuh"
#include "llmc/ops/accumulate.cuh"
static const char* backend_name() {
    static char name[320];
    cudaDeviceProp p;
    cudaCheck(cudaGetDeviceProperties(&p, 0));
#ifndef LLMC_FP16
    LLMC_CHECK(p.major >= 8, "%s (sm_%d%d) has no bf16: this is the bf16 build; build the fp16 one for it (make train_gpt "
               "PRECISION=fp16 GPU_ARCH=sm_%d%d)", p.name, p.major, p.minor, p.major, p.minor);
#endif
    snprintf(name, sizeof(name), "cuda on %s (sm_%d%d), %s with fp32 master weights%s", p.name, p.major, p.minor,
             LLMC_PRECISION,
#ifdef LLMC_FP16
             " and loss scaling"
#else
             ""
#endif
    );
    return name;
}
// which attention kernels and shared-memory variants this card runs (chosen from its limits at run
// time, llmc/ops/attention.cuh): the start-up says it, so no card silently takes a slower path
static std::string attention_summary(int hs) { return attention_kernels_summary(hs); }
// the card's dense 16-bit tensor-core peak (GPU_CARDS), for MFU; 0 (no MFU) where the table does not
// know the card
static double peak_flops_per_s() {
    cudaDeviceProp p;
    cudaCheck(cudaGetDeviceProperties(&p, 0));
    return gpu_peak_flops(p.name, p.major, p.minor, p.multiProcessorCount);
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
// The upload ring: pinned host memory that copy_to_buffer_async stages host data in, so that the
// copy is queued and the host goes on at once (the caller may reuse its memory: the bytes are in
// the ring). Bytes are taken in order; after a host sync every queued copy is done and the ring
// starts over. A copy that does not fit waits for the queued ones (a host sync) and, if the ring
// is still too small, grows it: only in the first step, whose uploads size it (the trainer's
// micro-batches: tokens, targets, document starts); later steps take no sync here.
struct UploadRing {
    char* host = nullptr;
    size_t capacity = 0, used = 0;
    uint64_t synced_at = 0;  // gpu_counters().stream_syncs when `used` was last valid
};
static UploadRing& upload_ring() {
    static UploadRing r;
    return r;
}
static void copy_to_buffer_async(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return;
    UploadRing& r = upload_ring();
    const size_t aligned = (bytes + 255) & ~(size_t)255;
    if (r.synced_at != gpu_counters().stream_syncs) r.used = 0;  // a sync since: all its copies are done
    if (r.used + aligned > r.capacity) {
        if (r.used > 0) llmc_stream_sync();
        r.used = 0;
        if (aligned > r.capacity) {
            if (r.host) cudaCheck(cudaFreeHost(r.host));
            r.capacity = std::max(aligned, 2 * r.capacity);
            cudaCheck(cudaMallocHost(&r.host, r.capacity));
        }
    }
    memcpy(r.host + r.used, src, bytes);
    cudaCheck(cudaMemcpyAsync(dst, r.host + r.used, bytes, cudaMemcpyHostToDevice, llmc_stream()));
    r.used += aligned;
    r.synced_at = gpu_counters().stream_syncs;
}
static void copy_to_buffer(void* dst, const void* src, size_t bytes) {
    cudaCheck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, llmc_stream()));
    llmc_stream_sync();  // src is pageable host memory the caller may reuse
}
// The download area: pinned host memory that download_async queues one copy of a buffer into (the
// losses of the step), there once the stream has been synced (download_wait syncs only if it has
// not been since). One download at a time; grown on demand.
struct DownloadArea {
    char* host = nullptr;
    size_t capacity = 0;
    uint64_t queued_at = 0;  // gpu_counters().stream_syncs when the copy was queued
};
static DownloadArea& download_area() {
    static DownloadArea a;
    return a;
}
static const void* download_async(const void* src, size_t bytes) {
    DownloadArea& a = download_area();
    if (bytes > a.capacity) {
        llmc_stream_sync();  // (a copy into the old area may be queued)
        if (a.host) cudaCheck(cudaFreeHost(a.host));
        a.capacity = std::max(bytes, 2 * a.capacity);
        cudaCheck(cudaMallocHost(&a.host, a.capacity));
    }
    cudaCheck(cudaMemcpyAsync(a.host, src, bytes, cudaMemcpyDeviceToHost, llmc_stream()));
    a.queued_at = gpu_counters().stream_syncs;
    return a.host;
}
static void download_wait() {
    if (download_area().queued_at == gpu_counters().stream_syncs) llmc_stream_sync();
}
static void copy_from_buffer(void* dst, const void* src, size_t bytes) {
    cudaCheck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, llmc_stream()));
    llmc_stream_sync();
}
static void copy_buffer(void* dst, const void* src, size_t bytes) {
    cudaCheck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, llmc_stream()));
}
static void copy_buffer_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width_bytes, size_t rows) {
    if (rows == 0 || width_bytes == 0) return;
    cudaCheck(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width_bytes, rows, cudaMemcpyDeviceToDevice, llmc_stream()));
}
// the step time includes everything queued on the GPU
static void backend_sync() { llmc_stream_sync(); }
// launches and host syncs so far (llmc/ops/cuda_common.cuh's counters; the trainer takes differences)
struct BackendCounts {
    uint64_t launches = 0, host_syncs = 0;
};
static constexpr bool backend_counts_work = true;
static BackendCounts backend_counts() { return {gpu_counters().launches, gpu_counters().host_syncs}; }
// kernels are queued: the host clock sees their time only after a sync, which would cost the overlap
// of host and device; the pipeline is timed (with syncs) only for --pp_trace
static constexpr bool host_timing_is_exact = false;
// The ops' scratch (cuda_scratch) and the cuBLASLt workspace from the model's MEM_SCRATCH arena
// (llmc/ops/op_scratch.h: the workspace first, then the scratch); nullptr: the ops' own again.
static void backend_bind_scratch(void* arena, size_t bytes) {
    matmul_bind_workspace(arena);
    if (arena) matmul_setup();  // the handle (a workspace is bound: nothing is allocated)
    cuda_scratch_bind(arena ? (char*)arena + MATMUL_WORKSPACE_BYTES : nullptr,
                      arena ? bytes - MATMUL_WORKSPACE_BYTES : 0);
}
// the SM count the plan assumes: the card --plan --device names, else this GPU's
static int plan_sm_count() { return planned_card_sms() > 0 ? planned_card_sms() : sm_count(); }
// the host threads (OpenMP: the offloaded AdamW step) are left as OMP_NUM_THREADS or the runtime sets them
static std::string backend_share_cores(int) { return ""; }
// --offload optimizer's copies (llmc/parallel/offload.h): side streams, an event per piece
using OffloadCopies = CudaOffloadCopies;
// the gradient norm's sums (llmc/parallel/zero.h): each rank's slice of a segment one range, all the
// rank's ranges in one batch (llmc/ops/global_norm.cuh: a few launches, one host sync)
static constexpr bool norm_per_chunk = false;
static void add_squares(double& sum, const float* p, size_t n) { sum += global_norm_squared(p, n); }
static void squares_of(double* sums, const float* const* p, const size_t* n, int count) {
    global_norm_squared_ranges(sums, p, n, count);
}
#endif
