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
//                   for the comm stream with another event.
// "buffer" calls take memory where the model's buffers live (device memory in the GPU build);
// "host" calls take host memory (losses, norms, checksums, flags) and always go through MPI.
//
// Failure: comm_abort() stops every rank (ncclCommAbort, then MPI_Abort); main() calls it on any
// error, so one rank's error ends the job with that rank named instead of leaving the others
// waiting in a collective.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <unistd.h>
#include "utils.h"
#ifdef LLMC_MPI
#include <mpi.h>
#endif
#ifdef LLMC_NCCL
#include <nccl.h>
#endif
#if !defined(LLMC_CPU) && defined(LLMC_MPI)
#include "cuda_common.cuh"  // the CUDA build under mpirun: each rank picks its GPU in comm_init
#endif

// what the byte counters are kept by
enum CommOp { COMM_ALL_GATHER = 0, COMM_ALL_TO_ALL, COMM_BROADCAST, COMM_P2P, COMM_HOST, COMM_N_OPS };
inline const char* comm_op_name(int op) {
    static const char* names[] = {"all_gather", "all_to_all", "broadcast", "send/recv", "host (scalars)"};
    return names[op];
}

struct CommGroup {
    int rank = 0, size = 1;
#ifdef LLMC_MPI
    MPI_Comm mpi = MPI_COMM_NULL;
#endif
#ifdef LLMC_NCCL
    ncclComm_t nccl = nullptr;
#endif
};

struct Comm {
    int world_rank = 0, world_size = 1;
    int stage = 0, n_stages = 1;  // this rank's pipeline stage, of pp
    CommGroup world, dp, pp, tp;
    CommGroup ep, edp;  // expert parallel: the dp ranks that share out an MoE layer's experts, and the
                        // ranks (one per ep group) that hold the same experts (their data parallelism)
    CommGroup tp_kv;  // the tp ranks that share a kv head (--tp > n_kv_head): they sum its gradients
    uint64_t sent_bytes[COMM_N_OPS] = {}, recv_bytes[COMM_N_OPS] = {};
    bool initialized = false;
#ifdef LLMC_NCCL
    cudaStream_t stream = nullptr;
    cudaEvent_t compute_done = nullptr, comm_done = nullptr;
#endif
};

// The process's communicator (one per process; main() aborts through it on errors).
inline Comm& comm_world() {
    static Comm c;
    return c;
}

inline const char* comm_backend_name() {
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

// Starts the process's part of the job: MPI_Init (when built with MPI), the world group.
inline Comm& comm_init(int* argc, char*** argv) {
    Comm& c = comm_world();
    if (c.initialized) return c;
#ifdef LLMC_MPI
    mpiCheck(MPI_Init(argc, argv));
    // errors come back as codes (mpiCheck turns them into LlmcError, main aborts the job)
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    mpiCheck(MPI_Comm_rank(MPI_COMM_WORLD, &c.world_rank));
    mpiCheck(MPI_Comm_size(MPI_COMM_WORLD, &c.world_size));
    c.world.mpi = MPI_COMM_WORLD;
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
        int local_rank = 0, n_dev = 0;
        mpiCheck(MPI_Comm_rank(node, &local_rank));
        MPI_Comm_free(&node);
        cudaCheck(cudaGetDeviceCount(&n_dev));
        LLMC_CHECK(n_dev > 0, "rank %d sees no GPU", c.world_rank);
        cudaCheck(cudaSetDevice(local_rank % n_dev));
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
    c.world.rank = c.world_rank;
    c.world.size = c.world_size;
    c.initialized = true;
    return c;
}

#ifdef LLMC_NCCL
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
#ifdef LLMC_NCCL
    if (c.world_size > 1) {
        // (the process's GPU was chosen in comm_init)
        for (CommGroup* g : {&c.dp, &c.pp, &c.tp, &c.ep, &c.edp})
            if (g->size > 1) nccl_group_init(*g);
        cudaCheck(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking));
        cudaCheck(cudaEventCreateWithFlags(&c.compute_done, cudaEventDisableTiming));
        cudaCheck(cudaEventCreateWithFlags(&c.comm_done, cudaEventDisableTiming));
    }
#endif
}

