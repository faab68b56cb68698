// Token shards and the packed-row data loader.
//
// Shard file (little-endian; written by dev/data/prepare_text.py):
//   64-byte header: char magic[8] = "LLMCSHRD", uint32 version = 1, uint32 token_bytes (2 or 4),
//   uint64 num_tokens, uint32 vocab_size, uint32 eot_token, zero padding; then the tokens.
// llm.c's GPT-2 shards (dev/data/*.py of karpathy/llm.c) are read too, told apart by their first
// word: a 256 x int32 header, int32 magic 20240520, int32 version 1, int32 num_tokens, zero
// padding; then uint16 tokens. They carry no vocabulary fields: they are GPT-2 tokens (vocab
// 50257) whose documents are separated by GPT-2's <|endoftext|> (50256), so that is the eot.
//
// A shard of N tokens holds (N - 1) / T rows; row r is tokens [r*T, r*T + T] (T inputs, T
// targets shifted by one), so rows pack documents and may start mid-document. The data is one
// stream of micro-batches of B rows (a shard holds rows / B of them, in its row order; with
// shuffling a fresh permutation per epoch, seeded by seed, epoch, shard, so an epoch visits every
// row once). The stream does not depend on the number of ranks: each call of next_batch consumes
// the next `world` micro-batches of it and rank r reads the r-th (global micro-batch index
// call * world + rank). The loader's position (epoch, shard, batch) is its whole state, the same
// on every rank: saving and restoring it resumes the exact token stream, under any layout.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>
#include "rand.h"
#include "utils.h"

constexpr uint32_t SHARD_VERSION = 1;
constexpr int SHARD_HEADER_BYTES = 64;
// llm.c's token shard (see the top of this file)
constexpr int32_t LLMC_SHARD_MAGIC = 20240520;
constexpr int LLMC_SHARD_HEADER_BYTES = 256 * 4;
constexpr uint32_t GPT2_VOCAB_SIZE = 50257, GPT2_EOT = 50256;

struct ShardInfo {
    std::string path;
    uint32_t token_bytes = 0, vocab_size = 0, eot_token = 0;
    uint64_t num_tokens = 0;
    uint32_t header_bytes = SHARD_HEADER_BYTES;  // where the tokens start
    bool llmc_format = false;                    // an llm.c GPT-2 shard
};

// The header of an llm.c shard, whose first 64 bytes (h) have been read; checks it and the file size.
inline ShardInfo read_llmc_shard_info(const std::string& path, const unsigned char* h) {
    ShardInfo s;
    s.path = path;
    s.llmc_format = true;
    s.header_bytes = LLMC_SHARD_HEADER_BYTES;
    s.token_bytes = 2;
    s.vocab_size = GPT2_VOCAB_SIZE;
    s.eot_token = GPT2_EOT;
    int32_t version, n;
    memcpy(&version, h + 4, 4);
    memcpy(&n, h + 8, 4);
    LLMC_CHECK(version == 1, "%s: llm.c token shard (magic %d) of version %d, expected version 1", path.c_str(),
               LLMC_SHARD_MAGIC, version);
    LLMC_CHECK(n >= 0, "%s: llm.c token shard: header says %d tokens, expected a count >= 0", path.c_str(), n);
    s.num_tokens = (uint64_t)n;
    const long long actual = file_size_bytes(path);
    const long long expected = LLMC_SHARD_HEADER_BYTES + 2LL * n;  // n < 2^31: no overflow
    LLMC_CHECK(actual == expected,
               "%s: llm.c token shard: %s: header says %d uint16 tokens (file of %lld bytes), file is %lld bytes",
               path.c_str(), actual < expected ? "truncated" : "trailing bytes", n, expected, actual);
    return s;
}

