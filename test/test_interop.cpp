// Interoperability: llm.c's GPT-2 model files, token shards and tokenizer files, our
// BPE vocabulary file, the GPT-2 presets and the step log's tokens. The llm.c files are written
// here byte by byte from the documented layout (llmc/io/llmc_format.h, llmc/io/dataloader.h,
// llmc/io/tokenizer.h), independently of the code under test.
#define LLMC_CPU
#define LLMC_NO_MAIN
#include "../train_gpt.cu"

#include "test_util.h"

#include <doctest/doctest.h>
#include <fstream>
#include <sstream>

namespace {

using test_util::make_temp_dir;
using test_util::read_file;
using test_util::run_train;
using test_util::synthetic_tokens;
using test_util::write_shard;

void write_bytes(const std::string& path, const std::string& bytes) {
    std::ofstream f(path, std::ios::binary);
    f.write(bytes.data(), (std::streamsize)bytes.size());
    REQUIRE(f.good());
}
template <class T>
void append(std::string& out, const T& v) {
    out.append((const char*)&v, sizeof(T));
}
std::string header_of(std::vector<int32_t> words) {
    words.resize(256, 0);
    return std::string((const char*)words.data(), 1024);
}

// A tiny GPT-2 in llm.c's layout: L 2, C 16, NH 2, maxT 16, V 200 padded to 256 (our padding too).
struct TinyLlmc {
    int maxT = 16, V = 200, L = 2, NH = 2, C = 16, Vp = 256;
    std::vector<float> values;  // llm.c order
    size_t count() const { return (size_t)Vp * C + (size_t)maxT * C + (size_t)L * (12 * C * C + 13 * C) + 2 * C; }
    explicit TinyLlmc(uint64_t seed) {
        test_util::Rng r(seed);
        values.resize(count());
        for (float& v : values) v = (float)r.uni(-0.3, 0.3);
        // LayerNorm weights near 1, so the activations stay in a useful range
        size_t at = (size_t)Vp * C + (size_t)maxT * C;
        for (int l = 0; l < L; l++) values[at + l * C] += 1.0f;  // one element is enough to be non-trivial
    }
    std::string file(int version = 3) const {
        std::string out = header_of({20240326, version, maxT, V, L, NH, C, Vp});
        for (float v : values) {
            if (version == 5) {
                uint32_t bits;
                memcpy(&bits, &v, 4);
                append(out, (uint16_t)(bits >> 16));  // truncation: any bf16 value will do for the test
            } else {
                append(out, v);
            }
        }
        return out;
    }
    // The same weights in our parameter table, placed by the documented llm.c layout (offsets
    // computed here from the tensor list, not by llmc_file_order).
    std::vector<float> in_table(const GPT& m, bool bf16 = false) const {
        std::vector<float> v = values;
        if (bf16)
            for (float& x : v) {
                uint32_t bits;
                memcpy(&bits, &x, 4);
                bits &= 0xFFFF0000u;
                memcpy(&x, &bits, 4);
            }
        const size_t c = C;
        const size_t sizes[16] = {Vp * c, maxT * c, L * c, L * c, L * 3 * c * c, L * 3 * c, L * c * c, L * c, L * c, L * c,
                                  L * 4 * c * c, L * 4 * c, L * 4 * c * c, L * c, c, c};
        const char* names[16] = {"wte", "wpe", "ln1.w", "ln1.b", "attn.qkv.w", "attn.qkv.b", "attn.proj.w", "attn.proj.b",
                                 "ln2.w", "ln2.b", "mlp.fc.w", "mlp.fc.b", "mlp.proj.w", "mlp.proj.b", "lnf.w", "lnf.b"};
        std::vector<float> table(m.n_params, 0.0f);
        size_t base = 0;
        for (int k = 0; k < 16; k++) {
            const bool stacked = k >= 2 && k < 14;
            const size_t per = stacked ? sizes[k] / L : sizes[k];
            for (int l = 0; l < (stacked ? L : 1); l++) {
                const std::string name = stacked ? "h" + std::to_string(l) + "." + names[k] : names[k];
                const ParamTensor* t = nullptr;
                for (const ParamTensor& p : m.table) if (p.name == name) t = &p;
                REQUIRE_MESSAGE(t, name);
                REQUIRE(t->numel == per);
                std::copy(v.begin() + base + l * per, v.begin() + base + (l + 1) * per, table.begin() + t->offset);
            }
            base += sizes[k];
        }
        std::fill(table.begin() + (size_t)V * C, table.begin() + (size_t)Vp * C, 0.0f);  // our zero padding rows
        return table;
    }
};

std::vector<float> logits_of(GPT& m, const std::vector<int>& in, int B, int T) {
    std::vector<int> ds(in.size());
    for (int b = 0; b < B; b++) compute_doc_start(ds.data() + b * T, in.data() + b * T, T, 199);
    return gpt_logits(m, in.data(), ds.data(), B, T);
}

std::vector<int> some_tokens(int n, int V, uint64_t seed) {
    test_util::Rng r(seed);
    std::vector<int> t(n);
    for (int& x : t) x = r.randint(0, V - 1);
    return t;
}

void fails_with(const std::function<void()>& f, const std::string& needle) {
    CAPTURE(needle);
    CHECK_THROWS_WITH_AS(f(), doctest::Contains(needle.c_str()), LlmcError);
}

// Byte shards and the flags of a tiny GPT-2-shaped run.
struct Gpt2Run {
    std::string dir = make_temp_dir("llmc_interop_");
    Gpt2Run() {
        write_shard(dir + "/tr_000.bin", synthetic_tokens(4000, 5));
        write_shard(dir + "/va_000.bin", synthetic_tokens(1000, 6));
    }
    std::vector<std::string> args(const std::string& out, int steps, std::vector<std::string> extra = {}) const {
        std::vector<std::string> a = {"--train", dir + "/tr_*.bin", "--val", dir + "/va_*.bin", "--out_dir",
                                      dir + "/" + out, "--n_layer", "2", "--n_embd", "32", "--n_head", "4",
                                      "--mlp", "gelu", "--pos", "learned", "--max_seq_len", "64", "-b", "2", "-t",
                                      "32", "--max_steps", std::to_string(steps), "--warmup", "2", "--val_every", "0",
                                      "--val_batches", "2", "--sample_len", "0"};
        a.insert(a.end(), extra.begin(), extra.end());
        return a;
    }
};

}  // namespace

