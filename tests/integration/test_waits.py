"""No silent waits, in either direction, and no lost steps: signals during
libscape's waits (a handler that returns, Ctrl-C), a daemon that dies under
its trainers, a daemon that waits for its trainers, trainers that start
before their daemon, README's "A node in one minute" run as written, and
status that answers while a collective waits for a hung daemon.

Run as a script, this file is the Python trainer these tests start:
    test_waits.py trainer --endpoint EP --index I --n N --steps S --out FILE
                  [--usr1] [--announce STEP] [--hold-at STEP --go FILE]
                  [--sleep-ms MS]
It trains the synthetic problem of synth.h (py_trainer's numpy twin) and
prints one JSON line last: the SIGUSR1 count and each KeyboardInterrupt that
reached it, with whether its step had settled."""
import argparse
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import py_trainer  # noqa: E402
from py_trainer import scape  # noqa: E402

ENGINE = ["--rho", "0.01", "--warmup", "3"]
SYS_POLL = {"7", "271"}  # x86_64 poll and ppoll: where zmq_poll waits
SYS_SLEEP = {"35", "230"}  # nanosleep, clock_nanosleep: libscape's wait for a socket


# ---- the trainer ------------------------------------------------------------------

def wait_for_file(path, seconds=120):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError("%s never appeared" % path)
        time.sleep(0.01)


def trainer(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint")
    ap.add_argument("--index", type=int, default=-1)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--out")
    ap.add_argument("--usr1", action="store_true", help="count SIGUSR1 in a Python handler")
    ap.add_argument("--announce", type=int, default=0, help="print 'posting T' before step T")
    ap.add_argument("--hold-at", type=int, default=0, help="before posting this step, wait "
                                                           "for --go to exist")
    ap.add_argument("--go")
    ap.add_argument("--sleep-ms", type=int, default=0)
    a = ap.parse_args(argv)
    usr1 = [0]
    if a.usr1:
        signal.signal(signal.SIGUSR1, lambda *_: usr1.__setitem__(0, usr1[0] + 1))
        print("handler ready", flush=True)
    layout = py_trainer.synth_layout(a.n)
    try:
        s = scape.attach(a.endpoint, layout, index=a.index)
        synth = py_trainer.Synth(1, s.index, layout)
        s.params[:] = synth.init()
        s.sync()
        interrupts = []
        for t in range(s.next_step, a.steps + 1):
            s.grads[:] = synth.grads(t, s.params)
            if t == a.hold_at:
                wait_for_file(a.go)
            if t == a.announce:
                print("posting %d" % t, flush=True)
            try:
                s.step(a.lr, step=t)
            except KeyboardInterrupt:
                interrupts.append({"step": t, "settled": s.next_step == t + 1})
                print("interrupted at %d" % t, flush=True)
                for _ in range(10):  # given up: the step is still in flight
                    if s.next_step == t + 1:
                        break
                    try:
                        s.step_wait()
                    except KeyboardInterrupt:
                        pass
            if a.sleep_ms:
                time.sleep(a.sleep_ms / 1000)
        if a.out:
            s.params.tofile(a.out)
        s.detach()
    except scape.ScapeError as e:
        print("test_waits trainer %d: %s" % (a.index, e), file=sys.stderr)
        return 1
    if a.usr1:  # the test's signals may come until it sees this process end
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    print(json.dumps({"usr1": usr1[0], "interrupts": interrupts}), flush=True)
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["trainer"]:
    sys.exit(trainer(sys.argv[2:]))


# ---- the tests ----------------------------------------------------------------------

import pytest  # noqa: E402

from conftest import (SOURCE, binary, free_endpoints, process_stopped,  # noqa: E402
                      run_reference, run_trainer)


class Proc:
    """A process whose stdout lines are read as they come."""

    def __init__(self, cmd, env=None):
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env)
        self.lines = queue.Queue()
        self.out = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.p.stdout:
            self.out.append(line)
            self.lines.put(line)

    def expect(self, pattern, seconds=120):
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and self.p.poll() is None, \
                "never printed %r: %s %s" % (pattern, "".join(self.out), self.err())
            try:
                if re.search(pattern, self.lines.get(timeout=min(left, 1.0))):
                    return
            except queue.Empty:
                pass

    def finish(self, seconds=300):
        self.p.wait(seconds)
        self.reader.join(10)
        return self.p.returncode

    def err(self):
        return self.p.stderr.read() if self.p.poll() is not None else ""

    def result(self):
        assert self.finish() == 0, "".join(self.out) + self.err()
        return json.loads(self.out[-1])


