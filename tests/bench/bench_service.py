#!/usr/bin/env python3
"""bench_service - what going through scaped costs, measured against the
in-process engine in the same run.

  1. per-step overhead: N = 1e6 fp32, 4 trainer processes, rho = 0.01.  The
     baseline is `reference`, the engine called in-process with the same
     trainers' gradients.  Through the daemon, the cost of a step is what the
     last trainer to post waits for its reply (the others also wait for it).
     The daemon runs twice per round: as configured by default, where the
     next mask is selected after the reply (behind the trainers' compute),
     and with defer_select false, where the step holds the selection as the
     in-process engine's does.  In-process and daemon runs alternate
     (--rounds, default 5); each run's figure is its median step, and the
     rounds' medians are reported, with the per-step means and every round's
     ratio next to them.
  2. handover: bytes of control messages per step, and gradient bytes the
     daemon copied to get at the gradients, against the gradient bytes.
  3. memory at N = 1e8: the daemon's private resident memory beyond the
     optimizer state and residual it must hold.

Usage: bench_service.py BUILD_DIR [--quick] [--rounds R] [--markdown FILE]
       bench_service.py --bin DIR ...   (scaped, scapectl, trainer_c and
                                         reference all in DIR, as
                                         tests/gpu/pack.sh packs them)
Prints figures; it does not pass or fail on them.  Needs nothing beyond the
Python standard library (the daemon's status comes from scapectl --json), so
it also runs on the GPU machine's image.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# Where the programs are: a build tree (BUILD/daemon/scaped, ...) or, with
# --bin, one folder holding them all.
_LAYOUT = {"scaped": "daemon", "scapectl": "client", "trainer_c": "tests/integration",
           "reference": "tests/integration"}


def prog(build, name):
    if os.path.exists(os.path.join(build, name)) and not os.path.isdir(os.path.join(build, name)):
        return os.path.join(build, name)
    return os.path.join(build, _LAYOUT[name], name)


def emit(lines, markdown=None):
    """Print the table rows, and write them to markdown if given."""
    print("\n".join(lines))
    if markdown:
        with open(markdown, "w") as f:
            f.write("\n".join(lines) + "\n")


def start_daemon(build, rt, *args):
    log = open(os.path.join(os.path.dirname(rt), "scaped.log"), "w")
    proc = subprocess.Popen([prog(build, "scaped"), "--runtime-dir", rt,
                             "--log-level", "warn", *args], stdout=log, stderr=log)
    deadline = time.time() + 15
    while not os.path.exists(os.path.join(rt, "control")):
        if proc.poll() is not None or time.time() > deadline:
            sys.exit("bench_service: scaped did not start")
        time.sleep(0.02)
    return proc


def status(build, rt):
    """The daemon's status (scapectl status --json) and its last step's."""
    res = subprocess.run([prog(build, "scapectl"), "--runtime-dir", rt, "status", "--json"],
                         capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        sys.exit("bench_service: scapectl status: %s" % (res.stderr.strip() or res.returncode))
    st = json.loads(res.stdout)
    return st, st.get("last") or {}


def trainer_cmd(build, rt, index, n, steps, extra=()):
    return [prog(build, "trainer_c"), "--endpoint",
            "ipc://%s/control" % rt, "--index", str(index), "--n", str(int(n)),
            "--steps", str(steps), *extra]


def wait_all(procs, what):
    for p in procs:
        if p.wait(timeout=3600) != 0:
            sys.exit("bench_service: a %s process failed" % what)


def overhead_round(build, work, n, steps, trainers, tag):
    """One in-process run and one run through scaped on the same inputs:
    per-step seconds of the in-process engine step, the last poster's wait
    and the engine step inside the daemon."""
    engine = ["--rho", "0.01", "--warmup", "1"]
    ref_timing = os.path.join(work, "ref-%s" % tag)
    subprocess.run([prog(build, "reference"),
                    "--trainers", str(trainers), "--n", str(int(n)), "--steps",
                    str(steps), "--timing", ref_timing, *engine],
                   capture_output=True, text=True, check=True)
    inproc = [float(l.split()[1]) for l in open(ref_timing)]
    out = {"inproc": inproc}
    for defer in ("true", "false"):
        rt = os.path.join(work, "rt-%s-%s" % (tag, defer))
        d = start_daemon(build, rt, *engine, "--trainers", str(trainers), "--defer-select", defer)
        files = [os.path.join(work, "timing-%s-%s-%d" % (tag, defer, i)) for i in range(trainers)]
        t0 = time.time()
        procs = [subprocess.Popen(trainer_cmd(build, rt, i, n, steps, ["--timing", files[i]]))
                 for i in range(trainers)]
        wait_all(procs, "trainer")
        wall = (time.time() - t0) / steps
        st, last = status(build, rt)
        d.terminate()
        d.wait()
        rows = [[list(map(float, l.split())) for l in open(f)] for f in files]
        sfx = "" if defer == "true" else "_nodefer"
        out["last_poster" + sfx] = [min(r[k][1] for r in rows) for k in range(steps)]
        out["engine_in_daemon" + sfx] = [rows[0][k][3] for k in range(steps)]
        out["wall" + sfx] = [wall]
        # what the trainers' posts waited for a busy daemon (the deferred
        # selection, when a post comes before it ends), per step
        out["queued" + sfx] = [float(st.get("queued_seconds_total") or 0.0) / steps]
        if defer == "true":
            out["control_bytes"] = int(last.get("control_bytes") or 0)
            out["copied_bytes"] = int(last.get("handover_copy_bytes") or 0)
    return out


def overhead(build, work, n, steps, rounds, trainers=4):
    """Alternates in-process and daemon runs `rounds` times.  Per run, the
    median step (a VM's scheduling hiccups land in the mean) and the mean;
    the figures are the medians over the rounds."""
    per = []
    for k in range(rounds):
        print("bench_service: overhead round %d/%d ..." % (k + 1, rounds), file=sys.stderr)
        per.append(overhead_round(build, work, n, steps, trainers, str(k)))
    def fig(key, stat):
        return 1e3 * statistics.median(stat(r[key]) for r in per)
    def ratios(key):
        return [statistics.median(r[key]) / statistics.median(r["inproc"]) for r in per]
    return {
        "rounds": rounds,
        "inproc_ms": fig("inproc", statistics.median),
        "daemon_ms": fig("last_poster", statistics.median),
        "daemon_engine_ms": fig("engine_in_daemon", statistics.median),
        "nodefer_ms": fig("last_poster_nodefer", statistics.median),
        "nodefer_engine_ms": fig("engine_in_daemon_nodefer", statistics.median),
        "inproc_mean_ms": fig("inproc", statistics.mean),
        "daemon_mean_ms": fig("last_poster", statistics.mean),
        "nodefer_mean_ms": fig("last_poster_nodefer", statistics.mean),
        "round_ratios": ratios("last_poster"),
        "nodefer_round_ratios": ratios("last_poster_nodefer"),
        "wall_ms": fig("wall", statistics.median),
        "nodefer_wall_ms": fig("wall_nodefer", statistics.median),
        "queued_ms": fig("queued", statistics.median),
        "nodefer_queued_ms": fig("queued_nodefer", statistics.median),
        "control_bytes": per[-1]["control_bytes"],
        "copied_bytes": per[-1]["copied_bytes"],
        "grad_bytes": trainers * 4 * int(n),
    }


def memory(build, work, n, trainers, steps=4):
    rt = os.path.join(work, "rt2-%d" % trainers)
    d = start_daemon(build, rt, "--rho", "0.01", "--warmup", "1", "--trainers", str(trainers))
    ts = [subprocess.Popen(trainer_cmd(build, rt, i, n, steps, ["--sleep-ms", "1500"]))
          for i in range(trainers)]
    time.sleep(1.0)
    deadline = time.time() + 3600
    st, last = status(build, rt)
    while int(st["step"]) < steps - 1 and time.time() < deadline:
        time.sleep(0.2)
        st, last = status(build, rt)
    rss, state = int(st["rss_bytes"]), int(st["state_bytes"])
    wait_all(ts, "trainer")
    d.terminate()
    d.wait()
    return {"n": int(st["numel"]), "rss": rss, "state": state, "trainers": trainers}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build", nargs="?", help="the build tree")
    ap.add_argument("--bin", help="one folder with scaped, scapectl, trainer_c, reference")
    ap.add_argument("--quick", action="store_true", help="N=1e7 for the memory figure")
    ap.add_argument("--markdown")
    ap.add_argument("--rounds", type=int, default=5,
                    help="alternating in-process / daemon runs for the overhead")
    a = ap.parse_args()
    if (a.build is None) == (a.bin is None):
        ap.error("give a build tree or --bin DIR")
    a.build = a.build or a.bin
    work = tempfile.mkdtemp(prefix="scape-bench-")
    try:
        print("bench_service: overhead at N=1e6, 4 trainers, rho=0.01 ...", file=sys.stderr)
        o = overhead(a.build, work, 1e6, 60, a.rounds)
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
        "| step, through scaped (last poster's wait; median of %d rounds of per-step "
        "medians; next mask selected after the reply, the default) | %.2f ms | "
        "in-process engine %.2f ms | %.2fx (overhead %+.1f%%) |"
        % (o["rounds"], o["daemon_ms"], o["inproc_ms"], o["daemon_ms"] / o["inproc_ms"],
           100 * (o["daemon_ms"] / o["inproc_ms"] - 1)),
        "| the same with per-step means | %.2f ms | in-process engine %.2f ms | %.2fx |"
        % (o["daemon_mean_ms"], o["inproc_mean_ms"], o["daemon_mean_ms"] / o["inproc_mean_ms"]),
        "| overhead in each round (per-step medians) | %s | | |"
        % ", ".join("%+.1f%%" % (100 * (x - 1)) for x in o["round_ratios"]),
        "| engine step inside scaped, up to the reply | %.2f ms | in-process engine %.2f ms | "
        "%.2fx |" % (o["daemon_engine_ms"], o["inproc_ms"], o["daemon_engine_ms"] / o["inproc_ms"]),
        "| step, through scaped with defer_select false (selection inside the step) | %.2f ms | "
        "in-process engine %.2f ms | %.2fx (overhead %+.1f%%) |"
        % (o["nodefer_ms"], o["inproc_ms"], o["nodefer_ms"] / o["inproc_ms"],
           100 * (o["nodefer_ms"] / o["inproc_ms"] - 1)),
        "| the same, each round | %s | | |"
        % ", ".join("%+.1f%%" % (100 * (x - 1)) for x in o["nodefer_round_ratios"]),
        "| engine step inside scaped, defer_select false | %.2f ms | in-process engine %.2f ms "
        "| %.2fx |" % (o["nodefer_engine_ms"], o["inproc_ms"],
                       o["nodefer_engine_ms"] / o["inproc_ms"]),
        "| whole job through scaped, wall time per step (trainers' gradient compute, "
        "start-up included) | %.2f ms | defer_select false %.2f ms | %.2fx |"
        % (o["wall_ms"], o["nodefer_wall_ms"], o["wall_ms"] / o["nodefer_wall_ms"]),
        "| a post's wait for a busy daemon before it is read (Phases.queued, longest of the "
        "step's trainers, mean per step) | %.3f ms | defer_select false %.3f ms | |"
        % (o["queued_ms"], o["nodefer_queued_ms"]),
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
    emit(lines, a.markdown)


if __name__ == "__main__":
    main()
