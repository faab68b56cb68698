"""What scripts/plot_pipeline.py and scripts/plot_timeline.py share: reading a --pp_trace file (one
JSON object a line and per executed event, times in ms from the step's start on that rank), their
command line (TRACE.jsonl OUT.png [--title TEXT]) and matplotlib without a display. Needs matplotlib
only (scripts/requirements-plot.txt).
"""
import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402,F401  (the scripts draw with this one, display-less)


def load(path, keys, ops=None, what="trace event"):
    """The events of the trace at path, in file order; exits naming the file and line of the first
    line that is not a JSON object with every key of keys (and, with ops, an op among them)."""
    events = []
    try:
        f = open(path)
    except OSError as err:
        sys.exit("%s: cannot read the trace (%s)" % (path, err.strerror))
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                e = json.loads(line)
                if not isinstance(e, dict):
                    raise ValueError("not an object")
                missing = [k for k in keys if k not in e]
                if missing:
                    raise ValueError("missing " + ", ".join(missing))
                if ops is not None and e["op"] not in ops:
                    raise ValueError("unknown op %r" % e["op"])
            except ValueError as err:
                sys.exit("%s:%d: not a %s (%s)" % (path, n, what, err))
            events.append(e)
    return events


def arg_parser(doc, title_help=None):
    """TRACE.jsonl OUT.png [--title TEXT]; the description is the first line of doc."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--title", default=None, help=title_help)
    return ap
