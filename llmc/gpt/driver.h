// A chapter of train_gpt.cu (included once, after the model, the state and the reports): the
// steps train_main is made of. The run's settings from the flags (and a checkpoint or an llm.c
// file), the data, the model's start (fresh, resumed or imported), the start-up report, the
// step's report and log line, checkpoints, and the end-of-run checks. Each step is a named
// function so that train_main reads as the run's outline.

// Everything the flags decide, once they are checked (the config may come from a checkpoint or
// an llm.c model file instead).
struct Run {
    Args args;
    GPTConfig config;
    int B = 0, T = 0, zero_stage = 0, n_stages = 1, tp = 1, ep = 1;
    bool sp = false, planning = false;  // planning: --plan / --max_fit, nothing is trained
    int world = 1;                      // the data-parallel ranks: they split the batch
    int64_t total_batch_flag = 0, total_batch = 0;
    int grad_accum = 1, global_micro = 1;  // micro-batches per step: per rank, over all ranks
    int max_steps = 0, max_bad_steps = 5;
    uint64_t seed = 0;
    LRSchedule sched;
    OptimizerConfig opt;
    int val_every = 0, val_batches = 0, sample_every = 0, sample_len = 0, top_k = 0, ckpt_every = 0;
    bool eval_only = false;  // evaluate a checkpoint or an llm.c model, train nothing
    float temperature = 1.0f;
    std::string out_dir, resume, init_from, export_llmc, export_dtype, pp_trace;
    std::string threads_note;  // the CPU build's OpenMP threads per rank, when it chose them
    PipeKind pp_kind = PIPE_1F1B;
    int pp_virtual = 1, recompute = 0, offload = OFFLOAD_NONE;
    int logits_chunk = 0;  // --logits_chunk (0: logits_chunk_tokens' default)
    int grad_blocks = 1;   // the order of the step's gradient sum (llmc/gpt/layout.h)
    LossScaler loss_scale;  // --loss_scale, --loss_scale_window: the scaler a fresh run starts with
};

// The batch (-b, -t, --total_batch_tokens) and the seed: from the flags, and again on a resume that
// adopted the checkpoint's values for the flags not given.
static void settle_batch(Run& r) {
    const Args& args = r.args;
    const int B = r.B = args.i("batch_size", 1), T = r.T = args.i("seq_len", 1);
    LLMC_CHECK(B > 0, "--batch_size: must be > 0, got %d", B);
    LLMC_CHECK(T > 0, "--seq_len: must be > 0, got %d", T);
    // token counts in 64 bits: B*T*ranks must fit the ops' int indexing, the step may be larger
    const int64_t tokens_per_micro = checked_product({B, T, r.world}, INT32_MAX, "the tokens per micro-batch B*T*ranks");
    r.total_batch_flag = parse_int64(args.str("total_batch_tokens"), "total_batch_tokens", 0, INT64_MAX);
    // (an evaluation's pipeline still needs a micro-batch per stage to schedule)
    r.total_batch = r.total_batch_flag > 0 ? r.total_batch_flag : tokens_per_micro * (r.eval_only ? r.n_stages : 1);
    LLMC_CHECK(r.total_batch % tokens_per_micro == 0,
               "--total_batch_tokens %lld is not a multiple of B*T*ranks = %d*%d*%d = %lld", (long long)r.total_batch, B, T,
               r.world, (long long)tokens_per_micro);
    r.grad_accum = (int)checked_product({r.total_batch / tokens_per_micro}, INT32_MAX,
                                        "the gradient accumulation steps --total_batch_tokens / (B*T*ranks)");
    r.global_micro = r.grad_accum * r.world;
    r.seed = args.u64("seed");
}

// The flags, checked, and the rank grid they ask for. Returns false when -h was asked for.
static bool run_from_flags(int argc, char** argv, Run& r) {
    Comm& cm = comm_world();
    const bool rank0 = cm.world_rank == 0;
    Args& args = r.args;
    if (!parse_args(argc, argv, args)) { if (rank0) print_usage(); return false; }
    comm_set_timeout(cm, args.f("comm_timeout"));
    comm_set_sim_link(cm, parse_sim_link(args.str("sim_link")));
    r.config = config_from_args(args);
    r.zero_stage = args.i("zero", 0, 3);
    const int n_stages = r.n_stages = args.i("pp", 1, 1024), tp = r.tp = args.i("tp", 1, 1024);
    r.ep = args.i("ep", 1, 1024);
    r.sp = args.flag("sp");
    LLMC_CHECK(!r.sp || tp > 1, "--sp: sequence parallelism splits the tokens over the tensor-parallel ranks; give --tp > 1");
    r.planning = args.flag("plan") || args.flag("max_fit");  // a plan for --plan_ranks processes
    for (const char* planning_only : {"device", "plan_ranks"})
        LLMC_CHECK(r.planning || !args.given.count(planning_only), "--%s %s: means something only with --plan or --max_fit "
                   "(the memory plan of that GPU or process count); a training run uses the GPUs it is started on: add "
                   "--plan, or drop --%s", planning_only, args.str(planning_only).c_str(), planning_only);
    LLMC_CHECK(r.planning || cm.world_size % (n_stages * tp) == 0,
               "--pp %d --tp %d: the %d processes are not a multiple of pp * tp = %d (the grid is pp x dp x tp: start a "
               "multiple of %d processes)", n_stages, tp, cm.world_size, n_stages * tp, n_stages * tp);
    if (r.planning) comm_make_grid(cm, cm.world_size, 1);
    else comm_make_grid(cm, cm.world_size / (n_stages * tp), n_stages, tp, r.ep);
    const int local_ranks = launcher_local_size();
    r.threads_note = backend_share_cores(local_ranks);
    if (rank0 && !r.planning && tp > 1 && local_ranks > 0 && local_ranks % tp != 0)
        fprintf(stderr, "warning: --tp %d with %d processes per node: some tensor-parallel groups span nodes (their "
                "collectives run on every layer's critical path); use a --tp that divides the processes per node\n",
                tp, local_ranks);
    r.world = cm.dp.size;
    r.eval_only = args.flag("eval_only");
    settle_batch(r);
    r.max_steps = args.i("max_steps", 0);
    r.max_bad_steps = args.i("max_bad_steps", 1);
    r.sched.kind = args.str("schedule");
    r.sched.lr_max = args.f("lr");
    r.sched.final_frac = args.f("final_lr_frac");
    r.sched.wsd_decay_frac = args.f("wsd_decay_frac");
    r.sched.warmup = args.i("warmup");
    r.sched.max_steps = r.max_steps;
    r.sched.validate();
    r.opt.beta1 = args.f("beta1");
    r.opt.beta2 = args.f("beta2");
    r.opt.weight_decay = args.f("weight_decay");
    r.opt.grad_clip = args.f("grad_clip");
    check_optimizer_flags(r.sched.lr_max, r.opt);
    r.loss_scale = loss_scaler_from_flags(args);
    r.val_every = args.i("val_every", 0);
    r.val_batches = args.i("val_batches", 0);
    r.sample_every = args.i("sample_every", 0);
    r.sample_len = args.i("sample_len", 0);
    r.top_k = args.i("top_k", 0);
    r.temperature = args.f("temperature");
    LLMC_CHECK(r.temperature >= 0, "--temperature: must be >= 0, got %g", r.temperature);
    r.ckpt_every = args.i("ckpt_every", -1);
    r.out_dir = args.str("out_dir");
    r.resume = args.str("resume");
    r.init_from = args.str("init_from");
    r.pp_trace = args.str("pp_trace");
    LLMC_CHECK(!r.eval_only || !r.resume.empty() || !r.init_from.empty(), "--eval_only: give the model to evaluate "
               "with --resume CHECKPOINT (or latest) or --init_from MODEL_FILE");
    LLMC_CHECK(!r.eval_only || !args.str("eval_mc").empty() || (!args.str("val").empty() && r.val_batches > 0),
               "--eval_only: nothing to evaluate: give --val shards (with --val_batches > 0) or --eval_mc FILE");
    return true;
}

