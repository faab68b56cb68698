// A chapter of train_gpt.cu (included once, there): the command line. Every flag with its llm.c
// letter, default and help (print_usage is generated from the table), the strict parse, the
// model presets and the config the flags describe, and the optimizer values refused up front.

struct Option {
    const char* name;
    const char* short_name;  // llm.c's single-letter flag, or ""
    const char* default_value;
    const char* help;
};

#ifdef LLMC_FP16
#define LOSS_SCALE_DEFAULT "dynamic"  // fp16 gradients underflow without it
#else
#define LOSS_SCALE_DEFAULT "1"  // fp32 and bf16 have fp32's exponent range
#endif
static const Option OPTIONS[] = {
    {"train", "i", "data/fortunes/fortunes_train_*.bin", "train shard pattern (glob)"},
    {"val", "j", "data/fortunes/fortunes_val_*.bin", "val shard pattern (glob); empty: no validation"},
    {"out_dir", "o", "out", "output directory: log.jsonl, checkpoints"},
    {"model", "e", "", "preset dN (n_layer N, n_embd 64N, n_head N), gpt2:124M|350M|774M|1558M (GPT-2's shapes, "
                       "vocab 50257, gelu, learned positions) or the open models' shapes llama3.2:1B|3B, "
                       "qwen2.5:0.5B|1.5B (rope, rmsnorm, their vocabularies; shapes only: the weights come from "
                       "scripts/import_hf.py); explicit flags override it (default: none)"},
    {"vocab_size", "", "257", "real vocabulary size (padded to a multiple of 128 internally)"},
    {"n_layer", "", "4", "transformer blocks"},
    {"n_embd", "", "128", "channels"},
    {"n_head", "", "4", "query heads"},
    {"n_kv_head", "", "", "key/value heads (GQA; divides n_head; default n_head)"},
    {"ffn_hidden", "", "0", "FFN hidden size (0: swiglu 8/3 C rounded up to 32, gelu 4 C)"},
    {"max_seq_len", "", "1024", "maximum sequence length (size of the learned position table)"},
    {"mlp", "", "swiglu", "swiglu | gelu"},
    {"n_expert", "", "0", "experts per MoE layer (0: dense model)"},
    {"moe_every", "", "1", "every k-th block's FFN is an MoE layer (layers k-1, 2k-1, ...)"},
    {"expert_hidden", "", "0", "hidden size of each SwiGLU expert (0: ffn_hidden)"},
    {"capacity_factor", "", "2.0", "expert choice: each expert takes capacity_factor * tokens / n_expert tokens"},
    {"moe_group", "", "batch", "routing group: batch (the micro-batch, sees future tokens) | position (causal)"},
    {"pos", "", "alibi", "alibi | learned | rope (rotary, per document, rotate-half pairing as Llama)"},
    {"rope_theta", "", "10000", "--pos rope: the base of the rotary frequencies"},
    {"rope_scaling", "", "none", "--pos rope: none | llama3 (Llama-3.1/3.2's frequency scaling, the four flags below)"},
    {"rope_factor", "", "8", "llama3 scaling: the factor low frequencies are divided by"},
    {"rope_low_freq_factor", "", "1", "llama3 scaling: wavelengths above original / this are scaled"},
    {"rope_high_freq_factor", "", "4", "llama3 scaling: wavelengths below original / this are kept"},
    {"rope_original_max_pos", "", "8192", "llama3 scaling: the context the model was first trained with"},
    {"norm", "", "layernorm", "layernorm (eps 1e-5, weight and bias) | rmsnorm (weight only, eps --norm_eps)"},
    {"norm_eps", "", "1e-5", "RMSNorm's eps (Llama 3: 1e-5, Qwen2.5: 1e-6)"},
    {"rms_eps", "", "", "the same as --norm_eps (transformers' name, rms_norm_eps)"},
    {"bias", "", "all", "which linear layers have a bias: all (GPT-2) | qkv (Qwen2: q, k, v only) | none (Llama)"},
    {"tie_embeddings", "", "1", "1: the lm head is wte (tied); 0: an lm head matrix of its own"},
    {"batch_size", "b", "16", "B: rows per micro-batch"},
    {"seq_len", "t", "256", "T: tokens per row"},
    {"total_batch_tokens", "d", "0", "tokens per optimizer step (a multiple of B*T; 0: B*T)"},
    {"lr", "l", "2e-3", "peak learning rate"},
    {"warmup", "u", "50", "warmup steps"},
    {"final_lr_frac", "q", "0.1", "final learning rate as a fraction of the peak"},
    {"schedule", "", "cosine", "cosine | linear | constant | wsd"},
    {"wsd_decay_frac", "", "0.2", "wsd: fraction of the steps spent decaying"},
    {"weight_decay", "c", "0.1", "AdamW weight decay (matrices: 2-D and stacked experts; not biases or LayerNorm)"},
    {"beta1", "", "0.9", "AdamW beta1"},
    {"beta2", "", "0.95", "AdamW beta2"},
    {"grad_clip", "", "1.0", "clip the global gradient norm to this (0: off)"},
    {"max_steps", "x", "1000", "optimizer steps"},
    {"val_every", "v", "100", "evaluate every N steps (0: only at the end)"},
    {"val_batches", "m", "20", "batches per evaluation"},
    {"eval_mc", "", "", "multiple-choice file (scripts/prepare_mc.py): acc and acc_norm at every evaluation "
                        "(default: none)"},
    {"eval_only", "", "0", "with --resume or --init_from: evaluate the model (val loss, bits per byte, --eval_mc) "
                           "and train nothing (a switch)"},
    {"sample_every", "s", "0", "print a sample every N steps (0: only at the end)"},
    {"sample_len", "g", "256", "tokens per sample"},
    {"temperature", "", "1.0", "sampling temperature"},
    {"top_k", "", "0", "sample from the k most likely tokens (0: all)"},
    {"ckpt_every", "n", "0", "write a checkpoint every N steps and at the end (0: only at the end; -1: never)"},
    {"resume", "y", "", "checkpoint to resume from: a file, or 'latest' (newest in out_dir; default: none)"},
    {"init_from", "", "", "start from the weights of a model file (scripts/import_hf.py: Llama, Qwen2, Mistral from "
                          "Hugging Face), one of our checkpoints, or an llm.c GPT-2 model file (the config is the "
                          "file's; fresh optimizer state; step 0; default: none)"},
    {"export_llmc", "", "", "at the end, also write the model as an llm.c GPT-2 model file (GPT-2 shapes only; "
                            "default: none)"},
    {"export_llmc_dtype", "", "fp32", "fp32 | bf16: the precision of --export_llmc (llm.c's version 3 or 5)"},
    {"tokenizer", "", "", "vocabulary file for decoding samples (default: tokenizer.bin or gpt2_tokenizer.bin next to "
                          "the train shards, else bytes or token ids)"},
    {"seed", "", "1337", "seed for init, data order and sampling (0 .. 2^64-1)"},
    {"overwrite", "", "0", "a fresh run may replace the checkpoints and log of an earlier run in out_dir (a switch)"},
    {"loss_scale", "", LOSS_SCALE_DEFAULT, "dynamic | N: the loss's gradient is multiplied by a scale so that small fp16 "
                                           "gradients do not flush to zero; dynamic starts at 65536, halves on an overflow "
                                           "(that step is skipped) and doubles after --loss_scale_window finite steps; N: a "
                                           "fixed scale (1: off) (default: dynamic in the fp16 build, else 1)"},
    {"loss_scale_window", "", "2000", "dynamic loss scale: finite steps in a row before it doubles"},
    {"max_bad_steps", "", "5", "stop (exit 1) after this many consecutive steps with a non-finite loss or grad norm"},
    {"zero", "z", "0", "ZeRO stage over the data-parallel ranks: 0 all-reduce, 1 shard optimizer state, 2 also "
                       "gradients, 3 also parameters (gathered per block)"},
    {"grad_blocks", "", "", "the order of the step's gradient sum: its micro-batches in this many blocks, each summed, "
                            "then added in order (default: what the layout sums at the anchors' bytes, printed at "
                            "start-up; one process given that count reproduces a layout bit for bit)"},
    {"recompute", "r", "0", "activation recomputation: 0 keep all, 1 recompute LayerNorm outputs and the FFN "
                            "activation, 2 recompute each block in the backward (same gradients)"},
    {"logits_chunk", "", "0", "tokens per lm-head chunk: the logits, loss and head backward run over a micro-batch's "
                              "tokens in chunks of this many, the logits buffer holds one (0: the largest power of two, "
                              "at most B*T, whose bf16 logits fit 1/32 of the GPU's total memory, or 128 MiB with no "
                              "GPU; the same in every layout; lower it if the plan does not fit)"},
    {"offload", "", "none", "none | optimizer: the fp32 master weights and AdamW moments of what this rank updates in "
                            "host memory, the AdamW step on the CPU (ZeRO-Offload; same results)"},
    {"plan", "", "0", "print the memory plan (every stage, -z and -r level) and whether it fits, then exit (a switch)"},
    {"plan_ranks", "", "", "--plan: plan for this many processes (default: the ones started)"},
    {"max_fit", "", "0", "--plan plus the largest -b and the largest dN model that fit, per -r level (a switch)"},
    {"device", "", "", "--plan: plan the CUDA build on this GPU instead of this machine: t4 | v100-16 | v100-32 | a100-40 | "
                       "a100-80 | l4 | rtx3090 | rtx4090 | a6000 | h100 | h200 (t4, v100: no bf16, an fp16 build's plan)"},
    {"pp", "", "1", "pipeline stages (the processes form pp x dp; micro-batches per step = the accumulation steps)"},
    {"pp_schedule", "", "1f1b", "pipeline schedule: gpipe | 1f1b | interleaved | zb1 (zero bubble, Qi et al. 2023)"},
    {"pp_virtual", "", "1", "interleaved: model chunks per stage"},
    {"pp_layers", "", "", "blocks per virtual stage, e.g. 3,5 (default: balanced by FLOPs)"},
    {"pp_trace", "", "", "write the executed pipeline timeline of the last step to this file (scripts/plot_pipeline.py)"},
    {"tp", "", "1", "tensor-parallel ranks per layer (neighbouring processes; divides n_head; the processes form "
                    "pp x dp x tp)"},
    {"ep", "", "1", "expert-parallel ranks: each MoE layer's experts are shared out over groups of ep data-parallel "
                    "ranks (divides dp and n_expert)"},
    {"sp", "", "0", "sequence parallel with --tp: LayerNorms and the residual stream hold B*T/tp tokens per rank (a switch)"},
    {"sim_link", "", "", "GBIT_S[,LATENCY_US]: every buffer collective and pipeline transfer takes at least what a link "
                         "of this bandwidth and latency would (one machine; measures overlap on the CPU build)"},
    {"comm_timeout", "", "300", "seconds a collective or transfer may wait for other ranks before the job aborts naming "
                                "the ranks that did not arrive (10x for checkpoint I/O and the start-up; 0: none)"},
};

