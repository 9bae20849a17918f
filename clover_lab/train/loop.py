"""Training small Clover models: the loop (warmup + cosine schedule, checkpoints, resume), the
export of a trained model directory and the command line.

    python -m clover_lab.train --out runs/stdlib --minutes 90       # resumes if runs/stdlib exists
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from clover_lab.checkpoint.loading import load_tokenizer
from clover_lab.checkpoint.saving import stage_model
from clover_lab.cli.arguments import ArgumentParser
from clover_lab.config import PRESETS, CloverConfig, ConfigError
from clover_lab.errors import CheckpointError, CloverError, OutputError
from clover_lab.model.decoder import CloverModel
from clover_lab.signals import NotedSignals
from clover_lab.train.functions import function_corpus, function_rows
from clover_lab.train.newlines import newline_splits, split_newlines
from clover_lab.train.objective import TrainSettings, block_diffusion_loss
from clover_lab.train.stdlib_corpus import encode_files, split_corpus, train_tokenizer
from clover_lab.writes import FileSet, atomic_path, check_writable, refuse_inputs, refuse_same, write_text


def training_batch(tokens: torch.Tensor, distilled: torch.Tensor | None, s: TrainSettings,
                   gen: torch.Generator, functions: list | None = None, eos: int = 0,
                   newlines: tuple | None = None) -> torch.Tensor:
    """[batch_size, seq_len] rows: random windows of the corpus; with a self-distillation corpus,
    ``distill_share`` of the rows drawn from it instead, and with ``functions`` (``train.functions``),
    ``functions_share`` of them rows that start at a function's head. With ``newlines``
    (``train.newlines.newline_splits``), ``split_newlines`` of every row's newline+indent tokens
    written as the newline and the indent apart."""
    n_distill = 0 if distilled is None else round(s.distill_share * s.batch_size)
    n_functions = 0 if not functions else round(s.functions_share * s.batch_size)
    n_windows = s.batch_size - n_distill - n_functions
    if n_windows < 0:
        raise ValueError(f"distill_share {s.distill_share} + functions_share {s.functions_share} exceed the batch")
    starts = torch.randint(0, len(tokens) - s.seq_len, (n_windows,), generator=gen)
    rows = [tokens[i:i + s.seq_len].long() for i in starts.tolist()]
    if n_distill:
        picks = torch.randint(0, len(distilled), (n_distill,), generator=gen)
        rows += [distilled[i, :s.seq_len].long() for i in picks.tolist()]
    if n_functions:
        rows += list(function_rows(functions, n_functions, s.seq_len, eos, gen))
    batch = torch.stack(rows).long()
    if newlines is not None and s.split_newlines:
        batch = split_newlines(batch, newlines, s.split_newlines, gen)
    return batch


def lr_at(step: int, s: TrainSettings) -> float:
    step, total = step - s.schedule_start, s.max_steps - s.schedule_start
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = min(1.0, (step - s.warmup_steps) / max(1, total - s.warmup_steps))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


INIT_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def prepare(out: Path, preset: str, vocab_size: int, block_size: int, overrides: dict, init: Path | None = None):
    """Tokenizer, token streams and the initial model config, made once per run directory.
    ``init``: a model directory (e.g. the embedded specimen) whose tokenizer the run takes instead
    of training one; its card.json, if any, is kept as ``init_card.json`` (the figures before)."""
    data = out / "data.pt"
    if not data.exists():
        train_files, held_files = split_corpus()
        print(f"corpus: {len(train_files)} training and {len(held_files)} held-out stdlib modules", flush=True)
        if init is not None:
            tok = copy_tokenizer(init, out)
        else:
            tok = train_tokenizer(train_files, vocab_size, out / "tokenizer")
        with atomic_path(data) as tmp:
            torch.save({"train": encode_files(tok, train_files), "heldout": encode_files(tok, held_files),
                        "heldout_modules": [str(f.name) for f in held_files]}, tmp)
    tok = load_tokenizer(out / "tokenizer")  # never the init's own code (its tokenizer_config's auto_map)
    config = CloverConfig.preset(
        preset, vocab_size=len(tok), block_size=block_size, mask_token_id=tok.mask_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **overrides)
    return tok, read_run_file(data, "the run's encoded corpus", f"delete {data} and rerun: the corpus is encoded "
                              f"again", {"train": torch.Tensor}), config


def copy_tokenizer(init: Path, out: Path):
    """``init``'s tokenizer (and card, as ``init_card.json``) copied into the run directory ``out``."""
    import shutil

    with FileSet(out / "tokenizer") as files:
        for name in INIT_FILES:
            if (init / name).is_file():
                shutil.copy(init / name, files.path(out / "tokenizer" / name))
    if (init / "card.json").is_file():
        shutil.copy(init / "card.json", out / "init_card.json")
    return load_tokenizer(out / "tokenizer")