// out_dir ownership (llmc/io/run_dir.h): one trainer at a time, and a fresh run does not mix with an
// earlier run's checkpoints. Rank 0 alone creates the directory and holds the lock.
static void claim_run_dir(const Run& r, RunDirLock& lock) {
    if (comm_world().world_rank == 0) {
        make_dirs(r.out_dir);
        lock.acquire(r.out_dir);
        if (claim_out_dir(r.out_dir, !r.resume.empty(), r.args.flag("overwrite")))
            printf("--overwrite: removed the earlier run's checkpoints and log from %s\n", r.out_dir.c_str());
    }
    barrier(comm_world().dp);
}

// --resume: the checkpoint's config wins over defaults, and must agree with explicit flags; its
// batch shape and seed must be this run's. The file is verified now (every rank a share of it);
// its arrays are read after the allocation (start_model). --resume latest in an out_dir that holds
// no checkpoint yet is a fresh start (r.resume becomes "").
static void settings_from_checkpoint(Run& r, Checkpoint& ck) {
    const Args& args = r.args;
    GPTConfig& config = r.config;
    std::string& resume = r.resume;
    const bool resume_latest = resume == "latest";
    if (resume_latest) resume = latest_checkpoint(r.out_dir, ck);  // "": none yet, a fresh start
    if (resume.empty()) return;
    if (!resume_latest) ck = verify_checkpoint(comm_world().world, resume);
    LLMC_CHECK(ck.n_arrays() == 3, "%s: a model file (weights only: no optimizer state, no data position): start a run "
               "from it with --init_from", resume.c_str());
    GPTConfig stored = config_from_checkpoint(ck, resume);
    auto mine = config_fields(config), theirs = config_fields(stored);
    for (size_t k = 0; k < mine.size(); k++) {
        const std::string n = mine[k].first;
        LLMC_CHECK(!(args.given.count(n) || preset_sets(args, n)) || *mine[k].second == *theirs[k].second,
                   "%s: checkpoint has %s = %s but the flags ask for %s; drop the flag or start a new run",
                   resume.c_str(), n.c_str(), config_value_text(n, *theirs[k].second).c_str(),
                   config_value_text(n, *mine[k].second).c_str());
    }
    auto mine_real = config_real_fields(config), theirs_real = config_real_fields(stored);
    for (size_t k = 0; k < mine_real.size(); k++) {
        const char* n = mine_real[k].name;
        LLMC_CHECK(!(args.given.count(n) || preset_sets(args, n)) || mine_real[k].get() == theirs_real[k].get(),
                   "%s: checkpoint has %s = %g but the flags ask for %g; drop the flag or start a new run", resume.c_str(),
                   n, theirs_real[k].get(), mine_real[k].get());
    }
    config = stored;
    // The global batch and the seed decide the math (how the batch is split over ranks does not): the
    // checkpoint's, as the model's; a flag given must agree with it.
    const int64_t stored_total = ck.get_int("train.total_batch_tokens", resume);
    LLMC_CHECK(stored_total >= 1, "%s: checkpoint field train.total_batch_tokens = %lld is not >= 1 (corrupt or written by "
               "another program)", resume.c_str(), (long long)stored_total);
    const std::pair<const char*, std::string> batch[] = {
        {"batch_size", std::to_string(checkpoint_int_field(ck, "train.batch_size", resume, 1))},
        {"seq_len", std::to_string(checkpoint_int_field(ck, "train.seq_len", resume, 1))},
        {"total_batch_tokens", std::to_string(stored_total)},
        {"seed", std::to_string((uint64_t)ck.get_int("train.seed", resume))}};
    const std::string flag_text[] = {std::to_string(r.B), std::to_string(r.T), std::to_string(r.total_batch),
                                     std::to_string(r.seed)};
    for (size_t k = 0; k < 4; k++) {
        const auto& [name, stored_text] = batch[k];
        // an evaluation takes the shape it is given, and has no step to batch
        if (r.eval_only && (args.given.count(name) || name == std::string("total_batch_tokens"))) continue;
        if (!args.given.count(name)) { r.args.value[name] = stored_text; continue; }
        LLMC_CHECK(flag_text[k] == stored_text, "%s: checkpoint was trained with --%s %s, this run has %s; drop the flag "
                   "(a resume takes it from the checkpoint) or start a new run", resume.c_str(), name, stored_text.c_str(),
                   flag_text[k].c_str());
    }
    settle_batch(r);
    const int64_t step = ck.get_int("step", resume);
    LLMC_CHECK(step >= 0 && (r.eval_only || step <= r.max_steps), "%s: checkpoint step %lld is outside [0, --max_steps "
               "%d]", resume.c_str(), (long long)step, r.max_steps);
}

