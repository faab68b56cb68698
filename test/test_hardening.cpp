// Hardening: hostile input must give a clear error (naming the flag or file), never
// memory corruption, a crash, a hang or a silently lost run. Each case below is one item of the
// issue; the file readers are also fuzzed under ASan/UBSan by `make fuzz` (test/fuzz_readers.cpp).
#define LLMC_CPU
#define LLMC_NO_MAIN
#include "../train_gpt.cu"

#include "test_util.h"

#include <doctest/doctest.h>
#include <fstream>
#include <sstream>
#include <sys/wait.h>

namespace {

using test_util::make_temp_dir;
using test_util::read_file;
using test_util::run_train;
using test_util::run_train_output;
using test_util::synthetic_tokens;
using test_util::write_shard;

struct Fixture {
    std::string dir = make_temp_dir("llmc_hard_");
    Fixture() {
        write_shard(dir + "/tr_000.bin", synthetic_tokens(6000, 1));
        write_shard(dir + "/va_000.bin", synthetic_tokens(2000, 3));
    }
    std::vector<std::string> args(const std::string& out, int max_steps) const {
        return {"--train", dir + "/tr_*.bin", "--val", dir + "/va_*.bin", "--out_dir", dir + "/" + out,
                "--n_layer", "2", "--n_embd", "32", "--n_head", "4", "--n_kv_head", "2", "-b", "2", "-t", "32",
                "-d", "128", "--max_steps", std::to_string(max_steps), "--warmup", "2", "--val_every", "2",
                "--val_batches", "2", "--sample_len", "0", "--ckpt_every", "2"};
    }
};

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& extra) {
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
}

void fails_with(const std::vector<std::string>& args, const std::string& needle) {
    CAPTURE(needle);
    CHECK_THROWS_WITH_AS(run_train(args), doctest::Contains(needle.c_str()), LlmcError);
}

std::vector<std::string> lines_of(const std::string& path) {
    std::vector<std::string> out;
    std::ifstream f(path);
    std::string line;
    while (std::getline(f, line)) out.push_back(line);
    return out;
}