// Reads and validates a shard header against the file size; says exactly what is wrong.
inline ShardInfo read_shard_info(const std::string& path) {
    ShardInfo s;
    s.path = path;
    FILE* f = fopen_or_fail(path, "rb");
    unsigned char h[SHARD_HEADER_BYTES] = {0};
    size_t got = fread(h, 1, sizeof(h), f);
    fclose(f);
    int32_t magic32;
    memcpy(&magic32, h, 4);
    if (got >= 12 && magic32 == LLMC_SHARD_MAGIC) return read_llmc_shard_info(path, h);
    LLMC_CHECK(got == sizeof(h), "%s: not a token shard: file is %zu bytes, shorter than the %d-byte header",
               path.c_str(), got, SHARD_HEADER_BYTES);
    LLMC_CHECK(memcmp(h, "LLMCSHRD", 8) == 0,
               "%s: not a token shard: magic is \"%.8s\", expected \"LLMCSHRD\" (make shards with dev/data/prepare_text.py) "
               "or llm.c's int32 %d", path.c_str(), (const char*)h, LLMC_SHARD_MAGIC);
    uint32_t version;
    memcpy(&version, h + 8, 4);
    memcpy(&s.token_bytes, h + 12, 4);
    memcpy(&s.num_tokens, h + 16, 8);
    memcpy(&s.vocab_size, h + 24, 4);
    memcpy(&s.eot_token, h + 28, 4);
    LLMC_CHECK(version == SHARD_VERSION, "%s: shard version %u, expected %u", path.c_str(), version, SHARD_VERSION);
    LLMC_CHECK(s.token_bytes == 2 || s.token_bytes == 4, "%s: token width %u bytes, expected 2 or 4",
               path.c_str(), s.token_bytes);
    LLMC_CHECK(s.eot_token < s.vocab_size, "%s: eot_token %u is not below the shard's vocab_size %u",
               path.c_str(), s.eot_token, s.vocab_size);
    // in checked 64-bit arithmetic: a huge num_tokens must not wrap around to the real file size
    // (it would pass this check and then ask for an impossible allocation)
    const long long actual = file_size_bytes(path);
    uint64_t body = 0, expected = 0;
    const bool fits = !__builtin_mul_overflow(s.num_tokens, (uint64_t)s.token_bytes, &body) &&
                      !__builtin_add_overflow(body, (uint64_t)SHARD_HEADER_BYTES, &expected);
    LLMC_CHECK(fits && expected <= (uint64_t)INT64_MAX,
               "%s: corrupt header: %llu tokens of %u bytes is more than any file can hold (file is %lld bytes)",
               path.c_str(), (unsigned long long)s.num_tokens, s.token_bytes, actual);
    LLMC_CHECK((uint64_t)actual == expected,
               "%s: %s: header says %llu tokens of %u bytes (file of %llu bytes), file is %lld bytes",
               path.c_str(), (uint64_t)actual < expected ? "truncated" : "trailing bytes",
               (unsigned long long)s.num_tokens, s.token_bytes, (unsigned long long)expected, actual);
    return s;
}

// Loads all tokens of a shard, checking each id against the model's vocabulary.
inline std::vector<int> load_shard_tokens(const ShardInfo& s, int model_vocab_size) {
    FILE* f = fopen_or_fail(s.path, "rb");
    fseek(f, s.header_bytes, SEEK_SET);
    std::vector<int> tokens(s.num_tokens);
    if (s.token_bytes == 2) {
        std::vector<uint16_t> raw(s.num_tokens);
        fread_or_fail(raw.data(), raw.size() * 2, f, s.path, "tokens");
        for (size_t i = 0; i < raw.size(); i++) tokens[i] = raw[i];
    } else {
        std::vector<uint32_t> raw(s.num_tokens);
        fread_or_fail(raw.data(), raw.size() * 4, f, s.path, "tokens");
        for (size_t i = 0; i < raw.size(); i++) {
            LLMC_CHECK(raw[i] < (1u << 31), "%s: token %zu has id %u, larger than any vocabulary", s.path.c_str(), i, raw[i]);
            tokens[i] = (int)raw[i];
        }
    }
    fclose(f);
    for (size_t i = 0; i < tokens.size(); i++)
        LLMC_CHECK(tokens[i] < model_vocab_size, "%s: token %zu has id %d, but the model's vocab_size is %d",
                   s.path.c_str(), i, tokens[i], model_vocab_size);
    return tokens;
}

// doc_start[t] = index of the last EOT at or before t in the row, 0 when the row began mid-document
inline void compute_doc_start(int* doc_start, const int* row_tokens, int T, int eot) {
    int start = 0;
    for (int t = 0; t < T; t++) {
        if (row_tokens[t] == eot) start = t;
        doc_start[t] = start;
    }
}

struct LoaderState {
    int64_t epoch = 0, shard = 0, batch = 0;  // next batch to serve: batch index inside shard of epoch
};

struct DataLoader {
    std::vector<ShardInfo> shards;
    int B = 0, T = 0, rank = 0, world = 1;
    bool shuffle = false;
    uint64_t seed = 0;
    int vocab_size = 0, eot = 0;
    LoaderState state;
    // the loaded shard
    int64_t loaded_epoch = -1, loaded_shard = -1;
    std::vector<int> tokens;
    std::vector<int64_t> row_order;

