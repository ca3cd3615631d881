"""Several daemons on one machine acting as one optimizer: rendezvous and the
host backend over loopback TCP, trainers on every daemon, the result bitwise
equal to the in-process engine on the local backend, and a killed daemon."""
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq

import pbwire
from conftest import (SOURCE, binary, free_endpoints, process_stopped, run_reference,
                      run_trainer, synth_layout)

sys.path.insert(0, os.path.join(SOURCE, "client", "python"))
import scape  # noqa: E402

ENGINE = ["--rho", "0.01", "--warmup", "3"]
PY_TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "py_trainer.py")


def start_group(daemon_factory, trainers, extra=(), timeout_ms=20000):
    """One daemon per entry of trainers; each data plane binds a port the
    kernel picks (tcp://127.0.0.1:*), which the rendezvous publishes."""
    coord = free_endpoints(1)[0]
    return [daemon_factory(*ENGINE, *extra, "--world", str(len(trainers)), "--rank", str(r),
                           "--coordinator", coord, "--listen", "tcp://127.0.0.1:*", "--job", "7",
                           "--trainers", str(t), "--comm-timeout-ms", str(timeout_ms))
            for r, t in enumerate(trainers)]


def data_endpoint(d):
    """Where a daemon's data plane really listens (status field 22)."""
    return pbwire.query_status(d.status_endpoint)[2][22][0].decode()


def read(path):
    with open(path, "rb") as f:
        return f.read()


def train_group(daemons, trainers, tmp_path, n, steps, tag):
    procs, outs = [], []
    for r, (d, t) in enumerate(zip(daemons, trainers)):
        for j in range(t):
            out = str(tmp_path / ("%s-r%d-t%d" % (tag, r, j)))
            outs.append(out)
            procs.append(run_trainer(d.endpoint, j, n, steps, out=out, seed=1 + 1000 * r,
                                     wait=False))
    for p in procs:
        o, e = p.communicate(timeout=600)
        assert p.returncode == 0, o + e
    return [read(o) for o in outs]


def last_step(d):
    """k, payload bytes and, of those, the mask all-gather's bytes of the
    daemon's last step, from its status socket."""
    status, msg, _, done = pbwire.query_status(d.status_endpoint)
    assert status == 0, msg
    overlap = done[11][0]
    assert 0.0 < overlap <= 1.0, "mask overlap %r" % overlap
    return done[3][0], done[5][0], done[12][0]


def collectives(d):
    """{op: (calls, payload bytes)} of the daemon's last step."""
    _, _, _, done = pbwire.query_status(d.status_endpoint)
    out = {}
    for blob in done.get(13, []):
        c = pbwire.parse(blob)
        out[c[1][0].decode()] = (c[2][0], c[3][0])
    return out


def owners(lens, ranks):
    """docs/algorithm.md: largest tensor first (ties: lower index) to the
    least-loaded rank (ties: lower rank)."""
    load, own = [0] * ranks, [0] * len(lens)
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        own[i] = r
        load[r] += lens[i]
    return own