// exit status of a shell command (stdout and stderr to files in dir)
int shell(const std::string& cmd, const std::string& dir) {
    int status = system((cmd + " > " + dir + "/sh_out.txt 2> " + dir + "/sh_err.txt").c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// every line of a JSONL file parses as strict JSON (Python's json without NaN/Infinity)
bool strict_jsonl(const std::string& path, const std::string& dir) {
    const std::string py = "import json,sys\n"
                           "def bad(c): raise ValueError(c)\n"
                           "[json.loads(l, parse_constant=bad) for l in open(sys.argv[1])]\n";
    std::ofstream(dir + "/check_json.py") << py;
    return shell("python3 " + dir + "/check_json.py " + path, dir) == 0;
}

}  // namespace

TEST_CASE("hardening 1: --pos learned with T > max_seq_len is refused (no out-of-bounds table access)") {
    Fixture fx;
    fails_with(with(fx.args("pos", 2), {"--pos", "learned", "--max_seq_len", "16"}),
               "--seq_len 32 is longer than --max_seq_len 16");
    // the model itself refuses the shape too (library use, tests)
    GPTConfig c;
    c.pos = POS_LEARNED;
    c.max_seq_len = 16;
    c.finalize();
    GPT m;
    CHECK_THROWS_WITH_AS(gpt_allocate(m, c, 1, 17), doctest::Contains("--max_seq_len 16"), LlmcError);
    c.pos = POS_ALIBI;  // ALiBi has no table: any T
    CHECK_NOTHROW(c.check_batch(1, 17));
    // exactly max_seq_len trains
    CHECK(run_train(with(fx.args("pos_ok", 1), {"--pos", "learned", "--max_seq_len", "32"})) == 0);
}

TEST_CASE("hardening 2: NaN/Inf steps are skipped, counted, logged as null; the run stops after --max_bad_steps") {
    Fixture fx;
    // lr 1e30: step 1 is finite, then every loss is NaN
    const std::string out = fx.dir + "/nan";
    fails_with(with(fx.args("nan", 20), {"--lr", "1e30", "--warmup", "0", "--max_bad_steps", "3", "--ckpt_every", "1"}),
               "step 4: 3 consecutive steps had a non-finite loss or gradient norm (--max_bad_steps 3)");
    const std::vector<std::string> log = lines_of(out + "/log.jsonl");
    int skipped = 0;
    for (const std::string& l : log) skipped += l.find("\"skipped\":1") != std::string::npos;
    CHECK(skipped == 3);
    CHECK(read_file(out + "/log.jsonl").find("\"loss\":null") != std::string::npos);
    CHECK(read_file(out + "/log.jsonl").find("nan") == std::string::npos);
    CHECK(strict_jsonl(out + "/log.jsonl", fx.dir));
    // the good step's checkpoint exists; none was written during the bad streak
    CHECK(file_exists(out + "/ckpt_000000001.bin"));
    CHECK(!file_exists(out + "/ckpt_000000002.bin"));
    CHECK_NOTHROW(load_checkpoint(out + "/ckpt_000000001.bin"));

    // a state that became non-finite through a finite step (lr * weight_decay overflows) is never saved
    fails_with(with(fx.args("inf", 4), {"--lr", "3e38", "--weight_decay", "10", "--warmup", "0", "--ckpt_every", "1"}),
               "refusing to write");
    CHECK(!file_exists(fx.dir + "/inf/ckpt_000000001.bin"));

    // the helpers
    std::vector<float> v = {1, 2, 3};
    CHECK(first_non_finite(v.data(), 3) == 3);
    v[1] = INFINITY;
    CHECK(first_non_finite(v.data(), 3) == 1);
    CHECK(json_number(NAN) == "null");
    CHECK(json_number(-INFINITY) == "null");
    CHECK(json_number(12) == "12");
    CHECK(json_number(0.5) == "0.5");
}

TEST_CASE("hardening 2: loss-spike z-score against a running window") {
    LossOutlierDetector d(16, 8);
    for (int i = 0; i < 7; i++) CHECK(std::isnan(d.update(3.0 + 0.01 * (i % 3))));  // too few values yet
    double z = 0;
    for (int i = 7; i < 40; i++) z = d.update(3.0 + 0.01 * (i % 3));
    CHECK(std::fabs(z) < 3);
    CHECK(std::isnan(d.update(NAN)));  // a bad step: no z, and it does not enter the window
    const double spike = d.update(4.0);
    CHECK(spike > 50);
    CHECK(d.ring.size() == 16);  // the window is bounded
    // the trainer logs it
    Fixture fx;
    REQUIRE(run_train(fx.args("z", 12)) == 0);
    const std::string log = read_file(fx.dir + "/z/log.jsonl");
    CHECK(log.find("\"loss_z\":null") != std::string::npos);  // the first steps
    CHECK(log.find("\"loss_z\":-") != std::string::npos);     // a falling loss: negative z later
}

TEST_CASE("loss scaler: skip and halve on an overflow (never below 1), double after the window, fixed scales count") {
    LossScaler s;
    s.dynamic = true;
    s.scale = 8.0f;
    s.window = 3;
    bool bad = true;
    CHECK(s.after_step(true, &bad));
    CHECK(!bad);
    CHECK(s.after_step(true, &bad));
    CHECK(s.scale == 8.0f);
    CHECK(s.after_step(true, &bad));  // the third finite step in a row: doubles
    CHECK(s.scale == 16.0f);
    CHECK(s.clean_steps == 0);
    CHECK(s.after_step(true, &bad));
    CHECK(!s.after_step(false, &bad));  // an overflow: skipped, halved, the count restarts
    CHECK(!bad);
    CHECK(s.scale == 8.0f);
    CHECK(s.clean_steps == 0);
    for (int k = 0; k < 3; k++) CHECK(!s.after_step(false, &bad));
    CHECK(s.scale == 1.0f);
    CHECK(!bad);
    CHECK(!s.after_step(false, &bad));  // at the floor: a divergence, counted by the trainer
    CHECK(bad);
    CHECK(s.scale == 1.0f);
    s.scale = 0x1p127f;  // never to inf
    s.clean_steps = 2;
    CHECK(s.after_step(true, &bad));
    CHECK(s.scale == 0x1p127f);
    LossScaler fixed;
    fixed.scale = 1024.0f;
    CHECK(fixed.on());
    for (int k = 0; k < 5; k++) CHECK(fixed.after_step(true, &bad));
    CHECK(fixed.scale == 1024.0f);
    CHECK(!fixed.after_step(false, &bad));
    CHECK(bad);
    CHECK(fixed.scale == 1024.0f);
    CHECK(!LossScaler().on());
}

TEST_CASE("hardening 3/12: shard reader: overflowing sizes, directories, FIFOs, tiny shards") {
    Fixture fx;
    const std::string d = fx.dir;
    // 4-byte tokens, num_tokens = n + 2^62: num_tokens * 4 wraps to 4 n, the real size; must not pass
    std::vector<int> toks = synthetic_tokens(3000, 1);
    write_shard(d + "/wrap_000.bin", toks, 257, 256, 4, "LLMCSHRD", (long long)(toks.size() + (1ull << 62)));
    CHECK_THROWS_WITH_AS(read_shard_info(d + "/wrap_000.bin"), doctest::Contains("corrupt header"), LlmcError);
    // a directory given as a shard
    REQUIRE(mkdir((d + "/dir_000.bin").c_str(), 0755) == 0);
    CHECK_THROWS_WITH_AS(read_shard_info(d + "/dir_000.bin"), doctest::Contains("it is a directory, expected a regular file"),
                         LlmcError);
    // a FIFO: refused at once (an open for reading would block until a writer appears)
    REQUIRE(mkfifo((d + "/fifo_000.bin").c_str(), 0644) == 0);
    CHECK_THROWS_WITH_AS(read_shard_info(d + "/fifo_000.bin"), doctest::Contains("FIFO"), LlmcError);
    fails_with(with(fx.args("fifo", 1), {"--train", d + "/fifo_*.bin"}), "it is a FIFO (named pipe), expected a regular file");
    // a tiny last shard is skipped with a warning; only tiny shards: an error naming the batch
    write_shard(d + "/mix_000.bin", synthetic_tokens(3000, 1));
    write_shard(d + "/mix_001.bin", synthetic_tokens(20, 2));
    DataLoader dl(d + "/mix_*.bin", 2, 32, 0, 1, true, 1, 257, "--train");
    CHECK(dl.shards.size() == 1);
    CHECK(run_train(with(fx.args("mix", 2), {"--train", d + "/mix_*.bin"})) == 0);
    write_shard(d + "/tiny_000.bin", synthetic_tokens(20, 2));
    fails_with(with(fx.args("tiny", 1), {"--train", d + "/tiny_*.bin"}), "none of the 1 shard(s) matching");
}

TEST_CASE("hardening 4/7/12: flags: 64-bit parse, range checks, no trailing junk, optimizer values") {
    CHECK(parse_int64("12", "x", 0, 100) == 12);
    CHECK_THROWS_WITH_AS(parse_int64("12abc", "x", 0, 100), doctest::Contains("--x: expected an integer, got '12abc'"), LlmcError);
    CHECK_THROWS_WITH_AS(parse_int64(" 12", "x", 0, 100), doctest::Contains("expected an integer"), LlmcError);
    CHECK_THROWS_WITH_AS(parse_int64("", "x", 0, 100), doctest::Contains("expected an integer"), LlmcError);
    CHECK_THROWS_WITH_AS(parse_int64("99999999999999999999", "x", 0, INT64_MAX), doctest::Contains("out of range"), LlmcError);
    CHECK(parse_uint64("18446744073709551615", "seed") == UINT64_MAX);
    CHECK_THROWS_WITH_AS(parse_uint64("-1", "seed"), doctest::Contains("expected a non-negative integer"), LlmcError);
    CHECK_THROWS_WITH_AS(parse_double("1e999", "lr"), doctest::Contains("finite"), LlmcError);
    CHECK_THROWS_AS(checked_product({1 << 20, 1 << 20}, INT32_MAX, "B*T"), LlmcError);

    Fixture fx;
    const std::vector<std::string> base = fx.args("flags", 1);
    const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
        {{"-b", "4294967300"}, "--batch_size: 4294967300 is out of range"},
        {{"-b", "0"}, "--batch_size: 0 is out of range, expected an integer in [1, 2147483647]"},
        {{"-t", "12abc"}, "--seq_len: expected an integer, got '12abc'"},
        {{"--seed", "abc"}, "--seed: expected a non-negative integer, got 'abc'"},
        {{"--seed", "12abc"}, "--seed: expected a non-negative integer, got '12abc'"},
        {{"--seed", "-5"}, "--seed: expected a non-negative integer"},
        {{"--seed", "18446744073709551616"}, "--seed: 18446744073709551616 is out of range"},
        {{"--vocab_size", "2147483647"}, "--vocab_size 2147483647 is too large"},
        {{"--n_embd", "1073741856"}, "--n_embd 1073741856 is too large"},
        {{"--n_layer", "100000"}, "--n_layer 100000 is too large"},
        {{"-e", "d99999999999"}, "--model dN: N: 99999999999 is out of range"},
        {{"-e", "dx"}, "--model: 'dx' is not a preset"},
        {{"-b", "2000000", "-t", "2000", "-d", "0"}, "B*T*ranks is too large"},
        {{"-d", "-256"}, "--total_batch_tokens: -256 is out of range"},
        {{"--lr", "-1"}, "--lr: must be a finite number > 0, got -1"},
        {{"--lr", "0"}, "--lr: must be a finite number > 0"},
        {{"--lr", "nan"}, "--lr: expected a finite number, got 'nan'"},
        {{"--beta1", "1"}, "--beta1: must be in [0, 1), got 1"},
        {{"--beta2", "-0.1"}, "--beta2: must be in [0, 1)"},
        {{"--grad_clip", "nan"}, "--grad_clip: expected a finite number, got 'nan'"},
        {{"--grad_clip", "-1"}, "--grad_clip: must be a finite number >= 0"},
        {{"--weight_decay", "-0.1"}, "--weight_decay: must be >= 0"},
        {{"--max_bad_steps", "0"}, "--max_bad_steps: 0 is out of range"},
        {{"--max_steps", "-3"}, "--max_steps: -3 is out of range"},
        {{"--val_batches", "-1"}, "--val_batches: -1 is out of range"},
    };
    for (const auto& [extra, needle] : cases) fails_with(with(base, extra), needle);
    // a seed of 2^64 - 1 is a valid seed, and survives the checkpoint round trip
    REQUIRE(run_train(with(fx.args("seed", 2), {"--seed", "18446744073709551615"})) == 0);
    CHECK(run_train(with(fx.args("seed", 3), {"--seed", "18446744073709551615", "--resume", "latest"})) == 0);

    // the binary: the message on stderr and exit 1, not an abort (std::stoll used to throw past main)
    REQUIRE(file_exists("./train_gpt_cpu"));
    CHECK(shell("./train_gpt_cpu --seed abc --out_dir " + fx.dir + "/bin", fx.dir) == 1);
    CHECK(read_file(fx.dir + "/sh_err.txt").find("error: --seed: expected a non-negative integer") != std::string::npos);
}

