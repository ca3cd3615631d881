"""scape-run: start a node's scaped and its trainer processes, torchrun-like.

    python -m scape.run --nproc-per-node 4 [options] -- python train.py ARGS...

It starts scaped with a fresh runtime directory, waits until the daemon
answers (for several nodes: until the daemons have met at the rendezvous),
starts the trainers with SCAPE_ENDPOINT, SCAPE_RUNTIME_DIR, SCAPE_INDEX and
torch's LOCAL_RANK, RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK set (and
MASTER_ADDR, MASTER_PORT removed: they are scape-run's rendezvous, not a
torch.distributed one), passes SIGTERM on to them (SIGINT reaches them
directly: they share scape-run's process group, the terminal's), stops the
daemon (kept out of that group) once they have ended, and exits with their
status.  When a trainer fails it stops the others, says which one failed
and how, and exits with that trainer's status.

Several nodes: run one scape-run per node with --nnodes, --node-rank and
--master-addr/--master-port (or NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT
in the environment).  Under srun (one task per node: srun --ntasks-per-node=1)
the job's shape comes from Slurm: node rank SLURM_PROCID of SLURM_NTASKS.
"""
import argparse
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from scape import __version__

PROG = "scape-run"


def say(msg):
    print("%s: %s" % (PROG, msg), file=sys.stderr, flush=True)


def _here_bin(name):
    """name in the prefix the package was installed from, or next to the
    libscape the binding loads (PREFIX/bin for PREFIX/lib, or a build tree),
    found without loading it."""
    from scape import _find
    pre = _find.installed_prefix()
    cands = [os.path.join(pre[1], name)] if pre else []
    path, _ = _find.first_present()
    if path and os.sep in path:
        top = os.path.dirname(os.path.dirname(path))
        cands += [os.path.join(top, "bin", name),
                  os.path.join(top, "daemon" if name == "scaped" else "client", name)]
    for c in cands:
        if os.access(c, os.X_OK):
            return c
    return None


def find_binary(name, flag):
    """flag, $SCAPE_BIN/name, $SCAPE_BUILD_DIR's, next to libscape, then PATH."""
    tries = [flag]
    if os.environ.get("SCAPE_BIN"):
        tries.append(os.path.join(os.environ["SCAPE_BIN"], name))
    if os.environ.get("SCAPE_BUILD_DIR"):
        sub = "daemon" if name == "scaped" else "client"
        tries.append(os.path.join(os.environ["SCAPE_BUILD_DIR"], sub, name))
    tries += [_here_bin(name), shutil.which(name)]
    for t in tries:
        if t and os.access(t, os.X_OK):
            return t
    return None


