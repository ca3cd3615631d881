"""The PyTorch example trainer (client/examples/torch_train.py) through a real
scaped: two trainer processes train the GPT on the fortunes corpus with
scape.torch.ScapeOptimizer; the loss falls and both end with the same
parameters, bit for bit.  Needs PyTorch in the interpreter running the tests
(skipped without it: the test command does not install PyTorch)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import SOURCE
from test_gpt_training import corpus  # noqa: F401  (the fixture)

torch = pytest.importorskip("torch")


def test_torch_trainer_trains_and_trainers_agree(daemon_factory, tmp_path, corpus):  # noqa: F811
    d = daemon_factory("--rho", "0.1", "--warmup", "10", "--trainers", "2")
    script = os.path.join(SOURCE, "client", "examples", "torch_train.py")
    procs = [subprocess.Popen([sys.executable, script, "--corpus", corpus, "--endpoint",
                               d.endpoint, "--index", str(i), "--seed", str(1 + i),
                               "--steps", "60", "--d", "32", "--layers", "1", "--heads", "2",
                               "--ctx", "32", "--lr", "1e-2", "--eval-every", "20",
                               "--out", str(tmp_path / ("p%d" % i))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in (0, 1)]
    outs = []
    for p in procs:
        o, e = p.communicate(timeout=600)
        assert p.returncode == 0, o + e
        outs.append(o)
    losses = [float(line.split()[3]) for line in outs[0].splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0], outs[0]
    p0, p1 = (np.fromfile(str(tmp_path / ("p%d" % i)), dtype=np.float32) for i in (0, 1))
    assert p0.size > 10000 and np.array_equal(p0, p1), "the trainers' parameters differ"