// flags that may be given without a value (--overwrite means --overwrite 1)
static bool is_switch(const char* name) {
    return strcmp(name, "overwrite") == 0 || strcmp(name, "plan") == 0 || strcmp(name, "max_fit") == 0 ||
           strcmp(name, "sp") == 0 || strcmp(name, "eval_only") == 0;
}

struct Args {
    std::map<std::string, std::string> value;
    std::map<std::string, bool> given;

    const std::string& str(const char* k) const { return value.at(k); }
    // strict parses (llmc/utils.h): the whole value, in range, or an error naming the flag
    int i(const char* k, int lo = INT32_MIN, int hi = INT32_MAX) const { return (int)parse_int64(value.at(k), k, lo, hi); }
    uint64_t u64(const char* k) const { return parse_uint64(value.at(k), k); }
    float f(const char* k) const {
        double v = parse_double(value.at(k), k);
        LLMC_CHECK(std::fabs(v) <= 3.4e38, "--%s: %s does not fit a 32-bit float", k, value.at(k).c_str());
        return (float)v;
    }
    bool flag(const char* k) const { return i(k, 0, 1) != 0; }
};

static void print_usage() {
    printf("usage: train_gpt [options]   (--name value, or llm.c's -x value)\n");
    for (const Option& o : OPTIONS) {
        char flags[64];
        snprintf(flags, sizeof(flags), "%s%s%s--%s", o.short_name[0] ? "-" : "", o.short_name,
                 o.short_name[0] ? ", " : "", o.name);
        if (o.default_value[0]) printf("  %-26s %s (default: %s)\n", flags, o.help, o.default_value);
        else printf("  %-26s %s\n", flags, o.help);
    }
}