def parse(argv):
    env = os.environ
    ap = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--version", action="version", version="%s %s" % (PROG, __version__),
                    help="the version of scape-run (scaped's), then exit")
    ap.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                    help="trainer processes on this node (default 1)")
    ap.add_argument("--nnodes", type=int, default=int(env.get("NNODES", "0") or 0),
                    help="nodes of the job, one scaped each (default $NNODES, else 1, "
                         "or Slurm's shape under srun)")
    ap.add_argument("--node-rank", type=int, default=int(env.get("NODE_RANK", "0") or 0),
                    help="this node's rank (default $NODE_RANK, else 0)")
    ap.add_argument("--master-addr", default=env.get("MASTER_ADDR", ""),
                    help="host of node 0's rendezvous (default $MASTER_ADDR)")
    ap.add_argument("--master-port", type=int, default=int(env.get("MASTER_PORT", "0") or 0),
                    help="its port (default $MASTER_PORT, else 29517)")
    ap.add_argument("--listen-host", default="",
                    help="this node's address for the data plane (default: the one that "
                         "reaches --master-addr)")
    ap.add_argument("--config", help="scaped configuration file")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a scaped setting (repeatable), e.g. --set rho=0.01")
    ap.add_argument("--runtime-dir", help="scaped's runtime directory (default: a fresh "
                                          "temporary one, removed at the end)")
    ap.add_argument("--scaped", help="the scaped binary (default: $SCAPE_BIN, next to "
                                     "libscape, then PATH)")
    ap.add_argument("--start-timeout", type=float, default=120.0, metavar="S",
                    help="seconds to wait for scaped to answer (default 120)")
    ap.add_argument("--grace", type=float, default=10.0, metavar="S",
                    help="seconds processes get to stop before SIGKILL (default 10; "
                         "with several nodes scaped gets comm_timeout_ms more, since it "
                         "waits that long for the other daemons to leave)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER,
                    help="-- and the trainer command line")
    a = ap.parse_args(argv)
    if a.cmd and a.cmd[0] == "--":
        a.cmd = a.cmd[1:]
    if not a.cmd:
        ap.error("no trainer command (put it after --)")
    if a.nproc_per_node < 1 or a.nproc_per_node > 64:
        ap.error("--nproc-per-node %d: 1..64" % a.nproc_per_node)
    if a.nnodes < 0 or (a.nnodes and not 0 <= a.node_rank < a.nnodes):
        ap.error("--node-rank %d outside --nnodes %d" % (a.node_rank, a.nnodes))
    if a.nnodes > 1 and not a.master_addr:
        ap.error("--nnodes %d needs --master-addr (or MASTER_ADDR)" % a.nnodes)
    for kv in a.set:
        if "=" not in kv or not kv.split("=", 1)[0]:
            ap.error("--set %r: KEY=VALUE" % kv)
    a.nodes, a.node_index, a.batch_script = max(a.nnodes, 1), a.node_rank, False
    if not a.nnodes and "SLURM_PROCID" in env:
        try:
            a.nodes, a.node_index, a.batch_script = slurm_shape(env)
        except ValueError as e:
            ap.error(str(e))
    return a


def _slurm_int(env, *names):
    for n in names:
        v = env.get(n, "")
        if v:
            if not v.isdigit():
                raise ValueError("%s=%r is not a number" % (n, v))
            return n, int(v)
    raise ValueError("Slurm set SLURM_PROCID but none of %s" % ", ".join(names))


def slurm_shape(env):
    """(nodes, this node's rank, whether this is the batch script) of an
    srun step with one task per node, as scaped's own Slurm defaults see it
    (rank SLURM_PROCID of SLURM_NTASKS), or of a one-node job's batch script;
    ValueError naming the variables for any other shape."""
    _, procid = _slurm_int(env, "SLURM_PROCID")
    nn, nnodes = _slurm_int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES",
                            "SLURM_JOB_NUM_NODES")
    if "SLURM_STEP_ID" not in env:  # srun sets it; the batch script has none
        if nnodes > 1:
            raise ValueError("this is the batch script of a %d-node job, which runs on its "
                             "first node only: start scape-run once per node, with srun "
                             "--ntasks-per-node=1 scape-run ..." % nnodes)
        return 1, 0, True
    tn, ntasks = _slurm_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if ntasks != nnodes:
        raise ValueError("under srun, scape-run runs once per node and starts the trainers "
                         "itself: this step has %s=%d tasks on %s=%d nodes; use srun "
                         "--ntasks-per-node=1 and --nproc-per-node for the trainers"
                         % (tn, ntasks, nn, nnodes))
    return nnodes, procid, False


