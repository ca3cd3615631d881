"""The Python binding against the real scaped: Python and C trainers in one
job matching the in-process engine bit for bit, numpy views that alias the
shared memory, errors, and the torch optimizer."""
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import SOURCE, binary, process_stopped, run_reference, run_trainer, synth_layout

sys.path.insert(0, os.path.join(SOURCE, "client", "python"))
import scape  # noqa: E402
import py_trainer  # noqa: E402
from scape._lib import lib  # noqa: E402

ENGINE = ["--rho", "0.01", "--warmup", "3"]
PY_TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "py_trainer.py")


def run_py_trainer(endpoint, index, n, steps, out, extra=()):
    cmd = [sys.executable, PY_TRAINER, "--endpoint", endpoint, "--index", str(index),
           "--n", str(n), "--steps", str(steps), "--out", out, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def shm_names():
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("scape-%d-" % os.getpid()))


def shm_mappings(pid):
    """{start address: shm name} of process pid's mappings of our deleted segments."""
    out = {}
    with open("/proc/%d/maps" % pid) as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/scape-"):
                name = parts[5].strip()
                assert name.endswith(" (deleted)"), name
                out[int(parts[0].split("-")[0], 16)] = name[len("/dev/shm/"):-len(" (deleted)")]
    return out


def test_python_and_c_trainers_match_in_process_engine(daemon_factory, tmp_path):
    n, steps = 20000, 60
    d = daemon_factory(*ENGINE, "--trainers", "4")
    outs = [str(tmp_path / ("t%d" % i)) for i in range(4)]
    procs = [run_py_trainer(d.endpoint, i, n, steps, outs[i]) if i % 2 == 0 else
             run_trainer(d.endpoint, i, n, steps, out=outs[i], wait=False) for i in range(4)]
    for i, p in enumerate(procs):
        o, e = p.communicate(timeout=300)
        assert p.returncode == 0, "trainer %d: %s %s" % (i, o, e)
    run_reference(str(tmp_path / "ref"), 4, n, steps, *ENGINE)
    with open(tmp_path / "ref", "rb") as f:
        ref = f.read()
    assert len(ref) == 4 * sum(t[2] for t in synth_layout(n))
    for i, path in enumerate(outs):
        with open(path, "rb") as f:
            assert f.read() == ref, "trainer %d differs from the engine" % i
    assert d.stop() == 0


def test_python_trainer_reposts_abandoned_step_and_joins_running_job(daemon_factory, tmp_path):
    n, steps = 4000, 150
    d = daemon_factory(*ENGINE, "--trainers", "2")
    a = run_py_trainer(d.endpoint, 0, n, steps, str(tmp_path / "a"))
    # b stops before posting step 5 and dies once a has posted it: mid-step
    b = run_trainer(d.endpoint, 1, n, steps, stop_before=5, wait=False)
    d.kill_mid_step(a.pid, b, 5)
    c = run_py_trainer(d.endpoint, 1, n, steps, str(tmp_path / "c"))
    errs = {}
    for name, p in (("a", a), ("c", c)):
        o, errs[name] = p.communicate(timeout=300)
        assert p.returncode == 0, name + o + errs[name]
    assert "abandoned" in errs["a"] and "posting again" in errs["a"], errs["a"]
    with open(tmp_path / "a", "rb") as fa, open(tmp_path / "c", "rb") as fc:
        assert fa.read() == fc.read(), "replicas differ after re-attach"
    assert d.stop() == 0


