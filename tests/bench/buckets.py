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
the ratio bucketed / whole is the issue's target (at most 0.25).  A third
run adds --chunk (the daemons' reduce_chunk): the reduction in chunks,
each sent as soon as its layers' buckets are in.  Both
runs must end with bitwise equal parameters.  With --link RATE (root) the
daemons run on test hosts (deploy/hosts.sh) joined by links of that rate.
Prints figures; it does not pass or fail on them.

With --torch, two torch trainers (torch_train's GPT through
ScapeOptimizer) train once per bucket_mb of --sizes, rounds interleaved:
per size the backward, the step() of the last poster and the whole
iteration (medians over steps 3..S); the shortest iteration is the
measured choice of the default bucket size, as DDP's 25 MB was chosen.

Usage: buckets.py BUILD_DIR [--d 256] [--layers 12] [--steps 12] [--link RATE] [--chunk C]
                  [--repeat 1] [--markdown FILE] [--torch [--sizes 0,0.25,1,4,16]]
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


def daemons_up(build, work, tag, link, extra=()):
    """Two daemons (host backend, sharded, scape rho 0.01), one trainer each:
    the processes and their runtime dirs once both serve."""
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
                  "--trainers", "1", "--comm-timeout-ms", "600000", "--auth", "none", *extra],
                 stdout=log, stderr=log))
    deadline = time.time() + 30
    for rt, d in zip(rts, daemons):
        while not os.path.exists(os.path.join(rt, "control")):
            if d.poll() is not None or time.time() > deadline:
                sys.exit("buckets: scaped did not start (logs in %s)" % work)
            time.sleep(0.02)
    return daemons, rts


