// A chapter of train_gpt.cu (included once, there): the layout arithmetic, pure host code. How a
// rank's part of the model is laid out: its tensor- and expert-parallel slice (local shapes, the
// local table and the pieces that map it to the table), the pipeline partition and schedule, the
// ZeRO layout of its stage's segments, and the micro-batches a schedule keeps in flight. Nothing
// here allocates or touches a buffer; Layout gathers what a rank's allocation is planned from.

// A rank's slice of the model. Tensor parallelism (llmc/parallel/tensor_parallel.h): each tensor-parallel
// rank holds a slice of the split tensors and a copy of the others; expert parallelism (--ep): each
// rank of an ep group holds n_expert / ep of every MoE layer's experts. Its local table lays its tensors out as the table does
// (same order, local shapes); pieces map every local element to its place in the table, which
// stays the one layout-independent index space (init, checkpoints, exports).
//   attn.qkv   rows of the rank's query heads, then of the kv heads they read (column-parallel by
//              heads; a kv head shared by several ranks when --tp > n_kv_head is a replica there)
//   attn.proj  the columns of the rank's heads (row-parallel; its bias is a replica, added once
//              after the reduction)
//   mlp.fc     SwiGLU: the rank's hidden units of W1 and the same units of W3 (so silu(W1 x) * W3 x
//              is local); GELU: its hidden units. mlp.proj: those columns (row-parallel)
//   moe.*      the rank's experts (--ep), each split as the dense FFN; the router is a replica
//   wte        rows of the rank's vocabulary slice (vocab-parallel embedding and loss)
//   the rest   LayerNorms, row-parallel biases, wpe: replicas (tp rank 0 is their owner)
struct LocalShape {
    int tp = 1, rank = 0;
    bool sp = false;                 // --sp: LayerNorms and the residual stream hold B*T/tp tokens
    int n_head = 0, head0 = 0;       // local query heads, the first one's global index
    int n_kv_head = 0, kv0 = 0;      // local kv heads, the first one's global index
    bool kv_owner = true;            // false: the local kv heads are replicas (another rank owns them)
    int ffn = 0, expert_hidden = 0;  // local hidden units (dense FFN, per expert)
    int vocab = 0, vocab0 = 0;       // local rows of the padded vocabulary
    int ep = 1, ep_rank = 0;         // --ep: the expert-parallel group
    int n_expert = 0, expert0 = 0;   // local experts of each MoE layer, the first one's global index
    int hs = 0;
    int qkv() const { return (n_head + 2 * n_kv_head) * hs; }
    int fc(int mlp) const { return mlp == MLP_SWIGLU ? 2 * ffn : ffn; }
};

static LocalShape local_shape(const GPTConfig& c, int tp, int rank, bool sp, int ep = 1, int ep_rank = 0) {
    LLMC_CHECK(ep == 1 || c.n_expert > 0, "--ep %d: the model has no experts (give --n_expert)", ep);
    LLMC_CHECK(c.n_expert == 0 || c.n_expert % ep == 0, "--ep %d must divide --n_expert %d (each rank of an expert group "
               "holds n_expert / ep experts)", ep, c.n_expert);
    LLMC_CHECK(tp >= 1 && c.n_head % tp == 0, "--tp %d must divide --n_head %d (attention is split by heads)", tp, c.n_head);
    LLMC_CHECK(c.n_kv_head % tp == 0 || tp % c.n_kv_head == 0,
               "--tp %d: the kv heads (--n_kv_head %d) must split evenly over the tensor-parallel ranks, or each be "
               "shared by a whole number of them (tp a multiple of n_kv_head)", tp, c.n_kv_head);
    LLMC_CHECK(c.ffn_hidden % tp == 0, "--tp %d must divide the FFN width --ffn_hidden %d", tp, c.ffn_hidden);
    LLMC_CHECK(c.n_expert == 0 || c.expert_hidden % tp == 0, "--tp %d must divide the expert width --expert_hidden %d", tp,
               c.expert_hidden);
    LLMC_CHECK(c.padded_vocab_size % tp == 0, "--tp %d must divide the padded vocabulary %d (vocab-parallel embedding)", tp,
               c.padded_vocab_size);
    LocalShape s;
    s.tp = tp;
    s.rank = rank;
    s.sp = sp && tp > 1;
    s.hs = c.head_size();
    s.n_head = c.n_head / tp;
    s.head0 = rank * s.n_head;
    if (c.n_kv_head % tp == 0) {
        s.n_kv_head = c.n_kv_head / tp;
        s.kv0 = rank * s.n_kv_head;
    } else {  // tp / n_kv_head ranks read each kv head; the first of them owns it
        const int share = tp / c.n_kv_head;
        s.n_kv_head = 1;
        s.kv0 = rank / share;
        s.kv_owner = rank % share == 0;
    }
    s.ffn = c.ffn_hidden / tp;
    s.expert_hidden = c.expert_hidden / tp;
    s.vocab = c.padded_vocab_size / tp;
    s.vocab0 = rank * s.vocab;
    s.ep = ep;
    s.ep_rank = ep_rank;
    s.n_expert = c.n_expert / ep;
    s.expert0 = ep_rank * s.n_expert;
    return s;
}