TEST_CASE("llm.c model file: a hand-built model loads with GPT-2's config; its forward equals our own layout's") {
    const std::string d = make_temp_dir("llmc_model_");
    TinyLlmc tiny(11);
    for (int version : {3, 5}) {
        CAPTURE(version);
        const std::string path = d + "/tiny_v" + std::to_string(version) + ".bin";
        write_bytes(path, tiny.file(version));
        LlmcModelFile f = read_llmc_model(path);
        CHECK(f.version == version);
        GPTConfig c = config_from_llmc(f.shape, path);
        CHECK(c.vocab_size == 200);
        CHECK(c.padded_vocab_size == 256);
        CHECK(c.n_layer == 2);
        CHECK(c.n_embd == 16);
        CHECK(c.n_head == 2);
        CHECK(c.n_kv_head == 2);
        CHECK(c.ffn_hidden == 64);
        CHECK(c.max_seq_len == 16);
        CHECK(c.mlp == MLP_GELU);
        CHECK(c.pos == POS_LEARNED);
        CHECK(c.n_expert == 0);
        const int B = 2, T = 16;
        std::vector<int> in = some_tokens(B * T, 200, 3);
        in[0] = in[21] = 199;  // documents: the mask and positions reset at the EOT (id 199 here)
        GPT a, b;
        gpt_allocate(a, c, B, T);
        gpt_load_llmc(a, f, path);
        gpt_allocate(b, c, B, T);
        std::vector<float> table = tiny.in_table(b, version == 5), zeros(b.n_params, 0.0f);
        gpt_set_state(b, table.data(), zeros.data(), zeros.data());
        std::vector<float> la = logits_of(a, in, B, T), lb = logits_of(b, in, B, T);
        test_util::check_bitwise("logits, llm.c file vs our layout", la, lb);
        std::vector<float> pa(a.n_params);
        gpt_get_state(a, pa.data(), nullptr, nullptr);
        test_util::check_bitwise("parameters, llm.c file vs our layout", pa, table);
        gpt_free(a);
        gpt_free(b);
    }
}

