#!/usr/bin/env python3
"""buckets - what bucketed hand-over takes off the step's critical path.

Two daemons (host backend, sharded, SCAPE) with one gpt_train trainer each,
a GPT of about --params coordinates, trained twice in one run on the same
seeds: the whole hand-over (all gradients posted with the step) and
--buckets (each layer's gradients posted as backward makes them, packed by
the daemons while backward goes on).  The figure is the trainer's time
inside scape_step: from the step posted (the last gradients with it) to the
parameters in place, of the trainer that posted last (the shorter of the
two: the other one's includes its wait for that post), median over steps
3..S;
the ratio bucketed / whole is the issue's target (at most 0.25).  Both
runs must end with bitwise equal parameters.  With --link RATE (root) the
daemons run on test hosts (deploy/hosts.sh) joined by links of that rate.
Prints figures; it does not pass or fail on them.

Usage: buckets.py BUILD_DIR [--d 256] [--layers 12] [--steps 12] [--link RATE]
                  [--repeat 1] [--markdown FILE]
"""
import argparse
import csv
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(SOURCE, "tests", "integration"))
from conftest import free_endpoints  # noqa: E402

HOSTS = os.path.join(SOURCE, "deploy", "hosts.sh")
HOSTS_NAME = "bench-b%d" % os.getpid()


def hosts(cmd, *args):
    subprocess.run(["bash", HOSTS, cmd, *args, "--name", HOSTS_NAME], check=True,
                   capture_output=True, timeout=120)


