// Seeded mutation fuzzing of the file readers (token shards, checkpoints), built with
// -fsanitize=address,undefined -fno-sanitize-recover=all by `make fuzz`.
//
//   fuzz_readers shard [--trials N] [--seed S]              shards (ours and llm.c's) through
//                                                             DataLoader (header, size check,
//                                                             mapping, batches and their ids)
//   fuzz_readers formats [--trials N] [--seed S]            llm.c model files (read_llmc_model)
//                                                             and tokenizer files of both formats
//                                                             (load_tokenizer_file + decode)
//   fuzz_readers checkpoint FILE [--trials N] [--seed S]    mutations of the valid checkpoint
//                                                             FILE through load_checkpoint(path):
//                                                             verify_checkpoint (the verify pass,
//                                                             one process) + CheckpointFile reads
//   fuzz_readers make_shard FILE                            writes a valid shard (for make fuzz)
//
// Every trial runs in a forked child with an alarm, so one trial's crash or hang is counted and
// reported (with the trial number, to reproduce it) without stopping the others. A child exits 0
// when the reader accepted the file, 2 when it refused it with an LlmcError (a clean error); any
// other end is a crash: a sanitizer report (ASan/UBSan exit 1), a signal, an uncaught exception
// (std::length_error, std::bad_alloc: the trainer would abort with rc 134), or SIGALRM (a hang).
// The summary line gives trials, clean errors, accepted, crashes and hangs; the exit code is 1
// when there was any crash or hang.
#include "llmc/io/checkpoint.h"
#include "llmc/io/dataloader.h"
#include "llmc/io/llmc_format.h"
#include "llmc/io/tokenizer.h"

#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>
#include <sys/wait.h>
#include <unistd.h>

namespace {

struct Mutator {
    Rng rng;
    explicit Mutator(uint64_t seed) : rng(seed) {}
    uint64_t below(uint64_t n) { return n ? rng.below(n) : 0; }

    // offsets of header words that look like counts or sizes (a small nonzero value): the fields
    // whose corruption a reader most needs to survive (num_tokens, n_fields, n_params, ...)
    static std::vector<std::pair<size_t, int>> length_like(const std::string& b) {
        std::vector<std::pair<size_t, int>> out;
        const size_t lim = std::min<size_t>(b.size(), 4096);
        for (size_t o = 0; o + 8 <= lim; o += 4) {
            uint32_t v32;
            memcpy(&v32, b.data() + o, 4);
            if (v32 > 0 && v32 < (1u << 24)) out.push_back({o, 4});
            if (o % 8 == 0) {
                uint64_t v64;
                memcpy(&v64, b.data() + o, 8);
                if (v64 >= (1ull << 24) && v64 < (1ull << 40)) out.push_back({o, 8});
            }
        }
        return out;
    }

    uint64_t interesting(uint64_t orig, size_t file_size) {
        const uint64_t vals[] = {0, 1, 2, 3, 4, 7, 8, 0x7f, 0x80, 0xff, 0xffff, 0x10000, 0x7fffffff, 0x80000000ull,
                                 0xffffffffull, 0x100000000ull, 0x7fffffffffffffffull, 0x8000000000000000ull,
                                 ~0ull, orig + (1ull << 62), orig + (1ull << 63), orig + 1, orig - 1, orig * 2,
                                 orig / 2, (uint64_t)file_size, (uint64_t)file_size / 4, 0x5555555555555556ull};
        return vals[below(sizeof(vals) / sizeof(vals[0]))];
    }

