// A chapter of train_gpt.cu (included once, after the GPT struct): the hooks between the model's
// math and the layouts, the named entry points through which the forward, backward and update
// meet ZeRO, tensor / sequence parallelism, expert parallelism and the pipeline. The contract: the
// model code calls them at fixed points and never reads a rank number or a group itself.
//   ZeRO                 params_needed / params_done around a segment's use (stage 3 gathers;
//                        params_prefetch starts them one segment ahead, params_done(keep)
//                        holds one for the next pass, params_drop_all at the update; stages
//                        1-2 complete the gather started after the last update),
//   (parallel/zero.h)    grads_needed / grads_ready around its weight gradients (stages 0-1:
//                        into the accumulator, reduced once per step from the last micro-batch's
//                        grads_ready; 2-3: a zeroed slot folded into the owners' fp32 accumulators),
//                        head_weights / head_done and head_grads_ready (the tied lm head),
//                        zero_reduce_finish before the norm,
//                        zero_update (the update: -z 1/2 gathers behind it; -z 0 deferred to each
//                        segment's first use, zero_update_segment), zero_settle_params before
//                        the update, zero_settle before anything else that reads params or state
//   tensor parallel      row_parallel_forward, column_parallel_dinp, norm_weight_grads
//   (parallel/           (canonical reductions over the tp group), vocab_parallel_loss and
//   tensor_parallel.h)   vocab_parallel_dinp_start (the lm head, per token chunk), tp_attention_backward
//                        (a kv head shared by several ranks)
//   sequence parallel    stream_rows / sp_row0 (the rank's rows), sp_gather, ln_gathered,
//   (--sp)               sp_gather_from
//   expert parallel      expert_dispatch_buffer, expert_dispatch_start, expert_return_start
//   pipeline             slot_for / stash_for (micro-batches in flight), pipe_transfer (a stage
//   (parallel/           transfer's bytes), tied_embedding_sum / tied_embedding_refresh
//   pipeline.h)
// With one process and no flags every hook is a no-op or the plain op. (With the comm's loopback,
// LLMC_COMM_LOOPBACK, the ZeRO hooks take their multi-rank paths on one process: comm_moves.)

