// Tensor parallelism (Megatron-LM, Shoeybi et al. 2019; sequence parallelism: Korthikanti et al.
// 2022): the reductions a split layer needs, in an order that does not depend on the split.
//
// A tensor-parallel group of T ranks splits a dimension of each layer (heads, FFN hidden units,
// vocabulary rows) into T slices. Where the split dimension is summed over (the input dimension of
// a row-parallel matmul, the output dimension of a column-parallel one in the backward, the
// vocabulary in the softmax, the tokens of a sequence-parallel LayerNorm's weight gradient), each
// rank computes a partial sum and the group adds the partials. Float addition is not associative,
// so a plain "local sum, then all-reduce" gives different bits for every T.
//
// Canonical chunks. The summed dimension is cut into G fixed chunks, the chunks are summed in a
// fixed binary tree (a node of leaves [lo, hi) adds [lo, mid) and [mid, hi), mid = lo + (hi - lo) / 2),
// and every layout computes exactly that tree. G is a multiple of every tp the model admits (the
// lcm of them, tp_chunk_count in train_gpt.cu; for the tokens of a micro-batch its gcd with B*T),
// so any of them gives each rank G / T whole leaves:
//   one process           all G leaves, the whole tree
//   T ranks               rank r computes the maximal tree nodes inside its leaves [r G/T, (r+1) G/T)
//                         (one node when its leaves are a subtree, as for T a power of two dividing
//                         G; e.g. two for T 3 of G 6), the group adds the ranks' nodes with the tree's
//                         remaining levels
// Each leaf is one matmul (or one sum) over the same inputs in the same order in every layout, so
// the result is bitwise the one-process result for every T (the CPU build). The GPU build uses G = T
// (one leaf per rank, no extra buffers): its matmuls are not bitwise across shapes anyway.
//
// The group's reduction is an all-to-all of 1/T blocks of each node (as many as the rank with the
// most nodes holds) and the tree's top levels over the received blocks (no float sum inside MPI or
// NCCL, as llmc/parallel/zero.h's reduce_scatter_add), then, for an all-reduce, an all-gather of the summed
// blocks: with one node per rank the bytes of a ring all-reduce, 2 (T-1)/T of the buffer.
#pragma once
#include <algorithm>
#include <cstddef>
#include <vector>
#include "llmc/parallel/comm.h"
#include "llmc/utils.h"

constexpr int TP_MAX_LEVELS = 16;  // the tree's depth bound: up to 2^16 chunks

// The leaves a rank computes: chunks [first, first + count) of `chunks`, each `units` units wide.
struct ChunkSplit {
    int first = 0, count = 1, chunks = 1;
    long units = 0;  // per leaf
};
// units: the whole dimension (over all ranks, a multiple of `chunks`, which tp divides); the rank's
// slice = units / tp. canonical false (the GPU build, or a plan for it): one leaf per rank.
inline ChunkSplit chunk_split(long units, int chunks, int tp, int tp_rank, bool canonical) {
    if (!canonical) chunks = tp;
    LLMC_CHECK(chunks % tp == 0 && units % chunks == 0, "internal: %ld units in %d canonical chunks over %d ranks", units,
               chunks, tp);
    ChunkSplit s;
    s.chunks = chunks;
    s.count = chunks / tp;
    s.first = tp_rank * s.count;
    s.units = units / chunks;
    return s;
}

// The rank's part as one leaf: for sums whose result does not depend on the order (a maximum, a
// sum with one non-zero term per element).
inline ChunkSplit rank_leaf(const CommGroup& g) {
    ChunkSplit s;
    s.first = g.rank;
    s.chunks = g.size;
    return s;
}

// the tree (see the top of the file): its split point, its depth over `count` leaves (the
// temporaries of tree_sum), and the maximal nodes inside leaves [a, b), left to right
inline int tree_mid(int lo, int hi) { return lo + (hi - lo) / 2; }
inline int tree_levels(int count) {
    int l = 0;
    while ((1 << l) < count) l++;
    return l;
}
struct TreeNode {
    int lo, hi;
};
inline void tree_nodes(int lo, int hi, int a, int b, std::vector<TreeNode>& out) {
    if (b <= lo || hi <= a) return;
    if (a <= lo && hi <= b) {
        out.push_back({lo, hi});
        return;
    }
    const int mid = tree_mid(lo, hi);
    tree_nodes(lo, mid, a, b, out);
    tree_nodes(mid, hi, a, b, out);
}
inline std::vector<TreeNode> rank_nodes(const ChunkSplit& s) {
    std::vector<TreeNode> out;
    tree_nodes(0, s.chunks, s.first, s.first + s.count, out);
    return out;
}
// the most nodes a rank of the split's group holds (the group's reduction sends that many blocks)
inline int split_nodes(const ChunkSplit& s) {
    int most = 0;
    for (int first = 0; first < s.chunks; first += s.count) {
        ChunkSplit r = s;
        r.first = first;
        most = std::max(most, (int)rank_nodes(r).size());
    }
    return most;
}

