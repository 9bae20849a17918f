"""Exact self-speculative decoding (issue 30), one loop for one row or many: the preview drafts
a block, one causal forward commits it and so scores every drafted token under the AR model,
and the draft is accepted up to its first disagreement with the causal choice, which takes that
position. Greedy, that is AR's greedy answer token for token; sampled, the acceptance follows
the speculative-sampling rule (``acceptance.py``), so the tokens follow AR's distribution.

A cycle, per block k and row:

1. the causal token c0 at the row's next position, from the last forward's logits (the
   prompt's prefill, or the previous verify's row at the last kept token);
2. a draft of the block ``[c0, mask, ...]`` by ``draft_passes`` denoising steps (the usual
   ``denoise.step`` decision and hooks; the last pass unmasks everything left);
3. one forward commits the whole drafted block (``CloverModel.commit_draft``); its row i gives
   the causal choice at position i + 1;
4. the accepted tokens are c0, the drafted tokens equal to the causal choice up to the first
   difference, and nothing after an EOS, a stop string or the length; the cache is cut back to
   exactly those (``DraftCommit.keep``: attention rows past the length are never read, the GDN
   state is recomputed over the kept rows from the block's chunk state); the causal choice at
   the first difference becomes the next cycle's c0, without another forward.

So a cycle costs ``draft_passes`` previews and one commit, and yields 1 + accepted tokens. Step
hooks see every draft step; ``block.commit`` fires per cycle with the kept tokens and the
acceptance (``drafted``, ``accepted``, ``rejected``); stats keep the same per block. A step hook
that stops ends the row after that cycle; StopGeneration inside a forward ends every row (a
draft commit it stopped changed nothing).
"""
from __future__ import annotations

from typing import Iterator

import torch

from clover_lab.engine import sampling
from clover_lab.engine.acceptance import greedy_accept, speculative_accept
from clover_lab.engine.ar import end_reason
from clover_lab.engine.diffusion import Block, denoise_step
from clover_lab.engine.faults import check_logits, collapsed, logits_health
from clover_lab.engine.results import StreamUpdate
from clover_lab.hooks.registry import StopGeneration


def run_speculative(run) -> Iterator[StreamUpdate]:
    """Generate ``run.max_new`` tokens at most per row, a drafted block per cycle; yields "step"
    updates (the draft's steps) and a "commit" per cycle (when the run emits), a "done" per row
    and, for a batch, a last "batch" update."""
    try:
        logits = run.prefill("last")  # [R, V]
    except StopGeneration:
        yield from run.end(run.active, "hook", cache_complete=False)
        yield from run.finish(0)
        return
    loop = DraftLoop(run)
    try:
        yield from loop.run_cycles(logits)
    except StopGeneration:  # a model hook stopped a forward; that forward changed nothing
        yield from run.end(list(run.active), "hook", index=loop.index)
    yield from run.finish(loop.index)


