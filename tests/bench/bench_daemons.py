#!/usr/bin/env python3
"""bench_daemons - step time of a real group of daemons on the host backend,
dense AdamS against SCAPE, measured in the same run.

R scaped processes (world R, one per "node", ZeroMQ TCP over 127.0.0.1,
sharded state) with one trainer_c each, N parameters; first dense AdamS, then
SCAPE at rho (warm-up 1), the same seeds and steps; each over plain TCP
(auth: none) and over CURVE (auth: secret: authenticated, encrypted), so that
what the encryption costs is measured in the same run.  Per optimizer: the
median over steps 3..S of the daemons' engine step (mean over ranks), of the
trainers' wait for a step (post to reply, mean over trainers), and rank 0's
collective payload and mask bytes from its status.  Before anything is
reported every trainer's final parameters must agree (the hash trainer_c
prints).  Prints figures; it does not pass or fail on them.

With --link RATE (root) the daemons run on test hosts of deploy/hosts.sh,
one per host, whose links have that rate (tc tbf: 100mbit, 1gbit, ...); the
trainers stay outside and attach through the daemons' ipc sockets.

With --fewer-bytes SCAPE also runs with its values in bf16 (wire_values)
and with bf16 values and mask deltas (mask_deltas), whose size all-gather
is the one collective the step adds: its cost shows in the step times.

Usage: bench_daemons.py BUILD_DIR [--ranks R] [--n N] [--steps S] [--rho RHO]
                        [--auth none|secret|both] [--link RATE] [--fewer-bytes]
                        [--markdown FILE]
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "integration"))
from bench_service import emit, status  # noqa: E402
from conftest import free_endpoints  # noqa: E402


def last_step(build, rt):
    """rank 0's collective payload and mask bytes of its last step."""
    _, done = status(build, rt)
    return int(done["bytes"]), int(done.get("mask_bytes") or 0)


def auth_args(build, work, auth):
    if auth == "none":
        return ["--auth", "none"]
    key = os.path.join(work, "job.key")
    if not os.path.exists(key):
        subprocess.run([os.path.join(build, "daemon", "scaped"), "keygen", key], check=True,
                       capture_output=True)
    return ["--auth", "secret", "--auth-key-file", key]


HOSTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "deploy",
                     "hosts.sh")
HOSTS_NAME = "bench-d%d" % os.getpid()


def hosts(cmd, *args):
    subprocess.run(["bash", HOSTS, cmd, *args, "--name", HOSTS_NAME], check=True,
                   capture_output=True, timeout=120)