// Scratch of one element type for the reductions: the tree's temporaries, the partial of a
// reduce-scatter, the extra nodes a rank sends (nodes - 1 of `capacity` each) and the receive
// buffer (nodes x capacity; a small vector's gather: nodes x T x its size).
template <typename T>
struct TpScratch {
    T* tmp[TP_MAX_LEVELS] = {};
    T *part = nullptr, *extra = nullptr, *recv = nullptr;
    size_t capacity = 0, recv_capacity = 0;
    int levels = 0, nodes = 1;
};

// dst[n] = the tree over leaves [lo, hi); leaf(k, out) overwrites out[n] with leaf k's value,
// add(a, b, n) does a += b.
template <typename T, typename Leaf, typename Add>
void tree_sum(T* dst, size_t n, int lo, int hi, T* const* tmp, const Leaf& leaf, const Add& add) {
    if (hi - lo == 1) {
        leaf(lo, dst);
        return;
    }
    const int mid = tree_mid(lo, hi);
    tree_sum(dst, n, lo, mid, tmp + 1, leaf, add);
    tree_sum(tmp[0], n, mid, hi, tmp + 1, leaf, add);
    add(dst, tmp[0], n);
}

// The tree over [lo, hi) from received nodes that tile it, in place: got(lo, hi) is the buffer of a
// received node (nullptr for a node that is not one); returns the buffer that holds the sum.
template <typename T, typename Got, typename Add>
T* tree_combine(int lo, int hi, size_t n, const Got& got, const Add& add) {
    if (T* b = got(lo, hi)) return b;
    LLMC_CHECK(hi - lo > 1, "internal: canonical leaf %d was received from no rank", lo);
    const int mid = tree_mid(lo, hi);
    T* a = tree_combine<T>(lo, mid, n, got, add);
    add(a, tree_combine<T>(mid, hi, n, got, add), n);
    return a;
}

// A reduction in flight (tp_sum_start .. tp_sum_finish): the exchange of the rank's nodes, then
// for an all-reduce the all-gather of the summed blocks. Between the two calls the caller computes
// what does not read dst (Wang et al. 2022, "Overlap communication with dependent computation via
// decomposition": a backward's weight gradients behind its input gradient's reduction, the other
// half of the micro-batch behind one half's); tp_sum_advance between two pieces of that work moves
// the reduction to its all-gather. The scratch's part, extra and recv are the reduction's until it
// finishes; dst is written until then.
template <typename T>
struct TpSumPending {
    const CommGroup* g = nullptr;
    ChunkSplit split;
    T* dst = nullptr;
    size_t n = 0;
    bool all_reduce = false;
    T* recv = nullptr;                  // the scratch's receive buffer it uses
    std::vector<CommRequest> exchange;  // one per node (empty: nothing in flight)
    CommRequest gather;                 // the all-reduce's all-gather
};

