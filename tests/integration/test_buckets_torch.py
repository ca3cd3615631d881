"""Bucketed hand-over from torch: ScapeOptimizer(bucket_mb=...) posts each
bucket of gradients (Session.post_tensors) from gradient hooks as backward()
fills it, with real daemons.  The daemon packs them before the step (its
status says how many tensors), and the parameters end bitwise as with
bucket_mb=0: the example GPT (torch_train.py --bucket-mb) with two trainers
on one daemon; a small model with an unused parameter, with two trainers on
one daemon and with two daemons of one trainer each, however the gradients
are zeroed, and with gradient accumulation under no_post().  A second
backward() into gradients already handed over is refused before it changes
them, and the step then takes the first backward's gradients; a posted
gradient changed in place before step() (a local clip) is refused at
step().  The default size (bucket_mb unset) watches the first step and
stays off, with one warning, for a loop that accumulates without no_post()
or changes gradients before step().  Under torch
2.x (the venv of test_torch2.py) the in-process tests run again, through
register_post_accumulate_grad_hook instead of the AccumulateGrad node's
hook."""
import os
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest

import pbwire
from conftest import SOURCE, free_endpoints, torch2_python
from test_gpt_training import corpus  # noqa: F401  (the fixture)

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(SOURCE, "client", "python"))
import scape.torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINE = ["--rho", "0.1", "--warmup", "2"]
# the fixture's daemon is ready once its socket file exists, which may be
# before it listens: an attach right away may find the socket refusing
WAIT_MS = 20000


def early_tensors(d):
    """Tensors the daemon packed before its last step's Steps came (Phases 14)."""
    status, msg, _, done = pbwire.query_status(d.status_endpoint)
    assert status == 0, msg
    return pbwire.parse(done[2][0]).get(14, [0])[0]


def group(daemon_factory, trainers, coord, job):
    """One daemon with `trainers` trainers, or a group of one daemon per entry."""
    if len(trainers) == 1:
        return [daemon_factory(*ENGINE, "--trainers", str(trainers[0]))]
    return [daemon_factory(*ENGINE, "--world", str(len(trainers)), "--rank", str(r),
                           "--coordinator", coord, "--listen", "tcp://127.0.0.1:*",
                           "--job", str(job), "--trainers", str(t), "--comm-timeout-ms", "20000")
            for r, t in enumerate(trainers)]


def test_torch_train_bucketed_equals_unbucketed_bitwise(daemon_factory, tmp_path,
                                                        corpus):  # noqa: F811
    """torch_train.py with --bucket-mb 0.01 (several buckets of its 20k
    parameters) and --bucket-mb 0, two trainers on one daemon, the two jobs
    side by side: every trainer ends with the same parameters, bucketed or
    not, bit for bit; the bucketed daemon packed tensors before the last
    step, the other none."""
    script = os.path.join(SOURCE, "client", "examples", "torch_train.py")
    env = dict(os.environ, PYTHONPATH=os.path.join(SOURCE, "client", "python"))
    runs = []
    for j, mb in enumerate(("0.01", "0")):
        trainers = [2]
        daemons = group(daemon_factory, trainers, None, None)
        procs = []
        for r, (d, t) in enumerate(zip(daemons, trainers)):
            for i in range(t):
                out = str(tmp_path / ("run%d-r%d-t%d" % (j, r, i)))
                cmd = [sys.executable, script, "--corpus", corpus, "--endpoint", d.endpoint,
                       "--index", str(i), "--seed", str(1 + r + i), "--steps", "8",
                       "--d", "32", "--layers", "1", "--heads", "2", "--ctx", "32",
                       "--lr", "1e-2", "--eval-every", "100", "--eval-windows", "2",
                       "--bucket-mb", mb, "--out", out]
                procs.append((out, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                                    stderr=subprocess.STDOUT, text=True,
                                                    env=env)))
        runs.append((trainers, mb, daemons, procs))
    params = []
    for trainers, mb, daemons, procs in runs:
        for out, p in procs:
            o, _ = p.communicate(timeout=600)
            assert p.returncode == 0, o
            with open(out, "rb") as f:
                params.append((mb, f.read()))
        early = early_tensors(daemons[0])
        assert early > 0 if mb != "0" else early == 0, \
            "--bucket-mb %s: %d tensors packed early" % (mb, early)
        assert daemons[0].stop() == 0, daemons[0].output()
    first = np.frombuffer(params[0][1], dtype=np.float32)
    assert first.size > 10000 and np.isfinite(first).all()
    assert [g == params[0][1] for _, g in params] == [True] * 4, \
        "the parameters differ (--bucket-mb of each: %s)" % [mb for mb, _ in params]