def read_run_file(path: Path, what: str, fix: str, expect: dict, weights_only: bool = True) -> dict:
    """A file a resume reads (a run's state, its encoded data), verified: readable and a dict
    holding ``expect``'s keys with values of their types; else a CheckpointError naming the file and
    what it is, and saying what to do (``fix``), where a cut-short file was a raw traceback."""
    try:
        obj = torch.load(path, weights_only=weights_only)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} is missing; {fix}") from None
    except Exception as e:  # noqa: BLE001 - pickle, zip and storage errors alike: the file is damaged
        raise CheckpointError(f"{path}: {what} cannot be read: it is damaged or cut short ({error_summary(e)}); "
                              f"{fix}") from None
    wrong = [k for k, kind in expect.items() if not isinstance(obj, dict) or not isinstance(obj.get(k), kind)]
    if wrong:
        raise CheckpointError(f"{path}: {what} lacks {', '.join(wrong)} (not a file this run wrote, or damaged); {fix}")
    return obj


@contextlib.contextmanager
def run_write(path: Path, what: str, after: str):
    """A write whose failure (a full disk: OSError, torch.save's RuntimeError, DCP's
    CheckpointException, a BaseException) is an OutputError naming ``path`` and saying what is
    safe (``after``), instead of a traceback; Ctrl-C and clover_lab's own errors pass through."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, CloverError):
        raise
    except BaseException as e:
        if not isinstance(e, (OSError, RuntimeError)) and type(e).__name__ != "CheckpointException":
            raise
        raise OutputError(f"{path}: cannot write {what} ({error_summary(e)}); {after}") from None


def error_summary(e: BaseException) -> str:
    """One line of what went wrong: the OS's words (No space left on device), the first failure a
    DCP CheckpointException gathered, else the first line of the message."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return error_summary(first[0] if isinstance(first, tuple) else first)
    return getattr(e, "strerror", None) or (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def check_init(init: str | Path) -> Path:
    """``init`` as a model directory to start a run from, or a CheckpointError naming what it lacks."""
    init = Path(init)
    missing = [name for name in ("config.json", "tokenizer.json") if not (init / name).is_file()]
    if missing:
        raise CheckpointError(f"--init {init}: not a model directory with a tokenizer (no {', '.join(missing)})")
    return init


def train(out: str | Path, minutes: float, preset: str = "clover-stdlib", vocab_size: int = 4096,
          block_size: int = 16, settings: TrainSettings | None = None, overrides: dict | None = None,
          threads: int | None = None, device: str | None = None, log_every: int = 10,
          checkpoint_every: int = 100, extend_steps: int | None = None, extend_lr: float | None = None,
          extend_overrides: dict | None = None, init: str | Path | None = None) -> Path:
    """Train (or resume) the run in ``out`` for at most ``minutes``. ``init``: a model directory
    a new run starts from (its weights, tokenizer and config; ``preset``, ``vocab_size``,
    ``block_size`` and ``overrides`` unused), so that a continuation spends nothing re-learning
    what that model knows; a run that exists resumes as it is. ``extend_steps`` continues a
    finished run for that many more steps with a fresh warmup + cosine schedule (peak ``extend_lr``;
    ``extend_overrides`` replaces other fields of its TrainSettings, e.g. ``distill_data``).
    Ctrl-C and SIGTERM stop it after the step in progress and its log line, with a checkpoint; a
    KeyboardInterrupt raised inside a step (a second Ctrl-C) saves nothing: the run resumes from
    its last checkpoint, which is always of a whole, logged step."""
    from tqdm.auto import tqdm

    out = Path(out)
    refuse_inputs(out, [("--init", init), ("--distill", settings.distill_data if settings else None)], "--out",
                  folder=True)
    check_writable(out, what="--out")
    out.mkdir(parents=True, exist_ok=True)
    if threads:
        torch.set_num_threads(threads)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    state_file = out / "train_state.pt"
    init = check_init(init) if init is not None and not state_file.exists() else None
    tok, data, config = prepare(out, preset, vocab_size, block_size, overrides or {}, init)
    if state_file.exists():
        state = read_run_file(state_file, "the run's state (the step it resumes from)", _restart_fix(state_file),
                              {"step": int, "settings": dict, "optimizer": dict, "generator": torch.Tensor},
                              weights_only=False)
        model, settings, step = _resume(out, state, device, extend_steps, extend_lr, extend_overrides)
        trim_log(out / "loss_log.jsonl", step)
    else:
        settings = settings or TrainSettings()
        if init is not None:
            model = CloverModel.from_pretrained(init, device=device, dtype=torch.float32)
            if model.config.vocab_size < len(tok):
                raise CheckpointError(f"--init {init}: its vocabulary ({model.config.vocab_size}) is smaller than "
                                f"its tokenizer's ({len(tok)})")
            settings.init = str(init)
            print(f"starting from {init} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)",
                  flush=True)
        else:
            model = CloverModel.random(config, device=device, seed=settings.seed)
        state, step = None, 0
        trim_log(out / "loss_log.jsonl", 0)  # steps logged by a run stopped before its first checkpoint
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    opt = _optimizer(model, settings)
    gen = torch.Generator().manual_seed(settings.seed)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
    tokens = data["train"]
    distilled = distill_corpus(settings)
    functions = function_corpus(out, tok)["train"] if settings.functions_share else None
    if functions:
        print(f"{settings.functions_share:.0%} of each batch: rows starting at one of {len(functions)} functions' "
              f"heads", flush=True)
    newlines = None
    if settings.split_newlines:
        newlines = newline_splits(tok)
        if newlines is None:
            raise ValueError("--split-newlines: the run's tokenizer has no newline+indent tokens to split")
        print(f"{settings.split_newlines:.0%} of the newline+indent tokens ({int((newlines[1] >= 0).sum())} kinds) "
              f"written as the newline and the indent apart", flush=True)
    log = open(out / "loss_log.jsonl", "a")
    saved = step if state is not None else None

    def checkpoint():
        """The weights and the state (step, optimizer, generator) put in place together."""
        nonlocal saved
        if saved == step:
            return
        safe = (f"the checkpoint of step {saved} is as it was" if saved is not None else "no checkpoint was made yet") \
            + "; free some space and rerun the command to resume"
        with run_write(out / "checkpoint", f"the checkpoint of step {step}", safe), \
                FileSet(out / "checkpoint") as files:
            stage_model(model, files, out / "checkpoint")
            torch.save({"step": step, "settings": asdict(settings), "optimizer": opt.state_dict(),
                        "generator": gen.get_state()}, files.path(state_file))
        saved = step

    deadline = time.monotonic() + minutes * 60
    bar = tqdm(desc="training", unit="step", initial=step)
    try:
        with NotedSignals(second_raises=True) as stops:
            while time.monotonic() < deadline and step < settings.max_steps and not stops:
                clean = training_batch(tokens, distilled, settings, gen, functions, tok.eos_token_id,
                                       newlines).to(device)
                for group in opt.param_groups:
                    group["lr"] = lr_at(step, settings)
                loss, parts = block_diffusion_loss(model, clean, settings, gen)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                step += 1
                bar.update(1)
                if step % log_every == 0:
                    bar.set_postfix(loss=f"{parts['loss']:.3f}", acc=f"{parts['mask_acc']:.3f}")
                    log.write(json.dumps({"step": step, "time": time.time(), "lr": lr_at(step, settings), **parts})
                              + "\n")
                    log.flush()
                if step % checkpoint_every == 0:
                    checkpoint()
            if stops:
                print(f"\ninterrupted: saving a checkpoint to resume from ({stops.names})", file=sys.stderr)
            checkpoint()
    except KeyboardInterrupt:
        print(interrupted_inside(step, saved), file=sys.stderr)
        raise
    finally:
        bar.close()
        log.close()
    return out


def interrupted_inside(step: int, saved: int | None) -> str:
    """What a KeyboardInterrupt raised inside a step left: nothing saved of it."""
    return (f"\ninterrupted inside step {step + 1}: nothing of it was saved; the run resumes from "
            + (f"its checkpoint at step {saved}" if saved else "the start"))


def trim_log(log: Path, step: int) -> None:
    """The loss log cut back to the steps up to ``step`` (a resume's checkpoint): the steps after
    it are trained and logged again, so that a resumed run's log is an uninterrupted run's."""
    if not log.exists():
        return
    lines = log.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and _logged_step(line) <= step]
    if kept != lines:
        write_text(log, "".join(kept))


