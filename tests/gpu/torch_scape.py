#!/usr/bin/env python3
"""torch_scape - the Python binding's CUDA path against a real scaped, with
nothing but torch and numpy (the GPU machine has no pyzmq or Check):

  1. scape.attach(device="cuda") hands over torch CUDA tensors over
     libscape's IPC buffers (float32 and bfloat16), at the addresses it
     reports;
  2. two ScapeOptimizer trainers on one daemon, one torch.nn.Linear on the
     CPU (shared memory) and one on the GPU (CUDA IPC), the same data: after
     every one of 20 steps both hold the same parameters, bit for bit.

Usage: torch_scape.py --daemon PATH/scaped --lib PATH/libscape.so [--log FILE]
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


def check_optimizers(torch, scape_torch, endpoint, steps=20):
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    y = x @ torch.randn(8, 1)
    models = [torch.nn.Linear(8, 1), torch.nn.Linear(8, 1).cuda()]
    opts, errs = [None, None], []

    def make(i):
        try:
            opts[i] = scape_torch.ScapeOptimizer(models[i].named_parameters(),
                                                 endpoint=endpoint, lr=0.05, index=i)
        except Exception as e:  # reported below
            errs.append("trainer %d: %s" % (i, e))

    ts = [threading.Thread(target=make, args=(i,)) for i in (0, 1)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    if errs:
        fail("; ".join(errs))
    try:
        for step in range(1, steps + 1):
            for m, o in zip(models, opts):
                o.zero_grad()
                dev = m.weight.device
                torch.nn.functional.mse_loss(m(x.to(dev)), y.to(dev)).backward()
            ws = [threading.Thread(target=o.step) for o in opts]
            [w.start() for w in ws]
            [w.join() for w in ws]
            a, b = models[0].weight.detach(), models[1].weight.detach().cpu()
            if not torch.equal(a, b):
                fail("step %d: the CPU and the CUDA trainer differ: %s vs %s" % (step, a, b))
        s = opts[1].session
        if not (models[1].weight.is_cuda and s.params.is_cuda and
                s.params.data_ptr() == s.device_ptrs[0]):
            fail("the CUDA trainer's parameters are not libscape's device buffer")
        if opts[1].last_info.step != steps:
            fail("last step %d, want %d" % (opts[1].last_info.step, steps))
    finally:
        for o in opts:
            o.detach()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--daemon", required=True)
    ap.add_argument("--lib", required=True)
    ap.add_argument("--log", default=os.devnull)
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("SKIP: torch is not importable")
        sys.exit(77)
    if not torch.cuda.is_available():
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
    print("torch_scape: PASS: CUDA sessions are torch tensors (float32, bfloat16); a CUDA "
          "and a CPU ScapeOptimizer agree bitwise for 20 steps (torch %s)" % torch.__version__)


def run(a, torch, scape, work):
    with open(a.log, "w") as log:
        for dtype in ("float32", "bfloat16"):
            rt = os.path.join(work, "rt-" + dtype)
            d = start(a.daemon, rt, log)
            try:
                check_session_tensors(torch, scape, "ipc://%s/control" % rt, dtype)
            finally:
                stop(d)
        rt = os.path.join(work, "rt-optimizers")
        d = start(a.daemon, rt, log, "--rho", "0.5", "--warmup", "5", "--trainers", "2")
        try:
            check_optimizers(torch, scape.torch, "ipc://%s/control" % rt)
        finally:
            stop(d)


if __name__ == "__main__":
    main()
