// A chapter of train_gpt.cu (included once, after the GPT struct): the memory plan and the
// allocation. gpt_allocate takes every buffer of a model, once, before the first step (the step
// allocates nothing); run with mem.plan_only it only counts them, and that count is the plan
// (llmc/memory.h): gpt_memory_estimate, the start-up tables and the memory guard read it.

// Every buffer comes from here (llmc/memory.h): counted in the plan, carved from its kind's arena.
static void* take(GPT& m, MemKind kind, size_t bytes) {
    void* p = m.mem.take(kind, bytes);
    if (kind == MEM_ACTIVATIONS) m.activation_bytes = m.mem.planned[MEM_ACTIVATIONS];
    return p;
}
static floatX* take_act(GPT& m, size_t n) { return (floatX*)take(m, MEM_ACTIVATIONS, n * m.elem_bytes); }
static float* take_stats(GPT& m, size_t n) { return (float*)take(m, MEM_ACTIVATIONS, n * sizeof(float)); }
static int* take_ints(GPT& m, size_t n) { return (int*)take(m, MEM_ACTIVATIONS, n * sizeof(int)); }

// receive buffers of the segment reductions (dp > 1): two, so that a segment's reduction starts the
// moment its gradient is ready even while the one before is still on the link (measured with
// bench_overlap: -z 0/1 one micro-batch about 0.03 lower; np 4 -z 3 at 4 micro-batches step ratio
// 1.46-1.50 -> 1.26-1.29: with one, the link idled between a reduction's end and the next hook's
// start of the one queued behind it). At -z 2/3 it costs the largest segment's fp32 once more.
constexpr int REDUCE_BUFFERS = 2;

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

// The layout of this rank's part of the model (llmc/gpt/layout.h): its groups (a plan's: those it
// plans for), its tensor / expert slice, the canonical reductions, the pipeline stage, the tables
// and the ZeRO layout of its segments. dp, edp: the data-parallel and expert-dp groups.
static void gpt_lay_out(GPT& m, const GPTConfig& config, int B, int T, const Layout& layout, CommGroup& dp,
                        CommGroup& edp) {
    const int zero_stage = layout.zero_stage, recompute = layout.recompute;
    const bool sp = layout.sp;
    dp = comm_world().dp;
    edp = comm_world().edp;
    CommGroup tp = comm_world().tp, ep = comm_world().ep;
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
    // the canonical chunks of the CPU build make tensor parallelism bitwise (llmc/parallel/tensor_parallel.h)
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
    m.logits_chunk = logits_chunk_tokens(config, layout.logits_chunk, (int64_t)B * T, layout.device_total_bytes);
    m.pipe = layout.pipe.first_layer.empty() ? single_stage_plan(config) : layout.pipe;
    const PipelinePlan& pp = m.pipe;
    m.table = build_param_table(config);
    m.local = local_param_table(config, m.table, m.ls, m.pieces);
    m.n_params = count_params(m.table);
    for (const ParamTensor& t : m.table) m.param_count += t.numel;
    m.zero = gpt_zero_layout(config, m.local, zero_stage, dp, edp, ep.size, pp);
    const ZeroLayout& z = m.zero;
    m.seg_local.assign(segment_count(config.n_layer), -1);
    for (int s = 0; s < (int)z.segs.size(); s++) m.seg_local[z.segs[s].id] = s;
}