def mask_code_bytes(lens, ks):
    """The wire form of a rank's mask bits (docs/design.md): per tensor, k
    positions of bits(len - 1) bits where that is smaller than its bitmap
    words, else the words; the positions in one stream padded to a word."""
    words = bits = 0
    for n, k in zip(lens, ks):
        b = max(1, (n - 1).bit_length())
        if k * b < 32 * ((n + 31) // 32):
            bits += k * b
        else:
            words += (n + 31) // 32
    return 4 * (words + (bits + 31) // 32)


def expected_bytes(n, mode, ranks):
    """One reduction of K floats (plus, sharded, the all-gather of K updated
    values) and the mask all-gather of every owner's coded bits."""
    lens = [t[2] for t in synth_layout(n)]
    ks = [max(1, math.ceil(0.01 * x)) for x in lens]
    own = owners(lens, ranks)
    mask = sum(mask_code_bytes([x for x, o in zip(lens, own) if o == r],
                               [k for k, o in zip(ks, own) if o == r]) for r in range(ranks))
    bitmap = 4 * sum((x + 31) // 32 for x in lens)
    assert mask < bitmap / 2, "the coded mask should be well under the bitmap at rho 0.01"
    # the values go in bf16 (wire_values' default): 2 bytes into the reduction,
    # 4 back in the sharded gather of fp32 parameters
    return sum(ks), (2 + (4 if mode == "sharded" else 0)) * sum(ks) + mask, mask


@pytest.mark.parametrize("trainers", [[1, 2], [2, 1, 3], [1, 3, 2, 1]])
def test_daemons_match_local_backend(daemon_factory, tmp_path, trainers):
    n, steps = 3000, 200
    results = {}
    for mode in ("replicated", "sharded"):
        daemons = start_group(daemon_factory, trainers, ["--mode", mode])
        got = train_group(daemons, trainers, tmp_path, n, steps, mode)
        assert all(g == got[0] for g in got), "trainers disagree (%s)" % mode
        want = expected_bytes(n, mode, len(trainers))
        lens = [t[2] for t in synth_layout(n)]
        own = owners(lens, len(trainers))
        k, total, mask = want
        # docs/algorithm.md invariant 7: one reduction of K values per step (sharded:
        # and the all-gather of the updated values), one mask all-gather
        calls = ({"allreduce": (1, 2 * k)} if mode == "replicated" else
                 {"reduce_scatter": (1, 2 * k), "allgather": (1, 4 * k)})
        calls["iallgather"] = (1, mask)
        for r, d in enumerate(daemons):
            assert last_step(d) == want, "rank %d: (K, bytes, mask bytes) %s, want %s" % (
                r, last_step(d), want)
            assert collectives(d) == calls, (r, mode, collectives(d), calls)
            # m and theta of the shard (sharded) or of all N, the residual of all N;
            # no device memory on the host backend
            held = sum(x for x, o in zip(lens, own) if o == r) if mode == "sharded" else sum(lens)
            _, _, st, _ = pbwire.query_status(d.status_endpoint)
            assert st[13][0] == 4 * (2 * held + sum(lens)), (r, mode, st[13][0])
            assert st.get(18, [0])[0] == 0 and st.get(19, [0.0])[0] == 0.0, st
        for d in daemons:
            assert d.stop() == 0, d.output()
        ref = str(tmp_path / ("ref-" + mode))
        run_reference(ref, ",".join(map(str, trainers)), n, steps, *ENGINE, "--mode", mode)
        assert got[0] == read(ref), "daemons differ from the local backend (%s)" % mode
        results[mode] = got[0]
    assert results["replicated"] == results["sharded"]


def test_gather_delta_over_daemons(daemon_factory, tmp_path):
    """gather_values: delta across three daemons, sharded: the gathers move
    2 bytes a value, every trainer ends with the in-process engine's
    parameters for the same setting (which differ from params'), status says
    delta; daemons that disagree on it are refused before step 1."""
    n, steps, trainers = 3000, 60, [1, 2, 1]
    daemons = start_group(daemon_factory, trainers, ["--mode", "sharded",
                                                     "--gather-values", "delta"])
    got = train_group(daemons, trainers, tmp_path, n, steps, "delta")
    assert all(g == got[0] for g in got), "trainers disagree"
    k, _, mask = expected_bytes(n, "sharded", len(trainers))
    for d in daemons:
        assert collectives(d) == {"reduce_scatter": (1, 2 * k), "allgather": (1, 2 * k),
                                  "iallgather": (1, mask)}, collectives(d)
        assert status_of(d)["gather_values"] == "delta"
        assert d.stop() == 0, d.output()
    for g in ("delta", "params"):
        run_reference(str(tmp_path / g), ",".join(map(str, trainers)), n, steps, *ENGINE,
                      "--mode", "sharded", "--gather-values", g)
    assert got[0] == read(tmp_path / "delta"), "daemons differ from the engine"
    assert got[0] != read(tmp_path / "params"), "delta changed nothing"
    refused_when_they_disagree(daemon_factory, "9", "gather_values", ["--mode", "sharded"],
                               ["--gather-values", "delta"], ["--gather-values", "params"])


def test_split_tensors_over_daemons(daemon_factory, tmp_path):
    """split_above across three daemons, sharded: the long tensors are cut
    into ranges with owners of their own, every trainer ends with the
    in-process engine's parameters for the same setting (which differ from
    whole tensors'), the reduction carries the pieces' K, status shows the
    key, and daemons that disagree on it are refused before step 1."""
    n, steps, trainers, split = 3000, 60, [1, 2, 1], 200
    daemons = start_group(daemon_factory, trainers, ["--mode", "sharded",
                                                     "--split-above", str(split)])
    got = train_group(daemons, trainers, tmp_path, n, steps, "split")
    assert all(g == got[0] for g in got), "trainers disagree"
    lens = [t[2] for t in synth_layout(n)]
    assert max(lens) > 2 * split, lens  # the setting cuts something
    pieces = [x // -(-x // split) + (1 if q < x % -(-x // split) else 0)
              for x in lens for q in range(-(-x // split))]
    assert sum(pieces) == sum(lens) and max(pieces) <= split
    k = sum(max(1, math.ceil(0.01 * x)) for x in pieces)
    for d in daemons:
        assert collectives(d)["reduce_scatter"] == (1, 2 * k), collectives(d)
        assert status_of(d)["config"]["split_above"] == str(split), status_of(d)["config"]
        assert d.stop() == 0, d.output()
    for s in (str(split), "0"):
        run_reference(str(tmp_path / ("ref" + s)), ",".join(map(str, trainers)), n, steps,
                      *ENGINE, "--mode", "sharded", "--split-above", s)
    assert got[0] == read(tmp_path / ("ref" + str(split))), "daemons differ from the engine"
    assert got[0] != read(tmp_path / "ref0"), "split_above changed nothing"
    # hashed, not agreed: the refusal lists the hashed keys, split_above among them
    refused_when_they_disagree(daemon_factory, "11", "split_above", ["--mode", "sharded"],
                               ["--split-above", str(split)], ["--split-above", "0"])


def status_of(d):
    res = subprocess.run([binary("client", "scapectl"), "--runtime-dir", d.rt, "status",
                          "--json"], capture_output=True, text=True, check=True)
    return json.loads(res.stdout)


def pause_group(daemon_factory, tmp_path, extra, n, steps, pause):
    """Two daemons, one trainer each, both trainers stopped before step pause."""
    daemons = start_group(daemon_factory, [1, 1], extra)
    procs = [run_trainer(d.endpoint, 0, n, steps, out=str(tmp_path / ("r%d" % r)),
                         seed=1 + 1000 * r, stop_before=pause, wait=False)
             for r, d in enumerate(daemons)]
    deadline = time.time() + 60
    while not all(process_stopped(p.pid) for p in procs):  # both before step `pause`
        assert time.time() < deadline and all(p.poll() is None for p in procs), "no pause"
        time.sleep(0.01)
    return daemons, procs


def refused_when_they_disagree(daemon_factory, job, key, common, first, second):
    """Two daemons, rank 0 with the flags `first`, rank 1 with `second`:
    each one's trainer fails before step 1, its error naming `key`."""
    eps = free_endpoints(3)
    daemons = [daemon_factory(*ENGINE, "--world", "2", "--rank", str(r), "--coordinator", eps[0],
                              "--listen", eps[1 + r], "--job", job, "--trainers", "1", *common,
                              *(first if r == 0 else second))
               for r in range(2)]
    ts = [run_trainer(d.endpoint, 0, 2000, 5, wait=False) for d in daemons]
    for t in ts:
        o, e = t.communicate(timeout=120)
        assert t.returncode != 0 and key in e, o + e
        print(e.strip().splitlines()[-1])


def finish_undisturbed(daemons, procs, tmp_path, n, steps):
    """Let the trainers run on; their parameters equal the reference's."""
    for p in procs:
        p.send_signal(signal.SIGCONT)
    for p in procs:
        o, e = p.communicate(timeout=300)
        assert p.returncode == 0, o + e
    run_reference(str(tmp_path / "ref"), "1,1", n, steps, *ENGINE)
    ref = read(tmp_path / "ref")
    for r in range(2):
        assert read(tmp_path / ("r%d" % r)) == ref, "rank %d's trainer differs" % r


def test_strays_on_the_data_port_are_dropped_and_logged(daemon_factory, tmp_path):
    """auth: none (plain TCP): a raw ZeroMQ peer pushing junk, and a frame pair
    that looks like another job's, at a daemon's data port in the middle of
    the job: the job's result is unchanged, and the daemon logs what it
    dropped and counts it in status (scapectl status, --json, metrics)."""
    n, steps, pause = 3000, 300, 100
    daemons, procs = pause_group(daemon_factory, tmp_path, ["--auth", "none"], n, steps, pause)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 5000)  # close() sends what is queued
    listen = data_endpoint(daemons[1])
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", listen), listen
    push.connect(listen)
    other_job = (99).to_bytes(8, "little") + bytes(16) + (0x31484353).to_bytes(4, "little") \
        + (1).to_bytes(2, "little") + (0).to_bytes(2, "little")
    for _ in range(10):
        push.send(b"junk")
        push.send_multipart([other_job, b"\0" * 64])
    push.close()
    ctx.term()
    # 200 more steps: every stray is read among their messages
    finish_undisturbed(daemons, procs, tmp_path, n, steps)
    for r, d in enumerate(daemons):
        js = status_of(d)
        assert js["auth"] == "none" and js["data_encrypted"] is False, js
        assert js["foreign_messages"] == (20 if r == 1 else 0), js
        assert ("job 99" in js["foreign_last"]) if r == 1 else "foreign_last" not in js, js
    text = subprocess.run([binary("client", "scapectl"), "--runtime-dir", daemons[1].rt,
                           "status"], capture_output=True, text=True, check=True).stdout
    assert re.search(r"^Strays\s*: 20 dropped; the last: a message of job 99", text, re.M), text
    metrics = subprocess.run([binary("client", "scapectl"), "--runtime-dir", daemons[1].rt,
                              "metrics"], capture_output=True, text=True, check=True).stdout
    assert re.search(r'^scape_data_foreign_messages_total\{rank="1"\} 20$', metrics, re.M), \
        metrics
    for d in daemons:
        assert d.stop() == 0
    log = daemons[1].output()
    assert "not of this job" in log and "job 99" in log, log[-3000:]
    assert "accept anyone" in log, log[-3000:]  # auth none says what it means


def wait_refused(d, more_than, deadline):
    """Status once the daemon has refused more than more_than handshakes."""
    while True:
        js = status_of(d)
        if js["refused_handshakes"] > more_than:
            return js
        assert time.time() < deadline, "never refused: %s" % js
        time.sleep(0.05)


@pytest.mark.skipif(not zmq.has("curve"), reason="pyzmq without CURVE")
def test_strangers_are_refused_at_the_handshake(daemon_factory, tmp_path):
    """auth: secret (CURVE on the data plane): in the middle of the job a
    plain ZeroMQ peer pushing junk, and a CURVE peer with the daemon's real
    public key (status shows it) but a key pair of its own, are refused at
    the handshake: nothing they send reaches the daemon (no foreign message),
    each refusal is counted and named in status, metrics and the log, and the
    job's result is bitwise the undisturbed run's."""
    n, steps, pause = 3000, 300, 100
    daemons, procs = pause_group(daemon_factory, tmp_path, [], n, steps, pause)
    target = daemons[1]
    js = status_of(target)
    assert js["auth"] == "secret" and js["data_encrypted"] is True, js
    assert js["refused_handshakes"] == 0 and len(js["data_public_key"]) == 40, js
    deadline = time.time() + 30
    ctx = zmq.Context()
    plain = ctx.socket(zmq.PUSH)
    plain.setsockopt(zmq.LINGER, 0)
    # once the daemon has refused it the socket may have no peer to queue
    # for, and a send would block for ever: each waits 1 s at most
    plain.setsockopt(zmq.SNDTIMEO, 1000)
    plain.connect(data_endpoint(target))
    for _ in range(10):
        try:
            plain.send(b"junk")
        except zmq.Again:
            break
    js = wait_refused(target, 0, deadline)
    # whichever side sees the other's mechanism first ends the handshake
    assert "without CURVE" in js["refused_last"] or "broke off" in js["refused_last"], js
    plain.close()
    seen = js["refused_handshakes"]
    stranger = ctx.socket(zmq.PUSH)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.setsockopt(zmq.SNDTIMEO, 1000)
    pub, sec = zmq.curve_keypair()
    stranger.curve_publickey, stranger.curve_secretkey = pub, sec
    stranger.curve_serverkey = js["data_public_key"].encode()
    stranger.connect(data_endpoint(target))
    for _ in range(10):
        try:
            stranger.send_multipart([b"\0" * 32, b"\0" * 64])
        except zmq.Again:
            break
    js = wait_refused(target, seen, deadline)
    assert "not a rank of this job" in js["refused_last"], js
    assert pub.decode()[:12] in js["refused_last"], js
    stranger.close()
    ctx.term()
    finish_undisturbed(daemons, procs, tmp_path, n, steps)
    js = status_of(target)
    assert js["foreign_messages"] == 0 and status_of(daemons[0])["refused_handshakes"] == 0, js
    text = subprocess.run([binary("client", "scapectl"), "--runtime-dir", target.rt,
                           "status"], capture_output=True, text=True, check=True).stdout
    assert re.search(r"^Auth\s*: secret; data plane CURVE .*refused at the handshake", text,
                     re.M), text
    metrics = subprocess.run([binary("client", "scapectl"), "--runtime-dir", target.rt,
                              "metrics"], capture_output=True, text=True, check=True).stdout
    assert re.search(r'^scape_data_refused_handshakes_total\{rank="1"\} [1-9]', metrics,
                     re.M), metrics
    for d in daemons:
        assert d.stop() == 0
    log = target.output()
    assert "refused" in log and "at the handshake" in log, log[-3000:]


def test_defer_select_changes_no_bit_and_must_agree(daemon_factory, tmp_path):
    """The next mask selected after the replies (the default) or inside the
    step: the same parameters and the same per-step bytes; daemons that
    disagree on it are refused before step 1, saying so."""
    n, steps, trainers = 3000, 60, [1, 2]
    got, done = {}, {}
    for defer in ("true", "false"):
        daemons = start_group(daemon_factory, trainers, ["--mode", "sharded",
                                                         "--defer-select", defer])
        got[defer] = train_group(daemons, trainers, tmp_path, n, steps, "defer-" + defer)
        done[defer] = [(last_step(d), collectives(d)) for d in daemons]
        for d in daemons:  # the selection after the replies is its own phase
            phases = pbwire.parse(pbwire.query_status(d.status_endpoint)[3][2][0])
            assert (11 in phases) == (defer == "true"), phases
            if defer == "true":
                assert phases[11][0] > 0.0 and phases[4][0] < phases[10][0], phases
        for d in daemons:
            assert d.stop() == 0, d.output()
    assert got["true"] == got["false"]
    assert done["true"] == done["false"]
    refused_when_they_disagree(daemon_factory, "8", "defer_select", [],
                               ["--defer-select", "true"], ["--defer-select", "false"])


@pytest.mark.parametrize("victim,timeout_ms", [(2, 1500), (1, 30000)])
def test_killed_daemon_fails_the_step_in_time(daemon_factory, victim, timeout_ms):
    """The survivors' trainers get an error naming the killed daemon's rank:
    for the middle rank too, although in the reduction's chain rank 0 waits
    for rank 2, not for it.  Its closed connections tell at once; the
    timeout is only the bound."""
    daemons = start_group(daemon_factory, [1, 1, 1], timeout_ms=timeout_ms)
    ts = [run_trainer(d.endpoint, 0, 2000, 10 ** 6, sleep_ms=10, seed=1 + 1000 * r, wait=False)
          for r, d in enumerate(daemons)]
    time.sleep(2.0)
    assert all(t.poll() is None for t in ts), "training stopped early"
    daemons[victim].proc.send_signal(signal.SIGKILL)
    ts[victim].kill()
    killed = time.time()
    survivors = [r for r in range(3) if r != victim]
    for r in survivors:
        o, e = ts[r].communicate(timeout=60)
        assert ts[r].returncode != 0
        assert "rank %d" % victim in e and "daemon is gone" in e, e
    waited = time.time() - killed
    assert waited < min(timeout_ms / 1000, 1.0) + 5.0, "the step failed only after %.1f s" % waited
    # status names the rank the survivors' connections no longer reach
    ctl = binary("client", "scapectl")
    for r in survivors:
        deadline = time.time() + 30
        while True:
            js = json.loads(subprocess.run([ctl, "--runtime-dir", daemons[r].rt, "status",
                                            "--json"], capture_output=True, text=True,
                                           check=True).stdout)
            if js["peers_down"] == [victim] or time.time() > deadline:
                break
            time.sleep(0.1)
        assert (js["peers_connected"], js["peers_down"]) == (1, [victim]), js
        text = subprocess.run([ctl, "--runtime-dir", daemons[r].rt, "status"],
                              capture_output=True, text=True, check=True).stdout
        assert re.search(r"^Peers\s*: 1 of 2 connected; down: rank %d$" % victim, text,
                         re.M), text
    for r in survivors:
        assert daemons[r].proc.poll() is None, "a surviving daemon exited"
        assert daemons[r].stop() == 0
    # the victim's trainer and daemon were both killed: the shared memory went
    # with them (libscape unlinks the names once the daemon has mapped them)
    ts[victim].wait()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("scape-%d-" % ts[victim].pid)]


def test_stop_is_not_held_up_by_a_missing_peer(daemon_factory):
    """SIGTERM to a daemon whose step waits for another daemon (whose trainer
    died) stops it at once, not after the collective's timeout."""
    daemons = start_group(daemon_factory, [1, 1], timeout_ms=60000)
    ts = [run_trainer(d.endpoint, 0, 2000, 10 ** 6, sleep_ms=5, seed=1 + 1000 * r, wait=False)
          for r, d in enumerate(daemons)]
    try:
        time.sleep(1.5)
        ts[1].kill()
        ts[1].wait()
        time.sleep(1.0)  # rank 0's trainer has posted; its step waits for rank 1
        t0 = time.time()
        daemons[0].proc.send_signal(signal.SIGTERM)
        daemons[0].proc.wait(30)
        assert time.time() - t0 < 5.0, "stopping took %.1f s" % (time.time() - t0)
    finally:
        for t in ts:
            t.kill()
            t.wait()


def test_sigterm_lets_the_running_step_finish(daemon_factory):
    """SIGTERM reaches rank 0 while its step waits in a collective for rank 1,
    whose trainer posts 0.4 s later (inside the stop grace): the step finishes
    on both daemons, rank 0's trainer gets that step's parameters, and only its
    next step hears that the daemon is shutting down."""
    daemons = start_group(daemon_factory, [1, 1], timeout_ms=60000)
    layout = synth_layout(5000)
    ss = [scape.attach(d.endpoint, layout, timeout_ms=30000) for d in daemons]
    rng = np.random.default_rng(5)
    start = rng.standard_normal(ss[0].params.size).astype(np.float32)

    def post(r, t):
        ss[r].grads[:] = np.sin(start * (t + 3 * r + 1))
        ss[r].step_begin(1e-2)

    try:
        for s in ss:
            s.params[:] = start
        # the job starts once both daemons' trainers have synced
        syncs = [threading.Thread(target=s.sync) for s in ss]
        for th in syncs:
            th.start()
        for th in syncs:
            th.join(60)
        assert [s.next_step for s in ss] == [1, 1]
        for t in range(1, 5):
            for r in range(2):
                post(r, t)
            for s in ss:
                s.step_wait()
        post(0, 5)
        time.sleep(0.5)  # rank 0 is in step 5, waiting for rank 1 (and deaf to status)
        daemons[0].proc.send_signal(signal.SIGTERM)
        time.sleep(0.4)
        post(1, 5)
        done = [s.step_wait() for s in ss]
        assert [d.step for d in done] == [5, 5]
        assert daemons[0].proc.wait(30) == 0, daemons[0].output()
        assert "stopping after step 5" in daemons[0].output(), daemons[0].output()
        assert np.array_equal(ss[0].params, ss[1].params)
        with pytest.raises(scape.ScapeError, match="shutting down"):
            ss[0].step(1e-2)
    finally:
        for s in ss:
            try:
                s.detach()
            except scape.ScapeError:
                pass


@pytest.mark.parametrize("gather", ["params", "delta"])
def test_replacement_trainer_gets_the_whole_parameters_when_sharded(daemon_factory, tmp_path,
                                                                    gather):
    """Rank 1's only trainer dies; its replacement must get every parameter
    (rank 1's master copy holds only its shard), and the job ends with the
    same parameters on both daemons; also when the gathers carry changes
    that the trainers add to what they hold (delta)."""
    daemons = start_group(daemon_factory, [1, 1], ["--mode", "sharded", "--gather-values", gather],
                          timeout_ms=60000)
    steps = 120
    ts = [run_trainer(d.endpoint, 0, 3000, steps, sleep_ms=20, seed=1 + 1000 * r,
                      out=str(tmp_path / ("t%d" % r)), wait=False)
          for r, d in enumerate(daemons)]
    try:
        time.sleep(1.0)
        ts[1].kill()
        ts[1].wait()
        deadline = time.time() + 60
        while daemons[1].trainers():  # its slot is free again
            assert time.time() < deadline, "rank 1 never noticed its trainer's death"
            time.sleep(0.01)
        ts[1] = run_trainer(daemons[1].endpoint, 0, 3000, steps, seed=1001,
                            out=str(tmp_path / "t1"), wait=False)
        outs = []
        for t in ts:
            o, e = t.communicate(timeout=300)
            assert t.returncode == 0, o + e
            outs.append(o)
        assert "steps 1..%d" % steps not in outs[1], "the replacement started over"
        assert read(str(tmp_path / "t0")) == read(str(tmp_path / "t1"))
    finally:
        for t in ts:
            if t.poll() is None:
                t.kill()
                t.wait()


def test_data_plane_bytes_are_measured_and_shown(daemon_factory, tmp_path):
    """The host backend counts the bytes it really moves; status, scapectl
    status and scapectl metrics show them, next to the ring model's figure."""
    n, steps = 20000, 50
    daemons = start_group(daemon_factory, [1, 1], ["--mode", "sharded", "--warmup", "1"])
    train_group(daemons, [1, 1], tmp_path, n, steps, "bytes")
    ctl = binary("client", "scapectl")
    for r, d in enumerate(daemons):
        _, _, st, done = pbwire.query_status(d.status_endpoint)
        sent, recvd = st[20][0], st[21][0]
        model = steps * done[6][0]  # the ring model's bytes of the last step, every step
        print("rank %d: sent %d, received %d, model %d" % (r, sent, recvd, model))
        assert model < recvd < 3 * model + 8 * n, (recvd, model)
        assert model < sent < 3 * model + 8 * n, (sent, model)
        js = json.loads(subprocess.run([ctl, "--runtime-dir", d.rt, "status", "--json"],
                                       capture_output=True, text=True, check=True).stdout)
        assert js["data_recv_bytes"] >= recvd and js["data_sent_bytes"] >= sent, js
        text = subprocess.run([ctl, "--runtime-dir", d.rt, "status"], capture_output=True,
                              text=True, check=True).stdout
        listen = data_endpoint(d)
        assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", listen) and js["data_endpoint"] == listen
        assert (js["peers_connected"], js["peers_down"]) == (1, []), js
        assert re.search(r"^Data plane\s*: %s: sent [\d.]+ \w+, received [\d.]+ \w+$"
                         % re.escape(listen), text, re.M), text
        assert re.search(r"^Peers\s*: 1 of 1 connected$", text, re.M), text
        metrics = subprocess.run([ctl, "--runtime-dir", d.rt, "metrics"], capture_output=True,
                                 text=True, check=True).stdout
        assert "# TYPE scape_data_received_bytes_total counter" in metrics, metrics
        assert re.search(r'^scape_peers_connected\{rank="%d"\} 1$' % r, metrics, re.M), metrics
        got = re.search(r'^scape_data_received_bytes_total\{rank="%d"\} (\S+)$' % r, metrics, re.M)
        assert got and float(got.group(1)) >= recvd, metrics


def test_ring_model_of_a_sharded_dense_step_is_the_same_on_both_ranks(daemon_factory, tmp_path):
    """Sharded dense steps at R = 2 with uneven shards: in a ring, each rank
    receives in the reduce-scatter a partial sum of every segment but its
    predecessor's (at R = 2: its own), and in the all-gather every segment but
    its own, N floats in all: wire_bytes is 4 N on both ranks (it used to
    leave the rank's own segment out of the reduce-scatter: 8 times the
    other's shard, uneven)."""
    n, steps = 3000, 4
    daemons = start_group(daemon_factory, [1, 1], ["--mode", "sharded", "--warmup", "100"])
    train_group(daemons, [1, 1], tmp_path, n, steps, "dense")
    lens = [t[2] for t in synth_layout(n)]
    own = owners(lens, 2)
    shards = [sum(x for x, o in zip(lens, own) if o == r) for r in range(2)]
    assert shards[0] != shards[1], "the test wants uneven shards"
    for d in daemons:
        _, _, _, done = pbwire.query_status(d.status_endpoint)
        assert done[6][0] == 4 * sum(lens), (done[6][0], 4 * sum(lens), shards)


def test_state_dict_of_two_daemons_resumes_bitwise(daemon_factory, tmp_path):
    """state_dict on one of two daemons (its trainer asks after step 6): the
    two agree to write the state after step 6 before step 7 starts (the
    answer says pending); the job stops after step 8.  Two fresh daemons,
    both trainers load it before their first step and train to step 12:
    bitwise the local backend's 12 steps."""
    n, ck, state = 3000, str(tmp_path / "ck"), str(tmp_path / "state.json")
    extra = ["--checkpoint-dir", ck]

    def run(steps, per_rank):
        daemons = start_group(daemon_factory, [1, 1], extra)
        procs = [subprocess.Popen([sys.executable, PY_TRAINER, "--endpoint", d.endpoint,
                                   "--index", "0", "--n", str(n), "--steps", str(steps),
                                   "--seed", str(1 + 1000 * r), *per_rank(r)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r, d in enumerate(daemons)]
        said = []
        for p in procs:
            o, e = p.communicate(timeout=300)
            assert p.returncode == 0, o + e
            said.append(o)
        for d in daemons:
            assert d.stop() == 0, d.output()
        return said

    run(8, lambda r: ["--checkpoint-at", "6", "--state", state] if r == 0 else [])
    with open(state) as f:
        st = json.load(f)
    # on disk when state_dict returned, though only rank 0's trainer asked
    assert st["step"] == 6 and not st["pending"] and os.path.isdir(st["dir"]), st
    assert st["name"] and os.path.isfile(os.path.join(st["dir"], "MANIFEST")), st
    outs = [str(tmp_path / ("r%d" % r)) for r in range(2)]
    said = run(12, lambda r: ["--resume", "--state", state, "--out", outs[r]])
    assert all("steps 7..12 done" in o for o in said), said
    run_reference(str(tmp_path / "ref"), "1,1", n, 12, *ENGINE)
    for out in outs:
        assert read(out) == read(str(tmp_path / "ref")), "the resumed job differs"