// The dense layers' weight gradients dweight[OC, C] and whether each splits over K = B*T
// (matmul_splitk_wanted, llmc/ops/op_scratch.h): decided on the whole weight, the same in every layout;
// the rank's shape (ls) is what its partials take. One place for the model code and the plan.
enum DenseWeight { DW_QKV, DW_ATTN_PROJ, DW_FC, DW_FC_PROJ, DW_COUNT };
struct DenseWeightShape {
    long C, OC;
};
static DenseWeightShape dense_weight_shape(const GPTConfig& c, const LocalShape& ls, DenseWeight w, bool whole) {
    const long n_embd = c.n_embd, hidden = whole ? c.ffn_hidden : ls.ffn;
    const long fc = c.mlp == MLP_SWIGLU ? 2 * hidden : hidden;
    switch (w) {
    case DW_QKV: return {n_embd, whole ? (long)c.qkv_channels() : (long)ls.qkv()};
    case DW_ATTN_PROJ: return {whole ? (long)c.n_head * c.head_size() : (long)ls.n_head * ls.hs, n_embd};
    case DW_FC: return {n_embd, fc};
    default: return {hidden, n_embd};
    }
}
static bool dense_dweight_split(const GPTConfig& c, const LocalShape& ls, int BT, DenseWeight w) {
    const DenseWeightShape s = dense_weight_shape(c, ls, w, /*whole*/ true);
    return matmul_splitk_wanted(BT, s.C, s.OC, plan_sm_count());
}

// The canonical chunk count of the tensor-parallel reductions (llmc/parallel/tensor_parallel.h): the lcm of
// every tp that local_shape accepts, so that each of them splits the chunks evenly
static int tp_chunk_count(const GPTConfig& c) {
    int g = 1;
    for (int t = 2; t <= c.n_head; t++)
        if (c.n_head % t == 0 && (c.n_kv_head % t == 0 || t % c.n_kv_head == 0) && c.ffn_hidden % t == 0 &&
            (c.n_expert == 0 || c.expert_hidden % t == 0) && c.padded_vocab_size % t == 0)
            g = std::lcm(g, t);
    return g;
}
// the canonical token chunks of a micro-batch of n tokens (--sp splits them over the tp ranks)
static int tp_token_chunks(const GPTConfig& c, long n) { return (int)std::gcd(n, (long)tp_chunk_count(c)); }

// local elements [local, local + len) are table elements [global, global + len)
struct TablePiece {
    size_t local, global, len;
    bool owner;  // this rank reports them (checkpoints, norm); false: a tensor-parallel replica
};

