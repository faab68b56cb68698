// Checkpoint file: everything needed to continue a run bitwise-identically, under any layout.
//   char magic[8] = "LLMCCKPT", uint32 version = 2, uint32 n_fields,
//   n_fields x { char name[32] (NUL-padded), char kind ('i' int64 | 'f' double), 7 pad bytes, 8-byte value },
//   uint64 n_params, uint64 checksum, then float32 params[n_params], adam_m[n_params], adam_v[n_params].
// The named fields hold the model config, the training shape, the step, the data loader position
// and the RNG state, so a mismatch can be reported by name. Tensors are stored in the parameter
// table's order and global shape (fp32 master values), whatever the layout that wrote them: a run
// saved with one (dp, zero stage) resumes with any other.
//
// Writing is collective: rank 0 creates <path>.tmp at its full size, every rank writes the ranges
// it owns with pwrite (in parallel) and fsyncs, then rank 0 writes the header (with the checksum
// of the whole content) last, fsyncs and renames <path>.tmp to <path>. A crash at any moment
// leaves either no <path> or a complete one; a .tmp never loads.
//
// Checksum: the header's hash plus, over every 4-byte word w at word index i of the tensor data,
// mix(i, w), summed mod 2^64. A sum of per-word terms can be computed by each rank over its own
// ranges and added, in any order; any changed, moved or swapped word changes it.
// Version 1 files (no checksum, written before multi-process training) still load.
#pragma once
#include <cmath>
#include <csignal>
#include <cstdint>
#include <map>
#include <string>
#include <vector>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include "comm.h"
#include "utils.h"

struct CheckpointField {
    std::string name;
    char kind;  // 'i' or 'f'
    int64_t i = 0;
    double f = 0;
};

