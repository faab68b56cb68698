// Decoding token ids to text, for printing samples. Three vocabularies:
//  - the byte-level tokenizer of dev/data/prepare_text.py (default): token b < 256 is the byte b,
//    the shard header names the end-of-text token (256);
//  - a vocabulary file: token id -> bytes, in one of two formats (told apart by the first word):
//      ours, written by prepare_text.py --tokenizer bpe next to tokenizer.json as tokenizer.bin:
//        char magic[8] = "LLMCVOCB", uint32 version = 1, uint32 vocab_size, uint32 eot_token,
//        uint32 reserved = 0, then vocab_size records { uint32 n_bytes, n_bytes bytes }
//      llm.c's gpt2_tokenizer.bin: 256 x uint32 header { 20240328, version 1 or 2, vocab_size,
//        eot_token (version 2; version 1 means GPT-2: vocab 50257, eot 50256), 0... }, then
//        vocab_size records { uint8 n_bytes, n_bytes bytes }
//  - none: the ids themselves are printed.
// A token of a byte-level BPE can end in the middle of a UTF-8 character (a Bengali letter is 3
// bytes, often split over two tokens), so decoding goes through Utf8Stream, which emits only whole
// characters and holds an incomplete one until the bytes that complete it arrive.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>
#include "llmc/utils.h"

constexpr uint32_t LLMC_TOKENIZER_MAGIC = 20240328;  // llm.c's gpt2_tokenizer.bin
constexpr uint32_t VOCAB_FILE_VERSION = 1;           // our LLMCVOCB file
constexpr int VOCAB_FILE_HEADER_BYTES = 24;
static const char* const EOT_TEXT = "\n<|endoftext|>\n";
static const char* const REPLACEMENT_CHAR = "\xEF\xBF\xBD";  // U+FFFD, for bytes that are not UTF-8

// Bytes in, whole UTF-8 characters out. Invalid bytes (a stray continuation byte, a character
// cut off by a byte that cannot continue it, overlong forms, surrogates) become U+FFFD, one per
// maximal valid prefix, and the stream resynchronizes on the next byte. Control characters other than tab and newline are
// shown as U+FFFD too: a sample must not move the terminal's cursor or change its state.
struct Utf8Stream {
    std::string pending;

    // the length of the character starting with lead byte c (0: c cannot start one)
    static int char_length(unsigned char c) {
        if (c < 0x80) return 1;
        if (c >= 0xC2 && c <= 0xDF) return 2;
        if (c >= 0xE0 && c <= 0xEF) return 3;
        if (c >= 0xF0 && c <= 0xF4) return 4;
        return 0;
    }
    // whether byte k (k >= 1) of a character led by `lead` may be c (the second byte's range
    // excludes overlong forms, surrogates and code points past U+10FFFF)
    static bool continuation_ok(unsigned char lead, int k, unsigned char c) {
        if (k == 1) {
            if (lead == 0xE0) return c >= 0xA0 && c <= 0xBF;
            if (lead == 0xED) return c >= 0x80 && c <= 0x9F;
            if (lead == 0xF0) return c >= 0x90 && c <= 0xBF;
            if (lead == 0xF4) return c >= 0x80 && c <= 0x8F;
        }
        return c >= 0x80 && c <= 0xBF;
    }

    std::string push(const std::string& bytes) {
        pending += bytes;
        std::string out;
        size_t i = 0;
        while (i < pending.size()) {
            const unsigned char c = (unsigned char)pending[i];
            const int len = char_length(c);
            if (len == 0) { out += REPLACEMENT_CHAR; i++; continue; }
            if (len == 1) {
                out += (c < 0x20 && c != '\n' && c != '\t') || c == 0x7F ? std::string(REPLACEMENT_CHAR) : std::string(1, (char)c);
                i++;
                continue;
            }
            int k = 1;
            while (k < len && i + k < pending.size() && continuation_ok(c, k, (unsigned char)pending[i + k])) k++;
            if (k == len) { out.append(pending, i, len); i += len; continue; }
            if (i + k == pending.size()) break;  // valid so far, the rest has not arrived: hold it
            out += REPLACEMENT_CHAR;             // broken: one U+FFFD for the valid prefix (Unicode's
            i += k;                              // "maximal subpart" practice), go on after it
        }
        pending.erase(0, i);
        return out;
    }
    // the end of the text: an incomplete character left over is shown as U+FFFD
    std::string finish() {
        std::string out = pending.empty() ? "" : REPLACEMENT_CHAR;
        pending.clear();
        return out;
    }
};

