// Tensor parallelism op by op, under mpirun (test/test_dist.sh section 8):
//   mpirun -np 2 ./test/test_tp      (and -np 3, 4, 6)
// Every rank is a tensor-parallel rank (dp 1 x pp 1 x tp = world). For each check the process
// builds the tensor-parallel model and, next to it, the unsplit one: the reference is allocated and
// run while the process sees a tensor-parallel group of one rank (SingleRankTp), so it is the
// one-process computation. Both get the same parameters (one table of random values, the same seed on
// every rank, none zero) through gpt_set_state. Compared, each against the unsplit computation:
//   - row_parallel_forward (the attention and FFN projections, the experts' batch) and
//     column_parallel_dinp (qkv, fc, the experts' fc, the vocabulary), on random tensors sliced per
//     rank, without and with scatter (sequence parallel: the rank keeps its rows of the sum);
//   - the vocab-parallel cross-entropy of gpt_forward with targets and a loss scale, vocabulary 300
//     padded to 384 (the last rank holds the padding rows): the loss and the per-token losses (the
//     lm head in one token chunk, and in chunks of 5 tokens);
//   - the attention block: gpt_layer_acts' qkv and atty columns of the rank's heads (LocalShape head0
//     / kv0) vs the matching columns of the unsplit model's, every layer;
//   - after gpt_backward: the gathered gradients (gpt_grads, table layout), and the gathered state.
// Every check is bitwise (llmc/parallel/tensor_parallel.h: every tp the model admits splits the canonical
// chunks of every reduction evenly; a kv head shared by several ranks: the group's attention
// backward on each of them). One line per check; the exit status is the number of failed checks
// (capped), the same on every rank.
#ifndef LLMC_CPU
#define LLMC_CPU
#endif
#ifndef LLMC_NO_MAIN
#define LLMC_NO_MAIN
#endif
#include "../train_gpt.cu"

#include <functional>
#include <random>

