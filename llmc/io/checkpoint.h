// Checkpoint file: everything needed to continue a run bitwise-identically, under any layout.
//   char magic[8] = "LLMCCKPT", uint32 version = 2, uint32 n_fields,
//   n_fields x { char name[32] (NUL-padded), char kind ('i' int64 | 'f' double), 7 pad bytes, 8-byte value },
//   uint64 n_params, uint64 checksum, then float32 params[n_params], adam_m[n_params], adam_v[n_params].
// The named fields hold the model config, the training shape, the step, the data loader position
// and the RNG state, so a mismatch can be reported by name. Tensors are stored in the parameter
// table's order and global shape (fp32 master values), whatever the layout that wrote them: a run
// saved with one (dp, zero stage) resumes with any other.
//
// Writing is collective (CheckpointWriter): rank 0 creates <path>.tmp at its full size, every rank
// writes the table runs it owns with pwrite (in parallel), chunk by chunk as it copies them out of
// its buffers (train_gpt.cu: gpt_write_state), and fsyncs; then rank 0 writes the header (with the
// checksum of the whole content) last, fsyncs and renames <path>.tmp to <path>. A crash at any
// moment leaves either no <path> or a complete one; a .tmp never loads, nor counts as a run's
// checkpoint, and the next trainer on the out_dir removes it once it holds the lock
// (llmc/io/run_dir.h). A write that fails on a rank (disk full, an fsync error, a non-finite state)
// removes the .tmp on its way out (the writer's destructor), so it does not hold the space.
//
// Reading is two passes, neither of which holds the file: verify_checkpoint (collective, before the
// model is allocated: the config comes from the checkpoint) reads the header on every rank and
// 1/ranks of the tensor data in chunks, for the checksum terms and the value checks; the ranks'
// verdicts are gathered, so all of them accept the file or all refuse it with the same message.
// Then each rank preads the table ranges it holds (CheckpointFile::read; gpt_set_state).
// Host memory, writing and reading: a chunk of at most staging_elems() elements per array.
//
// Checksum: the header's hash plus, over every 4-byte word w at word index i of the tensor data,
// mix(i, w), summed mod 2^64. A sum of per-word terms can be computed by each rank over its own
// ranges and added, in any order; any changed, moved or swapped word changes it.
// Version 1 files (no checksum, written before multi-process training) still load.
// A model file (scripts/import_hf.py writes them; --init_from reads them) is a checkpoint of the
// config fields and an int field model_only = 1, holding the params array only (no moments, no
// run state), its checksum computed the same way over that one array.
#pragma once
#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <map>
#include <string>
#include <vector>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include "llmc/parallel/comm.h"
#include "llmc/utils.h"

struct CheckpointField {
    std::string name;
    char kind;  // 'i' or 'f'
    int64_t i = 0;
    double f = 0;
};

// A checkpoint's header: the named fields and the size of its arrays (no tensor data: a rank reads
// the ranges it needs from the file, CheckpointFile).
struct Checkpoint {
    std::vector<CheckpointField> fields;
    uint64_t n_params = 0;     // elements of each of the three arrays
    uint32_t version = 0;      // of a file read
    uint64_t data_offset = 0;  // of a file read: the byte offset of params[0]
    // the arrays the file holds: 3 (params, adam m, adam v), or 1 in a model file (model_only = 1)
    int n_arrays() const {
        const CheckpointField* f = find("model_only");
        return f && f->kind == 'i' && f->i == 1 ? 1 : 3;
    }

