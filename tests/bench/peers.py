#!/usr/bin/env python3
"""peers.py - the example GPT trained by 4 trainers on 4 test hosts (--world), side by
side with what a user would otherwise pick: PyTorch DDP (gloo) with dense
AdamW, DDP with the PowerSGD hook (ranks 1 and 4) with AdamW, and scaped
(dense AdamS, SCAPE at rho 0.1 and 0.01) through scape.torch.ScapeOptimizer.

Every run uses the model, corpus split, data order (trainer r draws its
batches from seed 1 + r, step by step), learning-rate schedule and fixed
validation windows of client/examples/torch_train.py, imported from it.
Each trainer runs on its own host (deploy/hosts.sh: network namespaces, tbf
links of the given rates); under scaped each host runs its daemon too
(scape-run, auth secret). For every run the benchmark reports:

  - bytes per step per host, read from the hosts' interface counters (tx,
    mean over hosts, everything the run sent: gloo, the daemons, handshakes);
  - wall time per step (training only: the evaluations are left out);
  - validation loss at every evaluation, on rank 0's model;
  - the training time each run needed to reach a few validation-loss levels.

Each optimizer family runs at every learning rate of --lrs and is reported at
its best final validation loss; --lr-for runs the named ones at one rate each
instead (the best of a shorter grid, where the full grid at many steps would
take hours). With --results, the figures are written after every run, so a
failure part-way loses nothing already run. A benchmark: it prints figures
and passes or fails on nothing but the runs themselves. Needs root
(namespaces), torch.

usage: tests/bench/peers.py BUILD_DIR [--rates 100mbit,10mbit|calibrated] [--steps N]
           [--lrs 1e-3,3e-3] [--lr-for RUN=LR,...]
           [--runs adamw,psgd1,psgd3,psgd4,adams,scape0.1,scape0.01,scape0.1s,scape0.13s,
                   scape0.1b,scape0.01b] [--calibrate-steps S]
           [--eval-every E] [--time-rates 1gbit,10mbit] [--time-steps S]
           [--markdown FILE] [--plot FILE.svg] [--results FILE.json]
       tests/bench/peers.py --replot FILE.json [--markdown FILE] [--plot FILE.svg]
   --time-rates: after the full runs (at the first of --rates), each run again
   for S steps at its best learning rate on links of each of these rates, for
   the step times there; the time to each loss level at such a rate is then
   derived (the full run's steps, timed as measured at that rate), and the
   crossover link rate is fitted through all of them against 1/rate.
   --rates calibrated: first dense AdamS for S steps on unlimited links, whose
   compute per step (its step less the optimizer's part) and bytes per step
   give the rate at which it spends 82% of its step communicating (the SCAPE
   paper's dense AdamS at 64 GPUs); the runs then use that rate.
   (worker mode, run by the benchmark itself on each host: peers.py --worker ...)
"""
import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
HOSTS_SH = os.path.join(ROOT, "deploy", "hosts.sh")
WORLD = 4  # hosts, a trainer on each: --world
PORT = 29600