TEST_CASE("llm.c model file: export then import gives identical parameters, in every layout's file") {
    Gpt2Run run;
    const std::string out = run.dir + "/model.bin", out_bf16 = run.dir + "/model_bf16.bin";
    REQUIRE(run_train(run.args("a", 3, {"--export_llmc", out})) == 0);
    CheckpointContents ck = load_checkpoint(run.dir + "/a/ckpt_000000003.bin");
    const GPTConfig c = config_from_checkpoint(ck, "ck");
    LlmcModelFile f = read_llmc_model(out);
    CHECK(f.version == 3);
    const std::vector<ParamTensor> table = build_param_table(c);
    std::vector<float> back = llmc_to_table(f.shape, f.params, table_index(table), count_params(table), out);
    test_util::check_bitwise("params after llm.c export + import", back, ck.params);
    CHECK(f.params.size() == (size_t)f.shape.num_params());
    // importing and exporting again (no training step) writes the same bytes
    const std::string again = run.dir + "/again.bin";
    REQUIRE(run_train(run.args("b", 0, {"--init_from", out, "--export_llmc", again})) == 0);
    CHECK(read_file(again) == read_file(out));
    // bf16: every value is the round-to-nearest-even bf16 of the fp32 one
    REQUIRE(run_train(run.args("c", 0, {"--init_from", out, "--export_llmc", out_bf16, "--export_llmc_dtype", "bf16"})) == 0);
    LlmcModelFile h = read_llmc_model(out_bf16);
    CHECK(h.version == 5);
    REQUIRE(h.params.size() == f.params.size());
    size_t bad = 0;
    for (size_t i = 0; i < f.params.size(); i++) bad += h.params[i] != bf16_to_float(float_to_bf16(f.params[i]));
    CHECK(bad == 0);
    CHECK(float_to_bf16(1.0f) == 0x3F80);
    CHECK(float_to_bf16(1.00390625f) == 0x3F80);  // halfway: to even
    CHECK(float_to_bf16(1.01171875f) == 0x3F82);  // halfway: to even (up)
    // a run initialized from the file trains on (the optimizer state starts fresh)
    REQUIRE(run_train(run.args("d", 2, {"--init_from", out_bf16})) == 0);
}