// whether a file is one of ours (a checkpoint or a model file: "LLMCCKPT"), not an llm.c model
static bool is_our_model_file(const std::string& path) {
    FILE* f = fopen(path.c_str(), "rb");
    if (!f) return false;  // (the llm.c reader names the file and why)
    char magic[8] = {};
    const size_t got = fread(magic, 1, 8, f);
    fclose(f);
    return got == 8 && memcmp(magic, "LLMCCKPT", 8) == 0;
}
// --init_from: the file sets the config (explicit flags must agree) and, later, the weights
// (start_model): an llm.c model file (init_file), or one of ours (ck: a model file of
// scripts/import_hf.py, or a checkpoint, of which only the weights are taken).
static void settings_from_init_file(Run& r, Checkpoint& ck, LlmcModelFile& init_file) {
    GPTConfig from_file;
    const char* what = "the llm.c model";
    if (is_our_model_file(r.init_from)) {
        ck = verify_checkpoint(comm_world().world, r.init_from);
        from_file = config_from_checkpoint(ck, r.init_from);
        what = ck.n_arrays() == 1 ? "the model file" : "the checkpoint";
    } else {
        init_file = read_llmc_model(r.init_from);
        from_file = config_from_llmc(init_file.shape, r.init_from);
    }
    auto mine = config_fields(r.config), theirs = config_fields(from_file);
    for (size_t k = 0; k < mine.size(); k++) {
        const std::string n = mine[k].first;
        LLMC_CHECK(!(r.args.given.count(n) || preset_sets(r.args, n)) || *mine[k].second == *theirs[k].second,
                   "%s: %s has %s = %s but the flags ask for %s; drop the flag (the file sets it)", r.init_from.c_str(),
                   what, n.c_str(), config_value_text(n, *theirs[k].second).c_str(),
                   config_value_text(n, *mine[k].second).c_str());
    }
    auto mine_real = config_real_fields(r.config), theirs_real = config_real_fields(from_file);
    for (size_t k = 0; k < mine_real.size(); k++) {
        const char* n = mine_real[k].name;
        LLMC_CHECK(!(r.args.given.count(n) || preset_sets(r.args, n)) || mine_real[k].get() == theirs_real[k].get(),
                   "%s: %s has %s = %g but the flags ask for %g; drop the flag (the file sets it)", r.init_from.c_str(),
                   what, n, theirs_real[k].get(), mine_real[k].get());
    }
    r.config = from_file;
}

// Where the config comes from (flags, a checkpoint, an llm.c file), then the flags that need the
// final config: the export's shape, the batch, the pipeline and memory flags.
// The order of the step's gradient sum (llmc/gpt/layout.h): the layout's own gradient blocks. One
// process (no pipeline, one data-parallel rank) may be given another count (--grad_blocks), and a
// resume on one process keeps the count of the run that wrote the checkpoint, so that it continues
// that run bit for bit (a multi-GPU run resumed on one GPU); a resume whose count differs says so.
static void settle_grad_blocks(Run& r, const Checkpoint& ck) {
    const int own = layout_grad_blocks(r.zero_stage, r.world, r.n_stages, r.global_micro);
    const bool one_process = r.world == 1 && r.n_stages == 1;
    const bool given = !r.args.str("grad_blocks").empty();
    const CheckpointField* was = r.resume.empty() ? nullptr : ck.find("train.grad_blocks");
    if (was) checkpoint_int_field(ck, "train.grad_blocks", r.resume, 1);  // (range-checked before use)
    // what one process can sum: a count dividing the step's micro-batches, blocks only at -z 0/1
    // without --offload (its early download needs a gradient final at the last micro-batch)
    auto one_process_can = [&](int64_t G) {
        return G >= 1 && r.global_micro % G == 0 && (G == 1 || (r.zero_stage <= 1 && r.offload == OFFLOAD_NONE));
    };
    int G = given ? r.args.i("grad_blocks", 1) : own;
    if (!given && was && one_process && one_process_can(was->i)) G = (int)was->i;
    if (!one_process) {
        LLMC_CHECK(G == own, "--grad_blocks %d: this layout (dp %d, --pp %d, -z %d) sums the step's gradient in %d block%s; "
                   "only one process (one data-parallel rank, no --pp) can be given another count", G, r.world, r.n_stages,
                   r.zero_stage, own, own == 1 ? "" : "s");
    } else {
        LLMC_CHECK(r.global_micro % G == 0, "--grad_blocks %d must divide the step's %d micro-batches", G, r.global_micro);
        LLMC_CHECK(G == 1 || r.zero_stage <= 1, "--grad_blocks %d: one process sums gradient blocks at -z 0 or 1, got -z %d",
                   G, r.zero_stage);
        LLMC_CHECK(G == 1 || r.offload == OFFLOAD_NONE, "--grad_blocks %d: not with --offload optimizer (its early "
                   "download needs a gradient that is final at the last micro-batch)", G);
    }
    r.grad_blocks = G;
    if (was && was->i != G && comm_world().world_rank == 0)
        printf("resume: the step's gradient sum was %lld blocks, now %d (--grad_blocks): the same math to fp32 rounding, "
               "not the same bits\n", (long long)was->i, G);
}

