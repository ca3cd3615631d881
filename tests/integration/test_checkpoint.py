"""Checkpoints and resume with real daemons and trainers: a resumed job ends
bitwise where the uninterrupted one does (one daemon and a sharded group of
two); a checkpoint of two daemons resumed by three (resharded); the triggers
(period, scapectl checkpoint, SIGUSR1); pruning; and the refusals: corrupted
files (a flipped byte, a truncated file), another layout or optimizer
setting - each with its reason, and without touching the checkpoints on
disk."""
import hashlib
import json
import os
import signal
import subprocess
import time

from conftest import binary, free_endpoints, run_reference, run_trainer
from test_multinode import ENGINE, read, start_group, train_group

N = 3000


def scapectl(d, *args, timeout=60):
    res = subprocess.run([binary("client", "scapectl"), "--runtime-dir", d.rt, *args],
                         capture_output=True, text=True, timeout=timeout)
    return res.returncode, res.stdout, res.stderr


def status(d):
    rc, out, err = scapectl(d, "status", "--json")
    assert rc == 0, err
    return json.loads(out)


def train_one(d, tmp_path, trainers, steps, tag, **kw):
    procs = [run_trainer(d.endpoint, j, N, steps, out=str(tmp_path / ("%s-%d" % (tag, j))),
                         wait=False, **kw) for j in range(trainers)]
    outs = []
    for j, p in enumerate(procs):
        o, e = p.communicate(timeout=600)
        assert p.returncode == 0, o + e
        outs.append(o)
    return [read(str(tmp_path / ("%s-%d" % (tag, j)))) for j in range(trainers)], outs


