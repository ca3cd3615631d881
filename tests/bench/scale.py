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

With --faults (issue 35, parts 3 and 4; at R = 64 by default, one case at a
time, comm_timeout_ms --fault-timeout-ms, 5000 by default):
  kill   rank R/2+1's daemon SIGKILLed in the middle of the steps;
  stop   the same rank SIGSTOPped (hung: its connections stay open);
  cut    the daemons spread over --hosts test hosts (4: network namespaces
         of deploy/hosts.sh, 1 Gbit/s links, R/4 daemons each), the last
         host's link cut (needs root; the hosts are removed at the end);
  ckpt   checkpoints every 5 steps; that rank killed as soon as its file of
         a new checkpoint is on disk (before or while the commit runs); then
         LATEST must name a checkpoint with its MANIFEST and every rank's
         file, and R fresh daemons resume from it and train 2 steps;
  ckpt-late  the same, killed once rank 0's MANIFEST of it is on disk (after
         every rank's outcome was gathered, around LATEST's move);
  flood  two strangers running as nobody send random bytes as joins to rank
         0's rendezvous while the R ranks start (needs root); with --auth
         munge also 8 scaped run as nobody join with real munge credentials.
Per case it prints how many ranks named the rank at fault (and which ranks
they named otherwise), the time from the signal to each one's first error
(median / largest), whether every trainer failed and every daemon then
stopped at SIGTERM (status 0), and for flood the refused joins and the
lines rank 0 logged about them.

Usage: scale.py BUILD_DIR [--ranks 8,16,64,128,256] [--n N] [--steps S]
                [--auth secret|munge|none] [--munge-socket PATH] [--nofile N]
                [--check] [--keep] [--markdown FILE]
       scale.py BUILD_DIR --faults [kill,stop,cut,ckpt,ckpt-late,flood] [--ranks 64]
                [--hosts 4]
"""
import argparse
import datetime
import json
import os
import re
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
from conftest import Hosts, free_endpoints, hosts_unavailable  # noqa: E402

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

    def __init__(self, args, ranks, work, extra=(), coord=None, hosts=None):
        """hosts: test hosts (conftest.Hosts) to spread the daemons over,
        ranks / hosts.count on each, rank 0's rendezvous on the first."""
        self.args, self.ranks, self.work, self.extra = args, ranks, work, list(extra)
        self.hosts, self.per_host = hosts, -(-ranks // hosts.count) if hosts else ranks
        self.coord = coord or (free_endpoints(1)[0] if hosts is None else
                               "tcp://%s:29519" % hosts.addr[0])
        self.daemons, self.trainers, self.logs = [], [], []

    def where(self, r):
        """(command prefix, listen address) of rank r."""
        if self.hosts is None:
            return [], "127.0.0.1"
        h = r // self.per_host
        return ["ip", "netns", "exec", self.hosts.ns[h]], self.hosts.addr[h]

    def start(self, which=None, trainers=True):
        """Daemons `which` (all: None), then every rank's trainer."""
        a, coord = self.args, self.coord
        scaped = os.path.join(a.build, "daemon", "scaped")
        if not self.daemons:
            self.t0 = time.monotonic()
        for r in range(self.ranks) if which is None else which:
            rt = os.path.join(self.work, "r%d" % r)
            log = open(os.path.join(self.work, "r%d.log" % r), "w")
            self.logs.append(log)
            prefix, addr = self.where(r)
            self.daemons.append(subprocess.Popen(
                [*prefix, scaped, "--runtime-dir", rt, *ENGINE, "--mode", a.mode, "--world",
                 str(self.ranks), "--rank", str(r), "--coordinator", coord, "--listen",
                 "tcp://%s:*" % addr, "--job", "5", "--trainers", "1", "--comm-timeout-ms",
                 str(a.timeout_ms), *self.extra,
                 *auth_args(a, self.work)],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit_files(a.nofile)))
        trainer = os.path.join(a.build, "tests", "integration", "trainer_c")
        for r in range(self.ranks) if trainers else ():
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


# ---- faults (--faults) -------------------------------------------------------

# A stranger at rank 0's rendezvous (tests/integration/flooder.py), run as
# python3 -c so that a user such as nobody needs no file it can read.
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration",
                       "flooder.py")) as _f:
    FLOODER = _f.read()


