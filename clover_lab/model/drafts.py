"""A committed draft kept only up to its accepted length: the model-level half of speculative
decoding (``engine/speculative.py`` is the loop).

``CloverModel.commit_draft`` commits a drafted block of m tokens in one causal forward, so its
logits score every drafted token under the AR model. Once the caller knows how many of them it
accepts (per row), :meth:`DraftCommit.keep` makes the cache hold exactly that prefix:

- attention layers: the commit wrote K,V at the m positions; the rows past the kept length lie
  beyond the cache's length, where nothing reads them and the next commit overwrites them;
- GDN layers: the ring and state cannot be cut back, so each is computed anew at the kept
  length from the state the commit started from (the block's chunk state: a block of
  ``block_size`` <= 64 rows is one chunk of the delta rule) and the commit's own projections
  and gates of the kept rows, which the forward recorded (``layers.gdn.DraftRows``). Only that
  layer's recurrence over the kept rows runs again, not the block: no projection, no attention,
  no MoE, no other row; a row that keeps the whole block keeps the forward's state as it is.

The result equals a plain commit of the kept prefix to float tolerance (tests/test_drafts.py).
"""
from __future__ import annotations

import torch

from clover_lab.errors import CloverError
from clover_lab.model.cache import GDNCache


class DraftError(CloverError, ValueError):
    """A kept length outside the committed draft, or a draft kept twice."""


class DraftCommit:
    """One committed draft: ``logits`` [B, m, V] (row i predicts the token after draft row i),
    and :meth:`keep`. Until ``keep`` is called the cache holds the whole draft."""

    def __init__(self, model, cache, lengths_before: list[int], logits: torch.Tensor, records: dict):
        self.model, self.cache, self.before, self.logits = model, cache, lengths_before, logits
        self.records = records  # GDN layer -> DraftRows
        self.m = logits.shape[1]
        self.kept: list[int] | None = None

    def keep(self, lengths: list[int] | int) -> None:
        """Keep the first ``lengths[r]`` drafted tokens of each batch row r (an int: every row)."""
        if self.kept is not None:
            raise DraftError(f"this draft was already kept at {self.kept}")
        B = self.cache.batch_size
        lengths = list(lengths) if isinstance(lengths, (list, tuple)) else [lengths] * B
        if len(lengths) != B or any(isinstance(a, bool) or not isinstance(a, int) or not 0 <= a <= self.m
                                    for a in lengths):
            raise DraftError(f"keep: expected {B} lengths in [0, {self.m}], got {lengths}")
        groups: dict[int, list[int]] = {}
        for r, a in enumerate(lengths):
            if a < self.m:  # a row keeping the whole draft keeps the forward's state
                groups.setdefault(a, []).append(r)
        for i, rows in self.records.items():
            layer: GDNCache = self.cache.layers[i]
            mixer = self.model.model.layers[i].linear_attn
            for a, index in groups.items():
                index_t = torch.tensor(index, device=layer.state.device)
                ring, state = mixer.kept_state(rows.rows(index_t) if len(index) < B else rows, a)
                layer.ring.index_copy_(0, index_t, ring.to(layer.ring.dtype))
                layer.state.index_copy_(0, index_t, state)
        self.cache.set_row_lengths([n + a for n, a in zip(self.before, lengths)])
        self.kept = lengths
