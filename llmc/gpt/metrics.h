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
static double evaluate(GPT& m, DataLoader& loader, int n_batches, std::vector<int>& in, std::vector<int>& tgt,
                       std::vector<int>& ds) {
    loader.reset(LoaderState{});
    const int rounds = ceil_div(n_batches, loader.world);
    std::vector<double> losses(rounds);
    for (int k = 0; k < rounds; k++) {
        loader.next_batch(in.data(), tgt.data(), ds.data());
        losses[k] = gpt_forward(m, in.data(), tgt.data(), ds.data(), loader.B, loader.T);
    }
    return sum_in_global_order(losses, n_batches) / n_batches;
}
