// A chapter of train_gpt.cu (included once, there): what a run measures besides the loss. Active
// parameters and model FLOPs (for MFU), the MoE routing statistics of the latest forward, and the
// evaluation: the mean val loss, summed in global micro-batch order (the same for any layout).

// Parameters that act on one token: all of them in a dense model (without the position table,
// which does no matmul); in an MoE layer the router plus, on average, E * capacity / tokens
// experts (about capacity_factor; more where the capacity rounds up) instead of all E.
static double active_param_count(const GPT& m, int B, int T) {
    const GPTConfig& c = m.config;
    double n = (double)m.param_count - (c.pos == POS_LEARNED ? (double)c.max_seq_len * c.n_embd : 0.0);
    if (c.n_expert > 0) {
        const double one_expert = 3.0 * c.expert_hidden * c.n_embd + 2.0 * c.expert_hidden + c.n_embd;
        const double experts_per_token = (double)c.n_expert * c.moe_capacity(B, T) / ((double)B * T);
        for (int l = 0; l < c.n_layer; l++)
            if (c.is_moe(l)) n += one_expert * (experts_per_token - c.n_expert);
    }
    return n;
}

// Model FLOPs of one training step (forward + backward), the nanoGPT/PaLM convention: 6 per
// active parameter per token for the matmuls, plus the attention term 12 * n_layer * n_head *
// head_size per unmasked score element (2 FLOPs each for QK^T and PV in the forward, twice that
// in the backward).
static double step_flops(const GPT& m, const int* doc_start, int B, int T, int grad_accum_steps) {
    const GPTConfig& c = m.config;
    double score_elements = 0;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) score_elements += t - doc_start[b * T + t] + 1;
    return grad_accum_steps *
           (6.0 * active_param_count(m, B, T) * B * T + 12.0 * c.n_layer * c.n_head * c.head_size() * score_elements);
}

// MoE routing of the latest forward, over the model's MoE layers: the fraction of tokens taken by
// 0, 1 and 2+ experts, and the fewest / most tokens any expert took (equal by construction in expert
// choice; measured, not assumed). Every stage measures its layers; the pp group combines them.
struct MoeStats {
    double frac[3] = {0, 0, 0};
    int load_min = 0, load_max = 0;
};
static MoeStats gpt_moe_stats(const GPT& m) {
    const GPTConfig& c = m.config;
    const PipelinePlan& pp = m.pipe;
    const int n = m.B * m.T, E = c.n_expert;
    double mine[6] = {0, 0, 0, 0, (double)n, 0};  // frac sums, layers, load min, load max
    std::vector<int> slots((size_t)n * E), load(E);
    for (int ch = 0; ch < pp.V; ch++) {
        const ChunkSlot* s = m.last_forward[ch];
        for (int l = pp.layer_begin(ch); s && l < pp.layer_end(ch); l++) {
            if (!c.is_moe(l)) continue;
            mine[3] += 1;
            copy_from_buffer(slots.data(), s->acts[l - pp.layer_begin(ch)].token_slots, slots.size() * sizeof(int));
            std::fill(load.begin(), load.end(), 0);
            for (int i = 0; i < n; i++) {
                int taken = 0;
                for (int e = 0; e < E; e++)
                    if (slots[(size_t)i * E + e] >= 0) { taken++; load[e]++; }
                mine[std::min(taken, 2)] += 1.0 / n;
            }
            mine[4] = std::min(mine[4], (double)*std::min_element(load.begin(), load.end()));
            mine[5] = std::max(mine[5], (double)*std::max_element(load.begin(), load.end()));
        }
    }
    std::vector<double> all(6 * pp.P);
    host_all_gather(comm_world().pp, mine, all.data(), sizeof(mine));
    MoeStats st;
    double layers = 0, lo = n, hi = 0;
    for (int s = 0; s < pp.P; s++) {
        for (int k = 0; k < 3; k++) st.frac[k] += all[6 * s + k];
        layers += all[6 * s + 3];
        if (all[6 * s + 3] > 0) { lo = std::min(lo, all[6 * s + 4]); hi = std::max(hi, all[6 * s + 5]); }
    }
    for (double& f : st.frac) f /= std::max(layers, 1.0);
    st.load_min = (int)lo;
    st.load_max = (int)hi;
    return st;
}

// Sum, in global order, of one value per rank per round (a loss: the last pipeline stage's ranks
// have them): rounds x dp values, ordered as the global micro-batch index round * dp + rank (the
// first `count` of them). Collective over the world.
static double sum_in_global_order(const std::vector<double>& mine, size_t count) {
    const Comm& cm = comm_world();
    std::vector<double> all(mine.size() * cm.world_size);
    host_all_gather(cm.world, mine.data(), all.data(), mine.size() * sizeof(double));
    // the last stage's tp rank 0 of dp rank d is world rank ((pp - 1) dp + d) tp
    const size_t last_stage = (size_t)(cm.n_stages - 1) * cm.dp.size;
    double sum = 0;
    for (size_t g = 0; g < count; g++)
        sum += all[(last_stage + g % cm.dp.size) * cm.tp.size * mine.size() + g / cm.dp.size];
    return sum;
}

