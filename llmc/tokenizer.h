// The byte-level tokenizer of dev/data/prepare_text.py: token b < 256 is the byte b, the shard
// header names the end-of-text token (256). Decoding is for printing samples.
#pragma once
#include <string>

inline std::string decode_token(int token, int eot) {
    if (token == eot) return "\n<|endoftext|>\n";
    if (token < 0 || token >= 256) return "?";
    return std::string(1, (char)token);
}
