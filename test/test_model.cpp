// Model-level and training-loop tests of the CPU build: packing, overfitting, data loading,
// LR schedules, checkpoint/resume determinism and clear errors for bad input.
#define LLMC_CPU
#define LLMC_NO_MAIN
#include "../train_gpt.cu"

#include "test_util.h"

#include <doctest/doctest.h>
#include <fstream>
#include <set>
#include <sstream>
#include <sys/wait.h>

namespace {

// shards, temp dirs, running the trainer: test_util.h
using test_util::make_temp_dir;
using test_util::read_file;
using test_util::run_train;
using test_util::synthetic_tokens;
using test_util::write_shard;

GPTConfig small_config(int mlp, int pos, int n_head = 4, int n_kv_head = 2) {
    GPTConfig c;
    c.vocab_size = 257;
    c.n_layer = 2;
    c.n_embd = 8 * n_head;
    c.n_head = n_head;
    c.n_kv_head = n_kv_head;
    c.max_seq_len = 64;
    c.mlp = mlp;
    c.pos = pos;
    c.finalize();
    return c;
}

}  // namespace

TEST_CASE("packing: the losses of a packed row equal its documents run one by one") {
    for (int variant = 0; variant < 3; variant++) {
        // (a) SwiGLU + ALiBi + GQA, 6 heads; (b) GPT-2 style GELU + learned positions; (c) the Llama
        // shape: rope (llama3 scaling) positions per document, RMSNorm, no biases, an untied head
        GPTConfig c = variant == 0 ? small_config(MLP_SWIGLU, POS_ALIBI, 6, 2) : small_config(MLP_GELU, POS_LEARNED, 4, 4);
        if (variant == 2) {
            c = small_config(MLP_SWIGLU, POS_ROPE, 4, 2);
            c.norm = NORM_RMSNORM;
            c.bias = BIAS_NONE;
            c.tie_embeddings = 0;
            c.rope.theta = 5e5;
            c.rope.scaling = cpu::ROPE_SCALING_LLAMA3;
            c.rope.original_max_pos = 16;
            c.finalize();
        }
        CAPTURE(variant);
        const int T = 45;
        GPT m;
        gpt_allocate(m, c, 1, T);
        gpt_init_params(m, 7 + variant);
        // row starts mid-document; documents of length 1 at 12 and at the end
        std::vector<int> row(T), targets(T), ds(T);
        Rng rng(3);
        for (int t = 0; t < T; t++) { row[t] = (int)rng.below(256); targets[t] = (int)rng.below(257); }
        for (int e : {6, 12, 13, 30, 44}) row[e] = 256;
        compute_doc_start(ds.data(), row.data(), T, 256);
        gpt_forward(m, row.data(), targets.data(), ds.data(), 1, T);
        std::vector<float> packed(m.losses, m.losses + T);  // (the CPU build's buffers are host memory)
        int n_docs = 0;
        for (int s = 0; s < T;) {
            int e = s + 1;
            while (e < T && row[e] != 256) e++;
            std::vector<int> doc_ds(e - s);
            compute_doc_start(doc_ds.data(), row.data() + s, e - s, 256);
            gpt_forward(m, row.data() + s, targets.data() + s, doc_ds.data(), 1, e - s);
            for (int t = s; t < e; t++) {
                CAPTURE(t);
                CHECK(m.losses[t - s] == doctest::Approx(packed[t]).epsilon(1e-5));
            }
            s = e;
            n_docs++;
        }
        CHECK(n_docs == 6);
        gpt_free(m);
    }
}

TEST_CASE("open models' presets: Llama 3.2 and Qwen2.5 have their parameter counts and tensors") {
    struct Expect { const char* preset; size_t params; };
    // the counts Hugging Face reports for these models (tied heads; vocabularies multiples of 128)
    for (const Expect& e : {Expect{"llama3.2:1B", 1235814400}, Expect{"llama3.2:3B", 3212749824},
                            Expect{"qwen2.5:0.5B", 494032768}, Expect{"qwen2.5:1.5B", 1543714304}}) {
        CAPTURE(e.preset);
        Args args;
        for (const Option& o : OPTIONS) args.value[o.name] = o.default_value;
        args.value["model"] = e.preset;
        args.given["model"] = true;
        const GPTConfig c = config_from_args(args);
        const std::vector<ParamTensor> table = build_param_table(c);
        size_t n = 0;
        std::set<std::string> names;
        for (const ParamTensor& p : table) { n += p.numel; names.insert(p.name); }
        CHECK(n == e.params);
        CHECK(c.pos == POS_ROPE);
        CHECK(c.rmsnorm());
        CHECK(!names.count("lnf.b"));
        CHECK(!names.count("h0.ln1.b"));
        CHECK(!names.count("h0.attn.proj.b"));
        CHECK(!names.count("h0.mlp.fc.b"));
        CHECK(names.count("h0.attn.qkv.b") == (e.preset[0] == 'q' ? 1u : 0u));
        CHECK(!names.count("lm_head"));  // (all four tie their head)
    }
    // an untied head: its own matrix, last, in the final segment
    GPTConfig c = small_config(MLP_SWIGLU, POS_ROPE);
    c.tie_embeddings = 0;
    c.finalize();
    const std::vector<ParamTensor> table = build_param_table(c);
    CHECK(table.back().name == "lm_head");
    CHECK(table.back().decay);
    CHECK(segment_of("lm_head", c.n_layer) == c.n_layer + 1);
    GPT m;
    gpt_allocate(m, c, 1, 16);
    gpt_init_params(m, 5);
    // its rows past vocab_size start at zero (no token uses them)
    std::vector<float> p(m.n_params);
    gpt_get_state(m, p.data(), nullptr, nullptr);
    const ParamTensor& head = table.back();
    for (size_t i = (size_t)c.vocab_size * c.n_embd; i < head.numel; i++) REQUIRE(p[head.offset + i] == 0.0f);
    CHECK(p[head.offset] != 0.0f);
    gpt_free(m);
}

TEST_CASE("sampling: the context is the model's max_seq_len, not the training -t") {
    // trained with B x T = 4 x 8 (32 tokens a micro-batch), max_seq_len 24: greedy sampling from a
    // 6-token prompt for 30 tokens must equal greedy decoding with the last 24 tokens as context,
    // which (the check below) differs from decoding with the last 8
    GPTConfig c = small_config(MLP_GELU, POS_LEARNED, 4, 4);
    c.max_seq_len = 24;
    c.finalize();
    const int n_new = 30, eot = 256;
    GPT m, full;
    gpt_allocate(m, c, 4, 8);
    gpt_allocate(full, c, 1, c.max_seq_len);
    for (GPT* g : {&m, &full}) {  // weights 10x the init's, so that the attention's reach matters
        gpt_init_params(*g, 11);
        for (size_t i = 0; i < g->zero.params_elems(); i++) g->params[i] *= 10.0f;
    }
    const std::vector<int> prompt = {17, 99, 3, 200, 45, 120};
    Rng rng(5);
    const std::vector<int> got = gpt_sample(m, prompt, n_new, 1.0f, 1, eot, rng);
    auto greedy = [&](int ctx_len) {
        std::vector<int> seq = prompt;
        for (int i = 0; i < n_new; i++) {
            const int T = std::min((int)seq.size(), ctx_len);
            std::vector<int> ctx(seq.end() - T, seq.end()), ds(T);
            compute_doc_start(ds.data(), ctx.data(), T, eot);
            const std::vector<float> all = gpt_logits(full, ctx.data(), ds.data(), 1, T);
            const auto logits = all.begin() + (size_t)(T - 1) * full.ls.vocab;  // the last position's
            seq.push_back((int)(std::max_element(logits, logits + c.vocab_size) - logits));
        }
        return std::vector<int>(seq.begin() + prompt.size(), seq.end());
    };
    CHECK(got == greedy(c.max_seq_len));
    CHECK_MESSAGE(greedy(8) != greedy(c.max_seq_len), "the prompt does not tell the two contexts apart");
    gpt_free(m);
    gpt_free(full);
}

TEST_CASE("a d2 model overfits a single batch") {
    Args args;
    const char* argv[] = {"x", "-e", "d2"};
    REQUIRE(parse_args(3, (char**)argv, args));
    GPTConfig c = config_from_args(args);
    CHECK(c.n_layer == 2);
    CHECK(c.n_embd == 128);
    CHECK(c.n_head == 2);
    const int B = 2, T = 64;
    GPT m;
    gpt_allocate(m, c, B, T);
    gpt_init_params(m, 1);
    std::vector<int> tokens = synthetic_tokens(B * T + 1, 5), in(B * T), tgt(B * T), ds(B * T);
    for (int i = 0; i < B * T; i++) { in[i] = tokens[i]; tgt[i] = tokens[i + 1]; }
    for (int b = 0; b < B; b++) compute_doc_start(ds.data() + b * T, in.data() + b * T, T, 256);
    OptimizerConfig opt;
    opt.weight_decay = 0.0f;
    float loss = 0;
    int step = 0;
    for (; step < 300; step++) {
        gpt_zero_grad(m);
        loss = gpt_forward(m, in.data(), tgt.data(), ds.data(), B, T, 1.0f);
        if (loss < 0.1f) break;
        gpt_backward(m);
        gpt_update(m, opt, step < 10 ? 3e-3f * (step + 1) / 10 : 3e-3f, step);
    }
    MESSAGE("d2 overfit: loss " << loss << " after " << step << " steps");
    CHECK(loss < 0.1f);
    gpt_free(m);
}