def run(build, work, tag, link, trainer, extra=()):
    """One training run: trainer(r, endpoint, log, out) is rank r's command
    line; it writes a CSV log with step_ms per step and its parameters to
    out.  The per-step figures of both trainers and rank 0's last step."""
    daemons, rts = daemons_up(build, work, tag, link, extra)
    logs = [os.path.join(work, "%s-log%d.csv" % (tag, r)) for r in range(2)]
    outs = [os.path.join(work, "%s-out%d" % (tag, r)) for r in range(2)]
    try:
        trainers = [subprocess.Popen(trainer(r, "ipc://%s/control" % rts[r], logs[r], outs[r]),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    for r in range(2)]
        numel, said = 0, ""
        for p in trainers:
            out, err = p.communicate(timeout=7200)
            if p.returncode != 0:
                sys.exit("buckets: a trainer failed: %s" % err)
            numel, said = int(re.search(r"N=(\d+)", out).group(1)), out
        last = status(build, rts[0])
    finally:
        for d in daemons:
            d.terminate()
        for d in daemons:
            d.wait(60)
    rows = []
    for path in logs:
        with open(path) as f:
            rows.append(list(csv.DictReader(f)))
    phases = last.get("phases_s") or {}
    print("buckets: %s: rank 0's last step: %s" % (tag, ", ".join(
        "%s %.1f ms" % (k, 1e3 * v) for k, v in phases.items()
        if isinstance(v, float) and k != "early_tensors")), file=sys.stderr)
    return {"rows": rows, "params": [open(o, "rb").read() for o in outs], "n": numel,
            "said": said,
            "early_pack_ms": 1e3 * (phases.get("early_pack") or 0.0),
            "early_tensors": phases.get("early_tensors") or 0,
            "early_chunks": "%s of %s" % (phases.get("early_chunks"), phases.get("chunks")),
            "pack_ms": 1e3 * (phases.get("pack") or 0.0)}


def last_poster(rows, key="step_ms"):
    """Per step from the third: the trainer that posted last waits only for
    the step itself; the other one's wait includes the time until that last
    post."""
    return [min(float(rows[r][k][key]) for r in range(2)) for k in range(2, len(rows[0]))]


def gpt_run(build, work, tag, corpus, model, link, bucketed, chunk=0):
    def trainer(r, endpoint, log, out):
        return [os.path.join(build, "client", "examples", "gpt_train"), "--endpoint", endpoint,
                "--corpus", corpus, "--seed", str(1 + 1000 * r), *model, "--log", log,
                "--out", out] + (["--buckets"] if bucketed else [])
    res = run(build, work, tag, link, trainer,
              ["--reduce-chunk", str(chunk)] if chunk else [])
    res["step_ms"] = statistics.median(last_poster(res["rows"]))
    return res


def torch_worker(a):
    """One torch trainer (--worker): torch_train's GPT through ScapeOptimizer
    with bucket_mb; per step the CSV row backward_ms, step_ms (inside
    step()), iter_ms; the parameters to --out."""
    import torch
    sys.path.insert(0, os.path.join(SOURCE, "client", "python"))
    sys.path.insert(0, os.path.join(SOURCE, "client", "examples"))
    import scape.torch
    import torch_train as tt
    torch.set_num_threads(1)  # two trainers on the machine's cores
    vocab, train, _ = tt.load_corpus(a.corpus)
    torch.manual_seed(1234)
    model = tt.GPT(vocab, a.seq, a.d, a.layers, a.heads)
    opt = scape.torch.ScapeOptimizer(model.named_parameters(), endpoint=a.endpoint, lr=1e-3,
                                     bucket_mb=a.bucket_mb, timeout_ms=600000)
    print("N=%d buckets=%d" % (sum(p.numel() for p in model.parameters()),
                               len(opt._handover.buckets) if opt._handover else 0), flush=True)
    with open(a.log, "w") as f:
        f.write("step,backward_ms,step_ms,iter_ms\n")
        for t in range(1, a.steps + 1):
            gen = torch.Generator().manual_seed(a.seed * 1000003 + t)
            x, y = tt.batch(train, a.batch, a.seq, gen, "cpu")
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = model(x, y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            f.write("%d,%.3f,%.3f,%.3f\n" % (t, 1e3 * (t2 - t1), 1e3 * (t3 - t2), 1e3 * (t3 - t0)))
    with torch.no_grad():
        torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tofile(a.out)
    opt.detach()


def torch_sweep(a, work, corpus):
    """--torch: the bucket size swept, rounds interleaved; per size the
    medians over steps 3..S of both trainers' backward and iteration and the
    last poster's step(); every size must end with the same parameters."""
    sizes = [float(v) for v in a.sizes.split(",")]
    res = {b: [] for b in sizes}

    def trainer_for(bucket_mb):
        def trainer(r, endpoint, log, out):
            return [sys.executable, os.path.abspath(__file__), "--worker", "--endpoint",
                    endpoint, "--corpus", corpus, "--seed", str(1 + r), "--bucket-mb",
                    str(bucket_mb), "--d", str(a.d), "--layers", str(a.layers), "--heads",
                    str(a.heads), "--seq", str(a.seq), "--batch", str(a.batch), "--steps",
                    str(a.steps), "--log", log, "--out", out]
        return trainer
    for k in range(a.repeat):
        for b in sizes:
            print("buckets: round %d, torch, bucket_mb %g ..." % (k + 1, b), file=sys.stderr)
            res[b].append(run(a.build, work, "t%d-%g" % (k, b), a.link, trainer_for(b)))
    ref = res[sizes[0]][0]["params"]
    for b in sizes:
        for r in res[b]:
            if r["params"] != ref or r["params"][0] != r["params"][1]:
                sys.exit("buckets: bucket_mb %g ended with other parameters than %g" %
                         (b, sizes[0]))

    def med(b, key, last=False):
        vals = []
        for r in res[b]:
            rows = r["rows"]
            vals += last_poster(rows, key) if last else \
                [float(rows[q][k][key]) for q in range(2) for k in range(2, len(rows[q]))]
        return statistics.median(vals)
    off = med(sizes[0], "iter_ms")
    lines = ["| bucket_mb | buckets | backward ms | step() ms (last poster) | iteration ms | "
             "iteration ratio to %g | packed early (rank 0, last step) |" % sizes[0],
             "|---|---|---|---|---|---|---|"]
    for b in sizes:
        lines.append("| %g | %s | %.1f | %.1f | %.1f | %.3f | %d |" % (
            b, re.search(r"buckets=(\d+)", res[b][0]["said"]).group(1), med(b, "backward_ms"),
            med(b, "step_ms", True), med(b, "iter_ms"), med(b, "iter_ms") / off,
            res[b][-1]["early_tensors"]))
    best = min(sizes, key=lambda b: med(b, "iter_ms"))
    print("2 daemons (host backend, sharded, scape rho 0.01), 1 torch trainer each "
          "(torch_train's GPT, N = %d: d %d, %d layers, batch %d x %d, 1 thread), %s, steps "
          "3..%d, %d round(s) interleaved; every size ended with the same parameters"
          % (res[sizes[0]][0]["n"], a.d, a.layers, a.batch, a.seq,
             "test hosts, links of %s" % a.link if a.link else "127.0.0.1", a.steps, a.repeat))
    print("\n".join(lines))
    print("shortest iteration: bucket_mb %g" % best)
    return lines


def main():
    if "--worker" in sys.argv[1:]:
        wp = argparse.ArgumentParser()
        wp.add_argument("--worker", action="store_true")
        for name in ("--endpoint", "--corpus", "--log", "--out"):
            wp.add_argument(name, required=True)
        for name in ("--seed", "--d", "--layers", "--heads", "--seq", "--batch", "--steps"):
            wp.add_argument(name, type=int, required=True)
        wp.add_argument("--bucket-mb", type=float, required=True)
        return torch_worker(wp.parse_args())
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--torch", action="store_true",
                    help="torch trainers (ScapeOptimizer), the bucket size swept")
    ap.add_argument("--sizes", default="0,0.25,1,4,16",
                    help="--torch: the bucket_mb values, the first one the reference")
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=1, help="rounds of (whole, bucketed)")
    ap.add_argument("--link", help="run the daemons on test hosts with links of this rate")
    ap.add_argument("--chunk", type=int, default=1 << 20,
                    help="the third run's reduce_chunk, coordinates (0: no third run)")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    if a.steps < 4:
        sys.exit("buckets: --steps must be at least 4 (steps 3.. are measured)")
    os.environ.setdefault("SCAPE_BUILD_DIR", os.path.abspath(a.build))  # the torch workers'
    work = tempfile.mkdtemp(prefix="scape-bench-buckets-")
    corpus = os.path.join(work, "fortunes.txt")
    subprocess.run(["bash", os.path.join(SOURCE, "client", "examples", "fortunes-corpus.sh"),
                    corpus], check=True, capture_output=True)
    if a.link:
        hosts("up", "2", "--rate", a.link)
    try:
        lines = torch_sweep(a, work, corpus) if a.torch else gpt_compare(a, work, corpus)
    finally:
        if a.link:
            hosts("down")
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    shutil.rmtree(work, ignore_errors=True)


