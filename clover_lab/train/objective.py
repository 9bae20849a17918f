"""The block-diffusion objective on the model's own operators (``CloverModel.training_forward``):
a training sequence is split into blocks; the clean stream runs in commit mode and a noisy copy
(each block masked at its own random ratio) runs in preview mode against the clean prefix, in one
forward. Loss: cross-entropy on the masked positions, next-token loss on the clean stream, a router
load-balancing loss, and a confidence term that sharpens the distribution where the prediction is
already right (as LLaDA2's CAP training does), so that generation can unmask many tokens per step.
Also the held-out evaluation the model card reports."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from clover_lab.model.decoder import CloverModel


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
    functions_share: float = 0.0  # the share of each batch's rows that start at a function's head (train.functions)
    split_newlines: float = 0.0  # the share of newline+indent tokens written as the two apart (train.newlines)
    init: str | None = None  # the model directory the run started from (``--init``), if not from scratch


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


def load_balance_loss(router_stats: list, num_experts: int, top_k: int, shard=None) -> torch.Tensor:
    """Switch-style: E * sum_e (fraction of routed slots to e) * (mean router probability of e),
    over the whole batch: with ``shard`` (``train.shard.Shard``), each process holds some of its
    rows; the fractions are summed over processes (they carry no gradient), and this process's
    share of the mean probability is returned scaled by the process count, so that the mean over
    processes (what FSDP's gradient averaging takes) is the whole batch's loss."""
    world = 1 if shard is None else shard.world
    losses = []
    for probs, ids in router_stats:
        counts = torch.zeros(num_experts, device=probs.device).index_add_(
            0, ids.reshape(-1), torch.ones(ids.numel(), device=probs.device))
        tokens = torch.tensor(float(probs.shape[0]), device=probs.device)
        if shard is not None:
            counts, tokens = shard.all_sum(counts), shard.all_sum(tokens)
        frac = counts / (tokens * ids.shape[-1])
        losses.append(num_experts * (frac * probs.sum(0)).sum() / tokens * world)
    return torch.stack(losses).mean()


def block_diffusion_loss(model: CloverModel, clean: torch.Tensor, settings: TrainSettings, gen: torch.Generator,
                         shard=None):
    """The loss of the batch ``clean`` [B, L], and its parts (floats, over the whole batch).

    ``shard``: this process's place among several (``train.shard.Shard``). Every process draws the
    same masks for the whole batch, runs only its own rows, and normalises by whole-batch counts,
    times the process count: the mean of the processes' losses (and of their gradients, which is
    what FSDP reduces) is then the one-process loss, whatever the number of processes."""
    cfg = model.config
    clean = clean.cpu()  # the masks are drawn on the CPU generator, the same on every process
    noisy, masked = mask_blocks(clean, cfg.block_size, cfg.mask_token_id, gen, settings.min_mask_ratio)
    world = 1 if shard is None else shard.world
    mask_count, ar_count = masked.sum(), clean.shape[0] * (clean.shape[1] - 1)  # whole-batch counts
    if shard is not None:
        rows = shard.rows(clean.shape[0])
        clean, noisy, masked = clean[rows], noisy[rows], masked[rows]
    clean, noisy, masked = (t.to(model.device) for t in (clean, noisy, masked))
    stats: list = []
    clean_logits, noisy_logits = model.training_forward(clean, noisy, router_stats=stats)
    target = clean[masked]
    logits = noisy_logits[masked].float()
    mask_ce = F.cross_entropy(logits, target, reduction="sum") / mask_count * world
    ar_ce = F.cross_entropy(clean_logits[:, :-1].reshape(-1, cfg.vocab_size).float(), clean[:, 1:].reshape(-1),
                            reduction="sum") / ar_count * world
    balance = load_balance_loss(stats, cfg.num_experts, cfg.num_experts_per_tok, shard)
    # confidence-aware term: lower the entropy where the argmax is already the right token
    logp = logits.log_softmax(-1)
    right = logp.argmax(-1) == target
    entropy = -(logp.exp() * logp).sum(-1)
    right_count = right.sum().float() if shard is None else shard.all_sum(right.sum().float())
    confidence = (entropy * right).sum() / right_count.clamp_min(1) * world
    loss = (mask_ce + settings.ar_weight * ar_ce + settings.balance_weight * balance
            + settings.confidence_weight * confidence)
    parts = torch.stack([loss, mask_ce, ar_ce, balance, confidence]).detach() / world
    if shard is not None:
        parts = shard.all_sum(parts)
    parts = dict(zip(("loss", "mask_ce", "ar_ce", "balance", "confidence"), parts.tolist()))
    return loss, {**parts, "mask_acc": float(right_count / mask_count)}


@torch.no_grad()
def masked_accuracy(model: CloverModel, clean: torch.Tensor, ratio: float, gen: torch.Generator,
                    batch: int = 8, mask_id: int | None = None) -> tuple[float, float]:
    """Each block of the windows ``clean`` [B, L] masked at exactly ``ratio`` (at least one token)
    with ``mask_id`` (default: the config's) and previewed against the clean prefix: (the share of
    masked tokens predicted right, the share predicted with confidence >= 0.9, their mean
    negative log-likelihood in nats)."""
    cfg = model.config
    B, L = clean.shape
    nb, bs = L // cfg.block_size, cfg.block_size
    n_mask = max(1, round(ratio * bs))
    order = torch.rand(B, nb, bs, generator=gen).argsort(-1)
    masked = (order < n_mask).reshape(B, L).to(clean.device)  # drawn on the CPU: the same on any device
    noisy = clean.masked_fill(masked, cfg.mask_token_id if mask_id is None else mask_id)
    correct, confident, nll, total = 0, 0, 0.0, 0
    for i in range(0, B, batch):
        _, logits = model.training_forward(clean[i:i + batch], noisy[i:i + batch])
        m = masked[i:i + batch]
        logits, target = logits[m.to(logits.device)].float(), clean[i:i + batch][m].to(logits.device)
        p, pred = logits.softmax(-1).max(-1)
        correct += int((pred == target).sum())
        confident += int((p >= 0.9).sum())
        nll += float(F.cross_entropy(logits, target, reduction="sum"))
        total += int(m.sum())
    return correct / total, confident / total, nll / total


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
        out[f"mask_acc@{r}"], out[f"confident@{r}"], _ = masked_accuracy(model, clean, r, gen)
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