TEST_CASE("data loader: doc_start, epochs, rank slices, exact resume") {
    int row[8] = {5, 256, 7, 7, 256, 256, 9, 1};
    int ds[8];
    compute_doc_start(ds, row, 8, 256);
    const int expect[8] = {0, 1, 1, 1, 4, 5, 5, 5};
    for (int t = 0; t < 8; t++) CHECK(ds[t] == expect[t]);

    std::string dir = make_temp_dir();
    // tokens are their own positions (mod 250), so a row is identified by its first token
    std::vector<int> tokens(10 * 8 + 1);
    for (size_t i = 0; i < tokens.size(); i++) tokens[i] = (int)(i % 250);
    write_shard(dir + "/s_000.bin", tokens);
    const int B = 2, T = 8, world = 2;
    DataLoader r0(dir + "/s_*.bin", B, T, 0, world, true, 42, 257, "--train");
    DataLoader r1(dir + "/s_*.bin", B, T, 1, world, true, 42, 257, "--train");
    CHECK(r0.batches_in_shard(0) == 5);  // 10 rows / B: micro-batches of the stream, whatever world is
    // the ranks' calls interleave into the one stream a single loader reads: global micro-batch
    // call * world + rank, across shard and epoch ends
    DataLoader single(dir + "/s_*.bin", B, T, 0, 1, true, 42, 257, "--train");
    std::vector<int> in(B * T), tgt(B * T), d(B * T), want(B * T);
    std::vector<int> seen;
    for (int k = 0; k < 5; k++) {
        for (DataLoader* l : {&r0, &r1}) {
            l->next_batch(in.data(), tgt.data(), d.data());
            single.next_batch(want.data(), tgt.data(), d.data());
            CHECK(in == want);
            for (int b = 0; b < B; b++) {
                CHECK(in[b * T] % T == 0);
                seen.push_back(in[b * T] / T);
            }
        }
        CHECK(r0.state.epoch == r1.state.epoch);  // the position is the same on every rank
        CHECK(r0.state.batch == r1.state.batch);
    }
    for (int epoch = 0; epoch < 2; epoch++) {  // each epoch visits every row once
        std::vector<int> rows(seen.begin() + epoch * 10, seen.begin() + epoch * 10 + 10);
        std::sort(rows.begin(), rows.end());
        CHECK(std::unique(rows.begin(), rows.end()) == rows.end());
    }
    // restoring a saved position replays exactly the same batches
    DataLoader a(dir + "/s_*.bin", B, T, 0, 1, true, 42, 257, "--train");
    for (int k = 0; k < 7; k++) a.next_batch(in.data(), tgt.data(), d.data());
    LoaderState saved = a.state;
    std::vector<int> expect_in(B * T), got(B * T);
    a.next_batch(expect_in.data(), tgt.data(), d.data());
    DataLoader b(dir + "/s_*.bin", B, T, 0, 1, true, 42, 257, "--train");
    b.reset(saved);
    b.next_batch(got.data(), tgt.data(), d.data());
    CHECK(got == expect_in);
}

// The loader before shards were mapped, kept as the reference for the token stream: the whole
// shard read into ints, the row order a Fisher-Yates shuffle of the shard's rows at its first batch.
struct WholeShardLoader {
    std::vector<ShardInfo> shards;
    int B, T, rank, world;
    bool shuffle;
    uint64_t seed;
    int eot;
    LoaderState state;
    int64_t loaded_epoch = -1, loaded_shard = -1;
    std::vector<int> tokens;
    std::vector<int64_t> row_order;

    WholeShardLoader(const DataLoader& like, int rank_, int world_)
        : shards(like.shards), B(like.B), T(like.T), rank(rank_), world(world_), shuffle(like.shuffle),
          seed(like.seed), eot(like.eot) {}
    int64_t batches_in_shard(int64_t s) const { return (int64_t)((shards[s].num_tokens - 1) / T) / (int64_t)B; }
    void load(int64_t epoch, int64_t shard) {
        if (shard != loaded_shard) {
            const ShardInfo& s = shards[shard];
            FILE* f = fopen(s.path.c_str(), "rb");
            REQUIRE(f);
            fseek(f, s.header_bytes, SEEK_SET);
            tokens.assign(s.num_tokens, 0);
            for (int& t : tokens) REQUIRE(fread(&t, 1, s.token_bytes, f) == s.token_bytes);  // little-endian host
            fclose(f);
        }
        if (shard != loaded_shard || epoch != loaded_epoch) {
            const int64_t n = (int64_t)(shards[shard].num_tokens - 1) / T;
            row_order.resize(n);
            for (int64_t i = 0; i < n; i++) row_order[i] = i;
            if (shuffle) {
                Rng rng(seed ^ (0x9E3779B97F4A7C15ull * (uint64_t)(epoch + 1)) ^ ((uint64_t)shard << 32));
                for (int64_t i = n - 1; i > 0; i--) std::swap(row_order[i], row_order[rng.below((uint64_t)i + 1)]);
            }
        }
        loaded_epoch = epoch;
        loaded_shard = shard;
    }
    void next_batch(int* inputs, int* targets, int* doc_start) {
        for (int r = 0; r < world; r++) {
            if (state.batch >= batches_in_shard(state.shard)) {
                state.batch = 0;
                if (++state.shard == (int64_t)shards.size()) { state.shard = 0; state.epoch++; }
            }
            if (r == rank) {
                load(state.epoch, state.shard);
                for (int b = 0; b < B; b++) {
                    const int* src = tokens.data() + row_order[state.batch * B + b] * T;
                    for (int t = 0; t < T; t++) {
                        inputs[b * T + t] = src[t];
                        targets[b * T + t] = src[t + 1];
                    }
                    compute_doc_start(doc_start + b * T, inputs + b * T, T, eot);
                }
            }
            state.batch++;
        }
    }
};

TEST_CASE("data loader: the mapped shards serve the whole-shard reader's stream, byte for byte") {
    const std::string dir = make_temp_dir();
    // widths 2 and 4, row counts that do not divide into batches, a shard's last tokens in no row
    write_shard(dir + "/s_000.bin", synthetic_tokens(1000, 1), 257, 256, 2);
    write_shard(dir + "/s_001.bin", synthetic_tokens(1537, 2), 257, 256, 4);
    write_shard(dir + "/s_002.bin", synthetic_tokens(700, 3), 257, 256, 2);
    const int B = 3, T = 16;
    for (bool shuffle : {false, true}) {
        for (int world : {1, 3}) {
            for (int rank = 0; rank < world; rank++) {
                CAPTURE(shuffle);
                CAPTURE(world);
                CAPTURE(rank);
                DataLoader dl(dir + "/s_*.bin", B, T, rank, world, shuffle, 42, 257, "--train");
                WholeShardLoader ref(dl, rank, world);
                const int64_t calls = (20 + 32 + 14) * 3 / world + 1;  // 3 epochs of micro-batches, into the 4th
                std::vector<int> in(B * T), tgt(B * T), ds(B * T), want_in(B * T), want_tgt(B * T), want_ds(B * T);
                int differ = 0;
                LoaderState mid;
                for (int64_t k = 0; k < calls; k++) {
                    if (k == calls / 2) mid = dl.state;
                    dl.next_batch(in.data(), tgt.data(), ds.data());
                    ref.next_batch(want_in.data(), want_tgt.data(), want_ds.data());
                    differ += in != want_in || tgt != want_tgt || ds != want_ds;
                    // a shard's row order is complete before its first batch: no switch builds one
                    if (shuffle && dl.state.batch == dl.batches_in_shard(dl.state.shard)) CHECK(dl.ahead.work_left() == 0);
                }
                CHECK(differ == 0);
                CHECK(dl.state.epoch == 3);
                // a reset to a position mid-shard (a resume) serves the same stream from there
                dl.reset(mid);
                ref.state = mid;
                differ = 0;
                for (int64_t k = calls / 2; k < calls; k++) {
                    dl.next_batch(in.data(), tgt.data(), ds.data());
                    ref.next_batch(want_in.data(), want_tgt.data(), want_ds.data());
                    differ += in != want_in || tgt != want_tgt || ds != want_ds;
                }
                CHECK(differ == 0);
            }
        }
    }
    // the loader's host memory: two row orders of the largest shard, none unshuffled
    DataLoader dl(dir + "/s_*.bin", B, T, 0, 1, true, 42, 257, "--train");
    CHECK(dl.host_bytes() == 2 * (1536 / T) * sizeof(int64_t));
    CHECK(DataLoader(dir + "/s_*.bin", B, T, 0, 1, false, 42, 257, "--val").host_bytes() == 0);
}

