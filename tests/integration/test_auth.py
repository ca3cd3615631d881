"""Only the job's own daemons get in: the rendezvous under auth munge (a
private munged started here) and auth secret, what they refuse and how they
say so, auth none, and the start-up error when nothing is chosen.

The munged of these tests runs as root with its own key and socket in a
temporary directory, as deploy/slurm-cluster.sh runs the cluster's; another
uid is played by `nobody` through setpriv."""
import os
import shutil
import stat
import subprocess
import tempfile
import time

import pytest
import zmq

import pbwire
from conftest import binary, free_endpoints, job_key, run_reference, run_trainer
from test_multinode import ENGINE, read

N, STEPS = 3000, 30


def have(cmd):
    return shutil.which(cmd) is not None


@pytest.fixture(scope="module")
def munged():
    """A munged of our own: its socket path."""
    if not (have("munged") and have("munge")):
        pytest.skip("munge is not installed (deploy/setup.sh installs it)")
    if os.geteuid() != 0:
        pytest.skip("starting a private munged needs root")
    d = tempfile.mkdtemp(prefix="scape-munge-")
    os.chmod(d, 0o755)  # nobody must reach the socket too
    key, sock, pid = (os.path.join(d, f) for f in ("munge.key", "munge.socket", "munged.pid"))
    with open(key, "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(key, 0o400)
    subprocess.run(["munged", "--force", "--socket", sock, "--key-file", key, "--pid-file", pid,
                    "--log-file", os.path.join(d, "munged.log"), "--seed-file",
                    os.path.join(d, "munged.seed"), "--num-threads", "2"], check=True)
    deadline = time.time() + 10
    while not os.path.exists(sock):
        assert time.time() < deadline, "munged never made its socket"
        time.sleep(0.05)
    yield sock
    try:
        with open(pid) as f:
            os.kill(int(f.read()), 15)
    except (OSError, ValueError):
        pass
    time.sleep(0.2)
    shutil.rmtree(d, ignore_errors=True)


def group_args(coord, r, auth, job="11"):
    return [*ENGINE, "--world", "2", "--rank", str(r), "--coordinator", coord, "--listen",
            "tcp://127.0.0.1:*", "--job", job, "--trainers", "1", "--comm-timeout-ms", "20000",
            *auth]


def train_and_compare(daemons, tmp_path, tag):
    """One trainer per daemon; both end bitwise equal to the reference."""
    procs = [run_trainer(d.endpoint, 0, N, STEPS, out=str(tmp_path / ("%s%d" % (tag, r))),
                         seed=1 + 1000 * r, wait=False) for r, d in enumerate(daemons)]
    for p in procs:
        o, e = p.communicate(timeout=300)
        assert p.returncode == 0, o + e
    ref = tmp_path / (tag + "-ref")
    run_reference(str(ref), "1,1", N, STEPS, *ENGINE)
    for r in range(2):
        assert read(tmp_path / ("%s%d" % (tag, r))) == read(ref), "rank %d differs" % r


def wait_log(d, text, timeout=30):
    deadline = time.time() + timeout
    while text not in d.output():
        assert time.time() < deadline and d.proc.poll() is None, \
            "never logged %r:\n%s" % (text, d.output()[-3000:])
        time.sleep(0.05)


def status(d):
    return pbwire.query_status(d.status_endpoint)[2]


def test_munge_job_and_a_join_from_another_uid(daemon_factory, munged, tmp_path):
    """auth munge: a daemon run as nobody joins in rank 1's place first.
    Rank 0 refuses it, naming its uid, and goes on waiting; the nobody
    daemon stops with rank 0's reason; the real rank 1 joins and the job's
    result is bitwise the reference's."""
    coord = free_endpoints(1)[0]
    auth = ["--auth", "munge", "--munge-socket", munged]
    rank0 = daemon_factory(*group_args(coord, 0, auth))
    rt = tempfile.mkdtemp(prefix="scape-nobody-")
    os.chmod(rt, 0o777)
    try:
        intruder = subprocess.run(
            ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
             binary("daemon", "scaped"), "--runtime-dir", os.path.join(rt, "rt"),
             *group_args(coord, 1, auth)], capture_output=True, text=True, timeout=60)
    finally:
        shutil.rmtree(rt, ignore_errors=True)
    assert intruder.returncode != 0, intruder.stdout + intruder.stderr
    out = intruder.stdout + intruder.stderr
    assert "rank 0 refused rank 1" in out and "uid 65534 (nobody)" in out, out
    wait_log(rank0, "refused a join from")
    log = rank0.output()
    assert "a munge credential of uid 65534 (nobody), not of the job's uid 0" in log, log
    rank1 = daemon_factory(*group_args(coord, 1, auth))
    train_and_compare([rank0, rank1], tmp_path, "munge")
    st = status(rank0)
    assert st[31][0] == b"munge" and st[32][0] == 1, st  # auth, data_encrypted


