#!/usr/bin/env python3
"""torch_scape - the Python binding's CUDA path against a real scaped, with
nothing but torch and numpy (the GPU machine has no pyzmq or Check):

  1. scape.attach(device="cuda") hands over torch CUDA tensors over
     libscape's IPC buffers (float32 and bfloat16), at the addresses it
     reports;
  2. ScapeOptimizer on CUDA against the same run on the CPU: two trainers
     with fixed, different gradients (one written into .grad in place, one
     assigned), float32 and bfloat16 parameters (float32 master weights in
     the daemon); the host executor with two CPU trainers is the reference,
     and the daemon's own executor (cuda on a GPU machine) with a CPU and a
     CUDA trainer, and with two CUDA trainers, must give the same bits at
     every one of 20 steps.

Usage: torch_scape.py --daemon PATH/scaped --lib PATH/libscape.so [--log FILE]
                      [--cpu-check]  (every run on the CPU: the script's own logic)
Prints "torch_scape: PASS ..." and exits 0, "SKIP: ..." and 77 without a
usable torch/CUDA, or "torch_scape: FAIL ..." and 1.  The two checks are also
tests/integration/test_python.py's CUDA tests (where pyzmq and pytest exist).
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time


class Failed(AssertionError):
    """A check did not hold (pytest reports it as a failed assertion)."""


def fail(msg):
    raise Failed(msg)


def start(daemon, rt, log, *args):
    proc = subprocess.Popen([daemon, "--runtime-dir", rt, *args], stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.time() + 20
    while not os.path.exists(os.path.join(rt, "control")):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            proc.wait()
            fail("scaped did not start (see the log)")
        time.sleep(0.05)
    return proc


def stop(proc):
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        fail("scaped did not stop on SIGTERM")


def check_session_tensors(torch, scape, endpoint, dtype):
    """One daemon per dtype: a node's trainers must share their dtypes."""
    want = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    with scape.attach(endpoint, [("w", 1000), ("b", 3)], dtype=dtype, device="cuda") as s:
        for t, ptr in zip((s.params, s.grads), s.device_ptrs):
            if not (t.is_cuda and t.dtype == want and t.numel() == 1003 and
                    t.data_ptr() == ptr):
                fail("%s session: %s tensor of %d on %s at %#x, libscape says %#x" %
                     (dtype, t.dtype, t.numel(), t.device, t.data_ptr(), ptr))
        s.params.fill_(1.5)
        if float(s.params.float().sum()) != 1.5 * 1003:
            fail("%s session: writing the device buffer did not read back" % dtype)


