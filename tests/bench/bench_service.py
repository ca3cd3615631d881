#!/usr/bin/env python3
"""bench_service - what going through scaped costs, measured against the
in-process engine in the same run.

  1. per-step overhead: N = 1e6 fp32, 4 trainer processes, rho = 0.01.  The
     baseline is `reference`, the engine called in-process with the same
     trainers' gradients.  Through the daemon, the cost of a step is what the
     last trainer to post waits for its reply (the others also wait for it).
  2. handover: bytes of control messages per step, and gradient bytes the
     daemon copied to get at the gradients, against the gradient bytes.
  3. memory at N = 1e8: the daemon's private resident memory beyond the
     optimizer state and residual it must hold.

Usage: bench_service.py BUILD_DIR [--quick] [--markdown FILE]
Prints figures; it does not pass or fail on them.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import zmq

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "integration"))
import pbwire  # noqa: E402


def start_daemon(build, rt, *args):
    log = open(os.path.join(os.path.dirname(rt), "scaped.log"), "w")
    proc = subprocess.Popen([os.path.join(build, "daemon", "scaped"), "--runtime-dir", rt,
                             "--log-level", "warn", *args], stdout=log, stderr=log)
    deadline = time.time() + 15
    while not os.path.exists(os.path.join(rt, "control")):
        if proc.poll() is not None or time.time() > deadline:
            sys.exit("bench_service: scaped did not start")
        time.sleep(0.02)
    return proc


def status(rt):
    """The daemon's StatusReply as a field dict, and its last StepDone."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10000)
    s.connect("ipc://%s/status" % rt)
    s.send(pbwire.status_request())
    code, msg, f = pbwire.reply(s.recv())
    s.close()
    ctx.term()
    if code != 0:
        sys.exit("bench_service: status: %s" % msg)
    st = pbwire.parse(f[6][0])
    return st, pbwire.parse(st[14][0]) if 14 in st else {}


def trainer_cmd(build, rt, index, n, steps, extra=()):
    return [os.path.join(build, "tests", "integration", "trainer_c"), "--endpoint",
            "ipc://%s/control" % rt, "--index", str(index), "--n", str(int(n)),
            "--steps", str(steps), *extra]


def wait_all(procs, what):
    for p in procs:
        if p.wait(timeout=3600) != 0:
            sys.exit("bench_service: a %s process failed" % what)


def overhead(build, work, n, steps, trainers=4):
    engine = ["--rho", "0.01", "--warmup", "1"]
    ref = subprocess.run([os.path.join(build, "tests", "integration", "reference"),
                          "--trainers", str(trainers), "--n", str(int(n)), "--steps",
                          str(steps), *engine], capture_output=True, text=True, check=True)
    inproc_ms = float(ref.stdout.split("mean engine step")[1].split("ms")[0])
    rt = os.path.join(work, "rt1")
    d = start_daemon(build, rt, *engine, "--trainers", str(trainers))
    files = [os.path.join(work, "timing%d" % i) for i in range(trainers)]
    procs = [subprocess.Popen(trainer_cmd(build, rt, i, n, steps, ["--timing", files[i]]))
             for i in range(trainers)]
    wait_all(procs, "trainer")
    _, last = status(rt)
    d.terminate()
    d.wait()
    rows = [[list(map(float, l.split())) for l in open(f)] for f in files]
    last_poster = [min(r[k][1] for r in rows) for k in range(steps)]
    engine_in_daemon = [rows[0][k][3] for k in range(steps)]
    return {
        "inproc_ms": inproc_ms,
        "daemon_ms": 1e3 * statistics.mean(last_poster),
        "daemon_engine_ms": 1e3 * statistics.mean(engine_in_daemon),
        "control_bytes": int(last.get(10, [0])[0]),
        "copied_bytes": int(last.get(9, [0])[0]),
        "grad_bytes": trainers * 4 * int(n),
    }


def memory(build, work, n, trainers, steps=4):
    rt = os.path.join(work, "rt2-%d" % trainers)
    d = start_daemon(build, rt, "--rho", "0.01", "--warmup", "1", "--trainers", str(trainers))
    ts = [subprocess.Popen(trainer_cmd(build, rt, i, n, steps, ["--sleep-ms", "1500"]))
          for i in range(trainers)]
    time.sleep(1.0)
    deadline = time.time() + 3600
    st, last = status(rt)
    while int(st[8][0]) < steps - 1 and time.time() < deadline:
        time.sleep(0.2)
        st, last = status(rt)
    rss, state = int(st[12][0]), int(st[13][0])
    wait_all(ts, "trainer")
    d.terminate()
    d.wait()
    return {"n": int(st[9][0]), "rss": rss, "state": state, "trainers": trainers}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--quick", action="store_true", help="N=1e7 for the memory figure")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="scape-bench-")
    try:
        print("bench_service: overhead at N=1e6, 4 trainers, rho=0.01 ...", file=sys.stderr)
        o = overhead(a.build, work, 1e6, 60)
        mem_n = 1e7 if a.quick else 1e8
        mems = []
        for trainers in (1, 4):
            print("bench_service: memory at N=%g, %d trainer(s) ..." % (mem_n, trainers),
                  file=sys.stderr)
            mems.append(memory(a.build, work, mem_n, trainers))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [
        "| figure | value | baseline (same run) | ratio |",
        "|---|---|---|---|",
        "| step, through scaped (last poster's wait) | %.2f ms | in-process engine %.2f ms "
        "| %.2fx (overhead %+.1f%%) |" % (o["daemon_ms"], o["inproc_ms"],
                                          o["daemon_ms"] / o["inproc_ms"],
                                          100 * (o["daemon_ms"] / o["inproc_ms"] - 1)),
        "| engine step inside scaped | %.2f ms | in-process engine %.2f ms | %.2fx |"
        % (o["daemon_engine_ms"], o["inproc_ms"], o["daemon_engine_ms"] / o["inproc_ms"]),
        "| control bytes per step (4 trainers) | %d B | gradient bytes %d B | %.2g |"
        % (o["control_bytes"], o["grad_bytes"], o["control_bytes"] / o["grad_bytes"]),
        "| gradient bytes copied in handover | %d B | gradient bytes %d B | %.2g |"
        % (o["copied_bytes"], o["grad_bytes"], o["copied_bytes"] / o["grad_bytes"]),
    ]
    for m in mems:
        lines.append("| private RSS beyond state, N=%.0e, %d trainer(s) | %.1f MiB | "
                     "state+residual %.1f MiB | %+.1f%% |"
                     % (m["n"], m["trainers"], (m["rss"] - m["state"]) / 2**20,
                        m["state"] / 2**20, 100 * (m["rss"] - m["state"]) / m["state"]))
    print("\n".join(lines))
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