// For an unknown flag: the known flag it was most likely meant to be (dashes for underscores,
// a typo of up to two edits), as ", did you mean --x?", or "".
static std::string flag_suggestion(const std::string& typed) {
    std::string name = typed.substr(typed.find_first_not_of('-') == std::string::npos ? typed.size() : typed.find_first_not_of('-'));
    for (char& c : name) if (c == '-') c = '_';
    auto edits = [](const std::string& a, const std::string& b) {  // Levenshtein distance
        std::vector<size_t> row(b.size() + 1);
        for (size_t j = 0; j <= b.size(); j++) row[j] = j;
        for (size_t i = 1; i <= a.size(); i++) {
            size_t diagonal = row[0];
            row[0] = i;
            for (size_t j = 1; j <= b.size(); j++) {
                const size_t next = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
                diagonal = row[j];
                row[j] = next;
            }
        }
        return row[b.size()];
    };
    const Option* best = nullptr;
    size_t best_edits = 3;  // more than two edits: no suggestion
    for (const Option& o : OPTIONS) {
        const size_t e = edits(name, o.name);
        if (e < best_edits) best = &o, best_edits = e;
    }
    return best ? std::string(", did you mean --") + best->name + "?" : "";
}

// Returns false when -h was asked for.
static bool parse_args(int argc, char** argv, Args& args) {
    for (const Option& o : OPTIONS) args.value[o.name] = o.default_value;
    for (int k = 1; k < argc; k++) {
        std::string a = argv[k];
        if (a == "-h" || a == "--help") return false;
        const Option* found = nullptr;
        for (const Option& o : OPTIONS)
            if (a == std::string("--") + o.name || (o.short_name[0] && a == std::string("-") + o.short_name)) found = &o;
        LLMC_CHECK(found, "unknown flag '%s'%s (run with -h for the list)", a.c_str(), flag_suggestion(a).c_str());
        if (is_switch(found->name) && !(k + 1 < argc && (!strcmp(argv[k + 1], "0") || !strcmp(argv[k + 1], "1")))) {
            args.value[found->name] = "1";
            args.given[found->name] = true;
            continue;
        }
        LLMC_CHECK(k + 1 < argc, "flag %s needs a value", a.c_str());
        args.value[found->name] = argv[++k];
        args.given[found->name] = true;
    }
    return true;
}

