// ZeRO (Rajbhandari et al. 2020): sharding the flat parameter, gradient and optimizer buffers over
// the data-parallel ranks, and the sharded optimizer step.
//
// Segments. The flat buffers are cut into segments, the units that are reduced and (stage 3)
// gathered together: the embedding (wte, wpe), each block's attention and FFN halves, an MoE
// layer's experts, the final LayerNorm (llmc/gpt/config.h: segment_of). Every segment is
// padded to a multiple of dp * NORM_CHUNK elements and rank r owns the r-th of its dp equal
// slices, so any parameter count works with any dp. Three index spaces, by buffer:
//   table   the parameter table's offsets: layout-independent, what checkpoints hold
//   padded  the segments back to back, each padded: the full buffers
//   shard   the rank's slice of every segment, back to back: the sharded buffers
//
//   stage  params          grad_acc (fp32)          unreduced gradient      master, adam m/v   after the update
//   0      padded (full)   padded                   (in grad_acc)           padded             (all ranks updated all)
//   1      padded          padded                   (in grad_acc)           shard              all-gather params
//   2      padded          shard                    a segment slot          shard              all-gather params
//   3      shard           shard                    a segment slot          shard              (gathered per segment
//                                                                                              before each use)
//
// A layout moves bytes, not math. Every op adds its weight gradient into its destination with one
// fp32 addition per element of a sum it computed apart (op(acc) == acc + op(zeros)), so the step's
// gradient is a fixed association of the micro-batches' S(g), g = micro * dp + rank: the layout's
// gradient blocks (llmc/gpt/layout.h), which one process reproduces with --grad_blocks.
//   Stages 2-3 (ZeRO-2, ZeRO-3 / FSDP): each micro-batch's segment gradient goes to a zeroed slot
//   (scaled by 1 / global micro-batches); reduce_scatter_add sends every rank the slices it owns
//   and the owner adds them into its fp32 accumulator in rank order: acc += S(g) in increasing g,
//   one g at a time (a block per micro-batch).
//   Stages 0-1 (DDP with no_sync, Megatron's distributed optimizer): no leaf; the ops add straight
//   into the rank's fp32 accumulator over all of its micro-batches, and each segment is reduced
//   once per step, when its last micro-batch's gradient is final (reduce_scatter_sum: the owners
//   add every rank's sum in rank order; stage 0 then all-gathers the reduced fp32 slices, stage 1
//   the updated params): a block per rank (DDP no_sync's order; docs/PARALLELISM.md). An expert
//   segment with n_leaves sources (--ep) keeps one accumulator per source rank over the step (the
//   first in the accumulator's place, the others after padded_total: leaf_at), so that each
//   source's sum is that rank's block and the owners fold the leaves in (rank, source) order: the
//   dp ranks' order.
// (On the CPU build; the GPU kernels are deterministic too, but their gradient norm is summed per
// segment, see grad_norm_squared.)
#ifndef LLMC_ZERO_H
#define LLMC_ZERO_H
#include <algorithm>
#include <deque>
#include <functional>
#include <string>
#include <vector>
#include "llmc/parallel/comm.h"
#include "llmc/utils.h"

// The gradient norm is summed over fixed chunks of each segment; a shard holds whole chunks.
constexpr size_t NORM_CHUNK = 2048;

// Which part of the table a segment is: its number among all segments of the model (a pipeline
// stage holds some of them) and its table range. Expert segments (an MoE layer's experts) are
// sharded over the expert-data-parallel group (the ranks that hold the same experts, --ep) instead
// of the whole dp group, and with expert parallelism the experts' owner computes one gradient per
// source rank of its ep group (n_leaves): stages 2-3 keep them apart, n_leaves leaves back to back,
// folded in global micro-batch order (reduce_scatter_add); stages 0-1 keep n_leaves accumulators
// over the step, folded once per step in (rank, source) order (reduce_scatter_sum with leaves).
struct SegmentSpec {
    std::string name;
    int id = 0;
    size_t begin = 0, len = 0;
    bool expert = false;
    int n_leaves = 1;
};

struct Segment {
    std::string name;
    int id = 0;                 // the model's segment number (SegmentSpec::id)
    size_t begin = 0, len = 0;  // table offsets [begin, begin + len)
    bool expert = false;        // sharded over the expert-dp group
    int dp = 1, rank = 0;       // the group it is sharded over: its size and this rank's place
    int n_leaves = 1;           // leaf gradients (expert parallelism: one per source rank)
    size_t padded = 0;          // len rounded up to a multiple of dp * NORM_CHUNK
    size_t padded_offset = 0;   // where it starts in the padded space
    size_t shard_offset = 0;    // where the rank's slice starts in the shard space
    size_t extra_offset = 0;    // stages 0-1, n_leaves > 1: where leaves 1.. start after padded_total
};

