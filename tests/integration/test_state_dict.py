"""ScapeOptimizer.state_dict()/load_state_dict() as torch's optimizers keep
them, with real daemons and real torch trainers (sd_trainer.py):

- before step 1 (1 daemon and 2, with and without checkpoint_dir) the pair
  is a no-op, as accelerate calls it: training ends bitwise as without it;
- with 2 daemons, a state_dict from either trainer, at any step and at the
  last one, names a checkpoint that is on disk when it returns, though the
  other trainer never asks and every process stops right after; a new launch
  resumed from it (--resume) says so (resumed_step), takes the state_dict of
  that step as a no-op, refuses an older one with the reason, and ends
  bitwise where the uninterrupted run does;
- checkpoints handed out by state_dict survive the periodic ones while they
  are among the newest checkpoint_keep handed out; an older one's refusal
  says it was pruned by checkpoint_keep; a state_dict still resolves when the
  checkpoint directory is reached by another path;
- client/examples/torch_train.py, requeued with daemons that resume from a
  checkpoint newer than its own file, goes on from resumed_step.
Needs torch and numpy in the interpreter running the tests (/usr/bin/python3).
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import SOURCE, free_endpoints
from test_gpt_training import corpus  # noqa: F401  (the fixture)

pytest.importorskip("torch")

ENGINE = ["--rho", "0.25", "--warmup", "3"]
TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sd_trainer.py")


def start(daemon_factory, world, *extra):
    """world daemons (rank r gets one trainer), with the extra options."""
    if world == 1:
        return [daemon_factory(*ENGINE, *extra)]
    coord = free_endpoints(1)[0]
    return [daemon_factory(*ENGINE, *extra, "--world", str(world), "--rank", str(r),
                           "--coordinator", coord, "--listen", "tcp://127.0.0.1:*",
                           "--job", "7", "--comm-timeout-ms", "30000")
            for r in range(world)]


def train(daemons, tmp_path, tag, steps, per_rank=lambda r: ()):
    """One sd_trainer per daemon, to the end; then the daemons stop.  Returns
    each trainer's events ({event: [objects]}) and final parameters."""
    outs = [str(tmp_path / ("%s-%d.bin" % (tag, r))) for r in range(len(daemons))]
    procs = [subprocess.Popen([sys.executable, TRAINER, "--endpoint", d.endpoint,
                               "--steps", str(steps), "--seed", str(1 + r), "--out", outs[r],
                               *per_rank(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for r, d in enumerate(daemons)]
    events = []
    for p in procs:
        o, e = p.communicate(timeout=300)
        assert p.returncode == 0, o + e
        ev = {}
        for line in o.splitlines():
            obj = json.loads(line)
            ev.setdefault(obj["event"], []).append(obj)
        events.append(ev)
    for d in daemons:
        assert d.stop() == 0, d.output()
    return events, [np.fromfile(o, dtype=np.float32) for o in outs]


def step_dirs(ck):
    return sorted(n for n in os.listdir(ck) if n.startswith("step-"))


@pytest.mark.parametrize("world", [1, 2])
def test_state_dict_before_step_one_is_a_noop(daemon_factory, tmp_path, world):
    _, want = train(start(daemon_factory, world), tmp_path, "ref", 6)
    assert all(np.array_equal(w, want[0]) for w in want), "the trainers differ"
    for ck in (False, True):
        extra = ("--checkpoint-dir", str(tmp_path / "ck")) if ck else ()
        events, got = train(start(daemon_factory, world, *extra), tmp_path, "b%d" % ck, 6,
                            lambda r: ["--before-noop"])
        for ev in events:
            (b,) = ev["before"]
            sd = b["state_dict"]
            assert sd["step"] == 0 and sd["scaped_checkpoint"] is None, sd
            assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2, 3]], sd
            assert b["next_step"] == 1, b
        for r, g in enumerate(got):
            assert np.array_equal(g, want[r]), \
                "checkpoint_dir %s, trainer %d: the run differs after the no-op pair" % (ck, r)
        if ck:  # nothing to save before step 1: nothing written
            assert not os.path.isdir(tmp_path / "ck") or step_dirs(tmp_path / "ck") == []


def test_state_dict_at_the_last_step_of_two_daemons(daemon_factory, tmp_path):
    _, want = train(start(daemon_factory, 2), tmp_path, "ref", 12)
    ck = str(tmp_path / "ck")
    sd = {s: str(tmp_path / ("sd%d.pt" % s)) for s in (4, 6, 8)}
    # rank 0's trainer asks after steps 4 and 8 (the last), rank 1's after 6:
    # each time the other trainer does not ask; after 8 both end at once
    events, _ = train(start(daemon_factory, 2, "--checkpoint-dir", ck), tmp_path, "a", 8,
                      lambda r: ["--save-at", "4:" + sd[4], "--save-at", "8:" + sd[8]]
                      if r == 0 else ["--save-at", "6:" + sd[6]])
    saved = events[0]["saved"] + events[1]["saved"]
    assert sorted(s["step"] for s in saved) == [4, 6, 8], saved
    for s in saved:
        # complete when state_dict returned: every daemon's file and the manifest
        assert {"MANIFEST", "rank-00000.ckpt", "rank-00001.ckpt"} <= set(s["files"]), s
        assert s["name"] == os.path.basename(s["dir"]) and s["job"] == 7, s
    with open(os.path.join(ck, "LATEST")) as f:
        assert f.read().strip() == "step-8"
    assert [n for n in os.listdir(ck) if n.startswith(".state_dict")] == [], os.listdir(ck)

    # a new launch resumes from the newest checkpoint (a requeue): rank 0
    # loads the state_dict of that step (a no-op), rank 1 an older one
    events, got = train(start(daemon_factory, 2, "--checkpoint-dir", ck, "--resume", ck),
                        tmp_path, "b", 12, lambda r: ["--load", sd[8] if r == 0 else sd[6]])
    for ev in events:
        assert ev["attached"][0]["resumed_step"] == 8 and ev["attached"][0]["next_step"] == 9
    assert events[0]["loaded"] == [{"event": "loaded", "step": 8, "next_step": 9}], events[0]
    (refused,) = events[1]["refused"]
    assert "resumed from its checkpoint of step 8" in refused["message"] and \
        "resumed_step" in refused["message"] and refused["next_step"] == 9, refused
    for r in range(2):
        assert np.array_equal(got[r], want[r]), "trainer %d: the resumed run differs" % r


def test_handed_out_checkpoints_are_kept_and_pruned_ones_named(daemon_factory, tmp_path):
    real = tmp_path / "a"
    ck = str(real / "ck")
    sd = {s: str(tmp_path / ("sd%d.pt" % s)) for s in (3, 5, 7)}
    saves = [a for s in (3, 5, 7) for a in ("--save-at", "%d:%s" % (s, sd[s]))]
    _, want = train(start(daemon_factory, 1, "--checkpoint-dir", ck, "--checkpoint-keep", "2",
                          "--checkpoint-every", "2"), tmp_path, "a", 12, lambda r: saves)
    # the newest 2 periodic ones, and the newest 2 handed out (3 is older)
    assert step_dirs(ck) == ["step-10", "step-12", "step-5", "step-7"], step_dirs(ck)

    # the job's directory reached by another path: the saved absolute paths
    # are gone, the names relative to checkpoint_dir resolve
    os.rename(real, tmp_path / "moved")
    os.symlink(tmp_path / "moved", tmp_path / "b")
    d = start(daemon_factory, 1, "--checkpoint-dir", str(tmp_path / "b" / "ck"))
    events, got = train(d, tmp_path, "b", 12, lambda r: ["--load", sd[3], "--load", sd[5]])
    (refused,) = events[0]["refused"]
    assert refused["step"] == 3 and "step-3" in refused["message"] and \
        "pruned" in refused["message"] and "checkpoint_keep is 2" in refused["message"], refused
    assert events[0]["loaded"] == [{"event": "loaded", "step": 5, "next_step": 6}], events[0]
    assert np.array_equal(got[0], want[0]), "the run resumed from step 5 differs"


def torch_train(tmp_path, corpus, steps, out, extra=(), sets=()):  # noqa: F811
    """client/examples/torch_train.py through scape-run, two trainers."""
    script = os.path.join(SOURCE, "client", "examples", "torch_train.py")
    env = dict(os.environ, PYTHONPATH=os.path.join(SOURCE, "client", "python"))
    trainer = [sys.executable, script, "--corpus", corpus, "--steps", str(steps), "--d", "32",
               "--layers", "1", "--heads", "2", "--ctx", "32", "--lr", "1e-2",
               "--eval-every", "1000", "--eval-windows", "4", *extra]
    line = " ".join("'%s'" % c for c in trainer) + " --out '%s'$LOCAL_RANK" % out
    sets = [a for kv in ("rho=0.1", "warmup=10", *sets) for a in ("--set", kv)]
    r = subprocess.run([sys.executable, "-m", "scape.run", "--nproc-per-node", "2", *sets,
                        "--", "sh", "-c", line], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.skipif("asan" in os.environ.get("LD_PRELOAD", ""),
                    reason="the example GPT is too slow for the sanitizer build; the "
                           "contract itself is tested above")
def test_torch_train_resumes_past_its_own_older_save(tmp_path, corpus):  # noqa: F811
    """A requeue: the daemons resume from their newest checkpoint (step 25, a
    periodic one) while the trainers' own file is of step 20; the example's
    pattern goes on from resumed_step without loading the older file (which
    would be refused) and ends where the uninterrupted run does."""
    torch_train(tmp_path, corpus, 40, str(tmp_path / "p"))
    want = np.fromfile(str(tmp_path / "p0"), dtype=np.float32)
    ck, save = str(tmp_path / "ck"), str(tmp_path / "ckpt.pt")
    torch_train(tmp_path, corpus, 40, str(tmp_path / "a"),
                ["--save", save, "--save-every", "10", "--stop-at", "25"],
                ["checkpoint_dir=" + ck, "checkpoint_every=25"])
    with open(os.path.join(ck, "LATEST")) as f:
        assert f.read().strip() == "step-25"
    out = torch_train(tmp_path, corpus, 40, str(tmp_path / "b"), ["--save", save],
                      ["checkpoint_dir=" + ck, "resume=" + ck])
    assert "daemons resumed from their checkpoint of step 25; %s (step 20) is not loaded" \
        % save in out and "steps 26..40 done" in out, out
    for i in (0, 1):
        got = np.fromfile(str(tmp_path / ("b%d" % i)), dtype=np.float32)
        assert np.array_equal(got, want), "trainer %d: the requeued run differs" % i