def test_abandoned_step_leaves_the_last_consistent_state(daemon_factory, tmp_path):
    """Trainer b dies after a has posted step 5; a holds its repost until the
    replacement c has posted step 5 too.  If the abandoned step left nothing
    behind, the job ends exactly where an uninterrupted one of a and b does
    (c computes b's gradients: same seed and index, same parameters)."""
    n, steps, kill_at = 4000, 30, 5
    d = daemon_factory(*ENGINE, "--trainers", "2")
    layout = synth_layout(n)
    b = run_trainer(d.endpoint, 1, n, steps, stop_before=kill_at, wait=False)
    synth = py_trainer.Synth(1, 0, layout)
    c = None
    try:
        with scape.attach(d.endpoint, layout, index=0) as s:
            s.params[:] = synth.init()
            s.sync()
            for t in range(s.next_step, steps + 1):
                s.grads[:] = synth.grads(t, s.params)
                s.step_begin(1e-2, step=t)
                if t != kill_at:
                    s.step_wait()
                    continue
                d.kill_mid_step(os.getpid(), b, kill_at)  # b stopped before posting it
                with pytest.raises(scape.ScapeError) as e:
                    s.step_wait()
                assert e.value.code == scape.Rc.REMOTE and "abandoned" in e.value.message
                c = run_trainer(d.endpoint, 1, n, steps, out=str(tmp_path / "c"), wait=False)
                deadline = time.time() + 60
                while not any(ti[3] == c.pid and ti[4] == t for ti in d.trainers()):
                    assert time.time() < deadline and c.poll() is None, "c never posted"
                    time.sleep(0.02)
                s.step(1e-2, step=t)
            a = s.params.tobytes()
        o, e = c.communicate(timeout=120)
        assert c.returncode == 0, o + e
        with open(tmp_path / "c", "rb") as f:
            assert f.read() == a, "replicas differ after re-attach"
        run_reference(str(tmp_path / "ref"), 2, n, steps, *ENGINE)
        with open(tmp_path / "ref", "rb") as f:
            assert f.read() == a, "the abandoned step left a trace in the optimizer"
    finally:
        for p in (b, c):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert d.stop() == 0


def test_views_alias_shared_memory(daemon_factory):
    d = daemon_factory(*ENGINE)
    with scape.attach(d.endpoint, [("w", 1000), ("b", 1)]) as s:
        assert (s.numel, s.index, s.next_step) == (1001, 0, 1)
        assert s.layout == [("w", 0, 1000), ("b", 1000, 1)]
        assert s.params.dtype == np.float32 and s.params.shape == (1001,)
        assert s.params.ctypes.data == lib.scape_params(s._handle)
        assert s.grads.ctypes.data == lib.scape_grads(s._handle)
        # The names are unlinked once the daemon has mapped them (nothing is
        # left behind however the processes end); the trainer's views and the
        # daemon map the same two objects.
        assert not shm_names(), "names still linked after registration"
        ours = shm_mappings(os.getpid())
        theirs = shm_mappings(d.proc.pid)
        assert set(ours) == {s.params.ctypes.data, s.grads.ctypes.data}, ours
        assert sorted(ours.values()) == sorted(n for n in theirs.values()
                                               if n.startswith("scape-%d-" % os.getpid()))
        s.grads[:] = np.arange(1001, dtype=np.float32)
        s.params[:] = 0.25
        s.sync()
        assert s.next_step == 1 and np.all(s.params == 0.25)
        before = s.params.copy()
        info = s.step(0.1, loss=1.5)
        assert info.step == 1 and s.next_step == 2 and 0 < info.k <= 1001
        assert not np.array_equal(s.params, before), "the update did not land in the view"
        s.step_begin(0.1)
        assert s.step_wait().step == 2 and s.next_step == 3
    assert s.params is None and s.grads is None
    s.detach()
    assert not shm_names(), "detach left shared memory behind"
    with pytest.raises(scape.ScapeError, match="detached"):
        s.step(0.1)


def test_bfloat16_buffers_are_uint16(daemon_factory):
    d = daemon_factory(*ENGINE)
    with scape.attach(d.endpoint, [("w", 0, 64)], dtype="bfloat16", grad_dtype="float32") as s:
        assert s.params.dtype == np.uint16 and s.params.nbytes == 128
        assert s.grads.dtype == np.float32 and s.grads.nbytes == 256


