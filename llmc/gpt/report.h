// A chapter of train_gpt.cu (included once, there): the reports. The memory plan per rank and
// ZeRO stage, the pipeline per stage, --plan / --max_fit, the bytes each collective sends per step
// next to the layout's theory, and the --pp_trace timeline.

// The inputs of a memory plan: the model, the batch, and the layout of one rank (for a plan, the
// group sizes in plan_dp / plan_tp / plan_ep are the grid's, never 0).
struct PlanInputs {
    GPTConfig config;
    int B = 1, T = 1;
    Layout layout;  // its pipe's stage is the rank's
    // --device: plan the CUDA build (layout.elem_bytes 2: bf16 params and activations, fp32 master)
    // on a GPU of that memory, from any machine; device_bytes 0: this build on this machine
    double device_bytes = 0;
    std::string device_name;
    MemoryEstimate estimate(int zero, int stage, int r) const {
        Layout l = layout;
        l.zero_stage = zero;
        l.pipe.stage = stage;
        l.recompute = r;
        return gpt_memory_estimate(config, B, T, l);
    }
    double need(const MemoryEstimate& e) const { return device_bytes > 0 ? e.buffers() : plan_need_bytes(e); }
    // the host side when it is apart from the buffers (the CUDA build, or --device), with --offload
    // optimizer (without it the plan is the device's alone); 0 where it is in need()
    bool host_apart() const {
#ifdef LLMC_CPU
        return device_bytes > 0;
#else
        return true;
#endif
    }
    double host_need(const MemoryEstimate& e) const {
        return layout.offload == OFFLOAD_OPTIMIZER && host_apart() ? plan_host_bytes(e) : 0.0;
    }
};

// One rank's memory for every ZeRO stage (the current one marked): the plan of gpt_allocate.
static void print_memory_plan(const PlanInputs& in) {
    const Layout& L = in.layout;
    MemoryEstimate mem[4];
    for (int z = 0; z < 4; z++) mem[z] = in.estimate(z, L.pipe.stage, L.recompute);
    printf("memory per rank (MiB), dp %d%s%s%s, -r %d%s:  %10s %10s %10s %10s\n", L.plan_dp,
           L.plan_tp > 1 ? (", tp " + std::to_string(L.plan_tp) + (L.sp ? " + sp" : "")).c_str() : "",
           L.plan_ep > 1 ? (", ep " + std::to_string(L.plan_ep)).c_str() : "",
           L.pipe.P > 1 ? (", pipeline stage " + std::to_string(L.pipe.stage)).c_str() : "", L.recompute,
           L.offload == OFFLOAD_OPTIMIZER ? ", --offload optimizer" : "",
           L.zero_stage == 0 ? "[-z 0]" : "-z 0", L.zero_stage == 1 ? "[-z 1]" : "-z 1",
           L.zero_stage == 2 ? "[-z 2]" : "-z 2", L.zero_stage == 3 ? "[-z 3]" : "-z 3");
    auto row = [&](const char* name, double MemoryEstimate::*field) {
        printf("  %-34s", name);
        for (int z = 0; z < 4; z++) printf(" %10.2f", (field ? mem[z].*field : mem[z].buffers()) / 1048576.0);
        printf("\n");
    };
    row("params (+ stage-3 slots)", &MemoryEstimate::params);
    row("grads (fp32 accumulator)", &MemoryEstimate::grads);
    if (L.plan_ep > 1)  // (bitwise one process: a source rank's sum is its block; docs/PARALLELISM.md)
        row("  of which expert leaves (-z 0/1)", &MemoryEstimate::expert_leaves);
    row("grad buffers (slots, recv, head)", &MemoryEstimate::grad_buffers);
    row("master weights (fp32)", &MemoryEstimate::master);
    row("adam moments (fp32)", &MemoryEstimate::moments);
    row("activations", &MemoryEstimate::activations);
    std::string head_note;  // the lm head's chunk and why, after the table
    if (L.pipe.has_head()) {  // the lm head's share of them: one token chunk's logits (llmc/gpt/layout.h)
        const int tp = std::max(1, L.plan_tp);
        const size_t BT = (size_t)in.B * in.T;
        const int chunk = logits_chunk_tokens(in.config, L.logits_chunk, (int64_t)BT, L.device_total_bytes);
        const size_t rows = logits_rows(chunk, BT);
        const double cols = (double)in.config.padded_vocab_size / tp, MiB = 1048576.0;
        printf("  %-34s %10.2f MiB: %zu of the micro-batch's %zu tokens x %.0f vocabulary columns (whole: %.2f MiB)\n",
               "  of which logits (lm-head chunk)", rows * cols * L.elem_bytes / MiB, rows, BT, cols,
               BT * cols * L.elem_bytes / MiB);
        const size_t n = (BT + chunk - 1) / chunk;
        head_note = strfmt("  lm head: %d tokens per chunk, %zu chunk%s per micro-batch (%s)\n", chunk, n, n == 1 ? "" : "s",
                           logits_chunk_reason(in.config, L.logits_chunk, (int64_t)BT, L.device_total_bytes).c_str());
    }
    row("batch", &MemoryEstimate::batch);
    row("op scratch + cuBLASLt workspace", &MemoryEstimate::scratch);
    row("total", nullptr);
    if (L.offload == OFFLOAD_OPTIMIZER) {
        row("host: master weights (fp32)", &MemoryEstimate::host_master);
        row("host: adam moments (fp32)", &MemoryEstimate::host_moments);
        row("host: gradient staging (fp32)", &MemoryEstimate::host_staging);
        printf("  %-34s", "host total (offload arenas)");
        for (int z = 0; z < 4; z++) printf(" %10.2f", mem[z].host_arenas() / 1048576.0);
        printf("\n");
    }
    printf("%s", head_note.c_str());
}

