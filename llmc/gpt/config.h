// A chapter of train_gpt.cu (included once, there): the model's config and its parameter table.
// The config (stored in every checkpoint), the table of every tensor (name, shape, offset in the
// flat buffers, init, weight decay; the checkpoint order), the pointers into a flat buffer laid
// out by it, and the segments the flat buffers are cut into for ZeRO (llmc/parallel/zero.h).

enum MlpKind { MLP_SWIGLU = 0, MLP_GELU = 1 };
enum PosKind { POS_ALIBI = 0, POS_LEARNED = 1, POS_ROPE = 2 };
enum NormKind { NORM_LAYERNORM = 0, NORM_RMSNORM = 1 };
enum BiasKind { BIAS_ALL = 0, BIAS_QKV = 1, BIAS_NONE = 2 };  // which linear layers have a bias
enum MoeGroup { MOE_GROUP_BATCH = 0, MOE_GROUP_POSITION = 1 };

struct GPTConfig {
    int vocab_size = 257;          // real vocabulary (byte tokenizer: 256 bytes + EOT)
    int padded_vocab_size = 384;   // vocab_size rounded up to a multiple of 128 (derived)
    int n_layer = 4, n_embd = 128, n_head = 4, n_kv_head = 4;
    int ffn_hidden = 0;            // 0: derived (swiglu: 8/3 C rounded up to 32; gelu: 4 C)
    int max_seq_len = 1024;
    int mlp = MLP_SWIGLU, pos = POS_ALIBI;
    // mixture of experts (llmc/ops/cpu/moe.h): n_expert 0 = dense; every moe_every-th block's FFN
    // (layers l with (l + 1) % moe_every == 0) is a set of SwiGLU experts of size expert_hidden
    int n_expert = 0, moe_every = 1, expert_hidden = 0;  // expert_hidden 0: ffn_hidden
    float capacity_factor = 2.0f;
    int moe_group = MOE_GROUP_BATCH;
    // the Llama / Qwen2 shape (docs/ARCHITECTURE.md): RMSNorm (norm_eps; LayerNorm's eps is 1e-5),
    // linear biases (GPT-2: all; Qwen2: q/k/v only; Llama: none), an untied lm head, rotary
    // positions (llmc/ops/cpu/rope.h: theta and the llama3 frequency scaling)
    int norm = NORM_LAYERNORM, bias = BIAS_ALL, tie_embeddings = 1;
    float norm_eps = 1e-5f;
    cpu::RopeSpec rope;

    int head_size() const { return n_embd / n_head; }
    int qkv_channels() const { return (n_head + 2 * n_kv_head) * head_size(); }
    int fc_channels() const { return mlp == MLP_SWIGLU ? 2 * ffn_hidden : ffn_hidden; }
    bool rmsnorm() const { return norm == NORM_RMSNORM; }
    bool qkv_bias() const { return bias != BIAS_NONE; }
    bool linear_bias() const { return bias == BIAS_ALL; }  // the other linear layers'
    bool is_moe(int layer) const { return n_expert > 0 && (layer + 1) % moe_every == 0; }
    int moe_capacity(int B, int T) const {
        return cpu::moe_capacity(B, T, n_expert, capacity_factor, moe_group == MOE_GROUP_POSITION);
    }