def run(build, work, tag, ranks, n, steps, engine, link=None):
    if link:  # rank 0's rendezvous and every data plane on its own host
        eps = ["tcp://10.231.0.1:29517"] + ["tcp://10.231.0.%d:*" % (r + 1)
                                            for r in range(ranks)]
    else:
        eps = free_endpoints(ranks + 1)
    daemons, rts = [], []
    for r in range(ranks):
        rt = os.path.join(work, "%s-rt%d" % (tag, r))
        rts.append(rt)
        log = open(os.path.join(work, "%s-scaped%d.log" % (tag, r)), "w")
        on = ["ip", "netns", "exec", "%s-h%d" % (HOSTS_NAME, r)] if link else []
        daemons.append(subprocess.Popen(
            on + [os.path.join(build, "daemon", "scaped"), "--runtime-dir", rt, "--log-level",
                  "warn", *engine, "--mode", "sharded", "--world", str(ranks), "--rank", str(r),
                  "--coordinator", eps[0], "--listen", eps[r + 1], "--job", "4242",
                  "--trainers", "1", "--comm-timeout-ms", "600000"], stdout=log, stderr=log))
    deadline = time.time() + 30
    for rt, d in zip(rts, daemons):
        while not os.path.exists(os.path.join(rt, "control")):
            if d.poll() is not None or time.time() > deadline:
                sys.exit("bench_daemons: scaped did not start (logs in %s)" % work)
            time.sleep(0.02)
    files = [os.path.join(work, "%s-timing%d" % (tag, r)) for r in range(ranks)]
    trainers = [subprocess.Popen(
        [os.path.join(build, "tests", "integration", "trainer_c"), "--endpoint",
         "ipc://%s/control" % rts[r], "--index", "0", "--n", str(int(n)), "--steps",
         str(steps), "--seed", str(1 + 1000 * r), "--timing", files[r]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(ranks)]
    hashes = []
    for p in trainers:
        out, err = p.communicate(timeout=3600)
        if p.returncode != 0:
            sys.exit("bench_daemons: a trainer failed: %s" % err)
        hashes.append(re.search(r"params ([0-9a-f]+)", out).group(1))
    if len(set(hashes)) != 1:
        sys.exit("bench_daemons: trainers disagree: %s" % hashes)
    payload, mask = last_step(build, rts[0])
    for d in daemons:
        d.terminate()
    for d in daemons:
        d.wait(60)
    rows = [[list(map(float, l.split())) for l in open(f)] for f in files]
    measured = range(2, steps)  # steps 3..S
    engine_ms = [1e3 * statistics.mean(rows[r][k][3] for r in range(ranks)) for k in measured]
    wait_ms = [1e3 * statistics.mean(rows[r][k][1] for r in range(ranks)) for k in measured]
    return {"engine_ms": statistics.median(engine_ms), "wait_ms": statistics.median(wait_ms),
            "bytes": payload, "mask": mask}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--n", type=float, default=1e7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rho", type=float, default=0.01)
    ap.add_argument("--auth", choices=("none", "secret", "both"), default="both")
    ap.add_argument("--link", help="run the daemons on test hosts with links of this rate")
    ap.add_argument("--fewer-bytes", action="store_true",
                    help="add SCAPE with values in bf16, and with bf16 values and mask deltas")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    if a.steps < 4:
        sys.exit("bench_daemons: --steps must be at least 4 (steps 3.. are measured)")
    work = tempfile.mkdtemp(prefix="scape-bench-daemons-")
    if a.link:
        hosts("up", str(a.ranks), "--rate", a.link)
    variants = []
    try:
        res = {}
        auths = ("none", "secret") if a.auth == "both" else (a.auth,)
        scape = ["--optimizer", "scape", "--rho", str(a.rho), "--warmup", "1"]
        variants = [("adams", ["--optimizer", "adams"]), ("scape", scape)]
        if a.fewer_bytes:
            variants += [("scape-bf16", scape + ["--wire-values", "bf16"]),
                         ("scape-bf16-delta", scape + ["--wire-values", "bf16",
                                                       "--mask-deltas", "true"])]
        for name, engine in variants:
            for auth in auths:
                print("bench_daemons: %s, auth %s, %d daemons, N=%g, %d steps ..." %
                      (name, auth, a.ranks, a.n, a.steps), file=sys.stderr)
                res[name, auth] = run(a.build, work, "%s-%s" % (name, auth), a.ranks, a.n,
                                      a.steps, engine + auth_args(a.build, work, auth), a.link)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if a.link:
            hosts("down")
    lines = [
        "| optimizer | data plane | engine step ms (median, mean over ranks) | trainer wait ms | "
        "payload B/step (rank 0) | of it mask B | step vs dense | bytes vs dense | "
        "step vs plain TCP |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    labels = {"adams": "adams (dense)", "scape": "scape rho=%g" % a.rho,
              "scape-bf16": "scape rho=%g, bf16 values" % a.rho,
              "scape-bf16-delta": "scape rho=%g, bf16 values, mask deltas" % a.rho}
    for name, _ in variants:
        label = labels[name]
        for auth in auths:
            r, d = res[name, auth], res["adams", auth]
            plain = res.get((name, "none"))
            lines.append("| %s | %s | %.1f | %.1f | %d | %d | %.3f | %.4f | %s |" % (
                label, "plain TCP (auth none)" if auth == "none" else "CURVE (auth secret)",
                r["engine_ms"], r["wait_ms"], r["bytes"], r["mask"],
                r["engine_ms"] / d["engine_ms"], r["bytes"] / d["bytes"],
                "%.3f" % (r["engine_ms"] / plain["engine_ms"]) if plain else "-"))
    print("%d daemons (host backend, %s, sharded), 1 trainer each, N = %g, "
          "steps 3..%d" % (a.ranks, "test hosts, links of %s" % a.link if a.link
                           else "127.0.0.1", a.n, a.steps))
    emit(lines, a.markdown)


if __name__ == "__main__":
    main()