// The pipeline at start-up: per stage its virtual stages' blocks, parameters, FLOPs per micro-batch,
// the micro-batches it keeps in flight and its activation memory (the plan for that stage), and the
// schedule's theoretical bubble.
static void print_pipeline(const PlanInputs& in) {
    const Layout& L = in.layout;
    const PipelinePlan& p = L.pipe;
    const GPTConfig& c = in.config;
    const int B = in.B, T = in.T;
    const std::vector<ParamTensor> table = build_param_table(c);
    printf("pipeline: %d stages, schedule %s", p.P, pipe_kind_name(p.kind));
    if (p.V > 1) printf(" with %d chunks per stage", p.V);
    printf(", %d micro-batches per step; theoretical bubble %.1f%% (idle / step time, unit costs)\n", p.M,
           100 * pipe_bubble_formula(p.kind, p.P, p.M, p.V));
    for (int s = 0; s < p.P; s++) {
        PipelinePlan ps = p;
        ps.stage = s;
        std::vector<int> n_slots, n_stashes;
        chunk_bounds(p.schedule[s], p.V, n_slots, n_stashes);
        double params = 0, flops = 0;
        std::string layers;
        for (int ch = 0; ch < p.V; ch++) {
            const int l0 = ps.layer_begin(ch), l1 = ps.layer_end(ch);
            layers += (ch ? "," : "") + std::to_string(l0) + "-" + std::to_string(l1 - 1);
            for (int l = l0; l < l1; l++) flops += block_flops(c, l, B, T);
        }
        for (const ParamTensor& t : table) {
            const int seg = segment_of(t.name, c.n_layer);
            if (stage_holds_segment(ps, seg, c.n_layer)) params += t.numel;
        }
        if (ps.has_head()) flops += head_flops(c, B, T);
        int in_flight = 0, stashed = 0;
        for (int ch = 0; ch < p.V; ch++) { in_flight += n_slots[ch]; stashed += n_stashes[ch]; }
        const MemoryEstimate e = in.estimate(L.zero_stage, s, L.recompute);
        printf("  stage %d: blocks %-12s%s%s params %10.0f | %.3g GFLOP per micro-batch | %d micro-batch%s in flight%s | "
               "activations %.2f MiB, total %.2f MiB\n", s, layers.c_str(), ps.has_embedding() ? " +embedding" : "",
               ps.has_head() ? " +head" : "", params, flops / 1e9, in_flight, in_flight == 1 ? "" : "es",
               stashed ? (" (+" + std::to_string(stashed) + " weight-gradient stashes)").c_str() : "",
               e.activations / 1048576.0, e.buffers() / 1048576.0);
    }
}

