#!/usr/bin/env python3
"""How much of the communication the CPU build hides behind compute: step time with a simulated
link (--sim_link) over step time without, np 2, one OpenMP thread per rank, a small model.

For each layout the link is chosen so that its communication, not overlapped, would take about as
long as the compute it can hide behind (measured without the link, in the run just before each run
with it: the machine's load moves step times, and a link sized at another moment would not match):
  -z 0 / -z 1   the last micro-batch's backward: step / accumulation x 2/3 (backward = 2 forwards)
  -z 3          the segment computations the gathers and reductions overlap: the whole step
  --pp 2 1f1b   the micro-batch between two transfers: one stage's forward of a micro-batch,
                step x (1 - bubble) / M / 3
  --tp 2, --ep 2 (one micro-batch) as -z 0 / -z 1: step x 2/3 (their collectives run in the forward
                and the backward; a link that takes 2/3 of the compute, not overlapped, makes the
                step 1.67x)
bandwidth = bytes / that time, where bytes are the step's buffer bytes from the start-up
communication table (rank 0's all_gather + all_to_all, less what only the first step sends; for the
pipeline one activation, B*T*C*4)
and the latency (--latency_us) is small beside it. A ratio of 1 means the link's time is hidden.

Step times: the median over the steps after --warmup, per run; runs alternate without / with the
link, --repeats times; the table shows the medians (of the hidden time and the link too) and the
ratios' spread (min-max over the repeats). On a machine shared with other work a run's compute is 5-10% faster or slower than the run's before
it, as much as the link costs, so the step ratio of one repeat is that noisy. The "exposed"
column is steadier: the time the link adds to the waits of the run's last step (--pp_trace), on
the rank that waited least (the slowest one, whose waits are the link's alone: the others also
wait for it), over the step time without the link, plus 1: a ratio without the compute's drift.
The machine's load average is printed (before, after, and the 1-minute figure as each case
ends). A benchmark, not a test: nothing is asserted.

  python3 scripts/bench_overlap.py [--bin ./train_gpt_cpu] [--repeats 3] [--steps 14] [--only z0_a1,pp2_1f1b]
"""
import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, T, C = 4, 64, 128
MODEL = ["--n_layer", "4", "--n_embd", str(C), "--n_head", "4", "-b", str(B), "-t", str(T)]
# the MoE case: every block's FFN is 4 experts (capacity factor 1: each takes B*T/4 tokens)
MOE = ["--n_expert", "4", "--moe_every", "1", "--expert_hidden", "256", "--capacity_factor", "1"]
# name, ranks, flags, accumulation (micro-batches per data-parallel rank), what the link hides behind
CASES = [
    ("z0_a1", 2, ["-z", "0"], 1, "backward"),
    ("z0_a8", 2, ["-z", "0"], 8, "backward"),
    ("z1_a1", 2, ["-z", "1"], 1, "backward"),
    ("z1_a8", 2, ["-z", "1"], 8, "backward"),
    ("z3_a2", 2, ["-z", "3"], 2, "segments"),
    ("z3_np4_a4", 4, ["-z", "3"], 4, "segments"),
    ("pp2_1f1b", 2, ["--pp", "2", "--pp_schedule", "1f1b"], 8, "microbatch"),
    ("ep2", 2, ["--ep", "2", "-z", "1"] + MOE, 1, "backward"),
    ("tp2", 2, ["--tp", "2"], 1, "backward"),
    ("tp2_sp", 2, ["--tp", "2", "--sp"], 1, "backward"),
]


def flag(flags, name):
    return int(flags[flags.index(name) + 1]) if name in flags else 1


