#!/usr/bin/env python3
r"""Turn text into train/val token shards for train_gpt, with the byte-level tokenizer or a BPE.

Tokenizers (--tokenizer):
  byte (default)  token b in [0, 256) is the byte b; token 256 is <|endoftext|> (EOT). vocab_size
                  = 257 (the model pads it to a multiple of 128). Needs nothing but Python.
  bpe             a byte-level BPE of --vocab_size tokens trained on the train split with Hugging
                  Face `tokenizers` (its NFC normalizer, GPT-2's byte-level pre-tokenizer, its BPE
                  trainer); <|endoftext|> is a special token (id 0). Written next to the shards:
                  tokenizer.json (the `tokenizers` file, for Python) and tokenizer.bin (token id ->
                  bytes, which train_gpt reads to decode samples; format in llmc/io/tokenizer.h:
                  "LLMCVOCB", uint32 version 1, uint32 vocab_size, uint32 eot_token, uint32 0, then
                  per token uint32 n_bytes + the bytes). Needs `tokenizers`: `make tools`, then run this
                  script with .venv-tools/bin/python.
Every document is written as EOT followed by its tokens (GPT-2 convention: EOT opens a document),
so a packed row's doc_start is the last EOT at or before each position.

Documents come from text files or directories (all regular files inside, recursively, skipping
fortune's .dat index files and symlinks), split by --sep:
  percent   a line holding only '%' separates documents (fortune files)
  blank     one or more blank lines separate documents
  file      each file is one document
(lines end with \n or \r\n)
Documents are shuffled with --seed, --val_frac of them go to the val split.

Shard format (little-endian), read by llmc/io/dataloader.h:
  64-byte header: magic b"LLMCSHRD", uint32 version (1), uint32 token_bytes (2 or 4),
  uint64 num_tokens, uint32 vocab_size, uint32 eot_token, zero padding to 64 bytes;
  then num_tokens tokens of token_bytes bytes each.

Re-running into an out_dir that already holds shards of the same name prefix is refused unless
--force is given (then the old <name>_train_*.bin / <name>_val_*.bin are deleted first): the
trainer's glob would otherwise mix stale shards into the new split. A short last shard (under
half of --shard_tokens) is merged into the shard before it, so no shard is too small to batch.

Each split's line reports the tokenizer's fertility on it: tokens per character and per word
(whitespace-separated; EOTs left out), the figure that says what a tokenizer costs a language
(dev/data/bengali_sample.py's Bengali + English sample: 1.80 byte tokens per character, 0.52
with a 4096-token BPE trained on it).

Large inputs show their progress on stderr (files and bytes read, documents and tokens/s
encoded, tokens written), at most once a second and only for phases that take more than 2 s.

Examples:
  python3 dev/data/prepare_text.py /usr/share/games/fortunes --sep percent --out_dir data/fortunes
  python3 dev/data/prepare_text.py books/ --sep blank --tokenizer bpe --vocab_size 8192 --out_dir data/books
"""
import argparse
import glob
import os
import random
import re
import struct
import sys
import time
from array import array

EOT = 256
VOCAB_SIZE = 257
HEADER_BYTES = 64
MAGIC = b"LLMCSHRD"
VOCAB_MAGIC = b"LLMCVOCB"
EOT_TEXT = "<|endoftext|>"


