#!/usr/bin/env bash
# deploy/hf-venv.sh DIR [TORCH_VENV]: make (or reuse) the virtual environment
# in DIR that scape.integrations.hf and its test (ctest integration_hf) run
# in: transformers and accelerate from PyPI over an existing torch and numpy,
# which pip is held to by a constraints file (it never upgrades them).
#   - without TORCH_VENV: over the system Python's (Debian's torch 1.13),
#     through --system-site-packages;
#   - with TORCH_VENV: over that virtual environment's torch (for example
#     deploy/torch2-venv.sh's torch 2.x), which a .pth file puts on the path.
# The versions are what pip resolves against that torch: on torch 1.x the
# newest that run there, pinned (transformers >= 4.48 fails at import on
# torch 1.13 -- torch.distributed.tensor --, 5.x needs torch >= 2.6, and
# accelerate >= 1.3 torch >= 2.0); on torch 2.x the newest.
# Tested: transformers 4.47.1 + accelerate 1.2.1 on torch 1.13 (Debian 12),
# transformers 5.24.0 + accelerate 1.16.0 on torch 2.15.0 (PyPI).
# Idempotent: a DIR made for the same torch and requests that imports is
# kept.  Prints what it installed.
#   SCAPE_HF_PYTHON         the interpreter to base DIR on (default /usr/bin/python3)
#   SCAPE_HF_TRANSFORMERS   requirement for transformers (default: as above)
#   SCAPE_HF_ACCELERATE     requirement for accelerate (default: as above)
set -euo pipefail

DIR=${1:?usage: deploy/hf-venv.sh DIR [TORCH_VENV]}
TORCH_VENV=${2:-}
PY=${SCAPE_HF_PYTHON:-/usr/bin/python3}
say() { echo "hf-venv: $*"; }

site=""
if [ -n "$TORCH_VENV" ]; then
  site=$("$TORCH_VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])') || {
    say "$TORCH_VENV is not a virtual environment with a python (deploy/torch2-venv.sh makes one)" >&2
    exit 1
  }
  PY="$TORCH_VENV/bin/python"
fi
versions=$("$PY" -c 'from importlib.metadata import version as v; print(v("torch"), v("numpy"))' 2>&1) || {
  say "$PY has no torch or numpy ($versions); install Debian's (deploy/setup.sh: python3-torch python3-numpy)" >&2
  exit 1
}
read -r TORCH NUMPY <<<"$versions"
if [ "${TORCH%%.*}" -lt 2 ]; then
  TRANSFORMERS=${SCAPE_HF_TRANSFORMERS:-transformers==4.47.1}
  ACCELERATE=${SCAPE_HF_ACCELERATE:-accelerate==1.2.1}
else
  TRANSFORMERS=${SCAPE_HF_TRANSFORMERS:-transformers}
  ACCELERATE=${SCAPE_HF_ACCELERATE:-accelerate}
fi
STAMP="$TRANSFORMERS $ACCELERATE torch==$TORCH numpy==$NUMPY site=$site"

check() {
  "$DIR/bin/python" - "$TORCH" <<'PYEOF'
import sys
from importlib.metadata import version
import torch, transformers, accelerate
from transformers import LlamaForCausalLM, Trainer  # noqa: F401 (needs a torch transformers accepts)
got = {k: version(k) for k in ("transformers", "accelerate", "torch", "numpy")}
if got["torch"] != sys.argv[1]:
    sys.exit("hf-venv: torch %s, not %s" % (got["torch"], sys.argv[1]))
print("hf-venv: " + ", ".join("%s %s" % kv for kv in got.items()) + " (torch from %s)"
      % torch.__file__.rsplit("/torch/", 1)[0])
PYEOF
}

if [ -x "$DIR/bin/python" ] && [ "$(cat "$DIR/.scape-hf" 2>/dev/null)" = "$STAMP" ] && check; then
  say "$DIR is up to date"
  exit 0
fi
if [ -n "$site" ]; then
  say "creating $DIR over the torch of $TORCH_VENV"
  "$PY" -m venv --clear "$DIR"
  dsite=$("$DIR/bin/python" -c 'import site; print(site.getsitepackages()[0])')
  echo "$site" >"$dsite/scape-torch-venv.pth"
elif [ ! -x "$DIR/bin/python" ]; then
  say "creating $DIR from $PY (--system-site-packages)"
  "$PY" -m venv --system-site-packages "$DIR"
fi
printf 'torch==%s\nnumpy==%s\n' "$TORCH" "$NUMPY" >"$DIR/constraints.txt"
say "installing $TRANSFORMERS $ACCELERATE (constraints: torch==$TORCH numpy==$NUMPY)"
"$DIR/bin/python" -m pip install --disable-pip-version-check -q -c "$DIR/constraints.txt" \
  "$TRANSFORMERS" "$ACCELERATE"
check
echo "$STAMP" >"$DIR/.scape-hf"
say "installed into $DIR:"
"$DIR/bin/python" -m pip list --disable-pip-version-check --local --format=freeze 2>/dev/null |
  grep -iE '^(transformers|accelerate|tokenizers|safetensors|huggingface.hub)==' | sed 's/^/  /'