static void settle_config(Run& r, Checkpoint& ck, LlmcModelFile& init_file) {
    LLMC_CHECK(r.init_from.empty() || r.resume.empty(),
               "--init_from %s and --resume %s: give one (a resumed run has its weights)", r.init_from.c_str(),
               r.resume.c_str());
    if (!r.resume.empty()) settings_from_checkpoint(r, ck);
    if (!r.init_from.empty()) settings_from_init_file(r, ck, init_file);
    r.export_llmc = r.args.str("export_llmc");
    r.export_dtype = r.args.str("export_llmc_dtype");
    LLMC_CHECK(r.export_dtype == "fp32" || r.export_dtype == "bf16", "--export_llmc_dtype: expected fp32 or bf16, got '%s'",
               r.export_dtype.c_str());
    if (!r.export_llmc.empty()) llmc_shape_of(r.config);  // refuse a shape llm.c cannot hold now, not after training
    r.config.check_batch(r.B, r.T, r.world);  // after the resume: the checkpoint may have set the config
    // the pipeline: the schedule's micro-batches are the accumulation steps
    r.pp_kind = parse_pipe_kind(r.args.str("pp_schedule"));
    r.pp_virtual = r.args.i("pp_virtual", 1, 1024);
    r.recompute = r.args.i("recompute", 0, 2);
    r.offload = parse_offload(r.args.str("offload"));
    r.logits_chunk = r.args.i("logits_chunk", 0);
    settle_grad_blocks(r, ck);
}

// The total memory of the device this build trains on, which sizes the lm head's default token
// chunk (llmc/gpt/layout.h logits_chunk_tokens): the card's total, never its free memory, so that
// every rank of a layout (the same card each) and every layout cut the same chunks. The CPU build:
// 0, no device (the chunk keeps its constant budget).
static double run_device_total_bytes() {
#ifdef LLMC_CPU
    return 0;
#else
    size_t free_b = 0, total_b = 0;
    cudaCheck(cudaMemGetInfo(&free_b, &total_b));
    return (double)total_b;
#endif
}

// This rank's layout in the run (its pipeline stage: pipe).
static Layout layout_of(const Run& r, const PipelinePlan& pipe) {
    Layout l;
    l.device_total_bytes = run_device_total_bytes();
    l.zero_stage = r.zero_stage;
    l.pipe = pipe;
    l.recompute = r.recompute;
    l.sp = r.sp;
    l.offload = r.offload;
    l.logits_chunk = r.logits_chunk;
    l.grad_blocks = r.world == 1 && r.n_stages == 1 ? r.grad_blocks : 1;  // (a layout's own blocks need no buffer)
    return l;
}

// The memory plan's inputs (the start-up tables, --plan) for this run's layout.
static PlanInputs plan_inputs_of(const Run& r, const PipelinePlan& pipe) {
    PlanInputs in;
    in.config = r.config;
    in.B = r.B;
    in.T = r.T;
    in.layout = layout_of(r, pipe);
    in.layout.plan_dp = r.world;
    in.layout.plan_tp = r.tp;
    in.layout.plan_ep = r.ep;
    return in;
}

// --plan / --max_fit: the plan for --plan_ranks processes (default: this run's), nothing allocated.
static void print_plan_only(const Run& r) {
    const Args& args = r.args;
    const std::string device = args.str("device");
    const GpuCard* card = device.empty() ? nullptr : &gpu_card(device);  // (refuses an unknown name)
    // the plan's op scratch and split-K choices for the named card's SMs (this machine's otherwise)
    const PlanCardScope sms(card ? card->sms : planned_card_sms());
    const int ranks = args.str("plan_ranks").empty() ? comm_world().world_size : args.i("plan_ranks", 1, 1 << 20);
    LLMC_CHECK(ranks % (r.n_stages * r.tp) == 0, "--plan_ranks %d is not a multiple of --pp %d x --tp %d", ranks, r.n_stages,
               r.tp);
    PlanInputs in = plan_inputs_of(r, PipelinePlan());
    in.layout.plan_dp = ranks / (r.n_stages * r.tp);
    const int64_t per_micro = (int64_t)r.B * r.T * in.layout.plan_dp;
    LLMC_CHECK(r.total_batch_flag == 0 || r.total_batch_flag % per_micro == 0,
               "--total_batch_tokens %lld is not a multiple of B*T*dp = %lld for --plan_ranks %d",
               (long long)r.total_batch_flag, (long long)per_micro, ranks);
    const int plan_m = r.total_batch_flag > 0 ? (int)(r.total_batch_flag / per_micro) : 1;
    in.layout.pipe = pipeline_plan(r.config, r.B, r.T, r.n_stages, r.pp_virtual, plan_m, r.pp_kind, args.str("pp_layers"), 0);
    if (card) {
        // the CUDA build's plan (2-byte params and activations) against the card's free memory after
        // the CUDA context, less the headroom (llmc/ops/op_scratch.h); its total sizes the lm head's
        // chunk, as run_device_total_bytes does on the GPU (backend.h GPU_CARDS: nominal figures)
        in.layout.elem_bytes = 2;
        in.layout.device_total_bytes = card->total_bytes();
        in.device_bytes = card->free_bytes();
        // without bf16 the card runs the fp16 build (make train_gpt PRECISION=fp16: the same bytes)
        in.device_name = strfmt("%s (%s)", card->description,
                                card->bf16 ? "CUDA build, bf16"
                                           : "no bf16: the fp16 build's plan (make train_gpt PRECISION=fp16, loss scaling)");
    }
    if (comm_world().world_rank != 0) return;
    if (card)
        printf("device: %s: sm_%d%d, %d SMs, %d KiB shared memory per block, %s; %.0f MiB total, %.1f GiB free after "
               "the CUDA context (%s); peak %.1f TFLOP/s dense 16-bit (datasheet)\n", card->name, card->cc_major,
               card->cc_minor, card->sms, card->smem_optin_kib, card->bf16 ? "bf16" : "no bf16", card->total_mib,
               card->free_gib, card->free_measured ? "measured" : "estimated: the total less 0.55 GiB",
               card->peak_tflops);
    print_plan(in, args.flag("max_fit"));
}

