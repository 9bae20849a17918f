"""Adapt a checkpoint into a block-diffusion Clover: ``clover-lab adapt``.

    clover-lab adapt --init DIR --data FILES --out DIR [--train preview|lora|all] [--steps N] [--seed S]
    torchrun --nproc-per-node 8 -m clover_lab.train.adapt --init ... (the same, sharded with FSDP2)

Continues from ``--init`` (an autoregressive Qwen3.5/3.6-MoE checkpoint, or a Clover to fine-tune)
with the block-diffusion objective ``clover-lab train`` uses (``objective.block_diffusion_loss``),
optionally mixing in a self-distillation corpus (``--distill``). ``--train`` chooses what learns:
``preview`` the preview parameters only (the causal path, and so AR decoding, stays bit for bit
the init's), ``lora`` low-rank adapters on chosen projections plus the preview parameters, ``all``
everything. The global batch is drawn from one generator on every process and each process runs
its rows, so loss, gradients and data order do not depend on the number of processes.

``--out`` becomes a Clover model directory (config.json with block_size and mask_token_id, the
weights, the tokenizer with its mask token, generation_config.json); the run's own files live in
``OUT/training/`` (token streams, DCP checkpoints, state, loss log). Rerunning the command resumes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..loading import PREVIEW_PARAMS, load_config, load_generation_config, load_tokenizer, resolve_dtype
from ..model import CloverModel
from . import lora as lora_
from .corpus import encode_files, split_files, text_files
from .loop import distill_corpus, lr_at, training_batch
from .mask_token import ensure_mask_token
from .objective import TrainSettings, block_diffusion_loss
from .shard import Shard, from_environment, full_state_dict, load_checkpoint, save_checkpoint, shard_model

MODES = ("preview", "lora", "all")
DEFAULT_LR = {"lora": 1e-3, "all": 3e-4}  # for the init's weights (adapters); new parameters: preview_lr
# fields that fix what a run computes: a resumed run must be given the same
EMBEDDING = "model.embed_tokens.weight"
RUN_FIELDS = ("init", "train", "block_size", "reset_preview", "lora_rank", "lora_alpha", "lora_targets", "dtype",
              "preview_lr")


@dataclass
class AdaptSettings:
    init: str
    train: str = "preview"
    block_size: int | None = None  # default: the init's config
    reset_preview: bool = False  # start the preview parameters from the spec's defaults
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_targets: list[str] = field(default_factory=lambda: list(lora_.DEFAULT_TARGETS))
    dtype: str = "float32"
    preview_lr: float = 1e-2  # the preview parameters and the mask token's row start from defaults: larger steps


class Run:
    """One adaptation run's files under ``OUT/training``."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.dir = self.out / "training"
        self.state = self.dir / "state.pt"
        self.data = self.dir / "data.pt"
        self.tokenizer = self.dir / "tokenizer"
        self.log = self.dir / "loss_log.jsonl"

    def checkpoint(self, step: int) -> Path:
        return self.dir / f"checkpoint-{step:07d}"


# --------------------------------------------------------------------------- the model
def build_model(s: AdaptSettings, tokenizer, device, seed: int = 0) -> tuple[CloverModel, list[str], str]:
    """The init's model in ``s.dtype`` with a mask token, ``s.block_size`` and, for ``lora``, its
    adapters; only the parameters ``s.train`` trains require a gradient (with ``preview`` and
    ``lora`` also the embedding, of which ``keep_mask_row`` lets only the mask token's row
    change). Returns (model, the trained parameters' names, what was done about the mask token)."""
    with warnings.catch_warnings():  # an AR init has no preview weights: that is what adapt is for
        warnings.filterwarnings("ignore", message=".*the checkpoint has no Clover preview weights")
        model = CloverModel.from_pretrained(s.init, device="cpu", dtype=resolve_dtype(s.dtype))
    if s.reset_preview:
        model.reset_preview_parameters()
    _, mask_how = ensure_mask_token(tokenizer, model)
    if s.block_size is not None:
        model.config.block_size = s.block_size
        model.config.validate()
    model.train()
    if s.train == "lora":
        lora_.add_lora(model, s.lora_targets, s.lora_rank, s.lora_alpha, seed)
    for name, p in model.named_parameters():  # (peft froze everything but its adapters)
        p.requires_grad_(s.train == "all" or ".lora_" in name or _is_preview(name) or name == EMBEDDING)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    return model.to(device), trained, mask_how