// --plan: the plan of every stage and -r level for the flags, whether it fits this machine's memory
// (or LLMC_MEMORY_LIMIT), and with --max_fit the largest micro-batch and the largest dN-shaped model
// that fit per -r level; nothing is allocated.
static void print_plan(const PlanInputs& in, bool max_fit) {
    const Layout& L = in.layout;
    std::string source = in.device_name, host_source = "host memory of the GPU machine: unknown, not checked";
    double avail = in.device_bytes > 0 ? in.device_bytes : available_buffer_memory(source);
    const double GiB = 1073741824.0;
    const bool headroom = L.elem_bytes == 2 && avail > 0;  // a GPU's plan (the CUDA build, or --device)
    if (headroom) avail -= device_headroom_bytes(L.plan_dp, L.pipe.P, L.plan_tp, L.plan_ep);
    // --offload optimizer on the CUDA build: the host side is checked against this machine's host
    // memory; with --device it is reported (the GPU machine's host memory is not known here)
    const double host_avail = in.device_bytes > 0 ? -1 : available_host_memory(host_source);
    if (L.pipe.P > 1) print_pipeline(in);
    for (int s = 0; s < L.pipe.P; s++) {
        PlanInputs one = in;
        one.layout.pipe.stage = s;
        print_memory_plan(one);
    }
    // the most any stage needs; host: the most any stage needs of host memory apart (and of that, in
    // the offload arenas)
    auto worst = [&](const PlanInputs& p, int r, double* host = nullptr, double* arenas = nullptr) {
        double need = 0, h = 0, a = 0;
        for (int s = 0; s < p.layout.pipe.P; s++) {
            const MemoryEstimate e = p.estimate(p.layout.zero_stage, s, r);
            need = std::max(need, p.need(e));
            if (p.host_need(e) > h) { h = p.host_need(e); a = e.host_arenas(); }
        }
        if (host) *host = h;
        if (arenas) *arenas = a;
        return need;
    };
    auto fits = [&](const PlanInputs& p, int r) {
        double h = 0;
        const double need = worst(p, r, &h);
        return need <= avail && (host_avail <= 0 || h <= host_avail);
    };
    const int procs = L.pipe.P * L.plan_dp * L.plan_tp;
    printf("plan: %d process%s (pp %d x dp %d x tp %d%s), -z %d%s; available: %s %.2f GiB\n", procs, procs == 1 ? "" : "es",
           L.pipe.P, L.plan_dp, L.plan_tp, L.sp ? " + sp" : "", L.zero_stage,
           L.offload == OFFLOAD_OPTIMIZER ? ", --offload optimizer" : "", source.c_str(), avail / GiB);
    if (headroom) printf("  available is after %s\n", device_headroom_text(L.plan_dp, L.pipe.P, L.plan_tp, L.plan_ep).c_str());
    const bool host_line = L.offload == OFFLOAD_OPTIMIZER && in.host_apart();
    if (host_line) {
        if (host_avail > 0) printf("  host side: %s %.2f GiB\n", host_source.c_str(), host_avail / GiB);
        else printf("  host side: %s\n", host_source.c_str());
    }
    for (int r = 0; r <= 2; r++) {
        double host = 0, arenas = 0;
        const double need = worst(in, r, &host, &arenas);
        const bool ok = need <= avail && (host_avail <= 0 || host <= host_avail);
        printf("  -r %d: the largest stage needs %.3f GiB%s: %s\n", r, need / GiB,
               host_line ? strfmt(", and %.3f GiB of host memory per rank (offload arenas %.3f, staging for init and "
                                  "checkpoints %.3f)", host / GiB, arenas / GiB, (host - arenas) / GiB).c_str() : "",
               avail <= 0 ? "(no limit known)" : ok ? "fits" : "does NOT fit");
    }
    if (!max_fit || avail <= 0) return;
    // p's model reshaped as dN (n_layer N, n_embd 64 N, n_head N; the flags' grouping of kv heads where
    // N allows it, the default FFN) and its pipeline replanned; false where that shape is refused
    auto reshape_dn = [&](PlanInputs& p, int n) {
        p.config.n_layer = n;
        p.config.n_embd = 64 * n;
        p.config.n_head = n;
        p.config.n_kv_head = in.config.n_head % in.config.n_kv_head == 0 && n % (in.config.n_head / in.config.n_kv_head) == 0
                                 ? n / (in.config.n_head / in.config.n_kv_head) : n;
        p.config.ffn_hidden = 0;
        p.config.expert_hidden = 0;
        try {
            p.config.finalize();
            p.layout.pipe = pipeline_plan(p.config, p.B, p.T, L.pipe.P, L.pipe.V, L.pipe.M, L.pipe.kind, "", 0);
            return true;
        } catch (const LlmcError&) { return false; }
    };
    auto fits_safe = [&](const PlanInputs& p, int r) {
        try { return fits(p, r); } catch (const LlmcError&) { return false; }
    };
    // the largest dN of the flags' shape that fits at -z zero, -r r and the flags' -b (0: none)
    auto largest_dn = [&](int zero, int r) {
        int best = 0;
        for (int n = std::max(1, L.pipe.n_vs()); n <= 1024; n++) {
            PlanInputs p = in;
            p.layout.zero_stage = zero;
            if (!reshape_dn(p, n) || !fits_safe(p, r)) break;
            best = n;
        }
        return best;
    };
    auto dn_params = [&](int n) {
        PlanInputs p = in;
        reshape_dn(p, n);
        return count_params(build_param_table(p.config));
    };
    for (int r = 0; r <= 2; r++) {
        int lo = 0, hi = 1;  // the largest B that fits: doubling, then bisection
        auto fits_b = [&](int b) {
            PlanInputs p = in;
            p.B = b;
            return fits_safe(p, r);
        };
        while (hi <= (1 << 20) && fits_b(hi)) { lo = hi; hi *= 2; }
        while (hi - lo > 1) { const int mid = (lo + hi) / 2; (fits_b(mid) ? lo : hi) = mid; }
        const int best_n = largest_dn(L.zero_stage, r);
        printf("  -r %d: the largest micro-batch that fits is -b %d (T %d)", r, lo, in.T);
        if (best_n > 0)
            printf("; the largest dN model at -b %d is d%d (%.0f M parameters)", in.B, best_n, dn_params(best_n) / 1e6);
        printf("\n");
    }
    // Which model to train here, whatever -z and -r the flags gave: the largest dN and the largest GPT-2
    // shape that fit at the flags' -b x -t on this many processes, each with the cheapest -z / -r that
    // holds it. Cheapest first: -z 0, 1, 2 send the bytes of an all-reduce (ZeRO-1 and -2 a reduce-
    // scatter and an all-gather), -r 1 recomputes only LayerNorm outputs and the FFN activation; then
    // -z 3, which gathers the parameters again for the backward (1.5x the bytes); then -r 2, which
    // reruns every block's forward (about a third more compute). (One data-parallel rank: every -z
    // plans the same memory, and -z 0 is named.)
    std::vector<std::pair<int, int>> cheapest;  // (-z, -r)
    for (int cost : {0, 1, 2, 3, 4, 6})
        for (int r = 0; r <= 2; r++)
            for (int z = 0; z <= 3; z++)
                if ((r == 2 ? 4 : 0) + (z == 3 ? 2 : 0) + (r == 1 ? 1 : 0) == cost) cheapest.push_back({z, r});
    int top_n = 0, top_z = 0, top_r = 0;
    for (auto [z, r] : cheapest) {
        const int n = largest_dn(z, r);
        if (n > top_n) { top_n = n; top_z = z; top_r = r; }
    }
    printf("  largest model at -b %d x -t %d on %d process%s, any -z / -r:", in.B, in.T, procs, procs == 1 ? "" : "es");
    if (top_n > 0) printf(" d%d (%.0f M parameters) with -z %d -r %d", top_n, dn_params(top_n) / 1e6, top_z, top_r);
    else printf(" no dN fits");
    const Gpt2Preset* top_gpt2 = nullptr;
    int gpt2_z = 0, gpt2_r = 0;
    for (const Gpt2Preset& g : GPT2_PRESETS) {  // GPT-2's own shape: its vocabulary, context and block
        PlanInputs p = in;
        p.config = GPTConfig();
        p.config.n_layer = g.n_layer;
        p.config.n_embd = g.n_embd;
        p.config.n_head = g.n_head;
        p.config.n_kv_head = g.n_head;
        p.config.vocab_size = (int)GPT2_VOCAB_SIZE;
        p.config.max_seq_len = 1024;
        p.config.mlp = MLP_GELU;
        p.config.pos = POS_LEARNED;
        bool found = false;
        try {
            p.config.finalize();
            p.config.check_batch(p.B, p.T, L.plan_dp);
            p.layout.pipe = pipeline_plan(p.config, p.B, p.T, L.pipe.P, L.pipe.V, L.pipe.M, L.pipe.kind, "", 0);
        } catch (const LlmcError&) { break; }  // (its context shorter than -t: no preset fits)
        for (auto [z, r] : cheapest) {
            p.layout.zero_stage = z;
            if (fits_safe(p, r)) { found = true; gpt2_z = z; gpt2_r = r; break; }
        }
        if (!found) break;
        top_gpt2 = &g;
    }
    if (top_gpt2) printf("; GPT-2 shape: -e %s with -z %d -r %d", top_gpt2->name, gpt2_z, gpt2_r);
    else printf("; no GPT-2 shape fits");
    printf("\n");
}

