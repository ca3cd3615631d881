#!/usr/bin/env python3
"""scale - groups of R daemons on one machine: what a group costs per daemon.

For each R: R scaped processes (host backend over 127.0.0.1, sharded, rho
0.01, world R), one trainer_c each, N coordinates, S steps, every daemon
started with the soft limit on open files at --nofile (1024 by default, the
common default, not this machine's).  Per R it prints: the time from the
first daemon's start to the end of step 1 (rendezvous, CURVE handshakes,
trainers' sync), the median step time (steps 3..S, rank 0's trainer: post to
reply), and, read from /proc once the trainers are done and before the
daemons stop: resident memory (peak, VmHWM) per daemon, sockets and all open
files per daemon, threads per daemon (median and largest over the ranks).
Every trainer's final parameters must be bitwise equal (with --check: also
equal to the local backend's, tests/integration/reference, which runs up to
16 ranks) before a row is printed.  Prints figures; it does not pass or fail on them.

Usage: scale.py BUILD_DIR [--ranks 8,16,64,128,256] [--n N] [--steps S]
                [--auth secret|munge|none] [--munge-socket PATH] [--nofile N]
                [--check] [--keep] [--markdown FILE]
"""
import argparse
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
from conftest import free_endpoints  # noqa: E402

ENGINE = ["--rho", "0.01", "--warmup", "3"]
REFERENCE_MAX_RANKS = 16  # tests/integration/reference's MAX_RANKS


def limit_files(n):
    """preexec_fn: the soft limit on open files at n (the hard one kept)."""
    def set_it():
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(n, hard), hard))
    return set_it


def auth_args(args, work):
    if args.auth == "none":
        return ["--auth", "none"]
    if args.auth == "munge":
        return ["--auth", "munge"] + (["--munge-socket", args.munge_socket]
                                      if args.munge_socket else [])
    key = os.path.join(work, "job.key")
    if not os.path.exists(key):
        subprocess.run([os.path.join(args.build, "daemon", "scaped"), "keygen", key],
                       check=True, capture_output=True)
    return ["--auth", "secret", "--auth-key-file", key]


def proc_figures(pid):
    """(peak RSS in kB, sockets, open files, threads) of pid, from /proc."""
    rss = threads = 0
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                rss = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    fds = sockets = 0
    for fd in os.listdir("/proc/%d/fd" % pid):
        fds += 1
        try:
            sockets += os.readlink("/proc/%d/fd/%s" % (pid, fd)).startswith("socket:")
        except OSError:
            pass
    return rss, sockets, fds, threads


class Group:
    """R daemons and their trainers, all killed by close()."""

    def __init__(self, args, ranks, work):
        self.args, self.ranks, self.work = args, ranks, work
        self.daemons, self.trainers, self.logs = [], [], []

    def start(self):
        a, coord = self.args, free_endpoints(1)[0]
        scaped = os.path.join(a.build, "daemon", "scaped")
        self.t0 = time.monotonic()
        for r in range(self.ranks):
            rt = os.path.join(self.work, "r%d" % r)
            log = open(os.path.join(self.work, "r%d.log" % r), "w")
            self.logs.append(log)
            self.daemons.append(subprocess.Popen(
                [scaped, "--runtime-dir", rt, *ENGINE, "--mode", a.mode, "--world",
                 str(self.ranks), "--rank", str(r), "--coordinator", coord, "--listen",
                 "tcp://127.0.0.1:*", "--job", "5", "--trainers", "1", "--comm-timeout-ms",
                 str(a.timeout_ms),
                 *auth_args(a, self.work)],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit_files(a.nofile)))
        trainer = os.path.join(a.build, "tests", "integration", "trainer_c")
        for r in range(self.ranks):
            self.trainers.append(subprocess.Popen(
                [trainer, "--endpoint", "ipc://%s/r%d/control" % (self.work, r), "--index", "0",
                 "--n", str(a.n), "--steps", str(a.steps), "--seed", str(1 + 1000 * r),
                 "--start-wait-ms", "60000", "--out", os.path.join(self.work, "out%d" % r),
                 "--timing", os.path.join(self.work, "timing%d" % r)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))

    def wait_trainers(self):
        deadline = time.monotonic() + self.args.timeout_ms / 1000 + 60 * self.args.steps
        for r, t in enumerate(self.trainers):
            o, e = t.communicate(timeout=max(1, deadline - time.monotonic()))
            if t.returncode != 0:
                gone = [(q, d.returncode) for q, d in enumerate(self.daemons)
                        if d.poll() is not None]
                raise RuntimeError("rank %d's trainer failed: %s%s\ndaemon log:\n%s\n"
                                   "daemons that exited (rank, status): %s\n%s"
                                   % (r, o, e, self.log(r)[-2000:], gone[:20],
                                      self.log(gone[0][0])[-3000:] if gone else ""))
        self.t_end = time.monotonic()

    def log(self, r):
        self.logs[r].flush()
        with open(self.logs[r].name) as f:
            return f.read()

    def close(self):
        for p in self.trainers + self.daemons:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL if p in self.trainers else signal.SIGTERM)
        for p in self.trainers + self.daemons:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in self.logs:
            log.close()


