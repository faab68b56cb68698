// ZeRO-Offload of the optimizer (Ren et al. 2021), `--offload optimizer`: the fp32 master weights
// and the AdamW moments of what this rank updates (its ZeRO shard at -z >= 1, everything at -z 0)
// live in host memory (the MEM_HOST_* arenas of llmc/memory.h; pinned, cudaMallocHost, in the CUDA
// build) and the AdamW step runs on the CPU. The device keeps the params (bf16 in the CUDA build),
// the gradients and the activations. One optimizer step (offload_adamw_step):
//
//   1. the fp32 accumulated gradient of every update piece (llmc/parallel/zero.h: UpdatePiece, a run of one
//      tensor inside the rank's shard) is copied device -> host into the staging buffer (the state
//      space: piece k at its state_index), on a side stream, every piece queued at once with an
//      event after each;
//   2. piece by piece, as its gradient arrives: cpu::adamw_update (llmc/ops/cpu/adamw.h, the CPU
//      reference: OpenMP, a vectorisable loop; the one AdamW of the project) on the host master
//      and moments; then the new master rounded to the params' type, written over the piece's own
//      staging (its gradient is spent, and a bf16 takes half of an fp32's bytes);
//   3. that piece's rounded params copied host -> device on a second side stream (the copy
//      engines of the two directions run at once), into params at param_index;
//   4. the main stream waits for the last upload (the -z 1/2 all-gathers and the next step follow).
// So the download of pieces k+1.., the CPU step of piece k and the upload of piece k-1 overlap.
// And the downloads start earlier where they can: a segment's accumulated gradient is final after
// the step's last micro-batch has been reduced into it (grads_ready in train_gpt.cu), so there its
// pieces are queued at once (offload_download_early), under the backward of the segments before it;
// step 1 then only waits for them. Not the embedding's (the tied lm head's gradient is added to it
// after the backward), nor a segment that ZeRO stage 0 replicates over several ranks (its other
// ranks' parts arrive with the all-gather before the norm).
//
// What could overlap too and does not (yet): (a) the CPU step itself cannot start before the global
// norm (the clipping scale) is known without changing the math; (b) ZeRO-Offload's one-step delayed
// parameter update runs the CPU step under the next step's forward and backward, i.e. trains on
// one-step-stale weights: other math, so not here; (c) at -z 3 a segment's upload could feed the
// next forward's gather directly.
//
// Exactness. The CPU build runs this same orchestration with both arenas in host memory: the copies
// are memcpy, the rounding of fp32 params is the identity, and a host copy of the fp32 params is
// the master (so the CPU build with offload holds 4 more bytes per updated element, in the host
// arena). cpu::adamw_update is the function the CPU build's own step calls: the results (losses,
// checkpoints) are bitwise those without offload (test_hardening.cpp, test/test_dist.sh).
// The CUDA build: the kernel (llmc/ops/adamw.cuh) spells every fp32 op of the CPU twin as the same
// round-to-nearest op in the twin's order, and nvcc's host compiler (no -march: no FMA contraction)
// evaluates the twin as written, so master, m and v come out as the kernel's bits, except where a
// value is denormal (the kernel is built with --use_fast_math, whose -ftz flushes denormals to
// zero; the host keeps them; a denormal m or v moves the update far below the master's precision).
// The bf16 rounding is the kernel's stochastic rounding, bit for bit: element i of a piece draws
// adamw_random_bits(step_seed + table_offset, i) through the same host/device functions
// (llmc_hash, stochastic_round_floatX in llmc/ops/cuda_common.cuh).
//
// Host threads: the CPU step uses the OpenMP threads; with several ranks per node give each rank its
// share of the cores (OMP_NUM_THREADS = cores / ranks per node).
//
// Backend-independent: the copies are a type the step is given (HostOffloadCopies where the
// "device" is host memory; CudaOffloadCopies, under nvcc, with side streams), the params' type a
// template parameter.
#ifndef LLMC_OFFLOAD_H
#define LLMC_OFFLOAD_H
#include <cstring>
#include <string>
#include <vector>
#include "llmc/ops/cpu/adamw.h"
#include "llmc/utils.h"
#include "llmc/parallel/zero.h"
#ifdef __CUDACC__
#include "llmc/ops/adamw.cuh"  // adamw_random_bits: the kernel's stochastic-rounding bits (and cuda_common.cuh)
#endif

enum OffloadKind { OFFLOAD_NONE = 0, OFFLOAD_OPTIMIZER = 1 };
inline int parse_offload(const std::string& s) {
    if (s == "none") return OFFLOAD_NONE;
    if (s == "optimizer") return OFFLOAD_OPTIMIZER;
    LLMC_FAIL("--offload: expected none or optimizer, got '%s'", s.c_str());
}
inline const char* offload_name(int kind) { return kind == OFFLOAD_OPTIMIZER ? "optimizer" : "none"; }