def tree_digest(root):
    """Every file under root with its content hash: what must not change."""
    got = {}
    for base, _, files in os.walk(root):
        for f in files:
            p = os.path.join(base, f)
            with open(p, "rb") as fh:
                got[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return got


def refused(daemon_factory, *args):
    """Start scaped expecting it to refuse at start-up; its log."""
    try:
        d = daemon_factory(*args)
    except RuntimeError as e:
        return str(e)
    raise AssertionError("scaped started:\n" + d.output())


def test_resume_one_daemon_is_bitwise_uninterrupted(daemon_factory, tmp_path):
    ck = str(tmp_path / "ck")
    steps = 60
    d = daemon_factory(*ENGINE, "--trainers", "2", "--checkpoint-dir", ck,
                       "--checkpoint-every", "20", "--checkpoint-keep", "2")
    full, _ = train_one(d, tmp_path, 2, steps, "full")
    st = status(d)["checkpoint"]
    assert st["count"] == 3 and st["step"] == 60 and st["error"] is None, st
    assert d.stop() == 0, d.output()
    # keep=2: step-20 was removed, 40 and 60 remain, LATEST names 60.
    assert sorted(x for x in os.listdir(ck) if x.startswith("step-")) == ["step-40", "step-60"]
    assert open(os.path.join(ck, "LATEST")).read().strip() == "step-60"
    assert not [f for _, _, fs in os.walk(ck) for f in fs if ".tmp" in f]

    # Resume from an older step directory: trainers continue at step 41.
    d2 = daemon_factory(*ENGINE, "--trainers", "2", "--resume", os.path.join(ck, "step-40"))
    res, outs = train_one(d2, tmp_path, 2, steps, "res")
    assert all("steps 41..60" in o for o in outs), outs
    assert res == full, "the resumed run differs from the uninterrupted one"
    assert status(d2)["checkpoint"]["resumed_from"] == 40
    assert d2.stop() == 0

    ref = str(tmp_path / "ref")
    run_reference(ref, 2, N, steps, *ENGINE)
    assert full[0] == read(ref)


def test_resume_sharded_group_is_bitwise_uninterrupted(daemon_factory, tmp_path):
    ck = str(tmp_path / "ck")
    trainers, steps = [2, 1], 50
    extra = ["--mode", "sharded", "--checkpoint-dir", ck, "--checkpoint-every", "30"]
    daemons = start_group(daemon_factory, trainers, extra)
    full = train_group(daemons, trainers, tmp_path, N, steps, "full")
    assert all(g == full[0] for g in full)
    for d in daemons:
        assert status(d)["checkpoint"]["step"] == 30
        assert d.stop() == 0, d.output()
    man = open(os.path.join(ck, "step-30", "MANIFEST")).read()
    assert "world 2" in man and "mode sharded" in man and "rank 1 rank-00001.ckpt" in man

    daemons = start_group(daemon_factory, trainers, ["--mode", "sharded", "--resume", ck])
    res = train_group(daemons, trainers, tmp_path, N, steps, "res")
    assert res == full, "the resumed group differs from the uninterrupted one"
    for d in daemons:
        assert d.stop() == 0, d.output()
    ref = str(tmp_path / "ref")
    run_reference(ref, "2,1", N, steps, *ENGINE, "--mode", "sharded")
    assert full[0] == read(ref)


def test_requested_and_signalled_checkpoints_reach_every_daemon(daemon_factory, tmp_path):
    ck = str(tmp_path / "ck")
    daemons = start_group(daemon_factory, [1, 1], ["--checkpoint-dir", ck])
    ts = [run_trainer(d.endpoint, 0, N, 10 ** 6, sleep_ms=20, seed=1 + 1000 * r, wait=False)
          for r, d in enumerate(daemons)]
    try:
        # Asking one daemon is enough: both write after the same step.
        rc, out, err = scapectl(daemons[1], "checkpoint", "--wait", "--json")
        assert rc == 0, err
        first = json.loads(out)["checkpoint"]["step"]
        assert first > 0
        deadline = time.time() + 30
        while status(daemons[0])["checkpoint"]["count"] < 1 and time.time() < deadline:
            time.sleep(0.05)
        assert status(daemons[0])["checkpoint"]["step"] == first
        # SIGUSR1 to rank 0 (what Slurm's --signal delivers).
        daemons[0].proc.send_signal(signal.SIGUSR1)
        deadline = time.time() + 30
        while time.time() < deadline and not all(
                status(d)["checkpoint"]["count"] == 2 for d in daemons):
            time.sleep(0.05)
        steps = {status(d)["checkpoint"]["step"] for d in daemons}
        assert len(steps) == 1 and steps.pop() > first, "daemons disagree: %s" % steps
        assert all(t.poll() is None for t in ts), "training stopped"
    finally:
        for t in ts:
            t.kill()
            t.wait()


def test_a_daemon_without_a_directory_fails_the_checkpoint_not_the_job(daemon_factory,
                                                                       tmp_path):
    """Only rank 1 has a checkpoint_dir: a checkpoint asked of it fails on
    both daemons with the reason, nothing hangs, and training goes on."""
    coord, l0, l1 = free_endpoints(3)
    group = ["--world", "2", "--coordinator", coord, "--job", "9", "--trainers", "1",
             "--comm-timeout-ms", "20000"]
    daemons = [daemon_factory(*ENGINE, *group, "--rank", "0", "--listen", l0),
               daemon_factory(*ENGINE, *group, "--rank", "1", "--listen", l1,
                              "--checkpoint-dir", str(tmp_path / "ck"))]
    ts = [run_trainer(d.endpoint, 0, N, 10 ** 6, sleep_ms=20, seed=1 + 1000 * r, wait=False)
          for r, d in enumerate(daemons)]
    try:
        rc, out, err = scapectl(daemons[1], "checkpoint", "--wait", "--wait-ms", "30000")
        assert rc == 3, (rc, out, err)
        assert "no checkpoint_dir is configured on rank 0" in err, err
        assert "no checkpoint_dir" in status(daemons[0])["checkpoint"]["error"]
        step = status(daemons[0])["step"]
        time.sleep(1.0)
        assert status(daemons[0])["step"] > step, "training stopped"
        assert all(t.poll() is None for t in ts)
    finally:
        for t in ts:
            t.kill()
            t.wait()


def test_checkpoint_without_a_directory_is_refused(daemon_factory):
    d = daemon_factory(*ENGINE)
    rc, out, err = scapectl(d, "checkpoint")
    assert rc == 1 and "no checkpoint_dir is configured" in err, (rc, out, err)


def test_corrupted_checkpoints_are_refused_and_nothing_is_lost(daemon_factory, tmp_path):
    ck = str(tmp_path / "ck")
    d = daemon_factory(*ENGINE, "--trainers", "1", "--checkpoint-dir", ck,
                       "--checkpoint-every", "20")
    full, _ = train_one(d, tmp_path, 1, 40, "full")
    assert d.stop() == 0
    newest = os.path.join(ck, "step-40", "rank-00000.ckpt")
    data = bytearray(read(newest))
    data[len(data) // 2] ^= 0x01  # inside the residual section
    open(newest, "wb").write(data)
    before = tree_digest(ck)
    log = refused(daemon_factory, *ENGINE, "--resume", ck)
    assert "checksum mismatch" in log and "rank-00000.ckpt" in log, log
    assert tree_digest(ck) == before

    older = os.path.join(ck, "step-20", "rank-00000.ckpt")
    whole = read(older)
    open(older, "wb").write(whole[:len(whole) - 100])
    log = refused(daemon_factory, *ENGINE, "--resume", os.path.join(ck, "step-20"))
    assert "truncated" in log, log
    open(older, "wb").write(whole)  # the operator restores the file from a backup

    # Header damage is caught too, and the good checkpoint still resumes.
    data[9] ^= 0x80
    open(newest, "wb").write(data)
    assert "corrupted" in refused(daemon_factory, *ENGINE, "--resume", ck)
    d2 = daemon_factory(*ENGINE, "--trainers", "1", "--resume", os.path.join(ck, "step-20"))
    res, _ = train_one(d2, tmp_path, 1, 40, "res")
    assert res == full


def test_resume_on_another_number_of_daemons_reshards(daemon_factory, tmp_path):
    """A checkpoint of 2 daemons resumed by 3: every trainer starts at the
    step after it from the checkpoint's parameters, and all end equal."""
    ck = str(tmp_path / "ck")
    daemons = start_group(daemon_factory, [1, 1], ["--mode", "sharded", "--checkpoint-dir", ck,
                                                  "--checkpoint-every", "30"])
    procs = [run_trainer(d.endpoint, 0, N, 30, seed=1 + 1000 * r, wait=False)
             for r, d in enumerate(daemons)]
    first = [p.communicate(timeout=600)[0] for p in procs]
    for d in daemons:
        assert d.stop() == 0, d.output()
    daemons = start_group(daemon_factory, [1, 1, 1], ["--mode", "sharded", "--resume", ck])
    procs = [run_trainer(d.endpoint, 0, N, 50, seed=1 + 1000 * r, wait=False)
             for r, d in enumerate(daemons)]
    outs = []
    for p in procs:
        o, e = p.communicate(timeout=600)
        assert p.returncode == 0, o + e
        outs.append(o)
    assert all("steps 31..50 done" in o for o in outs), outs
    # rank 0's trainer has the same seed in both jobs: its starting loss is
    # the first job's final loss, so the parameters came through whole.
    assert first[0].split("-> ")[1].split(",")[0] == outs[0].split("loss ")[1].split(" ")[0]
    assert len({o.split("params ")[1].strip() for o in outs}) == 1
    assert "resharded" in daemons[0].output() and "resharded" in daemons[2].output()
    for d in daemons:
        assert d.stop() == 0, d.output()


def test_other_layout_or_settings_are_refused(daemon_factory, tmp_path):
    ck = str(tmp_path / "ck")
    d = daemon_factory(*ENGINE, "--trainers", "1", "--checkpoint-dir", ck,
                       "--checkpoint-every", "10")
    train_one(d, tmp_path, 1, 10, "full")
    assert d.stop() == 0
    before = tree_digest(ck)

    # Another layout: the trainers are told at sync, the daemon keeps serving.
    d2 = daemon_factory(*ENGINE, "--trainers", "1", "--resume", ck)
    p = run_trainer(d2.endpoint, 0, N + 100, 20, wait=False)
    o, e = p.communicate(timeout=60)
    assert p.returncode != 0 and "layout" in e and "differs" in e, e
    assert d2.proc.poll() is None
    assert status(d2)["state"] in ("waiting", "ready")

    d3 = daemon_factory("--rho", "0.05", "--warmup", "3", "--trainers", "1", "--resume", ck)
    p = run_trainer(d3.endpoint, 0, N, 20, wait=False)
    o, e = p.communicate(timeout=60)
    assert p.returncode != 0 and "other optimizer settings" in e, e
    assert tree_digest(ck) == before


def test_saving_a_step_again_never_overwrites_a_checkpoint(daemon_factory, tmp_path):
    """A job resumed from an older step checkpoints the same steps again: the
    new ones go to fresh directories (step-40.1), LATEST follows them, and the
    old complete ones stay readable until pruned."""
    ck = str(tmp_path / "ck")
    args = [*ENGINE, "--trainers", "1", "--checkpoint-dir", ck, "--checkpoint-every", "20",
            "--checkpoint-keep", "3"]
    d = daemon_factory(*args)
    train_one(d, tmp_path, 1, 40, "first")
    assert d.stop() == 0
    old40 = tree_digest(os.path.join(ck, "step-40"))
    d2 = daemon_factory(*args, "--resume", os.path.join(ck, "step-20"))
    second, _ = train_one(d2, tmp_path, 1, 40, "second")
    assert d2.stop() == 0
    assert open(os.path.join(ck, "LATEST")).read().strip() == "step-40.1"
    assert tree_digest(os.path.join(ck, "step-40")) == old40
    # the second run started at 21, so it saved 40 only; keep 3 keeps all
    names = sorted(x for x in os.listdir(ck) if x.startswith("step-"))
    assert names == ["step-20", "step-40", "step-40.1"], names
    d3 = daemon_factory(*ENGINE, "--trainers", "1", "--resume", ck)
    third, outs = train_one(d3, tmp_path, 1, 50, "third")
    assert "steps 41..50" in outs[0]
