"""sd_trainer.py - a small torch model trained through ScapeOptimizer, for
test_state_dict.py: it calls state_dict()/load_state_dict() where the test
says and reports what it saw, one JSON object a line on stdout.

    sd_trainer.py --endpoint E --steps 12 [--before-noop] [--save-at T:FILE]...
                  [--load FILE]... [--out FILE]

Step t's data comes from (--seed, t) alone, so a resumed run sees the data an
uninterrupted one does.  The script needs torch and numpy (/usr/bin/python3).
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "client", "python"))
import scape  # noqa: E402
import scape.torch  # noqa: E402


def say(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def on_disk(sd):
    """The files of the checkpoint a state_dict names, as they are now."""
    d = sd["scaped_checkpoint"]
    return sorted(os.listdir(d)) if d and os.path.isdir(d) else []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--steps", type=int, required=True, help="the last step")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--before-noop", action="store_true",
                    help="state_dict() then load_state_dict() of it before step 1, as "
                         "accelerate does")
    ap.add_argument("--save-at", action="append", default=[],
                    help="T:FILE: torch.save(state_dict()) after step T")
    ap.add_argument("--load", action="append", default=[],
                    help="torch.load a state_dict and load_state_dict it before step 1 "
                         "(in the order given; a refusal is reported, and the next tried)")
    ap.add_argument("--out", help="the final parameters, raw float32")
    a = ap.parse_args()

    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4))
    opt = scape.torch.ScapeOptimizer(
        [{"params": list(model[0].named_parameters(prefix="0")), "weight_decay": 0.1},
         {"params": list(model[2].named_parameters(prefix="2")), "weight_decay": 0.0}],
        endpoint=a.endpoint, lr=0.02, timeout_ms=60000)
    say(event="attached", next_step=opt.session.next_step, resumed_step=opt.resumed_step)
    if a.before_noop:
        sd = opt.state_dict()
        opt.load_state_dict(sd)
        say(event="before", state_dict={k: v for k, v in sd.items() if k != "state"},
            next_step=opt.session.next_step)
    for path in a.load:
        sd = torch.load(path)
        try:
            opt.load_state_dict(sd)
            say(event="loaded", step=sd["step"], next_step=opt.session.next_step)
        except scape.ScapeError as e:
            say(event="refused", step=sd["step"], message=e.message,
                next_step=opt.session.next_step)
    saves = {int(s.split(":", 1)[0]): s.split(":", 1)[1] for s in a.save_at}
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(11))
    y = torch.randn(256, 4, generator=torch.Generator().manual_seed(12))
    for t in range(opt.session.next_step, a.steps + 1):
        rows = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(
            a.seed * 100003 + t))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        for g in opt.param_groups:
            g["lr"] = 0.02 / (1 + 0.1 * t)
        opt.step()
        if t in saves:
            sd = opt.state_dict()
            files = on_disk(sd)  # before anything else can write them
            torch.save(sd, saves[t] + ".tmp")
            os.replace(saves[t] + ".tmp", saves[t])
            say(event="saved", at=t, step=sd["step"], dir=sd["scaped_checkpoint"],
                name=sd["checkpoint_name"], job=sd["job"], files=files)
    if a.out:
        with torch.no_grad():
            torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tofile(a.out)
    say(event="done", last=a.steps)
    opt.detach()


if __name__ == "__main__":
    main()