// Stages 2-3's segment slots (llmc/parallel/zero.h: SegmentSlots; grads: with their n_leaves leaf
// gradients): a class per kind of segment on the rank (segment_kind), of min(its segments, per
// kind) slots of its largest; a layer kind one fewer where the rank holds the embedding, whose
// slot stands for that one (zero.h: ZERO3_PARAM_SLOTS). Gradients: or, where that is less memory,
// one class of per_kind * (kinds of a layer) slots of the rank's largest segment.
template <typename T>
static void alloc_segment_slots(GPT& m, SegmentSlots<T>& slots, int per_kind, bool grads, MemKind kind, size_t elem_bytes) {
    const ZeroLayout& z = m.zero;
    std::vector<int> count(SEG_KINDS, 0);
    std::vector<size_t> largest(SEG_KINDS, 0);
    size_t all_largest = 0;
    for (const Segment& s : z.segs) {
        const int c = segment_kind(s.id, m.config.n_layer);
        const size_t need = (grads ? s.n_leaves : 1) * s.padded;
        slots.seg_class.push_back(c);
        count[c]++;
        largest[c] = std::max(largest[c], need);
        all_largest = std::max(all_largest, need);
    }
    std::vector<int> n(SEG_KINDS, 0);
    size_t by_kind = 0;
    int layer_kinds = 0;
    for (int c = 0; c < SEG_KINDS; c++) {  // (the embedding and the final LayerNorm: one segment each)
        n[c] = std::min(count[c], per_kind - (!grads && count[SEG_EMBEDDING] > 0 ? 1 : 0));
        by_kind += n[c] * largest[c];
        layer_kinds += c != SEG_EMBEDDING && c != SEG_FINAL && count[c] > 0;
    }
    const int n_one = per_kind * std::max(layer_kinds, 1);
    if (grads && n_one * all_largest < by_kind) {  // one class
        slots.seg_class.assign(z.segs.size(), 0);
        n.assign(SEG_KINDS, 0);
        n[0] = std::min(n_one, (int)z.segs.size());
        largest[0] = all_largest;
    }
    for (int c = 0; c < SEG_KINDS; c++)
        for (int k = 0; k < n[c]; k++) {
            slots.buf.push_back((T*)take(m, kind, largest[c] * elem_bytes));
            slots.slot_class.push_back(c);
        }
    slots.holds.assign(slots.buf.size(), -1);
    slots.in_use.assign(slots.buf.size(), 0);
}