// GPT-2's shapes (n_layer, n_embd, n_head; vocab 50257, context 1024, GELU MLP of 4C, learned
// positions): the -e gpt2:SIZE presets, named by GPT-2's parameter counts.
struct Gpt2Preset {
    const char* name;
    int n_layer, n_embd, n_head;
};
static const Gpt2Preset GPT2_PRESETS[] = {
    {"gpt2:124M", 12, 768, 12}, {"gpt2:350M", 24, 1024, 16}, {"gpt2:774M", 36, 1280, 20}, {"gpt2:1558M", 48, 1600, 25}};

static bool is_gpt2_preset(const std::string& preset) {
    for (const Gpt2Preset& g : GPT2_PRESETS) if (preset == g.name) return true;
    return false;
}

// The shapes of open models people continue training (their config.json's values; the weights
// come from scripts/import_hf.py): every field of the config, explicit flags override them.
struct OpenPreset {
    const char* name;
    int n_layer, n_embd, n_head, n_kv_head, ffn_hidden, vocab_size, max_seq_len, bias;
    double rope_theta, norm_eps;
    bool llama3_scaling;  // factor 32, low 1, high 4, original 8192
};
static const OpenPreset OPEN_PRESETS[] = {
    {"llama3.2:1B", 16, 2048, 32, 8, 8192, 128256, 131072, BIAS_NONE, 500000.0, 1e-5, true},
    {"llama3.2:3B", 28, 3072, 24, 8, 8192, 128256, 131072, BIAS_NONE, 500000.0, 1e-5, true},
    {"qwen2.5:0.5B", 24, 896, 14, 2, 4864, 151936, 32768, BIAS_QKV, 1000000.0, 1e-6, false},
    {"qwen2.5:1.5B", 28, 1536, 12, 2, 8960, 151936, 32768, BIAS_QKV, 1000000.0, 1e-6, false}};
