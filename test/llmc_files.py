"""The engine's token files as test/test_python.sh's checks read them, independently of the engine:
a vocabulary file (tokenizer.bin: "LLMCVOCB", uint32 version, vocab_size, eot, 0, then per token
uint32 length + bytes) and a token shard (64-byte "LLMCSHRD" header, then the tokens)."""
import struct


def read_vocab(path):
    """(header fields (version, vocab_size, eot, 0), [bytes of each token id])."""
    b = open(path, "rb").read()
    assert b[:8] == b"LLMCVOCB", path
    header, pieces, at = struct.unpack("<IIII", b[8:24]), [], 24
    while at < len(b):
        k = struct.unpack("<I", b[at:at + 4])[0]
        pieces.append(b[at + 4:at + 4 + k])
        at += 4 + k
    return header, pieces


def read_shard(path):
    """The shard's tokens."""
    s = open(path, "rb").read()
    assert s[:8] == b"LLMCSHRD", path
    width, n = struct.unpack("<I", s[12:16])[0], struct.unpack("<Q", s[16:24])[0]
    return [int.from_bytes(s[64 + i * width:64 + (i + 1) * width], "little") for i in range(n)]
