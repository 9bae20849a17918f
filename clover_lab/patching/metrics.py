"""Metrics of one position's logits at one forward (block, step), and ``measure``: a generation run
just far enough to read one."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable

import torch

from clover_lab.errors import InputError
from clover_lab.hooks import points as P
from clover_lab.hooks.events import ResidualEvent
from clover_lab.hooks.registry import StopGeneration
from clover_lab.patching.patch import one_prompt


@dataclass(frozen=True)
class Metric:
    """``fn`` of the logits [V] (fp32) at absolute ``position``; ``name`` says what it is;
    ``tokens`` the token ids it reads (checked against the vocabulary before a run)."""

    position: int
    fn: Callable[[torch.Tensor], torch.Tensor | float]
    name: str
    tokens: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "position", _index("position", self.position))
        object.__setattr__(self, "tokens", tuple(_index("token", t) for t in self.tokens))

    def check(self, vocab_size: int) -> None:
        """Refuse token ids past the vocabulary before a run, not as an IndexError inside one."""
        bad = [t for t in self.tokens if t >= vocab_size]
        if bad:
            raise InputError(f"metric {self.name!r}: token ids {bad} are outside the vocabulary [0, {vocab_size})")

    def __call__(self, logits: torch.Tensor) -> float:
        return float(self.fn(logits))


def _named(token: int, tokenizer) -> str:
    """A token in a metric's name: its text when a tokenizer is given, else its id (also for an id
    the tokenizer cannot decode: Metric's own checks name it)."""
    if tokenizer is None or isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
        return str(token)
    try:
        return repr(tokenizer.decode([int(token)]))
    except Exception:  # noqa: BLE001 - a name only
        return str(token)


def logit_diff(position: int, token: int, other: int, tokenizer=None) -> Metric:
    """logit[token] - logit[other] at ``position``: how much the model prefers ``token``
    (``tokenizer``: the name shows the tokens' text instead of their ids)."""
    return Metric(position, lambda lg: lg[token] - lg[other],
                  f"logit[{_named(token, tokenizer)}] - logit[{_named(other, tokenizer)}] at position {position}",
                  (token, other))


def probability(position: int, token: int, tokenizer=None) -> Metric:
    """The probability of ``token`` at ``position`` (softmax over the vocabulary, mask excluded
    in previews, as the engine decides)."""
    return Metric(position, lambda lg: lg.softmax(-1)[token], f"p({_named(token, tokenizer)}) at position {position}",
                  (token,))


def _index(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise InputError(f"metric {name}={value!r}: expected an int >= 0")
    return int(value)


def head_logits(engine, ev: ResidualEvent, b: int, i: int) -> torch.Tensor:
    """The logits [V] (fp32) of row ``i`` of batch row ``b`` of a ``final_norm.output`` event; in
    a preview the mask token is never a candidate (-inf), as the engine decides."""
    logits = engine.model.lm_head(ev.value[b:b + 1, i])[0].float()
    if ev.mode == "preview" and engine.mask_token_id is not None:
        logits[engine.mask_token_id] = float("-inf")
    return logits


def measure(engine, prompt, metric: Metric, block: int | None, step: int | None, hooks: dict | None = None,
            **generate) -> float:
    """Generate ``prompt`` (with ``hooks`` attached: patches) until the forward at (``block``,
    ``step``), read ``metric`` there and stop the run. NaN when the run never got there or the
    metric's position was not among that forward's logit rows (a preview has logits only where
    the block is still masked; a diffusion commit has none)."""
    one_prompt(prompt, "measure")
    if not isinstance(metric, Metric):
        raise InputError(f"measure: metric must be a Metric (logit_diff, probability), got {type(metric).__name__}")
    metric.check(engine.model.config.vocab_size)
    out: list[float] = []

    def read(ev: ResidualEvent) -> None:
        if (ev.block, ev.step) != (block, step):
            return
        positions = ev.positions.tolist()
        if metric.position in positions:
            out.append(metric(head_logits(engine, ev, 0, positions.index(metric.position))))
        raise StopGeneration

    attached = {k: (list(v) if isinstance(v, (list, tuple)) else [v]) for k, v in (hooks or {}).items()}
    attached.setdefault(P.FINAL_NORM_OUTPUT, []).append(read)  # after a patch of the same point
    with engine.hooks(attached):
        engine.generate(prompt, **generate)
    return out[0] if out else math.nan
