"""The loops of a batched generation (``engine.generate([p1, p2, ...])``): block diffusion and AR
over rows that share every forward.

Block diffusion: the rows resolve their block ``index`` together. Each row decides its own
unmasking from its own logits (``denoise_step``, as a single generation does), so rows unmask
different numbers of positions per step and finish their blocks at different steps; a row whose
block is done waits, out of the previews, until every row's block is done. The finished blocks
are then committed fused with the next block's first preview, as in a single generation. A row
that ends (EOS, a stop string, its length, a hook) commits its last block apart and leaves the
batch. Greedy rows give the tokens they would give alone.

Stops: a ``denoise.step`` or ``block.commit`` hook that stops ends its own row; StopGeneration
from a hook inside the model ends every row (the forward they share did not happen).
"""
from __future__ import annotations

from typing import Iterator

import torch

from .. import sampling
from ..hooks.registry import StopGeneration
from .ar import end_reason
from .diffusion import Block, denoise_step
from .faults import check_logits, collapsed, logits_health
from .results import StreamUpdate


def run_batch_diffusion(batch) -> Iterator[StreamUpdate]:
    loop = BatchBlockLoop(batch)
    try:
        batch.prefill(None)
    except StopGeneration:  # a model hook stopped a prompt's prefill: no tokens for any row
        yield from loop.end_rows(batch.active, "hook", cache_complete=False)
    else:
        try:
            yield from loop.run_blocks()
        except StopGeneration:  # a model hook stopped a shared forward; that forward changed nothing
            yield from loop.abandon()
    batch.finish()
    if batch.emit:
        yield StreamUpdate("batch", loop.index, None, [], [], result=batch.result)


class BatchBlockLoop:
    """Per row: the finished block waiting for its fused commit (``pending``); shared: the block
    index being resolved and the coreset (each row its own experts within it)."""

    def __init__(self, batch):
        self.batch = batch
        self.coreset = batch.rows[0].new_coreset()
        self.pending: dict[int, tuple[list[int], int]] = {}  # row -> (tokens, steps)
        self.index = 0

    def run_blocks(self) -> Iterator[StreamUpdate]:
        batch, engine = self.batch, self.batch.engine
        while batch.active:
            produced = len(batch.rows[batch.active[0]].committed) + len(self.pending_tokens(batch.active[0]))
            size = min(engine.block_size, batch.max_new - produced)
            blocks = {r: Block(self.index, size, engine.mask_token_id, batch.device, batch.s.max_steps_per_block)
                      for r in batch.active}
            if self.coreset is not None:
                self.coreset.reset()
            yield from self.resolve(blocks)
            leaving = []
            for r in batch.active:
                block = blocks[r]
                tokens = block.tokens()
                if block.end_reason is not None or produced + len(tokens) >= batch.max_new:
                    leaving.append((r, tokens, block))
                else:
                    self.pending[r] = (tokens, block.step)
            yield from self.commit_last(leaving)
            self.index += 1

    def pending_tokens(self, r: int) -> list[int]:
        return self.pending[r][0] if r in self.pending else []

    def resolve(self, blocks: dict[int, Block]) -> Iterator[StreamUpdate]:
        """Shared previews until no active row's block has a masked position."""
        batch = self.batch
        step = 0
        while any(blocks[r].masked for r in batch.active):
            rows = [r for r in batch.active if blocks[r].masked]  # a row whose block is done waits
            canvas = torch.stack([blocks[r].canvas for r in rows])
            if self.pending:  # the block's first step: every row takes part
                pending = torch.tensor([self.pending[r][0] for r in rows], device=batch.device)
                where = batch.where("decode", self.index, step, commit_block=self.index - 1)
                logits = batch.preview(canvas, self.coreset, where, pending=pending)
                yield from self.publish_pending(rows)
            else:
                logits = batch.preview(canvas, self.coreset, batch.where("decode", self.index, step, rows=rows),
                                       rows=rows)
            for i, r in enumerate(rows):
                block = blocks[r]
                if r not in batch.active or not block.masked:
                    continue
                idx = block.masked_index()
                row = batch.rows[r]
                unmask, _ = denoise_step(row, block, logits[i:i + 1] if idx is None else logits[i:i + 1, idx], idx)
                if batch.emit:
                    yield row.update("step", block.index, block.step - 1, block.host, unmask)
            step += 1

    def publish_pending(self, rows: list[int]) -> Iterator[StreamUpdate]:
        """The fused forward committed each row's previous block: it joins the row's response and
        fires ``block.commit``; a row whose hook asks to stop ends here."""
        batch = self.batch
        stopped = []
        for r in rows:
            tokens, steps = self.pending.pop(r)
            row = batch.rows[r]
            start = len(row.prompt_ids) + len(row.committed)
            row.record_block(tokens, steps)
            if row.fire_commit(self.index - 1, tokens, steps, start):
                stopped.append(r)
            if batch.emit:
                yield row.update("commit", self.index - 1, None)
        yield from self.end_rows(stopped, "hook")

    def commit_last(self, leaving: list[tuple]) -> Iterator[StreamUpdate]:
        """The last blocks of the rows that end now, committed apart (rows whose blocks are as long
        share a forward) so that each row's cache would hold its whole response."""
        batch = self.batch
        by_length: dict[int, list[tuple]] = {}
        for item in leaving:
            by_length.setdefault(len(item[1]), []).append(item)
        reasons = {}
        for length, group in by_length.items():
            rows = [r for r, _, _ in group]
            reasons.update({r: block.end_reason or "length" for r, _, block in group})
            if not length:
                continue
            starts = {r: len(batch.rows[r].prompt_ids) + len(batch.rows[r].committed) for r in rows}
            ids = torch.tensor([tokens for _, tokens, _ in group], device=batch.device)
            try:
                batch.commit_apart(rows, ids, batch.where("decode", commit_block=self.index, rows=rows))
            except StopGeneration:  # a model hook stopped it: the blocks are the rows' last, not cached
                for r, tokens, block in group:
                    batch.rows[r].record_block(tokens, block.step)
                    reasons[r] = "hook"
                yield from self.end_rows(rows, None, cache_complete=False, reasons=reasons)
                continue
            for r, tokens, block in group:
                row = batch.rows[r]
                row.record_block(tokens, block.step)
                row.fire_commit(self.index, tokens, block.step, starts[r])  # the row ends anyway
                if batch.emit:
                    yield row.update("commit", self.index, None)
        yield from self.end_rows([r for r, _, _ in leaving], None, reasons=reasons)

    def end_rows(self, rows: list[int], reason: str | None, cache_complete: bool = True,
                 reasons: dict[int, str] | None = None) -> Iterator[StreamUpdate]:
        """These rows are done: their results, and out of the batch."""
        batch = self.batch
        rows = [r for r in rows if r in batch.active]
        for r in rows:
            row = batch.rows[r]
            if not cache_complete:
                row.stats.cache_complete = False
            row.finish(reason or reasons[r])
            if batch.emit:
                yield row.update("done", self.index, None)
        batch.drop(rows, self.coreset)

    def abandon(self) -> Iterator[StreamUpdate]:
        """A model hook stopped a shared forward: every row ends; a finished block that was
        waiting for its fused commit is part of its row's response, but not in the cache."""
        for r in self.batch.active:
            if r in self.pending:
                tokens, steps = self.pending.pop(r)
                self.batch.rows[r].record_block(tokens, steps)
                self.batch.rows[r].stats.cache_complete = False
        yield from self.end_rows(list(self.batch.active), "hook")


