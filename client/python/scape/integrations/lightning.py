"""scape.integrations.lightning - Lightning's Trainer with scaped as its optimizer.

    from scape.integrations.lightning import ScapeStrategy
    from scape.torch import ScapeOptimizer

    class Model(lightning.pytorch.LightningModule):
        def configure_optimizers(self):
            return ScapeOptimizer(self.named_parameters(), lr=1e-3)

    trainer = lightning.pytorch.Trainer(strategy=ScapeStrategy(), accelerator="cpu",
                                        devices=1, gradient_clip_val=1.0)
    trainer.fit(Model(), datamodule)

run under scape-run (or a Slurm template), one process per trainer.  What
the strategy does (docs/python.md, "Lightning"):

- each trainer is its true global rank of the job's world, from RANK,
  WORLD_SIZE, LOCAL_RANK and NODE_RANK (scape-run and the Slurm templates
  set them), and rank_zero_only follows it;
- torch.distributed stays off: no process group, no DistributedDataParallel
  around the model; scaped reduces the gradients.  There is no collective
  either: reduce(), broadcast() and barrier() are each trainer's own
  (sync_dist=True logs this trainer's value; a decision such as early
  stopping must rest on values equal on every trainer);
- Lightning shards the training data with its DistributedSampler by that
  rank and world size, so each trainer reads its own part;
- one saver: only global rank 0 writes checkpoint files; the optimizer's
  part of them is the daemon's checkpoint, which ScapeOptimizer.state_dict()
  names (the daemon needs a checkpoint_dir while checkpointing is on);
- clipping is the daemon's: the Trainer's gradient_clip_val becomes the
  ScapeOptimizer's max_grad_norm (the attach checks that the daemon clips at
  that value) and Lightning clips no local gradient;
- fit() may be called again in the same process: after a fit the
  optimizer stays attached, and the ScapeOptimizer the next fit of the same
  module makes takes its session over (scape.torch.attach_defaults(adopt=)),
  so the trainer never leaves the job; after a failure it detaches, the
  model keeping its values; release() (also at exit) detaches the rest.

Tested with Lightning 2.6.6 on torch 2.15.0 (deploy/torch2-venv.sh installs
them); current Lightning needs torch >= 2.1, so not on Debian's torch 1.13.
"""
import atexit
import weakref

import torch

try:
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.fabric.utilities import rank_zero as _fabric_rank_zero
    from lightning.pytorch.callbacks import LearningRateFinder as _LearningRateFinder
    from lightning.pytorch.strategies import ParallelStrategy
    from lightning.pytorch.utilities import rank_zero as _rank_zero
except ImportError:  # only the standalone pytorch_lightning is installed
    from lightning_fabric.plugins.environments import ClusterEnvironment
    from lightning_fabric.utilities import rank_zero as _fabric_rank_zero
    from pytorch_lightning.callbacks import LearningRateFinder as _LearningRateFinder
    from pytorch_lightning.strategies import ParallelStrategy
    from pytorch_lightning.utilities import rank_zero as _rank_zero

from scape.integrations import launch_ranks
from scape.torch import ScapeOptimizer, attach_defaults


_LAUNCH = {}
_KEPT = {}  # id(LightningModule) -> (weak reference to it, its ScapeOptimizer still attached)


@atexit.register
def release():
    """Detach the optimizers that fits left attached for the next fit of
    their module (at exit, or before making a ScapeOptimizer by hand)."""
    while _KEPT:
        _, opt = _KEPT.popitem()[1]
        opt.detach()


def launch():
    """{"rank", "world_size", "local_rank", "node_rank"} of this trainer, read
    once from RANK, WORLD_SIZE, LOCAL_RANK and NODE_RANK (without them: one
    trainer, 0, 1, 0, 0): Lightning's own environment deletes WORLD_SIZE at
    the end of a fit.  ValueError when they do not make a rank of the world."""
    if _LAUNCH:
        return dict(_LAUNCH)
    got = launch_ranks("scape.integrations.lightning")
    _LAUNCH.update(got)
    return got


class ScapeEnvironment(ClusterEnvironment):
    """The launch's ranks (launch()) as Lightning's cluster environment: the
    processes are started outside (scape-run, srun), no rendezvous address
    is used, and nothing in os.environ is changed."""

    def __init__(self):
        self._ranks = launch()

    @property
    def creates_processes_externally(self):
        return True

    @property
    def main_address(self):
        return "127.0.0.1"  # no torch.distributed rendezvous: unused

    @property
    def main_port(self):
        return 0

    @staticmethod
    def detect():
        return True

    def world_size(self):
        return self._ranks["world_size"]

    def set_world_size(self, size):
        pass  # the launch's, whatever the Trainer's devices and num_nodes say

    def global_rank(self):
        return self._ranks["rank"]

    def set_global_rank(self, rank):
        pass

    def local_rank(self):
        return self._ranks["local_rank"]

    def node_rank(self):
        return self._ranks["node_rank"]