def test_errors(daemon_factory, tmp_path):
    # no daemon: refused at once, not after timeout_ms, saying where it looked
    missing = "ipc://%s/control" % tmp_path
    t0 = time.monotonic()
    with pytest.raises(scape.ScapeError) as e:
        scape.attach(missing, [("w", 10)])
    assert time.monotonic() - t0 < 1.0
    assert e.value.code == scape.Rc.REMOTE and e.value.code.name == "REMOTE"
    assert missing in e.value.message and "is scaped running?" in e.value.message
    assert "runtime directory %s" % tmp_path in e.value.message

    d = daemon_factory(*ENGINE)
    with scape.attach(d.endpoint, [("w", 10), ("b", 1)]) as s:
        with pytest.raises(scape.ScapeError, match="sync") as e:
            s.step(0.1)
        s.sync()
        with pytest.raises(scape.ScapeError, match="out of order") as e:
            s.step(0.1, step=5)
        assert e.value.code == scape.Rc.INVALID
        with pytest.raises(scape.ScapeError, match="layout") as e:
            scape.attach(d.endpoint, [("w", 11)], timeout_ms=5000)
        assert e.value.code == scape.Rc.INVALID
        assert s.step(0.1).step == 1
        with pytest.raises(scape.ScapeError, match="in host memory") as e:
            s.set_stream(0)  # a stream orders CUDA buffers only
        assert e.value.code == scape.Rc.INVALID

    if not cuda_usable():
        # A CPU-only libscape refuses device buffers; a CUDA build on a
        # machine without a usable GPU fails to allocate them: either way a
        # clear error, and the daemon is unaffected.
        with pytest.raises(scape.ScapeError, match="CUDA|cuda") as e:
            scape.attach(d.endpoint, [("w", 10)], device="cuda")
        assert e.value.code in (scape.Rc.UNSUPPORTED, scape.Rc.CUDA)
    for bad in (dict(layout=[]), dict(layout=[("w", 1), ("b", 1, 1)]),
                dict(layout=[("w", 1)], dtype="float16"), dict(layout=[("w", 1)], device="tpu")):
        with pytest.raises(ValueError):
            scape.attach(d.endpoint, **bad)


def cuda_usable():
    try:
        cudart = ctypes.CDLL("libcudart.so")
    except OSError:
        return False
    n = ctypes.c_int(0)
    return cudart.cudaGetDeviceCount(ctypes.byref(n)) == 0 and n.value > 0


