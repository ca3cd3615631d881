"""The PyTorch example trainer (client/examples/torch_train.py) as a user
runs it: through scape-run, two trainer processes train the GPT on the
fortunes corpus with scape.torch.ScapeOptimizer, two parameter groups (decay
on the matrices only), the daemon clipping at 1.0 and bf16 autocast; the
validation loss falls, the daemon reports the gradient norm and clips, and
both trainers end with the same parameters, bit for bit; saved after 30
steps through state_dict and resumed in a new launch, the run ends where
the uninterrupted one does, bit for bit, and resumed after its last step it
says there was nothing left to do.  Needs PyTorch in
the interpreter running the tests (deploy/setup.sh installs Debian's)."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import SOURCE
from test_gpt_training import corpus  # noqa: F401  (the fixture)

torch = pytest.importorskip("torch")


def launch(tmp_path, corpus, steps, out, extra=(), ck=None):
    script = os.path.join(SOURCE, "client", "examples", "torch_train.py")
    env = dict(os.environ, PYTHONPATH=os.path.join(SOURCE, "client", "python"))
    sets = ["--set", "rho=0.1", "--set", "warmup=10", "--set", "max_grad_norm=1.0"]
    if ck:
        sets += ["--set", "checkpoint_dir=" + ck]
    trainer = [sys.executable, script, "--corpus", corpus, "--steps", str(steps), "--d", "32",
               "--layers", "1", "--heads", "2", "--ctx", "32", "--lr", "1e-2",
               "--eval-every", "20", "--max-grad-norm", "1.0", "--autocast", "bf16", *extra]
    # the launcher runs the command as it is: a shell expands $LOCAL_RANK
    line = " ".join("'%s'" % c for c in trainer) + " --out '%s'$LOCAL_RANK" % out
    r = subprocess.run([sys.executable, "-m", "scape.run", "--nproc-per-node", "2", *sets,
                        "--", "sh", "-c", line], capture_output=True, text=True, env=env,
                       timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_torch_trainer_through_the_launcher(tmp_path, corpus):  # noqa: F811
    out = launch(tmp_path, corpus, 60, str(tmp_path / "p"))
    # both trainers print to the same pipe: read the figures, not the lines
    got = re.findall(r"step (\d+)  loss \S+  val (\S+)  grad norm ([\d.]+)", out)
    vals = [float(v) for _, v, _ in got]
    norms = [float(g) for _, _, g in got]
    assert len(vals) == 6 and max(vals[-2:]) < vals[0], out
    assert all(n > 0 for n in norms), out
    p0, p1 = (np.fromfile(str(tmp_path / ("p%d" % i)), dtype=np.float32) for i in (0, 1))
    assert p0.size > 10000 and np.array_equal(p0, p1), "the trainers' parameters differ"

    # the checkpoint pattern: stopped after 30 of 60 steps, saved at 30; a new
    # launch loads the file (model and optimizer state_dict) and goes on to 60
    ck, save = str(tmp_path / "ck"), str(tmp_path / "ckpt.pt")
    launch(tmp_path, corpus, 60, str(tmp_path / "a"),
           ["--save", save, "--save-every", "30", "--stop-at", "30"], ck)
    out = launch(tmp_path, corpus, 60, str(tmp_path / "b"), ["--save", save, "--save-every", "30"],
                 ck)
    assert "resumed from %s (step 30)" % save in out and "steps 31..60 done" in out, out
    for i in (0, 1):
        b = np.fromfile(str(tmp_path / ("b%d" % i)), dtype=np.float32)
        assert np.array_equal(b, p0), "trainer %d: the resumed run differs" % i

    # resumed after its last step (a job requeued as it ended): nothing left
    # to do, said, and the parameters are the finished run's
    out = launch(tmp_path, corpus, 60, str(tmp_path / "c"), ["--save", save], ck)
    assert "resumed from %s (step 60)" % save in out, out
    assert out.count("steps 61..60 done: nothing was left to do") == 2, out
    for i in (0, 1):
        c = np.fromfile(str(tmp_path / ("c%d" % i)), dtype=np.float32)
        assert np.array_equal(c, p0), "trainer %d: the run resumed at its end differs" % i