// The tp ranks that read one kv head when --tp exceeds n_kv_head (kv_share of them, consecutive):
// the model's config decides it, so it is made once the config is final (collective over the world).
inline void comm_make_kv_group(Comm& c, int kv_share) {
    LLMC_CHECK(kv_share >= 1 && c.tp.size % kv_share == 0, "internal: %d ranks sharing a kv head in --tp %d", kv_share,
               c.tp.size);
    c.tp_kv.rank = c.tp.rank % kv_share;
    c.tp_kv.size = kv_share;
#ifdef LLMC_MPI
    if (c.world_size > 1) {
        mpiCheck(MPI_Comm_split(MPI_COMM_WORLD, c.world_rank / kv_share, c.tp_kv.rank, &c.tp_kv.mpi));
        MPI_Comm_set_errhandler(c.tp_kv.mpi, MPI_ERRORS_RETURN);
    } else {
        c.tp_kv.mpi = MPI_COMM_WORLD;
    }
#endif
#ifdef LLMC_NCCL
    if (kv_share > 1) nccl_group_init(c.tp_kv);
#endif
}

// Ranks per node as the launcher reports them (0: unknown): a tensor-parallel group should not
// span nodes, its collectives are on the critical path of every layer.
inline int launcher_local_size() {
    for (const char* var : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE"}) {
        const char* v = getenv(var);
        if (v && atoi(v) > 0) return atoi(v);
    }
    return 0;
}

inline void comm_finalize() {
    Comm& c = comm_world();
    if (!c.initialized) return;
#ifdef LLMC_NCCL
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
    for (CommGroup* g : {&c.dp, &c.pp, &c.tp, &c.tp_kv, &c.ep, &c.edp})
        if (g->nccl) ncclCommAbort(g->nccl);
#endif
#ifdef LLMC_MPI
    if (c.initialized && c.world_size > 1) MPI_Abort(MPI_COMM_WORLD, code);
#endif
    (void)c;
    (void)code;
}

#ifdef LLMC_NCCL
// buffer collectives: the comm stream starts after the work queued so far on the compute stream,
// and the compute stream continues after the collective
inline void comm_stream_enter(Comm& c) {
    cudaCheck(cudaEventRecord(c.compute_done, llmc_stream()));
    cudaCheck(cudaStreamWaitEvent(c.stream, c.compute_done, 0));
}
inline void comm_stream_leave(Comm& c) {
    cudaCheck(cudaEventRecord(c.comm_done, c.stream));
    cudaCheck(cudaStreamWaitEvent(llmc_stream(), c.comm_done, 0));
}
#endif

// recv[r * bytes ...] = rank r's send (bytes each). In place when send == recv + rank * bytes.
inline void all_gather(const CommGroup& g, const void* send, void* recv, size_t bytes) {
    Comm& c = comm_world();
    if (g.size == 1) {  // callers gather in place or copy themselves (buffers may be device memory)
        LLMC_CHECK(send == recv, "all_gather on one rank must be in place");
        return;
    }
    c.sent_bytes[COMM_ALL_GATHER] += bytes * (g.size - 1);
    c.recv_bytes[COMM_ALL_GATHER] += bytes * (g.size - 1);
#if defined(LLMC_NCCL)
    comm_stream_enter(c);
    ncclCheck(ncclAllGather(send, recv, bytes, ncclInt8, g.nccl, c.stream));
    comm_stream_leave(c);
#elif defined(LLMC_MPI)
    const bool in_place = send == (char*)recv + (size_t)g.rank * bytes;
    mpiCheck(MPI_Allgather(in_place ? MPI_IN_PLACE : send, mpi_count(bytes), MPI_BYTE, recv, mpi_count(bytes),
                           MPI_BYTE, g.mpi));
#endif
}

