#!/usr/bin/env python3
"""Plot training runs from their log.jsonl (llmc/io/logger.h): one PNG with train and val loss
against steps and against tokens, the learning rate, throughput (tok/s) and, where the run
logged it (GPU), MFU. Several runs go on one figure, one colour each.

    python scripts/plot.py out/run_a [out/run_b ...] [-o runs.png] [--title TEXT] [--smooth 0.9] [--per byte]

Each argument is an out_dir (its log.jsonl is read) or a .jsonl file. The default output is
plot.png inside the first out_dir. The train loss is drawn raw (faint) and smoothed (an
exponential moving average, --smooth 0 turns it off); skipped steps (non-finite, null in the log)
leave gaps. Logs written before the "tokens" field existed are plotted against steps only.

--per token (default) plots cross-entropy in nats per token; --per byte in bits per byte of text,
the scale on which runs with different tokenizers (bytes, a BPE) compare: the val points are the
run's own bits per byte (val_bpb), the train curve is converted with the val set's bytes per token
(val_bytes_per_token: the same corpus, not the train batches' exact bytes).
"""
import argparse
import json
import math
import os
import sys


def read_log(path):
    """step -> record, for the training steps and the evaluations (the last record of a step wins:
    a resumed run's log is trimmed to its checkpoint, so duplicates only come from hand-made logs)."""
    steps, evals = {}, {}
    try:
        lines = open(path).read().splitlines()
    except OSError as e:
        sys.exit(f"plot.py: {path}: cannot read ({e.strerror})")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if n == len(lines):  # a run killed mid-write leaves a torn last line
                continue
            sys.exit(f"plot.py: {path}:{n}: not a JSON object: {line[:80]}")
        if "val_loss" in rec:
            evals[rec["step"]] = rec
        elif "loss" in rec:
            steps[rec["step"]] = rec
    if not steps and not evals:
        sys.exit(f"plot.py: {path}: no training records (is it a train_gpt log.jsonl?)")
    return [steps[k] for k in sorted(steps)], [evals[k] for k in sorted(evals)]


def column(records, key):
    return [r.get(key) if r.get(key) is not None else float("nan") for r in records]


def ema(values, beta):
    out, avg, n = [], 0.0, 0
    for v in values:
        if v == v:  # skip NaN
            n += 1
            avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** n) if n else float("nan"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="out_dir(s) holding log.jsonl, or .jsonl files")
    ap.add_argument("-o", "--out", help="PNG to write (default: <first out_dir>/plot.png)")
    ap.add_argument("--title", default=None)
    ap.add_argument("--smooth", type=float, default=0.9, help="EMA factor for the train loss (0: none)")
    ap.add_argument("--per", choices=["token", "byte"], default="token",
                    help="loss in nats per token, or bits per byte of text (comparable across tokenizers)")
    args = ap.parse_args()
    if not 0 <= args.smooth < 1:
        sys.exit(f"plot.py: --smooth must be in [0, 1), got {args.smooth}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot.py: needs matplotlib: pip install -r scripts/requirements-tools.txt")

    runs = []
    for r in args.runs:
        path = r if r.endswith(".jsonl") else os.path.join(r, "log.jsonl")
        name = os.path.basename(os.path.normpath(os.path.dirname(path) if r.endswith(".jsonl") else r)) or path
        steps, evals = read_log(path)
        if args.per == "byte":
            ratio = [e["val_bytes_per_token"] for e in evals if e.get("val_bytes_per_token") is not None]
            if not ratio:
                sys.exit(f"plot.py: {path}: no val_bpb in the log (--per byte needs a run with validation and a "
                         "tokenizer that knows the tokens' text: bytes or tokenizer.bin)")
            per_byte = 1 / (ratio[-1] * math.log(2))  # nats per token -> bits per byte
            steps = [dict(r, loss=r["loss"] * per_byte if r.get("loss") is not None else None) for r in steps]
            evals = [dict(e, val_loss=e.get("val_bpb")) for e in evals]
        runs.append((name, steps, evals))
    out = args.out or os.path.join(args.runs[0] if not args.runs[0].endswith(".jsonl") else
                                   os.path.dirname(args.runs[0]) or ".", "plot.png")

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    (ax_loss, ax_tok, ax_lr), (ax_tps, ax_mfu, ax_norm) = axes
    any_mfu = False
    for k, (name, steps, evals) in enumerate(runs):
        color = f"C{k % 10}"
        x = column(steps, "step")
        loss = column(steps, "loss")
        have_tokens = bool(steps) and all(r.get("tokens") is not None for r in steps)
        tokens = column(steps, "tokens") if have_tokens else None
        smooth = ema(loss, args.smooth) if args.smooth > 0 else loss
        # val records carry no tokens: a step's tokens are the step record's
        tok_of_step = dict(zip(x, tokens)) if have_tokens else {}
        vx, vloss = column(evals, "step"), column(evals, "val_loss")
        for ax, xs, vxs in [(ax_loss, x, vx), (ax_tok, tokens, [tok_of_step.get(s) for s in vx])]:
            if xs is None:
                continue
            if args.smooth > 0:
                ax.plot(xs, loss, color=color, alpha=0.25, lw=0.8)
            ax.plot(xs, smooth, color=color, lw=1.5, label=f"{name} train")
            pts = [(a, b) for a, b in zip(vxs, vloss) if a is not None]
            if pts:
                ax.plot(*zip(*pts), "o--", color=color, ms=4, lw=1, label=f"{name} val")
        ax_lr.plot(x, column(steps, "lr"), color=color, label=name)
        ax_tps.plot(x, column(steps, "tok_s"), color=color, lw=1, label=name)
        ax_norm.plot(x, column(steps, "grad_norm"), color=color, lw=0.8, label=name)
        mfu = column(steps, "mfu")
        if any(v == v for v in mfu):
            any_mfu = True
            ax_mfu.plot(x, [100 * v for v in mfu], color=color, lw=1, label=name)
    unit = "cross-entropy (nats/token)" if args.per == "token" else "bits per byte of text"
    ax_loss.set(title="loss", xlabel="step", ylabel=unit)
    ax_tok.set(title="loss against tokens", xlabel="tokens", ylabel=unit)
    ax_lr.set(title="learning rate", xlabel="step")
    ax_tps.set(title="throughput", xlabel="step", ylabel="tokens/s")
    ax_norm.set(title="gradient norm (before clipping)", xlabel="step")
    ax_mfu.set(title="MFU", xlabel="step", ylabel="% of peak")
    if not any_mfu:
        ax_mfu.text(0.5, 0.5, "no MFU in the log\n(CPU runs have no known peak)", ha="center", va="center",
                    transform=ax_mfu.transAxes, color="gray")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(args.title or ", ".join(name for name, _, _ in runs))
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    print(f"plot.py: wrote {out} ({len(runs)} run{'s' if len(runs) > 1 else ''})")


if __name__ == "__main__":
    main()
