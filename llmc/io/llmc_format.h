// llm.c's GPT-2 model files (karpathy/llm.c: train_gpt2.py writes them, train_gpt2.c/.cu read
// them), so the same weights run in both engines.
//
// File (little-endian): a header of 256 int32 { 20240326, version (3: fp32 params, 5: bf16
// params), max_seq_len, vocab_size, n_layer, n_head, n_embd, padded_vocab_size, 0... }, then the
// parameters, contiguous and unaligned, as 16 tensors each stacked over the layers:
//   wte [Vp, C], wpe [maxT, C], ln1w [L, C], ln1b [L, C], qkvw [L, 3C, C], qkvb [L, 3C],
//   attprojw [L, C, C], attprojb [L, C], ln2w [L, C], ln2b [L, C], fcw [L, 4C, C], fcb [L, 4C],
//   fcprojw [L, C, 4C], fcprojb [L, C], lnfw [C], lnfb [C].
// The model is exactly our `--mlp gelu --pos learned` config with n_kv_head = n_head, ffn_hidden
// 4C and the tied lm head: the same LayerNorm (eps 1e-5), tanh GELU, [out, in] weight matrices,
// and qkv rows [Q | K | V] with each part head-major (llm.c's attention reads query h at h*hs,
// its key at C + h*hs, its value at 2C + h*hs; ours reads the same rows when n_kv_head = n_head).
// Both pad the vocabulary to a multiple of 128 (50257 -> 50304). What differs is the order: llm.c
// groups each kind of tensor over all layers, our parameter table is per layer (h0.ln1.w,
// h0.ln1.b, ..., h1.ln1.w, ...), each tensor aligned to 8 elements. llmc_file_order() lists, in
// file order, which slice of which of our tensors every run of llm.c values is.
#pragma once
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>
#include "llmc/utils.h"

constexpr int32_t LLMC_MODEL_MAGIC = 20240326;
constexpr int LLMC_MODEL_HEADER_BYTES = 256 * 4;
constexpr int32_t LLMC_MODEL_VERSION_FP32 = 3, LLMC_MODEL_VERSION_BF16 = 5;

struct LlmcModelShape {
    int max_seq_len = 0, vocab_size = 0, n_layer = 0, n_head = 0, n_embd = 0, padded_vocab_size = 0;
    size_t num_params() const {
        const size_t C = n_embd, L = n_layer;
        return (size_t)padded_vocab_size * C + (size_t)max_seq_len * C + L * (12 * C * C + 13 * C) + 2 * C;
    }
};

struct LlmcModelFile {
    LlmcModelShape shape;
    int version = 0;
    std::vector<float> params;  // llm.c's order, fp32 (bf16 files are widened exactly)
};

// One run of llm.c values: `numel` elements of our tensor `name` (the whole tensor: every llm.c
// tensor is either global or one layer's slice of a stack, which is exactly one of ours).
struct LlmcSlice {
    std::string name;
    size_t numel;
};

inline std::vector<LlmcSlice> llmc_file_order(const LlmcModelShape& s) {
    const size_t C = s.n_embd;
    std::vector<LlmcSlice> out;
    out.push_back({"wte", (size_t)s.padded_vocab_size * C});
    out.push_back({"wpe", (size_t)s.max_seq_len * C});
    const std::pair<const char*, size_t> stacked[] = {
        {"ln1.w", C},          {"ln1.b", C},           {"attn.qkv.w", 3 * C * C}, {"attn.qkv.b", 3 * C},
        {"attn.proj.w", C * C}, {"attn.proj.b", C},    {"ln2.w", C},              {"ln2.b", C},
        {"mlp.fc.w", 4 * C * C}, {"mlp.fc.b", 4 * C},  {"mlp.proj.w", 4 * C * C}, {"mlp.proj.b", C}};
    for (const auto& [name, numel] : stacked)
        for (int l = 0; l < s.n_layer; l++) out.push_back({"h" + std::to_string(l) + "." + name, numel});
    out.push_back({"lnf.w", C});
    out.push_back({"lnf.b", C});
    return out;
}