TEST_CASE("hardening 5: log.jsonl write errors are fatal; a resume trims the log to its step and marks it") {
    JsonlLogger full;
    full.open("/dev/full", true);
    CHECK_THROWS_WITH_AS(full.write({{"step", 1}, {"loss", 2.5}}), doctest::Contains("writing the training log failed"),
                         LlmcError);

    Fixture fx;
    // the trainer: log.jsonl on a full disk stops the run at its first record
    REQUIRE(mkdir((fx.dir + "/full").c_str(), 0755) == 0);
    REQUIRE(symlink("/dev/full", (fx.dir + "/full/log.jsonl").c_str()) == 0);
    fails_with(fx.args("full", 2), "/full/log.jsonl: writing the training log failed");

    // 6 steps with checkpoints at 2, 4, 6; a crash leaves a torn last line; resume from step 2
    const std::string out = fx.dir + "/res";
    REQUIRE(run_train(fx.args("res", 6)) == 0);
    { std::ofstream(out + "/log.jsonl", std::ios::app) << "{\"step\":7,\"lo"; }
    REQUIRE(run_train(with(fx.args("res", 6), {"--resume", out + "/ckpt_000000002.bin"})) == 0);
    std::map<long long, int> train_records;
    int resumes = 0;
    for (const std::string& l : lines_of(out + "/log.jsonl")) {
        if (l.find("\"loss\":") != std::string::npos) train_records[jsonl_record_step(l)]++;
        if (l.find("\"resume\":1") != std::string::npos) { resumes++; CHECK(jsonl_record_step(l) == 2); }
    }
    CHECK(resumes == 1);
    CHECK(train_records.size() == 6);
    for (auto& [step, n] : train_records) { CAPTURE(step); CHECK(n == 1); }  // no step counted twice
    CHECK(strict_jsonl(out + "/log.jsonl", fx.dir));
}

TEST_CASE("hardening 6/10: out_dir lock, and a fresh run does not reuse another run's checkpoints") {
    Fixture fx;
    const std::string out = fx.dir + "/own";
    REQUIRE(run_train(fx.args("own", 4)) == 0);
    // a second trainer on the same out_dir (here: the lock held by this process, another open file)
    {
        RunDirLock other;
        other.acquire(out);
        fails_with(with(fx.args("own", 6), {"--resume", "latest"}), "is in use by another trainer");
    }
    // a fresh run into an out_dir with checkpoints: refused; --overwrite replaces the old run
    fails_with(fx.args("own", 2), "checkpoint(s) of another run");
    REQUIRE(file_exists(out + "/ckpt_000000004.bin"));
    REQUIRE(run_train(with(fx.args("own", 2), {"--overwrite"})) == 0);
    CHECK(file_exists(out + "/ckpt_000000002.bin"));
    CHECK(!file_exists(out + "/ckpt_000000004.bin"));
    int steps = 0;
    for (const std::string& l : lines_of(out + "/log.jsonl")) steps += l.find("\"loss\":") != std::string::npos;
    CHECK(steps == 2);
    // resuming is always allowed, and the lock is free again after a run
    CHECK(run_train(with(fx.args("own", 4), {"--resume", "latest"})) == 0);
    CHECK(run_train(with(fx.args("own", 2), {"--overwrite", "1"})) == 0);
}