    // fills derived fields and rejects impossible shapes, naming the flag
    void finalize() {
        // Upper bounds first, far above any real model, so that every derived size below (and the
        // int arithmetic of the ops) is far from overflowing: e.g. --vocab_size 2147483647 would
        // wrap the padding to a multiple of 128, --n_embd 1073741856 the FFN width.
        const std::pair<const char*, std::pair<int, int>> bounds[] = {
            {"vocab_size", {vocab_size, 1 << 24}},   {"n_layer", {n_layer, 1024}},
            {"n_embd", {n_embd, 1 << 16}},           {"n_head", {n_head, 4096}},
            {"n_kv_head", {n_kv_head, 4096}},        {"ffn_hidden", {ffn_hidden, 1 << 20}},
            {"max_seq_len", {max_seq_len, 1 << 24}}, {"n_expert", {n_expert, 1024}},
            {"moe_every", {moe_every, 1024}},        {"expert_hidden", {expert_hidden, 1 << 20}}};
        for (const auto& [flag, vb] : bounds)
            LLMC_CHECK(vb.first <= vb.second, "--%s %d is too large: at most %d is supported", flag, vb.first, vb.second);
        LLMC_CHECK(vocab_size > 0, "--vocab_size: must be > 0, got %d", vocab_size);
        padded_vocab_size = ceil_div(vocab_size, 128) * 128;
        LLMC_CHECK(n_layer > 0, "--n_layer: must be > 0, got %d", n_layer);
        LLMC_CHECK(n_head > 0 && n_embd > 0 && n_embd % n_head == 0,
                   "--n_embd %d must be a positive multiple of --n_head %d", n_embd, n_head);
        LLMC_CHECK(n_kv_head > 0 && n_head % n_kv_head == 0,
                   "--n_kv_head %d must divide --n_head %d (grouped-query attention)", n_kv_head, n_head);
        LLMC_CHECK(mlp == MLP_SWIGLU || mlp == MLP_GELU, "--mlp: expected swiglu or gelu");
        LLMC_CHECK(pos == POS_ALIBI || pos == POS_LEARNED || pos == POS_ROPE, "--pos: expected alibi, learned or rope");
        LLMC_CHECK(norm == NORM_LAYERNORM || norm == NORM_RMSNORM, "--norm: expected layernorm or rmsnorm");
        LLMC_CHECK(bias == BIAS_ALL || bias == BIAS_QKV || bias == BIAS_NONE, "--bias: expected all, qkv or none");
        LLMC_CHECK(tie_embeddings == 0 || tie_embeddings == 1, "--tie_embeddings: expected 0 or 1, got %d", tie_embeddings);
        LLMC_CHECK(std::isfinite(norm_eps) && norm_eps > 0 && norm_eps < 1, "--norm_eps: expected a number in (0, 1), got %g",
                   norm_eps);
        if (pos == POS_ROPE) {
            LLMC_CHECK(head_size() % 2 == 0, "--pos rope: the head size n_embd / n_head = %d must be even", head_size());
            LLMC_CHECK(std::isfinite(rope.theta) && rope.theta > 1 && rope.theta < 1e12,
                       "--rope_theta: expected a number in (1, 1e12), got %g", rope.theta);
            LLMC_CHECK(rope.scaling == cpu::ROPE_SCALING_NONE || rope.scaling == cpu::ROPE_SCALING_LLAMA3,
                       "--rope_scaling: expected none or llama3");
            if (rope.scaling == cpu::ROPE_SCALING_LLAMA3) {
                LLMC_CHECK(std::isfinite(rope.factor) && rope.factor >= 1 && rope.factor < 1e6,
                           "--rope_factor: expected a number in [1, 1e6), got %g", rope.factor);
                LLMC_CHECK(std::isfinite(rope.low_freq_factor) && std::isfinite(rope.high_freq_factor) &&
                               rope.low_freq_factor > 0 && rope.high_freq_factor > rope.low_freq_factor &&
                               rope.high_freq_factor < 1e6,
                           "--rope_low_freq_factor %g, --rope_high_freq_factor %g: expected 0 < low < high",
                           rope.low_freq_factor, rope.high_freq_factor);
                LLMC_CHECK(rope.original_max_pos > 0 && rope.original_max_pos <= (1 << 24),
                           "--rope_original_max_pos: expected 1 .. 2^24, got %d", rope.original_max_pos);
            }
        }
        if (ffn_hidden == 0) ffn_hidden = mlp == MLP_SWIGLU ? ceil_div(8 * n_embd / 3, 32) * 32 : 4 * n_embd;
        LLMC_CHECK(ffn_hidden > 0, "--ffn_hidden: must be > 0, got %d", ffn_hidden);
        LLMC_CHECK(max_seq_len > 0, "--max_seq_len: must be > 0, got %d", max_seq_len);
        LLMC_CHECK(n_expert >= 0, "--n_expert: must be >= 0, got %d", n_expert);
        LLMC_CHECK(moe_every >= 1, "--moe_every: must be >= 1, got %d", moe_every);
        LLMC_CHECK(std::isfinite(capacity_factor) && capacity_factor > 0, "--capacity_factor: must be a positive number, got %g",
                   capacity_factor);
        LLMC_CHECK(n_expert == 0 || moe_every <= n_layer,
                   "--moe_every %d is larger than --n_layer %d: no block would have an MoE layer", moe_every, n_layer);
        LLMC_CHECK(moe_group == MOE_GROUP_BATCH || moe_group == MOE_GROUP_POSITION, "--moe_group: expected batch or position");
        if (expert_hidden == 0) expert_hidden = ffn_hidden;
        LLMC_CHECK(expert_hidden > 0, "--expert_hidden: must be > 0, got %d", expert_hidden);
    }