struct ZeroLayout {
    int stage = 0, dp = 1, rank = 0;
    std::vector<Segment> segs;
    size_t table_total = 0, padded_total = 0, shard_total = 0, max_padded = 0;
    size_t max_leaves = 0;  // the largest segment's n_leaves * padded (a stage 2-3 gradient slot)
    size_t extra_leaves = 0;  // stages 0-1: the leaves 1.. of the expert segments, after padded_total
    size_t max_summed = 0;    // stages 0-1: the most elements one reduce_scatter_sum receives

    size_t shard_len(int s) const { return segs[s].padded / segs[s].dp; }
    size_t own_begin(int s) const { return (size_t)segs[s].rank * shard_len(s); }  // segment-relative
    // where an element at segment-relative position rel of segment s lives in each space
    size_t padded_index(int s, size_t rel) const { return segs[s].padded_offset + rel; }
    size_t shard_index(int s, size_t rel) const { return segs[s].shard_offset + rel - own_begin(s); }
    // the spaces of the buffers at this stage
    bool params_sharded() const { return stage >= 3; }
    bool state_sharded() const { return stage >= 1; }
    bool acc_sharded() const { return stage >= 2; }
    size_t params_elems() const { return params_sharded() ? shard_total : padded_total; }
    size_t state_elems() const { return state_sharded() ? shard_total : padded_total; }
    size_t acc_elems() const { return acc_sharded() ? shard_total : padded_total; }
    // the accumulator's allocation: acc_elems, then (stages 0-1) the expert segments' leaves 1..
    size_t acc_alloc_elems() const { return acc_elems() + extra_leaves; }
    // stages 0-1: the ops add straight into the accumulator (an expert segment's source p > 0 into
    // its own leaf after padded_total); stages 2-3: into a slot of n_leaves leaves, padded elements
    // apart
    bool grads_in_acc() const { return !acc_sharded(); }
    // how far leaf p of segment s's gradient is from leaf 0 (where its pointers point), in elements
    size_t leaf_at(int s, int p) const {
        if (!grads_in_acc()) return (size_t)p * segs[s].padded;
        if (p == 0) return 0;
        return padded_total + segs[s].extra_offset + (size_t)(p - 1) * segs[s].padded - segs[s].padded_offset;
    }
    // the most elements one reduction of a segment sends (reduce_scatter_add / _sum's scratch)
    size_t max_reduced() const { return grads_in_acc() ? max_summed : max_leaves; }
    // the rank's slice of segment s in the accumulator, master/moment and param buffers
    size_t acc_own(int s) const { return acc_sharded() ? segs[s].shard_offset : padded_index(s, own_begin(s)); }
    size_t state_own(int s) const { return state_sharded() ? segs[s].shard_offset : padded_index(s, own_begin(s)); }
    size_t params_own(int s) const { return params_sharded() ? segs[s].shard_offset : padded_index(s, own_begin(s)); }
};

// specs: the segments this rank's pipeline stage holds, in table order, ids distinct; table_total:
// the table's size. (edp, erank): the expert-dp group of expert segments.
inline ZeroLayout zero_layout(const std::vector<SegmentSpec>& specs, size_t table_total, int stage, int dp, int rank,
                              int edp = 0, int erank = 0) {
    LLMC_CHECK(stage >= 0 && stage <= 3, "--zero: expected 0, 1, 2 or 3, got %d", stage);
    if (edp == 0) { edp = dp; erank = rank; }
    ZeroLayout z;
    z.stage = stage;
    z.dp = dp;
    z.rank = rank;
    z.table_total = table_total;
    for (size_t k = 0; k < specs.size(); k++) {
        for (size_t j = 0; j < k; j++) LLMC_CHECK(specs[j].id != specs[k].id, "internal: segment %d twice", specs[k].id);
        Segment s;
        s.name = specs[k].name;
        s.id = specs[k].id;
        s.begin = specs[k].begin;
        s.len = specs[k].len;
        s.expert = specs[k].expert;
        s.dp = s.expert ? edp : dp;
        s.rank = s.expert ? erank : rank;
        s.n_leaves = specs[k].n_leaves;
        const size_t unit = (size_t)s.dp * NORM_CHUNK;
        s.padded = (s.len + unit - 1) / unit * unit;
        s.padded_offset = z.padded_total;
        s.shard_offset = z.shard_total;
        z.padded_total += s.padded;
        z.shard_total += s.padded / s.dp;
        z.max_padded = std::max(z.max_padded, s.padded);
        z.max_leaves = std::max(z.max_leaves, s.n_leaves * s.padded);
        z.max_summed = std::max(z.max_summed, (s.dp > 1 ? s.n_leaves : 1) * s.padded);
        z.segs.push_back(s);
    }
    for (Segment& s : z.segs)
        if (z.grads_in_acc() && s.n_leaves > 1) {
            s.extra_offset = z.extra_leaves;
            z.extra_leaves += (size_t)(s.n_leaves - 1) * s.padded;
        }
    return z;
}