    void mutate(std::string& b, size_t header_hint) {
        const int n_mut = 1 + (int)below(4);
        for (int k = 0; k < n_mut; k++) {
            const size_t size = b.size();
            auto pos = [&]() -> size_t {  // biased toward the header
                if (size == 0) return 0;
                uint64_t r = below(100);
                if (r < 50) return below(std::min(size, header_hint));
                if (r < 75) return below(std::min<size_t>(size, 4096));
                return below(size);
            };
            switch (below(7)) {
                case 0:  // bit flip
                    if (size) { size_t p = pos(); b[p] = (char)(b[p] ^ (1 << below(8))); }
                    break;
                case 1: {  // interesting byte
                    const unsigned char v[] = {0, 1, 0x7f, 0x80, 0xff, 0xfe};
                    if (size) b[pos()] = (char)v[below(sizeof(v))];
                    break;
                }
                case 2:
                case 3: {  // a count-like word (or any header word) set to an interesting value
                    auto cands = length_like(b);
                    size_t o;
                    int w;
                    if (!cands.empty() && below(3) != 0) {
                        auto c = cands[below(cands.size())];
                        o = c.first;
                        w = c.second;
                    } else {
                        w = below(2) ? 8 : 4;
                        o = below(std::max<size_t>(1, std::min(size, header_hint) / w)) * w;
                    }
                    if (o + w > size) break;
                    uint64_t orig = 0;
                    memcpy(&orig, b.data() + o, w);
                    uint64_t v = interesting(orig, size);
                    memcpy(&b[o], &v, w);  // little-endian host: the low bytes for a 4-byte word
                    break;
                }
                case 4:  // truncate
                    b.resize(below(size + 1));
                    break;
                case 5: {  // append junk
                    size_t n = 1 + below(64);
                    for (size_t i = 0; i < n; i++) b.push_back((char)below(256));
                    break;
                }
                case 6: {  // copy a chunk over another place
                    if (size < 2) break;
                    size_t len = 1 + below(std::min<size_t>(size / 2, 64));
                    size_t from = below(size - len + 1), to = below(size - len + 1);
                    memmove(&b[to], &b[from], len);
                    break;
                }
            }
        }
    }
};

void write_bytes(const std::string& path, const std::string& b) {
    FILE* f = fopen(path.c_str(), "wb");
    if (!f || fwrite(b.data(), 1, b.size(), f) != b.size() || fclose(f) != 0) {
        fprintf(stderr, "fuzz_readers: cannot write %s\n", path.c_str());
        exit(1);
    }
}

std::string read_bytes(const std::string& path) {
    FILE* f = fopen(path.c_str(), "rb");
    if (!f) { fprintf(stderr, "fuzz_readers: cannot read %s\n", path.c_str()); exit(1); }
    std::string b;
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), f)) > 0) b.append(buf, n);
    fclose(f);
    return b;
}

std::string valid_shard(Rng& rng, uint32_t token_bytes, size_t n_tokens) {
    std::string b(SHARD_HEADER_BYTES, '\0');
    memcpy(&b[0], "LLMCSHRD", 8);
    uint32_t version = SHARD_VERSION, vocab = 257, eot = 256;
    uint64_t n = n_tokens;
    memcpy(&b[8], &version, 4);
    memcpy(&b[12], &token_bytes, 4);
    memcpy(&b[16], &n, 8);
    memcpy(&b[24], &vocab, 4);
    memcpy(&b[28], &eot, 4);
    for (size_t i = 0; i < n_tokens; i++) {
        uint32_t t = i % 17 == 0 ? 256 : (uint32_t)rng.below(256);
        b.append((const char*)&t, token_bytes);
    }
    return b;
}

// llm.c's GPT-2 shard: 256 int32 header (magic, version, count), uint16 GPT-2 tokens
std::string valid_llmc_shard(Rng& rng, size_t n_tokens) {
    std::string b(LLMC_SHARD_HEADER_BYTES, '\0');
    const int32_t head[3] = {LLMC_SHARD_MAGIC, 1, (int32_t)n_tokens};
    memcpy(&b[0], head, sizeof(head));
    for (size_t i = 0; i < n_tokens; i++) {
        uint16_t t = i % 17 == 0 ? (uint16_t)GPT2_EOT : (uint16_t)rng.below(GPT2_EOT);
        b.append((const char*)&t, 2);
    }
    return b;
}

