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
//
// Nothing is loaded: the shard a rank reads is mapped read-only (MappedShard; the ranks of a node
// share the page cache's copy) and each micro-batch's rows are read from it in the file's width,
// their ids checked against the model's vocabulary as they are read: a bad id stops the run when
// the first micro-batch that holds it is served, naming the shard and the token's position (tokens
// no served row holds are never read). A shuffled shard's row order is built a slice per
// micro-batch of the shard before it, so a shard switch waits for neither. The loader's own host
// memory is two row orders, 8 bytes a row; the start-up memory table shows it (print_data_memory).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>
#include <sys/mman.h>
#include <sys/stat.h>
#include "llmc/rand.h"
#include "llmc/utils.h"

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
    // (it would pass this check and then read past the end of the mapping)
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

// A shard mapped read-only and shared (MAP_SHARED), so the processes of a node that read it share
// one copy, the page cache's; its tokens are read in place, in the file's width, and each id is
// checked against the model's vocabulary as it is read. Nothing is copied but the rows asked for.
// A shard must not change under a running trainer: a file truncated while it is mapped faults
// (SIGBUS) on its missing pages; one that changed between start-up and its mapping is refused.
struct MappedShard {
    std::string path;
    const unsigned char* base = nullptr;  // the whole file
    size_t bytes = 0;
    uint32_t header_bytes = 0, token_bytes = 0;
    int vocab_size = 0;  // the model's

    MappedShard() = default;
    // random_access: the rows are read in a shuffled order (every page is needed soon: read the
    // whole shard ahead, in the background); otherwise in file order (read ahead of the reads)
    MappedShard(const ShardInfo& s, int model_vocab_size, bool random_access)
        : path(s.path), header_bytes(s.header_bytes), token_bytes(s.token_bytes), vocab_size(model_vocab_size) {
        FILE* f = fopen_or_fail(s.path, "rb");  // a directory or FIFO put in its place is refused here
        struct stat st;
        const size_t expected = s.header_bytes + s.num_tokens * s.token_bytes;  // checked by read_shard_info
        if (fstat(fileno(f), &st) != 0 || (uint64_t)st.st_size != expected) {
            fclose(f);
            LLMC_FAIL("%s: the shard changed since start-up: it is %lld bytes, its header said %zu", s.path.c_str(),
                      (long long)file_size_bytes(s.path), expected);
        }
        void* p = mmap(nullptr, expected, PROT_READ, MAP_SHARED, fileno(f), 0);
        const int err = errno;
        fclose(f);  // the mapping holds the file
        LLMC_CHECK(p != MAP_FAILED, "%s: cannot map %zu bytes (%s)", s.path.c_str(), expected, strerror(err));
        base = (const unsigned char*)p;
        bytes = expected;
        madvise(p, bytes, random_access ? MADV_WILLNEED : MADV_SEQUENTIAL);  // a hint: its failure changes nothing
    }
    MappedShard(const MappedShard&) = delete;
    MappedShard& operator=(const MappedShard&) = delete;
    MappedShard(MappedShard&& o) noexcept { *this = std::move(o); }
    MappedShard& operator=(MappedShard&& o) noexcept {
        if (this != &o) {
            unmap();
            path = std::move(o.path);
            base = o.base;
            bytes = o.bytes;
            header_bytes = o.header_bytes;
            token_bytes = o.token_bytes;
            vocab_size = o.vocab_size;
            o.base = nullptr;
            o.bytes = 0;
        }
        return *this;
    }
    ~MappedShard() { unmap(); }
    void unmap() {
        if (base) munmap((void*)base, bytes);
        base = nullptr;
        bytes = 0;
    }

    // dst[i] = token first + i, for i < n (the caller keeps first + n within the shard)
    void read(uint64_t first, int n, int* dst) const {
        // the header is 64 or 1024 bytes and the mapping page-aligned: the tokens are aligned to their width
        if (token_bytes == 2) copy_checked((const uint16_t*)(base + header_bytes) + first, n, dst, first);
        else copy_checked((const uint32_t*)(base + header_bytes) + first, n, dst, first);
    }
    template <typename W>
    void copy_checked(const W* src, int n, int* dst, uint64_t first) const {
        for (int i = 0; i < n; i++) {
            const uint32_t id = src[i];
            LLMC_CHECK(id < (uint32_t)vocab_size, "%s: token %llu has id %u, but the model's vocab_size is %d",
                       path.c_str(), (unsigned long long)(first + i), id, vocab_size);
            dst[i] = (int)id;
        }
    }
};

// Fisher-Yates shuffle of [0, n) with a fresh Rng(seed) (a permutation depends only on its seed),
// built in slices: the loader builds the next shard's row order while it serves the current one.
struct RowShuffle {
    std::vector<int64_t> perm;
    Rng rng;
    int64_t n = 0, i = 0;  // perm holds [0, n) once filled; then the swaps run i = n-1 down to 1

