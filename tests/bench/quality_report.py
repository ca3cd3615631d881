#!/usr/bin/env python3
"""quality_report.py - the quality benchmark's verdict: reads the CSVs that
bench_quality wrote (one per optimizer) and its printed table, checks the
targets of the training issue against dense AdamS measured in the same run,
appends the rows to docs/benchmarks.md and writes the plot.

usage: quality_report.py --dir DIR --table DIR/out.txt --svg docs/img/quality.svg
                         [--markdown docs/benchmarks.md] [--command CMD]"""
import argparse
import datetime
import os
import platform
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "client", "examples"))
import scape_plot  # noqa: E402

ORDER = ["adamw", "adams", "scape-0.1", "scape-0.01", "topk-adamw-0.01", "scape-0.1-bf16",
         "scape-0.01-bf16", "scape-0.01-delta", "scape-0.01-sched", "scape-0.01-sched-slow",
         "scape-0.01-sched-long", "scape-0.01-bf16p", "adams-bf16p"]


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def median(xs):
    s = sorted(xs)
    return s[len(s) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--table", required=True, help="bench_quality's stdout")
    ap.add_argument("--svg", required=True)
    ap.add_argument("--markdown")
    ap.add_argument("--command", default="tests/bench/quality.sh")
    a = ap.parse_args()

    table = open(a.table).read().splitlines()
    header = table[0]
    rows = {}
    for line in table[2:]:
        f = line.split()
        if len(f) == 6:
            rows[f[0]] = {"val": float(f[1]), "train": float(f[2]), "bytes": float(f[3]),
                          "wall": float(f[5])}
    logs = {n: scape_plot.read_log(os.path.join(a.dir, "quality-%s.csv" % n))
            for n in ORDER if os.path.exists(os.path.join(a.dir, "quality-%s.csv" % n))}
    for n, log in logs.items():
        rows[n]["median_bytes"] = median(log["bytes"])
        rows[n]["mean_bytes"] = sum(log["bytes"]) / len(log["bytes"])
        # the mask all-gather's share of the median step (runs that logged it)
        m = [x for x in log.get("mask_bytes", []) if x == x]
        rows[n]["mask_share"] = median(m) / rows[n]["median_bytes"] if m else None
    if "adams" not in rows:
        sys.exit("quality_report: the run has no adams row to compare with")
    dense = rows["adams"]["median_bytes"]
    # (what, the row the loss is held against, loss margin, bytes share,
    # whether the share is of the mean (else the median) bytes per step)
    targets = {
        "scape-0.1": ("val <= adams + 0.01, bytes <= 15% of dense", "adams", 0.01, 0.15, 0),
        "scape-0.01": ("val <= adams + 0.04, bytes <= 3% of dense", "adams", 0.04, 0.03, 0),
        "scape-0.1-bf16": ("val <= scape-0.1 (f32 values) + 0.01", "scape-0.1", 0.01, 1.0, 0),
        "scape-0.01-bf16": ("val <= scape-0.01 (f32 values) + 0.01", "scape-0.01", 0.01, 1.0,
                            0),
        "scape-0.01-delta": ("bytes <= 0.6% of dense, mask included", "scape-0.01", 0.01,
                             0.006, 0),
        "scape-0.01-sched": ("mean bytes <= 2% of dense, val <= adams + 0.15", "adams", 0.15,
                             0.02, 1),
        "scape-0.01-sched-slow": ("mean bytes <= 2% of dense, val <= adams + 0.15", "adams",
                                  0.15, 0.02, 1),
        "scape-0.01-sched-long": ("mean bytes <= 2% of dense, val <= adams + 0.15", "adams",
                                  0.15, 0.02, 1),
    }
    lines = []
    for n in ORDER:
        if n not in rows:
            continue
        r = rows[n]
        share = r["median_bytes"] / dense
        verdict = ""
        if n in targets and targets[n][1] in rows:
            what, against, dv, db, of_mean = targets[n]
            ok_v = r["val"] <= rows[against]["val"] + dv
            ok_b = (r["mean_bytes"] if of_mean else r["median_bytes"]) / dense <= db
            verdict = "%s: loss %s, bytes %s" % (what, "met" if ok_v else "NOT met",
                                                  "met" if ok_b else "NOT met")
        mask = "-" if r.get("mask_share") is None else "%.0f%%" % (100 * r["mask_share"])
        lines.append("| %s | %.4f | %+.4f | %.4f | %.0f | %.2f%% | %.0f | %.2f%% | %s | %.0f | "
                     "%s |" % (n, r["val"], r["val"] - rows["adams"]["val"], r["train"],
                               r["median_bytes"], 100 * share, r["mean_bytes"],
                               100 * r["mean_bytes"] / dense, mask, r["wall"], verdict))
    print("\n".join(lines))

    loss, sent = [], []
    for i, n in enumerate(ORDER):
        if n not in logs:
            continue
        log = logs[n]
        loss.append((n, scape_plot.finite(log["step"], log["val_loss"]), False))
        sent.append((n, scape_plot.finite(log["step"], log["bytes"]), n.startswith("adam")))
    scape_plot.write_svg(a.svg, [
        scape_plot.panel("Validation loss", "step", "cross-entropy (nats)", loss),
        scape_plot.panel("Bytes sent per step (rank 0)", "step", "collective payload", sent,
                         log=True),
    ])
    print("plot: %s" % a.svg)

    if a.markdown:
        today = datetime.date.today().isoformat()
        with open(a.markdown, "a") as f:
            f.write("\n### Quality: %s, %s (%d cores)\n\n" % (today, cpu_model(),
                                                            os.cpu_count() or 0))
            f.write("Command: `%s`. %s\n\n" % (a.command, header.replace("bench_quality: ", "")))
            f.write("| optimizer | final val loss | vs adams | train loss (last 100) | "
                    "bytes/step (median) | of adams | bytes/step (mean) | of adams | mask share | "
                    "wall s | target |\n")
            f.write("|---|---|---|---|---|---|---|---|---|---|---|\n")
            f.write("\n".join(lines) + "\n\n")
            f.write("Plot: [%s](%s).\n" % (os.path.basename(a.svg),
                                           os.path.relpath(a.svg, os.path.dirname(a.markdown))))
        print("rows appended to %s" % a.markdown)


if __name__ == "__main__":
    main()
