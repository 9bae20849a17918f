"""Train a multi-token-prediction head (``model/prediction_head.py``) on a frozen trunk: the embedded
specimen's drafter for mode "mtp" (recipe: ``assets/make_mtp_head.sh``).

    python -m clover_lab.train.mtp_head --model assets/clover-stdlib --out runs/mtp --minutes 8

The trunk never changes: its weights are frozen and written back byte for byte, the head beside
them (``mtp.*``). The head learns the trunk's own next-next-token distribution (self-distillation:
what verification accepts is the trunk's choice, not the corpus's), on windows of the training
split of the standard library (``train.stdlib_corpus``; the held-out modules stay unseen):

- step 1: slot i reads the trunk's state at i (after its final norm) and the token at i + 1, and
  is taught the trunk's distribution at i + 1 (of the token at i + 2);
- step 2: slot i reads the head's own step-1 output at i and the token at i + 2, and is taught the
  trunk's distribution at i + 2: drafts after the first are chained this way (``engine/mtp.py``).

The head starts from the trunk's last decoder layer when it is a full-attention layer (its shapes
are the head layer's), ``fc`` from reading the state half only, and its norms from the trunk's.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from clover_lab.model.cache import CloverCache


def head_init(model) -> None:
    """A fresh head from the trunk: the last full-attention layer's weights, ``fc`` passing the
    normed state through (plus a small share of the normed embedding), the trunk's final norm."""
    from clover_lab.model.decoder import DecoderLayer
    from clover_lab.model.prediction_head import MTPHead

    config = model.config.replace(mtp_num_hidden_layers=1)
    model.config = config
    head = MTPHead(config, DecoderLayer).to(model.dtype)
    last = max(i for i, t in enumerate(config.layer_types) if t == "full_attention")
    with torch.no_grad():
        head.layers[0].load_state_dict(model.model.layers[last].state_dict())
        H = config.hidden_size
        eye = torch.eye(H, dtype=head.fc.weight.dtype)
        head.fc.weight.copy_(torch.cat([0.1 * eye, eye], dim=1))
        head.norm.weight.copy_(model.model.norm.weight)
    model.mtp = head


def windows(tokens: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(tokens) - length, (batch,), generator=gen)
    return torch.stack([tokens[s:s + length] for s in starts.tolist()]).long()


