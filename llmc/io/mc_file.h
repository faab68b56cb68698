// Multiple-choice evaluation files (scripts/prepare_mc.py writes them from HellaSwag, Belebele or
// MMLU-style data; docs/FORMATS.md): tokenized items of a context, its candidate endings and the
// right one. Scored as lm-evaluation-harness scores them: each ending's summed log-likelihood
// given the context (llmc/gpt/metrics.h evaluate_mc).
//
// File (little-endian): a 64-byte header { magic "LLMCMCQA", uint32 version (1), uint32 n_items,
// uint32 vocab_size, uint32 eot_token, zero padding }, then per item: uint32 label (the right
// ending, 0-based), uint32 n_endings, uint32 context_len, the context's tokens (uint32 each), then
// per ending uint32 length and its tokens. A context starts with EOT, as a document of the shards.
// Everything is checked on load: a bad file is an error naming the file and the item.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>
#include "llmc/utils.h"

constexpr char MC_MAGIC[8] = {'L', 'L', 'M', 'C', 'M', 'C', 'Q', 'A'};
constexpr int MC_HEADER_BYTES = 64, MC_MAX_ENDINGS = 16;

struct McItem {
    std::vector<int> context;
    std::vector<std::vector<int>> endings;
    int label = 0;
};

struct McFile {
    std::string path;
    uint32_t vocab_size = 0, eot = 0;
    std::vector<McItem> items;
    int max_endings = 0;  // every rank scores this many endings per item (the collectives line up)
};

// Reads and checks an evaluation file for a model of `model_vocab` tokens whose rows hold `T`
// tokens: every ending must fit a row (the context is cut from the left to make room, as
// lm-evaluation-harness does), with at least one context token before it.
inline McFile read_mc_file(const std::string& path, int model_vocab, int T) {
    McFile f;
    f.path = path;
    const long long size = file_size_bytes(path);
    LLMC_CHECK(size >= MC_HEADER_BYTES, "--eval_mc %s: %lld bytes, shorter than the %d-byte header (not a "
               "prepare_mc.py file)", path.c_str(), size, MC_HEADER_BYTES);
    std::vector<uint8_t> bytes((size_t)size);
    FILE* fp = fopen_or_fail(path, "rb");
    fread_or_fail(bytes.data(), bytes.size(), fp, path, "the evaluation items");
    fclose(fp);
    size_t at = 0;
    auto u32 = [&](const char* what, size_t item) {
        LLMC_CHECK(at + 4 <= bytes.size(), "--eval_mc %s: truncated in item %zu (reading its %s at byte %zu of %zu)",
                   path.c_str(), item, what, at, bytes.size());
        uint32_t v;
        memcpy(&v, bytes.data() + at, 4);
        at += 4;
        return v;
    };
    LLMC_CHECK(memcmp(bytes.data(), MC_MAGIC, 8) == 0, "--eval_mc %s: not a multiple-choice file (magic \"LLMCMCQA\" "
               "expected; make one with scripts/prepare_mc.py)", path.c_str());
    at = 8;
    const uint32_t version = u32("header", 0), n_items = u32("header", 0);
    f.vocab_size = u32("header", 0);
    f.eot = u32("header", 0);
    LLMC_CHECK(version == 1, "--eval_mc %s: version %u, expected 1", path.c_str(), version);
    LLMC_CHECK(n_items >= 1, "--eval_mc %s: holds no items", path.c_str());
    LLMC_CHECK(f.vocab_size >= 1 && (int64_t)f.vocab_size <= model_vocab && f.eot < f.vocab_size,
               "--eval_mc %s: vocab_size %u (eot %u) does not fit the model's vocab_size %d", path.c_str(), f.vocab_size,
               f.eot, model_vocab);
    at = MC_HEADER_BYTES;
    auto tokens = [&](uint32_t n, size_t item, const char* what) {
        LLMC_CHECK(n <= (bytes.size() - at) / 4, "--eval_mc %s: item %zu: its %s of %u tokens runs past the end of the "
                   "file", path.c_str(), item, what, n);
        std::vector<int> t(n);
        for (uint32_t k = 0; k < n; k++) {
            const uint32_t v = u32(what, item);
            LLMC_CHECK(v < f.vocab_size, "--eval_mc %s: item %zu: token %u of its %s is %u, outside vocab_size %u",
                       path.c_str(), item, k, what, v, f.vocab_size);
            t[k] = (int)v;
        }
        return t;
    };
    f.items.resize(n_items);
    for (size_t i = 0; i < n_items; i++) {
        McItem& it = f.items[i];
        const uint32_t label = u32("label", i), n_endings = u32("ending count", i);
        LLMC_CHECK(n_endings >= 2 && n_endings <= MC_MAX_ENDINGS, "--eval_mc %s: item %zu has %u endings, expected 2..%d",
                   path.c_str(), i, n_endings, MC_MAX_ENDINGS);
        LLMC_CHECK(label < n_endings, "--eval_mc %s: item %zu: label %u, but it has %u endings", path.c_str(), i, label,
                   n_endings);
        it.label = (int)label;
        const uint32_t context_len = u32("context length", i);
        LLMC_CHECK(context_len >= 1, "--eval_mc %s: item %zu has an empty context (it starts with EOT at least)",
                   path.c_str(), i);
        it.context = tokens(context_len, i, "context");
        for (uint32_t e = 0; e < n_endings; e++) {
            const uint32_t len = u32("ending length", i);
            LLMC_CHECK(len >= 1 && (int64_t)len <= T, "--eval_mc %s: item %zu: ending %u has %u tokens, expected 1..%d "
                       "(the run's -t: an ending must fit a row)", path.c_str(), i, e, len, T);
            it.endings.push_back(tokens(len, i, "ending"));
        }
        f.max_endings = std::max(f.max_endings, (int)n_endings);
    }
    LLMC_CHECK(at == bytes.size(), "--eval_mc %s: %zu bytes after the last of its %u items (corrupt or not a "
               "prepare_mc.py file)", path.c_str(), bytes.size() - at, n_items);
    return f;
}

// One ending as a row of T positions: the context's last tokens, then the ending; targets are -1
// except where the ending's tokens are predicted, and the rest of the row is EOT padding (after
// the ending: causal attention keeps it from the scored positions). Returns the scored count.
inline int mc_row(const McItem& it, int ending, int T, int eot, int* inputs, int* targets, int* doc_start) {
    const std::vector<int>& e = it.endings[ending];
    const int n_ctx = std::min((int)it.context.size(), T + 1 - (int)e.size());  // tokens of context kept
    std::vector<int> row(it.context.end() - n_ctx, it.context.end());
    row.insert(row.end(), e.begin(), e.end());
    for (int t = 0; t < T; t++) {
        const bool in_row = t + 1 < (int)row.size();
        inputs[t] = t < (int)row.size() ? row[t] : eot;
        targets[t] = in_row && t + 1 >= n_ctx ? row[t + 1] : -1;
        doc_start[t] = 0;  // one document
    }
    return (int)e.size();
}