// Mean loss over the first n_batches micro-batches of the val stream, split over the dp ranks
// (every rank runs the same number of forwards: ZeRO-3 gathers in them); the same for any layout.
// Bits per byte: the nats of every target over the UTF-8 bytes of their text (EOT: 0 bytes, its
// loss counted), divided by ln 2: a byte-level and a BPE run of the same text on one scale (NaN
// when the tokenizer does not know the tokens' text).
struct ValResult {
    double loss = 0, bits_per_byte = NAN, bytes_per_token = NAN;
};
static ValResult evaluate(GPT& m, DataLoader& loader, const Tokenizer& tokenizer, int n_batches, std::vector<int>& in,
                          std::vector<int>& tgt, std::vector<int>& ds) {
    loader.reset(LoaderState{});
    const int rounds = ceil_div(n_batches, loader.world);
    std::vector<double> losses(rounds), nats(rounds), tokens(rounds), bytes(rounds);
    bool bytes_known = true;
    for (int k = 0; k < rounds; k++) {
        loader.next_batch(in.data(), tgt.data(), ds.data());
        losses[k] = gpt_forward(m, in.data(), tgt.data(), ds.data(), loader.B, loader.T);
        for (size_t i = 0; i < (size_t)loader.B * loader.T; i++) {
            if (tgt[i] == -1) continue;  // (the loss's mean leaves them out too)
            const int64_t b = tokenizer.text_bytes(tgt[i]);
            bytes_known = bytes_known && b >= 0;
            bytes[k] += (double)b;
            tokens[k] += 1;
        }
        nats[k] = losses[k] * tokens[k];
    }
    ValResult v;
    v.loss = sum_in_global_order(losses, n_batches) / n_batches;
    if (!bytes_known) return v;  // (the same on every rank: one tokenizer)
    const double all_bytes = sum_in_global_order(bytes, n_batches), all_tokens = sum_in_global_order(tokens, n_batches);
    v.bits_per_byte = sum_in_global_order(nats, n_batches) / (all_bytes * std::log(2.0));
    v.bytes_per_token = all_bytes / all_tokens;
    return v;
}

// Multiple-choice accuracy (--eval_mc, llmc/io/mc_file.h), as lm-evaluation-harness scores it:
// each ending's log-likelihood given the context, summed over its tokens; `acc` takes the most
// likely ending, `acc_norm` the most likely per UTF-8 byte of the ending's text (the harness
// divides by characters; bytes keep Bengali and English on one scale; token counts where the
// tokenizer does not know the text). One forward of one row per ending; the dp ranks split the
// items (item = round * dp + dp_rank) and run the same number of forwards (the file's most
// endings per item: a rank without one repeats its last), so the collectives inside line up in
// every layout; the last stage scores, and the counts are summed in the items' order.
struct McResult {
    int items = 0;
    double acc = NAN, acc_norm = NAN;
};
static McResult evaluate_mc(GPT& m, const McFile& f, const Tokenizer& tokenizer, int T) {
    const Comm& cm = comm_world();
    const int dp = cm.dp.size, n = (int)f.items.size(), rounds = ceil_div(n, dp);
    std::vector<int> in(T), tgt(T), ds(T);
    std::vector<double> right(rounds), right_norm(rounds);
    for (int k = 0; k < rounds; k++) {
        const int item = std::min(k * dp + cm.dp.rank, n - 1);  // (past the end: a repeat, not counted)
        const McItem& it = f.items[item];
        double best = -INFINITY, best_norm = -INFINITY;
        int pick = 0, pick_norm = 0;
        for (int e = 0; e < f.max_endings; e++) {
            const int ending = std::min(e, (int)it.endings.size() - 1);
            const int scored = mc_row(it, ending, T, (int)f.eot, in.data(), tgt.data(), ds.data());
            const double loglik = -(double)gpt_forward(m, in.data(), tgt.data(), ds.data(), 1, T) * scored;
            if (e != ending) continue;
            int64_t text_bytes = 0;
            for (int t : it.endings[e]) text_bytes += tokenizer.text_bytes(t);
            const double per_unit = loglik / (text_bytes > 0 ? (double)text_bytes : (double)scored);
            if (loglik > best) best = loglik, pick = e;
            if (per_unit > best_norm) best_norm = per_unit, pick_norm = e;
        }
        right[k] = pick == it.label;
        right_norm[k] = pick_norm == it.label;
    }
    McResult r;
    r.items = n;
    r.acc = sum_in_global_order(right, n) / n;
    r.acc_norm = sum_in_global_order(right_norm, n) / n;
    return r;
}