def keep_mask_row(model, mask_id: int, train: str) -> None:
    """With ``preview`` and ``lora``: the embedding's gradient zeroed but for the mask token's row,
    so that only the new token's embedding learns (with no weight decay on the embedding, Adam
    leaves rows that never had a gradient exactly as they were)."""
    if train == "all":
        return
    grad = dict(model.named_parameters())[EMBEDDING].grad
    if grad is None:
        return
    keep = torch.zeros(grad.shape[0], 1, dtype=grad.dtype)
    keep[mask_id] = 1
    if hasattr(grad, "device_mesh"):  # a DTensor: the mask sharded as the gradient is
        from torch.distributed.tensor import distribute_tensor

        keep = distribute_tensor(keep.to(grad.device), grad.device_mesh, grad.placements)
    grad.mul_(keep.to(grad.device))


def _is_preview(name: str) -> bool:
    return name.split("layers.")[-1].split(".", 1)[-1] in PREVIEW_PARAMS


def optimizer(model, names: list[str], s: AdaptSettings, settings: TrainSettings) -> torch.optim.AdamW:
    """AdamW over the trained parameters: the init's weights at ``settings.lr`` (weight decay on
    matrices but the embedding), the new ones (preview parameters; the embedding when only its
    mask row learns) at ``s.preview_lr``. Each group's ``lr_scale`` follows the schedule."""
    params = dict(model.named_parameters())
    new = [n for n in names if _is_preview(n) or (n == EMBEDDING and s.train != "all")]
    old = [n for n in names if n not in new]
    decay = [n for n in old if params[n].dim() >= 2 and "embed" not in n]
    groups = [(decay, settings.weight_decay, 1.0), ([n for n in old if n not in decay], 0.0, 1.0),
              (new, 0.0, s.preview_lr / settings.lr)]
    return torch.optim.AdamW([{"params": [params[n] for n in group], "weight_decay": wd, "lr_scale": scale}
                              for group, wd, scale in groups if group], lr=settings.lr, betas=(0.9, 0.95))


# --------------------------------------------------------------------------- data
def prepare_data(run: Run, data: list[str], pattern: str, tokenizer, shard: Shard) -> dict:
    """The token streams of ``data`` (training and held-out files), encoded once per run by the
    main process into ``OUT/training/data.pt``."""
    if shard.is_main and not run.data.exists():
        train_files, held_files = split_files(text_files(data, pattern))
        if not train_files:
            raise ValueError(f"--data {' '.join(data)}: every file fell into the held-out split; give more files")
        print(f"data: {len(train_files)} training and {len(held_files)} held-out files", flush=True)
        tokens = {"train": encode_files(tokenizer, train_files), "heldout": encode_files(tokenizer, held_files),
                  "heldout_files": [str(f) for f in held_files], "sources": list(data)}
        torch.save(tokens, run.data.with_suffix(".tmp"))
        os.replace(run.data.with_suffix(".tmp"), run.data)
    shard.barrier()
    return torch.load(run.data)


def init_tokenizer(s: AdaptSettings, tokenizer_dir: str | None):
    """The init's tokenizer (or ``tokenizer_dir``'s), as it was: every run and every resume
    derives the mask token from it the same way."""
    source = Path(tokenizer_dir or s.init)
    tokenizer = load_tokenizer(source)
    if tokenizer is None:
        raise ValueError(f"{source} has no tokenizer, which adapt needs to encode --data; "
                         f"name a directory holding one with --tokenizer")
    return tokenizer