static const OpenPreset* open_preset(const std::string& preset) {
    for (const OpenPreset& o : OPEN_PRESETS) if (preset == o.name) return &o;
    return nullptr;
}
// whether the --model preset sets this config field (so an explicit value for it may disagree)
static bool preset_sets(const Args& args, const std::string& field) {
    if (!args.given.count("model")) return false;
    if (field == "n_layer" || field == "n_embd" || field == "n_head") return true;
    if (open_preset(args.str("model"))) return field != "n_expert" && field != "moe_every" && field != "moe_group" &&
                                               field != "expert_hidden";
    return is_gpt2_preset(args.str("model")) &&
           (field == "vocab_size" || field == "max_seq_len" || field == "mlp" || field == "pos");
}

static GPTConfig config_from_args(const Args& args) {
    GPTConfig c;
    const std::string preset = args.str("model");
    const bool gpt2 = is_gpt2_preset(preset);
    const OpenPreset* open = open_preset(preset);
    if (gpt2) {
        for (const Gpt2Preset& g : GPT2_PRESETS)
            if (preset == g.name) { c.n_layer = g.n_layer; c.n_embd = g.n_embd; c.n_head = g.n_head; }
    } else if (open) {
        c.n_layer = open->n_layer; c.n_embd = open->n_embd; c.n_head = open->n_head;
    } else if (!preset.empty()) {
        // strict: "d" then a number in range (sscanf's %d would overflow on d99999999999)
        LLMC_CHECK(preset.size() >= 2 && preset[0] == 'd' && isdigit((unsigned char)preset[1]),
                   "--model: '%s' is not a preset: expected dN (e.g. d4), gpt2:124M, gpt2:350M, gpt2:774M, gpt2:1558M, "
                   "llama3.2:1B, llama3.2:3B, qwen2.5:0.5B or qwen2.5:1.5B",
                   preset.c_str());
        const int n = (int)parse_int64(preset.substr(1), "model dN: N", 1, 1024);
        c.n_layer = n; c.n_embd = 64 * n; c.n_head = n;
    }
    auto take = [&](const char* k, int& field) { if (preset.empty() || args.given.count(k)) field = args.i(k); };
    take("n_layer", c.n_layer);
    take("n_embd", c.n_embd);
    take("n_head", c.n_head);
    // a GPT-2 preset also sets the vocabulary, the context and the block type; an open model's
    // preset every field of its shape
    auto from_gpt2 = [&](const char* k) { return gpt2 && !args.given.count(k); };
    auto from_open = [&](const char* k) { return open && !args.given.count(k); };
    c.vocab_size = from_gpt2("vocab_size") ? (int)GPT2_VOCAB_SIZE : from_open("vocab_size") ? open->vocab_size
                                                                                          : args.i("vocab_size");
    c.n_kv_head = from_open("n_kv_head") ? open->n_kv_head : args.str("n_kv_head").empty() ? c.n_head : args.i("n_kv_head");
    c.ffn_hidden = from_open("ffn_hidden") ? open->ffn_hidden : args.i("ffn_hidden");
    c.max_seq_len = from_gpt2("max_seq_len") ? 1024 : from_open("max_seq_len") ? open->max_seq_len : args.i("max_seq_len");
    const std::string mlp = from_gpt2("mlp") ? "gelu" : args.str("mlp");
    const std::string pos = from_gpt2("pos") ? "learned" : from_open("pos") ? "rope" : args.str("pos");
    LLMC_CHECK(mlp == "swiglu" || mlp == "gelu", "--mlp: expected swiglu or gelu, got '%s'", mlp.c_str());
    LLMC_CHECK(pos == "alibi" || pos == "learned" || pos == "rope", "--pos: expected alibi, learned or rope, got '%s'",
               pos.c_str());
    c.mlp = mlp == "swiglu" ? MLP_SWIGLU : MLP_GELU;
    c.pos = pos == "alibi" ? POS_ALIBI : pos == "learned" ? POS_LEARNED : POS_ROPE;
    const std::string norm = from_open("norm") ? "rmsnorm" : args.str("norm");
    LLMC_CHECK(norm == "layernorm" || norm == "rmsnorm", "--norm: expected layernorm or rmsnorm, got '%s'", norm.c_str());
    c.norm = norm == "layernorm" ? NORM_LAYERNORM : NORM_RMSNORM;
    LLMC_CHECK(!args.given.count("rms_eps") || !args.given.count("norm_eps"), "--rms_eps and --norm_eps: give one");
    c.norm_eps = args.given.count("rms_eps") ? args.f("rms_eps") : from_open("norm_eps") ? open->norm_eps : args.f("norm_eps");
    const std::string bias = args.str("bias");
    LLMC_CHECK(bias == "all" || bias == "qkv" || bias == "none", "--bias: expected all, qkv or none, got '%s'", bias.c_str());
    c.bias = from_open("bias") ? open->bias : bias == "all" ? BIAS_ALL : bias == "qkv" ? BIAS_QKV : BIAS_NONE;
    c.tie_embeddings = args.i("tie_embeddings", 0, 1);
    c.rope.theta = from_open("rope_theta") ? open->rope_theta : parse_double(args.str("rope_theta"), "rope_theta");
    const std::string scaling = from_open("rope_scaling") ? (open->llama3_scaling ? "llama3" : "none") : args.str("rope_scaling");
    LLMC_CHECK(scaling == "none" || scaling == "llama3", "--rope_scaling: expected none or llama3, got '%s'", scaling.c_str());
    c.rope.scaling = scaling == "llama3" ? cpu::ROPE_SCALING_LLAMA3 : cpu::ROPE_SCALING_NONE;
    c.rope.factor = from_open("rope_factor") && open->llama3_scaling ? 32.0 : parse_double(args.str("rope_factor"), "rope_factor");
    c.rope.low_freq_factor = parse_double(args.str("rope_low_freq_factor"), "rope_low_freq_factor");
    c.rope.high_freq_factor = parse_double(args.str("rope_high_freq_factor"), "rope_high_freq_factor");
    c.rope.original_max_pos = args.i("rope_original_max_pos");
    c.n_expert = args.i("n_expert");
    c.moe_every = args.i("moe_every");
    c.expert_hidden = args.i("expert_hidden");
    c.capacity_factor = args.f("capacity_factor");
    const std::string group = args.str("moe_group");
    LLMC_CHECK(group == "batch" || group == "position", "--moe_group: expected batch or position, got '%s'", group.c_str());
    c.moe_group = group == "batch" ? MOE_GROUP_BATCH : MOE_GROUP_POSITION;
    c.finalize();
    return c;
}

