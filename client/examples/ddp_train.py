"""A plain torchrun-style DDP training script: the starting point of
docs/porting.md, which ports it to scaped (ddp_port.py).

    torchrun --nproc-per-node 2 client/examples/ddp_train.py --steps 100
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


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

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)

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
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if rank == 0 and step % 10 == 0:
                print("step %d loss %.4f" % (step, loss.item()), flush=True)
            if step == a.steps:
                break
        epoch += 1

    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict()}, a.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
