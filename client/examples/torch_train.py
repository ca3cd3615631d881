#!/usr/bin/env python3
"""torch_train.py - the example GPT in PyTorch, trained through scaped with
scape.torch.ScapeOptimizer: the same character-level model and fortunes
corpus (with the same train/validation split) as gpt_train.c, for machines
with PyTorch, and for GPUs once libscape's CUDA buffers exist.

    python3 client/examples/torch_train.py --corpus fortunes.txt \
        [--endpoint ipc:///tmp/scape-job42-n1/control] [--steps 1000] [--device cpu]

Run one per trainer slot; each uses its own --seed for its data order.
ScapeOptimizer re-points every parameter and its .grad into libscape's flat
shared buffers, so backward() writes straight into the memory the daemon
reduces, and optimizer.step() returns with the updated parameters in place.
On CUDA, parameters must live in the CUDA IPC buffers, which libscape does not
allocate yet: attaching raises ScapeError UNSUPPORTED there (see README)."""
import argparse
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import scape.torch  # noqa: E402

MASK64 = (1 << 64) - 1


def mix64(z):
    """splitmix64's finaliser, as gpt_data.c uses it to split the corpus."""
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def load_corpus(path):
    """Byte vocabulary and the 90/10 split by entry of gpt_data.c: an entry
    runs up to and including its line holding only '%'; entry i is in the
    validation split when mix64(i) % 10 == 0."""
    data = open(path, "rb").read()
    vocab = sorted(set(data))
    ids = {b: i for i, b in enumerate(vocab)}
    train, val, start, i, at = bytearray(), bytearray(), 0, 0, 0
    for line in data.splitlines(keepends=True):
        at += len(line)
        if line.rstrip(b"\n") == b"%" and (line.endswith(b"\n") or at == len(data)):
            (val if mix64(i) % 10 == 0 else train).extend(data[start:at])
            start, i = at, i + 1
    if start < len(data):
        (val if mix64(i) % 10 == 0 else train).extend(data[start:])
    to_ids = lambda b: torch.tensor([ids[x] for x in b], dtype=torch.long)  # noqa: E731
    return len(vocab), to_ids(train), to_ids(val)


def attention(q, k, v):
    """Causal softmax attention over [B, heads, T, dh] (PyTorch's fused kernel
    where it has one, the same arithmetic spelled out where it has not)."""
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    T = q.shape[-2]
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        shape = (B, T, self.heads, C // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        a = attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """The shape of gpt.c: token and position embeddings, pre-LN blocks, a
    final layernorm and a separate head without bias."""

    def __init__(self, vocab, ctx, d, layers, heads):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.lnf = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "ln" in name:
                nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.lnf(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def lr_at(a, t):
    if t <= a.lr_warmup:
        return a.lr * t / max(1, a.lr_warmup)
    done = min(1.0, (t - a.lr_warmup) / max(1, a.steps - a.lr_warmup))
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


def batch(tokens, B, T, gen, device):
    starts = torch.randint(0, len(tokens) - T - 1, (B,), generator=gen)
    x = torch.stack([tokens[s:s + T] for s in starts])
    y = torch.stack([tokens[s + 1:s + T + 1] for s in starts])
    return x.to(device), y.to(device)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--endpoint", default=None, help="scaped's control endpoint")
    ap.add_argument("--index", type=int, default=-1, help="trainer slot on the node")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lr-warmup", type=int, default=20)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1, help="this trainer's data order")
    ap.add_argument("--model-seed", type=int, default=1234)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--out", help="write the final parameters here (raw float32, layout order)")
    a = ap.parse_args()

    vocab, train, val = load_corpus(a.corpus)
    torch.manual_seed(a.model_seed)
    model = GPT(vocab, a.ctx, a.d, a.layers, a.heads).to(a.device)
    opt = scape.torch.ScapeOptimizer(model.named_parameters(), endpoint=a.endpoint,
                                     lr=a.lr, index=a.index)
    first = opt.session.next_step
    print("torch_train: N=%d, vocab %d, steps %d..%d on %s" % (
        sum(p.numel() for p in model.parameters()), vocab, first, a.steps, a.device))
    t0 = time.time()
    for t in range(first, a.steps + 1):
        gen = torch.Generator().manual_seed(a.seed * 1000003 + t)  # resumable
        x, y = batch(train, a.batch, a.ctx, gen, a.device)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.param_groups[0]["lr"] = lr_at(a, t)
        opt.step(lambda: loss)
        if t % a.eval_every == 0 or t == a.steps:
            with torch.no_grad():
                g = torch.Generator().manual_seed(0)
                vx, vy = batch(val, a.batch, a.ctx, g, a.device)
                vloss = float(model(vx, vy))
            info = opt.last_info
            # wire_bytes: what this daemon moves over its links per step (the
            # ring model); bytes: the collectives' payload, every daemon's part
            print("step %d  loss %.4f  val %.4f  wire %d B/step (payload %d B)  %.1f step/s"
                  % (t, float(loss), vloss, info.wire_bytes, info.bytes,
                     (t - first + 1) / (time.time() - t0)), flush=True)
    if a.out:
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
        flat.numpy().tofile(a.out)
    print("torch_train: steps %d..%d done, loss %.4f" % (first, a.steps, float(loss)))
    opt.detach()


if __name__ == "__main__":
    main()
