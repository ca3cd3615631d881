"""Daemons on separate test hosts (network namespaces from deploy/hosts.sh,
their own addresses, links with a rate): groups of 2 and 4 bitwise equal to
the local backend, the bytes on each host's interface against the daemon's
own count and the ring model, a cut link named within the timeout, and a
short cut survived.  Without root or namespaces these skip, saying why; the
loopback versions in test_multinode.py run everywhere."""
import json
import os
import subprocess
import time

import pytest

import pbwire
from conftest import binary, run_reference, run_trainer, synth_layout
from test_multinode import ENGINE, read, train_group

PORT = 29517


def start_on_hosts(daemon_factory, hosts, trainers, extra=(), timeout_ms=20000):
    """Daemon r on host r: the rendezvous on host 0, each data plane on its
    host's address; returns once every daemon reaches all the others."""
    coord = "tcp://%s:%d" % (hosts.addr[0], PORT)
    daemons = [daemon_factory(*ENGINE, *extra, "--world", str(len(trainers)), "--rank", str(r),
                              "--coordinator", coord, "--listen", "tcp://%s:*" % hosts.addr[r],
                              "--job", "9", "--trainers", str(t),
                              "--comm-timeout-ms", str(timeout_ms), netns=hosts.ns[r])
               for r, t in enumerate(trainers)]
    deadline = time.time() + 60
    for d in daemons:
        while status_json(d).get("peers_connected") != len(trainers) - 1:
            assert time.time() < deadline and d.proc.poll() is None, \
                "the daemons never met:\n" + d.output()
            time.sleep(0.05)
    return daemons


def status_json(d):
    r = subprocess.run([binary("client", "scapectl"), "--runtime-dir", d.rt, "--timeout-ms",
                        "2000", "status", "--json"], capture_output=True, text=True)
    return json.loads(r.stdout) if r.returncode == 0 else {}


@pytest.mark.parametrize("trainers,auth", [([1, 2], "none"), ([1, 3, 2, 1], "none"),
                                           ([1, 3, 2, 1], "secret")])
def test_groups_on_hosts_match_the_local_backend(daemon_factory, hosts_factory, tmp_path,
                                                  trainers, auth):
    """Both modes, links at 1 Gbit/s.  On every host the interface sent at
    least what the daemon counted on its data plane (framing included), and
    over plain TCP (auth none) at most 10% more plus 80 bytes of headers per
    packet (Ethernet, IP, TCP; the ACKs are packets too); with CURVE (auth
    secret) each frame also carries its box (a MAC, a nonce, the command
    name), which the daemon does not count: there only the lower bound and
    the overhead are printed.  The ring model's per-step bytes, for every
    step, stay below the daemon's count."""
    n, steps = 3000, 60
    hosts = hosts_factory(len(trainers), rate="1gbit")
    extra = ["--auth", "none"] if auth == "none" else []
    for mode in ("replicated", "sharded"):
        daemons = start_on_hosts(daemon_factory, hosts, trainers, ["--mode", mode, *extra])
        before = [(hosts.counters(r), status_json(d)) for r, d in enumerate(daemons)]
        got = train_group(daemons, trainers, tmp_path, n, steps, mode)
        assert all(g == got[0] for g in got), "trainers disagree (%s)" % mode
        for r, d in enumerate(daemons):
            (tx0, txp0, rx0, rxp0), s0 = before[r]
            tx1, txp1, rx1, rxp1 = hosts.counters(r)
            s1 = status_json(d)
            sent = s1["data_sent_bytes"] - s0["data_sent_bytes"]
            recvd = s1["data_recv_bytes"] - s0["data_recv_bytes"]
            _, _, _, done = pbwire.query_status(d.status_endpoint)
            model = done[6][0]  # the last (sparse) step's ring model
            print("%s rank %d: interface tx %d (%d packets) rx %d; daemon sent %d received "
                  "%d; ring model %d B/step" % (mode, r, tx1 - tx0, txp1 - txp0, rx1 - rx0,
                                                 sent, recvd, model))
            assert status_json(d)["data_encrypted"] is (auth != "none")
            assert sent <= tx1 - tx0 and recvd <= rx1 - rx0, (r, tx1 - tx0, sent)
            if auth == "none":
                assert tx1 - tx0 <= 1.10 * sent + 80 * (txp1 - txp0), (r, tx1 - tx0, sent)
                assert rx1 - rx0 <= 1.10 * recvd + 80 * (rxp1 - rxp0), (r, rx1 - rx0, recvd)
            else:
                print("  CURVE: interface tx / daemon sent %.2f" % ((tx1 - tx0) / sent))
            assert 0 < model * steps <= sent, (model, steps, sent)
        for d in daemons:
            assert d.stop() == 0, d.output()
        ref = str(tmp_path / ("ref-" + mode))
        run_reference(ref, ",".join(map(str, trainers)), n, steps, *ENGINE, "--mode", mode)
        assert got[0] == read(ref), "daemons on hosts differ from the local backend (%s)" % mode


