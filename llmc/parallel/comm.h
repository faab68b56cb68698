// The rank grid, its groups, and the one collective API every parallel layout uses.
//
// Launch: `mpirun -np N ./train_gpt ...` starts N processes (one per GPU; on the CPU build one per
// rank, OpenMP threads inside). The grid: world = pp x dp x tp, rank = (stage * dp + dp_rank) * tp +
// tp_rank (Megatron's order: the tensor-parallel ranks of a layer are neighbours, i.e. one node;
// then the data-parallel ranks of a stage). Groups: tp (the ranks that split each layer's matrices),
// dp (the ranks of one stage and one tp rank, which shard ZeRO state), pp (one rank per stage, the
// same dp and tp rank: the pipeline's sends and receives), ep (--ep consecutive dp ranks that share
// out the experts), edp (the dp ranks with the same ep rank: the same experts), tp_kv (tp ranks that
// read one kv head). Every subsystem receives the group it works on and never computes raw rank
// numbers itself.
//
// Three backends behind the same calls:
//   single process  built without MPI: world 1, collectives are copies (refuses to run when an
//                   MPI launcher started several copies of it)
//   MPI             the CPU build (LLMC_MPI): MPI moves bytes only. No MPI reduction op is ever
//                   used on floats: every float sum happens in our code in a fixed order (see
//                   zero.h's reduce_scatter_add), so results do not depend on the MPI library
//   NCCL            the GPU build (LLMC_MPI + LLMC_NCCL): MPI launches the processes and
//                   broadcasts the NCCL unique id; buffer collectives run on a comm stream that is
//                   ordered after the compute stream with an event, and the compute stream waits
//                   for the comm stream with another event. At start-up each node checks peer access
//                   between the GPUs its ranks use and sets NCCL_P2P_DISABLE=1 where a pair has
//                   none (consumer cards), unless the user chose (comm_peer_access_setup).
//   loopback        a test mode of the CUDA build on one process (LLMC_COMM_LOOPBACK=DELAY_US in the
//                   environment, or comm_set_loopback): the buffer collectives of one-rank groups
//                   (a copy: world is still 1) take NCCL's comm-stream path, the same events
//                   (comm_stream_enter / comm_stream_leave) and the same comm_finish, each one
//                   behind a spin of DELAY_US microseconds on the comm stream, and the hooks take the
//                   overlapped paths of several ranks (comm_moves: ZeRO's gathers in flight, -z 0's
//                   deferred update). So one GPU runs the stream order of a multi-GPU run, and a
//                   missing event wait reads data the comm stream has not written yet (see "The
//                   loopback" below; test_gpu's "comm loopback" cases).
// "buffer" calls take memory where the model's buffers live (device memory in the GPU build);
// "host" calls take host memory (losses, norms, checksums, flags) and always go through MPI.
//
// Failure: comm_abort() stops every rank (ncclCommAbort, then MPI_Abort); main() calls it on any
// error, so one rank's error ends the job with that rank named instead of leaving the others
// waiting in a collective.
//
// Deadlines (--comm_timeout, Comm::timeout_s). A rank that is stopped, hung or on a lost node
// never errors: the others would wait for it forever. So every MPI wait for other ranks (a
// collective, a group of transfers, a host collective, a barrier) is a non-blocking call completed
// in a polling loop with a deadline (comm_wait); when it passes, the job aborts with one message
// naming the operation, the step and the ranks that did not arrive. The NCCL build adds a watchdog
// thread over the buffer collectives on the GPU (see "NCCL watchdog" below).
//  - What counts: only the time one rank spends inside one wait. Local work between waits never
//    counts, however long. A rank's peers do wait for it, but for a step's compute they wait only
//    for the imbalance between ranks (every rank does the same work), far below the default.
//  - Long local work that is not balanced: checkpoint I/O (each rank's share of the writes and its
//    fsync, rank 0's header, fsync and rename; the verify pass of a resume), an llm.c export that
//    rank 0 writes alone, and the start-up before the first step has completed (data, allocation,
//    the first use of each communicator). The waits inside a CommLongWork section (scoped; the
//    checkpoint writer and verify_checkpoint hold one) and before the first step is over get
//    COMM_LONG_WORK_FACTOR x the timeout: a slow disk does not trip it, a stopped rank is still
//    found, later.
//  - Who did not arrive: on expiry the rank asks every rank of the world for its state on a
//    communicator of its own (every rank answers while it waits, in any wait). An answer says
//    which operation the rank waits in and how many collectives it has entered on each group, so
//    the members of the group that have not entered this collective are known; a transfer group
//    names the peers of its incomplete transfers; a rank that does not answer within COMM_PROBE_S
//    is named as not responding (stopped, hung, busy far beyond the deadline, or its node is gone).
//  - One message: the lowest-numbered rank that is waiting reports (its error aborts the job);
//    the others keep answering until that abort ends them (or report themselves after a grace
//    period, if it never comes).
#pragma once
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "llmc/utils.h"
#ifdef LLMC_MPI
#include <condition_variable>
#include <mutex>
#include <thread>
#endif
#ifdef LLMC_MPI
#include <mpi.h>
#endif
#ifdef LLMC_NCCL
#include <atomic>
#include <deque>
#include <mutex>
#include <thread>
#include <nccl.h>
#endif
#if !defined(LLMC_CPU) && defined(LLMC_MPI)
#include "llmc/ops/cuda_common.cuh"  // the CUDA build under mpirun: each rank picks its GPU in comm_init
#endif
#if defined(__CUDACC__) && !defined(LLMC_CPU)
// Every CUDA build has the comm stream: NCCL's collectives run on it, and on one process the
// loopback's. (Compiled by nvcc only: the host-only tests include this header through g++.)
#define LLMC_COMM_STREAM
#include <mutex>
#include <cuda_runtime.h>
// cuda_common.cuh comes later in a single-process build (llmc/gpt/backend.h; test_gpu declares the
// CPU build's model in between, which must not see the CUDA helpers): the compute stream is
// declared here, and the stream code checks its calls with its own macro
inline cudaStream_t llmc_stream();
#define commCudaCheck(call)                                                                                     \
    do {                                                                                                        \
        const cudaError_t comm_cuda_err_ = (call);                                                              \
        LLMC_CHECK(comm_cuda_err_ == cudaSuccess, "CUDA error at %s:%d: %s", __FILE__, __LINE__,                \
                   cudaGetErrorString(comm_cuda_err_));                                                         \
    } while (0)
#endif

// what the byte counters are kept by
enum CommOp { COMM_ALL_GATHER = 0, COMM_ALL_TO_ALL, COMM_BROADCAST, COMM_P2P, COMM_HOST, COMM_N_OPS };
constexpr int COMM_BARRIER = COMM_N_OPS;  // a wait with no bytes: no counter
inline const char* comm_op_name(int op) {
    static const char* names[] = {"all_gather", "all_to_all", "broadcast", "send/recv", "host (scalars)", "barrier"};
    return op >= 0 && op <= COMM_BARRIER ? names[op] : "?";
}
// how a timeout names the operation
inline const char* comm_op_title(int op) {
    static const char* names[] = {"all_gather", "all_to_all", "broadcast", "send/recv", "host all_gather", "barrier"};
    return op >= 0 && op <= COMM_BARRIER ? names[op] : "?";
}

// the groups, by id (timeouts name them and count the collectives each rank has entered on each)
enum CommGroupId { CG_WORLD = 0, CG_DP, CG_PP, CG_TP, CG_EP, CG_EDP, CG_TP_KV, COMM_N_GROUPS };
inline const char* comm_group_name(int id) {
    static const char* names[] = {"world", "data-parallel", "pipeline", "tensor-parallel", "expert-parallel",
                                  "expert data-parallel", "shared-kv-head"};
    return id >= 0 && id < COMM_N_GROUPS ? names[id] : "?";
}

struct CommGroup {
    int rank = 0, size = 1;
#ifdef LLMC_MPI
    MPI_Comm mpi = MPI_COMM_NULL;
#endif
#ifdef LLMC_NCCL
    ncclComm_t nccl = nullptr;
#endif
    int id = CG_WORLD;
};

constexpr double COMM_DEFAULT_TIMEOUT_S = 300;
constexpr double COMM_LONG_WORK_FACTOR = 10;  // the waits of checkpoint I/O, exports and the start-up
constexpr double COMM_PROBE_S = 5;            // at most this long for the other ranks' answers on a timeout
constexpr double COMM_SPIN_S = 0.01;          // a wait for the simulated link's end spins this long (comm_wait)

// What a rank tells a timed-out rank about itself.
struct CommRankState {
    int32_t waiting = 0;            // 1: inside a wait now (only waiting ranks answer, so always 1 in an answer)
    int32_t op = -1, group = -1;    // the wait's operation and group id
    int64_t step = 0;
    double waited_s = 0, bound_s = 0;
    uint64_t calls[COMM_N_GROUPS] = {};  // collectives entered on each group
};

// The simulated link's parameters (--sim_link GBIT_S[,LATENCY_US]); off when bytes_per_s is 0.
struct SimLink {
    double bytes_per_s = 0, latency_s = 0;
    bool on() const { return bytes_per_s > 0; }
};
// What the link made this rank wait, summed over the run (tests, the benchmark, the timeline).
struct CommSimStats {
    uint64_t finished = 0;     // simulated operations finished
    uint64_t held = 0;         // of those, the ones whose finish had to wait for the model's end
    double model_s = 0;        // their model costs, summed
    double held_s = 0;         // time spent waiting for the model's end after MPI had completed
};
// One finished operation, for the timeline: [start_s, done_s] it was in flight (done: the model's end,
// or the MPI completion when later), [wait_s, end_s] the rank was blocked in its finish. Times are
// comm_now_s().
struct CommInterval {
    int op, group;
    size_t bytes;
    double start_s, done_s, wait_s, end_s;
};

#ifdef LLMC_COMM_STREAM
// The loopback's state (see "The loopback" below). skip_wait is for tests only: a negative control
// that leaves one of the two event waits out, to show that the loopback catches it.
enum CommSkipWait { COMM_SKIP_NONE = 0, COMM_SKIP_ENTER_WAIT, COMM_SKIP_FINISH_WAIT };
struct CommLoopback {
    int delay_us = -1;                       // the spin before each collective's copy; -1: the loopback is off
    uint64_t issued = 0;                     // loopback collectives queued so far (the last one's number)
    unsigned long long* progress = nullptr;  // device: [0] the number of the last one done on the comm
                                             // stream, [1] finishes whose consumer ran ahead of it (stale)
    void* staging = nullptr;                 // device: an in-place collective's bytes as it started
    size_t staging_bytes = 0;
    int skip_wait = COMM_SKIP_NONE;
};
#endif