def test_attach_waits_for_a_starting_daemon_when_asked(tmp_path, capfd):
    """start_wait_ms: a trainer started before its daemon says once that it
    waits, and attaches when the daemon comes up."""
    import tempfile
    import threading
    rt = os.path.join(tempfile.mkdtemp(prefix="scape-sw-"), "rt")
    endpoint = "ipc://%s/control" % rt
    got = {}

    def attach():
        try:
            got["s"] = scape.attach(endpoint, [("w", 10)], start_wait_ms=20000)
        except scape.ScapeError as e:
            got["e"] = e

    t = threading.Thread(target=attach)
    t.start()
    time.sleep(0.5)  # the trainer is waiting before the daemon starts
    d = subprocess.Popen([binary("daemon", "scaped"), "--runtime-dir", rt],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t.join(30)
        assert not t.is_alive() and "s" in got, got
        got["s"].detach()
    finally:
        d.send_signal(signal.SIGTERM)
        d.wait(timeout=20)
    err = capfd.readouterr().err
    assert err.count("waiting up to 20 s for scaped at %s" % endpoint) == 1, err


def test_c_trainer_without_daemon_says_so_at_once(tmp_path):
    t0 = time.monotonic()
    p = subprocess.run([binary("tests", "integration", "trainer_c"), "--endpoint",
                        "ipc://%s/control" % tmp_path, "--steps", "1"],
                       capture_output=True, text=True, timeout=30)
    assert time.monotonic() - t0 < 1.0
    assert p.returncode != 0 and "is scaped running?" in p.stderr, p.stderr
    assert "its control socket does not exist" in p.stderr, p.stderr
    # --help answers without attaching
    h = subprocess.run([binary("tests", "integration", "trainer_c"), "--help"],
                       capture_output=True, text=True, timeout=10)
    assert h.returncode == 0 and h.stdout.startswith("usage: trainer_c"), (h.stdout, h.stderr)


def test_rc_names_match_libscape():
    for rc in scape.Rc:
        assert lib.scape_rc_name(rc).decode() == rc.name
    assert lib.scape_rc_name(len(scape.Rc)).decode() == "UNKNOWN"
    assert scape.version()


def test_torch_optimizer_trains_in_shared_memory(daemon_factory):
    torch = pytest.importorskip("torch")
    import scape.torch

    torch.manual_seed(0)
    d = daemon_factory("--rho", "0.5", "--warmup", "20")
    model = torch.nn.Linear(8, 1)
    x = torch.randn(256, 8)
    y = x @ torch.randn(8, 1) + 0.5
    opt = scape.torch.ScapeOptimizer(model.named_parameters(), endpoint=d.endpoint, lr=0.1)
    s = opt.session
    try:
        assert [t[0] for t in s.layout] == ["weight", "bias"]

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        losses = [float(opt.step(closure).detach()) for _ in range(100)]
        assert losses[-1] < 0.5 * losses[0], losses
        assert opt.last_info.step == 100
        for p, (_, off, _) in zip(model.parameters(), s.layout):
            assert p.data_ptr() == s.params.ctypes.data + 4 * off
            assert p.grad.data_ptr() == s.grads.ctypes.data + 4 * off
    finally:
        opt.detach()
    assert model.weight.grad is None and not shm_names()
    assert float(torch.nn.functional.mse_loss(model(x), y)) < losses[0]


def test_torch_gradients_reach_the_daemon_however_grads_are_zeroed(daemon_factory):
    """model.zero_grad() sets .grad to None (torch 2's default), and backward
    then makes a fresh gradient outside the daemon's buffer: step() copies
    it in and points .grad at the buffer again, so training equals the run
    that zeroes with opt.zero_grad(), bit for bit; a parameter the loss does
    not reach counts as a zero gradient; a parameter whose .data was
    replaced is refused, saying why."""
    torch = pytest.importorskip("torch")
    import scape.torch

    def run(zero_with_model):
        torch.manual_seed(0)
        d = daemon_factory("--rho", "0.5", "--warmup", "2")
        model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 1))
        unused = torch.nn.Linear(3, 1)  # trained by nothing: its gradient is zero
        x = torch.randn(64, 8)
        y = x @ torch.randn(8, 1)
        named = list(model.named_parameters()) + [("u." + n, p)
                                                  for n, p in unused.named_parameters()]
        opt = scape.torch.ScapeOptimizer(named, endpoint=d.endpoint, lr=0.05)
        try:
            for _ in range(12):
                if zero_with_model:
                    # torch 2's default (1.13 zeroes in place): .grad is None now
                    model.zero_grad(set_to_none=True)
                    unused.zero_grad(set_to_none=True)
                    assert model[0].weight.grad is None
                else:
                    opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            out = [p.detach().clone() for _, p in named]
            ptr = opt.session.grads.ctypes.data
            assert model[0].weight.grad.data_ptr() == ptr  # the view again
            model[1].bias.data = model[1].bias.data.clone()
            with pytest.raises(RuntimeError, match="no longer holds the daemon's buffer"):
                opt.step()
        finally:
            opt.detach()
            d.stop()
        return out

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


