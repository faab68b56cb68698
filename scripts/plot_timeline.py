#!/usr/bin/env python3
"""Draws compute against communication for one optimizer step, per rank.

    python scripts/plot_timeline.py TRACE.jsonl OUT.png [--title TEXT]

TRACE.jsonl is what the trainer writes with --pp_trace FILE (any layout; pp 1 too): the executed F,
B and W computations, and for each buffer collective or transfer up to the gradient norm a "link"
line (from its start to its end: the simulated link's with --sim_link, else MPI's completion) and
a "wait" line (the rank blocked in its finish). Two rows per rank: compute (F, B, W bars; time
blocked in a wait hatched grey on top) and the link (each operation in flight, coloured by kind).
Communication that runs under a compute bar without a grey hatch over it is hidden. Needs
matplotlib only (scripts/requirements-plot.txt).
"""
import sys

from matplotlib.patches import Patch
from trace_plot import arg_parser, load, plt

COMPUTE = {"F": "#1f77b4", "B": "#2ca02c", "W": "#9467bd"}
LINK = {"all_gather": "#ff7f0e", "all_to_all": "#d62728", "send/recv": "#8c564b", "broadcast": "#e377c2"}
WAIT = "#808080"


def main():
    args = arg_parser(__doc__).parse_args()
    events = load(args.trace, ("rank", "op", "t0_ms", "t1_ms"))
    if not any(e["op"] == "link" for e in events):
        sys.exit("%s: no collectives in the trace (a one-rank run, or a trainer without the comm lines)" % args.trace)
    ranks = sorted({e["rank"] for e in events})
    end = max(e["t1_ms"] for e in events)
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.75 * len(ranks)), dpi=100)
    labels, ticks = [], []
    for i, r in enumerate(ranks):
        y_c, y_l = 2 * i * 1.3 + 1, 2 * i * 1.3  # compute row above, link row below
        mine = [e for e in events if e["rank"] == r]
        for e in mine:
            w = max(e["t1_ms"] - e["t0_ms"], 0.0)
            if e["op"] in COMPUTE:
                ax.barh(y_c, w, left=e["t0_ms"], height=0.8, color=COMPUTE[e["op"]], edgecolor="none")
            elif e["op"] == "wait" and w > 0:
                ax.barh(y_c, w, left=e["t0_ms"], height=0.8, color="none", edgecolor=WAIT, hatch="////",
                        linewidth=0)
            elif e["op"] == "link":
                ax.barh(y_l, max(w, end * 1e-3), left=e["t0_ms"], height=0.7, color=LINK.get(e["comm"], "#7f7f7f"),
                        alpha=0.85, edgecolor="white", linewidth=0.3)
        ticks += [y_c, y_l]
        labels += ["rank %d compute" % r, "rank %d link" % r]
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("ms from the step's start")
    present = {e.get("comm") for e in events if e["op"] == "link"}
    handles = [Patch(color=c, label=k) for k, c in COMPUTE.items() if any(e["op"] == k for e in events)]
    handles += [Patch(color=c, label=k) for k, c in LINK.items() if k in present]
    handles.append(Patch(facecolor="none", edgecolor=WAIT, hatch="////", label="blocked in a wait"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.45 if len(ranks) < 3 else -0.15),
              ncol=len(handles), fontsize=8, frameon=False)
    ax.set_title(args.title or "compute vs communication, one step", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out)
    print("wrote %s" % args.out)


if __name__ == "__main__":
    main()