struct Comm {
    int world_rank = 0, world_size = 1;
    int stage = 0, n_stages = 1;  // this rank's pipeline stage, of pp
    CommGroup world, dp, pp, tp;
    CommGroup ep, edp;  // expert parallel: the dp ranks that share out an MoE layer's experts, and the
                        // ranks (one per ep group) that hold the same experts (their data parallelism)
    CommGroup tp_kv;  // the tp ranks that share a kv head (--tp > n_kv_head): they gather the group's attention inputs
    // the ranks of dp / edp again, for the gradient reductions: MPI, a communicator of their own (a
    // rank starts a queued reduction when the one before it has completed, llmc/gpt/hooks.h, so
    // the ranks may start it before or after their next gather, and the order of collectives is
    // fixed per communicator); NCCL, the same communicators (the reductions start in a fixed order
    // there: comm_done_early)
    CommGroup dp_reduce, edp_reduce;
    uint64_t sent_bytes[COMM_N_OPS] = {}, recv_bytes[COMM_N_OPS] = {};
    bool initialized = false;
    // deadlines (see the top of this file)
    double timeout_s = COMM_DEFAULT_TIMEOUT_S;  // --comm_timeout; 0: none
    int64_t step = 0;                           // the step being run (1-based; 0: the start-up)
    bool started = false;                       // the first step has completed
    int long_work = 0;                          // CommLongWork sections open
    CommRankState state;                        // this rank's, as it answers
    double wait_t0 = 0;
    bool spin = false;  // the node has a core for every thread of its ranks: the link's waits spin (comm_wait)
    // --sim_link (see "The simulated link" below)
    SimLink link;
    double link_free_s = 0;       // when this rank's link has carried what it was given so far
    CommSimStats sim;
    std::vector<CommInterval>* trace = nullptr;  // where finished operations are recorded (null: nowhere)
#ifdef LLMC_MPI
    MPI_Comm diag = MPI_COMM_NULL;              // the timeout's questions and answers, apart from the traffic
    std::vector<CommRankState> answers;         // one send buffer per asking rank
#endif
#ifdef LLMC_COMM_STREAM
    cudaStream_t stream = nullptr;       // the buffer collectives' (NCCL's, the loopback's); made on first need
    cudaEvent_t compute_done = nullptr;  // the compute stream's work so far, which a collective follows
    CommLoopback loop;
#endif
};

// The process's communicator (one per process; main() aborts through it on errors).
inline Comm& comm_world() {
    static Comm c;
    return c;
}

#ifdef LLMC_COMM_STREAM
// ---- The loopback (LLMC_COMM_LOOPBACK=DELAY_US: the CUDA build, one process) ----
// What it is for: on one GPU every collective of a one-rank group has nothing to move, so the
// stream order of the overlap machinery (a collective queued on the comm stream after the compute
// that produced its input, the compute stream waiting for it where its output is consumed, ZeRO's
// gathers in flight behind the compute, -z 0's deferred update) would only run on several GPUs.
// With the loopback, a buffer collective of a one-rank group is issued as NCCL's are
// (comm_stream_enter: the comm stream waits for the compute stream's work so far; comm_stream_leave:
// the request's done event; comm_finish: the compute stream waits for that event), and is on the
// comm stream:
//   out of place (a one-rank all_to_all: a reduce-scatter's exchange)  spin DELAY_US, copy send -> recv
//   in place (a one-rank all_gather, broadcast)   copy the bytes aside, spin DELAY_US, copy them back
//                                                (the collective "writes" its output after the spin,
//                                                as a real one may at any time before its done event)
// then writes its sequence number to a device word. Every comm_finish of a loopback collective
// then queues, on the compute stream, a one-thread check that the word has reached the request's
// number: it has, unless the compute stream ran ahead of the done event, i.e. an event wait is
// missing; such stale finishes are counted on the device (comm_loopback_stale) and comm_end_step
// fails the run on any (reading the count: one host sync per step, in this mode only). The spin makes that certain (the consumer runs while the comm stream still
// spins) and costs DELAY_US per collective on the comm stream only. The results are bitwise those
// without the loopback (a copy of one rank changes no bit; the deferred update is the same AdamW
// per piece; test_gpu checks -z 0..3). The hooks ask comm_moves(group) where they would skip a
// one-rank group. (The gradient reductions of one rank stay local adds: the plan gives one rank no
// receive buffers.)
__global__ void comm_spin_kernel(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
#if __CUDA_ARCH__ >= 700
        __nanosleep(1000);
#endif
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
__global__ void comm_loopback_mark(unsigned long long* progress, unsigned long long seq) { progress[0] = seq; }
__global__ void comm_loopback_check(unsigned long long* progress, unsigned long long seq) {
    if (*(volatile unsigned long long*)progress < seq) atomicAdd(progress + 1, 1ull);
}
// us microseconds of a one-thread spin queued on stream s (the loopback's delay; tests delay the
// compute stream with it)
inline void comm_gpu_spin(cudaStream_t s, int us) {
    if (us <= 0) return;
    comm_spin_kernel<<<1, 1, 0, s>>>(1000ull * (unsigned long long)us);
    commCudaCheck(cudaGetLastError());
}
// the comm stream and its event, made on first need (NCCL: with the grid; the loopback: at its
// first collective)
inline void comm_stream_setup(Comm& c) {
    if (c.stream) return;
    commCudaCheck(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking));
    commCudaCheck(cudaEventCreateWithFlags(&c.compute_done, cudaEventDisableTiming));
}
inline void comm_loopback_setup(Comm& c) {
    comm_stream_setup(c);
    if (c.loop.progress) return;
    commCudaCheck(cudaMalloc(&c.loop.progress, 2 * sizeof(unsigned long long)));
    commCudaCheck(cudaMemsetAsync(c.loop.progress, 0, 2 * sizeof(unsigned long long), c.stream));
    commCudaCheck(cudaStreamSynchronize(c.stream));  // (once: zero before any check can read it)
}
// Turns the loopback on (delay_us >= 0: the spin before each collective's copy, in microseconds) or
// off (-1), between steps (nothing in flight). One process only. comm_init applies
// LLMC_COMM_LOOPBACK; tests call it directly.
inline void comm_set_loopback(Comm& c, int delay_us) {
    LLMC_CHECK(delay_us >= -1 && delay_us <= 10000000, "LLMC_COMM_LOOPBACK: a delay in [0, 1e7] microseconds, got %d",
               delay_us);
    LLMC_CHECK(delay_us < 0 || c.world_size == 1,
               "LLMC_COMM_LOOPBACK: the loopback is a test mode of one process, this job has %d ranks", c.world_size);
    if (delay_us < 0 && c.loop.staging) {  // off: the aside buffer goes once the comm stream is done with it
        commCudaCheck(cudaStreamSynchronize(c.stream));
        commCudaCheck(cudaFree(c.loop.staging));
        c.loop.staging = nullptr;
        c.loop.staging_bytes = 0;
    }
    c.loop.delay_us = delay_us;
}
// The loopback's stale finishes since the start (see above); waits for the compute stream.
inline uint64_t comm_loopback_stale(Comm& c) {
    if (!c.loop.progress) return 0;
    unsigned long long stale = 0;
    commCudaCheck(cudaMemcpyAsync(&stale, c.loop.progress + 1, sizeof(stale), cudaMemcpyDeviceToHost, llmc_stream()));
    commCudaCheck(cudaStreamSynchronize(llmc_stream()));
    return stale;
}
#endif
inline bool comm_loopback_on() {
#ifdef LLMC_COMM_STREAM
    return comm_world().loop.delay_us >= 0;
#else
    return false;
#endif
}
// Whether the buffer collectives of g go through the comm: more than one rank, or the loopback. The
// hooks start their collectives (and take the paths that keep them in flight) only then; a one-rank
// group otherwise has nothing to move, and its data stays where it is.
inline bool comm_moves(const CommGroup& g) { return g.size > 1 || comm_loopback_on(); }

inline const char* comm_backend_name() {
    if (comm_loopback_on()) return "one process, collectives looped back on a comm stream (LLMC_COMM_LOOPBACK)";
#if defined(LLMC_NCCL)
    return "NCCL (MPI bootstrap)";
#elif defined(LLMC_MPI)
    return "MPI";
#else
    return "single process (built without MPI)";
#endif
}

// world size an MPI launcher announced to this process, 0 when none did
inline int launcher_world_size() {
    for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE"}) {
        const char* v = getenv(var);
        if (v && atoi(v) > 0) return atoi(v);
    }
    return 0;
}

#ifdef LLMC_MPI
#define mpiCheck(call)                                                                        \
    do {                                                                                      \
        int mpi_err_ = (call);                                                                \
        if (mpi_err_ != MPI_SUCCESS) {                                                        \
            char mpi_msg_[MPI_MAX_ERROR_STRING];                                              \
            int mpi_len_ = 0;                                                                 \
            MPI_Error_string(mpi_err_, mpi_msg_, &mpi_len_);                                  \
            LLMC_FAIL("MPI error at %s:%d: %s", __FILE__, __LINE__, mpi_msg_);                \
        }                                                                                     \
    } while (0)
// MPI counts are int: the byte count of one call must fit
inline int mpi_count(size_t bytes) {
    LLMC_CHECK(bytes <= (size_t)INT32_MAX, "a collective of %zu bytes is larger than MPI's int count allows", bytes);
    return (int)bytes;
}
#endif
#ifdef LLMC_NCCL
#define ncclCheck(call)                                                                                         \
    do {                                                                                                        \
        ncclResult_t nccl_err_ = (call);                                                                        \
        LLMC_CHECK(nccl_err_ == ncclSuccess, "NCCL error at %s:%d: %s", __FILE__, __LINE__,                     \
                   ncclGetErrorString(nccl_err_));                                                              \
    } while (0)
#endif

