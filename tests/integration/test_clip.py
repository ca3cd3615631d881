"""Clipping says what it clips (docs/algorithm.md, "Gradient clipping"): the
norm torch's clip_grad_norm_ would see is reported beside the norm the
daemon clipped, each checked here against numpy from the gradients the
trainers handed over; clip_norm picks which of the two the bound applies
to; and a trainer that clips its own gradients to the daemon's bound before
step() gets one warning in the daemon's log."""
import os
import sys
import threading

import numpy as np
import pytest

from conftest import SOURCE, run_reference, run_trainer, synth_layout

sys.path.insert(0, os.path.join(SOURCE, "client", "python"))
import scape  # noqa: E402

N, STEPS, WARMUP = 3000, 24, 3
LAYOUT = synth_layout(N)
NUMEL = sum(length for _, _, length in LAYOUT)
WARNING = "something in the trainer clips them before step()"


def grads_at(t, index, n):
    """Trainer index's gradient at step t: every third step 8 times larger,
    so that some steps clip and some do not."""
    rng = np.random.default_rng(1000 * t + index)
    g = rng.standard_normal(n).astype(np.float32) * np.float32(0.05)
    return g * np.float32(8.0) if t % 3 == 0 else g


def run_two(d, layout, steps):
    """Two trainers of one daemon, a thread each (the waits release the GIL);
    each step's StepInfo as both saw it, the gradients they handed over, and
    trainer 0's final parameters."""
    infos, errors = [[], []], []

    def trainer(i):
        try:
            with scape.attach(d.endpoint, layout, index=i, timeout_ms=120000) as s:
                s.params[:] = np.linspace(-1, 1, NUMEL).astype(np.float32)
                s.sync()
                for t in range(1, steps + 1):
                    s.grads[:] = grads_at(t, i, NUMEL)
                    infos[i].append(s.step(1e-2, step=t))
                infos[i].append(s.params.tobytes())
        except Exception as e:  # reported by the test, in the main thread
            errors.append(e)

    threads = [threading.Thread(target=trainer, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    assert not any(th.is_alive() for th in threads), "a trainer never finished"
    assert not errors, errors
    assert infos[0][:-1] == infos[1][:-1], "the trainers saw different step figures"
    handed = [[grads_at(t, i, NUMEL) for i in range(2)] for t in range(1, steps + 1)]
    return infos[0][:-1], handed, infos[0][-1]


@pytest.mark.parametrize("by", ["sent", "gradient"])
def test_reported_norms_and_the_factor(daemon_factory, tmp_path, by):
    """1 daemon x 2 trainers, scape at rho 0.01: mean_grad_norm is the norm
    of the mean of what the two handed over (numpy, float64), exact; on the
    dense warm-up steps it is g_hat's norm too; the factor is torch's
    min(1, C / (norm + 1e-6)) of the norm clip_norm names, some steps clip
    and some do not; the run is the in-process engine's bit for bit."""
    bound = 5.0  # between the quiet steps' mean gradient norm (about 1.9) and the loud
    engine = ["--rho", "0.01", "--warmup", str(WARMUP), "--max-grad-norm", str(bound)]
    d = daemon_factory(*engine, "--clip-norm", by, "--trainers", "2")
    infos, handed, got = run_two(d, LAYOUT, STEPS)
    for t, (i, gs) in enumerate(zip(infos, handed), start=1):
        mean = (gs[0].astype(np.float64) + gs[1].astype(np.float64)) / 2.0
        want = float(np.linalg.norm(mean))
        assert i.mean_grad_exact == 1, (t, i)
        assert abs(i.mean_grad_norm - want) <= 1e-6 * want, (t, i.mean_grad_norm, want)
        if t <= WARMUP:
            assert abs(i.grad_norm - want) <= 1e-6 * want, (t, i.grad_norm, want)
        norm = i.mean_grad_norm if by == "gradient" else i.grad_norm
        factor = min(1.0, bound / (norm + 1e-6))
        assert abs(i.clip - factor) <= 1e-7 * factor, (t, by, norm, i.clip, factor)
    clipped = sum(i.clip < 1 for i in infos)
    assert 0 < clipped < STEPS, [(round(i.grad_norm, 3), round(i.mean_grad_norm, 3))
                                 for i in infos]
    # after the warm-up what is sent (1% of the coordinates, with what waited
    # in the residual) is another vector than the step's mean gradient
    assert any(abs(i.grad_norm - i.mean_grad_norm) > 0.1 * i.mean_grad_norm
               for i in infos[WARMUP:]), infos
    assert WARNING not in d.output()
    assert d.stop() == 0


def test_clip_norm_gradient_is_the_engines_and_differs(daemon_factory, tmp_path):
    """The two measures give different runs, each the in-process engine's
    with the same setting."""
    outs = {}
    for by in ("sent", "gradient"):
        engine = ["--rho", "0.01", "--warmup", str(WARMUP), "--max-grad-norm", "1"]
        d = daemon_factory(*engine, "--clip-norm", by, "--trainers", "1")
        out = str(tmp_path / by)
        run_trainer(d.endpoint, 0, N, STEPS, out)
        ref = str(tmp_path / (by + ".ref"))
        run_reference(ref, 1, N, STEPS, *engine, "--clip-norm", by)
        outs[by] = open(out, "rb").read()
        assert outs[by] == open(ref, "rb").read(), by + ": differs from the engine"
        assert d.stop() == 0
    assert outs["sent"] != outs["gradient"], "clip_norm changed nothing"


def torch_run(d, bound, clip_upstream, steps=10):
    """A torch trainer (one linear layer) through ScapeOptimizer; with
    clip_upstream it clips its own gradients to `bound` before step(), as
    the HF Trainer and Lightning do."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    x, y = torch.randn(64, 16), torch.randn(64, 4) * 10
    opt = scape.torch.ScapeOptimizer(model.named_parameters(), endpoint=d.endpoint, lr=1e-3)
    norms = []
    try:
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if clip_upstream:
                torch.nn.utils.clip_grad_norm_(model.parameters(), bound)
            norms.append(float(torch.sqrt(sum((p.grad.double() ** 2).sum()
                                              for p in model.parameters()))))
            opt.step()
    finally:
        opt.detach()
    return norms


@pytest.mark.parametrize("upstream", [True, False])
def test_upstream_clipping_is_named_once(daemon_factory, upstream):
    """A trainer whose gradients arrive with norm max_grad_norm on every step
    (it clips them itself): the daemon's log has the warning once, naming
    the trainer; the same trainer without its own clipping: none."""
    pytest.importorskip("torch")
    import scape.torch  # noqa: F401
    bound = 0.5
    d = daemon_factory("--rho", "0.5", "--warmup", "2", "--max-grad-norm", str(bound))
    norms = torch_run(d, bound, upstream)
    # the premise: clipped, every norm is the bound; unclipped, none is
    assert all(abs(n - bound) < 1e-5 for n in norms) == upstream, norms
    assert all(n > 2 * bound for n in norms) != upstream, norms
    assert d.stop() == 0
    log = d.output()
    assert log.count(WARNING) == (1 if upstream else 0), log
    if upstream:
        line = next(ln for ln in log.splitlines() if WARNING in ln)
        assert "trainer 0 (" in line and "max_grad_norm" in line, line