TEST_CASE("data loader: a bad token id stops the batch that holds it, naming the shard and the position") {
    const std::string dir = make_temp_dir();
    const int B = 2, T = 16;
    auto served_before_error = [&](const std::string& path, const char* needle) {
        DataLoader dl(path, B, T, 0, 1, false, 1, 257, "--train");
        std::vector<int> in(B * T), tgt(B * T), ds(B * T);
        int served = 0;
        try {
            for (; served < 1000; served++) dl.next_batch(in.data(), tgt.data(), ds.data());
        } catch (const LlmcError& e) {
            CHECK(std::string(e.what()).find(needle) != std::string::npos);
            CAPTURE(e.what());
        }
        return served;
    };
    // token 777 is in row 48 only (tokens 768..784: the last target of row 47 is 768), the first
    // row of micro-batch 24: 24 micro-batches are served, the 25th stops
    std::vector<int> toks = synthetic_tokens(3000, 1);
    toks[777] = 300;
    write_shard(dir + "/a_000.bin", toks, 257, 256, 2);
    CHECK(served_before_error(dir + "/a_*.bin", "a_000.bin: token 777 has id 300, but the model's vocab_size is 257") == 24);
    // in 4-byte shards, ids past 2^31 too; as a target only: the last token of row 47 (its target 15)
    toks[777] = synthetic_tokens(3000, 1)[777];
    toks[768] = (int)0x80000001u;
    write_shard(dir + "/b_000.bin", toks, 257, 256, 4);
    CHECK(served_before_error(dir + "/b_*.bin", "b_000.bin: token 768 has id 2147483649, but the model's vocab_size is 257") == 23);
    // a shard that changed between start-up and its mapping is refused, not read past its end
    write_shard(dir + "/c_000.bin", synthetic_tokens(3000, 1));
    DataLoader dl(dir + "/c_*.bin", B, T, 0, 1, true, 1, 257, "--train");
    write_shard(dir + "/c_000.bin", synthetic_tokens(2000, 1), 257, 256, 2, "LLMCSHRD", 3000);
    std::vector<int> in(B * T), tgt(B * T), ds(B * T);
    CHECK_THROWS_WITH_AS(dl.next_batch(in.data(), tgt.data(), ds.data()),
                         doctest::Contains("c_000.bin: the shard changed since start-up: it is 4064 bytes, its header said 6064"),
                         LlmcError);
}

TEST_CASE("learning-rate schedules") {
    LRSchedule s;
    s.lr_max = 1.0f; s.final_frac = 0.1f; s.warmup = 10; s.max_steps = 110;
    CHECK(s.at(0) == doctest::Approx(0.1));
    CHECK(s.at(9) == doctest::Approx(1.0));
    CHECK(s.at(10) == doctest::Approx(1.0));
    CHECK(s.at(60) == doctest::Approx(0.55));
    CHECK(s.at(110) == doctest::Approx(0.1));
    s.kind = "linear";
    CHECK(s.at(60) == doctest::Approx(0.55));
    s.kind = "constant";
    CHECK(s.at(100) == doctest::Approx(1.0));
    s.kind = "wsd"; s.wsd_decay_frac = 0.2f;  // decays over the last 22 steps
    CHECK(s.at(87) == doctest::Approx(1.0));
    CHECK(s.at(99) == doctest::Approx(1.0 - 0.9 * 11 / 22.0));
    s.kind = "nope";
    CHECK_THROWS_WITH_AS(s.validate(), doctest::Contains("--schedule"), LlmcError);
}

namespace {
struct TrainFixture {
    std::string dir = make_temp_dir();
    TrainFixture() {
        write_shard(dir + "/tr_000.bin", synthetic_tokens(6000, 1));
        write_shard(dir + "/tr_001.bin", synthetic_tokens(3000, 2));
        write_shard(dir + "/va_000.bin", synthetic_tokens(2000, 3));
    }
    std::vector<std::string> args(const std::string& out, int max_steps) const {
        return {"--train", dir + "/tr_*.bin", "--val", dir + "/va_*.bin", "--out_dir", dir + "/" + out + "/run",
                "--n_layer", "2", "--n_embd", "32", "--n_head", "4", "--n_kv_head", "2", "-b", "2", "-t", "32",
                "-d", "128", "--max_steps", std::to_string(max_steps), "--warmup", "2", "--val_every", "3",
                "--val_batches", "2", "--sample_len", "16", "--ckpt_every", "4"};
    }
};

// the "loss" values of a log.jsonl, by step (timing fields differ between runs)
std::map<int, std::string> logged_losses(const std::string& path) {
    std::map<int, std::string> out;
    std::ifstream f(path);
    std::string line;
    while (std::getline(f, line)) {
        size_t p = line.find("\"loss\":");
        if (p == std::string::npos) continue;
        int step = std::stoi(line.substr(line.find("\"step\":") + 7));
        out[step] = line.substr(p, line.find(',', p) - p) + line.substr(line.find("\"grad_norm\""), 20);
    }
    return out;
}
}  // namespace

TEST_CASE("checkpoints: round trip, and resume continues bitwise-identically") {
    TrainFixture fx;
    // uninterrupted 10 steps (4 micro-batches of 2x32 per 128-token step: accumulation 2)
    REQUIRE(run_train(fx.args("full", 10)) == 0);
    // the same run again: bitwise identical (determinism for a fixed seed)
    REQUIRE(run_train(fx.args("again", 10)) == 0);
    CHECK(read_file(fx.dir + "/full/run/ckpt_000000010.bin") == read_file(fx.dir + "/again/run/ckpt_000000010.bin"));
    // resume from step 4 in a fresh directory, with neither the model's nor the batch's flags: both
    // come from the checkpoint
    std::vector<std::string> a;
    const std::vector<std::string> all = fx.args("resumed", 10);
    const std::set<std::string> from_checkpoint = {"--n_layer", "--n_embd", "--n_head", "--n_kv_head", "-b", "-t", "-d"};
    for (size_t k = 0; k < all.size(); k += 2)
        if (!from_checkpoint.count(all[k])) a.insert(a.end(), {all[k], all[k + 1]});
    REQUIRE(a.size() == all.size() - 14);
    a.push_back("--resume");
    a.push_back(fx.dir + "/full/run/ckpt_000000004.bin");
    REQUIRE(run_train(a) == 0);
    std::string full = read_file(fx.dir + "/full/run/ckpt_000000010.bin");
    CHECK(full.size() > 1000);
    CHECK(full == read_file(fx.dir + "/resumed/run/ckpt_000000010.bin"));
    auto l_full = logged_losses(fx.dir + "/full/run/log.jsonl"), l_res = logged_losses(fx.dir + "/resumed/run/log.jsonl");
    CHECK(l_res.size() == 6);
    for (auto& [step, text] : l_res) {
        CAPTURE(step);
        CHECK(text == l_full[step]);
    }
    // round trip of the file format itself
    CheckpointContents ck = load_checkpoint(fx.dir + "/full/run/ckpt_000000010.bin");
    CHECK(ck.get_int("step", "") == 10);
    CHECK(ck.get_int("config.n_kv_head", "") == 2);
    save_checkpoint(fx.dir + "/copy.bin", ck, ck.params.data(), ck.adam_m.data(), ck.adam_v.data(), ck.params.size());
    CHECK(read_file(fx.dir + "/copy.bin") == full);
    CHECK(!file_exists(fx.dir + "/copy.bin.tmp"));
    // resume 'latest' picks the newest checkpoint and continues to a later max_steps
    std::vector<std::string> b = fx.args("full", 12);
    b.push_back("--resume");
    b.push_back("latest");
    REQUIRE(run_train(b) == 0);
    CHECK(file_exists(fx.dir + "/full/run/ckpt_000000012.bin"));
}

