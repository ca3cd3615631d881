"""Mutation fuzzing of a live scaped: thousands of damaged requests (flipped
bits, cut, spliced, grown, extra frames) on the control and status sockets
while a real trainer runs.  The daemon must answer every one of them (a
refusal or, for the few that stay valid, an answer), never crash or stall,
and the trainer's parameters must end bitwise equal to the in-process engine's.

The seed is fixed so a failure reproduces; SCAPE_FUZZ_SEED and
SCAPE_FUZZ_COUNT choose others."""
import os
import random
import time

import zmq

import pbwire
from conftest import run_reference, run_trainer, synth_layout

ENGINE = ["--rho", "0.01", "--warmup", "3"]
SEED = int(os.environ.get("SCAPE_FUZZ_SEED", "20261129"))
COUNT = int(os.environ.get("SCAPE_FUZZ_COUNT", "2500"))


def mutate(rng, msg, corpus):
    """One damaged copy of msg."""
    b = bytearray(msg)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        if op == 0 and b:                      # flip a bit
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:                    # replace a byte
            b[rng.randrange(len(b))] = rng.choice((0, 0x7F, 0x80, 0xFF, rng.randrange(256)))
        elif op == 2:                          # insert bytes
            i = rng.randrange(len(b) + 1)
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 3 and b:                    # delete a run
            i = rng.randrange(len(b))
            del b[i:i + rng.randint(1, 8)]
        elif op == 4 and b:                    # cut the tail
            del b[rng.randrange(len(b)):]
        elif op == 5:                          # splice another request in
            o = rng.choice(corpus)
            i, j = rng.randrange(len(b) + 1), rng.randrange(len(o) + 1)
            b[i:] = o[j:]
        elif op == 6 and b:                    # repeat a slice
            i = rng.randrange(len(b))
            b[i:i] = b[i:i + rng.randint(1, 16)]
        else:                                  # a huge varint somewhere
            i = rng.randrange(len(b) + 1)
            b[i:i] = b"\xff" * rng.randint(1, 11)
    return bytes(b)


def may_shut_down(msg):
    """Could the daemon read this as a Shutdown request (field 7)?  Those are
    left out of the status socket's share, which would honour them."""
    try:
        return 7 in pbwire.parse(msg)
    except Exception:  # noqa: BLE001 - undecodable for us; be careful
        return b"\x3a" in msg or b"\xba" in msg


def answered(sock, frames, what):
    sock.send_multipart(frames)
    if not sock.poll(10000):
        raise AssertionError("scaped did not answer %s within 10 s: %r" % (what, frames))
    return pbwire.reply(sock.recv())


def test_damaged_requests_are_refused_while_a_trainer_runs(daemon_factory, tmp_path):
    n, steps = 5000, 400
    d = daemon_factory(*ENGINE)
    layout = synth_layout(n)
    total = sum(t[2] for t in layout)
    trainer = run_trainer(d.endpoint, 0, n, steps, out=str(tmp_path / "t0"), sleep_ms=5,
                          wait=False)
    rng = random.Random(SEED)
    missing = pbwire.mem_shm("/scape-fuzz-no-such-object", 4 * total)
    control = [pbwire.hello(os.getpid(), name="fuzz"), pbwire.register(layout, missing, missing),
               pbwire.step(1, lr=2.0), pbwire.sync(), pbwire.detach(),
               pbwire.field(9, pbwire.LEN, b"")]
    status = [pbwire.status_request(), pbwire.field(6, pbwire.LEN, b""),
              pbwire.field(9, pbwire.LEN, b"")]
    ctx = zmq.Context()
    socks = []
    counts = {"control": 0, "status": 0, "refused": 0, "while_training": 0}
    try:
        time.sleep(0.3)
        # Two control connections: one that never said hello, and one that
        # did (its later requests reach the per-trainer checks).
        for k in range(2):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(d.endpoint)
            socks.append(s)
        assert answered(socks[1], [control[0]], "hello")[0] == 0
        st = ctx.socket(zmq.REQ)
        st.setsockopt(zmq.LINGER, 0)
        st.connect(d.status_endpoint)
        socks.append(st)
        for i in range(COUNT):
            if i % 4 == 3:
                m = mutate(rng, rng.choice(status), status)
                if may_shut_down(m):
                    continue
                code, _, _ = answered(st, [m], "a status request")
                counts["status"] += 1
            else:
                frames = [mutate(rng, rng.choice(control), control)]
                if rng.random() < 0.05:
                    frames.append(rng.choice((b"", b"x" * rng.randint(1, 64))))
                code, _, _ = answered(socks[i % 2], frames, "a control request")
                counts["control"] += 1
            counts["refused"] += code != 0
            counts["while_training"] += trainer.poll() is None
        # Still serving: a clean status query answers.
        code, msg, f = answered(st, [pbwire.status_request()], "a clean status request")
        assert code == 0 and 6 in f, msg
    finally:
        for s in socks:
            s.close()
        ctx.term()
    o, e = trainer.communicate(timeout=300)
    assert trainer.returncode == 0, o + e
    run_reference(str(tmp_path / "ref"), 1, n, steps, *ENGINE)
    with open(tmp_path / "t0", "rb") as a, open(tmp_path / "ref", "rb") as b:
        assert a.read() == b.read(), "fuzzing changed the trainer's result"
    assert counts["refused"] > counts["control"] // 2, counts
    assert counts["while_training"] >= min(COUNT // 2, 1000), \
        "the trainer finished too soon: %r" % counts
    assert d.proc.poll() is None, "scaped exited:\n" + d.output()[-4000:]
    assert d.stop() == 0
    print("fuzz: %(control)d control and %(status)d status requests, %(refused)d refused, "
          "%(while_training)d while the trainer ran" % counts)