// The local table (as build_param_table, with this rank's shapes) and its pieces in local order.
static std::vector<ParamTensor> local_param_table(const GPTConfig& c, const std::vector<ParamTensor>& table,
                                                  const LocalShape& s, std::vector<TablePiece>& pieces) {
    pieces.clear();
    std::vector<ParamTensor> local;
    size_t offset = 0;
    const int C = c.n_embd, hs = s.hs;
    for (const ParamTensor& g : table) {
        ParamTensor p = g;
        p.offset = offset;
        const std::string f = g.name.substr(g.name.find('.') + 1);
        // a piece of `rows` rows of `width` elements, at global row `row` of a matrix `stride` wide
        auto add = [&](size_t local_at, size_t row, size_t rows, size_t width, size_t col, size_t stride, bool owner) {
            for (size_t r = 0; r < rows; r++)
                pieces.push_back({p.offset + local_at + r * width, g.offset + (row + r) * stride + col, width, owner});
        };
        auto contiguous = [&](size_t local_at, size_t global_at, size_t n, bool owner) {
            pieces.push_back({p.offset + local_at, g.offset + global_at, n, owner});
        };
        const bool replica = s.tp > 1 && s.rank != 0, experts = f.compare(0, 4, "moe.") == 0 && f != "moe.router.w";
        if (s.tp == 1 && (s.ep == 1 || !experts)) {
            contiguous(0, 0, (g.numel + 7) / 8 * 8, true);  // with its padding: one process reports every element
        } else if (g.name == "wte" || g.name == "lm_head") {  // vocab-parallel: the rank's rows
            p.shape = {s.vocab, C};
            contiguous(0, (size_t)s.vocab0 * C, (size_t)s.vocab * C, true);
        } else if (f == "attn.qkv.w" || f == "attn.qkv.b") {
            const size_t w = f == "attn.qkv.w" ? C : 1;
            p.shape = f == "attn.qkv.w" ? std::vector<int>{s.qkv(), C} : std::vector<int>{s.qkv()};
            const size_t q = (size_t)s.n_head * hs, kv = (size_t)s.n_kv_head * hs;
            contiguous(0, (size_t)s.head0 * hs * w, q * w, true);
            contiguous(q * w, ((size_t)c.n_head + s.kv0) * hs * w, kv * w, s.kv_owner);
            contiguous((q + kv) * w, ((size_t)c.n_head + c.n_kv_head + s.kv0) * hs * w, kv * w, s.kv_owner);
        } else if (f == "attn.proj.w") {
            p.shape = {C, s.n_head * hs};
            add(0, 0, C, (size_t)s.n_head * hs, (size_t)s.head0 * hs, (size_t)c.n_head * hs, true);
        } else if (f == "mlp.fc.w" || f == "mlp.fc.b" || f == "moe.fc.w" || f == "moe.fc.b") {
            const bool moe = f[0] == 'm' && f[1] == 'o', glu = moe || c.mlp == MLP_SWIGLU;
            const size_t w = f.back() == 'w' ? C : 1, E = moe ? s.n_expert : 1, e0 = moe ? s.expert0 : 0;
            const size_t H = moe ? c.expert_hidden : c.ffn_hidden, Hl = moe ? s.expert_hidden : s.ffn;
            const size_t rows_g = glu ? 2 * H : H, rows_l = glu ? 2 * Hl : Hl;  // per expert
            p.shape = moe ? (w == 1 ? std::vector<int>{(int)E, (int)rows_l} : std::vector<int>{(int)E, (int)rows_l, C})
                          : (w == 1 ? std::vector<int>{(int)rows_l} : std::vector<int>{(int)rows_l, C});
            for (size_t e = 0; e < E; e++) {
                contiguous(e * rows_l * w, ((e0 + e) * rows_g + (size_t)s.rank * Hl) * w, Hl * w, true);
                if (glu) contiguous((e * rows_l + Hl) * w, ((e0 + e) * rows_g + H + (size_t)s.rank * Hl) * w, Hl * w, true);
            }
        } else if (f == "mlp.proj.w" || f == "moe.proj.w") {
            const bool moe = f[0] == 'm' && f[1] == 'o';
            const size_t E = moe ? s.n_expert : 1, H = moe ? c.expert_hidden : c.ffn_hidden, e0 = moe ? s.expert0 : 0;
            const size_t Hl = moe ? s.expert_hidden : s.ffn;
            p.shape = moe ? std::vector<int>{(int)E, C, (int)Hl} : std::vector<int>{C, (int)Hl};
            add(0, e0 * C, E * C, Hl, (size_t)s.rank * Hl, H, true);
        } else if (f == "moe.proj.b") {  // the rank's experts' biases (replicas over tp)
            p.shape = {s.n_expert, C};
            contiguous(0, (size_t)s.expert0 * C, (size_t)s.n_expert * C, !replica);
            if (s.ep == 1) pieces.back().len = (g.numel + 7) / 8 * 8;  // with the table's padding
        } else {
            contiguous(0, 0, (g.numel + 7) / 8 * 8, !replica);
        }
        p.numel = 1;
        for (int d : p.shape) p.numel *= (size_t)d;
        offset += (p.numel + 7) / 8 * 8;
        local.push_back(p);
    }
    return local;
}