TEST_CASE("llm.c model file: corrupt or foreign files and contradicting flags fail, naming the file and what was expected") {
    const std::string d = make_temp_dir("llmc_bad_model_");
    TinyLlmc tiny(12);
    const std::string good = tiny.file(3);
    auto with_word = [&](int k, int32_t v) {
        std::string b = good;
        memcpy(&b[4 * k], &v, 4);
        return b;
    };
    auto fails = [&](const std::string& bytes, const std::string& needle) {
        write_bytes(d + "/m.bin", bytes);
        fails_with([&] { read_llmc_model(d + "/m.bin"); }, needle);
    };
    fails(with_word(0, 1234), "m.bin: not an llm.c GPT-2 model file: the first int32 is 1234, expected the magic 20240326");
    fails(std::string("LLMCCKPT") + good.substr(8), "one of our checkpoints, not an llm.c model file");
    fails(with_word(1, 1), "llm.c model file version 1, expected 3 (fp32) or 5 (bf16)");
    fails(with_word(1, 4), "version 4");
    fails(good.substr(0, 100), "truncated header (100 bytes, expected 1024)");
    fails(good.substr(0, good.size() - 4), "truncated");
    fails(good + "x", "trailing bytes");
    fails(with_word(5, 3), "n_embd 16 must be a multiple of n_head 3");
    fails(with_word(4, 0), "n_layer (header[4]) is 0, expected 1 .. 1024");
    fails(with_word(6, -5), "n_embd (header[6]) is -5");
    fails(with_word(7, 100), "padded_vocab_size 100 at least vocab_size 200");
    {
        std::string b = good;
        const float nan = NAN;
        memcpy(&b[1024 + 4 * ((size_t)256 * 16 + 3)], &nan, 4);  // wpe element 3
        fails(b, "wpe element 3 is nan, expected a finite number");
    }
    // a padding our engine does not use: refused with both numbers
    {
        TinyLlmc odd(1);
        odd.Vp = 200;  // unpadded (llm.c's version 1 layout would have this)
        odd.values.resize(odd.count());
        write_bytes(d + "/odd.bin", odd.file(3));
        LlmcModelFile f = read_llmc_model(d + "/odd.bin");
        fails_with([&] { config_from_llmc(f.shape, d + "/odd.bin"); },
                   "odd.bin: the llm.c model pads vocab_size 200 to 200 rows, this engine pads it to 256");
    }
    // flags that contradict the file, --init_from with --resume, shapes llm.c cannot hold
    Gpt2Run run;
    write_bytes(d + "/tiny.bin", good);
    fails_with([&] { run_train(run.args("e", 1, {"--init_from", d + "/tiny.bin"})); },
               "tiny.bin: the llm.c model has n_embd = 16 but the flags ask for 32; drop the flag");
    fails_with([&] { run_train(run.args("e", 1, {"--init_from", d + "/tiny.bin", "--resume", "latest"})); },
               "--init_from " + d + "/tiny.bin and --resume latest: give one");
    fails_with([&] { run_train(run.args("e", 1, {"--init_from", d + "/nothing.bin"})); }, "nothing.bin: cannot stat");
    // refused before training, not after it: no checkpoint is written
    std::vector<std::string> swiglu = run.args("f", 2, {"--export_llmc", d + "/x.bin"});
    for (std::string& a : swiglu) if (a == "gelu") a = "swiglu";
    fails_with([&] { run_train(swiglu); }, "--export_llmc: llm.c's GPT-2 format holds only GPT-2-shaped models: it "
                                           "needs --mlp gelu (this model has swiglu)");
    CHECK(glob_files(run.dir + "/f/ckpt_*.bin").empty());
    fails_with([&] { run_train(run.args("g", 1, {"--n_kv_head", "2", "--export_llmc", d + "/x.bin"})); },
               "needs --n_kv_head equal to --n_head");
    fails_with([&] { run_train(run.args("g", 1, {"--export_llmc", d + "/x.bin", "--export_llmc_dtype", "fp16"})); },
               "--export_llmc_dtype: expected fp32 or bf16, got 'fp16'");
}