// The config fields stored in (and checked against) checkpoints, with the flag that sets each.
static std::vector<std::pair<const char*, int*>> config_fields(GPTConfig& c) {
    return {{"vocab_size", &c.vocab_size}, {"n_layer", &c.n_layer},         {"n_embd", &c.n_embd},
            {"n_head", &c.n_head},         {"n_kv_head", &c.n_kv_head},     {"ffn_hidden", &c.ffn_hidden},
            {"max_seq_len", &c.max_seq_len}, {"mlp", &c.mlp},               {"pos", &c.pos},
            {"n_expert", &c.n_expert},     {"moe_every", &c.moe_every},     {"moe_group", &c.moe_group},
            {"expert_hidden", &c.expert_hidden}, {"norm", &c.norm},          {"bias", &c.bias},
            {"tie_embeddings", &c.tie_embeddings}, {"rope_scaling", &c.rope.scaling},
            {"rope_original_max_pos", &c.rope.original_max_pos}};
}
// ... and its real-valued fields (doubles in the checkpoint)
struct ConfigReal {
    const char* name;
    float* f;
    double* d;
    double get() const { return f ? (double)*f : *d; }
    void set(double v) const { f ? (void)(*f = (float)v) : (void)(*d = v); }
};
static std::vector<ConfigReal> config_real_fields(GPTConfig& c) {
    return {{"capacity_factor", &c.capacity_factor, nullptr}, {"norm_eps", &c.norm_eps, nullptr},
            {"rope_theta", nullptr, &c.rope.theta},           {"rope_factor", nullptr, &c.rope.factor},
            {"rope_low_freq_factor", nullptr, &c.rope.low_freq_factor},
            {"rope_high_freq_factor", nullptr, &c.rope.high_freq_factor}};
}
// the fields added with the open models' shape: a checkpoint written before has the defaults
static bool config_field_added_later(const std::string& name) {
    return name == "norm" || name == "bias" || name == "tie_embeddings" || name == "rope_scaling" ||
           name == "rope_original_max_pos" || name == "norm_eps" || name.compare(0, 5, "rope_") == 0;
}

