"""Bucketed hand-over (scape_post_tensors) with real daemons and C trainers:
the buckets are packed before the step (the status says how many tensors),
and the parameters are bitwise the in-process engine's, whatever the order
the trainers post their buckets in; a trainer that dies between buckets is
named and its step abandoned; posts a daemon cannot take fail the step,
naming why."""
import os
import subprocess
import time

import pytest
import zmq

import pbwire
from conftest import SOURCE, binary, free_endpoints, run_reference, synth_layout
from test_service import Buffers, Probe

INVALID = 1
ENGINE = ["--rho", "0.01", "--warmup", "3"]


def read(path):
    with open(path, "rb") as f:
        return f.read()


def trainer(endpoint, index, n, steps, out, seed, *extra):
    return subprocess.Popen([binary("tests", "integration", "trainer_c"), "--endpoint", endpoint,
                             "--index", str(index), "--n", str(n), "--steps", str(steps),
                             "--seed", str(seed), "--out", out, *map(str, extra)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def phases(d):
    """The daemon's last step's Phases."""
    status, msg, _, done = pbwire.query_status(d.status_endpoint)
    assert status == 0, msg
    return pbwire.parse(done[2][0])


def early_tensors(d):
    """Tensors the daemon packed before its last step's Steps came (Phases 14)."""
    return phases(d).get(14, [0])[0]


def early_chunks(d):
    """reduce_chunk: (chunks reduced before the Steps came, chunks) of the
    daemon's last step (Phases 15, 16)."""
    ph = phases(d)
    return ph.get(15, [0])[0], ph.get(16, [0])[0]


def group(daemon_factory, trainers, extra):
    if len(trainers) == 1:
        return [daemon_factory(*ENGINE, *extra, "--trainers", str(trainers[0]))]
    coord = free_endpoints(1)[0]
    return [daemon_factory(*ENGINE, *extra, "--world", str(len(trainers)), "--rank", str(r),
                           "--coordinator", coord, "--listen", "tcp://127.0.0.1:*",
                           "--job", "7", "--trainers", str(t), "--comm-timeout-ms", "20000")
            for r, t in enumerate(trainers)]


# (optimizer, mode, trainers per daemon, buckets, orders, executor,
# reduce_chunk): every trainer of a rank posts in an order of its own (mix:
# shuffled per trainer and step)
CASES = [
    ("scape", "sharded", [1, 3, 1], 3, ["mix", "rev", "fwd"], "host", 0),
    ("scape", "replicated", [3], 7, ["fwd", "mix", "rev"], "host", 0),
    ("adamw", "replicated", [1, 1, 1, 1], 4, ["mix"], "host", 0),
    ("adams", "sharded", [2, 1, 1], 2, ["rev", "mix"], "host", 0),
    # the cuda executor's code on the CPU, the residual streamed in chunks
    ("scape", "sharded", [2, 1], 3, ["mix"], "sim", 0),
    # the reduction in chunks, each sent once its buckets are in
    ("scape", "sharded", [1, 3, 1], 3, ["rev", "mix", "fwd"], "host", 1000),
    ("adamw", "replicated", [1, 2], 4, ["mix", "rev"], "host", 700),
]


@pytest.mark.parametrize("optimizer,mode,trainers,buckets,orders,executor,chunk", CASES)
def test_buckets_equal_the_engine_bitwise(daemon_factory, tmp_path, optimizer, mode, trainers,
                                          buckets, orders, executor, chunk):
    n, steps = 6000, 50
    extra = ["--optimizer", optimizer, "--mode", mode, "--executor", executor,
             "--residual-chunk", "1000", "--reduce-chunk", str(chunk)]
    daemons = group(daemon_factory, trainers, extra)
    procs, outs = [], []
    for r, (d, t) in enumerate(zip(daemons, trainers)):
        for j in range(t):
            outs.append(str(tmp_path / ("r%d-t%d" % (r, j))))
            procs.append(trainer(d.endpoint, j, n, steps, outs[-1], 1 + 1000 * r,
                                 "--buckets", buckets, "--bucket-order", orders[j % len(orders)]))
    for p in procs:
        o, e = p.communicate(timeout=600)
        assert p.returncode == 0, o + e
    for d in daemons:
        assert early_tensors(d) > 0, "nothing was packed before the step"
        if chunk:
            went, chunks = early_chunks(d)
            assert chunks > 1 and went > 0, "no chunk reduced before the step: %d of %d" % (
                went, chunks)
    run_reference(str(tmp_path / "ref"), ",".join(map(str, trainers)), n, steps, *ENGINE,
                  "--optimizer", optimizer, "--mode", mode)
    ref = read(tmp_path / "ref")
    for o in outs:
        assert read(o) == ref, "%s differs from the in-process engine" % o
    for d in daemons:
        assert d.stop() == 0, d.output()


def test_trainer_dying_between_buckets_is_named_and_its_step_abandoned(daemon_factory,
                                                                       tmp_path):
    """Trainer 1 posts two buckets of the last step (after trainer 0 has
    posted all of it, so they are packed early) and exits: the daemon names
    it, undoes the early packs, and trainer 0's step runs again with it
    alone; bitwise the in-process engine whose second trainer leaves then."""
    n, steps = 6000, 12
    d = daemon_factory(*ENGINE, "--trainers", "2")
    t0 = trainer(d.endpoint, 0, n, steps, str(tmp_path / "t0"), 1, "--buckets", 3)
    t1 = trainer(d.endpoint, 1, n, steps, str(tmp_path / "t1"), 1, "--buckets", 3,
                 "--die-after-buckets", 2, "--sleep-ms", 150)
    o1, e1 = t1.communicate(timeout=300)
    assert t1.returncode == 3, o1 + e1
    o0, e0 = t0.communicate(timeout=300)
    assert t0.returncode == 0, o0 + e0
    log = d.output()
    assert "trainer 1 " in log and "died" in log, log
    assert "undid the early packs" in log, log
    run_reference(str(tmp_path / "ref"), 2, n, steps, *ENGINE, "--members",
                  "1:2,%d:1" % steps)
    assert read(tmp_path / "t0") == read(tmp_path / "ref"), "trainer 0 differs"
    assert d.stop() == 0


def test_chunks_reduced_before_a_trainer_dies_are_kept(daemon_factory, tmp_path):
    """Two daemons reducing in chunks: rank 1's trainer posts two buckets of
    the last step, the last layers first (their chunks are reduced with
    rank 0 at once), and exits.  Rank 1 names it, keeps the reduced chunks
    (undoing only the rest), and a replacement trainer's step completes the
    others; rank 0, which waited in the next chunk, finishes; both ranks
    end with the same parameters."""
    n, steps = 6000, 12
    coord = free_endpoints(1)[0]
    daemons = [daemon_factory(*ENGINE, "--mode", "sharded", "--reduce-chunk", "1000",
                              "--world", "2", "--rank", str(r), "--coordinator", coord,
                              "--listen", "tcp://127.0.0.1:*", "--job", "7", "--trainers", "1",
                              "--comm-timeout-ms", "60000") for r in range(2)]
    t0 = trainer(daemons[0].endpoint, 0, n, steps, str(tmp_path / "t0"), 1, "--buckets", 3,
                 "--bucket-order", "rev")
    t1 = trainer(daemons[1].endpoint, 0, n, steps, str(tmp_path / "dead"), 1001, "--buckets", 3,
                 "--bucket-order", "rev", "--die-after-buckets", 2, "--sleep-ms", 150)
    o1, e1 = t1.communicate(timeout=300)
    assert t1.returncode == 3, o1 + e1
    deadline = time.time() + 60
    while daemons[1].trainers():  # its slot is free again
        assert time.time() < deadline, "rank 1 never noticed its trainer's death"
        time.sleep(0.01)
    t2 = trainer(daemons[1].endpoint, 0, n, steps, str(tmp_path / "t2"), 1001, "--buckets", 3)
    for p in (t0, t2):
        o, e = p.communicate(timeout=300)
        assert p.returncode == 0, o + e
    log = daemons[1].output()
    assert "died" in log, log
    assert "were reduced already" in log, log
    assert read(tmp_path / "t0") == read(tmp_path / "t2"), "the ranks' parameters differ"
    for d in daemons:
        assert d.stop() == 0, d.output()


def test_posts_the_daemon_refuses_fail_the_step_naming_them(daemon_factory):
    """A raw peer's Posts (one-way) that the daemon cannot take: each is
    refused and the peer's Step is answered with the reason; after that a
    good bucketed step goes through."""
    n = 1000
    d = daemon_factory(*ENGINE, "--trainers", "1")
    layout = synth_layout(n)
    total = sum(t[2] for t in layout)
    ctx = zmq.Context()
    p = Probe(ctx, d.endpoint)
    bufs = Buffers(4 * total)
    try:
        assert p.ask(pbwire.hello(os.getpid(), name="poster"))[0] == 0
        status, msg, _ = p.ask(pbwire.register(layout, *bufs.handles()))
        assert status == 0, msg
        assert p.ask(pbwire.sync())[0] == 0
        bad = [(pbwire.post(1, 5, 9), "tensors [5, 5 + 9) of step 1: the layout has "
                                      "tensors [0, %d)" % len(layout)),
               (pbwire.post(1, 0, 0), "tensors [0, 0 + 0)"),
               (pbwire.post(7, 0, 1), "tensors of step 7, but the next step is 1"),
               (pbwire.post(1, 0, 2) + b"", None),  # good, then overlapped:
               (pbwire.post(1, 1, 1), "tensor 1 (w1) of step 1 posted twice")]
        for frame, needle in bad:
            p.sock.send(frame)
            if needle is None:
                continue
            p.refused(INVALID, needle, pbwire.step(1))
        for first in range(len(layout)):  # one tensor a bucket, then the step
            p.sock.send(pbwire.post(1, first, 1))
        status, msg, _ = p.ask(pbwire.step(1))
        assert status == 0, msg
        assert early_tensors(d) == len(layout)
        assert p.ask(pbwire.detach())[0] == 0
        log = d.output()
        assert log.count("refused a post from trainer 0") == 4, log
    finally:
        bufs.close()
        p.close()
        ctx.term()
    assert d.stop() == 0


def test_gpt_train_posting_each_layer_equals_the_whole_hand_over(daemon_factory, tmp_path):
    """The example GPT with --buckets (each layer's gradients posted as
    backward makes them), two daemons, sharded: the same parameters, bit for
    bit, as without, and the daemons packed the buckets before the step."""
    from test_gpt_training import MODEL
    corpus = str(tmp_path / "fortunes.txt")
    res = subprocess.run(["bash", os.path.join(SOURCE, "client", "examples",
                                               "fortunes-corpus.sh"), corpus],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    model = list(MODEL) + ["--layers", "2", "--steps", "30"]
    got = {}
    for flags in ([], ["--buckets"]):
        daemons = group(daemon_factory, [1, 1], ["--mode", "sharded"])
        procs, outs = [], []
        for r, d in enumerate(daemons):
            outs.append(str(tmp_path / ("gpt%d-%d" % (len(flags), r))))
            procs.append(subprocess.Popen(
                [binary("client", "examples", "gpt_train"), "--endpoint", d.endpoint,
                 "--corpus", corpus, "--seed", str(1 + 1000 * r), *model, "--out", outs[-1],
                 *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for p in procs:
            o, e = p.communicate(timeout=600)
            assert p.returncode == 0, o + e
        early = [early_tensors(d) for d in daemons]
        assert (min(early) > 0) == bool(flags), early
        for d in daemons:
            assert d.stop() == 0, d.output()
        got[len(flags)] = [read(o) for o in outs]
    assert got[0][0] == got[0][1] and got[1] == got[0], "bucketed GPT differs"