def test_a_cut_link_is_named_within_the_timeout(daemon_factory, hosts_factory):
    """Host 1's link goes down mid-job: no connection closes, so only the
    timeout (3 s) can tell; host 0's trainer gets an error naming rank 1
    within it and a margin, and host 0's daemon reports itself broken."""
    hosts = hosts_factory(2, rate="100mbit")
    daemons = start_on_hosts(daemon_factory, hosts, [1, 1], timeout_ms=3000)
    ts = [run_trainer(d.endpoint, 0, 2000, 10 ** 6, sleep_ms=5, seed=1 + 1000 * r, wait=False)
          for r, d in enumerate(daemons)]
    try:
        time.sleep(2.0)
        assert all(t.poll() is None for t in ts), "training stopped early"
        hosts.cut(1)
        cut = time.time()
        o, e = ts[0].communicate(timeout=60)
        waited = time.time() - cut
        assert ts[0].returncode != 0, o + e
        assert "rank 1" in e, e
        assert waited < 3.0 + 5.0, "named only after %.1f s" % waited
        print("cut named after %.1f s: %s" % (waited, e.strip().splitlines()[-1]))
        assert daemons[0].proc.poll() is None, "the daemon on host 0 exited"
        # and it says so (what the sbatch template requeues on), whichever
        # of the step's collectives the cut caught
        deadline = time.time() + 10
        while status_json(daemons[0]).get("state") != "broken":
            assert time.time() < deadline, status_json(daemons[0])
            time.sleep(0.1)
    finally:
        for t in ts:
            if t.poll() is None:
                t.kill()
            t.communicate()


def test_a_short_cut_is_survived(daemon_factory, hosts_factory, tmp_path):
    """Host 1's link is down for 1.5 s, well within the 20 s timeout, in
    the middle of the job, and comes back: the job finishes, bitwise equal to
    the local backend's undisturbed run."""
    n, steps = 2000, 300
    hosts = hosts_factory(2, rate="100mbit")
    daemons = start_on_hosts(daemon_factory, hosts, [1, 1], timeout_ms=20000)
    outs = [str(tmp_path / ("r%d" % r)) for r in range(2)]
    ts = [run_trainer(d.endpoint, 0, n, steps, out=outs[r], sleep_ms=10, seed=1 + 1000 * r,
                      wait=False) for r, d in enumerate(daemons)]
    try:
        time.sleep(1.0)
        assert all(t.poll() is None for t in ts), "the job ended before the cut"
        hosts.cut(1)
        time.sleep(1.5)
        hosts.restore(1)
        for t in ts:
            o, e = t.communicate(timeout=300)
            assert t.returncode == 0, o + e
    finally:
        for t in ts:
            if t.poll() is None:
                t.kill()
                t.communicate()
    run_reference(str(tmp_path / "ref"), "1,1", n, steps, *ENGINE)
    for out in outs:
        assert read(out) == read(str(tmp_path / "ref")), "the cut changed the result"
    for d in daemons:
        assert d.stop() == 0, d.output()