// The model's state buffers: params, the fp32 gradient accumulators (stages 0-1: where the ops add
// the gradients), master weights and moments (--offload: in the host arenas), the tied head's, the
// gradient slots of stages 2-3 and ZeRO-3's gathered segments, and the pointers into them; then
// what the update, the offload and the norm need from the layout.
static void alloc_model_state(GPT& m, const CommGroup& dp, const CommGroup& edp) {
    const GPTConfig& config = m.config;
    const PipelinePlan& pp = m.pipe;
    const ZeroLayout& z = m.zero;
    const int zero_stage = z.stage;
    const size_t fx = m.elem_bytes;
    m.params = (floatX*)take(m, MEM_PARAMS, z.params_elems() * fx);
    m.grad_acc = (float*)take(m, MEM_GRADS, z.acc_alloc_elems() * sizeof(float));  // (with -z 0/1's expert leaves)
    // --offload optimizer: the master (the CPU build too: a host copy of its fp32 params), the
    // moments and the gradient staging of what this rank updates go to the host arenas
    const bool host_state = m.offload == OFFLOAD_OPTIMIZER;
    if (m.elem_bytes != sizeof(float) || host_state)
        m.master = (float*)take(m, host_state ? MEM_HOST_MASTER : MEM_MASTER, z.state_elems() * sizeof(float));
    m.adam_m = (float*)take(m, host_state ? MEM_HOST_MOMENTS : MEM_MOMENTS, z.state_elems() * sizeof(float));
    m.adam_v = (float*)take(m, host_state ? MEM_HOST_MOMENTS : MEM_MOMENTS, z.state_elems() * sizeof(float));
    if (host_state) m.grad_staging = (float*)take(m, MEM_HOST_STAGING, z.state_elems() * sizeof(float));
    m.tied = config.tie_embeddings ? tied_sum_of(zero_stage, dp.size, pp.P) : TIED_NONE;
    if (m.tied != TIED_NONE && (pp.has_head() || (pp.has_embedding() && pp.P > 1))) {
        const std::vector<SegmentSpec> all = segment_specs(config, m.local);
        m.head = zero_layout({all[0]}, count_params(m.local), zero_stage, dp.size, dp.rank);
        if (head_acc_elems(m) > 0) m.head_acc = (float*)take(m, MEM_GRAD_BUFFERS, head_acc_elems(m) * sizeof(float));
        m.head_leaf_elems = m.head.padded_total;
        if (pp.has_head() && pp.P > 1) m.head_params = (floatX*)take(m, MEM_PARAMS, m.head.padded_total * fx);
    }
    if (m.tied == TIED_NONE) m.head_leaf_elems = (size_t)m.ls.vocab * config.n_embd;  // the rank's lm_head rows
    if (pp.has_head()) m.head_leaf = (float*)take(m, MEM_GRAD_BUFFERS, m.head_leaf_elems * sizeof(float));
    if (m.grad_blocks > 1) m.grad_total = (float*)take(m, MEM_GRAD_BUFFERS, z.acc_elems() * sizeof(float));
    const size_t scratch_elems = std::max(z.max_reduced(), m.head.segs.empty() ? 0 : m.head.max_padded);
    if (dp.size > 1) m.comm_scratch = (float*)take(m, MEM_GRAD_BUFFERS, scratch_elems * sizeof(float));
    m.zs.free_scratch = {m.comm_scratch};  // (one process: the adds read the slot itself)
    for (int k = 1; k < REDUCE_BUFFERS && dp.size > 1; k++)
        m.zs.free_scratch.push_back((float*)take(m, MEM_GRAD_BUFFERS, z.max_reduced() * sizeof(float)));
    if (z.params_sharded()) alloc_segment_slots(m, m.param_slots, ZERO3_PARAM_SLOTS, false, MEM_PARAMS, fx);
    if (!z.grads_in_acc()) alloc_segment_slots(m, m.grad_slots, ZERO_GRAD_SLOTS, true, MEM_GRAD_BUFFERS, sizeof(float));
    m.p.layers.resize(config.n_layer);  // stage 3: pointers appear while a segment is gathered
    m.g.layers.resize(config.n_layer);  // stages 2-3: while its slot is held
    if (!m.mem.plan_only)
        for (const Segment& s : z.segs) {
            if (!z.params_sharded()) point_segment(m.p, config, m.local, s, m.params + s.padded_offset);
            if (z.grads_in_acc()) point_segment(m.g, config, m.local, s, m.grad_acc + s.padded_offset);
        }
    std::vector<TensorRange> tensors;
    for (const ParamTensor& t : m.local) tensors.push_back({t.offset, t.numel, t.decay});
    m.update_pieces = table_update_pieces(zero_update_pieces(z, tensors), m.pieces);
    // each local segment's pieces (zero_update runs them segment by segment); --offload optimizer:
    // those whose gradient download can start at their segment's last grads_ready of a step
    // (llmc/parallel/offload.h): not the embedding's when the tied head's gradient adds to it after
    // the backward (TIED_PER_STEP), not a segment that -z 0 replicates (the all-gather before the
    // norm completes it)
    m.seg_pieces.assign(z.segs.size(), {});
    m.early_pieces.assign(z.segs.size(), {});
    m.zs.ready_count.assign(z.segs.size(), 0);
    m.zs.update_pending.assign(z.segs.size(), 0);
    m.zs.reduced.assign(z.segs.size(), 0);
    for (int k = 0; k < (int)m.update_pieces.size(); k++)
        for (int s = 0; s < (int)z.segs.size(); s++) {
            const size_t at = m.update_pieces[k].acc_index;
            const size_t lo = z.acc_sharded() ? z.segs[s].shard_offset : z.segs[s].padded_offset;
            if (at < lo || at >= lo + (z.acc_sharded() ? z.shard_len(s) : z.segs[s].padded)) continue;
            m.seg_pieces[s].push_back(k);
            break;
        }
    for (int s = 0; s < (int)z.segs.size() && m.offload == OFFLOAD_OPTIMIZER; s++)
        if ((z.segs[s].id != 0 || m.tied != TIED_PER_STEP) && (z.stage >= 1 || (z.segs[s].expert ? edp : dp).size == 1))
            m.early_pieces[s] = m.seg_pieces[s];
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
}