// Bytes this rank sends in one optimizer step, by collective, for the layout (what the counters
// in comm.h must show after a step without evaluation or sampling).
// The tensor-parallel bytes one rank sends per step (a second derivation of what the collectives
// count, from the model's structure): per micro-batch and block, Megatron's four all-reduces of
// B*T*C (attention and FFN outputs forward, their inputs' gradients backward) at 2 (tp-1)/tp of the
// bytes each, or with --sp the same bytes as four all-gathers and four reduce-scatters; MoE layers
// reduce the experts' rows instead of the FFN's tokens; recomputed forwards (-r) repeat theirs; the
// lm head reduces per token chunk.
static void tp_comm_theory(const GPT& m, int grad_accum, double theory[COMM_N_OPS]) {
    const LocalShape& ls = m.ls;
    if (ls.tp == 1) return;
    const GPTConfig& c = m.config;
    const PipelinePlan& pp = m.pipe;
    const double P = ls.tp, f = (P - 1) / P, fx = sizeof(floatX), BT = (double)m.max_B * m.max_T;
    const double S = BT * c.n_embd * fx, expert = c.n_expert > 0 ? (double)c.n_expert * c.moe_capacity(m.max_B, m.max_T) * c.n_embd * fx : 0;
    double& a2a = theory[COMM_ALL_TO_ALL];
    double& ag = theory[COMM_ALL_GATHER];
    // a canonical reduction sends each of its tree nodes (the most a rank of the split holds:
    // llmc/parallel/tensor_parallel.h); an order-free one (max, embedding, target logit) one
    const double n_attn = split_nodes(m.split_attn), n_ffn = split_nodes(m.split_ffn),
                 n_expert = split_nodes(m.split_expert), n_vocab = split_nodes(m.split_vocab),
                 n_tok = split_nodes(m.split_tokens);
    auto all_reduce = [&](double bytes, double n_elems, double nodes) {
        if (std::fmod(n_elems, P) == 0) { a2a += nodes * f * bytes; ag += f * bytes; }
        else ag += nodes * (P - 1) * bytes;  // small vectors: all-gather of the partials
    };
    auto reduce = [&](double bytes, double nodes) {  // RS or AR
        if (ls.sp) a2a += nodes * f * bytes;
        else all_reduce(bytes, bytes / fx, nodes);
    };
    auto gather = [&](double bytes) { if (ls.sp) ag += f * bytes; };  // --sp only
    const double n_norm_grads = (c.rmsnorm() ? 1.0 : 2.0) * c.n_embd;  // fp32 (norm_weight_grads)
    auto ln_grads = [&]() { if (ls.sp) all_reduce(n_norm_grads * 4.0, n_norm_grads, n_tok); };
    // one forward of block l (the attention output and the FFN's; with --sp the LN outputs' gathers)
    auto block_fwd = [&](int l) {
        gather(S);
        reduce(S, n_attn);
        gather(S);
        if (c.is_moe(l)) all_reduce(expert, expert / fx, n_expert);
        else reduce(S, n_ffn);
    };
    // the backward's recomputation: -r 2 runs each block's forward again (-r 1 recomputes only
    // LayerNorms and activations: no communication); a W that does not follow its B recomputes once more
    std::vector<int> passes(pp.V, 0);
    const std::vector<PipeAction>& acts = pp.schedule[pp.stage];
    for (size_t k = 0; k < acts.size(); k++)
        if (acts[k].op == PIPE_B) passes[acts[k].chunk] += 1 + !next_compute_is_own_w(acts, k);
    const int kv_share = comm_world().tp_kv.size;
    for (int ch = 0; ch < pp.V; ch++) {
        const double a2a0 = a2a, ag0 = ag;
        for (int l = pp.layer_begin(ch); l < pp.layer_end(ch); l++) {
            block_fwd(l);
            // backward: the FFN's (MoE: the experts' input rows) and the attention's input gradients
            // (with --sp each gathers the branch's output gradient, and LN1 / LN2 again for the weight
            // gradients; MoE: LN2 once more for the router's input gradient)
            if (c.is_moe(l)) { gather(S); all_reduce(expert, expert / fx, n_expert); gather(S); }
            else { gather(S); reduce(S, n_ffn); }
            gather(S);
            reduce(S, n_attn);
            gather(S);
            gather(S);
            ln_grads();
            ln_grads();
            if (kv_share > 1)  // a shared kv head: the group's query heads, outputs, their gradients, lse
                ag += (kv_share - 1) * BT * ls.n_head * (3.0 * ls.hs * fx + 4.0);
        }
        if (pp.first_vs(ch)) { reduce(S, 1); gather(S); }  // the embedding; its backward gathers the stream (--sp)
        if (pp.last_vs(ch)) {
            gather(S);  // the final LN's output
            // per lm-head token chunk: the softmax's max, sum and target logit, and the chunk's gradient
            // at the final LN (an all-reduce also with --sp: a chunk's rows need not be the rank's)
            for (double t0 = 0; t0 < BT; t0 += m.logits_chunk) {
                const double n = std::min((double)m.logits_chunk, BT - t0);
                for (double nodes : {1.0, n_vocab, 1.0}) all_reduce(4.0 * n, n, nodes);
                all_reduce(n * c.n_embd * fx, n * c.n_embd, n_vocab);
            }
            ln_grads();
        }
        a2a = a2a0 + (a2a - a2a0) * grad_accum;  // per micro-batch, times the step's micro-batches
        ag = ag0 + (ag - ag0) * grad_accum;
        for (int r = 0; r < passes[ch]; r++)
            for (int l = pp.layer_begin(ch); l < pp.layer_end(ch); l++) {
                if (m.recompute == 2) block_fwd(l);
            }
    }
}