// an enum field's values by number (empty: a count)
static std::vector<const char*> config_enum_names(const std::string& field) {
    if (field == "mlp") return {"swiglu", "gelu"};
    if (field == "pos") return {"alibi", "learned", "rope"};
    if (field == "moe_group") return {"batch", "position"};
    if (field == "norm") return {"layernorm", "rmsnorm"};
    if (field == "bias") return {"all", "qkv", "none"};
    if (field == "rope_scaling") return {"none", "llama3"};
    return {};
}
static std::string config_value_text(const std::string& field, int v) {
    const std::vector<const char*> names = config_enum_names(field);
    return v >= 0 && v < (int)names.size() ? names[v] : std::to_string(v);
}
// A checkpoint's config: every field range-checked, by its name in the file, before it is
// narrowed to an int (llmc/io/checkpoint.h: checkpoint_int_field), then the config's own checks.
static GPTConfig config_from_checkpoint(const Checkpoint& ck, const std::string& path) {
    GPTConfig c;
    for (auto& [name, field] : config_fields(c)) {
        const std::string n = name;
        if (config_field_added_later(n) && !ck.find("config." + n)) continue;
        const bool may_be_0 = n == "ffn_hidden" || n == "n_expert" || n == "expert_hidden" || n == "tie_embeddings";
        *field = checkpoint_int_field(ck, "config." + n, path, may_be_0 ? 0 : 1, config_enum_names(n));
    }
    for (const ConfigReal& f : config_real_fields(c)) {
        const std::string n = std::string("config.") + f.name;
        if (config_field_added_later(f.name) && !ck.find(n)) continue;
        const double v = ck.get_float(n, path);
        LLMC_CHECK(std::isfinite(v) && v > 0 && v <= 3.4e38, "%s: checkpoint field %s = %g is not a positive float "
                   "(corrupt or written by another program)", path.c_str(), n.c_str(), v);
        f.set(v);
    }
    try {
        c.finalize();
    } catch (const LlmcError& e) {
        LLMC_FAIL("%s: the checkpoint's config (its config.* fields) is refused: %s", path.c_str(), e.what());
    }
    return c;
}