TEST_CASE("init: normal_at is Rng's stream indexed; an element's init depends only on (seed, table index)") {
    for (uint64_t seed : {0ull, 1ull, 1337ull, 0xFFFFFFFFFFFFFFFFull}) {
        CAPTURE(seed);
        Rng r(seed), q(seed);
        for (uint64_t k = 0; k < 1000; k++) REQUIRE(splitmix64_at(seed, k) == q.next_u64());
        for (uint64_t i = 0; i < 1000; i++) REQUIRE(normal_at(seed, i, 0.5f, 0.02f) == r.normal(0.5f, 0.02f));
    }
    // the model's init: every element from its table index alone; ones, zeros, the wte padding rows
    GPTConfig c = small_config(MLP_SWIGLU, POS_ALIBI);
    GPT m;
    gpt_allocate(m, c, 1, 8);
    gpt_init_params(m, 42);
    std::vector<float> p(m.n_params, -1.0f), mm(m.n_params, -1.0f), v(m.n_params, -1.0f);
    gpt_get_state(m, p.data(), mm.data(), v.data());
    std::vector<int> seen(m.n_params, 0);
    double sum = 0, sq = 0;
    size_t normals = 0;
    for (const ParamTensor& t : m.table) {
        CAPTURE(t.name);
        const size_t used = t.name == "wte" ? (size_t)c.vocab_size * c.n_embd : t.numel;
        for (size_t i = 0; i < t.numel; i++) {
            const size_t at = t.offset + i;
            seen[at] = 1;
            const float expect = i >= used ? 0.0f
                                 : t.init == ParamTensor::NORMAL ? normal_at(42, at, 0.0f, t.init_std)
                                 : t.init == ParamTensor::ONES   ? 1.0f : 0.0f;
            REQUIRE(p[at] == expect);
            if (t.init == ParamTensor::NORMAL && t.init_std == 0.02f && i < used) {
                sum += p[at];
                sq += (double)p[at] * p[at];
                normals++;
            }
        }
    }
    for (size_t i = 0; i < m.n_params; i++) {
        if (!seen[i]) REQUIRE(p[i] == 0.0f);  // the alignment gaps
        REQUIRE(mm[i] == 0.0f);
        REQUIRE(v[i] == 0.0f);
    }
    const double mean = sum / normals, sd = std::sqrt(sq / normals - mean * mean);
    CHECK(std::fabs(mean) < 1e-3);
    CHECK(std::fabs(sd - 0.02) < 5e-4);
    // another seed gives other values; the same seed the same ones, whatever the staging chunk
    std::vector<float> p2(m.n_params);
    setenv("LLMC_STAGING_ELEMS", "37", 1);
    gpt_init_params(m, 42);
    unsetenv("LLMC_STAGING_ELEMS");
    gpt_get_state(m, p2.data(), nullptr, nullptr);
    CHECK(p2 == p);
    gpt_init_params(m, 43);
    gpt_get_state(m, p2.data(), nullptr, nullptr);
    CHECK(p2 != p);
    gpt_free(m);
}

TEST_CASE("streamed state: gpt_set_state / checkpoint saves and loads in chunks that split segments") {
    // every ZeRO stage (one process: its shards are the whole segments) and --offload optimizer: a
    // state set through a tiny staging chunk comes back exactly, the padding zero
    GPTConfig c = small_config(MLP_GELU, POS_LEARNED);
    for (int zero = 0; zero <= 3; zero++)
        for (int offload : {OFFLOAD_NONE, OFFLOAD_OPTIMIZER}) {
            CAPTURE(zero);
            CAPTURE(offload);
            Layout layout;
            layout.zero_stage = zero;
            layout.offload = offload;
            GPT m;
            gpt_allocate(m, c, 1, 8, layout);
            std::vector<float> a[3], b[3];
            Rng r(zero * 2 + offload);
            for (int k = 0; k < 3; k++) {
                a[k].resize(m.n_params);
                b[k].assign(m.n_params, -1.0f);
                for (float& x : a[k]) x = k == 2 ? r.uniform() : r.normal(0.0f, 1.0f);
            }
            setenv("LLMC_STAGING_ELEMS", "53", 1);
            gpt_set_state(m, a[0].data(), a[1].data(), a[2].data());
            unsetenv("LLMC_STAGING_ELEMS");
            gpt_get_state(m, b[0].data(), b[1].data(), b[2].data());
            for (int k = 0; k < 3; k++) CHECK(a[k] == b[k]);
            const size_t state = m.zero.state_elems();
            std::vector<float> st(state);
            state_copy_out(offload == OFFLOAD_OPTIMIZER, st.data(), m.adam_m, state * 4);
            for (const Segment& s : m.zero.segs)  // one process: shard space == padded space
                for (size_t rel = s.len; rel < s.padded; rel++) REQUIRE(st[s.padded_offset + rel] == 0.0f);
            gpt_free(m);
        }

    // training runs whose init, checkpoint loads and saves go through a chunk of 100 elements give
    // the bytes of the default chunk, and resume from each other bitwise
    TrainFixture fx;
    REQUIRE(run_train(fx.args("big", 8)) == 0);
    setenv("LLMC_STAGING_ELEMS", "100", 1);
    REQUIRE(run_train(fx.args("small", 8)) == 0);
    const std::string full = read_file(fx.dir + "/big/run/ckpt_000000008.bin");
    CHECK(read_file(fx.dir + "/small/run/ckpt_000000008.bin") == full);
    std::vector<std::string> a = fx.args("resumed", 8);
    a.insert(a.end(), {"--resume", fx.dir + "/big/run/ckpt_000000004.bin"});
    REQUIRE(run_train(a) == 0);
    unsetenv("LLMC_STAGING_ELEMS");
    CHECK(read_file(fx.dir + "/resumed/run/ckpt_000000008.bin") == full);
    // an explicit offload resume of the chunked checkpoint: the same bytes again
    std::vector<std::string> b = fx.args("offload", 8);
    b.insert(b.end(), {"--resume", fx.dir + "/small/run/ckpt_000000004.bin", "--offload", "optimizer"});
    REQUIRE(run_train(b) == 0);
    CHECK(read_file(fx.dir + "/offload/run/ckpt_000000008.bin") == full);
}

TEST_CASE("checkpoint verify pass: corrupt, non-finite and negative-moment files are refused by name; latest skips them") {
    TrainFixture fx;
    REQUIRE(run_train(fx.args("run", 8)) == 0);
    const std::string dir = fx.dir + "/run/run", newest = dir + "/ckpt_000000008.bin";
    const std::string good = read_file(newest);
    const CheckpointContents ck = load_checkpoint(newest);
    const Checkpoint header = verify_checkpoint(CommGroup{}, newest);
    CHECK(header.n_params == ck.params.size());
    CHECK(header.get_int("step", newest) == 8);
    auto refused = [&](const std::string& path, const char* needle) {
        CAPTURE(needle);
        CHECK_THROWS_WITH_AS(verify_checkpoint(CommGroup{}, path), doctest::Contains(needle), LlmcError);
        CHECK_THROWS_WITH_AS(load_checkpoint(path), doctest::Contains(needle), LlmcError);
    };
    // one flipped bit in the data: the checksum
    std::string bytes = good;
    bytes[bytes.size() - 7] ^= 4;
    std::ofstream(fx.dir + "/flip.bin", std::ios::binary) << bytes;
    refused(fx.dir + "/flip.bin", "checksum mismatch");
    // a correctly hashed file with a NaN parameter, a negative second moment
    std::vector<float> p = ck.params, v = ck.adam_v;
    p[5] = NAN;
    save_checkpoint(fx.dir + "/nan.bin", ck, p.data(), ck.adam_m.data(), ck.adam_v.data(), ck.n_params);
    refused(fx.dir + "/nan.bin", "params[5] is nan");
    v[ck.n_params - 1] = -1.0f;
    save_checkpoint(fx.dir + "/neg.bin", ck, ck.params.data(), ck.adam_m.data(), v.data(), ck.n_params);
    refused(fx.dir + "/neg.bin", strfmt("adam v[%llu] is -1", (unsigned long long)ck.n_params - 1).c_str());
    // the newest checkpoint corrupt: an explicit --resume refuses it, naming it; --resume latest
    // takes the one before and continues to the uninterrupted run's bytes
    std::ofstream(newest, std::ios::binary) << bytes;
    std::vector<std::string> a = fx.args("run", 8);
    a.insert(a.end(), {"--resume", newest});
    CHECK_THROWS_WITH_AS(run_train(a), doctest::Contains((newest + ": checksum mismatch").c_str()), LlmcError);
    a.back() = "latest";
    REQUIRE(run_train(a) == 0);
    CHECK(read_file(newest) == good);
}

