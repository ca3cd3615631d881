#!/usr/bin/env bash
# deploy/torch2-venv.sh DIR: make (or reuse) the virtual environment in DIR
# with a current torch 2.x from PyPI, Lightning, numpy, pytest and pyzmq.
# The ctest entries integration_torch2 and integration_lightning run the
# binding, scape-run's trainers and scape.integrations.lightning in it
# (tests/integration/test_torch2.py, test_lightning.py), beside Debian's
# torch 1.13 in /usr/bin/python3.
#
# PyPI is the only index reachable, so torch is PyPI's default wheel with its
# nvidia-* dependencies (about 3 GB to download, 5.5 GB installed; it runs
# on the CPU too), about 2 minutes here.  The venv is isolated (no
# --system-site-packages), so Debian's torch 1.13 cannot shadow it.
# Idempotent: a DIR whose requested packages are unchanged and import is
# kept.  Prints what it installed and how long it took.
#   SCAPE_TORCH2_BASE_PYTHON  interpreter to base it on (default /usr/bin/python3)
#   SCAPE_TORCH2_SPEC         requirement for torch (default "torch>=2,<3")
#   SCAPE_LIGHTNING_SPEC      requirement for Lightning (default "lightning>=2,<3")
set -euo pipefail

DIR=${1:?usage: deploy/torch2-venv.sh DIR}
PY=${SCAPE_TORCH2_BASE_PYTHON:-/usr/bin/python3}
TORCH_SPEC=${SCAPE_TORCH2_SPEC:-torch>=2,<3}
LIGHTNING_SPEC=${SCAPE_LIGHTNING_SPEC:-lightning>=2,<3}
REQS=("$TORCH_SPEC" "$LIGHTNING_SPEC" numpy pytest pyzmq)
say() { echo "torch2-venv: $*"; }

check() {
  "$DIR/bin/python" - <<'PYEOF'
import sys
from importlib.metadata import version
import torch, lightning, numpy, pytest, zmq  # noqa: F401
if int(torch.__version__.split(".")[0]) < 2:
    sys.exit("torch2-venv: torch %s is not 2.x" % torch.__version__)
print("torch2-venv: " + ", ".join("%s %s" % (k, version(k)) for k in
      ("torch", "lightning", "numpy", "pytest", "pyzmq")))
PYEOF
}

if [ -x "$DIR/bin/python" ] && [ "$(cat "$DIR/.scape-torch2-reqs" 2>/dev/null)" = "${REQS[*]}" ] && check; then
  say "$DIR is up to date"
  exit 0
fi
if ! "$PY" -c 'import ensurepip' 2>/dev/null; then
  say "$PY cannot make a venv (no ensurepip); install Debian's python3-venv (apt-get install python3-venv)" >&2
  exit 1
fi
start=$(date +%s)
if [ ! -x "$DIR/bin/python" ]; then
  say "creating $DIR from $PY"
  "$PY" -m venv "$DIR"
fi
say "installing ${REQS[*]} from PyPI (torch's default wheel with its nvidia-* libraries, about 3 GB the first time)"
"$DIR/bin/python" -m pip install --disable-pip-version-check -q "${REQS[@]}"
check
echo "${REQS[*]}" >"$DIR/.scape-torch2-reqs"
say "installed into $DIR in $(( $(date +%s) - start )) s ($(du -sh "$DIR" | cut -f1) on disk):"
"$DIR/bin/python" -m pip list --disable-pip-version-check --format=freeze |
  grep -iE '^(torch|lightning|pytorch-lightning|lightning-utilities|torchmetrics|numpy|pytest|pyzmq)==' | sed 's/^/  /'