namespace {

using Ranges = SplitRanges;
constexpr int B = 2, T = 12;  // B*T = 24 tokens: divisible by tp 2, 3, 4 and 6 (--sp)
constexpr float LOSS_SCALE = 0.75f;
int n_checks = 0, n_failed = 0;

bool rank0() { return comm_world().world_rank == 0; }
int tp_size() { return comm_world().tp.size; }

// The same stream of numbers on every rank (the same seed)
struct Rand {
    std::mt19937_64 g;
    explicit Rand(uint64_t seed) : g(seed) {}
    float uni(double a, double b) { return (float)std::uniform_real_distribution<double>(a, b)(g); }
    float nz(double lo, double hi) { const float m = uni(lo, hi); return (g() & 1) ? m : -m; }  // never zero
    int below(int n) { return (int)(g() % (uint64_t)n); }
};
std::vector<float> rand_vec(Rand& r, size_t n, double lo = 0.1, double hi = 1.0) {
    std::vector<float> v(n);
    for (float& x : v) x = r.nz(lo, hi);
    return v;
}

// While one lives, this process sees a tensor-parallel group of one rank (and no kv-sharing group):
// gpt_allocate and the model's calls are then the one-process computation.
struct SingleRankTp {
    CommGroup tp, kv;
    SingleRankTp() : tp(comm_world().tp), kv(comm_world().tp_kv) {
        comm_world().tp = CommGroup{};
        comm_world().tp_kv = CommGroup{};
    }
    ~SingleRankTp() {
        comm_world().tp = tp;
        comm_world().tp_kv = kv;
    }
};

// ---- comparison, merged over the ranks (every rank returns the same verdict)
struct Diff {
    double max_abs = 0, max_ref = 0;
    uint64_t n_diff = 0, n = 0, n_nan = 0;
};
Diff diff(const float* got, const float* ref, size_t n) {
    Diff d;
    d.n = n;
    for (size_t i = 0; i < n; i++) {
        if (memcmp(&got[i], &ref[i], sizeof(float)) != 0) d.n_diff++;
        const double e = std::fabs((double)got[i] - (double)ref[i]);
        if (!std::isfinite(e) || !std::isfinite((double)ref[i])) d.n_nan++;
        else d.max_abs = std::max(d.max_abs, e);
        if (std::isfinite((double)ref[i])) d.max_ref = std::max(d.max_ref, std::fabs((double)ref[i]));
    }
    return d;
}
// slices: every rank compared its own part (counts add up); otherwise each compared the same
// whole tensor (counts: the largest rank's)
Diff merged(const Diff& mine, bool slices) {
    Diff all;
    for (const Diff& d : host_gather_all<Diff>(comm_world().world, mine)) {
        all.max_abs = std::max(all.max_abs, d.max_abs);
        all.max_ref = std::max(all.max_ref, d.max_ref);
        all.n_diff = slices ? all.n_diff + d.n_diff : std::max(all.n_diff, d.n_diff);
        all.n = slices ? all.n + d.n : std::max(all.n, d.n);
        all.n_nan += d.n_nan;
    }
    return all;
}
double rel_of(const Diff& d) { return d.max_ref > 0 ? d.max_abs / d.max_ref : d.max_abs; }

// one line per check: bitwise required
enum Scope { SLICES, WHOLE };
bool report(const std::string& what, const Diff& mine, Scope scope = SLICES, const std::string& note = "") {
    const Diff d = merged(mine, scope == SLICES);
    const double rel = rel_of(d);
    const bool ok = d.n > 0 && d.n_nan == 0 && d.n_diff == 0;
    n_checks++;
    n_failed += !ok;
    if (rank0()) {
        char detail[256];
        snprintf(detail, sizeof(detail), "bitwise: %llu of %llu elements differ%s", (unsigned long long)d.n_diff,
                 (unsigned long long)d.n, d.n_diff ? "" : " (max diff 0)");
        std::string extra = d.n_diff ? strfmt(", max rel diff %.2e", rel) : "";
        if (d.n_nan) extra += strfmt(", %llu non-finite", (unsigned long long)d.n_nan);
        printf("%s np %d  %-64s %s%s%s\n", ok ? "PASS" : "FAIL", comm_world().world_size, what.c_str(), detail,
               extra.c_str(), note.c_str());
        fflush(stdout);
    }
    return ok;
}

// ---- slicing the unsplit tensors as a rank holds them
size_t total(const Ranges& r) {
    size_t n = 0;
    for (const SplitRange& x : r) n += x.n;
    return n;
}
// columns r of a [rows, ld] matrix, side by side
std::vector<float> columns(const std::vector<float>& a, size_t rows, size_t ld, const Ranges& r) {
    std::vector<float> out;
    out.reserve(rows * total(r));
    for (size_t i = 0; i < rows; i++)
        for (const SplitRange& x : r) out.insert(out.end(), a.begin() + i * ld + x.at, a.begin() + i * ld + x.at + x.n);
    return out;
}
// rows r of each of n_batch [per, width] matrices
std::vector<float> rows_of(const std::vector<float>& a, size_t n_batch, size_t per, size_t width, const Ranges& r) {
    std::vector<float> out;
    for (size_t b = 0; b < n_batch; b++)
        for (const SplitRange& x : r)
            out.insert(out.end(), a.begin() + (b * per + x.at) * width, a.begin() + (b * per + x.at + x.n) * width);
    return out;
}
// the rank's part of a split dimension, in the unsplit tensor's indices (local_param_table's pieces)
Ranges head_columns(const LocalShape& s) { return {{(size_t)s.head0 * s.hs, (size_t)s.n_head * s.hs}}; }
Ranges qkv_rows(const GPTConfig& c, const LocalShape& s) {
    const size_t hs = s.hs;
    return {{s.head0 * hs, s.n_head * hs}, {(c.n_head + s.kv0) * hs, s.n_kv_head * hs},
            {(c.n_head + c.n_kv_head + s.kv0) * hs, s.n_kv_head * hs}};
}
Ranges hidden_units(const GPTConfig& c, const LocalShape& s, bool moe, bool fc) {
    const size_t H = moe ? c.expert_hidden : c.ffn_hidden, Hl = moe ? s.expert_hidden : s.ffn, at = s.rank * Hl;
    if (fc && (moe || c.mlp == MLP_SWIGLU)) return {{at, Hl}, {H + at, Hl}};  // W1's units, then W3's
    return {{at, Hl}};
}
Ranges vocab_rows(const LocalShape& s) { return {{(size_t)s.vocab0, (size_t)s.vocab}}; }

// ---- the op checks
// out = inp[.., K] W[OC, K]^T (+ bias), K split: the rank's columns `mine` of inp and W
void check_row_parallel(const std::string& what, GPT& m, GPT& ref, ChunkSplit GPT::*split, int n_batch, int rows, int K,
                        int OC, const Ranges& mine, bool scatter, Rand& rng) {
    const std::vector<float> inp = rand_vec(rng, (size_t)n_batch * rows * K), W = rand_vec(rng, (size_t)n_batch * OC * K),
                             bias = rand_vec(rng, (size_t)n_batch * OC);
    const std::vector<float> inp_l = columns(inp, (size_t)n_batch * rows, K, mine), W_l = columns(W, (size_t)n_batch * OC, K, mine);
    const size_t n = (size_t)n_batch * rows * OC, P = m.ls.tp;
    std::vector<float> got(scatter ? n / P : n, NAN), want(n, NAN);
    row_parallel_forward(m, got.data(), inp_l.data(), W_l.data(), bias.data(), n_batch, rows, (int)total(mine), OC, m.*split,
                         scatter);
    {
        SingleRankTp one;
        row_parallel_forward(ref, want.data(), inp.data(), W.data(), bias.data(), n_batch, rows, K, OC, ref.*split, false);
    }
    report(what, diff(got.data(), want.data() + (scatter ? m.ls.rank * (n / P) : 0), got.size()), scatter ? SLICES : WHOLE);
}

// dinp[.., C] = dout[.., OC] W[OC, C], OC split: the rank's columns `mine` of dout, rows of W;
// leaf_rows(model, j): the model's j-th leaf's rows (qkv_leaf_rows, fc_leaf_rows, ...)
void check_column_parallel(const std::string& what, GPT& m, GPT& ref, ChunkSplit GPT::*split, int n_batch, int rows, int C,
                           int OC, const Ranges& mine, const std::function<Ranges(const GPT&, int)>& leaf_rows, bool scatter,
                           Rand& rng) {
    const std::vector<float> dout = rand_vec(rng, (size_t)n_batch * rows * OC), W = rand_vec(rng, (size_t)n_batch * OC * C);
    const std::vector<float> dout_l = columns(dout, (size_t)n_batch * rows, OC, mine), W_l = rows_of(W, n_batch, OC, C, mine);
    const size_t n = (size_t)n_batch * rows * C, P = m.ls.tp;
    std::vector<float> got(scatter ? n / P : n, NAN), want(n, NAN);
    column_parallel_dinp(m, got.data(), dout_l.data(), W_l.data(), n_batch, rows, C, (int)total(mine), m.*split,
                         [&](int j) { return leaf_rows(m, j); }, scatter);
    {
        SingleRankTp one;
        column_parallel_dinp(ref, want.data(), dout.data(), W.data(), n_batch, rows, C, OC, ref.*split,
                             [&](int j) { return leaf_rows(ref, j); }, false);
    }
    report(what, diff(got.data(), want.data() + (scatter ? m.ls.rank * (n / P) : 0), got.size()), scatter ? SLICES : WHOLE);
}

void op_checks(const std::string& tag, GPT& m, GPT& ref, bool scatter, Rand& rng) {
    const GPTConfig& c = m.config;
    const LocalShape& s = m.ls;
    const int BT = B * T, C = c.n_embd, hs = c.head_size();
    const std::string sc = scatter ? " scatter" : "";
    check_row_parallel(tag + " row_parallel_forward attn.proj" + sc, m, ref, &GPT::split_attn, 1, BT, c.n_head * hs, C,
                       head_columns(s), scatter, rng);
    check_row_parallel(tag + " row_parallel_forward mlp.proj" + sc, m, ref, &GPT::split_ffn, 1, BT, c.ffn_hidden, C,
                       hidden_units(c, s, false, false), scatter, rng);
    check_column_parallel(tag + " column_parallel_dinp mlp.fc" + sc, m, ref, &GPT::split_ffn, 1, BT, C, c.fc_channels(),
                          hidden_units(c, s, false, true), [](const GPT& g, int j) { return fc_leaf_rows(g, j, false); },
                          scatter, rng);
    // the lm head's dx: one token chunk's rows (the buffers hold a chunk)
    check_column_parallel(tag + " column_parallel_dinp lm head (vocab)" + sc, m, ref, &GPT::split_vocab, 1,
                          std::min(BT, m.logits_chunk), C,
                          c.padded_vocab_size, vocab_rows(s), [](const GPT& g, int j) {
                              const size_t per = (size_t)g.ls.vocab / g.split_vocab.count;
                              return Ranges{{j * per, per}};
                          }, scatter, rng);
    // qkv (a kv head shared by several ranks: each holds its whole gradient, the owner's leaf adds it)
    check_column_parallel(tag + " column_parallel_dinp attn.qkv" + sc, m, ref, &GPT::split_attn, 1, BT, C,
                          c.qkv_channels(), qkv_rows(c, s), [](const GPT& g, int j) { return qkv_leaf_rows(g, j); },
                          scatter, rng);
    if (c.n_expert > 0 && !scatter) {  // the experts as one batch of products (never scattered)
        const int E = c.n_expert, cap = c.moe_capacity(B, T);
        check_row_parallel(tag + " row_parallel_forward moe.proj (experts batch)", m, ref, &GPT::split_expert, E, cap,
                           c.expert_hidden, C, hidden_units(c, s, true, false), false, rng);
        check_column_parallel(tag + " column_parallel_dinp moe.fc (experts batch)", m, ref, &GPT::split_expert, E, cap, C,
                              2 * c.expert_hidden, hidden_units(c, s, true, true),
                              [](const GPT& g, int j) { return fc_leaf_rows(g, j, true); }, false, rng);
    }
}

// ---- the model checks
GPTConfig make_config(int C, int n_head, int n_kv_head, int ffn, int mlp = MLP_SWIGLU, int pos = POS_ALIBI, int n_expert = 0,
                      int expert_hidden = 0) {
    GPTConfig c;
    c.vocab_size = 300;  // padded to 384: 3 x 128
    c.n_layer = 2;
    c.n_embd = C;
    c.n_head = n_head;
    c.n_kv_head = n_kv_head;
    c.ffn_hidden = ffn;
    c.max_seq_len = 16;
    c.mlp = mlp;
    c.pos = pos;
    c.n_expert = n_expert;
    c.moe_every = 2;
    c.expert_hidden = expert_hidden;
    c.capacity_factor = 1.5f;
    c.finalize();
    return c;
}

// every tensor's elements random and non-zero (LayerNorm weights near 1); the alignment padding zero
std::vector<float> random_table(const GPTConfig& c, Rand& rng) {
    const std::vector<ParamTensor> table = build_param_table(c);
    std::vector<float> v(count_params(table), 0.0f);
    for (const ParamTensor& t : table) {
        auto ends_with = [&](const std::string& x) { return t.name.size() >= x.size() && t.name.compare(t.name.size() - x.size(), x.size(), x) == 0; };
        const bool is_ln_w = ends_with(".ln1.w") || ends_with(".ln2.w") || t.name == "lnf.w";
        for (size_t k = 0; k < t.numel; k++)
            v[t.offset + k] = is_ln_w ? 1.0f + rng.nz(0.01, 0.2) : rng.nz(0.01, t.shape.size() >= 2 ? 0.15 : 0.1);
    }
    return v;
}

// the table element with the largest relative difference: "name[index]"
std::string worst_tensor(const GPT& m, const std::vector<float>& got, const std::vector<float>& want) {
    std::string name = "-";
    double worst = 0;
    for (const ParamTensor& t : m.table) {
        double mx = 0;
        for (size_t k = 0; k < t.numel; k++) mx = std::max(mx, (double)std::fabs(want[t.offset + k]));
        for (size_t k = 0; k < t.numel; k++) {
            const double e = std::fabs((double)got[t.offset + k] - want[t.offset + k]) / (mx > 0 ? mx : 1);
            if (e > worst) worst = e, name = strfmt("%s[%zu] (%.2e of its largest)", t.name.c_str(), k, e);
        }
    }
    return name;
}

struct Reference {
    float loss = 0;
    std::vector<float> losses, grads;
    std::vector<std::vector<float>> qkv, atty;  // per layer, all heads
};

bool can_split(const GPTConfig& c, int tp) {
    return c.n_head % tp == 0 && (c.n_kv_head % tp == 0 || tp % c.n_kv_head == 0) && c.ffn_hidden % tp == 0 &&
           (c.n_expert == 0 || c.expert_hidden % tp == 0) && c.padded_vocab_size % tp == 0;
}

// logits_chunk: the lm head's token chunk (Layout::logits_chunk; 0 the default, here the whole micro-batch)
void model_checks(const std::string& name, const GPTConfig& c, uint64_t seed, int logits_chunk = 0) {
    Comm& cm = comm_world();
    const int P = tp_size(), BT = B * T;
    if (!can_split(c, P)) {
        if (rank0()) printf("skip np %d  %s: does not split over %d ranks\n", cm.world_size, name.c_str(), P);
        return;
    }
    comm_make_kv_group(cm, P > c.n_kv_head ? P / c.n_kv_head : 1);  // as train_main does (collective)
    Rand rng(seed);
    const std::vector<float> params = random_table(c, rng), adam_m = rand_vec(rng, params.size(), 0.001, 0.01),
                             adam_v = rand_vec(rng, params.size(), 0.001, 0.01);
    // packed documents (EOT 256), tokens and targets in every rank's vocabulary slice, a few -1 targets
    std::vector<int> in(BT), tg(BT), ds(BT);
    for (int i = 0; i < BT; i++) {
        in[i] = rng.below(6) == 0 ? 256 : rng.below(c.vocab_size);
        tg[i] = i % 7 == 5 ? -1 : rng.below(c.vocab_size);
    }
    in[1] = c.vocab_size - 1;
    tg[0] = c.vocab_size - 1;  // the last real row (the last rank's slice, next to its padding)
    tg[2] = 0;
    tg[3] = c.padded_vocab_size / 2;
    for (int b = 0; b < B; b++) compute_doc_start(ds.data() + b * T, in.data() + b * T, T, 256);

    // the unsplit model: forward with targets and a loss scale, backward, what the checks compare
    GPT ref;
    Reference want;
    Layout ref_layout;
    ref_layout.logits_chunk = logits_chunk;
    {
        SingleRankTp one;
        gpt_allocate(ref, c, B, T, ref_layout);
        gpt_set_state(ref, params.data(), adam_m.data(), adam_v.data());
        gpt_zero_grad(ref);
        want.loss = gpt_forward(ref, in.data(), tg.data(), ds.data(), B, T, LOSS_SCALE);
        want.losses.assign(ref.losses, ref.losses + BT);  // (the CPU build's buffers are host memory)
        for (int l = 0; l < c.n_layer; l++) {
            const LayerActs& a = gpt_layer_acts(ref, l);
            want.qkv.emplace_back(a.qkv, a.qkv + (size_t)BT * c.qkv_channels());
            want.atty.emplace_back(a.atty, a.atty + (size_t)BT * c.n_embd);
        }
        gpt_backward(ref);
        want.grads = gpt_grads(ref);  // (collective over the world: every rank's reference is the same)
    }

    for (int sp = 0; sp < 2; sp++) {
        const std::string tag = name + (sp ? " sp" : "");
        Layout layout;
        layout.sp = sp == 1;
        layout.logits_chunk = logits_chunk;
        GPT m;
        gpt_allocate(m, c, B, T, layout);
        gpt_set_state(m, params.data(), adam_m.data(), adam_v.data());
        const LocalShape& s = m.ls;
        {  // the state as this layout holds it, gathered back: the table
            std::vector<float> back(m.n_params, NAN);
            gpt_get_state(m, back.data(), nullptr, nullptr);
            report(tag + " gpt_get_state == the table", diff(back.data(), params.data(), back.size()), WHOLE);
        }
        Rand op_rng(seed + 1000 + sp);
        op_checks(tag, m, ref, sp == 1, op_rng);

        gpt_zero_grad(m);
        const float loss = gpt_forward(m, in.data(), tg.data(), ds.data(), B, T, LOSS_SCALE);
        report(tag + " vocab-parallel loss (padded vocab 384)", diff(&loss, &want.loss, 1), WHOLE,
               rank0() ? strfmt("  [loss %.6f]", loss) : "");
        report(tag + " vocab-parallel per-token losses", diff(m.losses, want.losses.data(), BT), WHOLE);
        for (int l = 0; l < c.n_layer; l++) {
            const LayerActs& a = gpt_layer_acts(m, l);
            const std::vector<float> qkv_want = columns(want.qkv[l], BT, c.qkv_channels(), qkv_rows(c, s));
            const std::vector<float> atty_want = columns(want.atty[l], BT, c.n_embd, head_columns(s));
            report(tag + strfmt(" layer %d qkv columns of the rank's heads", l), diff(a.qkv, qkv_want.data(), qkv_want.size()));
            report(tag + strfmt(" layer %d atty columns of the rank's heads", l),
                   diff(a.atty, atty_want.data(), atty_want.size()));
        }
        gpt_backward(m);
        const std::vector<float> g = gpt_grads(m);
        report(tag + " gradients (gpt_grads, table layout)", diff(g.data(), want.grads.data(), g.size()), WHOLE,
               rank0() ? "  worst: " + worst_tensor(m, g, want.grads) : "");
        gpt_free(m);
    }
    gpt_free(ref);
}

int run() {
    Comm& cm = comm_init(nullptr, nullptr);
    comm_make_grid(cm, 1, 1, cm.world_size);  // dp 1 x pp 1 x tp = every rank
    if (rank0())
        printf("test_tp: %d ranks, tp %d (%s), B %d x T %d\n", cm.world_size, tp_size(), comm_backend_name(), B, T);
    // n_head / n_kv_head: 6/2 and 8/4 split the kv heads over np 2 (and 8/4 over np 4); 8/2 on np 4
    // shares each kv head between two ranks; 6/3 splits over np 3 and shares over np 6 (canonical
    // chunks: 6, not a power of two)
    model_checks("6h/2kv swiglu alibi", make_config(48, 6, 2, 64), 11);
    // the lm head over token chunks of 5 (not dividing B*T = 24, nor aligned with the --sp rows)
    model_checks("6h/2kv swiglu alibi, lm-head chunks of 5", make_config(48, 6, 2, 64), 11, 5);
    model_checks("6h/2kv moe", make_config(48, 6, 2, 64, MLP_SWIGLU, POS_ALIBI, 3, 32), 12);
    model_checks("8h/4kv gelu learned-pos", make_config(64, 8, 4, 96, MLP_GELU, POS_LEARNED), 13);
    model_checks("8h/4kv moe", make_config(64, 8, 4, 96, MLP_SWIGLU, POS_ALIBI, 4, 48), 14);
    model_checks("8h/2kv swiglu alibi", make_config(64, 8, 2, 96), 15);
    model_checks("6h/3kv gelu learned-pos", make_config(48, 6, 3, 66, MLP_GELU, POS_LEARNED), 16);
    model_checks("6h/3kv moe", make_config(48, 6, 3, 66, MLP_SWIGLU, POS_ALIBI, 3, 36), 17);
    if (rank0()) printf("test_tp: np %d: %d checks, %d failed\n", cm.world_size, n_checks, n_failed);
    return std::min(n_failed, 100);
}

}  // namespace

int main() {
    try {
        const int rc = run();
        comm_finalize();
        return rc;
    } catch (const std::exception& e) {
        fprintf(stderr, "error (rank %d of %d): %s\n", comm_world().world_rank, comm_world().world_size, e.what());
        fflush(stderr);
        comm_abort(1);
        return 1;
    }
}
