"""py_trainer - the Python twin of trainer_c: attaches to scaped through the
scape binding, trains the synthetic problem of synth.h with numpy (the same
float32 bits as the C code), and writes its final parameters to a file.

usage: py_trainer.py --endpoint EP --index I --n N --steps S [--seed X] [--lr LR]
                     [--sleep-ms MS] [--out FILE]
A step abandoned because another trainer died is posted again.  A trainer that
attaches to a running job starts at the daemon's next step."""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "client", "python"))
import scape  # noqa: E402

M64 = (1 << 64) - 1
SHARES = [0.40, 0.25, 0.15, 0.10, 0.05, 0.03]


def synth_layout(n):
    """synth_layout of synth.h: (name, offset, length)."""
    out, pos = [], 0
    for i, s in enumerate(SHARES):
        length = int(s * n) | 1
        out.append(("w%d" % i, pos, length))
        pos += length
    return out + [("bias", pos, 1)]


def mix(x):
    """synth_mix on a uint64 array (products wrap modulo 2^64, as in C)."""
    s33 = np.uint64(33)
    x = x ^ (x >> s33)
    x = x * np.uint64(0xff51afd7ed558ccd)
    x = x ^ (x >> s33)
    x = x * np.uint64(0xc4ceb9fe1a85ec53)
    return x ^ (x >> s33)


def unit(h):
    """synth_unit: (float)(int32_t)(h >> 40) / 8388608.0f."""
    return (h >> np.uint64(40)).astype(np.int32).astype(np.float32) / np.float32(8388608.0)


class Synth:
    """The per-element constants of synth.h for one trainer."""

    def __init__(self, seed, trainer, layout):
        n = layout[-1][1] + layout[-1][2]
        self.seed, self.trainer = seed, trainer
        self.i = np.arange(n, dtype=np.uint64)
        self.target = unit(mix(np.uint64(seed * 31 & M64) + self.i))
        self.scale = np.empty(n, dtype=np.float32)
        for l, (_, off, length) in enumerate(layout):
            self.scale[off:off + length] = np.float32(0.05) + np.float32(0.1) * np.float32(l % 3)

    def init(self):
        key = np.uint64((self.seed ^ (self.trainer << 48)) & M64)
        return np.float32(0.5) * unit(mix(key ^ (self.i + np.uint64(1))))

    def grads(self, step, p):
        key = np.uint64((self.seed ^ (step << 24) ^ (self.trainer << 56)) & M64)
        noise = unit(mix(key ^ self.i))
        return (p - self.target) * self.scale + np.float32(0.3) * noise


def step_retrying(s, t, lr):
    """Post step t, again while it is abandoned because a peer died."""
    for _ in range(100):
        try:
            return s.step(lr, step=t)
        except scape.ScapeError as e:
            if e.code != scape.Rc.REMOTE or "abandoned" not in e.message:
                raise
            print("py_trainer %d: %s; posting again" % (s.index, e.message), file=sys.stderr)
    return s.step(lr, step=t)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint")
    ap.add_argument("--index", type=int, default=-1)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=lambda v: int(v, 0), default=1)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--sleep-ms", type=int, default=0)
    ap.add_argument("--out")
    ap.add_argument("--checkpoint-at", type=int, default=0,
                    help="after this step, ask for the job's checkpoint (state_dict) and "
                         "write what identifies it to --state as JSON")
    ap.add_argument("--state", help="that JSON file (written, or read by --resume)")
    ap.add_argument("--resume", action="store_true",
                    help="before the first step, restart the job from --state's checkpoint")
    ap.add_argument("--groups", help="parameter groups' weight decays, e.g. 0.1,nan "
                                     "(reference.c's rule: tensor l in group l %% G, group "
                                     "g's lr (1 + g) * lr)")
    return ap.parse_args(argv)


def train(a):
    layout = synth_layout(a.n)
    groups = [None if w == "nan" else float(w) for w in a.groups.split(",")] if a.groups \
        else None
    s = scape.attach(a.endpoint, layout, index=a.index, groups=groups,
                     tensor_groups=[l % len(groups) for l in range(len(layout))]
                     if groups else None)
    lr = [(1 + g) * a.lr for g in range(len(groups))] if groups else a.lr
    a.index = s.index
    synth = Synth(a.seed, s.index, layout)
    s.params[:] = synth.init()
    s.sync()
    if a.resume:
        with open(a.state) as f:
            st = json.load(f)
        s.resume(st["dir"], st["step"], st["layout_hash"])
    first = s.next_step
    for t in range(first, a.steps + 1):
        s.grads[:] = synth.grads(t, s.params)
        step_retrying(s, t, lr)
        if t == a.checkpoint_at:
            with open(a.state, "w") as f:
                json.dump(s.checkpoint(), f)
        if a.sleep_ms:
            time.sleep(a.sleep_ms / 1000)
    if a.out:
        s.params.tofile(a.out)
    print("py_trainer %d: steps %d..%d done, N=%d" % (s.index, first, a.steps, s.numel))
    s.detach()


def main(argv):
    a = parse(argv)
    try:
        train(a)
    except scape.ScapeError as e:
        print("py_trainer %d: %s" % (a.index, e), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
