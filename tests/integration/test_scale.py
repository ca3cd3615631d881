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

    def start(self, ranks, mode, soft, auth, timeout_ms=60000, which=None, coord=None):
        """Daemons `which` (all: None) of a group of `ranks`."""
        coord = coord or free_endpoints(1)[0]
        self.coord = coord
        for r in range(ranks) if which is None else which:
            d = tempfile.mkdtemp(prefix="scape-sc-")  # ipc paths stay short
            self.dirs.append(d)
            log = open(os.path.join(d, "scaped.log"), "w")
            self.logs.append(log)
            self.daemons.append(subprocess.Popen(
                [binary("daemon", "scaped"), "--runtime-dir", os.path.join(d, "rt"), *ENGINE,
                 "--mode", mode, "--world", str(ranks), "--rank", str(r), "--coordinator", coord,
                 "--listen", "tcp://127.0.0.1:*", "--job", "17", "--trainers", "1",
                 "--comm-timeout-ms", str(timeout_ms), *auth],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=files_limit(soft)))

    def rt(self, r):
        return os.path.join(self.dirs[r], "rt")

    def log(self, r):
        self.logs[r].flush()
        with open(self.logs[r].name) as f:
            return f.read()

    def start_trainers(self, steps, outs):
        """One trainer_c per daemon, writing its final parameters to outs[r]."""
        for r in range(len(self.daemons)):
            self.trainers.append(subprocess.Popen(
                [binary("tests", "integration", "trainer_c"), "--endpoint",
                 "ipc://%s/control" % self.rt(r), "--index", "0", "--n", str(N), "--steps",
                 str(steps), "--seed", str(1 + 1000 * r), "--start-wait-ms", "60000",
                 "--out", outs[r]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))

    def train(self, steps, tag, tmp_path):
        """One trainer per daemon; each one's final parameters."""
        outs = [str(tmp_path / ("%s-%d" % (tag, r))) for r in range(len(self.daemons))]
        self.start_trainers(steps, outs)
        deadline = time.time() + 300
        for r, t in enumerate(self.trainers):
            o, e = t.communicate(timeout=max(1.0, deadline - time.time()))
            assert t.returncode == 0, "rank %d: %s%s\n%s" % (r, o, e, self.log(r)[-3000:])
        self.trainers = []
        return [read(o) for o in outs]

    def status(self, r, starting=False):
        """Rank r's status (--json); starting: None while the daemon has
        not opened its status socket yet, rather than failing."""
        res = subprocess.run([binary("client", "scapectl"), "--runtime-dir", self.rt(r),
                              "status", "--json"], capture_output=True, text=True, timeout=60)
        if starting and res.returncode != 0 and self.daemons[r].poll() is None:
            return None
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


def first_error(log):
    """The first ERROR line of a daemon's log, or ''."""
    return next((ln for ln in log.splitlines() if " ERROR " in ln), "")


def test_a_stopped_rank_of_sixteen_fails_the_job_cleanly(group, tmp_path):
    """R = 16, comm_timeout_ms 5000: rank 5's daemon stopped (SIGSTOP: hung,
    its connections open, so only comm_timeout_ms can tell) in the middle of
    the steps.  Every other trainer fails with an error that says which rank
    sent nothing for 5000 ms, each daemon logs the same and says it is
    broken, and each one then stops at SIGTERM with status 0 (the job is
    broken, not the daemon).
    Ranks that waited on rank 5 itself name it; see the end of the test for
    those that waited on a rank that waited on it."""
    ranks, victim, timeout_ms = 16, 5, 5000
    group.start(ranks, "sharded", 1024, ["--auth", "secret", "--auth-key-file", job_key()],
                timeout_ms=timeout_ms)
    group.start_trainers(100000, [str(tmp_path / ("o%d" % r)) for r in range(ranks)])
    deadline = time.time() + 120
    while (group.status(0, starting=True) or {"step": 0})["step"] < 3:
        assert time.time() < deadline and group.trainers[0].poll() is None, group.log(0)
        time.sleep(0.1)
    group.daemons[victim].send_signal(signal.SIGSTOP)
    try:
        named = {}
        for r, t in enumerate(group.trainers):
            if r == victim:
                continue
            out, err = t.communicate(timeout=120)
            m = re.search(r"rank (\d+) sent nothing for %d ms during (\w+)" % timeout_ms, err)
            assert t.returncode != 0 and m, "trainer %d: %s%s" % (r, out, err)
            named[r] = int(m.group(1))
            assert m.group(0) in first_error(group.log(r)), (r, group.log(r)[-2000:])
            assert group.status(r)["state"] == "broken", r
        for r, d in enumerate(group.daemons):
            if r != victim:
                d.send_signal(signal.SIGTERM)
        for r, d in enumerate(group.daemons):
            if r != victim:
                assert d.wait(120) == 0, group.log(r)[-2000:]
    finally:
        group.daemons[victim].send_signal(signal.SIGKILL)
        group.daemons[victim].send_signal(signal.SIGCONT)
    # every rank names the stopped one: those that waited on it from their
    # own wait, those that waited on a rank stuck behind it (a rank that never
    # sent its part) from that rank's report
    assert named == {r: victim for r in range(ranks) if r != victim}, named


# A stranger at rank 0's rendezvous (flooder.py), run as python3 -c so
# that a user such as nobody needs no file it can read.
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "flooder.py")) as _f:
    FLOODER = _f.read()