RUNS = {  # name: (family, settings)
    "adamw": ("ddp", {"powersgd": 0}),
    "psgd1": ("ddp", {"powersgd": 1}),
    "psgd3": ("ddp", {"powersgd": 3}),
    "psgd4": ("ddp", {"powersgd": 4}),
    "adams": ("scaped", {"optimizer": "adams"}),
    "scape0.1": ("scaped", {"optimizer": "scape", "rho": "0.1"}),
    "scape0.01": ("scaped", {"optimizer": "scape", "rho": "0.01"}),
    # the GPT's norms and biases (at most 256 coordinates) whole every step,
    # as PowerSGD leaves them, and masks as deltas
    "scape0.1s": ("scaped", {"optimizer": "scape", "rho": "0.1", "dense_below": "256",
                             "mask_deltas": "true"}),
    "scape0.13s": ("scaped", {"optimizer": "scape", "rho": "0.13", "dense_below": "256",
                              "mask_deltas": "true"}),
    # and the gathers carrying each parameter's change in bf16 (4 bytes a
    # value instead of 6 with fp32 trainers)
    "scape0.16sg": ("scaped", {"optimizer": "scape", "rho": "0.16", "dense_below": "256",
                               "mask_deltas": "true", "gather_values": "delta"}),
    "scape0.2sg": ("scaped", {"optimizer": "scape", "rho": "0.2", "dense_below": "256",
                              "mask_deltas": "true", "gather_values": "delta"}),
    # bucketed hand-over (ScapeOptimizer(bucket_mb=), a trainer setting):
    # buckets of about 0.1 MB, five of them in the example GPT
    "scape0.1b": ("scaped", {"optimizer": "scape", "rho": "0.1", "bucket_mb": "0.1"}),
    "scape0.01b": ("scaped", {"optimizer": "scape", "rho": "0.01", "bucket_mb": "0.1"}),
}
LABEL = {"adamw": "DDP AdamW (dense)", "psgd1": "DDP PowerSGD rank 1 + AdamW",
         "psgd3": "DDP PowerSGD rank 3 + AdamW", "psgd4": "DDP PowerSGD rank 4 + AdamW",
         "adams": "scaped dense AdamS",
         "scape0.1": "scaped SCAPE rho 0.1", "scape0.01": "scaped SCAPE rho 0.01",
         "scape0.1s": "scaped SCAPE rho 0.1, small tensors whole, mask deltas",
         "scape0.13s": "scaped SCAPE rho 0.13, small tensors whole, mask deltas",
         "scape0.16sg": "scaped SCAPE rho 0.16, small whole, mask deltas, gathers of changes",
         "scape0.2sg": "scaped SCAPE rho 0.2, small whole, mask deltas, gathers of changes",
         "scape0.1b": "scaped SCAPE rho 0.1, bucketed hand-over",
         "scape0.01b": "scaped SCAPE rho 0.01, bucketed hand-over"}
SHARE = 0.82  # --rates calibrated: dense AdamS's share of its step communicating
WARMUP = 10  # PowerSGD's vanilla all-reduce steps = SCAPE's dense warm-up


# ---- worker: one trainer ----------------------------------------------------

