"""scape.integrations.hf - the Hugging Face Trainer with scaped as its optimizer.

    from scape.integrations.hf import ScapeTrainer, ScapeTrainingArguments
    args = ScapeTrainingArguments(output_dir="out", max_steps=1000, save_steps=100,
                                  learning_rate=3e-4, max_grad_norm=1.0)
    ScapeTrainer(model=model, args=args, train_dataset=ds).train()

run under scape-run (or a Slurm template), one process per trainer.  What it
does in the Trainer's stead (docs/python.md, "Hugging Face Trainer"):

- torch.distributed stays off: the launch's RANK, WORLD_SIZE, LOCAL_RANK
  (and the MPI/PMI variants accelerate reads) are taken out of the
  environment when ScapeTrainingArguments is made, so accelerate sees one
  process and wraps nothing in DistributedDataParallel; scaped reduces the
  gradients.  The true rank and world are in launch() and on the arguments
  (scape_rank, scape_world_size, scape_local_rank).
- the training data is sharded by that rank (torch's DistributedSampler,
  seeded with args.seed), so each trainer reads its own part;
- one trainer saves (rank 0, or local rank 0 with save_on_each_node); every
  trainer keeps its own RNG state in the checkpoint and waits for the
  daemons' checkpoint at each save; the optimizer state is the daemons'
  checkpoint, which ScapeOptimizer.state_dict() names;
- max_grad_norm is the daemon's bound: the Trainer clips nothing (its own
  max_grad_norm becomes 0) and the attach checks that the daemon clips at
  the stated value (None: whatever the daemon has);
- each training log carries the daemon's figures of the latest step
  (grad_norm before clipping, clip, density, the mean gradient's norm when
  the daemon reports it) and its bytes summed since the last log; each
  step's loss goes to the daemon, whose status shows the trainers' mean;
- train() may be called again in the same process: after a train() that
  returns, the optimizer stays attached, and the one the next train() of
  the same trainer makes takes its session over
  (scape.torch.attach_defaults(adopt=)) when its parameters, groups and
  settings are the same (otherwise the old one detaches first), so the
  trainer never leaves the job between the two; the Trainer's optimizer and
  scheduler are made anew.  After a train() that raises, the optimizer
  detaches at once, the model keeping its values.  release() (also at exit)
  detaches what is left attached.

Tested with transformers 4.47.1 and accelerate 1.2.1 on torch 1.13, and
with transformers 5.24.0 and accelerate 1.16.0 on torch 2.15 (deploy/hf-venv.sh
installs them).
"""
import atexit
import dataclasses
import os
import weakref
from typing import Optional

import torch
from torch.utils.data import DistributedSampler
from transformers import Trainer, TrainingArguments

from scape.integrations import launch_ranks
from scape.torch import ScapeOptimizer, attach_defaults

# what a launcher sets for torch.distributed, and the MPI/PMI variables
# accelerate also reads to decide it is one of several processes
_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK",
              "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
              "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
              "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALRANKID",
              "MPI_LOCALNRANKS")

_LAUNCH = {}
_KEPT = {}  # id(ScapeTrainer) -> (weak reference to it, its ScapeOptimizer still attached)


@atexit.register
def release():
    """Detach the optimizers that train() left attached for the next
    train() of their trainer (at exit, or before making a ScapeOptimizer by
    hand)."""
    while _KEPT:
        _, opt = _KEPT.popitem()[1]
        opt.detach()


def launch():
    """{"rank", "world_size", "local_rank"} of this trainer, read once from
    RANK, WORLD_SIZE and LOCAL_RANK (scape-run and the Slurm templates set
    them; without them one trainer: 0, 1, 0); the first call then removes
    the launch's torch.distributed variables from os.environ."""
    if not _LAUNCH:
        got = launch_ranks("scape.integrations.hf")
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            raise RuntimeError("scape.integrations.hf: torch.distributed is already "
                               "initialized; scaped reduces the gradients, so nothing may "
                               "init_process_group (remove it, or MASTER_ADDR, from the script)")
        _LAUNCH.update(rank=got["rank"], world_size=got["world_size"],
                       local_rank=got["local_rank"])
        for k in _DIST_VARS:
            os.environ.pop(k, None)
    return dict(_LAUNCH)


