"""Training small Clover models: the embedded default model, trained on the Python standard library.

The block-diffusion objective on the model's own operators (``CloverModel.block_forward``): a
training sequence is split into blocks; the clean stream runs in commit mode and a noisy copy
(each block masked at its own random ratio) runs in preview mode against the clean prefix, in one
forward. Loss: cross-entropy on the masked positions, next-token loss on the clean stream, a router
load-balancing loss, and a confidence term that sharpens the distribution where the prediction is
already right (as LLaDA2's CAP training does), so that generation can unmask many tokens per step.

    python -m clover_lab.train --out runs/stdlib --minutes 90       # resumes if runs/stdlib exists
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .config import CloverConfig
from .model import CloverModel

SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "turtledemo"}


# --------------------------------------------------------------------------- corpus
def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The running interpreter's standard-library .py files, without test suites or site-packages."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS & set(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        files.append(path)
    return files


def is_heldout(path: Path, root: Path, fraction: int = 20) -> bool:
    """Deterministic split by module: one module in ``fraction`` is held out."""
    digest = hashlib.sha1(str(path.relative_to(root)).encode()).digest()
    return digest[0] % fraction == 0


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def split_corpus(root: str | Path | None = None) -> tuple[list[Path], list[Path]]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    held = [f for f in files if is_heldout(f, root)]
    train = [f for f in files if not is_heldout(f, root)]
    return train, held


# --------------------------------------------------------------------------- tokenizer
def train_tokenizer(files: list[Path], vocab_size: int, out_dir: Path):
    """Byte-level BPE on the training split, saved so that transformers' AutoTokenizer loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = (t for f in files if (t := read_text(f)) is not None)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                   mask_token="<|mask|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 8192
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast


def encode_files(tokenizer, files: list[Path]) -> torch.Tensor:
    """All files as one stream of token ids, each file followed by EOS."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for f in files:
        text = read_text(f)
        if text:
            ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


# --------------------------------------------------------------------------- objective
@dataclass
class TrainSettings:
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.05
    max_steps: int = 20000  # the cosine schedule's length; the time budget usually ends a run first
    ar_weight: float = 0.5
    balance_weight: float = 0.01
    confidence_weight: float = 0.2
    min_mask_ratio: float = 0.05
    seed: int = 0
    schedule_start: int = 0  # the step a (re)started warmup + cosine schedule begins at
    distill_data: str | None = None  # a self-distillation corpus (clover_lab.distill) mixed into each batch
    distill_share: float = 0.5  # the share of each batch's rows drawn from it


def mask_blocks(clean: torch.Tensor, block_size: int, mask_id: int, gen: torch.Generator, min_ratio: float):
    """Each block of each row masked at its own ratio ~ U(min_ratio, 1); at least one mask per block."""
    B, L = clean.shape
    nb = L // block_size
    ratio = min_ratio + (1 - min_ratio) * torch.rand(B, nb, 1, generator=gen)
    masked = torch.rand(B, nb, block_size, generator=gen) < ratio
    force = torch.randint(0, block_size, (B, nb), generator=gen)
    masked.scatter_(2, force[..., None], True)
    masked = masked.reshape(B, L)
    return clean.masked_fill(masked, mask_id), masked


def load_balance_loss(router_stats: list, num_experts: int, top_k: int) -> torch.Tensor:
    """Switch-style: E * sum_e (fraction of routed slots to e) * (mean router probability of e)."""
    losses = []
    for probs, ids in router_stats:
        frac = torch.zeros(num_experts, device=probs.device).index_add_(
            0, ids.reshape(-1), torch.ones(ids.numel(), device=probs.device)) / ids.numel()
        losses.append(num_experts * (frac * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def block_diffusion_loss(model: CloverModel, clean: torch.Tensor, settings: TrainSettings, gen: torch.Generator):
    cfg = model.config
    noisy, masked = mask_blocks(clean, cfg.block_size, cfg.mask_token_id, gen, settings.min_mask_ratio)
    stats: list = []
    clean_logits, noisy_logits = model.block_forward(clean, noisy, router_stats=stats)
    target = clean[masked]
    logits = noisy_logits[masked].float()
    mask_ce = F.cross_entropy(logits, target)
    ar_ce = F.cross_entropy(clean_logits[:, :-1].reshape(-1, cfg.vocab_size).float(), clean[:, 1:].reshape(-1))
    balance = load_balance_loss(stats, cfg.num_experts, cfg.num_experts_per_tok)
    # confidence-aware term: lower the entropy where the argmax is already the right token
    logp = logits.log_softmax(-1)
    right = logp.argmax(-1) == target
    entropy = -(logp.exp() * logp).sum(-1)
    confidence = (entropy * right).sum() / right.sum().clamp_min(1)
    loss = (mask_ce + settings.ar_weight * ar_ce + settings.balance_weight * balance
            + settings.confidence_weight * confidence)
    with torch.no_grad():
        acc = right.float().mean()
    return loss, {"loss": loss.item(), "mask_ce": mask_ce.item(), "ar_ce": ar_ce.item(), "balance": balance.item(),
                  "confidence": confidence.item(), "mask_acc": acc.item()}


@torch.no_grad()
def evaluate(model: CloverModel, tokens: torch.Tensor, ratios=(0.25, 0.5, 0.75, 1.0), windows: int = 32,
             seq_len: int = 256, seed: int = 1234) -> dict:
    """Held-out figures: masked-token accuracy per mask ratio (each block masked at exactly that
    ratio), next-token perplexity, and the share of masked predictions with confidence >= 0.9."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (windows,), generator=gen)
    clean = torch.stack([tokens[s:s + seq_len] for s in starts.tolist()]).long()
    out = {}
    for r in ratios:
        B, L = clean.shape
        nb, bs = L // cfg.block_size, cfg.block_size
        n_mask = max(1, round(r * bs))
        order = torch.rand(B, nb, bs, generator=gen).argsort(-1)
        masked = (order < n_mask).reshape(B, L)
        noisy = clean.masked_fill(masked, cfg.mask_token_id)
        correct, confident, total = 0, 0, 0
        for i in range(0, B, 8):
            _, logits = model.block_forward(clean[i:i + 8], noisy[i:i + 8])
            m = masked[i:i + 8]
            probs = logits[m].float().softmax(-1)
            p, pred = probs.max(-1)
            correct += int((pred == clean[i:i + 8][m]).sum())
            confident += int((p >= 0.9).sum())
            total += int(m.sum())
        out[f"mask_acc@{r}"] = correct / total
        out[f"confident@{r}"] = confident / total
    nll, count = 0.0, 0
    for i in range(0, clean.shape[0], 8):
        logits = model.logits(clean[i:i + 8])
        nll += F.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size).float(), clean[i:i + 8, 1:].reshape(-1),
                               reduction="sum").item()
        count += clean[i:i + 8, 1:].numel()
    out["ar_perplexity"] = math.exp(nll / count)
    return out