def py(endpoint, index, n, steps, out, *extra, env=None):
    return Proc([sys.executable, os.path.abspath(__file__), "trainer", "--endpoint", endpoint,
                 "--index", str(index), "--n", str(n), "--steps", str(steps), "--out", out,
                 *map(str, extra)], env=env)


def c_trainer(endpoint, index, n, steps, out, *extra, env=None):
    return Proc([binary("tests", "integration", "trainer_c"), "--endpoint", endpoint,
                 "--index", str(index), "--n", str(n), "--steps", str(steps), "--out", out,
                 *map(str, extra)], env=env)


def in_syscall(pid, numbers):
    """Whether pid's main thread sits in one of these system calls."""
    with open("/proc/%d/syscall" % pid) as f:
        return f.read().split()[0] in numbers


def in_poll(pid):
    """In poll: zmq_poll, a libscape wait."""
    return in_syscall(pid, SYS_POLL)


def until_waiting(proc, seconds=60):
    deadline = time.monotonic() + seconds
    while not in_poll(proc.p.pid):
        assert time.monotonic() < deadline and proc.p.poll() is None, "never waited in libscape"
        time.sleep(0.01)


def reference(tmp_path, n, steps):
    run_reference(str(tmp_path / "ref"), 2, n, steps, *ENGINE)
    with open(tmp_path / "ref", "rb") as f:
        return f.read()


def assert_bitwise(paths, ref):
    for path in paths:
        with open(path, "rb") as f:
            assert f.read() == ref, "%s differs from the undisturbed run" % path


def test_usr1_with_a_python_handler_during_steps_loses_nothing(daemon_factory, tmp_path):
    """SIGUSR1, over and over, to two Python trainers whose handler returns:
    the run ends bitwise where the in-process engine does."""
    n, steps, hold = 20000, 50, 25
    d = daemon_factory(*ENGINE, "--trainers", "2")
    go = str(tmp_path / "go")
    outs = [str(tmp_path / ("t%d" % i)) for i in range(2)]
    t0 = py(d.endpoint, 0, n, steps, outs[0], "--usr1", "--announce", hold)
    t1 = py(d.endpoint, 1, n, steps, outs[1], "--usr1", "--hold-at", hold, "--go", go)
    t0.expect("handler ready")
    t1.expect("handler ready")
    stop = threading.Event()

    def pester():  # every few ms, for the whole run (bounded by the run)
        while not stop.is_set():
            for t in (t0, t1):
                if t.p.poll() is None:
                    t.p.send_signal(signal.SIGUSR1)
            time.sleep(0.003)

    sender = threading.Thread(target=pester, daemon=True)
    sender.start()
    try:
        # and for certain inside a wait: t0 waits for step `hold`, which t1 holds
        t0.expect("posting %d" % hold)
        for _ in range(20):
            until_waiting(t0)
            t0.p.send_signal(signal.SIGUSR1)
            time.sleep(0.01)
        open(go, "w").close()
        r0, r1 = t0.result(), t1.result()
    finally:
        stop.set()
        sender.join(10)
    assert r0["usr1"] >= 20 and r1["usr1"] > 0, (r0, r1)
    assert_bitwise(outs, reference(tmp_path, n, steps))
    assert d.stop() == 0


@pytest.mark.parametrize("sigints", [1, 2])
def test_ctrl_c_during_a_step_reaches_the_caller_once_it_settled(daemon_factory, tmp_path,
                                                                  sigints):
    """SIGINT while step() waits: KeyboardInterrupt reaches the caller after
    the step settled (one Ctrl-C), or with it given up and still in flight
    (a second one), which step_wait() then completes; the other trainer is
    not disturbed, and the run ends bitwise where the engine does."""
    n, steps, hold = 5000, 20, 10
    d = daemon_factory(*ENGINE, "--trainers", "2")
    go = str(tmp_path / "go")
    outs = [str(tmp_path / ("t%d" % i)) for i in range(2)]
    t0 = py(d.endpoint, 0, n, steps, outs[0], "--announce", hold)
    t1 = py(d.endpoint, 1, n, steps, outs[1], "--hold-at", hold, "--go", go)
    t0.expect("posting %d" % hold)
    until_waiting(t0)
    t0.p.send_signal(signal.SIGINT)
    if sigints == 2:
        deadline = time.monotonic() + 60
        while not any(l.startswith("interrupted") for l in t0.out):
            assert time.monotonic() < deadline, "a second Ctrl-C did not give the wait up"
            until_waiting(t0)
            t0.p.send_signal(signal.SIGINT)
            time.sleep(0.2)
    open(go, "w").close()
    r0, r1 = t0.result(), t1.result()
    assert r0["interrupts"] == [{"step": hold, "settled": sigints == 1}], r0
    assert r1["interrupts"] == []
    assert_bitwise(outs, reference(tmp_path, n, steps))
    assert d.stop() == 0