def test_gpu_torch_check_runs_on_cpu(tmp_path):
    """tests/gpu/torch_scape.py is run only where a GPU is lent: its logic
    (daemons, threads, fixed gradients, the bitwise comparison) runs here
    with every trainer on the CPU (--cpu-check), so it cannot rot unseen."""
    pytest.importorskip("torch")
    script = os.path.join(SOURCE, "tests", "gpu", "torch_scape.py")
    r = subprocess.run([sys.executable, script, "--daemon", binary("daemon", "scaped"),
                        "--lib", binary("client", "libscape.so"), "--cpu-check",
                        "--log", str(tmp_path / "scaped.log")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "torch_scape: PASS (--cpu-check)" in r.stdout, (
        r.stdout + r.stderr)


def test_torch_optimizer_keeps_bfloat16_parameters(daemon_factory):
    """bfloat16 parameters through ScapeOptimizer: the model stays bfloat16,
    its parameters and .grad alias the shared bf16 buffers, the first step is
    AdamS's from m = 0 on the float32 master (theta - lr*(1-beta1)/sqrt(1-beta2)
    * sign(g), rounded once to bfloat16), training lowers the loss; a model
    that mixes dtypes is refused, naming the parameters."""
    torch = pytest.importorskip("torch")
    import scape.torch

    torch.manual_seed(0)
    d = daemon_factory("--rho", "0.5", "--warmup", "20")
    mixed = torch.nn.Linear(4, 1)
    mixed.bias.data = mixed.bias.data.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"bfloat16 \(bias\); float32 \(weight\)"):
        scape.torch.ScapeOptimizer(mixed.named_parameters(), endpoint=d.endpoint)
    model = torch.nn.Linear(8, 1).to(torch.bfloat16)
    x = torch.randn(256, 8).to(torch.bfloat16)
    y = (x.float() @ torch.randn(8, 1) + 0.5).to(torch.bfloat16)
    lr = 0.05
    opt = scape.torch.ScapeOptimizer(model.named_parameters(), endpoint=d.endpoint, lr=lr)
    s = opt.session
    try:
        assert s.params.dtype == np.uint16
        for p, (_, off, _) in zip(model.parameters(), s.layout):
            assert p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16
            assert p.data_ptr() == s.params.ctypes.data + 2 * off
            assert p.grad.data_ptr() == s.grads.ctypes.data + 2 * off

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
            loss.backward()
            return loss

        before = [p.detach().float().clone() for p in model.parameters()]
        first = float(opt.step(closure).detach())
        step = lr * (1 - 0.9) / (1 - 0.95) ** 0.5
        for p, b in zip(model.parameters(), before):
            g = p.grad.float()
            want = (b - step * torch.sign(g)).to(torch.bfloat16).float()
            got = p.detach().float()
            ulp = (want.abs() * 2.0 ** -7).clamp(min=1e-30)
            assert torch.all((got - want).abs() <= ulp), (got, want)
        losses = [first] + [float(opt.step(closure).detach()) for _ in range(60)]
        assert losses[-1] < 0.5 * losses[0], losses
    finally:
        opt.detach()
    assert model.weight.dtype == torch.bfloat16 and model.weight.grad is None


def test_torch_parameter_groups_decay_and_learn_per_group(daemon_factory):
    """nanoGPT's groups through ScapeOptimizer: decay on the matrix, none on
    the bias, a group lr each.  With zero gradients AdamS moves a parameter
    only by its weight decay, theta - lr * (wd * theta) in float32: the
    matrix by its group's lr and weight decay, the bias not at all; a group
    lr changed between steps applies from the next step; a group without a
    weight_decay takes the daemon's."""
    torch = pytest.importorskip("torch")
    import scape.torch

    torch.manual_seed(0)
    d = daemon_factory("--optimizer", "adams", "--weight-decay", "0.3")
    model = torch.nn.Linear(16, 4)
    extra = torch.nn.Parameter(torch.randn(8))
    opt = scape.torch.ScapeOptimizer([
        {"params": [("weight", model.weight)], "weight_decay": 0.1, "lr": 0.01},
        {"params": [("bias", model.bias)], "weight_decay": 0.0, "lr": 0.02},
        {"params": [("extra", extra)], "lr": 0.05}], endpoint=d.endpoint)
    try:
        assert [n for n, _, _ in opt.session.layout] == ["weight", "bias", "extra"]

        def decayed(p, lr, wd):
            f = torch.float32
            lr, wd = torch.tensor(lr, dtype=f), torch.tensor(wd, dtype=f)
            return p - lr * (torch.zeros((), dtype=f) + wd * p)

        for lr0 in (0.01, 0.04):
            opt.param_groups[0]["lr"] = lr0
            want = [decayed(model.weight.detach().clone(), lr0, 0.1),
                    model.bias.detach().clone(),
                    decayed(extra.detach().clone(), 0.05, 0.3)]
            opt.zero_grad()
            opt.step()
            for got, w in zip((model.weight, model.bias, extra), want):
                assert torch.equal(got.detach(), w), (got, w)
    finally:
        opt.detach()
    with pytest.raises(ValueError, match="weight_decay"):
        scape.torch.ScapeOptimizer([{"params": [extra], "weight_decay": -1.0}],
                                   endpoint=d.endpoint)


def cuda_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    sys.path.insert(0, os.path.join(SOURCE, "tests", "gpu"))
    import torch_scape
    return torch, torch_scape


def test_torch_optimizer_on_cuda_matches_host(daemon_factory):
    """Two trainers on one daemon, one with its parameters in CUDA IPC
    buffers, one in host shared memory, the same data: after every step
    both hold the same parameters (the daemon stages the device buffers).
    The check is tests/gpu/torch_scape.py's, which run.sh runs on GPU
    machines without pyzmq."""
    torch, torch_scape = cuda_torch()
    import scape.torch
    d = daemon_factory("--rho", "0.5", "--warmup", "5", "--trainers", "2")
    torch_scape.check_optimizers(torch, scape.torch, d.endpoint)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_session_buffers_are_torch_tensors(daemon_factory, dtype):
    """scape.attach(device="cuda") hands over CUDA tensors over libscape's
    IPC buffers: the dtype asked for, the device addresses it reports."""
    torch, torch_scape = cuda_torch()
    d = daemon_factory()
    torch_scape.check_session_tensors(torch, scape, d.endpoint, dtype)


def test_a_step_posted_to_a_busy_daemon_says_how_long_it_waited(daemon_factory):
    """Phases.queued: how long the step's Step message waited before the
    daemon read it (the trainer stamps its send time).  The daemon is stopped
    (SIGSTOP) for 0.5 s while a step is posted: that step's figure covers the
    stop and no more than the whole round trip; status and scapectl show it."""
    import pbwire
    d = daemon_factory(*ENGINE)

    def queued():
        _, _, st, done = pbwire.query_status(d.status_endpoint)
        return pbwire.parse(done[2][0])[12][0], st[23][0]

    with scape.attach(d.endpoint, [("w", 1000), ("b", 1)]) as s:
        s.sync()
        s.grads[:] = 1.0
        t_first = time.monotonic()
        s.step(0.1)
        assert queued()[0] >= 0.0
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGSTOP)
        try:
            while not process_stopped(d.proc.pid):
                time.sleep(0.001)
            s.step_begin(0.1)
            time.sleep(0.5)
        finally:
            d.proc.send_signal(signal.SIGCONT)
        assert s.step_wait().step == 2
        round_trip = time.monotonic() - t0
        q, total = queued()
        assert 0.5 <= q <= round_trip, (q, round_trip)
        # the sum of both steps' waits: at least this one's, at most both round trips
        assert q <= total <= time.monotonic() - t_first, (q, total)
        out = subprocess.run([binary("client", "scapectl"), "--runtime-dir", d.rt, "status"],
                             capture_output=True, text=True, check=True).stdout
        assert re.search(r"^\s+queued\s*: [\d.]+ ms$", out, re.M), out
        assert re.search(r"^Queued\s*: %.3f s " % total, out, re.M), out
    assert d.stop() == 0


