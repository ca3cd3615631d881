"""The daemon's own Prometheus endpoint (metrics_listen): a real scaped with
real C trainers, scraped over HTTP with urllib while it steps.  Counters
only grow, and after the run they equal the status socket's totals; the
endpoint answers 404 and 405 as HTTP wants, and garbled, silent or too many
clients do not keep it from the next scrape.  `scapectl metrics` against a
daemon that is gone prints scape_up 0."""
import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

import pytest

import pbwire
from conftest import SOURCE, binary, run_trainer
from test_scapectl import parse_metrics

N = 20000
EVERY = 5                      # checkpoint_every
ENGINE = ["--rho", "0.01", "--warmup", "3", "--trainers", "2",
          "--max-grad-norm", "1e-9",    # every step's gradient is above it: clipped
          "--checkpoint-every", str(EVERY)]
COUNTERS = ("scape_steps_total", "scape_collective_bytes_total", "scape_wire_bytes_total",
            "scape_clipped_steps_total", "scape_checkpoints_total",
            "scape_data_sent_bytes_total", "scape_data_received_bytes_total",
            "scape_data_refused_handshakes_total", "scape_step_queued_seconds_total")
R0 = '{rank="0"}'


def metrics_url(d):
    """The daemon was given port 0: the port it took is in its log."""
    m = re.search(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", d.output())
    assert m, d.output()
    return "http://127.0.0.1:%s/metrics" % m.group(1), int(m.group(1))


def scrape(url, method="GET"):
    req = urllib.request.Request(url, method=method)
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        return r.read().decode()


def http_error(url, method="GET"):
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10)
    return e.value


def status_fields(d):
    code, msg, st, last = pbwire.query_status(d.status_endpoint)
    assert code == 0, msg
    return st, last


@pytest.fixture
def served(daemon_factory):
    ckpt = tempfile.mkdtemp(prefix="scape-mt-")
    d = daemon_factory(*ENGINE, "--checkpoint-dir", ckpt, "--metrics-listen", "127.0.0.1:0")
    yield d
    subprocess.run(["rm", "-rf", ckpt], check=True)