def test_a_flood_of_bogus_joins_is_refused_counted_and_logged_sparingly(group, tmp_path):
    """R = 16, auth secret: while ranks 0 to 14 wait in the rendezvous, two
    strangers running as nobody flood rank 0 with joins of random bytes, and
    a scaped with another key claims rank 3.  Only once rank 0 has logged a
    summary of the flood does rank 15 start: the job then starts and trains,
    every refused join is counted once (at least those the strangers saw
    refused, at most those they sent), and rank 0's log holds 5 refusals one
    by one and the rest only as summary lines, whose counts add up."""
    if os.geteuid() != 0:
        pytest.skip("running the strangers as nobody needs root")
    ranks = 16
    auth = ["--auth", "secret", "--auth-key-file", job_key()]
    group.start(ranks, "sharded", 1024, auth, which=range(ranks - 1))
    strangers = [subprocess.Popen(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "/usr/bin/python3",
         "-c", FLOODER, group.coord, "100000", "60"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd="/") for _ in range(2)]
    try:
        other_key = str(tmp_path / "other.key")
        subprocess.run([binary("daemon", "scaped"), "keygen", other_key], check=True,
                       capture_output=True)
        impostor = subprocess.run(
            [binary("daemon", "scaped"), "--runtime-dir", str(tmp_path / "imp"), *ENGINE,
             "--world", str(ranks), "--rank", "3", "--coordinator", group.coord, "--listen",
             "tcp://127.0.0.1:*", "--job", "17", "--auth", "secret", "--auth-key-file",
             other_key], capture_output=True, text=True, timeout=120)
        out = impostor.stdout + impostor.stderr
        assert impostor.returncode != 0 and "rank 0 refused rank 3" in out, out
        assert "sealed with another key" in out, out
        deadline = time.time() + 60
        while "more joins in the last" not in group.log(0):
            assert time.time() < deadline, group.log(0)[-3000:]
            assert all(p.poll() is None for p in strangers), [p.communicate() for p in strangers]
            time.sleep(0.2)
        group.start(ranks, "sharded", 1024, auth, which=[ranks - 1], coord=group.coord)
        got = group.train(3, "flood", tmp_path)
        assert all(x == got[0] for x in got), "the trainers disagree"
        counts = []
        for p in strangers:
            o, e = p.communicate(timeout=120)
            assert p.returncode == 0, o + e
            counts.append([int(x) for x in o.split()])
    finally:
        for p in strangers:
            if p.poll() is None:
                p.kill()
                p.wait()
    sent, answered = sum(c[0] for c in counts), sum(c[1] for c in counts)
    log = group.log(0)
    (total,) = [int(x) for x in re.findall(r"rendezvous: refused (\d+) joins in all", log)]
    assert answered + 1 <= total <= sent + 1, (sent, answered, total)
    one_by_one = re.findall(r"refused a join from (\S+): (.*); still waiting", log)
    assert len(one_by_one) == 5, one_by_one
    summaries = [int(x) for x in re.findall(r"refused (\d+) more joins in the last", log)]
    assert summaries and 5 + sum(summaries) == total, (summaries, total)
    assert group.stop() == [0] * ranks