    void set_int(const std::string& name, int64_t v) { fields.push_back({name, 'i', v, 0}); }
    void set_float(const std::string& name, double v) { fields.push_back({name, 'f', 0, v}); }
    const CheckpointField* find(const std::string& name) const {
        for (const auto& f : fields) if (f.name == name) return &f;
        return nullptr;
    }
    int64_t get_int(const std::string& name, const std::string& path) const {
        const CheckpointField* f = find(name);
        LLMC_CHECK(f && f->kind == 'i', "%s: checkpoint has no integer field '%s'", path.c_str(), name.c_str());
        return f->i;
    }
    double get_float(const std::string& name, const std::string& path) const {
        const CheckpointField* f = find(name);
        LLMC_CHECK(f && f->kind == 'f', "%s: checkpoint has no float field '%s'", path.c_str(), name.c_str());
        return f->f;
    }
};
// A field a caller narrows to an int, range-checked first and refused by its name in the file (a
// header with a valid checksum may still hold anything another program or a bug wrote there).
// names: an enum's values by number (the message says them), else [lo, INT32_MAX].
inline int checkpoint_int_field(const Checkpoint& ck, const std::string& name, const std::string& path, int64_t lo,
                                const std::vector<const char*>& names = {}) {
    const int64_t v = ck.get_int(name, path);
    if (!names.empty()) {
        std::string list;
        for (size_t k = 0; k < names.size(); k++) list += strfmt("%s%s (%zu)", k ? ", " : "", names[k], k);
        LLMC_CHECK(v >= 0 && v < (int64_t)names.size(), "%s: checkpoint field %s = %lld is not one of %s (corrupt or "
                   "written by another program)", path.c_str(), name.c_str(), (long long)v, list.c_str());
    } else {
        LLMC_CHECK(v >= lo && v <= INT32_MAX, "%s: checkpoint field %s = %lld is outside [%lld, %d] (corrupt or written "
                   "by another program)", path.c_str(), name.c_str(), (long long)v, (long long)lo, INT32_MAX);
    }
    return (int)v;
}

// A cheap identity of a data file: its size and its first and last 4 KiB, hashed (another train
// set shows as another value; reading whole shards would cost minutes on every rank).
inline int64_t file_fingerprint(const std::string& path);

// A whole checkpoint in memory (load_checkpoint: tests and tools, one process, small models).
struct CheckpointContents : Checkpoint {
    std::vector<float> params, adam_m, adam_v;
};

constexpr uint32_t CHECKPOINT_VERSION = 2;
constexpr uint32_t CHECKPOINT_MAX_FIELDS = 4096;
inline constexpr const char* CHECKPOINT_ARRAYS[3] = {"params", "adam m", "adam v"};

// Host staging: init, checkpoint loads (and their verify pass) and saves move the model state
// through host buffers of at most this many elements per array, never the whole table (a 70B
// model's fp32 params and moments are 840 GB). LLMC_STAGING_ELEMS=<n> overrides it: a test knob (a
// small n cuts every segment into many chunks); the memory plan reads it too.
constexpr size_t STAGING_ELEMS = (size_t)1 << 24;
inline size_t staging_elems() {
    const char* s = getenv("LLMC_STAGING_ELEMS");
    return s ? (size_t)parse_int64(s, "LLMC_STAGING_ELEMS", 1, (int64_t)1 << 40) : STAGING_ELEMS;
}

inline uint64_t ckpt_splitmix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}
// the checksum terms of n words starting at word index first
inline uint64_t ckpt_hash_words(const float* words, size_t n, uint64_t first) {
    uint64_t h = 0;
#pragma omp parallel for reduction(+ : h) schedule(static)
    for (size_t k = 0; k < n; k++) {
        uint32_t w;
        memcpy(&w, words + k, 4);
        h += ckpt_splitmix(ckpt_splitmix(first + k) ^ w);
    }
    return h;
}
// a byte stream's hash; h: the hash of the bytes before p (the stream hashed in pieces)
inline uint64_t ckpt_hash_bytes(const unsigned char* p, size_t n, uint64_t h = 0x243F6A8885A308D3ull) {
    for (size_t k = 0; k < n; k++) h = ckpt_splitmix(h ^ p[k]);
    return h;
}

// magic, version, fields and n_params, as written (the checksum follows them)
inline std::vector<unsigned char> ckpt_header_bytes(const Checkpoint& ck, uint64_t n_params) {
    std::vector<unsigned char> h(16 + 48 * ck.fields.size() + 8, 0);
    memcpy(h.data(), "LLMCCKPT", 8);
    const uint32_t head[2] = {CHECKPOINT_VERSION, (uint32_t)ck.fields.size()};
    memcpy(h.data() + 8, head, 8);
    for (size_t k = 0; k < ck.fields.size(); k++) {
        const CheckpointField& f = ck.fields[k];
        LLMC_CHECK(f.name.size() < 32, "checkpoint field name too long: %s", f.name.c_str());
        unsigned char* rec = h.data() + 16 + 48 * k;
        memcpy(rec, f.name.data(), f.name.size());
        rec[32] = (unsigned char)f.kind;
        if (f.kind == 'i') memcpy(rec + 40, &f.i, 8); else memcpy(rec + 40, &f.f, 8);
    }
    memcpy(h.data() + h.size() - 8, &n_params, 8);
    return h;
}

