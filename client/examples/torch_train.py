#!/usr/bin/env python3
"""torch_train.py - the example GPT in PyTorch, trained through scaped with
scape.torch.ScapeOptimizer: the same character-level model and fortunes
corpus (with the same train/validation split) as gpt_train.c, for machines
with PyTorch, and for GPUs once libscape's CUDA buffers exist.

    scape-run --nproc-per-node 4 --set rho=0.01 --set max_grad_norm=1.0 -- \
        python3 client/examples/torch_train.py --corpus fortunes.txt --steps 1000

or one per trainer slot by hand, with --endpoint and --index.  As LLM
recipes do, it decays the matrices but not the biases, norms and embeddings
(two parameter groups), states the daemon's gradient clipping bound
(--max-grad-norm, checked at attach), runs the forward pass under bf16
autocast (--autocast bf16), and evaluates every --eval-every steps on fixed,
evenly spaced validation windows.  Each trainer's data order comes from its
--seed (default 1 + RANK, which scape-run sets).
ScapeOptimizer re-points every parameter and its .grad into libscape's flat
shared buffers, so backward() writes straight into the memory the daemon
reduces, and optimizer.step() returns with the updated parameters in place.
On CUDA the flat buffers are libscape's CUDA IPC buffers (unverified on a
GPU so far)."""
import argparse
import hashlib
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
    """B random windows of T tokens and their next tokens: any of the
    len(tokens) - T starts, as gpt_data.c's gpt_batch."""
    starts = torch.randint(0, len(tokens) - T, (B,), generator=gen)
    x = torch.stack([tokens[s:s + T] for s in starts])
    y = torch.stack([tokens[s + 1:s + T + 1] for s in starts])
    return x.to(device), y.to(device)