def unigram_accuracy(train_tokens: torch.Tensor, heldout: torch.Tensor) -> float:
    """The baseline: always predict the most frequent training token."""
    top = torch.bincount(train_tokens.long()).argmax()
    return float((heldout.long() == top).float().mean())


# --------------------------------------------------------------------------- the run
def training_batch(tokens: torch.Tensor, distilled: torch.Tensor | None, s: TrainSettings,
                   gen: torch.Generator) -> torch.Tensor:
    """[batch_size, seq_len] rows: random windows of the corpus, and with a self-distillation
    corpus, ``distill_share`` of the rows drawn from it instead."""
    n_distill = 0 if distilled is None else round(s.distill_share * s.batch_size)
    starts = torch.randint(0, len(tokens) - s.seq_len, (s.batch_size - n_distill,), generator=gen)
    rows = [tokens[i:i + s.seq_len] for i in starts.tolist()]
    if n_distill:
        picks = torch.randint(0, len(distilled), (n_distill,), generator=gen)
        rows += [distilled[i, :s.seq_len] for i in picks.tolist()]
    return torch.stack(rows).long()


def lr_at(step: int, s: TrainSettings) -> float:
    step, total = step - s.schedule_start, s.max_steps - s.schedule_start
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = min(1.0, (step - s.warmup_steps) / max(1, total - s.warmup_steps))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def prepare(out: Path, preset: str, vocab_size: int, block_size: int, overrides: dict):
    """Tokenizer, token streams and the initial model config, made once per run directory."""
    data = out / "data.pt"
    if not data.exists():
        train_files, held_files = split_corpus()
        print(f"corpus: {len(train_files)} training and {len(held_files)} held-out stdlib modules", flush=True)
        tok = train_tokenizer(train_files, vocab_size, out / "tokenizer")
        torch.save({"train": encode_files(tok, train_files), "heldout": encode_files(tok, held_files),
                    "heldout_modules": [str(f.name) for f in held_files]}, data)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    config = CloverConfig.preset(
        preset, vocab_size=len(tok), block_size=block_size, mask_token_id=tok.mask_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **overrides)
    return tok, torch.load(data), config