    // Rejects a batch shape this model cannot run, naming the flags. Sizes in 64 bits: the ops
    // index tokens (B*T*ranks) and an MoE layer's expert rows with int.
    void check_batch(int64_t B, int64_t T, int64_t world = 1) const {
        LLMC_CHECK(B > 0, "--batch_size: must be > 0, got %lld", (long long)B);
        LLMC_CHECK(T > 0, "--seq_len: must be > 0, got %lld", (long long)T);
        // the learned position table has max_seq_len rows; a longer row would read and write past it
        LLMC_CHECK(pos != POS_LEARNED || T <= max_seq_len,
                   "--seq_len %lld is longer than --max_seq_len %d: with --pos learned the position table has "
                   "max_seq_len rows; lower -t or raise --max_seq_len", (long long)T, max_seq_len);
        checked_product({B, T, world}, INT32_MAX, "the tokens per micro-batch B*T*ranks");
        if (n_expert > 0)
            checked_product({(int64_t)n_expert, (int64_t)moe_capacity((int)B, (int)T)}, INT32_MAX,
                            "the MoE expert rows n_expert * capacity");
    }
};

// One row of the parameter table: every parameter lives at `offset` in one flat buffer (and its
// gradient and Adam moments at the same offset in theirs; the few padding elements between
// tensors stay zero). The order is the checkpoint order and
// the order of scripts/reference.py.
struct ParamTensor {
    std::string name;
    std::vector<int> shape;
    size_t offset = 0, numel = 0;
    enum Init { NORMAL, ZEROS, ONES } init = NORMAL;
    float init_std = 0.02f;
    bool decay = false;
};

static std::vector<ParamTensor> build_param_table(const GPTConfig& c) {
    std::vector<ParamTensor> table;
    size_t offset = 0;
    auto add = [&](const std::string& name, std::vector<int> shape, ParamTensor::Init init, float std = 0.02f) {
        ParamTensor p;
        p.name = name;
        p.shape = shape;
        p.numel = 1;
        for (int d : shape) p.numel *= (size_t)d;
        p.offset = offset;
        p.init = init;
        p.init_std = std;
        // AdamW weight decay: matrices only (embeddings and linear weights; not biases, not LN)
        p.decay = shape.size() >= 2 && (name == "wte" || name == "wpe" || name == "lm_head" ||
                                        name.substr(name.size() - 2) == ".w");
        offset += (p.numel + 7) / 8 * 8;  // every tensor 16-byte aligned in bf16 (cuBLASLt bias epilogue)
        table.push_back(p);
    };
    const int C = c.n_embd;
    // GPT-2 / nanoGPT init: residual-branch output projections scaled by 1/sqrt(2 n_layer)
    const float proj_std = 0.02f / std::sqrt(2.0f * c.n_layer);
    add("wte", {c.padded_vocab_size, C}, ParamTensor::NORMAL);
    if (c.pos == POS_LEARNED) add("wpe", {c.max_seq_len, C}, ParamTensor::NORMAL);
    for (int l = 0; l < c.n_layer; l++) {
        std::string h = "h" + std::to_string(l) + ".";
        // (RMSNorm has no bias; --bias says which linear layers have one)
        const bool ln = !c.rmsnorm(), lb = c.linear_bias();
        add(h + "ln1.w", {C}, ParamTensor::ONES);
        if (ln) add(h + "ln1.b", {C}, ParamTensor::ZEROS);
        add(h + "attn.qkv.w", {c.qkv_channels(), C}, ParamTensor::NORMAL);
        if (c.qkv_bias()) add(h + "attn.qkv.b", {c.qkv_channels()}, ParamTensor::ZEROS);
        add(h + "attn.proj.w", {C, c.n_head * c.head_size()}, ParamTensor::NORMAL, proj_std);
        if (lb) add(h + "attn.proj.b", {C}, ParamTensor::ZEROS);
        add(h + "ln2.w", {C}, ParamTensor::ONES);
        if (ln) add(h + "ln2.b", {C}, ParamTensor::ZEROS);
        if (c.is_moe(l)) {  // E SwiGLU experts, stacked
            const int E = c.n_expert, He = c.expert_hidden;
            add(h + "moe.router.w", {E, C}, ParamTensor::NORMAL);
            add(h + "moe.fc.w", {E, 2 * He, C}, ParamTensor::NORMAL);
            if (lb) add(h + "moe.fc.b", {E, 2 * He}, ParamTensor::ZEROS);
            add(h + "moe.proj.w", {E, C, He}, ParamTensor::NORMAL, proj_std);
            if (lb) add(h + "moe.proj.b", {E, C}, ParamTensor::ZEROS);
        } else {
            add(h + "mlp.fc.w", {c.fc_channels(), C}, ParamTensor::NORMAL);
            if (lb) add(h + "mlp.fc.b", {c.fc_channels()}, ParamTensor::ZEROS);
            add(h + "mlp.proj.w", {C, c.ffn_hidden}, ParamTensor::NORMAL, proj_std);
            if (lb) add(h + "mlp.proj.b", {C}, ParamTensor::ZEROS);
        }
    }
    add("lnf.w", {C}, ParamTensor::ONES);
    if (!c.rmsnorm()) add("lnf.b", {C}, ParamTensor::ZEROS);
    // an untied lm head (--tie_embeddings 0): its own matrix, in the final LayerNorm's segment (the
    // last pipeline stage's), vocab-parallel like wte; the rows past vocab_size stay zero
    if (!c.tie_embeddings) add("lm_head", {c.padded_vocab_size, C}, ParamTensor::NORMAL);
    return table;
}