// ZeRO glue for the model code (llmc/parallel/zero.h), by model segment id. At stages 0-2 the parameters are
// always in place and the param calls do nothing; at stage 3 a segment is all-gathered into a slot
// before its first use and the slot is released after its last. The gradients: at stages 0-1 the
// segment's pointers are into the fp32 accumulator (zeroed once per step) and grads_ready counts the
// step's micro-batches, starting the segment's reduction at its last one (zero_reduce_start); at
// stages 2-3 grads_needed points them at a zeroed slot and grads_ready reduce-scatters it into the
// owners' accumulators (on the GPU the next segment's work is queued behind it).
// zero.h's fold of a gradient into the fp32 accumulator: the backend's grad_accumulate
struct AccumulateGrads {
    void operator()(float* acc, const float* x, size_t n) const { grad_accumulate(acc, x, n); }
};
struct ZeroFloats {
    void operator()(float* p, size_t n) const { buffer_zero(p, n * sizeof(float)); }
};
// the tag of the tied embedding's transfers between the first and the last pipeline stage
constexpr int TIED_EMBEDDING_TAG = 32767;
// the group a segment is sharded and reduced over: the experts' over the expert-dp ranks
static const CommGroup& seg_group(const ZeroLayout& z, int s) {
    return z.segs[s].expert ? comm_world().edp : comm_world().dp;
}
// the same ranks, for the segment's reductions (their own communicator: see Comm::dp_reduce)
static const CommGroup& seg_reduce_group(const ZeroLayout& z, int s) {
    return z.segs[s].expert ? comm_world().edp_reduce : comm_world().dp_reduce;
}
// the local segments of model segment seg: a layer's (by its attention's id) are its attention
// half, its FFN half and, in an MoE layer, its experts; part: all of them, or the attention's, or
// the FFN's (its half and the experts)
enum LayerPart { PART_ALL, PART_ATTENTION, PART_FFN };
struct LocalSegments {
    int s[3] = {-1, -1, -1}, n = 0;
    const int* begin() const { return s; }
    const int* end() const { return s + n; }
};
static LocalSegments local_segments(const GPT& m, int seg, LayerPart part = PART_ALL) {
    LocalSegments out;
    const int L = m.config.n_layer, l = segment_layer(seg, L);
    if (l < 0 || part != PART_FFN) out.s[out.n++] = m.seg_local[seg];
    if (l >= 0 && part != PART_ATTENTION) {
        out.s[out.n++] = m.seg_local[2 * L + 2 + l];
        if (m.config.is_moe(l)) out.s[out.n++] = m.seg_local[L + 2 + l];
    }
    return out;
}
// the gather of local segment s in flight (stage 3's into its slot, stages 1-2's after the update)
// completed; false: none
static bool param_gather_finish(GPT& m, int s) {
    auto in_flight = std::find_if(m.zs.param_gathers.begin(), m.zs.param_gathers.end(), [&](const auto& g) { return g.first == s; });
    if (in_flight == m.zs.param_gathers.end()) return false;
    comm_finish(in_flight->second);
    m.zs.param_gathers.erase(in_flight);
    return true;
}
// Stage 3: local segment s into a slot (an empty one; with take_held, else one held and not in use,
// whose gather completes first): the rank's shard in place, the others' by an all-gather (started)
static CommRequest params_gather_start(GPT& m, int s, bool take_held) {
    const ZeroLayout& z = m.zero;
    SegmentSlots<floatX>& ps = m.param_slots;
    const int k = ps.free_slot(s, take_held);
    LLMC_CHECK(k >= 0, "internal: zero stage 3: no free parameter slot for segment %d (all %zu in use)", s, ps.buf.size());
    if (ps.holds[k] >= 0) param_gather_finish(m, ps.holds[k]);
    ps.holds[k] = s;
    ps.in_use[k] = 0;
    floatX* own = ps.buf[k] + z.own_begin(s);
    copy_buffer(own, m.params + z.segs[s].shard_offset, z.shard_len(s) * sizeof(floatX));
    return all_gather_start(seg_group(z, s), own, ps.buf[k], z.shard_len(s) * sizeof(floatX));
}
static void zero_update_segment(GPT& m, int s);
static void zero_reduce_poll(GPT& m);
// A segment's params before its use: a gather in flight (stage 3's prefetch, stages 1-2's after
// the update: zero_update) completes here; stage 3 gathers one its slots do not hold, and points
// the segment's tensors at its slot, in use until params_done; stage 0's deferred update of the
// segment runs here. A block's forward asks for its attention part first and its FFN part where
// the FFN begins (block_forward), so the FFN half's gather or update waits that much later.
static void params_needed(GPT& m, int seg, LayerPart part = PART_ALL) {
    const ZeroLayout& z = m.zero;
    zero_reduce_poll(m);
    if (m.zs.n_pending > 0)
        for (int s : local_segments(m, seg, part)) zero_update_segment(m, s);
    if (m.zs.param_gathers.empty() && !z.params_sharded()) return;
    for (int s : local_segments(m, seg, part)) {
        const bool in_flight = param_gather_finish(m, s);
        if (!z.params_sharded()) continue;
        if (!in_flight && !m.param_slots.find(s)) {
            CommRequest r = params_gather_start(m, s, true);
            comm_finish(r);
        }
        const int k = m.param_slots.slot_of(s);
        m.param_slots.in_use[k] = 1;
        point_segment(m.p, m.config, m.local, z.segs[s], m.param_slots.buf[k]);
    }
}
// Stage 3: starts the gather of segment seg ahead of its params_needed (the model code calls it one
// segment ahead, so the gather runs behind the compute of the segment before). All of a layer's
// segments or none: when the empty slots cannot take them, the gather waits for params_needed
// (a prefetch takes no slot that holds a segment). -1 or another stage's segment: nothing.
static void params_prefetch(GPT& m, int seg) {
    if (!m.zero.params_sharded() || seg < 0 || m.seg_local[seg] < 0) return;
    LocalSegments needed;
    for (int s : local_segments(m, seg))
        if (!m.param_slots.find(s)) needed.s[needed.n++] = s;
    if (needed.n == 0 || !m.param_slots.fit_empty(needed.s, needed.n)) return;
    for (int s : local_segments(m, seg))
        if (!m.param_slots.find(s)) m.zs.param_gathers.emplace_back(s, params_gather_start(m, s, false));
}
// Stage 3: the segment's use is over: its slot is free, or with keep held for the next pass on this
// stage, which starts with it (a forward's last block for its backward; a backward's first blocks
// for the next forward of the chunk)
static void params_done(GPT& m, int seg, bool keep = false) {
    if (!m.zero.params_sharded()) return;
    SegmentSlots<floatX>& ps = m.param_slots;
    for (int s : local_segments(m, seg)) {
        const int k = ps.slot_of(s);
        ps.in_use[k] = 0;
        if (!keep) ps.holds[k] = -1;
        point_segment(m.p, m.config, m.local, m.zero.segs[s], nullptr);
    }
}
// Stage 3: every slot emptied before the params change (the update, a state load): a slot's params
// are always the current ones. Nothing is in use between passes.
static void params_drop_all(GPT& m) {
    SegmentSlots<floatX>& ps = m.param_slots;
    for (size_t k = 0; k < ps.buf.size(); k++) {
        LLMC_CHECK(!ps.in_use[k], "internal: zero stage 3: segment %d in use while the params change", ps.holds[k]);
        if (ps.holds[k] >= 0) param_gather_finish(m, ps.holds[k]);
        ps.holds[k] = -1;
    }
}
// A pass of a step's schedule begins (gpt_pipeline_step): m.next_pass is the stage's pass after it
// (mb -1 outside a step, e.g. an evaluation forward, and after the step's last pass: zero_step_end)
static void pass_begin(GPT& m, PipeOp op, int mb, int chunk) {
    const std::vector<PipeAction>& acts = m.pipe.schedule[m.pipe.stage];
    const int k = find_computation(acts, op, mb, chunk), next = k < 0 ? -1 : next_computation(acts, k);
    m.next_pass = next < 0 ? PipeAction{PIPE_F, -1, -1, -1} : acts[next];
}
// the next pass is op on chunk (of micro-batch mb; -1: any)
static bool next_pass_is(const GPT& m, PipeOp op, int chunk, int mb = -1) {
    const PipeAction& n = m.next_pass;
    return n.mb >= 0 && n.op == op && n.chunk == chunk && (mb < 0 || n.mb == mb);
}
// Stage 3, the blocks of a pass. After block l's forward (chunk, micro-batch mb): its slot is
// freed, or kept where the chunk's backward of mb comes next, which starts with its last block;
// then the block before it, the backward's second, is gathered behind the head (the link would
// idle there: the forward gathers nothing more).
static void forward_block_done(GPT& m, int chunk, int mb, int l) {
    const bool backward_next = l + 1 == m.pipe.layer_end(chunk) && next_pass_is(m, PIPE_B, chunk, mb);
    params_done(m, l + 1, backward_next);
    if (backward_next && l > m.pipe.layer_begin(chunk)) params_prefetch(m, l);
}
// In block l's backward: the block below is gathered behind it; below the chunk's first block, the
// embedding, for a forward of the chunk that comes next.
static void backward_block_prefetch(GPT& m, int chunk, int l) {
    const PipelinePlan& pp = m.pipe;
    params_prefetch(m, l > pp.layer_begin(chunk) ? l : pp.first_vs(chunk) && next_pass_is(m, PIPE_F, chunk) ? 0 : -1);
}
// After block l's backward: the chunk's first two blocks are kept for a forward of the chunk that
// comes next (it starts with them).
static void backward_block_done(GPT& m, int chunk, int l) {
    params_done(m, l + 1, next_pass_is(m, PIPE_F, chunk) && l <= m.pipe.layer_begin(chunk) + 1);
}
// Stage 3: the model segments the next forward of this stage starts with, as many as the slots hold
// beside it (ZERO3_PARAM_SLOTS layer segments): chunk 0's embedding, blocks and final LayerNorm, in
// order. The update gathers them (zero_update), behind the rest of the update and the data loading.
static std::vector<int> forward_first_segments(const GPT& m) {
    const PipelinePlan& pp = m.pipe;
    const int L = m.config.n_layer, n = ZERO3_PARAM_SLOTS;
    std::vector<int> segs;
    if (pp.first_vs(0)) segs.push_back(0);
    for (int l = pp.layer_begin(0); l < pp.layer_end(0); l++) segs.push_back(l + 1);
    if (pp.last_vs(0)) segs.push_back(L + 1);
    segs.resize(std::min((int)segs.size(), n));
    return segs;
}
// --offload optimizer: local segment s's gradient is final (reduced into the accumulator); its
// pieces' download can start (not the embedding's where the tied head adds to it after the backward)
static void offload_start(GPT& m, int s) {
    if (m.zs.count_ready && !m.early_pieces[s].empty())
        offload_download_early<OffloadCopies>(m.update_pieces, m.early_pieces[s], m.grad_acc, m.grad_staging);
}
// Stages 0-1: local segment s's once-per-step reduction over its group (reduce_scatter_sum: the
// owners' slices hold the sums in rank order), started where its gradient is final. It stays in
// flight behind the next segment's backward, one at a time (the receive buffer holds one
// segment): the next start, or zero_reduce_finish before the norm, completes it, and the offload's
// early download follows.
// Stage 0: the all-gather of segment s's reduced slices, in place (no buffer), started once every
// segment's reduction is complete, in table order (the next forward's), and in flight behind the
// norm, which reads only the rank's own slices, and the next step's forward: each segment's update
// waits for its gather at the segment's first use (zero_update_segment). (Started in the backward
// they would delay the reductions behind them on the link, and the norm waits for those.)
static void zero_gather_grads_start(GPT& m, int s) {
    const ZeroLayout& z = m.zero;
    // one rank in the group: nothing to gather, and the update stays in one call at its own place
    // (unless the comm's loopback runs the multi-rank path: comm_moves)
    if (s < 0 || z.stage != 0 || !comm_moves(seg_group(z, s))) return;
    m.zs.grad_gathers.emplace_back(s, all_gather_start(seg_group(z, s), m.grad_acc + z.acc_own(s),
                                                    m.grad_acc + z.segs[s].padded_offset, z.shard_len(s) * 4));
}
// Stages 2-3: each micro-batch's segment reduction (reduce_scatter_add_start) stays in flight
// behind the next segment's backward in the same way, its slot held until it completes.
// A reduction in flight holds a receive buffer (REDUCE_BUFFERS: two);
// those that are ready while none is free wait in a queue, in order, and start when the oldest in
// flight has completed: every hook polls (zero_reduce_poll, never waiting), and where a slot or the
// buffers are needed (grads_needed, the head's per-step reduction) or the step's gradient is
// (zero_reduce_finish) they are waited for. They complete in start order (a segment's micro-batches
// add in order). So a micro-batch's last reductions run behind the next one's forward instead of
// stopping it.
// Stages 0-1: an expert segment's leaves 1.. (--ep: the step's sums of the ep group's other source
// ranks, after padded_total in the accumulator's allocation); none for the others
static std::vector<const float*> extra_leaves(const GPT& m, int s) {
    const ZeroLayout& z = m.zero;
    std::vector<const float*> leaves;
    for (int p = 1; p < z.segs[s].n_leaves; p++) leaves.push_back(m.grad_acc + z.segs[s].padded_offset + z.leaf_at(s, p));
    return leaves;
}
// completes the oldest reduction in flight (if any)
static void zero_reduce_complete(GPT& m) {
    if (m.zs.in_flight.empty()) return;
    ZeroInFlight::Reduction& r = m.zs.in_flight.front();
    const int s = r.s;
    const ZeroLayout& z = m.zero;
    if (z.grads_in_acc()) {
        reduce_scatter_sum_finish(AccumulateGrads(), ZeroFloats(), r.leaf_reqs, seg_reduce_group(z, s),
                                  m.grad_acc + z.segs[s].padded_offset, z.shard_len(s), r.scratch, extra_leaves(m, s));
    } else {
        reduce_scatter_add_finish(AccumulateGrads(), r.leaf_reqs, seg_reduce_group(z, s), m.grad_acc + z.acc_own(s),
                                  m.grad_slots.find(s), z.shard_len(s), r.scratch, z.segs[s].n_leaves);
        m.grad_slots.release(s);
        point_segment(m.g, m.config, m.local, z.segs[s], (float*)nullptr);
    }
    const bool last = r.last;
    m.zs.free_scratch.push_back(r.scratch);
    m.zs.in_flight.pop_front();
    if (last) offload_start(m, s);
}
// starts queued reductions while a receive buffer is free
static void zero_reduce_begin(GPT& m) {
    const ZeroLayout& z = m.zero;
    while (!m.zs.reduce_queue.empty() && !m.zs.free_scratch.empty()) {
        const auto [s, last] = m.zs.reduce_queue.front();
        m.zs.reduce_queue.pop_front();
        ZeroInFlight::Reduction r;
        r.s = s;
        r.last = last;
        r.scratch = m.zs.free_scratch.back();
        m.zs.free_scratch.pop_back();
        if (z.grads_in_acc())
            r.leaf_reqs = reduce_scatter_sum_start(seg_reduce_group(z, s), m.grad_acc + z.segs[s].padded_offset,
                                                   z.shard_len(s), r.scratch, extra_leaves(m, s));
        else
            r.leaf_reqs = reduce_scatter_add_start(seg_reduce_group(z, s), m.grad_slots.find(s), z.shard_len(s), r.scratch,
                                                   z.segs[s].n_leaves);
        m.zs.in_flight.push_back(std::move(r));
    }
}
static bool zero_reduce_ready(GPT& m) {
    ZeroInFlight::Reduction& r = m.zs.in_flight.front();
    for (CommRequest& q : r.leaf_reqs)
        if (!comm_done_early(q)) return false;
    return true;
}
// without waiting: the reductions that can start, start
static void zero_reduce_poll(GPT& m) {
    while (!m.zs.in_flight.empty() && zero_reduce_ready(m)) zero_reduce_complete(m);
    zero_reduce_begin(m);
}
// waits for the oldest in flight and starts what can (all: every queued one completes)
static void zero_reduce_wait(GPT& m, bool all) {
    do {
        zero_reduce_complete(m);
        zero_reduce_begin(m);
    } while (all && !m.zs.in_flight.empty());
}
static void zero_reduce_enqueue(GPT& m, int s, bool last) {
    // NCCL: no queue (it would wait for a fixed point); where no receive buffer is free the compute
    // stream waits for the oldest reduction
    if (!COMM_ORDER_PER_COMMUNICATOR && m.zs.free_scratch.empty()) zero_reduce_wait(m, false);
    m.zs.reduce_queue.emplace_back(s, last);
    zero_reduce_begin(m);
    if (seg_reduce_group(m.zero, s).size == 1) zero_reduce_wait(m, true);  // nothing to wait for: the adds now
}
static bool zero_reduce_holds(const GPT& m, int s) {
    for (const auto& r : m.zs.in_flight)
        if (r.s == s) return true;
    for (const auto& q : m.zs.reduce_queue)
        if (q.first == s) return true;
    return false;
}
static void grads_needed(GPT& m, int seg) {
    const ZeroLayout& z = m.zero;
    zero_reduce_poll(m);
    if (z.grads_in_acc()) return;
    for (int s : local_segments(m, seg)) {
        while (zero_reduce_holds(m, s)) zero_reduce_wait(m, false);  // its previous micro-batch's reduction holds its slot
        float* slot;
        while (!(slot = m.grad_slots.acquire(s))) {  // its class's slots: held by reductions in flight or queued
            LLMC_CHECK(!m.zs.in_flight.empty() || !m.zs.reduce_queue.empty(),
                       "internal: zero stage 2-3: no gradient slot for segment %d", s);
            zero_reduce_wait(m, false);
        }
        buffer_zero(slot, z.segs[s].n_leaves * z.segs[s].padded * sizeof(float));
        point_segment(m.g, m.config, m.local, z.segs[s], slot);
    }
}
// TIED_PER_RANK (stages 0-1): the head's gradient of the rank's micro-batches joins the embedding's
// accumulator before the embedding's one reduction (with pp it comes from the last stage first:
// tied_embedding_sum sends it). head_acc is left zero: the head's part is in the accumulator now.
static void tied_head_into_embedding(GPT& m, int s) {
    if (m.zero.segs[s].id != 0 || !m.head_acc) return;
    const size_t n = m.head.padded_total;
    if (m.pipe.P > 1) p2p_group(comm_world().pp, {{false, m.head_acc, n * sizeof(float), m.pipe.P - 1, TIED_EMBEDDING_TAG}});
    grad_accumulate(m.grad_acc + m.zero.segs[s].padded_offset, m.head_acc, n);
    buffer_zero(m.head_acc, n * sizeof(float));
}
static void zero_reduce_start(GPT& m, int s) {
    if (m.zs.reduced[s]) return;
    m.zs.reduced[s] = 1;
    tied_head_into_embedding(m, s);
    zero_reduce_enqueue(m, s, true);
}
// local segment s's weight gradients of this micro-batch are complete
static void segment_grads_ready(GPT& m, int s) {
    const ZeroLayout& z = m.zero;
    // the step's last micro-batch of this segment: its gradient is final
    const bool last = m.zs.reduce_at > 0 && ++m.zs.ready_count[s] == m.zs.reduce_at;
    if (z.grads_in_acc()) {
        if (last) zero_reduce_start(m, s);
        return;
    }
    if (z.segs[s].id == 0 && m.tied == TIED_PER_MICRO_BATCH)  // the micro-batch's head gradient joins the embedding's
        grad_accumulate(m.grad_slots.find(s), m.head_leaf, m.head.padded_total);
    zero_reduce_enqueue(m, s, last);
}
// After block l's FFN weight gradients (before its attention's): the FFN part's reductions can
// start, behind the attention's backward. A block's grads_ready, which always follows it, does
// the attention part.
static void ffn_grads_ready(GPT& m, int l) {
    zero_reduce_poll(m);
    for (int s : local_segments(m, l + 1, PART_FFN)) segment_grads_ready(m, s);
}
static void grads_ready(GPT& m, int seg) {
    zero_reduce_poll(m);
    for (int s : local_segments(m, seg, PART_ATTENTION)) segment_grads_ready(m, s);
}
// The tied lm head's gradient of this micro-batch (head_leaf, fp32), by the layout's TiedSum
// (llmc/gpt/layout.h): per rank, folded into head_acc (it joins the embedding's accumulator before
// the embedding's reduction); per micro-batch, left in head_leaf for the embedding's slot; per
// step, reduce-scattered over the dp group into head_acc's slice.
static void head_grads_ready(GPT& m) {
    if (m.tied == TIED_PER_RANK) grad_accumulate(m.head_acc, m.head_leaf, m.head.padded_total);
    else if (m.tied == TIED_PER_STEP) {
        zero_reduce_wait(m, true);  // (the segments', in the receive buffer)
        reduce_scatter_add(AccumulateGrads(), comm_world().dp, m.head_acc, m.head_leaf, m.head.shard_len(0), m.comm_scratch);
    }
}
static void grad_blocks_finish(GPT& m);
// Before the norm: every segment's reduction completes (stages 0-1: one not started in the
// backward, e.g. after gpt_backward, runs now). Stage 0 then starts the gathers of the reduced
// gradient, which must be final: --grad_blocks (one process; with the loopback its gathers run)
// adds its last block here, before them, not after in gpt_grad_norm (at -z 0 in one stage the tied
// head has nothing to add between: the same adds in the same order).
static void zero_reduce_finish(GPT& m) {
    if (m.zero.grads_in_acc())
        for (int s = 0; s < (int)m.zero.segs.size(); s++) zero_reduce_start(m, s);
    zero_reduce_wait(m, true);
    if (m.zero.stage == 0) grad_blocks_finish(m);
    for (int s = 0; s < (int)m.zero.segs.size(); s++) zero_gather_grads_start(m, s);
}
// A step's forwards and backwards: each segment's gradient is final at its last grads_ready of
// the step (stages 0-1 reduce it there, --offload starts its download).
static void zero_step_begin(GPT& m) {
    const bool backward = m.dloss_scale != 0.0f;
    m.zs.reduce_at = backward ? (int)m.batches.size() : 0;
    m.zs.count_ready = m.offload == OFFLOAD_OPTIMIZER && backward;
    offload_early_reset(m.update_pieces.size());
}
static void zero_step_end(GPT& m) {
    m.zs.reduce_at = 0;
    m.zs.count_ready = false;
    m.next_pass = PipeAction{PIPE_F, -1, -1, -1};
}
// what is still in flight of a backward whose norm was never taken or of a step that was not
// applied (before the next step's zeroing), and the segments' progress back to none; the gathers
// of stage 0's deferred updates stay
static void zero_drain(GPT& m) {
    std::fill(m.zs.ready_count.begin(), m.zs.ready_count.end(), 0);
    std::fill(m.zs.reduced.begin(), m.zs.reduced.end(), 0);
    zero_reduce_wait(m, true);
    auto& gathers = m.zs.grad_gathers;
    for (auto& g : gathers)
        if (!m.zs.update_pending[g.first]) comm_finish(g.second);
    gathers.erase(std::remove_if(gathers.begin(), gathers.end(), [&](const auto& g) { return !g.second.active(); }),
                  gathers.end());
}
// The step's accumulator from zero: every segment's but those whose deferred update (stage 0) is
// still to read their gradient (zero_update_segment clears those after it).
static void zero_clear_grads(GPT& m) {
    const ZeroLayout& z = m.zero;
    if (m.zs.n_pending == 0) return buffer_zero(m.grad_acc, z.acc_alloc_elems() * sizeof(float));
    if (z.extra_leaves > 0) buffer_zero(m.grad_acc + z.acc_elems(), z.extra_leaves * sizeof(float));
    for (int s = 0; s < (int)z.segs.size(); s++)
        if (!m.zs.update_pending[s]) buffer_zero(m.grad_acc + z.segs[s].padded_offset, z.segs[s].padded * sizeof(float));
}
// --grad_blocks G > 1 on one process (llmc/gpt/layout.h): the step's micro-batches run block by
// block, position p being global micro-batch (p % k) * G + p / k (k = M / G per block), so that each
// block's gradient is summed in the accumulator as a data-parallel rank sums its micro-batches;
// after each block but the last, that sum (wte's with the head's part) is added into grad_total
// (the blocks' left fold, as the reduction adds the ranks' sums) and the accumulator starts again;
// the last block's joins it before the norm (grad_blocks_finish).
template <typename T> static std::vector<T> grad_block_order(const std::vector<T>& global, int G) {
    std::vector<T> out(global.size());
    const size_t k = global.size() / G;
    for (size_t p = 0; p < out.size(); p++) out[p] = global[(p % k) * G + p / k];
    return out;
}
template <typename T> static std::vector<T> global_order_of(const std::vector<T>& blocked, int G) {
    std::vector<T> out(blocked.size());
    const size_t k = blocked.size() / G;
    for (size_t p = 0; p < out.size(); p++) out[(p % k) * G + p / k] = blocked[p];
    return out;
}
// after position p's backward
static void grad_block_done(GPT& m, int p) {
    const int M = (int)m.batches.size();
    if (m.grad_blocks <= 1 || m.dloss_scale == 0.0f || (p + 1) % (M / m.grad_blocks) != 0 || p + 1 == M) return;
    const size_t n = m.zero.acc_elems();
    tied_head_into_embedding(m, m.seg_local[0]);
    grad_accumulate(m.grad_total, m.grad_acc, n);
    buffer_zero(m.grad_acc, n * sizeof(float));
    m.blocks_folded = true;
}
static void grad_blocks_reset(GPT& m) {
    if (m.grad_total) buffer_zero(m.grad_total, m.zero.acc_elems() * sizeof(float));
    m.blocks_folded = false;
}
static void grad_blocks_finish(GPT& m) {
    if (!m.blocks_folded) return;
    grad_accumulate(m.grad_acc, m.grad_total, m.zero.acc_elems());
    m.blocks_folded = false;
}
// After the update, stages 1-2: each segment's updated slices are all-gathered, started here in
// segment order (the next forward's) and completed at the segment's first use (params_needed), so
// they run behind the next step's data loading and the forward of the segments before. Whatever
// reads the params outside a forward completes them all first (zero_settle). In flight, a
// gather reads the rank's own slice (the update writes only that) and writes the others.
static void zero_gather_params_start(GPT& m, int s) {
    const ZeroLayout& z = m.zero;
    if ((z.stage == 1 || z.stage == 2) && comm_moves(seg_group(z, s)))
        m.zs.param_gathers.emplace_back(s, all_gather_start(seg_group(z, s), m.params + z.params_own(s),
                                                         m.params + z.segs[s].padded_offset, z.shard_len(s) * sizeof(floatX)));
}
static void zero_gather_params(GPT& m) {
    for (int s = 0; s < (int)m.zero.segs.size(); s++) zero_gather_params_start(m, s);
    for (int seg : m.zero.params_sharded() ? forward_first_segments(m) : std::vector<int>()) params_prefetch(m, seg);
}
// The update in the order that starts the gathers earliest: at stages 1-2 segment by segment, each
// one's all-gather started as soon as the rank's slice of it is updated (so the first segments'
// gathers run behind the later segments' updates, and are the first the next forward needs); at
// stage 0 with dp > 1 each segment's where its gradient's all-gather completes, at its first use
// in the next forward (or zero_settle); at stage 3 the next forward's first segments so (their
// gathers into the slots, which params_drop_all emptied), then every other piece in one call;
// elsewhere every piece in one call. update(pieces): AdamW over those of m.update_pieces (kept,
// for stage 0: it must own what it reads).
template <typename Update> static void zero_update(GPT& m, const Update& update) {
    const ZeroLayout& z = m.zero;
    if (z.stage == 0 && !m.zs.grad_gathers.empty()) {
        m.zs.deferred_update = update;
        std::fill(m.zs.update_pending.begin(), m.zs.update_pending.end(), 1);
        m.zs.n_pending = (int)z.segs.size();
        return;
    }
    if (z.stage == 3) {
        std::vector<char> first(z.segs.size(), 0);
        for (int seg : forward_first_segments(m)) {
            for (int s : local_segments(m, seg)) {
                update(m.seg_pieces[s]);
                first[s] = 1;
            }
            params_prefetch(m, seg);
        }
        std::vector<int> rest;
        for (int s = 0; s < (int)z.segs.size(); s++)
            if (!first[s]) rest.insert(rest.end(), m.seg_pieces[s].begin(), m.seg_pieces[s].end());
        return update(rest);
    }
    if (z.stage != 1 && z.stage != 2) {
        std::vector<int> all(m.update_pieces.size());
        std::iota(all.begin(), all.end(), 0);
        return update(all);
    }
    for (int s = 0; s < (int)z.segs.size(); s++) {
        update(m.seg_pieces[s]);
        zero_gather_params_start(m, s);
    }
}
// param_gathers' key of the tied head's copy in flight (pp > 1, tied_embedding_refresh): on the
// embedding's stage the send of the updated weights, on the last stage their receive
constexpr int HEAD_COPY = -2;
// The last stage's copy of the tied embedding complete: its receive, then (dp > 1) the all-gather
// of the slices the dp ranks received. At its first use (head_weights), or zero_settle.
static void head_copy_complete(GPT& m) {
    if (!param_gather_finish(m, HEAD_COPY)) return;
    if (!m.pipe.has_head() || comm_world().dp.size == 1) return;
    const size_t bytes = m.head.shard_len(0) * sizeof(floatX);
    all_gather(comm_world().dp, m.head_params + m.head.own_begin(0), m.head_params, bytes);
}
// Every transfer of params or gradients still in flight completes, and stage 0's deferred updates
// run: for a checkpoint, an export, the ranks' agreement check, whatever reads params or optimizer
// state outside a forward. zero_settle_params: the params' side only, stages 1-2's gathers of the
// updated params and the tied head's copy (before an update writes the slices they read; stage 0's
// gradient gathers stay in flight).
static void zero_settle_params(GPT& m) {
    head_copy_complete(m);
    for (auto& g : m.zs.param_gathers) comm_finish(g.second);
    m.zs.param_gathers.clear();
}
static void zero_settle(GPT& m) {
    for (int s = 0; s < (int)m.zero.segs.size() && m.zs.n_pending > 0; s++) zero_update_segment(m, s);
    zero_settle_params(m);
    for (auto& g : m.zs.grad_gathers) comm_finish(g.second);
    m.zs.grad_gathers.clear();
}
// Stage 0's deferred update of local segment s (zero_update): its gradient's all-gather completes,
// its pieces are updated, its accumulator is cleared for the step it is in (zero_clear_grads left
// it). The same AdamW over the same pieces as in one call: the order of segments changes nothing.
static void zero_update_segment(GPT& m, int s) {
    if (!m.zs.update_pending[s]) return;
    auto g = std::find_if(m.zs.grad_gathers.begin(), m.zs.grad_gathers.end(), [&](const auto& x) { return x.first == s; });
    if (g != m.zs.grad_gathers.end()) {
        comm_finish(g->second);
        m.zs.grad_gathers.erase(g);
    }
    m.zs.deferred_update(m.seg_pieces[s]);
    const Segment& seg = m.zero.segs[s];
    buffer_zero(m.grad_acc + seg.padded_offset, seg.padded * sizeof(float));
    m.zs.update_pending[s] = 0;
    if (--m.zs.n_pending == 0) m.zs.deferred_update = nullptr;
}
// the tied lm head's weights: the embedding's in one stage, the last stage's copy with pp > 1;
// an untied head's own matrix (in the final segment, gathered with it)
static const floatX* head_weights(GPT& m) {
    if (!m.config.tie_embeddings) return m.p.lm_head;
    if (m.head_params) {
        head_copy_complete(m);
        return m.head_params;
    }
    params_needed(m, 0);
    return m.p.wte;
}
// (stage 3 without a pipeline: the embedding's slot, held since the embedding's forward)
static void head_done(GPT& m) {
    if (m.config.tie_embeddings && !m.head_params) params_done(m, 0);
}