# --------------------------------------------------------------------------- the run
class Adaptation:
    """A run in progress: the (sharded) model, its optimizer and the batch generator, at ``step``."""

    def __init__(self, run: Run, s: AdaptSettings, settings: TrainSettings, shard: Shard, tokenizer_dir=None,
                 data=(), pattern="*.py", recompute: bool = False):
        self.run, self.s, self.settings, self.shard = run, s, settings, shard
        self.tokenizer = init_tokenizer(s, tokenizer_dir)
        model, self.names, mask_how = build_model(s, self.tokenizer, shard.device, settings.seed)
        self.mask_id = model.config.mask_token_id
        if shard.is_main:
            print(f"mask token {self.tokenizer.mask_token!r} (id {self.mask_id}): {mask_how}; training {s.train}: "
                  f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,} of "
                  f"{sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
        self.tokens = prepare_data(run, list(data), pattern, self.tokenizer, shard)["train"]
        if len(self.tokens) <= settings.seq_len:
            raise ValueError(f"--data: {len(self.tokens)} training tokens, fewer than one --seq-len {settings.seq_len}")
        shard.rows(settings.batch_size)  # refuses a batch that does not split, before any work
        self.distilled = distill_corpus(settings)
        self.model = shard_model(model, shard, recompute)
        self.opt = optimizer(self.model, self.names, s, settings)
        self.gen = torch.Generator().manual_seed(settings.seed)
        self.step, self.saved, self.seconds = 0, None, 0.0  # seconds: spent in training steps, all sessions

    def resume(self, state: dict) -> None:
        load_checkpoint(self.run.checkpoint(state["step"]), self.model, self.opt, set(self.names))
        self.gen.set_state(state["generator"])
        self.step = self.saved = state["step"]
        self.seconds = state.get("train_seconds", 0.0)

    def train_step(self) -> dict:
        st = self.settings
        clean = training_batch(self.tokens, self.distilled, st, self.gen)
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, st) * group["lr_scale"]
        loss, parts = block_diffusion_loss(self.model, clean, st, self.gen, self.shard)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        keep_mask_row(self.model, self.mask_id, self.s.train)
        params = dict(self.model.named_parameters())
        norm = torch.nn.utils.clip_grad_norm_([params[n] for n in self.names], 1.0)
        self.opt.step()
        self.step += 1
        return {**parts, "grad_norm": float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)}

    def checkpoint(self) -> None:
        """DCP shards of the trained parameters and the optimizer, then (main process) the state
        that points at them, replaced atomically; older checkpoints go only after that."""
        if self.saved == self.step:
            return
        path = self.run.checkpoint(self.step)
        save_checkpoint(path, self.model, self.opt, set(self.names))
        if self.shard.is_main:
            tmp = self.run.state.with_suffix(".tmp")
            torch.save({"step": self.step, "adapt": asdict(self.s), "settings": asdict(self.settings),
                        "generator": self.gen.get_state(), "train_seconds": self.seconds}, tmp)
            os.replace(tmp, self.run.state)
            for old in self.run.dir.glob("checkpoint-*"):
                if old != path:
                    shutil.rmtree(old)
        self.saved = self.step
        self.shard.barrier()

    def train(self, minutes: float | None = None, stop_at: int | None = None, checkpoint_every: int = 100,
              log_every: int = 10) -> None:
        """Steps until the schedule ends, ``stop_at`` or ``minutes`` (all processes stop at the
        same step), checkpointing every ``checkpoint_every`` steps and at the end."""
        from tqdm.auto import tqdm

        end = min(self.settings.max_steps, stop_at or self.settings.max_steps)
        deadline = None if minutes is None else time.monotonic() + minutes * 60
        main = self.shard.is_main
        bar = tqdm(desc=f"adapt ({self.s.train})", unit="step", initial=self.step, total=end, disable=not main)
        log = open(self.run.log, "a") if main else None
        try:
            while self.step < end and not (deadline and self.shard.any(time.monotonic() > deadline)):
                t0 = time.monotonic()
                parts = self.train_step()
                self.seconds += time.monotonic() - t0
                bar.update(1)
                if main and (self.step % log_every == 0 or self.step == end):
                    bar.set_postfix(loss=f"{parts['loss']:.3f}", acc=f"{parts['mask_acc']:.3f}")
                    log.write(json.dumps({"step": self.step, "time": time.time(),
                                          "lr": lr_at(self.step - 1, self.settings), **parts}) + "\n")
                    log.flush()
                if self.step % checkpoint_every == 0:
                    self.checkpoint()
        except KeyboardInterrupt:
            if self.shard.world > 1:
                raise  # the processes stop at different points: resume from the last checkpoint
            print("\ninterrupted: saving a checkpoint to resume from", file=sys.stderr)
        finally:
            bar.close()
            if log is not None:
                log.close()
        self.checkpoint()

    def export(self) -> None:
        """The Clover directory in OUT: adapters merged, in the init's dtype, with the tokenizer
        (mask token included) and generation_config.json; written aside, then moved in."""
        state = full_state_dict(self.model, self.shard)
        if self.shard.is_main:
            if self.s.train == "lora":
                state = lora_.merged_state_dict(state, lora_.lora_scaling(self.s.lora_rank, self.s.lora_alpha))
            write_clover_dir(self.run.out, self.model.config, state, self.tokenizer, self.s.init)
        self.shard.barrier()