TEST_CASE("the memory plan's host staging is a chunk, not the table") {
    // d12 and d24 (85M and 325M parameters, each more than a chunk): the same host staging, one
    // chunk per array (3 fp32 + the params' type) plus the batch vectors
    // the CUDA build's plan (bf16) at a ZeRO stage over dp ranks
    auto gpu_plan = [](int zero, int dp) {
        Layout l;
        l.zero_stage = zero;
        l.plan_dp = dp;
        l.elem_bytes = 2;
        return l;
    };
    auto host = [&](int n_layer, int n_embd, int zero, int dp) {
        GPTConfig c;
        c.n_layer = n_layer; c.n_embd = n_embd; c.n_head = n_embd / 64; c.n_kv_head = c.n_head; c.vocab_size = 50257;
        c.max_seq_len = 1024;
        c.finalize();
        return gpt_memory_estimate(c, 1, 64, gpu_plan(zero, dp)).host;
    };
    const double batch = 4.0 * 64 * sizeof(int), chunk = (double)STAGING_ELEMS * (3 * 4 + 2);
    CHECK(host(12, 768, 0, 1) == chunk + batch);
    CHECK(host(24, 1024, 0, 1) == chunk + batch);
    CHECK(host(24, 1024, 3, 8) == chunk + batch);
    // a 70B shape at -z 3 over 8 ranks: the same; the test knob shrinks it; a tiny model: its size
    GPTConfig big;
    big.n_layer = 80; big.n_embd = 8192; big.n_head = 64; big.n_kv_head = 8; big.ffn_hidden = 28672; big.vocab_size = 50257;
    big.finalize();
    CHECK(gpt_memory_estimate(big, 1, 64, gpu_plan(3, 8)).host == chunk + batch);
    setenv("LLMC_STAGING_ELEMS", "1000", 1);
    CHECK(gpt_memory_estimate(big, 1, 64, gpu_plan(3, 8)).host == 1000.0 * 14 + batch);
    unsetenv("LLMC_STAGING_ELEMS");
    GPTConfig tiny = small_config(MLP_SWIGLU, POS_ALIBI);
    GPT m;
    gpt_allocate(m, tiny, 1, 64);
    CHECK(gpt_memory_estimate(tiny, 1, 64).host == (double)staging_cap(m) * (3 * 4 + sizeof(floatX)) + batch);
    CHECK(staging_cap(m) < STAGING_ELEMS);
    gpt_free(m);
}

TEST_CASE("the memory plan per parameter: the model states of every ZeRO stage, the gradient buffers apart") {
    // the CUDA build's plan (bf16 params, fp32 gradients, master and moments) of the ZeRO paper's
    // 7.5B example (Rajbhandari et al. 2020, fig. 1: 36 x 4096, the GPT-2 vocabulary) over N ranks,
    // buffer by buffer from the layout's sizes; per parameter of the padded flat buffer P: -z 0 18 B
    // (param 2 + gradient 4 + master 4 + moments 8), -z 1 6 + 12/N, -z 2 2 + 16/N, -z 3 18/N, and
    // apart from them the gradient buffers (stage 2-3 slots, the reductions' receive buffers, the tied
    // head's micro-batch gradient and its accumulator) and the stage-3 param slots
    GPTConfig c;
    c.n_layer = 36; c.n_embd = 4096; c.n_head = 32; c.n_kv_head = 32; c.vocab_size = 50257; c.max_seq_len = 1024;
    c.finalize();
    auto al = [](double bytes) { return std::ceil(bytes / BUFFER_ALIGN) * BUFFER_ALIGN; };
    const double paper[4] = {120e9, 31.4e9, 16.6e9, 1.9e9};  // the paper's model states at N = 64 (fp16 gradients)
    for (int N : {1, 4, 64})
        for (int zero = 0; zero <= 3; zero++) {
            CAPTURE(N);
            CAPTURE(zero);
            Layout l;
            l.zero_stage = zero;
            l.plan_dp = N;
            l.elem_bytes = 2;
            GPT plan;
            plan.mem.plan_only = true;
            gpt_allocate(plan, c, 1, 64, l);
            const MemoryEstimate e = MemoryEstimate::of(plan.mem);
            const ZeroLayout& z = plan.zero;
            const ZeroLayout& h = plan.head;
            const double P = (double)z.padded_total, own = (double)z.shard_total;
            CHECK(own * N == P);
            // the slots: the parameters' one of the embedding, two of each block half, one of the
            // final LayerNorm; the gradients' the smaller of four of the largest segment (the
            // embedding here) and the same as the parameters'
            CHECK(z.segs[1].name == "h0.attn");
            CHECK(z.segs[2].name == "h0.ffn");
            const double emb = (double)z.segs[0].padded, attn = (double)z.segs[1].padded, ffn = (double)z.segs[2].padded;
            const double final_ln = (double)z.segs.back().padded;
            CHECK(emb == (double)z.max_padded);
            auto slots = [&](double b) { return al(b * emb) + 2 * al(b * attn) + 2 * al(b * ffn) + al(b * final_ln); };
            const double param_slots = zero == 3 ? slots(2.0) : 0.0;
            const double grad_slots = 4 * emb < emb + 2 * attn + 2 * ffn + final_ln ? 4 * al(4.0 * emb) : slots(4.0);
            CHECK(e.params == al(2.0 * (zero == 3 ? own : P)) + param_slots);
            CHECK(e.grads == al(4.0 * (zero >= 2 ? own : P)));
            CHECK(e.master == al(4.0 * (zero >= 1 ? own : P)));
            CHECK(e.moments == 2 * al(4.0 * (zero >= 1 ? own : P)));
            const double reduced = (double)(zero <= 1 ? z.max_padded : z.max_leaves);
            // the head's accumulator: per rank, the whole head; per micro-batch (-z 2/3, N > 1), none
            const double head_acc = zero <= 1 ? al(4.0 * h.padded_total) : N > 1 ? 0.0 : al(4.0 * h.shard_len(0));
            CHECK(e.grad_buffers == head_acc + al(4.0 * h.padded_total) +
                                        (N > 1 ? al(4.0 * std::max(reduced, (double)h.max_padded)) : 0.0) +
                                        (N > 1 ? al(4.0 * reduced) : 0.0) +  // (the second receive buffer)
                                        (zero >= 2 ? grad_slots : 0.0));
            const double states = e.params - param_slots + e.grads + e.master + e.moments;
            const double per_param[4] = {18.0, 6 + 12.0 / N, 2 + 16.0 / N, 18.0 / N};
            CHECK(states / P <= per_param[zero] + 1e-6);
            CHECK(states / P >= per_param[zero] - 1e-6);
            if (N == 64) {
                // the paper's figure plus our fp32 gradients' 2 more bytes per parameter (per rank's
                // share at -z 2-3), within 10%
                const double fp32 = (zero <= 1 ? 2.0 : 2.0 / N) * 7.5e9;
                CHECK(std::fabs(states - (paper[zero] + fp32)) <= 0.1 * (paper[zero] + fp32));
                MESSAGE(strfmt("7.5B shape, N 64, -z %d: model states %.1f GB (the paper %.1f + fp32 gradients %.2f), "
                               "gradient buffers %.2f GB, param slots %.2f GB", zero, states / 1e9, paper[zero] / 1e9,
                               fp32 / 1e9, e.grad_buffers / 1e9, param_slots / 1e9));
            }
        }
}

TEST_CASE("bad input: each a clear error") {
    TrainFixture fx;
    const std::string d = fx.dir;
    auto fails_with = [&](std::vector<std::string> args, const char* needle) {
        CAPTURE(needle);
        CHECK_THROWS_WITH_AS(run_train(args), doctest::Contains(needle), LlmcError);
    };
    auto with = [&](std::vector<std::string> a, std::vector<std::string> extra) {
        a.insert(a.end(), extra.begin(), extra.end());
        return a;
    };
    std::vector<std::string> base = fx.args("bad", 2);

    write_shard(d + "/magic_000.bin", synthetic_tokens(3000, 1), 257, 256, 2, "GPT2SHRD");
    fails_with(with(base, {"--train", d + "/magic_*.bin"}), "magic is \"GPT2SHRD\", expected \"LLMCSHRD\"");

    write_shard(d + "/trunc_000.bin", synthetic_tokens(3000, 1), 257, 256, 2, "LLMCSHRD", 4000);
    fails_with(with(base, {"--train", d + "/trunc_*.bin"}), "truncated: header says 4000 tokens");

    // ids are checked in the rows served (the position named: "data loader: a bad token id ..."):
    // a bad one in every row, so the first micro-batch stops
    std::vector<int> big = synthetic_tokens(3000, 1);
    for (size_t i = 5; i < big.size(); i += 16) big[i] = 300;
    write_shard(d + "/vocab_000.bin", big, 257);
    fails_with(with(base, {"--train", d + "/vocab_*.bin"}), "has id 300, but the model's vocab_size is 257");
    write_shard(d + "/vocab2_000.bin", synthetic_tokens(3000, 1), 50257, 256);
    fails_with(with(base, {"--train", d + "/vocab2_*.bin"}), "shard vocab_size 50257 is larger than the model's vocab_size 257");

    write_shard(d + "/width_000.bin", synthetic_tokens(3000, 1), 257, 256, 3);
    fails_with(with(base, {"--train", d + "/width_*.bin"}), "token width 3 bytes, expected 2 or 4");

    fails_with(with(base, {"--train", d + "/nothing_*.bin"}), "--train: no files match");
    fails_with(with(base, {"-d", "100"}), "--total_batch_tokens 100 is not a multiple of B*T*ranks = 2*32*1 = 64");
    fails_with(with(base, {"--n_kv_head", "3"}), "--n_kv_head 3 must divide --n_head 4");
    fails_with(with(base, {"--mlp", "relu"}), "--mlp: expected swiglu or gelu");
    fails_with(with(base, {"--lr", "fast"}), "--lr: expected a number");
    fails_with(with(base, {"--bogus", "1"}), "unknown flag '--bogus' (run with -h");
    fails_with(with(base, {"--batch-size", "4"}), "unknown flag '--batch-size', did you mean --batch_size?");
    fails_with(with(base, {"--max_step", "4"}), "unknown flag '--max_step', did you mean --max_steps?");
    fails_with(with(base, {"--resume", d + "/missing.bin"}), "missing.bin: cannot open");

    REQUIRE(run_train(fx.args("ok", 4)) == 0);
    const std::string ck = d + "/ok/run/ckpt_000000004.bin";
    fails_with(with(fx.args("ok", 6), {"--resume", ck, "--n_layer", "3"}),
               "checkpoint has n_layer = 2 but the flags ask for 3");
    fails_with(with(fx.args("ok", 6), {"--resume", ck, "-b", "1", "-d", "64"}),
               "checkpoint was trained with --batch_size 2, this run has 1");
    std::string bytes = read_file(ck);
    std::ofstream(d + "/cut.bin", std::ios::binary) << bytes.substr(0, bytes.size() - 100);
    fails_with(with(fx.args("ok", 6), {"--resume", d + "/cut.bin"}), "expected");

    // the binary itself: message on stderr, exit code 1
    REQUIRE_MESSAGE(file_exists("./train_gpt_cpu"), "run the tests from the repository root after make train_gpt_cpu");
    std::string cmd = "./train_gpt_cpu --train '" + d + "/magic_*.bin' --out_dir " + d + "/bin > " + d +
                      "/stdout.txt 2> " + d + "/stderr.txt";
    int status = system(cmd.c_str());
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 1);
    CHECK(read_file(d + "/stderr.txt").find("error: " + d + "/magic_000.bin: not a token shard") != std::string::npos);
}