// The data-parallel gradient and parameter traffic of this stage per optimizer step, and what the
// anchors send for the same gradient elements: PyTorch DDP with no_sync (one all-reduce per step),
// Megatron's distributed optimizer (one reduce-scatter of fp32 gradients, one all-gather of the
// params per step), ZeRO-2 (a reduce-scatter per micro-batch, an all-gather of the params per step),
// ZeRO-3 / FSDP (per micro-batch two all-gathers of the params and a reduce-scatter; ours: zero3_gathers). Each with a
// ring's (N - 1) / N of the bytes per rank, on the same flat buffer (segments padded to a multiple
// of dp * NORM_CHUNK: the anchors pad their buckets too), fp32 gradients (4 bytes) and the build's
// params (sizeof(floatX)); an expert segment's gradient elements are its n_leaves leaves (--ep: a
// sum per source rank, which is what keeps its fold the dp ranks' order). head: the tied head's
// gradient where it is reduced on its own (TIED_PER_STEP: -z 2/3 with pp, the two uses of the tied
// weight on two stages, as in Megatron's embedding group); elsewhere it joins the embedding's
// gradient before the one reduction, as the anchors do (llmc/gpt/layout.h).
struct ZeroVolume {
    double all_to_all = 0, all_gather = 0, head = 0;
    double next_step = 0;  // -z 3: the gathers of the next step's first segments (after the update)
    double ddp = 0, megatron = 0, zero2 = 0, zero3 = 0;
    double total() const { return all_to_all + all_gather; }
    double anchor(int stage) const { return stage == 0 ? ddp : stage == 1 ? megatron : stage == 2 ? zero2 : zero3; }
};
// -z 3: how often this stage gathers each model segment in a first step, its passes in schedule
// order by the rules of llmc/gpt/hooks.h: every segment of a forward (the embedding once: the tied
// head reads its slot), every block of a backward and of a W that recomputes; less a forward's last
// block, which its backward right after starts with, and a backward's first two blocks, which the
// chunk's forward right after starts with (that backward gathers the embedding for it); and after
// the update the next step's first segments (forward_first_segments: a later step finds them).
// next: the count of that last part alone
static std::vector<double> zero3_gathers(const GPT& m, std::vector<double>* next = nullptr) {
    const PipelinePlan& pp = m.pipe;
    const int L = m.config.n_layer;
    const std::vector<PipeAction>& acts = pp.schedule[pp.stage];
    std::vector<double> n(L + 2, 0.0);
    int prev = -1;
    for (int k = 0; k < (int)acts.size(); k++) {
        if (!is_group_boundary(acts, k)) continue;
        const PipeAction& a = acts[k];
        const int l0 = pp.layer_begin(a.chunk), l1 = pp.layer_end(a.chunk), next = next_computation(acts, k);
        const bool after_b = prev >= 0 && acts[prev].op == PIPE_B && acts[prev].chunk == a.chunk;
        const bool after_own_f = prev >= 0 && acts[prev].op == PIPE_F && acts[prev].chunk == a.chunk && acts[prev].mb == a.mb;
        const bool f_next = next >= 0 && acts[next].op == PIPE_F && acts[next].chunk == a.chunk;
        prev = k;
        if (a.op == PIPE_F) {
            n[0] += pp.first_vs(a.chunk) && !after_b;
            for (int l = l0; l < l1; l++) n[l + 1] += !(after_b && l <= l0 + 1);
            n[L + 1] += pp.last_vs(a.chunk);
        } else if (a.op == PIPE_B || m.recompute > 0) {
            for (int l = l0; l < l1; l++) n[l + 1] += !(a.op == PIPE_B && after_own_f && l == l1 - 1);
            n[0] += a.op == PIPE_B && pp.first_vs(a.chunk) && f_next;
        }
    }
    if (next) next->assign(L + 2, 0.0);
    for (int seg : forward_first_segments(m)) {
        n[seg]++;
        if (next) (*next)[seg]++;
    }
    return n;
}
static ZeroVolume zero_comm_volume(const GPT& m, int grad_accum) {
    const ZeroLayout& z = m.zero;
    const PipelinePlan& pp = m.pipe;
    const double k = grad_accum, fx = sizeof(floatX), g4 = sizeof(float);
    ZeroVolume v;
    // the tied head's gradient reduced apart, per micro-batch
    if (pp.has_head() && m.tied == TIED_PER_STEP) v.head = k * (z.dp - 1.0) / z.dp * g4 * m.head.padded_total;
    v.all_to_all = v.head;
    std::vector<double> next;
    const std::vector<double> gathers = z.stage == 3 ? zero3_gathers(m, &next) : std::vector<double>();
    for (int s = 0; s < (int)z.segs.size(); s++) {
        const Segment& seg = z.segs[s];
        const double sh = (seg.dp - 1.0) / seg.dp, n = (double)seg.padded;
        const int layer = segment_layer(seg.id, m.config.n_layer);
        // stages 0-1: reduce_scatter_sum of the accumulator (an expert segment's leaves: one per
        // source rank) once per step; 2-3: reduce_scatter_add of every micro-batch's leaves
        v.all_to_all += z.grads_in_acc() ? sh * g4 * n * seg.n_leaves : k * sh * g4 * n * seg.n_leaves;
        if (z.stage == 0) v.all_gather += sh * g4 * n;                          // completes the all-reduce
        if (z.stage == 1 || z.stage == 2) v.all_gather += sh * fx * n;          // updated params
        if (z.stage == 3) {  // (an expert segment with its block)
            v.all_gather += gathers[layer >= 0 ? layer + 1 : seg.id] * sh * fx * n;
            v.next_step += next[layer >= 0 ? layer + 1 : seg.id] * sh * fx * n;
        }
        // (the anchors' gradient elements: an expert segment's are its leaves, one per source rank,
        // as the experts' gradients are on the dp ranks without --ep)
        const double ng = n * seg.n_leaves;
        v.ddp += 2 * sh * g4 * ng;
        v.megatron += sh * g4 * ng + sh * fx * n;
        v.zero2 += k * sh * g4 * ng + sh * fx * n;
        v.zero3 += k * (2 * sh * fx * n + sh * g4 * ng);
    }
    return v;
}

