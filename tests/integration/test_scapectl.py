"""scapectl against a real scaped with real C trainers: status (labels and
JSON), Prometheus metrics, watch, shutdown; and against no daemon, a silent
one and a fake one, for the exit codes, the timeouts and the escaping."""
import json
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time

import pytest
import zmq

import pbwire
from conftest import binary, run_trainer

ENGINE = ["--rho", "0.01", "--warmup", "3", "--trainers", "2"]
N = 20000
OK, INVALID, PROTO, TIMEOUT, USAGE = 0, 1, 7, 9, 64


def ctl(*args, rt=None, timeout=30, env=None):
    cmd = [binary("client", "scapectl")]
    if rt is not None:
        cmd += ["--runtime-dir", rt]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout,
                          env=env)


def status_json(rt):
    res = ctl("status", "--json", rt=rt)
    assert res.returncode == OK, res.stderr
    return json.loads(res.stdout)


class Job:
    """A daemon with two slow C trainers that keep stepping."""

    def __init__(self, daemon_factory):
        self.d = daemon_factory(*ENGINE)
        self.trainers = [run_trainer(self.d.endpoint, i, N, 10 ** 6, sleep_ms=5, wait=False)
                         for i in range(2)]
        deadline = time.time() + 30
        while status_json(self.d.rt)["step"] < 5:
            assert time.time() < deadline, "no steps:\n" + self.d.output()
            for t in self.trainers:
                assert t.poll() is None, t.communicate()
            time.sleep(0.05)

    def close(self):
        for t in self.trainers:
            if t.poll() is None:
                t.kill()
            t.communicate()


@pytest.fixture
def job(daemon_factory):
    j = Job(daemon_factory)
    yield j
    j.close()


def test_status_labels(job):
    res = ctl("status", rt=job.d.rt)
    assert res.returncode == OK, res.stderr
    lines = res.stdout.splitlines()
    fields = {l.split(" : ")[0].strip(): l.split(" : ", 1)[1] for l in lines if " : " in l}
    for label in ("Version", "State", "Rank/World", "Optimizer", "Mode", "Rho", "Step",
                  "Parameters", "Trainers", "Uptime", "RSS", "State memory", "Last step", "K",
                  "Density", "Bytes/step", "Wire bytes", "Residual norm", "Mask churn",
                  "Handover copy", "Step time", "pack", "Loss", "Runtime dir"):
        assert label in fields, (label, res.stdout)
    assert fields["Optimizer"] == "scape" and fields["Rho"] == "0.01"
    # the fewer-bytes settings, at their defaults
    assert fields["Values on wire"] == "bf16" and fields["Mask deltas"] in ("no", "false")
    assert fields["Rho schedule"] == "0 (none)" and fields["Gathers"] == "f32"
    assert fields["State"] == "ready" and fields["Rank/World"] == "0/1"
    assert fields["Trainers"] == "2" and fields["Runtime dir"] == job.d.rt
    assert re.fullmatch(r"[\d.]+ (B|KiB|MiB|GiB)", fields["RSS"]), fields["RSS"]
    assert re.fullmatch(r"[\d.]+ %", fields["Density"]), fields["Density"]
    assert re.fullmatch(r"[\d.]+ ms", fields["pack"]), fields["pack"]
    pids = {t.pid for t in job.trainers}
    rows = [l for l in lines if l.strip().startswith("Trainer ")]
    assert len(rows) == 2
    for row in rows:
        m = re.search(r"pid (\d+), last step (\d+)", row)
        assert m and int(m.group(1)) in pids, row
    top = [l for l in lines if not l.startswith(" ")]
    assert len({l.index(" : ") for l in top}) == 1, "labels are not aligned:\n" + res.stdout


