"""ddp_train.py ported to scaped (docs/porting.md shows the diff): the same
model, data and loop, with scaped in the place of DDP and AdamW.

    scape-run --nproc-per-node 2 --set optimizer=adamw --set max_grad_norm=1.0 \
        --set checkpoint_dir=ckpt -- python3 client/examples/ddp_port.py --steps 100
"""
import argparse
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from scape.torch import ScapeOptimizer


def dataset(n=4096, d=32):
    """A fixed regression problem: y = tanh(x w) + noise."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g)
    y = (x @ torch.randn(d, 1, generator=g)).tanh() + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--save", default="ckpt.pt")
    a = ap.parse_args()

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    opt = ScapeOptimizer(model.named_parameters(), lr=a.lr, weight_decay=0.01,
                         max_grad_norm=1.0)

    data = dataset()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)
    step, epoch = 0, 0
    while step < a.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step(lambda: loss)
            step += 1
            if rank == 0 and step % 10 == 0:
                print("step %d loss %.4f" % (step, loss.item()), flush=True)
            if step == a.steps:
                break
        epoch += 1

    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, a.save)
    opt.detach()


if __name__ == "__main__":
    main()
