// The memory plan and the arenas that allocate exactly it.
//
// The model allocates every buffer before the first step through MemoryArenas::take(kind, bytes),
// in one function (gpt_allocate in train_gpt.cu), and nothing after. Run once with plan_only, that
// function is the plan: take() only counts, by kind, and returns null; run for real, it allocates
// one arena per kind at the planned size and take() carves it in the same order. So the start-up
// tables, the memory guard, --plan and --max_fit read exactly what is allocated (check_used()
// verifies allocated == planned, byte for byte). Every buffer is rounded up to BUFFER_ALIGN bytes,
// which keeps each one aligned for the kernels' 16-byte vector loads.
//
// MEM_SCRATCH is the CUDA ops' scratch arena and the cuBLASLt workspace (llmc/ops/op_scratch.h gives
// their sizes as host arithmetic, so a CPU machine plans them for a GPU too); the CPU build's ops
// need none.
//
// Device and host kinds. The MEM_HOST_* arenas hold what --offload optimizer moves to host memory
// (llmc/parallel/offload.h): the fp32 master weights, the AdamW moments and the gradient staging buffer.
// They come from host_buffer_alloc (pinned, cudaMallocHost, in the CUDA build; the CPU build's
// "device" is host memory too, so there both kinds are plain host memory), the others from
// buffer_alloc (device memory in the CUDA build). The plan reports the two sides apart: buffers()
// is what the device holds, host_arenas() what the host holds for the optimizer.
//
// Backend-independent: the arenas' bytes come from the allocators handed to allocate_as (the
// backend's buffer_alloc / host_buffer_alloc and their frees).
#ifndef LLMC_MEMORY_H
#define LLMC_MEMORY_H
#include <cstddef>
#include "utils.h"

// MEM_GRADS is the fp32 gradient accumulator (a model state, what the ZeRO stages shard);
// MEM_GRAD_BUFFERS the gradients in flight: the stage 2-3 gradient slots, a reduction's receive
// buffer, the tied lm head's micro-batch gradient and its step accumulator.
enum MemKind {
    MEM_PARAMS = 0, MEM_GRADS, MEM_GRAD_BUFFERS, MEM_MASTER, MEM_MOMENTS, MEM_ACTIVATIONS, MEM_BATCH, MEM_SCRATCH,  // device
    MEM_HOST_MASTER, MEM_HOST_MOMENTS, MEM_HOST_STAGING,                             // host (--offload optimizer)
    MEM_KINDS
};
inline const char* mem_kind_name(int k) {
    static const char* names[] = {"params", "grads", "grad buffers", "master", "moments", "activations", "batch",
                                  "op scratch", "host master", "host moments", "host staging"};
    return names[k];
}
inline bool mem_kind_is_host(int k) { return k >= MEM_HOST_MASTER; }
constexpr size_t BUFFER_ALIGN = 256;

// Where the arenas' bytes come from: device buffers (the CPU build's are host memory too) and the
// host arenas, with their frees.
struct ArenaAllocator {
    void* (*alloc)(size_t) = nullptr;
    void (*free)(void*) = nullptr;
    void* (*host_alloc)(size_t) = nullptr;
    void (*host_free)(void*) = nullptr;
};

struct MemoryArenas {
    bool plan_only = false;
    ArenaAllocator with;  // set by allocate_as
    double planned[MEM_KINDS] = {};  // bytes taken so far, by kind
    char* base[MEM_KINDS] = {};
    size_t size[MEM_KINDS] = {}, used[MEM_KINDS] = {};

    void* take(MemKind kind, size_t bytes) {
        const size_t aligned = (bytes + BUFFER_ALIGN - 1) / BUFFER_ALIGN * BUFFER_ALIGN;
        planned[kind] += (double)aligned;
        if (plan_only) return nullptr;
        LLMC_CHECK(used[kind] + aligned <= size[kind], "internal: the %s arena (%zu bytes) is smaller than what is taken "
                   "from it", mem_kind_name(kind), size[kind]);
        void* p = base[kind] + used[kind];
        used[kind] += aligned;
        return p;
    }
    // one allocation per kind, at the sizes a plan_only run counted
    void allocate_as(const MemoryArenas& plan, const ArenaAllocator& allocator) {
        with = allocator;
        for (int k = 0; k < MEM_KINDS; k++) {
            size[k] = (size_t)plan.planned[k];
            base[k] = !size[k] ? nullptr : mem_kind_is_host(k) ? (char*)with.host_alloc(size[k]) : (char*)with.alloc(size[k]);
        }
    }
    void check_used() const {
        for (int k = 0; k < MEM_KINDS && !plan_only; k++)
            LLMC_CHECK(used[k] == size[k], "internal: the %s arena holds %zu bytes, %zu were taken", mem_kind_name(k),
                       size[k], used[k]);
    }
    void release() {
        for (int k = 0; k < MEM_KINDS; k++) {
            if (base[k]) mem_kind_is_host(k) ? with.host_free(base[k]) : with.free(base[k]);
            base[k] = nullptr;
        }
    }
};

// A plan by kind, in bytes: the device arenas, the host arenas (--offload optimizer), plus the
// host-side staging in pageable memory (init, checkpoint copies, batch vectors).
struct MemoryEstimate {
    double params = 0, grads = 0, grad_buffers = 0, master = 0, moments = 0, activations = 0, batch = 0, scratch = 0;  // device
    double host_master = 0, host_moments = 0, host_staging = 0;                                      // host arenas
    double host = 0;
    double expert_leaves = 0;  // of grads: -z 0/1 with --ep, the experts' accumulators of the other source ranks
    double buffers() const { return params + grads + grad_buffers + master + moments + activations + batch + scratch; }
    double host_arenas() const { return host_master + host_moments + host_staging; }
    static MemoryEstimate of(const MemoryArenas& a) {
        MemoryEstimate e;
        e.params = a.planned[MEM_PARAMS];
        e.grads = a.planned[MEM_GRADS];
        e.grad_buffers = a.planned[MEM_GRAD_BUFFERS];
        e.master = a.planned[MEM_MASTER];
        e.moments = a.planned[MEM_MOMENTS];
        e.activations = a.planned[MEM_ACTIVATIONS];
        e.batch = a.planned[MEM_BATCH];
        e.scratch = a.planned[MEM_SCRATCH];
        e.host_master = a.planned[MEM_HOST_MASTER];
        e.host_moments = a.planned[MEM_HOST_MOMENTS];
        e.host_staging = a.planned[MEM_HOST_STAGING];
        return e;
    }
};
#endif  // LLMC_MEMORY_H
