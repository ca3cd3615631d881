"""The C GPT (client/examples/gpt.c) and the PyTorch GPT of torch_train.py
are the same model: on the same parameters and the same batch they give the
same loss and the same gradients.

gpt_probe (client/examples/gpt_probe.c) initialises the C model as the C
trainers do, takes one fixed batch, runs forward and backward in float and in
the double twin, and writes the layout, parameters, loss and gradients.  Here
every C tensor is mapped to its torch parameter (the C matrices are
[in][out], nn.Linear's [out][in]: transposed), each exactly once and every
torch parameter covered; torch_train.GPT gets the C parameters and computes
loss and gradients on the same tokens, in float32 and float64.  float32 must
agree to float rounding; float64 (C's double twin against torch in float64)
to 1e-10, which separates a real difference of the models (a layer norm
epsilon, a GELU variant) from rounding: the test shows that it catches a
layer norm epsilon of 1e-6 instead of gpt.c's 1e-5, whose loss differs by
only 4e-6 relative, inside the float32 loss bound.
The initialisation is compared by distribution (the two draw from different
generators): the same tensors zero, one, N(0, 0.02) and N(0, 0.02/sqrt(2L)).

The data side too: torch_train.load_corpus splits the corpus as gpt_data.c
does (sizes and a hash of each split), torch_train.evaluate over 128 windows
is bench_quality's validation loss (16 batches of 8) on the same parameters,
and torch_train.batch draws from every window gpt_batch does."""
import contextlib
import importlib.util
import os
import subprocess

import numpy as np
import pytest

from conftest import SOURCE, binary
from test_gpt_training import corpus  # noqa: F401  (the fixture)

torch = pytest.importorskip("torch")

# float32: loss to rel 1e-5, each gradient tensor to 1e-5 * max(1, max|g|)
# (every max|g| here is below 1: 1e-5 absolute); measured: loss rel <= 7e-8,
# gradients <= 1.8e-7.  float64: 1e-10 relative; measured: loss rel <= 6e-16,
# gradients <= 6e-16 (pytest -s prints every tensor).
LOSS_RTOL32, GRAD_TOL32 = 1e-5, 1e-5
LOSS_RTOL64, GRAD_TOL64 = 1e-10, 1e-10