def log_time(line):
    """The UTC time (s since the epoch) at the start of a daemon log line."""
    t = datetime.datetime.strptime(line[:23], "%Y-%m-%dT%H:%M:%S.%f")
    return t.replace(tzinfo=datetime.timezone.utc).timestamp()


def status(args, work, r):
    res = subprocess.run([os.path.join(args.build, "client", "scapectl"), "--runtime-dir",
                          os.path.join(work, "r%d" % r), "status", "--json"],
                         capture_output=True, text=True, timeout=60)
    return json.loads(res.stdout) if res.returncode == 0 else {}


def wait_for(what, seconds, poll=0.1):
    deadline = time.monotonic() + seconds
    while not what():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out waiting")
        time.sleep(poll)


def fault_args(args):
    a = argparse.Namespace(**vars(args))
    a.steps, a.timeout_ms = 100000, args.fault_timeout_ms
    return a


def named_report(g, victim, t_sig):
    """Who each other rank named in its first error, and after how long."""
    named, delays, failed = {}, [], 0
    for r, t in enumerate(g.trainers):
        if r == victim:
            continue
        _, e = t.communicate(timeout=g.args.timeout_ms / 1000 + 120)
        failed += t.returncode != 0
        err = next((ln for ln in g.log(r).splitlines() if " ERROR " in ln), "")
        m = re.search(r"(?:lost rank|rank) (\d+) (?:during|sent nothing)", err)
        named[r] = int(m.group(1)) if m else None
        if err:
            delays.append(log_time(err) - t_sig)
    right = sum(q == victim for q in named.values())
    wrong = sorted({q for q in named.values() if q != victim}, key=str)
    return ("%d of %d named rank %d%s; first error after %.2f / %.2f s (median / max); "
            "%d trainers failed" % (right, len(named), victim,
                                    " (the others named %s)" % wrong if wrong else "",
                                    statistics.median(delays) if delays else -1,
                                    max(delays) if delays else -1, failed))


def stop_report(g, skip):
    """SIGTERM to every daemon but skip; their exit statuses, time to stop."""
    t = time.monotonic()
    for r, d in enumerate(g.daemons):
        if r != skip:
            d.send_signal(signal.SIGTERM)
    codes = [d.wait(g.args.timeout_ms / 1000 + 120) for r, d in enumerate(g.daemons) if r != skip]
    return "daemons stopped at SIGTERM in %.1f s, statuses %s" % (
        time.monotonic() - t, sorted(set(codes)))