// The group's sum of the rank's leaves (see the top of the file). all_reduce: dst[n] gets the whole
// sum on every rank; otherwise (reduce-scatter, sequence parallel) dst[n / T] gets block tp.rank of it.
// copy(dst, src, n) copies n elements (buffers live where the ops run). _start computes the leaves
// and starts the exchange; _finish completes it (tp_sum: both at once).
template <typename T, typename Leaf, typename Add, typename Copy>
TpSumPending<T> tp_sum_start(const CommGroup& tp, const ChunkSplit& split, TpScratch<T>& s, T* dst, size_t n,
                             bool all_reduce, const Leaf& leaf, const Add& add, const Copy& copy) {
    const int P = tp.size;
    LLMC_CHECK(n <= s.capacity, "internal: tensor-parallel reduction of %zu elements, scratch holds %zu", n, s.capacity);
    LLMC_CHECK(split.chunks == split.count * P && tree_levels(split.count) <= s.levels,
               "internal: a split of %d leaves per rank over %d ranks, scratch for %d tree levels", split.count, P,
               s.levels);
    TpSumPending<T> p;
    p.g = &tp;
    p.split = split;
    p.dst = dst;
    p.n = n;
    p.all_reduce = all_reduce;
    p.recv = s.recv;
    const std::vector<TreeNode> mine = rank_nodes(split);
    const int nodes = P == 1 ? 1 : split_nodes(split);
    LLMC_CHECK(nodes <= s.nodes, "internal: a rank sends %d tree nodes, scratch holds %d", nodes, s.nodes);
    auto part = [&](int k) { return k == 0 ? (all_reduce ? dst : s.part) : s.extra + (size_t)(k - 1) * s.capacity; };
    for (size_t k = 0; k < mine.size(); k++) tree_sum(part((int)k), n, mine[k].lo, mine[k].hi, s.tmp, leaf, add);
    if (P == 1) {
        if (!all_reduce) copy(dst, part(0), n);
        return p;
    }
    // the blocks of every rank's nodes: node k of rank r at recv + k * stride + r * blk
    const bool blocks = n % P == 0;  // else a small vector (per-token statistics): gather all of it
    LLMC_CHECK(blocks || all_reduce, "internal: a sequence-parallel reduction of %zu elements over %d ranks", n, P);
    const size_t blk = blocks ? n / P : n, stride = blk * P;
    LLMC_CHECK(nodes * stride <= s.recv_capacity, "internal: tensor-parallel receive of %d x %zu elements, scratch "
               "holds %zu", nodes, stride, s.recv_capacity);
    for (int k = 0; k < nodes; k++) {  // a rank with fewer nodes sends a block nobody reads
        if (blocks) p.exchange.push_back(all_to_all_start(tp, part(k), s.recv + k * stride, blk * sizeof(T)));
        else p.exchange.push_back(all_gather_start(tp, part(k), s.recv + k * stride, n * sizeof(T)));
    }
    return p;
}
// Completes the exchange and sums the received nodes; an all-reduce's all-gather starts (a no-op
// once done).
template <typename T, typename Add, typename Copy>
void tp_sum_advance(TpSumPending<T>& p, const Add& add, const Copy& copy) {
    if (p.exchange.empty()) return;
    for (CommRequest& r : p.exchange) comm_finish(r);
    p.exchange.clear();
    const CommGroup& tp = *p.g;
    const int P = tp.size;
    const bool blocks = p.n % P == 0;
    const size_t blk = blocks ? p.n / P : p.n, stride = blk * P;
    std::vector<std::vector<TreeNode>> held(P);
    for (int r = 0; r < P; r++) {
        ChunkSplit other = p.split;
        other.first = r * p.split.count;
        held[r] = rank_nodes(other);
    }
    auto got = [&](int lo, int hi) -> T* {
        const int r = lo / p.split.count;  // the rank whose leaves start at lo's node
        for (size_t k = 0; k < held[r].size(); k++)
            if (held[r][k].lo == lo && held[r][k].hi == hi) return p.recv + k * stride + (size_t)r * blk;
        return nullptr;
    };
    const T* sum = tree_combine<T>(0, p.split.chunks, blk, got, add);
    if (!blocks) {
        copy(p.dst, sum, p.n);
        return;
    }
    if (!p.all_reduce) {
        copy(p.dst, sum, blk);
        return;
    }
    copy(p.dst + (size_t)tp.rank * blk, sum, blk);
    p.gather = all_gather_start(tp, p.dst + (size_t)tp.rank * blk, p.dst, blk * sizeof(T));
}
template <typename T, typename Add, typename Copy>
void tp_sum_finish(TpSumPending<T>& p, const Add& add, const Copy& copy) {
    tp_sum_advance(p, add, copy);
    comm_finish(p.gather);
}
template <typename T, typename Leaf, typename Add, typename Copy>
void tp_sum(const CommGroup& tp, const ChunkSplit& split, TpScratch<T>& s, T* dst, size_t n, bool all_reduce,
            const Leaf& leaf, const Add& add, const Copy& copy) {
    TpSumPending<T> p = tp_sum_start(tp, split, s, dst, n, all_reduce, leaf, add, copy);
    tp_sum_finish(p, add, copy);
}

// The scratch of reduction j of several of at most n elements each in flight at once (the parts of
// a micro-batch: lane j of a buffer the plan sized whole): the j-th n of the partial, of each extra
// node's and of the receive buffer. The tree's temporaries are shared: they are used only while
// tp_sum_start computes the leaves.
template <typename T>
TpScratch<T> tp_scratch_lane(const TpScratch<T>& s, size_t n, int tp, int j) {
    const size_t used = (size_t)s.nodes * (n % tp == 0 ? n : n * tp);  // a lane's receive (tp_sum_start)
    LLMC_CHECK((j + 1) * n <= s.capacity && (j + 1) * used <= s.recv_capacity, "internal: tensor-parallel reduction "
               "lane %d of %zu elements, scratch for %zu (receive %zu)", j, n, s.capacity, s.recv_capacity);
    TpScratch<T> h = s;
    if (h.part) h.part += j * n;
    if (h.extra) h.extra += j * n;  // (node k's at extra + (k - 1) capacity: the stride stays the whole's)
    h.recv += j * used;
    h.recv_capacity -= j * used;
    return h;
}