class Net(torch.nn.Module):
    """Seven tensors of 16 to 2,048 bytes: in buckets of 512 bytes, (c.weight,
    c.bias), (b.weight, b.bias, unused), (a.weight, a.bias); the unused
    parameter gets no gradient, so its bucket never fills (step() posts it)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 32)
        self.unused = torch.nn.Parameter(torch.zeros(64))
        self.c = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class NetUnusedFirst(Net):
    """Net with one more parameter that gets no gradient, given between
    a.weight and a.bias: in buckets of 512 bytes the first layer's tensors,
    whose gradients backward makes last, share a bucket with it that never
    fills, and so does b's: the last post is c's bucket, and backward goes
    on adding to b's and a's gradients after it."""

    def __init__(self):
        super().__init__()
        self.extra = torch.nn.Parameter(torch.zeros(4))

    def named_parameters(self, *a, **k):
        own = dict(super().named_parameters(*a, **k))
        extra = own.pop("extra")
        items = list(own.items())
        return iter(items[:1] + [("extra", extra)] + items[1:])

    def parameters(self, *a, **k):
        return (p for _, p in self.named_parameters())


def batch(step, micro):
    g = torch.Generator().manual_seed(100 * step + micro)
    x = torch.randn(16, 8, generator=g)
    return x, torch.randn(16, 4, generator=g)


def backward(model, step, micro):
    x, y = batch(step, micro)
    torch.nn.functional.mse_loss(model(x), y).backward()


def zero(model, opt, how):
    if how == "optimizer":
        opt.zero_grad()
    else:
        model.zero_grad(set_to_none=how == "none")


def hooked(model):
    """The parameters with tensor hooks."""
    return [n for n, p in model.named_parameters() if getattr(p, "_backward_hooks", None)]


def final(model):
    return b"".join(p.detach().numpy().tobytes() for p in model.parameters())


def train(daemon_factory, bucket_mb, how="optimizer", steps=4, micro=1, no_post=False,
          second_at=None, clip=False, net=Net):
    """Net trained for `steps` steps of `micro` backward()s each, the earlier
    ones inside no_post() when asked; at step second_at a second backward()
    after the first, which must be refused; with clip, a local
    clip_grad_norm_ before each step.  The final parameters and the
    daemon's count of early-packed tensors (of the last step)."""
    d = daemon_factory(*ENGINE, "--trainers", "1")
    model = net()
    opt = scape.torch.ScapeOptimizer(model.named_parameters(), endpoint=d.endpoint, lr=0.05,
                                     bucket_mb=bucket_mb, start_wait_ms=WAIT_MS)
    try:
        for t in range(1, steps + 1):
            zero(model, opt, how)
            for m in range(micro):
                if no_post and m < micro - 1:
                    with opt.no_post():
                        backward(model, t, m)
                else:
                    backward(model, t, m)
            if t == second_at:
                g = opt.session.grads.tobytes()
                with pytest.raises(RuntimeError, match=r"a second backward\(\) before step\(\).*"
                                                       r"opt(imizer)?\.no_post\(\)"):
                    backward(model, t, 1)
                assert opt.session.grads.tobytes() == g, "the refused backward changed gradients"
                with pytest.raises(RuntimeError, match="must not change until step"):
                    opt.zero_grad()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
        early = early_tensors(d)
        out = final(model)
    finally:
        opt.detach()
    assert not hooked(model)
    backward(model, 1, 0)  # backward twice, nothing posted, nothing refused
    backward(model, 1, 1)
    assert d.stop() == 0, d.output()
    return out, early


def train_threads(daemon_factory, trainers, bucket_mb, coord, job, steps=4):
    """Net trained by one thread per trainer (trainers: per daemon), each on
    data of its own: every trainer's final parameters, and the daemons'
    counts of early-packed tensors."""
    daemons = group(daemon_factory, trainers, coord, job)
    slots = [(d, i) for d, t in zip(daemons, trainers) for i in range(t)]
    models = [Net() for _ in slots]  # here: Net seeds torch's global generator
    outs, errors = [None] * len(slots), []

    def trainer(k):
        d, i = slots[k]
        try:
            opt = scape.torch.ScapeOptimizer(models[k].named_parameters(), endpoint=d.endpoint,
                                             index=i, lr=0.05, bucket_mb=bucket_mb,
                                             timeout_ms=120000, start_wait_ms=WAIT_MS)
            try:
                for t in range(1, steps + 1):
                    opt.zero_grad()
                    backward(models[k], t, k)
                    opt.step()
                outs[k] = final(models[k])
            finally:
                opt.detach()
        except Exception as e:  # reported by the test, in the main thread
            errors.append(e)

    threads = [threading.Thread(target=trainer, args=(k,)) for k in range(len(slots))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads), errors
    early = [early_tensors(d) for d in daemons]
    for d in daemons:
        assert d.stop() == 0, d.output()
    return outs, early