def typed(text):
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def test_scrapes_during_a_run(served):
    d = served
    url, _ = metrics_url(d)
    trainers = [run_trainer(d.endpoint, i, N, 10 ** 6, sleep_ms=5, wait=False) for i in range(2)]
    scrapes = []
    try:
        deadline = time.time() + 60
        # scrape until five scrapes have seen five different step counts,
        # and two checkpoints are due
        seen = set()
        while len(seen) < 5 or max(seen) < 2 * EVERY:
            assert time.time() < deadline, "no steps:\n" + d.output()
            for t in trainers:
                assert t.poll() is None, t.communicate()
            scrapes.append(parse_metrics(scrape(url)))
            seen.add(scrapes[-1][("scape_steps_total", R0)])
    finally:
        for t in trainers:
            t.kill()
            t.communicate()
    # the trainers are gone: once the daemon has let them go, nothing grows
    deadline = time.time() + 30
    while status_fields(d)[0].get(10):
        assert time.time() < deadline, "the daemon kept the dead trainers"
        time.sleep(0.05)
    text = scrape(url)
    last = parse_metrics(text)
    scrapes.append(last)

    types = typed(text)
    for name in COUNTERS:
        assert types.get(name) == "counter", (name, types.get(name))
    assert types["scape_collectives_total"] == "counter"
    for name in ("scape_up", "scape_step", "scape_trainers", "scape_last_step_bytes",
                 "scape_last_step_density", "scape_residual_norm", "scape_grad_norm",
                 "scape_phase_seconds"):
        assert types.get(name) == "gauge", (name, types.get(name))
    assert all(n.endswith("_total") for n, k in types.items() if k == "counter"), types
    assert not any(n.endswith("_total") for n, k in types.items() if k == "gauge"), types

    # counters never go down, from one scrape to the next
    for before, after in zip(scrapes, scrapes[1:]):
        for key, v in before.items():
            if types.get(key[0]) == "counter":
                assert after.get(key, -1) >= v, (key, v, after.get(key))

    st, step_done = status_fields(d)
    ckpt = pbwire.parse(st[17][0])
    by_op = {}
    for raw in st.get(48, []):
        f = pbwire.parse(raw)
        by_op[f[1][0].decode()] = f[2][0]
    got = {name: last[(name, R0)] for name in COUNTERS}
    assert got == {
        "scape_steps_total": st[45][0],
        "scape_collective_bytes_total": st[46][0],
        "scape_wire_bytes_total": st[47][0],
        "scape_clipped_steps_total": st[49][0],
        "scape_checkpoints_total": ckpt[5][0],
        # one daemon: no data plane, so nothing sent, received or refused on it
        "scape_data_sent_bytes_total": 0,
        "scape_data_received_bytes_total": 0,
        "scape_data_refused_handshakes_total": 0,
        "scape_step_queued_seconds_total": pytest.approx(st[23][0]),
    }
    assert {k[1]: v for k, v in last.items() if k[0] == "scape_collectives_total"} == \
        {'{rank="0",op="%s"}' % op: calls for op, calls in by_op.items()}
    # what the totals must be, from the run itself: a fresh daemon's steps
    # are the job's, each of them clipped (max_grad_norm 1e-9), and one
    # checkpoint every EVERY steps
    steps = st[8][0]
    assert steps >= 2 * EVERY and last[("scape_step", R0)] == steps
    assert got["scape_steps_total"] == steps
    assert got["scape_clipped_steps_total"] == steps
    assert got["scape_checkpoints_total"] == steps // EVERY
    assert got["scape_collective_bytes_total"] >= step_done[5][0] > 0
    assert last[("scape_trainers", R0)] == 0
    # and scapectl status --json shows the same totals
    out = subprocess.run([binary("client", "scapectl"), "--runtime-dir", d.rt, "status",
                          "--json"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    totals = json.loads(out.stdout)["totals"]
    assert {k: totals[k] for k in ("steps_total", "collective_bytes_total", "wire_bytes_total",
                                   "clipped_steps_total")} == {
        "steps_total": st[45][0], "collective_bytes_total": st[46][0],
        "wire_bytes_total": st[47][0], "clipped_steps_total": st[49][0]}
    assert {c["op"]: c["calls"] for c in totals["collectives_total"]} == by_op

    # the shipped Grafana dashboard asks only for series the daemon serves
    with open(os.path.join(SOURCE, "deploy", "grafana-scaped.json")) as f:
        dash = json.load(f)
    assert any(v["type"] == "datasource" and v["query"] == "prometheus"
               for v in dash["templating"]["list"])
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = set(re.findall(r"\b(scape_[a-z_]+)", " ".join(exprs)))
    # (scape_loss comes once trainers post a loss: the C trainer posts none)
    assert len(used) >= 10 and used - {"scape_loss"} <= set(types), used - set(types)


def test_errors_and_bad_clients(served):
    d = served
    url, port = metrics_url(d)
    base = url[:-len("/metrics")]
    assert http_error(base + "/").code == 404
    assert http_error(base + "/metricsx").code == 404
    e = http_error(url, "POST")
    assert e.code == 405 and e.headers["Allow"] == "GET"
    assert http_error(url, "HEAD").code == 405
    assert "scape_up" in scrape(url + "?x=1")

    def raw(payload, shut=True):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(payload)
        if shut:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            out += chunk
        s.close()
        return out

    assert raw(b"\x00\xff garbage \r\n\r\n").startswith(b"HTTP/1.0 400 ")
    assert raw(b"GET /metrics HTTP/1.0\r\nX: " + b"a" * 10000, shut=False) \
        .startswith(b"HTTP/1.0 431 ")
    assert raw(b"GET /metrics HTTP/1.0\n\n").startswith(b"HTTP/1.0 200 OK\r\n")
    # clients that connect and send nothing, more of them than the daemon
    # keeps, half a request from another: the next scrape is still answered
    silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
    half = socket.create_connection(("127.0.0.1", port), timeout=10)
    half.sendall(b"GET /metr")
    try:
        text = scrape(url)
        assert parse_metrics(text)[("scape_up", R0)] == 1
    finally:
        for s in silent + [half]:
            s.close()
    assert d.proc.poll() is None
    assert "scape_up" in scrape(url)


def test_port_taken_and_bad_address(served):
    _, port = metrics_url(served)
    rt = tempfile.mkdtemp(prefix="scape-mt-")
    try:
        for addr, needle in (("127.0.0.1:%d" % port, "Address already in use"),
                             ("localhost", "is not HOST:PORT"),
                             ("127.0.0.1:99999", "is not HOST:PORT")):
            res = subprocess.run([binary("daemon", "scaped"), "--runtime-dir",
                                  os.path.join(rt, "rt"), "--metrics-listen", addr],
                                 capture_output=True, text=True, timeout=30)
            assert res.returncode == 1 and needle in res.stderr, (addr, res)
    finally:
        subprocess.run(["rm", "-rf", rt], check=True)


def test_scapectl_metrics_of_a_stopped_daemon(served):
    ctl = [binary("client", "scapectl"), "--runtime-dir", served.rt, "metrics"]
    up = subprocess.run(ctl, capture_output=True, text=True, timeout=30)
    assert up.returncode == 0 and parse_metrics(up.stdout)[("scape_up", R0)] == 1
    assert served.stop() == 0
    down = subprocess.run(ctl, capture_output=True, text=True, timeout=30)
    assert down.returncode == 0, down
    assert parse_metrics(down.stdout) == {("scape_up", ""): 0}
    assert "no answer from scaped" in down.stderr