// What the run was started with beyond what a resume must keep (the config, the batch shape, the
// seed): stored in every checkpoint, so a resume says what it changes (run_setting_changes) instead
// of changing it silently. Float settings are doubles; --schedule is its index in SCHEDULES; the
// train data is an identity of its shards; the lm head's chunk (the order of the loss's sum) is
// added by the driver once the model knows it (run.logits_chunk).
static const char* const SCHEDULES[] = {"cosine", "linear", "constant", "wsd"};
static std::vector<CheckpointField> run_settings(const Args& args, const DataLoader& train) {
    std::vector<CheckpointField> out;
    for (const char* flag : {"lr", "warmup", "final_lr_frac", "wsd_decay_frac", "weight_decay", "beta1", "beta2",
                             "grad_clip", "max_steps", "loss_scale_window"})
        out.push_back({std::string("run.") + flag, 'f', 0, (double)args.f(flag)});
    for (int64_t k = 0; k < 4; k++)
        if (args.str("schedule") == SCHEDULES[k]) out.push_back({"run.schedule", 'i', k, 0});
    uint64_t data = ckpt_hash_bytes(nullptr, 0);
    for (const ShardInfo& sh : train.shards) data = ckpt_splitmix(data ^ (uint64_t)file_fingerprint(sh.path));
    out.push_back({"run.train", 'i', (int64_t)(data >> 1), 0});
    return out;
}
// What a resume changes, one "resume: --X was A, now B" line per setting the checkpoint holds with
// another value (fields it lacks, from an older file, are not compared).
static std::vector<std::string> run_setting_changes(const Checkpoint& ck, const std::vector<CheckpointField>& now) {
    std::vector<std::string> out;
    for (const CheckpointField& f : now) {
        const CheckpointField* was = ck.find(f.name);
        if (!was || was->kind != f.kind || (f.kind == 'i' ? was->i == f.i : was->f == f.f)) continue;
        const std::string flag = f.name.substr(4);  // (run.X)
        std::string a = strfmt("%g", was->f), b = strfmt("%g", f.f), why;
        if (flag == "schedule") {
            a = was->i >= 0 && was->i < 4 ? SCHEDULES[was->i] : strfmt("%lld", (long long)was->i);
            b = SCHEDULES[f.i];
            why = " (the learning rate follows the new schedule from here)";
        } else if (flag == "train") {
            a = strfmt("data %016llx", (unsigned long long)was->i);
            b = strfmt("data %016llx (other shards: their sizes or first and last 4 KiB differ)", (unsigned long long)f.i);
        } else if (flag == "logits_chunk") {
            a = strfmt("%lld", (long long)was->i);
            b = strfmt("%lld tokens (the loss is summed in other chunks: the bits differ from an uninterrupted run)",
                       (long long)f.i);
        }
        out.push_back(strfmt("--%s was %s, now %s%s", flag.c_str(), a.c_str(), b.c_str(), why.c_str()));
    }
    return out;
}

// --loss_scale, --loss_scale_window: the scaler a fresh run starts with (llmc/loss_scaler.h)
static LossScaler loss_scaler_from_flags(const Args& args) {
    LossScaler s;
    s.window = args.i("loss_scale_window", 1);
    const std::string& v = args.str("loss_scale");
    if (v == "dynamic") {
        s.dynamic = true;
        s.scale = LossScaler::init_scale;
        return s;
    }
    double x = NAN;
    try { x = parse_double(v, "loss_scale"); } catch (const LlmcError&) {}
    LLMC_CHECK(std::isfinite(x) && x > 0 && x <= 3.4e38, "--loss_scale: expected dynamic or a positive number (1: off), "
               "got '%s'", v.c_str());
    s.scale = (float)x;
    return s;
}

// Optimizer values that would silently ruin a run (a negative lr ascends, beta >= 1 never
// forgets, a NaN clip disables clipping) are refused up front, naming the flag.
static void check_optimizer_flags(float lr, const OptimizerConfig& o) {
    LLMC_CHECK(std::isfinite(lr) && lr > 0, "--lr: must be a finite number > 0, got %g", lr);
    LLMC_CHECK(o.beta1 >= 0 && o.beta1 < 1, "--beta1: must be in [0, 1), got %g", o.beta1);
    LLMC_CHECK(o.beta2 >= 0 && o.beta2 < 1, "--beta2: must be in [0, 1), got %g", o.beta2);
    LLMC_CHECK(std::isfinite(o.eps) && o.eps > 0, "AdamW eps: must be > 0, got %g", o.eps);
    LLMC_CHECK(std::isfinite(o.weight_decay) && o.weight_decay >= 0, "--weight_decay: must be >= 0, got %g",
               o.weight_decay);
    LLMC_CHECK(std::isfinite(o.grad_clip) && o.grad_clip >= 0, "--grad_clip: must be a finite number >= 0 (0: off), got %g",
               o.grad_clip);
}