def gpt_compare(a, work, corpus):
    """gpt_train, the whole hand-over against --buckets (a layer at a time)."""
    model = ["--d", str(a.d), "--layers", str(a.layers), "--heads", str(a.heads), "--ctx",
             str(a.seq), "--seq", str(a.seq), "--batch", str(a.batch), "--steps",
             str(a.steps), "--lr", "1e-3", "--lr-warmup", "2"]
    runs = [("whole", False, 0), ("bucketed", True, 0)]
    if a.chunk:
        runs.append(("chunked", True, a.chunk))
    res = {name: [] for name, _, _ in runs}
    for k in range(a.repeat):
        for name, bucketed, chunk in runs:
            print("buckets: round %d, %s hand-over ..." % (k + 1, name), file=sys.stderr)
            res[name].append(gpt_run(a.build, work, "r%d-%s" % (k, name), corpus, model, a.link,
                                     bucketed, chunk))
    for k in range(a.repeat):
        for name, _, _ in runs:
            if res[name][k]["params"] != res["whole"][k]["params"] or \
                    res[name][k]["params"][0] != res[name][k]["params"][1]:
                sys.exit("buckets: %s parameters differ from the whole hand-over's" % name)
    whole = statistics.median(r["step_ms"] for r in res["whole"])
    lines = [
        "| hand-over | step posted to parameters ready, ms (median) | ratio to whole | "
        "packed early (last step, rank 0) | chunks reduced early (last step, rank 0) | "
        "early pack ms | pack at the step ms |",
        "|---|---|---|---|---|---|---|",
    ]
    label = {"whole": "whole (all gradients with the step)",
             "bucketed": "bucketed (--buckets: a layer at a time)",
             "chunked": "bucketed, reduce_chunk %d" % a.chunk}
    for name, bucketed, chunk in runs:
        ms = statistics.median(r["step_ms"] for r in res[name])
        lines.append("| %s | %.1f | %.3f | %d tensors | %s | %s | %.1f |" % (
            label[name], ms, ms / whole, res[name][-1]["early_tensors"],
            res[name][-1]["early_chunks"] if chunk else "-",
            "%.1f" % statistics.median(r["early_pack_ms"] for r in res[name]) if bucketed
            else "-", statistics.median(r["pack_ms"] for r in res[name])))
    print("2 daemons (host backend, sharded, scape rho 0.01), 1 gpt_train each, N = %d "
          "(d %d, %d layers), batch %d x %d, %s, steps 3..%d, %d round(s)"
          % (res["whole"][0]["n"], a.d, a.layers, a.batch, a.seq, "test hosts, links of %s" % a.link if a.link
             else "127.0.0.1", a.steps, a.repeat))
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
