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
import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..arguments import ArgumentParser
from ..errors import CloverError
from ..loading import load_config, resolve_dtype
from . import lora as lora_
from .adapt_setup import (DEFAULT_LR, EMBEDDING, MODES, RUN_FIELDS, AdaptSettings, Run, build_model, check_stops,
                          check_tokenizer_fits, init_tokenizer, is_preview, keep_mask_row, optimizer, prepare_data,
                          write_clover_dir)
from .corpus import text_files
from .loop import distill_corpus, lr_at, training_batch
from .objective import TrainSettings, block_diffusion_loss
from .shard import Shard, from_environment, full_state_dict, load_checkpoint, save_checkpoint, shard_model

__all__ = ["AdaptSettings", "Adaptation", "EMBEDDING", "adapt", "build_model", "is_preview", "main"]


# --------------------------------------------------------------------------- the run
class Adaptation:
    """A run in progress: the (sharded) model, its optimizer and the batch generator, at ``step``."""

    def __init__(self, run: Run, s: AdaptSettings, settings: TrainSettings, shard: Shard, tokenizer_dir=None,
                 data=(), pattern="*.py", recompute: bool = False):
        self.run, self.s, self.settings, self.shard = run, s, settings, shard
        self.tokenizer = init_tokenizer(s, tokenizer_dir)
        model, self.names, mask_how = build_model(s, self.tokenizer, settings.seed)
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
        # sharded: fully_shard moves each unit to this process's device; else the whole model
        self.model = shard_model(model if shard.sharded else model.to(shard.device), shard, recompute)
        self.opt = optimizer(self.model, self.names, s, settings)
        self.gen = torch.Generator().manual_seed(settings.seed)
        self.step, self.saved, self.seconds = 0, None, 0.0  # seconds: spent in training steps, all sessions

    def resume(self, state: dict) -> None:
        load_checkpoint(self.run.checkpoint(state["step"]), self.model, self.opt, set(self.names))
        self.gen.set_state(state["generator"])
        self.step = self.saved = state["step"]
        self.seconds = state.get("train_seconds", 0.0)

    def train_step(self) -> dict:
        st, t0 = self.settings, time.monotonic()
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
        self.seconds += time.monotonic() - t0
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
            with _terminate_as_interrupt(self.shard.world == 1):
                while self.step < end and not (deadline and self.shard.any(time.monotonic() > deadline)):
                    parts = self.train_step()
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


@contextlib.contextmanager
def _terminate_as_interrupt(enabled: bool):
    """SIGTERM (``kill``; a job scheduler's stop) handled as Ctrl-C: the single process saves a
    checkpoint and exports before it ends. In a background job SIGINT is often ignored."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def adapt(out, data, s: AdaptSettings, settings: TrainSettings, *, pattern: str = "*.py",
          tokenizer_dir: str | None = None, minutes: float | None = None, stop_at: int | None = None,
          device: str | None = None, checkpoint_every: int = 100, log_every: int = 10,
          recompute: bool = False) -> Path:
    """Adapt ``s.init`` on ``data`` into the Clover directory ``out`` (resuming the run there),
    on one process or on all that torchrun started. ``recompute``: activation checkpointing."""
    run = Run(out)
    check_stops(minutes, stop_at)
    config = load_config(s.init)  # the inputs checked before anything is written
    check_tokenizer_fits(init_tokenizer(s, tokenizer_dir), config, tokenizer_dir or s.init)
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
    option = {"max_steps": "steps", "distill_data": "distill"}
    differ += [f"--{option.get(k, k).replace('_', '-')}: {v!r} in the run, {getattr(settings, k)!r} given"
               for k, v in asdict(stored).items() if getattr(settings, k) != v]
    if differ:
        raise ValueError("the run in OUT was started with other settings; give the same ones to resume it, "
                         "or another --out (" + "; ".join(differ) + ")")
    return stored_s, stored


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="clover-lab adapt", description="Adapt a checkpoint (autoregressive "
                        "Qwen3.5/3.6-MoE, or a Clover) into a block-diffusion Clover; under torchrun, "
                        "sharded with FSDP2.")
    ap.add_argument("--init", required=True, metavar="DIR",
                    help="the checkpoint to start from (Qwen3.5/3.6-MoE or Clover)")
    ap.add_argument("--data", required=True, nargs="+", metavar="FILES",
                    help="text files or directories (their --glob files); 'stdlib': the embedded model's corpus")
    ap.add_argument("--out", required=True, metavar="DIR",
                    help="the Clover directory to write (resumed when it exists)")
    ap.add_argument("--train", choices=MODES, default="preview", help="what learns (default: preview)")
    ap.add_argument("--steps", type=int, default=1000, help="length of the warmup + cosine schedule (default 1000)")
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
    try:
        check_stops(args.minutes, args.stop_at, "--minutes", "--stop-at")
    except ValueError as e:
        ap.error(str(e))
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
    lr = args.lr or DEFAULT_LR.get(args.train, args.preview_lr)
    settings = TrainSettings(seq_len=args.seq_len, batch_size=args.batch_size, lr=lr,
                             max_steps=args.steps, seed=args.seed, weight_decay=args.weight_decay,
                             warmup_steps=args.warmup_steps if args.warmup_steps is not None else
                             max(1, min(100, args.steps // 10)),
                             confidence_weight=args.confidence_weight, distill_data=args.distill,
                             distill_share=args.distill_share)
    return s, settings


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    s, settings = settings_from_args(ap, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        adapt(args.out, args.data, s, settings, pattern=args.glob, tokenizer_dir=args.tokenizer,
              minutes=args.minutes, stop_at=args.stop_at, device=args.device, checkpoint_every=args.checkpoint_every,
              log_every=args.log_every, recompute=args.activation_checkpointing)
    except (CloverError, ValueError, OSError) as e:  # one line, like every clover-lab error
        print(f"clover-lab adapt: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
