#!/usr/bin/env python3
"""calibrate_link.py - the link rate at which dense AdamS spends a given share
of its step communicating, from a short dense run over loopback.

usage: calibrate_link.py PROBE.csv [--share 0.82] [--skip 5]

PROBE.csv is gpt_train's --log of dense AdamS over loopback (no rate
limit): per step the wall time (wall_s), the time inside scape_step
(step_ms) and what the daemon sent over its links (wire_bytes).  Compute
is a step's wall time less its time in scape_step (median over the steps
after --skip); the link rate is the one at which sending wire_bytes takes
share / (1 - share) of that compute, so that communication is `share` of
the step.  0.82 is the SCAPE paper's dense AdamS at 64 GPUs (17.58%
strong-scaling efficiency: about 82% of its step communicating).  Prints
the derivation in one line on stderr and the rate in tc's units (kbit) on
stdout."""
import argparse
import csv
import sys


def median(xs):
    s = sorted(xs)
    return s[len(s) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("probe")
    ap.add_argument("--share", type=float, default=0.82)
    ap.add_argument("--skip", type=int, default=5)
    a = ap.parse_args()
    if not 0.0 < a.share < 1.0:
        sys.exit("calibrate_link: --share must be in (0, 1)")
    with open(a.probe) as f:
        rows = list(csv.DictReader(f))
    if len(rows) < a.skip + 3:
        sys.exit("calibrate_link: %s has %d steps, need more than %d" % (a.probe, len(rows),
                                                                          a.skip + 2))
    wall = [float(r["wall_s"]) for r in rows]
    compute = [wall[i] - wall[i - 1] - 1e-3 * float(rows[i]["step_ms"])
               for i in range(a.skip, len(rows))]
    sent = median([int(r["wire_bytes"]) for r in rows[a.skip:]])
    c = median(compute)
    if c <= 0.0 or sent <= 0:
        sys.exit("calibrate_link: cannot calibrate from compute %.6f s and %d bytes a step"
                 % (c, sent))
    comm = c * a.share / (1.0 - a.share)
    kbit = max(1, int(round(8.0 * sent / comm / 1e3)))
    print("calibrated link: dense AdamS computes %.1f ms a step and each daemon sends %.0f KiB "
          "a step; to spend %.0f%% of its step communicating (the SCAPE paper's dense AdamS at "
          "64 GPUs) that takes %.1f ms: 8 x %d B / %.1f ms = %.2f Mbit/s"
          % (1e3 * c, sent / 1024.0, 100.0 * a.share, 1e3 * comm, sent, 1e3 * comm,
             kbit / 1e3), file=sys.stderr)
    print("%dkbit" % kbit)


if __name__ == "__main__":
    main()
