// Checkpoint file: everything needed to continue a run bitwise-identically.
//   char magic[8] = "LLMCCKPT", uint32 version = 1, uint32 n_fields,
//   n_fields x { char name[32] (NUL-padded), char kind ('i' int64 | 'f' double), 7 pad bytes, 8-byte value },
//   uint64 n_params, then float32 params[n_params], adam_m[n_params], adam_v[n_params].
// The named fields hold the model config, the training shape, the step, the data loader position
// and the RNG state, so a mismatch can be reported by name. Written atomically (utils.h).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>
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

constexpr uint32_t CHECKPOINT_VERSION = 1;

inline void save_checkpoint(const std::string& path, const Checkpoint& ck, const float* params,
                            const float* adam_m, const float* adam_v, uint64_t n_params) {
    AtomicFile out(path);
    out.write("LLMCCKPT", 8);
    uint32_t head[2] = {CHECKPOINT_VERSION, (uint32_t)ck.fields.size()};
    out.write(head, sizeof(head));
    for (const auto& f : ck.fields) {
        unsigned char rec[48] = {0};
        LLMC_CHECK(f.name.size() < 32, "checkpoint field name too long: %s", f.name.c_str());
        memcpy(rec, f.name.data(), f.name.size());
        rec[32] = (unsigned char)f.kind;
        if (f.kind == 'i') memcpy(rec + 40, &f.i, 8); else memcpy(rec + 40, &f.f, 8);
        out.write(rec, sizeof(rec));
    }
    out.write(&n_params, 8);
    out.write(params, n_params * 4);
    out.write(adam_m, n_params * 4);
    out.write(adam_v, n_params * 4);
    out.commit();
}

inline Checkpoint load_checkpoint(const std::string& path) {
    Checkpoint ck;
    FILE* f = fopen_or_fail(path, "rb");
    char magic[8];
    fread_or_fail(magic, 8, f, path, "magic");
    if (memcmp(magic, "LLMCCKPT", 8) != 0) { fclose(f); LLMC_FAIL("%s: not a checkpoint (bad magic)", path.c_str()); }
    uint32_t head[2];
    fread_or_fail(head, sizeof(head), f, path, "header");
    if (head[0] != CHECKPOINT_VERSION) {
        fclose(f);
        LLMC_FAIL("%s: checkpoint version %u, this build reads version %u", path.c_str(), head[0], CHECKPOINT_VERSION);
    }
    for (uint32_t k = 0; k < head[1]; k++) {
        unsigned char rec[48];
        fread_or_fail(rec, sizeof(rec), f, path, "fields");
        CheckpointField fld;
        fld.name = std::string((const char*)rec, strnlen((const char*)rec, 32));
        fld.kind = (char)rec[32];
        if (fld.kind == 'i') memcpy(&fld.i, rec + 40, 8); else memcpy(&fld.f, rec + 40, 8);
        ck.fields.push_back(fld);
    }
    uint64_t n = 0;
    fread_or_fail(&n, 8, f, path, "parameter count");
    long long expected = 8 + 8 + 48LL * head[1] + 8 + 12LL * (long long)n;
    long long actual = file_size_bytes(path);
    if (actual != expected) {
        fclose(f);
        LLMC_FAIL("%s: checkpoint is %lld bytes, expected %lld for %llu parameters (truncated?)", path.c_str(), actual,
                  expected, (unsigned long long)n);
    }
    ck.params.resize(n); ck.adam_m.resize(n); ck.adam_v.resize(n);
    fread_or_fail(ck.params.data(), n * 4, f, path, "params");
    fread_or_fail(ck.adam_m.data(), n * 4, f, path, "adam m");
    fread_or_fail(ck.adam_v.data(), n * 4, f, path, "adam v");
    fclose(f);
    return ck;
}