// size of the flat buffers, including the alignment padding
static size_t count_params(const std::vector<ParamTensor>& table) {
    return table.back().offset + (table.back().numel + 7) / 8 * 8;
}

// Pointers into a flat buffer laid out by the table, of element type T: the parameters (floatX)
// or the gradients (fp32 in both builds: every op's weight gradient is an fp32 sum, llmc/ops/).
template <typename T>
struct LayerTensors {
    T *ln1w = nullptr, *ln1b = nullptr, *qkvw = nullptr, *qkvb = nullptr, *attprojw = nullptr, *attprojb = nullptr,
      *ln2w = nullptr, *ln2b = nullptr;
    // dense FFN, or the stacked experts' of an MoE layer
    T *fcw = nullptr, *fcb = nullptr, *fcprojw = nullptr, *fcprojb = nullptr;
    T* routerw = nullptr;  // MoE layers only
};
template <typename T>
struct ModelTensors {
    T *wte = nullptr, *wpe = nullptr, *lnfw = nullptr, *lnfb = nullptr;
    T* lm_head = nullptr;  // --tie_embeddings 0 only
    std::vector<LayerTensors<T>> layers;
};

// The segments of the flat buffers (llmc/parallel/zero.h): the embedding; each block's two halves,
// its attention (LN1, attn) and its FFN (LN2, the MLP or the router), so that a block's FFN
// gradient is reduced while its attention's backward runs and its FFN's params are gathered while
// its attention's forward runs; each MoE layer's experts (sharded over the expert-dp group); the
// final LayerNorm. Layer l's attention is segment 1 + l (a block's model segment: the hooks take
// all of a layer's parts by it), the final LayerNorm n_layer + 1, layer l's experts n_layer + 2 + l,
// its FFN 2 n_layer + 2 + l. The table and the checkpoints do not depend on it; the gradient
// norm's chunks and the reductions' grouping do, the same for every layout.
static bool is_expert_tensor(const std::string& name) {
    const size_t dot = name.find('.');
    return dot != std::string::npos && name.compare(dot + 1, 4, "moe.") == 0 && name.compare(dot + 1, 10, "moe.router") != 0;
}
static bool is_ffn_tensor(const std::string& name) {
    const size_t dot = name.find('.');
    return dot != std::string::npos && (name.compare(dot + 1, 4, "ln2.") == 0 || name.compare(dot + 1, 4, "mlp.") == 0 ||
                                        name.compare(dot + 1, 10, "moe.router") == 0);
}
static int segment_of(const std::string& name, int n_layer) {
    if (name == "wte" || name == "wpe") return 0;
    if (name[0] != 'h') return n_layer + 1;
    const int l = std::stoi(name.substr(1, name.find('.') - 1));
    return is_expert_tensor(name) ? n_layer + 2 + l : is_ffn_tensor(name) ? 2 * n_layer + 2 + l : 1 + l;
}
static int segment_count(int n_layer) { return 3 * n_layer + 2; }  // ids [0, count), MoE or not
// the block a segment belongs to (-1: the embedding or the final LayerNorm)
static int segment_layer(int id, int n_layer) {
    if (id == 0 || id == n_layer + 1) return -1;
    return id <= n_layer ? id - 1 : id < 2 * n_layer + 2 ? id - n_layer - 2 : id - 2 * n_layer - 2;
}
// the kinds of segments: the classes of the ZeRO-2/3 slots (llmc/gpt/plan.h: alloc_segment_slots)
enum SegmentKind { SEG_EMBEDDING, SEG_ATTENTION, SEG_FFN, SEG_EXPERTS, SEG_FINAL, SEG_KINDS };
static int segment_kind(int id, int n_layer) {
    return id == 0                  ? SEG_EMBEDDING
           : id <= n_layer          ? SEG_ATTENTION
           : id == n_layer + 1      ? SEG_FINAL
           : id < 2 * n_layer + 2   ? SEG_EXPERTS
                                    : SEG_FFN;
}
// every segment of the model, in table order (a segment's range runs to the next one's start);
// n_leaves: the experts' leaf gradients (expert parallelism: --ep)
static std::vector<SegmentSpec> segment_specs(const GPTConfig& c, const std::vector<ParamTensor>& table, int n_leaves = 1) {
    std::vector<SegmentSpec> specs;
    for (const ParamTensor& p : table) {
        const int s = segment_of(p.name, c.n_layer), l = segment_layer(s, c.n_layer);
        if (specs.empty() || specs.back().id != s) {
            SegmentSpec spec;
            const int kind = segment_kind(s, c.n_layer);
            spec.name = kind == SEG_EMBEDDING ? "embedding" : kind == SEG_FINAL ? "final"
                        : "h" + std::to_string(l) + (kind == SEG_ATTENTION ? ".attn" : kind == SEG_FFN ? ".ffn" : ".experts");
            spec.id = s;
            spec.begin = p.offset;
            spec.expert = kind == SEG_EXPERTS;
            spec.n_leaves = spec.expert ? n_leaves : 1;
            specs.push_back(spec);
        }
    }
    for (size_t k = 0; k < specs.size(); k++)
        specs[k].len = (k + 1 < specs.size() ? specs[k + 1].begin : count_params(table)) - specs[k].begin;
    return specs;
}