// The run's data: the train stream (shuffled, split over the dp ranks), the val stream (in order)
// and the tokenizer that decodes samples.
struct RunData {
    DataLoader train, val;
    bool have_val = false;
    McFile mc;  // --eval_mc
    Tokenizer tokenizer;
    std::vector<CheckpointField> settings;  // what the run was started with, stored in checkpoints (run_settings)
};
static void open_data(const Run& r, RunData& d) {
    const int dp_rank = comm_world().dp.rank;
    d.train = DataLoader(r.args.str("train"), r.B, r.T, dp_rank, r.world, true, r.seed, r.config.vocab_size, "--train");
    d.settings = run_settings(r.args, d.train);
    const ShardInfo& first_shard = d.train.shards[0];
    d.tokenizer = find_tokenizer(r.args.str("tokenizer"), first_shard.path, first_shard.vocab_size, d.train.eot,
                                 first_shard.llmc_format);
    d.have_val = !r.args.str("val").empty() && r.val_batches > 0;
    if (d.have_val) {
        d.val = DataLoader(r.args.str("val"), r.B, r.T, dp_rank, r.world, false, r.seed, r.config.vocab_size, "--val");
        int64_t avail = d.val.batches_in_shard(0);
        LLMC_CHECK(r.val_batches <= avail, "--val_batches %d: the first val shard holds only %lld batches of %dx%d",
                   r.val_batches, (long long)avail, r.B, r.T);
    }
    if (!r.args.str("eval_mc").empty()) {
        d.mc = read_mc_file(r.args.str("eval_mc"), r.config.vocab_size, r.T);
        LLMC_CHECK((int)d.mc.eot == d.train.eot, "--eval_mc %s: its eot token is %u, the train shards' is %d: it was "
                   "made with another tokenizer (prepare_mc.py --tokenizer: the run's)", d.mc.path.c_str(), d.mc.eot,
                   d.train.eot);
    }
}

// The loss scaler's state in a checkpoint (its scale and its count of finite steps: a resume
// continues the run's scale bitwise), and what a resume makes of it: a dynamic run continues the
// checkpoint's dynamic state; a resume that changes --loss_scale starts the flags' scaler and
// returns a note saying so.
static void save_loss_scaler(Checkpoint& out, const LossScaler& s) {
    out.set_int("train.loss_scale_dynamic", s.dynamic ? 1 : 0);
    out.set_float("train.loss_scale", s.scale);
    out.set_int("train.loss_scale_clean_steps", s.clean_steps);
}
static std::string resume_loss_scaler(LossScaler& s, const Checkpoint& ck, const std::string& path) {
    if (!ck.find("train.loss_scale_dynamic")) return s.on() ? "--loss_scale was none (an older checkpoint), now on" : "";
    const int64_t dynamic = ck.get_int("train.loss_scale_dynamic", path);
    const double scale = ck.get_float("train.loss_scale", path);
    const int64_t clean = ck.get_int("train.loss_scale_clean_steps", path);
    LLMC_CHECK((dynamic == 0 || dynamic == 1) && std::isfinite(scale) && scale > 0 && scale <= 3.4e38 &&
                   (!dynamic || scale >= LossScaler::min_scale) && clean >= 0 && clean < INT32_MAX,
               "%s: checkpoint fields train.loss_scale_dynamic %lld, train.loss_scale %g, train.loss_scale_clean_steps "
               "%lld are not a loss scaler's state (corrupt or written by another program)", path.c_str(),
               (long long)dynamic, scale, (long long)clean);
    if (dynamic && s.dynamic) {
        s.scale = (float)scale;
        s.clean_steps = (int)clean;
        return "";
    }
    if (!dynamic && !s.dynamic && (float)scale == s.scale) return "";
    const std::string now = s.dynamic ? strfmt("dynamic from %g", s.scale) : strfmt("%g", s.scale);
    const std::string was = dynamic ? strfmt("dynamic at %g", scale) : strfmt("%g", scale);
    return strfmt("--loss_scale was %s, now %s", was.c_str(), now.c_str());
}

// The model's first state: the checkpoint's (with the data position and the sampling RNG), an llm.c
// file's weights, or the init. Returns the step the run starts at.
static int start_model(GPT& model, Run& r, const Checkpoint& ck, LlmcModelFile& init_file, RunData& d, Rng& sample_rng,
                       LossScaler& scaler) {
    const bool rank0 = comm_world().world_rank == 0;
    d.settings.push_back({"run.logits_chunk", 'i', model.logits_chunk, 0});  // (the model chose it)
    if (!r.resume.empty()) {
        LLMC_CHECK(ck.n_params == model.n_params, "%s: checkpoint holds %llu parameters, the config needs %zu",
                   r.resume.c_str(), (unsigned long long)ck.n_params, model.n_params);
        const CheckpointFile file(r.resume, ck);  // each rank reads the table ranges it holds
        gpt_set_state(model, [&](size_t begin, size_t n, float* p, float* m, float* v) {
            file.read(0, begin, n, p);
            if (m) file.read(1, begin, n, m);
            if (v) file.read(2, begin, n, v);
        });
        const int start_step = (int)ck.get_int("step", r.resume);
        // (range-checked here: an epoch near 2^63 would overflow the loader's arithmetic)
        d.train.reset({checkpoint_int_field(ck, "loader.epoch", r.resume, 0), checkpoint_int_field(ck, "loader.shard", r.resume, 0),
                       checkpoint_int_field(ck, "loader.batch", r.resume, 0)});
        sample_rng.state = (uint64_t)ck.get_int("rng.sample", r.resume);
        const std::string scale_note = resume_loss_scaler(scaler, ck, r.resume);
        if (rank0) printf("resumed from %s at step %d\n", r.resume.c_str(), start_step);
        if (rank0 && !scale_note.empty()) printf("resume: %s\n", scale_note.c_str());
        for (const std::string& change : run_setting_changes(ck, d.settings))
            if (rank0) printf("resume: %s\n", change.c_str());
        return start_step;
    }
    if (!r.init_from.empty() && init_file.params.empty()) {  // one of ours: its weights, fresh moments
        LLMC_CHECK(ck.n_params == model.n_params, "%s: the file holds %llu parameters, its config needs %zu",
                   r.init_from.c_str(), (unsigned long long)ck.n_params, model.n_params);
        const CheckpointFile file(r.init_from, ck);
        gpt_set_state(model, [&](size_t begin, size_t n, float* p, float* m, float* v) {
            file.read(0, begin, n, p);
            if (m) std::fill(m, m + n, 0.0f);
            if (v) std::fill(v, v + n, 0.0f);
        });
        if (rank0) printf("initialized from %s (%s, fresh optimizer state)\n", r.init_from.c_str(),
                          ck.n_arrays() == 1 ? "model file" : "the weights of a checkpoint");
    } else if (!r.init_from.empty()) {
        gpt_load_llmc(model, init_file, r.init_from);
        if (rank0) printf("initialized from %s (llm.c GPT-2 model, %s)\n", r.init_from.c_str(),
                          init_file.version == LLMC_MODEL_VERSION_BF16 ? "bf16" : "fp32");
        init_file = LlmcModelFile();  // the weights are in the model now
    } else {
        gpt_init_params(model, r.seed);
    }
    return 0;
}