struct Checkpoint {
    std::vector<CheckpointField> fields;
    std::vector<float> params, adam_m, adam_v;

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

constexpr uint32_t CHECKPOINT_VERSION = 2;
constexpr uint32_t CHECKPOINT_MAX_FIELDS = 4096;

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
inline uint64_t ckpt_hash_bytes(const unsigned char* p, size_t n) {
    uint64_t h = 0x243F6A8885A308D3ull;
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

// A rank's part of a checkpoint: ranges of the table [begin, begin + n) and their values,
// concatenated in range order, for params (fp32 master values), adam m and adam v.
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

// Collective over g: every rank passes its ranges (together they cover [0, n_params) once).
inline void save_checkpoint_parts(const CommGroup& g, const std::string& path, const Checkpoint& ck, uint64_t n_params,
                                  const std::vector<CheckpointRange>& ranges, const float* params, const float* adam_m,
                                  const float* adam_v) {
    const std::string tmp = path + ".tmp";
    const std::vector<unsigned char> header = ckpt_header_bytes(ck, n_params);
    const uint64_t data_offset = header.size() + 8;
    if (g.rank == 0) {
        int fd = open(tmp.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
        LLMC_CHECK(fd >= 0, "%s: cannot create (%s)", tmp.c_str(), strerror(errno));
        const bool sized = ftruncate(fd, (off_t)(data_offset + 12 * n_params)) == 0;
        close(fd);
        LLMC_CHECK(sized, "%s: cannot size the file (%s)", tmp.c_str(), strerror(errno));
    }
    barrier(g);
    int fd = open(tmp.c_str(), O_WRONLY);
    LLMC_CHECK(fd >= 0, "%s: cannot open on rank %d (%s); ranks need one shared out_dir", tmp.c_str(), g.rank,
               strerror(errno));
    uint64_t hash = 0;
    const float* arrays[3] = {params, adam_m, adam_v};
    for (int a = 0; a < 3; a++) {
        size_t at = 0;
        for (const CheckpointRange& r : ranges) {
            const uint64_t word = (uint64_t)a * n_params + r.begin;
            pwrite_or_fail(fd, arrays[a] + at, r.n * 4, data_offset + 4 * word, tmp);
            hash += ckpt_hash_words(arrays[a] + at, r.n, word);
            at += r.n;
        }
    }
    const bool synced = fsync(fd) == 0;
    close(fd);
    LLMC_CHECK(synced, "%s: fsync failed (%s)", tmp.c_str(), strerror(errno));
    // fault injection for the tests: this rank dies after writing its part, before the header
    if (const char* kill_rank = getenv("LLMC_FAULT_KILL_IN_CHECKPOINT"))
        if (atoi(kill_rank) == g.rank) raise(SIGKILL);
    uint64_t total = ckpt_hash_bytes(header.data(), header.size());
    for (uint64_t h : host_gather_all<uint64_t>(g, hash)) total += h;
    if (g.rank == 0) {
        fd = open(tmp.c_str(), O_WRONLY);
        LLMC_CHECK(fd >= 0, "%s: cannot reopen (%s)", tmp.c_str(), strerror(errno));
        pwrite_or_fail(fd, header.data(), header.size(), 0, tmp);
        pwrite_or_fail(fd, &total, 8, header.size(), tmp);
        const bool ok = fsync(fd) == 0;
        close(fd);
        LLMC_CHECK(ok, "%s: fsync failed (%s)", tmp.c_str(), strerror(errno));
        LLMC_CHECK(rename(tmp.c_str(), path.c_str()) == 0, "%s: rename failed (%s)", path.c_str(), strerror(errno));
        std::string dir = path.find('/') == std::string::npos ? "." : path.substr(0, path.rfind('/'));
        int dfd = open(dir.empty() ? "/" : dir.c_str(), O_RDONLY);
        if (dfd >= 0) { fsync(dfd); close(dfd); }
    }
    barrier(g);  // nobody goes on (or reads the checkpoint) before it exists
}

// One process, whole arrays.
inline void save_checkpoint(const std::string& path, const Checkpoint& ck, const float* params, const float* adam_m,
                            const float* adam_v, uint64_t n_params) {
    CommGroup single;
    save_checkpoint_parts(single, path, ck, n_params, {{0, (size_t)n_params}}, params, adam_m, adam_v);
}

// Reads the header (fields, n_params) and checks the file size; leaves f at the tensor data.
// Every size is checked before it is multiplied, so no header value can make the arithmetic wrap.
inline Checkpoint read_checkpoint_header(const std::string& path, FILE* f, uint32_t& version, uint64_t& n_params,
                                         uint64_t& checksum, std::vector<unsigned char>& header) {
    Checkpoint ck;
    struct stat st;
    LLMC_CHECK(stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode), "%s: not a regular file", path.c_str());
    const uint64_t actual = (uint64_t)st.st_size;
    unsigned char head[16];
    fread_or_fail(head, 16, f, path, "header");
    LLMC_CHECK(memcmp(head, "LLMCCKPT", 8) == 0, "%s: not a checkpoint (bad magic)", path.c_str());
    uint32_t n_fields;
    memcpy(&version, head + 8, 4);
    memcpy(&n_fields, head + 12, 4);
    LLMC_CHECK(version == 1 || version == CHECKPOINT_VERSION, "%s: checkpoint version %u, this build reads 1 and %u",
               path.c_str(), version, CHECKPOINT_VERSION);
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
    fread_or_fail(&n_params, 8, f, path, "parameter count");
    header.insert(header.end(), (unsigned char*)&n_params, (unsigned char*)&n_params + 8);
    checksum = 0;
    if (version >= 2) fread_or_fail(&checksum, 8, f, path, "checksum");
    const uint64_t data_offset = header.size() + (version >= 2 ? 8 : 0);
    const bool representable = n_params <= (UINT64_MAX - data_offset) / 12;  // checked before multiplying
    LLMC_CHECK(representable && actual == data_offset + 12 * n_params,
               "%s: checkpoint is %llu bytes, expected %s%llu for %llu parameters (truncated or corrupt header?)",
               path.c_str(), (unsigned long long)actual, representable ? "" : "more than ",
               (unsigned long long)(representable ? data_offset + 12 * n_params : UINT64_MAX), (unsigned long long)n_params);
    return ck;
}

// Reads the step field only (choosing among checkpoints); -1 when the file is not a checkpoint.
inline int64_t checkpoint_step(const std::string& path) {
    FILE* f = fopen(path.c_str(), "rb");
    if (!f) return -1;
    try {
        uint32_t version;
        uint64_t n, sum;
        std::vector<unsigned char> header;
        Checkpoint ck = read_checkpoint_header(path, f, version, n, sum, header);
        fclose(f);
        const CheckpointField* step = ck.find("step");
        return step && step->kind == 'i' ? step->i : -1;
    } catch (const LlmcError&) {
        fclose(f);
        return -1;
    }
}

// Reads a whole checkpoint, verifies its checksum (version 2) and that every stored value is
// usable: finite params and moments, second moments >= 0.
inline Checkpoint load_checkpoint(const std::string& path) {
    FILE* f = fopen_or_fail(path, "rb");
    uint32_t version = 0;
    uint64_t n = 0, stored_sum = 0;
    std::vector<unsigned char> header;
    Checkpoint ck;
    try {
        ck = read_checkpoint_header(path, f, version, n, stored_sum, header);
        ck.params.resize(n); ck.adam_m.resize(n); ck.adam_v.resize(n);
        fread_or_fail(ck.params.data(), n * 4, f, path, "params");
        fread_or_fail(ck.adam_m.data(), n * 4, f, path, "adam m");
        fread_or_fail(ck.adam_v.data(), n * 4, f, path, "adam v");
    } catch (...) {
        fclose(f);
        throw;
    }
    fclose(f);
    if (version >= 2) {
        uint64_t sum = ckpt_hash_bytes(header.data(), header.size());
        sum += ckpt_hash_words(ck.params.data(), n, 0) + ckpt_hash_words(ck.adam_m.data(), n, n) +
               ckpt_hash_words(ck.adam_v.data(), n, 2 * n);
        LLMC_CHECK(sum == stored_sum, "%s: checksum mismatch (stored %016llx, content %016llx): the file is corrupt",
                   path.c_str(), (unsigned long long)stored_sum, (unsigned long long)sum);
    }
    for (size_t i = 0; i < n; i++) {
        LLMC_CHECK(std::isfinite(ck.params[i]) && std::isfinite(ck.adam_m[i]) && std::isfinite(ck.adam_v[i]) &&
                       ck.adam_v[i] >= 0.0f,
                   "%s: element %zu holds a non-finite parameter or moment (param %g, m %g, v %g)", path.c_str(), i,
                   ck.params[i], ck.adam_m[i], ck.adam_v[i]);
    }
    return ck;
}