// The pipeline partition (llmc/parallel/pipeline.h runs the schedule). The model's blocks are cut into
// P * V contiguous virtual stages; pipeline stage s runs virtual stages s, P + s, 2P + s, ... (its
// chunks 0..V-1; V > 1 only for the interleaved schedule). Virtual stage 0 also holds the
// embedding, the last one the final LayerNorm, the lm head and the loss. One process is P = 1.
struct PipelinePlan {
    PipeKind kind = PIPE_1F1B;
    int P = 1, V = 1, M = 1, stage = 0;
    std::vector<int> first_layer;                   // P*V + 1 entries: virtual stage vs has [first_layer[vs], first_layer[vs+1])
    std::vector<std::vector<PipeAction>> schedule;  // every stage's actions for one step
    int n_vs() const { return P * V; }
    int vs(int chunk) const { return chunk * P + stage; }
    int layer_begin(int chunk) const { return first_layer[vs(chunk)]; }
    int layer_end(int chunk) const { return first_layer[vs(chunk) + 1]; }
    bool first_vs(int chunk) const { return vs(chunk) == 0; }
    bool last_vs(int chunk) const { return vs(chunk) == n_vs() - 1; }
    bool has_embedding() const { return stage == 0; }
    bool has_head() const { return stage == P - 1; }
    bool holds_layer(int l) const {
        for (int c = 0; c < V; c++) if (l >= layer_begin(c) && l < layer_end(c)) return true;
        return false;
    }
};

// Training FLOPs (forward + backward) of one micro-batch in block l: 6 per active parameter per
// token, plus the causal attention's 12 * n_head * head_size per score element (a full row's
// average, (T + 1) / 2 keys). The partition balances these.
static double block_flops(const GPTConfig& c, int l, int B, int T) {
    const double C = c.n_embd, BT = (double)B * T;
    double params = (double)c.qkv_channels() * C + C * c.n_head * c.head_size() + 4 * C;
    if (c.is_moe(l)) {
        const double per_token = (double)c.n_expert * c.moe_capacity(B, T) / BT;  // experts a token visits
        params += (double)c.n_expert * C + per_token * 3.0 * c.expert_hidden * C;
    } else {
        params += (double)c.fc_channels() * C + (double)c.ffn_hidden * C;
    }
    return 6.0 * params * BT + 12.0 * c.n_head * c.head_size() * BT * (T + 1) / 2.0;
}
static double head_flops(const GPTConfig& c, int B, int T) { return 6.0 * c.n_embd * c.padded_vocab_size * (double)B * T; }