def param_groups(model, weight_decay):
    """nanoGPT's split: weight decay on the matrices of the blocks and the
    head, none on biases, layer norms and the embeddings."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        emb = name.startswith(("wte.", "wpe."))
        (decay if p.dim() >= 2 and not emb else no_decay).append((name, p))
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def evaluate(model, val, ctx, windows, device, autocast):
    """Mean loss over `windows` fixed validation windows, evenly spaced over
    the split from its first to its last (the same for every run): window j
    starts at j * (len(val) - ctx - 1) // (windows - 1), as gpt_data.c's
    gpt_batch_eval places them, so that --eval-windows E*B measures what the
    C trainers' --eval-batches E of --batch B does (bench_quality: 16 x 8)."""
    last = len(val) - ctx - 1
    starts = [j * last // (windows - 1) if windows > 1 else 0 for j in range(windows)]
    x = torch.stack([val[s:s + ctx] for s in starts]).to(device)
    y = torch.stack([val[s + 1:s + ctx + 1] for s in starts]).to(device)
    with torch.no_grad(), autocast():
        return float(model(x, y))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--endpoint", default=None, help="scaped's control endpoint")
    ap.add_argument("--index", type=int, default=-1,
                    help="trainer slot on the node (default: $SCAPE_INDEX, or the lowest free)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lr-warmup", type=int, default=20)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1 + int(os.environ.get("RANK", "0")),
                    help="this trainer's data order (default 1 + $RANK)")
    ap.add_argument("--weight-decay", type=float, default=0.1,
                    help="of the matrices (biases, norms, embeddings: none)")
    ap.add_argument("--max-grad-norm", type=float, default=None,
                    help="the clipping bound the daemon must apply (its max_grad_norm)")
    ap.add_argument("--bucket-mb", type=float, default=None,
                    help="hand the gradients over in buckets of about this many MB as "
                         "backward() produces them (0: all at step(); default: "
                         "$SCAPE_BUCKET_MB, else ScapeOptimizer's measured default)")
    ap.add_argument("--autocast", choices=("none", "bf16"), default="none",
                    help="run the forward pass under bf16 autocast")
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--save", help="checkpoint file (torch.save of the model's and the "
                                   "optimizer's state_dict): resumed from when it exists; "
                                   "the daemon needs a checkpoint_dir")
    ap.add_argument("--save-every", type=int, default=0, help="steps between checkpoints")
    ap.add_argument("--stop-at", type=int, default=0,
                    help="stop after this step (a job's time limit), the schedule still "
                         "that of --steps")
    ap.add_argument("--model-seed", type=int, default=1234)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--out", help="write the final parameters here (raw float32, layout order)")
    a = ap.parse_args()

    vocab, train, val = load_corpus(a.corpus)
    torch.manual_seed(a.model_seed)
    model = GPT(vocab, a.ctx, a.d, a.layers, a.heads).to(a.device)
    opt = scape.torch.ScapeOptimizer(param_groups(model, a.weight_decay), endpoint=a.endpoint,
                                     lr=a.lr, index=a.index, max_grad_norm=a.max_grad_norm,
                                     bucket_mb=a.bucket_mb)

    def autocast():
        return torch.autocast(device_type=torch.device(a.device).type, dtype=torch.bfloat16,
                              enabled=a.autocast == "bf16")
    # Resuming.  Daemons started with --resume (a requeued job: SCAPE_RESUME)
    # have restored their newest checkpoint already, and resumed_step says
    # which step that is; the data position and the schedule follow from it
    # (first below).  --save's state_dict is loaded only when it is of that
    # step (a no-op for the optimizer) or when the daemons start afresh (they
    # then restart from its checkpoint): never an older one over a newer state.
    resumed = opt.resumed_step
    saved = torch.load(a.save) if a.save and os.path.exists(a.save) else None
    if saved is not None and (resumed == 0 or saved["step"] == resumed):
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        print("torch_train: resumed from %s (step %d)" % (a.save, saved["step"]), flush=True)
    elif resumed:
        print("torch_train: the daemons resumed from their checkpoint of step %d%s" % (
            resumed, "" if saved is None else "; %s (step %d) is not loaded over it" % (
                a.save, saved["step"])), flush=True)
    first = opt.session.next_step
    print("torch_train: N=%d, vocab %d, steps %d..%d on %s" % (
        sum(p.numel() for p in model.parameters()), vocab, first, a.steps, a.device))
    t0 = time.time()
    last = min(a.steps, a.stop_at) if a.stop_at else a.steps
    loss = None  # a run resumed after its last step (a late requeue) has none to take
    for t in range(first, last + 1):
        gen = torch.Generator().manual_seed(a.seed * 1000003 + t)  # resumable
        x, y = batch(train, a.batch, a.ctx, gen, a.device)
        if t == first:  # which data this trainer has (tests/slurm/template.sh compares them)
            print("torch_train: first batch sha256 %s rank %s" % (hashlib.sha256(
                x.cpu().numpy().tobytes()).hexdigest(), os.environ.get("RANK", "0")), flush=True)
        opt.zero_grad()
        with autocast():
            loss = model(x, y)
        loss.backward()
        for g in opt.param_groups:  # one schedule for both groups
            g["lr"] = lr_at(a, t)
        opt.step(lambda: loss)
        if a.save and a.save_every and t % a.save_every == 0 and \
                int(os.environ.get("RANK", "0")) == 0:  # one saver: every daemon writes
            # the checkpoint it names, on disk when state_dict() returns
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": t}
            torch.save(state, a.save + ".tmp")
            os.replace(a.save + ".tmp", a.save)
        if t % a.eval_every == 0 or t == last:
            vloss = evaluate(model, val, a.ctx, a.eval_windows, a.device, autocast)
            info = opt.last_info
            # wire_bytes: what this daemon moves over its links per step (the
            # ring model); bytes: the collectives' payload, every daemon's part;
            # grad_norm: the reduced mean gradient's, before the daemon clipped it
            # one write per line: trainers launched together share stdout
            sys.stdout.write("step %d  loss %.4f  val %.4f  grad norm %.3f (x%.3f)  wire %d "
                             "B/step (payload %d B)  %.1f step/s\n"
                             % (t, float(loss), vloss, info.grad_norm, info.clip,
                                info.wire_bytes, info.bytes,
                                (t - first + 1) / (time.time() - t0)))
            sys.stdout.flush()
    if a.out:
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
        flat.numpy().tofile(a.out)
    if loss is None:
        print("torch_train: steps %d..%d done: nothing was left to do" % (first, last))
    else:
        print("torch_train: steps %d..%d done, loss %.4f" % (first, last, float(loss)))
    opt.detach()


if __name__ == "__main__":
    main()