// ---- Peer access between one node's GPUs (the NCCL build's start-up) ----
// Consumer cards (RTX 4090 and its kin) have no peer-to-peer access: the driver reports none for
// them, and where an older driver reported some that did not work, NCCL's P2P transport hung or
// failed on them (NCCL_P2P_DISABLE=1 was the known cure). So before the first NCCL call the node's
// local rank 0 asks CUDA about every pair of the GPUs the node's ranks use, and when a pair lacks
// access in either direction the node's ranks set NCCL_P2P_DISABLE=1 (NCCL then moves those bytes
// through host memory, its SHM transport), unless the user set NCCL_P2P_DISABLE or NCCL_P2P_LEVEL:
// their choice stands, and the line says so. The decision is this pure function (tested on the CPU
// build, test/test_comm); comm_peer_access_setup runs the CUDA queries and applies it.
struct PeerAccessPlan {
    bool set_p2p_disable = false;  // setenv NCCL_P2P_DISABLE=1 on the node's ranks
    std::string message;           // the start-up line (empty: nothing to say)
};
// NCCL ignores a variable set to the empty string, so it counts as not set here too
inline bool peer_env_set(const char* v) { return v && v[0]; }
// devices: the node's GPU ordinals in use (n), names their product names, can[i * n + j]: GPU
// devices[i] can access devices[j]'s memory (the diagonal is ignored); ranks_on_node: the node's
// processes; env_disable / env_level: NCCL_P2P_DISABLE / NCCL_P2P_LEVEL as set (null: unset);
// where: the node's name when the job spans nodes (each node's line says which it is), else "".
inline PeerAccessPlan peer_access_plan(const std::vector<int>& devices, const std::vector<std::string>& names,
                                       const std::vector<char>& can, int ranks_on_node, const char* env_disable,
                                       const char* env_level, const std::string& where = "") {
    PeerAccessPlan plan;
    const int n = (int)devices.size();
    LLMC_CHECK(names.size() == devices.size() && can.size() == (size_t)n * n,
               "internal: peer access of %d GPUs given %zu names and %zu answers", n, names.size(), can.size());
    const std::string head = where.empty() ? "peer access: " : "peer access on " + where + ": ";
    const bool user_disable = peer_env_set(env_disable), user_level = peer_env_set(env_level);
    const std::string user = user_disable ? strfmt("NCCL_P2P_DISABLE=%s", env_disable)
                                          : user_level ? strfmt("NCCL_P2P_LEVEL=%s", env_level) : "";
    if (n < 2) {
        // one GPU per process and each sees only its own (CUDA_VISIBLE_DEVICES per rank): no process
        // can ask about the pairs, so say what to do if NCCL's P2P misbehaves
        if (ranks_on_node > 1)
            plan.message = head + strfmt("not checked: each of the node's %d ranks sees %d GPU (CUDA_VISIBLE_DEVICES per "
                                         "rank?); %s", ranks_on_node, n,
                                         user.empty() ? "on cards without peer access (RTX 4090s) set NCCL_P2P_DISABLE=1"
                                                      : (user + " from the environment kept").c_str());
        return plan;
    }
    // the pairs without access in either direction (NCCL's P2P between two GPUs uses both)
    std::vector<std::pair<int, int>> none;
    std::vector<std::string> kinds;  // the product names of the GPUs in those pairs, once each
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++)
            if (!can[(size_t)i * n + j] || !can[(size_t)j * n + i]) {
                none.push_back({i, j});
                for (int k : {i, j})
                    if (std::find(kinds.begin(), kinds.end(), names[k]) == kinds.end()) kinds.push_back(names[k]);
            }
    if (none.empty()) {
        plan.message = head + strfmt("all %d local GPUs pairwise", n) +
                       (user.empty() ? "" : "; " + user + " from the environment kept");
        return plan;
    }
    // which pairs: all of them in a word; else up to 6 by number (8 GPUs have 28 pairs)
    const int n_pairs = n * (n - 1) / 2;
    std::string what;
    if ((int)none.size() == n_pairs && n > 2) {
        what = strfmt("no pair of the %d local GPUs (%d-%d) has it", n, devices[0], devices[n - 1]);
    } else {
        what = "GPUs ";
        const size_t shown = std::min<size_t>(none.size(), 6);
        for (size_t k = 0; k < shown; k++)
            what += strfmt("%s%d-%d", k ? ", " : "", devices[none[k].first], devices[none[k].second]);
        if (shown < none.size()) what += strfmt(" and %zu more pairs", none.size() - shown);
        what += " have none";
    }
    std::string kind;
    for (size_t k = 0; k < kinds.size(); k++) kind += (k ? ", " : "") + kinds[k];
    what += " (" + kind + ")";
    if (user.empty()) {
        plan.set_p2p_disable = true;
        plan.message = head + what + ": NCCL_P2P_DISABLE=1 set (transfers between them go through host memory)";
    } else if (user_disable && strcmp(env_disable, "0") == 0) {
        // asked for P2P where the driver reports none: kept, but this is how such boxes hang
        plan.message = head + what + ": " + user + " from the environment kept (P2P asked for where there is none: "
                       "if NCCL hangs or fails, unset it and this program sets NCCL_P2P_DISABLE=1)";
    } else {
        plan.message = head + what + ": " + user + " from the environment kept";
    }
    return plan;
}

#if defined(LLMC_NCCL) && !defined(LLMC_CPU)
// The node's peer access, asked and applied (see peer_access_plan above); collective over the
// node's ranks (node: their communicator, local_rank / local_size: this rank's place in it). The
// node's ranks take GPUs local_rank % n_dev (comm_init), so they use GPUs 0 .. min(local_size,
// n_dev) - 1. Local rank 0 asks CUDA about every ordered pair of those and decides; the decision is
// broadcast so that every rank of the node sets the same environment (NCCL's ranks on one node
// must agree on their transports). Nodes decide apart: P2P is a transport within a node.
inline void comm_peer_access_setup(const Comm& c, MPI_Comm node, int local_rank, int local_size, int n_dev) {
    const char* env_disable = getenv("NCCL_P2P_DISABLE");
    const char* env_level = getenv("NCCL_P2P_LEVEL");
    int set_disable = 0;
    if (local_rank == 0) {
        const int n = std::min(local_size, n_dev);
        std::vector<int> devices(n);
        std::vector<std::string> names(n);
        std::vector<char> can((size_t)n * n, 0);
        for (int i = 0; i < n; i++) {
            devices[i] = i;
            cudaDeviceProp prop;
            cudaCheck(cudaGetDeviceProperties(&prop, i));
            names[i] = prop.name;
            for (int j = 0; j < n; j++) {
                if (j == i) continue;
                int ok = 0;
                cudaCheck(cudaDeviceCanAccessPeer(&ok, i, j));
                can[(size_t)i * n + j] = ok != 0;
            }
        }
        // the job spans nodes when this one holds fewer than all ranks: each node's line names it
        std::string where;
        if (local_size < c.world_size) {
            char host[256] = {0};
            where = gethostname(host, sizeof(host) - 1) == 0 ? host : "?";
            where += strfmt(" (rank %d's node)", c.world_rank);
        }
        const PeerAccessPlan plan = peer_access_plan(devices, names, can, local_size, env_disable, env_level, where);
        set_disable = plan.set_p2p_disable;
        if (!plan.message.empty()) {
            printf("%s\n", plan.message.c_str());
            fflush(stdout);
        }
    }
    mpiCheck(MPI_Bcast(&set_disable, 1, MPI_INT, 0, node));
    // a rank whose own environment has either variable keeps it (mpirun -x gives every rank the same)
    if (set_disable && !peer_env_set(env_disable) && !peer_env_set(env_level))
        LLMC_CHECK(setenv("NCCL_P2P_DISABLE", "1", 1) == 0, "setenv NCCL_P2P_DISABLE=1 failed: %s", strerror(errno));
}
#endif

#ifdef LLMC_MPI
// The start-up watchdog. MPI_Init, the communicators' splits and NCCL's id exchange block with no
// deadline of their own: one rank stalled there (a node that hangs, a process the launcher never
// got going) would hang the whole job for good. A thread armed before MPI_Init ends this process
// with a message when the start-up has not finished within 10 x --comm_timeout (the allowance the
// checkpoint I/O gets; 0: none): an exit before MPI_Finalize makes mpirun tear the job down. The
// grid's and the kv group's creation disarm it (comm_make_grid, comm_make_kv_group re-arm around
// their own splits). --comm_timeout is read from argv before MPI_Init, the flags' parse comes later.
struct StartupWatch {
    std::mutex mu;
    std::condition_variable cv;
    bool armed = false;
    std::chrono::steady_clock::time_point deadline;
    double allowance_s = 3000;  // 10 x --comm_timeout's default 300
    std::string what;
};
inline StartupWatch& startup_watch() {
    static StartupWatch* w = new StartupWatch;  // (never freed: its detached thread may outlive static destructors)
    return *w;
}
inline void startup_watch_arm(const std::string& what) {
    StartupWatch& w = startup_watch();
    static std::once_flag started;
    std::call_once(started, [] {
        std::thread([] {
            StartupWatch& w = startup_watch();
            std::unique_lock<std::mutex> lock(w.mu);
            for (;;) {
                if (!w.armed) { w.cv.wait(lock); continue; }
                if (w.cv.wait_until(lock, w.deadline) != std::cv_status::timeout || !w.armed) continue;
                const char* rank = getenv("OMPI_COMM_WORLD_RANK") ? getenv("OMPI_COMM_WORLD_RANK") : getenv("PMI_RANK");
                fprintf(stderr, "error (rank %s): %s did not finish within %.0f s (10 x --comm_timeout): a rank is stalled "
                        "or was never started; this rank stops, and the launcher ends the job\n", rank ? rank : "?",
                        w.what.c_str(), w.allowance_s);
                fflush(stderr);
                _exit(1);
            }
        }).detach();
    });
    std::lock_guard<std::mutex> lock(w.mu);
    if (w.allowance_s <= 0) return;
    w.armed = true;
    w.what = what;
    w.deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                        std::chrono::duration<double>(w.allowance_s));
    w.cv.notify_all();
}
inline void startup_watch_disarm() {
    StartupWatch& w = startup_watch();
    std::lock_guard<std::mutex> lock(w.mu);
    w.armed = false;
    w.cv.notify_all();
}
// --comm_timeout from argv (the last one given), before the flags are parsed; an unreadable value
// keeps the default here (the parse names it later)
inline double startup_allowance_s(int argc, char** argv) {
    double timeout = 300;
    for (int k = 1; k + 1 < argc; k++)
        if (strcmp(argv[k], "--comm_timeout") == 0) {
            char* end = nullptr;
            const double v = strtod(argv[k + 1], &end);
            if (end != argv[k + 1] && *end == 0 && std::isfinite(v) && v >= 0) timeout = v;
        }
    return 10 * timeout;
}
#endif

// Ranks per node as the launcher reports them (0: unknown): a tensor-parallel group should not
// span nodes, its collectives are on the critical path of every layer; the link's waits spin when
// the node has a core per thread (Comm::spin).
inline int launcher_local_size() {
    for (const char* var : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE"}) {
        const char* v = getenv(var);
        if (v && atoi(v) > 0) return atoi(v);
    }
    return 0;
}

// Starts the process's part of the job: MPI_Init (when built with MPI), the world group.
inline Comm& comm_init(int* argc, char*** argv) {
    Comm& c = comm_world();
    if (c.initialized) return c;
#ifdef LLMC_MPI
    startup_watch().allowance_s = argc && argv ? startup_allowance_s(*argc, *argv) : startup_allowance_s(0, nullptr);
    startup_watch_arm("the start-up (MPI_Init, the communicators, NCCL's id exchange)");
    if (const char* v = getenv("LLMC_FAULT_STARTUP_STALL")) {  // fault injection for the tests: this rank stalls
        const char* rank = getenv("OMPI_COMM_WORLD_RANK");
        if (rank && strcmp(v, rank) == 0)
            for (;;) pause();
    }
    mpiCheck(MPI_Init(argc, argv));
    // errors come back as codes (mpiCheck turns them into LlmcError, main aborts the job)
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    mpiCheck(MPI_Comm_rank(MPI_COMM_WORLD, &c.world_rank));
    mpiCheck(MPI_Comm_size(MPI_COMM_WORLD, &c.world_size));
    c.world.mpi = MPI_COMM_WORLD;
    if (c.world_size > 1) {
        mpiCheck(MPI_Comm_dup(MPI_COMM_WORLD, &c.diag));
        MPI_Comm_set_errhandler(c.diag, MPI_ERRORS_RETURN);
        c.answers.resize(c.world_size);
    }
#if !defined(LLMC_CPU) && !defined(LLMC_NCCL)
    // a CUDA build with MPI but without NCCL would hand device pointers to MPI (which a build of MPI
    // without CUDA support dereferences on the host): one rank only
    LLMC_CHECK(c.world_size == 1,
               "this CUDA build has MPI but no NCCL, so it cannot run as %d ranks: install NCCL (e.g. apt-get "
               "install libnccl-dev, or pip install nvidia-nccl-cu12) and rebuild with make train_gpt "
               "NCCL_HOME=/path/with/include/nccl.h+lib/libnccl.so, or run one process",
               c.world_size);
#endif
#ifndef LLMC_CPU
    if (c.world_size > 1) {
        // one GPU per process, chosen from the node-local rank before anything touches a device (the
        // first CUDA call of a process makes its context on the current device: GPU 0 for every rank)
        MPI_Comm node;
        mpiCheck(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, c.world_rank, MPI_INFO_NULL, &node));
        int local_rank = 0, local_size = 1, n_dev = 0;
        mpiCheck(MPI_Comm_rank(node, &local_rank));
        mpiCheck(MPI_Comm_size(node, &local_size));
        cudaCheck(cudaGetDeviceCount(&n_dev));
        LLMC_CHECK(n_dev > 0, "rank %d sees no GPU", c.world_rank);
        cudaCheck(cudaSetDevice(local_rank % n_dev));
#ifdef LLMC_NCCL
        // before any NCCL call: NCCL reads its environment once, at its first use
        comm_peer_access_setup(c, node, local_rank, local_size, n_dev);
#endif
        MPI_Comm_free(&node);
    }