// Cuts the blocks into P * V virtual stages: by hand (--pp_layers, one count per virtual stage), in
// equal parts (interleaved), or contiguous parts that minimise the largest cost (blocks, plus the
// lm head on the last one), by dynamic programming over the cut points.
static std::vector<int> pipeline_partition(const GPTConfig& c, int B, int T, int P, int V, PipeKind kind,
                                           const std::string& layers_flag) {
    const int L = c.n_layer, n = P * V;
    LLMC_CHECK(n <= L, "--pp %d%s: %d virtual stages for %d layers; every stage needs at least one layer (lower --pp%s)",
               P, V > 1 ? (" x --pp_virtual " + std::to_string(V)).c_str() : "", n, L, V > 1 ? " or --pp_virtual" : "");
    std::vector<int> first(n + 1, 0);
    if (!layers_flag.empty()) {
        std::vector<int> counts;
        size_t at = 0;
        while (at <= layers_flag.size()) {
            size_t comma = layers_flag.find(',', at);
            if (comma == std::string::npos) comma = layers_flag.size();
            counts.push_back((int)parse_int64(layers_flag.substr(at, comma - at), "pp_layers", 1, L));
            at = comma + 1;
        }
        LLMC_CHECK((int)counts.size() == n, "--pp_layers %s: %zu counts, expected one per virtual stage (%d)",
                   layers_flag.c_str(), counts.size(), n);
        for (int k = 0; k < n; k++) first[k + 1] = first[k] + counts[k];
        LLMC_CHECK(first[n] == L, "--pp_layers %s: the counts add up to %d, the model has --n_layer %d", layers_flag.c_str(),
                   first[n], L);
        return first;
    }
    if (kind == PIPE_INTERLEAVED) {
        LLMC_CHECK(L % P == 0 && (L / P) % V == 0,
                   "--pp_virtual %d: the interleaved schedule splits each stage's n_layer / pp = %d / %d layers into %d "
                   "equal chunks; choose --pp and --pp_virtual so that they divide it (or give --pp_layers)", V, L, P, V);
        for (int k = 0; k <= n; k++) first[k] = k * (L / n);
        return first;
    }
    std::vector<double> prefix(L + 1, 0);
    for (int l = 0; l < L; l++) prefix[l + 1] = prefix[l] + block_flops(c, l, B, T);
    const double head = head_flops(c, B, T), inf = 1e300;
    // best[k][i]: the smallest largest cost of the first k stages over layers [0, i)
    std::vector<std::vector<double>> best(n + 1, std::vector<double>(L + 1, inf));
    std::vector<std::vector<int>> cut(n + 1, std::vector<int>(L + 1, 0));
    best[0][0] = 0;
    for (int k = 1; k <= n; k++)
        for (int i = k; i <= L - (n - k); i++)
            for (int j = k - 1; j < i; j++) {
                const double cost = std::max(best[k - 1][j], prefix[i] - prefix[j] + (k == n ? head : 0.0));
                if (cost < best[k][i]) { best[k][i] = cost; cut[k][i] = j; }
            }
    first[n] = L;
    for (int k = n; k > 0; k--) first[k - 1] = cut[k][first[k]];
    return first;
}

static PipelinePlan pipeline_plan(const GPTConfig& c, int B, int T, int P, int V, int M, PipeKind kind,
                                  const std::string& layers_flag, int stage) {
    PipelinePlan p;
    p.kind = kind;
    p.P = P;
    p.V = V;
    p.M = M;
    p.stage = stage;
    LLMC_CHECK(V == 1 || kind == PIPE_INTERLEAVED, "--pp_virtual %d: only the interleaved schedule has virtual stages", V);
    p.first_layer = pipeline_partition(c, B, T, P, V, kind, layers_flag);
    p.schedule = pipeline_schedule(kind, P, M, V);
    return p;
}
static PipelinePlan single_stage_plan(const GPTConfig& c) {
    PipelinePlan p;
    p.first_layer = {0, c.n_layer};
    p.schedule = pipeline_schedule(PIPE_1F1B, 1, 1, 1);
    return p;
}

// The layout of this stage's flat buffers for a ZeRO stage over the data-parallel group (zero.h).
static bool stage_holds_segment(const PipelinePlan& pp, int id, int n_layer) {
    return id == 0 ? pp.has_embedding() : id == n_layer + 1 ? pp.has_head() : pp.holds_layer(segment_layer(id, n_layer));
}
// Expert segments are sharded over the expert-dp group (edp) and have ep leaves.
static ZeroLayout gpt_zero_layout(const GPTConfig& c, const std::vector<ParamTensor>& table, int zero_stage,
                                  const CommGroup& dp, const CommGroup& edp, int ep, const PipelinePlan& pipe) {
    std::vector<SegmentSpec> mine;
    for (const SegmentSpec& s : segment_specs(c, table, ep))
        if (stage_holds_segment(pipe, s.id, c.n_layer)) mine.push_back(s);
    return zero_layout(mine, count_params(table), zero_stage, dp.size, dp.rank, edp.size, edp.rank);
}

