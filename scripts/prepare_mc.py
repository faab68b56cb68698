#!/usr/bin/env python3
r"""Turn a multiple-choice evaluation set into the file train_gpt scores with --eval_mc.

    python3 scripts/prepare_mc.py INPUT OUT.bin [--format hellaswag|belebele|csv] [--tokenizer FILE]

Inputs (the format is guessed from the file when --format is not given):
  hellaswag  JSONL, one item per line: "ctx" (or "ctx_a" + "ctx_b", with "activity_label" in
             front as lm-evaluation-harness does), "endings" (a list), "label" (the right
             ending, 0-based). The Okapi multilingual HellaSwag files have the same fields.
  belebele   JSONL: "flores_passage", "question", "mc_answer1".."mc_answer4", "correct_answer_num"
             (1-based), e.g. Belebele's ben_Beng.jsonl.
  csv        MMLU-style rows: question, the choices, the right choice as a letter (A, B, ...);
             an optional header row (its first field "question") is skipped.
  continuation  JSONL of documents ({"text": ...}): does the model know how a text of the corpus
             goes on? Each document long enough gives an item: its first --context_chars characters,
             then the next --ending_chars as the right ending against the same characters of 3 other
             documents (chosen with --seed), joined with no space: a raw continuation, which even a
             small byte-level model can score. Made for held-out documents of your own corpus.
Every item becomes a context and its candidate endings, scored as a cloze (the summed
log-likelihood of each ending's text given the context): hellaswag "<context>" + " <ending>";
belebele "<passage>\nQuestion: <question>\nAnswer:" + " <answer>"; csv "Question: <question>\n
Answer:" + " <choice>". The context starts with <|endoftext|>, as every document of the shards.

--tokenizer: the run's tokenizer. Default: bytes (token b is byte b, EOT 256, as prepare_text.py's
default); or the tokenizer.json that prepare_text.py --tokenizer bpe wrote next to the shards
(needs `tokenizers`: `make tools`, then .venv-tools/bin/python).

Output (little-endian; llmc/io/mc_file.h reads it, docs/FORMATS.md): a 64-byte header { b"LLMCMCQA",
uint32 version 1, uint32 n_items, uint32 vocab_size, uint32 eot, zero padding }, then per item
uint32 label, uint32 n_endings, uint32 context_len, its tokens, and per ending uint32 len and its
tokens (uint32 each). A bad line is refused with its number; nothing is written then.
"""
import argparse
import csv
import json
import os
import struct
import sys

MAGIC = b"LLMCMCQA"
MAX_ENDINGS = 16


def fail(msg):
    sys.exit(f"prepare_mc.py: {msg}")


class ByteTokenizer:
    vocab_size, eot = 257, 256

    def encode(self, text):
        return list(text.encode("utf-8"))