def test_daemon_clips_by_the_global_norm(daemon_factory, tmp_path):
    """max_grad_norm in the daemon: a trainer that expects another bound is
    refused with the reason; one that expects this bound gets the in-process
    engine's clipped run bit for bit, the norm and factor in its step info,
    and scapectl shows both (status and metrics)."""
    n, steps, bound = 4000, 20, "10"
    engine = ENGINE + ["--max-grad-norm", bound]
    d = daemon_factory(*engine)
    layout = synth_layout(n)
    for wrong in (1.0, 0.0):
        with pytest.raises(scape.ScapeError) as e:
            scape.attach(d.endpoint, layout, max_grad_norm=wrong)
        assert e.value.code == scape.Rc.INVALID, e.value
        assert "max_grad_norm" in e.value.message and "clips at 10 " in e.value.message, \
            e.value.message
    synth = py_trainer.Synth(1, 0, layout)
    infos = []
    with scape.attach(d.endpoint, layout, index=0, max_grad_norm=float(bound)) as s:
        s.params[:] = synth.init()
        s.sync()
        for t in range(1, steps + 1):
            s.grads[:] = synth.grads(t, s.params)
            infos.append(s.step(1e-2, step=t))
        got = s.params.tobytes()
        rt = os.path.dirname(d.endpoint[len("ipc://"):])
        ctl = binary("client", "scapectl")
        st = subprocess.run([ctl, "--runtime-dir", rt, "status", "--json"], capture_output=True,
                            text=True, timeout=30)
        assert st.returncode == 0, st.stderr
        metrics = subprocess.run([ctl, "--runtime-dir", rt, "metrics"], capture_output=True,
                                 text=True, timeout=30)
        assert metrics.returncode == 0, metrics.stderr
    assert all(i.grad_norm > 0 for i in infos), [i.grad_norm for i in infos]
    clipped = [i for i in infos if i.clip < 1]
    assert clipped and len(clipped) < steps, [round(i.grad_norm, 3) for i in infos]
    for i in infos:
        want = min(1.0, float(bound) / (i.grad_norm + 1e-6))
        assert abs(i.clip - want) <= 1e-7 * want, (i.grad_norm, i.clip, want)
    run_reference(str(tmp_path / "ref"), 1, n, steps, *engine)
    with open(tmp_path / "ref", "rb") as f:
        assert f.read() == got, "the daemon's clipped run differs from the engine's"
    plain = tmp_path / "plain"
    run_reference(str(plain), 1, n, steps, *ENGINE)
    assert plain.read_bytes() != got, "clipping changed nothing: the bound is too loose"
    status = json.loads(st.stdout)
    assert status["max_grad_norm"] == pytest.approx(float(bound))
    assert status["last"]["grad_norm"] == pytest.approx(infos[-1].grad_norm)
    assert status["last"]["clip"] == pytest.approx(infos[-1].clip)
    for name in ("scape_grad_norm", "scape_clip_factor"):
        assert re.search(r'^%s{rank="0"} [0-9.e+-]+$' % name, metrics.stdout, re.M), \
            metrics.stdout
    assert d.stop() == 0