// One contiguous run of elements the rank's optimizer step updates (inside one tensor).
struct UpdatePiece {
    size_t param_index, state_index, acc_index;  // into params, master/moments, grad_acc
    size_t table_offset, n;                      // its place in the table (stochastic-rounding seed)
    bool decay;
};

// tensors: (table offset, numel, decay) in table order (those outside the layout's segments are
// another pipeline stage's). Stage 0 updates every element on every rank; stages 1-3 each rank its
// own slices.
struct TensorRange {
    size_t offset, numel;
    bool decay;
};
inline std::vector<UpdatePiece> zero_update_pieces(const ZeroLayout& z, const std::vector<TensorRange>& tensors) {
    std::vector<UpdatePiece> pieces;
    for (const TensorRange& t : tensors) {
        int s = -1;  // the segment holding the tensor; none: another pipeline stage's
        for (int k = 0; k < (int)z.segs.size() && s < 0; k++)
            if (t.offset >= z.segs[k].begin && t.offset < z.segs[k].begin + z.segs[k].len) s = k;
        if (s < 0) continue;
        const Segment& seg = z.segs[s];
        const size_t rel0 = t.offset - seg.begin, rel1 = rel0 + t.numel;
        const size_t lo = z.stage == 0 ? rel0 : std::max(rel0, z.own_begin(s));
        const size_t hi = z.stage == 0 ? rel1 : std::min(rel1, z.own_begin(s) + z.shard_len(s));
        if (lo >= hi) continue;
        UpdatePiece p;
        p.param_index = z.params_sharded() ? z.shard_index(s, lo) : z.padded_index(s, lo);
        p.state_index = z.state_sharded() ? z.shard_index(s, lo) : z.padded_index(s, lo);
        p.acc_index = z.acc_sharded() ? z.shard_index(s, lo) : z.padded_index(s, lo);
        p.table_offset = seg.begin + lo;
        p.n = hi - lo;
        p.decay = t.decay;
        pieces.push_back(p);
    }
    return pieces;
}

// What a rank's ZeRO communication has in flight during a step, and how far each local segment's
// gradient is (llmc/gpt/hooks.h starts and completes them; the model holds one).
struct ZeroInFlight {
    std::vector<std::pair<int, CommRequest>> param_gathers;  // stage 3's slots (params_prefetch), stages 1-2's after the update
    struct Reduction {
        int s = -1;
        bool last = false;                 // the segment's gradient is final with it (--offload downloads it)
        std::vector<CommRequest> leaf_reqs;  // its transfers (one per leaf)
        float* scratch = nullptr;          // its receive buffer
    };
    std::deque<Reduction> in_flight;       // oldest first, at most one per receive buffer
    std::vector<float*> free_scratch;      // the receive buffers not in use
    std::deque<std::pair<int, bool>> reduce_queue;            // (segment, last) whose reductions wait for it, in order
    std::vector<std::pair<int, CommRequest>> grad_gathers;    // stage 0: the reduced segments' all-gathers
    // stage 0 with dp > 1: the update runs segment by segment where its gradient's all-gather
    // completes, at the segment's first use after the step (hooks.h: zero_update_segment)
    std::function<void(const std::vector<int>&)> deferred_update;
    std::vector<char> update_pending;
    int n_pending = 0;
    // grads_ready's count per local segment this step: at reduce_at (the step's micro-batches; 0 in
    // a lone backward) the segment's gradient is final: stages 0-1 start its reduction (reduced:
    // started), --offload its download (count_ready)
    std::vector<int> ready_count;
    std::vector<char> reduced;
    int reduce_at = 0;
    bool count_ready = false;
};