TEST_CASE("llm.c token shards: detected by their magic, eot 50256 opens documents; bad headers are named") {
    const std::string d = make_temp_dir("llmc_shard_");
    // GPT-2 tokens: documents opened by 50256, ids up to 50256
    std::vector<int> toks;
    test_util::Rng r(4);
    while (toks.size() < 3000) {
        toks.push_back(50256);
        const int len = r.randint(3, 60);
        for (int i = 0; i < len; i++) toks.push_back(r.randint(0, 50255));
    }
    auto shard_bytes = [&](int32_t magic, int32_t version, int64_t n_header) {
        std::string b = header_of({magic, version, (int32_t)n_header});
        for (int t : toks) append(b, (uint16_t)t);
        return b;
    };
    write_bytes(d + "/gpt2_train_000.bin", shard_bytes(20240520, 1, (int64_t)toks.size()));
    ShardInfo s = read_shard_info(d + "/gpt2_train_000.bin");
    CHECK(s.llmc_format);
    CHECK(s.header_bytes == 1024);
    CHECK(s.token_bytes == 2);
    CHECK(s.num_tokens == toks.size());
    CHECK(s.vocab_size == 50257);
    CHECK(s.eot_token == 50256);
    std::vector<int> read_back(toks.size());
    ShardReader(s, 50257, false).read(0, (int)toks.size(), read_back.data());
    CHECK(read_back == toks);
    // the loader's rows and doc_start come straight from the file
    DataLoader dl(d + "/gpt2_train_*.bin", 2, 64, 0, 1, false, 1, 50257, "--train");
    CHECK(dl.eot == 50256);
    std::vector<int> in(128), tgt(128), ds(128), want(64);
    dl.next_batch(in.data(), tgt.data(), ds.data());
    CHECK(std::vector<int>(in.begin(), in.begin() + 64) == std::vector<int>(toks.begin(), toks.begin() + 64));
    CHECK(tgt[0] == toks[1]);
    compute_doc_start(want.data(), toks.data(), 64, 50256);
    CHECK(std::vector<int>(ds.begin(), ds.begin() + 64) == want);
    // a byte-vocabulary model is told what to change
    fails_with([&] { DataLoader(d + "/gpt2_train_*.bin", 2, 64, 0, 1, false, 1, 257, "--train"); },
               "shard vocab_size 50257 is larger than the model's vocab_size 257 (give --vocab_size 50257, or a GPT-2 "
               "preset such as -e gpt2:124M");
    auto fails = [&](const std::string& bytes, const std::string& needle) {
        write_bytes(d + "/bad.bin", bytes);
        fails_with([&] { read_shard_info(d + "/bad.bin"); }, needle);
    };
    fails(shard_bytes(20240520, 2, (int64_t)toks.size()), "bad.bin: llm.c token shard (magic 20240520) of version 2, "
                                                          "expected version 1");
    fails(shard_bytes(20240520, 1, (int64_t)toks.size() + 1), "bad.bin: llm.c token shard: truncated: header says 3");
    fails(shard_bytes(20240520, 1, 5), "trailing bytes");
    fails(shard_bytes(20240520, 1, -1), "header says -1 tokens, expected a count >= 0");
    fails(shard_bytes(20240521, 1, (int64_t)toks.size()), "expected \"LLMCSHRD\" (make shards with "
                                                          "dev/data/prepare_text.py) or llm.c's int32 20240520");
    fails(std::string("\x28\xd5\x34\x01\x01\x00", 6), "shorter than the 64-byte header");
    // training on llm.c shards with a GPT-2 vocabulary (the loader checks every id against it)
    write_bytes(d + "/gpt2_val_000.bin", shard_bytes(20240520, 1, (int64_t)toks.size()));
    CHECK(run_train({"--train", d + "/gpt2_train_*.bin", "--val", d + "/gpt2_val_*.bin", "--out_dir", d + "/run",
                     "--vocab_size", "50257", "--n_layer", "1", "--n_embd", "16", "--n_head", "2", "-b", "2", "-t", "32",
                     "--max_steps", "2", "--val_batches", "1", "--sample_len", "4"}) == 0);
}