// calls f(local, table, n, owner) for the runs of local elements [begin, begin + n) that are the
// table's (the local tables' alignment padding between tensors is no one's)
template <typename F>
static void for_each_table_run(const std::vector<TablePiece>& pieces, size_t begin, size_t n, const F& f) {
    size_t k = std::upper_bound(pieces.begin(), pieces.end(), begin, [](size_t v, const TablePiece& p) { return v < p.local; }) -
               pieces.begin();
    if (k > 0) k--;
    for (; k < pieces.size() && pieces[k].local < begin + n; k++) {
        const TablePiece& p = pieces[k];
        const size_t lo = std::max(begin, p.local), hi = std::min(begin + n, p.local + p.len);
        if (lo < hi) f(lo, p.global + (lo - p.local), hi - lo, p.owner);
    }
}
// The optimizer's pieces (local offsets) cut where the table's runs end, with table offsets: element
// i of the table draws its stochastic-rounding bits from step_seed + i in every layout.
static std::vector<UpdatePiece> table_update_pieces(const std::vector<UpdatePiece>& local, const std::vector<TablePiece>& pieces) {
    std::vector<UpdatePiece> out;
    for (const UpdatePiece& u : local)
        for_each_table_run(pieces, u.table_offset, u.n, [&](size_t lo, size_t global, size_t n, bool) {
            UpdatePiece v = u;
            const size_t d = lo - u.table_offset;
            v.param_index += d;
            v.state_index += d;
            v.acc_index += d;
            v.table_offset = global;
            v.n = n;
            out.push_back(v);
        });
    return out;
}
// Micro-batches in flight per chunk in a stage's actions: activation slots (from a chunk's first
// action on a micro-batch to its last, pipe_last_use) and zero-bubble stashes (from a B whose W
// does not follow at once, to that W). The schedule decides the memory.
static void chunk_bounds(const std::vector<PipeAction>& actions, int V, std::vector<int>& slots, std::vector<int>& stashes) {
    slots.assign(V, 0);
    stashes.assign(V, 0);
    std::vector<int> live(V, 0), pending(V, 0);
    const std::vector<std::vector<size_t>> last = pipe_last_use(actions, V);
    std::vector<std::vector<bool>> seen(V);
    for (size_t k = 0; k < actions.size(); k++) {
        const PipeAction& a = actions[k];
        if ((int)seen[a.chunk].size() <= a.mb) seen[a.chunk].resize(a.mb + 1, false);
        if (!seen[a.chunk][a.mb]) { seen[a.chunk][a.mb] = true; slots[a.chunk] = std::max(slots[a.chunk], ++live[a.chunk]); }
        if (a.op == PIPE_B && !next_compute_is_own_w(actions, k))
            stashes[a.chunk] = std::max(stashes[a.chunk], ++pending[a.chunk]);
        if (a.op == PIPE_W && is_group_boundary(actions, k)) pending[a.chunk]--;
        if (last[a.chunk][a.mb] == k) live[a.chunk]--;
    }
    for (int c = 0; c < V; c++) slots[c] = std::max(slots[c], 1);  // forward-only passes (evaluation) use one
}