#endif
#else
    (void)argc;
    (void)argv;
    const int launched = launcher_world_size();
    LLMC_CHECK(launched <= 1,
               "this binary was built without MPI but was started as one of %d processes (mpirun -np %d): "
               "install MPI (e.g. apt-get install libopenmpi-dev) and rebuild, or run it as one process",
               launched, launched);
#endif
    if (const char* v = getenv("LLMC_COMM_LOOPBACK")) {  // the loopback (see "The loopback" above)
#ifdef LLMC_COMM_STREAM
        char* end = nullptr;
        errno = 0;
        const long us = strtol(v, &end, 10);
        LLMC_CHECK(isdigit((unsigned char)v[0]) && *end == 0 && errno == 0 && us <= 10000000,
                   "LLMC_COMM_LOOPBACK=%s: expected the delay in microseconds, an integer in [0, 10000000]", v);
        comm_set_loopback(c, (int)us);
#else
        LLMC_FAIL("LLMC_COMM_LOOPBACK=%s: the loopback orders a comm stream against the compute stream, a mode of the "
                  "CUDA build; this build has no streams (unset it)", v);
#endif
    }
    c.world.rank = c.world_rank;
    c.world.size = c.world_size;
#ifdef _OPENMP
    const long threads = omp_get_max_threads();
#else
    const long threads = 1;
#endif
    const long local = launcher_local_size();
    c.spin = local > 0 && local * threads <= sysconf(_SC_NPROCESSORS_ONLN);
    c.initialized = true;
    return c;
}

#ifdef LLMC_NCCL
inline void nccl_watchdog_watch(const CommGroup& g);  // below, with the wait machinery
inline void nccl_watchdog_start();
// one NCCL communicator over an MPI group: the unique id from its rank 0
inline void nccl_group_init(CommGroup& g) {
    ncclUniqueId id;
    if (g.rank == 0) ncclCheck(ncclGetUniqueId(&id));
    mpiCheck(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, g.mpi));
    ncclCheck(ncclCommInitRank(&g.nccl, g.size, id, g.rank));
}
#endif

// The grid world = pp x dp x tp. Checked on every rank before anything is allocated.
inline void comm_make_grid(Comm& c, int dp, int pp, int tp = 1, int ep = 1) {
    LLMC_CHECK(dp >= 1 && pp >= 1 && tp >= 1 && (int64_t)dp * pp * tp == c.world_size,
               "layout: %d processes do not form a grid of --pp %d stages x --tp %d tensor-parallel ranks x %d "
               "data-parallel ranks (the number of processes must be a multiple of pp * tp: dp = processes / (pp tp))",
               c.world_size, pp, tp, dp);
    c.n_stages = pp;
    c.dp.id = CG_DP;
    c.pp.id = CG_PP;
    c.tp.id = CG_TP;
    c.ep.id = CG_EP;
    c.edp.id = CG_EDP;
    c.stage = c.world_rank / (dp * tp);
    c.dp.rank = c.world_rank / tp % dp;
    c.dp.size = dp;
    c.tp.rank = c.world_rank % tp;
    c.tp.size = tp;
    c.pp.rank = c.stage;
    c.pp.size = pp;
    LLMC_CHECK(ep >= 1 && dp % ep == 0, "--ep %d must divide the %d data-parallel ranks (an expert group is ep of them)", ep, dp);
    c.ep.rank = c.dp.rank % ep;
    c.ep.size = ep;
    c.edp.rank = c.dp.rank / ep;
    c.edp.size = dp / ep;
#ifdef LLMC_MPI
    if (c.world_size > 1) {
        // colour: what the group's ranks share; key: the rank's place in the group
        mpiCheck(MPI_Comm_split(MPI_COMM_WORLD, c.stage * tp + c.tp.rank, c.dp.rank, &c.dp.mpi));
        mpiCheck(MPI_Comm_split(MPI_COMM_WORLD, c.dp.rank * tp + c.tp.rank, c.stage, &c.pp.mpi));
        mpiCheck(MPI_Comm_split(MPI_COMM_WORLD, c.stage * dp + c.dp.rank, c.tp.rank, &c.tp.mpi));
        const int stage_tp = c.stage * tp + c.tp.rank;
        mpiCheck(MPI_Comm_split(MPI_COMM_WORLD, stage_tp * (dp / ep) + c.edp.rank, c.ep.rank, &c.ep.mpi));
        mpiCheck(MPI_Comm_split(MPI_COMM_WORLD, stage_tp * ep + c.ep.rank, c.edp.rank, &c.edp.mpi));
        for (CommGroup* g : {&c.dp, &c.pp, &c.tp, &c.ep, &c.edp}) MPI_Comm_set_errhandler(g->mpi, MPI_ERRORS_RETURN);
    } else {
        c.dp.mpi = c.pp.mpi = c.tp.mpi = c.ep.mpi = c.edp.mpi = MPI_COMM_WORLD;
    }
#endif
    c.dp_reduce = c.dp;
    c.edp_reduce = c.edp;
#ifdef LLMC_MPI
    if (c.world_size > 1)
        for (CommGroup* g : {&c.dp_reduce, &c.edp_reduce}) {
            mpiCheck(MPI_Comm_dup(g->mpi, &g->mpi));
            MPI_Comm_set_errhandler(g->mpi, MPI_ERRORS_RETURN);
        }
#endif
#ifdef LLMC_NCCL
    if (c.world_size > 1) {
        // (the process's GPU was chosen in comm_init)
        for (CommGroup* g : {&c.dp, &c.pp, &c.tp, &c.ep, &c.edp})
            if (g->size > 1) nccl_group_init(*g);
        comm_stream_setup(c);
        for (CommGroup* g : {&c.dp, &c.pp, &c.tp, &c.ep, &c.edp})
            if (g->nccl) nccl_watchdog_watch(*g);
        nccl_watchdog_start();
        c.dp_reduce.nccl = c.dp.nccl;
        c.edp_reduce.nccl = c.edp.nccl;
    }
#endif
#ifdef LLMC_MPI
    startup_watch_disarm();  // (the start-up's blocking part is done)
#endif
}

// The tp ranks that read one kv head when --tp exceeds n_kv_head (kv_share of them, consecutive):
// the model's config decides it, so it is made once the config is final (collective over the world).
inline void comm_make_kv_group(Comm& c, int kv_share) {
    LLMC_CHECK(kv_share >= 1 && c.tp.size % kv_share == 0, "internal: %d ranks sharing a kv head in --tp %d", kv_share,
               c.tp.size);
    c.tp_kv.id = CG_TP_KV;
    c.tp_kv.rank = c.tp.rank % kv_share;
    c.tp_kv.size = kv_share;
#ifdef LLMC_MPI
    startup_watch_arm("the kv group's creation (MPI_Comm_split, NCCL's id exchange)");
    if (c.world_size > 1) {
        mpiCheck(MPI_Comm_split(MPI_COMM_WORLD, c.world_rank / kv_share, c.tp_kv.rank, &c.tp_kv.mpi));
        MPI_Comm_set_errhandler(c.tp_kv.mpi, MPI_ERRORS_RETURN);
    } else {
        c.tp_kv.mpi = MPI_COMM_WORLD;
    }
#endif
#ifdef LLMC_NCCL
    if (kv_share > 1) {
        nccl_group_init(c.tp_kv);
        nccl_watchdog_watch(c.tp_kv);
    }
#endif
#ifdef LLMC_MPI
    startup_watch_disarm();
#endif
}

#ifdef LLMC_NCCL
inline void nccl_watchdog_stop();
#endif
inline void comm_finalize() {
    Comm& c = comm_world();
    if (!c.initialized) return;
#ifdef LLMC_MPI
    startup_watch_disarm();  // (a run that ended before its grid: -h)
#endif
#ifdef LLMC_NCCL
    nccl_watchdog_stop();
    for (CommGroup* g : {&c.dp, &c.pp, &c.tp, &c.tp_kv, &c.ep, &c.edp})
        if (g->nccl) ncclCommDestroy(g->nccl);
#endif
#ifdef LLMC_MPI
    MPI_Finalize();
#endif
    c.initialized = false;
}

// Stops the whole job (every rank) with an exit code; returns only in a single-process build.
inline void comm_abort(int code) {
    Comm& c = comm_world();
#ifdef LLMC_NCCL
    // the watchdog thread polls the communicators (ncclCommGetAsyncError) and may abort them itself:
    // it is gone before they are (if it is firing, its _exit ends the process while we wait for it)
    nccl_watchdog_stop();
    for (CommGroup* g : {&c.dp, &c.pp, &c.tp, &c.tp_kv, &c.ep, &c.edp})
        if (g->nccl) ncclCommAbort(g->nccl);
#endif
#ifdef LLMC_MPI
    if (c.initialized && c.world_size > 1) MPI_Abort(MPI_COMM_WORLD, code);
#endif
    (void)c;
    (void)code;
}

// --comm_timeout: seconds a wait may take (0: no deadline); set before the first collective
inline void comm_set_timeout(Comm& c, double seconds) {
    LLMC_CHECK(std::isfinite(seconds) && seconds >= 0, "--comm_timeout: must be a number of seconds >= 0 (0: none), got %g",
               seconds);
    c.timeout_s = seconds;
#ifdef LLMC_MPI
    std::lock_guard<std::mutex> lock(startup_watch().mu);
    startup_watch().allowance_s = 10 * seconds;  // (what comm_init read from argv; later arms use it)
#endif
}
// --sim_link (see "The simulated link" below): collective over the world (the ranks must share one
// machine's clock); set before the first buffer collective
inline void comm_set_sim_link(Comm& c, const SimLink& link) {
    if (!link.on()) return;
#ifdef LLMC_NCCL
    LLMC_FAIL("--sim_link: the simulated link is the CPU build's (MPI moves the bytes); the GPU build's collectives "
              "run on NCCL over the real links");
#endif
#ifdef LLMC_MPI
    if (c.world_size > 1) {
        MPI_Comm node;
        int node_size = 0;
        mpiCheck(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, c.world_rank, MPI_INFO_NULL, &node));
        mpiCheck(MPI_Comm_size(node, &node_size));
        MPI_Comm_free(&node);
        LLMC_CHECK(node_size == c.world_size, "--sim_link: the %d ranks span several machines (%d on this one): the "
                   "simulated link compares start times on one machine's clock; run them on one machine",
                   c.world_size, node_size);
    }