// acc_own[0, chunk) += sum over ranks r, in rank order, of rank r's send[rank * chunk, + chunk):
// a reduce-scatter whose float sums happen here, in a fixed order, never inside MPI or NCCL.
// n_leaves > 1: send holds that many leaves (g.size * chunk each), rank r's leaf k being global
// micro-batch r * n_leaves + k of the group's: they fold in (r, k) order. scratch holds n_leaves *
// g.size * chunk elements. add(acc, leaf, n): acc[i] += leaf[i] in fp32 (the backend's op).
// In two halves, so that a segment's all-to-alls run behind the next segment's backward:
// reduce_scatter_add_start sends the leaves (send and scratch stay untouched until the finish),
// _finish completes them and adds the received slices as above. (One group member: no transfer,
// the adds at the finish.)
inline std::vector<CommRequest> reduce_scatter_add_start(const CommGroup& g, const float* send, size_t chunk, float* scratch,
                                                         int n_leaves = 1) {
    std::vector<CommRequest> reqs;
    const size_t leaf = (size_t)g.size * chunk;
    for (int k = 0; k < n_leaves && g.size > 1; k++)
        reqs.push_back(all_to_all_start(g, send + k * leaf, scratch + k * leaf, chunk * sizeof(float)));
    return reqs;
}
template <typename Add>
inline void reduce_scatter_add_finish(const Add& add, std::vector<CommRequest>& reqs, const CommGroup& g, float* acc_own,
                                      const float* send, size_t chunk, const float* scratch, int n_leaves = 1) {
    for (CommRequest& r : reqs) comm_finish(r);
    reqs.clear();
    const size_t leaf = (size_t)g.size * chunk;
    if (g.size == 1) {
        for (int k = 0; k < n_leaves; k++) add(acc_own, send + k * leaf, chunk);
        return;
    }
    for (int r = 0; r < g.size; r++)
        for (int k = 0; k < n_leaves; k++) add(acc_own, scratch + k * leaf + (size_t)r * chunk, chunk);
}
template <typename Add>
inline void reduce_scatter_add(const Add& add, const CommGroup& g, float* acc_own, const float* send, size_t chunk,
                               float* scratch, int n_leaves = 1) {
    std::vector<CommRequest> reqs = reduce_scatter_add_start(g, send, chunk, scratch, n_leaves);
    reduce_scatter_add_finish(add, reqs, g, acc_own, send, chunk, scratch, n_leaves);
}

// Stages 0-1, once per step and segment: acc[rank * chunk, + chunk) = the sum over ranks r, in rank
// order, of rank r's acc[rank * chunk, + chunk) (acc: the rank's whole segment, g.size * chunk
// elements, summed in place over its micro-batches). In two halves so that the sends can run behind
// the backward: reduce_scatter_sum_start starts the all-to-all into scratch (g.size * chunk; acc
// and scratch stay untouched until the finish), _finish completes it and adds the received slices
// into the zeroed own slice. zero(p, n): p[0, n) = 0.
// leaves: an expert segment's further sums (--ep: leaf k the step's sum of source rank k > 0 of
// the ep group, leaf 0 being acc), each g.size * chunk elements, scratch n_leaves times as large:
// the owner adds them in (rank r, leaf k) order, rank r's leaf k being dp rank r * n_leaves + k's
// block; one group member: acc += leaf 1, leaf 2, ... in place.
inline std::vector<CommRequest> reduce_scatter_sum_start(const CommGroup& g, const float* acc, size_t chunk, float* scratch,
                                                         const std::vector<const float*>& leaves = {}) {
    std::vector<CommRequest> reqs;
    if (g.size == 1) return reqs;
    const size_t leaf = (size_t)g.size * chunk;
    reqs.push_back(all_to_all_start(g, acc, scratch, chunk * sizeof(float)));
    for (size_t k = 0; k < leaves.size(); k++)
        reqs.push_back(all_to_all_start(g, leaves[k], scratch + (k + 1) * leaf, chunk * sizeof(float)));
    return reqs;
}
template <typename Add, typename Zero>
inline void reduce_scatter_sum_finish(const Add& add, const Zero& zero, std::vector<CommRequest>& reqs, const CommGroup& g,
                                      float* acc, size_t chunk, const float* scratch,
                                      const std::vector<const float*>& leaves = {}) {
    for (CommRequest& r : reqs) comm_finish(r);
    reqs.clear();
    const size_t leaf = (size_t)g.size * chunk;
    if (g.size == 1) {
        for (const float* l : leaves) add(acc, l, chunk);
        return;
    }
    float* own = acc + (size_t)g.rank * chunk;
    zero(own, chunk);
    for (int r = 0; r < g.size; r++)
        for (size_t k = 0; k <= leaves.size(); k++) add(own, scratch + k * leaf + (size_t)r * chunk, chunk);
}