def forged_join(coord, payload):
    """What rank 0 answers a raw join: (status, message)."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10000)
    s.connect(coord)
    s.send(payload)
    try:
        reply = pbwire.parse(s.recv())
    finally:
        s.close()
        ctx.term()
    err = pbwire.parse(reply[2][0]) if 2 in reply else {}
    return reply[1][0], err.get(2, [b""])[0].decode()


def rdv_join(rank, world, job, endpoint):
    """A well-formed RdvJoin (protocol 2), unsealed."""
    v, ln = pbwire.VARINT, pbwire.LEN
    return (pbwire.field(1, v, 2) + pbwire.field(2, v, job) + pbwire.field(3, v, rank) +
            pbwire.field(4, v, world) + pbwire.field(5, ln, endpoint))


def test_forged_joins_are_refused(daemon_factory, munged, tmp_path):
    """auth munge: joins with the right job id but no credential, a bad one,
    or a sealed one replayed are refused with the reason (and logged); the
    job then meets and runs as if nothing had happened."""
    coord = free_endpoints(1)[0]
    auth = ["--auth", "munge", "--munge-socket", munged]
    rank0 = daemon_factory(*group_args(coord, 0, auth))
    bare = rdv_join(1, 2, 11, "tcp://127.0.0.1:9")
    code, msg = forged_join(coord, bare)
    assert code != 0 and "no munge credential" in msg, msg
    code, msg = forged_join(coord, b"MUNGE:AwQFAAD" + b"x" * 80 + b":")
    assert code != 0 and "does not hold" in msg, msg
    cred = subprocess.run(["munge", "--socket", munged, "--input", "/dev/stdin"], input=bare,
                          capture_output=True, check=True).stdout.strip()
    subprocess.run(["unmunge", "--socket", munged], input=cred, capture_output=True,
                   check=True)  # someone read it off the wire and used it first
    code, msg = forged_join(coord, cred)
    assert code != 0 and "replayed" in msg.lower(), msg
    log = rank0.output()
    assert log.count("refused a join from") >= 3, log
    rank1 = daemon_factory(*group_args(coord, 1, auth))
    train_and_compare([rank0, rank1], tmp_path, "forged")
    # rank 0's status counts the three (StatusReply.rendezvous_refused_joins)
    assert status(rank0).get(55) == [3] and 55 not in status(rank1), (status(rank0).get(55),)


def test_secret_with_the_right_key_and_a_wrong_one(daemon_factory, tmp_path):
    """auth secret: a rank with another key file is refused with the reason
    (and stops saying so); a key file others can read is refused at start;
    with the job's key the job runs, bitwise the reference."""
    coord = free_endpoints(1)[0]
    good = ["--auth", "secret", "--auth-key-file", job_key()]
    rank0 = daemon_factory(*group_args(coord, 0, good))
    other = str(tmp_path / "other.key")
    subprocess.run([binary("daemon", "scaped"), "keygen", other], check=True,
                   capture_output=True)
    assert stat.S_IMODE(os.stat(other).st_mode) == 0o600
    again = subprocess.run([binary("daemon", "scaped"), "keygen", other], capture_output=True,
                           text=True)
    assert again.returncode != 0 and "never overwritten" in again.stderr, again.stderr
    wrong = subprocess.run([binary("daemon", "scaped"), "--runtime-dir", str(tmp_path / "w"),
                            *group_args(coord, 1, ["--auth", "secret", "--auth-key-file",
                                                   other])],
                           capture_output=True, text=True, timeout=60)
    out = wrong.stdout + wrong.stderr
    assert wrong.returncode != 0 and "rank 0 refused rank 1" in out, out
    assert "sealed with another key than this job's auth_key_file" in out, out
    wait_log(rank0, "refused a join from")
    os.chmod(other, 0o644)
    loose = subprocess.run([binary("daemon", "scaped"), "--runtime-dir", str(tmp_path / "l"),
                            *group_args(coord, 1, ["--auth", "secret", "--auth-key-file",
                                                   other])],
                           capture_output=True, text=True, timeout=60)
    assert loose.returncode != 0 and "can be read by others (mode 0644)" in loose.stderr, \
        loose.stderr
    rank1 = daemon_factory(*group_args(coord, 1, good))
    train_and_compare([rank0, rank1], tmp_path, "secret")
    assert status(rank1)[31][0] == b"secret"


