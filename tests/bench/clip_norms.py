"""How often max_grad_norm clips, by each measure (docs/algorithm.md,
"Gradient clipping"): a small character-level MLP (embedding, 2 layers)
through ScapeOptimizer, one scaped (rho 0.01, W = 10), one trainer, so the
reported mean_grad_norm is exactly torch's.  Prints the steps after the
warm-up that the daemon clipped, those torch's clip_grad_norm_ would have
clipped (mean_grad_norm > C), the median of both norms and the last 20
steps' mean loss.  A benchmark: it prints figures and never fails on them.

usage: SCAPE_BUILD_DIR=build /usr/bin/python3 tests/bench/clip_norms.py
           --corpus FILE [--clip-norm sent|gradient] [--max-grad-norm C]
           [--steps S]
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
import torch  # noqa: E402
import scape  # noqa: E402
import scape.torch  # noqa: E402,F401

V, D, CTX, BATCH, WARMUP = 64, 64, 8, 32, 10


def start_daemon(rt, args):
    build = os.environ.get("SCAPE_BUILD_DIR", os.path.join(ROOT, "build"))
    log = open(os.path.join(rt, "scaped.log"), "w")
    d = subprocess.Popen([os.path.join(build, "daemon", "scaped"), "--runtime-dir",
                          os.path.join(rt, "rt"), "--rho", "0.01", "--warmup", str(WARMUP),
                          "--max-grad-norm", str(args.max_grad_norm), "--clip-norm",
                          args.clip_norm], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 15
    while not os.path.exists(os.path.join(rt, "rt", "control")):
        if d.poll() is not None or time.time() > deadline:
            sys.exit("clip_norms: scaped did not start; see %s/scaped.log" % rt)
        time.sleep(0.05)
    return d


def train(endpoint, corpus, steps):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(V, D)
    net = torch.nn.Sequential(torch.nn.Linear(CTX * D, 256), torch.nn.GELU(),
                              torch.nn.Linear(256, V))
    model = torch.nn.ModuleDict({"emb": emb, "net": net})
    with open(corpus, "rb") as f:
        data = torch.tensor([b % V for b in f.read(2_000_000)])
    gen = torch.Generator().manual_seed(1)
    opt = scape.torch.ScapeOptimizer(model.named_parameters(), endpoint=endpoint, lr=3e-3)
    rows = []
    try:
        for _ in range(steps):
            ix = torch.randint(0, len(data) - CTX - 1, (BATCH,), generator=gen)
            x = torch.stack([data[i:i + CTX] for i in ix])
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(emb(x).flatten(1)), data[ix + CTX])
            loss.backward()
            opt.step()
            i = opt.last_info
            rows.append((i.grad_norm, i.mean_grad_norm, i.clip, float(loss)))
    finally:
        opt.detach()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--clip-norm", default="sent", choices=["sent", "gradient"])
    ap.add_argument("--max-grad-norm", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    rt = tempfile.mkdtemp(prefix="scape-clip-")
    d = start_daemon(rt, args)
    try:
        rows = train("ipc://%s/rt/control" % rt, args.corpus, args.steps)
    finally:
        d.terminate()
        d.wait(20)
        shutil.rmtree(rt, ignore_errors=True)
    after = rows[WARMUP:]
    print("clip_norm %s, max_grad_norm %g: clipped %d of %d steps after the warm-up; "
          "torch's norm above the bound on %d; median grad_norm %.4f, mean_grad_norm %.4f; "
          "loss (last 20) %.4f" % (
              args.clip_norm, args.max_grad_norm, sum(r[2] < 1 for r in after), len(after),
              sum(r[1] > args.max_grad_norm for r in after),
              statistics.median(r[0] for r in after), statistics.median(r[1] for r in after),
              statistics.mean(r[3] for r in rows[-20:])))


if __name__ == "__main__":
    main()
