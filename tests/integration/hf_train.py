"""One trainer of test_hf.py: a tiny Llama from a config, trained by the Hugging
Face Trainer through scape.integrations.hf on bytes of Debian's fortunes,
launched by scape-run.  Writes OUT/rRANK.json with what the test checks (the
parameters' hash, the logs, the batches it saw, its own gradients before each
step, what it saved, whether anything went distributed).  --train-again N
calls train() a second time on the same trainer, to max_steps N: the second
train()'s results are under "again" (with --again-fails that train() raises
once its optimizer is made: what was attached then), and OUT/exitRANK.json
says what was still attached after scape.integrations.hf's release() at
exit."""
import argparse
import atexit
import hashlib
import json
import os

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

AT_EXIT = {}  # main() names the file and the trainer for after_release()


@atexit.register  # before scape.integrations.hf registers its release(): runs after it
def after_release():
    if AT_EXIT:
        opt = AT_EXIT["trainer"].scape_optimizer
        with open(AT_EXIT["path"], "w") as f:
            json.dump({"attached": opt.attached, "kept": len(hf._KEPT)}, f)


import scape.integrations.hf as hf  # noqa: E402
from scape.integrations.hf import ScapeTrainer, ScapeTrainingArguments, launch  # noqa: E402

CORPUS = "/usr/share/games/fortunes/fortunes"
WINDOWS = 160  # 10 batches of 8 per trainer and epoch with 2 trainers


class Windows(torch.utils.data.Dataset):
    """Byte-level tokens (vocabulary 256) of the corpus in fixed windows."""

    def __init__(self, data, n, length):
        self.data, self.n, self.length = data, n, length
        self.stride = (len(data) - length) // n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = torch.tensor(self.data[i * self.stride:i * self.stride + self.length],
                         dtype=torch.long)
        return {"input_ids": x, "labels": x}


class Record(TrainerCallback):
    """This trainer's own gradient before each step (what backward wrote,
    before anything could clip it) and the early stop of --stop-at."""

    def __init__(self, out, rank, keep_grads, stop_at):
        self.out, self.rank, self.keep, self.stop_at = out, rank, keep_grads, stop_at
        self.local_norms, self.kept, self.first_step = {}, 0, None

    def on_train_begin(self, args, state, control, **kw):
        self.first_step = state.global_step  # after a resume: the checkpoint's

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        step = state.global_step + 1
        g = torch.cat([p.grad.detach().reshape(-1).double() for p in model.parameters()])
        self.local_norms[step] = float(g.norm())
        if self.kept < self.keep:  # the first steps of this launch
            self.kept += 1
            np.save(os.path.join(self.out, "grad_r%d_s%d.npy" % (self.rank, step)), g.numpy())

    def on_step_end(self, args, state, control, **kw):
        if self.stop_at and state.global_step == self.stop_at:
            control.should_save = True
            control.should_training_stop = True
        return control


class Fail(TrainerCallback):
    """--again-fails: train() raises after its optimizer is made."""

    def on_train_begin(self, args, state, control, **kw):
        raise RuntimeError("hf_train.py: the failing train()")