def reach_address(host, port):
    """This host's address on the route to host:port (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), port or 9))
        return s.getsockname()[0]


def daemon_command(a, scaped, rt):
    cmd = [scaped, "--runtime-dir", rt]
    if a.config:
        cmd += ["--config", a.config]
    keys = {kv.split("=", 1)[0].replace("-", "_") for kv in a.set}
    if "trainers" not in keys:
        cmd += ["--trainers", str(a.nproc_per_node)]
    if a.nnodes >= 1 and not ({"world", "rank"} & keys):
        port = a.master_port or 29517
        cmd += ["--world", str(a.nnodes), "--rank", str(a.node_rank)]
        if a.nnodes > 1:
            host = a.listen_host or reach_address(a.master_addr, port)
            cmd += ["--coordinator", "tcp://%s:%d" % (a.master_addr, port),
                    "--listen", "tcp://%s:*" % host, "--job", str(port)]
    for kv in a.set:
        k, v = kv.split("=", 1)
        cmd += ["--" + k, v]
    return cmd


def pump(stream, prefix):
    """Copy a child's output to our stderr, a prefix on each line."""
    for line in iter(stream.readline, b""):
        sys.stderr.buffer.write(prefix + line)
        sys.stderr.buffer.flush()
    stream.close()


def _die_with(parent):
    """For scaped's child before exec: SIGTERM when scape-run (pid parent)
    dies, even by SIGKILL (scaped is in a session of its own, out of reach
    of the terminal's signals)."""
    def preexec():
        if _LIBC is not None and _LIBC.prctl(1, int(signal.SIGTERM), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != parent:  # it died before the prctl
            os._exit(1)
    return preexec


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def status_name(rc):
    return "killed by signal %d (%s)" % (-rc, signal.Signals(-rc).name) if rc < 0 \
        else "exit status %d" % rc


def exit_code(rc):
    return 128 - rc if rc < 0 else rc


def trainer_env(base, rt, local, per_node, node, nodes):
    """Trainer `local` of node `node`: its slot, torch's variables, and no
    MASTER_ADDR/MASTER_PORT, with which frameworks would start
    torch.distributed and all-reduce the gradients besides scaped."""
    env = {k: v for k, v in base.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(SCAPE_RUNTIME_DIR=rt, SCAPE_ENDPOINT="ipc://%s/control" % rt,
               SCAPE_INDEX=str(local), LOCAL_RANK=str(local),
               LOCAL_WORLD_SIZE=str(per_node), NODE_RANK=str(node),
               RANK=str(node * per_node + local), WORLD_SIZE=str(nodes * per_node))
    return env


class Launch:
    def __init__(self, a):
        self.a = a
        self.daemon = None
        self.trainers = []
        self.signalled = None
        self.pumps = []

    def on_signal(self, signum, _frame):
        """SIGTERM is passed on; SIGINT is not: it comes from a terminal's
        Ctrl-C (or a kill of the process group), which reached the trainers
        too, and a second one would interrupt their shutdown saves."""
        if self.signalled is None:
            self.signalled = signum
            say("%s: %s" % (signal.Signals(signum).name,
                            "the trainers got it too (one process group); waiting for them"
                            if signum == signal.SIGINT else "passing it to the trainers"))
        if signum == signal.SIGINT:
            return
        for p in self.trainers:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass

    def wait_up(self, scapectl, rt):
        """Until scaped answers its status socket (the rendezvous done), or
        its control socket is there when no scapectl was found."""
        deadline = time.monotonic() + self.a.start_timeout
        while True:
            if self.daemon.poll() is not None:
                raise RuntimeError("scaped exited while starting: %s"
                                   % status_name(self.daemon.returncode))
            if self.signalled is not None:
                raise RuntimeError("interrupted while scaped was starting")
            if scapectl:
                r = subprocess.run([scapectl, "--runtime-dir", rt, "--timeout-ms", "1000",
                                    "status"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
                if r.returncode == 0:
                    return
            elif os.path.exists(os.path.join(rt, "control")):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("scaped did not answer within %g s (runtime directory "
                                   "%s)" % (self.a.start_timeout, rt))
            time.sleep(0.1)

    def start_trainers(self, rt):
        a = self.a
        for i in range(a.nproc_per_node):
            env = trainer_env(os.environ, rt, i, a.nproc_per_node, a.node_index, a.nodes)
            try:
                self.trainers.append(subprocess.Popen(a.cmd, env=env))
            except OSError as e:
                raise RuntimeError("cannot start the trainer %r: %s" % (a.cmd[0], e))

    def stop(self, procs, why):
        """SIGTERM, then SIGKILL after the grace period."""
        live = [p for p in procs if p.poll() is None]
        for p in live:
            p.terminate()
        deadline = time.monotonic() + self.a.grace
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                say("%s pid %d did not stop within %g s (%s): killing it"
                    % ("scaped" if p is self.daemon else "trainer", p.pid, self.a.grace, why))
                p.kill()
                p.wait()

    def supervise(self):
        """Until every trainer has ended, one has failed, or scaped died.
        Returns the exit code."""
        while True:
            failed = [(i, p) for i, p in enumerate(self.trainers)
                      if p.poll() is not None and p.returncode != 0]
            if failed and self.signalled is None:
                i, p = failed[0]
                say("trainer %d (pid %d) failed: %s; stopping the other trainers"
                    % (i, p.pid, status_name(p.returncode)))
                self.stop(self.trainers, "after trainer %d failed" % i)
                return exit_code(p.returncode)
            if all(p.poll() is not None for p in self.trainers):
                if self.signalled is not None:
                    return 128 + self.signalled
                return 0
            if self.daemon.poll() is not None:
                say("scaped (pid %d) ended while trainers ran: %s; stopping them"
                    % (self.daemon.pid, status_name(self.daemon.returncode)))
                self.stop(self.trainers, "scaped ended")
                return exit_code(self.daemon.returncode) or 1
            time.sleep(0.05)

    def run(self):
        a = self.a
        scaped = find_binary("scaped", a.scaped)
        if scaped is None:
            say("no scaped binary: give --scaped PATH, set SCAPE_BIN, or put it on PATH")
            return 2
        scapectl = find_binary("scapectl", None)
        own_rt = a.runtime_dir is None
        rt = tempfile.mkdtemp(prefix="scape-run-") if own_rt else a.runtime_dir
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self.on_signal)
        code = 1
        try:
            cmd = daemon_command(a, scaped, rt)
            # a batch script's SLURM_PROCID (0) would have scaped take the
            # job's task count (or none) for its world: it is one node alone
            env = {k: v for k, v in os.environ.items()
                   if not (a.batch_script and k == "SLURM_PROCID")}
            self.daemon = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True,
                                           preexec_fn=_die_with(os.getpid()))
            t = threading.Thread(target=pump, args=(self.daemon.stdout, b"[scaped] "),
                                 daemon=True)
            t.start()
            self.pumps.append(t)
            self.wait_up(scapectl, rt)
            say("scaped pid %d is up (runtime directory %s); starting %d trainer(s)"
                % (self.daemon.pid, rt, a.nproc_per_node))
            self.start_trainers(rt)
            code = self.supervise()
            if code == 0:
                say("%d trainer(s) done" % len(self.trainers))
        except RuntimeError as e:
            say(str(e))
            self.stop(self.trainers, str(e))
            code = 128 + self.signalled if self.signalled else 1
        finally:
            if self.daemon is not None:
                if a.nodes > 1:  # scaped waits, up to its comm_timeout_ms (300 s unless
                    # --set), for the other nodes' daemons: a state_dict may still come
                    ms = [kv.split("=", 1)[1] for kv in a.set
                          if kv.split("=", 1)[0].replace("-", "_") == "comm_timeout_ms"]
                    try:
                        a.grace += float(ms[-1]) / 1000 if ms else 300.0
                    except ValueError:
                        a.grace += 300.0
                self.stop([self.daemon], "stopping scaped")
                drc = self.daemon.returncode
                if drc not in (0, -signal.SIGTERM) and code == 0:
                    say("scaped ended with %s" % status_name(drc))
                    code = exit_code(drc) or 1
            for t in self.pumps:
                t.join(timeout=5)
            if own_rt:
                shutil.rmtree(rt, ignore_errors=True)
        return code


def main(argv=None):
    return Launch(parse(sys.argv[1:] if argv is None else argv)).run()


if __name__ == "__main__":
    sys.exit(main())