def status(build, rt):
    import json
    res = subprocess.run([os.path.join(build, "client", "scapectl"), "--runtime-dir", rt,
                          "status", "--json"], capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        sys.exit("buckets: scapectl status: %s" % res.stderr.strip())
    return json.loads(res.stdout).get("last") or {}


def run(build, work, tag, corpus, model, link, bucketed):
    if link:
        eps = ["tcp://10.231.0.1:29518", "tcp://10.231.0.1:*", "tcp://10.231.0.2:*"]
    else:
        eps = free_endpoints(3)
    daemons, rts = [], []
    for r in range(2):
        rt = os.path.join(work, "%s-rt%d" % (tag, r))
        rts.append(rt)
        log = open(os.path.join(work, "%s-scaped%d.log" % (tag, r)), "w")
        on = ["ip", "netns", "exec", "%s-h%d" % (HOSTS_NAME, r)] if link else []
        daemons.append(subprocess.Popen(
            on + [os.path.join(build, "daemon", "scaped"), "--runtime-dir", rt,
                  "--log-level", "warn", "--optimizer", "scape", "--rho", "0.01",
                  "--warmup", "1", "--mode", "sharded", "--world", "2", "--rank", str(r),
                  "--coordinator", eps[0], "--listen", eps[r + 1], "--job", "4243",
                  "--trainers", "1", "--comm-timeout-ms", "600000", "--auth", "none"],
                 stdout=log, stderr=log))
    deadline = time.time() + 30
    for rt, d in zip(rts, daemons):
        while not os.path.exists(os.path.join(rt, "control")):
            if d.poll() is not None or time.time() > deadline:
                sys.exit("buckets: scaped did not start (logs in %s)" % work)
            time.sleep(0.02)
    logs = [os.path.join(work, "%s-log%d.csv" % (tag, r)) for r in range(2)]
    outs = [os.path.join(work, "%s-out%d" % (tag, r)) for r in range(2)]
    trainers = [subprocess.Popen(
        [os.path.join(build, "client", "examples", "gpt_train"), "--endpoint",
         "ipc://%s/control" % rts[r], "--corpus", corpus, "--seed", str(1 + 1000 * r),
         *model, "--log", logs[r], "--out", outs[r]] + (["--buckets"] if bucketed else []),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    numel = 0
    for p in trainers:
        out, err = p.communicate(timeout=7200)
        if p.returncode != 0:
            sys.exit("buckets: a trainer failed: %s" % err)
        numel = int(re.search(r"N=(\d+)", out).group(1))
    last = status(build, rts[0])
    for d in daemons:
        d.terminate()
    for d in daemons:
        d.wait(60)
    rows = []
    for path in logs:
        with open(path) as f:
            rows.append([float(r["step_ms"]) for r in csv.DictReader(f)])
    # the trainer that posted last waits only for the step itself; the other
    # one's wait includes the time until that last post
    per_step = [min(rows[r][k] for r in range(2)) for k in range(2, len(rows[0]))]
    params = [open(o, "rb").read() for o in outs]
    phases = last.get("phases_s") or {}
    print("buckets: %s: rank 0's last step: %s" % (tag, ", ".join(
        "%s %.1f ms" % (k, 1e3 * v) for k, v in phases.items()
        if isinstance(v, float) and k != "early_tensors")), file=sys.stderr)
    return {"step_ms": statistics.median(per_step), "params": params, "n": numel,
            "early_pack_ms": 1e3 * (phases.get("early_pack") or 0.0),
            "early_tensors": phases.get("early_tensors") or 0,
            "pack_ms": 1e3 * (phases.get("pack") or 0.0)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=1, help="rounds of (whole, bucketed)")
    ap.add_argument("--link", help="run the daemons on test hosts with links of this rate")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    if a.steps < 4:
        sys.exit("buckets: --steps must be at least 4 (steps 3.. are measured)")
    work = tempfile.mkdtemp(prefix="scape-bench-buckets-")
    corpus = os.path.join(work, "fortunes.txt")
    subprocess.run(["bash", os.path.join(SOURCE, "client", "examples", "fortunes-corpus.sh"),
                    corpus], check=True, capture_output=True)
    model = ["--d", str(a.d), "--layers", str(a.layers), "--heads", str(a.heads), "--ctx",
             str(a.seq), "--seq", str(a.seq), "--batch", str(a.batch), "--steps",
             str(a.steps), "--lr", "1e-3", "--lr-warmup", "2"]
    if a.link:
        hosts("up", "2", "--rate", a.link)
    res = {False: [], True: []}
    try:
        for k in range(a.repeat):
            for bucketed in (False, True):
                print("buckets: round %d, %s hand-over ..." % (k + 1, "bucketed" if bucketed
                                                                 else "whole"), file=sys.stderr)
                res[bucketed].append(run(a.build, work, "r%d-%d" % (k, bucketed), corpus,
                                         model, a.link, bucketed))
    finally:
        if a.link:
            hosts("down")
    for k in range(a.repeat):
        if res[True][k]["params"] != res[False][k]["params"] or \
                res[True][k]["params"][0] != res[True][k]["params"][1]:
            sys.exit("buckets: bucketed parameters differ from the whole hand-over's")
    whole = statistics.median(r["step_ms"] for r in res[False])
    buck = statistics.median(r["step_ms"] for r in res[True])
    lines = [
        "| hand-over | step posted to parameters ready, ms (median) | ratio to whole | "
        "packed early (last step, rank 0) | early pack ms | pack at the step ms |",
        "|---|---|---|---|---|---|",
        "| whole (all gradients with the step) | %.1f | 1.000 | 0 | - | %.1f |"
        % (whole, statistics.median(r["pack_ms"] for r in res[False])),
        "| bucketed (--buckets: a layer at a time) | %.1f | %.3f | %d tensors | %.1f | %.1f |"
        % (buck, buck / whole, res[True][-1]["early_tensors"],
           statistics.median(r["early_pack_ms"] for r in res[True]),
           statistics.median(r["pack_ms"] for r in res[True])),
    ]
    print("2 daemons (host backend, sharded, scape rho 0.01), 1 gpt_train each, N = %d "
          "(d %d, %d layers), batch %d x %d, %s, steps 3..%d, %d round(s)"
          % (res[True][0]["n"], a.d, a.layers, a.batch, a.seq, "test hosts, links of %s" % a.link if a.link
             else "127.0.0.1", a.steps, a.repeat))
    print("\n".join(lines))
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
