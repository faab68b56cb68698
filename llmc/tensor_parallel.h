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
// Canonical chunks. The summed dimension is cut into G fixed chunks (G a power of two <= 8 that
// divides the dimension's units: heads, hidden units, vocabulary rows, tokens), the chunks are
// summed in a fixed balanced binary tree, and every layout computes exactly that tree:
//   one process           all G leaves, the whole tree
//   T ranks, T divides G  rank r computes the subtree of leaves [r G/T, (r+1) G/T) (an aligned
//                         subtree), the group adds the T subtree sums with the tree's top levels
// Each leaf is one matmul (or one sum) over the same inputs in the same order in every layout, so
// the result is bitwise the one-process result for T in {1, 2, 4, 8} up to G (the CPU build).
// Where T does not divide G (e.g. T 3, or a kv head shared by ranks) a rank's slice is one leaf and
// the T partials are added in the same in-place tree: deterministic, but not bitwise the one-process
// value (the tests hold those cases to 1e-6). The GPU build uses G = T (one leaf per rank, no extra
// buffers): its matmuls are not bitwise across shapes anyway.
//
// The group's reduction is an all-to-all of 1/T blocks and a local tree over the received blocks
// (no float sum inside MPI or NCCL, as llmc/zero.h's reduce_scatter_add), then, for an all-reduce,
// an all-gather of the summed blocks: the bytes of a ring all-reduce, 2 (T-1)/T of the buffer.
#pragma once
#include <algorithm>
#include <cstddef>
#include <vector>
#include "comm.h"
#include "utils.h"

constexpr int TP_MAX_CHUNKS = 8;
constexpr int TP_TREE_LEVELS = 3;  // log2(TP_MAX_CHUNKS): temporaries of a local subtree

// G for a dimension of `units` units (heads, hidden units, vocabulary rows, tokens); canonical
// false (the GPU build, or a plan for it): G = tp.
inline int canonical_chunks(long units, int tp, bool canonical) {
    if (!canonical) return tp;
    int g = 1;
    while (g < TP_MAX_CHUNKS && units % (2 * g) == 0) g *= 2;
    return g;
}

// The leaves a rank computes: chunks [first, first + count) of `chunks`, each `units` units wide;
// canonical false: the rank's slice is one leaf (T does not divide G).
struct ChunkSplit {
    int first = 0, count = 1, chunks = 1;
    long units = 0;  // per leaf
    bool canonical = true;
};
// units: the whole dimension (over all ranks); rank's slice = units / T
inline ChunkSplit chunk_split(long units, int tp, int tp_rank, bool canonical) {
    ChunkSplit s;
    const int g = canonical_chunks(units, tp, canonical);
    if (g % tp == 0) {
        s.chunks = g;
        s.count = g / tp;
        s.first = tp_rank * s.count;
        s.units = units / g;
    } else {
        s.chunks = tp;
        s.count = 1;
        s.first = tp_rank;
        s.units = units / tp;
        s.canonical = tp == 1;
    }
    return s;
}

// The rank's part as one leaf: for sums whose result does not depend on the order (a maximum, a
// sum with one non-zero term per element) or that are not canonical anyway.
inline ChunkSplit rank_leaf(const CommGroup& g) {
    ChunkSplit s;
    s.first = g.rank;
    s.chunks = g.size;
    s.canonical = g.size == 1;
    return s;
}

// Scratch of one element type for the reductions: subtree temporaries, the partial of a
// reduce-scatter and the receive buffer, each `capacity` elements.
template <typename T>
struct TpScratch {
    T* tmp[TP_TREE_LEVELS] = {};
    T *part = nullptr, *recv = nullptr;
    size_t capacity = 0;
};

// dst[n] = the balanced tree over leaves [first, first + count) (count a power of two, or 1);
// leaf(k, out) overwrites out[n] with leaf k's value, add(a, b, n) does a += b.
template <typename T, typename Leaf, typename Add>
void tree_sum(T* dst, size_t n, int first, int count, T* const* tmp, const Leaf& leaf, const Add& add) {
    if (count == 1) {
        leaf(first, dst);
        return;
    }
    LLMC_CHECK(count % 2 == 0, "internal: a canonical subtree of %d leaves", count);
    tree_sum(dst, n, first, count / 2, tmp + 1, leaf, add);
    tree_sum(tmp[0], n, first + count / 2, count / 2, tmp + 1, leaf, add);
    add(dst, tmp[0], n);
}

// blocks[0] = the tree over count blocks of n elements, stride apart (summed in place)
template <typename T, typename Add>
void tree_sum_blocks(T* blocks, size_t stride, size_t n, int count, const Add& add) {
    for (int step = 1; step < count; step *= 2)
        for (int i = 0; i + step < count; i += 2 * step) add(blocks + (size_t)i * stride, blocks + (size_t)(i + step) * stride, n);
}

// The group's sum of the rank's leaves (see the top of the file). all_reduce: dst[n] gets the whole
// sum on every rank; otherwise (reduce-scatter, sequence parallel) dst[n / T] gets block tp.rank of it.
// copy(dst, src, n) copies n elements (buffers live where the ops run).
template <typename T, typename Leaf, typename Add, typename Copy>
void tp_sum(const CommGroup& tp, const ChunkSplit& split, TpScratch<T>& s, T* dst, size_t n, bool all_reduce,
            const Leaf& leaf, const Add& add, const Copy& copy) {
    const int P = tp.size;
    LLMC_CHECK(n <= s.capacity, "internal: tensor-parallel reduction of %zu elements, scratch holds %zu", n, s.capacity);
    T* part = all_reduce ? dst : s.part;
    tree_sum(part, n, split.first, split.count, s.tmp, leaf, add);
    if (P == 1) {
        if (!all_reduce) copy(dst, part, n);
        return;
    }
    if (n % P == 0) {
        const size_t blk = n / P;
        all_to_all(tp, part, s.recv, blk * sizeof(T));
        tree_sum_blocks(s.recv, blk, blk, P, add);
        if (!all_reduce) {
            copy(dst, s.recv, blk);
            return;
        }
        copy(dst + (size_t)tp.rank * blk, s.recv, blk);
        all_gather(tp, dst + (size_t)tp.rank * blk, dst, blk * sizeof(T));
        return;
    }
    // a small vector that does not split into P blocks (per-token statistics): gather all partials
    LLMC_CHECK(all_reduce, "internal: a sequence-parallel reduction of %zu elements over %d ranks", n, P);
    LLMC_CHECK(n * P <= s.capacity, "internal: tensor-parallel gather of %zu x %d elements, scratch holds %zu", n, P,
               s.capacity);
    all_gather(tp, part, s.recv, n * sizeof(T));
    tree_sum_blocks(s.recv, n, n, P, add);
    copy(dst, s.recv, n);
}