#endif
    c.link = link;
}
// the training loop: the step about to run (1-based), and that the first one has completed
inline void comm_begin_step(Comm& c, int64_t step) { c.step = step; }
inline std::string comm_step_text(int64_t step);
// (the loopback: a step that consumed a collective before it completed fails here, see "The loopback")
inline void comm_end_step(Comm& c) {
    c.started = true;
#ifdef LLMC_COMM_STREAM
    if (c.loop.progress) {
        const uint64_t stale = comm_loopback_stale(c);
        LLMC_CHECK(stale == 0, "LLMC_COMM_LOOPBACK: %llu collective(s) consumed on the compute stream before they completed "
                   "on the comm stream %s (an event wait between the streams is missing)", (unsigned long long)stale,
                   comm_step_text(c.step).c_str());
    }
#endif
}

// Long local work (checkpoint I/O, an export): the waits inside get COMM_LONG_WORK_FACTOR x the
// timeout, since a rank's peers wait for its disk (see the top of this file).
struct CommLongWork {
    CommLongWork() { comm_world().long_work++; }
    ~CommLongWork() { comm_world().long_work--; }
    CommLongWork(const CommLongWork&) = delete;
    CommLongWork& operator=(const CommLongWork&) = delete;
};

inline double comm_now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
// the deadline of a wait that starts now (0: none)
inline double comm_bound_s(const Comm& c) {
    return c.long_work > 0 || !c.started ? COMM_LONG_WORK_FACTOR * c.timeout_s : c.timeout_s;
}
inline std::string comm_step_text(int64_t step) {
    return step > 0 ? strfmt("at step %lld", (long long)step) : std::string("during the start-up");
}

// ---- The simulated link (--sim_link GBIT_S[,LATENCY_US]) ----
// On one machine MPI moves bytes through shared memory, far faster than the network between nodes, so
// nothing the overlap of communication with compute hides would show. The link makes every buffer
// collective and transfer end no earlier than a network of BW bytes/s and latency a would let it
// (bytes / rank block b, the group's size N):
//   all_gather   ring: N-1 steps of b bytes                              (N-1) (a + b / BW)
//   all_to_all   N-1 pairwise exchanges of b bytes ((N-1)/N of the send buffer)   (N-1) (a + b / BW)
//   broadcast    binomial tree of the whole buffer                       ceil(log2 N) (a + bytes / BW)
//   send         the message                                             a + bytes / BW
// A rank's link carries one operation at a time, in the order the rank starts them (full duplex: a
// receive costs the sender's link): an operation is ready at max(its start, the end of the rank's
// previous one). A collective cannot begin before its last member is ready: every member sends its
// ready time beside the data (a non-blocking all-gather of one double on the same communicator) and
// each computes the same end, max(ready) + cost. A transfer ends cost after the sender was ready; the
// sender sends that instant beside the data (the same tag, so it matches in order). The times are
// comm_now_s() (steady_clock, CLOCK_MONOTONIC): one clock for the processes of one machine, so the
// link is refused when the ranks span nodes. comm_finish returns at the later of the model's end and
// MPI's completion; the bytes counted stay the real ones. Host collectives (losses, norms, flags, a few
// bytes each) are not simulated.
//
// Non-blocking operations. *_start posts the MPI requests (the NCCL build: queues the collective on the
// comm stream) and returns a CommRequest; comm_finish(req) completes it where its data is needed, in
// the deadline loop of every wait (comm_wait: --comm_timeout and the state probe apply). MPI requests
// progress inside MPI calls only: the tests at finish points and comm_progress() between computations
// drive them (no progress thread: that would need MPI_THREAD_MULTIPLE and a core that the ranks'
// compute uses; the ranks of a group reach their finish points at about the same time, every rank
// doing the same work).
struct P2POp {
    bool send;
    void* buf;
    size_t bytes;
    int peer, tag;
};
struct CommRequest {
    int op = -1;                     // CommOp; -1: nothing to finish (one rank, or finished)
    const CommGroup* g = nullptr;
    size_t bytes = 0;                // sent by this rank (the timeline)
    double start_s = 0, done_s = 0;  // the link's end (0 until known: a collective's members' times)
    double cost_s = 0;
    bool link = false;               // simulated
#ifdef LLMC_MPI
    std::vector<MPI_Request> reqs;   // the data's, then (link) the times'
    std::vector<double> times;       // link: the members' ready times (a collective) / each transfer's end
    std::vector<P2POp> p2p;          // a transfer group's transfers (a timeout names their peers)
    std::vector<int> counts, displs; // an all-to-all that skips the rank's own block (MPI_Ialltoallv's)
#endif
#ifdef LLMC_COMM_STREAM
    cudaEvent_t done = nullptr;      // recorded on the comm stream after the collective (NCCL's, the loopback's)
    uint64_t seq = 0;                // the loopback's number of it (0: an NCCL collective)
#endif
    CommRequest() = default;
    CommRequest(const CommRequest&) = delete;
    CommRequest& operator=(const CommRequest&) = delete;
    CommRequest(CommRequest&& o) noexcept { *this = std::move(o); }
    CommRequest& operator=(CommRequest&& o) noexcept {
        op = o.op; g = o.g; bytes = o.bytes; start_s = o.start_s; done_s = o.done_s; cost_s = o.cost_s; link = o.link;
#ifdef LLMC_MPI
        reqs = std::move(o.reqs); times = std::move(o.times); p2p = std::move(o.p2p);
        counts = std::move(o.counts); displs = std::move(o.displs);
#endif
#ifdef LLMC_COMM_STREAM
        done = o.done;
        seq = o.seq;
        o.done = nullptr;
#endif
        o.op = -1;
        return *this;
    }
    bool active() const { return op >= 0; }
    // queued on the comm stream (comm_finish makes the compute stream wait for it)
    bool on_stream() const {
#ifdef LLMC_COMM_STREAM
        return done != nullptr;
#else
        return false;
#endif
    }
};

// "GBIT_S[,LATENCY_US]": gigabits per second, microseconds (default 0)
inline SimLink parse_sim_link(const std::string& text) {
    SimLink l;
    if (text.empty()) return l;
    const size_t comma = text.find(',');
    const double gbit = parse_double(text.substr(0, comma), "sim_link");
    const double lat_us = comma == std::string::npos ? 0.0 : parse_double(text.substr(comma + 1), "sim_link");
    LLMC_CHECK(gbit >= 1e-3 && gbit <= 1e6, "--sim_link %s: the bandwidth must be in [0.001, 1e6] Gbit/s (below 1 Mbit/s a "
               "step of even a tiny model takes minutes), got %g Gbit/s", text.c_str(), gbit);
    LLMC_CHECK(lat_us >= 0 && lat_us <= 1e6, "--sim_link %s: the latency must be in [0, 1e6] microseconds, got %g",
               text.c_str(), lat_us);
    l.bytes_per_s = gbit * 1e9 / 8;
    l.latency_s = lat_us * 1e-6;
    return l;
}
// The model's time of one operation on this rank's link (the table above); bytes: the rank block
// (all_gather, all_to_all) or the whole message (broadcast, send).
inline double sim_link_cost_s(const SimLink& l, int op, int n, size_t bytes) {
    const double step = l.latency_s + (double)bytes / l.bytes_per_s;
    switch (op) {
        case COMM_ALL_GATHER:
        case COMM_ALL_TO_ALL: return (n - 1) * step;
        case COMM_BROADCAST: return std::ceil(std::log2((double)n)) * step;
        case COMM_P2P: return step;
    }
    return 0;
}

#ifdef LLMC_MPI
constexpr int COMM_TAG_ASK = 1, COMM_TAG_STATE = 2;
// Answers the questions of timed-out ranks (this rank is waiting: its state says in what).
inline void comm_answer(Comm& c) {
    if (c.diag == MPI_COMM_NULL) return;
    for (;;) {
        int flag = 0;
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, COMM_TAG_ASK, c.diag, &flag, &st) != MPI_SUCCESS || !flag) return;
        int token = 0;
        if (MPI_Recv(&token, 1, MPI_INT, st.MPI_SOURCE, COMM_TAG_ASK, c.diag, MPI_STATUS_IGNORE) != MPI_SUCCESS) return;
        CommRankState& a = c.answers[st.MPI_SOURCE];  // stays untouched until the send completes: one question per rank
        a = c.state;
        a.step = c.step;
        a.waited_s = comm_now_s() - c.wait_t0;
        MPI_Request r;
        if (MPI_Isend(&a, sizeof(a), MPI_BYTE, st.MPI_SOURCE, COMM_TAG_STATE, c.diag, &r) == MPI_SUCCESS) MPI_Request_free(&r);
    }
}
// a pause in a wait for other ranks: a yield at first (a peer sharing the core may be the one we
// wait for: spinning there would hold it off for a whole time slice at every collective), then
// short sleeps, so a long wait does not burn a core
inline void comm_relax(double waited_s) {
    if (waited_s < 0.01) { sched_yield(); return; }
    const struct timespec ts = {0, waited_s < 1 ? 100000L : 1000000L};
    nanosleep(&ts, nullptr);
}
// the world ranks of a group's members
inline std::vector<int> comm_world_ranks(const CommGroup& g) {
    std::vector<int> in(g.size), out(g.size, -1);
    for (int r = 0; r < g.size; r++) in[r] = r;
    MPI_Group mine, world;
    if (MPI_Comm_group(g.mpi, &mine) == MPI_SUCCESS && MPI_Comm_group(MPI_COMM_WORLD, &world) == MPI_SUCCESS)
        MPI_Group_translate_ranks(mine, g.size, in.data(), world, out.data());
    return out;
}
// "0-3, 6": sorted ranks, runs as ranges
inline std::string comm_rank_list(const std::vector<int>& ranks) {
    std::string s;
    for (size_t k = 0; k < ranks.size();) {
        size_t e = k;
        while (e + 1 < ranks.size() && ranks[e + 1] == ranks[e] + 1) e++;
        s += (k ? ", " : "") + std::to_string(ranks[k]) + (e > k ? "-" + std::to_string(ranks[e]) : "");
        k = e + 1;
    }
    return s;
}

struct P2POp;
// A wait that passed its deadline: asks every rank for its state, names who did not arrive, and
// either reports (throws: main() aborts the job) or, when a lower-numbered rank is waiting too and
// will report, keeps answering until its abort ends this process.
[[noreturn]] inline void comm_timed_out(const CommGroup& g, int op, int n, MPI_Request* reqs, const P2POp* p2p,
                                        double waited_s, double bound_s);

// the simulated end of a request whose MPI requests have completed (the members' times are in)
inline double comm_link_done_s(const CommRequest& r) {
    if (r.op == COMM_P2P) return *std::max_element(r.times.begin(), r.times.end());
    return *std::max_element(r.times.begin(), r.times.end()) + r.cost_s;
}