def worker(a):
    import torch
    sys.path.insert(0, os.path.join(ROOT, "client", "examples"))
    import torch_train as tt
    torch.set_num_threads(1)
    vocab, train, val = tt.load_corpus(a.corpus)
    torch.manual_seed(1234)  # torch_train's --model-seed
    model = tt.GPT(vocab, a.ctx, a.d, a.layers, a.heads)
    groups = tt.param_groups(model, a.weight_decay)
    if a.family == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo", init_method="tcp://%s" % a.master, rank=a.rank,
                                world_size=a.world)
        net = DDP(model)
        if a.powersgd:
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=a.powersgd,
                                       start_powerSGD_iter=WARMUP, use_error_feedback=True,
                                       warm_start=True)
            net.register_comm_hook(state, psgd.powerSGD_hook)
        opt = torch.optim.AdamW([{"params": [p for _, p in g["params"]],
                                  "weight_decay": g["weight_decay"]} for g in groups],
                                lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
        step = lambda loss: opt.step()  # noqa: E731
    else:
        import scape.torch
        net = model
        opt = scape.torch.ScapeOptimizer(groups, lr=a.lr,
                                         max_grad_norm=a.max_grad_norm or None,
                                         bucket_mb=a.bucket_mb)
        step = lambda loss: opt.step(lambda: loss)  # noqa: E731
    targs = argparse.Namespace(lr=a.lr, lr_warmup=a.lr_warmup, steps=a.steps)
    nograd = lambda: torch.autocast(device_type="cpu", enabled=False)  # noqa: E731
    trained, curve, step_s, step_tx, opt_s = 0.0, [], [], [], []

    def tx():  # this host's interface (the worker runs in its namespace)
        try:
            with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
                return int(f.read())
        except (OSError, ValueError):
            return None
    for t in range(1, a.steps + 1):
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed((1 + a.rank) * 1000003 + t)
        x, y = tt.batch(train, a.batch, a.ctx, gen, "cpu")
        opt.zero_grad()
        loss = net(x, y)
        loss.backward()
        if a.family == "ddp" and a.max_grad_norm:
            # DDP's .grad is the all-reduced mean by now: the norm torch clips
            # is the global one, as the daemon's max_grad_norm clips its g_hat
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.max_grad_norm)
        for g in opt.param_groups:
            g["lr"] = tt.lr_at(targs, t)
        t1 = time.perf_counter()
        step(loss)
        opt_s.append(time.perf_counter() - t1)  # the optimizer step's part of it
        step_s.append(time.perf_counter() - t0)
        step_tx.append(tx())
        trained += step_s[-1]
        if a.rank == 0 and (t % a.eval_every == 0 or t == a.steps):
            curve.append((t, trained, tt.evaluate(model, val, a.ctx, a.eval_windows, "cpu",
                                                  nograd)))
    if a.rank == 0:
        with open(a.out, "w") as f:
            json.dump({"curve": curve, "train_s": trained, "step_s": step_s,
                       "step_tx": step_tx, "opt_s": opt_s}, f)
    if a.family == "ddp":
        import torch.distributed as dist
        dist.barrier()  # nobody leaves while another still talks to it
        sys.stdout.flush()
        # gloo's threads can abort the interpreter's own teardown ("terminate
        # called without an active exception", seen here): the work is done
        os._exit(0)
    opt.detach()


# ---- the benchmark ------------------------------------------------------------