TEST_CASE("multi-process: a build without MPI refuses to run as N copies; ZeRO slices cover every element once") {
    // what mpirun would announce to a binary without MPI
    setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
    Comm& c = comm_world();
    const bool was = c.initialized;
    c.initialized = false;
    CHECK_THROWS_WITH_AS(comm_init(nullptr, nullptr), doctest::Contains("built without MPI but was started as one of 4"),
                         LlmcError);
    unsetenv("OMPI_COMM_WORLD_SIZE");
    comm_init(nullptr, nullptr);
    c.initialized = was || c.initialized;

    // for any dp x tp (ep) and stage: the ranks' checkpoint slices cover every table element once,
    // and their update pieces cover every element of a tensor (once per tp rank holding a replica,
    // and at stage 0 once per dp rank)
    GPTConfig cfg;
    cfg.n_layer = 3; cfg.n_embd = 28; cfg.n_head = 4; cfg.n_kv_head = 2; cfg.ffn_hidden = 52; cfg.max_seq_len = 16;
    cfg.n_expert = 4; cfg.moe_every = 2; cfg.expert_hidden = 44;
    cfg.finalize();
    const std::vector<ParamTensor> table = build_param_table(cfg);
    const size_t n = count_params(table);
    for (int tp : {1, 2, 4})
        for (int dp = 1; dp <= 5; dp++)
            for (int ep : {1, 2, 4}) {
                if (dp % ep != 0) continue;
                for (int stage = 0; stage <= 3; stage++) {
                    CAPTURE(tp);
                    CAPTURE(dp);
                    CAPTURE(ep);
                    CAPTURE(stage);
                    std::vector<int> updated(n, 0), written(n, 0), holders(n, 0);
                    for (int t = 0; t < tp; t++)
                        for (int r = 0; r < dp; r++) {
                            GPT m;
                            m.config = cfg;
                            m.table = table;
                            m.ls = local_shape(cfg, tp, t, false, ep, r % ep);
                            m.local = local_param_table(cfg, table, m.ls, m.pieces);
                            std::vector<TensorRange> tensors;
                            for (const ParamTensor& p : m.local) tensors.push_back({p.offset, p.numel, p.decay});
                            m.zero = zero_layout(segment_specs(cfg, m.local, ep), count_params(m.local), stage, dp, r, dp / ep,
                                                 r / ep);
                            m.table_padding = tp_table_padding(m, single_stage_plan(cfg));
                            for (const UpdatePiece& u : table_update_pieces(zero_update_pieces(m.zero, tensors), m.pieces))
                                for (size_t k = 0; k < u.n; k++) updated[u.table_offset + k]++;
                            if (r < ep)  // one ep group: each table element's holders
                                for (const TablePiece& p : m.pieces)
                                    for (size_t k = 0; k < p.len; k++) holders[p.global + k]++;
                            std::vector<float> shard(m.zero.shard_total, 0.0f), values;
                            std::vector<CheckpointRange> ranges;
                            own_table_slices(m, shard.data(), ranges, values);
                            for (const CheckpointRange& rg : ranges)
                                for (size_t k = 0; k < rg.n; k++) written[rg.begin + k]++;
                        }
                    std::vector<int> in_tensor(n, 0), expert(n, 0);
                    for (const ParamTensor& t : table)
                        for (size_t k = 0; k < t.numel; k++) {
                            in_tensor[t.offset + k] = 1;
                            expert[t.offset + k] = is_expert_tensor(t.name);
                        }
                    for (size_t i = 0; i < n; i++) {
                        CHECK(written[i] == 1);  // each element written once
                        if (!in_tensor[i]) continue;
                        // holders: the tp ranks holding it, times the ranks of one ep group that do
                        // (all ep of them for a dense tensor, one for an expert's); each holder's dp
                        // (expert: expert-dp) group updates it once, at stage 0 each of its ranks
                        const int tp_holders = expert[i] ? holders[i] : holders[i] / ep;
                        const int group = expert[i] ? dp / ep : dp;
                        CHECK(tp_holders >= 1);
                        CHECK(updated[i] == tp_holders * (stage == 0 ? group : 1));
                    }
                }
            }
}

TEST_CASE("lm head token chunks: losses, logits and gradients of any chunk match the whole micro-batch's") {
    // The classifier over token chunks (head_forward): per-token statistics, so the losses and the
    // logits are row for row the unchunked ones (bitwise); the head's weight gradient folds the
    // chunks' sums in chunk order and the gradient at the final LayerNorm is per token, so every
    // gradient is the unchunked one to fp32 rounding. Chunks: 7 and 16 (not dividing B*T = 39), 1,
    // and B*T itself (the unchunked math, also the default for this vocabulary).
    const GPTConfig c = small_config(MLP_SWIGLU, POS_ALIBI, 4, 2);
    const int B = 3, T = 13, BT = B * T;
    std::vector<int> in(BT), tg(BT), ds(BT);
    Rng rng(41);
    for (int i = 0; i < BT; i++) {
        in[i] = (int)(rng.next_u64() % c.vocab_size);
        tg[i] = i % 5 == 3 ? -1 : (int)(rng.next_u64() % c.vocab_size);  // some ignored targets
    }
    for (int b = 0; b < B; b++) compute_doc_start(ds.data() + b * T, in.data() + b * T, T, 256);
    struct Result {
        float loss;
        std::vector<float> losses, logits, grads;
    };
    auto run = [&](int chunk) {
        Layout l;
        l.logits_chunk = chunk;
        GPT m;
        gpt_allocate(m, c, B, T, l);
        gpt_init_params(m, 9);
        Result r;
        r.logits = gpt_logits(m, in.data(), ds.data(), B, T);
        gpt_zero_grad(m);
        r.loss = gpt_forward(m, in.data(), tg.data(), ds.data(), B, T, 0.5f);
        r.losses.assign(m.losses, m.losses + (size_t)B * T);  // (the CPU build's buffers are host memory)
        gpt_backward(m);
        r.grads = gpt_grads(m);
        gpt_free(m);
        return r;
    };
    REQUIRE(logits_chunk_tokens(c, 0, BT, 0) == BT);  // (the default: a small vocabulary's budget holds B*T tokens)
    const Result whole = run(BT);
    for (int chunk : {7, 16, 1, 0}) {
        CAPTURE(chunk);
        const Result got = run(chunk);
        CHECK(got.losses == whole.losses);
        CHECK(got.loss == whole.loss);
        CHECK(got.logits == whole.logits);
        double max_err = 0, max_ref = 0, err2 = 0, ref2 = 0;
        for (size_t i = 0; i < whole.grads.size(); i++) {
            const double e = std::fabs((double)got.grads[i] - whole.grads[i]);
            max_err = std::max(max_err, e);
            max_ref = std::max(max_ref, (double)std::fabs(whole.grads[i]));
            err2 += e * e;
            ref2 += (double)whole.grads[i] * whole.grads[i];
        }
        MESSAGE("chunk " << chunk << ": gradients max err / max " << max_err / max_ref << ", rel L2 " << std::sqrt(err2 / ref2));
        CHECK(max_ref > 0);
        CHECK(max_err <= 1e-5 * max_ref);
        CHECK(std::sqrt(err2 / ref2) <= 1e-6);
    }
}

