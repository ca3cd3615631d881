"""The daemons of a job leave together (daemon/checkpoint.c, "Leaving
together"), with real scape-run processes, daemons and torch trainers:

- two nodes (two scape-runs, 2 daemons x 1 trainer): rank 1's trainer ends
  after its last step, so node 1's scape-run stops its daemon; rank 0's
  trainer waits until that daemon has said it is leaving, then saves with
  state_dict(): the checkpoint is complete on disk when it returns, both
  scape-runs exit 0, and node 1's daemon served that checkpoint and left only
  with rank 0's;
- a daemon of a pair whose peer was SIGKILLed stops by itself as soon as the
  peer's connection has stayed closed for a second, and says why; with a
  hung peer (its connection open) once comm_timeout_ms has passed.
Needs torch in the interpreter running the tests (/usr/bin/python3).
"""
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import SOURCE, free_endpoints, job_key, run_trainer

pytest.importorskip("torch")

CLIENT = os.path.join(SOURCE, "client", "python")

TRAINER = textwrap.dedent("""\
    import json, os, sys, time
    import torch
    sys.path.insert(0, %(client)r)
    import scape.torch
    rank = int(os.environ["RANK"])
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = scape.torch.ScapeOptimizer(model.parameters(), lr=0.02, timeout_ms=60000)
    g = torch.Generator().manual_seed(1 + rank)
    for t in range(%(steps)d):
        opt.zero_grad()
        model(torch.randn(16, 8, generator=g)).pow(2).mean().backward()
        opt.step()
    if rank == 0:
        # the save at the end, once node 1's daemon is stopping for certain
        marker = os.path.join(%(ck)r, ".leaving-%%s.1" %% %(job)r)
        deadline = time.time() + 120
        while not os.path.exists(marker) and time.time() < deadline:
            time.sleep(0.05)
        sd = opt.state_dict()
        files = sorted(os.listdir(sd["scaped_checkpoint"]))
        torch.save({"opt": sd, "model": model.state_dict()}, %(out)r)
        print(json.dumps({"peer_leaving": os.path.exists(marker), "step": sd["step"],
                          "files": files}), flush=True)
""")


def test_the_last_save_of_rank_0_finds_node_1s_daemon(tmp_path):
    steps = 5
    port = int(free_endpoints(1)[0].rsplit(":", 1)[1])
    ck, out = str(tmp_path / "ck"), str(tmp_path / "final.pt")
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER % dict(client=CLIENT, steps=steps, ck=ck, job=str(port), out=out))
    env = dict(os.environ, PYTHONPATH=CLIENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "scape.run", "--nnodes", "2", "--node-rank", str(r),
         "--master-addr", "127.0.0.1", "--master-port", str(port),
         "--set", "auth=secret", "--set", "auth_key_file=" + job_key(),
         "--set", "checkpoint_dir=" + ck, "--set", "comm_timeout_ms=60000",
         "--", sys.executable, str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    res = [p.communicate(timeout=300) for p in nodes]
    for r, p in enumerate(nodes):
        assert p.returncode == 0, "node %d:\n%s%s" % (r, *res[r])
    import json
    import torch
    (line,) = [ln for ln in res[0][0].splitlines() if ln.startswith("{")]
    saved = json.loads(line)
    assert saved["peer_leaving"], "node 1's daemon never said it was leaving:\n" + res[1][1]
    assert saved["step"] == steps, saved
    # complete when state_dict returned: both daemons' files and the manifest
    assert {"MANIFEST", "rank-00000.ckpt", "rank-00001.ckpt"} <= set(saved["files"]), saved
    assert torch.load(out)["opt"]["step"] == steps
    log1 = res[1][1]
    waited = log1.index("waiting for daemons 0 to leave (a state_dict may still come")
    served = log1.index("state_dict on another daemon: saving the state after step %d" % steps)
    left = log1.index("the other daemons are leaving too: stopping")
    assert waited < served < left, log1
    assert "stopping without the other daemons" not in log1 + res[0][1], log1 + res[0][1]
    # the markers are gone
    assert not [n for n in os.listdir(ck) if n.startswith((".leaving-", ".idle-"))]


@pytest.mark.parametrize("how", ["marked", "gone", "hung", "twice"])
def test_a_daemon_whose_peer_was_killed_stops_by_itself(daemon_factory, tmp_path, how):
    """The peer killed once idle (its marker left behind: the leave round
    finds it gone); killed while it had a trainer (no marker, as the test
    makes it: its closed connection tells); or hung (SIGSTOP: its connection
    stays open, so the wait ends at comm_timeout_ms, or at a second SIGTERM)."""
    timeout_ms = "60000" if how == "twice" else "3000"
    ck = str(tmp_path / "ck")
    coord = free_endpoints(1)[0]
    daemons = [daemon_factory("--world", "2", "--rank", str(r), "--coordinator", coord,
                              "--listen", "tcp://127.0.0.1:*", "--job", "9",
                              "--checkpoint-dir", ck, "--comm-timeout-ms", timeout_ms)
               for r in range(2)]
    trainers = [run_trainer(d.endpoint, 0, 1000, 4, seed=1 + r, wait=False)
                for r, d in enumerate(daemons)]
    for t in trainers:
        o, e = t.communicate(timeout=300)
        assert t.returncode == 0, o + e
    idle = [os.path.join(ck, ".idle-9.%d" % r) for r in range(2)]
    deadline = time.time() + 60
    while not all(map(os.path.exists, idle)):
        assert time.time() < deadline, "no idle markers: %s" % os.listdir(ck)
        time.sleep(0.05)
    hung = how in ("hung", "twice")
    daemons[0].proc.send_signal(signal.SIGSTOP if hung else signal.SIGKILL)
    try:
        if not hung:
            daemons[0].proc.wait()
        if how != "marked":
            os.unlink(idle[0])
        if how == "twice":
            daemons[1].proc.send_signal(signal.SIGTERM)
            while "waiting for daemons 0 to leave" not in daemons[1].output():
                assert daemons[1].proc.poll() is None and time.time() < deadline, \
                    daemons[1].output()
                time.sleep(0.05)
        assert daemons[1].stop() == 0, daemons[1].output()
    finally:
        if hung:
            daemons[0].proc.send_signal(signal.SIGKILL)
            daemons[0].proc.wait()
    log = daemons[1].output()
    if how == "marked":
        assert "the leave round failed" in log, log
    elif how == "gone":
        assert re.search(r"stopping without the other daemons: rank 0's daemon is gone "
                         r"\(its connection closed \d+ ms ago\)", log), log
    elif how == "twice":
        assert "stopping without the other daemons: told to stop again" in log, log
    else:
        assert re.search(r"waiting for daemons 0 to leave .*comm_timeout_ms, 3000 ms", log), log
        assert "stopping without the other daemons: comm_timeout_ms passed" in log, log
    assert "stopping without the other daemons" in log, log
    assert [n for n in os.listdir(ck) if n.endswith("-9.1")] == [], os.listdir(ck)