def test_status_json_and_step_advances(job):
    a = status_json(job.d.rt)
    deadline = time.time() + 30
    while (b := status_json(job.d.rt))["step"] == a["step"]:  # the trainers step on
        assert time.time() < deadline, "the step never advanced past %d" % a["step"]
        time.sleep(0.05)
    assert b["step"] > a["step"], (a["step"], b["step"])
    assert set(a) == set(b)
    assert a["optimizer"] == "scape" and a["mode"] == "replicated"
    assert a["rho"] == pytest.approx(0.01) and a["rank"] == 0 and a["world"] == 1
    assert a["wire_values"] == "bf16" and a["mask_deltas"] is False and a["rho_start"] == 0
    assert a["dense_below"] == 0
    assert a["numel"] >= N * 0.9 and a["runtime_dir"] == job.d.rt
    assert {t["pid"] for t in a["trainers"]} == {t.pid for t in job.trainers}
    assert sorted(t["index"] for t in a["trainers"]) == [0, 1]
    assert all(t["memory"] == "host" for t in a["trainers"]), a["trainers"]  # shared memory
    last = b["last"]
    assert last["step"] == b["step"] and 0 < last["k"] <= b["numel"]
    assert last["density"] == pytest.approx(last["k"] / b["numel"])
    assert last["bytes"] > 0 and isinstance(last["phases_s"]["total"], float)
    # the lagged mask all-gather of a SCAPE step: coded bits, part of `bytes`
    assert 0 < last["mask_bytes"] < last["bytes"]
    # two trainers' Step messages, no gradient bytes: those stay in shared memory
    assert 0 < last["control_bytes"] < 100 and last["handover_copy_bytes"] == 0
    assert "loss" in b and b["uptime_ms"] > 0 and b["rss_bytes"] > 0


METRIC = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_]\w*="(?:[^"\\]|\\.)*",?)*\})? '
                    r'(\S+)$')