def test_auth_none_and_the_start_up_error(daemon_factory, tmp_path):
    """auth none must be asked for, and works as before; with nothing chosen
    and no munged answering, a group daemon does not start and names the
    three choices; one daemon alone needs none of it."""
    coord = free_endpoints(1)[0]
    res = subprocess.run([binary("daemon", "scaped"), "--runtime-dir", str(tmp_path / "a"),
                          *group_args(coord, 0, ["--munge-socket", str(tmp_path / "none")])],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0, res.stderr
    for word in ("auth is auto but no munged answers", "auth: munge", "auth: secret",
                 "auth: none", "scaped keygen"):
        assert word in res.stderr, res.stderr
    daemons = [daemon_factory(*group_args(coord, r, ["--auth", "none"])) for r in range(2)]
    train_and_compare(daemons, tmp_path, "none")
    st = status(daemons[0])
    assert st[31][0] == b"none" and st[32][0] == 0, st
    assert "accept anyone" in daemons[0].output()
    alone = daemon_factory(*ENGINE, "--munge-socket", str(tmp_path / "none"))
    p = run_trainer(alone.endpoint, 0, N, 3, wait=False)
    o, e = p.communicate(timeout=120)
    assert p.returncode == 0, o + e


PROBE = r"""
import sys, zmq
sys.path.insert(0, sys.argv[3])
import pbwire
ctx = zmq.Context()
for kind, ep, req in (("control", sys.argv[1], pbwire.hello(1)),
                      ("status", sys.argv[2], pbwire.status_request())):
    s = ctx.socket(zmq.DEALER if kind == "control" else zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10000)
    s.connect(ep)
    s.send(req)
    r = pbwire.parse(s.recv())
    err = pbwire.parse(r[2][0]) if 2 in r else {}
    print(kind, r[1][0], err.get(2, [b""])[0].decode())
    s.close()
"""


def test_another_user_is_refused_on_the_node_sockets(daemon_factory, tmp_path):
    """The runtime directory opened to everyone by hand: a process of nobody
    reaches the control and status sockets, and the daemon refuses each of
    its messages with the reason (SO_PEERCRED), logs it, and goes on serving
    its own user's trainers."""
    if os.geteuid() != 0:
        pytest.skip("playing another uid needs root")
    d = daemon_factory(*ENGINE)
    os.chmod(d.dir, 0o755)
    os.chmod(d.rt, 0o777)
    for f in ("control", "status"):
        os.chmod(os.path.join(d.rt, f), 0o777)
    # nobody may not read the source tree (a clone in a 0700 directory): the
    # probe takes pbwire from the daemon's directory, opened above
    probe = os.path.join(d.dir, "probe")
    os.mkdir(probe)
    os.chmod(probe, 0o755)
    shutil.copy(pbwire.__file__, probe)
    os.chmod(os.path.join(probe, "pbwire.py"), 0o644)
    res = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                          "/usr/bin/python3", "-c", PROBE, d.endpoint, d.status_endpoint, probe],
                         capture_output=True, text=True, timeout=60, cwd=probe)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 2, res.stdout
    for line, kind in zip(lines, ("control", "status")):
        assert line.startswith(kind + " ") and not line.startswith(kind + " 0"), line
        assert "of uid 65534 (nobody) is not this daemon's user" in line, line
    log = d.output()
    assert "refused a control message" in log and "refused a status message" in log, log
    p = run_trainer(d.endpoint, 0, N, 3, wait=False)
    o, e = p.communicate(timeout=120)
    assert p.returncode == 0, o + e
