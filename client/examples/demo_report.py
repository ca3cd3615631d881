#!/usr/bin/env python3
"""demo_report.py - the demo's closing table and plot, from the CSV logs the
reporting trainer of each run wrote (client/examples/gpt_train.c --log).

usage: demo_report.py --svg OUT.svg [--link TEXT] NAME=LOG.csv [NAME=LOG.csv ...]
The first run is compared with the last (the dense baseline).  Besides the
bytes, the table gives each run's wall time and when it first reached a
loss level all runs reach (the worst of their final smoothed training
losses): fewer bytes and a faster step on one side, slower learning per
step on the other."""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scape_plot  # noqa: E402


def last_finite(xs):
    for x in reversed(xs):
        if math.isfinite(x):
            return x
    return float("nan")


def median(xs):
    s = sorted(xs)
    return s[len(s) // 2]


def human(b):
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if b >= scale:
            return "%.1f %s" % (b / scale, unit)
    return "%.0f B" % b


SMOOTH = 10  # steps in the training-loss average


def first_reach(log, level):
    """(step, wall s) where the smoothed training loss first is <= level."""
    sm = scape_plot.smooth(log["loss"], SMOOTH)
    for st, w, x in zip(log["step"], log["wall_s"], sm):
        if x <= level:
            return int(st), w
    return None, float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--svg", required=True)
    ap.add_argument("--link", default="", help="what joins the daemons, for the heading")
    ap.add_argument("runs", nargs="+", metavar="NAME=LOG.csv")
    a = ap.parse_args()
    runs = []
    for spec in a.runs:
        name, _, path = spec.rpartition("=")
        runs.append((name, scape_plot.read_log(path)))
    # what one daemon moves per step: the ring model's bytes it receives, about
    # what it sends (the collectives' payload counts every rank's part)
    dense_bytes = median(runs[-1][1]["wire_bytes"])
    level = max(scape_plot.smooth(log["loss"], SMOOTH)[-1] for _, log in runs)

    rows = []
    for name, log in runs:
        steps = len(log["step"])
        tail = log["loss"][-max(1, steps // 10):]
        per_step = median(log["wire_bytes"])
        wall = log["wall_s"][-1]
        at_step, at_wall = first_reach(log, level)
        rows.append((name, int(log["step"][-1]), sum(tail) / len(tail),
                     last_finite(log["val_loss"]), human(per_step),
                     100.0 * per_step / dense_bytes if dense_bytes > 0 else float("nan"),
                     human(sum(log["wire_bytes"])), wall,
                     steps / wall if wall > 0 else float("nan"), at_step, at_wall))
    if a.link:
        print("daemons joined by %s" % a.link)
    head = ("run", "steps", "train loss", "val loss", "sent/step", "of dense", "total sent",
            "wall s", "step/s", "to %.3f" % level)
    fmt = "%-20s %6s %10s %9s %11s %9s %11s %7s %7s %16s"
    print(fmt % head)
    for r in rows:
        reach = "step %d, %.1f s" % (r[9], r[10]) if r[9] is not None else "-"
        print(fmt % (r[0], r[1], "%.4f" % r[2], "%.4f" % r[3], r[4], "%.2f%%" % r[5], r[6],
                     "%.1f" % r[7], "%.1f" % r[8], reach))
    print("train loss: mean of the last 10%% of steps (reporting trainer); val loss: the "
          "validation split at the end;\nsent/step: median bytes one daemon moves per "
          "step over its links (the ring model of its collectives, mask all-gather "
          "included;\nnot the collectives' payload, which counts every daemon's part); "
          "total sent: all steps, dense warm-up included;\nto L: the first step (and "
          "wall time) where the training loss, averaged over %d steps, is at most L, the "
          "worst of the runs' final values." % SMOOTH)

    loss, sent, timed = [], [], []
    for i, (name, log) in enumerate(runs):
        dashed = i == len(runs) - 1
        sm = scape_plot.smooth(log["loss"], 10)
        loss.append((name + " train", scape_plot.finite(log["step"], sm), dashed))
        sent.append((name, scape_plot.finite(log["step"], log["wire_bytes"]), dashed))
        timed.append((name, scape_plot.finite(log["wall_s"], sm), dashed))
    for name, log in runs:
        loss.append((name + " val", scape_plot.finite(log["step"], log["val_loss"]), True))
    scape_plot.write_svg(a.svg, [
        scape_plot.panel("Loss", "step", "cross-entropy (nats)", loss),
        scape_plot.panel("Training loss against wall time", "seconds", "cross-entropy (nats)",
                         timed),
        scape_plot.panel("Bytes per step, one daemon", "step", "ring model of its links",
                         sent, log=True),
    ])
    print("plot: %s" % a.svg)


if __name__ == "__main__":
    main()