// GPT-2 124M (-e gpt2:124M): the lm head's shape the chunk tests below plan
static GPTConfig gpt2_124m() {
    GPTConfig c;
    c.n_layer = 12; c.n_embd = 768; c.n_head = 12; c.n_kv_head = 12; c.vocab_size = 50257; c.max_seq_len = 1024;
    c.mlp = MLP_GELU; c.pos = POS_LEARNED;
    c.finalize();
    return c;
}
// the devices' total memory as run_device_total_bytes reads it (nvidia-smi's MiB), and a 24 GiB card
constexpr double H200_TOTAL = 143771.0 * 1048576.0, H100_TOTAL = 81559.0 * 1048576.0, CARD_24G = 24.0 * 1073741824.0;

TEST_CASE("dense weight gradients split over B*T by the whole weight's tiles: the same decision in every tp layout") {
    const GPTConfig c = gpt2_124m();
    const int BT = 32 * 1024;
    const LocalShape whole = local_shape(c, 1, 0, false);
    // GPT-2 124M at B 32 x T 1024 (132 SMs): the attention projection (36 tiles) splits; qkv (108), the FFN not
    CHECK(dense_dweight_split(c, whole, BT, DW_ATTN_PROJ));
    CHECK(!dense_dweight_split(c, whole, BT, DW_QKV));
    CHECK(!dense_dweight_split(c, whole, BT, DW_FC));
    CHECK(!dense_dweight_split(c, whole, BT, DW_FC_PROJ));
    CHECK(!dense_dweight_split(c, whole, 8 * 1024, DW_ATTN_PROJ));
    for (int tp : {2, 4})
        for (int rank = 0; rank < tp; rank++) {
            const LocalShape ls = local_shape(c, tp, rank, false);
            for (int w = 0; w < DW_COUNT; w++)
                CHECK(dense_dweight_split(c, ls, BT, (DenseWeight)w) == dense_dweight_split(c, whole, BT, (DenseWeight)w));
            // the rank's partials are its slice's: qkv's output and the projection's input split by tp
            CHECK(dense_weight_shape(c, ls, DW_QKV, false).OC * tp == dense_weight_shape(c, whole, DW_QKV, true).OC);
            CHECK(dense_weight_shape(c, ls, DW_ATTN_PROJ, false).C * tp == dense_weight_shape(c, whole, DW_ATTN_PROJ, true).C);
        }
}

TEST_CASE("lm head token chunks: GPT-2 124M at B 32 x T 1024 plans one chunk's logits, not the micro-batch's") {
    // no device known (the CPU build): the constant 128 MiB budget, 1024 tokens of GPT-2's 50304 columns
    const GPTConfig c = gpt2_124m();
    const int B = 32, T = 1024, BT = B * T, Vp = c.padded_vocab_size;
    const int chunk = logits_chunk_tokens(c, 0, BT, 0);
    CHECK(chunk == 1024);
    CHECK((double)chunk * logits_chunk_token_bytes(c) <= LOGITS_CHUNK_BYTES);  // bf16: 98 MiB, against 3.1 GiB for the micro-batch
    CHECK(2.0 * chunk * logits_chunk_token_bytes(c) > LOGITS_CHUNK_BYTES);     // the largest power of two that fits
    for (size_t elem : {(size_t)2, sizeof(float)}) {  // the CUDA build's plan and the CPU build's
        CAPTURE(elem);
        Layout l;
        l.plan_dp = 1;
        l.elem_bytes = elem;
        const double chunked = gpt_memory_estimate(c, B, T, l).activations;
        l.logits_chunk = BT;  // the whole micro-batch in one chunk: what the head held before
        const double whole = gpt_memory_estimate(c, B, T, l).activations;
        // exactly the logits rows and the three per-token softmax statistics of the tokens past the chunk
        const double saved = (double)(BT - chunk) * Vp * elem + 3.0 * (BT - chunk) * sizeof(float);
        // the CPU build's canonical vocabulary leaves also copy dlogits columns (tp_copy_a), now a chunk's
        // rows at most, below the widest block operand (the FFN's 4C columns of all B*T tokens)
        const bool copies = elem == sizeof(float);
        const double copy_saved = ((double)BT * Vp - std::max((double)BT * 4 * c.n_embd, (double)chunk * Vp)) * elem;
        CHECK(whole - chunked == saved + (copies ? copy_saved : 0.0));
        // the device's budget (an H200) plans the same buffers as --logits_chunk B*T: the plan counts the chunk
        l.logits_chunk = 0;
        l.device_total_bytes = H200_TOTAL;
        const MemoryEstimate e = gpt_memory_estimate(c, B, T, l);
        CHECK(e.activations == whole);
        // a plan that does not fit names --logits_chunk with the activations (the logits are in them)
        CHECK_THROWS_WITH_AS(check_plan_fits(e, B, T, OFFLOAD_NONE, elem == sizeof(float), 0.5 * e.buffers(), "a card",
                                             -1, ""),
                             doctest::Contains("--logits_chunk N"), LlmcError);
    }
}

TEST_CASE("lm head token chunks: the default grows with the device's memory, never past B*T, and --logits_chunk overrides") {
    // 1/32 of the card's total memory over 2 Vp + 12 bytes per token (100620 for GPT-2), the largest power
    // of two: H200 (140.4 GiB -> 4.39 GiB) 32768 tokens, the whole d12 B 32 x T 1024 micro-batch in one
    // chunk instead of 32 (llmc/gpt/layout.h: 14.8 GB less HBM traffic of the head's weights and fp32
    // gradient per micro-batch); H100 80GB 16384 (2 chunks); a 24 GiB card 4096 (8 chunks)
    const GPTConfig c = gpt2_124m();
    const int64_t BT = 32 * 1024;
    CHECK(logits_chunk_tokens(c, 0, BT, H200_TOTAL) == 32768);
    CHECK(logits_chunk_tokens(c, 0, BT, H100_TOTAL) == 16384);
    CHECK(logits_chunk_tokens(c, 0, BT, CARD_24G) == 4096);
    CHECK(logits_chunk_tokens(c, 0, BT, 0) == 1024);
    int last = 0;
    for (double gib = 1; gib <= 1024; gib *= 1.5) {  // monotone in the budget, within it, the largest power of two
        CAPTURE(gib);
        const double dev = gib * 1073741824.0, budget = logits_chunk_budget(dev);
        const int n = logits_chunk_tokens(c, 0, int64_t(1) << 40, dev);
        CHECK(n >= last);
        CHECK((n & (n - 1)) == 0);
        CHECK((n == 1 || n * logits_chunk_token_bytes(c) <= budget));
        CHECK(2.0 * n * logits_chunk_token_bytes(c) > budget);
        last = n;
    }
    // capped at B*T: a micro-batch of up to B*T tokens is still cut as by the uncapped power of two
    // (one chunk), B*T a power of two or not
    for (int64_t bt : {1, 1000, 3000, 4096, 24576, 32768, 65536, 3 * 32768 + 5}) {
        CAPTURE(bt);
        const int n = logits_chunk_tokens(c, 0, bt, H200_TOTAL);
        CHECK(n == std::min<int64_t>(bt, 32768));
        CHECK(logits_rows(n, (size_t)bt) == (size_t)n);
    }
    // a larger vocabulary: fewer tokens per chunk for the same budget (128k: 16384 on an H200, 512 without)
    GPTConfig big = c;
    big.vocab_size = 128256;
    big.finalize();
    CHECK(logits_chunk_tokens(big, 0, BT, H200_TOTAL) == 16384);
    CHECK(logits_chunk_tokens(big, 0, BT, 0) == 512);
    // --logits_chunk N: that many, whatever the device or B*T
    CHECK(logits_chunk_tokens(c, 13, BT, H200_TOTAL) == 13);
    CHECK(logits_chunk_tokens(c, 1 << 20, BT, 0) == 1 << 20);
    CHECK_THROWS_AS(logits_chunk_tokens(c, -1, BT, 0), LlmcError);
}

