"""scape-run (python -m scape.run) with real daemons and trainers: a node of
two trainers that ends equal to the in-process engine, a failing trainer
that stops the rest and is named, a forwarded SIGTERM, two nodes on this
machine meeting through --master-addr/--master-port, two nodes of an srun
step (each trainer's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
NODE_RANK from Slurm's variables), and a Ctrl-C that lets the trainer's
shutdown save finish."""
import os
import re
import signal
import subprocess
import sys
import textwrap
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


LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "SCAPE_INDEX",
               "MASTER_ADDR", "MASTER_PORT")


def srun_env(procid, nodes, job):
    """What srun puts in the environment of task procid of a step with one
    task per node (srun -N nodes --ntasks-per-node=1), as Slurm 22+ names
    it.  Setting these is how srun itself talks to its tasks; the real
    srun case runs in tests/slurm/template.sh on the local Slurm cluster."""
    return {"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid),
            "SLURM_NODEID": str(procid), "SLURM_LOCALID": "0", "SLURM_NTASKS": str(nodes),
            "SLURM_STEP_NUM_TASKS": str(nodes), "SLURM_NNODES": str(nodes),
            "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "localhost",
            "SLURM_STEP_NODELIST": "localhost"}


def test_srun_steps_give_each_trainer_its_rank(tmp_path):
    """Two scape-runs as the two tasks of `srun -N 2 --ntasks-per-node=1`,
    two trainers each: the daemons take rank and world from SLURM_PROCID and
    SLURM_NTASKS (their rendezvous moved to loopback by --set, which wins
    over Slurm's defaults), and the four trainers get RANK 0..3 in node
    order, WORLD_SIZE 4, their node's NODE_RANK, and no MASTER_ADDR."""
    port = int(free_endpoints(1)[0].rsplit(":", 1)[1])
    rdv = ["--set", "coordinator=tcp://127.0.0.1:%d" % port, "--set", "listen=tcp://127.0.0.1:*",
           "--set", "auth=secret", "--set", "auth_key_file=" + job_key()]
    dump = "env | grep -E '^(%s)=' | sort > %s/env.$$" % ("|".join(LAUNCH_VARS), tmp_path)
    nodes = [launch(["--nproc-per-node", "2", *ENGINE, *rdv], dump,
                    env=dict(srun_env(r, 2, 4242), MASTER_ADDR="10.0.0.9", MASTER_PORT="1"))
             for r in range(2)]
    errs = []
    for r, p in enumerate(nodes):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, "node %d:\n%s%s" % (r, out, err)
        errs.append(err)
    for r in range(2):
        assert re.search(r"rendezvous: rank %d of 2\b" % r, errs[r]), errs[r]
    seen = []
    for f in tmp_path.glob("env.*"):
        seen.append(dict(line.split("=", 1) for line in f.read_text().split()))
    seen.sort(key=lambda e: int(e["RANK"]))
    assert len(seen) == 4, seen
    for rank, e in enumerate(seen):
        node, local = divmod(rank, 2)
        assert e == {"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(local),
                     "LOCAL_WORLD_SIZE": "2", "NODE_RANK": str(node),
                     "SCAPE_INDEX": str(local)}, e


def test_srun_steps_of_another_shape_are_refused():
    e = dict(os.environ, PYTHONPATH=os.path.join(SOURCE, "client", "python"))
    cases = ((dict(srun_env(0, 2, 1), SLURM_NTASKS="4", SLURM_STEP_NUM_TASKS="4"),
              "SLURM_STEP_NUM_TASKS=4 tasks on SLURM_STEP_NUM_NODES=2 nodes"),
             ({k: v for k, v in srun_env(0, 2, 1).items() if "STEP" not in k},
              "batch script of a 2-node job"))
    for env, msg in cases:
        r = subprocess.run([sys.executable, "-m", "scape.run", "--", "true"],
                           capture_output=True, text=True, env=dict(e, **env), timeout=60)
        assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_a_one_node_batch_script_runs(tmp_path):
    """scape-run in the batch script of a one-node job (as sbatch sets its
    variables: SLURM_PROCID 0, no SLURM_STEP_ID, no SLURM_NTASKS without
    --ntasks): one node of its own, whose daemon answers and whose trainer
    is rank 0 of 1."""
    env = {k: v for k, v in srun_env(0, 1, 77).items()
           if "STEP" not in k and k != "SLURM_NTASKS"}
    p = launch(["--nproc-per-node", "1", *ENGINE],
               "echo RANK=$RANK WORLD_SIZE=$WORLD_SIZE NODE_RANK=$NODE_RANK", env=env)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, out + err
    assert "RANK=0 WORLD_SIZE=1 NODE_RANK=0" in out, out + err


CTRL_C_TRAINER = textwrap.dedent("""
    import os, sys, time
    import torch
    import scape.torch
    model = torch.nn.Linear(16, 4)
    opt = scape.torch.ScapeOptimizer(model.parameters(), lr=0.01)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    try:
        for t in range(1, 10 ** 6):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            with open(sys.argv[1] + ".steps", "w") as f:
                f.write(str(t))
            time.sleep(0.02)
    except KeyboardInterrupt:
        sd = opt.state_dict()  # the daemon must still be there to write it
        torch.save({"model": model.state_dict(), "optimizer": sd}, sys.argv[1])
        print("saved at step", sd["step"], flush=True)
    opt.detach()
""")


def test_ctrl_c_lets_the_shutdown_save_finish(tmp_path):
    """SIGINT to scape-run's whole process group, as a terminal's Ctrl-C
    sends it to its foreground job (scape-run and the trainers): the
    trainer's KeyboardInterrupt handler asks the daemon for the state_dict,
    whose checkpoint must then be on disk, and scape-run exits 130.  The
    daemon, in a session of its own, gets no SIGINT and stops afterwards."""
    script = tmp_path / "trainer.py"
    script.write_text(CTRL_C_TRAINER)
    saved, ckpt = tmp_path / "saved.pt", tmp_path / "ckpt"
    e = dict(os.environ)
    e["PYTHONPATH"] = os.path.join(SOURCE, "client", "python") + os.pathsep + \
        e.get("PYTHONPATH", "")
    p = subprocess.Popen([sys.executable, "-m", "scape.run", "--set", "checkpoint_dir=%s" % ckpt,
                          "--", sys.executable, str(script), str(saved)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e,
                         start_new_session=True)
    steps = tmp_path / "saved.pt.steps"
    deadline = time.monotonic() + 120
    while not (steps.exists() and steps.read_text() and int(steps.read_text()) >= 3):
        assert p.poll() is None, "scape-run ended early:\n" + "".join(p.communicate())
        assert time.monotonic() < deadline, "the trainer made no 3 steps in 120 s"
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, out + err
    assert "saved at step" in out, out + err
    import torch
    sd = torch.load(str(saved))["optimizer"]
    where = sd["scaped_checkpoint"]
    where = where if os.path.isabs(where) else os.path.join(str(ckpt), where)
    assert sd["step"] >= 3 and os.path.isdir(where) and os.listdir(where), (sd, err)
    assert scaped_gone(err)