// Rank 0's start-up report: backend, layout, model, batch, pipeline, memory plan, data.
static void print_startup(const Run& r, const GPT& model, const RunData& d, const PlanInputs& plan, const LossScaler& scaler) {
    const Comm& cm = comm_world();
    const GPTConfig& config = r.config;
    printf("backend: %s", backend_name());
#ifdef _OPENMP
    printf(", %d OpenMP thread%s%s", omp_get_max_threads(), omp_get_max_threads() == 1 ? "" : "s",
           r.threads_note.empty() ? "" : (" per rank (" + r.threads_note + ")").c_str());
#endif
    printf("\nlayout: %d rank%s (pp %d x dp %d x tp %d%s, ep %d), ZeRO stage %d, recompute -r %d, offload %s, "
           "collectives: %s\n", cm.world_size, cm.world_size > 1 ? "s" : "", r.n_stages, r.world, r.tp, r.sp ? " + sp" : "",
           r.ep, r.zero_stage, r.recompute, offload_name(r.offload), comm_backend_name());
    printf("gradient sum: %d block%s of %d micro-batch%s (one process: --grad_blocks %d sums the same bits)\n",
           r.grad_blocks, r.grad_blocks == 1 ? "" : "s", r.global_micro / r.grad_blocks,
           r.global_micro / r.grad_blocks == 1 ? "" : "es", r.grad_blocks);
    printf("model: n_layer %d, n_embd %d, n_head %d, n_kv_head %d, ffn_hidden %d (%s), pos %s, vocab %d (padded %d)\n",
           config.n_layer, config.n_embd, config.n_head, config.n_kv_head, config.ffn_hidden,
           config.mlp == MLP_SWIGLU ? "swiglu" : "gelu", config.pos == POS_ALIBI ? "alibi" : "learned",
           config.vocab_size, config.padded_vocab_size);
    const std::string attention = attention_summary(config.head_size());
    if (!attention.empty()) printf("%s\n", attention.c_str());
    if (config.n_expert > 0) {
        printf("mixture of experts: %d experts of hidden %d in layers", config.n_expert, config.expert_hidden);
        for (int l = 0; l < config.n_layer; l++) if (config.is_moe(l)) printf(" %d", l);
        printf(", capacity factor %g (%d tokens per expert per micro-batch), routing group %s\n",
               config.capacity_factor, config.moe_capacity(r.B, r.T),
               config.moe_group == MOE_GROUP_BATCH ? "batch" : "position");
        printf("parameters: %zu, active per token %.0f\n", model.param_count, active_param_count(model, r.B, r.T));
    } else {
        printf("parameters: %zu\n", model.param_count);
    }
    printf("batch: B %d x T %d x %d ranks x %d accumulation steps = %lld tokens per step\n", r.B, r.T, r.world,
           r.grad_accum, (long long)r.total_batch);
    if (scaler.dynamic)
        printf("loss scale: dynamic, now %g (halves on an overflow, doubles after %d finite steps in a row)\n",
               scaler.scale, scaler.window);
    else if (scaler.on())
        printf("loss scale: %g, fixed\n", scaler.scale);
    if (r.n_stages > 1) print_pipeline(plan);
    print_memory_plan(plan);
    print_data_memory(d.train, d.have_val ? &d.val : nullptr);
    const ShardInfo& first_shard = d.train.shards[0];
    printf("train: %zu shard(s)%s, val: %s%s\n", d.train.shards.size(), first_shard.llmc_format ? " (llm.c GPT-2 format)" : "",
           d.have_val ? "yes" : "no", d.mc.items.empty() ? "" : strfmt(", multiple choice: %zu items of up to %d endings "
           "(%s)", d.mc.items.size(), d.mc.max_endings, d.mc.path.c_str()).c_str());
    printf("tokenizer: %s\n", d.tokenizer.source.c_str());
}

// A checkpoint of the state after `step` steps (collective: every rank writes the table ranges of
// its own slices, streamed, rank 0 the header last).
static void save_checkpoint(const Run& r, const GPT& model, const RunData& d, const Rng& sample_rng,
                            const LossScaler& scaler, int step) {
    Checkpoint out;
    GPTConfig config = r.config;
    for (auto& [name, field] : config_fields(config)) out.set_int(std::string("config.") + name, *field);
    for (const ConfigReal& f : config_real_fields(config)) out.set_float(std::string("config.") + f.name, f.get());
    out.set_int("train.batch_size", r.B);
    out.set_int("train.seq_len", r.T);
    out.set_int("train.total_batch_tokens", r.total_batch);
    out.set_int("train.seed", (int64_t)r.seed);
    out.set_int("train.grad_blocks", r.grad_blocks);  // the order of the gradient sum (a resume keeps it where it can)
    out.set_int("step", step);
    out.set_int("loader.epoch", d.train.state.epoch);
    out.set_int("loader.shard", d.train.state.shard);
    out.set_int("loader.batch", d.train.state.batch);
    out.set_int("rng.sample", (int64_t)sample_rng.state);
    save_loss_scaler(out, scaler);
    for (const CheckpointField& f : d.settings) out.fields.push_back(f);
    const std::string path = checkpoint_path(r.out_dir, step);
    CheckpointWriter writer(comm_world().world, path, out, model.n_params);
    gpt_write_state(model, writer, step);  // refuses a non-finite state (each rank checks its slices)
    writer.finish();
    if (comm_world().world_rank == 0) printf("saved %s\n", path.c_str());
}

// The step's micro-batches, read before the pipeline runs them (stages need them at different
// times), and the step the run started at (the fault injection of the tests counts from it).
struct StepBatches {
    std::vector<std::vector<int>> in, tgt, ds;
    std::vector<MicroBatch> batches;
    int start_step = 0;
    StepBatches(int n, size_t tokens, int start)
        : in(n, std::vector<int>(tokens)), tgt(in), ds(in), batches(n), start_step(start) {}
};