TEST_CASE("--device cards: the table's names, the measured H100 / H200 figures, 24 GB cards' lm head chunk") {
    std::set<std::string> names;
    for (const GpuCard& card : GPU_CARDS) {
        CAPTURE(card.name);
        CHECK(&gpu_card(card.name) == &card);  // every card parses
        CHECK(names.insert(card.name).second);
        // free after the context: below the total; estimated ones the total less 0.55 GiB, rounded down to 0.1
        CHECK(card.free_bytes() < card.total_bytes());
        if (!card.free_measured) {
            const double est = card.total_mib / 1024.0 - 0.55;
            CHECK(card.free_gib <= est);
            CHECK(card.free_gib > est - 0.1);
        }
        CHECK(card.bf16 == (card.cc_major >= 8));  // bf16 tensor cores from sm_80
        CHECK(card.sms > 0);
        CHECK(card.peak_tflops > 0);
        // the CUDA build finds it by its driver name (the word, the compute capability, the SM count)
        const std::string driver_name = std::string("NVIDIA GeForce RTX ") + card.match + " card";
        CHECK(gpu_peak_flops(driver_name.c_str(), card.cc_major, card.cc_minor, card.sms) ==
              doctest::Approx(card.peak_tflops * 1e12));
    }
    CHECK_THROWS_WITH_AS(gpu_card("a100"),
                         "--device: expected one of t4, v100-16, v100-32, a100-40, a100-80, l4, rtx3090, rtx4090, a6000, "
                         "h100, h200, got 'a100'", LlmcError);
    // the measured figures the earlier --device h200 / h100 planned with, unchanged
    CHECK(gpu_card("h200").total_bytes() == H200_TOTAL);
    CHECK(gpu_card("h100").total_bytes() == H100_TOTAL);
    CHECK(gpu_card("h200").free_bytes() == 139.8 * 1073741824.0);
    CHECK(gpu_card("h100").free_bytes() == 79.1 * 1073741824.0);
    CHECK(gpu_card("h200").sms == 132);
    CHECK(gpu_card("h100").sms == 132);
    // the lm head's chunk of GPT-2's vocabulary (1/32 of the total over 100620 bytes a token): 4096 on
    // every 24 GB card and on the 16 GB ones, 8192 on 32-48 GB, 16384 on 80 GB, 32768 on the H200
    const GPTConfig c = gpt2_124m();
    const int64_t BT = 32 * 1024;
    for (const char* n : {"l4", "rtx3090", "rtx4090", "t4", "v100-16"}) CHECK(logits_chunk_tokens(c, 0, BT, gpu_card(n).total_bytes()) == 4096);
    for (const char* n : {"v100-32", "a100-40", "a6000"}) CHECK(logits_chunk_tokens(c, 0, BT, gpu_card(n).total_bytes()) == 8192);
    for (const char* n : {"a100-80", "h100"}) CHECK(logits_chunk_tokens(c, 0, BT, gpu_card(n).total_bytes()) == 16384);
    CHECK(logits_chunk_tokens(c, 0, BT, gpu_card("h200").total_bytes()) == 32768);
}

TEST_CASE("--device cards: the CUDA build's MFU peak by driver name, compute capability and SM count") {
    CHECK(gpu_peak_flops("NVIDIA H100 80GB HBM3", 9, 0, 132) == 989.4e12);
    CHECK(gpu_peak_flops("NVIDIA H200", 9, 0, 132) == 989.4e12);
    CHECK(gpu_peak_flops("NVIDIA A100-SXM4-40GB", 8, 0, 108) == 312e12);
    CHECK(gpu_peak_flops("NVIDIA A100 80GB PCIe", 8, 0, 108) == 312e12);
    CHECK(gpu_peak_flops("NVIDIA GeForce RTX 4090", 8, 9, 128) == doctest::Approx(165.2e12));
    CHECK(gpu_peak_flops("NVIDIA GeForce RTX 3090", 8, 6, 82) == 71e12);
    CHECK(gpu_peak_flops("NVIDIA RTX A6000", 8, 6, 84) == doctest::Approx(154.8e12));
    CHECK(gpu_peak_flops("NVIDIA L4", 8, 9, 58) == 121e12);
    CHECK(gpu_peak_flops("Tesla T4", 7, 5, 40) == 65e12);
    CHECK(gpu_peak_flops("Tesla V100-SXM2-32GB", 7, 0, 80) == 125e12);
    // a MIG slice: its share of the card's SMs at the card's clocks
    CHECK(gpu_peak_flops("NVIDIA A100-SXM4-40GB MIG 3g.20gb", 8, 0, 42) == doctest::Approx(312e12 * 42 / 108));
    // not in the table: no MFU rather than another card's peak
    CHECK(gpu_peak_flops("NVIDIA L40S", 8, 9, 142) == 0);          // not the L4
    CHECK(gpu_peak_flops("NVIDIA H100 PCIe", 9, 0, 114) == 0);      // fewer SMs at other clocks
    CHECK(gpu_peak_flops("NVIDIA GeForce RTX 4090 D", 8, 9, 114) == 0);
    CHECK(gpu_peak_flops("NVIDIA RTX A1000", 8, 6, 84) == 0);       // not the A100 (nor an sm_80)
    CHECK(gpu_peak_flops("NVIDIA GeForce RTX 3080", 8, 6, 68) == 0);
    // the plan's SM count: an H100's without a card named, the card's inside a plan, restored after
    CHECK(plan_sm_count() == 132);
    {
        const PlanCardScope t4(gpu_card("t4").sms);
        CHECK(plan_sm_count() == 40);
    }
    CHECK(plan_sm_count() == 132);
}

TEST_CASE("lm head token chunks: the default is the same in every layout on a device (the head's fold order)") {
    // The head's gradient folds the chunks in chunk order, and the layouts are bitwise one process's:
    // the default chunk reads the model, B*T and the card's total memory, never -z, --pp, --tp, --sp,
    // -r, --offload or what the rest of the plan takes. Each layout's plan (the CUDA build's, bf16)
    // on an H200 and on a 24 GiB card: the chunk of one process.
    const GPTConfig c = gpt2_124m();
    const int B = 8, T = 1024;
    for (double dev : {H200_TOTAL, CARD_24G}) {
        CAPTURE(dev);
        const int want = logits_chunk_tokens(c, 0, (int64_t)B * T, dev);
        CHECK(want == (dev == H200_TOTAL ? B * T : 4096));
        std::vector<Layout> layouts;
        for (int zero = 0; zero <= 3; zero++)
            for (int r = 0; r <= 2; r++)
                for (int dp : {1, 4}) {
                    Layout l;
                    l.zero_stage = zero;
                    l.recompute = r;
                    l.plan_dp = dp;
                    l.offload = zero == 1 && r == 0 ? OFFLOAD_OPTIMIZER : OFFLOAD_NONE;
                    layouts.push_back(l);
                }
        Layout tp;  // tensor parallel with sequence parallelism
        tp.plan_dp = 2;
        tp.plan_tp = 2;
        tp.sp = true;
        layouts.push_back(tp);
        for (int z : {0, 3}) {  // the last of two pipeline stages (the head's), -z 0 and 3
            Layout pp;
            pp.zero_stage = z;
            pp.plan_dp = 2;
            pp.pipe = pipeline_plan(c, B, T, 2, 1, 4, PIPE_1F1B, "", 1);
            layouts.push_back(pp);
        }
        for (Layout l : layouts) {
            CAPTURE(l.zero_stage);
            CAPTURE(l.recompute);
            CAPTURE(l.plan_dp);
            CAPTURE(l.plan_tp);
            l.elem_bytes = 2;
            l.device_total_bytes = dev;
            GPT plan;
            plan.mem.plan_only = true;
            gpt_allocate(plan, c, B, T, l);
            CHECK(plan.logits_chunk == want);
        }
    }
}

// What test_gpu's launch-count test (test/gpu/model.cuh) expects of the host side, checked here
// where CI runs it: the ZeRO segments are the embedding, each block's attention and FFN halves, each
// MoE layer's experts and the final LayerNorm; on one rank no stage defers the update into the next
// forward (the gradient gathers that stage 0 waits on are for groups of several ranks only).
TEST_CASE("one rank: 2L + 2 segments (+ the experts), and gpt_apply_update runs the whole update at every -z") {
    for (int moe = 0; moe <= 1; moe++)
        for (int stage = 0; stage <= 3; stage++) {
            CAPTURE(moe);
            CAPTURE(stage);
            GPTConfig c = small_config(MLP_SWIGLU, POS_ALIBI);
            if (moe) {
                c.n_expert = 2;
                c.moe_every = 2;
                c.finalize();
            }
            const int B = 2, T = 16, L = c.n_layer;
            Layout layout;
            layout.zero_stage = stage;
            GPT m;
            gpt_allocate(m, c, B, T, layout);
            gpt_init_params(m, 3);
            CHECK(m.zero.segs.size() == (size_t)(2 * L + 2 + (moe ? L / 2 : 0)));
            std::vector<int> tokens = synthetic_tokens(B * T + 1, 7), in(B * T), tgt(B * T), ds(B * T);
            for (int i = 0; i < B * T; i++) { in[i] = tokens[i]; tgt[i] = tokens[i + 1]; }
            for (int b = 0; b < B; b++) compute_doc_start(ds.data() + b * T, in.data() + b * T, T, 256);
            const OptimizerConfig opt;
            for (int step = 0; step < 2; step++) {
                gpt_zero_grad(m);
                gpt_pipeline_step(m, {{in.data(), tgt.data(), ds.data()}}, B, T, 1.0f, false, nullptr);
                const float norm = gpt_grad_norm(m);
                take_losses(m);
                gpt_apply_update(m, opt, 1e-3f, step, norm);
                CHECK(m.zs.n_pending == 0);
                CHECK(m.zs.grad_gathers.empty());
            }
            gpt_free(m);
        }
}