TEST_CASE("faults: an interrupted checkpoint write's .tmp is never a run's checkpoint; a failed write leaves none") {
    Fixture fx;
    const std::string out = fx.dir + "/tmp";
    auto write_file_bytes = [](const std::string& path, const std::string& bytes) { std::ofstream(path) << bytes; };
    // a kill during the first checkpoint write leaves only its .tmp: a fresh start removes it and runs
    make_dirs(out);
    write_file_bytes(out + "/ckpt_000000002.bin.tmp", std::string(1000, 'x'));
    REQUIRE(run_train(fx.args("tmp", 2)) == 0);
    CHECK(file_exists(out + "/ckpt_000000002.bin"));
    CHECK(!file_exists(out + "/ckpt_000000002.bin.tmp"));
    // --resume latest with only a .tmp: a fresh start (the same command line serves every restart)
    const std::string out2 = fx.dir + "/tmp2";
    make_dirs(out2);
    write_file_bytes(out2 + "/ckpt_000000002.bin.tmp", std::string(1000, 'x'));
    REQUIRE(run_train(with(fx.args("tmp2", 2), {"--resume", "latest"})) == 0);
    CHECK(!file_exists(out2 + "/ckpt_000000002.bin.tmp"));
    CHECK(read_file(out + "/ckpt_000000002.bin") == read_file(out2 + "/ckpt_000000002.bin"));
    // a .tmp beside real checkpoints: --resume latest takes the newest real one
    write_file_bytes(out + "/ckpt_000000009.bin.tmp", std::string(1000, 'x'));
    REQUIRE(run_train(with(fx.args("tmp", 4), {"--resume", "latest"})) == 0);
    CHECK(!file_exists(out + "/ckpt_000000009.bin.tmp"));
    CHECK(file_exists(out + "/ckpt_000000004.bin"));
    // a checkpoints-only directory still refuses a fresh run (the .tmp rule changes nothing there)
    fails_with(fx.args("tmp", 2), "checkpoint(s) of another run");

    // a write that fails on this rank (here: a range outside the table) removes its .tmp
    Checkpoint ck;
    ck.set_int("step", 1);
    const std::string path = fx.dir + "/failed.bin";
    std::vector<float> v(16, 1.0f);
    {
        CHECK_THROWS_AS(([&] {
                            CheckpointWriter w(CommGroup{}, path, ck, 8);
                            CHECK(file_exists(path + ".tmp"));
                            w.write_range(0, 0, 8, v.data());
                            w.write_range(1, 4, 8, v.data());  // past the end: throws
                        }()),
                        LlmcError);
    }
    CHECK(!file_exists(path + ".tmp"));
    CHECK(!file_exists(path));
    {
        CheckpointWriter w(CommGroup{}, path, ck, 8);
        for (int a = 0; a < 3; a++) w.write_range(a, 0, 8, v.data());
        w.finish();
    }
    CHECK(file_exists(path));
    CHECK(!file_exists(path + ".tmp"));
}

TEST_CASE("faults: a checkpoint's config fields are range-checked by name before narrowing, enums by name") {
    GPTConfig c;
    c.n_layer = 2; c.n_embd = 32; c.n_head = 4; c.n_kv_head = 2;
    c.finalize();
    auto header = [&](const std::string& field, int64_t value) {
        Checkpoint ck;
        for (auto& [name, v] : config_fields(c)) ck.set_int(std::string("config.") + name, name == field ? value : *v);
        ck.set_float("config.capacity_factor", c.capacity_factor);
        return ck;
    };
    CHECK(config_from_checkpoint(header("", 0), "ck").n_embd == 32);
    const std::vector<std::tuple<std::string, int64_t, std::string>> cases = {
        {"n_embd", 4294967328LL, "ck: checkpoint field config.n_embd = 4294967328 is outside [1, 2147483647]"},
        {"vocab_size", 2147483648LL, "checkpoint field config.vocab_size = 2147483648 is outside [1, 2147483647]"},
        {"n_layer", -1, "checkpoint field config.n_layer = -1 is outside [1, 2147483647]"},
        {"mlp", 7, "checkpoint field config.mlp = 7 is not one of swiglu (0), gelu (1)"},
        {"pos", -1, "checkpoint field config.pos = -1 is not one of alibi (0), learned (1)"},
        {"moe_group", 2, "checkpoint field config.moe_group = 2 is not one of batch (0), position (1)"},
        {"n_embd", 30, "ck: the checkpoint's config (its config.* fields) is refused: --n_embd 30 must be"},
    };
    for (const auto& [field, value, needle] : cases) {
        CAPTURE(field);
        CHECK_THROWS_WITH_AS(config_from_checkpoint(header(field, value), "ck"), doctest::Contains(needle.c_str()), LlmcError);
    }
    CHECK(config_value_text("mlp", MLP_GELU) == "gelu");
    CHECK(config_value_text("n_embd", 32) == "32");
}

