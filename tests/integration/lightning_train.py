#!/usr/bin/env python3
"""A LightningModule trained through scaped with ScapeStrategy, for
test_lightning.py; one process per trainer under scape-run.

It prints, per trainer, lines the test reads: "first-batch RANK HASH" (a
hash of the first training batch it sees), "wrote RANK PATH" for every
checkpoint file it writes, and at the end "result RANK key=value ..." (the
ranks and world size Lightning has, whether torch.distributed or a
DistributedDataParallel is in play, the largest norm of this trainer's own
gradient as the optimizer receives it, the smallest clip factor the daemon
applied, the daemon's last step); it writes its parameters, float32, to
--out followed by its rank.  --fit-again fits a second time in the same
process, with a new Trainer, after writing them."""
import argparse
import hashlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "client", "python"))
import lightning.pytorch as pl  # noqa: E402
from lightning.fabric.plugins import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from scape.integrations.lightning import ScapeStrategy  # noqa: E402
from scape.torch import ScapeOptimizer  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))


def say(*a):
    # one write per line: the trainers share scape-run's pipe
    sys.stdout.flush()
    os.write(1, (" ".join(str(x) for x in a) + "\n").encode())


class RecordingIO(TorchCheckpointIO):
    """Lightning's own checkpoint writer, saying which trainer wrote what."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        say("wrote", RANK, path)
        return super().save_checkpoint(checkpoint, path, storage_options)


class Regression(pl.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))
        self.first = None
        self.local_norm_max = 0.0
        self.clip_min = 1.0
        self.pre_hooks = self.post_hooks = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.first is None:
            self.first = hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16]
            say("first-batch", RANK, self.first)
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = self.opt = ScapeOptimizer(self.named_parameters(), lr=self.lr)
        opt.register_step_pre_hook(self._before_step)
        opt.register_step_post_hook(self._after_step)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                    gradient_clip_algorithm=None):
        # Lightning's clipping, then this trainer's own gradient as the daemon
        # will receive it
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in self.parameters()))
        self.local_norm_max = max(self.local_norm_max, float(norm))

    def _before_step(self, opt, args, kwargs):
        self.pre_hooks += 1

    def _after_step(self, opt, args, kwargs):
        self.post_hooks += 1
        self.clip_min = min(self.clip_min, opt.last_info.clip)
        self.daemon_step = opt.last_info.step


def data():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(96, 8, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True)) * 3.0
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8,
                                       shuffle=True)


def fit(model, a, epochs, ckpt_path=None):
    callbacks = []
    if a.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=a.ckpt_dir, save_last=True, save_top_k=-1,
                                         every_n_epochs=1))
    trainer = pl.Trainer(strategy=ScapeStrategy(checkpoint_io=RecordingIO()),
                         accelerator="cpu", devices=1, max_epochs=epochs,
                         gradient_clip_val=a.clip, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         enable_checkpointing=bool(a.ckpt_dir), callbacks=callbacks)
    trainer.fit(model, data(), ckpt_path=ckpt_path)
    return trainer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--ckpt-dir")
    ap.add_argument("--resume")
    ap.add_argument("--out", required=True)
    ap.add_argument("--fit-again", action="store_true")
    ap.add_argument("--lr-find", action="store_true")
    a = ap.parse_args()
    if a.lr_find:
        from lightning.pytorch.tuner import Tuner
        trainer = pl.Trainer(strategy=ScapeStrategy(), accelerator="cpu", devices=1,
                             max_epochs=1, logger=False, enable_checkpointing=False)
        Tuner(trainer).lr_find(Regression(a.lr), train_dataloaders=data(), num_training=5)
        return

    pl.seed_everything(1, verbose=False)  # every trainer the same initial model
    model = Regression(a.lr)
    trainer = fit(model, a, a.epochs, a.resume)
    s = trainer.strategy
    ddp = isinstance(s.model, torch.nn.parallel.DistributedDataParallel)
    say("result", RANK, "global_rank=%d world_size=%d is_global_zero=%d dist=%d ddp=%d "
        "sampler_replicas=%d local_norm_max=%.6f clip_min=%.6f step=%d hooks=%d,%d"
        % (trainer.global_rank, trainer.world_size, trainer.is_global_zero,
           torch.distributed.is_available() and torch.distributed.is_initialized(), ddp,
           s.distributed_sampler_kwargs["num_replicas"], model.local_norm_max, model.clip_min,
           model.daemon_step, model.pre_hooks, model.post_hooks))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    flat.numpy().astype("float32").tofile(a.out + str(RANK))
    if a.fit_again:
        a.ckpt_dir = None
        session = model.opt.session  # still attached, for the next fit to take over
        fit(model, a, 1)
        say("again", RANK, "step=%d same_session=%d" % (model.daemon_step,
                                                        model.opt.session is session))
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        flat.numpy().astype("float32").tofile(a.out + "again" + str(RANK))


if __name__ == "__main__":
    main()
