#!/usr/bin/env python3
r"""Turn text into train/val token shards for train_gpt: the byte-level tokenizer, a BPE trained here,
or an existing Hugging Face tokenizer (Llama 3, Qwen2, Mistral, ...).

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
  PATH            an existing Hugging Face tokenizer: a tokenizer.json (a path ending in .json) or a
                  folder holding one (a model folder: Llama 3, Qwen2, Mistral, ...), applied with
                  `tokenizers` as it is (its normalizer, pre-tokenizer and model; no special tokens
                  added: the document token below is ours). Written next to the shards:
                  tokenizer.bin (every id's bytes: byte-level BPE vocabularies through GPT-2's
                  byte-to-unicode map, SentencePiece-style ones with "▁" as a space and <0xXX>
                  byte-fallback tokens as that byte; special and added tokens as their text) and a
                  copy of tokenizer.json, tokenizer_config.json and special_tokens_map.json (those
                  present), which scripts/export_hf.py --tokenizer OUT_DIR carries into the model
                  folder. Shards hold 4-byte tokens when the vocabulary has more than 65536 ids.
                  The shards' vocab_size is the tokenizer's (its largest id + 1); the model's may be
                  larger: a model imported with scripts/import_hf.py keeps its config.json's
                  vocab_size (Qwen2: 151936 rows for 151665 tokens), a new one needs --vocab_size of
                  the trainer >= the shards'.
Every document is written as its document token followed by its tokens (GPT-2 convention: EOT
opens a document), so a packed row's doc_start is the last such token at or before each position.
The document token is EOT (<|endoftext|>) for byte and bpe; for an existing tokenizer it is
--doc_token when given, else the model's BOS (bos_token of tokenizer_config.json /
special_tokens_map.json, or the token its post-processor puts first: Llama 3's <|begin_of_text|>,
Llama 2's and Mistral's <s>), else <|endoftext|> when the vocabulary has it (Qwen2, GPT-2), else
the eos_token; the output says which it took.

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
  python3 dev/data/prepare_text.py books/ --sep blank --tokenizer hf/Llama-3.2-1B --out_dir data/books_llama3
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


TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def _types(node):
    """The component types of a tokenizer.json decoder / pre-tokenizer (Sequence unrolled)."""
    if not isinstance(node, dict):
        return []
    inner = node.get("decoders") or node.get("pretokenizers") or []
    return [node.get("type")] + [t for n in inner for t in _types(n)]


def hf_tokenizer(path, doc_token=None):
    """An existing tokenizer.json (or a folder holding one). Returns (tokenizer, document token id,
    [bytes of each token id], the files to copy beside the shards, what the document token is)."""
    try:
        from tokenizers import Tokenizer, pre_tokenizers
    except ImportError:
        sys.exit("prepare_text.py: --tokenizer PATH needs Hugging Face tokenizers: run `make tools` once, then this "
                 "script with .venv-tools/bin/python (or pip install tokenizers into your own environment)")
    import json
    tj = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    folder = os.path.dirname(tj) or "."
    try:
        spec = json.load(open(tj, encoding="utf-8"))
        tok = Tokenizer.from_file(tj)
    except (OSError, ValueError, Exception) as e:
        sys.exit(f"prepare_text.py: --tokenizer {tj}: cannot read it as a tokenizers tokenizer.json ({e})")
    vocab = tok.get_vocab(with_added_tokens=True)
    n = max(vocab.values()) + 1
    if n > (1 << 24):
        sys.exit(f"prepare_text.py: --tokenizer {tj}: {n} token ids, the engine takes at most {1 << 24}")
    added = {a["id"]: a["content"] for a in spec.get("added_tokens") or []}
    model = spec.get("model") or {}
    kinds = set(_types(spec.get("decoder"))) | set(_types(spec.get("pre_tokenizer")))
    if "ByteLevel" in kinds:
        kind = "byte-level"
        byte_of = byte_level_alphabet()
        if set(byte_of) != set(pre_tokenizers.ByteLevel.alphabet()):
            sys.exit("prepare_text.py: this tokenizers version spells bytes differently from GPT-2's byte-level map")
    elif kinds & {"Metaspace", "ByteFallback", "Replace"} or model.get("byte_fallback"):
        kind = "sentencepiece"
    else:
        sys.exit(f"prepare_text.py: --tokenizer {tj}: its decoder ({', '.join(sorted(k for k in kinds if k)) or 'none'})"
                 " is neither byte-level BPE nor SentencePiece-style: cannot tell each token's bytes")
    pieces = [b""] * n
    for text, i in vocab.items():
        if i in added:
            pieces[i] = added[i].encode()
        elif kind == "byte-level":
            try:
                pieces[i] = bytes(byte_of[c] for c in text)
            except KeyError:
                sys.exit(f"prepare_text.py: --tokenizer {tj}: token {i} {text!r} is not spelled in the byte-level "
                         "alphabet")
        elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text) and model.get("byte_fallback"):
            pieces[i] = bytes([int(text[3:5], 16)])
        else:
            pieces[i] = text.replace("\u2581", " ").encode()
    # the document token
    named = {}
    for name in reversed(TOKENIZER_FILES[1:]):  # tokenizer_config.json has the last word
        p = os.path.join(folder, name)
        if os.path.isfile(p):
            try:
                d = json.load(open(p, encoding="utf-8"))
            except (OSError, ValueError) as e:
                sys.exit(f"prepare_text.py: {p}: not JSON ({e})")
            for k in ("bos", "eos"):
                if f"{k}_token" in d:
                    v = d[f"{k}_token"]
                    named[k] = v.get("content") if isinstance(v, dict) else v
    first = None
    post = spec.get("post_processor") or {}
    for proc in [post] + list(post.get("processors") or []):
        single = proc.get("single") if proc.get("type") == "TemplateProcessing" else None
        if single and "SpecialToken" in single[0]:
            first = single[0]["SpecialToken"]["id"]
    if doc_token is not None:
        text, why = doc_token, "--doc_token"
    elif named.get("bos"):
        text, why = named["bos"], "the model's BOS"
    elif "bos" not in named and first is not None:
        text, why = first, "the model's BOS (its post-processor's first token)"
    elif EOT_TEXT in vocab:
        text, why = EOT_TEXT, "the end-of-text token: the model has no BOS"
    elif named.get("eos"):
        text, why = named["eos"], "the model's EOS: it has no BOS"
    else:
        sys.exit(f"prepare_text.py: --tokenizer {tj}: cannot tell the token that starts a document (no bos_token, no "
                 f"{EOT_TEXT}, no eos_token): name it with --doc_token TEXT")
    if text not in vocab:
        sys.exit(f"prepare_text.py: --tokenizer {tj}: the document token {text!r} ({why}) is not in its vocabulary")
    eot = vocab[text]
    # the vocabulary must spell what the tokenizer decodes, byte for byte
    for sample in ["the quick brown fox, 42 times!", "আমার সোনার বাংলা", "naïve café \u20ac \u6f22\u5b57 \U0001F600"]:
        ids = tok.encode(sample, add_special_tokens=False).ids
        got = b"".join(pieces[i] for i in ids).decode("utf-8", "replace")
        want = tok.decode(ids, skip_special_tokens=False)
        if got != want and got != " " + want:  # SentencePiece's decoder strips the first "▁"
            sys.exit(f"prepare_text.py: --tokenizer {tj}: its tokens' bytes ({kind}) do not spell what it decodes: "
                     f"{got!r} vs {want!r}")
    files = [tj] + [os.path.join(folder, f) for f in TOKENIZER_FILES[1:] if os.path.isfile(os.path.join(folder, f))]
    print(f"tokenizer: {tj} ({kind}, {n} token ids); documents start with {text!r} (id {eot}, {why})")
    return tok, eot, pieces, files


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
        for enc in tok.encode_batch([d.decode("utf-8", "replace") for d in docs[k:k + batch]], add_special_tokens=False):
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
    ap.add_argument("--tokenizer", default="byte", help="byte (257 tokens), bpe (a BPE trained here), or an existing "
                    "Hugging Face tokenizer: a tokenizer.json or a folder holding one")
    ap.add_argument("--vocab_size", type=int, default=None, help="--tokenizer bpe: tokens in the vocabulary (default 8192)")
    ap.add_argument("--doc_token", default=None, help="--tokenizer PATH: the token text that starts every document "
                    "(default: the model's BOS, else <|endoftext|>, else its EOS)")
    args = ap.parse_args()
    # argparse has already refused non-numbers; the ranges are ours (exit 1 with a message, no traceback)
    if not 0 <= args.val_frac < 1:
        sys.exit(f"prepare_text.py: --val_frac must be in [0, 1) (the train split needs documents), got {args.val_frac}")
    if args.shard_tokens < 1:
        sys.exit(f"prepare_text.py: --shard_tokens must be >= 1, got {args.shard_tokens}")
    hf = args.tokenizer not in ("byte", "bpe")
    if hf and not (args.tokenizer.endswith(".json") or os.path.isfile(os.path.join(args.tokenizer, "tokenizer.json"))):
        sys.exit(f"prepare_text.py: --tokenizer {args.tokenizer}: expected byte, bpe, a tokenizer.json or a folder holding "
                 "one")
    if args.tokenizer == "byte" and args.vocab_size is not None:
        sys.exit("prepare_text.py: --vocab_size is for --tokenizer bpe (the byte tokenizer has 257 tokens)")
    if hf and args.vocab_size is not None:
        sys.exit("prepare_text.py: --vocab_size is for --tokenizer bpe (an existing tokenizer has its own)")
    if args.doc_token is not None and not hf:
        sys.exit("prepare_text.py: --doc_token is for --tokenizer PATH (byte and bpe start documents with <|endoftext|>)")
    if args.tokenizer == "bpe":
        args.vocab_size = 8192 if args.vocab_size is None else args.vocab_size
        # 256 bytes + EOT at least; at most what the trainer's 32-bit token ids (and 2^24 in the engine) allow
        if not 257 <= args.vocab_size <= (1 << 24):
            sys.exit(f"prepare_text.py: --vocab_size must be in [257, {1 << 24}], got {args.vocab_size}")

    if hf:  # read (and its files kept) before anything is written: it may live in out_dir
        *hf_tok, files = hf_tokenizer(args.tokenizer, args.doc_token)
        copies = {os.path.basename(f): open(f, "rb").read() for f in files}
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
        stale += [p for p in [os.path.join(args.out_dir, f) for f in ["tokenizer.bin"] + TOKENIZER_FILES]
                  if os.path.exists(p)]
        if stale and not args.force:
            sys.exit(f"prepare_text.py: {args.out_dir} already holds {len(stale)} shard or tokenizer file(s) "
                     f"(e.g. {stale[0]}); the trainer would mix them with the new ones. "
                     f"Pass --force to delete them first, or choose another --out_dir / --name")
        for p in stale:
            os.remove(p)
        tok, eot, vocab_size = None, EOT, VOCAB_SIZE
        if hf:
            tok, eot, pieces = hf_tok
            vocab_size = len(pieces)
            for base, data in copies.items():
                with open(os.path.join(args.out_dir, base), "wb") as f:
                    f.write(data)
            write_vocab(os.path.join(args.out_dir, "tokenizer.bin"), pieces, eot)
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
        if hf:
            print(f"the shards' vocab_size is {vocab_size} ({'4' if vocab_size > 65536 else '2'}-byte tokens): a model "
                  f"imported with scripts/import_hf.py keeps its config.json's vocab_size (>= this), a new one needs "
                  f"the trainer's --vocab_size >= {vocab_size}")
    except OSError as e:
        sys.exit(f"prepare_text.py: cannot write to {args.out_dir}: {e.strerror or e} ({e.filename or args.out_dir})")


if __name__ == "__main__":
    main()
