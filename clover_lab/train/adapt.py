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
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from clover_lab.checkpoint.loading import load_config, resolve_dtype
from clover_lab.cli.arguments import ArgumentParser
from clover_lab.errors import CheckpointError, CloverError
from clover_lab.signals import NotedSignals
from clover_lab.train import lora as lora_
from clover_lab.train.adapt_setup import (
    DEFAULT_LR,
    EMBEDDING,
    MODES,
    RUN_FIELDS,
    AdaptSettings,
    Run,
    build_model,
    check_stops,
    check_tokenizer_fits,
    init_tokenizer,
    is_preview,
    keep_mask_row,
    optimizer,
    prepare_data,
    write_clover_dir,
)
from clover_lab.train.loop import (
    distill_corpus,
    error_summary,
    interrupted_inside,
    lr_at,
    read_run_file,
    run_write,
    training_batch,
    trim_log,
)
from clover_lab.train.objective import TrainSettings, block_diffusion_loss
from clover_lab.train.shard import (
    Shard,
    from_environment,
    full_state_dict,
    load_checkpoint,
    save_checkpoint,
    shard_model,
)
from clover_lab.train.stdlib_corpus import text_files
from clover_lab.writes import atomic_path, check_writable, refuse_inputs, refuse_same

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
        path, fix = self.run.checkpoint(state["step"]), self.run.restart_fix()
        if not (path / ".metadata").is_file():  # DCP's index of the shards
            raise CheckpointError(f"{path}: the checkpoint of step {state['step']}, which {self.run.state} says the run "
                                  f"resumes from, is {'incomplete' if path.is_dir() else 'missing'}; {fix}")
        try:
            load_checkpoint(path, self.model, self.opt, set(self.names))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            raise CheckpointError(f"{path}: the checkpoint of step {state['step']} cannot be read: a shard is damaged "
                                  f"or cut short ({error_summary(e)}); {fix}") from None
        self.gen.set_state(state["generator"])
        self.step = self.saved = state["step"]
        self.seconds = state.get("train_seconds", 0.0)
        if self.shard.is_main:
            trim_log(self.run.log, self.step)

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
        """DCP shards of the trained parameters and the optimizer into a temporary directory,
        renamed when every process has written its part; then (main process) the state that
        points at it, replaced atomically; older checkpoints go only after that."""
        if self.saved == self.step:
            return
        path = self.run.checkpoint(self.step)
        partial = path.with_name(f".{path.name}.partial")
        safe = (f"the run's last checkpoint (step {self.saved}) is as it was" if self.saved else
                "no checkpoint was made yet") + "; free some space and rerun the command to resume"
        if self.shard.is_main:
            shutil.rmtree(partial, ignore_errors=True)  # left by a run that was killed while saving
        self.shard.barrier()
        try:
            with run_write(path, f"the checkpoint of step {self.step}", safe):
                save_checkpoint(partial, self.model, self.opt, set(self.names))
        except BaseException:
            if self.shard.is_main:
                shutil.rmtree(partial, ignore_errors=True)
            raise
        self.shard.barrier()
        if self.shard.is_main:
            shutil.rmtree(path, ignore_errors=True)  # a checkpoint of this step that no state names
            os.replace(partial, path)
            with run_write(self.run.state, f"the run's state at step {self.step}", safe), \
                    atomic_path(self.run.state) as tmp:
                torch.save({"step": self.step, "adapt": asdict(self.s), "settings": asdict(self.settings),
                            "generator": self.gen.get_state(), "train_seconds": self.seconds}, tmp)
            for old in self.run.dir.glob("checkpoint-*"):
                if old != path:
                    shutil.rmtree(old)
        self.saved = self.step
        self.shard.barrier()

    def train(self, minutes: float | None = None, stop_at: int | None = None, checkpoint_every: int = 100,
              log_every: int = 10) -> None:
        """Steps until the schedule ends, ``stop_at``, ``minutes``, Ctrl-C or SIGTERM (all
        processes stop at the same step), checkpointing every ``checkpoint_every`` steps and at
        the end. A signal is acted on only between whole steps (after the optimizer step and its
        log line), so every checkpoint is of a complete, logged step; a KeyboardInterrupt raised
        inside a step (a second Ctrl-C) saves nothing, and the run resumes from its last checkpoint."""
        from tqdm.auto import tqdm

        end = min(self.settings.max_steps, stop_at or self.settings.max_steps)
        deadline = None if minutes is None else time.monotonic() + minutes * 60
        main = self.shard.is_main
        bar = tqdm(desc=f"adapt ({self.s.train})", unit="step", initial=self.step, total=end, disable=not main)
        log = open(self.run.log, "a") if main else None
        try:
            # under torchrun a Ctrl-C reaches each process twice (the terminal's SIGINT, then the
            # agent's SIGTERM): only a single process takes a second signal as "stop at once"
            with NotedSignals(second_raises=self.shard.world == 1) as stops:
                while self.step < end and not self._stopping(stops, deadline):
                    parts = self.train_step()
                    bar.update(1)
                    if main and (self.step % log_every == 0 or self.step == end):
                        bar.set_postfix(loss=f"{parts['loss']:.3f}", acc=f"{parts['mask_acc']:.3f}")
                        log.write(json.dumps({"step": self.step, "time": time.time(),
                                              "lr": lr_at(self.step - 1, self.settings), **parts}) + "\n")
                        log.flush()
                    if self.step % checkpoint_every == 0:
                        self.checkpoint()
                if stops and main:
                    print(f"\ninterrupted: saving a checkpoint to resume from ({stops.names})", file=sys.stderr)
                self.checkpoint()
        except KeyboardInterrupt:
            if main:
                print(interrupted_inside(self.step, self.saved), file=sys.stderr)
            raise
        finally:
            bar.close()
            if log is not None:
                log.close()

    def _stopping(self, stops, deadline) -> bool:
        """Whether to stop before the next step: a signal or the deadline, on any process."""
        flag = bool(stops) or (deadline is not None and time.monotonic() > deadline)
        return self.shard.any(flag) if self.shard.world > 1 else flag

    def export(self) -> None:
        """The Clover directory in OUT: adapters merged, in the init's dtype, with the tokenizer
        (mask token included) and generation_config.json; written aside, then moved in."""
        state = full_state_dict(self.model, self.shard)
        if self.shard.is_main:
            if self.s.train == "lora":
                state = lora_.merged_state_dict(state, lora_.lora_scaling(self.s.lora_rank, self.s.lora_alpha))
            with run_write(self.run.out, "the adapted model", f"the previous files there are as they were and the run "
                           f"is checkpointed at step {self.step}: free some space and rerun the command to export"):
                write_clover_dir(self.run.out, self.model.config, state, self.tokenizer, self.s.init)
        self.shard.barrier()