// Squared L2 norm of the accumulated gradient over the whole model, the same on every rank of the
// world. per_chunk (the CPU build): sums fixed NORM_CHUNK chunks of each segment (shards hold whole
// chunks), gathers the chunk sums of every rank (each pipeline stage has its own segments) and adds
// them in (segment id, rank, chunk) order: bitwise the unsharded single-process norm, for any dp and
// pp (padding chunks add +0.0). Otherwise (the GPU build) each rank's slice of a segment is summed
// as one range, every range of the rank in one batch (a few launches and one host sync). add_squares(sum,
// p, n): sum += the squares of p[0, n) (the CPU backend's loop in double); squares_of(sums, ptrs,
// ns, count): sums[k] = the squares of ptrs[k][0, ns[k]) (the GPU backend's batch). skip: sorted
// accumulator ranges [begin, end) this rank does not count (tensor-parallel replicas, counted by
// their owner).
using AccRanges = std::vector<std::pair<size_t, size_t>>;
template <typename AddSquares, typename SquaresOf>
inline double grad_norm_squared(const ZeroLayout& z, const float* grad_acc, const AccRanges& skip, bool per_chunk,
                                const AddSquares& add_squares, const SquaresOf& squares_of) {
    const size_t n_seg = z.segs.size();
    // the parts of [a, b) outside skip
    auto counted = [&](size_t a, size_t b, auto f) {
        auto it = std::upper_bound(skip.begin(), skip.end(), std::make_pair(a, ~(size_t)0));
        if (it != skip.begin()) --it;
        for (; it != skip.end() && it->first < b && a < b; ++it) {
            if (it->second <= a) continue;
            if (it->first > a) f(a, std::min(b, it->first));
            a = std::max(a, it->second);
        }
        if (a < b) f(a, b);
    };
    std::vector<size_t> first(n_seg + 1, 0);  // this rank's sums of segment s: [first[s], first[s + 1])
    std::vector<double> mine;
    if (per_chunk) {
        for (size_t s = 0; s < n_seg; s++) first[s + 1] = first[s] + z.shard_len((int)s) / NORM_CHUNK;
        mine.resize(first[n_seg]);
#pragma omp parallel for schedule(static)
        for (size_t k = 0; k < first[n_seg]; k++) {
            const size_t s = std::upper_bound(first.begin(), first.end(), k) - first.begin() - 1;
            const size_t at = z.acc_own((int)s) + (k - first[s]) * NORM_CHUNK;
            double sum = 0;
            counted(at, at + NORM_CHUNK, [&](size_t lo, size_t hi) { add_squares(sum, grad_acc + lo, hi - lo); });
            mine[k] = sum;
        }
    } else {
        for (size_t s = 0; s <= n_seg; s++) first[s] = s;
        mine.assign(n_seg, 0.0);
        std::vector<const float*> ptrs;
        std::vector<size_t> ns, seg_of;
        for (size_t s = 0; s < n_seg; s++)
            counted(z.acc_own((int)s), z.acc_own((int)s) + z.shard_len((int)s), [&](size_t lo, size_t hi) {
                ptrs.push_back(grad_acc + lo);
                ns.push_back(hi - lo);
                seg_of.push_back(s);
            });
        std::vector<double> sums(ptrs.size());
        squares_of(sums.data(), ptrs.data(), ns.data(), (int)ptrs.size());
        for (size_t k = 0; k < sums.size(); k++) mine[seg_of[k]] += sums[k];  // a segment's ranges in order
    }
    // (segment id, chunk sum) pairs of every rank, padded to the longest list (id -1)
    const CommGroup& world = comm_world().world;
    size_t longest = 0;
    for (uint64_t n : host_gather_all<uint64_t>(world, (uint64_t)mine.size())) longest = std::max(longest, (size_t)n);
    std::vector<std::pair<double, double>> tagged(longest, {-1.0, 0.0}), all(longest * world.size);
    for (size_t s = 0; s < n_seg; s++)
        for (size_t k = first[s]; k < first[s + 1]; k++) tagged[k] = {(double)z.segs[s].id, mine[k]};
    host_all_gather(world, tagged.data(), all.data(), longest * sizeof(tagged[0]));
    // a segment lives on one stage: its ranks are consecutive in the world (tp, then dp order)
    std::vector<size_t> order;
    for (size_t k = 0; k < all.size(); k++)
        if (all[k].first >= 0) order.push_back(k);
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return all[a].first < all[b].first; });
    double total = 0;
    for (size_t k : order) total += all[k].second;
    return total;
}