class Progress:
    """One progress line on stderr, rewritten in place on a terminal (a line per update otherwise),
    at most once a second and only after the phase has run 2 s, so small inputs stay quiet."""

    def __init__(self, what):
        self.what, self.t0, self.last, self.shown = what, time.time(), 0.0, False
        self.tty = sys.stderr.isatty()

    def elapsed(self):
        return max(time.time() - self.t0, 1e-9)

    def update(self, message):
        now = time.time()
        if now - self.t0 < 2 or now - self.last < 1:
            return
        self.last, self.shown = now, True
        start = "\r" if self.tty else ""
        print(f"{start}{self.what}: {message()}", end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def done(self, message):
        if self.shown:
            start = "\r" if self.tty else ""
            print(f"{start}{self.what}: {message()} ({self.elapsed():.1f} s)", file=sys.stderr, flush=True)


def mib(n):
    return f"{n / 1048576:.1f} MiB"


def write_shard(path, tokens, vocab_size=VOCAB_SIZE, eot=EOT):
    token_bytes = 2 if vocab_size <= 65536 else 4
    header = MAGIC + struct.pack("<IIQII", 1, token_bytes, len(tokens), vocab_size, eot)
    header += b"\0" * (HEADER_BYTES - len(header))
    data = array("H" if token_bytes == 2 else "I", tokens)
    if sys.byteorder != "little":
        data.byteswap()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(header)
        data.tofile(f)
    os.replace(tmp, path)


def list_files(inputs):
    files = []
    for p in inputs:
        if os.path.isdir(p):
            for root, _, names in os.walk(p):
                for n in sorted(names):
                    full = os.path.join(root, n)
                    if n.endswith(".dat") or os.path.islink(full) or not os.path.isfile(full):
                        continue
                    files.append(full)
        elif os.path.isfile(p):
            files.append(p)
        else:
            sys.exit(f"prepare_text.py: input {p}: no such file or directory")
    return sorted(files)


def split_documents(data, sep):
    if sep == "file":
        docs = [data]
    elif sep == "percent":  # a line ends with \n or \r\n (Windows files); a document keeps its own bytes
        docs = re.split(rb"(?:^|\r?\n)%[ \t]*(?:\r?\n|$)", data)
    else:  # blank
        docs = re.split(rb"\r?\n(?:[ \t]*\r?\n)+", data)
    return [d.strip(b"\r\n") for d in docs if d.strip()]


def byte_level_alphabet():
    """GPT-2's map from bytes to the printable characters that byte-level BPE tokens are spelled
    in: the printable Latin-1 bytes stand for themselves, the other 68 bytes, in order, for
    chr(256), chr(257), ... (the `tokenizers` ByteLevel pre-tokenizer uses this map; train_bpe
    checks that the alphabets agree and that decoding round-trips)."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("\xa1"), ord("\xac") + 1)) | set(range(ord("\xae"), 256))
    char_of, extra = {}, 0
    for b in range(256):
        if b in keep:
            char_of[b] = chr(b)
        else:
            char_of[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in char_of.items()}


def train_bpe(train_docs, vocab_size):
    """A byte-level BPE trained on the documents (bytes, decoded as UTF-8 with replacement).
    Returns (tokenizer, eot id, [bytes of each token id])."""
    try:
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    except ImportError:
        sys.exit("prepare_text.py: --tokenizer bpe needs Hugging Face tokenizers: run `make tools` once, then this "
                 "script with .venv-tools/bin/python (or pip install tokenizers into your own environment)")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TEXT], show_progress=sys.stderr.isatty(),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t0 = time.time()
    tok.train_from_iterator((d.decode("utf-8", "replace") for d in train_docs), trainer=trainer, length=len(train_docs))
    eot = tok.token_to_id(EOT_TEXT)
    byte_of = byte_level_alphabet()
    if set(byte_of) != set(pre_tokenizers.ByteLevel.alphabet()):
        sys.exit("prepare_text.py: this tokenizers version spells bytes differently from GPT-2's byte-level map")
    pieces = []
    for i in range(tok.get_vocab_size()):
        s = tok.id_to_token(i)
        pieces.append(s.encode() if i == eot else bytes(byte_of[c] for c in s))
    # the vocabulary must decode what the tokenizer encodes, byte for byte (after its normalizer)
    for d in train_docs[:50]:
        text = d.decode("utf-8", "replace")
        got = b"".join(pieces[i] for i in tok.encode(text).ids)
        if got != tok.normalizer.normalize_str(text).encode():
            sys.exit("prepare_text.py: internal error: the BPE vocabulary does not round-trip a training document")
    print(f"bpe: trained {tok.get_vocab_size()} tokens (asked for {vocab_size}) in {time.time() - t0:.1f} s, "
          f"eot id {eot}")
    return tok, eot, pieces


def write_vocab(path, pieces, eot):
    """tokenizer.bin: what train_gpt decodes samples with (format in the docstring at the top)."""
    out = bytearray(VOCAB_MAGIC + struct.pack("<IIII", 1, len(pieces), eot, 0))
    for p in pieces:
        out += struct.pack("<I", len(p)) + p
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(out)
    os.replace(tmp, path)


def read_documents(files, sep):
    docs, done_bytes = [], 0
    total = sum(os.path.getsize(p) for p in files)
    progress = Progress("reading")
    for k, path in enumerate(files):
        with open(path, "rb") as f:
            data = f.read()
        docs.extend(split_documents(data, sep))
        done_bytes += len(data)
        progress.update(lambda: f"file {k + 1}/{len(files)}, {mib(done_bytes)} of {mib(total)}, "
                                f"{mib(done_bytes / progress.elapsed())}/s, {len(docs)} documents")
    progress.done(lambda: f"{len(files)} files, {mib(done_bytes)}, {len(docs)} documents")
    return docs


def encoded_documents(docs, tok):
    """The token ids of each document: its bytes, or its BPE ids (encoded in parallel batches)."""
    if tok is None:
        yield from docs
        return
    batch = 1024
    for k in range(0, len(docs), batch):
        for enc in tok.encode_batch([d.decode("utf-8", "replace") for d in docs[k:k + batch]]):
            yield enc.ids


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="text files or directories")
    ap.add_argument("--sep", choices=["percent", "blank", "file"], default="percent", help="document separator")
    ap.add_argument("--out_dir", required=True, help="where to write <name>_train_NNN.bin / <name>_val_NNN.bin")
    ap.add_argument("--name", default=None, help="shard name prefix (default: basename of out_dir)")
    ap.add_argument("--val_frac", type=float, default=0.05, help="fraction of documents for validation")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per shard (the last may hold up to 1.5x)")
    ap.add_argument("--force", action="store_true", help="delete existing shards of the same name in out_dir first")
    ap.add_argument("--tokenizer", choices=["byte", "bpe"], default="byte", help="byte-level (257 tokens) or a trained BPE")
    ap.add_argument("--vocab_size", type=int, default=None, help="--tokenizer bpe: tokens in the vocabulary (default 8192)")
    args = ap.parse_args()
    # argparse has already refused non-numbers; the ranges are ours (exit 1 with a message, no traceback)
    if not 0 <= args.val_frac < 1:
        sys.exit(f"prepare_text.py: --val_frac must be in [0, 1) (the train split needs documents), got {args.val_frac}")
    if args.shard_tokens < 1:
        sys.exit(f"prepare_text.py: --shard_tokens must be >= 1, got {args.shard_tokens}")
    if args.tokenizer == "byte" and args.vocab_size is not None:
        sys.exit("prepare_text.py: --vocab_size is for --tokenizer bpe (the byte tokenizer has 257 tokens)")
    if args.tokenizer == "bpe":
        args.vocab_size = 8192 if args.vocab_size is None else args.vocab_size
        # 256 bytes + EOT at least; at most what the trainer's 32-bit token ids (and 2^24 in the engine) allow
        if not 257 <= args.vocab_size <= (1 << 24):
            sys.exit(f"prepare_text.py: --vocab_size must be in [257, {1 << 24}], got {args.vocab_size}")

    docs = read_documents(list_files(args.inputs), args.sep)
    if len(docs) < 2:
        sys.exit(f"prepare_text.py: found {len(docs)} documents in {args.inputs}; need at least 2 (check --sep)")
    random.Random(args.seed).shuffle(docs)
    # at least one val document, and never all of them (len(docs) >= 2 here)
    n_val = min(len(docs) - 1, max(1, int(round(len(docs) * args.val_frac))))
    splits = {"val": docs[:n_val], "train": docs[n_val:]}

    name = args.name or os.path.basename(os.path.normpath(args.out_dir))
    try:
        os.makedirs(args.out_dir, exist_ok=True)
        stale = sorted(glob.glob(os.path.join(glob.escape(args.out_dir), f"{glob.escape(name)}_train_*.bin")) +
                       glob.glob(os.path.join(glob.escape(args.out_dir), f"{glob.escape(name)}_val_*.bin")))
        # an old BPE vocabulary would be picked up by the trainer for these shards
        stale += [p for p in (os.path.join(args.out_dir, "tokenizer.bin"), os.path.join(args.out_dir, "tokenizer.json"))
                  if os.path.exists(p)]
        if stale and not args.force:
            sys.exit(f"prepare_text.py: {args.out_dir} already holds {len(stale)} shard or tokenizer file(s) "
                     f"(e.g. {stale[0]}); the trainer would mix them with the new ones. "
                     f"Pass --force to delete them first, or choose another --out_dir / --name")
        for p in stale:
            os.remove(p)
        tok, eot, vocab_size = None, EOT, VOCAB_SIZE
        if args.tokenizer == "bpe":
            tok, eot, pieces = train_bpe(splits["train"], args.vocab_size)
            vocab_size = len(pieces)
            tok.save(os.path.join(args.out_dir, "tokenizer.json"))
            write_vocab(os.path.join(args.out_dir, "tokenizer.bin"), pieces, eot)
        for split, split_docs in splits.items():
            def shard_path(k):
                return os.path.join(args.out_dir, f"{name}_{split}_{k:03d}.bin")
            # shards are written one behind, so a short last shard can be merged into the one before
            shard, tokens, pending, n_tok = 0, [], None, 0
            progress = Progress(f"{split}: encoding")
            for k, ids in enumerate(encoded_documents(split_docs, tok)):
                tokens.append(eot)
                tokens.extend(ids)
                n_tok += len(ids) + 1
                progress.update(lambda: f"document {k + 1}/{len(split_docs)}, {n_tok} tokens, "
                                        f"{n_tok / progress.elapsed():.0f} tokens/s")
                if len(tokens) >= args.shard_tokens:
                    if pending is not None:
                        write_shard(shard_path(shard), pending, vocab_size, eot)
                        shard += 1
                    pending, tokens = tokens, []
            progress.done(lambda: f"{len(split_docs)} documents, {n_tok} tokens")
            if tokens and pending is not None and len(tokens) < args.shard_tokens // 2:
                pending, tokens = pending + tokens, []
            if pending is not None:
                write_shard(shard_path(shard), pending, vocab_size, eot)
                shard += 1
            if tokens or shard == 0:
                write_shard(shard_path(shard), tokens, vocab_size, eot)
                shard += 1
            # fertility: tokens (without the EOTs) per character and per whitespace-separated word of the text
            n_chars = sum(len(d.decode("utf-8", "replace")) for d in split_docs)
            n_words = sum(len(d.split()) for d in split_docs)
            print(f"{split}: {len(split_docs)} documents, {n_tok} tokens in {shard} shard(s), "
                  f"mean document {n_tok / max(1, len(split_docs)):.0f} tokens; "
                  f"{(n_tok - len(split_docs)) / max(1, n_chars):.3f} tokens per character, "
                  f"{(n_tok - len(split_docs)) / max(1, n_words):.3f} per word")
    except OSError as e:
        sys.exit(f"prepare_text.py: cannot write to {args.out_dir}: {e.strerror or e} ({e.filename or args.out_dir})")


if __name__ == "__main__":
    main()