def _logged_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf  # a torn last line (the process killed while writing it)


def _resume(out: Path, state: dict, device, extend_steps, extend_lr, extend_overrides):
    """(model, settings, step) of the run in ``out``; ``extend_steps`` starts a fresh schedule."""
    settings = TrainSettings(**state["settings"])
    try:
        model = CloverModel.from_pretrained(out / "checkpoint", device=device, dtype=torch.float32)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; {_restart_fix(out / 'train_state.pt')}") from None
    step = state["step"]
    if extend_steps:
        settings.schedule_start, settings.max_steps = step, step + extend_steps
        settings.lr = extend_lr or settings.lr
        for field, value in (extend_overrides or {}).items():
            setattr(settings, field, value)
    print(f"resuming {out} at step {step} (schedule to step {settings.max_steps})", flush=True)
    return model, settings, step


def _restart_fix(state_file: Path) -> str:
    return f"the run cannot resume: delete {state_file} to start the run again from step 0, or give another --out"


def _optimizer(model: CloverModel, settings: TrainSettings) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices except the embedding."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=settings.lr, betas=(0.9, 0.95))


def distill_corpus(settings: TrainSettings) -> torch.Tensor | None:
    """The self-distillation corpus' sequences, when the settings name one."""
    if not settings.distill_data:
        return None
    distilled = torch.load(settings.distill_data)["sequences"]
    if distilled.shape[1] < settings.seq_len:
        raise ValueError(f"{settings.distill_data}: sequences of {distilled.shape[1]} tokens, "
                         f"shorter than seq_len {settings.seq_len}")
    print(f"mixing {len(distilled)} self-distilled sequences into {settings.distill_share:.0%} "
          f"of each batch", flush=True)
    return distilled