def run(args, bin_path, data, np, flags, acc, link, out):
    dp = np // flag(flags, "--pp") // flag(flags, "--tp")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(np), bin_path,
           "-i", data, "-j", "", "-x", str(args.steps), "-g", "0", "-n", "-1", "-u", "2", "-l", "1e-3",
           "-d", str(B * T * dp * acc), "-o", out, "--overwrite", "--pp_trace", out + ".trace.jsonl"] + MODEL + flags
    if link:
        cmd += ["--sim_link", link]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        sys.exit("bench_overlap: %s failed:\n%s" % (" ".join(cmd), p.stdout[-2000:] + p.stderr[-2000:]))
    ms = [r["ms"] for r in map(json.loads, open(os.path.join(out, "log.jsonl"))) if "ms" in r]
    table = re.search(r"communication per step, rank 0 \(sent bytes\): (.*)", p.stdout)
    sent = {k: int(v) for k, v in re.findall(r"(\w[\w/ ()]*?) (\d+) \(theory", table.group(1))} if table else {}
    # the table is of the first step; -z 3's first step also gathers its own first segments, which
    # a later step (the ones timed) finds gathered
    extra = re.search(r"the first step (\d+) more", p.stdout)
    sent["first_step_extra"] = int(extra.group(1)) if extra else 0
    # the last step's waits per rank (every comm wait the trace holds), the least of them
    events = [json.loads(line) for line in open(out + ".trace.jsonl")]
    waits = {}
    for e in events:
        if e["op"] == "wait":
            waits[e["rank"]] = waits.get(e["rank"], 0.0) + e["t1_ms"] - e["t0_ms"]
    return statistics.median(ms[args.warmup:]), sent, min(waits.values()) if waits else 0.0


def link_for(kind, step_ms, sent, acc, latency_us):
    """the --sim_link value whose communication takes about as long as the compute it hides behind"""
    step_bytes = sent.get("all_gather", 0) + sent.get("all_to_all", 0) - sent.get("first_step_extra", 0)
    if kind == "backward":
        hide_s, nbytes = step_ms / 1e3 / acc * 2 / 3, step_bytes
    elif kind == "segments":
        hide_s, nbytes = step_ms / 1e3, step_bytes
    else:  # one activation between two transfers, 2 stages, 1f1b
        bubble = 1 / (acc + 1)
        hide_s, nbytes = step_ms / 1e3 * (1 - bubble) / acc / 3, B * T * C * 4
    gbit = nbytes * 8 / hide_s / 1e9
    return "%.4g,%g" % (gbit, latency_us), hide_s * 1e3, nbytes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "train_gpt_cpu"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--latency_us", type=float, default=10)
    ap.add_argument("--only", default="", help="comma-separated case names")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench_overlap.")
    try:
        bench(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench(args, work):
    subprocess.run([sys.executable, os.path.join(ROOT, "dev/data/prepare_text.py"), os.path.join(ROOT, "llmc"),
                    "--sep", "blank", "--out_dir", work + "/data", "--val_frac", "0.1"], check=True,
                   capture_output=True)
    data = glob.glob(work + "/data/*train*.bin")[0]
    print("load average before: %s" % open("/proc/loadavg").read().split()[:3])
    print("%-10s %9s %10s %14s %10s %10s %7s %11s %8s %11s %6s" % (
        "case", "hide (ms)", "bytes", "link (Gb/s,us)", "off (ms)", "on (ms)", "ratio", "(min-max)", "exposed",
        "(min-max)", "load"))
    only = set(filter(None, args.only.split(",")))
    for name, np, flags, acc, kind in CASES:
        if only and name not in only:
            continue
        out = os.path.join(work, name)
        # each run with the link is sized from the run without it just before: a step's time moves
        # with the machine's load, and a link sized at another moment would not match its compute
        off, on, ratios, exposed, hides, gbits = [], [], [], [], [], []
        for _ in range(args.repeats):
            a, sent, wait_off = run(args, args.bin, data, np, flags, acc, None, out)
            link, hide_ms, nbytes = link_for(kind, a, sent, acc, args.latency_us)
            b, _, wait_on = run(args, args.bin, data, np, flags, acc, link, out)
            off.append(a)
            on.append(b)
            ratios.append(b / a)
            exposed.append(1 + (wait_on - wait_off) / a)
            hides.append(hide_ms)
            gbits.append(float(link.split(",")[0]))
        hide_ms, link = statistics.median(hides), "%.4g,%g" % (statistics.median(gbits), args.latency_us)
        print("%-10s %9.2f %10d %14s %10.2f %10.2f %7.3f %11s %8.3f %11s %6s" % (
            name, hide_ms, nbytes, link, statistics.median(off), statistics.median(on), statistics.median(ratios),
            "%.2f-%.2f" % (min(ratios), max(ratios)), statistics.median(exposed),
            "%.2f-%.2f" % (min(exposed), max(exposed)), open("/proc/loadavg").read().split()[0]), flush=True)
    print("load average after: %s" % open("/proc/loadavg").read().split()[:3])


if __name__ == "__main__":
    main()