// How one rank runs the model, apart from the config and the batch: what gpt_allocate,
// gpt_memory_estimate and the memory guard plan from. For a plan only (nothing allocated): the
// group sizes to plan for instead of the started ranks', and the element size of the build
// planned (2: the CUDA build's bf16, from any machine).
// How the tied lm head's gradient joins the embedding's (wte is both: Press & Wolf 2017), and so
// the order in which the step's gradient is summed. The step's global micro-batches g = round * dp
// + rank fall into G gradient blocks, block b = {g : g mod G = b}; each block's gradient is the
// left fold of its micro-batches' (for wte: the embedding's fold E_b plus the head's H_b, one add),
// and the step's is the blocks' left fold. Each layout picks the G it can sum at the anchors' bytes
// (one reduction of the tied weight, as DDP and Megatron do), and one process given --grad_blocks G
// sums the same way, bit for bit (docs/PARALLELISM.md):
//   TIED_PER_RANK        -z 0/1: a block per dp rank (its micro-batches); the rank adds H_r to E_r
//                        before the embedding's one reduction (with pp the last stage sends H_r to
//                        the first first). G = dp.
//   TIED_PER_MICRO_BATCH -z 2/3 in one stage, dp > 1: a block per micro-batch; each micro-batch's
//                        head gradient joins the embedding's slot before its reduction. G = all
//                        micro-batches (for every other weight the same sum as G = 1).
//   TIED_PER_STEP        -z 2/3 with pp (the head's and the embedding's gradients live on two
//                        stages; per micro-batch they would cost a transfer of the table), or dp 1:
//                        the head's gradient summed apart over the step, added once. G = 1.
//   TIED_NONE            --tie_embeddings 0: the lm head is a matrix of the final segment, summed
//                        as every other weight (the same G as the tied sums give: dp, or 1).
enum TiedSum { TIED_PER_RANK, TIED_PER_MICRO_BATCH, TIED_PER_STEP, TIED_NONE };
inline TiedSum tied_sum_of(int zero_stage, int dp, int n_stages) {
    if (zero_stage <= 1) return TIED_PER_RANK;
    return n_stages == 1 && dp > 1 ? TIED_PER_MICRO_BATCH : TIED_PER_STEP;
}
inline int layout_grad_blocks(int zero_stage, int dp, int n_stages, int global_micro) {
    switch (dp == 1 ? TIED_PER_STEP : tied_sum_of(zero_stage, dp, n_stages)) {
    case TIED_PER_RANK: return dp;
    case TIED_PER_MICRO_BATCH: return global_micro;
    default: return 1;
    }
}

struct Layout {
    int zero_stage = 0;
    int grad_blocks = 1;  // --grad_blocks on one process (> 1: the step's gradient in that many blocks)
    PipelinePlan pipe;  // this rank's stage; no first_layer: one stage holding the whole model
    int recompute = 0;  // -r
    bool sp = false;    // --sp
    int offload = OFFLOAD_NONE;
    int plan_dp = 0, plan_tp = 0, plan_ep = 0;  // planning: 0 the started ranks' groups
    size_t elem_bytes = sizeof(floatX);         // planning: of params, leaf grads, activations
    int logits_chunk = 0;  // --logits_chunk: tokens per lm-head chunk (0: logits_chunk_tokens' default)
    // the total memory of the device the run trains on (the same card on every rank), which sizes the
    // default lm-head chunk; 0: none known (the CPU build; Layout() in tests)
    double device_total_bytes = 0;
};