inline float bf16_to_float(uint16_t b) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
// round to nearest even (NaN stays NaN)
inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu)) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

// Reads and checks an llm.c model file; every failure names the file and what was expected.
inline LlmcModelFile read_llmc_model(const std::string& path) {
    const long long size = file_size_bytes(path);
    FILE* f = fopen_or_fail(path, "rb");
    int32_t h[256] = {0};
    const size_t got = fread(h, 1, sizeof(h), f);
    if (got >= 8 && memcmp(h, "LLMCCKPT", 8) == 0) {
        fclose(f);
        LLMC_FAIL("%s: this is one of our checkpoints, not an llm.c model file: continue it with --resume", path.c_str());
    }
    if (got < sizeof(h) || h[0] != LLMC_MODEL_MAGIC) {
        fclose(f);
        LLMC_CHECK(got >= 4 && h[0] == LLMC_MODEL_MAGIC,
                   "%s: not an llm.c GPT-2 model file: the first int32 is %d, expected the magic %d", path.c_str(),
                   got >= 4 ? h[0] : -1, LLMC_MODEL_MAGIC);
        LLMC_FAIL("%s: llm.c model file: truncated header (%zu bytes, expected %d)", path.c_str(), got,
                  LLMC_MODEL_HEADER_BYTES);
    }
    LlmcModelFile m;
    m.version = h[1];
    if (m.version != LLMC_MODEL_VERSION_FP32 && m.version != LLMC_MODEL_VERSION_BF16) {
        fclose(f);
        LLMC_FAIL("%s: llm.c model file version %d, expected %d (fp32) or %d (bf16)%s", path.c_str(), m.version,
                  LLMC_MODEL_VERSION_FP32, LLMC_MODEL_VERSION_BF16,
                  m.version == 1 || m.version == 2 ? " (versions 1-2 predate the padded vocabulary: re-export it with "
                                                     "a current llm.c)" : "");
    }
    LlmcModelShape& s = m.shape;
    s.max_seq_len = h[2]; s.vocab_size = h[3]; s.n_layer = h[4]; s.n_head = h[5]; s.n_embd = h[6];
    s.padded_vocab_size = h[7];
    const std::pair<const char*, std::pair<int, int>> fields[] = {
        {"max_seq_len (header[2])", {s.max_seq_len, 1 << 24}}, {"vocab_size (header[3])", {s.vocab_size, 1 << 24}},
        {"n_layer (header[4])", {s.n_layer, 1024}},           {"n_head (header[5])", {s.n_head, 4096}},
        {"n_embd (header[6])", {s.n_embd, 1 << 16}},          {"padded_vocab_size (header[7])", {s.padded_vocab_size, 1 << 24}}};
    for (const auto& [name, vb] : fields) {
        if (vb.first > 0 && vb.first <= vb.second) continue;
        fclose(f);
        LLMC_FAIL("%s: llm.c model file: %s is %d, expected 1 .. %d", path.c_str(), name, vb.first, vb.second);
    }
    if (s.n_embd % s.n_head != 0 || s.padded_vocab_size < s.vocab_size) {
        fclose(f);
        LLMC_FAIL("%s: llm.c model file: inconsistent header: n_embd %d must be a multiple of n_head %d and "
                  "padded_vocab_size %d at least vocab_size %d", path.c_str(), s.n_embd, s.n_head, s.padded_vocab_size,
                  s.vocab_size);
    }
    const size_t n = s.num_params(), width = m.version == LLMC_MODEL_VERSION_BF16 ? 2 : 4;
    const long long expected = LLMC_MODEL_HEADER_BYTES + (long long)(n * width);  // bounded above: no overflow
    if (size != expected) {
        fclose(f);
        LLMC_FAIL("%s: llm.c model file: %s: the header's shape (L %d, C %d, V %d padded to %d, maxT %d) makes %zu %s "
                  "parameters, a file of %lld bytes; the file is %lld bytes", path.c_str(),
                  size < expected ? "truncated" : "trailing bytes", s.n_layer, s.n_embd, s.vocab_size,
                  s.padded_vocab_size, s.max_seq_len, n, width == 2 ? "bf16" : "fp32", expected, size);
    }
    m.params.resize(n);
    try {
        if (width == 4) {
            fread_or_fail(m.params.data(), n * 4, f, path, "parameters");
        } else {
            std::vector<uint16_t> raw(n);
            fread_or_fail(raw.data(), n * 2, f, path, "parameters");
            for (size_t i = 0; i < n; i++) m.params[i] = bf16_to_float(raw[i]);
        }
    } catch (...) {
        fclose(f);
        throw;
    }
    fclose(f);
    size_t at = 0;
    for (const LlmcSlice& sl : llmc_file_order(s)) {
        for (size_t i = 0; i < sl.numel; i++)
            LLMC_CHECK(std::isfinite(m.params[at + i]), "%s: llm.c model file: %s element %zu is %g, expected a finite "
                       "number", path.c_str(), sl.name.c_str(), i, m.params[at + i]);
        at += sl.numel;
    }
    return m;
}