def adapt(out, data, s: AdaptSettings, settings: TrainSettings, *, pattern: str = "*.py",
          tokenizer_dir: str | None = None, minutes: float | None = None, stop_at: int | None = None,
          device: str | None = None, checkpoint_every: int = 100, log_every: int = 10,
          recompute: bool = False) -> Path:
    """Adapt ``s.init`` on ``data`` into the Clover directory ``out`` (resuming the run there),
    on one process or on all that torchrun started. ``recompute``: activation checkpointing."""
    run = Run(out)
    for source, option in ((s.init, "--init"), (tokenizer_dir, "--tokenizer")):
        if source is not None:  # the export would overwrite it
            refuse_same(run.out, source, f"--out (equal to {option})")
    refuse_inputs(run.out, [("--data", Path(d)) for d in data] + [("--distill", settings.distill_data)], "--out",
                  folder=True)
    check_stops(minutes, stop_at)
    config = load_config(s.init)  # the inputs checked before anything is written
    check_tokenizer_fits(init_tokenizer(s, tokenizer_dir), config, tokenizer_dir or s.init)
    if not (run.data.exists() or text_files(data, pattern)):
        raise ValueError(f"--data {' '.join(map(str, data))}: no files")
    check_writable(run.out, run.dir, what="--out")  # found now, not after the run
    shard = from_environment(device)
    try:
        made = [p for p in (run.out, run.dir, run.data) if not p.exists()]
        if shard.is_main:
            run.dir.mkdir(parents=True, exist_ok=True)
        shard.barrier()
        state = read_run_file(run.state, "the run's state (the step it resumes from)", run.restart_fix(),
                              {"step": int, "adapt": dict, "settings": dict, "generator": torch.Tensor},
                              weights_only=False) if run.state.exists() else None
        try:
            if state is not None:
                s, settings = resumed_settings(state, s, settings)
            job = Adaptation(run, s, settings, shard, tokenizer_dir, data, pattern, recompute)
        except BaseException:
            if state is None and shard.is_main:  # refused before it started: no run left to resume
                _remove_made(made)
            raise
        if state is not None:
            if shard.is_main:
                print(f"resuming {out} at step {state['step']} of {settings.max_steps}", flush=True)
            job.resume(state)
        elif shard.is_main:
            trim_log(run.log, 0)  # steps logged by a run stopped before its first checkpoint
        job.train(minutes, stop_at, checkpoint_every, log_every)
        job.export()
    finally:
        shard.close()
    return run.out


def _remove_made(made: list[Path]) -> None:
    """What a refused first invocation made (the encoded data, the run's directories if empty), so
    that the corrected command starts afresh instead of being refused as a resume."""
    for p in reversed(made):
        if p.is_file():
            p.unlink()
        elif p.is_dir():
            with contextlib.suppress(OSError):
                p.rmdir()


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
    except KeyboardInterrupt:  # what was saved is said where it stopped
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