// Completes n requests of an operation on group g within the deadline (p2p: the transfers, to
// name the peers of the incomplete ones; null for a collective). link: also waits for the simulated
// end of that request (which these are the MPI requests of), counted in the link's statistics.
inline void comm_wait(const CommGroup& g, int op, int n, MPI_Request* reqs, const P2POp* p2p = nullptr,
                      CommRequest* link = nullptr) {
    Comm& c = comm_world();
    int done = 0;
    mpiCheck(MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE));
    double mpi_done_s = 0;
    if (done) {
        if (!link) return;
        mpi_done_s = comm_now_s();
        link->done_s = comm_link_done_s(*link);
        if (mpi_done_s >= link->done_s) return;
    }
    const double t0 = comm_now_s(), bound = comm_bound_s(c);
    c.wait_t0 = t0;
    c.state.waiting = 1;
    c.state.op = op;
    c.state.group = g.id;
    c.state.bound_s = bound;
    for (;;) {
        if (!done) {
            mpiCheck(MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE));
            if (done && link) {
                mpi_done_s = comm_now_s();
                link->done_s = comm_link_done_s(*link);
            }
        }
        const double now = comm_now_s(), waited = now - t0;
        if (done && (!link || now >= link->done_s)) break;
        if (bound > 0 && waited > bound) comm_timed_out(g, op, n, reqs, p2p, waited, bound);
        if (waited > 0.001) comm_answer(c);
        if (done) {
            // Only the model's end is left, and no peer is needed for it: with a core per rank thread
            // (Comm::spin) the last COMM_SPIN_S before it spin. A sleep hands the core to any runnable
            // process and wakes late on a loaded machine (measured at load 4-5 on 2 cores: nanosleep
            // of 200 us returned after 275 us at the median, 1.4 ms at the 99th percentile, 16 ms at
            // most), late at each of the many small collectives of tensor and expert parallelism.
            // Longer, or where ranks share cores (a peer here computes), sleep.
            const double left = link->done_s - now - (c.spin ? COMM_SPIN_S : 0);
            const struct timespec ts = {0, (long)(std::min(left, 2e-4) * 1e9)};
            if (left > 0) nanosleep(&ts, nullptr);
        } else {
            comm_relax(waited);
        }
    }
    if (link && link->done_s > mpi_done_s) {
        c.sim.held++;
        c.sim.held_s += comm_now_s() - std::max(mpi_done_s, t0);
    }
    c.state.waiting = 0;
}
#endif

// Drives the MPI requests in flight between computations (MPI progresses them inside its calls).
inline void comm_progress() {
#ifdef LLMC_MPI
    Comm& c = comm_world();
    if (c.diag == MPI_COMM_NULL) return;
    int flag = 0;  // a probe of a tag nobody sends: only the progress engine's turn
    MPI_Iprobe(MPI_ANY_SOURCE, COMM_TAG_STATE + 1, c.diag, &flag, MPI_STATUS_IGNORE);
#endif
}