// ---- tensor-parallel glue (llmc/parallel/tensor_parallel.h) ----
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
// The backward starts the weight gradients' gather before the input gradient's matmul
// (ln_gather_start), which then runs behind it; ln_gathered completes it.
static void ln_gather_start(GPT& m, const floatX* local, int k) {
    if (!m.ls.sp) return;
    const size_t n = (size_t)stream_rows(m) * m.config.n_embd;
    copy_buffer(m.ln_full[k] + m.ls.rank * n, local, n * sizeof(floatX));
    m.ln_gathering[k] = all_gather_start(tp_group(), m.ln_full[k] + m.ls.rank * n, m.ln_full[k], n * sizeof(floatX));
}
static const floatX* ln_gathered(GPT& m, const floatX* local, int k) {
    if (!m.ls.sp) return local;
    if (!m.ln_gathering[k].active()) ln_gather_start(m, local, k);
    comm_finish(m.ln_gathering[k]);
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
// (capacity: dst's elements; a caller with more rows than the plan sized it for is a bug, caught here)
static size_t gather_columns(floatX* dst, size_t capacity, const floatX* src, size_t rows, size_t ld,
                             const SplitRanges& ranges) {
    size_t w = 0, at = 0;
    for (const SplitRange& r : ranges) w += r.n;
    LLMC_CHECK(rows * w <= capacity, "internal: %zu x %zu columns gathered into a tensor-parallel copy of %zu elements",
               rows, w, capacity);
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

// a reduction of the activations in flight (tp_sum_start): moved on to its all-gather, completed
static void tp_advance(TpSumPending<floatX>& p) { tp_sum_advance(p, tp_add, tp_copy); }
static void tp_finish(TpSumPending<floatX>& p) { tp_sum_finish(p, tp_add, tp_copy); }

// A micro-batch's parts between blocks (block_forward_parts: tensor parallel without --sp, a dense
// block): part k's reductions in lane k of the scratch (1/K of it each: K in flight, no more memory);
// into[k] the one that makes part k's input to the next block (a block's FFN output, or the
// embedding), completed by land(k) (its bias, the residual add fused with the next LayerNorm) just
// before the next block reads the part, so the last parts' reductions run behind the next block's
// first parts. A reduction moves on to its all-gather in the order they started (parts_advance):
// the same calls in the same order on every rank, whatever arrived first.
struct ForwardParts {
    int K = 0, rows = 0;  // parts (0: none in flight), tokens per part
    TpScratch<floatX> lane[4];
    TpSumPending<floatX> attn[4], into[4];
    std::vector<TpSumPending<floatX>*> started;  // not yet moved on to their all-gather, oldest first
    std::function<void(int)> land;
    bool landed[4] = {};
};
// The parts block l runs in (0: whole): 4 where the micro-batch's sequences allow, else 2.
static int forward_parts(const GPT& m, int l) {
    if (tp_group().size == 1 || m.ls.sp || m.config.is_moe(l) || m.B % 2 != 0) return 0;
    return m.B % 4 == 0 ? 4 : 2;
}
// Whether block l's parts stay in flight into what comes after it (the next block, the final
// LayerNorm): not with ZeRO-3, whose slot of block l's params (the FFN bias that land adds) is freed
// and reused as the block ends.
static bool forward_parts_carry(const GPT& m, int l) { return forward_parts(m, l) > 0 && !m.zero.params_sharded(); }
static void parts_begin(GPT& m, ForwardParts& p, int K) {
    LLMC_CHECK(p.K == 0 || p.K == K, "internal: %d parts in flight into a block of %d", p.K, K);
    if (p.K == K) return;
    p.K = K;
    p.rows = m.B / K * m.T;
    for (int k = 0; k < K; k++) {
        p.lane[k] = tp_scratch_lane(m.tpx, (size_t)p.rows * m.config.n_embd, m.ls.tp, k);
        p.landed[k] = true;
    }
}
static void parts_start(ForwardParts& p, TpSumPending<floatX>& slot, TpSumPending<floatX>&& r) {
    p.started.erase(std::remove(p.started.begin(), p.started.end(), &slot), p.started.end());
    slot = std::move(r);
    p.started.push_back(&slot);
}
static void parts_advance(ForwardParts& p) {
    while (!p.started.empty()) {
        TpSumPending<floatX>* r = p.started.front();
        p.started.erase(p.started.begin());
        if (!r->exchange.empty()) {
            tp_advance(*r);
            return;
        }
    }
}
static void parts_land(ForwardParts& p, int k) {
    if (p.landed[k]) return;
    p.landed[k] = true;
    p.land(k);
}
// every part landed, nothing left in flight
static void parts_land_all(ForwardParts& p) {
    for (int k = 0; k < p.K; k++) parts_land(p, k);
    p.K = 0;
    p.started.clear();
    p.land = nullptr;
}

// Row-parallel linear: out = sum over the split input dimension K of inp[.., K] W[OC, K]^T, the
// canonical leaves being slices of K (one matmul each, on copies of the slice when it is not the
// rank's whole K), then + bias once. n_batch > 1: the experts of an MoE layer (inp [E, rows, K],
// W [E, OC, K], bias [E, OC]). scatter (--sp): this rank keeps its rows of the sum. _start leaves
// the reduction in flight in scratch s (row_parallel_finish completes it and adds the bias).
static TpSumPending<floatX> row_parallel_start(GPT& m, TpScratch<floatX>& s, floatX* out, const floatX* inp,
                                               const floatX* W, int n_batch, int rows, int K, int OC,
                                               const ChunkSplit& split, bool scatter) {
    const size_t per = (size_t)K / split.count, n = (size_t)n_batch * rows * OC;
    auto leaf = [&](int g, floatX* dst) {
        const SplitRanges r = {{(g - split.first) * per, per}};
        const floatX *a = inp, *b = W;
        if (!covers(r, K)) {
            gather_columns(m.tp_copy_a, m.tp_copy_a_elems, inp, (size_t)n_batch * rows, K, r);
            gather_columns(m.tp_copy_b, m.tp_copy_b_elems, W, (size_t)n_batch * OC, K, r);
            a = m.tp_copy_a;
            b = m.tp_copy_b;
        }
        matmul_forward_batched(dst, a, b, (const floatX*)nullptr, n_batch, rows, (int)per, OC);
    };
    return tp_sum_start(tp_group(), split, s, out, n, !scatter, leaf, tp_add, tp_copy);
}
static void row_parallel_finish(GPT& m, TpSumPending<floatX>& p, const floatX* bias, int n_batch, int rows, int OC,
                                bool scatter) {
    tp_finish(p);
    if (!bias) return;
    const int out_rows = scatter ? rows / m.ls.tp : rows;
    for (int e = 0; e < n_batch; e++) add_bias(p.dst + (size_t)e * out_rows * OC, bias + (size_t)e * OC, out_rows, OC);
}
static void row_parallel_forward(GPT& m, floatX* out, const floatX* inp, const floatX* W, const floatX* bias, int n_batch,
                                 int rows, int K, int OC, const ChunkSplit& split, bool scatter) {
    if (!m.canonical && tp_group().size == 1) {  // the GPU build on one tp rank: one matmul, bias fused in
        matmul_forward_batched(out, inp, W, bias, n_batch, rows, K, OC);
        return;
    }
    TpSumPending<floatX> p = row_parallel_start(m, m.tpx, out, inp, W, n_batch, rows, K, OC, split, scatter);
    row_parallel_finish(m, p, bias, n_batch, rows, OC, scatter);
}

// Input gradient of a column-parallel linear: dinp[.., C] = sum over the split output dimension OC
// of dout[.., OC] W[OC, C]; a leaf's output rows are `ranges(j)` for its j-th leaf on this rank.
// _start leaves the reduction in flight (tp_advance, tp_finish complete it; the backward computes
// the layer's weight gradients meanwhile).
template <typename Ranges>
static TpSumPending<floatX> column_parallel_dinp_start(GPT& m, TpScratch<floatX>& s, floatX* dinp, const floatX* dout,
                                                       const floatX* W, int n_batch, int rows, int C, int OC,
                                                       const ChunkSplit& split, const Ranges& ranges, bool scatter) {
    const size_t n = (size_t)n_batch * rows * C;
    auto leaf = [&](int g, floatX* dst) {
        const SplitRanges r = ranges(g - split.first);
        if (covers(r, OC)) {
            matmul_backward_batched(dst, (float*)nullptr, (float*)nullptr, dout, (const floatX*)nullptr, W, n_batch, rows, C, OC);
            return;
        }
        const size_t w = gather_columns(m.tp_copy_a, m.tp_copy_a_elems, dout, (size_t)n_batch * rows, OC, r);
        LLMC_CHECK((size_t)n_batch * w * C <= m.tp_copy_b_elems, "internal: %d x %zu weight rows copied into a "
                   "tensor-parallel copy of %zu elements", n_batch, w, m.tp_copy_b_elems);
        for (int e = 0; e < n_batch; e++) {
            size_t at = 0;
            for (const SplitRange& x : r) {
                copy_buffer(m.tp_copy_b + ((size_t)e * w + at) * C, W + ((size_t)e * OC + x.at) * C, x.n * C * sizeof(floatX));
                at += x.n;
            }
        }
        matmul_backward_batched(dst, (float*)nullptr, (float*)nullptr, m.tp_copy_a, (const floatX*)nullptr, m.tp_copy_b,
                                n_batch, rows, C, (int)w);
    };
    return tp_sum_start(tp_group(), split, s, dinp, n, !scatter, leaf, tp_add, tp_copy);
}
template <typename Ranges>
static void column_parallel_dinp(GPT& m, floatX* dinp, const floatX* dout, const floatX* W, int n_batch, int rows, int C,
                                 int OC, const ChunkSplit& split, const Ranges& ranges, bool scatter) {
    TpSumPending<floatX> p = column_parallel_dinp_start(m, m.tpx, dinp, dout, W, n_batch, rows, C, OC, split, ranges, scatter);
    tp_finish(p);
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
// The attention backward of the rank's heads: the op, or where a kv head is shared by several tp
// ranks, the group's (shared_kv_attention_backward).
static void tp_attention_backward(GPT& m, floatX* dqkv, const floatX* dout, const LayerActs& a, const int* doc_start) {
    if (comm_world().tp_kv.size > 1) {
        shared_kv_attention_backward(m, dqkv, dout, a, doc_start);
        return;
    }
    const LocalShape& ls = m.ls;
    attention_backward(dqkv, dout, a.qkv, a.atty, a.att_lse, doc_start, m.B, m.T, ls.n_head, ls.n_kv_head, ls.hs,
                       m.config.pos == POS_ALIBI ? m.config.n_head : 0, ls.head0);
}

// A LayerNorm's weight and bias gradients (RMSNorm's: its weight's), summed over canonical token
// chunks (the rank's stream rows: with --sp the tp group adds the chunks of every rank; otherwise
// every rank has all of them) in fp32, then added into the gradients once.
static void norm_weight_grads(GPT& m, float* dweight, float* dbias, const floatX* dout, const floatX* inp,
                              const float* mean, const float* rstd) {
    const int C = m.config.n_embd;
    const bool rms = m.config.rmsnorm();
    const size_t n_grads = (rms ? 1 : 2) * (size_t)C;
    // the canonical token chunks of this micro-batch (B*T may be below the allocated maximum)
    const long n = (long)m.B * m.T;
    const int G = tp_token_chunks(m.config, n);
    const ChunkSplit split = m.ls.sp ? chunk_split(n, G, m.ls.tp, m.ls.rank, m.canonical)
                                     : chunk_split(n, G, 1, 0, m.canonical);
    const size_t per = (size_t)stream_rows(m) / split.count;
    auto leaf = [&](int g, float* dst) {
        const size_t t0 = (g - split.first) * per;
        buffer_zero(dst, n_grads * sizeof(float));
        if (rms) rmsnorm_backward((floatX*)nullptr, dst, dout + t0 * C, inp + t0 * C, (const floatX*)nullptr, rstd + t0,
                                  (int)per, C);
        else layernorm_backward((floatX*)nullptr, dst, dst + C, dout + t0 * C, inp + t0 * C, (const floatX*)nullptr,
                                mean + t0, rstd + t0, (int)per, C);
    };
    tp_sum(m.ls.sp ? tp_group() : tp_single(), split, m.tpf, m.tp_ln_grads, n_grads, true, leaf, tp_add_f, tp_copy_f);
    tp_add_f(dweight, m.tp_ln_grads, C);
    if (!rms) tp_add_f(dbias, m.tp_ln_grads + C, C);
}

// ---- micro-batches in flight (the pipeline schedule's activation slots and stashes) ----
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
            copy_to_buffer_async(s.inputs, b.inputs, n);  // (queued: no host sync inside a step)
            copy_to_buffer_async(s.doc_start, b.doc_start, n);
            if (b.targets) copy_to_buffer_async(s.targets, b.targets, n);
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

// The vocab-parallel softmax cross-entropy of one token chunk: n rows of m.logits (the rank's
// vocabulary columns), their targets and losses. The max over every rank's columns, the sum of
// exponentials over canonical vocabulary chunks, the target's logit from the rank that holds it;
// then the losses (every rank the same) and, with a loss scale, the rank's dlogits in place. Every
// statistic is per token, so the chunk's rows get the bits the whole micro-batch's would. The GPU
// build on one tp rank: the fused kernel, one pass.
static void vocab_parallel_loss(GPT& m, const int* targets, float* losses, int n, float dloss) {
    const LocalShape& ls = m.ls;
    const int Vl = ls.vocab, n_real = std::max(0, std::min(Vl, m.config.vocab_size - ls.vocab0));  // real columns
    if (!m.canonical && ls.tp == 1) {
        fused_classifier(m.logits, losses, targets, dloss, n, m.config.vocab_size, Vl);
        return;
    }
    const ChunkSplit one = rank_leaf(tp_group());
    tp_sum(tp_group(), one, m.tpf, m.ce_max, n, true,
           [&](int, float* dst) { classifier_max(dst, m.logits, n, Vl, n_real); }, tp_max_f, tp_copy_f);
    const ChunkSplit& split = m.split_vocab;
    const int per = Vl / split.count;
    tp_sum(tp_group(), split, m.tpf, m.ce_sum, n, true, [&](int g, float* dst) {
        const int c0 = (g - split.first) * per;
        classifier_sumexp(dst, m.logits, m.ce_max, n, Vl, std::min(c0, n_real), std::min(c0 + per, n_real));
    }, tp_add_f, tp_copy_f);
    tp_sum(tp_group(), one, m.tpf, m.ce_target, n, true,
           [&](int, float* dst) { classifier_target(dst, m.logits, targets, n, Vl, ls.vocab0, n_real); }, tp_add_f,
           tp_copy_f);
    classifier_backward(m.logits, losses, m.ce_max, m.ce_sum, m.ce_target, targets, dloss, n, Vl, ls.vocab0, n_real);
}
// The gradient at the final LayerNorm's output of one token chunk: dx [n, C] = dlogits [n, Vl] W
// summed over the vocabulary's canonical chunks (every rank gets the chunk's rows: with --sp a
// chunk's rows need not be the rank's, which take theirs from the whole micro-batch's afterwards).
// (_start: its reduction left in flight, tp_finish completes it)
static TpSumPending<floatX> vocab_parallel_dinp_start(GPT& m, floatX* dx, const floatX* dlogits, const floatX* W, int n) {
    const size_t per = (size_t)m.ls.vocab / m.split_vocab.count;
    return column_parallel_dinp_start(m, m.tpx, dx, dlogits, W, 1, n, m.config.n_embd, m.ls.vocab, m.split_vocab,
                                      [&](int j) { return SplitRanges{{j * per, per}}; }, false);
}

// Expert parallelism (--ep): an MoE layer's rows [E, cap, C] in expert order, the tokens this rank
// chose for every expert, go to the experts' owners (ep rank q owns experts [q E/ep, (q+1) E/ep),
// a contiguous block of the rows) with one all-to-all; the owner receives [ep][E/ep][cap][C], the
// rows of each source rank for its experts, and returns the outputs the same way. Every size is the
// capacity, known at start-up: no count is exchanged. Without --ep the rows stay in place.
// Overlapped (as Tutel's a2a_ffn_overlap, Hwang et al. 2023, and DeepSpeed-MoE's pipelined
// all-to-all, Rajbhandari et al. 2022, chunk the exchange): the rows a rank chose for its own
// experts never leave it, so the experts compute them while the other ranks' rows are in flight,
// and the exchange is cut into slices, one per local expert (its rows from every source, a
// contiguous part of each rank's block), so that the experts compute slice j while slice j+1 is
// in flight; on the way back the others' outputs go slice by slice as they are computed, the own
// rows last, in place. Each expert's rows of each source are separate matmuls, as before: the
// order changes no sum.
static floatX* expert_dispatch_buffer(GPT& m, floatX* rows) { return m.ls.ep > 1 ? m.ep_buf : rows; }
static size_t expert_block(const GPT& m, int width) {
    return (size_t)m.ls.n_expert * m.config.moe_capacity(m.B, m.T) * width;
}
// local expert j's rows of every other source, from send to recv (both [ep][E/ep][cap][width])
static CommRequest expert_slice_start(GPT& m, const floatX* send, floatX* recv, int width, int j) {
    const size_t slice = (size_t)m.config.moe_capacity(m.B, m.T) * width, at = (size_t)j * slice;
    return all_to_all_start(comm_world().ep, send + at, recv + at, slice * sizeof(floatX), true,
                            expert_block(m, width) * sizeof(floatX));
}
// The other ranks' rows of m.ep_buf on their way to received, a request per local expert's slice
// (complete slice j before reading it); the own rows copied at once. None without --ep.
static std::vector<CommRequest> expert_dispatch_start(GPT& m, floatX* received, int width) {
    std::vector<CommRequest> slices;
    if (m.ls.ep == 1) return slices;
    const size_t block = expert_block(m, width), own = (size_t)comm_world().ep.rank * block;
    copy_buffer(received + own, m.ep_buf + own, block * sizeof(floatX));
    for (int j = 0; j < m.ls.n_expert; j++) slices.push_back(expert_slice_start(m, m.ep_buf, received, width, j));
    return slices;
}
// local expert j's outputs of the other sources (in m.ep_buf) on their way back into own_rows
static CommRequest expert_return_start(GPT& m, floatX* own_rows, int width, int j) {
    if (m.ls.ep == 1) return CommRequest();
    return expert_slice_start(m, m.ep_buf, own_rows, width, j);
}

// ---- pipeline stage transfers ----
// Where a pipeline transfer's bytes are: activations leave from the chunk's last block output and
// arrive in the slot's input; gradients leave and arrive in the slot's d_stream. A message is
// named by (micro-batch, direction, sending virtual stage), below TIED_EMBEDDING_TAG.
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

// The tied embedding (Press & Wolf 2017): the lm head's gradient of wte joins the embedding's as
// the layout's TiedSum says (llmc/gpt/layout.h); the stage that holds the embedding owns wte's
// optimizer state, and with pp > 1 the last stage keeps a copy of the weights, refreshed after
// every update (tied_embedding_refresh; Megatron's embedding group does the same between the first
// and the last stage).
// head_acc's elements: per rank, the whole head (the embedding's stage with pp: the receive
// buffer); per step, the rank's slice of the head's step gradient; per micro-batch, none
static size_t head_acc_elems(const GPT& m) {
    return m.tied == TIED_PER_RANK ? m.head.padded_total : m.tied == TIED_PER_STEP ? m.head.shard_len(0) : 0;
}
// After the backward. Per rank with pp > 1: the last stage sends the head's gradient of its
// micro-batches to the first (which adds it before the embedding's reduction: tied_head_into_embedding).
// Per step: the slices of the head's gradient, reduced over dp in the backward, join the embedding's
// accumulator after its reduction (sent from the last stage to the first with pp > 1).
static void tied_embedding_sum(GPT& m) {
    const PipelinePlan& pp = m.pipe;
    if (m.tied == TIED_NONE || (!pp.has_embedding() && !pp.has_head())) return;
    if (m.tied == TIED_PER_RANK) {
        if (pp.P > 1 && pp.has_head())
            p2p_group(comm_world().pp, {{true, m.head_acc, m.head.padded_total * sizeof(float), 0, TIED_EMBEDDING_TAG}});
        return;
    }
    if (m.tied != TIED_PER_STEP) return;
    const size_t n = m.head.shard_len(0);
    if (pp.P > 1 && pp.has_head()) p2p_group(comm_world().pp, {{true, m.head_acc, n * sizeof(float), 0, TIED_EMBEDDING_TAG}});
    if (!pp.has_embedding()) return;
    if (pp.P > 1) p2p_group(comm_world().pp, {{false, m.head_acc, n * sizeof(float), pp.P - 1, TIED_EMBEDDING_TAG}});
    grad_accumulate(m.grad_acc + m.zero.acc_own(m.seg_local[0]), m.head_acc, n);
}
// After the update (pp > 1): the embedding's stage sends the rank's slice of the updated weights
// to the last stage, started here and in flight behind the next step's data loading and the
// forwards before the head; the last stage completes it at the head's first use (head_weights),
// after its first micro-batch's blocks.
static void tied_embedding_refresh(GPT& m) {
    const PipelinePlan& pp = m.pipe;
    if (m.tied == TIED_NONE || pp.P == 1 || (!pp.has_embedding() && !pp.has_head())) return;
    const ZeroLayout& z = m.zero;
    const size_t n = m.head.shard_len(0), bytes = n * sizeof(floatX);
    if (pp.has_embedding()) zero_update_segment(m, m.seg_local[0]);  // (stage 0: the embedding's update now)
    if (pp.has_embedding())
        m.zs.param_gathers.emplace_back(HEAD_COPY, p2p_start(comm_world().pp, {{true, m.params + z.params_own(m.seg_local[0]),
                                                                               bytes, pp.P - 1, TIED_EMBEDDING_TAG}}));
    if (pp.has_head())
        m.zs.param_gathers.emplace_back(HEAD_COPY, p2p_start(comm_world().pp, {{false, m.head_params + m.head.own_begin(0),
                                                                               bytes, 0, TIED_EMBEDDING_TAG}}));
}
