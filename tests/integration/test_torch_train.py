"""The PyTorch example trainer (client/examples/torch_train.py) as a user
runs it: through scape-run, two trainer processes train the GPT on the
fortunes corpus with scape.torch.ScapeOptimizer, two parameter groups (decay
on the matrices only), the daemon clipping at 1.0 and bf16 autocast; the
validation loss falls, the daemon reports the gradient norm and clips, and
both trainers end with the same parameters, bit for bit.  Needs PyTorch in
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


def test_torch_trainer_through_the_launcher(tmp_path, corpus):  # noqa: F811
    script = os.path.join(SOURCE, "client", "examples", "torch_train.py")
    env = dict(os.environ, PYTHONPATH=os.path.join(SOURCE, "client", "python"))
    cmd = [sys.executable, "-m", "scape.run", "--nproc-per-node", "2",
           "--set", "rho=0.1", "--set", "warmup=10", "--set", "max_grad_norm=1.0", "--",
           sys.executable, script, "--corpus", corpus, "--steps", "60", "--d", "32",
           "--layers", "1", "--heads", "2", "--ctx", "32", "--lr", "1e-2",
           "--eval-every", "20", "--max-grad-norm", "1.0", "--autocast", "bf16",
           "--out", str(tmp_path / "p") + "$LOCAL_RANK"]
    # the launcher passes the command as it is; a shell expands $LOCAL_RANK
    shell = cmd[:cmd.index("--") + 1] + ["sh", "-c", " ".join(
        "'%s'" % c if c != cmd[-1] else c for c in cmd[cmd.index("--") + 1:])]
    r = subprocess.run(shell, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    steps = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    vals = [float(line.split()[5]) for line in steps]
    norms = [float(re.search(r"grad norm ([\d.]+)", line).group(1)) for line in steps]
    assert len(vals) == 6 and max(vals[-2:]) < vals[0], r.stdout  # both trainers print
    assert all(n > 0 for n in norms), r.stdout
    p0, p1 = (np.fromfile(str(tmp_path / ("p%d" % i)), dtype=np.float32) for i in (0, 1))
    assert p0.size > 10000 and np.array_equal(p0, p1), "the trainers' parameters differ"