// The lm head's token chunk: the classifier (logits, loss, dlogits, the head's backward) runs over a
// micro-batch's tokens in chunks of this many (train_gpt.cu head_forward), so the logits buffer holds
// one chunk's rows. requested > 0: that many (--logits_chunk). 0, the default: the largest power of
// two whose per-token bytes (logits_chunk_token_bytes) fit logits_chunk_budget, at most BT tokens (a
// micro-batch of up to BT tokens is then one chunk, as with any larger power of two: min(P, BT)
// cuts exactly P's chunks, B*T a power of two or not).
//
// Why a budget from the device and not a constant: each chunk's head weight-gradient GEMM reads and
// writes the whole fp32 head gradient (Vp x C), and the logits GEMM and the dx GEMM each read the
// head's bf16 weights, whatever the chunk's rows; so these cross HBM once per chunk, while the
// logits' own traffic is per token (written by the GEMM, read and written by the classifier, read
// by the two backward GEMMs: 5 x 2 bytes x Vp per token, in any chunking, a chunk of 1024 rows being
// 103 MB already, past L2). GPT-2 124M (d12: Vp 50304, C 768) at B 32 x T 1024 on an H200:
//   a 128 MiB budget (the constant before): 1024 tokens, 32 chunks per micro-batch: the fp32 head
//     gradient 32 x 2 x 155 MB = 9.9 GB plus the bf16 weights 32 x 2 x 77 MB = 4.9 GB: 14.8 GB;
//   1/32 of the H200's 140.4 GiB (4.39 GiB): 32768 tokens, the whole micro-batch in one chunk:
//     0.31 + 0.15 = 0.46 GB. The logits: 16.5 GB per micro-batch both ways (32 x 515 MB, 1 x 16.5 GB).
//   So about 14.4 GB less per micro-batch, ~3 ms at the H200's 4.8 TB/s; the price is the logits
//   buffer, 3.07 GiB instead of 98 MiB (1/46 of the card).
//
// The chunk must be the same in every layout (dp, tp, sp, pp, -z 0-3, -r, --offload): the head's
// gradient folds the chunks' sums in chunk order, and another chunking rounds differently, while
// the layouts are bitwise one process's. So the default reads only the model (its padded
// vocabulary), B*T and the device's total memory (the same card on every rank; never its free
// memory, nor what the rest of the layout's plan takes); a plan that then does not fit says to lower
// --logits_chunk (check_plan_fits). device_total_bytes 0 (no device known: the CPU build, unless
// --plan --device names one) keeps the constant LOGITS_CHUNK_BYTES, so the CPU runs and tests cut
// GPT-2's vocabulary in chunks of 1024 as before.
constexpr double LOGITS_CHUNK_BYTES = 128.0 * 1048576.0;  // the budget where no device is known
constexpr int LOGITS_CHUNK_DEVICE_SHARE = 32;             // else 1/32 of the device's total memory
// What gpt_allocate takes per token of the chunk on any rank, bounded with the CUDA build's bf16 (a
// number of the model alone, so the same in every layout and build): the logits row over the padded
// vocabulary and the three fp32 softmax statistics (ce_max, ce_sum, ce_target). With --tp a rank holds
// Vp / tp columns of the logits and, where the canonical leaves copy an operand (tp_copy_a), at most
// as many again: 2 x 2 Vp / tp <= 2 Vp for tp >= 2.
inline double logits_chunk_token_bytes(const GPTConfig& c) { return 2.0 * c.padded_vocab_size + 3.0 * sizeof(float); }
inline double logits_chunk_budget(double device_total_bytes) {
    return device_total_bytes > 0 ? device_total_bytes / LOGITS_CHUNK_DEVICE_SHARE : LOGITS_CHUNK_BYTES;
}
static int logits_chunk_tokens(const GPTConfig& c, int requested, int64_t BT, double device_total_bytes) {
    LLMC_CHECK(requested >= 0, "--logits_chunk: expected tokens >= 0 (0: the default), got %d", requested);
    if (requested > 0) return requested;
    const double budget = logits_chunk_budget(device_total_bytes), per_token = logits_chunk_token_bytes(c);
    int n = 1;
    while (n < (1 << 30) && 2.0 * n * per_token <= budget) n *= 2;
    return (int)std::min<int64_t>(n, std::max<int64_t>(BT, 1));
}
// why the chunk is what it is (the start-up report and --plan print it)
static std::string logits_chunk_reason(const GPTConfig& c, int requested, int64_t BT, double device_total_bytes) {
    if (requested > 0) return "--logits_chunk";
    const double budget = logits_chunk_budget(device_total_bytes), MiB = 1048576.0, GiB = 1073741824.0;
    const std::string of = device_total_bytes > 0
        ? strfmt("1/%d of the device's %.1f GiB = %.2f GiB", LOGITS_CHUNK_DEVICE_SHARE, device_total_bytes / GiB, budget / GiB)
        : strfmt("%.0f MiB (no device known)", budget / MiB);
    const int uncapped = logits_chunk_tokens(c, requested, INT64_MAX, device_total_bytes);
    return strfmt("default: the largest power of two of tokens whose logits and softmax statistics at %.0f bytes per "
                  "token fit %s: %d, at most B*T = %lld", logits_chunk_token_bytes(c), of.c_str(), uncapped, (long long)BT);
}
// the rows the logits buffer holds for micro-batches of up to BT tokens
static size_t logits_rows(int chunk, size_t BT) { return std::min((size_t)chunk, BT); }