def test_c_trainer_with_a_handled_signal_in_its_waits(daemon_factory, tmp_path):
    """trainer_c with a counting SIGUSR1 handler (no SA_RESTART): signals in
    sync, while its step waits for a stopped peer, and all along; it ends
    bitwise where the engine does."""
    n, steps, hold = 20000, 30, 12
    d = daemon_factory(*ENGINE, "--trainers", "2")
    outs = [str(tmp_path / ("t%d" % i)) for i in range(2)]
    t0 = c_trainer(d.endpoint, 0, n, steps, outs[0], "--catch-signal", int(signal.SIGUSR1))
    until_waiting(t0)  # in sync: the daemon waits for trainer 1
    for _ in range(10):
        t0.p.send_signal(signal.SIGUSR1)
        time.sleep(0.01)
    t1 = c_trainer(d.endpoint, 1, n, steps, outs[1], "--stop-before", hold)
    deadline = time.monotonic() + 60
    while not d.trainers() or max(ti[4] for ti in d.trainers()) < hold or \
            not open("/proc/%d/stat" % t1.p.pid).read().rsplit(")", 1)[1].split()[0] == "T":
        assert time.monotonic() < deadline, "trainer 0 never posted step %d" % hold
        time.sleep(0.01)
    for _ in range(20):
        until_waiting(t0)
        t0.p.send_signal(signal.SIGUSR1)
        time.sleep(0.01)
    t1.p.send_signal(signal.SIGCONT)
    assert t0.finish() == 0 and t1.finish() == 0, "".join(t0.out) + t0.err() + t1.err()
    caught = re.search(r"caught signal \d+ (\d+) times", "".join(t0.out))
    assert caught and int(caught.group(1)) >= 30, t0.out
    assert_bitwise(outs, reference(tmp_path, n, steps))
    assert d.stop() == 0


def scape_shm(pid, before=()):
    """The shared-memory names of process pid, less those already there (a
    process killed earlier, with the same pid since reused, may have left
    some: pids wrap at 32,768 in a long CI run)."""
    return [f for f in os.listdir("/dev/shm")
            if f.startswith("scape-%d-" % pid) and f not in before]


def test_killed_daemon_fails_its_trainers_in_time_and_leaves_no_memory(daemon_factory,
                                                                         tmp_path):
    """SIGKILL the daemon under a C and a Python trainer: each fails within
    the bound (SCAPE_DAEMON_LOST_MS, not timeout_ms's 600 s), naming the
    daemon and its runtime directory, and leaves no shared memory."""
    d = daemon_factory(*ENGINE, "--trainers", "2")
    env = dict(os.environ, SCAPE_DAEMON_LOST_MS="1000")
    outs = [str(tmp_path / ("t%d" % i)) for i in range(2)]
    before = set(os.listdir("/dev/shm"))
    trainers = [c_trainer(d.endpoint, 0, 2000, 100000, outs[0], "--sleep-ms", 5, env=env),
                py(d.endpoint, 1, 2000, 100000, outs[1], "--sleep-ms", 5, env=env)]
    deadline = time.monotonic() + 60
    while len(d.trainers()) < 2 or min(ti[4] for ti in d.trainers()) < 5:
        assert time.monotonic() < deadline, "the trainers never got going"
        time.sleep(0.02)
    pid = d.proc.pid
    d.proc.send_signal(signal.SIGKILL)  # not reaped: a zombie counts as gone
    killed = time.monotonic()
    for t in trainers:
        # a generous outer bound: without the check they wait 600 s
        assert t.finish(seconds=60) != 0
    waited = time.monotonic() - killed
    for t in trainers:
        err = t.err()
        assert "scaped (pid %d) at %s is gone (runtime directory %s)" % (pid, d.endpoint,
                                                                         d.rt) in err, err
        assert scape_shm(t.p.pid, before) == []
    d.proc.wait()
    print("trainers failed %.2f s after the daemon was killed (bound 1 s + a 0.1 s slice)"
          % waited)