// The copies of one offloaded step: device -> host of the gradients, host -> device of the params.
struct HostOffloadCopies {  // the "device" is host memory: plain copies, nothing to wait for
    void prepare(size_t) {}
    void after_main_stream(bool) {}
    void begin(size_t) {}
    void download(size_t, void* host, const void* dev, size_t bytes) { memcpy(host, dev, bytes); }
    void wait_download(size_t) {}
    void upload(void* dev, const void* host, size_t bytes) { memcpy(dev, host, bytes); }
    void finish() {}
};
#ifdef __CUDACC__
struct CudaOffloadCopies {  // two side streams (one per copy direction) and an event per piece
    cudaStream_t down = nullptr, up = nullptr;
    cudaEvent_t grads_final = nullptr, uploaded = nullptr;
    std::vector<cudaEvent_t> downloaded;
    void prepare(size_t pieces) {
        if (!down) {
            cudaCheck(cudaStreamCreateWithFlags(&down, cudaStreamNonBlocking));
            cudaCheck(cudaStreamCreateWithFlags(&up, cudaStreamNonBlocking));
            cudaCheck(cudaEventCreateWithFlags(&grads_final, cudaEventDisableTiming));
            cudaCheck(cudaEventCreateWithFlags(&uploaded, cudaEventDisableTiming));
        }
        while (downloaded.size() < pieces) {
            cudaEvent_t e;
            cudaCheck(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
            downloaded.push_back(e);
        }
    }
    // the side streams go on after everything queued on the main stream so far: the gradients are
    // final there, and the main stream waited for the previous step's uploads (finish), so the
    // staging buffer is free again
    void after_main_stream(bool both) {
        cudaCheck(cudaEventRecord(grads_final, llmc_stream()));
        cudaCheck(cudaStreamWaitEvent(down, grads_final, 0));
        if (both) cudaCheck(cudaStreamWaitEvent(up, grads_final, 0));
    }
    void begin(size_t pieces) {
        prepare(pieces);
        after_main_stream(true);
    }

    void download(size_t k, void* host, const void* dev, size_t bytes) {
        cudaCheck(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, down));
        cudaCheck(cudaEventRecord(downloaded[k], down));
    }
    void wait_download(size_t k) {  // (a host sync, counted)
        gpu_counters().host_syncs++;
        cudaCheck(cudaEventSynchronize(downloaded[k]));
    }
    void upload(void* dev, const void* host, size_t bytes) {
        cudaCheck(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, up));
    }
    void finish() {  // the main stream's next work (all-gathers, the next forward) sees the new params
        cudaCheck(cudaEventRecord(uploaded, up));
        cudaCheck(cudaStreamWaitEvent(llmc_stream(), uploaded, 0));
    }
};
#endif
template <typename Copies>
inline Copies& offload_copies() {
    static Copies c;  // the streams and events live as long as the process
    return c;
}
// early[k]: piece k's gradient download is queued already (offload_download_early)
inline std::vector<char>& offload_early() {
    static std::vector<char> early;
    return early;
}
// At the start of a step: no download is queued.
inline void offload_early_reset(size_t pieces) { offload_early().assign(pieces, 0); }
// Queues the downloads of these pieces (indices into the step's pieces) now: their gradients are final.
template <typename Copies>
inline void offload_download_early(const std::vector<UpdatePiece>& pieces, const std::vector<int>& which,
                                   const float* grad_acc, float* staging) {
    Copies& copies = offload_copies<Copies>();
    std::vector<char>& early = offload_early();
    copies.prepare(pieces.size());
    copies.after_main_stream(false);  // the uploads keep waiting for the whole step (begin)
    for (int k : which) {
        copies.download(k, staging + pieces[k].state_index, grad_acc + pieces[k].acc_index, pieces[k].n * sizeof(float));
        early[k] = 1;
    }
}

// The params' value of a new fp32 master value, element i of a piece whose seed is
// step_seed + table_offset: fp32 params: the value; floatX: the CUDA kernel's stochastic rounding.
inline void offload_round(float& out, float x, uint64_t, size_t) { out = x; }
#ifdef __CUDACC__
inline void offload_round(floatX& out, float x, uint64_t seed, size_t i) {
    out = stochastic_round_floatX(x, adamw_random_bits(seed, i));
}
#endif

// One AdamW step of the rank's pieces with master, m, v and staging in host memory (staging: fp32,
// the state space's size); params and grad_acc are device buffers. The arguments are the device
// step's (adamw_update), step_seed the step's stochastic-rounding seed before the table offset.
template <typename Copies, typename floatX>
inline void offload_adamw_step(const std::vector<UpdatePiece>& pieces, floatX* params, const float* grad_acc,
                               float* master, float* adam_m, float* adam_v, float* staging, float lr, float beta1,
                               float beta2, float eps, float weight_decay, float grad_scale, int t, uint64_t step_seed) {
    static_assert(sizeof(floatX) <= sizeof(float), "the rounded params are written over their fp32 gradients");
    Copies& copies = offload_copies<Copies>();
    std::vector<char>& early = offload_early();
    early.resize(pieces.size(), 0);
    copies.begin(pieces.size());
    for (size_t k = 0; k < pieces.size(); k++)
        if (!early[k])
            copies.download(k, staging + pieces[k].state_index, grad_acc + pieces[k].acc_index, pieces[k].n * sizeof(float));
    for (size_t k = 0; k < pieces.size(); k++) {
        const UpdatePiece& u = pieces[k];
        copies.wait_download(k);
        float* g = staging + u.state_index;
        float* w = master + u.state_index;
        cpu::adamw_update<float>(w, nullptr, g, adam_m + u.state_index, adam_v + u.state_index, u.n, lr, beta1, beta2,
                                 eps, u.decay ? weight_decay : 0.0f, grad_scale, t, 0);
        floatX* out = reinterpret_cast<floatX*>(g);  // element i's bytes lie inside g[0, i]: spent
        const uint64_t seed = step_seed + u.table_offset;
        const size_t n = u.n;
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++) offload_round(out[i], w[i], seed, i);
        copies.upload(params + u.param_index, out, n * sizeof(floatX));
    }
    copies.finish();
    offload_early_reset(pieces.size());
}
#endif  // LLMC_OFFLOAD_H