TEST_CASE("hardening 8: the memory guard refuses an impossible run before allocating") {
    // the estimate is what gpt_allocate allocates, buffer for buffer
    for (int variant = 0; variant < 3; variant++) {
        CAPTURE(variant);
        GPTConfig c;
        c.n_layer = 2; c.n_embd = 32; c.n_head = 4; c.n_kv_head = 2; c.max_seq_len = 64;
        if (variant == 1) { c.mlp = MLP_GELU; c.pos = POS_LEARNED; }
        if (variant == 2) { c.n_expert = 4; c.moe_every = 2; c.expert_hidden = 48; }
        c.finalize();
        const int B = 3, T = 24;
        double act[3] = {0, 0, 0};
        for (int recompute = 0; recompute <= 2; recompute++) {
            CAPTURE(recompute);
            Layout layout;
            layout.recompute = recompute;
            MemoryEstimate e = gpt_memory_estimate(c, B, T, layout);
            GPT m;
            const size_t before = buffer_bytes_allocated();
            gpt_allocate(m, c, B, T, layout);
            const double allocated = (double)(buffer_bytes_allocated() - before);
            CHECK(e.buffers() == allocated);
            CHECK(e.host_arenas() == 0);
            act[recompute] = e.activations;
            gpt_free(m);
            // --offload optimizer: the master (here a host copy of the fp32 params), the moments and
            // the gradient staging move to the host arenas; both sides are allocated as planned
            for (int zero = 0; zero <= 3; zero += 3) {
                CAPTURE(zero);
                Layout dl = layout, ol = layout;
                dl.zero_stage = ol.zero_stage = zero;
                ol.offload = OFFLOAD_OPTIMIZER;
                const MemoryEstimate d = gpt_memory_estimate(c, B, T, dl);
                const MemoryEstimate o = gpt_memory_estimate(c, B, T, ol);
                GPT off;
                const size_t dev0 = buffer_bytes_allocated(), host0 = host_bytes_allocated();
                gpt_allocate(off, c, B, T, ol);
                CHECK(o.buffers() == (double)(buffer_bytes_allocated() - dev0));
                CHECK(o.host_arenas() == (double)(host_bytes_allocated() - host0));
                const double state = 4.0 * off.zero.state_elems();  // bytes of one fp32 state buffer
                CHECK(o.master == 0);
                CHECK(o.moments == 0);
                CHECK(o.host_master == state);
                CHECK(o.host_moments == 2 * state);
                CHECK(o.host_staging == state);
                CHECK(o.buffers() == d.buffers() - d.moments);
                CHECK(o.activations == d.activations);
                // the pieces whose download starts in the backward: every one, but the embedding's
                // where the tied head's gradient joins it after the backward (TIED_PER_STEP: -z 2/3 here)
                size_t early = 0, embedding = 0;
                for (const std::vector<int>& seg : off.early_pieces) early += seg.size();
                const Segment& seg0 = off.zero.segs[off.seg_local[0]];  // one process: local == table offsets
                for (const UpdatePiece& u : off.update_pieces) embedding += u.table_offset < seg0.begin + seg0.len;
                CHECK(off.tied == (zero <= 1 ? TIED_PER_RANK : TIED_PER_STEP));
                CHECK(embedding > 0);
                CHECK(early + (off.tied == TIED_PER_STEP ? embedding : 0) == off.update_pieces.size());
                gpt_free(off);
            }
        }
        CHECK(act[2] < act[1]);  // -r 2 keeps less than -r 1, which keeps less than -r 0
        CHECK(act[1] < act[0]);
    }
    // tensor-parallel layouts: a real allocation with tp > 1 needs MPI, so here only the plan (the
    // dry run of gpt_allocate for rank 0 of a tp group, plan_tp), for tp 1, 2, 4 with and without
    // --sp, dense and MoE, every -r; it must succeed and be consistent: the same as
    // gpt_memory_estimate's, params and moments per rank = the split tensors / tp + the replicated
    // ones (LayerNorms, row-parallel biases, the router) up to alignment and segment padding, so tp 2
    // about halves tp 1; --sp keeps fewer activations than no --sp
    for (int moe = 0; moe < 2; moe++) {
        CAPTURE(moe);
        GPTConfig c;
        c.n_layer = 4; c.n_embd = 256; c.n_head = 8; c.n_kv_head = 4; c.ffn_hidden = 512; c.max_seq_len = 64;
        if (moe) { c.n_expert = 4; c.moe_every = 2; c.expert_hidden = 256; }
        c.finalize();
        const int B = 4, T = 64;
        double split = 0, replicated = 0, n_tensors = 0;  // table elements
        for (const ParamTensor& t : build_param_table(c)) {
            auto has = [&](const char* part) { return t.name.find(part) != std::string::npos; };
            const bool is_split = t.name == "wte" || has(".attn.qkv.") || has(".attn.proj.w") || has(".mlp.fc.") ||
                                  has(".mlp.proj.w") || has(".moe.fc.") || has(".moe.proj.w");
            (is_split ? split : replicated) += (double)t.numel;
            n_tensors++;
        }
        REQUIRE(replicated > 0);
        // per tensor up to 7 alignment elements, per segment (embedding, block halves, final LN) up to 2047
        const double slack = 8 * n_tensors + (double)NORM_CHUNK * (2 * c.n_layer + 2);
        for (int recompute = 0; recompute <= 2; recompute++) {
            CAPTURE(recompute);
            double params[5] = {}, act[5][2] = {};
            for (int tp : {1, 2, 4})
                for (int sp = 0; sp <= (tp > 1 ? 1 : 0); sp++) {
                    CAPTURE(tp);
                    CAPTURE(sp);
                    Layout layout;
                    layout.recompute = recompute;
                    layout.sp = sp == 1;
                    layout.plan_tp = tp;
                    GPT plan;
                    plan.mem.plan_only = true;
                    const size_t before = buffer_bytes_allocated();
                    REQUIRE_NOTHROW(gpt_allocate(plan, c, B, T, layout));
                    CHECK(buffer_bytes_allocated() == before);  // a dry run: nothing allocated
                    CHECK(plan.ls.tp == tp);
                    CHECK(plan.ls.sp == (sp == 1));
                    const MemoryEstimate e = MemoryEstimate::of(plan.mem);
                    CHECK(e.buffers() == gpt_memory_estimate(c, B, T, layout).buffers());
                    const double ideal = split / tp + replicated, p = e.params / sizeof(floatX), mom = e.moments / 8;
                    CHECK(p >= ideal);
                    CHECK(p <= ideal + slack);
                    CHECK(mom >= ideal);  // fp32 m and v of the same elements
                    CHECK(mom <= ideal + slack);
                    CHECK(e.grads >= e.params);  // leaves + fp32 accumulators
                    params[tp] = p;
                    act[tp][sp] = e.activations;
                    // every ZeRO stage over 2 data-parallel ranks, and the CUDA build's plan (bf16, one leaf per rank)
                    for (int zero = 0; zero <= 3; zero++) {
                        CAPTURE(zero);
                        Layout dp2 = layout;
                        dp2.zero_stage = zero;
                        dp2.plan_dp = 2;
                        CHECK_NOTHROW(gpt_memory_estimate(c, B, T, dp2));
                        dp2.elem_bytes = 2;
                        CHECK_NOTHROW(gpt_memory_estimate(c, B, T, dp2));
                    }
                }
            // tp 2 holds about half of tp 1's parameters: half, plus half of the replicated share
            CHECK(params[2] >= params[1] / 2 - slack);
            CHECK(params[2] <= params[1] / 2 + replicated / 2 + slack);
            CHECK(params[4] < params[2]);
            for (int tp : {2, 4}) {
                CAPTURE(tp);
                CHECK(act[tp][1] <= act[tp][0]);  // --sp: the residual stream and LayerNorms hold B*T/tp tokens
                CHECK(act[tp][0] < act[1][0]);    // the split heads and hidden units
            }
            CHECK(act[4][1] < act[2][1]);
            if (recompute == 0)
                MESSAGE(strfmt("%s plan per rank, -r 0: params %.0f / %.0f / %.0f elements at tp 1 / 2 / 4 (replicated "
                               "%.0f); activations MiB tp 1 %.2f, tp 2 %.2f (sp %.2f), tp 4 %.2f (sp %.2f)",
                               moe ? "MoE" : "dense", params[1], params[2], params[4], replicated, act[1][0] / 1048576,
                               act[2][0] / 1048576, act[2][1] / 1048576, act[4][0] / 1048576, act[4][1] / 1048576));
        }
        // layouts the model cannot split: refused by the dry run, naming the flag
        Layout tp3, tp2_sp;
        tp3.plan_tp = 3;
        tp2_sp.plan_tp = 2;
        tp2_sp.sp = true;
        CHECK_THROWS_WITH_AS(gpt_memory_estimate(c, B, T, tp3), doctest::Contains("--tp 3 must divide --n_head 8"),
                             LlmcError);
        CHECK_THROWS_WITH_AS(gpt_memory_estimate(c, 1, 3, tp2_sp),
                             doctest::Contains("--sp: the B*T = 3 tokens of a micro-batch must split evenly over --tp 2"),
                             LlmcError);
    }
    Fixture fx;
    setenv("LLMC_MEMORY_LIMIT", "64M", 1);
    fails_with(with(fx.args("mem", 1), {"-b", "37000", "-t", "64", "-d", "0"}), "memory: this run needs");
    fails_with(with(fx.args("mem", 1), {"-b", "37000", "-t", "64", "-d", "0"}), "lower -b (batch size) or -t");
    CHECK(run_train(fx.args("mem_ok", 1)) == 0);  // a small run fits in 64 MiB
    // --plan: the plan for the flags against the limit, nothing allocated; --max_fit searches
    std::string out;
    const size_t before = buffer_bytes_allocated();
    CHECK(run_train_output(with(fx.args("plan", 1), {"--plan"}), out) == 0);
    CHECK(buffer_bytes_allocated() == before);
    CHECK(out.find("plan: 1 process (pp 1 x dp 1 x tp 1)") != std::string::npos);
    CHECK(out.find("-r 2: the largest stage needs") != std::string::npos);
    CHECK(out.find(": fits") != std::string::npos);
    CHECK(run_train_output(with(fx.args("plan", 1), {"--plan", "-b", "37000", "-t", "64", "-d", "0"}), out) == 0);
    CHECK(out.find("-r 0: the largest stage needs") != std::string::npos);
    CHECK(out.find("does NOT fit") != std::string::npos);
    CHECK(run_train_output(with(fx.args("plan", 1), {"--max_fit", "--plan_ranks", "4", "--pp", "2", "-d", "256"}), out) == 0);
    CHECK(out.find("plan: 4 processes (pp 2 x dp 2 x tp 1)") != std::string::npos);
    CHECK(out.find("pipeline: 2 stages") != std::string::npos);
    CHECK(out.find("-r 2: the largest micro-batch that fits is -b") != std::string::npos);
    // a tensor-parallel plan from one process: 4 ranks as dp 2 x tp 2 with --sp
    CHECK(run_train_output(with(fx.args("plan", 1), {"--plan", "--plan_ranks", "4", "--tp", "2", "--sp"}), out) == 0);
    CHECK(out.find("plan: 4 processes (pp 1 x dp 2 x tp 2 + sp)") != std::string::npos);
    CHECK(out.find("memory per rank (MiB), dp 2, tp 2 + sp") != std::string::npos);
    // --device: the CUDA build's plan (bf16 + fp32 master) against that GPU, from this machine
    CHECK(run_train_output(with(fx.args("plan", 1), {"--plan", "--device", "h200"}), out) == 0);
    // (139.80 GiB of free memory, less the headroom of llmc/ops/op_scratch.h: 0.5 GiB on one GPU)
    CHECK(out.find("available: an H200 (CUDA build, bf16) 139.30 GiB") != std::string::npos);
    CHECK(out.find("available is after 0.50 GiB kept free for what the plan cannot count") != std::string::npos);
    CHECK(run_train_output(with(fx.args("plan", 1), {"--plan", "--device", "h200", "--plan_ranks", "4", "--pp", "2",
                                                     "-d", "256"}), out) == 0);  // dp 2, pp 2: two NCCL communicators
    CHECK(out.find("available: an H200 (CUDA build, bf16) 138.80 GiB") != std::string::npos);
    CHECK(out.find("NCCL 2 communicators x 256 MiB") != std::string::npos);
    // an unknown card: refused with the names the table accepts
    fails_with(with(fx.args("plan", 1), {"--plan", "--device", "a100"}),
               "--device: expected one of t4, v100-16, v100-32, a100-40, a100-80, l4, rtx3090, rtx4090, a6000, h100, "
               "h200, got 'a100'");
    unsetenv("LLMC_MEMORY_LIMIT");
    CHECK(meminfo_available_bytes("/proc/meminfo") > 0);
    CHECK(meminfo_available_bytes("/nonexistent") < 0);
}