def export(run: str | Path, dest: str | Path, generation_defaults: dict | None = None,
           dtype: torch.dtype = torch.bfloat16) -> Path:
    """Copy a run's checkpoint (in ``dtype``: bf16 halves the shipped size) and tokenizer into a
    self-contained model directory."""
    import shutil

    run, dest = Path(run), Path(dest)
    for source in (run, run / "checkpoint", run / "tokenizer"):
        refuse_same(dest, source, "export")
    model = CloverModel.from_pretrained(run / "checkpoint", dtype=dtype)
    defaults = {"threshold": 0.9, "max_new_tokens": 128, **(generation_defaults or {})}
    with FileSet(dest) as files:
        stage_model(model, files, dest)
        for f in (run / "tokenizer").iterdir():
            shutil.copy(f, files.path(dest / f.name))
        files.path(dest / "generation_config.json").write_text(json.dumps(defaults, indent=2) + "\n")
    return dest


def _check_numbers(ap, args) -> None:
    """The numeric options' ranges, as usage errors before anything runs."""
    if not (math.isfinite(args.minutes) and args.minutes >= 0):
        ap.error(f"--minutes must be a number >= 0 (0: prepare the run and its checkpoint only), got {args.minutes}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        ap.error(f"--lr must be a positive number, got {args.lr}")
    for name in ("vocab_size", "block_size", "seq_len", "batch_size", "max_steps", "threads", "extend_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.seq_len % args.block_size:
        ap.error(f"--seq-len {args.seq_len} must be a multiple of --block-size {args.block_size}")


def _config_overrides(ap, preset: str, items: list[str]) -> dict:
    """``--set FIELD=VALUE`` items as config overrides (VALUE as JSON, else a string), checked
    against the preset now, so that a bad one is a usage error before anything runs."""
    names = set(CloverConfig.__dataclass_fields__) - {"extra"}
    overrides = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or key not in names:
            ap.error(f"--set {item!r}: expected FIELD=VALUE with FIELD a config field "
                     f"(e.g. num_hidden_layers=4, hidden_size=128)")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value  # a plain string; the config check names it if it must be a number
    if preset not in PRESETS:
        ap.error(f"--preset {preset!r}: known presets are {', '.join(sorted(PRESETS))}")
    try:
        CloverConfig.preset(preset, **overrides)
    except ConfigError as e:
        ap.error(f"--set: {e}")
    return overrides


def _generation_defaults(ap, items: list[str]) -> dict:
    """``--generation SETTING=VALUE`` items (VALUE as JSON), checked as sampler settings now."""
    from clover_lab.engine.sampling import SamplerSettings, SettingsError

    defaults = {}
    for item in items:
        key, eq, value = item.partition("=")
        try:
            defaults[key] = json.loads(value)
        except json.JSONDecodeError:
            defaults[key] = value
        if not eq:
            ap.error(f"--generation {item!r}: expected SETTING=VALUE, e.g. repetition_penalty=1.3")
    try:
        SamplerSettings.from_kwargs(**defaults)
    except SettingsError as e:
        ap.error(f"--generation: {e}")
    return defaults


def main(argv=None):
    ap = ArgumentParser(prog="clover-lab train", description="Train a small Clover on the Python stdlib")
    ap.add_argument("--out", required=True, help="run directory (resumed when it exists)")
    ap.add_argument("--minutes", type=float, default=60.0,
                    help="wall-clock budget of this invocation (0: make the run directory and its step-0 "
                         "checkpoint, e.g. to distill from an --init model before training)")
    ap.add_argument("--preset", default="clover-stdlib")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--max-steps", type=int, default=20000)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a config field of the preset, e.g. --set num_hidden_layers=4")
    ap.add_argument("--extend-steps", type=int, default=None,
                    help="continue a finished run for N more steps, restarting the schedule at --lr")
    ap.add_argument("--confidence-weight", type=float, default=None,
                    help=f"weight of the confidence term (default {TrainSettings.confidence_weight}; "
                         f"with --extend-steps, the run's own unless given)")
    ap.add_argument("--distill", metavar="FILE", help="mix this self-distillation corpus (python -m "
                    "clover_lab.distill) into each batch; with --extend-steps, from the continuation on")
    ap.add_argument("--distill-share", type=float, default=TrainSettings.distill_share)
    ap.add_argument("--functions-share", type=float, default=None,
                    help="the share of each batch's rows that start at a function's head (signature and "
                         "docstring, then its body: train.functions), to teach the model to follow a prompt "
                         f"(default {TrainSettings.functions_share}; with --extend-steps, the run's own unless given)")
    ap.add_argument("--split-newlines", type=float, default=None,
                    help="the share of newline+indent tokens written as the newline and the indent apart, as a "
                         "prompt that ends on a newline tokenizes them (train.newlines), so that such a prompt is "
                         f"continued, not ended (default {TrainSettings.split_newlines}; with --extend-steps, the "
                         "run's own unless given)")
    ap.add_argument("--export", metavar="DIR", help="after training, write a model directory here")
    ap.add_argument("--generation", action="append", default=[], metavar="SETTING=VALUE",
                    help="with --export: a sampler default for its generation_config.json, e.g. "
                         "repetition_penalty=1.3 (besides threshold 0.9, max_new_tokens 128)")
    ap.add_argument("--init", metavar="DIR", help="start a new run from this model directory's weights, "
                    "tokenizer and config (e.g. assets/clover-stdlib) instead of from scratch")
    args = ap.parse_args(argv)
    _check_numbers(ap, args)
    if args.init:
        if args.set:
            ap.error("--init takes the model's own config: no --set with it")
        try:
            check_init(args.init)
        except CheckpointError as e:
            ap.error(str(e))
    if args.export:  # found now, not after the training
        check_writable(args.export, what="--export")
    overrides = _config_overrides(ap, args.preset, args.set)
    generation = _generation_defaults(ap, args.generation)
    if generation and not args.export:
        ap.error("--generation sets the defaults of an --export: give --export DIR")
    if not 0 <= args.distill_share <= 1:
        ap.error("--distill-share must be in [0, 1]")
    if args.functions_share is not None and not 0 <= args.functions_share <= 1 - (args.distill_share if args.distill
                                                                                  else 0):
        ap.error("--functions-share must be in [0, 1], and with --distill at most 1 - --distill-share")
    if args.split_newlines is not None and not 0 <= args.split_newlines <= 1:
        ap.error("--split-newlines must be in [0, 1]")
    if args.distill and not Path(args.distill).is_file():
        ap.error(f"--distill: {args.distill} is not a file")
    settings = TrainSettings(seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                             max_steps=args.max_steps, seed=args.seed, distill_data=args.distill,
                             distill_share=args.distill_share)
    extend_overrides = {}
    if args.confidence_weight is not None:
        settings.confidence_weight = extend_overrides["confidence_weight"] = args.confidence_weight
    if args.distill:
        extend_overrides.update(distill_data=args.distill, distill_share=args.distill_share)
    if args.functions_share is not None:
        settings.functions_share = extend_overrides["functions_share"] = args.functions_share
    if args.split_newlines is not None:
        settings.split_newlines = extend_overrides["split_newlines"] = args.split_newlines
    run = train(args.out, args.minutes, args.preset, args.vocab_size, args.block_size, settings, overrides,
                threads=args.threads, extend_steps=args.extend_steps,
                extend_lr=args.lr if args.extend_steps else None, extend_overrides=extend_overrides,
                init=args.init)
    if args.export:
        export(run, args.export, generation)