// recv[r * bytes ...] = rank r's send[rank * bytes ...]: block r of send goes to rank r.
inline void all_to_all(const CommGroup& g, const void* send, void* recv, size_t bytes) {
    Comm& c = comm_world();
    LLMC_CHECK(g.size > 1, "all_to_all on one rank: the caller uses its own data");
    c.sent_bytes[COMM_ALL_TO_ALL] += bytes * (g.size - 1);
    c.recv_bytes[COMM_ALL_TO_ALL] += bytes * (g.size - 1);
#if defined(LLMC_NCCL)
    comm_stream_enter(c);
    ncclCheck(ncclGroupStart());
    for (int r = 0; r < g.size; r++) {
        ncclCheck(ncclSend((const char*)send + (size_t)r * bytes, bytes, ncclInt8, r, g.nccl, c.stream));
        ncclCheck(ncclRecv((char*)recv + (size_t)r * bytes, bytes, ncclInt8, r, g.nccl, c.stream));
    }
    ncclCheck(ncclGroupEnd());
    comm_stream_leave(c);
#elif defined(LLMC_MPI)
    mpiCheck(MPI_Alltoall(send, mpi_count(bytes), MPI_BYTE, recv, mpi_count(bytes), MPI_BYTE, g.mpi));
#else
    (void)send;
    (void)recv;
#endif
}

// One group of point-to-point transfers (a pipeline's sends and receives between two computations):
// every transfer is posted at once and the call returns when all have completed. A send completes
// once its peer has posted the matching receive (the peer is in its own group at that moment), so
// no buffer is still in flight after the call. tag tells transfers between the same two ranks apart.
struct P2POp {
    bool send;
    void* buf;
    size_t bytes;
    int peer, tag;
};
inline void p2p_group(const CommGroup& g, const std::vector<P2POp>& ops) {
    Comm& c = comm_world();
    if (ops.empty()) return;
    for (const P2POp& op : ops) {
        LLMC_CHECK(op.peer >= 0 && op.peer < g.size && op.peer != g.rank, "p2p: peer %d is not another rank of the group (%d ranks)",
                   op.peer, g.size);
        (op.send ? c.sent_bytes : c.recv_bytes)[COMM_P2P] += op.bytes;
    }
#if defined(LLMC_NCCL)
    comm_stream_enter(c);
    ncclCheck(ncclGroupStart());
    for (const P2POp& op : ops) {
        if (op.send) ncclCheck(ncclSend(op.buf, op.bytes, ncclInt8, op.peer, g.nccl, c.stream));
        else ncclCheck(ncclRecv(op.buf, op.bytes, ncclInt8, op.peer, g.nccl, c.stream));
    }
    ncclCheck(ncclGroupEnd());
    comm_stream_leave(c);
#elif defined(LLMC_MPI)
    std::vector<MPI_Request> req(ops.size());
    for (size_t k = 0; k < ops.size(); k++) {
        const P2POp& op = ops[k];
        if (op.send) mpiCheck(MPI_Isend(op.buf, mpi_count(op.bytes), MPI_BYTE, op.peer, op.tag, g.mpi, &req[k]));
        else mpiCheck(MPI_Irecv(op.buf, mpi_count(op.bytes), MPI_BYTE, op.peer, op.tag, g.mpi, &req[k]));
    }
    mpiCheck(MPI_Waitall((int)req.size(), req.data(), MPI_STATUSES_IGNORE));
#else
    LLMC_FAIL("p2p: a transfer in a single-process build");
#endif
}

// root's buf to every rank of the group
inline void broadcast(const CommGroup& g, void* buf, size_t bytes, int root) {
    Comm& c = comm_world();
    if (g.size == 1) return;
    c.sent_bytes[COMM_BROADCAST] += g.rank == root ? bytes * (g.size - 1) : 0;
    c.recv_bytes[COMM_BROADCAST] += g.rank == root ? 0 : bytes;
#if defined(LLMC_NCCL)
    comm_stream_enter(c);
    ncclCheck(ncclBroadcast(buf, buf, bytes, ncclInt8, root, g.nccl, c.stream));
    comm_stream_leave(c);
#elif defined(LLMC_MPI)
    mpiCheck(MPI_Bcast(buf, mpi_count(bytes), MPI_BYTE, root, g.mpi));
#else
    (void)buf;
#endif
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
    mpiCheck(MPI_Allgather(send, mpi_count(bytes), MPI_BYTE, recv, mpi_count(bytes), MPI_BYTE, g.mpi));
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
    cudaCheck(cudaStreamSynchronize(llmc_stream()));
#endif
#ifdef LLMC_MPI
    mpiCheck(MPI_Barrier(g.mpi));
#endif
}

inline void comm_reset_counters(Comm& c) {
    for (int k = 0; k < COMM_N_OPS; k++) c.sent_bytes[k] = c.recv_bytes[k] = 0;
}
