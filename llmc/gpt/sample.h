// A chapter of train_gpt.cu (included once, there): sampling from the model, the same token on
// every rank (every stage runs its part of each forward; the last stage's logits go to all).

// Generates n_tokens after the prompt (temperature, top-k; top_k <= 0 means all), feeding the last
// max(max_seq_len, max_T) tokens (the model's context; ALiBi may train past max_seq_len), at most the
// tokens one training micro-batch's buffers hold (max_B x max_T) over the rows; an EOT starts a new
// document, as in training. MoE models sample `rows` independent sequences
// side by side so the routing groups look as in training (the B tokens of a position, or the
// B x length tokens of the batch); a dense model needs one row. Returns row 0. Collective: every
// stage runs its part of each forward; the last stage's logits go to every rank, which all draw
// the same token.
static std::vector<int> gpt_sample(GPT& m, const std::vector<int>& prompt, int n_tokens, float temperature, int top_k,
                                   int eot, Rng& rng) {
    const int V = m.config.vocab_size, Vl = m.ls.vocab, tp = m.ls.tp;
    const int rows = m.config.n_expert > 0 ? m.max_B : 1;
    const PipelinePlan& pp = m.pipe;
    std::vector<std::vector<int>> seqs(rows, prompt);
    std::vector<int> ctx, ctx_start;
    std::vector<std::pair<float, int>> cand(V);
    std::vector<floatX> mine((size_t)rows * Vl), slices((size_t)rows * Vl * tp), logits((size_t)rows * V),
        all_logits((size_t)rows * V * pp.P);
    // --sp splits a forward's tokens over the tp ranks: the context is a multiple of what makes
    // rows * T divide, left-padded with end-of-text (a new document: attention ignores the padding)
    int unit = 1;  // the smallest T with rows * T a multiple of tp
    while (m.ls.sp && ((int64_t)rows * unit) % tp != 0) unit++;
    const int max_ctx = (int)std::min<int64_t>(std::max(m.config.max_seq_len, m.max_T), (int64_t)m.max_B * m.max_T / rows);
    for (int i = 0; i < n_tokens; i++) {
        const int len = (int)seqs[0].size();  // all rows have the same length
        int T = ceil_div(std::min(len, max_ctx), unit) * unit;
        if (T > max_ctx) T -= unit;
        const int n_ctx = std::min(len, T);
        ctx.resize((size_t)rows * T);
        ctx_start.resize((size_t)rows * T);
        for (int r = 0; r < rows; r++) {
            std::fill(ctx.begin() + (size_t)r * T, ctx.begin() + (size_t)r * T + (T - n_ctx), eot);
            std::copy(seqs[r].end() - n_ctx, seqs[r].end(), ctx.begin() + (size_t)r * T + (T - n_ctx));
            compute_doc_start(ctx_start.data() + (size_t)r * T, ctx.data() + (size_t)r * T, T, eot);
        }
        // each row's last position's logits, from the head's token chunks: this rank's vocabulary columns
        gpt_forward(m, ctx.data(), nullptr, ctx_start.data(), rows, T, 0.0f, [&](int t0, int n, const floatX* chunk) {
            for (int r = 0; r < rows; r++) {
                const int last = r * T + T - 1;
                if (last >= t0 && last < t0 + n)
                    copy_from_buffer(mine.data() + (size_t)r * Vl, chunk + (size_t)(last - t0) * Vl, Vl * sizeof(floatX));
            }
        });
        if (pp.has_head()) {  // then all the columns
            host_all_gather(comm_world().tp, mine.data(), slices.data(), mine.size() * sizeof(floatX));
            for (int r = 0; r < rows; r++)
                for (int v = 0; v < V; v++) logits[(size_t)r * V + v] = slices[((size_t)(v / Vl) * rows + r) * Vl + v % Vl];
        }
        host_all_gather(comm_world().pp, logits.data(), all_logits.data(), logits.size() * sizeof(floatX));
        const floatX* last = all_logits.data() + (size_t)(pp.P - 1) * rows * V;
        for (int r = 0; r < rows; r++) {
            for (int v = 0; v < V; v++) cand[v] = {(float)last[(size_t)r * V + v] / std::max(temperature, 1e-6f), v};
            int k = top_k > 0 ? std::min(top_k, V) : V;
            std::partial_sort(cand.begin(), cand.begin() + k, cand.end(),
                              [](const std::pair<float, int>& a, const std::pair<float, int>& b) {
                                  return a.first > b.first || (a.first == b.first && a.second < b.second);
                              });
            double sum = 0;
            for (int j = 0; j < k; j++) sum += std::exp((double)cand[j].first - cand[0].first);
            double u = rng.uniform() * sum, acc = 0;
            int next = cand[k - 1].second;
            for (int j = 0; j < k; j++) {
                acc += std::exp((double)cand[j].first - cand[0].first);
                if (u < acc) { next = cand[j].second; break; }
            }
            seqs[r].push_back(next);
        }
    }
    return std::vector<int>(seqs[0].begin() + prompt.size(), seqs[0].end());
}


static void print_sample(GPT& m, int n_tokens, float temperature, int top_k, const Tokenizer& tokenizer, Rng& rng) {
    std::vector<int> out = gpt_sample(m, {tokenizer.eot}, n_tokens, temperature, top_k, tokenizer.eot, rng);
    const std::string text = tokenizer.decode(out);  // whole UTF-8 characters only (llmc/io/tokenizer.h)
    if (comm_world().world_rank != 0) return;  // every rank samples (stage 3 gathers), rank 0 prints
    printf("---- sample ----\n%s\n----------------\n", text.c_str());
    fflush(stdout);
}