class DraftLoop:
    """The rows draft, commit and accept their block ``index`` together (one preview forward per
    draft pass, one draft commit per cycle); each row accepts on its own and leaves on its own."""

    def __init__(self, run):
        self.run = run
        self.index = 0
        self.next: dict[int, int] = {}  # row -> its causal token at the next position, when known

    def run_cycles(self, logits: torch.Tensor) -> Iterator[StreamUpdate]:
        run, engine = self.run, self.run.engine
        while run.active:
            rows = run.live()
            cache = run.runner.cache
            m = max(1, min(engine.block_size, cache.max_len - cache.length))
            blocks = {row.index: self.start_block(row, None if logits is None else logits[j], m)
                      for j, row in enumerate(rows)}
            logits = None
            stopped = yield from self.draft(blocks)
            ids = torch.stack([blocks[row.index].canvas for row in rows])
            names = [row.index for row in rows]
            draft = run.commit_draft(names, ids, run.where("decode", commit_block=self.index))
            keep, ending, reasons = [], [], {}
            for j, row in enumerate(rows):
                kept, reason = self.accept(row, blocks[row.index], draft.logits[j])
                keep.append(kept)
                if row.index in stopped:
                    reason = "hook"
                if reason != "length" or len(row.committed) >= run.max_new:
                    ending.append(row.index)
                    reasons[row.index] = reason
            draft.keep(keep)
            for j, row in enumerate(rows):
                tokens = row.committed[len(row.committed) - keep[j]:]
                start = len(row.prompt_ids) + len(row.committed) - keep[j]
                if row.fire_commit(self.index, tokens, blocks[row.index].step, start, row.stats.acceptance(-1)):
                    if row.index not in ending:
                        ending.append(row.index)
                    reasons[row.index] = "hook"
                if run.emit:
                    yield row.update("commit", self.index, None)
            self.index += 1
            yield from run.end(ending, reasons, index=self.index)

    def start_block(self, row, logits: torch.Tensor | None, m: int) -> Block:
        """The block ``[c0, mask, ...]`` of ``m`` positions. c0, the causal token, is the last
        verify's choice at the first difference, or (after the prefill) decided here exactly as
        the AR loop decides it."""
        c0 = self.next.pop(row.index, None)
        if c0 is None:
            t, conf, _ = sampling.decide(logits[None], row.counts, row.s, row.generator)
            c0, health = torch.stack([t[0], logits_health(collapsed(logits[None]), conf)]).tolist()
            check_logits(row, health, "the prompt's next token")
        block = Block(self.index, m, self.run.engine.mask_token_id, self.run.device, row.s.draft_passes)
        block.canvas[0] = c0
        block.place({0: c0}, row.eos)
        block.masked = [p for p in range(1, m) if p < block.end]
        block.memo = row.policy.begin_block(row, block)
        return block

    def draft(self, blocks: dict[int, Block]):
        """Up to ``draft_passes`` previews over the rows whose block has masked positions; the
        penalty counts and the stop strings' scan are the response's again afterwards (a draft is
        not the response).
        Sampled rows keep their draft's distribution (``block.q``). Returns the rows whose step
        hook asked to stop."""
        run = self.run
        counts = {r: run.rows[r].counts.clone() for r in blocks if run.rows[r].counts is not None}
        scanned = {r: run.rows[r].stop_strings.clean for r in blocks if run.rows[r].stop_strings is not None}
        stopped = set()
        while True:
            rows = [r for r in run.active if blocks[r].masked and r not in stopped]
            if not rows:
                break
            canvas = torch.stack([blocks[r].canvas for r in rows])
            one = blocks[rows[0]].masked_index() if len(rows) == 1 else None
            where = run.where("decode", self.index, blocks[rows[0]].step, rows=rows)
            logits = run.preview(rows, canvas, where, positions=one)
            for i, r in enumerate(rows):
                block, row = blocks[r], run.rows[r]
                idx = block.masked_index()
                mine = logits[i:i + 1] if idx is None or one is not None else logits[i:i + 1, idx]
                if not row.s.greedy:  # one pass: every position drawn from these distributions
                    masked = mine[0].float().clone()
                    masked[:, run.engine.mask_token_id] = float("-inf")
                    block.q = sampling.sampling_probs(masked, row.counts, row.s)
                unmask, stop = denoise_step(row, block, mine, idx)
                if stop:
                    stopped.add(r)
                if run.emit:
                    yield row.update("step", block.index, block.step - 1, block.host, unmask)
        for r, c in counts.items():
            run.rows[r].counts.copy_(c)
        for r, clean in scanned.items():
            run.rows[r].stop_strings.clean = clean
        return stopped

    def accept(self, row, block: Block, logits: torch.Tensor) -> tuple[int, str]:
        """The row's accepted tokens of its committed draft (``logits`` [m, V]: row i the causal
        distribution at position i + 1) join its response; the causal token after them is kept
        for the next cycle. Returns (tokens kept, why the row ends or "length")."""
        d = min(block.prefix, block.end) - 1  # drafted positions 1..d
        drafted = block.host[1:d + 1]
        rows, counts = logits[:d + 1].float(), self.draft_counts(row, block.host[:d + 1])
        if row.s.greedy:
            t, conf, _ = sampling.decide(rows, counts, row.s, row.generator)
            host = torch.cat([t, logits_health(collapsed(rows), conf).reshape(1)]).tolist()
            check_logits(row, host[-1], f"block {self.index}, the draft's commit")
            n = greedy_accept(drafted, host[:d])
            self.next[row.index] = host[n]
        else:
            p = sampling.sampling_probs(rows, counts, row.s)
            q = block.q[:d] if d else p[:0]  # nothing drafted (a block of one): the causal token only
            n, self.next[row.index] = speculative_accept(torch.tensor(drafted, device=rows.device, dtype=torch.long),
                                                         q, p, row.generator)
        kept, reason = 0, "length"
        row.info.forget()  # the draft's unmask notes: its tokens join as the causal pass's
        for t in [block.host[0]] + drafted[:n]:
            row.info.add(None)  # no denoising step unmasked it; log-probabilities are refused up front
            if row.counts is not None:
                row.counts[t] += 1
            row.committed.append(t)
            kept += 1
            reason = end_reason(row, t)
            if reason != "length" or len(row.committed) >= self.run.max_new:
                break
        row.stats.record_draft(d, n, block.step)
        return kept, reason

    @staticmethod
    def draft_counts(row, tokens: list[int]) -> torch.Tensor | None:
        """Penalty counts [len(tokens), V] at each drafted position: the response's, then the
        draft's tokens before that position (as AR would have counted them)."""
        if row.counts is None:
            return None
        ids = torch.tensor(tokens, device=row.counts.device)
        onehot = torch.zeros(len(tokens), row.counts.shape[0], device=ids.device).scatter_(1, ids[:, None], 1.0)
        return row.counts[None] + onehot.cumsum(0)