def trunk(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen trunk over windows ``ids`` [B, L]: (states after the final norm [B, L, H], the
    log-probabilities of its next-token distributions [B, L, V])."""
    with torch.no_grad():
        cache = model.new_cache(ids.shape[1], ids.shape[0])
        with model.keeping_hidden() as kept:
            logits = model.commit(cache, ids, logits="all")
        return model.model.norm(kept[0]), logits.float().log_softmax(-1)


def head_pass(model, hidden: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over a whole window at once (causal over its slots), with gradients."""
    cache = CloverCache.allocate(model.mtp.head_config, ids.shape[1], ids.shape[0], device=ids.device,
                                 dtype=model.dtype)
    return model.mtp(model, cache, hidden, ids)


def losses(model, ids: torch.Tensor, h: torch.Tensor, logp: torch.Tensor,
           chain: bool = True) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """(step-1 loss, step-2 loss, step-1 and step-2 agreement with the trunk's greedy token) on
    windows ``ids`` and the trunk's states and log-probabilities over them (``trunk``); without
    ``chain`` step 2 is not run (its loss 0, its agreement NaN)."""
    L = ids.shape[1]
    out1, logits1 = head_pass(model, h[:, :L - 2], ids[:, 1:L - 1])  # slot i: (h_i, t_{i+1}) -> trunk at i + 1
    target1 = logp[:, 1:L - 1]
    loss1 = F.kl_div(logits1.float().log_softmax(-1), target1, log_target=True, reduction="batchmean") / (L - 2)
    agree1 = (logits1.argmax(-1) == target1.argmax(-1)).float().mean().item()
    if not chain:
        return loss1, loss1.new_zeros(()), agree1, float("nan")
    _, logits2 = head_pass(model, out1[:, :L - 3], ids[:, 2:L - 1])  # slot i: (g_i, t_{i+2}) -> trunk at i + 2
    target2 = logp[:, 2:L - 1]
    loss2 = F.kl_div(logits2.float().log_softmax(-1), target2, log_target=True, reduction="batchmean") / (L - 3)
    agree2 = (logits2.argmax(-1) == target2.argmax(-1)).float().mean().item()
    return loss1, loss2, agree1, agree2


def train(model_dir: str | Path, out: str | Path, minutes: float, batch: int = 8, length: int = 192,
          lr: float = 1e-3, seed: int = 0, files: int | None = None, chain: float = 0.5, reuse: int = 1) -> dict:
    from clover_lab.checkpoint.loading import load_tokenizer
    from clover_lab.model.decoder import CloverModel
    from clover_lab.train.stdlib_corpus import encode_files, split_corpus

    torch.manual_seed(seed)
    model_dir, out = Path(model_dir), Path(out)
    model = CloverModel.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(model_dir)
    train_files = split_corpus()[0]
    if files:
        train_files = train_files[::max(1, len(train_files) // files)][:files]
    tokens = encode_files(tokenizer, train_files)
    head_init(model)
    for p in model.parameters():
        p.requires_grad_(False)
    params = list(model.mtp.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    log, start, step = [], time.monotonic(), 0
    budget = minutes * 60
    while time.monotonic() - start < budget:
        frac = (time.monotonic() - start) / budget
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * (1 - frac))
        ids = windows(tokens, batch, length, gen)
        h, logp = trunk(model, ids)
        for _ in range(reuse):  # the trunk's forward costs more than the head's: each batch taught ``reuse`` times
            loss1, loss2, a1, a2 = losses(model, ids, h, logp, chain > 0)
            opt.zero_grad()
            (loss1 + chain * loss2).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        step += 1
        if step % 5 == 0 or step == 1:
            row = {"step": step, "seconds": round(time.monotonic() - start, 1), "loss1": loss1.item(),
                   "loss2": loss2.item(), "agree1": a1, "agree2": a2}
            log.append(row)
            print(json.dumps(row), flush=True)
    return save(model, model_dir, out, {"steps": step, "batch": batch, "length": length, "lr": lr,
                                         "minutes": minutes, "chain": chain, "reuse": reuse, "train_tokens": len(tokens), "log": log})


def save(model, model_dir: Path, out: Path, record: dict) -> dict:
    """The trunk as it was (its own dtype) with the trained head, the tokenizer and generation
    defaults copied, into ``out``; ``mtp_training.json`` beside them."""
    stored = json.loads((model_dir / "config.json").read_text()).get("dtype") or "float32"
    for p in model.parameters():
        p.requires_grad_(False)
    model = model.to(getattr(torch, stored))
    model.save_pretrained(out)
    for f in model_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors", "model.safetensors.index.json") and f.is_file():
            shutil.copy2(f, out / f.name)
    (out / "mtp_training.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def measure(model_dir: str | Path, windows_count: int = 24, new_tokens: int = 64, draft_tokens: int = 3) -> dict:
    """Mode "mtp" at greedy (no penalties) on ``windows_count`` held-out windows of the standard
    library (``train.measure``'s: 48 tokens each, never trained on): tokens per trunk forward, the
    mean accepted drafts per verify, and whether every completion equals AR's."""
    from clover_lab.engine import load
    from clover_lab.train.measure import heldout_prompts, heldout_tokens

    engine = load(model_dir, dtype=torch.float32)
    prompts = heldout_prompts(heldout_tokens(model_dir), windows_count)
    greedy = dict(temperature=0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                  max_new_tokens=new_tokens)
    made = forwards = 0
    accepted, same = [], True
    for p in prompts:
        r = engine.generate(p, mode="mtp", mtp_draft_tokens=draft_tokens, **greedy)
        made, forwards = made + len(r.token_ids), forwards + r.stats.forwards
        accepted += r.stats.accepted
        same &= r.token_ids == engine.generate(p, mode="ar", **greedy).token_ids
    return {"windows": len(prompts), "new_tokens": new_tokens, "draft_tokens": draft_tokens,
            "tokens_per_forward": made / max(1, forwards), "mean_accepted": sum(accepted) / max(1, len(accepted)),
            "equals_ar": same}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clover_lab.train.mtp_head", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the trunk's model directory (frozen)")
    ap.add_argument("--out", default=None, help="where the trunk with its trained MTP head is written")
    ap.add_argument("--measure", action="store_true",
                    help="measure --model's head instead (mode mtp, greedy, held-out windows) and print JSON")
    ap.add_argument("--windows", type=int, default=24, help="--measure: held-out windows")
    ap.add_argument("--minutes", type=float, default=8.0, help="wall-clock training budget")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=192, help="window length in tokens")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--files", type=int, default=None, help="encode only this many training files (faster start)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reuse", type=int, default=1, help="optimizer steps per batch of trunk states")
    ap.add_argument("--chain", type=float, default=0.5,
                    help="weight of the chained (step-2) loss; 0 trains the first draft only (cheaper)")
    a = ap.parse_args(argv)
    if a.measure:
        print(json.dumps(measure(a.model, a.windows)))
        return 0
    if a.out is None:
        ap.error("--out is required to train")
    record = train(a.model, a.out, a.minutes, a.batch, a.length, a.lr, a.seed, a.files, a.chain, a.reuse)
    print(f"{record['steps']} steps; wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
