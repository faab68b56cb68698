#!/usr/bin/env python3
"""Draws one optimizer step of a pipeline-parallel run as a timeline.

    python scripts/plot_pipeline.py TRACE.jsonl OUT.png [--title TEXT] [--all_ranks]

TRACE.jsonl is what the trainer writes with --pp_trace FILE: one JSON object per line and per
executed event, {"rank", "stage", "dp", "op": "F"|"B"|"W"|"send"|"recv", "mb", "chunk",
"t0_ms", "t1_ms"}, times relative to the step's start on that rank. One row per pipeline stage
(the ranks of data-parallel rank 0), or one row per rank with --all_ranks. F, B and W bars in
their own colours, a lighter shade for each later model chunk, the micro-batch number inside
when the bar is wide enough; time waiting in a receive is drawn hatched grey (idle); sends as thin
ticks under the row. Needs matplotlib only (scripts/requirements-plot.txt).
"""
import sys

from matplotlib.colors import to_rgb
from matplotlib.patches import Patch
from trace_plot import arg_parser, load, plt

COLOURS = {"F": "#1f77b4", "B": "#2ca02c", "W": "#9467bd"}
RECV = "#b0b0b0"
DPI = 120
KEYS = ("rank", "stage", "dp", "op", "mb", "chunk", "t0_ms", "t1_ms")
OPS = ("F", "B", "W", "send", "recv", "link", "wait")


def shade(colour, chunk, n_chunks):
    """Chunk 0 in the full colour, later chunks mixed towards white."""
    if n_chunks <= 1:
        return colour
    mix = 0.55 * chunk / (n_chunks - 1)
    return tuple(c + (1 - c) * mix for c in to_rgb(colour))


def main():
    ap = arg_parser(__doc__, "title, e.g. the schedule: '1f1b, pp=4, 8 micro-batches'")
    ap.add_argument("--all_ranks", action="store_true", help="one row per rank instead of the stages of dp rank 0")
    args = ap.parse_args()

    # the collectives' lines (link, wait) are scripts/plot_timeline.py's
    events = [e for e in load(args.trace, KEYS, OPS, "pipeline trace event") if e["op"] not in ("link", "wait")]
    if not events:
        sys.exit("%s: no events" % args.trace)
    if not args.all_ranks:
        events = [e for e in events if e["dp"] == 0]
        if not events:
            sys.exit("%s: no events of dp rank 0 (use --all_ranks)" % args.trace)
    key = (lambda e: e["rank"]) if args.all_ranks else (lambda e: e["stage"])
    rows = sorted({key(e) for e in events})
    row_of = {r: i for i, r in enumerate(rows)}
    labels = {}
    for e in events:
        labels[key(e)] = ("rank %d (stage %d, dp %d)" % (e["rank"], e["stage"], e["dp"]) if args.all_ranks
                          else "stage %d" % e["stage"])
    n_chunks = max(e["chunk"] for e in events) + 1
    end = max(e["t1_ms"] for e in events)
    start = min(e["t0_ms"] for e in events)
    span = max(end - start, 1e-9)

    width_in, height_in = min(24, 8 + 0.12 * len(events) / len(rows)), 1.2 + 0.55 * len(rows)
    fig, ax = plt.subplots(figsize=(width_in, height_in))
    px_per_ms = 0.8 * width_in * DPI / (span * 1.07)  # about: the axes take ~80% of the width
    busy = {r: 0.0 for r in rows}
    for e in events:
        y, t0, w = row_of[key(e)], e["t0_ms"], e["t1_ms"] - e["t0_ms"]
        op = e["op"]
        if op in COLOURS:
            busy[key(e)] += w
            ax.barh(y, w, left=t0, height=0.8, color=shade(COLOURS[op], e["chunk"], n_chunks),
                    edgecolor="white", linewidth=0.5)
            label = str(e["mb"])
            if w * px_per_ms >= 7 * len(label) + 4:  # ~7 px a digit at 7 pt
                light = n_chunks > 1 and e["chunk"] > (n_chunks - 1) / 2
                ax.text(t0 + w / 2, y, label, ha="center", va="center", fontsize=7, color="black" if light else "white")
        elif op == "recv" and w > 0:
            ax.barh(y, w, left=t0, height=0.8, color="none", edgecolor=RECV, hatch="////", linewidth=0)
        elif op == "send":
            ax.plot([t0, t0], [y + 0.42, y + 0.5], color="black", linewidth=0.6)

    # idle fraction of the step per row (the step ends when the last row ends)
    for r in rows:
        ax.text(end + span * 0.005, row_of[r], "%.0f%% idle" % (100 * (1 - busy[r] / (end - start))),
                va="center", fontsize=7, color="#555555")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([labels[r] for r in rows])
    ax.set_ylim(len(rows) - 0.4, -0.6)  # row 0 on top
    ax.set_xlim(start, end + span * 0.07)
    ax.set_xlabel("time (ms)")
    total_busy = sum(busy.values())
    bubble = 1 - total_busy / ((end - start) * len(rows))
    ax.set_title("%s  (step %.3g ms, bubble %.1f%%)" % (args.title or args.trace, end - start, 100 * bubble))
    handles = [Patch(color=COLOURS[o], label=n) for o, n in
               (("F", "F forward"), ("B", "B backward (input grad)"), ("W", "W weight grad"))]
    handles.append(Patch(facecolor="none", edgecolor=RECV, hatch="////", label="waiting in recv"))
    if n_chunks > 1:
        handles.append(Patch(color=shade("#555555", n_chunks - 1, n_chunks), label="lighter: later chunk"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.35 / height_in, 1, 1))  # room for the legend under the axis
    fig.savefig(args.out, dpi=DPI)


if __name__ == "__main__":
    main()