def torch_train():
    """client/examples/torch_train.py as a module (it imports scape.torch,
    which finds libscape through SCAPE_BUILD_DIR)."""
    path = os.path.join(SOURCE, "client", "examples", "torch_train.py")
    spec = importlib.util.spec_from_file_location("torch_train", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def read_probe(path):
    """gpt_probe's file (the format is in gpt_probe.c's comment)."""
    buf = open(path, "rb").read()
    assert buf[:8] == b"GPTPROB1", "not a gpt_probe file"
    at = 8
    head = np.frombuffer(buf, "<i4", 8, at)
    at += 32
    vocab, ctx, d, layers, heads, B, T, nt = (int(v) for v in head)
    n = int(np.frombuffer(buf, "<u8", 1, at)[0])
    at += 8
    tensors = []
    for _ in range(nt):
        name = buf[at:at + 48].split(b"\0")[0].decode()
        off, length = (int(v) for v in np.frombuffer(buf, "<u8", 2, at + 48))
        tensors.append((name, off, length))
        at += 64

    def take(dtype, count):
        nonlocal at
        a = np.frombuffer(buf, dtype, count, at)
        at += a.nbytes
        return a
    p = {"config": dict(vocab=vocab, ctx=ctx, d=d, layers=layers, heads=heads),
         "B": B, "T": T, "n": n, "tensors": tensors}
    p["x"] = take("<i4", B * T).reshape(B, T)
    p["y"] = take("<i4", B * T).reshape(B, T)
    p["params"] = take("<f4", n)
    p["loss"] = float(take("<f8", 1)[0])
    p["grads"] = take("<f4", n)
    p["loss64"] = float(take("<f8", 1)[0])
    p["grads64"] = take("<f8", n)
    p["val_loss"] = float(take("<f8", 1)[0])
    p["n_train"], p["n_val"], p["hash_train"], p["hash_val"] = (
        int(v) for v in take("<u8", 4))
    assert at == len(buf), "gpt_probe's file has %d bytes, %d read" % (len(buf), at)
    return p


def run_probe(tmp_path, name, args):
    out = str(tmp_path / (name + ".bin"))
    r = subprocess.run([binary("client", "examples", "gpt_probe"), "--out", out, *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    p = read_probe(out)
    # the layout it prints is the one it wrote
    printed = [tuple(line.split()[1:]) for line in r.stdout.splitlines()
               if line.startswith("tensor ")]
    assert printed == [(nm, str(o), str(ln)) for nm, o, ln in p["tensors"]]
    return p


# gpt.h's per-layer tensors -> Block's parameters; True: transposed (a matrix
# of gpt.c is [in][out], nn.Linear's weight [out][in])
LAYER_MAP = {"ln1.w": ("ln1.weight", False), "ln1.b": ("ln1.bias", False),
             "attn.qkv.w": ("qkv.weight", True), "attn.qkv.b": ("qkv.bias", False),
             "attn.proj.w": ("proj.weight", True), "attn.proj.b": ("proj.bias", False),
             "ln2.w": ("ln2.weight", False), "ln2.b": ("ln2.bias", False),
             "mlp.fc.w": ("fc.weight", True), "mlp.fc.b": ("fc.bias", False),
             "mlp.proj.w": ("fc_proj.weight", True), "mlp.proj.b": ("fc_proj.bias", False)}
TOP_MAP = {"wte": ("wte.weight", False), "wpe": ("wpe.weight", False),
           "lnf.w": ("lnf.weight", False), "lnf.b": ("lnf.bias", False),
           "head.w": ("head.weight", True)}


def torch_name(c_name):
    if c_name in TOP_MAP:
        return TOP_MAP[c_name]
    layer, rest = c_name.split(".", 1)
    assert layer[0] == "h" and layer[1:].isdigit() and rest in LAYER_MAP, c_name
    tname, tr = LAYER_MAP[rest]
    return "blocks.%d.%s" % (int(layer[1:]), tname), tr


def mapping(p, model):
    """[(c name, C offset, length, torch name, torch parameter, transposed)]:
    every C tensor once, every torch parameter once, the C tensors tiling
    [0, n) in order."""
    named = dict(model.named_parameters())
    rows, seen, off = [], set(), 0
    for c_name, c_off, length in p["tensors"]:
        assert c_off == off, "%s at %d, expected %d: gaps or overlaps" % (c_name, c_off, off)
        off += length
        tname, tr = torch_name(c_name)
        assert tname in named, "%s -> %s: torch has no such parameter" % (c_name, tname)
        assert tname not in seen, "%s: torch's %s mapped twice" % (c_name, tname)
        seen.add(tname)
        t = named[tname]
        assert t.numel() == length, "%s: %d floats, torch's %s has %d" % (
            c_name, length, tname, t.numel())
        assert not tr or t.dim() == 2, tname
        rows.append((c_name, c_off, length, tname, t, tr))
    assert off == p["n"], "the C tensors cover %d of %d floats" % (off, p["n"])
    missing = sorted(set(named) - seen)
    assert not missing, "torch parameters no C tensor maps to: %s" % missing
    assert sum(t.numel() for t in named.values()) == p["n"]
    return rows


def c_view(flat, c_off, length, t, tr):
    """C tensor as a numpy array of torch parameter t's shape."""
    a = flat[c_off:c_off + length]
    if tr:
        return a.reshape(t.shape[1], t.shape[0]).T
    return a.reshape(t.shape)


def load_model(tt, p, dtype, layernorm_eps=None):
    """torch_train.GPT holding the probe's parameters; and mapping()'s rows."""
    c = p["config"]
    torch.manual_seed(0)
    model = tt.GPT(c["vocab"], c["ctx"], c["d"], c["layers"], c["heads"]).to(dtype)
    if layernorm_eps is not None:
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.eps = layernorm_eps
    rows = mapping(p, model)
    with torch.no_grad():
        for c_name, off, length, _, t, tr in rows:
            t.copy_(torch.from_numpy(np.array(
                c_view(p["params"], off, length, t, tr))).to(dtype))
    return model, rows


def torch_pass(tt, p, dtype, layernorm_eps=None):
    """torch_train.GPT on the probe's parameters and batch: loss, {c name:
    gradient as a C-layout numpy array}."""
    model, rows = load_model(tt, p, dtype, layernorm_eps)
    x = torch.from_numpy(p["x"].astype(np.int64))
    y = torch.from_numpy(p["y"].astype(np.int64))
    model.zero_grad()
    loss = model(x, y)
    loss.backward()
    grads = {}
    for c_name, _, _, _, t, tr in rows:
        g = t.grad.detach().numpy()
        grads[c_name] = np.ascontiguousarray(g.T if tr else g).reshape(-1)
    return float(loss), grads


def compare(p, loss, grads, which, loss_rtol, grad_tol, report=True):
    """Worst relative loss difference and worst scaled gradient difference of
    the torch pass against the probe's float (which=32) or double (64) pass;
    asserts them against the bounds and prints every tensor."""
    c_loss = p["loss"] if which == 32 else p["loss64"]
    c_grads = p["grads"] if which == 32 else p["grads64"]
    loss_rel = abs(loss - c_loss) / abs(c_loss)
    worst, lines = 0.0, []
    for c_name, off, length in p["tensors"]:
        cg = c_grads[off:off + length].astype(np.float64)
        tg = grads[c_name].astype(np.float64)
        diff = float(np.max(np.abs(cg - tg)))
        scale = max(1.0, float(np.max(np.abs(cg))))
        worst = max(worst, diff / scale)
        lines.append("  %-16s max|g| %.3e  max|dg| %.3e" % (c_name, np.max(np.abs(cg)), diff))
        if report:
            assert diff <= grad_tol * scale, "float%d %s: gradients differ by %.3e " \
                "(bound %.1e)" % (which, c_name, diff, grad_tol * scale)
    print("float%d: loss C %.10g torch %.10g (rel %.2e); worst gradient diff %.2e\n%s"
          % (which, c_loss, loss, loss_rel, worst, "\n".join(lines)))
    if report:
        assert loss_rel <= loss_rtol, "float%d: loss C %.10g, torch %.10g" % (
            which, c_loss, loss)
    return loss_rel, worst


def check_same_model(p, tt=None):
    tt = tt or torch_train()
    loss32, grads32 = torch_pass(tt, p, torch.float32)
    compare(p, loss32, grads32, 32, LOSS_RTOL32, GRAD_TOL32)
    loss64, grads64 = torch_pass(tt, p, torch.float64)
    compare(p, loss64, grads64, 64, LOSS_RTOL64, GRAD_TOL64)
    return tt


# The C trainers' own case: the demo model (d 64, 2 layers, 4 heads, ctx 64)
# from gpt_init with the trainers' model seed, the training batch of step 1
# of the trainer seeded 1 (bench_quality's rank 0, gpt_train --seed 1), and
# bench_quality's validation (16 batches of 8 windows).
DEMO = ["--d", "64", "--layers", "2", "--heads", "4", "--ctx", "64", "--batch", "8",
        "--seq", "64", "--model-seed", "1234", "--seed", "1", "--eval-batches", "16"]


@pytest.fixture(scope="module")
def torch_side(corpus):  # noqa: F811
    """torch_train as a module and its load_corpus of the test corpus."""
    tt = torch_train()
    return tt, tt.load_corpus(corpus)


def fnv1a(ids):
    """gpt_probe's hash of a split: FNV-1a (64-bit) over the ids as bytes."""
    h = 0xcbf29ce484222325
    for b in bytes(ids.to(torch.uint8).numpy()):
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def check_evaluation(tt, p, val):
    """torch_train.evaluate over E*B windows is the C trainers' validation
    loss of E batches of B (gpt_run_val_loss), on the same parameters."""
    model, _ = load_model(tt, p, torch.float32)
    windows = 16 * p["B"]
    got = tt.evaluate(model, val, p["T"], windows, "cpu", contextlib.nullcontext)
    print("validation over %d windows: C %.9g torch %.9g (rel %.2e)" % (
        windows, p["val_loss"], got, abs(got - p["val_loss"]) / p["val_loss"]))
    assert abs(got - p["val_loss"]) <= LOSS_RTOL32 * p["val_loss"], \
        "validation loss: C %.9g, torch_train.evaluate %.9g" % (p["val_loss"], got)


def test_trainers_start_the_same(tmp_path, corpus, torch_side):  # noqa: F811
    tt, (vocab, train, val) = torch_side
    p = run_probe(tmp_path, "demo", ["--corpus", corpus, *DEMO, "--step", "1"])
    # the same corpus split, token for token
    assert p["config"]["vocab"] == vocab
    assert (p["n_train"], p["n_val"]) == (len(train), len(val))
    assert (p["hash_train"], p["hash_val"]) == (fnv1a(train), fnv1a(val)), \
        "torch_train.load_corpus splits the corpus differently from gpt_data.c"
    check_same_model(p, tt)
    check_evaluation(tt, p, val)
    # the initialisation, by distribution: gpt_init's parameters against a
    # freshly initialised torch_train.GPT of the same shape
    c = p["config"]
    torch.manual_seed(1234)
    model = tt.GPT(c["vocab"], c["ctx"], c["d"], c["layers"], c["heads"])
    for c_name, off, length, tname, t, tr in mapping(p, model):
        cv = p["params"][off:off + length].astype(np.float64)
        tv = t.detach().numpy().astype(np.float64)
        if np.all(cv == 0) or np.all(cv == 1):
            assert np.array_equal(np.unique(tv), np.unique(cv)), \
                "%s is %g everywhere in C; torch's %s is not" % (c_name, cv[0], tname)
            continue
        cs, ts = cv.std(), tv.std()
        assert abs(cv.mean()) < 0.1 * cs and abs(tv.mean()) < 0.1 * ts, c_name
        assert abs(ts - cs) <= 0.1 * cs, "%s: C init std %.4g, torch's %s %.4g" % (
            c_name, cs, tname, ts)


def test_perturbed_ragged_model(tmp_path):
    """Every bias, gain and weight away from its initial value (so that none
    hides behind a zero or a one, and attention is far from uniform), sizes
    off the C tiles, three layers, three heads, a sequence shorter than the
    context (torch slices wpe)."""
    p = run_probe(tmp_path, "ragged", ["--vocab", "37", "--ctx", "16", "--seq", "13",
                                       "--d", "24", "--heads", "3", "--layers", "3",
                                       "--batch", "3", "--model-seed", "5", "--seed", "9",
                                       "--perturb", "0.3"])
    tt = check_same_model(p)
    # the double comparison can tell a layer norm epsilon of 1e-6 from
    # gpt.c's 1e-5, which is below float32's bound
    loss, grads = torch_pass(tt, p, torch.float64, layernorm_eps=1e-6)
    rel, worst = compare(p, loss, grads, 64, LOSS_RTOL64, GRAD_TOL64, report=False)
    assert rel > 100 * LOSS_RTOL64 or worst > 100 * GRAD_TOL64, \
        "float64 cannot tell eps 1e-6 from 1e-5 (loss rel %.2e, grads %.2e)" % (rel, worst)


def test_perturbed_demo_model_on_the_corpus(tmp_path, corpus, torch_side):  # noqa: F811
    """The demo model away from its initialisation (per-window losses then
    differ, so misplaced validation windows would show), step 7's batch."""
    tt, (_, _, val) = torch_side
    p = run_probe(tmp_path, "demo-perturbed", ["--corpus", corpus, *DEMO, "--step", "7",
                                               "--perturb", "0.1"])
    check_same_model(p, tt)
    check_evaluation(tt, p, val)


def test_batches_draw_every_window(torch_side):
    """torch_train.batch draws from all len - T starts, as gpt_batch does
    (it once left out the last one)."""
    tt, _ = torch_side
    tokens, T = torch.arange(10), 7  # starts 0, 1 and 2
    x, y = tt.batch(tokens, 300, T, torch.Generator().manual_seed(3), "cpu")
    assert sorted(set(x[:, 0].tolist())) == [0, 1, 2]
    assert torch.equal(y, x + 1) and int(y.max()) == 9
