"""A short training run of the pip-installed scape package: a quadratic's
parameters pulled to a target through the installed scaped, started by the
installed scape-run.  Prints the losses; exits 1 unless the loss falls."""
import os
import sys

import numpy as np
import scape

n = 5000
target = np.linspace(-1.0, 1.0, n, dtype=np.float32)
with scape.attach(layout=[("w", n - 100), ("b", 100)]) as s:
    assert s.index == int(os.environ["SCAPE_INDEX"]), (s.index, os.environ["SCAPE_INDEX"])
    s.params[:] = 0.0
    s.sync()
    losses = []
    for t in range(1, 41):
        s.grads[:] = s.params - target
        losses.append(float(np.mean((s.params - target) ** 2)))
        s.step(0.05)
print("venv_train %d: loss %.4f -> %.4f (libscape %s, from %s)"
      % (s.index, losses[0], losses[-1], scape.version(), scape.__file__))
sys.exit(0 if losses[-1] < 0.5 * losses[0] else 1)
