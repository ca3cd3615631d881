"""Fixtures for the integration tests: the real scaped binary started in a
private runtime directory, and helpers to run trainers and the reference."""
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest
import zmq

import pbwire

BUILD = os.environ.get("SCAPE_BUILD_DIR")
SOURCE = os.environ.get("SCAPE_SOURCE_DIR",
                        os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))


def binary(*parts):
    if not BUILD:
        pytest.fail("SCAPE_BUILD_DIR is not set (run through ctest)")
    path = os.path.join(BUILD, *parts)
    if not os.path.exists(path):
        pytest.fail("missing build output %s" % path)
    return path


_KEY = {}


def job_key():
    """One key for auth: secret, written by `scaped keygen` once per test
    process: every multi-daemon group of the tests authenticates its
    rendezvous with it and runs CURVE on its data plane, as a real job
    does (auth: munge has its own tests, with a munged they start)."""
    if "path" not in _KEY:
        d = tempfile.mkdtemp(prefix="scape-key-")
        path = os.path.join(d, "job.key")
        subprocess.run([binary("daemon", "scaped"), "keygen", path], check=True,
                       capture_output=True)
        _KEY["path"] = path
    return _KEY["path"]


def with_auth(args):
    """args, plus auth: secret with the tests' key when they start one daemon
    of several and choose no auth themselves."""
    args = list(args)
    world = args[args.index("--world") + 1] if "--world" in args else "1"
    if world != "1" and "--auth" not in args:
        args += ["--auth", "secret", "--auth-key-file", job_key()]
    return args


class Daemon:
    def __init__(self, args=(), netns=None):
        args = with_auth(args)
        # ipc:// paths must stay short (108 bytes), so not under tmp_path.
        self.dir = tempfile.mkdtemp(prefix="scape-it-")
        self.rt = os.path.join(self.dir, "rt")
        self.log_path = os.path.join(self.dir, "scaped.log")
        self.log = open(self.log_path, "w")
        # on a test host (network namespace): `ip netns exec` execs in place,
        # so the process is scaped itself
        prefix = ["ip", "netns", "exec", netns] if netns else []
        self.proc = subprocess.Popen(
            prefix + [binary("daemon", "scaped"), "--runtime-dir", self.rt, *args],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.endpoint = "ipc://%s/control" % self.rt
        self.status_endpoint = "ipc://%s/status" % self.rt
        deadline = time.time() + 15
        while not os.path.exists(os.path.join(self.rt, "control")):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("scaped did not start:\n" + self.output())
            time.sleep(0.02)

    def trainers(self):
        """Each attached trainer's TrainerInfo fields {1: index, 3: pid, 4: last
        step}, from the status socket."""
        status, msg, st, _ = pbwire.query_status(self.status_endpoint)
        assert status == 0, msg
        return [{k: v[0] for k, v in pbwire.parse(raw).items()} for raw in st.get(10, [])]

    def kill_mid_step(self, waiting_pid, stopped, step, noticed=True):
        """Kill `stopped` (a trainer run with stop_before=step) once it has
        stopped before posting step and the trainer of waiting_pid has posted
        it: a death in the middle of the step, for certain, however loaded the
        machine.  Returns once the daemon has let the dead trainer go (with
        noticed=False at once, before the daemon may have looked)."""
        deadline = time.time() + 60
        while not (process_stopped(stopped.pid) and
                   any(ti[3] == waiting_pid and ti[4] == step for ti in self.trainers())):
            assert time.time() < deadline, "step %d: never posted by one and not the other" % step
            assert stopped.poll() is None, "the trainer to kill ended early"
            time.sleep(0.01)
        stopped.send_signal(signal.SIGKILL)
        stopped.wait()
        while noticed and any(ti[3] == stopped.pid for ti in self.trainers()):
            assert time.time() < deadline, "the daemon never noticed the death"
            time.sleep(0.01)

    def output(self):
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout=45):
        # a daemon of several waits up to comm_timeout_ms (the tests' groups
        # use 20 s) for the others to leave too, when one may still be asked
        # for a state_dict: stopping is bounded by that, not by an instant
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def close(self):
        try:
            self.stop()
        finally:
            self.log.close()
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def daemon_factory():
    started = []

    def make(*args, netns=None):
        d = Daemon(args, netns)
        started.append(d)
        return d

    yield make
    for d in started:
        d.close()


def run_trainer(endpoint, index, n, steps, out=None, sleep_ms=0, seed=1, lr=1e-2, wait=True,
                stop_before=None):
    cmd = [binary("tests", "integration", "trainer_c"), "--endpoint", endpoint,
           "--index", str(index), "--n", str(n), "--steps", str(steps), "--seed", str(seed),
           "--lr", repr(lr), "--sleep-ms", str(sleep_ms)]
    if stop_before is not None:
        cmd += ["--stop-before", str(stop_before)]
    if out:
        cmd += ["--out", out]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if wait:
        o, e = proc.communicate(timeout=600)
        assert proc.returncode == 0, "trainer %d failed:\n%s\n%s" % (index, o, e)
    return proc