// What one optimizer step measured, for its report.
struct StepResult {
    double loss = 0, loss_z = 0, ms = 0, flops = 0;
    float norm = 0, lr = 0;
    float loss_scale = 1;  // the loss's gradient was multiplied by this (the norm is the unscaled gradient's)
    bool overflow = false;  // a non-finite gradient the loss scale absorbs: skipped, the scale lowered
    bool bad = false;       // a non-finite loss, or a gradient the scale cannot absorb: skipped, counted
    bool skipped = false;   // no update (bad or overflow)
    PipeTimes times;
    BackendCounts counts;  // the GPU build's kernel launches and host syncs in train_step (llmc/gpt/backend.h)
};

// The first step's extra lines (rank 0): communication per collective against the layout's
// theory, and the memory measured against the plan.
static void print_first_step(const Run& r, const GPT& model, const Layout& layout, double in_use_before_model, int step) {
    if (comm_world().world_size > 1) print_comm_volume(model, r.grad_accum);
    const MemoryEstimate e = gpt_memory_estimate(r.config, r.B, r.T, layout);
    printf("memory after step %d, rank 0: %s (plan: %.2f MiB of buffers)", step + 1, measured_memory(in_use_before_model).c_str(),
           e.buffers() / 1048576.0);
    if (r.offload == OFFLOAD_OPTIMIZER)
        printf("; host arenas %.2f MiB (plan: %.2f MiB)", host_bytes_allocated() / 1048576.0, e.host_arenas() / 1048576.0);
    printf("\n");
}

// The step's line (rank 0) and its log record; bad_in_a_row / bad_total count the skipped steps.
static void report_step(const Run& r, const GPT& model, int step, int start_step, const StepResult& s, int bad_in_a_row,
                        int bad_total, std::chrono::steady_clock::time_point run_t0, JsonlLogger& log) {
    const Comm& cm = comm_world();
    const int n_stages = r.n_stages;
    // the pipeline's idle fraction per stage: time waiting in transfers over the step
    std::vector<double> idle;
    if (n_stages > 1) idle = host_gather_all<double>(cm.pp, s.times.total_ms > 0 ? s.times.wait_ms / s.times.total_ms : 0.0);
    const double peak = peak_flops_per_s();
    double tok_s = r.total_batch / (s.ms / 1000.0);
    double mfu = peak > 0 ? s.flops / (s.ms / 1000.0) / peak : -1;  // per GPU: this rank's FLOPs
    MoeStats st;
    if (r.config.n_expert > 0) st = gpt_moe_stats(model);  // rank 0's last micro-batch
    if (cm.world_rank != 0) return;
    char mfu_text[32] = "n/a";
    if (mfu >= 0) snprintf(mfu_text, sizeof(mfu_text), "%.1f%%", 100 * mfu);
    printf("step %5d/%d | loss %.4f | norm %.4f | lr %.2e | %.1f ms | %.0f tok/s | MFU %s", step + 1, r.max_steps, s.loss,
           s.norm, s.lr, s.ms, tok_s, mfu_text);
    // ETA from the mean wall time per step so far, evaluations and samples included
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_t0).count();
    const double eta = elapsed / (step + 1 - start_step) * (r.max_steps - step - 1);
    printf(" | %s elapsed, ETA %s", format_duration(elapsed).c_str(), format_duration(eta).c_str());
    if (std::isfinite(s.loss_z)) printf(" | z %+.1f%s", s.loss_z, s.loss_z > 5 ? " (loss spike)" : "");
    if (r.loss_scale.on()) printf(" | loss scale %g", s.loss_scale);
    if (s.overflow) printf(" | OVERFLOW: the scaled gradient is not finite, no update, the loss scale halves");
    if (s.bad)
        printf(" | SKIPPED: non-finite loss or grad norm, no update (%d in a row, stop at %d)", bad_in_a_row,
               r.max_bad_steps);
    // (the first step's include one-time work: cuBLASLt's plans, the pinned staging areas' growth)
    if (backend_counts_work)
        printf(" | gpu: %llu launches, %llu host sync%s", (unsigned long long)s.counts.launches,
               (unsigned long long)s.counts.host_syncs, s.counts.host_syncs == 1 ? "" : "s");
    std::vector<std::pair<const char*, double>> fields = {
        {"step", step + 1}, {"loss", s.loss}, {"grad_norm", s.norm}, {"lr", s.lr}, {"ms", s.ms}, {"tok_s", tok_s},
        {"loss_z", s.loss_z}, {"tokens", (double)(step + 1) * r.total_batch}, {"elapsed_s", elapsed}};
    if (mfu >= 0) fields.push_back({"mfu", mfu});
    if (backend_counts_work)
        fields.insert(fields.end(), {{"launches", (double)s.counts.launches}, {"host_syncs", (double)s.counts.host_syncs}});
    if (r.loss_scale.on()) fields.push_back({"loss_scale", s.loss_scale});
    if (s.skipped) fields.push_back({"skipped", 1});
    if (s.overflow) fields.push_back({"overflow", 1});
    if (s.bad) fields.push_back({"bad_steps", (double)bad_total});
    if (r.config.n_expert > 0) {
        printf(" | tokens by 0/1/2+ experts %.0f/%.0f/%.0f%% | expert load %d..%d", 100 * st.frac[0], 100 * st.frac[1],
               100 * st.frac[2], st.load_min, st.load_max);
        fields.insert(fields.end(), {{"moe_frac_0", st.frac[0]}, {"moe_frac_1", st.frac[1]},
                                     {"moe_frac_2plus", st.frac[2]}, {"moe_load_min", (double)st.load_min},
                                     {"moe_load_max", (double)st.load_max}});
    }
    if (n_stages > 1 && host_timing_is_exact) {
        printf(" | idle");
        static const char* names[] = {"pp_idle_0", "pp_idle_1", "pp_idle_2", "pp_idle_3",
                                      "pp_idle_4", "pp_idle_5", "pp_idle_6", "pp_idle_7"};
        for (int k = 0; k < n_stages; k++) {
            printf("%s%.0f%%", k ? "/" : " ", 100 * idle[k]);
            if (k < 8) fields.push_back({names[k], idle[k]});
        }
    }
    if (cm.world_size > 1)
        printf(" | pp %d dp %d tp %d%s ep %d z%d", n_stages, r.world, r.tp, r.sp ? "+sp" : "", r.ep, r.zero_stage);
    printf("\n");
    fflush(stdout);
    log.write(fields);
}

