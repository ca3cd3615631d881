"""ScapeOptimizer under the parts of torch's optimizer API that frameworks
and schedulers use, and the torch tests under a current torch 2.x.

The API tests run in the interpreter running the tests: Debian's torch 1.13
in integration_torch2_api, torch 2.x when test_torch_tests_under_torch2 runs
them again (with test_torch_train.py and the ScapeOptimizer tests of
test_python.py, unchanged) under the interpreter of the torch 2.x virtual
environment in $SCAPE_TORCH2_VENV (ctest integration_torch2;
deploy/torch2-venv.sh makes it).  Without that environment it skips, saying
why."""
import os
import subprocess
import sys
import warnings
import xml.etree.ElementTree as ET

import pytest

from conftest import SOURCE, torch2_python

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(SOURCE, "client", "python"))
import scape.torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    x = torch.randn(64, 8)
    return model, x, x @ torch.randn(8, 1) + 0.5


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def test_scheduler_edits_lr_and_sees_the_steps(daemon_factory):
    """An LR scheduler sets param_groups' lr between steps and the daemon
    steps with it: with lr 0 (LambdaLR factors 1, 0, 1, 0) a step leaves the
    parameters as they were, bit for bit, with lr > 0 it moves them; the
    scheduler sees optimizer.step() as torch's own (no "lr_scheduler.step()
    before optimizer.step()" warning); under torch 2 the step hooks fire
    around every step, the pre-hook seeing the gradient the daemon gets."""
    d = daemon_factory("--rho", "0.5", "--warmup", "1")
    model, x, y = _model_and_data()
    opt = scape.torch.ScapeOptimizer(model.named_parameters(), endpoint=d.endpoint, lr=0.1)
    try:
        factors = [1.0, 0.0, 1.0, 0.0]
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: factors[e % 4])
        hooks = []
        if hasattr(opt, "register_step_pre_hook"):  # torch >= 2.0
            opt.register_step_pre_hook(
                lambda o, a, k: hooks.append(("pre", float(model.weight.grad.norm()))))
            opt.register_step_post_hook(lambda o, a, k: hooks.append(("post", o.last_info.step)))
        after, lrs = [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in factors:
                opt.zero_grad(set_to_none=True)
                _loss(model, x, y).backward()
                lrs.append(opt.param_groups[0]["lr"])
                opt.step()
                after.append(model.weight.detach().clone())
                sched.step()
        assert lrs == [0.1, 0.0, 0.1, 0.0]
        assert [str(w.message) for w in caught if "lr_scheduler" in str(w.message)] == []
        assert torch.equal(after[1], after[0]) and torch.equal(after[3], after[2])
        assert not torch.equal(after[2], after[1])
        if hasattr(opt, "register_step_pre_hook"):
            assert [h[0] for h in hooks] == ["pre", "post"] * 4
            assert [h[1] for h in hooks[1::2]] == [1, 2, 3, 4]
            assert all(n > 0 for _, n in hooks[0::2])
            assert getattr(opt, "_opt_called", True)
    finally:
        opt.detach()


def test_zero_grad_set_to_none_keeps_the_shared_view(daemon_factory):
    """zero_grad(set_to_none=True), as frameworks call it, leaves .grad a
    zeroed view of the daemon's gradient buffer rather than None."""
    d = daemon_factory()
    model, x, y = _model_and_data()
    opt = scape.torch.ScapeOptimizer(model.named_parameters(), endpoint=d.endpoint)
    try:
        _loss(model, x, y).backward()
        assert float(model.weight.grad.abs().sum()) > 0
        opt.zero_grad(set_to_none=True)
        g = model.weight.grad
        assert g is not None and g.data_ptr() == opt.session.grads.ctypes.data
        assert float(g.abs().sum()) == 0 and not opt.session.grads.any()
    finally:
        opt.detach()


def test_param_group_changes_the_daemon_cannot_follow_are_refused(daemon_factory):
    """add_param_group after construction and a weight decay changed between
    steps are refused with the reason (the daemon registered both at
    attach); the lr of one group changes that group's step only."""
    d = daemon_factory("--rho", "0.5", "--warmup", "1")
    model, x, y = _model_and_data()
    opt = scape.torch.ScapeOptimizer(
        [{"params": [("weight", model.weight)], "weight_decay": 0.0},
         {"params": [("bias", model.bias)], "weight_decay": 0.0}], endpoint=d.endpoint, lr=0.1)
    try:
        with pytest.raises(ValueError, match="add_param_group: the parameters and their groups"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
        opt.param_groups[1]["lr"] = 0.0
        b0 = model.bias.detach().clone()
        w0 = model.weight.detach().clone()
        _loss(model, x, y).backward()
        opt.step()
        assert torch.equal(model.bias, b0) and not torch.equal(model.weight, w0)
        opt.param_groups[0]["weight_decay"] = 0.1
        opt.zero_grad()
        _loss(model, x, y).backward()
        with pytest.raises(ValueError, match=r"param_groups\[0\]\['weight_decay'\] was changed"):
            opt.step()
    finally:
        opt.detach()


def test_a_new_optimizer_takes_over_an_attached_one(daemon_factory):
    """attach_defaults(adopt=old) (what the Lightning strategy does for a
    second fit): a ScapeOptimizer over the same parameters takes old's
    session over and the job goes on at the next step; over other
    parameters, old is detached and the new one attaches."""
    d = daemon_factory("--rho", "0.5", "--warmup", "1")
    model, x, y = _model_and_data()
    old = scape.torch.ScapeOptimizer(model.named_parameters(), endpoint=d.endpoint, lr=0.1)
    new = None
    try:
        _loss(model, x, y).backward()
        old.step()
        session = old.session
        with scape.torch.attach_defaults(adopt=old):
            new = scape.torch.ScapeOptimizer(model.named_parameters(), endpoint=d.endpoint,
                                             lr=0.05)
        assert new.session is session and new.attached and not old.attached
        old.detach()  # a no-op now
        new.zero_grad()
        _loss(model, x, y).backward()
        new.step()
        assert new.last_info.step == 2
        assert model.weight.data_ptr() == session.params.ctypes.data
        extra = torch.nn.Linear(2, 1)
        with scape.torch.attach_defaults(adopt=new):
            with pytest.raises(scape.ScapeError, match="layout"):
                scape.torch.ScapeOptimizer(extra.named_parameters(), endpoint=d.endpoint)
        assert not new.attached and model.weight.grad is None  # detached
    finally:
        for o in (old, new):
            if o is not None:
                o.detach()


def test_torch_tests_under_torch2(tmp_path):
    """test_torch_train.py, the ScapeOptimizer tests of test_python.py and
    this file's tests, run unchanged by the torch 2.x environment's
    interpreter: all pass (only CUDA-only tests may skip)."""
    py = torch2_python()
    report = str(tmp_path / "report.xml")
    env = dict(os.environ, PYTHONPATH=os.path.join(SOURCE, "client", "python"))
    env.pop("SCAPE_TORCH2_VENV")  # the inner run does not start another
    r = subprocess.run(
        [py, "-c", "import torch, sys; print('torch', torch.__version__); "
         "sys.exit(int(torch.__version__.split('.')[0]) < 2)"],
        capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, "%s has no torch 2.x:\n%s%s" % (py, r.stdout, r.stderr)
    print(r.stdout.strip())
    r = subprocess.run([py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        "--junitxml", report, "test_torch_train.py", "test_python.py",
                        "test_torch2.py", "-k", "torch and not test_torch_tests_under_torch2"],
                       cwd=HERE, capture_output=True, text=True, env=env, timeout=1200)
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stdout[-20000:] + r.stderr[-5000:]
    cases = ET.parse(report).getroot().iter("testcase")
    ran, skipped = [], []
    for c in cases:
        s = c.find("skipped")
        (ran if s is None else skipped).append((c.get("name"), "" if s is None
                                                else s.get("message", "")))
    assert not [s for s in skipped if "cuda" not in s[0].lower() and "gpu" not in s[1].lower()
                and "cuda" not in s[1].lower()], skipped
    names = {n for n, _ in ran}
    for want in ("test_torch_trainer_through_the_launcher",
                 "test_torch_optimizer_trains_in_shared_memory",
                 "test_torch_gradients_reach_the_daemon_however_grads_are_zeroed",
                 "test_torch_checkpoint_pattern_continues_bitwise",
                 "test_scheduler_edits_lr_and_sees_the_steps"):
        assert want in names, "%s did not run under torch 2: %s" % (want, sorted(names))
