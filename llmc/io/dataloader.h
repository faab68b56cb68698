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
// Nothing is loaded: each micro-batch's rows are read from the shard with pread (ShardReader; the
// ranks of a node share the page cache's copy), in the file's width, their ids checked against the
// model's vocabulary as they are read: a bad id stops the run when the first micro-batch that holds
// it is served, naming the shard and the token's position (tokens no served row holds are never
// read). A shard that changes under the running trainer (truncated, rewritten, removed) or cannot be
// read stops it with an error naming the file and the position, never a signal (ShardReader says
// how it is seen). A shuffled shard's row order is built a slice per micro-batch of the shard
// before it, so a shard switch waits for neither. The loader's own host memory is two row orders,
// 8 bytes a row, and one row's read buffer; the start-up memory table shows it (print_data_memory).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
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
    uint64_t fingerprint = 0;                    // of the file at start-up (shard_fingerprint)

    uint64_t file_bytes() const { return header_bytes + num_tokens * token_bytes; }  // checked by read_shard_info
};

// The end of every message about a shard that changed under the running trainer: what to do.
constexpr const char* SHARD_CHANGED_REMEDY = "; restore it and continue with --resume latest";

// n bytes of the shard at path (open as fd, `expected` bytes since start-up) at byte offset. A read
// that fails or comes back short is an error naming the file and the byte: the file must hold them.
inline void pread_shard(int fd, void* dst, size_t n, uint64_t offset, const std::string& path, uint64_t expected) {
    size_t got = 0;
    while (got < n) {
        const ssize_t r = pread(fd, (char*)dst + got, n - got, (off_t)(offset + got));
        if (r > 0) { got += (size_t)r; continue; }
        if (r < 0 && errno == EINTR) continue;
        LLMC_CHECK(r == 0, "%s: cannot read %zu bytes at byte %llu (%s)", path.c_str(), n - got,
                   (unsigned long long)(offset + got), strerror(errno));
        struct stat st;
        const long long now = fstat(fd, &st) == 0 ? (long long)st.st_size : -1;
        LLMC_FAIL("%s: reading %zu bytes at byte %llu, the file ended after %zu of them: it is %lld bytes, it was %llu "
                  "at start-up (truncated under the running trainer)%s", path.c_str(), n, (unsigned long long)offset,
                  got, now, (unsigned long long)expected, SHARD_CHANGED_REMEDY);
    }
}