def process_stopped(pid):
    """Whether pid is stopped (SIGSTOP; its delivery is asynchronous)."""
    with open("/proc/%d/stat" % pid) as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def run_reference(out, trainers, n, steps, *engine_args, seed=1, lr=1e-2):
    """trainers: an int (one rank) or "2,1,3" (trainers per rank)."""
    cmd = [binary("tests", "integration", "reference"), "--trainers", str(trainers),
           "--n", str(n), "--steps", str(steps), "--seed", str(seed), "--lr", repr(lr),
           "--out", out, *engine_args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def synth_layout(n):
    """The layout of tests/integration/synth.h, as (name, offset, length)."""
    shares = [0.40, 0.25, 0.15, 0.10, 0.05, 0.03]
    out, pos = [], 0
    for i, s in enumerate(shares):
        length = int(s * n) | 1
        out.append(("w%d" % i, pos, length))
        pos += length
    out.append(("bias", pos, 1))
    return out


def free_endpoints(count):
    """count distinct tcp://127.0.0.1:PORT endpoints that were free a moment
    ago, from below the kernel's ephemeral range: the ports it picks for a
    '*' bind (every data plane here binds one) are never among them.  (Taken
    from that range, the coordinator port of one test was once given to rank
    0's own data plane, bound first, and its rendezvous could not bind.)"""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    rng = random.SystemRandom()
    ports = set()
    while len(ports) < count:
        port = rng.randrange(10000, max(low, 10001 + count))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.add(port)
    return ["tcp://127.0.0.1:%d" % p for p in sorted(ports)]


HOSTS_SH = os.path.join(SOURCE, "deploy", "hosts.sh")


class Hosts:
    """Test hosts made by deploy/hosts.sh: network namespaces NAME-h0.., at
    10.231.0.(i+1), joined by a switch; links can be cut and rate-limited."""

    def __init__(self, name, count):
        self.name, self.count = name, count
        self.addr = ["10.231.0.%d" % (i + 1) for i in range(count)]
        self.ns = ["%s-h%d" % (name, i) for i in range(count)]

    def sh(self, *args):
        r = subprocess.run(["bash", HOSTS_SH, *args, "--name", self.name],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    def cut(self, i):
        self.sh("cut", str(i))

    def restore(self, i):
        self.sh("restore", str(i))

    def rate(self, i, rate):
        self.sh("rate", str(i), rate)

    def counters(self, i):
        """(tx bytes, tx packets, rx bytes, rx packets) of host i's eth0."""
        import json
        r = subprocess.run(["ip", "-n", self.ns[i], "-s", "-j", "link", "show", "eth0"],
                           capture_output=True, text=True, check=True, timeout=30)
        st = json.loads(r.stdout)[0]["stats64"]
        return st["tx"]["bytes"], st["tx"]["packets"], st["rx"]["bytes"], st["rx"]["packets"]


def hosts_unavailable():
    """Why test hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "test hosts need iproute2 (ip, tc)"
    probe = "scape-probe-%d" % os.getpid()
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return "no network namespaces here: " + r.stderr.strip()
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.fixture
def hosts_factory():
    """make(count, rate="none"): a fresh group of test hosts, removed after
    the test; skips the test, saying why, where they cannot be made."""
    why = hosts_unavailable()
    if why:
        pytest.skip(why)
    made = []

    def make(count, rate="none"):
        h = Hosts("scit%d-%d" % (os.getpid() % 100000, len(made)), count)
        made.append(h)
        h.sh("up", str(count), "--rate", rate)
        return h

    yield make
    for h in made:
        h.sh("down")


def torch2_python():
    """The interpreter of the torch 2.x virtual environment named by
    $SCAPE_TORCH2_VENV (the ctest entries integration_torch2 and
    integration_lightning set it; deploy/torch2-venv.sh makes it); skips the
    test, saying why, when it is not set or holds no interpreter."""
    venv = os.environ.get("SCAPE_TORCH2_VENV", "")
    if not venv:
        pytest.skip("SCAPE_TORCH2_VENV is not set: the ctest entries integration_torch2 and "
                    "integration_lightning run this in the torch 2.x virtual environment")
    py = os.path.join(venv, "bin", "python")
    if not os.access(py, os.X_OK):
        pytest.skip("no torch 2.x virtual environment at %s (make it with "
                    "deploy/torch2-venv.sh %s; about 3 GB from PyPI)" % (venv, venv))
    return py