// Writes params (llm.c's order, fp32) as an llm.c model file, fp32 or bf16, atomically.
inline void write_llmc_model(const std::string& path, const LlmcModelShape& s, const std::vector<float>& params,
                             bool bf16) {
    LLMC_CHECK(params.size() == s.num_params(), "internal: %zu llm.c parameters for a shape of %zu", params.size(),
               s.num_params());
    int32_t h[256] = {0};
    h[0] = LLMC_MODEL_MAGIC;
    h[1] = bf16 ? LLMC_MODEL_VERSION_BF16 : LLMC_MODEL_VERSION_FP32;
    h[2] = s.max_seq_len; h[3] = s.vocab_size; h[4] = s.n_layer; h[5] = s.n_head; h[6] = s.n_embd;
    h[7] = s.padded_vocab_size;
    AtomicFile out(path);
    out.write(h, sizeof(h));
    if (bf16) {
        std::vector<uint16_t> raw(params.size());
        for (size_t i = 0; i < raw.size(); i++) raw[i] = float_to_bf16(params[i]);
        out.write(raw.data(), raw.size() * 2);
    } else {
        out.write(params.data(), params.size() * 4);
    }
    out.commit();
}

// Our parameter table as name -> (offset, numel), the only thing the conversions need from it.
using TableIndex = std::map<std::string, std::pair<size_t, size_t>>;

// llm.c order -> our table layout (table has n_table elements, alignment gaps left zero).
inline std::vector<float> llmc_to_table(const LlmcModelShape& s, const std::vector<float>& llmc, const TableIndex& index,
                                        size_t n_table, const std::string& path) {
    std::vector<float> table(n_table, 0.0f);
    size_t at = 0;
    for (const LlmcSlice& sl : llmc_file_order(s)) {
        auto it = index.find(sl.name);
        LLMC_CHECK(it != index.end() && it->second.second == sl.numel,
                   "%s: the llm.c tensor %s (%zu elements) has no counterpart of that size in this model", path.c_str(),
                   sl.name.c_str(), sl.numel);
        std::copy(llmc.begin() + at, llmc.begin() + at + sl.numel, table.begin() + it->second.first);
        at += sl.numel;
    }
    return table;
}

// our table layout -> llm.c order
inline std::vector<float> table_to_llmc(const LlmcModelShape& s, const float* table, const TableIndex& index) {
    std::vector<float> out;
    out.reserve(s.num_params());
    for (const LlmcSlice& sl : llmc_file_order(s)) {
        auto it = index.find(sl.name);
        LLMC_CHECK(it != index.end() && it->second.second == sl.numel,
                   "internal: our tensor %s does not have llm.c's %zu elements", sl.name.c_str(), sl.numel);
        out.insert(out.end(), table + it->second.first, table + it->second.first + sl.numel);
    }
    return out;
}