// A cheap fingerprint of a shard (open as fd): its header and 4 KiB at the start, the middle and
// the end of its tokens (FNV-1a), 4 reads. Taken at start-up and compared whenever the shard is
// opened, it catches a shard rewritten at the same size while it was not open (regenerated: every
// sample differs); a change while it is open is caught by the modification time (ShardReader).
inline uint64_t shard_fingerprint(int fd, const ShardInfo& s) {
    const uint64_t start = s.header_bytes, end = s.file_bytes(), body = end - start, piece = std::min<uint64_t>(body, 4096);
    std::vector<unsigned char> buf(std::max<uint64_t>(s.header_bytes, piece));
    uint64_t h = 0xcbf29ce484222325ull;
    auto add = [&](uint64_t at, uint64_t n) {
        pread_shard(fd, buf.data(), (size_t)n, at, s.path, end);
        for (uint64_t i = 0; i < n; i++) h = (h ^ buf[i]) * 0x100000001b3ull;
    };
    add(0, start);
    for (uint64_t at : {start, start + (body - piece) / 2, end - piece}) add(at, piece);
    return h;
}

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
inline ShardInfo read_shard_header(const std::string& path) {
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

// A shard's header, validated, and the file's fingerprint: what every later open must find.
inline ShardInfo read_shard_info(const std::string& path) {
    ShardInfo s = read_shard_header(path);
    FILE* f = fopen_or_fail(path, "rb");
    try {
        s.fingerprint = shard_fingerprint(fileno(f), s);
    } catch (...) {
        fclose(f);
        throw;
    }
    fclose(f);
    return s;
}

// A shard open for reading: rows are read with pread, each id checked against the model's
// vocabulary as it is converted. Reads, not a mapping: a read past a truncated end or a failing
// disk is an error naming the file and the byte (a mapping's missing pages are a SIGBUS), any
// filesystem can serve them (FUSE with direct_io cannot map), and nothing of the shard is held but
// the row being read (the page cache keeps the file, shared by the node's ranks). A shard must not
// change under a running trainer: each open refuses one whose size or fingerprint differs from
// start-up, and check_unchanged sees a change while it is open.
struct ShardReader {
    std::string path;
    FILE* file = nullptr;  // read with pread on its descriptor, never through its buffer
    uint64_t bytes = 0;    // the file's size, as at start-up
    uint32_t header_bytes = 0, token_bytes = 0;
    int vocab_size = 0;            // the model's
    struct timespec mtime = {};    // the file's modification time when opened
    nlink_t links = 0;             // and its link count (0 on a filesystem that keeps none)
    std::vector<unsigned char> buf;  // one read's tokens, in the file's width
    bool random_access = false;
    uint64_t ahead = 0;  // random access: the bytes asked for ahead so far (read_ahead)

    ShardReader() = default;
    // random_access: the rows are read in a shuffled order (every page is needed soon: read the
    // whole shard ahead, read_ahead); otherwise in file order (the kernel reads ahead of the reads)
    ShardReader(const ShardInfo& s, int model_vocab_size, bool random_access_)
        : path(s.path), bytes(s.file_bytes()), header_bytes(s.header_bytes), token_bytes(s.token_bytes),
          vocab_size(model_vocab_size), random_access(random_access_) {
        try {
            file = fopen_or_fail(s.path, "rb");  // a directory or FIFO put in its place is refused here
        } catch (const LlmcError& e) {
            LLMC_FAIL("%s, but the shard was there at start-up%s", e.what(), SHARD_CHANGED_REMEDY);
        }
        struct stat st;
        const long long size = fstat(fileno(file), &st) == 0 ? (long long)st.st_size : -1;
        try {  // (a constructor that throws runs no destructor)
            LLMC_CHECK(size == (long long)bytes, "%s: the shard changed since start-up: it is %lld bytes, its header "
                       "said %llu%s", s.path.c_str(), size, (unsigned long long)bytes, SHARD_CHANGED_REMEDY);
            LLMC_CHECK(shard_fingerprint(fileno(file), s) == s.fingerprint, "%s: the shard changed since start-up: "
                       "the same %llu bytes, but its header or its sampled blocks differ%s", s.path.c_str(),
                       (unsigned long long)bytes, SHARD_CHANGED_REMEDY);
        } catch (...) {
            close_file();
            throw;
        }
        mtime = st.st_mtim;
        links = st.st_nlink;
        // hints: their failure changes nothing (random: a row's read reads only its pages)
        posix_fadvise(fileno(file), 0, 0, random_access ? POSIX_FADV_RANDOM : POSIX_FADV_SEQUENTIAL);
    }
    ShardReader(const ShardReader&) = delete;
    ShardReader& operator=(const ShardReader&) = delete;
    ShardReader(ShardReader&& o) noexcept { *this = std::move(o); }
    ShardReader& operator=(ShardReader&& o) noexcept {
        if (this != &o) {
            close_file();
            path = std::move(o.path);
            file = o.file;
            bytes = o.bytes;
            header_bytes = o.header_bytes;
            token_bytes = o.token_bytes;
            vocab_size = o.vocab_size;
            mtime = o.mtime;
            links = o.links;
            buf = std::move(o.buf);
            random_access = o.random_access;
            ahead = o.ahead;
            o.file = nullptr;
        }
        return *this;
    }
    ~ShardReader() { close_file(); }
    void close_file() {
        if (file) fclose(file);
        file = nullptr;
    }

    // Random access: the next 4 MiB of the shard asked for, read in the background (once per
    // micro-batch: a 200 MB shard is asked for by its 50th), so the shuffled rows' reads soon find
    // it in the page cache. In slices because Linux reads at most the device's read-ahead window per
    // request, and asking for the whole shard at once would block while most of it is read.
    void read_ahead() {
        if (!random_access || ahead >= bytes) return;
        const uint64_t n = std::min<uint64_t>(bytes - ahead, (uint64_t)4 << 20);
        posix_fadvise(fileno(file), (off_t)ahead, (off_t)n, POSIX_FADV_WILLNEED);
        ahead += n;
    }

    // dst[i] = token first + i, for i < n (the caller keeps first + n within the shard)
    void read(uint64_t first, int n, int* dst) {
        buf.resize((size_t)n * token_bytes);
        pread_shard(fileno(file), buf.data(), buf.size(), header_bytes + first * token_bytes, path, bytes);
        if (token_bytes == 2) convert_checked<uint16_t>(n, dst, first);
        else convert_checked<uint32_t>(n, dst, first);
    }
    template <typename W>
    void convert_checked(int n, int* dst, uint64_t first) const {
        for (int i = 0; i < n; i++) {
            W w;
            memcpy(&w, buf.data() + (size_t)i * sizeof(W), sizeof(W));
            const uint32_t id = w;
            LLMC_CHECK(id < (uint32_t)vocab_size, "%s: token %llu has id %u, but the model's vocab_size is %d",
                       path.c_str(), (unsigned long long)(first + i), id, vocab_size);
            dst[i] = (int)id;
        }
    }

    // Whether the open file is still the one opened: one fstat, after each micro-batch's reads, so
    // a batch read before a change is whole and one read during or after it is refused. The size
    // catches a truncation (or an append); the modification time a rewrite in place at the same
    // size (nothing else short of reading every byte would see it); st_nlink == 0 a removal or a
    // replacement under its name (this descriptor would go on reading the old file, which no later
    // open finds). No I/O: a few hundred nanoseconds a micro-batch.
    void check_unchanged() const {
        struct stat st;
        LLMC_CHECK(fstat(fileno(file), &st) == 0, "%s: cannot stat the open shard (%s)", path.c_str(), strerror(errno));
        LLMC_CHECK(st.st_nlink > 0 || links == 0, "%s: the shard was removed (or replaced) while the run was reading it%s",
                   path.c_str(), SHARD_CHANGED_REMEDY);
        LLMC_CHECK((uint64_t)st.st_size == bytes, "%s: the shard changed while the run was reading it: it is %lld "
                   "bytes, it was %llu%s", path.c_str(), (long long)st.st_size, (unsigned long long)bytes,
                   SHARD_CHANGED_REMEDY);
        LLMC_CHECK(st.st_mtim.tv_sec == mtime.tv_sec && st.st_mtim.tv_nsec == mtime.tv_nsec,
                   "%s: the shard was rewritten while the run was reading it (the same %llu bytes, modified since it "
                   "was opened)%s", path.c_str(), (unsigned long long)bytes, SHARD_CHANGED_REMEDY);
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
    ShardReader reader;  // the shard this rank reads now (no other is open)
    int64_t open_shard = -1;
    std::vector<int> row;  // one row's T + 1 tokens
    int64_t calls = 0;     // of next_batch (LLMC_FAULT_SHARD counts them)
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
        calls++;
        if (rank == 0) inject_shard_fault();
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

    // This rank's micro-batch at the position; any error in it (a bad id, a shard that changed or
    // cannot be read) names the position too.
    void read_batch(int* inputs, int* targets, int* doc_start) {
        try {
            if (state.shard != open_shard) {
                reader = ShardReader();  // closed first: one shard open at a time
                open_shard = -1;
                reader = ShardReader(shards[state.shard], vocab_size, shuffle);
                open_shard = state.shard;
            }
            reader.read_ahead();
            row.resize((size_t)T + 1);
            for (int b = 0; b < B; b++) {
                const int64_t r = shuffle ? row_order[state.batch * B + b] : state.batch * B + b;
                reader.read((uint64_t)r * T, T + 1, row.data());  // the targets are the inputs shifted by one
                std::copy(row.begin(), row.end() - 1, inputs + (size_t)b * T);
                std::copy(row.begin() + 1, row.end(), targets + (size_t)b * T);
                compute_doc_start(doc_start + (size_t)b * T, inputs + (size_t)b * T, T, eot);
            }
            reader.check_unchanged();
        } catch (const LlmcError& e) {
            LLMC_FAIL("%s (the loader at epoch %lld, shard %lld, batch %lld)", e.what(), (long long)state.epoch,
                      (long long)state.shard, (long long)state.batch);
        }
    }

    // LLMC_FAULT_SHARD=<truncate|rewrite|remove>:<n>:<path>, fault injection for the tests: the
    // loader of dp rank 0 whose shards include <path> changes that file as a user could under a
    // running trainer, at the start of its n-th next_batch call (step n with one micro-batch per
    // rank): truncate to half its size, rewrite its tokens in place (every id 0, the same size),
    // or remove it.
    void inject_shard_fault() const {
        static const char* spec = getenv("LLMC_FAULT_SHARD");
        char action[16];
        long long n = 0;
        int at = 0;
        if (!spec || sscanf(spec, "%15[a-z]:%lld:%n", action, &n, &at) != 2 || at == 0 || n != calls) return;
        const std::string path = spec + at;
        const auto s = std::find_if(shards.begin(), shards.end(), [&](const ShardInfo& i) { return i.path == path; });
        if (s == shards.end()) return;
        bool done = false;  // (ignored: a stage or tp rank of dp rank 0 may have done it first)
        if (!strcmp(action, "truncate")) done = truncate(path.c_str(), (off_t)(s->file_bytes() / 2)) == 0;
        else if (!strcmp(action, "remove")) done = unlink(path.c_str()) == 0;
        else if (!strcmp(action, "rewrite")) {
            const int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
            const std::vector<char> zeros(s->file_bytes() - s->header_bytes, 0);
            done = fd >= 0 && pwrite(fd, zeros.data(), zeros.size(), s->header_bytes) == (ssize_t)zeros.size();
            if (fd >= 0) close(fd);
        } else LLMC_FAIL("LLMC_FAULT_SHARD=%s: the action is truncate, rewrite or remove", spec);
        fprintf(stderr, "fault injected: %s %s at next_batch call %lld%s\n", action, path.c_str(), n,
                done ? "" : " (failed)");
    }
};

// The data's host memory per rank, under the memory table: the loaders' own (row orders); the
// shards are read a row at a time, through the page cache.
inline void print_data_memory(const DataLoader& train, const DataLoader* val) {
    auto largest_shard = [](const DataLoader* l) {
        double bytes = 0;
        for (const ShardInfo& s : l ? l->shards : std::vector<ShardInfo>())
            bytes = std::max(bytes, (double)s.header_bytes + (double)s.num_tokens * s.token_bytes);
        return bytes;
    };
    const double own = train.host_bytes() + (val ? val->host_bytes() : 0);
    printf("  %-34s %10.2f (any -z; the shards are read a row at a time, through the page cache: at most %.2f "
           "MiB of it, shared by the node's ranks)\n", "host: data loader (row orders)", own / 1048576.0,
           (largest_shard(&train) + largest_shard(val)) / 1048576.0);
}
