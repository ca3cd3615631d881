"""Real training end to end, short: the example GPT (client/examples) on the
fortunes corpus, two daemons with one trainer process each (host backend
over loopback, sharded), a few hundred steps.  The model must learn: its
validation loss ends well below the unigram entropy of the corpus (computed
here, from the text), and SCAPE's ends within a loose bound of dense AdamS
trained in the same test with the same seeds."""
import collections
import math
import os
import subprocess

import pytest

from conftest import SOURCE, binary
from test_multinode import start_group

STEPS = 500
MODEL = ["--d", "32", "--layers", "1", "--heads", "2", "--ctx", "32", "--seq", "32",
         "--batch", "8", "--lr", "1e-2", "--lr-warmup", "10", "--eval-every", "100",
         "--eval-batches", "8", "--steps", str(STEPS)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("corpus") / "fortunes.txt")
    res = subprocess.run(["bash", os.path.join(SOURCE, "client", "examples",
                                               "fortunes-corpus.sh"), path],
                         capture_output=True, text=True)
    assert res.returncode == 0, "the corpus needs the Debian fortunes package " \
                                "(deploy/setup.sh installs it):\n" + res.stderr
    return path


def unigram_entropy(path):
    with open(path, "rb") as f:
        counts = collections.Counter(f.read())
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


def train(daemon_factory, tmp_path, corpus, name, flags):
    daemons = start_group(daemon_factory, [1, 1], ["--mode", "sharded", *flags])
    procs = []
    for r, d in enumerate(daemons):
        cmd = [binary("client", "examples", "gpt_train"), "--endpoint", d.endpoint,
               "--corpus", corpus, "--seed", str(1 + 1000 * r), *MODEL]
        if r == 0:
            cmd += ["--report", "--log", str(tmp_path / (name + ".csv"))]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    for p in procs:
        o, e = p.communicate(timeout=900)
        assert p.returncode == 0, o + e
    for d in daemons:
        assert d.stop() == 0, d.output()
    with open(str(tmp_path / (name + ".csv"))) as f:
        rows = [line.strip().split(",") for line in f][1:]
    assert len(rows) == STEPS
    vals = [float(r[3]) for r in rows if r[3] != "nan"]
    return [float(r[2]) for r in rows], vals, [int(r[4]) for r in rows]


def test_gpt_learns_and_scape_keeps_up_with_adams(daemon_factory, tmp_path, corpus):
    h = unigram_entropy(corpus)
    loss_d, val_d, bytes_d = train(daemon_factory, tmp_path, corpus, "adams",
                                   ["--optimizer", "adams"])
    loss_s, val_s, bytes_s = train(daemon_factory, tmp_path, corpus, "scape",
                                   ["--optimizer", "scape", "--rho", "0.05", "--warmup", "10"])
    print("unigram entropy %.3f nats; final validation loss: adams %.3f, scape %.3f; "
          "median bytes/step adams %d, scape %d" % (h, val_d[-1], val_s[-1],
                                                    sorted(bytes_d)[STEPS // 2],
                                                    sorted(bytes_s)[STEPS // 2]))
    assert loss_d[0] > h, "the untrained model should be worse than unigram"
    assert val_d[-1] < h - 0.4, "adams: %.3f is not well below %.3f" % (val_d[-1], h)
    assert val_s[-1] < h - 0.4, "scape: %.3f is not well below %.3f" % (val_s[-1], h)
    assert val_s[-1] < val_d[-1] + 0.3, "scape %.3f vs adams %.3f" % (val_s[-1], val_d[-1])
    # The steps after the warm-up send a small fraction of what dense sends.
    assert sorted(bytes_s)[STEPS // 2] < 0.25 * sorted(bytes_d)[STEPS // 2]


def test_calibrated_link_from_a_dense_probe(daemon_factory, tmp_path, corpus):
    """The demo's calibration (client/examples/calibrate_link.py) on a real
    probe: dense AdamS over loopback, gpt_train's CSV log; the rate is the
    one at which the daemon's wire bytes take 82/18 of the measured compute,
    and the derivation it prints says so."""
    import csv
    import re
    import statistics
    daemons = start_group(daemon_factory, [1, 1], ["--mode", "sharded", "--optimizer", "adams"])
    logs, procs = [str(tmp_path / ("probe%d.csv" % r)) for r in range(2)], []
    for r, d in enumerate(daemons):
        procs.append(subprocess.Popen(
            [binary("client", "examples", "gpt_train"), "--endpoint", d.endpoint, "--corpus",
             corpus, "--seed", str(1 + 1000 * r), *MODEL[:-1], "12", "--log", logs[r]],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        o, e = p.communicate(timeout=300)
        assert p.returncode == 0, o + e
    for d in daemons:
        assert d.stop() == 0, d.output()
    tool = os.path.join(SOURCE, "client", "examples", "calibrate_link.py")
    res = subprocess.run(["python3", tool, logs[0]], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    kbit = int(re.fullmatch(r"(\d+)kbit\n", res.stdout).group(1))
    with open(logs[0]) as f:
        rows = list(csv.DictReader(f))
    wall = [float(r["wall_s"]) for r in rows]
    c = statistics.median_high(wall[i] - wall[i - 1] - 1e-3 * float(rows[i]["step_ms"])
                               for i in range(5, len(rows)))
    sent = statistics.median_high(int(r["wire_bytes"]) for r in rows[5:])
    assert kbit == round(8 * sent / (c * 0.82 / 0.18) / 1e3), (kbit, sent, c)
    assert "82% of its step communicating" in res.stderr and "Mbit/s" in res.stderr
    short = subprocess.run(["python3", tool, logs[0], "--skip", "11"], capture_output=True,
                           text=True)
    assert short.returncode != 0 and "need more than" in short.stderr