TEST_CASE("tokenizer files: llm.c's and our BPE vocabulary decode bytes, whole UTF-8 characters only") {
    const std::string d = make_temp_dir("llmc_tok_");
    // Bengali KA (U+0995) is E0 A6 95; a grinning face (U+1F600) is F0 9F 98 80
    const std::vector<std::string> pieces = {"Hello", " w", "\xE0\xA6", "\x95", "<|endoftext|>", "\xF0\x9F", "\x98\x80",
                                             "\x80", "\x1b[2J", "\xE0\xA6\x95\xE0"};
    std::string llmc = header_of({20240328, 2, (int32_t)pieces.size(), 4});
    std::string ours = "LLMCVOCB";
    for (uint32_t w : {1u, (uint32_t)pieces.size(), 4u, 0u}) append(ours, w);
    for (const std::string& p : pieces) {
        append(llmc, (uint8_t)p.size());
        llmc += p;
        append(ours, (uint32_t)p.size());
        ours += p;
    }
    write_bytes(d + "/gpt2_tokenizer.bin", llmc);
    write_bytes(d + "/tokenizer.bin", ours);
    const std::string ka = "\xE0\xA6\x95", face = "\xF0\x9F\x98\x80", bad = REPLACEMENT_CHAR;
    for (const char* file : {"/gpt2_tokenizer.bin", "/tokenizer.bin"}) {
        CAPTURE(file);
        Tokenizer t = load_tokenizer_file(d + file);
        CHECK(t.kind == Tokenizer::TABLE);
        CHECK(t.eot == 4);
        REQUIRE(t.pieces == pieces);
        CHECK(t.decode({0, 1}) == "Hello w");
        CHECK(t.decode({0, 1, 2, 3}) == "Hello w" + ka);           // a letter split over two tokens
        CHECK(t.decode({5, 6, 0}) == face + "Hello");               // 4 bytes over two tokens
        CHECK(t.decode({2, 0}) == bad + "Hello");                   // cut off by a token that is not its tail
        CHECK(t.decode({2}) == bad);                                // cut off by the end
        CHECK(t.decode({2, 4, 3}) == bad + EOT_TEXT + bad);         // cut off by an EOT; a stray continuation
        CHECK(t.decode({7, 0}) == bad + "Hello");
        CHECK(t.decode({8}) == bad + "[2J");                        // no terminal escapes from a sample
        CHECK(t.decode({9, 3, 9, 0}) == ka + bad + bad + ka + bad + "Hello");  // E0 95: not a pair; 95 alone
        CHECK(t.decode({9, 2, 3}) == ka + bad + ka);  // E0 E0: the first is replaced, the second goes on
        CHECK(t.decode({0, 99}) == "Hello" + bad);                 // an id past the vocabulary
    }
    // the streaming decoder holds an incomplete character and releases it when completed
    Utf8Stream u;
    CHECK(u.push("a\xE0") == "a");
    CHECK(u.push("\xA6") == "");
    CHECK(u.push("\x95" "b") == ka + "b");
    CHECK(u.push("\xED\xA0\x80") == bad + bad + bad);  // a UTF-16 surrogate is not UTF-8
    CHECK(u.push("\xC0\xAF") == bad + bad);              // overlong '/'
    CHECK(u.finish().empty());
    // the byte tokenizer goes through the same decoder
    Tokenizer bytes = byte_tokenizer(256);
    CHECK(bytes.decode({0xE0, 0xA6, 0x95, 'x', 256, 'y'}) == ka + "x" + EOT_TEXT + "y");
    CHECK(ids_tokenizer(50256, "test").decode({464, 3290, 50256, 318}) == "464 3290" + std::string(EOT_TEXT) + "318");
    // broken files
    auto fails = [&](const std::string& bytes, const std::string& needle) {
        write_bytes(d + "/bad.bin", bytes);
        fails_with([&] { load_tokenizer_file(d + "/bad.bin"); }, needle);
    };
    fails("hello", "bad.bin: not a tokenizer file: expected the magic \"LLMCVOCB\"");
    fails(llmc.substr(0, 500), "llm.c tokenizer file: truncated header (500 bytes, expected 1024)");
    fails(llmc.substr(0, llmc.size() - 1), "truncated: token 9 of 10 says 4 bytes, 3 are left");
    fails(llmc + "z", "1 trailing bytes after the 10 tokens");
    fails(ours.substr(0, 30), "truncated: token 0 of 10 says 5 bytes, 2 are left");
    {
        std::string b = llmc;
        b[4] = 3;
        fails(b, "llm.c tokenizer file version 3, expected 1 or 2");
        b[4] = 1;
        fails(b, "version 1 must hold GPT-2's 50257 tokens, it says 10");
        b = ours;
        b[16] = 10;
        fails(b, "eot_token 10 is not below vocab_size 10");
    }
}

