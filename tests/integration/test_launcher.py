"""scape-run (python -m scape.run) with real daemons and trainers: a node of
two trainers that ends equal to the in-process engine, a failing trainer
that stops the rest and is named, a forwarded SIGTERM, and two nodes on
this machine meeting through --master-addr/--master-port."""
import os
import re
import signal
import subprocess
import sys
import time

from conftest import SOURCE, free_endpoints, job_key, run_reference

PY_TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "py_trainer.py")
ENGINE = ["--set", "rho=0.01", "--set", "warmup=3"]
REF_ENGINE = ["--rho", "0.01", "--warmup", "3"]


def launch(args, trainer, env=None):
    """scape-run with args; trainer is a shell command line run per process."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.path.join(SOURCE, "client", "python") + os.pathsep + \
        e.get("PYTHONPATH", "")
    e.update(env or {})
    cmd = [sys.executable, "-m", "scape.run", *args, "--", "sh", "-c", trainer]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=e)


def py(n, steps, out, seed="1", extra=""):
    return ("exec %s %s --n %d --steps %d --seed %s --out %s %s"
            % (sys.executable, PY_TRAINER, n, steps, seed, out, extra))


def runtime_dir_of(err):
    m = re.search(r"runtime directory (\S+)\)", err)
    assert m, err
    return m.group(1)


def scaped_gone(err):
    """The launcher's daemon exited: its pid (from the log) is not running."""
    m = re.search(r"scaped pid (\d+) is up", err)
    assert m, err
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return True
    with open("/proc/%s/stat" % m.group(1)) as f:
        return f.read().split()[2] == "Z"


def test_a_node_of_two_trainers_matches_the_engine(tmp_path):
    n, steps = 4000, 40
    p = launch(["--nproc-per-node", "2", *ENGINE],
               py(n, steps, str(tmp_path / "t$LOCAL_RANK")))
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, out + err
    assert "2 trainer(s) done" in err and "[scaped]" in err, err
    run_reference(str(tmp_path / "ref"), 2, n, steps, *REF_ENGINE)
    ref = (tmp_path / "ref").read_bytes()
    for i in range(2):
        assert (tmp_path / ("t%d" % i)).read_bytes() == ref, "trainer %d differs" % i
    assert not os.path.exists(runtime_dir_of(err)), "the runtime directory was left behind"
    assert scaped_gone(err)


def test_a_failing_trainer_stops_the_rest_and_is_named(tmp_path):
    """Trainer 1 exits 3 at once; trainer 0 waits for it at the job start.
    The launcher stops trainer 0 and scaped and exits with 3."""
    t0 = time.monotonic()
    trainer = ('if [ "$LOCAL_RANK" = 1 ]; then sleep 0.3; exit 3; fi; '
               + py(2000, 10 ** 6, str(tmp_path / "t0"), extra="--sleep-ms 10"))
    p = launch(["--nproc-per-node", "2", "--grace", "5", *ENGINE], trainer)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 3, out + err
    assert re.search(r"trainer 1 \(pid \d+\) failed: exit status 3; stopping the other", err), err
    assert time.monotonic() - t0 < 60
    assert scaped_gone(err)
    assert not os.path.exists(runtime_dir_of(err))


def test_sigterm_reaches_the_trainers(tmp_path):
    marker = tmp_path / "got-term"
    trainer = ("trap 'touch %s.$LOCAL_RANK; kill $c; wait $c; exit 143' TERM; "
               "%s %s --n 2000 --steps 1000000 --sleep-ms 5 & c=$!; wait $c" %
               (marker, sys.executable, PY_TRAINER))
    p = launch(["--nproc-per-node", "2", *ENGINE], trainer)
    deadline = time.monotonic() + 60
    err_lines = []
    while True:  # until the trainers run
        line = p.stderr.readline()
        assert line, "scape-run ended early:\n" + "".join(err_lines)
        err_lines.append(line)
        if "starting 2 trainer(s)" in line:
            break
        assert time.monotonic() < deadline
    time.sleep(1.0)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    err = "".join(err_lines) + err
    assert p.returncode == 128 + signal.SIGTERM, out + err
    assert "SIGTERM: passing it to the trainers" in err, err
    for i in range(2):
        assert os.path.exists("%s.%d" % (marker, i)), "trainer %d never got SIGTERM" % i
    assert scaped_gone(err)


def test_two_nodes_meet_at_the_master(tmp_path):
    """Two nodes with a shared key (auth: secret, as a user without munge
    would run them), bitwise the reference."""
    n, steps = 3000, 30
    port = int(free_endpoints(1)[0].rsplit(":", 1)[1])
    auth = ["--set", "auth=secret", "--set", "auth_key_file=" + job_key()]
    nodes = [launch(["--nnodes", "2", "--node-rank", str(r), "--master-addr", "127.0.0.1",
                     "--master-port", str(port), *ENGINE, *auth],
                    py(n, steps, str(tmp_path / ("r%d" % r)), seed=str(1 + 1000 * r)))
             for r in range(2)]
    for r, p in enumerate(nodes):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, "node %d:\n%s%s" % (r, out, err)
    run_reference(str(tmp_path / "ref"), "1,1", n, steps, *REF_ENGINE)
    ref = (tmp_path / "ref").read_bytes()
    for r in range(2):
        assert (tmp_path / ("r%d" % r)).read_bytes() == ref, "node %d differs" % r


def test_usage_errors():
    for args, msg in ((["--nnodes", "2", "--", "true"], "needs --master-addr"),
                      (["--nproc-per-node", "0", "--", "true"], "1..64"),
                      ([], "no trainer command")):
        e = dict(os.environ, PYTHONPATH=os.path.join(SOURCE, "client", "python"))
        e.pop("MASTER_ADDR", None)
        r = subprocess.run([sys.executable, "-m", "scape.run", *args], capture_output=True,
                           text=True, env=e, timeout=60)
        assert r.returncode == 2 and msg in r.stderr, r.stderr
