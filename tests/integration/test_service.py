"""The single-node service with real processes: scaped, C trainers through
libscape, raw ZeroMQ peers that send bad input, a trainer killed mid-step."""
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from multiprocessing import shared_memory

import pytest
import zmq

import pbwire
from conftest import binary, run_reference, run_trainer, synth_layout

PROTO, INVALID, REMOTE, CUDA, UNSUPPORTED = 7, 1, 8, 4, 10
ENGINE = ["--rho", "0.01", "--warmup", "3"]


def read(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("executor,threads", [("host", 1), ("host", 3), ("sim", 1)])
def test_c_trainers_match_in_process_engine(daemon_factory, tmp_path, executor, threads):
    """Bitwise equal to the in-process engine (host executor, one thread),
    whatever the daemon's engine_threads and executor: sim runs the cuda
    executor's code, the residual streamed in chunks of 5000 coordinates."""
    n, steps = 20000, 60
    d = daemon_factory(*ENGINE, "--trainers", "4", "--engine-threads", str(threads),
                       "--executor", executor, "--residual-chunk", "5000")
    ctx = zmq.Context()
    events = ctx.socket(zmq.SUB)
    events.setsockopt(zmq.LINGER, 0)
    events.setsockopt(zmq.SUBSCRIBE, b"")
    events.connect("ipc://%s/events" % d.rt)
    time.sleep(0.3)  # the subscription reaches the daemon before step 1
    procs = [run_trainer(d.endpoint, i, n, steps, out=str(tmp_path / ("t%d" % i)), wait=False)
             for i in range(4)]
    for i, p in enumerate(procs):
        o, e = p.communicate(timeout=300)
        assert p.returncode == 0, "trainer %d: %s %s" % (i, o, e)
    # one event per step on the PUB socket, each a Metrics with its StepDone
    published = []
    while events.poll(1000):
        m = pbwire.parse(events.recv())
        assert m[4][0] == 4, m
        published.append(pbwire.parse(m[2][0])[1][0])
    events.close()
    ctx.term()
    assert published == list(range(1, steps + 1)), published
    # zero-copy handover: the engine read the gradients where the trainers
    # wrote them; only the four Step messages came in
    status, msg, st, done = pbwire.query_status(d.status_endpoint)
    assert status == 0, msg
    assert done[1][0] == steps and done[9][0] == 0 and 0 < done[10][0] < 200, done
    # which executor ran, and the memory it holds: the residual pinned
    # (N floats), m, theta and the rest on the "device"
    assert st[28][0] == executor.encode(), st.get(28)
    numel = sum(t[2] for t in synth_layout(n))
    if executor == "sim":
        assert 4 * numel <= st[29][0] < 4 * numel + 4096, st.get(29)
        assert st[18][0] >= 12 * numel, st.get(18)
    else:
        assert st[29][0] == 0 and st[18][0] == 0, (st.get(18), st.get(29))
    run_reference(str(tmp_path / "ref"), 4, n, steps, *ENGINE)
    ref = read(tmp_path / "ref")
    assert len(ref) == 4 * sum(t[2] for t in synth_layout(n))
    for i in range(4):
        assert read(tmp_path / ("t%d" % i)) == ref, "trainer %d differs from the engine" % i
    assert d.stop() == 0


def test_small_tensors_whole(daemon_factory, tmp_path):
    """dense_below through a real daemon: status shows it, a masked step
    reduces the small tensors whole and rho's share of the others (K from
    the layout, computed here), and both trainers end bitwise equal to the
    in-process engine with the same setting."""
    n, steps, below = 20000, 30, 1500
    engine = ENGINE + ["--dense-below", str(below)]
    d = daemon_factory(*engine, "--trainers", "2")
    procs = [run_trainer(d.endpoint, i, n, steps, out=str(tmp_path / ("t%d" % i)), wait=False)
             for i in range(2)]
    for i, p in enumerate(procs):
        o, e = p.communicate(timeout=300)
        assert p.returncode == 0, "trainer %d: %s %s" % (i, o, e)
    status, msg, st, done = pbwire.query_status(d.status_endpoint)
    assert status == 0, msg
    assert st[41][0] == below, st.get(41)
    lens = [t[2] for t in synth_layout(n)]
    want = sum(x if x <= below else -(-x // 100) for x in lens)  # ceil(0.01 x)
    assert sum(x for x in lens if x <= below) > 1000, lens  # the setting does something
    assert done[1][0] == steps and done[3][0] == want, (done, want)
    run_reference(str(tmp_path / "ref"), 2, n, steps, *engine)
    ref = read(tmp_path / "ref")
    for i in range(2):
        assert read(tmp_path / ("t%d" % i)) == ref, "trainer %d differs from the engine" % i
    assert d.stop() == 0


class Probe:
    """A raw DEALER peer speaking scape.proto by hand."""

    def __init__(self, ctx, endpoint):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 10000)
        self.sock.connect(endpoint)

    def ask(self, *frames):
        self.sock.send_multipart(list(frames))
        return pbwire.reply(self.sock.recv())

    def refused(self, code, needle, *frames):
        status, msg, _ = self.ask(*frames)
        assert status == code and msg and needle in msg, (status, msg)

    def close(self):
        self.sock.close()


class Buffers:
    """A pair of shm objects a probe can register."""

    def __init__(self, nbytes, gbytes=None):
        self.p = shared_memory.SharedMemory(create=True, size=nbytes)
        self.g = shared_memory.SharedMemory(create=True, size=gbytes or nbytes)

    def handles(self, pbytes=None):
        return (pbwire.mem_shm("/" + self.p.name, pbytes or self.p.size),
                pbwire.mem_shm("/" + self.g.name, self.g.size))

    def close(self):
        for s in (self.p, self.g):
            s.close()
            s.unlink()


def bad_inputs(ctx, endpoint, layout, n):
    """Every refusal the service promises, each with its message."""
    p = Probe(ctx, endpoint)
    p.refused(PROTO, "undecodable", b"\xff\xff\xff")
    p.refused(PROTO, "undecodable", pbwire.hello(os.getpid())[:-3])
    p.refused(PROTO, "exceeds the limit", b"\0" * (2 << 20))
    p.refused(PROTO, "unknown or empty request", pbwire.field(15, pbwire.LEN, b"x"))
    p.refused(PROTO, "frames", pbwire.hello(os.getpid()), b"extra")
    p.refused(PROTO, "protocol version 99", pbwire.hello(os.getpid(), protocol=99))
    p.refused(INVALID, "say hello first", pbwire.step(1))
    status, _, _ = p.ask(pbwire.hello(os.getpid(), name="probe"))
    assert status == 0
    bufs = Buffers(4 * n)
    try:
        other = [("w0", 0, n - 1), ("bias", n - 1, 1)]
        p.refused(INVALID, "node's layout", pbwire.register(other, *bufs.handles()))
        p.refused(INVALID, "too small", pbwire.register(layout, *bufs.handles(pbytes=4 * n - 4)))
        missing = pbwire.mem_shm("/scape-no-such-object", 4 * n)
        p.refused(INVALID, "No such file", pbwire.register(layout, missing, missing))
        p.refused(INVALID, "does not tile", pbwire.register(
            [("a", 0, 5), ("b", 6, n - 6)], *bufs.handles()))
        status, msg, _ = p.ask(pbwire.register(layout, *bufs.handles()))
        assert status == 0, msg
        p.refused(INVALID, "already registered", pbwire.register(layout, *bufs.handles()))
        p.refused(INVALID, "not synced", pbwire.step(1))
        status, msg, _ = p.ask(pbwire.sync())
        assert status == 0, msg
        p.refused(INVALID, "already synced", pbwire.sync())
        p.refused(INVALID, "out of order", pbwire.step(10 ** 9))
        status, msg, _ = p.ask(pbwire.detach())
        assert status == 0, msg
    finally:
        bufs.close()
        p.close()


def test_cuda_ipc_ranges_checked_before_opening(daemon_factory, tmp_path):
    """A CUDA IPC handle names a whole allocation: forged registrations whose
    buffers overlap in one allocation, with a handle of the wrong size or an
    offset that overflows, with a gradient-ready event handle of the wrong
    size or on buffers that are not both CUDA IPC ones, are refused with the trainer and the buffer named,
    before the daemon opens anything (so also in a build without CUDA, or
    without a GPU); a well-formed one gets as far as opening the handle,
    which fails here; and the daemon goes on serving a real trainer."""
    n = 1000
    d = daemon_factory(*ENGINE)
    layout = synth_layout(n)
    total = sum(t[2] for t in layout)
    ctx = zmq.Context()
    p = Probe(ctx, d.endpoint)
    try:
        status, _, _ = p.ask(pbwire.hello(os.getpid(), name="forger"))
        assert status == 0
        h = bytes(range(64))
        p.refused(INVALID, "grads [%d, +%d) overlap its params [0, +%d)" % (
            4 * total - 4, 4 * total, 4 * total), pbwire.register(
            layout, pbwire.mem_ipc(h, 4 * total, 0), pbwire.mem_ipc(h, 4 * total, 4 * total - 4)))
        p.refused(INVALID, "overlap its params", pbwire.register(  # the same block twice
            layout, pbwire.mem_ipc(h, 4 * total), pbwire.mem_ipc(h, 4 * total)))
        p.refused(INVALID, "params: a CUDA IPC handle has 64 bytes, not 63", pbwire.register(
            layout, pbwire.mem_ipc(h[:63], 4 * total), pbwire.mem_ipc(h, 4 * total, 4 * total)))
        p.refused(INVALID, "bytes overflow", pbwire.register(
            layout, pbwire.mem_ipc(h, 4 * total, 2 ** 64 - 8), pbwire.mem_ipc(h, 4 * total, 0)))
        # gradient-ready events: the handle's size, and only with CUDA buffers
        p.refused(INVALID, "grad_event: an interprocess event handle has 64 bytes, not 63",
                  pbwire.register(layout, pbwire.mem_ipc(h, 4 * total, 0),
                                  pbwire.mem_ipc(h, 4 * total, 4 * total), grad_event=h[:63]))
        p.refused(INVALID, "sent a gradient-ready event, but its buffers are not both CUDA IPC",
                  pbwire.register(layout, pbwire.mem_shm("/scape-none-p", 4 * total),
                                  pbwire.mem_ipc(h, 4 * total, 0), grad_event=h))
        # the GPU by its UUID: 16 bytes; one no GPU here has is refused, named
        p.refused(INVALID, "trainer 0's params: a GPU UUID has 16 bytes, not 15", pbwire.register(
            layout, pbwire.mem_ipc(h, 4 * total, 0, uuid=h[:15]),
            pbwire.mem_ipc(h, 4 * total, 4 * total)))
        status, msg, _ = p.ask(pbwire.register(
            layout, pbwire.mem_ipc(h, 4 * total, 0, uuid=bytes(range(16))),
            pbwire.mem_ipc(h, 4 * total, 4 * total)))
        assert status in (UNSUPPORTED, CUDA) and "trainer 0's params" in msg, (status, msg)
        assert "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f" in msg or "cudaGetDeviceCount" in msg \
            or "CPU-only" in msg, msg
        # apart in one allocation: past the checks, refused where the handle is opened
        status, msg, _ = p.ask(pbwire.register(
            layout, pbwire.mem_ipc(h, 4 * total, 0), pbwire.mem_ipc(h, 4 * total, 4 * total)))
        assert status in (UNSUPPORTED, CUDA, INVALID) and "overlap" not in msg, (status, msg)
        status, msg, _ = p.ask(pbwire.detach())  # the slot is the real trainer's then
        assert status == 0, msg
    finally:
        p.close()
        ctx.term()
    run_trainer(d.endpoint, 0, n, 20, out=str(tmp_path / "t0"))
    assert d.stop() == 0


def test_bad_input_refused_while_another_trainer_completes(daemon_factory, tmp_path):
    n, steps = 5000, 1000  # >= 3 s of steps: the probes end well before, even under load
    d = daemon_factory(*ENGINE)
    layout = synth_layout(n)
    total = sum(t[2] for t in layout)
    trainer = run_trainer(d.endpoint, 0, n, steps, out=str(tmp_path / "t0"), sleep_ms=3,
                          wait=False)
    ctx = zmq.Context()
    try:
        time.sleep(0.3)
        bad_inputs(ctx, d.endpoint, layout, total)
        assert trainer.poll() is None, "the trainer finished before the probes: make it slower"
    finally:
        ctx.term()
    o, e = trainer.communicate(timeout=300)
    assert trainer.returncode == 0, o + e
    run_reference(str(tmp_path / "ref"), 1, n, steps, *ENGINE)
    assert read(tmp_path / "t0") == read(tmp_path / "ref")
    assert d.stop() == 0
    log = d.output()
    assert "refused" in log and "undecodable" in log


def test_trainer_killed_mid_step(daemon_factory, tmp_path):
    n, steps = 4000, 150
    d = daemon_factory(*ENGINE, "--trainers", "2")
    a = run_trainer(d.endpoint, 0, n, steps, out=str(tmp_path / "a"), wait=False)
    # b stops before posting step 5 and dies once a has posted it: mid-step
    b = run_trainer(d.endpoint, 1, n, steps, stop_before=5, wait=False)
    d.kill_mid_step(a.pid, b, 5)
    # A replacement takes the dead trainer's slot and joins at the next step.
    c = run_trainer(d.endpoint, 1, n, steps, out=str(tmp_path / "c"), wait=False)
    outs = {}
    for name, p in (("a", a), ("c", c)):
        o, e = p.communicate(timeout=300)
        assert p.returncode == 0, name + o + e
        outs[name] = o
        if name == "a":
            assert "step 5 abandoned" in e, e
    assert read(tmp_path / "a") == read(tmp_path / "c"), "replicas differ after re-attach"
    # Not only equal to each other (the daemon writes both): equal to the
    # engine run in process with the same history, two trainers for steps
    # 1-4, a alone from the abandoned step 5, both again from c's first step.
    joined = int(re.search(r"steps (\d+)\.\.%d done" % steps, outs["c"]).group(1))
    members = ["--members", "5:1,%d:2" % joined] if joined > 5 else []
    run_reference(str(tmp_path / "ref"), 2, n, steps, *ENGINE, *members)
    assert read(tmp_path / "a") == read(tmp_path / "ref"), (
        "after the death and the re-attach at step %d the parameters are not the "
        "reference's" % joined)
    assert "died" in d.output()
    assert d.stop() == 0
    leftovers = [f for f in os.listdir("/dev/shm") if f.startswith("scape-%d-" % b.pid)]
    assert not leftovers, "the dead trainer's shared memory was not unlinked: %s" % leftovers


def test_replacement_takes_a_dead_trainers_slot_at_once(daemon_factory, tmp_path):
    """A trainer restarted at once asks for its slot before the daemon's
    liveness check (every 200 ms) has seen the old process go: the slot is
    the dead one's, so the daemon lets it go then and there, instead of
    refusing the replacement as "slot 1 is taken"."""
    n, steps = 2000, 40
    d = daemon_factory(*ENGINE, "--trainers", "2")
    a = run_trainer(d.endpoint, 0, n, steps, out=str(tmp_path / "a"), wait=False)
    b = run_trainer(d.endpoint, 1, n, steps, stop_before=5, wait=False)
    d.kill_mid_step(a.pid, b, 5, noticed=False)
    c = run_trainer(d.endpoint, 1, n, steps, out=str(tmp_path / "c"), wait=False)
    for name, p in (("a", a), ("c", c)):
        o, e = p.communicate(timeout=120)
        assert p.returncode == 0, name + o + e
    assert read(tmp_path / "a") == read(tmp_path / "c")
    assert "died" in d.output()
    assert d.stop() == 0
    leftovers = [f for f in os.listdir("/dev/shm") if f.startswith("scape-%d-" % b.pid)]
    assert not leftovers, "the dead trainer's shared memory was not unlinked: %s" % leftovers


def test_shutdown_tells_trainers_and_unlinks(daemon_factory):
    d = daemon_factory(*ENGINE)
    t = run_trainer(d.endpoint, 0, 1000, 10 ** 6, sleep_ms=20, wait=False)
    deadline = time.time() + 30
    while not d.trainers():  # attached, so it is told when the daemon stops
        assert time.time() < deadline and t.poll() is None, "the trainer never attached"
        time.sleep(0.02)
    assert d.stop() == 0
    o, e = t.communicate(timeout=60)
    assert t.returncode != 0 and "shutting down" in e, e
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("scape-%d-" % t.pid)]
    assert not os.path.exists(os.path.join(d.rt, "control"))


def test_sigint_tells_a_waiting_trainer(daemon_factory):
    """SIGINT stops the daemon like SIGTERM, and a trainer still waiting (here
    for the second trainer the job needs before step 1) is told why."""
    d = daemon_factory(*ENGINE, "--trainers", "2")
    t = run_trainer(d.endpoint, 0, 1000, 10, wait=False)
    deadline = time.time() + 30
    while len(d.trainers()) < 1:
        assert time.time() < deadline and t.poll() is None, "the trainer never attached"
        time.sleep(0.05)
    time.sleep(0.3)  # it has posted its sync and waits for the reply
    d.proc.send_signal(signal.SIGINT)
    assert d.proc.wait(30) == 0, d.output()
    o, e = t.communicate(timeout=60)
    assert t.returncode != 0 and "shutting down" in e, o + e
    assert not os.path.exists(os.path.join(d.rt, "control"))


def test_runtime_dir_is_private_and_single(daemon_factory):
    d = daemon_factory()
    assert stat.S_IMODE(os.stat(d.rt).st_mode) == 0o700
    second = subprocess.run([binary("daemon", "scaped"), "--runtime-dir", d.rt],
                            capture_output=True, text=True, timeout=30)
    assert second.returncode == 1 and "another scaped" in second.stderr, second.stderr


def test_config_errors_and_print_config(tmp_path):
    cfg = tmp_path / "scaped.yaml"
    cfg.write_text("optimizer: scape\nrho: 0.05\n\nwarmup: 0\n")
    res = subprocess.run([binary("daemon", "scaped"), "--config", str(cfg)],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "%s:4:" % cfg in res.stderr and "warmup" in res.stderr
    cfg.write_text("rho: 0.05\n")
    env = dict(os.environ, SCAPE_WARMUP="7")
    res = subprocess.run([binary("daemon", "scaped"), "--config", str(cfg), "--print-config",
                          "--mode", "sharded"], capture_output=True, text=True, env=env,
                         timeout=30)
    assert res.returncode == 0, res.stderr
    lines = {l.split(":")[0]: l.split(":")[1].split("#")[0].strip()
             for l in res.stdout.splitlines() if ":" in l and not l.startswith("#")}
    assert float(lines["rho"]) == 0.05
    assert lines["warmup"] == "7" and lines["mode"] == "sharded"
    # one key at every level: the file < SCAPE_* < the flag
    for flags, want in (((), 0.07), (("--rho", "0.3"), 0.3)):
        res = subprocess.run([binary("daemon", "scaped"), "--config", str(cfg), "--print-config",
                              *flags], capture_output=True, text=True, timeout=30,
                             env=dict(os.environ, SCAPE_RHO="0.07"))
        assert res.returncode == 0, res.stderr
        rho = [l for l in res.stdout.splitlines() if l.startswith("rho:")]
        assert rho and float(rho[0].split(":")[1].split("#")[0]) == want, res.stdout


def test_slurm_environment_sets_the_job_shape():
    env = dict(os.environ, SLURM_PROCID="1", SLURM_NTASKS="4", SLURM_JOB_ID="55",
               SLURM_JOB_NODELIST="n[1-4]")
    env.pop("SLURM_STEP_NODELIST", None)

    def printed(*flags):
        res = subprocess.run([binary("daemon", "scaped"), "--print-config", *flags],
                             capture_output=True, text=True, env=env, timeout=30)
        assert res.returncode == 0, res.stderr
        return {l.split(":", 1)[0]: l.split(":", 1)[1].split("#")[0].strip()
                for l in res.stdout.splitlines() if ":" in l}

    got = printed()
    assert (got["world"], got["rank"], got["job"]) == ("4", "1", "55")
    # rank 0's port follows the job id (two jobs on one first node differ);
    # the data plane takes any free port and the rendezvous publishes it
    assert got["coordinator"] == '"tcp://n1:20055"'
    assert got["listen"].startswith('"tcp://') and got["listen"].endswith(':*"')
    env["SLURM_JOB_ID"] = "123456"
    assert printed()["coordinator"] == '"tcp://n1:23456"'
    assert printed("--rank", "2")["rank"] == "2"  # flags still win


def test_sixty_four_trainers_and_no_sixty_fifth(daemon_factory, tmp_path):
    """The most trainers a daemon serves, every one bitwise equal to the
    in-process engine with 64 trainers; a 65th is refused meanwhile."""
    n, steps, count = 2000, 40, 64
    d = daemon_factory(*ENGINE, "--trainers", str(count))
    procs = [run_trainer(d.endpoint, i, n, steps, out=str(tmp_path / ("t%d" % i)),
                         sleep_ms=50, wait=False) for i in range(count)]
    try:
        deadline = time.time() + 120
        while len(d.trainers()) < count:
            assert time.time() < deadline, "only %d trainers attached" % len(d.trainers())
            assert all(p.poll() is None for p in procs), "a trainer ended early"
            time.sleep(0.05)
        ctx = zmq.Context()
        p = Probe(ctx, d.endpoint)
        try:
            p.refused(INVALID, "all 64 trainer slots are taken", pbwire.hello(os.getpid()))
        finally:
            p.close()
            ctx.term()
        assert all(p.poll() is None for p in procs), "the 65th hello came too late"
        for i, p in enumerate(procs):
            o, e = p.communicate(timeout=300)
            assert p.returncode == 0, "trainer %d: %s %s" % (i, o, e)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    run_reference(str(tmp_path / "ref"), count, n, steps, *ENGINE)
    ref = read(tmp_path / "ref")
    for i in range(count):
        assert read(tmp_path / ("t%d" % i)) == ref, "trainer %d differs from the engine" % i
    assert d.stop() == 0


# A peer that registers its own POSIX shm names and keeps them (libscape
# unlinks its names once the daemon has mapped them, so only such a peer shows
# whether the daemon unlinks what is left when the peer dies or it stops).
KEEPER = r"""
import os, sys, time, zmq
sys.path.insert(0, sys.argv[1])
import pbwire
layout, nbytes = [("w", 0, 999), ("b", 999, 1)], 4000
names = ["/scape-keeper-%d-%s" % (os.getpid(), k) for k in "pg"]
for name in names:
    with open("/dev/shm" + name, "wb") as f:
        f.truncate(nbytes)
s = zmq.Context().socket(zmq.DEALER)
s.setsockopt(zmq.RCVTIMEO, 10000)
s.connect(sys.argv[2])
for req in (pbwire.hello(os.getpid(), name="keeper"),
            pbwire.register(layout, *[pbwire.mem_shm(n, nbytes) for n in names])):
    s.send(req)
    status, msg, _ = pbwire.reply(s.recv())
    assert status == 0, msg
print(" ".join(names), flush=True)
time.sleep(600)
"""


def start_keeper(d):
    k = subprocess.Popen([sys.executable, "-c", KEEPER, os.path.dirname(pbwire.__file__),
                          d.endpoint], stdout=subprocess.PIPE, text=True)
    names = k.stdout.readline().split()
    assert len(names) == 2 and all(os.path.exists("/dev/shm" + n) for n in names), names
    return k, names


def gone(names, within=10.0):
    deadline = time.time() + within
    while any(os.path.exists("/dev/shm" + n) for n in names):
        if time.time() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_daemon_unlinks_what_a_dead_or_dropped_peer_left(daemon_factory):
    d = daemon_factory(*ENGINE)
    k, names = start_keeper(d)
    try:
        k.kill()
        k.wait()
        assert gone(names), "a dead peer's shm names are still there"
        assert "died" in d.output()
        k, names = start_keeper(d)
        assert d.stop() == 0
        assert gone(names, within=0), "shm names left after shutdown"
    finally:
        k.kill()
        k.wait()
        for n in names:
            if os.path.exists("/dev/shm" + n):
                os.unlink("/dev/shm" + n)


def test_default_runtime_dir(tmp_path):
    """Without --runtime-dir or SCAPE_RUNTIME_DIR: /tmp/scape-job$SLURM_JOB_ID,
    else /tmp/scape-$USER, created (or tightened) to 0700; scapectl finds the
    daemon there by the same rule."""
    tag = "it%d" % os.getpid()
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("SLURM_") and k != "SCAPE_RUNTIME_DIR"}
    for env, rt in ((dict(base, SLURM_JOB_ID=tag), "/tmp/scape-job" + tag),
                    (dict(base, USER=tag), "/tmp/scape-" + tag)):
        shutil.rmtree(rt, ignore_errors=True)
        if "USER" in env and env["USER"] == tag:
            os.mkdir(rt, 0o755)  # an existing directory others could enter
        log = open(str(tmp_path / ("scaped-%s.log" % os.path.basename(rt))), "w")
        proc = subprocess.Popen([binary("daemon", "scaped")], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 15
            while not os.path.exists(os.path.join(rt, "control")):
                assert proc.poll() is None and time.time() < deadline, "no control socket in " + rt
                time.sleep(0.02)
            assert stat.S_IMODE(os.stat(rt).st_mode) == 0o700
            res = subprocess.run([binary("client", "scapectl"), "status", "--json"], env=env,
                                 capture_output=True, text=True, timeout=30)
            assert res.returncode == 0 and rt in res.stdout, res.stdout + res.stderr
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
            log.close()
            shutil.rmtree(rt, ignore_errors=True)