// The first accumulator element this rank's norm counts (SIZE_MAX: none): where the tests' fault
// injection puts an inf (LLMC_FAULT_INF_GRAD, train_gpt.cu).
inline size_t first_counted_grad(const ZeroLayout& z, const AccRanges& skip) {
    for (size_t s = 0; s < z.segs.size(); s++) {
        size_t a = z.acc_own((int)s);
        const size_t b = a + z.shard_len((int)s);
        for (const auto& r : skip)  // (sorted)
            if (r.first <= a && a < r.second) a = r.second;
        if (a < b) return a;
    }
    return SIZE_MAX;
}

// Slots per class (below). Stage 3 keeps the parameters of the current and the next segment of a
// kind (a block's forward ends with the next block's LN1) and a third: a segment kept for the next
// pass, or gathered ahead at a pass boundary (where the rank holds the embedding, its own slot, held
// through a one-stage forward for the tied head, stands for that third one). Stages 2-3 keep the
// gradient of the segment in its backward and of the one before it, whose reduction runs behind
// that backward.
constexpr int ZERO3_PARAM_SLOTS = 3, ZERO_GRAD_SLOTS = 2;

// Stages 2-3: buffers that each hold one segment: a micro-batch's segment gradients (fp32) from
// grads_needed to their reduction; at stage 3 also the gathered segments' parameters, a slot
// holding its segment from the gather's start until it is dropped, in use from its params_needed to
// its params_done (held and not in use: a gather in flight, a prefetch, or a segment kept for the
// pass that starts with it; llmc/gpt/hooks.h). Slots come in classes, each sized for the largest
// segment of its class, and a segment takes only slots of its class (llmc/gpt/plan.h:
// alloc_segment_slots), so that a 50k-row embedding does not make every slot its size.
template <typename floatX>
struct SegmentSlots {
    std::vector<floatX*> buf;
    std::vector<int> slot_class;  // per slot
    std::vector<int> seg_class;   // per local segment: the class of the slots it takes
    std::vector<int> holds;       // per slot: the local segment it holds, or -1
    std::vector<char> in_use;     // per slot (parameters): between params_needed and params_done
    int slot_of(int seg) const {
        for (size_t k = 0; k < buf.size(); k++)
            if (holds[k] == seg) return (int)k;
        return -1;
    }
    floatX* find(int seg) const {
        const int k = slot_of(seg);
        return k < 0 ? nullptr : buf[k];
    }
    // the empty slots of class c
    int empty(int c) const {
        int n = 0;
        for (size_t k = 0; k < buf.size(); k++) n += holds[k] < 0 && slot_class[k] == c;
        return n;
    }
    // a slot of seg's class: an empty one, else with take_held the first one held and not in use; -1: none
    int free_slot(int seg, bool take_held) const {
        int k = -1;
        for (size_t j = 0; j < buf.size() && k < 0; j++)
            if (slot_class[j] == seg_class[seg] && holds[j] < 0) k = (int)j;
        for (size_t j = 0; j < buf.size() && k < 0 && take_held; j++)
            if (slot_class[j] == seg_class[seg] && !in_use[j]) k = (int)j;
        return k;
    }
    // empty slots for all of segs[0, n) at once
    bool fit_empty(const int* segs, int n) const {
        for (int i = 0; i < n; i++) {
            int same = 0;
            for (int j = 0; j < n; j++) same += seg_class[segs[j]] == seg_class[segs[i]];
            if (same > empty(seg_class[segs[i]])) return false;
        }
        return true;
    }
    // (gradients) the slot that holds seg, else an empty one of its class, now holding it; nullptr: none free
    floatX* acquire(int seg) {
        if (floatX* p = find(seg)) return p;
        const int k = free_slot(seg, false);
        if (k < 0) return nullptr;
        holds[k] = seg;
        return buf[k];
    }
    void release(int seg) {
        for (size_t k = 0; k < buf.size(); k++)
            if (holds[k] == seg) holds[k] = -1;
    }
};

#endif  // LLMC_ZERO_H