// A table range [begin, begin + n) (a rank's part of a checkpoint, padding it reports).
struct CheckpointRange {
    size_t begin, n;
};

inline void pwrite_or_fail(int fd, const void* src, size_t bytes, uint64_t offset, const std::string& path) {
    const char* p = (const char*)src;
    while (bytes > 0) {
        ssize_t put = pwrite(fd, p, std::min<size_t>(bytes, (size_t)1 << 30), (off_t)offset);
        LLMC_CHECK(put > 0, "%s: write failed (%s)", path.c_str(), put < 0 ? strerror(errno) : "no progress");
        p += put;
        bytes -= (size_t)put;
        offset += (uint64_t)put;
    }
}
inline void pread_or_fail(int fd, void* dst, size_t bytes, uint64_t offset, const std::string& path) {
    char* p = (char*)dst;
    while (bytes > 0) {
        ssize_t got = pread(fd, p, std::min<size_t>(bytes, (size_t)1 << 30), (off_t)offset);
        LLMC_CHECK(got > 0, "%s: read failed at byte %llu (%s)", path.c_str(), (unsigned long long)offset,
                   got < 0 ? strerror(errno) : "the file is shorter than its header says: truncated?");
        p += got;
        bytes -= (size_t)got;
        offset += (uint64_t)got;
    }
}

// Writes a checkpoint collectively over g: the constructor (collective) creates <path>.tmp at its
// full size, write_range is each rank's part, in any order and pieces, and finish (collective)
// publishes it. Every table element of the three arrays must be written by exactly one rank.
// The waits inside (the barriers, the checksum gather) follow each rank's disk writes: they get
// the long-work deadline (comm.h's CommLongWork).
struct CheckpointWriter {
    const CommGroup& g;
    const std::string path, tmp;
    const std::vector<unsigned char> header;
    const uint64_t n_params, data_offset;
    uint64_t hash = 0;  // the checksum terms of what this rank wrote
    int fd = -1;
    bool published = false;  // renamed to path: the .tmp is gone
    const CommLongWork long_work;