// Points the fields of the tensors of segment `seg` at base (the segment's first element), or
// at nullptr (stage 3: the segment is not gathered). (T is taken from t alone: base may be nullptr.)
template <typename T>
static void point_segment(ModelTensors<T>& t, const GPTConfig& c, const std::vector<ParamTensor>& table,
                          const Segment& seg, typename std::common_type<T>::type* base) {
    t.layers.resize(c.n_layer);
    for (const ParamTensor& p : table) {
        if (segment_of(p.name, c.n_layer) != seg.id) continue;
        T* ptr = base ? base + (p.offset - seg.begin) : nullptr;
        if (p.name == "wte") { t.wte = ptr; continue; }
        if (p.name == "wpe") { t.wpe = ptr; continue; }
        if (p.name == "lnf.w") { t.lnfw = ptr; continue; }
        if (p.name == "lnf.b") { t.lnfb = ptr; continue; }
        if (p.name == "lm_head") { t.lm_head = ptr; continue; }
        LayerTensors<T>& L = t.layers[segment_layer(seg.id, c.n_layer)];
        const std::string f = p.name.substr(p.name.find('.') + 1);
        T** field = f == "ln1.w" ? &L.ln1w : f == "ln1.b" ? &L.ln1b : f == "attn.qkv.w" ? &L.qkvw
                       : f == "attn.qkv.b" ? &L.qkvb : f == "attn.proj.w" ? &L.attprojw : f == "attn.proj.b" ? &L.attprojb
                       : f == "ln2.w" ? &L.ln2w : f == "ln2.b" ? &L.ln2b : f == "moe.router.w" ? &L.routerw
                       : (f == "mlp.fc.w" || f == "moe.fc.w") ? &L.fcw : (f == "mlp.fc.b" || f == "moe.fc.b") ? &L.fcb
                       : (f == "mlp.proj.w" || f == "moe.proj.w") ? &L.fcprojw
                       : (f == "mlp.proj.b" || f == "moe.proj.b") ? &L.fcprojb : nullptr;
        LLMC_CHECK(field, "internal: parameter %s has no field", p.name.c_str());
        *field = ptr;
    }
}