class Trainer(ScapeTrainer):
    """Notes each batch it trains on, each model it writes (save_pretrained as
    the main process) and each optimizer state_dict it takes after a step."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.batches, self.saves, self.opt_saves = [], [], []
        save = self.model.save_pretrained

        def saved(output_dir, *a, **k):
            if k.get("is_main_process", True):
                self.saves.append(os.path.basename(output_dir))
            return save(output_dir, *a, **k)
        self.model.save_pretrained = saved

    def create_optimizer(self):
        opt = super().create_optimizer()
        if not hasattr(opt, "recorded"):
            sd = opt.state_dict

            def recorded():
                if opt.last_info is not None:
                    self.opt_saves.append(opt.last_info.step)
                return sd()
            opt.state_dict, opt.recorded = recorded, True
        return opt

    def training_step(self, model, inputs, *a, **k):
        self.batches.append(hashlib.sha256(inputs["input_ids"].numpy().tobytes()).hexdigest())
        return super().training_step(model, inputs, *a, **k)


def params_hash(model):
    h = hashlib.sha256()
    for n, p in model.named_parameters():
        h.update(n.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def checkpoints(output_dir):
    """checkpoint-N -> the optimizer state_dict the Trainer saved there."""
    out = {}
    for d in sorted(os.listdir(output_dir)):
        f = os.path.join(output_dir, d, "optimizer.pt")
        if d.startswith("checkpoint-") and os.path.exists(f):
            sd = torch.load(f)
            out[d] = {k: v for k, v in sd.items() if k != "param_groups"}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-steps", type=int, default=8)
    ap.add_argument("--stop-at", type=int, default=0)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--keep-grads", type=int, default=3)
    ap.add_argument("--train-again", type=int, default=0)
    ap.add_argument("--again-fails", action="store_true")
    a = ap.parse_args()
    env_before = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    args = ScapeTrainingArguments(
        output_dir=a.output_dir, max_steps=a.steps, save_steps=a.save_steps,
        save_strategy="steps", per_device_train_batch_size=8, learning_rate=3e-3,
        lr_scheduler_type="cosine", warmup_steps=3, weight_decay=0.1, seed=42,
        max_grad_norm=a.max_grad_norm, logging_steps=1, report_to=[], use_cpu=True,
        disable_tqdm=True, dataloader_drop_last=True)
    rank = launch()["rank"]
    torch.manual_seed(1 + rank)  # each trainer its own initial model: sync makes them one
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    with open(CORPUS, "rb") as f:
        data = list(f.read(1 << 16))
    rec = Record(a.out, rank, a.keep_grads, a.stop_at)
    trainer = Trainer(model=model, args=args, train_dataset=Windows(data, WINDOWS, 33),
                      callbacks=[rec])
    trainer.train(resume_from_checkpoint=a.resume)
    res = results(a, args, trainer, rec, env_before, rank, model)
    if a.train_again:  # the same trainer again, in the same process
        opt = trainer.scape_optimizer
        res.update(attached=opt.attached, kept=kept(trainer) is opt)
        res["again"] = train_again(a, trainer, lambda: results(a, args, trainer, rec,
                                                               env_before, rank, model))
        AT_EXIT.update(trainer=trainer, path=os.path.join(a.out, "exit%d.json" % rank))
    with open(os.path.join(a.out, "r%d.json" % rank), "w") as f:
        json.dump(res, f)


def kept(trainer):
    """The optimizer scape.integrations.hf keeps attached for trainer."""
    return hf._KEPT.get(id(trainer), (None, None))[1]


def train_again(a, trainer, results):
    old = trainer.scape_optimizer
    session, before = old.session, len(trainer.batches)
    trainer.args.max_steps = a.train_again
    if a.again_fails:
        trainer.add_callback(Fail)
        try:
            trainer.train()
        except RuntimeError as e:
            new = trainer.scape_optimizer
            return {"raised": str(e), "took_over": new is not old and new.session is session,
                    "attached": new.attached, "old_attached": old.attached,
                    "kept": kept(trainer) is not None}
        raise AssertionError("hf_train.py: train() with the Fail callback returned")
    trainer.train()
    again = results()
    opt = trainer.scape_optimizer
    again.update(batches=trainer.batches[before:], same_session=opt.session is session,
                 attached=opt.attached, kept=kept(trainer) is opt,
                 lr=[l["learning_rate"] for l in again["logs"]])
    return again


def results(a, args, trainer, rec, env_before, rank, model):
    """What the test checks of the train() that just returned."""
    opt = trainer.scape_optimizer
    return {
        "rank": rank, "world": args.scape_world_size, "env_before": env_before,
        "versions": [transformers.__version__, torch.__version__],
        "hash": params_hash(model),
        "wrapped": type(trainer.model_wrapped).__name__,
        "same_model": trainer.model_wrapped is trainer.model,
        "dist_initialized": torch.distributed.is_initialized(),
        "accelerate_processes": trainer.accelerator.num_processes,
        "trainer_max_grad_norm": args.max_grad_norm,
        "scape_max_grad_norm": args.scape_max_grad_norm,
        "last_info_step": opt.last_info.step,
        "logs": [l for l in trainer.state.log_history  # this launch's training logs
                 if "loss" in l and l["step"] > rec.first_step],
        "local_norms": dict(rec.local_norms), "batches": list(trainer.batches),
        "saves": list(trainer.saves), "opt_saves": list(trainer.opt_saves),
        "checkpoints": checkpoints(a.output_dir) if rank == 0 else {},
    }


if __name__ == "__main__":
    main()
