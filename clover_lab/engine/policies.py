"""Decoding rules from the field, through the seam (``policy.py``), beside the spec's threshold
rule (:class:`~.policy.ThresholdPolicy`: probability, margin or entropy confidence):

- :class:`EntropyBoundedPolicy`, the EB-sampler (Ben-Hamu et al. 2025): the masked positions in
  order of rising entropy, unmasking the longest run whose summed entropy, less its largest,
  stays within ``gamma`` (the error bound); always at least the surest one.
- :class:`TopKPolicy`: the ``k`` most confident positions per step, ``k`` from a schedule (one
  value per step, the last repeated), as LLaDA's and Fast-dLLM's fixed-count decoding does.
- :class:`LookAheadPolicy`, multi-block decoding (D2F, SGLang's multi-block): the threshold rule
  on the current block; once ``start`` of it is resolved, each step also previews the next block
  in the same forward (the seam's look-ahead: one canvas of both blocks, so the next block sees
  this one's current guesses) and unmasks there the positions at ``threshold``; the next block
  starts with them, so it needs fewer steps, and the run fewer forwards.

Candidates come from the row's sampler settings (penalties, temperature, top-k / top-p) as in
the threshold rule; the step limit unmasks everything left. Each rule checks its settings when
made (a SettingsError naming the setting). :func:`make_policy` makes one by name
(``clover-lab generate --policy eb:gamma=0.5``).
"""
from __future__ import annotations

import torch

from .. import sampling
from ..sampling import SettingsError
from .policy import DecodingPolicy, Proposal, ThresholdPolicy


def _candidates(row, logits: torch.Tensor):
    """(tokens [N], probs [N, V]) from the row's sampler settings, after its penalties."""
    if row.counts is not None:
        logits = sampling.apply_penalties(logits, row.counts, row.s)
    return sampling.candidates(logits, row.s, row.generator)


class EntropyBoundedPolicy(DecodingPolicy):
    """EB-sampler: unmask the surest positions while their summed entropy minus the largest
    stays within ``gamma`` (nats; >= 0). ``gamma=0`` unmasks one position per step (ties aside)."""

    def __init__(self, gamma: float = 0.1):
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 <= gamma < float("inf"):
            raise SettingsError(f"EntropyBoundedPolicy gamma={gamma!r}: must be a finite number >= 0")
        self.gamma = float(gamma)

    def propose(self, row, block, logits: torch.Tensor, finish: bool) -> Proposal:
        tokens, probs = _candidates(row, logits)
        entropy = torch.special.entr(probs).sum(-1)  # [N]
        order = entropy.argsort(stable=True)
        sorted_h = entropy[order]
        bound = sorted_h.cumsum(0) - sorted_h  # summed entropy of the run up to i, less its largest (sorted_h[i])
        take = bound <= self.gamma
        take[0] = True
        flags = torch.zeros_like(take).scatter(0, order, take) | finish
        return Proposal(tokens, torch.exp(-entropy), flags)

    def __repr__(self) -> str:
        return f"EntropyBoundedPolicy(gamma={self.gamma})"


class TopKPolicy(DecodingPolicy):
    """Unmask the ``k`` most confident positions per step (by the candidate's probability);
    ``k``: one count (every step) or a schedule, a list of counts per step, the last repeated."""

    def __init__(self, k: int | list[int] = 2):
        schedule = list(k) if isinstance(k, (list, tuple)) else [k]
        if not schedule or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in schedule):
            raise SettingsError(f"TopKPolicy k={k!r}: must be a positive integer or a non-empty list of them")
        self.schedule = schedule

    def k_at(self, step: int) -> int:
        return self.schedule[min(step, len(self.schedule) - 1)]

    def propose(self, row, block, logits: torch.Tensor, finish: bool) -> Proposal:
        tokens, probs = _candidates(row, logits)
        conf = sampling.confidences(probs, tokens)
        flags = rank_below(conf, self.k_at(block.step)) | finish
        return Proposal(tokens, conf, flags)

    def __repr__(self) -> str:
        return f"TopKPolicy(k={self.schedule if len(self.schedule) > 1 else self.schedule[0]})"


class LookAheadPolicy(ThresholdPolicy):
    """The threshold rule (the row's sampler settings) on the current block; once a fraction
    ``start`` (in [0, 1]) of it is resolved, the next block is previewed beside it, and its
    positions whose confidence is at least ``threshold`` (in (0, 1]) are unmasked ahead."""

    def __init__(self, start: float = 0.5, threshold: float = 0.9):
        for name, v, low_open in (("start", start, False), ("threshold", threshold, True)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v <= 1 if low_open else 0 <= v <= 1):
                raise SettingsError(f"LookAheadPolicy {name}={v!r}: must be a number in {'(0' if low_open else '[0'}, 1]")
        self.start, self.threshold = float(start), float(threshold)

    def look_ahead(self, row, block) -> bool:
        return 1 - len(block.masked) / len(block) >= self.start

    def propose_ahead(self, row, block, ahead, logits: torch.Tensor) -> Proposal:
        tokens, probs = _candidates(row, logits)
        conf = sampling.confidences(probs, tokens, row.s.confidence)
        return Proposal(tokens, conf, conf >= self.threshold)

    def __repr__(self) -> str:
        return f"LookAheadPolicy(start={self.start}, threshold={self.threshold})"


def rank_below(conf: torch.Tensor, k: int) -> torch.Tensor:
    """bool [N]: the ``k`` largest of ``conf`` (ties by position)."""
    order = conf.argsort(descending=True, stable=True)
    return torch.zeros_like(conf, dtype=torch.bool).scatter(0, order[:k], True)


POLICIES = {"threshold": ThresholdPolicy, "eb": EntropyBoundedPolicy, "topk": TopKPolicy,
            "lookahead": LookAheadPolicy}


def make_policy(spec) -> DecodingPolicy:
    """A policy from a DecodingPolicy (itself), a name (``"eb"``) or ``"name:setting=value,..."``
    (``"topk:k=4"``, ``"topk:k=1/2/4"`` for a schedule, ``"eb:gamma=0.5"``,
    ``"lookahead:start=0.5,threshold=0.9"``)."""
    if isinstance(spec, DecodingPolicy):
        return spec
    if not isinstance(spec, str):
        raise SettingsError(f"policy={spec!r}: expected a DecodingPolicy or one of {', '.join(POLICIES)}")
    name, _, args = spec.partition(":")
    if name not in POLICIES:
        raise SettingsError(f"policy {name!r}: unknown; use one of {', '.join(POLICIES)}")
    kwargs = {}
    for item in filter(None, args.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SettingsError(f"policy {spec!r}: settings are name=value, got {item!r}")
        kwargs[key.strip()] = _value(value.strip())
    try:
        return POLICIES[name](**kwargs)
    except TypeError as e:
        raise SettingsError(f"policy {spec!r}: {e}") from None


def _value(text: str):
    if "/" in text:
        return [_value(v) for v in text.split("/")]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