    void start(int64_t n_, uint64_t seed) {
        perm.clear();
        perm.reserve(n_);  // no fill here: the identity is written in slices too
        rng = Rng(seed);
        n = n_;
        i = n_ - 1;
    }
    int64_t work_left() const { return (n - (int64_t)perm.size()) + (i > 0 ? i : 0); }
    // `units` more of the work_left() units: one per element filled, one per swap
    void advance(int64_t units) {
        for (; units > 0 && (int64_t)perm.size() < n; units--) perm.push_back((int64_t)perm.size());
        for (; units > 0 && i > 0; units--, i--) {
            const int64_t j = (int64_t)rng.below((uint64_t)i + 1);
            const int64_t t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
    }
};

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
    MappedShard mapped;  // the shard this rank reads now (no other is mapped)
    int64_t mapped_shard = -1;
    // shuffle: the row order of (order_epoch, order_shard), and the one of the (epoch, shard) after
    // it, being built a slice per micro-batch, so that it is complete when its shard begins
    std::vector<int64_t> row_order;
    int64_t order_epoch = -1, order_shard = -1;
    RowShuffle ahead;
    int64_t ahead_epoch = -1, ahead_shard = -1;

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

    // rows of T + 1 tokens (stride T) in shard s, and the micro-batches of B of them it serves
    int64_t rows_in_shard(int64_t s) const { return (int64_t)((shards[s].num_tokens - 1) / T); }
    int64_t batches_in_shard(int64_t s) const { return rows_in_shard(s) / (int64_t)B; }

    void reset(const LoaderState& st) {
        LLMC_CHECK(st.shard >= 0 && st.shard < (int64_t)shards.size() && st.batch >= 0 &&
                       st.batch <= batches_in_shard(st.shard),
                   "loader state (epoch %lld, shard %lld, batch %lld) does not fit the %zu shards given",
                   (long long)st.epoch, (long long)st.shard, (long long)st.batch, shards.size());
        state = st;
    }

    // host memory of the loader itself, at most: two row orders (the current and the next shard's)
    size_t host_bytes() const {
        int64_t rows = 0;
        for (size_t s = 0; s < shards.size(); s++) rows = std::max(rows, rows_in_shard((int64_t)s));
        return shuffle ? 2 * (size_t)rows * sizeof(int64_t) : 0;
    }

    uint64_t shuffle_seed(int64_t epoch, int64_t shard) const {
        return seed ^ (0x9E3779B97F4A7C15ull * (uint64_t)(epoch + 1)) ^ ((uint64_t)shard << 32);
    }

    // row_order for (epoch, shard): the one built ahead, finished (nothing is left of it unless the
    // position was reset), or built now (at start-up, after a reset elsewhere); then the next begins
    void order_for(int64_t epoch, int64_t shard) {
        if (epoch == order_epoch && shard == order_shard) return;
        if (epoch != ahead_epoch || shard != ahead_shard) ahead.start(rows_in_shard(shard), shuffle_seed(epoch, shard));
        ahead.advance(ahead.work_left());
        std::swap(row_order, ahead.perm);
        order_epoch = epoch;
        order_shard = shard;
        ahead_shard = shard + 1 == (int64_t)shards.size() ? 0 : shard + 1;
        ahead_epoch = ahead_shard == 0 ? epoch + 1 : epoch;
        ahead.start(rows_in_shard(ahead_shard), shuffle_seed(ahead_epoch, ahead_shard));
    }

    // Fills inputs, targets, doc_start ([B, T] each) with this rank's micro-batch and advances
    // past all ranks' micro-batches of this call.
    void next_batch(int* inputs, int* targets, int* doc_start) {
        for (int r = 0; r < world; r++) {
            if (state.batch >= batches_in_shard(state.shard)) {
                state.batch = 0;
                if (++state.shard == (int64_t)shards.size()) { state.shard = 0; state.epoch++; }
            }
            if (shuffle) {
                // every rank builds the same row orders: its share of the next one for this micro-batch
                order_for(state.epoch, state.shard);
                const int64_t batches_left = batches_in_shard(state.shard) - state.batch;
                ahead.advance((ahead.work_left() + batches_left - 1) / batches_left);
            }
            if (r == rank) read_batch(inputs, targets, doc_start);
            state.batch++;
        }
    }

    void read_batch(int* inputs, int* targets, int* doc_start) {
        if (state.shard != mapped_shard) {
            mapped = MappedShard();  // unmapped first: one shard mapped at a time
            mapped_shard = -1;
            mapped = MappedShard(shards[state.shard], vocab_size, shuffle);
            mapped_shard = state.shard;
        }
        for (int b = 0; b < B; b++) {
            const int64_t row = shuffle ? row_order[state.batch * B + b] : state.batch * B + b;
            int* in = inputs + (size_t)b * T;
            int* tgt = targets + (size_t)b * T;
            mapped.read((uint64_t)row * T, T, in);  // the targets are the inputs shifted by one
            std::copy(in + 1, in + T, tgt);
            mapped.read((uint64_t)row * T + T, 1, tgt + T - 1);
            compute_doc_start(doc_start + (size_t)b * T, in, T, eot);
        }
    }
};

// The data's host memory per rank, under the memory table: the loaders' own (row orders) and the
// shards, which are mapped, not copied.
inline void print_data_memory(const DataLoader& train, const DataLoader* val) {
    auto largest_shard = [](const DataLoader* l) {
        double bytes = 0;
        for (const ShardInfo& s : l ? l->shards : std::vector<ShardInfo>())
            bytes = std::max(bytes, (double)s.header_bytes + (double)s.num_tokens * s.token_bytes);
        return bytes;
    };
    const double own = train.host_bytes() + (val ? val->host_bytes() : 0);
    printf("  %-34s %10.2f (any -z; + the shards being read, at most %.2f MiB, mapped read-only: the page "
           "cache's copy, shared by the node's ranks)\n", "host: data loader (row orders)", own / 1048576.0,
           (largest_shard(&train) + largest_shard(val)) / 1048576.0);
}
