#!/usr/bin/env python3
"""Turn text into train/val token shards for train_gpt, with the byte-level tokenizer.

Tokenizer: token b in [0, 256) is the byte b; token 256 is <|endoftext|> (EOT). vocab_size = 257
(the model pads it to a multiple of 128). Every document is written as EOT followed by its bytes
(GPT-2 convention: EOT opens a document), so a packed row's doc_start is the last EOT at or before
each position.

Documents come from text files or directories (all regular files inside, recursively, skipping
fortune's .dat index files and symlinks), split by --sep:
  percent   a line holding only '%' separates documents (fortune files)
  blank     one or more blank lines separate documents
  file      each file is one document
Documents are shuffled with --seed, --val_frac of them go to the val split.

Shard format (little-endian), read by llmc/dataloader.h:
  64-byte header: magic b"LLMCSHRD", uint32 version (1), uint32 token_bytes (2 or 4),
  uint64 num_tokens, uint32 vocab_size, uint32 eot_token, zero padding to 64 bytes;
  then num_tokens tokens of token_bytes bytes each.

Re-running into an out_dir that already holds shards of the same name prefix is refused unless
--force is given (then the old <name>_train_*.bin / <name>_val_*.bin are deleted first): the
trainer's glob would otherwise mix stale shards into the new split. A short last shard (under
half of --shard_tokens) is merged into the shard before it, so no shard is too small to batch.

Example:  python3 dev/data/prepare_text.py /usr/share/games/fortunes --sep percent --out_dir data/fortunes
"""
import argparse
import glob
import os
import random
import re
import struct
import sys
from array import array

EOT = 256
VOCAB_SIZE = 257
HEADER_BYTES = 64
MAGIC = b"LLMCSHRD"


def write_shard(path, tokens, token_bytes=2):
    header = MAGIC + struct.pack("<IIQII", 1, token_bytes, len(tokens), VOCAB_SIZE, EOT)
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
    elif sep == "percent":
        docs = re.split(rb"(?:^|\n)%[ \t]*(?:\n|$)", data)
    else:  # blank
        docs = re.split(rb"\n[ \t]*\n+", data)
    return [d.strip(b"\n") for d in docs if d.strip()]


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
    args = ap.parse_args()
    # argparse has already refused non-numbers; the ranges are ours (exit 1 with a message, no traceback)
    if not 0 <= args.val_frac < 1:
        sys.exit(f"prepare_text.py: --val_frac must be in [0, 1) (the train split needs documents), got {args.val_frac}")
    if args.shard_tokens < 1:
        sys.exit(f"prepare_text.py: --shard_tokens must be >= 1, got {args.shard_tokens}")

    docs = []
    for path in list_files(args.inputs):
        with open(path, "rb") as f:
            docs.extend(split_documents(f.read(), args.sep))
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
        if stale and not args.force:
            sys.exit(f"prepare_text.py: {args.out_dir} already holds {len(stale)} shard(s) named {name}_* "
                     f"(e.g. {stale[0]}); the trainer's glob would mix them with the new ones. "
                     f"Pass --force to delete them first, or choose another --out_dir / --name")
        for p in stale:
            os.remove(p)
        for split, split_docs in splits.items():
            # shards are written one behind, so a short last shard can be merged into the one before
            shard, tokens, pending = 0, [], None
            for d in split_docs:
                tokens.append(EOT)
                tokens.extend(d)
                if len(tokens) >= args.shard_tokens:
                    if pending is not None:
                        write_shard(os.path.join(args.out_dir, f"{name}_{split}_{shard:03d}.bin"), pending)
                        shard += 1
                    pending, tokens = tokens, []
            if tokens and pending is not None and len(tokens) < args.shard_tokens // 2:
                pending, tokens = pending + tokens, []
            if pending is not None:
                write_shard(os.path.join(args.out_dir, f"{name}_{split}_{shard:03d}.bin"), pending)
                shard += 1
            if tokens or shard == 0:
                write_shard(os.path.join(args.out_dir, f"{name}_{split}_{shard:03d}.bin"), tokens)
            n_tok = sum(len(d) + 1 for d in split_docs)
            print(f"{split}: {len(split_docs)} documents, {n_tok} tokens, "
                  f"mean document {n_tok / max(1, len(split_docs)):.0f} tokens")
    except OSError as e:
        sys.exit(f"prepare_text.py: cannot write to {args.out_dir}: {e.strerror or e} ({e.filename or args.out_dir})")


if __name__ == "__main__":
    main()