def timing(path):
    with open(path) as f:
        return [float(line.split()[1]) for line in f if line.strip()]


def run_one(args, ranks):
    work = tempfile.mkdtemp(prefix="scape-scale-%d-" % ranks)
    g = Group(args, ranks, work)
    try:
        g.start()
        g.wait_trainers()
        figs = [proc_figures(d.pid) for d in g.daemons]
        outs = []
        for r in range(ranks):
            with open(os.path.join(work, "out%d" % r), "rb") as f:
                outs.append(f.read())
        if any(o != outs[0] for o in outs):
            raise RuntimeError("R=%d: the trainers' parameters differ" % ranks)
        check = args.check and ranks <= REFERENCE_MAX_RANKS
        if check:
            ref = os.path.join(work, "ref")
            subprocess.run([os.path.join(args.build, "tests", "integration", "reference"),
                            "--trainers", ",".join(["1"] * ranks), "--n", str(args.n),
                            "--steps", str(args.steps), "--seed", "1", "--lr", "0.01",
                            "--out", ref, *ENGINE, "--mode", args.mode],
                           check=True, capture_output=True)
            with open(ref, "rb") as f:
                if f.read() != outs[0]:
                    raise RuntimeError("R=%d: the daemons differ from the local backend" % ranks)
        steps = timing(os.path.join(work, "timing0"))
        first = g.t_end - g.t0 - sum(steps[1:])  # the launch to the end of step 1
        return {"R": ranks, "first": first, "step": statistics.median(steps[2:] or steps),
                "rss": [f[0] for f in figs], "sockets": [f[1] for f in figs],
                "fds": [f[2] for f in figs], "threads": [f[3] for f in figs],
                "equal": "local" if check else "ranks"}
    finally:
        g.close()
        if args.keep:
            print("logs kept in %s" % work)
        else:
            shutil.rmtree(work, ignore_errors=True)


def spread(xs, fmt="%d"):
    return (fmt + " / " + fmt) % (statistics.median(xs), max(xs))


def table(rows, args):
    head = ["R", "start to step 1 (s)", "step (ms)", "RSS MiB med/max", "sockets med/max",
            "open files med/max", "threads med/max", "bitwise equal to"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for x in rows:
        lines.append("| %d | %.2f | %.1f | %s | %s | %s | %s | %s |" % (
            x["R"], x["first"], 1e3 * x["step"], spread([r / 1024 for r in x["rss"]], "%.1f"),
            spread(x["sockets"]), spread(x["fds"]), spread(x["threads"]), x["equal"]))
    note = ("N = %d, %d steps, %s, rho 0.01, auth %s, soft limit on open files %d, "
            "%d CPU cores" % (args.n, args.steps, args.mode, args.auth, args.nofile,
                              os.cpu_count()))
    return "\n".join(lines) + "\n\n" + note + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("build")
    p.add_argument("--ranks", default="8,16,64,128,256")
    p.add_argument("--n", type=int, default=4000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--mode", choices=["sharded", "replicated"], default="sharded")
    p.add_argument("--auth", choices=["secret", "munge", "none"], default="secret")
    p.add_argument("--munge-socket", default="")
    p.add_argument("--nofile", type=int, default=1024)
    p.add_argument("--timeout-ms", type=int, default=120000)
    p.add_argument("--check", action="store_true")
    p.add_argument("--markdown")
    p.add_argument("--keep", action="store_true", help="keep the daemons' logs")
    args = p.parse_args()
    rows = []
    for ranks in [int(x) for x in args.ranks.split(",")]:
        rows.append(run_one(args, ranks))
        print(table(rows[-1:], args).splitlines()[2], flush=True)
    out = table(rows, args)
    print(out)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(out)


if __name__ == "__main__":
    main()
