"""Engine events: what the generation loop hands to hooks (``denoise.step``, ``block.commit``)
and what :meth:`Engine.stream` yields.

Hook events are built only when a hook is attached to their point. Their tensors live on the
model's device; positions and tokens the engine already holds on the host are plain lists, so
reading them costs no synchronisation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .generate import GenerationResult


class _Stoppable:
    stopped: bool

    def stop(self) -> None:
        """End the generation cleanly after this event (same as raising StopGeneration)."""
        self.stopped = True


@dataclass
class StepEvent(_Stoppable):
    """After one preview's unmask decision (``denoise.step``), before it is applied.

    ``canvas`` [m] (a copy of the block before this step: mask tokens where still masked),
    ``masked`` the block positions still masked before this step, ``candidates`` [N] and
    ``confidences`` [N] aligned with ``masked`` (device tensors), ``unmask`` the positions the
    rule chose to unmask now, ``time`` seconds since the generation started.

    Change the decision by editing ``unmask`` (or :meth:`veto` / :meth:`add`), and the token
    placed at a position with :meth:`set_token`; stop with :meth:`stop`.
    """

    block: int
    step: int
    canvas: torch.Tensor
    masked: list[int]
    candidates: torch.Tensor
    confidences: torch.Tensor
    unmask: list[int]
    time: float
    tokens: dict[int, int] = field(default_factory=dict)  # position -> token overriding the candidate
    stopped: bool = False
    logits: torch.Tensor | None = field(default=None, repr=False)  # [N, V] this preview's, aligned with masked

    def top_candidates(self, k: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most probable tokens of this step's distribution at each masked position:
        (ids [N, k], probabilities [N, k]), computed only when asked."""
        if self.logits is None:
            raise ValueError("this step event carries no logits")
        probs, ids = self.logits.float().softmax(-1).topk(min(k, self.logits.shape[-1]), dim=-1)
        return ids, probs

    def veto(self, *positions: int | Iterable[int]) -> None:
        """Keep these block positions masked this step."""
        drop = set(_flatten(positions))
        self.unmask = [p for p in self.unmask if p not in drop]

    def add(self, *positions: int | Iterable[int]) -> None:
        """Unmask these (still masked) block positions too, with their candidates."""
        have = set(self.unmask)
        for p in _flatten(positions):
            if p not in have:
                self.unmask.append(p)
                have.add(p)

    def set_token(self, position: int, token: int) -> None:
        """Unmask ``position`` now with ``token`` instead of its candidate."""
        self.tokens[int(position)] = int(token)
        self.add(int(position))

    def candidate(self, position: int) -> int:
        """The candidate token at a block position (reads one value from the device)."""
        return int(self.candidates[self.masked.index(position)])

    def confidence(self, position: int) -> float:
        return float(self.confidences[self.masked.index(position)])


@dataclass
class CommitEvent(_Stoppable):
    """After a block is committed to the cache (``block.commit``).

    ``tokens`` the block's final tokens (after EOS / stop-string truncation), ``steps`` the
    previews it took, ``start`` its first position in the sequence, ``time`` seconds since the
    generation started. In AR mode every token is a block of one (``steps`` = 1)."""

    block: int
    tokens: list[int]
    steps: int
    start: int
    time: float
    stopped: bool = False


def _flatten(items) -> list[int]:
    out = []
    for item in items:
        if isinstance(item, torch.Tensor):
            out += [int(x) for x in item.reshape(-1).tolist()]
        elif isinstance(item, (list, tuple, set, frozenset, range)):
            out += [int(x) for x in item]
        else:
            out.append(int(item))
    return out


@dataclass
class StreamUpdate:
    """One update of :meth:`Engine.stream`.

    ``kind``: "step" (provisional tokens of the current block changed), "commit" (a block became
    final and is in the cache) or "done" (``result`` holds the GenerationResult).
    ``committed`` the final response tokens so far; ``block_tokens`` the current block, None where
    still masked. Its tokens are provisional: an unmasked position keeps its token, but the block
    may still be cut after an EOS or a stop string before it is committed. ``unmasked`` the block
    positions unmasked by this step.
    """

    kind: str
    block: int
    step: int | None
    committed: list[int]
    block_tokens: list[int | None]
    unmasked: list[int] = field(default_factory=list)
    time: float = 0.0
    result: "GenerationResult | None" = None
    tokenizer: object = field(default=None, repr=False)

    @property
    def committed_text(self) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(self.committed, skip_special_tokens=True)

    def block_pieces(self) -> list[str | None]:
        """The current block as one string per position (None where masked); ids without a tokenizer."""
        if self.tokenizer is None:
            return [None if t is None else str(t) for t in self.block_tokens]
        return [None if t is None else self.tokenizer.decode([t], skip_special_tokens=False)
                for t in self.block_tokens]