def threads(fns):
    """Run fns at once; the first exception any raised is raised here."""
    errs = []

    def wrap(f, i):
        try:
            f()
        except Exception as e:  # noqa: BLE001 - reported below
            errs.append("trainer %d: %s: %s" % (i, type(e).__name__, e))

    ts = [threading.Thread(target=wrap, args=(f, i)) for i, f in enumerate(fns)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    if errs:
        fail("; ".join(errs))


def train(torch, scape_torch, endpoint, devices, dtype, steps):
    """Two ScapeOptimizer trainers on one daemon, one per device of
    `devices`, each a small two-layer model in `dtype` from the same seed.
    Their gradients are fixed numbers made on the CPU (trainer i's differ
    from the other's), not backward's: a CUDA and a CPU backward need not
    agree bitwise, the hand-over must.  Trainer 0 writes them into .grad in
    place, trainer 1 assigns a fresh tensor (step() copies it into the
    daemon's buffer on the current stream).  Returns every step's
    parameters of both trainers, as float32 on the CPU."""
    models = []
    for dev in devices:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
        models.append(m.to(device=dev, dtype=dtype))
    opts = [None, None]

    def make(i):
        opts[i] = scape_torch.ScapeOptimizer(models[i].named_parameters(),
                                             endpoint=endpoint, lr=0.05, index=i)

    threads([lambda i=i: make(i) for i in (0, 1)])
    history = []
    try:
        for step in range(1, steps + 1):
            for i, (m, dev) in enumerate(zip(models, devices)):
                gen = torch.Generator().manual_seed(1000 * step + i)
                for p in m.parameters():
                    g = (0.1 * torch.randn(p.shape, generator=gen)).to(device=dev,
                                                                         dtype=dtype)
                    if i == 0:
                        p.grad.copy_(g)
                    else:
                        p.grad = g
            threads([o.step for o in opts])
            history.append([[p.detach().float().cpu().clone() for p in m.parameters()]
                            for m in models])
        for i, (o, dev) in enumerate(zip(opts, devices)):
            if o.last_info.step != steps:
                fail("trainer %d: last step %d, want %d" % (i, o.last_info.step, steps))
            if dev == "cuda" and not (o.session.params.is_cuda and
                                      o.session.params.data_ptr() == o.session.device_ptrs[0]):
                fail("trainer %d's parameters are not libscape's device buffer" % i)
    finally:
        for o in opts:
            if o is not None:
                o.detach()
    return history


def compare(what, got, want):
    """Both trainers of every step of got against want's trainer 0, bitwise."""
    for step, (g, w) in enumerate(zip(got, want), 1):
        for i, params in enumerate(g):
            for j, (a, b) in enumerate(zip(params, w[0])):
                if not torch_equal(a, b):
                    fail("%s: step %d, trainer %d, parameter %d differs from the "
                         "host-executor run with two CPU trainers: %s vs %s"
                         % (what, step, i, j, a.flatten()[:4], b.flatten()[:4]))


def torch_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and \
        a.numpy().tobytes() == b.numpy().tobytes()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--daemon", required=True)
    ap.add_argument("--lib", required=True)
    ap.add_argument("--log", default=os.devnull)
    ap.add_argument("--cpu-check", action="store_true",
                    help="every run on the CPU (host executor): the script's own logic")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("SKIP: torch is not importable")
        sys.exit(77)
    if not torch.cuda.is_available() and not a.cpu_check:
        print("SKIP: torch sees no CUDA device")
        sys.exit(77)
    os.environ["SCAPE_LIB"] = os.path.abspath(a.lib)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "client", "python"))
    import scape
    import scape.torch

    work = tempfile.mkdtemp(prefix="scape-torch-")
    try:
        run(a, torch, scape, work)
    except Failed as e:
        print("torch_scape: FAIL: %s" % e)
        sys.exit(1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.cpu_check:
        print("torch_scape: PASS (--cpu-check): three host-executor runs of the two-trainer "
              "check agree bitwise at each of 20 steps, float32 and bfloat16 (torch %s)"
              % torch.__version__)
        return
    print("torch_scape: PASS: CUDA sessions are torch tensors (float32, bfloat16); "
          "ScapeOptimizer trainers on CUDA (one beside a CPU trainer, and two) equal the "
          "host executor's run with two CPU trainers bitwise at each of 20 steps, float32 "
          "and bfloat16 parameters, fixed gradients (torch %s)" % torch.__version__)


def run(a, torch, scape, work, steps=20):
    with open(a.log, "w") as log:
        for dtype in () if a.cpu_check else ("float32", "bfloat16"):
            rt = os.path.join(work, "rt-" + dtype)
            d = start(a.daemon, rt, log)
            try:
                check_session_tensors(torch, scape, "ipc://%s/control" % rt, dtype)
            finally:
                stop(d)
        engine = ["--rho", "0.5", "--warmup", "5", "--trainers", "2"]
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            runs = {}
            # the reference: the host executor, both trainers in shared memory;
            # then the daemon's own choice (cuda on a GPU machine) with a CPU
            # and a CUDA trainer, and with two CUDA trainers
            plan = (("ref", "host", ("cpu", "cpu")), ("mixed", "auto", ("cpu", "cuda")),
                    ("cuda", "auto", ("cuda", "cuda")))
            if a.cpu_check:  # the script's own check where there is no GPU
                plan = (("ref", "host", ("cpu", "cpu")), ("mixed", "host", ("cpu", "cpu")),
                        ("cuda", "host", ("cpu", "cpu")))
            for key, executor, devices in plan:
                rt = os.path.join(work, "rt-%s-%s" % (name, key))
                d = start(a.daemon, rt, log, *engine, "--executor", executor)
                try:
                    runs[key] = train(torch, scape.torch, "ipc://%s/control" % rt, devices,
                                      dtype, steps)
                finally:
                    stop(d)
            compare("%s, a CPU and a CUDA trainer" % name, runs["mixed"], runs["ref"])
            compare("%s, two CUDA trainers" % name, runs["cuda"], runs["ref"])
            compare("%s, the reference's own trainers" % name, runs["ref"], runs["ref"])


if __name__ == "__main__":
    main()