// A tiny llm.c model file (L 1, C 8, NH 2, maxT 4, V 10 padded to 128), fp32 or bf16.
std::string valid_llmc_model(Rng& rng, bool bf16) {
    LlmcModelShape s;
    s.max_seq_len = 4; s.vocab_size = 10; s.n_layer = 1; s.n_head = 2; s.n_embd = 8; s.padded_vocab_size = 128;
    int32_t h[256] = {0};
    const int32_t head[8] = {LLMC_MODEL_MAGIC, bf16 ? LLMC_MODEL_VERSION_BF16 : LLMC_MODEL_VERSION_FP32, 4, 10, 1, 2, 8, 128};
    memcpy(h, head, sizeof(head));
    std::string b((const char*)h, sizeof(h));
    for (size_t i = 0; i < s.num_params(); i++) {
        const float v = (float)rng.below(1000) / 1000.0f - 0.5f;
        if (bf16) { uint16_t x = float_to_bf16(v); b.append((const char*)&x, 2); }
        else b.append((const char*)&v, 4);
    }
    return b;
}

// A vocabulary of 40 tokens (some multi-byte UTF-8 pieces, some split characters) in our format
// (LLMCVOCB) or llm.c's (gpt2_tokenizer.bin, version 2).
std::string valid_tokenizer(Rng& rng, bool ours) {
    std::vector<std::string> pieces;
    const char* some[] = {"a", " the", "\xE0\xA6", "\x95", "\xE0\xA6\x95", "\xF0\x9F", "\x98\x80", "<|endoftext|>"};
    for (int i = 0; i < 40; i++) pieces.push_back(some[rng.below(8)]);
    std::string b;
    if (ours) {
        b = "LLMCVOCB";
        for (uint32_t w : {VOCAB_FILE_VERSION, 40u, 7u, 0u}) b.append((const char*)&w, 4);
    } else {
        uint32_t h[256] = {LLMC_TOKENIZER_MAGIC, 2, 40, 7};
        b.assign((const char*)h, sizeof(h));
    }
    for (const std::string& p : pieces) {
        if (ours) { uint32_t n = (uint32_t)p.size(); b.append((const char*)&n, 4); }
        else b.push_back((char)p.size());
        b += p;
    }
    return b;
}

// Runs `body` in a child; returns 0 accepted, 2 clean error, 1 crash, 3 hang.
template <class F>
int run_trial(F body, int timeout_s) {
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) { perror("fork"); exit(1); }
    if (pid == 0) {
        alarm(timeout_s);
        int code = 0;
        try {
            body();
        } catch (const LlmcError&) {
            code = 2;
        } catch (const std::exception& e) {
            // not a clean error: the trainer's main() would not catch it and abort
            fprintf(stderr, "uncaught %s\n", e.what());
            code = 4;
        }
        _exit(code);  // no atexit/leak checks in the child: leaks are not what this fuzz looks for
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM) return 3;
    if (WIFEXITED(status) && (WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == 2)) return WEXITSTATUS(status);
    return 1;
}