#ifdef LLMC_COMM_STREAM
// The comm stream's events (a request's done event; the NCCL watchdog's two per collective), reused:
// one goes back to the pool once the compute stream's wait on it is queued (a wait keeps the record
// it saw: a later record does not change it), the watchdog's once it has seen them complete (from
// its thread: hence the lock; taken alone, or inside the watchdog's).
struct CommEventPool {
    std::mutex mu;
    std::vector<cudaEvent_t> spare;
};
inline CommEventPool& comm_event_pool() {
    static CommEventPool p;
    return p;
}
inline cudaEvent_t comm_event_take() {
    CommEventPool& p = comm_event_pool();
    {
        std::lock_guard<std::mutex> lock(p.mu);
        if (!p.spare.empty()) {
            cudaEvent_t e = p.spare.back();
            p.spare.pop_back();
            return e;
        }
    }
    cudaEvent_t e;
    commCudaCheck(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
}
inline void comm_event_return(cudaEvent_t e) {
    CommEventPool& p = comm_event_pool();
    std::lock_guard<std::mutex> lock(p.mu);
    p.spare.push_back(e);
}
#endif

#ifdef LLMC_NCCL
// NCCL watchdog. An NCCL call only queues work on the comm stream: the host never waits inside
// it, so a thread keeps the deadline. Every buffer collective is bracketed by two events on the
// comm stream: `start` completes when the collective can begin (the compute it follows is done),
// `done` when it has finished. The thread polls the oldest pending collective (the stream runs
// them in order): its deadline counts from the moment its start is seen complete, so only the
// time the collective itself waits counts, never the compute queued before it; the bound is an
// MPI wait's (comm_bound_s when it was queued: the long-work factor included). It also polls
// ncclCommGetAsyncError of every communicator. On expiry or an async error it aborts every
// communicator (ncclCommAbort: the kernels stop) and ends this process with exit code 1, which
// makes the launcher end the job. NCCL does not tell which peer has not arrived: the message names
// the operation, the step and the group's ranks (every live rank of the group times out; ranks
// other than 0 wait 2 s before printing, as main() does, so the job usually shows one message).
// The host collectives (MPI) keep their own deadline and name the missing ranks (comm_wait).
struct NcclPending {
    cudaEvent_t start, done;
    int op, group;
    int64_t step;
    double bound_s, started_at_s = 0;
};
struct NcclWatchdog {
    std::mutex mu;  // pending and comms
    std::deque<NcclPending> pending;
    std::vector<ncclComm_t> comms;
    std::string ranks[COMM_N_GROUPS];  // the groups' world ranks (MPI is for the main thread only)
    std::thread thread;
    std::atomic<bool> stop{false};
    int device = 0;
};
inline NcclWatchdog& nccl_watchdog() {
    static NcclWatchdog w;
    return w;
}
inline void nccl_watchdog_watch(const CommGroup& g) {
    NcclWatchdog& w = nccl_watchdog();
    const std::string ranks = comm_rank_list(comm_world_ranks(g));
    std::lock_guard<std::mutex> lock(w.mu);
    w.ranks[g.id] = ranks;
    w.comms.push_back(g.nccl);
}
[[noreturn]] inline void nccl_watchdog_fire(const std::string& what) {
    NcclWatchdog& w = nccl_watchdog();
    const Comm& c = comm_world();
    for (ncclComm_t comm : w.comms) ncclCommAbort(comm);
    if (c.world_rank != 0) sleep(2);
    fprintf(stderr, "error (rank %d of %d): %s\n", c.world_rank, c.world_size, what.c_str());
    fflush(stderr);
    fflush(stdout);
    _exit(1);
}
inline void nccl_watchdog_loop() {
    NcclWatchdog& w = nccl_watchdog();
    if (cudaSetDevice(w.device) != cudaSuccess) return;
    const Comm& c = comm_world();
    while (!w.stop.load()) {
        const struct timespec ts = {0, 100000000L};
        nanosleep(&ts, nullptr);
        std::unique_lock<std::mutex> lock(w.mu);
        for (ncclComm_t comm : w.comms) {
            ncclResult_t r = ncclSuccess;
            if (ncclCommGetAsyncError(comm, &r) == ncclSuccess && r != ncclSuccess && r != ncclInProgress) {
                lock.unlock();
                nccl_watchdog_fire(strfmt("NCCL reported an asynchronous error %s: %s", comm_step_text(c.step).c_str(),
                                          ncclGetErrorString(r)));
            }
        }
        while (!w.pending.empty()) {
            NcclPending& p = w.pending.front();
            const cudaError_t done = cudaEventQuery(p.done);
            if (done == cudaSuccess) {
                comm_event_return(p.start);
                comm_event_return(p.done);
                w.pending.pop_front();
                continue;
            }
            if (done != cudaErrorNotReady) break;  // a CUDA error: the main thread's checks report it
            const double now = comm_now_s();
            if (p.started_at_s == 0 && cudaEventQuery(p.start) == cudaSuccess) p.started_at_s = now;
            if (p.started_at_s > 0 && p.bound_s > 0 && now - p.started_at_s > p.bound_s) {
                const std::string what = strfmt(
                    "comm timeout %s: NCCL %s on the %s group (world ranks %s) did not complete within %.0f s "
                    "(--comm_timeout %g%s): a rank of that group did not arrive (NCCL does not say which)",
                    comm_step_text(p.step).c_str(), comm_op_title(p.op), comm_group_name(p.group),
                    w.ranks[p.group].c_str(), now - p.started_at_s, c.timeout_s,
                    p.bound_s > c.timeout_s ? ", x10 for checkpoint I/O and the start-up" : "");
                lock.unlock();
                nccl_watchdog_fire(what);
            }
            break;
        }
    }
}
inline void nccl_watchdog_start() {
    NcclWatchdog& w = nccl_watchdog();
    if (w.thread.joinable()) return;
    cudaCheck(cudaGetDevice(&w.device));
    w.stop = false;
    w.thread = std::thread(nccl_watchdog_loop);
}
inline void nccl_watchdog_stop() {
    NcclWatchdog& w = nccl_watchdog();
    if (!w.thread.joinable()) return;
    w.stop = true;
    w.thread.join();
}
#endif

#ifdef LLMC_COMM_STREAM
// buffer collectives: the comm stream starts after the work queued so far on the compute stream;
// the request's own event marks the collective's end, and comm_finish makes the compute stream wait
// for it there, where the data is consumed (not right after the collective is queued). NCCL's
// collectives (several ranks) get two more events for the watchdog (it recycles those): the start
// event enter returns, and one after the collective; the loopback's have no peer to wait for and
// no watchdog (start null).
inline cudaEvent_t comm_stream_enter(Comm& c) {
    commCudaCheck(cudaEventRecord(c.compute_done, llmc_stream()));
    if (c.loop.skip_wait != COMM_SKIP_ENTER_WAIT) commCudaCheck(cudaStreamWaitEvent(c.stream, c.compute_done, 0));
#ifdef LLMC_NCCL
    if (c.world_size > 1) {
        cudaEvent_t start = comm_event_take();
        commCudaCheck(cudaEventRecord(start, c.stream));
        return start;
    }
#endif
    return nullptr;
}
inline void comm_stream_leave(Comm& c, cudaEvent_t start, const CommGroup& g, int op, CommRequest& r) {
    r.done = comm_event_take();
    commCudaCheck(cudaEventRecord(r.done, c.stream));
#ifdef LLMC_NCCL
    if (!start) return;
    cudaEvent_t done = comm_event_take();
    commCudaCheck(cudaEventRecord(done, c.stream));
    NcclWatchdog& w = nccl_watchdog();
    std::lock_guard<std::mutex> lock(w.mu);
    w.pending.push_back({start, done, op, g.id, c.step, comm_bound_s(c)});
#else
    (void)start;
    (void)g;
    (void)op;
#endif
}
// the compute stream waits for the collective's done event; a loopback collective's check follows
// (see "The loopback")
inline void comm_stream_finish(Comm& c, CommRequest& r) {
    if (c.loop.skip_wait != COMM_SKIP_FINISH_WAIT) commCudaCheck(cudaStreamWaitEvent(llmc_stream(), r.done, 0));
    comm_event_return(r.done);
    r.done = nullptr;
    if (r.seq == 0) return;
    comm_loopback_check<<<1, 1, 0, llmc_stream()>>>(c.loop.progress, r.seq);
    commCudaCheck(cudaGetLastError());
}
// The loopback's collective of a one-rank group (op; see "The loopback"): queued on the comm stream
// as NCCL's are, send's bytes to recv (in place when they are the same) behind the spin.
inline void comm_loopback_start(Comm& c, const CommGroup& g, int op, const void* send, void* recv, size_t bytes,
                                CommRequest& r) {
    CommLoopback& lb = c.loop;
    comm_loopback_setup(c);
    r.op = op;
    r.g = &g;
    r.bytes = 0;  // nothing leaves the rank
    r.start_s = comm_now_s();
    const bool in_place = send == recv;
    if (in_place && bytes > lb.staging_bytes) {  // (stream-ordered: the smaller one goes behind its last use)
        if (lb.staging) commCudaCheck(cudaFreeAsync(lb.staging, c.stream));
        commCudaCheck(cudaMallocAsync(&lb.staging, bytes, c.stream));
        lb.staging_bytes = bytes;
    }
    cudaEvent_t start = comm_stream_enter(c);
    // in place: the bytes as the collective starts, which it "writes" back after the spin
    if (in_place && bytes > 0)
        commCudaCheck(cudaMemcpyAsync(lb.staging, recv, bytes, cudaMemcpyDeviceToDevice, c.stream));
    comm_gpu_spin(c.stream, lb.delay_us);
    if (bytes > 0)
        commCudaCheck(cudaMemcpyAsync(recv, in_place ? lb.staging : send, bytes, cudaMemcpyDeviceToDevice, c.stream));
    r.seq = ++lb.issued;
    comm_loopback_mark<<<1, 1, 0, c.stream>>>(lb.progress, r.seq);
    commCudaCheck(cudaGetLastError());
    comm_stream_leave(c, start, g, op, r);
}
#endif

#ifdef LLMC_MPI
// The link's part of a collective's start: this rank's ready time to the members, beside the data
// (block_bytes: the rank block the cost is counted in).
inline void comm_link_start(Comm& c, const CommGroup& g, CommRequest& r, size_t block_bytes) {
    if (!c.link.on()) return;
    r.link = true;
    r.cost_s = sim_link_cost_s(c.link, r.op, g.size, block_bytes);
    const double ready = std::max(r.start_s, c.link_free_s);
    c.link_free_s = ready + r.cost_s;
    r.times.assign(g.size, 0.0);
    r.times[g.rank] = ready;
    r.reqs.emplace_back();
    mpiCheck(MPI_Iallgather(MPI_IN_PLACE, 1, MPI_DOUBLE, r.times.data(), 1, MPI_DOUBLE, g.mpi, &r.reqs.back()));
}
#endif

// Completes a started operation (a no-op for one that has nothing to finish): MPI waits for its
// requests and the link's end within the deadline; NCCL (and the loopback) makes the compute stream
// wait for it.
inline void comm_finish(CommRequest& r) {
    if (!r.active()) return;
    Comm& c = comm_world();
    const double wait_s = comm_now_s();
#ifdef LLMC_COMM_STREAM
    if (r.on_stream()) comm_stream_finish(c, r);  // NCCL's collectives, the loopback's
#endif
#if defined(LLMC_MPI) && !defined(LLMC_NCCL)
    if (!r.on_stream()) {
        comm_wait(*r.g, r.op, (int)r.reqs.size(), r.reqs.data(), r.p2p.empty() ? nullptr : r.p2p.data(),
                  r.link ? &r : nullptr);
        if (r.link) {
            c.sim.finished++;
            c.sim.model_s += r.cost_s;
            c.link_free_s = std::max(c.link_free_s, r.done_s);
        }
    }
#endif
    const double end_s = comm_now_s();
    if (c.trace) c.trace->push_back({r.op, r.g->id, r.bytes, r.start_s, r.link ? r.done_s : end_s, wait_s, end_s});
    r.op = -1;
}

// Whether a started operation has completed (the link's end included), without waiting: where it
// has, comm_finish returns at once. For a rank to act on it in an order of its own, e.g. to start
// the next queued reduction (llmc/gpt/hooks.h): MPI, yes (those run on communicators of their own,
// Comm::dp_reduce); NCCL, never true (one comm stream runs the collectives in the order of the
// calls, which must then be the same on every rank: COMM_ORDER_PER_COMMUNICATOR false).
#ifdef LLMC_NCCL
constexpr bool COMM_ORDER_PER_COMMUNICATOR = false;
#else
constexpr bool COMM_ORDER_PER_COMMUNICATOR = true;
#endif
inline bool comm_done_early(CommRequest& r) {
    if (!r.active()) return true;
    if (r.on_stream()) return false;  // (the loopback's too: the comm stream's order)
#if defined(LLMC_NCCL)
    return false;
#elif defined(LLMC_MPI)
    int done = 0;
    mpiCheck(MPI_Testall((int)r.reqs.size(), r.reqs.data(), &done, MPI_STATUSES_IGNORE));
    if (!done || !r.link) return done != 0;
    r.done_s = comm_link_done_s(r);
    return comm_now_s() >= r.done_s;
#else
    return true;
#endif
}

// recv[r * bytes ...] = rank r's send (bytes each). In place when send == recv + rank * bytes.
inline CommRequest all_gather_start(const CommGroup& g, const void* send, void* recv, size_t bytes) {
    Comm& c = comm_world();
    CommRequest r;
    if (g.size == 1) {  // callers gather in place or copy themselves (buffers may be device memory)
        LLMC_CHECK(send == recv, "all_gather on one rank must be in place");
#ifdef LLMC_COMM_STREAM
        if (comm_loopback_on()) comm_loopback_start(c, g, COMM_ALL_GATHER, send, recv, bytes, r);
#endif
        return r;
    }
    c.sent_bytes[COMM_ALL_GATHER] += bytes * (g.size - 1);
    c.recv_bytes[COMM_ALL_GATHER] += bytes * (g.size - 1);
    r.op = COMM_ALL_GATHER;
    r.g = &g;
    r.bytes = bytes * (g.size - 1);
    r.start_s = comm_now_s();
#if defined(LLMC_NCCL)
    cudaEvent_t start = comm_stream_enter(c);
    ncclCheck(ncclAllGather(send, recv, bytes, ncclInt8, g.nccl, c.stream));
    comm_stream_leave(c, start, g, COMM_ALL_GATHER, r);
#elif defined(LLMC_MPI)
    const bool in_place = send == (char*)recv + (size_t)g.rank * bytes;
    c.state.calls[g.id]++;
    r.reqs.emplace_back();
    mpiCheck(MPI_Iallgather(in_place ? MPI_IN_PLACE : send, mpi_count(bytes), MPI_BYTE, recv, mpi_count(bytes),
                            MPI_BYTE, g.mpi, &r.reqs[0]));
    comm_link_start(c, g, r, bytes);
#endif
    return r;
}
inline void all_gather(const CommGroup& g, const void* send, void* recv, size_t bytes) {
    CommRequest r = all_gather_start(g, send, recv, bytes);
    comm_finish(r);
}

// recv[r * bytes ...] = rank r's send[rank * bytes ...]: block r of send goes to rank r. skip_own:
// the rank's own block is left alone (the caller moves it, or computes it in place while the others
// are in flight: llmc/gpt/hooks.h's expert dispatch); the bytes counted are the same, none of them
// ever left the rank. stride (0: bytes): block r at send + r * stride and recv + r * stride (a slice
// of each rank's block).
inline CommRequest all_to_all_start(const CommGroup& g, const void* send, void* recv, size_t bytes,
                                    bool skip_own = false, size_t stride = 0) {
    if (stride == 0) stride = bytes;
    Comm& c = comm_world();
    if (g.size == 1 && skip_own) return CommRequest();
#ifdef LLMC_COMM_STREAM
    if (g.size == 1 && comm_loopback_on()) {  // a copy of send to recv
        CommRequest r;
        comm_loopback_start(c, g, COMM_ALL_TO_ALL, send, recv, bytes, r);
        return r;
    }
#endif
    LLMC_CHECK(g.size > 1, "all_to_all on one rank: the caller uses its own data");
    c.sent_bytes[COMM_ALL_TO_ALL] += bytes * (g.size - 1);
    c.recv_bytes[COMM_ALL_TO_ALL] += bytes * (g.size - 1);
    CommRequest r;
    r.op = COMM_ALL_TO_ALL;
    r.g = &g;
    r.bytes = bytes * (g.size - 1);
    r.start_s = comm_now_s();
#if defined(LLMC_NCCL)
    cudaEvent_t start = comm_stream_enter(c);
    ncclCheck(ncclGroupStart());
    for (int k = 0; k < g.size; k++) {
        if (skip_own && k == g.rank) continue;
        ncclCheck(ncclSend((const char*)send + (size_t)k * stride, bytes, ncclInt8, k, g.nccl, c.stream));
        ncclCheck(ncclRecv((char*)recv + (size_t)k * stride, bytes, ncclInt8, k, g.nccl, c.stream));
    }
    ncclCheck(ncclGroupEnd());
    comm_stream_leave(c, start, g, COMM_ALL_TO_ALL, r);
#elif defined(LLMC_MPI)
    c.state.calls[g.id]++;
    r.reqs.emplace_back();
    if (skip_own || stride != bytes) {
        // (the count and displacement arrays must live until the operation completes)
        r.counts.assign(g.size, mpi_count(bytes));
        if (skip_own) r.counts[g.rank] = 0;
        r.displs.resize(g.size);
        for (int k = 0; k < g.size; k++) r.displs[k] = mpi_count((size_t)k * stride);
        mpiCheck(MPI_Ialltoallv(send, r.counts.data(), r.displs.data(), MPI_BYTE, recv, r.counts.data(),
                                r.displs.data(), MPI_BYTE, g.mpi, &r.reqs[0]));
    } else {
        mpiCheck(MPI_Ialltoall(send, mpi_count(bytes), MPI_BYTE, recv, mpi_count(bytes), MPI_BYTE, g.mpi, &r.reqs[0]));
    }
    comm_link_start(c, g, r, bytes);
#else
    (void)send;
    (void)recv;
#endif
    return r;
}
inline void all_to_all(const CommGroup& g, const void* send, void* recv, size_t bytes) {
    CommRequest r = all_to_all_start(g, send, recv, bytes);
    comm_finish(r);
}

#ifdef LLMC_MPI
// how long a timed-out rank waits for the others' answers (a short timeout, in tests: shorter)
inline double comm_probe_s(const Comm& c) { return std::min(COMM_PROBE_S, std::max(1.0, c.timeout_s)); }
// Every other rank's state: asks them all and collects the answers for up to COMM_PROBE_S,
// answering the others' questions meanwhile. answered[r]: rank r answered (this rank counts as).
inline std::vector<CommRankState> comm_ask_all(Comm& c, std::vector<char>& answered) {
    const int n = c.world_size;
    std::vector<CommRankState> st(n);
    answered.assign(n, 0);
    st[c.world_rank] = c.state;
    st[c.world_rank].step = c.step;
    st[c.world_rank].waited_s = comm_now_s() - c.wait_t0;
    answered[c.world_rank] = 1;
    static int token = 0;  // the question has no content; a static buffer outlives the sends
    std::vector<MPI_Request> ask(n, MPI_REQUEST_NULL), answer(n, MPI_REQUEST_NULL);
    for (int r = 0; r < n; r++) {
        if (r == c.world_rank) continue;
        // errors are ignored here: a lost rank is what is being diagnosed
        MPI_Isend(&token, 1, MPI_INT, r, COMM_TAG_ASK, c.diag, &ask[r]);
        MPI_Irecv(&st[r], sizeof(CommRankState), MPI_BYTE, r, COMM_TAG_STATE, c.diag, &answer[r]);
    }
    const double t0 = comm_now_s(), probe = comm_probe_s(c);
    int missing = n - 1;
    while (missing > 0 && comm_now_s() - t0 < probe) {
        for (int r = 0; r < n; r++) {
            if (answered[r]) continue;
            int flag = 0;
            if (MPI_Test(&answer[r], &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag) answered[r] = 1, missing--;
        }
        comm_answer(c);
        comm_relax(0.5);
    }
    for (MPI_Request& r : ask) if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
    // the unanswered receives stay posted: this process is about to end
    return st;
}

inline void comm_timed_out(const CommGroup& g, int op, int n, MPI_Request* reqs, const P2POp* p2p, double waited_s,
                           double bound_s) {
    Comm& c = comm_world();
    const std::vector<int> members = comm_world_ranks(g);
    // who is missing from this operation, in world ranks
    std::vector<int> absent;
    if (p2p) {  // the peers of the transfers that have not completed (a completed request tests as done)
        for (int k = 0; k < n; k++) {
            int flag = 0;
            MPI_Test(&reqs[k], &flag, MPI_STATUS_IGNORE);
            const int peer = p2p[k].peer >= 0 && p2p[k].peer < g.size ? members[p2p[k].peer] : -1;
            if (!flag && peer >= 0 && std::find(absent.begin(), absent.end(), peer) == absent.end()) absent.push_back(peer);
        }
    }
    std::vector<char> answered;
    const std::vector<CommRankState> st = comm_ask_all(c, answered);
    if (!p2p) {  // a collective: the members that have not entered it (as many calls on the group as this rank)
        for (int r : members)
            if (r != c.world_rank && (!answered[r] || st[r].calls[g.id] < c.state.calls[g.id])) absent.push_back(r);
    }
    std::sort(absent.begin(), absent.end());
    const double probe = comm_probe_s(c);
    auto describe = [&](int r) {
        if (!answered[r]) return strfmt("rank %d (not responding within %.0f s: stopped, hung, or its node is gone)", r, probe);
        const CommRankState& s = st[r];
        return strfmt("rank %d (waiting in %s on the %s group %s for %.1f s)", r, comm_op_title(s.op),
                      comm_group_name(s.group), comm_step_text(s.step).c_str(), s.waited_s);
    };
    std::string msg = strfmt("comm timeout %s: %s on the %s group (world ranks %s) did not complete within %.0f s "
                             "(--comm_timeout %g%s)", comm_step_text(c.step).c_str(), comm_op_title(op),
                             comm_group_name(g.id), comm_rank_list(members).c_str(), waited_s, c.timeout_s,
                             bound_s > c.timeout_s ? strfmt(", x%g for checkpoint I/O and the start-up",
                                                            COMM_LONG_WORK_FACTOR).c_str() : "");
    if (absent.empty()) {
        msg += "; every rank of the group has arrived (the transport itself is stuck)";
    } else {
        msg += "; did not arrive:";
        for (size_t k = 0; k < absent.size(); k++) msg += (k ? ", " : " ") + describe(absent[k]);
    }
    std::vector<int> silent;  // the ones not named yet: where a chain of waits ends
    for (int r = 0; r < c.world_size; r++)
        if (!answered[r] && std::find(absent.begin(), absent.end(), r) == absent.end()) silent.push_back(r);
    if (!silent.empty())
        msg += strfmt("; not responding within %.0f s: rank%s %s (stopped, hung, or its node is gone)", probe,
                      silent.size() > 1 ? "s" : "", comm_rank_list(silent).c_str());
    // one message: a lower-numbered rank that waits too reports instead (it times out at most its
    // remaining time later, then asks for COMM_PROBE_S); this rank answers until that abort ends it
    int reporter = c.world_rank;
    for (int r = 0; r < c.world_rank; r++)
        if (answered[r] && st[r].waiting) { reporter = r; break; }
    if (reporter != c.world_rank) {
        const CommRankState& s = st[reporter];
        const double grace = std::max(0.0, s.bound_s - s.waited_s) + 2 * COMM_PROBE_S + 10;
        for (const double t0 = comm_now_s(); comm_now_s() - t0 < grace;) {
            comm_answer(c);
            comm_relax(1);
        }
    }
    LLMC_FAIL("%s", msg.c_str());
}
#endif

// Point-to-point transfers (P2POp: a send or a receive of bytes at buf, with the peer's rank in the
// group; tag tells transfers between the same two ranks apart), posted at once. The request
// completes when all have: a send once its bytes have left the buffer (MPI: its peer has received
// them), a receive once they have arrived. p2p_group is the blocking form.
inline CommRequest p2p_start(const CommGroup& g, const std::vector<P2POp>& ops) {
    Comm& c = comm_world();
    CommRequest r;
    if (ops.empty()) return r;
    for (const P2POp& op : ops) {
        LLMC_CHECK(op.peer >= 0 && op.peer < g.size && op.peer != g.rank, "p2p: peer %d is not another rank of the group (%d ranks)",
                   op.peer, g.size);
        (op.send ? c.sent_bytes : c.recv_bytes)[COMM_P2P] += op.bytes;
        if (op.send) r.bytes += op.bytes;
    }
    r.op = COMM_P2P;
    r.g = &g;
    r.start_s = comm_now_s();
#if defined(LLMC_NCCL)
    cudaEvent_t start = comm_stream_enter(c);
    ncclCheck(ncclGroupStart());
    for (const P2POp& op : ops) {
        if (op.send) ncclCheck(ncclSend(op.buf, op.bytes, ncclInt8, op.peer, g.nccl, c.stream));
        else ncclCheck(ncclRecv(op.buf, op.bytes, ncclInt8, op.peer, g.nccl, c.stream));
    }
    ncclCheck(ncclGroupEnd());
    comm_stream_leave(c, start, g, COMM_P2P, r);
#elif defined(LLMC_MPI)
    const size_t n = ops.size();
    r.link = c.link.on();
    r.reqs.resize(r.link ? 2 * n : n);
    r.p2p = ops;
    for (size_t k = 0; k < n; k++) {
        const P2POp& op = ops[k];
        if (op.send) mpiCheck(MPI_Isend(op.buf, mpi_count(op.bytes), MPI_BYTE, op.peer, op.tag, g.mpi, &r.reqs[k]));
        else mpiCheck(MPI_Irecv(op.buf, mpi_count(op.bytes), MPI_BYTE, op.peer, op.tag, g.mpi, &r.reqs[k]));
    }
    if (r.link) {  // each send's end on this rank's link, to its receiver (same tag: matched after the data)
        r.times.assign(n, 0.0);
        r.p2p.insert(r.p2p.end(), ops.begin(), ops.end());
        for (size_t k = 0; k < n; k++) {
            const P2POp& op = ops[k];
            if (op.send) {
                const double cost = sim_link_cost_s(c.link, COMM_P2P, 2, op.bytes);
                r.times[k] = std::max(r.start_s, c.link_free_s) + cost;
                c.link_free_s = r.times[k];
                r.cost_s += cost;
                mpiCheck(MPI_Isend(&r.times[k], 1, MPI_DOUBLE, op.peer, op.tag, g.mpi, &r.reqs[n + k]));
            } else {
                mpiCheck(MPI_Irecv(&r.times[k], 1, MPI_DOUBLE, op.peer, op.tag, g.mpi, &r.reqs[n + k]));
            }
        }
    }
#else
    LLMC_FAIL("p2p: a transfer in a single-process build");
#endif
    return r;
}
// Whether a send may stay in flight while the receives posted after it complete. MPI: yes (each is
// its own request). NCCL: no, the comm stream runs operations in order, so a send queued alone
// would hold back the receives behind it (two stages that each send to the other first would wait
// for each other): a pipeline group's sends and receives go in one ncclGroup, as one request.
#ifdef LLMC_NCCL
constexpr bool COMM_SENDS_IN_FLIGHT = false;
#else
constexpr bool COMM_SENDS_IN_FLIGHT = true;
#endif
inline void p2p_group(const CommGroup& g, const std::vector<P2POp>& ops) {
    CommRequest r = p2p_start(g, ops);
    comm_finish(r);
}

// root's buf to every rank of the group
inline void broadcast(const CommGroup& g, void* buf, size_t bytes, int root) {
    Comm& c = comm_world();
    if (g.size == 1) {
#ifdef LLMC_COMM_STREAM
        if (comm_loopback_on()) {
            CommRequest r;
            comm_loopback_start(c, g, COMM_BROADCAST, buf, buf, bytes, r);
            comm_finish(r);
        }
#endif
        return;
    }
    c.sent_bytes[COMM_BROADCAST] += g.rank == root ? bytes * (g.size - 1) : 0;
    c.recv_bytes[COMM_BROADCAST] += g.rank == root ? 0 : bytes;
    CommRequest r;
    r.op = COMM_BROADCAST;
    r.g = &g;
    r.bytes = g.rank == root ? bytes * (g.size - 1) : 0;
    r.start_s = comm_now_s();
#if defined(LLMC_NCCL)
    cudaEvent_t start = comm_stream_enter(c);
    ncclCheck(ncclBroadcast(buf, buf, bytes, ncclInt8, root, g.nccl, c.stream));
    comm_stream_leave(c, start, g, COMM_BROADCAST, r);
#elif defined(LLMC_MPI)
    c.state.calls[g.id]++;
    r.reqs.emplace_back();
    mpiCheck(MPI_Ibcast(buf, mpi_count(bytes), MPI_BYTE, root, g.mpi, &r.reqs[0]));
    comm_link_start(c, g, r, bytes);
#else
    (void)buf;
#endif
    comm_finish(r);
}

// all_gather of host memory (scalars, flags, hashes), in every build
inline void host_all_gather(const CommGroup& g, const void* send, void* recv, size_t bytes) {
    Comm& c = comm_world();
    if (g.size == 1) {
        memmove(recv, send, bytes);
        return;
    }
    c.sent_bytes[COMM_HOST] += bytes * (g.size - 1);
    c.recv_bytes[COMM_HOST] += bytes * (g.size - 1);
#ifdef LLMC_MPI
    MPI_Request req;
    c.state.calls[g.id]++;
    mpiCheck(MPI_Iallgather(send, mpi_count(bytes), MPI_BYTE, recv, mpi_count(bytes), MPI_BYTE, g.mpi, &req));
    comm_wait(g, COMM_HOST, 1, &req);
#endif
}

// the value every rank of the group passed, in rank order
template <typename T>
inline std::vector<T> host_gather_all(const CommGroup& g, const T& value) {
    std::vector<T> out(g.size);
    host_all_gather(g, &value, out.data(), sizeof(T));
    return out;
}

inline void barrier(const CommGroup& g) {
    if (g.size == 1) return;
#ifdef LLMC_NCCL
    llmc_stream_sync();
#endif
#ifdef LLMC_MPI
    MPI_Request req;
    comm_world().state.calls[g.id]++;
    mpiCheck(MPI_Ibarrier(g.mpi, &req));
    comm_wait(g, COMM_BARRIER, 1, &req);
#endif
}

inline void comm_reset_counters(Comm& c) {
    for (int k = 0; k < COMM_N_OPS; k++) c.sent_bytes[k] = c.recv_bytes[k] = 0;
}