def write_clover_dir(out: Path, config, state: dict, tokenizer, init: str) -> None:
    """A model directory in ``out`` from a full state dict, in the dtype config.json names."""
    dtype = resolve_dtype(config.dtype) or torch.float32
    with torch.device("meta"):
        model = CloverModel(config)
    model.load_state_dict(state, assign=True)
    tmp = out / ".export"
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(dtype).save_pretrained(tmp)
    tokenizer.save_pretrained(str(tmp))
    generation = {"threshold": 0.9, "max_new_tokens": 128}
    if (Path(init) / "generation_config.json").is_file():
        load_generation_config(init, ())  # refuses a malformed file, naming it
        generation = {**generation, **json.loads((Path(init) / "generation_config.json").read_text())}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for stale in list(out.glob("model*.safetensors")) + [out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    for f in tmp.iterdir():
        os.replace(f, out / f.name)
    tmp.rmdir()


def adapt(out, data, s: AdaptSettings, settings: TrainSettings, *, pattern: str = "*.py",
          tokenizer_dir: str | None = None, minutes: float | None = None, stop_at: int | None = None,
          device: str | None = None, checkpoint_every: int = 100, log_every: int = 10,
          recompute: bool = False) -> Path:
    """Adapt ``s.init`` on ``data`` into the Clover directory ``out`` (resuming the run there),
    on one process or on all that torchrun started. ``recompute``: activation checkpointing."""
    run = Run(out)
    load_config(s.init)  # the inputs checked before anything is written
    init_tokenizer(s, tokenizer_dir)
    if not (run.data.exists() or text_files(data, pattern)):
        raise ValueError(f"--data {' '.join(map(str, data))}: no files")
    shard = from_environment(device)
    try:
        if shard.is_main:
            run.dir.mkdir(parents=True, exist_ok=True)
        shard.barrier()
        state = torch.load(run.state, weights_only=False) if run.state.exists() else None
        if state is not None:
            s, settings = resumed_settings(state, s, settings)
        job = Adaptation(run, s, settings, shard, tokenizer_dir, data, pattern, recompute)
        if state is not None:
            if shard.is_main:
                print(f"resuming {out} at step {state['step']} of {settings.max_steps}", flush=True)
            job.resume(state)
        job.train(minutes, stop_at, checkpoint_every, log_every)
        job.export()
    finally:
        shard.close()
    return run.out


def resumed_settings(state: dict, s: AdaptSettings, settings: TrainSettings):
    """The run's stored settings; refused when the command asks for a different run."""
    stored_s, stored = AdaptSettings(**state["adapt"]), TrainSettings(**state["settings"])
    differ = [f"--{k.replace('_', '-')}: {getattr(stored_s, k)!r} in the run, {getattr(s, k)!r} given"
              for k in RUN_FIELDS if getattr(stored_s, k) != getattr(s, k)]
    differ += [f"{k}: {v!r} in the run, {getattr(settings, k)!r} given"
               for k, v in asdict(stored).items() if getattr(settings, k) != v]
    if differ:
        raise ValueError("the run in OUT was started with other settings; give the same ones to resume it, "
                         "or another --out (" + "; ".join(differ) + ")")
    return stored_s, stored


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="clover-lab adapt", description=__doc__.splitlines()[0])
    ap.add_argument("--init", required=True, metavar="DIR", help="the checkpoint to start from (Qwen3.5/3.6-MoE or Clover)")
    ap.add_argument("--data", required=True, nargs="+", metavar="FILES",
                    help="text files or directories (their --glob files); 'stdlib': the embedded model's corpus")
    ap.add_argument("--out", required=True, metavar="DIR", help="the Clover directory to write (resumed when it exists)")
    ap.add_argument("--train", choices=MODES, default="preview", help="what learns (default: preview)")
    ap.add_argument("--steps", type=int, default=1000, help="length of the warmup + cosine schedule")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=None, help=f"peak learning rate of the init's weights or the "
                    f"adapters (default: {DEFAULT_LR})")
    ap.add_argument("--preview-lr", type=float, default=AdaptSettings.preview_lr,
                    help="peak learning rate of the new parameters: preview weights, the mask token's embedding")
    ap.add_argument("--warmup-steps", type=int, default=None, help="default: a tenth of --steps, at most 100")
    ap.add_argument("--batch-size", type=int, default=8, help="global batch in rows, split over the processes")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=None, help="default: the init's config (32 for Qwen)")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--reset-preview", action="store_true", help="start the preview parameters at the spec's defaults")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument("--lora-targets", default=",".join(lora_.DEFAULT_TARGETS), help="comma-separated Linear names")
    ap.add_argument("--distill", metavar="FILE", help="a self-distillation corpus (python -m clover_lab.train.distill)")
    ap.add_argument("--distill-share", type=float, default=TrainSettings.distill_share)
    ap.add_argument("--confidence-weight", type=float, default=TrainSettings.confidence_weight)
    ap.add_argument("--glob", default="*.py", help="the files taken from a --data directory")
    ap.add_argument("--tokenizer", metavar="DIR", help="where the tokenizer is (default: --init)")
    ap.add_argument("--minutes", type=float, default=None, help="stop (checkpointed) after this long")
    ap.add_argument("--stop-at", type=int, default=None, help="stop (checkpointed) after this step")
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--log-every", type=int, default=10, help="write the loss to OUT/training/loss_log.jsonl")
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="keep only each layer's input and recompute it in backward (long rows on big models)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    ap.add_argument("--dtype", default=None, help="training dtype (default: float32 on the CPU, bfloat16 on GPUs)")
    return ap