TEST_CASE("--plan --device: every card of the table plans; a T4 plan of GPT-2 124M fits as its arithmetic says") {
    std::string out;
    const double GiB = 1073741824.0;
    for (const GpuCard& card : GPU_CARDS) {  // each card parses and plans against its own figures
        CAPTURE(card.name);
        REQUIRE(run_train_output({"--plan", "--device", card.name}, out) == 0);
        CHECK(out.find(strfmt("device: %s: sm_%d%d, %d SMs", card.name, card.cc_major, card.cc_minor, card.sms)) !=
              std::string::npos);
        CHECK(out.find(strfmt("available: %s (%s", card.description, card.bf16 ? "CUDA build, bf16" : "no bf16")) !=
              std::string::npos);
        CHECK(out.find(strfmt(" %.2f GiB\n", (card.free_bytes() - device_headroom_bytes(1, 1, 1, 1)) / GiB)) !=
              std::string::npos);
        if (!card.bf16) CHECK(out.find("no bf16: the fp16 build's plan (make train_gpt PRECISION=fp16") != std::string::npos);
        CHECK(planned_card_sms() == 0);  // the card's SMs were the plan's alone
    }
    // GPT-2 124M on one T4: the plan's bytes (fp16-sized: 2-byte params and activations) for its 40 SMs
    // and its total memory (the lm head's chunk), against its free memory less the headroom
    const GpuCard& t4 = gpu_card("t4");
    const double avail = t4.free_bytes() - device_headroom_bytes(1, 1, 1, 1);
    GPTConfig c;
    c.n_layer = 12; c.n_embd = 768; c.n_head = 12; c.n_kv_head = 12; c.vocab_size = 50257; c.max_seq_len = 1024;
    c.mlp = MLP_GELU; c.pos = POS_LEARNED;
    c.finalize();
    for (int B : {8, 64}) {
        CAPTURE(B);
        REQUIRE(run_train_output({"-e", "gpt2:124M", "-b", std::to_string(B), "-t", "1024", "--plan", "--device", "t4"}, out) == 0);
        CHECK(out.find("lm head: 4096 tokens per chunk") != std::string::npos);  // 1/32 of 15 GiB: 4096 of 100620 bytes
        for (int r = 0; r <= 2; r++) {
            CAPTURE(r);
            Layout l;
            l.plan_dp = 1;
            l.plan_tp = 1;
            l.plan_ep = 1;
            l.elem_bytes = 2;
            l.recompute = r;
            l.device_total_bytes = t4.total_bytes();
            double need;
            {
                const PlanCardScope sms(t4.sms);
                need = gpt_memory_estimate(c, B, 1024, l).buffers();
            }
            // B 8 fits at every -r level (5.3 GiB at -r 0 of the 13.9); B 64's activations do not at -r 0
            if (B == 8) CHECK(need <= avail);
            if (B == 64 && r == 0) CHECK(need > avail);
            CHECK(out.find(strfmt("-r %d: the largest stage needs %.3f GiB: %s", r, need / GiB,
                                  need <= avail ? "fits" : "does NOT fit")) != std::string::npos);
        }
    }
    // what two T4s can train (Kaggle): --max_fit answers with the largest dN and GPT-2 shape and their -z / -r
    REQUIRE(run_train_output({"-e", "gpt2:124M", "-b", "8", "-t", "1024", "--plan", "--max_fit", "--device", "t4",
                              "--plan_ranks", "2"}, out) == 0);
    CHECK(out.find("plan: 2 processes (pp 1 x dp 2 x tp 1)") != std::string::npos);
    CHECK(out.find("largest model at -b 8 x -t 1024 on 2 processes, any -z / -r: d") != std::string::npos);
    CHECK(out.find("; GPT-2 shape: -e gpt2:") != std::string::npos);
}