def run_batch_ar(batch) -> Iterator[StreamUpdate]:
    """One token per row per forward; rows leave at EOS or a stop string."""
    try:
        logits = batch.prefill("last")  # [B, V]
    except StopGeneration:  # a model hook stopped a prompt's prefill: no tokens for any row
        return (yield from _stopped(batch, 0))
    for i in range(batch.max_new):
        rows = batch.live()
        tokens, health = [], []
        for j, row in enumerate(rows):
            t, conf, _ = sampling.decide(logits[j:j + 1], row.counts, row.s, row.generator)
            tokens.append(t[0])
            health.append(logits_health(collapsed(logits[j:j + 1]), conf))
        # the one sync per step: every row's token and whether its logits could be used
        host = torch.stack(tokens + health).tolist()
        for j, row in enumerate(rows):
            check_logits(row, host[len(rows) + j], f"token {i} (AR)")
        reasons = {}
        for j, (row, t) in enumerate(zip(rows, host)):
            row.info.add(0, *row.info.chosen(row.info.distribution(logits[j:j + 1], row.counts, row.s), [0], [t])[0])
            if row.counts is not None:
                row.counts[t] += 1
            row.committed.append(t)
            reasons[row.row] = end_reason(row, t)
        last = i + 1 == batch.max_new or all(reason != "length" for reason in reasons.values())
        ids = torch.tensor([[t] for t in host[:len(rows)]], device=batch.device)
        try:
            out = batch.commit(ids, batch.where("decode", commit_block=i), logits=None if last else "last")
        except StopGeneration:  # a model hook stopped the forward: each row keeps its token, not cached
            return (yield from _stopped(batch, i))
        ending = []
        for row, t in zip(rows, host):
            row.stats.blocks += 1
            stopped = row.fire_commit(i, [t], 1, len(row.prompt_ids) + i)
            if batch.emit:
                yield row.update("commit", i, None)
            if stopped:
                reasons[row.row] = "hook"
            if reasons[row.row] != "length" or i + 1 == batch.max_new:
                row.finish(reasons[row.row])
                ending.append(row)
        if batch.emit:
            for row in ending:
                yield row.update("done", i, None)
        keep = [j for j, row in enumerate(rows) if row not in ending]
        batch.drop([row.row for row in ending])
        if not batch.active:
            break
        logits = out[keep, -1]
    yield from _batch_done(batch, [], batch.max_new)


def _stopped(batch, index: int) -> Iterator[StreamUpdate]:
    """A model hook stopped a shared forward: every row still going ends, not all in the cache."""
    rows = batch.live()
    for row in rows:
        row.stats.cache_complete = False
        row.finish("hook")
    batch.drop([row.row for row in rows])
    yield from _batch_done(batch, rows, index)


def _batch_done(batch, rows, index: int) -> Iterator[StreamUpdate]:
    if batch.emit:
        for row in rows:
            yield row.update("done", index, None)
    batch.finish()
    if batch.emit:
        yield StreamUpdate("batch", index, None, [], [], result=batch.result)