struct Counts {
    int trials = 0, clean = 0, accepted = 0, crashes = 0, hangs = 0;
    void add(int r, const char* what, int trial) {
        trials++;
        if (r == 0) accepted++;
        if (r == 2) clean++;
        if (r == 1) { crashes++; fprintf(stderr, "fuzz %s: CRASH in trial %d\n", what, trial); }
        if (r == 3) { hangs++; fprintf(stderr, "fuzz %s: HANG in trial %d\n", what, trial); }
    }
    int report(const char* what) const {
        printf("fuzz %s: trials %d, clean errors %d, accepted %d, crashes %d, hangs %d\n", what, trials, clean,
               accepted, crashes, hangs);
        return crashes + hangs > 0 ? 1 : 0;
    }
};

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: fuzz_readers shard|formats|checkpoint FILE|make_shard FILE [--trials N] [--seed S]\n");
        return 1;
    }
    const std::string mode = argv[1];
    std::string file;
    int argi = 2;
    if (mode == "checkpoint" || mode == "make_shard") {
        if (argc < 3) { fprintf(stderr, "fuzz_readers %s: needs FILE\n", mode.c_str()); return 1; }
        file = argv[argi++];
    }
    int trials = 600;
    uint64_t seed = 1;
    for (; argi + 1 < argc; argi += 2) {
        if (!strcmp(argv[argi], "--trials")) trials = atoi(argv[argi + 1]);
        else if (!strcmp(argv[argi], "--seed")) seed = strtoull(argv[argi + 1], nullptr, 10);
    }
    char dir_tmpl[] = "/tmp/llmc_fuzz_XXXXXX";
    if (mode == "make_shard") {
        Rng rng(seed);
        write_bytes(file, valid_shard(rng, 2, 4000));
        return 0;
    }
    if (!mkdtemp(dir_tmpl)) { perror("mkdtemp"); return 1; }
    const std::string dir = dir_tmpl, path = dir + "/input.bin";
    Mutator mut(seed);
    Counts counts;
    if (mode == "shard") {
        for (int t = 0; t < trials; t++) {
            const uint32_t width = mut.below(2) ? 2 : 4;
            const bool llmc = t % 3 == 2;  // a third are llm.c's GPT-2 shards
            std::string b = llmc ? valid_llmc_shard(mut.rng, 40 + mut.below(400))
                                 : valid_shard(mut.rng, width, 40 + mut.below(400));
            if (t % 10 != 0) mut.mutate(b, llmc ? 16 : SHARD_HEADER_BYTES);  // every 10th stays valid: the accept path
            write_bytes(path, b);
            const int B = 1 + (int)mut.below(3), T = 1 + (int)mut.below(16);
            const int vocab = llmc ? (mut.below(4) == 0 ? 257 : 50257) : mut.below(4) == 0 ? 65536 : 257;
            int r = run_trial([&] {
                DataLoader dl(path, B, T, 0, 1, true, 7, vocab, "fuzz");
                std::vector<int> in((size_t)B * T), tgt((size_t)B * T), ds((size_t)B * T);
                for (int k = 0; k < 40; k++) dl.next_batch(in.data(), tgt.data(), ds.data());
            }, 10);
            counts.add(r, "shard", t);
        }
        remove(path.c_str());
        rmdir(dir.c_str());
        return counts.report("shard");
    }
    if (mode == "checkpoint") {
        const std::string base = read_bytes(file);
        // its header: everything before the first parameter (a few KB at most for a tiny model)
        const size_t header_hint = std::min<size_t>(base.size(), 2048);
        for (int t = 0; t < trials; t++) {
            std::string b = base;
            if (t % 10 != 0) mut.mutate(b, header_hint);
            write_bytes(path, b);
            int r = run_trial([&] {
                Checkpoint ck = load_checkpoint(path);
                (void)ck;
            }, 10);
            counts.add(r, "checkpoint", t);
        }
        remove(path.c_str());
        rmdir(dir.c_str());
        return counts.report("checkpoint");
    }
    if (mode == "formats") {
        for (int t = 0; t < trials; t++) {
            const int kind = t % 4;  // llm.c model fp32, bf16; our vocabulary, llm.c's tokenizer
            std::string b = kind < 2 ? valid_llmc_model(mut.rng, kind == 1) : valid_tokenizer(mut.rng, kind == 2);
            if (t % 10 >= 2) mut.mutate(b, kind == 2 ? 24 : 64);
            write_bytes(path, b);
            std::vector<int> ids(64);
            for (int& id : ids) id = (int)mut.below(48) - 4;  // some out of range, some negative
            int r = run_trial([&] {
                if (kind < 2) {
                    LlmcModelFile m = read_llmc_model(path);
                    (void)m;
                } else {
                    Tokenizer tok = load_tokenizer_file(path);
                    (void)tok.decode(ids);
                }
            }, 10);
            counts.add(r, kind < 2 ? "llm.c model" : "tokenizer", t);
        }
        remove(path.c_str());
        rmdir(dir.c_str());
        return counts.report("formats");
    }
    fprintf(stderr, "fuzz_readers: unknown mode '%s'\n", mode.c_str());
    return 1;
}
