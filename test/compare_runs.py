#!/usr/bin/env python3
"""Compares the logged losses and gradient norms of two runs (their log.jsonl): the layouts that are
not bitwise one process (docs/PARALLELISM.md) are held to a relative tolerance on every record.

  compare_runs.py REF_DIR OUT_DIR [--rtol 1e-6] [--last N] [--min_steps 8]

Every record of OUT with a loss, val_loss or grad_norm must have the same step and keys in REF and
|out - ref| <= rtol * max(|ref|, |out|); --last N compares only the last N records of each (a
resumed run's), --min_steps the fewest training records (with a grad_norm) compared. Prints the
largest relative difference; exit 1 if over the tolerance or the records differ in number or kind.
"""
import argparse
import json
import math
import os
import sys

KEYS = ("loss", "val_loss", "grad_norm")


def records(run_dir):
    out = []
    with open(os.path.join(run_dir, "log.jsonl")) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            r = json.loads(line)
            if "step" in r and any(k in r for k in KEYS):
                out.append((r["step"], {k: float(r[k]) for k in KEYS if k in r}))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ref")
    ap.add_argument("out")
    ap.add_argument("--rtol", type=float, default=1e-6)
    ap.add_argument("--last", type=int, default=0)
    ap.add_argument("--min_steps", type=int, default=8)
    a = ap.parse_args()
    ref, out = records(a.ref), records(a.out)
    if a.last:
        ref, out = ref[-a.last:], out[-a.last:]
    if len(ref) != len(out):
        print(f"compare_runs: {len(ref)} records in {a.ref}, {len(out)} in {a.out}")
        return 1
    worst, where, steps = 0.0, "", 0
    for (s0, r0), (s1, r1) in zip(ref, out):
        if s0 != s1 or set(r0) != set(r1):
            print(f"compare_runs: record of step {s0} {sorted(r0)} vs step {s1} {sorted(r1)}")
            return 1
        steps += "grad_norm" in r0
        for k in r0:
            x, y = r0[k], r1[k]
            if not (math.isfinite(x) and math.isfinite(y)):
                print(f"compare_runs: step {s0} {k}: {x} vs {y}")
                return 1
            d = abs(x - y) / max(abs(x), abs(y), 1e-30)
            if d > worst:
                worst, where = d, f"step {s0} {k}: {x!r} vs {y!r}"
    if steps < a.min_steps:
        print(f"compare_runs: {steps} training records compared, at least {a.min_steps} wanted")
        return 1
    print(f"compare_runs: {steps} steps, largest relative difference {worst:.3g}" + (f" ({where})" if where else ""))
    return 0 if worst <= a.rtol else 1


if __name__ == "__main__":
    sys.exit(main())