def train(out: str | Path, minutes: float, preset: str = "clover-stdlib", vocab_size: int = 4096,
          block_size: int = 16, settings: TrainSettings | None = None, overrides: dict | None = None,
          threads: int | None = None, device: str | None = None, log_every: int = 10,
          checkpoint_every: int = 100, extend_steps: int | None = None, extend_lr: float | None = None,
          extend_overrides: dict | None = None) -> Path:
    """Train (or resume) the run in ``out`` for at most ``minutes``. ``extend_steps`` continues a
    finished run for that many more steps with a fresh warmup + cosine schedule (peak ``extend_lr``;
    ``extend_overrides`` replaces other fields of its TrainSettings, e.g. ``distill_data``)."""
    from tqdm.auto import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if threads:
        torch.set_num_threads(threads)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    state_file = out / "train_state.pt"
    tok, data, config = prepare(out, preset, vocab_size, block_size, overrides or {})
    if state_file.exists():  # resume
        state = torch.load(state_file, weights_only=False)
        settings = TrainSettings(**state["settings"])
        model = CloverModel.from_pretrained(out / "checkpoint", device=device, dtype=torch.float32)
        step = state["step"]
        if extend_steps:
            settings.schedule_start, settings.max_steps = step, step + extend_steps
            settings.lr = extend_lr or settings.lr
            for field, value in (extend_overrides or {}).items():
                setattr(settings, field, value)
        print(f"resuming {out} at step {step} (schedule to step {settings.max_steps})", flush=True)
    else:
        settings = settings or TrainSettings()
        model = CloverModel.random(config, device=device, seed=settings.seed)
        state, step = None, 0
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=settings.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(settings.seed)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
    tokens = data["train"]
    distilled = None
    if settings.distill_data:
        distilled = torch.load(settings.distill_data)["sequences"]
        if distilled.shape[1] < settings.seq_len:
            raise ValueError(f"{settings.distill_data}: sequences of {distilled.shape[1]} tokens, "
                             f"shorter than seq_len {settings.seq_len}")
        print(f"mixing {len(distilled)} self-distilled sequences into {settings.distill_share:.0%} "
              f"of each batch", flush=True)
    log = open(out / "loss_log.jsonl", "a")

    def checkpoint():
        model.save_pretrained(out / "checkpoint")
        torch.save({"step": step, "settings": asdict(settings), "optimizer": opt.state_dict(),
                    "generator": gen.get_state()}, state_file.with_suffix(".tmp"))
        os.replace(state_file.with_suffix(".tmp"), state_file)

    deadline = time.monotonic() + minutes * 60
    bar = tqdm(desc="training", unit="step", initial=step)
    try:
        while time.monotonic() < deadline and step < settings.max_steps:
            clean = training_batch(tokens, distilled, settings, gen).to(device)
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
                log.write(json.dumps({"step": step, "time": time.time(), "lr": lr_at(step, settings), **parts}) + "\n")
                log.flush()
            if step % checkpoint_every == 0:
                checkpoint()
    except KeyboardInterrupt:
        print("\ninterrupted: saving a checkpoint to resume from", file=sys.stderr)
    finally:
        bar.close()
        checkpoint()
        log.close()
    return out


def export(run: str | Path, dest: str | Path, generation_defaults: dict | None = None,
           dtype: torch.dtype = torch.bfloat16) -> Path:
    """Copy a run's checkpoint (in ``dtype``: bf16 halves the shipped size) and tokenizer into a
    self-contained model directory."""
    import shutil

    run, dest = Path(run), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    model = CloverModel.from_pretrained(run / "checkpoint", dtype=dtype)
    model.save_pretrained(dest)
    for f in (run / "tokenizer").iterdir():
        shutil.copy(f, dest / f.name)
    defaults = {"threshold": 0.9, "max_new_tokens": 128, **(generation_defaults or {})}
    (dest / "generation_config.json").write_text(json.dumps(defaults, indent=2) + "\n")
    return dest


def main(argv=None):
    ap = argparse.ArgumentParser(prog="clover-lab train", description="Train a small Clover on the Python stdlib")
    ap.add_argument("--out", required=True, help="run directory (resumed when it exists)")
    ap.add_argument("--minutes", type=float, default=60.0, help="wall-clock budget of this invocation")
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
    ap.add_argument("--export", metavar="DIR", help="after training, write a model directory here")
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)
    if not 0 <= args.distill_share <= 1:
        ap.error("--distill-share must be in [0, 1]")
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
    run = train(args.out, args.minutes, args.preset, args.vocab_size, args.block_size, settings, overrides,
                threads=args.threads, extend_steps=args.extend_steps,
                extend_lr=args.lr if args.extend_steps else None, extend_overrides=extend_overrides)
    if args.export:
        export(run, args.export)


if __name__ == "__main__":
    main()