    DataLoader() = default;
    DataLoader(const std::string& pattern, int B_, int T_, int rank_, int world_, bool shuffle_, uint64_t seed_,
               int model_vocab_size, const char* what)
        : B(B_), T(T_), rank(rank_), world(world_), shuffle(shuffle_), seed(seed_), vocab_size(model_vocab_size) {
        std::vector<std::string> files = glob_files(pattern);
        LLMC_CHECK(!files.empty(), "%s: no files match '%s'", what, pattern.c_str());
        const int64_t batch_rows = (int64_t)B * world;
        LLMC_CHECK(B > 0 && T > 0 && world > 0 && batch_rows <= INT32_MAX, "%s: bad batch shape B %d x T %d x %d ranks",
                   what, B, T, world);
        std::vector<std::string> skipped;
        for (const std::string& p : files) {
            ShardInfo s = read_shard_info(p);
            LLMC_CHECK((int64_t)s.vocab_size <= model_vocab_size,
                       "%s: shard vocab_size %u is larger than the model's vocab_size %d (give --vocab_size %u%s)",
                       p.c_str(), s.vocab_size, model_vocab_size, s.vocab_size,
                       s.llmc_format ? ", or a GPT-2 preset such as -e gpt2:124M, for llm.c's GPT-2 shards" : "");
            LLMC_CHECK(shards.empty() || s.eot_token == shards[0].eot_token,
                       "%s: eot_token %u differs from %u in %s", p.c_str(), s.eot_token, shards[0].eot_token,
                       shards[0].path.c_str());
            const uint64_t rows = s.num_tokens > 0 ? (s.num_tokens - 1) / (uint64_t)T : 0;
            if (rows < (uint64_t)B) {
                // A shard smaller than one micro-batch (typically the short last shard of a split)
                // cannot serve one; skip it with a warning rather than refuse the whole run.
                if (rank == 0)
                    fprintf(stderr, "warning: %s: skipping %s: %llu tokens make %llu rows of T=%d, fewer than one batch "
                                    "of B = %d rows\n", what, p.c_str(), (unsigned long long)s.num_tokens,
                            (unsigned long long)rows, T, B);
                skipped.push_back(p);
                continue;
            }
            shards.push_back(s);
        }
        LLMC_CHECK(!shards.empty(),
                   "%s: none of the %zu shard(s) matching '%s' holds one batch: each has fewer than B = %d rows "
                   "of T=%d tokens (see the warnings above); use a smaller -b / -t or more data",
                   what, files.size(), pattern.c_str(), B, T);
        eot = (int)shards[0].eot_token;
        reset(LoaderState{});
    }

    // micro-batches of B rows in shard s
    int64_t batches_in_shard(int64_t s) const { return (int64_t)((shards[s].num_tokens - 1) / T) / (int64_t)B; }

    void reset(const LoaderState& st) {
        LLMC_CHECK(st.shard >= 0 && st.shard < (int64_t)shards.size() && st.batch >= 0 &&
                       st.batch <= batches_in_shard(st.shard),
                   "loader state (epoch %lld, shard %lld, batch %lld) does not fit the %zu shards given",
                   (long long)st.epoch, (long long)st.shard, (long long)st.batch, shards.size());
        state = st;
    }

    void load(int64_t epoch, int64_t shard) {
        if (shard != loaded_shard) tokens = load_shard_tokens(shards[shard], vocab_size);
        if (shard != loaded_shard || epoch != loaded_epoch) {
            int64_t n_rows = (int64_t)(shards[shard].num_tokens - 1) / T;
            if (shuffle) {
                row_order = random_permutation(n_rows, seed ^ (0x9E3779B97F4A7C15ull * (uint64_t)(epoch + 1)) ^
                                                           ((uint64_t)shard << 32));
            } else {
                row_order.resize(n_rows);
                for (int64_t i = 0; i < n_rows; i++) row_order[i] = i;
            }
        }
        loaded_epoch = epoch;
        loaded_shard = shard;
    }

    // Fills inputs, targets, doc_start ([B, T] each) with this rank's micro-batch and advances
    // past all ranks' micro-batches of this call.
    void next_batch(int* inputs, int* targets, int* doc_start) {
        for (int r = 0; r < world; r++) {
            if (state.batch >= batches_in_shard(state.shard)) {
                state.batch = 0;
                if (++state.shard == (int64_t)shards.size()) { state.shard = 0; state.epoch++; }
            }
            if (r == rank) read_batch(inputs, targets, doc_start);
            state.batch++;
        }
    }

    void read_batch(int* inputs, int* targets, int* doc_start) {
        load(state.epoch, state.shard);
        for (int b = 0; b < B; b++) {
            int64_t r = row_order[state.batch * B + b];
            const int* src = tokens.data() + r * T;
            for (int t = 0; t < T; t++) {
                inputs[b * T + t] = src[t];
                targets[b * T + t] = src[t + 1];
            }
            compute_doc_start(doc_start + b * T, inputs + b * T, T, eot);
        }
    }
};