TEST_CASE("tokenizer choice: --tokenizer, then tokenizer.bin / gpt2_tokenizer.bin next to the shards, bytes, ids") {
    const std::string d = make_temp_dir("llmc_tokfind_");
    const std::string shard = d + "/x_train_000.bin";
    CHECK(find_tokenizer("", shard, 257, 256, false).kind == Tokenizer::BYTES);
    Tokenizer none = find_tokenizer("", shard, 50257, 50256, true);
    CHECK(none.kind == Tokenizer::IDS);
    CHECK(none.source.find("no gpt2_tokenizer.bin") != std::string::npos);
    std::string ours = "LLMCVOCB";
    for (uint32_t w : {1u, 300u, 0u, 0u}) append(ours, w);
    for (int i = 0; i < 300; i++) {
        append(ours, (uint32_t)1);
        ours += (char)('a' + i % 26);
    }
    write_bytes(d + "/tokenizer.bin", ours);
    Tokenizer found = find_tokenizer("", shard, 300, 0, false);
    CHECK(found.kind == Tokenizer::TABLE);
    CHECK(found.source == d + "/tokenizer.bin (BPE vocabulary)");
    fails_with([&] { find_tokenizer("", shard, 300, 7, false); },
               "tokenizer.bin: tokenizer (vocab_size 300, eot 0) does not match the train shards");
    fails_with([&] { find_tokenizer(d + "/missing.bin", shard, 300, 0, false); }, "missing.bin: cannot stat");
    CHECK(find_tokenizer(d + "/tokenizer.bin", d + "/elsewhere/s.bin", 300, 0, false).kind == Tokenizer::TABLE);
}

TEST_CASE("GPT-2 presets: shapes, vocabulary, context, block type; explicit flags override") {
    auto config_of = [](std::vector<std::string> flags) {
        flags.insert(flags.begin(), "train_gpt_cpu");
        std::vector<char*> argv;
        for (std::string& f : flags) argv.push_back(f.data());
        Args args;
        REQUIRE(parse_args((int)argv.size(), argv.data(), args));
        return config_from_args(args);
    };
    const int shapes[4][3] = {{12, 768, 12}, {24, 1024, 16}, {36, 1280, 20}, {48, 1600, 25}};
    const char* names[4] = {"gpt2:124M", "gpt2:350M", "gpt2:774M", "gpt2:1558M"};
    for (int k = 0; k < 4; k++) {
        GPTConfig c = config_of({"-e", names[k]});
        CHECK(c.n_layer == shapes[k][0]);
        CHECK(c.n_embd == shapes[k][1]);
        CHECK(c.n_head == shapes[k][2]);
        CHECK(c.n_kv_head == shapes[k][2]);
        CHECK(c.vocab_size == 50257);
        CHECK(c.padded_vocab_size == 50304);  // llm.c's padding of GPT-2's vocabulary
        CHECK(c.max_seq_len == 1024);
        CHECK(c.mlp == MLP_GELU);
        CHECK(c.pos == POS_LEARNED);
        CHECK(c.ffn_hidden == 4 * shapes[k][1]);
    }
    // llm.c counts 124,475,904 parameters for GPT-2 124M with the padded vocabulary
    size_t n = 0;
    for (const ParamTensor& t : build_param_table(config_of({"-e", "gpt2:124M"}))) n += t.numel;
    CHECK(n == 124475904);
    GPTConfig c = config_of({"-e", "gpt2:124M", "--max_seq_len", "256", "--n_layer", "2", "--vocab_size", "257"});
    CHECK(c.max_seq_len == 256);
    CHECK(c.n_layer == 2);
    CHECK(c.vocab_size == 257);
    CHECK(c.n_embd == 768);
    fails_with([&] { config_of({"-e", "gpt2:125M"}); },
               "--model: 'gpt2:125M' is not a preset: expected dN (e.g. d4), gpt2:124M, gpt2:350M");
}

TEST_CASE("step log: cumulative tokens and elapsed seconds per step") {
    Gpt2Run run;
    REQUIRE(run_train(run.args("log", 3, {"-d", "128"})) == 0);
    std::istringstream lines(read_file(run.dir + "/log/log.jsonl"));
    std::string line;
    int steps = 0;
    double last_elapsed = -1;
    while (std::getline(lines, line)) {
        if (line.find("\"loss\"") == std::string::npos) continue;
        steps++;
        CHECK(line.find("\"tokens\":" + std::to_string(128 * steps) + ",") != std::string::npos);
        const size_t p = line.find("\"elapsed_s\":");
        REQUIRE(p != std::string::npos);
        const double e = atof(line.c_str() + p + 12);
        CHECK(e >= last_elapsed);
        last_elapsed = e;
    }
    CHECK(steps == 3);
    CHECK(format_duration(42.4) == "42s");
    CHECK(format_duration(187) == "3m07s");
    CHECK(format_duration(7500) == "2h05m");
}