struct Tokenizer {
    enum Kind { BYTES, TABLE, IDS } kind = BYTES;
    int eot = 256;
    std::vector<std::string> pieces;  // TABLE: token id -> bytes
    std::string source;               // what it is, for the start-up line

    // The UTF-8 bytes of the text a token stands for (EOT: none), -1 when unknown (token ids only):
    // what bits per byte divides by, so that runs with different tokenizers compare.
    int64_t text_bytes(int token) const {
        if (kind == IDS) return -1;
        if (token == eot) return 0;
        if (kind == BYTES) return token >= 0 && token < 256 ? 1 : 0;
        return token >= 0 && token < (int)pieces.size() ? (int64_t)pieces[token].size() : 0;
    }

    // Decodes a whole sequence: EOT as a marked line break, everything else through Utf8Stream.
    std::string decode(const std::vector<int>& tokens) const {
        Utf8Stream utf8;
        std::string out;
        for (int t : tokens) {
            if (t == eot) {
                out += utf8.finish();
                out += EOT_TEXT;
            } else if (kind == IDS) {
                out += (out.empty() || out.back() == '\n' ? "" : " ") + std::to_string(t);
            } else if (kind == BYTES) {
                out += t >= 0 && t < 256 ? utf8.push(std::string(1, (char)t)) : utf8.finish() + REPLACEMENT_CHAR;
            } else {
                out += t >= 0 && t < (int)pieces.size() ? utf8.push(pieces[t]) : utf8.finish() + REPLACEMENT_CHAR;
            }
        }
        return out + utf8.finish();
    }
};

inline Tokenizer byte_tokenizer(int eot) {
    Tokenizer t;
    t.kind = Tokenizer::BYTES;
    t.eot = eot;
    t.source = "bytes (token b is byte b)";
    return t;
}

inline Tokenizer ids_tokenizer(int eot, const std::string& why) {
    Tokenizer t;
    t.kind = Tokenizer::IDS;
    t.eot = eot;
    t.source = "none (" + why + "): samples print token ids";
    return t;
}