def test_status_says_which_trainers_the_daemon_waits_for(daemon_factory, tmp_path):
    d = daemon_factory(*ENGINE, "--trainers", "2")
    ctl = binary("client", "scapectl")
    t0 = c_trainer(d.endpoint, 0, 1000, 5, str(tmp_path / "t0"))
    deadline = time.monotonic() + 60
    while len(d.trainers()) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    text = subprocess.run([ctl, "--runtime-dir", d.rt, "status"], capture_output=True,
                          text=True, timeout=30)
    assert text.returncode == 0, text.stderr
    fields = {l.split(" : ")[0].strip(): l.split(" : ", 1)[1]
              for l in text.stdout.splitlines() if " : " in l}
    assert fields["State"] == "waiting", text.stdout
    assert fields["Waiting for"] == "1 more trainer (slot 1)", text.stdout
    js = json.loads(subprocess.run([ctl, "--runtime-dir", d.rt, "--json", "status"],
                                   capture_output=True, text=True, timeout=30).stdout)
    assert (js["waiting_for"], js["waiting_slots"], js["trainers_expected"]) == (1, [1], 2)
    w = subprocess.run([ctl, "--runtime-dir", d.rt, "watch", "--count", "1"],
                       capture_output=True, text=True, timeout=30)
    assert "waiting for 1 more trainer (slot 1)" in w.stdout, w.stdout
    t1 = c_trainer(d.endpoint, 1, 1000, 5, str(tmp_path / "t1"))
    assert t0.finish() == 0 and t1.finish() == 0
    js = json.loads(subprocess.run([ctl, "--runtime-dir", d.rt, "--json", "status"],
                                   capture_output=True, text=True, timeout=30).stdout)
    assert js["waiting_for"] is None and js["step"] == 5, js
    assert d.stop() == 0