    CheckpointWriter(const CommGroup& group, const std::string& path_, const Checkpoint& ck, uint64_t n)
        : g(group), path(path_), tmp(path_ + ".tmp"), header(ckpt_header_bytes(ck, n)), n_params(n),
          data_offset(header.size() + 8) {
        if (g.rank == 0) {
            int f = open(tmp.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
            LLMC_CHECK(f >= 0, "%s: cannot create (%s)", tmp.c_str(), strerror(errno));
            const bool sized = ftruncate(f, (off_t)(data_offset + 12 * n_params)) == 0;
            const int err = errno;
            close(f);
            if (!sized) abandon();  // the constructor throws: no destructor runs
            LLMC_CHECK(sized, "%s: cannot size the file (%s)", tmp.c_str(), strerror(err));
        }
        barrier(g);
        fd = open(tmp.c_str(), O_WRONLY);
        if (fd < 0) {
            const int err = errno;
            abandon();
            LLMC_FAIL("%s: cannot open on rank %d (%s); ranks need one shared out_dir", tmp.c_str(), g.rank, strerror(err));
        }
    }
    CheckpointWriter(const CheckpointWriter&) = delete;
    CheckpointWriter& operator=(const CheckpointWriter&) = delete;
    // A write that did not finish (an error on this rank unwinds through here) leaves no .tmp.
    ~CheckpointWriter() {
        if (fd >= 0) close(fd);
        if (!published) abandon();
    }

    // table elements [begin, begin + n) of array a (0 params, 1 adam m, 2 adam v)
    void write_range(int a, uint64_t begin, size_t n, const float* values) {
        LLMC_CHECK(a >= 0 && a < 3 && begin <= n_params && n <= n_params - begin,
                   "internal: %s: write of %s [%llu, +%zu) outside the %llu parameters", tmp.c_str(), CHECKPOINT_ARRAYS[a & 3],
                   (unsigned long long)begin, n, (unsigned long long)n_params);
        const uint64_t word = (uint64_t)a * n_params + begin;
        pwrite_or_fail(fd, values, n * 4, data_offset + 4 * word, tmp);
        hash += ckpt_hash_words(values, n, word);
    }
    // This rank gives up (its error stops the job): the .tmp goes, so nothing of this save is left.
    // Any rank may remove it: the others' writes then go to a file without a name, which no rename
    // can publish (rank 0's reopen fails, or it never gets this rank's checksum terms).
    void abandon() { remove(tmp.c_str()); }

    // Collective: every rank fsyncs its part; the checksum terms are gathered; rank 0 writes the
    // header last, fsyncs, renames and fsyncs the directory; nobody returns before the file exists.
    void finish() {
        const bool synced = fsync(fd) == 0;
        close(fd);
        fd = -1;
        LLMC_CHECK(synced, "%s: fsync failed (%s)", tmp.c_str(), strerror(errno));
        // fault injection for the tests: this rank dies after writing its part, before the header;
        // or is slow to write it (LLMC_FAULT_CHECKPOINT_DELAY=<rank>:<ms>: a slow disk)
        if (const char* kill_rank = getenv("LLMC_FAULT_KILL_IN_CHECKPOINT"))
            if (atoi(kill_rank) == g.rank) raise(SIGKILL);
        if (const char* delay = getenv("LLMC_FAULT_CHECKPOINT_DELAY"))
            if (atoi(delay) == g.rank && strchr(delay, ':')) usleep((useconds_t)(1000 * atoi(strchr(delay, ':') + 1)));
        uint64_t total = ckpt_hash_bytes(header.data(), header.size());
        for (uint64_t h : host_gather_all<uint64_t>(g, hash)) total += h;
        if (g.rank == 0) {
            int f = open(tmp.c_str(), O_WRONLY);
            LLMC_CHECK(f >= 0, "%s: cannot reopen (%s)", tmp.c_str(), strerror(errno));
            pwrite_or_fail(f, header.data(), header.size(), 0, tmp);
            pwrite_or_fail(f, &total, 8, header.size(), tmp);
            const bool ok = fsync(f) == 0;
            close(f);
            LLMC_CHECK(ok, "%s: fsync failed (%s)", tmp.c_str(), strerror(errno));
            LLMC_CHECK(rename(tmp.c_str(), path.c_str()) == 0, "%s: rename failed (%s)", path.c_str(), strerror(errno));
            published = true;
            std::string dir = path.find('/') == std::string::npos ? "." : path.substr(0, path.rfind('/'));
            int dfd = open(dir.empty() ? "/" : dir.c_str(), O_RDONLY);
            if (dfd >= 0) { fsync(dfd); close(dfd); }
        }
        barrier(g);  // nobody goes on (or reads the checkpoint) before it exists
        published = true;  // (on the other ranks: rank 0 renamed it)
    }
};

// One process, whole arrays (tests).
inline void save_checkpoint(const std::string& path, const Checkpoint& ck, const float* params, const float* adam_m,
                            const float* adam_v, uint64_t n_params) {
    CommGroup single;
    CheckpointWriter w(single, path, ck, n_params);
    const float* arrays[3] = {params, adam_m, adam_v};
    for (int a = 0; a < 3; a++) w.write_range(a, 0, n_params, arrays[a]);
    w.finish();
}

// Reads the header (fields, n_params, version, data_offset, the stored checksum and the header's
// bytes) and checks the file size; leaves f at the tensor data. Every size is checked before it is
// multiplied, so no header value can make the arithmetic wrap.
inline Checkpoint read_checkpoint_header(const std::string& path, FILE* f, uint64_t& checksum,
                                         std::vector<unsigned char>& header) {
    Checkpoint ck;
    struct stat st;
    LLMC_CHECK(fstat(fileno(f), &st) == 0 && S_ISREG(st.st_mode), "%s: not a regular file", path.c_str());
    const uint64_t actual = (uint64_t)st.st_size;
    unsigned char head[16];
    fread_or_fail(head, 16, f, path, "header");
    LLMC_CHECK(memcmp(head, "LLMCCKPT", 8) == 0, "%s: not a checkpoint (bad magic)", path.c_str());
    uint32_t n_fields;
    memcpy(&ck.version, head + 8, 4);
    memcpy(&n_fields, head + 12, 4);
    LLMC_CHECK(ck.version == 1 || ck.version == CHECKPOINT_VERSION, "%s: checkpoint version %u, this build reads 1 and %u",
               path.c_str(), ck.version, CHECKPOINT_VERSION);
    LLMC_CHECK(n_fields <= CHECKPOINT_MAX_FIELDS, "%s: header claims %u fields (corrupt header?)", path.c_str(), n_fields);
    header.assign(head, head + 16);
    for (uint32_t k = 0; k < n_fields; k++) {
        unsigned char rec[48];
        fread_or_fail(rec, sizeof(rec), f, path, "fields");
        header.insert(header.end(), rec, rec + 48);
        CheckpointField fld;
        fld.name = std::string((const char*)rec, strnlen((const char*)rec, 32));
        fld.kind = (char)rec[32];
        LLMC_CHECK(fld.kind == 'i' || fld.kind == 'f', "%s: field %u has kind %d, expected 'i' or 'f'", path.c_str(), k,
                   (int)rec[32]);
        if (fld.kind == 'i') memcpy(&fld.i, rec + 40, 8); else memcpy(&fld.f, rec + 40, 8);
        ck.fields.push_back(fld);
    }
    uint64_t n_params = 0;
    fread_or_fail(&n_params, 8, f, path, "parameter count");
    header.insert(header.end(), (unsigned char*)&n_params, (unsigned char*)&n_params + 8);
    checksum = 0;
    if (ck.version >= 2) fread_or_fail(&checksum, 8, f, path, "checksum");
    ck.data_offset = header.size() + (ck.version >= 2 ? 8 : 0);
    const uint64_t per_param = 4 * (uint64_t)ck.n_arrays();
    const bool representable = n_params <= (UINT64_MAX - ck.data_offset) / per_param;  // checked before multiplying
    LLMC_CHECK(representable && actual == ck.data_offset + per_param * n_params,
               "%s: %s is %llu bytes, expected %s%llu for %llu parameters (truncated or corrupt header?)",
               path.c_str(), ck.n_arrays() == 1 ? "model file" : "checkpoint", (unsigned long long)actual,
               representable ? "" : "more than ",
               (unsigned long long)(representable ? ck.data_offset + per_param * n_params : UINT64_MAX),
               (unsigned long long)n_params);
    ck.n_params = n_params;
    return ck;
}

// Reads the step field only (choosing among checkpoints); -1 when the file is not a checkpoint.
inline int64_t checkpoint_step(const std::string& path) {
    FILE* f = nullptr;
    try {
        f = fopen_or_fail(path, "rb");
        uint64_t sum;
        std::vector<unsigned char> header;
        Checkpoint ck = read_checkpoint_header(path, f, sum, header);
        fclose(f);
        const CheckpointField* step = ck.find("step");
        return step && step->kind == 'i' ? step->i : -1;
    } catch (const LlmcError&) {
        if (f) fclose(f);
        return -1;
    }
}

// Verifies a checkpoint without holding it, collectively over g: every rank reads the header and
// its 1/g.size share of the 3 n_params data words, in chunks, for their checksum terms (a sum of
// per-word terms: the shares add) and the value checks (finite params and moments, second moments
// >= 0). Each rank's verdict is gathered (its error message with it), so every rank returns the
// header (fields, n_params) or every rank throws the same error, the first failing rank's: callers
// agree without another collective. One process (tests, tools): CommGroup{} .
inline Checkpoint verify_checkpoint(const CommGroup& g, const std::string& path) {
    const CommLongWork long_work;  // the verdict gather follows each rank's reads
    struct Verdict {
        uint64_t header_hash = 0, stored = 0, hash = 0;
        int failed = 0;
        char why[500] = {};
    } mine;
    Checkpoint ck;
    FILE* f = nullptr;
    try {
        f = fopen_or_fail(path, "rb");
        std::vector<unsigned char> header;
        ck = read_checkpoint_header(path, f, mine.stored, header);
        mine.header_hash = ckpt_hash_bytes(header.data(), header.size());
        const uint64_t n = ck.n_params, words = ck.n_arrays() * n;  // fits: the file's size was checked
        const uint64_t per = words / g.size, extra = words % g.size, r = (uint64_t)g.rank;
        const uint64_t lo = per * r + std::min(r, extra), hi = lo + per + (r < extra ? 1 : 0);
        std::vector<float> buf(std::min<uint64_t>(staging_elems(), hi - lo));
        for (uint64_t w = lo; w < hi; w += buf.size()) {
            const size_t len = (size_t)std::min<uint64_t>(buf.size(), hi - w);
            pread_or_fail(fileno(f), buf.data(), len * 4, ck.data_offset + 4 * w, path);
            if (ck.version >= 2) mine.hash += ckpt_hash_words(buf.data(), len, w);
            for (size_t k = 0; k < len;) {  // the chunk's part in array a, then the next array's
                const uint64_t a = (w + k) / n;
                for (const size_t stop = (size_t)std::min<uint64_t>(len, (a + 1) * n - w); k < stop; k++)
                    LLMC_CHECK(std::isfinite(buf[k]) && (a < 2 || buf[k] >= 0.0f),
                               "%s: %s[%llu] is %g: a checkpoint holds finite parameters and moments and second "
                               "moments >= 0 (the file is corrupt)", path.c_str(), CHECKPOINT_ARRAYS[a],
                               (unsigned long long)(w + k - a * n), buf[k]);
            }
        }
    } catch (const LlmcError& e) {
        mine.failed = 1;
        snprintf(mine.why, sizeof(mine.why), "%s", e.what());
    }
    if (f) fclose(f);
    const std::vector<Verdict> all = host_gather_all<Verdict>(g, mine);
    int n_failed = 0;
    for (const Verdict& v : all) n_failed += v.failed;
    for (int r = 0; r < g.size; r++)
        if (all[r].failed)  // a failure only some ranks see (a file one rank cannot read): name the rank
            LLMC_FAIL("%s%s", all[r].why, n_failed < g.size ? strfmt(" (on rank %d)", r).c_str() : "");
    if (ck.version >= 2) {
        uint64_t sum = all[0].header_hash;
        for (const Verdict& v : all) sum += v.hash;
        LLMC_CHECK(sum == all[0].stored, "%s: checksum mismatch (stored %016llx, content %016llx): the file is corrupt",
                   path.c_str(), (unsigned long long)all[0].stored, (unsigned long long)sum);
    }
    return ck;
}

inline int64_t file_fingerprint(const std::string& path) {
    FILE* f = fopen_or_fail(path, "rb");
    struct stat st;
    const bool ok = fstat(fileno(f), &st) == 0;
    const uint64_t size = ok ? (uint64_t)st.st_size : 0, piece = std::min<uint64_t>(size, 4096);
    std::vector<unsigned char> buf(piece);
    uint64_t h = ckpt_hash_bytes((const unsigned char*)&size, sizeof(size));
    try {
        for (uint64_t at : {(uint64_t)0, size - piece}) {
            pread_or_fail(fileno(f), buf.data(), piece, at, path);
            h = ckpt_hash_bytes(buf.data(), piece, h);
        }
    } catch (...) {
        fclose(f);
        throw;
    }
    fclose(f);
    return (int64_t)(h >> 1);  // a non-negative field value
}

// Reads table ranges of the arrays of a verified checkpoint (the ranges a rank holds).
struct CheckpointFile {
    const std::string path;
    const uint64_t n_params, data_offset;
    const int n_arrays;
    FILE* f;
    CheckpointFile(const std::string& path_, const Checkpoint& verified)
        : path(path_), n_params(verified.n_params), data_offset(verified.data_offset), n_arrays(verified.n_arrays()),
          f(fopen_or_fail(path_, "rb")) {}
    CheckpointFile(const CheckpointFile&) = delete;
    CheckpointFile& operator=(const CheckpointFile&) = delete;
    ~CheckpointFile() { fclose(f); }
    // table elements [begin, begin + n) of array a (0 params, 1 adam m, 2 adam v)
    void read(int a, uint64_t begin, size_t n, float* out) const {
        LLMC_CHECK(a >= 0 && a < n_arrays && begin <= n_params && n <= n_params - begin,
                   "internal: %s: read of %s [%llu, +%zu) outside the %llu parameters", path.c_str(),
                   CHECKPOINT_ARRAYS[a & 3], (unsigned long long)begin, n, (unsigned long long)n_params);
        pread_or_fail(fileno(f), out, n * 4, data_offset + 4 * ((uint64_t)a * n_params + begin), path);
    }
};

// A whole checkpoint, verified, in memory: one process (tests, tools, the fuzzer).
inline CheckpointContents load_checkpoint(const std::string& path) {
    CheckpointContents c;
    static_cast<Checkpoint&>(c) = verify_checkpoint(CommGroup{}, path);
    CheckpointFile file(path, c);
    std::vector<float>* arrays[3] = {&c.params, &c.adam_m, &c.adam_v};
    for (int a = 0; a < 3; a++) {
        arrays[a]->assign(c.n_params, 0.0f);  // (a model file: zero moments)
        if (a < c.n_arrays()) file.read(a, 0, c.n_params, arrays[a]->data());
    }
    return c;
}