// the step records of a log without their timings (val and resume records whole)
static std::vector<std::string> log_records(const std::string& path) {
    std::vector<std::string> out;
    for (const std::string& l : lines_of(path)) out.push_back(l.substr(0, l.find(",\"ms\":")));
    return out;
}

TEST_CASE("hardening 8: --offload optimizer: bitwise the run without it, resumes across it, plan and refusal") {
    Fixture fx;
    const std::vector<std::string> off = {"--offload", "optimizer"};
    const std::vector<std::string> moe = {"--n_expert", "4", "--moe_every", "2", "--expert_hidden", "48"};
    // the same losses, gradient norms and checkpoint bytes, dense and MoE
    for (int variant = 0; variant < 2; variant++) {
        CAPTURE(variant);
        const std::vector<std::string> extra = variant ? moe : std::vector<std::string>{};
        const std::string a = "dev" + std::to_string(variant), b = "off" + std::to_string(variant);
        REQUIRE(run_train(with(fx.args(a, 4), extra)) == 0);
        std::string out;
        REQUIRE(run_train_output(with(with(fx.args(b, 4), extra), off), out) == 0);
        CHECK(out.find("offload optimizer") != std::string::npos);
        CHECK(out.find("host: adam moments (fp32)") != std::string::npos);
        for (const char* ck : {"/ckpt_000000002.bin", "/ckpt_000000004.bin"}) {
            CAPTURE(ck);
            CHECK(read_file(fx.dir + "/" + a + ck).size() > 1000);
            CHECK(read_file(fx.dir + "/" + a + ck) == read_file(fx.dir + "/" + b + ck));
        }
        CHECK(log_records(fx.dir + "/" + a + "/log.jsonl") == log_records(fx.dir + "/" + b + "/log.jsonl"));
    }
    // resumes across: the checkpoint format is the same, the continuation bitwise the same
    REQUIRE(run_train(with(fx.args("on_from_off", 4), {"--offload", "optimizer", "--resume", fx.dir + "/dev0/ckpt_000000002.bin"})) == 0);
    REQUIRE(run_train(with(fx.args("off_from_on", 4), {"--resume", fx.dir + "/off0/ckpt_000000002.bin"})) == 0);
    const std::string want = read_file(fx.dir + "/dev0/ckpt_000000004.bin");
    CHECK(read_file(fx.dir + "/on_from_off/ckpt_000000004.bin") == want);
    CHECK(read_file(fx.dir + "/off_from_on/ckpt_000000004.bin") == want);
    fails_with(with(fx.args("bad", 1), {"--offload", "cpu"}), "--offload: expected none or optimizer, got 'cpu'");

    // --plan: the host arenas in their own rows, the device's plan without the optimizer state
    std::string out;
    REQUIRE(run_train_output(with(fx.args("plan", 1), {"--plan", "--device", "h200", "--offload", "optimizer"}), out) == 0);
    CHECK(out.find("--offload optimizer") != std::string::npos);
    CHECK(out.find("host: master weights (fp32)") != std::string::npos);
    CHECK(out.find("GiB of host memory per rank") != std::string::npos);
    CHECK(out.find("host memory of the GPU machine: unknown, not checked") != std::string::npos);

    // the refusal, on the CUDA build's plan (bf16 params, fp32 master: the optimizer state, 12 bytes
    // per parameter, is the biggest part of a small batch of a model large enough for it to outweigh
    // the fixed 32 MiB cuBLASLt workspace): it names --offload optimizer, and with the offload the
    // device side fits; the host side is checked on its own
    GPTConfig c;
    c.n_layer = 4; c.n_embd = 512; c.n_head = 8; c.n_kv_head = 4;
    c.finalize();
    Layout gpu, gpu_offload;  // the CUDA build's plan (bf16), without and with --offload optimizer
    gpu.elem_bytes = gpu_offload.elem_bytes = 2;
    gpu_offload.offload = OFFLOAD_OPTIMIZER;
    const MemoryEstimate dev = gpt_memory_estimate(c, 1, 8, gpu);
    const MemoryEstimate host = gpt_memory_estimate(c, 1, 8, gpu_offload);
    CHECK(dev.master + dev.moments > std::max({dev.params, dev.grads, dev.activations, dev.scratch}));
    // the bf16 plan has the GPU's op scratch and cuBLASLt workspace (llmc/ops/op_scratch.h, the H200's 132
    // SMs), the CPU build's none
    const int widest_biased = std::max({c.n_embd, c.qkv_channels(), c.fc_channels()});
    const size_t op_bytes = op_scratch_bytes(1, 8, c.n_embd, c.n_head, widest_biased, 0, 0, 0, 132);
    CHECK(dev.scratch == (double)((MATMUL_WORKSPACE_BYTES + op_bytes + BUFFER_ALIGN - 1) / BUFFER_ALIGN * BUFFER_ALIGN));
    CHECK(gpt_memory_estimate(c, 1, 8).scratch == 0);
    const double limit = 0.8 * dev.buffers();
    CHECK_THROWS_WITH_AS(check_plan_fits(dev, 1, 8, OFFLOAD_NONE, false, limit, "the test's GPU", 1e12, "the test's host"),
                         doctest::Contains("The biggest part is the optimizer state, master weights and Adam moments "
                                           "(--offload optimizer keeps the fp32 master weights and Adam moments in host "
                                           "memory"), LlmcError);
    CHECK(host.buffers() < limit);
    CHECK(host.host_arenas() == host.host_master + host.host_moments + host.host_staging);
    CHECK(host.host_master == dev.master);
    CHECK(host.host_moments == dev.moments);
    CHECK_NOTHROW(check_plan_fits(host, 1, 8, OFFLOAD_OPTIMIZER, false, limit, "the test's GPU", 1e12, "the test's host"));
    CHECK_THROWS_WITH_AS(check_plan_fits(host, 1, 8, OFFLOAD_OPTIMIZER, false, limit, "the test's GPU",
                                         0.5 * host.host_arenas(), "the test's host"),
                         doctest::Contains("memory: the host side of this run needs"), LlmcError);
    CHECK_THROWS_WITH_AS(check_plan_fits(host, 1, 8, OFFLOAD_OPTIMIZER, false, limit, "the test's GPU",
                                         0.5 * host.host_arenas(), "the test's host"),
                         doctest::Contains("--offload none"), LlmcError);
    // the CPU build (one memory): the activations of a big batch are the biggest part
    CHECK_THROWS_WITH_AS(check_plan_fits(gpt_memory_estimate(c, 512, 64), 512, 64, OFFLOAD_NONE, true, 1048576.0,
                                         "the test's memory", -1, ""),
                         doctest::Contains("The biggest part is the activations (activations grow with B*T"), LlmcError);
}