def parse_metrics(text):
    """{(name, labels): value}, checking the exposition format as it goes."""
    samples, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            assert kind in ("gauge", "counter") and name not in typed, line
            typed.add(name)
            continue
        if line.startswith("#"):
            assert line.startswith("# HELP "), line
            continue
        m = METRIC.match(line)
        assert m, "not a sample: %r" % line
        assert m.group(1) in typed, "sample before its TYPE: %r" % line
        samples[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return samples


def test_metrics_exposition(job):
    res = ctl("metrics", rt=job.d.rt)
    assert res.returncode == OK, res.stderr
    s = parse_metrics(res.stdout)
    assert s[("scape_up", '{rank="0"}')] == 1
    assert s[("scape_step", '{rank="0"}')] >= 5
    assert s[("scape_trainers", '{rank="0"}')] == 2
    assert s[("scape_rho", '{rank="0"}')] == pytest.approx(0.01)
    for name in ("scape_numel", "scape_rss_bytes", "scape_state_bytes", "scape_last_step_k",
                 "scape_last_step_density", "scape_last_step_bytes",
                 "scape_last_step_wire_bytes", "scape_last_step_mask_bytes",
                 "scape_residual_norm", "scape_mask_churn",
                 "scape_uptime_seconds"):
        assert (name, '{rank="0"}') in s, name
    assert ("scape_phase_seconds", '{rank="0",phase="pack"}') in s
    assert ("scape_trainer_last_step", '{rank="0",trainer="1"}') in s


def watch_steps(lines):
    return [int(re.search(r"step (\d+),", l).group(1)) for l in lines]


def test_watch_lines(job):
    res = ctl("watch", "--count", "3", "--interval-ms", "300", rt=job.d.rt)
    assert res.returncode == OK, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 3, res.stdout
    steps = watch_steps(lines)
    assert steps[0] < steps[1] < steps[2], steps
    assert all("trainers 2" in l and "density" in l and "bytes/step" in l for l in lines)
    assert "steps/s -" in lines[0] and re.search(r"steps/s [\d.]+", lines[2])


def test_watch_json(job):
    res = ctl("watch", "--count", "2", "--interval-ms", "200", "--json", rt=job.d.rt)
    assert res.returncode == OK, res.stderr
    objs = [json.loads(l) for l in res.stdout.splitlines()]
    assert len(objs) == 2 and objs[1]["step"] > objs[0]["step"]
    assert objs[0]["steps_per_s"] is None and objs[1]["steps_per_s"] > 0
    assert objs[1]["trainers"] == 2 and objs[1]["k"] > 0


def test_watch_redraws_a_terminal(job):
    master, slave = pty.openpty()
    p = subprocess.Popen([binary("client", "scapectl"), "--runtime-dir", job.d.rt, "watch",
                          "--count", "2", "--interval-ms", "200"], stdout=slave,
                         stderr=subprocess.PIPE)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    _, e = p.communicate(timeout=10)
    assert p.returncode == OK, e
    text = out.decode()
    assert text.count("\x1b[H\x1b[2J") == 2, text
    assert re.search(r"step +: \d+", text) and re.search(r"trainers +: 2", text), text


def test_watch_ends_on_sigint(job):
    p = subprocess.Popen([binary("client", "scapectl"), "--runtime-dir", job.d.rt, "watch",
                          "--interval-ms", "100"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    first = []
    deadline = time.time() + 30
    while len(first) < 2:  # two lines drawn: watch is running
        assert time.time() < deadline and p.poll() is None, "watch drew nothing"
        if select.select([p.stdout], [], [], 0.1)[0]:
            first.append(p.stdout.readline())
    p.send_signal(signal.SIGINT)
    o, e = p.communicate(timeout=10)
    assert p.returncode == OK, e
    assert all(l.strip() for l in first), first


def test_watch_ends_when_the_daemon_stops(job):
    p = subprocess.Popen([binary("client", "scapectl"), "--runtime-dir", job.d.rt,
                          "--timeout-ms", "500", "watch", "--interval-ms", "100"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    assert job.d.stop() == 0
    o, e = p.communicate(timeout=10)
    assert p.returncode == TIMEOUT, (o, e)
    assert "no answer from scaped at ipc://%s/status" % job.d.rt in e, e


def test_shutdown(daemon_factory):
    d = daemon_factory("--rho", "0.01")
    t = run_trainer(d.endpoint, 0, 1000, 10 ** 6, sleep_ms=20, wait=False)
    deadline = time.time() + 30
    while not d.trainers():  # attached, so it is told when the daemon stops
        assert time.time() < deadline and t.poll() is None, "the trainer never attached"
        time.sleep(0.02)
    res = ctl("shutdown", rt=d.rt)
    assert res.returncode == OK and res.stdout == "scaped is stopping\n", res.stderr
    assert d.proc.wait(20) == 0
    o, e = t.communicate(timeout=60)
    assert t.returncode != 0 and "shutting down" in e, e
    assert "shutdown requested" in d.output()


@pytest.fixture
def empty_dir():
    path = tempfile.mkdtemp(prefix="scape-ctl-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_no_daemon_exits_9_at_once(empty_dir):
    t0 = time.time()
    res = ctl("status", rt=empty_dir)
    assert res.returncode == TIMEOUT, res
    assert time.time() - t0 < 2
    assert "no answer from scaped at ipc://%s/status" % empty_dir in res.stderr
    assert "is it running? runtime dir %s" % empty_dir in res.stderr


class FakeDaemon:
    """A REP socket at <dir>/status that answers with canned bytes, or never."""

    def __init__(self, path, answer=None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("ipc://%s/status" % path)
        self.answer, self.requests = answer, []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        try:
            while not self.stopped.is_set():
                self.requests.append(self.sock.recv())
                if self.answer is None:
                    self.stopped.wait()
                else:
                    self.sock.send(self.answer)
        except zmq.ContextTerminated:
            pass
        finally:
            self.sock.close()

    def close(self):
        self.stopped.set()
        self.ctx.term()  # wakes serve(), which closes the socket
        self.thread.join(5)


def test_silent_daemon_times_out(empty_dir):
    fake = FakeDaemon(empty_dir)
    try:
        t0 = time.time()
        res = ctl("--timeout-ms", "300", "status", rt=empty_dir)
        elapsed = time.time() - t0
    finally:
        fake.close()
    assert res.returncode == TIMEOUT and elapsed < 3, (res, elapsed)
    assert "within 300 ms (is it running? runtime dir %s)" % empty_dir in res.stderr
    assert fake.requests == [pbwire.status_request()]


def error_reply(code, message):
    err = pbwire.field(1, pbwire.VARINT, code) + pbwire.field(2, pbwire.LEN, message)
    return pbwire.field(1, pbwire.VARINT, code) + pbwire.field(2, pbwire.LEN, err)


@pytest.mark.parametrize("answer,code,needle", [
    (error_reply(INVALID, "not today"), INVALID, "scaped answered INVALID: not today"),
    (b"\xff\xff\xff", PROTO, "undecodable reply"),
    (pbwire.field(1, pbwire.VARINT, 0), PROTO, "without a status"),
])
def test_refusals_become_the_exit_code(empty_dir, answer, code, needle):
    fake = FakeDaemon(empty_dir, answer)
    try:
        res = ctl("status", rt=empty_dir)
        shut = ctl("shutdown", rt=empty_dir)
    finally:
        fake.close()
    assert res.returncode == code and needle in res.stderr, res
    if code == INVALID:
        assert shut.returncode == INVALID and "not today" in shut.stderr
    assert res.stdout == ""


def fixed64(num, value):
    return pbwire.varint((num << 3) | pbwire.FIXED64) + struct.pack("<d", value)


def odd_status(identity):
    f, V, L = pbwire.field, pbwire.VARINT, pbwire.LEN
    trainer = f(1, V, 3) + f(2, L, identity) + f(3, V, 4242) + f(4, V, 7)
    body = (f(1, L, 'v"1\\') + f(2, V, 0) + f(3, V, 1) + f(4, L, "ready\n") + f(5, L, "scape")
            + f(6, L, "replicated") + fixed64(7, 0.25) + f(8, V, 7) + f(9, V, 10 ** 10)
            + f(10, L, trainer) + f(11, V, 3723000) + f(12, V, 5 << 30) + f(13, V, 1536)
            + f(15, L, "/tmp/x") + fixed64(16, float("nan")))
    return f(1, V, 0) + f(6, L, body)


def test_escaping_and_units(empty_dir):
    identity = b'h\xc3\xa9"\\\t\x01:\xff'
    fake = FakeDaemon(empty_dir, odd_status(identity))
    try:
        js, text, prom = (ctl(*a, rt=empty_dir) for a in (("status", "--json"), ("status",),
                                                          ("metrics",)))
    finally:
        fake.close()
    assert js.returncode == text.returncode == prom.returncode == OK
    s = json.loads(js.stdout)
    assert s["version"] == 'v"1\\' and s["state"] == "ready\n"
    assert s["trainers"][0]["identity"] == 'hé"\\\t\x01:\ufffd'
    assert s["loss"] is None and s["last"] is None and s["numel"] == 10 ** 10
    assert "Uptime           : 1h 02m 03s" in text.stdout
    assert "RSS              : 5.0 GiB" in text.stdout
    assert "State memory     : 1.5 KiB" in text.stdout
    assert "Parameters       : 10000000000 (10.00 G)" in text.stdout
    assert "Last step        : -" in text.stdout and "Loss             : nan" in text.stdout
    assert "Version          : v\"1\\\nState            : ready?\n" in text.stdout
    assert "Trainer 3      : hé\"\\??:\ufffd, pid 4242, last step 7\n" in text.stdout
    samples = parse_metrics(prom.stdout)
    assert ("scape_info", '{rank="0",version="v\\"1\\\\",state="ready\\n",optimizer="scape",'
            'mode="replicated"}') in samples
    assert ("scape_loss", '{rank="0"}') in samples and "scape_loss{rank=\"0\"} NaN" in prom.stdout


def test_endpoint_and_environment(job):
    ep = "ipc://%s/status" % job.d.rt
    res = subprocess.run([binary("client", "scapectl"), "--endpoint", ep, "status", "--json"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == OK and json.loads(res.stdout)["runtime_dir"] == job.d.rt
    env = dict(os.environ, SCAPE_RUNTIME_DIR=job.d.rt)
    res = ctl("status", env=env)
    assert res.returncode == OK and "Runtime dir      : %s" % job.d.rt in res.stdout


@pytest.mark.parametrize("args,needle", [
    (["frobnicate"], "unknown command 'frobnicate'"),
    ([], "no command given"),
    (["status", "--bogus"], "unknown option '--bogus'"),
    (["metrics", "--json"], "--json does not apply"),
    (["watch", "--count", "many"], "--count wants a whole number"),
    (["status", "--timeout-ms"], "--timeout-ms needs a value"),
    (["--runtime-dir", "/a", "--endpoint", "ipc:///a/status", "status"], "not both"),
    (["--endpoint", "tcp://host:1", "status"], "ipc://DIR/status"),
    (["status", "extra"], "unexpected argument 'extra'"),
])
def test_usage_errors(args, needle):
    res = ctl(*args)
    assert res.returncode == USAGE, res
    assert needle in res.stderr and "usage: scapectl" in res.stderr, res.stderr


def test_help():
    for args in (["help"], ["--help"], ["status", "-h"]):
        res = ctl(*args)
        assert res.returncode == OK and "Commands:" in res.stdout, res
        assert all(c in res.stdout for c in ("status", "watch", "metrics", "shutdown"))