class BpeTokenizer:
    def __init__(self, path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            fail("--tokenizer FILE.json needs Hugging Face tokenizers: run `make tools` once, then this script with "
                 ".venv-tools/bin/python")
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises its own exception types
            fail(f"--tokenizer {path}: not a tokenizers tokenizer.json ({e})")
        self.vocab_size = self.tok.get_vocab_size()
        self.eot = self.tok.token_to_id("<|endoftext|>")
        if self.eot is None:
            fail(f"--tokenizer {path}: has no <|endoftext|> token (prepare_text.py's tokenizers have it)")

    def encode(self, text):
        return self.tok.encode(text).ids


def hellaswag_item(rec):
    if "ctx_a" in rec and "ctx_b" in rec:
        ctx = rec["ctx_a"] + " " + rec["ctx_b"][:1].upper() + rec["ctx_b"][1:]
    else:
        ctx = rec["ctx"]
    if rec.get("activity_label"):
        ctx = rec["activity_label"] + ": " + ctx
    return ctx.strip(), [" " + str(e).strip() for e in rec["endings"]], int(rec["label"])


def belebele_item(rec):
    answers = [rec[f"mc_answer{k}"] for k in range(1, 5)]
    ctx = rec["flores_passage"].strip() + "\nQuestion: " + rec["question"].strip() + "\nAnswer:"
    return ctx, [" " + str(a).strip() for a in answers], int(rec["correct_answer_num"]) - 1


def continuation_items(records, context_chars, ending_chars, seed):
    """(line number, context, endings, label): a document's start and its own next characters, against
    the same characters of 3 other documents."""
    import random
    cut, end = context_chars, context_chars + ending_chars
    docs = [(n, t) for n, t in records if len(t) >= end and t[cut:end].strip()]
    if len(docs) < 4:
        fail(f"continuation: {len(docs)} documents of at least {end} characters, need 4 or more")
    rng = random.Random(seed)
    items = []
    for k, (n, text) in enumerate(docs):
        others = rng.sample([j for j in range(len(docs)) if j != k], 3)
        endings = [docs[j][1][cut:end] for j in others]
        label = rng.randrange(4)
        endings.insert(label, text[cut:end])
        items.append((n, text[:cut], endings, label))
    return items


def read_items(path, fmt, args):
    """(line number, context, endings, label) of each item, each checked."""
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        fail(f"{path}: cannot read ({e.strerror})")
    except UnicodeDecodeError as e:
        fail(f"{path}: not UTF-8 text ({e})")
    items = []
    if fmt is None:
        first = text.lstrip()[:1]
        if first == "{":
            head = json.loads(text.lstrip().splitlines()[0]) if text.strip() else {}
            fmt = "belebele" if "flores_passage" in head else "continuation" if "text" in head else "hellaswag"
        else:
            fmt = "csv"
    if fmt == "csv":
        rows = list(csv.reader(text.splitlines()))
        for n, row in enumerate(rows, 1):
            if not row or (n == 1 and row[0].strip().lower() == "question"):
                continue
            if len(row) < 4:
                fail(f"{path}:{n}: expected question, at least 2 choices and the answer letter, got {len(row)} fields")
            letter = row[-1].strip().upper()
            choices = row[1:-1]
            if len(letter) != 1 or not "A" <= letter < chr(ord("A") + len(choices)):
                fail(f"{path}:{n}: the answer '{row[-1]}' is not one of the letters A..{chr(ord('A') + len(choices) - 1)}")
            items.append((n, "Question: " + row[0].strip() + "\nAnswer:", [" " + c.strip() for c in choices],
                          ord(letter) - ord("A")))
        return items, fmt
    make = {"hellaswag": hellaswag_item, "belebele": belebele_item, "continuation": lambda rec: (str(rec["text"]),)}[fmt]
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
            items.append((n, *make(rec)))
        except (ValueError, KeyError, TypeError) as e:
            what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            fail(f"{path}:{n}: not a {fmt} item ({what})")
    if fmt == "continuation":
        items = continuation_items(items, args.context_chars, args.ending_chars, args.seed)
    return items, fmt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input")
    ap.add_argument("out")
    ap.add_argument("--format", choices=["hellaswag", "belebele", "csv", "continuation"],
                    help="default: guessed from the file")
    ap.add_argument("--context_chars", type=int, default=48, help="continuation: the context's characters")
    ap.add_argument("--ending_chars", type=int, default=24, help="continuation: each ending's characters")
    ap.add_argument("--seed", type=int, default=1, help="continuation: the choice of the other documents")
    ap.add_argument("--tokenizer", help="tokenizer.json of the run (default: bytes)")
    ap.add_argument("--limit", type=int, default=0, help="keep the first N items (0: all)")
    args = ap.parse_args()
    tok = BpeTokenizer(args.tokenizer) if args.tokenizer else ByteTokenizer()
    if args.context_chars < 1 or args.ending_chars < 1:
        fail("--context_chars and --ending_chars must be >= 1")
    items, fmt = read_items(args.input, args.format, args)
    if args.limit > 0:
        items = items[:args.limit]
    if not items:
        fail(f"{args.input}: no items")
    out = [MAGIC + struct.pack("<IIII", 1, len(items), tok.vocab_size, tok.eot).ljust(56, b"\0")]
    n_tokens = 0
    for n, ctx, endings, label in items:
        if not 2 <= len(endings) <= MAX_ENDINGS:
            fail(f"{args.input}:{n}: {len(endings)} endings, expected 2..{MAX_ENDINGS}")
        if not 0 <= label < len(endings):
            fail(f"{args.input}:{n}: label {label} but {len(endings)} endings")
        if any(not e.strip() for e in endings):
            fail(f"{args.input}:{n}: an empty ending")
        context = [tok.eot] + tok.encode(ctx)
        ends = [tok.encode(e) for e in endings]
        out.append(struct.pack("<III", label, len(ends), len(context)) + struct.pack(f"<{len(context)}I", *context))
        for e in ends:
            out.append(struct.pack("<I", len(e)) + struct.pack(f"<{len(e)}I", *e))
        n_tokens += len(context) + sum(len(e) for e in ends)
    tmp = args.out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(b"".join(out))
    os.replace(tmp, args.out)
    print(f"prepare_mc.py: {len(items)} {fmt} items, {n_tokens} tokens -> {args.out}")


if __name__ == "__main__":
    main()