// Reads a vocabulary file of either format (see the top of this file), checking every length
// against the bytes that are left, so a corrupt file gives an error rather than a huge allocation.
inline Tokenizer load_tokenizer_file(const std::string& path) {
    const long long size = file_size_bytes(path);
    FILE* f = fopen_or_fail(path, "rb");
    std::string data((size_t)size, '\0');
    const size_t got = fread(data.data(), 1, data.size(), f);
    fclose(f);
    LLMC_CHECK(got == data.size(), "%s: read error (got %zu of %lld bytes)", path.c_str(), got, size);
    Tokenizer t;
    t.kind = Tokenizer::TABLE;
    auto u32 = [&](size_t at) {
        uint32_t v;
        memcpy(&v, data.data() + at, 4);
        return v;
    };
    size_t at = 0;
    uint32_t vocab = 0;
    int length_bytes = 0;
    if (data.size() >= 8 && memcmp(data.data(), "LLMCVOCB", 8) == 0) {
        LLMC_CHECK(data.size() >= (size_t)VOCAB_FILE_HEADER_BYTES, "%s: truncated header (%zu bytes, expected %d)",
                   path.c_str(), data.size(), VOCAB_FILE_HEADER_BYTES);
        LLMC_CHECK(u32(8) == VOCAB_FILE_VERSION, "%s: vocabulary file version %u, expected %u", path.c_str(), u32(8),
                   VOCAB_FILE_VERSION);
        vocab = u32(12);
        t.eot = (int)u32(16);
        at = VOCAB_FILE_HEADER_BYTES;
        length_bytes = 4;
        t.source = path + " (BPE vocabulary)";
    } else if (data.size() >= 4 && u32(0) == LLMC_TOKENIZER_MAGIC) {
        LLMC_CHECK(data.size() >= 1024, "%s: llm.c tokenizer file: truncated header (%zu bytes, expected 1024)",
                   path.c_str(), data.size());
        const uint32_t version = u32(4);
        vocab = u32(8);
        LLMC_CHECK(version == 1 || version == 2, "%s: llm.c tokenizer file version %u, expected 1 or 2", path.c_str(),
                   version);
        if (version == 1) {  // version 1 predates the eot field: it is GPT-2's
            LLMC_CHECK(vocab == 50257, "%s: llm.c tokenizer file version 1 must hold GPT-2's 50257 tokens, it says %u",
                       path.c_str(), vocab);
            t.eot = 50256;
        } else {
            t.eot = (int)u32(12);
        }
        at = 1024;
        length_bytes = 1;
        t.source = path + " (llm.c tokenizer)";
    } else {
        LLMC_FAIL("%s: not a tokenizer file: expected the magic \"LLMCVOCB\" (prepare_text.py --tokenizer bpe) or "
                  "llm.c's uint32 %u (gpt2_tokenizer.bin)", path.c_str(), LLMC_TOKENIZER_MAGIC);
    }
    LLMC_CHECK(vocab > 0 && vocab <= (1u << 24), "%s: vocab_size %u, expected 1 .. %u", path.c_str(), vocab, 1u << 24);
    LLMC_CHECK(t.eot >= 0 && (uint32_t)t.eot < vocab, "%s: eot_token %d is not below vocab_size %u", path.c_str(), t.eot,
               vocab);
    t.pieces.reserve(vocab);
    for (uint32_t i = 0; i < vocab; i++) {
        LLMC_CHECK(at + length_bytes <= data.size(), "%s: truncated: token %u of %u has no length", path.c_str(), i, vocab);
        const size_t n = length_bytes == 4 ? u32(at) : (unsigned char)data[at];
        at += length_bytes;
        LLMC_CHECK(n <= data.size() - at, "%s: truncated: token %u of %u says %zu bytes, %zu are left", path.c_str(), i, vocab, n,
                   data.size() - at);
        t.pieces.emplace_back(data, at, n);
        at += n;
    }
    LLMC_CHECK(at == data.size(), "%s: %zu trailing bytes after the %u tokens", path.c_str(), data.size() - at, vocab);
    return t;
}

// Chooses the tokenizer for samples: the --tokenizer file if given, else a vocabulary file next to
// the first train shard (tokenizer.bin, then gpt2_tokenizer.bin; for llm.c's GPT-2 shards also
// ./gpt2_tokenizer.bin, where llm.c keeps it), else the byte tokenizer when the shards are bytes
// (vocab 257, eot 256), else token ids. A file that is found must agree with the shards.
inline Tokenizer find_tokenizer(const std::string& flag, const std::string& shard_path, uint32_t shard_vocab,
                                uint32_t shard_eot, bool llmc_shard) {
    std::vector<std::string> candidates;
    if (!flag.empty()) {
        candidates.push_back(flag);
    } else {
        const size_t slash = shard_path.rfind('/');
        const std::string dir = slash == std::string::npos ? "" : shard_path.substr(0, slash + 1);
        for (const char* name : {"tokenizer.bin", "gpt2_tokenizer.bin"})
            if (file_exists(dir + name)) candidates.push_back(dir + name);
        if (llmc_shard && file_exists("gpt2_tokenizer.bin")) candidates.push_back("gpt2_tokenizer.bin");
    }
    if (!candidates.empty()) {
        Tokenizer t = load_tokenizer_file(candidates[0]);
        LLMC_CHECK((uint32_t)t.eot == shard_eot && (uint32_t)t.pieces.size() >= shard_vocab,
                   "%s: tokenizer (vocab_size %zu, eot %d) does not match the train shards (%s: vocab_size %u, eot %u)%s",
                   candidates[0].c_str(), t.pieces.size(), t.eot, shard_path.c_str(), shard_vocab, shard_eot,
                   flag.empty() ? "; remove it or name the right one with --tokenizer" : "");
        return t;
    }
    if (shard_vocab <= 257 && shard_eot == 256) return byte_tokenizer((int)shard_eot);
    return ids_tokenizer((int)shard_eot, llmc_shard ? "no gpt2_tokenizer.bin next to the shards or here"
                                                    : "no tokenizer.bin next to the shards; see --tokenizer");
}
