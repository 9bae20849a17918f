"""What a result says about each response token beside its id: the denoising step that unmasked
it (0 for every AR token), and, when ``SamplerSettings.logprobs`` asks, its log-probability and
the ``logprobs`` most probable alternatives', under the distribution it was chosen from (after
penalties, before temperature and filtering: the one confidences are measured on).

The loops note tokens where they choose them (``note``: a block's positions as a step unmasks
them; AR tokens as they are appended) and ``Run.record_block`` takes a block's notes when it
joins the response, oldest block first. Without ``logprobs`` nothing is computed on the device.
"""
from __future__ import annotations

from collections import deque

import torch

from clover_lab.engine.sampling import log_probs


class TokenInfo:
    def __init__(self, logprobs: int | None):
        self.k = logprobs  # None: no log-probabilities
        self.steps: list[int] = []
        self.logprobs: list[float] | None = None if logprobs is None else []
        self.top: list[list[tuple[int, float]]] | None = None if not logprobs else []
        self._blocks: deque = deque()  # (block, {position: (step, logprob, top)}) being resolved, oldest first

    def distribution(self, logits: torch.Tensor, counts, s) -> torch.Tensor | None:
        """The log-distribution [N, V] the tokens of ``logits`` [N, V] are chosen from, or None
        without ``logprobs``; taken before the step's tokens enter the penalty counts."""
        return None if self.k is None else log_probs(logits, counts, s)

    def chosen(self, logp: torch.Tensor | None, rows: list[int], tokens: list[int]) -> list[tuple]:
        """(log-probability, top alternatives) of ``tokens`` chosen at ``rows`` of ``logp``
        (one host transfer), or Nones without ``logprobs``."""
        if logp is None or not rows:
            return [(None, None)] * len(rows)
        logp = logp[torch.tensor(rows, device=logp.device)]  # [n, V]
        lp = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
        if not self.k:
            return [(x, None) for x in lp]
        top = logp.topk(min(self.k, logp.shape[-1]), dim=-1)
        pairs = [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
        return list(zip(lp, pairs))

    def note(self, block, step: int, chosen: dict[int, int], details: list[tuple]) -> None:
        """Block positions unmasked at ``step`` with their tokens and ``chosen``'s details (a
        look-ahead policy notes the next block between the current block's steps)."""
        notes = next((n for b, n in reversed(self._blocks) if b is block), None)
        if notes is None:
            notes = {}
            self._blocks.append((block, notes))
        for p, d in zip(chosen, details):
            notes[p] = (step, *d)

    def forget(self) -> None:
        """Drop the notes of blocks that do not join the response as noted (a speculative draft:
        its accepted tokens are the causal pass's, added one by one)."""
        self._blocks.clear()

    def take(self, count: int) -> None:
        """The oldest block noted joins the response with its first ``count`` positions."""
        notes = self._blocks.popleft()[1] if self._blocks else {}
        for p in range(count):
            self.add(*notes.get(p, (None, None, None)))

    def add(self, step: int | None, logprob: float | None = None, top=None) -> None:
        self.steps.append(step)
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        if self.top is not None:
            self.top.append(top)