TEST_CASE("hardening 11: prepare_text.py: val_frac range, unwritable out_dir, stale shards, short last shard") {
    const std::string d = make_temp_dir("llmc_prep_");
    {
        std::ofstream f(d + "/corpus.txt");
        for (int i = 0; i < 60; i++) f << "document " << i << " " << std::string(40 + i % 7, 'a' + i % 26) << "\n\n";
    }
    const std::string py = "python3 dev/data/prepare_text.py " + d + "/corpus.txt --sep blank ";
    CHECK(shell(py + "--out_dir " + d + "/a --val_frac 1", d) == 1);
    CHECK(read_file(d + "/sh_err.txt").find("--val_frac must be in [0, 1)") != std::string::npos);
    CHECK(read_file(d + "/sh_err.txt").find("Traceback") == std::string::npos);
    CHECK(shell(py + "--out_dir " + d + "/a --val_frac -0.5", d) == 1);
    CHECK(shell(py + "--out_dir /proc/llmc_no/x", d) == 1);
    CHECK(read_file(d + "/sh_err.txt").find("cannot write to /proc/llmc_no/x") != std::string::npos);
    CHECK(read_file(d + "/sh_err.txt").find("Traceback") == std::string::npos);
    // shards of ~1000 tokens: the short remainder is merged into the last full shard
    REQUIRE(shell(py + "--out_dir " + d + "/a --shard_tokens 1000", d) == 0);
    std::vector<std::string> shards = glob_files(d + "/a/a_train_*.bin");
    REQUIRE(shards.size() >= 2);
    for (const std::string& s : shards) CHECK(read_shard_info(s).num_tokens >= 500);
    // re-running into the used out_dir: refused, or with --force the old shards go first
    CHECK(shell(py + "--out_dir " + d + "/a", d) == 1);
    CHECK(read_file(d + "/sh_err.txt").find("--force") != std::string::npos);
    REQUIRE(shell(py + "--out_dir " + d + "/a --force", d) == 0);
    CHECK(glob_files(d + "/a/a_train_*.bin").size() == 1);
}

TEST_CASE("hardening 5b: log.jsonl truncated, rotated or deleted under the logger: valid lines, one warning each") {
    Fixture fx;
    const std::string path = fx.dir + "/log.jsonl", err = fx.dir + "/logger_err.txt";
    // the logger's stderr into a file for the duration
    fflush(stderr);
    const int saved = dup(2), to = open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    REQUIRE((saved >= 0 && to >= 0 && dup2(to, 2) == 2));
    close(to);
    {
        JsonlLogger log;
        log.open_for_run(path, -1);
        for (int s = 0; s < 3; s++) log.write({{"step", (double)s}, {"loss", 2.5}});
        REQUIRE(truncate(path.c_str(), 0) == 0);  // copytruncate (the copy aside) of 3 x 22 bytes
        log.write({{"step", 3}, {"loss", 2.5}});
        log.write({{"step", 4}, {"loss", 2.5}});
        CHECK(read_file(path) == "{\"step\":3,\"loss\":2.5}\n{\"step\":4,\"loss\":2.5}\n");  // no NUL gap
        REQUIRE(rename(path.c_str(), (path + ".1").c_str()) == 0);  // rename + create
        { std::ofstream created(path); }
        log.write({{"step", 5}, {"loss", 2.5}});
        CHECK(read_file(path) == "{\"step\":5,\"loss\":2.5}\n");
        CHECK(read_file(path + ".1") == "{\"step\":3,\"loss\":2.5}\n{\"step\":4,\"loss\":2.5}\n");
        REQUIRE(unlink(path.c_str()) == 0);  // deleted
        log.write({{"step", 6}, {"loss", 2.5}});
        log.write({{"step", 7}, {"loss", 2.5}});
        CHECK(read_file(path) == "{\"step\":6,\"loss\":2.5}\n{\"step\":7,\"loss\":2.5}\n");
    }
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    const std::string said = read_file(err);
    INFO(said);
    CHECK(said == "warning: " + path + " was truncated during the run (to 0 of its 66 bytes, as logrotate's "
                  "copytruncate does): logging on from its new end\n"
                  "warning: " + path + " was replaced during the run (moved away, as logrotate does): logging into "
                  "the new file\n"
                  "warning: " + path + " was deleted during the run: logging into a new one\n");
    CHECK(strict_jsonl(path, fx.dir));
}