def fault_signal(args, ranks, work, how):
    a = fault_args(args)
    g, victim = Group(a, ranks, work), ranks // 2 + 1
    try:
        g.start()
        wait_for(lambda: status(a, work, 0).get("step", 0) >= 3, 300, 0.5)
        t_sig = time.time()
        g.daemons[victim].send_signal(signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        rep = named_report(g, victim, t_sig)
        g.daemons[victim].kill()
        g.daemons[victim].wait()
        return "%s: %s; %s" % (how, rep, stop_report(g, victim))
    finally:
        g.close()


def fault_cut(args, ranks, work):
    """The last of args.hosts test hosts loses its link: its ranks are cut
    off from the others, whose first errors are reported."""
    why = hosts_unavailable()
    if why:
        return "cut: not run: " + why
    a = fault_args(args)
    hosts = Hosts("scbench%d" % (os.getpid() % 100000), args.hosts)
    try:
        hosts.sh("up", str(args.hosts), "--rate", "1gbit")
        g = Group(a, ranks, work, hosts=hosts)
        cut_off = set(range((args.hosts - 1) * g.per_host, ranks))
        try:
            g.start()
            wait_for(lambda: status(a, work, 0).get("step", 0) >= 3, 300, 0.5)
            t_sig = time.time()
            hosts.cut(args.hosts - 1)
            named, delays = {}, []
            for r, t in enumerate(g.trainers):
                _, e = t.communicate(timeout=a.timeout_ms / 1000 + 120)
                err = next((ln for ln in g.log(r).splitlines() if " ERROR " in ln), "")
                m = re.search(r"(?:lost rank|rank) (\d+) (?:during|sent nothing)", err)
                named[r] = int(m.group(1)) if m else None
                if err and r not in cut_off:
                    delays.append(log_time(err) - t_sig)
            outside = [q for r, q in named.items() if r not in cut_off]
            right = sum(q in cut_off for q in outside)
            rep = ("cut: %d daemons on %d hosts, host %d's link (ranks %d-%d) cut; %d of %d "
                   "ranks elsewhere named one of them%s; first error after %.2f / %.2f s "
                   "(median / max)" % (
                       ranks, args.hosts, args.hosts - 1, min(cut_off), max(cut_off), right,
                       len(outside), " (the others named %s)" % sorted(
                           {q for q in outside if q not in cut_off}, key=str)
                       if right < len(outside) else "", statistics.median(delays),
                       max(delays)))
            hosts.restore(args.hosts - 1)
            return rep + "; " + stop_report(g, -1)
        finally:
            g.close()
    finally:
        hosts.sh("down")


def checkpoint_complete(ck, ranks):
    with open(os.path.join(ck, "LATEST")) as f:
        name = f.read().strip()
    files = set(os.listdir(os.path.join(ck, name)))
    want = {"MANIFEST"} | {"rank-%05d.ckpt" % r for r in range(ranks)}
    return name, want <= files


def fault_ckpt(args, ranks, work, at_manifest=False):
    a, ck = fault_args(args), os.path.join(work, "ck")
    g, victim = Group(a, ranks, work, ["--checkpoint-dir", ck, "--checkpoint-every", "5"]), \
        ranks // 2 + 1
    try:
        g.start()
        wait_for(lambda: os.path.exists(os.path.join(ck, "LATEST")), 300, 0.2)
        before, _ = checkpoint_complete(ck, ranks)
        mine = "MANIFEST" if at_manifest else "rank-%05d.ckpt" % victim
        new = []

        def its_file_is_there():
            new[:] = [d for d in os.listdir(ck) if d.startswith("step-") and d != before and
                      os.path.exists(os.path.join(ck, d, mine))]
            return new
        wait_for(its_file_is_there, 300, 0.001)
        g.daemons[victim].kill()
        t_sig = time.time()
        g.daemons[victim].wait()
        rep = named_report(g, victim, t_sig)
        stopped = stop_report(g, victim)
    finally:
        g.close()
    latest, complete = checkpoint_complete(ck, ranks)
    moved = "moved to the interrupted %s" % latest if latest == new[0] else \
        "still %s (the interrupted one: %s, %s)" % (
            latest, new[0], "no MANIFEST" if not os.path.exists(
                os.path.join(ck, new[0], "MANIFEST")) else "with a MANIFEST")
    work2 = os.path.join(work, "resume")
    os.makedirs(work2)
    a2 = argparse.Namespace(**vars(args))
    a2.steps = int(latest.split("-")[1].split(".")[0]) + 2
    g2 = Group(a2, ranks, work2, ["--resume", ck])
    try:
        g2.start()
        g2.wait_trainers()
        resumed = status(a2, work2, 0).get("checkpoint", {}).get("resumed_from")
    finally:
        g2.close()
    return ("%s: rank %d killed with %s of %s on disk; %s; LATEST %s, complete: %s; "
            "%d daemons resumed from step %s and trained 2 steps" % (
                "ckpt-late" if at_manifest else "ckpt", victim,
                "rank 0's MANIFEST" if at_manifest else "its file", new[0], rep, moved, complete, ranks, resumed)) + "; " + stopped


def fault_flood(args, ranks, work):
    a = fault_args(args)
    a.steps = 3
    g, half = Group(a, ranks, work), ranks // 2
    strangers = []
    try:
        g.start(range(half), trainers=False)
        strangers = [subprocess.Popen(
            ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
             "/usr/bin/python3", "-c", FLOODER, g.coord, "1000000", "120"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
            for _ in range(2)]
        # the other half joins in the middle of the flood
        wait_for(lambda: "more refusals: one line every" in g.log(0), 60)
        intruders = intrude(a, g, work) if a.auth == "munge" else ""
        g.start(range(half, ranks))
        g.wait_trainers()
        counts = [[int(x) for x in p.communicate(timeout=200)[0].split()] for p in strangers]
        log = g.log(0)
    finally:
        for p in strangers:
            if p.poll() is None:
                p.kill()
                p.wait()
        g.close()
    total = re.findall(r"rendezvous: refused (\d+) joins in all", log)
    lines = len(re.findall(r"refused (?:a join from|\d+ more joins)", log))
    return ("flood: the job started (start to step 3 %.1f s); strangers sent %d, saw %d "
            "refused%s; rank 0 counted %s and logged %d lines about them" % (
                g.t_end - g.t0, sum(c[0] for c in counts), sum(c[1] for c in counts),
                intruders, total[0] if total else 0, lines))


def intrude(a, g, work, count=8):
    """auth munge: count scaped run as nobody join as ranks 1.., each with a
    real munge credential of uid 65534; how many were refused naming it."""
    rt = os.path.join(work, "nobody")
    os.makedirs(rt)
    os.chmod(work, 0o755)
    os.chmod(rt, 0o777)
    procs = [subprocess.Popen(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
         os.path.abspath(os.path.join(a.build, "daemon", "scaped")), "--runtime-dir",
         os.path.join(rt, "%d" % k),
         *ENGINE, "--world", str(g.ranks), "--rank", str(1 + k), "--coordinator", g.coord,
         "--listen", "tcp://127.0.0.1:*", "--job", "5", "--auth", "munge",
         *(["--munge-socket", a.munge_socket] if a.munge_socket else [])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/")
        for k in range(count)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    named = sum(p.returncode != 0 and "uid 65534 (nobody)" in o for p, o in zip(procs, outs))
    if named < count:
        print("an intruder that was not refused as such said:", next(
            o for p, o in zip(procs, outs) if p.returncode == 0 or "uid 65534" not in o)[-1500:])
    return "; %d of %d scaped run as nobody (munge) refused naming uid 65534" % (named, count)


def run_faults(args):
    cases = {"kill": lambda r, w: fault_signal(args, r, w, "kill"),
             "stop": lambda r, w: fault_signal(args, r, w, "stop"),
             "cut": lambda r, w: fault_cut(args, r, w),
             "ckpt": lambda r, w: fault_ckpt(args, r, w),
             "ckpt-late": lambda r, w: fault_ckpt(args, r, w, True),
             "flood": lambda r, w: fault_flood(args, r, w)}
    for ranks in [int(x) for x in args.ranks.split(",")]:
        for case in args.faults.split(","):
            work = tempfile.mkdtemp(prefix="scape-fault-%d-" % ranks)
            try:
                print("R=%d %s" % (ranks, cases[case](ranks, work)), flush=True)
            finally:
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
    p.add_argument("--faults", nargs="?", const="kill,stop,cut,ckpt,ckpt-late,flood",
                   help="the fault cases instead of the table (R = 64 unless --ranks)")
    p.add_argument("--fault-timeout-ms", type=int, default=5000)
    p.add_argument("--hosts", type=int, default=4, help="test hosts of the cut case")
    args = p.parse_args()
    if args.faults:
        if "--ranks" not in sys.argv:
            args.ranks = "64"
        return run_faults(args)
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