// The evaluations a run has (the val loss and its bits per byte, --eval_mc's accuracy) after
// `step` steps: one line, and one log record when there is a log (rank 0). Collective.
static void evaluate_and_report(const Run& r, GPT& model, RunData& d, int step, JsonlLogger* log, std::vector<int>& in,
                                std::vector<int>& tgt, std::vector<int>& ds) {
    if (!d.have_val && d.mc.items.empty()) return;
    ValResult val;
    McResult mc;
    if (d.have_val) val = evaluate(model, d.val, d.tokenizer, r.val_batches, in, tgt, ds);
    if (!d.mc.items.empty()) mc = evaluate_mc(model, d.mc, d.tokenizer, r.T);
    if (comm_world().world_rank != 0) return;
    if (r.eval_only) printf("eval of step %d", step);
    else printf("step %5d/%d", step, r.max_steps);
    if (d.have_val) printf(" | val loss %.4f", val.loss);
    if (val.bits_per_byte == val.bits_per_byte) printf(" | %.4f bits per byte", val.bits_per_byte);
    if (mc.items) printf(" | mc acc %.4f acc_norm %.4f (%d items)", mc.acc, mc.acc_norm, mc.items);
    printf("\n");
    std::vector<std::pair<const char*, double>> fields = {{"step", step}};
    if (d.have_val)
        fields.insert(fields.end(), {{"val_loss", val.loss}, {"val_bpb", val.bits_per_byte},
                                     {"val_bytes_per_token", val.bytes_per_token}});
    if (mc.items) fields.insert(fields.end(), {{"mc_acc", mc.acc}, {"mc_acc_norm", mc.acc_norm}, {"mc_items", mc.items}});
    if (log) log->write(fields);
}

// After step `step`: the evaluation, the sample and the checkpoint that are due, and the stop that
// a signal on any rank asks for (llmc/io/run_stop.h: every rank stops after the same step, with a
// checkpoint). Returns true when the run stops here.
static bool after_step(const Run& r, GPT& model, RunData& d, Rng& sample_rng, const LossScaler& scaler, int step,
                       int bad_in_a_row, JsonlLogger& log, std::vector<int>& in, std::vector<int>& tgt, std::vector<int>& ds) {
    Comm& cm = comm_world();
    const bool rank0 = cm.world_rank == 0;
    const bool last = step + 1 == r.max_steps;
    if ((r.val_every > 0 && (step + 1) % r.val_every == 0) || last) evaluate_and_report(r, model, d, step + 1, &log, in, tgt, ds);
    if ((r.sample_every > 0 && (step + 1) % r.sample_every == 0) || (last && r.sample_len > 0))
        print_sample(model, r.sample_len, r.temperature, r.top_k, d.tokenizer, sample_rng);
    int stop_sig = 0, stop_rank = 0;  // a signal on any rank stops every rank after this step
    const bool stopping = !last && stop_agreed(cm.world, stop_sig, stop_rank);
    if (rank0 && stopping) printf("%s on rank %d: stopping after step %d\n", strsignal(stop_sig), stop_rank, step + 1);
    const bool ckpt = (r.ckpt_every > 0 && (step + 1) % r.ckpt_every == 0) || ((last || stopping) && r.ckpt_every >= 0);
    if (ckpt || stopping) zero_settle(model);  // (the parameter gathers still in flight: a checkpoint reads them)
    if (ckpt) {
        // not in the middle of a bad streak: --resume latest should land before the trouble began
        if (bad_in_a_row == 0) save_checkpoint(r, model, d, sample_rng, scaler, step + 1);
        else if (rank0) printf("checkpoint at step %d not written: the step was skipped as non-finite\n", step + 1);
    }
    comm_end_step(cm);
    if (stopping && rank0)
        printf("stopped by signal at step %d; continue with --resume latest%s\n", step + 1,
               r.ckpt_every < 0 ? " (--ckpt_every -1: no checkpoint was written)" : "");
    return stopping;
}

// The end of the run: the llm.c export (--export_llmc), and with several data-parallel ranks the
// check that replicated params are bitwise the same on every rank that holds them (the dense
// segments on the dp group, the experts on the expert-dp group).
static void finish_run(const Run& r, GPT& model) {
    const Comm& cm = comm_world();
    zero_settle(model);
    if (!r.export_llmc.empty()) {
        gpt_export_llmc(model, r.export_llmc, r.export_dtype == "bf16");
        if (cm.world_rank == 0) printf("wrote %s (llm.c GPT-2 model, %s)\n", r.export_llmc.c_str(), r.export_dtype.c_str());
    }
    if (r.world == 1 || model.zero.params_sharded()) return;
    const ZeroLayout& z = model.zero;
    std::vector<floatX> p(staging_cap(model));  // each segment's hash streams through one chunk
    uint64_t h[2] = {0, 0};
    for (const Segment& seg : z.segs) {
        uint64_t seg_hash = ckpt_hash_bytes(nullptr, 0);
        for (size_t a = 0; a < seg.padded; a += p.size()) {
            const size_t n = std::min(p.size(), seg.padded - a);
            copy_from_buffer(p.data(), model.params + seg.padded_offset + a, n * sizeof(floatX));
            seg_hash = ckpt_hash_bytes((const unsigned char*)p.data(), n * sizeof(floatX), seg_hash);
        }
        h[seg.expert] += seg_hash;
    }
    for (int e = 0; e < 2; e++)
        for (uint64_t other : host_gather_all<uint64_t>(e ? cm.edp : cm.dp, h[e]))
            LLMC_CHECK(other == h[e], "rank %d: %s parameters differ between ranks at the end (hash %016llx vs %016llx)",
                       cm.dp.rank, e ? "expert" : "dense", (unsigned long long)h[e], (unsigned long long)other);
    if (cm.world_rank == 0)
        printf("params identical on all %d ranks (hash %016llx; experts on the ranks that hold them)\n", r.world,
               (unsigned long long)h[0]);
}