@pytest.mark.parametrize("trainers", [[2], [1, 1]], ids=["one-daemon", "two-daemons"])
def test_trainers_bucketed_equal_unbucketed_bitwise(daemon_factory, trainers):
    """Two trainers (threads of this process) on one daemon, and two daemons
    of one trainer each, bucketed (three buckets) and not: every trainer of
    both runs ends with the same parameters, bit for bit; the bucketed
    daemons packed the filled buckets early."""
    coords = free_endpoints(2)
    ref, early0 = train_threads(daemon_factory, trainers, 0, coords[0], 21)
    got, early = train_threads(daemon_factory, trainers, 1 / 2048, coords[1], 22)
    assert early0 == [0] * len(trainers) and all(e > 0 for e in early), (early0, early)
    assert [g == ref[0] for g in ref + got] == [True] * 4, "the parameters differ"


@pytest.mark.parametrize("how", ["optimizer", "none", "zeros"])
def test_bucketed_equals_unbucketed_however_grads_are_zeroed(daemon_factory, how):
    """opt.zero_grad(), model.zero_grad(set_to_none=True) (backward makes
    fresh .grad tensors, which the hooks copy into the shared buffer) and
    set_to_none=False: bucketed (512 bytes: three buckets) ends bitwise as
    unbucketed; the daemon packed the filled buckets early, not the
    unused parameter's."""
    ref, early0 = train(daemon_factory, 0, how)
    got, early = train(daemon_factory, 1 / 2048, how)
    assert early0 == 0
    n = sum(p.numel() for p in Net().parameters())
    assert 0 < early < n, "tensors packed early: %d of %d" % (early, n)
    assert got == ref, "bucketed parameters differ from unbucketed ones"


def test_gradient_accumulation_with_no_post(daemon_factory):
    """Two micro-batches a step: with no_post() around the first, bitwise as
    unbucketed accumulation, with early packs.  Without it the second
    backward() is refused before it changes anything (and zero_grad() with
    it), and the step takes the first micro-batch's gradients: bitwise the
    run whose step 2 had only that one."""
    ref, _ = train(daemon_factory, 0, micro=2)
    got, early = train(daemon_factory, 1 / 2048, micro=2, no_post=True)
    assert early > 0 and got == ref, "accumulation under no_post() differs"
    one, _ = train(daemon_factory, 0, steps=3)
    refused, _ = train(daemon_factory, 1 / 2048, steps=3, second_at=2)
    assert refused == one, "the step after a refused backward took other gradients"


def default_size(monkeypatch):
    """bucket_mb and SCAPE_BUCKET_MB unset: the default size, here 512 bytes
    so that Net's tensors make three buckets."""
    monkeypatch.delenv("SCAPE_BUCKET_MB", raising=False)
    monkeypatch.setattr(scape.torch, "DEFAULT_BUCKET_MB", 1 / 2048)


