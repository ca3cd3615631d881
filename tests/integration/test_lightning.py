"""Lightning with scaped (scape.integrations.lightning.ScapeStrategy): a
LightningModule (tests/integration/lightning_train.py) trained by
1 daemon x 2 trainers under scape-run, with the real scaped, in the torch
2.x virtual environment of $SCAPE_TORCH2_VENV (ctest integration_lightning;
deploy/torch2-venv.sh makes it; without it the tests skip, saying why).

Checked: each trainer is its own global rank of a world of 2 and reads its
own shard (the hashes of the first batches differ); only rank 0 writes
checkpoint files; no process group, no DistributedDataParallel; the
Trainer's gradient_clip_val is the daemon's bound (this trainer's own
gradient reaches the optimizer unclipped, the daemon clips); the trainers
end bitwise equal; fit() runs a second time in the same process and the
job goes on from the daemon's step; stopped after epoch 1 and resumed from
Lightning's last.ckpt by a new launch, the run ends bitwise where the
uninterrupted one does; a gradient_clip_val other than the daemon's is
refused at attach, and lr_find at setup."""
import os
import re
import subprocess

import numpy as np

from conftest import SOURCE, torch2_python

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "lightning_train.py")
CLIP = 0.1


def launch(py, args, ck_daemon, nproc=2, max_grad_norm=CLIP, ok=True):
    env = dict(os.environ, PYTHONPATH=os.path.join(SOURCE, "client", "python"))
    env.pop("SCAPE_TORCH2_VENV", None)
    cmd = [py, "-m", "scape.run", "--nproc-per-node", str(nproc),
           "--set", "rho=0.5", "--set", "warmup=2",
           "--set", "max_grad_norm=%g" % max_grad_norm, "--set", "checkpoint_dir=" + ck_daemon,
           "--", py, SCRIPT, "--clip", str(CLIP), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    out = r.stdout + r.stderr
    assert (r.returncode == 0) == ok, out[-20000:]
    # Lightning's loop fits bucketed hand-over (the daemon clips): the
    # default size stays on
    assert "is off for this optimizer" not in out, out[-20000:]
    return out


def results(out):
    """rank -> {key: value} of the script's "result" lines."""
    got = {}
    for rank, kv in re.findall(r"^result (\d+) (.*)$", out, re.M):
        got[int(rank)] = dict(p.split("=") for p in kv.split())
    return got


def params(path):
    return np.fromfile(path, dtype=np.float32)


def test_lightning_module_with_scaped(tmp_path):
    py = torch2_python()
    t = str(tmp_path)

    # the uninterrupted run: 2 epochs of 6 steps, checkpoint files each epoch,
    # then a second fit() of 1 epoch in the same processes
    out = launch(py, ["--epochs", "2", "--ckpt-dir", t + "/ck", "--out", t + "/a",
                      "--fit-again"], t + "/dck")
    res = results(out)
    assert sorted(res) == [0, 1], out
    for r in (0, 1):
        v = res[r]
        assert (v["global_rank"], v["world_size"], v["is_global_zero"]) == \
            (str(r), "2", str(int(r == 0))), (r, v)
        assert v["dist"] == "0" and v["ddp"] == "0", "torch.distributed in play: %r" % v
        assert v["sampler_replicas"] == "2" and v["step"] == "12", v
        assert v["hooks"] == "12,12", "the step hooks did not fire on every step: %r" % v
        # Lightning left this trainer's gradient as it was: its norm exceeds the
        # clip bound; the daemon clipped (a factor below 1)
        assert float(v["local_norm_max"]) > CLIP and float(v["clip_min"]) < 1.0, v

    first = dict(re.findall(r"^first-batch (\d+) (\w+)$", out, re.M))
    assert sorted(first) == ["0", "1"] and first["0"] != first["1"], \
        "the trainers' first batches: %r" % first

    wrote = re.findall(r"^wrote (\d+) (\S+)$", out, re.M)
    assert {r for r, _ in wrote} == {"0"}, "checkpoint files written by: %r" % wrote
    assert {os.path.basename(p) for _, p in wrote} == \
        {"epoch=0-step=6.ckpt", "epoch=1-step=12.ckpt", "last.ckpt"}, wrote

    a0, a1 = params(t + "/a0"), params(t + "/a1")
    assert a0.size == 8 * 16 + 16 + 16 + 1 and np.array_equal(a0, a1), \
        "the trainers' parameters differ"

    # fit() again in the same processes: the new ScapeOptimizer takes the
    # session over (the trainers never leave the job), which goes on from step 13
    assert sorted(re.findall(r"^again (\d+) step=(\d+) same_session=(\d)$", out, re.M)) == \
        [("0", "18", "1"), ("1", "18", "1")], out[-5000:]
    g0, g1 = params(t + "/aagain0"), params(t + "/aagain1")
    assert np.array_equal(g0, g1) and not np.array_equal(g0, a0)

    # stopped after epoch 1; a new launch resumes from Lightning's last.ckpt
    # (its optimizer state names the daemon's checkpoint) and ends bitwise
    # where the uninterrupted run did
    launch(py, ["--epochs", "1", "--ckpt-dir", t + "/ckb", "--out", t + "/b"], t + "/dckb")
    out = launch(py, ["--epochs", "2", "--ckpt-dir", t + "/ckb", "--out", t + "/c",
                      "--resume", t + "/ckb/last.ckpt"], t + "/dckb")
    res = results(out)
    assert [res[r]["step"] for r in (0, 1)] == ["12", "12"], out[-5000:]
    for r in (0, 1):
        assert np.array_equal(params(t + "/c%d" % r), a0), \
            "trainer %d: the resumed run differs from the uninterrupted one" % r

    # a Trainer clipping at another bound than the daemon's is refused at attach
    out = launch(py, ["--epochs", "1", "--out", t + "/d"], t + "/dckd", nproc=1,
                 max_grad_norm=1.0, ok=False)
    assert "expects max_grad_norm %g, but this daemon clips at 1" % CLIP in out, out[-5000:]

    # lr_find's trial steps could not be taken back in the daemon: refused
    out = launch(py, ["--lr-find", "--out", t + "/e"], t + "/dcke", nproc=1, ok=False)
    assert "lr_find (Tuner.lr_find, LearningRateFinder) is not supported" in out, out[-5000:]
