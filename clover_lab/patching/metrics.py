"""Metrics of one position's logits at one forward (block, step), and ``measure``: a generation run
just far enough to read one."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..hooks import points as P
from ..hooks.events import ResidualEvent
from ..hooks.registry import StopGeneration


@dataclass(frozen=True)
class Metric:
    """``fn`` of the logits [V] (fp32) at absolute ``position``; ``name`` says what it is."""

    position: int
    fn: Callable[[torch.Tensor], torch.Tensor | float]
    name: str

    def __call__(self, logits: torch.Tensor) -> float:
        return float(self.fn(logits))


def _named(token: int, tokenizer) -> str:
    """A token in a metric's name: its text when a tokenizer is given, else its id."""
    return repr(tokenizer.decode([int(token)])) if tokenizer is not None else str(token)


def logit_diff(position: int, token: int, other: int, tokenizer=None) -> Metric:
    """logit[token] - logit[other] at ``position``: how much the model prefers ``token``
    (``tokenizer``: the name shows the tokens' text instead of their ids)."""
    return Metric(int(position), lambda lg: lg[token] - lg[other],
                  f"logit[{_named(token, tokenizer)}] - logit[{_named(other, tokenizer)}] at position {position}")


def probability(position: int, token: int, tokenizer=None) -> Metric:
    """The probability of ``token`` at ``position`` (softmax over the vocabulary, mask excluded
    in previews, as the engine decides)."""
    return Metric(int(position), lambda lg: lg.softmax(-1)[token],
                  f"p({_named(token, tokenizer)}) at position {position}")


def measure(engine, prompt, metric: Metric, block: int | None, step: int | None, hooks: dict | None = None,
            **generate) -> float:
    """Generate ``prompt`` (with ``hooks`` attached: patches) until the forward at (``block``,
    ``step``), read ``metric`` there and stop the run. NaN when the run never got there or the
    metric's position was not among that forward's logit rows (a preview has logits only where
    the block is still masked; a diffusion commit has none)."""
    out: list[float] = []
    mask_id = engine.mask_token_id

    def read(ev: ResidualEvent) -> None:
        if (ev.block, ev.step) != (block, step):
            return
        positions = ev.positions.tolist()
        if metric.position in positions:
            logits = engine.model.lm_head(ev.value[:, positions.index(metric.position)])[0].float()
            if ev.mode == "preview" and mask_id is not None:
                logits[mask_id] = float("-inf")  # never a candidate
            out.append(metric(logits))
        raise StopGeneration

    attached = {k: (list(v) if isinstance(v, (list, tuple)) else [v]) for k, v in (hooks or {}).items()}
    attached.setdefault(P.FINAL_NORM_OUTPUT, []).append(read)  # after a patch of the same point
    with engine.hooks(attached):
        engine.generate(prompt, **generate)
    return out[0] if out else math.nan