static void print_comm_volume(const GPT& m, int grad_accum) {
    const Comm& c = comm_world();
    const ZeroLayout& z = m.zero;
    const PipelinePlan& pp = m.pipe;
    const double share = (double)(z.dp - 1) / z.dp, fx = sizeof(floatX);
    double theory[COMM_N_OPS] = {};
    const ZeroVolume zv = zero_comm_volume(m, grad_accum);
    theory[COMM_ALL_TO_ALL] = zv.all_to_all;
    theory[COMM_ALL_GATHER] = zv.all_gather;
    // expert parallel: each MoE layer's rows to the experts' owners and back, forward and backward
    // (and again in a recomputed forward, -r 2)
    if (m.ls.ep > 1) {
        const GPTConfig& cf = m.config;
        const double rows = (double)cf.n_expert * cf.moe_capacity(m.max_B, m.max_T) * cf.n_embd * fx;
        const double per_layer = (m.ls.ep - 1.0) / m.ls.ep * rows;
        std::vector<int> passes(pp.V, 0);  // backward passes per chunk (a split W recomputes once more)
        const std::vector<PipeAction>& acts = pp.schedule[pp.stage];
        for (size_t k = 0; k < acts.size(); k++)
            if (acts[k].op == PIPE_B) passes[acts[k].chunk] += 1 + !next_compute_is_own_w(acts, k);
        for (int ch = 0; ch < pp.V; ch++)
            for (int l = pp.layer_begin(ch); l < pp.layer_end(ch); l++)
                if (cf.is_moe(l))
                    theory[COMM_ALL_TO_ALL] += per_layer * (4.0 * grad_accum + (m.recompute == 2 ? 2.0 * passes[ch] : 0.0));
    }
    if (pp.P > 1) {
        const double act = (double)m.max_B * m.max_T / (m.ls.sp ? m.ls.tp : 1) * m.config.n_embd * fx;  // the stream's rows
        for (int ch = 0; ch < pp.V; ch++) theory[COMM_P2P] += grad_accum * act * (!pp.last_vs(ch) + !pp.first_vs(ch));
        if (pp.has_embedding() && m.tied != TIED_NONE) theory[COMM_P2P] += fx * m.head.shard_len(0);  // the tied weights, to the last stage
        if (pp.has_head() && m.tied != TIED_NONE) {
            theory[COMM_P2P] += 4.0 * head_acc_elems(m);                           // the head's gradient, to the first
            theory[COMM_ALL_GATHER] += share * fx * m.head.padded_total;           // its copy of the new weights
        }
    }
    tp_comm_theory(m, grad_accum, theory);
    printf("communication per step, rank %d (sent bytes): ", c.world_rank);
    for (int k = 0; k < COMM_N_OPS; k++) {
        if (k == COMM_HOST) printf("%s %llu", comm_op_name(k), (unsigned long long)c.sent_bytes[k]);
        else printf("%s %llu (theory %.0f), ", comm_op_name(k), (unsigned long long)c.sent_bytes[k], theory[k]);
    }
    printf("\n");
    if (z.dp == 1) return;
    // a step after the first: the first one gathers its own first segments in its forward as well
    // as (after its update) the next step's; later steps find theirs gathered
    printf("data-parallel gradients and params per step, rank %d, dp %d, %d micro-batch%s: -z %d sends %.0f (tied head "
           "%.0f of it; the first step %.0f more: its own first segments); anchors: DDP all-reduce %.0f, Megatron "
           "distributed optimizer %.0f, ZeRO-2 %.0f, ZeRO-3/FSDP %.0f\n",
           c.world_rank, z.dp, grad_accum, grad_accum == 1 ? "" : "es", z.stage, zv.total() - zv.next_step, zv.head,
           zv.next_step, zv.ddp, zv.megatron, zv.zero2, zv.zero3);
}