def settings_from_args(ap, args) -> tuple[AdaptSettings, TrainSettings]:
    for name in ("steps", "batch_size", "seq_len", "checkpoint_every", "log_every", "lora_rank"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.distill_share <= 1:
        ap.error(f"--distill-share must be in [0, 1], got {args.distill_share}")
    if args.distill and not Path(args.distill).is_file():
        ap.error(f"--distill: {args.distill} is not a file")
    cuda = torch.cuda.is_available() if args.device is None else args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    try:
        resolve_dtype(dtype)
    except ValueError as e:
        ap.error(f"--dtype: {e}")
    s = AdaptSettings(init=str(Path(args.init)), train=args.train, block_size=args.block_size,
                      reset_preview=args.reset_preview, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                      lora_targets=[t for t in args.lora_targets.split(",") if t], dtype=dtype,
                      preview_lr=args.preview_lr)
    settings = TrainSettings(seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr or DEFAULT_LR.get(args.train, args.preview_lr),
                             max_steps=args.steps, seed=args.seed, weight_decay=args.weight_decay,
                             warmup_steps=args.warmup_steps if args.warmup_steps is not None else
                             max(1, min(100, args.steps // 10)),
                             confidence_weight=args.confidence_weight, distill_data=args.distill,
                             distill_share=args.distill_share)
    return s, settings


def main(argv=None) -> int:
    from ..loading import CheckpointError

    ap = build_parser()
    args = ap.parse_args(argv)
    s, settings = settings_from_args(ap, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        adapt(args.out, args.data, s, settings, pattern=args.glob, tokenizer_dir=args.tokenizer,
              minutes=args.minutes, stop_at=args.stop_at, device=args.device, checkpoint_every=args.checkpoint_every,
              log_every=args.log_every, recompute=args.activation_checkpointing)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"clover-lab adapt: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
