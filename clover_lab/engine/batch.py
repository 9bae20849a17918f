"""A batched generation's state and the forwards its rows share; the loops are in
``batch_loops.py``.

Each prompt is a *row*: a :class:`BatchRow` (a ``Run`` without a cache of its own) holds its
response, sampler generator, penalty counts, stop strings and stats, so the single-generation
step logic (``denoise_step``, ``record_block``, ``fire_commit``) runs on it unchanged. The
:class:`BatchRun` holds the one cache of every row still going (``active``: request rows in the
cache's batch order) and runs the shared forwards.

Prompts of different lengths are not padded into the model: each row's prompt is prefilled into
its own row of the cache, which then keeps per-row lengths (``CloverCache.row_lengths``); every
later forward gives each row its own positions and attention masks the keys past each row's
length. Rows leave the batch (and the cache) as they finish.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch

from ..hooks.events import Where
from ..sampling import SamplerSettings
from .results import Clock, GenerationResult
from .run import Run, allocation_error


class BatchRow(Run):
    """One prompt of a batch: its response and figures; the batch runs its forwards."""

    def __init__(self, batch: "BatchRun", row: int, prompt_ids: list[int], *args):
        self.batch, self.row = batch, row
        super().__init__(batch.engine, prompt_ids, *args)
        self.hooks = batch.hooks  # the scopes open where the batch started, for every row alike
        self.t0 = batch.t0

    def open_cache(self, length: int) -> None:
        self.graphs = None  # the batch's cache is shared; no fast path for batches

    @property
    def cache(self):
        """This row's part of the batch's cache, as a cache of its own (a copy: the error path
        inspects it)."""
        return self.batch.cache.select([self.batch.active.index(self.row)])


@dataclass
class BatchStats:
    """Figures of a batched generation. ``forwards`` counts the shared forwards after the prefill
    (each row's own stats count those it took part in); ``tokens_per_second`` is every row's new
    tokens over the wall time after the prefill, until the last row finished."""

    mode: str
    rows: int
    prompt_tokens: int = 0
    new_tokens: int = 0
    forwards: int = 0
    prefill_forwards: int = 0
    tokens_per_forward: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    total_seconds: float = 0.0
    tokens_per_second: float = 0.0
    stop_reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class BatchResult(list):
    """The results of a batched generation, one :class:`GenerationResult` per prompt in order,
    with the batch's figures in ``stats``."""

    def __init__(self, results: list[GenerationResult], stats: BatchStats):
        super().__init__(results)
        self.stats = stats

    def to_dict(self) -> dict:
        return {"results": [r.to_dict() for r in self], "stats": self.stats.to_dict()}


class BatchRun:
    """The rows of one batched generation, their shared cache and forwards."""

    def __init__(self, engine, prompts: list[list[int]], mode: str, max_new_tokens: int, s: SamplerSettings,
                 stop: list[str], emit: bool, number: int):
        model = engine.model
        self.engine, self.model, self.mode, self.emit, self.number = engine, model, mode, emit, number
        self.device = model.device
        self.max_new = max_new_tokens
        self.s = s
        self.hooks = model.hooks.view()
        self.t0 = time.perf_counter()
        self.t_decode = self.t0
        self.rows = [BatchRow(self, r, ids, mode, max_new_tokens, s, stop, emit, number)
                     for r, ids in enumerate(prompts)]
        self.active = list(range(len(prompts)))  # request rows in the cache's batch order
        self.clock = Clock(self.device)
        self.stats = BatchStats(mode=mode, rows=len(prompts), prompt_tokens=sum(map(len, prompts)))
        self.result: BatchResult | None = None
        length = max(map(len, prompts)) + max_new_tokens
        try:
            self.cache = model.new_cache(length, len(prompts))
        except (torch.OutOfMemoryError, RuntimeError) as e:
            raise allocation_error(model, length, len(prompts), e) from e

    def where(self, phase: str, block: int | None = None, step: int | None = None,
              commit_block: int | None = None, rows: list[int] | None = None) -> Where:
        return Where(self.number, phase, block, step, commit_block, tuple(self.active if rows is None else rows))

    def live(self) -> list[BatchRow]:
        """The rows still going, in the cache's batch order."""
        return [self.rows[r] for r in self.active]

    # ---------------------------------------------------------------- forwards
    def prefill(self, logits: str | None) -> torch.Tensor | None:
        """Every prompt into its row of the cache, the prompts of one length in one forward (no
        padding inside the model). Returns the last-position logits [B, V] when ``logits`` is
        "last"."""
        chunk = self.engine.prefill_chunk_size
        lengths = [len(row.prompt_ids) for row in self.rows]
        by_length: dict[int, list[int]] = {}
        for r, length in enumerate(lengths):
            by_length.setdefault(length, []).append(r)
        outs = {}
        for names in by_length.values():
            rows = [self.rows[r] for r in names]
            if len(names) == len(self.rows):
                cache = self.cache
            elif len(names) == 1:
                cache = self.cache.row(names[0])  # views: the commit lands in the batch's cache
            else:
                cache = self.model.new_cache(self.cache.max_len, len(names))
            self.clock.start("prefill")
            try:
                with self.hooks.applied():
                    out = self.model.prefill(cache, [row.prompt_ids for row in rows], chunk_size=chunk,
                                             logits=logits, where=self.where("prefill", rows=names))
            finally:
                self.clock.stop()
            span, forwards = self.clock.spans["prefill"][-1], math.ceil(len(rows[0].prompt_ids) / chunk)
            for row in rows:
                row.clock.spans["prefill"].append(span)
                row.stats.prefill_forwards = forwards
            self.stats.prefill_forwards += forwards
            if 1 < len(names) < len(self.rows):
                self.cache.put(names, cache)
            if out is not None:
                outs.update(zip(names, out[:, -1]))
        self.cache.set_row_lengths(lengths)
        if self.clock.cuda:
            torch.cuda.synchronize(self.device)
        self.t_decode = time.perf_counter()
        for row in self.rows:
            row.t_decode = self.t_decode
        return torch.stack([outs[r] for r in range(len(self.rows))]) if outs else None

    def _timed(self, kind: str, rows: list[BatchRow], fn):
        """Run one shared forward; its time and count go to the batch and to each of ``rows``."""
        self.clock.start(kind)
        try:
            with self.hooks.applied():
                out = fn()
        finally:
            self.clock.stop()
        span = self.clock.spans[kind][-1]
        self.stats.forwards += 1
        for row in rows:
            row.clock.spans[kind].append(span)
            if kind == "preview":
                row.stats.preview_forwards += 1
            else:
                row.stats.commit_forwards += 1
        return out

    def preview(self, canvas: torch.Tensor, coreset, where: Where, pending: torch.Tensor | None = None,
                rows: list[int] | None = None):
        """Preview logits [B, m, V] of every active row's block ``canvas`` [B, m], after committing
        ``pending`` [B, c] (each row's previous block) in the same forward when given. ``rows``:
        only these active rows (``canvas`` theirs), when the others' blocks are done: they run
        against a copy of their rows of the cache, so that a finished block costs nothing."""
        if rows is not None and rows != self.active:
            index = [self.active.index(r) for r in rows]
            sub = self.cache.select(index)
            narrowed = None if coreset is None else coreset.subset(index)
            return self._timed("preview", [self.rows[r] for r in rows],
                               lambda: self.model.preview(sub, canvas, coreset=narrowed, where=where))
        live = self.live()
        if pending is None:
            return self._timed("preview", live, lambda: self.model.preview(self.cache, canvas, coreset=coreset,
                                                                           where=where))
        logits = self._timed("preview", live, lambda: self.model.commit_and_preview(
            self.cache, pending, canvas, coreset=coreset, where=where).preview_logits)
        for row in live:
            row.stats.fused_forwards += 1
        return logits

    def commit(self, ids: torch.Tensor, where: Where, logits: str | None = None):
        """Commit ``ids`` [B, c] (a token or a block per active row); logits as ``model.commit``."""
        return self._timed("commit", self.live(),
                           lambda: self.model.commit(self.cache, ids, logits=logits, where=where))

    def commit_apart(self, rows: list[int], ids: torch.Tensor, where: Where) -> None:
        """Commit ``ids`` [len(rows), c] for some active rows only (their last block, as they
        leave), in a cache of their own: the others' rows are not touched."""
        sub = self.cache.select([self.active.index(r) for r in rows])
        self._timed("commit", [self.rows[r] for r in rows],
                    lambda: self.model.commit(sub, ids, logits=None, where=where))

    def drop(self, rows: list[int], coreset=None) -> None:
        """These rows have finished: out of the batch and its cache."""
        if not rows:
            return
        keep = [i for i, r in enumerate(self.active) if r not in rows]
        self.active = [self.active[i] for i in keep]
        if self.active:
            self.cache = self.cache.select(keep)
            if coreset is not None:
                coreset.keep(keep)

    # ---------------------------------------------------------------- the end
    def finish(self) -> BatchResult:
        if self.clock.cuda:
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        st = self.stats
        results = [row.result for row in self.rows]
        st.new_tokens = sum(len(r.token_ids) for r in results)
        st.stop_reasons = [r.stop_reason for r in results]
        st.tokens_per_forward = st.new_tokens / st.forwards if st.forwards else 0.0
        st.prefill_seconds = self.clock.total("prefill")
        st.decode_seconds = end - self.t_decode
        st.total_seconds = end - self.t0
        st.tokens_per_second = st.new_tokens / st.decode_seconds if st.decode_seconds > 0 else 0.0
        self.result = BatchResult(results, st)
        return self.result
