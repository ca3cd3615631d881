"""The Hugging Face Trainer with scaped through scape.integrations.hf
(hf_train.py: a tiny Llama from a config on bytes of Debian's fortunes),
launched by scape-run with real daemons, as 1 daemon x 2 trainers and as
2 daemons x 1 trainer: the loss falls, the trainers see different data and
end bitwise equal, nothing goes distributed, the daemon clips (the trainers'
own gradients reach it unclipped), one trainer saves, checkpoints every K
steps and at the last one, and a new launch resumed from the Trainer's
checkpoint ends bitwise where the uninterrupted run does; train() called
twice on one trainer keeps the trainer in the job (one attach), and a
second train() that raises detaches at once.  Also the
porting example of docs/porting.md: ddp_port.py under scape-run against
ddp_train.py under torch.distributed, and the doc's diff against the files.

The HF tests run in the virtual environment of deploy/hf-venv.sh, named by
SCAPE_HF_VENV (ctest integration_hf sets it); without it they are skipped
(integration_hf_ddp_port runs the rest of the file, leaving them to that
ctest)."""
import difflib
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import SOURCE, free_endpoints, job_key

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, EVERY, STOP = 30, 8, 16
CLIP = 1.0  # below every early step's gradient norm, so the daemon clips


def hf_python():
    venv = os.environ.get("SCAPE_HF_VENV")
    if not venv:
        pytest.skip("needs SCAPE_HF_VENV (ctest integration_hf, venv from deploy/hf-venv.sh)")
    py = os.path.join(venv, "bin", "python")
    if not os.access(py, os.X_OK):
        pytest.fail("SCAPE_HF_VENV=%s holds no virtual environment: make it with "
                    "deploy/hf-venv.sh %s" % (venv, venv))
    r = subprocess.run([py, "-c", "import transformers, accelerate"], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.fail("the venv %s cannot import transformers/accelerate (%s): run "
                    "deploy/hf-venv.sh %s" % (venv, r.stderr.strip()[-300:], venv))
    return py


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = os.path.join(SOURCE, "client", "python") + os.pathsep + \
        e.get("PYTHONPATH", "")
    return e


def scape_run(args, cmd, cwd):
    return subprocess.Popen([sys.executable, "-m", "scape.run", *args, "--", *cmd],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env(), cwd=cwd)


def launch(py, layout, tag, tmp, extra=()):
    """One launch of hf_train.py as layout (1, 2): one daemon, two trainers,
    or (2, 1): two daemons of one trainer; its results by rank."""
    nodes, per = layout
    out = tmp / ("out-" + tag)
    out.mkdir()
    base = ["--nproc-per-node", str(per), "--set", "checkpoint_dir=%s" % (tmp / "ckpt"),
            "--set", "checkpoint_keep=8", "--set", "max_grad_norm=%g" % CLIP,
            "--set", "rho=1"]
    cmd = [py, os.path.join(HERE, "hf_train.py"), "--out", str(out),
           "--output-dir", str(tmp / "hf"), "--steps", str(STEPS), "--save-steps", str(EVERY),
           "--max-grad-norm", str(CLIP), *extra]
    if nodes == 1:
        procs = [scape_run(base, cmd, str(tmp))]
    else:
        port = int(free_endpoints(1)[0].rsplit(":", 1)[1])
        procs = [scape_run(base + ["--nnodes", "2", "--node-rank", str(r),
                                   "--master-addr", "127.0.0.1", "--master-port", str(port),
                                   "--set", "auth=secret", "--set",
                                   "auth_key_file=" + job_key()], cmd, str(tmp))
                 for r in range(2)]
    for i, p in enumerate(procs):
        text, _ = p.communicate(timeout=400)
        (out / ("launch%d.log" % i)).write_text(text)
        assert p.returncode == 0, "launch %s failed:\n%s" % (tag, text[-6000:])
        # the Trainer's loop fits bucketed hand-over (the daemon clips): the
        # default size stays on
        assert "is off for this optimizer" not in text, text[-6000:]
    return [json.loads((out / ("r%d.json" % r)).read_text()) for r in range(nodes * per)], out


def daemon_checkpoint(ckdir, sd):
    """The directory a ScapeOptimizer state_dict names (absolute, or relative
    to checkpoint_dir)."""
    p = sd["scaped_checkpoint"]
    return p if os.path.isabs(p) else os.path.join(ckdir, p)


def check_run(res, out, ckdir, steps, first=1):
    world = len(res)
    for r in res:
        assert r["world"] == world and r["env_before"]["RANK"] == str(r["rank"])
        # no DDP: one process for accelerate, the bare model, no process group
        assert r["same_model"] and r["wrapped"] == "LlamaForCausalLM", r["wrapped"]
        assert not r["dist_initialized"] and r["accelerate_processes"] == 1
        # the Trainer clips nothing; the bound went to the daemon
        assert r["trainer_max_grad_norm"] == 0 and r["scape_max_grad_norm"] == CLIP
        assert [l["scape_step"] for l in r["logs"]] == list(range(first, steps + 1))
        assert r["last_info_step"] == steps
    # bitwise equal trainers, each on its own shard
    assert len({r["hash"] for r in res}) == 1, [r["hash"] for r in res]
    for i in range(len(res[0]["batches"])):
        assert len({r["batches"][i] for r in res}) == world, "step %d: shared batch" % (i + 1)
    for r in res:  # 10 steps an epoch: each epoch reshuffled
        b = r["batches"]
        assert all(b[i:i + 10] != b[i + 10:i + 20] for i in range(0, len(b) - 19, 10))
    # the daemon's figures in every trainer's logs, the same in each
    for a, b in zip(res[0]["logs"], res[1]["logs"]):
        for k in ("grad_norm", "clip", "scape_bytes", "scape_density"):
            assert a[k] == b[k], (k, a, b)
    logs = res[0]["logs"]
    assert all(l["scape_bytes"] > 0 and l["scape_density"] == 1.0 for l in logs)
    # clipping once, by the daemon: clip = CLIP / norm where the norm is above
    # CLIP, and that norm is the one of the trainers' mean raw gradient
    assert any(l["clip"] < 1 for l in logs)
    for l in logs:
        want = min(1.0, CLIP / (l["grad_norm"] + 1e-6))
        assert abs(l["clip"] - want) <= 1e-6 * want, l
    for r in res:
        assert any(v > CLIP for v in r["local_norms"].values()), r["local_norms"]
    grads = sorted(out.glob("grad_r0_s*.npy"))
    assert grads
    for g0 in grads:
        step = int(re.search(r"_s(\d+)", g0.name).group(1))
        mean = sum(np.load(out / ("grad_r%d_s%d.npy" % (r, step))) for r in range(world)) / world
        log = logs[step - first]
        for k in ("grad_norm", "scape_mean_grad_norm"):  # the second when reported
            daemon = log.get(k, log["grad_norm"])
            assert abs(np.linalg.norm(mean) - daemon) <= 1e-5 * daemon, (step, k, daemon)
    # one saver of the model; every trainer waits for the daemons' checkpoint
    assert res[0]["saves"] and all(not r["saves"] for r in res[1:])
    assert all(r["opt_saves"] == res[0]["opt_saves"] for r in res)
    return logs


def check_checkpoints(res, hfdir, ckdir, want):
    ck = res[0]["checkpoints"]
    assert sorted(ck, key=lambda d: int(d.split("-")[1])) == \
        ["checkpoint-%d" % s for s in want], sorted(ck)
    assert res[0]["saves"] == ["checkpoint-%d" % s for s in want]
    assert res[0]["opt_saves"] == want
    for name, sd in ck.items():
        step = int(name.split("-")[1])
        assert sd["step"] == step, (name, sd)
        assert os.path.isdir(daemon_checkpoint(str(ckdir), sd)), (name, sd)
        for r in range(len(res)):
            assert (hfdir / name / ("rng_state_rank%d" % r) / "rng_state.pth").exists()


@pytest.mark.parametrize("layout", [(1, 2), (2, 1)], ids=["1daemon-2trainers",
                                                            "2daemons-1trainer"])
def test_hf_trainer(tmp_path, layout):
    py = hf_python()
    full_dir, part_dir = tmp_path / "full", tmp_path / "part"
    full_dir.mkdir()
    part_dir.mkdir()
    # uninterrupted: the loss falls; checkpoints every EVERY steps and the last
    full, out = launch(py, layout, "full", full_dir)
    logs = check_run(full, out, full_dir / "ckpt", STEPS)
    loss = [l["loss"] for l in logs]
    assert np.mean(loss[-5:]) < np.mean(loss[:5]) - 0.5, loss
    want = list(range(EVERY, STEPS + 1, EVERY)) + ([STEPS] if STEPS % EVERY else [])
    check_checkpoints(full, full_dir / "hf", full_dir / "ckpt", want)
    # stopped at STOP, then a new launch resumed from the Trainer's checkpoint
    part, _ = launch(py, layout, "stop", part_dir, ["--stop-at", str(STOP)])
    check_checkpoints(part, part_dir / "hf", part_dir / "ckpt",
                      list(range(EVERY, STOP + 1, EVERY)))
    for p in part:
        assert p["batches"] == full[p["rank"]]["batches"][:STOP]
    resumed, out = launch(py, layout, "resumed", part_dir,
                          ["--resume", str(part_dir / "hf" / ("checkpoint-%d" % STOP))])
    check_run(resumed, out, part_dir / "ckpt", STEPS, first=STOP + 1)
    for r, f in zip(resumed, full):
        assert r["batches"] == f["batches"][STOP:], "rank %d: other data after resume" % r["rank"]
        assert [l["loss"] for l in r["logs"]] == [l["loss"] for l in f["logs"][STOP:]]
    assert resumed[0]["hash"] == full[0]["hash"], "resumed run differs from uninterrupted"


def test_hf_train_twice(tmp_path):
    """train() twice on one ScapeTrainer in each of 2 trainer processes under
    one daemon: after the first the optimizer stays attached and the second
    train()'s takes its session over, so the daemon sees each trainer attach
    once and the steps go on; the release() at exit detaches them."""
    py = hf_python()
    first, again = 3, 6
    res, out = launch(py, (1, 2), "twice", tmp_path,
                      ["--steps", str(first), "--train-again", str(again)])
    check_run(res, out, tmp_path / "ckpt", first)
    for r in res:
        assert r["attached"] and r["kept"], "after the first train(): %r" % r["rank"]
        a = r["again"]
        assert a["same_session"] and a["attached"] and a["kept"], (r["rank"], a["attached"])
        # the daemon's steps go on from the first train(); the Trainer's own
        # count and its scheduler start anew (warm-up again)
        assert [l["scape_step"] for l in a["logs"]] == list(range(first + 1, first + again + 1))
        assert [l["step"] for l in a["logs"]] == list(range(1, again + 1))
        assert a["last_info_step"] == first + again
        assert a["lr"][0] == r["logs"][0]["learning_rate"], (a["lr"], r["logs"])
        assert a["hash"] != r["hash"]
        assert a["saves"][-1:] == (["checkpoint-%d" % again] if r["rank"] == 0 else [])
        # the atexit release() detached the optimizer the second train() kept
        assert json.loads((out / ("exit%d.json" % r["rank"])).read_text()) == \
            {"attached": False, "kept": 0}
    assert res[0]["again"]["hash"] == res[1]["again"]["hash"], "trainers differ after train 2"
    for i in range(again):
        assert res[0]["again"]["batches"][i] != res[1]["again"]["batches"][i]
    for a, b in zip(res[0]["again"]["logs"], res[1]["again"]["logs"]):
        for k in ("grad_norm", "clip", "scape_bytes", "scape_step"):
            assert a[k] == b[k], (k, a, b)
    # the daemon: each trainer attached once and detached (said goodbye) once
    log = (out / "launch0.log").read_text()
    attached = re.findall(r"trainer (\d+) attached", log)
    left = re.findall(r"trainer (\d+) \([^)]*\) (detached|died)", log)
    assert sorted(attached) == ["0", "1"], log[-6000:]
    assert sorted(left) == [("0", "detached"), ("1", "detached")], log[-6000:]


def test_hf_train_again_fails(tmp_path):
    """A second train() that raises (a callback, once its optimizer has taken
    the first's session over) detaches at once: nothing is kept attached."""
    py = hf_python()
    res, out = launch(py, (1, 1), "fails", tmp_path,
                      ["--steps", "2", "--train-again", "4", "--again-fails"])
    r = res[0]
    assert r["last_info_step"] == 2 and r["attached"] and r["kept"], r["rank"]
    assert r["again"] == {"raised": "hf_train.py: the failing train()", "took_over": True,
                          "attached": False, "old_attached": False, "kept": False}, r["again"]
    assert json.loads((out / "exit0.json").read_text()) == {"attached": False, "kept": 0}
    log = (out / "launch0.log").read_text()
    assert re.findall(r"trainer (\d+) attached", log) == ["0"], log[-6000:]
    assert re.findall(r"trainer (\d+) \([^)]*\) (detached|died)", log) == \
        [("0", "detached")], log[-6000:]


def test_ddp_port(tmp_path):
    """docs/porting.md: ddp_port.py under scape-run trains as ddp_train.py does
    under torch.distributed (the same losses within float rounding), and the
    doc's diff is the files' diff."""
    ex = os.path.join(SOURCE, "client", "examples")
    orig, port = os.path.join(ex, "ddp_train.py"), os.path.join(ex, "ddp_port.py")
    with open(orig) as f:
        a = f.readlines()
    with open(port) as f:
        b = f.readlines()
    diff = "".join(difflib.unified_diff(a, b, "ddp_train.py", "ddp_port.py"))
    with open(os.path.join(SOURCE, "docs", "porting.md")) as f:
        doc = f.read()
    block = re.search(r"```diff\n(.*?)```", doc, re.S)
    assert block and block.group(1) == diff, "docs/porting.md's diff is not the files' diff:\n" + diff

    steps = "40"
    port_no = int(free_endpoints(1)[0].rsplit(":", 1)[1])
    # the reference is torch's own code: run it without the sanitizer build's preload
    plain = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS")}
    ddp = [subprocess.Popen([sys.executable, orig, "--steps", steps, "--save",
                             str(tmp_path / "ddp.pt")], cwd=str(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(plain, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port_no)))
           for r in range(2)]
    p = scape_run(["--nproc-per-node", "2", "--set", "optimizer=adamw",
                   "--set", "max_grad_norm=1.0", "--set",
                   "checkpoint_dir=%s" % (tmp_path / "ckpt")],
                  [sys.executable, port, "--steps", steps, "--save", str(tmp_path / "s.pt")],
                  str(tmp_path))
    outs = [q.communicate(timeout=300)[0] for q in ddp + [p]]
    for q, o in zip(ddp + [p], outs):
        assert q.returncode == 0, o[-4000:]

    def losses(text):
        return [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", text, re.M)]
    ref, got = losses(outs[0]), losses(outs[2])
    assert len(ref) == len(got) == 4, (outs[0], outs[2])
    for x, y in zip(ref, got):
        assert abs(x - y) <= 0.02 * x, (ref, got)
    sd = torch.load(str(tmp_path / "s.pt"))["optimizer"]
    assert sd["step"] == int(steps) and os.path.isdir(daemon_checkpoint(
        str(tmp_path / "ckpt"), sd)), sd