def test_parameter_groups_through_the_daemon(daemon_factory, tmp_path):
    """Two Python trainers with two parameter groups (weight decay 0.1, and
    NaN: the daemon's 0.02; every tensor alternately in each; group g's lr
    (1 + g) * lr): bitwise the in-process engine's run with the same groups,
    and not the run without groups.  Afterwards a trainer whose tensors sit
    in other groups, or whose group has another weight decay, is refused,
    naming the tensor or the group."""
    n, steps = 4000, 30
    engine = ENGINE + ["--weight-decay", "0.02"]
    d = daemon_factory(*engine, "--trainers", "2")
    outs = [str(tmp_path / ("t%d" % i)) for i in range(2)]
    procs = [run_py_trainer(d.endpoint, i, n, steps, outs[i], ["--groups", "0.1,nan"])
             for i in range(2)]
    for i, p in enumerate(procs):
        o, e = p.communicate(timeout=300)
        assert p.returncode == 0, "trainer %d: %s %s" % (i, o, e)
    run_reference(str(tmp_path / "ref"), 2, n, steps, *engine, "--groups", "0.1,nan")
    run_reference(str(tmp_path / "plain"), 2, n, steps, *engine)
    got = [open(o, "rb").read() for o in outs]
    assert got[0] == got[1] == (tmp_path / "ref").read_bytes(), "differs from the engine"
    assert got[0] != (tmp_path / "plain").read_bytes(), "the groups changed nothing"
    layout = synth_layout(n)
    swapped = [(l + 1) % 2 for l in range(len(layout))]
    with pytest.raises(scape.ScapeError) as e:
        scape.attach(d.endpoint, layout, groups=[0.1, None], tensor_groups=swapped)
    assert e.value.code == scape.Rc.INVALID and \
        "tensor %s is in parameter group 1, but in the node's layout in group 0" \
        % layout[0][0] in e.value.message, e.value.message
    with pytest.raises(scape.ScapeError) as e:
        scape.attach(d.endpoint, layout, groups=[0.2, None],
                     tensor_groups=[l % 2 for l in range(len(layout))])
    assert "parameter group 0 has weight_decay 0.2" in e.value.message, e.value.message
    assert d.stop() == 0