// The activations of B x T tokens: each chunk's layers once per micro-batch the schedule keeps in
// flight (-r: less per slot), the zero-bubble stashes, one layer's backward scratch and the head's.
static void alloc_activations(GPT& m, int B, int T) {
    const GPTConfig& config = m.config;
    const PipelinePlan& pp = m.pipe;
    const int recompute = m.recompute;
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
    m.d_stream_spare.clear();
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
        // a chunk that sends gradients: one d_stream more, for the gradient still being sent (release_slot)
        m.d_stream_spare.push_back(pp.vs(c) > 0 ? take_act(m, rows * C) : nullptr);
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
    if (config.pos == POS_ROPE) {  // every position a forward's buffers can hold (the sampler's one long row)
        const size_t n_pos = BT, bytes = n_pos * ls.hs * sizeof(float);
        m.rope_cos_sin = (float*)take(m, MEM_ACTIVATIONS, bytes);
        if (!m.mem.plan_only) {
            std::vector<float> table(n_pos * ls.hs);
            cpu::rope_table(table.data(), (int)n_pos, ls.hs, config.rope);
            copy_to_buffer(m.rope_cos_sin, table.data(), bytes);
        }
    }
    if (pp.has_head()) {
        m.lnf = take_act(m, BT * C);
        m.lnf_mean = take_stats(m, rows);
        m.lnf_rstd = take_stats(m, rows);
        const size_t chunk = logits_rows(m.logits_chunk, BT);  // the lm head's token chunk, not B*T
        m.logits = take_act(m, chunk * ls.vocab);
        m.losses = take_stats(m, BT);
        m.ce_max = take_stats(m, chunk);
        m.ce_sum = take_stats(m, chunk);
        m.ce_target = take_stats(m, chunk);
        m.d_ln = take_act(m, BT * C);
        m.loss_sums = (double*)take(m, MEM_ACTIVATIONS, pp.M * sizeof(double));
        m.mb_valid.assign(pp.M, 0);
    }
}