// --pp_trace: every rank's executed actions of one step, gathered to rank 0 and written as JSON
// lines for scripts/plot_pipeline.py (times from the step's start; "recv"/"send" events are waits),
// and its buffer collectives and transfers up to the gradient norm for scripts/plot_timeline.py:
// "link" spans one in flight (start to its end: the simulated link's, or MPI's completion), "wait"
// the rank blocked in its finish. comm times are comm_now_s(), origin_s the step's start.
static void write_pipeline_trace(const std::string& path, const std::vector<PipeEvent>& events,
                                 const std::vector<CommInterval>& comm_events, double origin_s, const PipelinePlan& pp) {
    const Comm& cm = comm_world();
    constexpr double LINK = 100, WAIT = 101;  // op codes of the comm lines (after the PipeOps)
    std::vector<double> mine;
    for (const PipeEvent& e : events)
        mine.insert(mine.end(), {(double)e.op, (double)e.mb, (double)e.chunk, e.t0_ms, e.t1_ms, 0, 0});
    for (const CommInterval& e : comm_events) {
        mine.insert(mine.end(), {LINK, (double)e.op, (double)e.group, (e.start_s - origin_s) * 1e3,
                                 (e.done_s - origin_s) * 1e3, (double)e.bytes, 0});
        mine.insert(mine.end(), {WAIT, (double)e.op, (double)e.group, (e.wait_s - origin_s) * 1e3,
                                 (e.end_s - origin_s) * 1e3, (double)e.bytes, 0});
    }
    size_t longest = 0;
    for (uint64_t n : host_gather_all<uint64_t>(cm.world, mine.size())) longest = std::max(longest, (size_t)n);
    mine.resize(longest, -1.0);
    std::vector<double> all(longest * cm.world_size);
    host_all_gather(cm.world, mine.data(), all.data(), longest * sizeof(double));
    if (cm.world_rank != 0) return;
    FILE* f = fopen_or_fail(path, "w");
    static const char* ops[] = {"F", "B", "W", "send", "recv", "send", "recv"};
    for (int r = 0; r < cm.world_size; r++)
        for (size_t k = 0; k + 6 < longest; k += 7) {
            const double* e = all.data() + (size_t)r * longest + k;
            if (e[0] < 0) break;
            if (e[0] >= LINK)
                fprintf(f, "{\"rank\": %d, \"stage\": %d, \"dp\": %d, \"op\": \"%s\", \"comm\": \"%s\", \"group\": \"%s\", "
                           "\"bytes\": %.0f, \"mb\": -1, \"chunk\": 0, \"t0_ms\": %.4f, \"t1_ms\": %.4f, \"schedule\": \"%s\"}\n",
                        r, r / cm.dp.size, r % cm.dp.size, e[0] == LINK ? "link" : "wait", comm_op_name((int)e[1]),
                        comm_group_name((int)e[2]), e[5], e[3], e[4], pipe_kind_name(pp.kind));
            else
                fprintf(f, "{\"rank\": %d, \"stage\": %d, \"dp\": %d, \"op\": \"%s\", \"mb\": %d, \"chunk\": %d, "
                           "\"t0_ms\": %.4f, \"t1_ms\": %.4f, \"schedule\": \"%s\"}\n",
                        r, r / cm.dp.size, r % cm.dp.size, ops[(int)e[0]], (int)e[1], (int)e[2], e[3], e[4],
                        pipe_kind_name(pp.kind));
        }
    LLMC_CHECK(fclose(f) == 0, "%s: cannot write the pipeline trace", path.c_str());
    printf("wrote the pipeline timeline of step %lld (the run's last) to %s\n", (long long)cm.step, path.c_str());
}