def test_torch_checkpoint_pattern_continues_bitwise(daemon_factory, tmp_path):
    """The training loop's checkpoint pattern: torch.save of the model's and
    the optimizer's state_dict after step 6, everything stopped (trainer and
    daemon), a fresh daemon and a freshly initialised model, load both,
    continue to step 12: the parameters equal, bit for bit, those of one run
    of 12 steps.  A foreign, a missing and a late state are refused, with
    the reason."""
    torch = pytest.importorskip("torch")
    import scape.torch

    ck = str(tmp_path / "ck")
    engine = ["--rho", "0.25", "--warmup", "3", "--checkpoint-dir", ck]
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(5))
    y = torch.randn(64, 2, generator=torch.Generator().manual_seed(6))

    def model_and_opt(d, seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 2))
        opt = scape.torch.ScapeOptimizer(model.named_parameters(), endpoint=d.endpoint,
                                         lr=0.01)
        return model, opt

    def train(model, opt, first, last):
        for t in range(first, last + 1):
            rows = torch.Generator().manual_seed(t)  # the data of step t
            idx = torch.randint(0, 64, (16,), generator=rows)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
            opt.param_groups[0]["lr"] = 0.01 * (1 + t % 3)
            opt.step()

    def flat(model):
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()

    d = daemon_factory(*engine)
    model, opt = model_and_opt(d, 0)
    train(model, opt, 1, 12)
    want = flat(model)
    opt.detach()
    assert d.stop() == 0

    d = daemon_factory(*engine)
    model, opt = model_and_opt(d, 0)
    train(model, opt, 1, 6)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 6}, path)
    opt.detach()
    assert d.stop() == 0

    d = daemon_factory(*engine)
    model, opt = model_and_opt(d, 99)  # other initial values: the checkpoint's must win
    saved = torch.load(path)
    assert saved["optimizer"]["step"] == 6 and os.path.isdir(saved["optimizer"]["scaped_checkpoint"])
    with pytest.raises(ValueError, match="not a ScapeOptimizer state_dict"):
        opt.load_state_dict({"state": {}, "param_groups": []})
    with pytest.raises(scape.ScapeError) as e:
        opt.load_state_dict(dict(saved["optimizer"], scaped_checkpoint=str(tmp_path / "none")))
    assert "none" in e.value.message, e.value.message
    with pytest.raises(scape.ScapeError) as e:
        opt.load_state_dict(dict(saved["optimizer"], layout_hash=12345))
    assert "another layout" in e.value.message, e.value.message
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    assert opt.session.next_step == 7
    train(model, opt, 7, 12)
    assert torch.equal(flat(model), want), "the resumed run differs from the uninterrupted one"
    with pytest.raises(scape.ScapeError) as e:
        opt.load_state_dict(saved["optimizer"])
    assert "past step 12" in e.value.message, e.value.message
    opt.detach()
    assert d.stop() == 0

    # another optimizer: refused with the reason, and the job goes on afresh
    d = daemon_factory("--optimizer", "adams", "--checkpoint-dir", ck)
    model, opt = model_and_opt(d, 0)
    with pytest.raises(scape.ScapeError) as e:
        opt.load_state_dict(saved["optimizer"])
    assert "refused" in e.value.message and "optimizer" in e.value.message, e.value.message
    assert opt.session.next_step == 1
    train(model, opt, 1, 2)
    opt.detach()
    assert d.stop() == 0