class ScapeStrategy(ParallelStrategy):
    """One process per trainer, on one device ("cpu", or "cuda" for cuda:
    LOCAL_RANK), with scaped as the optimizer (see the module's doc).
    endpoint, timeout_ms and start_wait_ms are the defaults of the
    ScapeOptimizer that configure_optimizers makes (None: $SCAPE_ENDPOINT,
    600 s, 0)."""

    strategy_name = "scape"

    def __init__(self, endpoint=None, timeout_ms=None, start_wait_ms=None, device="cpu",
                 accelerator=None, checkpoint_io=None, precision_plugin=None):
        got = launch()
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", got["local_rank"])
        super().__init__(accelerator=accelerator, parallel_devices=[device],
                         cluster_environment=ScapeEnvironment(),
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._attach = {k: v for k, v in (("endpoint", endpoint), ("timeout_ms", timeout_ms),
                                          ("start_wait_ms", start_wait_ms)) if v is not None}
        self._clipping = None  # the precision plugin whose clip_gradients is ours

    @property
    def root_device(self):
        return self.parallel_devices[0]

    def model_to_device(self):
        self.model.to(self.root_device)

    def reduce(self, tensor, *args, **kwargs):
        """This trainer's own value: there is no collective."""
        return tensor

    def reduce_boolean_decision(self, decision, all=True):
        return decision

    def barrier(self, *args, **kwargs):
        pass

    def broadcast(self, obj, src=0):
        return obj

    @property
    def is_distributed(self):
        """Lightning then puts a DistributedSampler on the training data."""
        return True

    @property
    def distributed_sampler_kwargs(self):
        return dict(num_replicas=self.world_size, rank=self.global_rank)

    def setup_environment(self):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            raise RuntimeError("ScapeStrategy: torch.distributed is initialized; scaped reduces "
                               "the gradients, so nothing may init_process_group (remove it "
                               "from the script)")
        _rank_zero.rank_zero_only.rank = _fabric_rank_zero.rank_zero_only.rank = self.global_rank
        super().setup_environment()

    def setup_optimizers(self, trainer):
        """configure_optimizers, with the Trainer's gradient_clip_val as the
        ScapeOptimizer's max_grad_norm; the optimizer must be one
        ScapeOptimizer, clipping by norm."""
        if any(type(cb).__name__ == "LearningRateFinder" or
               isinstance(cb, _LearningRateFinder) for cb in trainer.callbacks):
            raise ValueError("ScapeStrategy: lr_find (Tuner.lr_find, LearningRateFinder) is not "
                             "supported: its trial steps go through the daemon, which cannot "
                             "take them back when Lightning restores the model; find the "
                             "learning rate in a run with a local torch optimizer, without "
                             "ScapeStrategy")
        clip = trainer.gradient_clip_val
        algo = trainer.gradient_clip_algorithm
        if clip is not None and algo is not None and str(getattr(algo, "value", algo)) != "norm":
            raise ValueError("ScapeStrategy: gradient_clip_algorithm=%r: the daemon clips the "
                             "reduced gradient by its global norm only (use 'norm')"
                             % str(getattr(algo, "value", algo)))
        module = self.lightning_module
        ref, kept = _KEPT.pop(id(module), (None, None))
        if kept is not None and ref() is not module:  # a dead module's, whose id was reused
            kept.detach()
            kept = None
        release()  # other modules'
        with attach_defaults(max_grad_norm=None if clip is None else float(clip),
                             adopt=kept, **self._attach):
            super().setup_optimizers(trainer)
        if kept is not None:
            kept.detach()  # not taken over (a no-op when it was)
        opts = self.optimizers
        if len(opts) != 1 or not isinstance(opts[0], ScapeOptimizer):
            raise TypeError("ScapeStrategy: configure_optimizers must return one "
                            "scape.torch.ScapeOptimizer (scaped is the optimizer), got %s"
                            % (", ".join(type(o).__name__ for o in opts) or "none"))
        mgn = opts[0].max_grad_norm
        if clip is not None and mgn != float(clip):
            raise ValueError("ScapeStrategy: Trainer(gradient_clip_val=%r) but the "
                             "ScapeOptimizer states max_grad_norm=%r; the daemon clips once, "
                             "at one bound: leave max_grad_norm out of ScapeOptimizer(...)"
                             % (clip, mgn))
        self._own_clipping()

    def _own_clipping(self):
        """Lightning would clip this trainer's own gradient in the shared
        buffer before the daemon reads it: its precision plugin's
        clip_gradients becomes a check that the bound asked is the daemon's."""
        plugin = self.precision_plugin
        opt = self.optimizers[0]

        def clip_gradients(optimizer, clip_val=0.0, gradient_clip_algorithm=None):
            if clip_val and float(clip_val) > 0 and float(clip_val) != opt.max_grad_norm:
                raise ValueError("ScapeStrategy: clip_gradients(%r): the daemon clips, at the "
                                 "max_grad_norm stated at attach (%r); set it through "
                                 "Trainer(gradient_clip_val=...)" % (clip_val, opt.max_grad_norm))
        plugin.clip_gradients = clip_gradients
        self._clipping = plugin

    def on_exception(self, exception):
        self._failed = True
        super().on_exception(exception)

    def teardown(self):
        """After a fit the optimizer stays attached, so that the next fit()
        of the module takes its session over and the trainer never leaves the
        job (a trainer that detached would rejoin it while the others step);
        release() detaches it at exit.  After a failure it detaches, the model
        keeping its values.  Then Lightning's teardown."""
        try:
            module = self.lightning_module
            for opt in self.optimizers:
                if not isinstance(opt, ScapeOptimizer) or not opt.attached:
                    continue
                if getattr(self, "_failed", False) or module is None:
                    opt.detach()
                else:
                    _KEPT[id(module)] = (weakref.ref(module), opt)
        finally:
            if self._clipping is not None:
                self._clipping.__dict__.pop("clip_gradients", None)
                self._clipping = None
            super().teardown()