def test_trainers_started_before_their_daemon_wait_for_it(tmp_path):
    """SCAPE_START_WAIT_MS: a C and a Python trainer started first say once
    what they wait for, and the run completes once the daemon is up."""
    base = tempfile.mkdtemp(prefix="scape-sw-")
    rt = os.path.join(base, "rt")
    endpoint = "ipc://%s/control" % rt
    env = dict(os.environ, SCAPE_START_WAIT_MS="60000")
    outs = [str(tmp_path / ("t%d" % i)) for i in range(2)]
    n, steps = 3000, 10
    trainers = [c_trainer(endpoint, 0, n, steps, outs[0], env=env),
                py(endpoint, 1, n, steps, outs[1], env=env)]
    d = None
    try:
        deadline = time.monotonic() + 60
        # both in libscape's wait for the socket (a trainer importing numpy
        # sleeps nowhere else)
        while not all(t.p.poll() is None and in_syscall(t.p.pid, SYS_SLEEP) for t in trainers):
            assert time.monotonic() < deadline, "the trainers never waited"
            time.sleep(0.02)
        d = subprocess.Popen([binary("daemon", "scaped"), "--runtime-dir", rt, "--trainers",
                              "2", *ENGINE], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for t in trainers:
            assert t.finish() == 0, t.err()
            err = t.err()
            assert err.count("waiting up to 60 s for scaped at %s" % endpoint) == 1, err
        assert_bitwise(outs, reference(tmp_path, n, steps))
    finally:
        for t in trainers:
            if t.p.poll() is None:
                t.p.kill()
        if d is not None:
            d.send_signal(signal.SIGTERM)
            d.wait(20)
        shutil.rmtree(base, ignore_errors=True)


def test_trainer_killed_while_waiting_for_its_daemon_leaves_no_memory(tmp_path):
    """A C and a Python trainer SIGKILLed in SCAPE_START_WAIT_MS's wait
    leave no shared-memory name behind: the buffers come after the
    daemon's welcome (a long CI run found hundreds left by trainers killed
    before their daemons had formed the group)."""
    base = tempfile.mkdtemp(prefix="scape-sk-")
    endpoint = "ipc://%s/rt/control" % base
    env = dict(os.environ, SCAPE_START_WAIT_MS="60000")
    before = set(os.listdir("/dev/shm"))
    trainers = [c_trainer(endpoint, 0, 3000, 10, str(tmp_path / "t0"), env=env),
                py(endpoint, 1, 3000, 10, str(tmp_path / "t1"), env=env)]
    try:
        deadline = time.monotonic() + 60
        while not all(t.p.poll() is None and in_syscall(t.p.pid, SYS_SLEEP) for t in trainers):
            assert time.monotonic() < deadline, "the trainers never waited"
            time.sleep(0.02)
        for t in trainers:
            t.p.kill()
            t.p.wait(20)
            assert scape_shm(t.p.pid, before) == []
    finally:
        for t in trainers:
            if t.p.poll() is None:
                t.p.kill()
        shutil.rmtree(base, ignore_errors=True)


def readme_block(title):
    with open(os.path.join(SOURCE, "README.md")) as f:
        text = f.read()
    section = text.split("## " + title, 1)[1]
    return section.split("```sh\n", 1)[1].split("```", 1)[0]


def test_readme_node_in_one_minute_runs_as_written():
    """README's commands, verbatim, from a directory whose build-demo is the
    build under test, with a private runtime directory; bounded."""
    cmds = readme_block("A node in one minute")
    assert "build-demo/tests/integration/trainer_c" in cmds
    base = tempfile.mkdtemp(prefix="scape-rd-")
    build = os.environ.get("SCAPE_BUILD_DIR", os.path.join(SOURCE, "build"))
    os.symlink(os.path.abspath(build), os.path.join(base, "build-demo"))
    env = dict(os.environ, SCAPE_RUNTIME_DIR=os.path.join(base, "rt"))
    env.pop("SCAPE_START_WAIT_MS", None)
    p = subprocess.Popen(["bash", "-e", "-c", cmds], cwd=base, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = p.communicate(timeout=300)
    finally:
        try:  # whatever of the commands still runs (nothing, when they passed)
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
        shutil.rmtree(base, ignore_errors=True)
    assert p.returncode == 0, out + err
    assert "waiting for" in out, out
    hashes = re.findall(r"trainer_c \d: steps 1\.\.200 done, .* params ([0-9a-f]{16})", out)
    assert len(hashes) == 2 and hashes[0] == hashes[1], out


def scapectl_status(d, *args):
    res = subprocess.run([binary("client", "scapectl"), "--runtime-dir", d.rt, *args,
                          "status"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def scrape_metrics(d):
    import urllib.request
    m = re.search(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", d.output())
    assert m, d.output()
    with urllib.request.urlopen("http://127.0.0.1:%s/metrics" % m.group(1), timeout=30) as r:
        assert r.status == 200
        return r.read().decode()


def test_status_answers_while_a_collective_waits_for_a_hung_daemon(daemon_factory, tmp_path):
    """Three daemons over the host backend, one trainer each.  Rank 2's
    trainer stops itself before step 6 and rank 2's daemon is then SIGSTOPped
    (hung: its connections stay open), so ranks 0 and 1 wait in step 6's
    first collective for it.  While rank 2 is provably still stopped, both
    answer `scapectl status` (the binary) and /metrics, naming the collective
    and rank 2 as the one they wait for.  A checkpoint request (which runs
    collectives of its own) is held until the wait is over, then answered.
    Once rank 2 goes on, the job ends bitwise where the in-process engine
    ends."""
    n, steps, hold = 3000, 12, 6
    coord = free_endpoints(1)[0]
    daemons = [daemon_factory(*ENGINE, "--world", "3", "--rank", str(r), "--coordinator", coord,
                              "--listen", "tcp://127.0.0.1:*", "--job", "35",
                              "--comm-timeout-ms", "120000", "--metrics-listen", "127.0.0.1:0")
               for r in range(3)]
    outs = [str(tmp_path / ("r%d" % r)) for r in range(3)]
    trainers = [run_trainer(d.endpoint, 0, n, steps, out=outs[r], seed=1 + 1000 * r, wait=False,
                            stop_before=hold if r == 2 else None)
                for r, d in enumerate(daemons)]
    hung = daemons[2].proc
    try:
        deadline = time.monotonic() + 120
        while not process_stopped(trainers[2].pid):
            assert time.monotonic() < deadline and trainers[2].poll() is None, \
                "rank 2's trainer never reached step %d" % hold
            time.sleep(0.01)
        hung.send_signal(signal.SIGSTOP)
        while not process_stopped(hung.pid):
            assert time.monotonic() < deadline, "rank 2's daemon did not stop"
            time.sleep(0.01)
        for r in (0, 1):
            # the other ranks post step `hold` and wait in its collective: ask
            # until one answer comes from inside that wait (bounded)
            for _ in range(2000):
                text = scapectl_status(daemons[r])
                if "waiting in " in text:
                    break
                assert time.monotonic() < deadline, text
                time.sleep(0.02)
            line = re.search(r"^Collective\s*: waiting in (\w+) for ranks \[([\d, ]*)\] "
                             r"since ([\d.]+) s$", text, re.M)
            assert line, text
            op, ranks = line.group(1), [int(x) for x in line.group(2).split(",") if x.strip()]
            assert op in ("allreduce", "reduce_scatter", "allgather", "iallgather",
                          "broadcast", "barrier"), text
            assert 2 in ranks and r not in ranks, text
            assert re.search(r"^Step\s*: %d$" % (hold - 1), text, re.M), text
            got = json.loads(scapectl_status(daemons[r], "--json"))
            assert got["wait"]["op"] == op and 2 in got["wait"]["ranks"], got["wait"]
            assert got["wait"]["ranks_known"] is True and got["wait"]["seconds"] >= 0, got
            metrics = scrape_metrics(daemons[r])
            assert re.search(r'^scape_collective_wait_seconds\{rank="%d",op="%s"\} [\d.e+-]+$'
                             % (r, op), metrics, re.M), metrics
            assert re.search(r'^scape_collective_waiting_for\{rank="%d",peer="2"\} 1$' % r,
                             metrics, re.M), metrics
            assert process_stopped(hung.pid), "rank 2's daemon went on during the queries"
        ckpt = subprocess.Popen([binary("client", "scapectl"), "--runtime-dir", daemons[0].rt,
                                 "--timeout-ms", "120000", "checkpoint"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while "a checkpoint request during a collective" not in daemons[0].output():
            assert time.monotonic() < deadline and ckpt.poll() is None, daemons[0].output()
            time.sleep(0.02)
        assert process_stopped(hung.pid)
    finally:
        hung.send_signal(signal.SIGCONT)
        if trainers[2].poll() is None:
            trainers[2].send_signal(signal.SIGCONT)
    o, e = ckpt.communicate(timeout=300)
    assert ckpt.returncode == 1 and "no checkpoint_dir is configured" in e, (o, e)
    for t in trainers:
        o, e = t.communicate(timeout=300)
        assert t.returncode == 0, o + e
    for r, d in enumerate(daemons):
        text = scapectl_status(d)
        assert not re.search(r"^Collective", text, re.M), text
        assert 'scape_collective_wait_seconds{rank="%d"} 0' % r in scrape_metrics(d)
    run_reference(str(tmp_path / "ref"), "1,1,1", n, steps, *ENGINE)
    with open(tmp_path / "ref", "rb") as f:
        ref = f.read()
    assert_bitwise(outs, ref)


def test_shutdown_asked_during_a_hung_wait_stops_the_daemon(daemon_factory, tmp_path):
    """`scapectl shutdown` reaches a daemon whose collective waits for a hung
    peer (comm_timeout_ms two minutes away): it is answered, and the wait
    gives up as on SIGTERM, so the daemon stops cleanly, saying why."""
    coord = free_endpoints(1)[0]
    daemons = [daemon_factory(*ENGINE, "--world", "2", "--rank", str(r), "--coordinator", coord,
                              "--listen", "tcp://127.0.0.1:*", "--job", "36",
                              "--comm-timeout-ms", "120000") for r in range(2)]
    trainers = [run_trainer(d.endpoint, 0, 2000, 6, seed=1 + 1000 * r, wait=False,
                            stop_before=3 if r == 1 else None) for r, d in enumerate(daemons)]
    hung = daemons[1].proc
    try:
        deadline = time.monotonic() + 120
        while not process_stopped(trainers[1].pid):
            assert time.monotonic() < deadline and trainers[1].poll() is None
            time.sleep(0.01)
        hung.send_signal(signal.SIGSTOP)
        for _ in range(2000):
            if "waiting in " in scapectl_status(daemons[0]):
                break
            assert time.monotonic() < deadline, daemons[0].output()
            time.sleep(0.02)
        res = subprocess.run([binary("client", "scapectl"), "--runtime-dir", daemons[0].rt,
                              "shutdown"], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stdout + res.stderr
        # well before comm_timeout_ms: the wait gave up on the stop request
        assert daemons[0].proc.wait(timeout=60) == 0, daemons[0].output()
        assert process_stopped(hung.pid)
    finally:
        hung.send_signal(signal.SIGKILL)
        hung.wait()
        for t in trainers:
            t.send_signal(signal.SIGKILL)
            t.communicate()
    log = daemons[0].output()
    assert "shutdown requested on the status socket" in log, log
    assert "given up: the daemon is shutting down" in log, log