def calibrate(a, work, key, port):
    """--rates calibrated: dense AdamS through scaped for --calibrate-steps
    steps on unlimited links of the test hosts; its compute per step is the
    step's time less its optimizer step (median over the steps after the
    tenth), its bytes the interface's tx per host per step; the rate is the
    one at which those bytes take SHARE / (1 - SHARE) of that compute, as the
    SCAPE paper's dense AdamS spends 82% of its step communicating at 64
    GPUs.  Returns the rate in tc's units and the derivation."""
    hosts(a.hosts, "up", str(a.world), "--rate", "none")
    try:
        res = one_run(a, "adams", "unlimited", a.lrs[0], work, key, port, a.calibrate_steps)
    finally:
        hosts(a.hosts, "down")
    skip = min(10, len(res["step_s"]) // 2)
    comp = sorted(t - o for t, o in zip(res["step_s"][skip:], res["opt_s"][skip:]))
    c = comp[len(comp) // 2]
    comm = c * SHARE / (1.0 - SHARE)
    kbit = max(1, int(round(8.0 * res["tx_per_step"] / comm / 1e3)))
    why = ("calibrated link: dense AdamS computes %.1f ms a step (%d steps on unlimited links) "
           "and sends %.0f B a step per host; to spend %.0f%% of its step communicating (the "
           "SCAPE paper's dense AdamS at 64 GPUs) that takes %.1f ms: %.2f Mbit/s"
           % (1e3 * c, a.calibrate_steps, res["tx_per_step"], 100 * SHARE, 1e3 * comm,
              kbit / 1e3))
    return "%dkbit" % kbit, why


def hosts(name, *args):
    r = subprocess.run(["bash", HOSTS_SH, *args, "--name", name], capture_output=True,
                       text=True, timeout=120)
    if r.returncode != 0:
        sys.exit("peers: hosts.sh %s: %s" % (" ".join(args), r.stderr.strip()))


def tx_bytes(ns):
    r = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show", "eth0"],
                       capture_output=True, text=True, check=True, timeout=30)
    return json.loads(r.stdout)[0]["stats64"]["tx"]["bytes"]


def one_run(a, name, rate, lr, work, key, port, steps=None):
    family, settings = RUNS[name]
    steps = steps or a.steps
    out = os.path.join(work, "%s-%s-%g-%d.json" % (name, rate, lr, steps))
    common = ["--corpus", a.corpus, "--steps", str(steps), "--lr", str(lr),
              "--world", str(a.world), "--eval-every", str(a.eval_every if steps == a.steps else steps),
              "--family", family, "--out", out, "--max-grad-norm", str(a.max_grad_norm)]
    settings = dict(settings)
    if family == "ddp":
        common += ["--powersgd", str(settings["powersgd"])]
    if "bucket_mb" in settings:  # the trainer's, not the daemon's
        common += ["--bucket-mb", settings.pop("bucket_mb")]
    procs, logs = [], []
    before = [tx_bytes("%s-h%d" % (a.hosts, r)) for r in range(a.world)]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1",
               PYTHONPATH=os.path.join(ROOT, "client", "python"), SCAPE_BUILD_DIR=a.build)
    for r in range(a.world):
        me = [sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(r),
              "--master", "10.231.0.1:%d" % port, *common]
        if family == "scaped":
            sets = ["--set", "mode=sharded", "--set", "auth=secret", "--set",
                    "auth_key_file=" + key, "--set", "warmup=%d" % WARMUP,
                    "--set", "comm_timeout_ms=600000", "--set", "log_level=warn",
                    "--set", "max_grad_norm=%g" % a.max_grad_norm]
            for k, v in settings.items():
                sets += ["--set", "%s=%s" % (k, v)]
            me = [sys.executable, "-m", "scape.run", "--nnodes", str(a.world), "--node-rank",
                  str(r), "--master-addr", "10.231.0.1", "--master-port", str(port),
                  "--listen-host", "10.231.0.%d" % (r + 1), "--nproc-per-node", "1",
                  "--scaped", os.path.join(a.build, "daemon", "scaped"), *sets, "--", *me]
        log = open(os.path.join(work, "%s-%s-%g-r%d.log" % (name, rate, lr, r)), "w")
        logs.append(log)
        procs.append(subprocess.Popen(["ip", "netns", "exec", "%s-h%d" % (a.hosts, r), *me],
                                      stdout=log, stderr=subprocess.STDOUT, env=env))
    deadline = time.time() + a.timeout
    try:
        for p in procs:
            p.wait(max(1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        sys.exit("peers: %s at %s, lr %g, took longer than %d s (logs in %s)" % (
            name, rate, lr, a.timeout, work))
    finally:  # a timeout, a signal: no trainer or daemon outlives the run
        for q in procs:  # scape-run passes SIGTERM on to its trainer and daemon
            if q.poll() is None:
                q.terminate()
        for q in procs:
            try:
                q.wait(15)
            except subprocess.TimeoutExpired:
                q.kill()
                q.wait()
    for log in logs:
        log.close()
    bad = [r for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        text = open(os.path.join(work, "%s-%s-%g-r%d.log" % (name, rate, lr, bad[0]))).read()
        sys.exit("peers: %s at %s, lr %g: trainer %d failed:\n%s" % (
            name, rate, lr, bad[0], text[-3000:]))
    after = [tx_bytes("%s-h%d" % (a.hosts, r)) for r in range(a.world)]
    with open(out) as f:
        res = json.load(f)
    res["tx_per_step"] = sum(b - c for b, c in zip(after, before)) / a.world / steps
    res["step_ms"] = 1e3 * res["train_s"] / steps
    res["final"] = res["curve"][-1][2]
    return res


def time_to(curve, level):
    """The step, and the training seconds, at which the validation loss gets
    to level: linear between the first evaluation at or below it and the
    one before (the loss is measured every --eval-every steps only); at the
    first evaluation itself when that is already there."""
    prev = None
    for t, s, v in curve:
        if v <= level:
            if prev is None or prev[2] <= v:
                return float(t), s
            f = (prev[2] - level) / (prev[2] - v)
            return prev[0] + f * (t - prev[0]), prev[1] + f * (s - prev[1])
        prev = (t, s, v)
    return None


def levels_of(a, best, rate):
    """The shared loss levels: what dense AdamS and PowerSGD rank 4 end at,
    and the highest final loss of all runs (a level every run reaches)."""
    levels = []
    if "adams" in a.runs:
        levels.append(("dense AdamS's final", best[rate, "adams"]["final"]))
    if "psgd4" in a.runs:
        levels.append(("PowerSGD rank 4's final", best[rate, "psgd4"]["final"]))
    worst = max(a.runs, key=lambda n: best[rate, n]["final"])
    levels.append(("every run's (%s's final)" % LABEL[worst], best[rate, worst]["final"]))
    return levels


def report(a, best, rates):
    lines = []
    for rate in rates:
        levels = levels_of(a, best, rate)
        lines.append("")
        fixed = getattr(a, "lr_for", {})
        lines.append("Links of %s, %d hosts, %d steps, each run at its best learning rate of %s%s:"
                     % (rate, a.world, a.steps, ", ".join("%g" % x for x in a.lrs),
                        "; at one fixed rate: " + ", ".join(
                            "%s %g" % (LABEL[n], v) for n, v in fixed.items()) if fixed else ""))
        lines.append("")
        head = ("| run | best lr | bytes/step/host (interface tx) | step ms (training) | "
                "val loss at " + ", ".join(str(t) for t, _, _ in best[rate, a.runs[0]]["curve"])
                + " | " + " | ".join("steps, s to %s (%.4f)" % (n, v) for n, v in levels) + " |")
        lines.append(head)
        lines.append("|" + "---|" * (4 + 1 + len(levels)))
        for name in a.runs:
            r = best[rate, name]
            cells = ["%s" % LABEL[name], "%g" % r["lr"], "%.0f" % r["tx_per_step"],
                     "%.1f" % r["step_ms"], " / ".join("%.4f" % v for _, _, v in r["curve"])]
            for _, v in levels:
                hit = time_to(r["curve"], v)
                cells.append("%.0f, %.1f s" % hit if hit else "not reached")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def derived_time(curve_run, timed, level):
    """Training seconds a run needs to reach level at a timed rate: the steps
    it took in the full run, timed as the short run at that rate measured
    them (its own steps, then the mean of its steps after the warm-up; the
    step count interpolated between evaluations, as time_to does)."""
    hit = time_to(curve_run["curve"], level)
    if not hit:
        return None
    n, st = hit[0], timed["step_s"]
    sparse = st[WARMUP:] or st
    mean = sum(sparse) / len(sparse)
    whole = int(n)
    return (sum(st[:whole]) + max(0, whole - len(st)) * mean +
            (n - whole) * (st[whole] if whole < len(st) else mean))


def fit_line(xs, ys):
    """Least squares y = p + q x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    q = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - q * mx, q


RATE_UNIT = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bps(rate):
    for u, f in RATE_UNIT.items():
        if rate.endswith(u):
            return float(rate[:-len(u)]) * f
    return float(rate)


def timing_report(a, best, main, timed, levels):
    """Step times at the other rates, the derived times to each level, and
    the crossover link rate, by a line fitted in 1/rate through them."""
    rates = [main] + a.time_rates
    lines = ["", "Step times at every link rate (the full runs at %s; at the others %d-step "
             "runs at each run's best learning rate), and the training time to each "
             "level: the steps the full run took, timed at that rate (derived):" % (
                 main, a.time_steps), ""]
    head = ("| run | link | bytes/step/host (all steps) | bytes/sparse step (host 0) | "
            "warm-up ms/step | sparse ms/step | " +
            " | ".join("s to %s" % n for n, _ in levels) + " |")
    lines += [head, "|" + "---|" * (6 + len(levels))]
    tt = {}
    for name in a.runs:
        for rate in rates:
            r = best[main, name] if rate == main else timed[rate, name]
            st = r["step_s"]
            warm, sparse = st[:WARMUP], st[WARMUP:] or st
            txs = r.get("step_tx") or []
            sparse_tx = ("%.0f" % ((txs[-1] - txs[WARMUP - 1]) / (len(txs) - WARMUP))
                         if len(txs) > WARMUP and None not in (txs[-1], txs[WARMUP - 1])
                         else "-")
            cells = [LABEL[name], rate, "%.0f" % r["tx_per_step"], sparse_tx,
                     "%.1f" % (1e3 * sum(warm) / max(1, len(warm))),
                     "%.1f" % (1e3 * sum(sparse) / len(sparse))]
            for ln, v in levels:
                d = derived_time(best[main, name], r, v)
                tt[name, rate, ln] = d
                cells.append("%.1f" % d if d is not None else "not reached")
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Crossover: the link rate below which a SCAPE run reaches the level in "
              "less training time than the peer (a line fitted through the times above "
              "against 1/rate; a projection outside %s..%s):" % (
                  min(rates, key=rate_bps), max(rates, key=rate_bps)), ""]
    lines += ["| SCAPE run | peer | level | crossover |", "|---|---|---|---|"]
    for sn in [n for n in a.runs if n.startswith("scape")]:
        for pn in [n for n in a.runs if not n.startswith("scape")]:
            for ln, _ in levels:
                pts = [(1 / rate_bps(r), tt[sn, r, ln], tt[pn, r, ln]) for r in rates]
                if any(s_ is None for _, s_, _ in pts):
                    cell = "SCAPE does not reach it"
                elif any(p_ is None for _, _, p_ in pts):
                    cell = "the peer does not reach it"
                else:
                    sp, sq = fit_line([x for x, _, _ in pts], [y for _, y, _ in pts])
                    pp, pq = fit_line([x for x, _, _ in pts], [y for _, _, y in pts])
                    if pq <= sq:
                        cell = ("SCAPE faster at every rate" if sp < pp else
                                "none: the peer is faster at every rate")
                    else:
                        x = (sp - pp) / (pq - sq)
                        cell = ("SCAPE faster at every rate" if x <= 0 else
                                "%.1f Mbit/s" % (1e-6 / x))
                lines.append("| %s | %s | %s | %s |" % (LABEL[sn], LABEL[pn], ln, cell))
    return lines


def plot(a, best, rates, path):
    """Validation loss against training time and against bytes sent per host,
    at each rate of the full runs (scape_plot: SVG, no plotting library)."""
    sys.path.insert(0, os.path.join(ROOT, "client", "examples"))
    import scape_plot
    panels = []
    for rate in rates:
        by_time, by_bytes = [], []
        for name in a.runs:
            r = best[rate, name]
            by_time.append((LABEL[name], [(s_, v) for _, s_, v in r["curve"]],
                            name.startswith("scape")))
            by_bytes.append((LABEL[name], [(math.log10(t * r["tx_per_step"]), v)
                                           for t, _, v in r["curve"]], name.startswith("scape")))
        panels.append(scape_plot.panel("links of %s: loss against time" % rate,
                                       "training wall time, s", "validation loss", by_time))
        panels.append(scape_plot.panel("links of %s: loss against bytes" % rate,
                                       "log10(bytes sent per host, interface)",
                                       "validation loss", by_bytes))
    scape_plot.write_svg(path, panels, width=560, height=360)
    print("peers: plot in %s" % path, file=sys.stderr)


def save_results(a, best, timed, rates, path):
    """Everything the report needs, to report again with --replot."""
    # only what has run: a file written part-way reports the runs done so far
    done = [n for n in a.runs if all((r, n) in best for r in rates)]
    timed_rates = [r for r in a.time_rates if all((r, n) in timed for n in done)]
    out = {"steps": a.steps, "lrs": a.lrs, "lr_for": a.lr_for, "runs": done, "rates": rates,
           "time_rates": timed_rates, "time_steps": a.time_steps, "eval_windows": a.eval_windows,
           "model": [a.d, a.layers, a.ctx, a.batch], "max_grad_norm": a.max_grad_norm,
           "world": a.world, "calibration": getattr(a, "calibration", None),
           "best": {"%s|%s" % k: v for k, v in best.items()},
           "timed": {"%s|%s" % k: v for k, v in timed.items()}}
    with open(path, "w") as f:
        json.dump(out, f)


def load_results(a, path):
    with open(path) as f:
        r = json.load(f)
    a.steps, a.lrs, a.runs = r["steps"], r["lrs"], r["runs"]
    a.lr_for = r.get("lr_for", {})
    a.time_rates, a.time_steps, a.eval_windows = r["time_rates"], r["time_steps"], r["eval_windows"]
    a.d, a.layers, a.ctx, a.batch = r["model"]
    a.max_grad_norm = r.get("max_grad_norm", 0.0)
    a.world, a.calibration = r.get("world", WORLD), r.get("calibration")
    split = lambda d: {tuple(k.split("|", 1)): v for k, v in d.items()}  # noqa: E731
    return split(r["best"]), split(r["timed"]), r["rates"]


def write_report(a, best, timed, rates, command):
    lines = ["peers.py: %d trainers on %d test hosts, torch_train.py's GPT (d %d, %d layers, "
             "ctx %d, batch %d per trainer), %d steps, eval on %d fixed windows, %s; "
             "command: %s" % (a.world, a.world, a.d, a.layers, a.ctx, a.batch, a.steps,
                              a.eval_windows,
                              "gradients clipped to a global norm of %g" % a.max_grad_norm
                              if a.max_grad_norm else "no gradient clipping",
                              command)] + report(a, best, rates)
    if getattr(a, "calibration", None):
        lines[1:1] = ["", a.calibration]
    if a.time_rates:
        lines += timing_report(a, best, rates[0], timed, levels_of(a, best, rates[0]))
    print("\n".join(lines))
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    if a.plot:
        plot(a, best, rates, a.plot)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("build", nargs="?")
    ap.add_argument("--rates", default="100mbit",
                    help="link rates (tc units), or 'calibrated': dense AdamS at 82%% of "
                         "its step communicating, from its compute measured first")
    ap.add_argument("--calibrate-steps", type=int, default=40)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--world", type=int, default=WORLD,
                    help="test hosts, one trainer (and under scaped one daemon) on each")
    ap.add_argument("--lrs", default="1e-3,3e-3")
    ap.add_argument("--lr-for", default="",
                    help="RUN=LR,...: these runs at this one rate instead of the grid "
                         "(the best of an earlier grid, for long runs)")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--timeout", type=int, default=3600, help="longest run, s")
    ap.add_argument("--time-rates", default="",
                    help="more link rates, each run timed there for --time-steps steps")
    ap.add_argument("--time-steps", type=int, default=60)
    ap.add_argument("--markdown")
    ap.add_argument("--plot", help="an SVG of loss against time and bytes")
    ap.add_argument("--results", help="write every run's figures here (JSON)")
    ap.add_argument("--replot", help="report again from a --results file, running nothing")
    # the model and the schedule: torch_train.py's defaults
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr-warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--max-grad-norm", type=float, default=0.0,
                    help="clip every run's global gradient norm to this (0: off): torch's "
                         "clip_grad_norm_ on DDP's reduced gradient, the daemon's max_grad_norm")
    # worker only
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--master")
    ap.add_argument("--corpus")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--family")
    ap.add_argument("--powersgd", type=int, default=0)
    ap.add_argument("--bucket-mb", type=float, default=0.0)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    if a.replot:
        best, timed, rates = load_results(a, a.replot)
        return write_report(a, best, timed, rates, "peers.py --replot %s" % a.replot)
    if not a.build:
        ap.error("BUILD_DIR is needed")
    if os.geteuid() != 0:
        sys.exit("peers: test hosts need root")
    a.build = os.path.abspath(a.build)
    a.runs = [r for r in a.runs.split(",") if r]
    for r in a.runs:
        if r not in RUNS:
            ap.error("unknown run %r (%s)" % (r, ", ".join(RUNS)))
    a.lrs = [float(x) for x in a.lrs.split(",")]
    try:
        a.lr_for = {n: float(v) for n, v in (x.split("=", 1) for x in a.lr_for.split(",") if x)}
    except ValueError:
        ap.error("--lr-for takes RUN=LR,... (e.g. adamw=3e-3,scape0.1=3e-3)")
    for n in a.lr_for:
        if n not in a.runs:
            ap.error("--lr-for names %r, which is not among --runs" % n)
    rates = a.rates.split(",")
    a.time_rates = [r for r in a.time_rates.split(",") if r]
    work = tempfile.mkdtemp(prefix="scape-peers-")
    a.corpus = os.path.join(work, "fortunes.txt")
    subprocess.run(["sh", os.path.join(ROOT, "client", "examples", "fortunes-corpus.sh"),
                    a.corpus], check=True)
    key = os.path.join(work, "job.key")
    subprocess.run([os.path.join(a.build, "daemon", "scaped"), "keygen", key], check=True,
                   capture_output=True)
    a.hosts = "peers%d" % os.getpid()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("peers: stopped (SIGTERM)"))
    best, timed, port, t0 = {}, {}, PORT, time.time()
    if "calibrated" in rates:
        port += 1
        rate, why = calibrate(a, work, key, port)
        print("peers: " + why, file=sys.stderr, flush=True)
        a.calibration = why
        rates = [rate if r == "calibrated" else r for r in rates]
    try:
        for rate in rates:
            hosts(a.hosts, "up", str(a.world), "--rate", rate)
            for name in a.runs:
                for lr in ([a.lr_for[name]] if name in a.lr_for else a.lrs):
                    port += 1
                    print("peers: %s at %s, lr %g ... (%.0f s so far)" % (
                        name, rate, lr, time.time() - t0), file=sys.stderr, flush=True)
                    res = one_run(a, name, rate, lr, work, key, port)
                    res["lr"] = lr
                    print("peers:   val %.4f, %.1f ms/step, %.0f B/step/host" % (
                        res["final"], res["step_ms"], res["tx_per_step"]), file=sys.stderr)
                    if (rate, name) not in best or res["final"] < best[rate, name]["final"]:
                        best[rate, name] = res
                    if a.results:  # a later failure loses nothing already run
                        save_results(a, best, timed, rates, a.results)
            hosts(a.hosts, "down")
        for rate in a.time_rates:  # step times only, at each run's best lr
            hosts(a.hosts, "up", str(a.world), "--rate", rate)
            for name in a.runs:
                port += 1
                lr = best[rates[0], name]["lr"]
                print("peers: timing %s at %s, lr %g ... (%.0f s so far)" % (
                    name, rate, lr, time.time() - t0), file=sys.stderr, flush=True)
                timed[rate, name] = one_run(a, name, rate, lr, work, key, port, a.time_steps)
                if a.results:
                    save_results(a, best, timed, rates, a.results)
            hosts(a.hosts, "down")
    finally:
        subprocess.run(["bash", HOSTS_SH, "down", "--name", a.hosts], capture_output=True)
    if a.results:
        save_results(a, best, timed, rates, a.results)
    write_report(a, best, timed, rates, " ".join(sys.argv))
    shutil.rmtree(work, ignore_errors=True)



if __name__ == "__main__":
    main()