@dataclasses.dataclass
class ScapeTrainingArguments(TrainingArguments):
    """TrainingArguments for a trainer of a scaped job.

    max_grad_norm is the daemon's clipping bound (its max_grad_norm key):
    it is kept in scape_max_grad_norm, checked at attach, and the Trainer's
    own clipping is off (max_grad_norm 0).  None takes the daemon's."""
    scape_endpoint: Optional[str] = dataclasses.field(
        default=None, metadata={"help": "scaped's endpoint (None: $SCAPE_ENDPOINT)"})
    scape_timeout_ms: int = dataclasses.field(
        default=600000, metadata={"help": "bound on every wait for the daemon"})
    scape_start_wait_ms: int = dataclasses.field(
        default=0, metadata={"help": "how long to wait for a daemon still starting"})
    scape_max_grad_norm: Optional[float] = dataclasses.field(
        default=None, metadata={"help": "the daemon's clipping bound (from max_grad_norm)"})

    def __post_init__(self):
        launch()
        if self.scape_max_grad_norm is None:
            self.scape_max_grad_norm = self.max_grad_norm
        self.max_grad_norm = 0.0  # the daemon clips the reduced gradient
        super().__post_init__()

    @property
    def scape_rank(self):
        return launch()["rank"]

    @property
    def scape_world_size(self):
        return launch()["world_size"]

    @property
    def scape_local_rank(self):
        return launch()["local_rank"]

    @property
    def should_save(self):
        """One saver: rank 0 (local rank 0 of each node with save_on_each_node)."""
        return (self.scape_local_rank if self.save_on_each_node else self.scape_rank) == 0

    @property
    def should_log(self):
        if self.log_on_each_node:
            return self.scape_local_rank == 0
        return self.scape_rank == 0


class _TrainerOptimizer(ScapeOptimizer):
    """ScapeOptimizer whose closure-less step() (the Trainer's) sends the
    loss the Trainer computed for it to the daemon, and which sums the
    daemon's bytes until the next log takes them."""
    pending_loss = None
    bytes = wire_bytes = 0

    def step(self, closure=None):
        loss, self.pending_loss = self.pending_loss, None
        out = super().step(closure if closure is not None or loss is None else lambda: loss)
        self.bytes += self.last_info.bytes
        self.wire_bytes += self.last_info.wire_bytes
        return out


