"""Groups of 16 and 64 daemons on one machine (host backend over loopback,
auth: secret, so CURVE on every one of the R(R-1) connections), one
trainer_c each, started as a user's shell would start them: with a soft
limit on open files below what a full mesh of that size holds, which the
daemons raise themselves (within the hard limit), and, where the hard limit
is too low too, a start-up error that names the limit needed."""
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

from conftest import binary, free_endpoints, job_key, run_reference
from test_auth import munged  # noqa: F401  (the fixture: a private munged)
from test_multinode import ENGINE, read

N = 3000


def files_limit(soft, hard=None):
    """preexec_fn: the child's limit on open files at soft (and hard)."""
    def set_it():
        h = resource.getrlimit(resource.RLIMIT_NOFILE)[1] if hard is None else hard
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, h), h))
    return set_it


class Group:
    """R scaped processes, each in its own runtime directory, and their
    trainers; close() kills whatever is left and removes the directories."""

    def __init__(self):
        self.daemons, self.trainers, self.dirs, self.logs = [], [], [], []

    def start(self, ranks, mode, soft, auth):
        coord = free_endpoints(1)[0]
        for r in range(ranks):
            d = tempfile.mkdtemp(prefix="scape-sc-")  # ipc paths stay short
            self.dirs.append(d)
            log = open(os.path.join(d, "scaped.log"), "w")
            self.logs.append(log)
            self.daemons.append(subprocess.Popen(
                [binary("daemon", "scaped"), "--runtime-dir", os.path.join(d, "rt"), *ENGINE,
                 "--mode", mode, "--world", str(ranks), "--rank", str(r), "--coordinator", coord,
                 "--listen", "tcp://127.0.0.1:*", "--job", "17", "--trainers", "1",
                 "--comm-timeout-ms", "60000", *auth],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=files_limit(soft)))

    def rt(self, r):
        return os.path.join(self.dirs[r], "rt")

    def log(self, r):
        self.logs[r].flush()
        with open(self.logs[r].name) as f:
            return f.read()

    def train(self, steps, tag, tmp_path):
        """One trainer per daemon; each one's final parameters."""
        outs = [str(tmp_path / ("%s-%d" % (tag, r))) for r in range(len(self.daemons))]
        for r in range(len(self.daemons)):
            self.trainers.append(subprocess.Popen(
                [binary("tests", "integration", "trainer_c"), "--endpoint",
                 "ipc://%s/control" % self.rt(r), "--index", "0", "--n", str(N), "--steps",
                 str(steps), "--seed", str(1 + 1000 * r), "--start-wait-ms", "60000",
                 "--out", outs[r]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        deadline = time.time() + 300
        for r, t in enumerate(self.trainers):
            o, e = t.communicate(timeout=max(1.0, deadline - time.time()))
            assert t.returncode == 0, "rank %d: %s%s\n%s" % (r, o, e, self.log(r)[-3000:])
        self.trainers = []
        return [read(o) for o in outs]

    def status(self, r):
        res = subprocess.run([binary("client", "scapectl"), "--runtime-dir", self.rt(r),
                              "status", "--json"], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
        return json.loads(res.stdout)

    def stop(self):
        """SIGTERM to all first (each waits for the others to leave), then
        each one's exit status."""
        for d in self.daemons:
            d.send_signal(signal.SIGTERM)
        return [d.wait(120) for d in self.daemons]

    def close(self):
        for p in self.trainers + self.daemons:
            if p.poll() is None:
                p.kill()
        for p in self.trainers + self.daemons:
            p.wait()
        for log in self.logs:
            log.close()
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.__init__()


@pytest.fixture
def group():
    g = Group()
    yield g
    g.close()


def open_files(pid):
    """(open files, soft limit on them) of pid, from /proc."""
    with open("/proc/%d/limits" % pid) as f:
        soft = next(int(line.split()[3]) for line in f if line.startswith("Max open files"))
    return len(os.listdir("/proc/%d/fd" % pid)), soft


def check_mesh(g, ranks, soft, auth):
    """Every daemon reaches every other one, refused no handshake, holds
    more open files than the limit it was started with allowed for a full
    mesh's sockets alone, and runs under a limit it raised above them."""
    for r in range(ranks):
        js = g.status(r)
        assert (js["peers_connected"], js["peers_down"]) == (ranks - 1, []), (r, js)
        assert js["auth"] == auth and js["data_encrypted"] is True, js
        assert js["refused_handshakes"] == 0, js
        held, limit = open_files(g.daemons[r].pid)
        assert held < limit and limit > soft, (r, held, limit, soft)
        assert held >= 2 * (ranks - 1), (r, held)  # a connection to and from each peer


def test_sixteen_daemons_match_the_local_backend(group, tmp_path):
    """R = 16, sharded, rho 0.01, started under a soft limit of 64 open files
    (a full mesh of 16 holds more): bitwise the local backend's result."""
    ranks, steps, soft = 16, 30, 64
    group.start(ranks, "sharded", soft, ["--auth", "secret", "--auth-key-file", job_key()])
    got = group.train(steps, "r16", tmp_path)
    check_mesh(group, ranks, soft, "secret")
    assert group.stop() == [0] * ranks
    ref = str(tmp_path / "ref")
    run_reference(ref, ",".join(["1"] * ranks), N, steps, *ENGINE, "--mode", "sharded")
    for r, x in enumerate(got):
        assert x == read(ref), "rank %d differs from the local backend" % r


def test_sixteen_daemons_under_munge(group, munged, tmp_path):  # noqa: F811
    """The same group under auth munge: 15 joins and 15 tables each sealed
    by munged; the result is bitwise the local backend's."""
    ranks, steps = 16, 10
    group.start(ranks, "sharded", 1024, ["--auth", "munge", "--munge-socket", munged])
    got = group.train(steps, "munge", tmp_path)
    check_mesh(group, ranks, 0, "munge")
    assert group.stop() == [0] * ranks
    ref = str(tmp_path / "ref")
    run_reference(ref, ",".join(["1"] * ranks), N, steps, *ENGINE, "--mode", "sharded")
    assert all(x == read(ref) for x in got), "the daemons differ from the local backend"


def test_sixty_four_daemons(group, tmp_path):
    """R = 64 for a few steps under a soft limit of 256 open files, in both
    modes: every trainer ends with the same parameters, and the two modes
    (reduce-scatter and all-gather, or one all-reduce) bitwise agree, and
    equal the local backend's 64 ranks."""
    ranks, steps, soft = 64, 6, 256
    got = {}
    for mode in ("sharded", "replicated"):
        group.start(ranks, mode, soft, ["--auth", "secret", "--auth-key-file", job_key()])
        got[mode] = group.train(steps, mode, tmp_path)
        assert all(x == got[mode][0] for x in got[mode]), "the trainers disagree (%s)" % mode
        check_mesh(group, ranks, soft, "secret")
        assert group.stop() == [0] * ranks
        group.close()
    assert got["sharded"][0] == got["replicated"][0]
    ref = str(tmp_path / "ref")
    run_reference(ref, ",".join(["1"] * ranks), N, steps, *ENGINE, "--mode", "sharded")
    assert got["sharded"][0] == read(ref), "the daemons differ from the local backend"


def test_a_hard_limit_too_low_is_named():
    """A daemon of 64 whose hard limit on open files is below a full mesh's
    needs stops at start-up, before the rendezvous, naming what it needs and
    how to raise it."""
    d = tempfile.mkdtemp(prefix="scape-sc-")
    try:
        res = subprocess.run(
            [binary("daemon", "scaped"), "--runtime-dir", os.path.join(d, "rt"), *ENGINE,
             "--world", "64", "--rank", "3", "--coordinator", free_endpoints(1)[0], "--listen",
             "tcp://127.0.0.1:*", "--job", "17", "--auth", "secret", "--auth-key-file",
             job_key()], capture_output=True, text=True, timeout=60,
            preexec_fn=files_limit(100, 100))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    m = re.search(r"a group of 64 daemons needs about (\d+) open files per daemon.*the limit "
                  r"is 100 \(hard 100\).*ulimit -n (\d+)", out)
    assert m and m.group(1) == m.group(2), out
    assert int(m.group(1)) >= 2 * 63, out  # at least a connection to and from each peer