def test_default_size_watches_the_first_step_then_posts(daemon_factory, monkeypatch):
    """The default bucket size, asked for by nobody: the first step hands
    everything over at step() (nothing packed early), a plain loop posts from
    the second step on, with no warning, bitwise as bucket_mb=0."""
    ref, _ = train(daemon_factory, 0)
    default_size(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, first = train(daemon_factory, None, steps=1)
        got, early = train(daemon_factory, None)
    assert first == 0 and early > 0, (first, early)
    assert got == ref, "the default bucket size changed the parameters"


@pytest.mark.parametrize("loop", ["accumulation", "local-clip"])
def test_default_size_turns_itself_off_where_the_loop_does_not_fit(daemon_factory, monkeypatch,
                                                                   loop):
    """The default bucket size with two backward() passes a step and no
    no_post() (gradient accumulation), or with a local clip_grad_norm_
    between backward() and step(): the first step sees it, warns once,
    and the hand-over is off from then on (nothing packed early, nothing
    refused): bitwise as bucket_mb=0 with the same loop."""
    kw = {"micro": 2} if loop == "accumulation" else {"clip": True}
    ref, _ = train(daemon_factory, 0, **kw)
    default_size(monkeypatch)
    with pytest.warns(UserWarning) as seen:
        got, early = train(daemon_factory, None, **kw)
    said = [str(w.message) for w in seen if "ScapeOptimizer" in str(w.message)]
    assert len(said) == 1, said
    assert ("gradient accumulation" if loop == "accumulation" else "clip_grad_norm_") in \
        said[0] and "no_post()" in said[0], said[0]
    assert early == 0 and got == ref, (early, "the parameters differ")


@pytest.mark.parametrize("how", ["optimizer", "none"])
def test_gradients_after_the_last_post_are_no_change(daemon_factory, how):
    """The first layers' gradients, which backward makes last, in buckets
    that never fill: their accumulation after the last post changes the
    shared buffer, but not what was posted: nothing refused, bitwise as
    unbucketed."""
    ref, _ = train(daemon_factory, 0, how, net=NetUnusedFirst)
    got, early = train(daemon_factory, 1 / 2048, how, net=NetUnusedFirst)
    assert early > 0 and got == ref, (early, "the parameters differ")


def test_posted_gradient_changed_in_place_is_refused(daemon_factory):
    """bucket_mb asked for, and a local clip_grad_norm_ after backward()
    changes gradients already handed over: step() refuses, naming the
    tensor and the fixes, instead of stepping on what the daemon packed."""
    with pytest.raises(RuntimeError, match=r"gradients changed after backward\(\) handed them "
                                           r".*tensor \d, \w+\.\w+\).*max_grad_norm"):
        train(daemon_factory, 1 / 2048, clip=True)


def test_bucket_mb_settings(daemon_factory, monkeypatch):
    """bucket_mb None reads SCAPE_BUCKET_MB (unset: the default); a bad value is refused
    naming where it came from; an optimizer that takes the session over
    (bucket_mb 0) leaves no hook of the old one behind."""
    d = daemon_factory(*ENGINE, "--trainers", "1")
    model = Net()
    monkeypatch.setenv("SCAPE_BUCKET_MB", "lots")
    with pytest.raises(ValueError, match="SCAPE_BUCKET_MB='lots'"):
        scape.torch.ScapeOptimizer(model.parameters(), endpoint=d.endpoint)
    with pytest.raises(ValueError, match="bucket_mb=-1"):
        scape.torch.ScapeOptimizer(model.parameters(), endpoint=d.endpoint, bucket_mb=-1)
    monkeypatch.setenv("SCAPE_BUCKET_MB", "0.5")
    old = scape.torch.ScapeOptimizer(model.parameters(), endpoint=d.endpoint,
                                     start_wait_ms=WAIT_MS)
    assert old.bucket_mb == 0.5 and len(hooked(model)) == 7
    with scape.torch.attach_defaults(adopt=old):  # the take-over removes old's hooks
        opt = scape.torch.ScapeOptimizer(model.parameters(), endpoint=d.endpoint, bucket_mb=0)
    assert opt.session is not None and not old.attached and not hooked(model)
    backward(model, 1, 0)
    backward(model, 1, 1)
    opt.step()
    assert opt.last_info.step == 1
    opt.detach()
    monkeypatch.delenv("SCAPE_BUCKET_MB")
    assert scape.torch._bucket_mb(None) == (scape.torch.DEFAULT_BUCKET_MB, False)
    assert scape.torch._bucket_mb(0) == (0.0, True)
    assert scape.torch._buckets([4, 4, 4, 4, 4], 8) == [(3, 2), (1, 2), (0, 1)]


def test_buckets_under_torch2(tmp_path):
    """This file's in-process tests, run unchanged by the torch 2.x
    environment's interpreter (post-accumulate-grad hooks): all pass."""
    py = torch2_python()
    env = dict(os.environ, PYTHONPATH=os.path.join(SOURCE, "client", "python"))
    env.pop("SCAPE_TORCH2_VENV")
    inner = ("import sys, torch, pytest; print('torch', torch.__version__); "
             "sys.exit(3 if not hasattr(torch.Tensor, 'register_post_accumulate_grad_hook') "
             "else pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', 'test_buckets_torch.py', "
             "'-k', 'not torch2 and not torch_train']))")
    r = subprocess.run([py, "-c", inner], cwd=HERE, capture_output=True, text=True, env=env,
                       timeout=600)
    print(r.stdout[-3000:])
    assert r.returncode != 3, "%s has no torch >= 2.1: %s" % (py, r.stdout)
    assert r.returncode == 0 and " passed" in r.stdout and "skipped" not in r.stdout, \
        r.stdout[-20000:] + r.stderr[-5000:]