class ScapeTrainer(Trainer):
    """transformers.Trainer whose optimizer is scaped's (ScapeOptimizer, with
    the Trainer's decay/no-decay parameter groups, learning rate and
    scheduler).  Takes ScapeTrainingArguments; see the module's doc."""

    def __init__(self, *args, **kwargs):
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        if not isinstance(targs, ScapeTrainingArguments):
            raise TypeError("ScapeTrainer: args must be ScapeTrainingArguments (plain "
                            "TrainingArguments start torch.distributed from the launch's "
                            "RANK/WORLD_SIZE and clip locally); got %s" % type(targs).__name__)
        super().__init__(*args, **kwargs)
        if self.accelerator.num_processes != 1 or (
                torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise RuntimeError("ScapeTrainer: accelerate sees %d processes (torch.distributed "
                               "initialized: %s); under scaped each trainer is one process: "
                               "do not start it with accelerate launch or torchrun, and make "
                               "the arguments before anything initializes torch.distributed"
                               % (self.accelerator.num_processes,
                                  torch.distributed.is_initialized()))
        if self.optimizer is not None and not isinstance(self.optimizer, ScapeOptimizer):
            raise TypeError("ScapeTrainer: optimizers=(%s, ...): the optimizer is scaped's; "
                            "pass None (or a ScapeOptimizer)" % type(self.optimizer).__name__)
        self.scape_optimizer = self.optimizer

    def _no_optimizer_placement(self):
        """accelerate's prepare() would place a ScapeOptimizer's state on the
        device by a state_dict() and load_state_dict() round trip: a
        checkpoint of the daemons, which a job past its first step (a second
        train()) refuses to load.  Its state is the daemons': nothing to
        place.  Done on the accelerator of the train() about to prepare."""
        prepare = self.accelerator.prepare_optimizer
        if getattr(prepare, "scape_no_placement", False):
            return

        def prepare_optimizer(optimizer, device_placement=None, **kw):
            if isinstance(optimizer, ScapeOptimizer):
                device_placement = False
            return prepare(optimizer, device_placement=device_placement, **kw)
        prepare_optimizer.scape_no_placement = True
        self.accelerator.prepare_optimizer = prepare_optimizer

    # -- the optimizer --------------------------------------------------------------
    def create_optimizer(self):
        self._no_optimizer_placement()
        if self.optimizer is None:
            decay = set(self.get_decay_parameter_names(self.model))
            named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
            groups = [{"params": [(n, p) for n, p in named if n in decay],
                       "weight_decay": self.args.weight_decay},
                      {"params": [(n, p) for n, p in named if n not in decay],
                       "weight_decay": 0.0}]
            a = self.args
            kept = self._take_kept()
            try:
                with attach_defaults(adopt=kept):
                    self.optimizer = _TrainerOptimizer(
                        [g for g in groups if g["params"]], endpoint=a.scape_endpoint,
                        lr=a.learning_rate, timeout_ms=a.scape_timeout_ms,
                        start_wait_ms=a.scape_start_wait_ms,
                        max_grad_norm=a.scape_max_grad_norm)
            finally:
                if kept is not None:
                    kept.detach()  # not taken over (a no-op when it was)
            self.scape_optimizer = self.optimizer
        return self.optimizer

    def _take_kept(self):
        """The optimizer an earlier train() of this trainer left attached
        (None if none), out of the registry; every other one there is
        detached (one attached session per process)."""
        ref, kept = _KEPT.pop(id(self), (None, None))
        if kept is not None and ref() is not self:  # a dead trainer's, whose id was reused
            kept.detach()
            kept = None
        release()
        return kept

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        opt = self.scape_optimizer
        if isinstance(opt, _TrainerOptimizer):
            v = float(loss.detach())
            opt.pending_loss = v if opt.pending_loss is None else opt.pending_loss + v
        return loss

    def train(self, *args, **kwargs):
        """Trainer.train.  When it returns, the optimizer stays attached (in
        the registry release() empties at exit), so that the next train()'s
        optimizer takes its session over and the trainer never leaves the
        job; when it raises, the optimizer detaches from scaped at once (the
        model keeps its values).  Either way the Trainer's optimizer and
        scheduler are dropped: the next train() makes them anew."""
        try:
            out = super().train(*args, **kwargs)
        except BaseException:
            self._end_train(keep=False)
            raise
        self._end_train(keep=True)
        return out

    def _end_train(self, keep):
        opt = self.scape_optimizer
        if opt is None:
            return
        _KEPT.pop(id(self), None)
        if keep and opt.attached:
            _KEPT[id(self)] = (weakref.ref(self), opt)
        else:
            opt.detach()
        self.optimizer = self.lr_scheduler = None

    # -- data -------------------------------------------------------------------------
    def _get_train_sampler(self, *args, **kwargs):
        # newer transformers pass the dataset, 4.47 does not
        ds = args[0] if args else kwargs.get("train_dataset")
        ds = self.train_dataset if ds is None else ds
        if ds is None or not hasattr(ds, "__len__"):
            return None  # an iterable dataset: the script shards it (docs/python.md)
        return DistributedSampler(ds, num_replicas=self.args.scape_world_size,
                                  rank=self.args.scape_rank, shuffle=True,
                                  seed=self.args.seed, drop_last=self.args.dataloader_drop_last)

    # -- who saves and logs ---------------------------------------------------------
    def is_world_process_zero(self):
        return self.args.scape_rank == 0

    def is_local_process_zero(self):
        return self.args.scape_local_rank == 0

    def _save_optimizer_and_scheduler(self, output_dir):
        """The saver writes the optimizer's state_dict (which names the
        daemons' checkpoint); every other trainer takes it too and so waits
        until the daemons have written that checkpoint: no trainer leaves
        the job (and, under scape-run, stops its node's daemon) while
        another daemon still needs its daemon for the checkpoint, the last
        step's included."""
        if not self.args.should_save and self.optimizer is not None:
            self.optimizer.state_dict()
        return super()._save_optimizer_and_scheduler(output_dir)

    def _rng_dir(self, checkpoint):
        return os.path.join(checkpoint, "rng_state_rank%d" % self.args.scape_rank)

    def _save_rng_state(self, output_dir):
        """Each trainer its own (the Trainer, seeing one process, would have
        every trainer write the same rng_state.pth)."""
        super()._save_rng_state(self._rng_dir(output_dir))

    def _load_rng_state(self, checkpoint):
        if checkpoint is not None:
            super()._load_rng_state(self._rng_dir(checkpoint))

    # -- logs -----------------------------------------------------------------------
    def log(self, logs, *args, **kwargs):
        opt = self.scape_optimizer
        info = getattr(opt, "last_info", None)
        if info is not None and "loss" in logs:
            logs.update(grad_norm=info.grad_norm, clip=info.clip, scape_step=info.step,
                        scape_density=info.density)
            mean = getattr(info, "mean_grad_norm", -1.0)
            if mean >= 0:  # what torch's clip_grad_norm_ would have measured
                logs["scape_mean_grad_norm"] = mean
            if isinstance(opt, _TrainerOptimizer):
                logs.update(scape_bytes=opt.bytes, scape_wire_bytes=opt.wire_bytes)
                opt.bytes = opt.wire_bytes = 0
        return super().log(logs, *args, **kwargs)