// The tensor-parallel reductions' buffers for B x T tokens (llmc/parallel/tensor_parallel.h).
static void alloc_tp_scratch(GPT& m, int B, int T) {
    const GPTConfig& config = m.config;
    const LocalShape& ls = m.ls;
    const size_t BT = (size_t)B * T, C = config.n_embd, E = config.n_expert;
    const size_t expert_rows = E > 0 ? E * config.moe_capacity(B, T) : 0, He = ls.expert_hidden;
    // a subtree's temporaries where a rank computes several canonical leaves, the parts and receive buffers of a group's
    // reduction, the leaves' operand slices
    int max_leaves = 1, levels = 0, nodes = 1;
    for (const ChunkSplit* sp : {&m.split_attn, &m.split_ffn, &m.split_expert, &m.split_vocab, &m.split_tokens}) {
        max_leaves = std::max(max_leaves, sp->count);
        levels = std::max(levels, tree_levels(sp->count));
        if (ls.tp > 1) nodes = std::max(nodes, split_nodes(*sp));
    }
    LLMC_CHECK(levels <= TP_MAX_LEVELS, "internal: %d canonical chunks per rank", max_leaves);
    // (the LayerNorm weight gradients, 2C, are fp32: tpf)
    const size_t red_x = std::max(BT * C, expert_rows * C), red_f = std::max(BT, 2 * C);
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
    m.tp_ln_grads = take_stats(m, 2 * C);
    if (ls.sp) {
        m.tp_full = take_act(m, BT * C);
        for (floatX*& buf : m.ln_full) buf = take_act(m, BT * C);
    }
    const int kv_share = ls.tp > config.n_kv_head ? ls.tp / config.n_kv_head : 1;
    if (max_leaves > 1 || kv_share > 1) {  // (a shared kv head: only its owner's qkv leaf has its rows)
        const size_t wide = std::max((size_t)ls.qkv(), (size_t)ls.fc(config.mlp));  // the lm head's rows: a chunk
        m.tp_copy_a_elems = std::max({BT * wide, logits_rows(m.logits_chunk, BT) * ls.vocab, expert_rows * 2 * He});
        m.tp_copy_b_elems = std::max({C * wide, C * ls.vocab, E * 2 * He * C});
        m.tp_copy_a = take_act(m, m.tp_copy_a_elems);
        m.tp_copy_b = take_act(m, m.tp_copy_b_elems);
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
}

// The CUDA ops' scratch and the cuBLASLt workspace for the rank's shapes (llmc/ops/op_scratch.h),
// wherever the plan is the CUDA build's (bf16); the CPU ops need none.
static void alloc_op_scratch(GPT& m, int B, int T) {
    const GPTConfig& config = m.config;
    const LocalShape& ls = m.ls;
    const size_t C = config.n_embd, E = config.n_expert, He = ls.expert_hidden;
    if (m.elem_bytes == 2) {
        const int widest_biased = std::max({(int)C, ls.qkv(), ls.fc(config.mlp)});
        // the split-K dweight partials (llmc/ops/matmul.cuh) of the dense layers that split (the FFN's
        // only where a block has a dense one; never the lm head's, nor the experts')
        const bool dense_ffn = E == 0 || config.moe_every > 1;
        size_t splitk = 0;
        for (int w = 0; w < DW_COUNT; w++) {
            if (!dense_ffn && (w == DW_FC || w == DW_FC_PROJ)) continue;
            if (!dense_dweight_split(config, ls, B * T, (DenseWeight)w)) continue;
            const DenseWeightShape s = dense_weight_shape(config, ls, (DenseWeight)w, /*whole*/ false);
            splitk = std::max(splitk, matmul_splitk_scratch_bytes(B * T, (int)s.C, (int)s.OC));
        }
        m.op_scratch_bytes = MATMUL_WORKSPACE_BYTES +
                             std::max(splitk, op_scratch_bytes(B, T, (int)C, ls.n_head, widest_biased, (int)E,
                                                               E > 0 ? config.moe_capacity(B, T) : 0, (int)He,
                                                               plan_sm_count()));
        m.op_scratch = take(m, MEM_SCRATCH, m.op_scratch_bytes);
    }
}

// The memory plan: everything is allocated here, once; the training step allocates nothing. With
// mem.plan_only set it counts the same buffers without allocating (gpt_memory_estimate).
static void gpt_allocate(GPT& m, const GPTConfig& config, int B, int T, const Layout& layout = Layout()) {
    m.offload = layout.offload;
    m.grad_blocks = layout.grad_blocks;
    if (m.mem.plan_only) {
        m.plan_dp = layout.plan_dp;
        m.plan_tp = layout.plan_tp;
        m.plan_ep = layout.plan_ep;
        m.elem_bytes = layout.elem_bytes;
    } else {  // the arenas: one allocation per kind, at the plan's size (for the ranks started)
        LLMC_CHECK(!layout.plan_dp && !layout.plan_tp && !layout.plan_ep && layout.elem_bytes == sizeof(floatX),
                   "internal: a layout for planning only (other groups or another build's element size) to allocate");
        GPT plan;
        plan.mem.plan_only = true;
        gpt_allocate(plan, config, B, T, layout);
        m.mem.allocate_as(plan.mem, {buffer_alloc, buffer_free, host_buffer_alloc, host_buffer_free});
    }
    CommGroup dp, edp;
    gpt_lay_out(m, config, B, T, layout, dp, edp);
    alloc_model_state(m, dp, edp);
    alloc_activations(m, B, T);
    alloc_tp_scratch(m, B, T);
    alloc_op_scratch(m, B, T);
    m.mem.check_used();  // allocated == planned, byte for byte
    if (!m.mem.plan_only) bind_op_scratch(m);
}

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
static MemoryEstimate gpt_memory_estimate(const GPTConfig& c, int B, int T, const Layout& layout = Layout()) {
    GPT plan;
    plan.mem.plan_only = true;
    gpt_allocate(plan, c, B, T, layout);
    MemoryEstimate e = MemoryEstimate::of(plan.mem);
    e.expert_leaves = (double)plan.zero.extra_leaves * sizeof(float);
    // host (pageable) staging: init, checkpoint loads and saves stream the state through one chunk
    // per array (gpt_set_state, gpt_write_state: params, adam m, adam v in fp32 and the params'
    // type; verify_checkpoint reads at most as many bytes), not the table; plus the batch vectors of
    // the step's micro-batches and one batch more (an upper bound of the losses read back). Not counted: --init_from and --export_llmc
    // (llm.c's GPT-2 files, at most 1.5B parameters) stage the whole table (a few fp32 copies).
    const double chunk = (double)staging_cap(plan), f = sizeof(float), fx = (double)layout.elem_bytes, BT = (double)B * T;
    e.host = chunk * (3 * f + fx) + (3.0 * plan.pipe.M + 1) * BT * sizeof(int);
    return e;
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
                             "activations (-r 1 or 2), or hold the lm head's logits for fewer tokens at a time "
                             "(--logits_chunk N: its default is sized from the device's total memory, not the plan)";
    const std::string opt = offloaded || one_memory ? shard_state
                                                    : "--offload optimizer keeps the fp32 master weights and Adam moments "
                                                      "in host memory and runs AdamW on the CPU (ZeRO-Offload), or " +
                                                          shard_state;
    std::vector<std::pair<double, std::string>> parts = {
        {e.activations, "the activations (" + acts + ")"},
        {state, "the optimizer state, master weights and Adam moments (" + opt + ")"},
        {e.grads + e.grad_buffers, "the gradients (--zero 2 shards the fp32 accumulators; --pp splits "
                  "the layers)"},
        {e.params, "the parameters (--zero 3 shards them; --pp splits the layers)"},
        {e.scratch, "the op scratch and the cuBLASLt workspace (32 MiB plus the largest op's partial sums, which grow "
                    "with B*T)"}};
    std::stable_sort(parts.begin(), parts.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    LLMC_FAIL("memory: this run needs %.2f GiB (params %.1f MiB, grads %.1f MiB, master %.1f MiB, Adam moments %.1f "
              "MiB, activations %.1f MiB for B %d x T %d, op scratch %.1f MiB%s) but %s is %.2f GiB. The biggest part is %s; next %s. "
              "Or shard with --zero / split with --pp or --tp (--sp), or shrink the model (--n_layer, --n_embd, --vocab_size)",
              need / GiB, (e.params) / MiB, (e.grads + e.grad_buffers) / MiB, (e.master + (one_memory ? e.host_master : 0)) / MiB,
              (e.moments + (one_memory ? e.host_moments : 0)) / MiB, e.activations / MiB, B, T, e.scratch / MiB,
              one_memory ? strfmt(", host staging %.1f MiB%s", e.host / MiB,
                                  offloaded ? strfmt(", offload gradient staging %.1f MiB", e.host_staging / MiB).c_str()
                                            : "").c_str()
                         : "",
              source.c_str(), avail / GiB, parts[0].second.c_str(), parts[1].second.c_str());
}
// The memory guard: refuses, before anything big is allocated, a run whose buffers cannot fit,
// with the numbers and what to change. On the CPU the buffers and the host staging share host memory.
static void check_memory_fits(const GPTConfig& c, int B, int T, const Layout& layout) {
    const MemoryEstimate e = gpt_memory_estimate(c, B, T, layout);
    const int offload = layout.offload;
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
