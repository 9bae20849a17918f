"""One generation's state; nothing here outlives the generation. A single prompt is a batch of
one: the same rows, loops and runner serve both.

The loops (``diffusion.py``, ``ar.py``) decide; a ``Run`` holds what the rows share: the runner
(``runner.py``: the cache and every forward), the clock and the batch's figures, where the
generation stands for the events it fires, and the hooks that apply to it (the engine's
permanent ones and the scopes open where it started). A ``Row`` holds one prompt's own: its
response so far, the block it is resolving and the finished block waiting for its fused commit,
its sampler generator, penalty counts, stop strings and stats.
"""
from __future__ import annotations

import math
import random
import time
from contextlib import contextmanager

import torch

from clover_lab.engine.requests import StopStrings
from clover_lab.engine.results import BatchResult, BatchStats, Clock, GenerationResult, GenerationStats, StreamUpdate
from clover_lab.engine.runner import Runner
from clover_lab.engine.sampling import SamplerSettings
from clover_lab.engine.thinking import Thinking, texts
from clover_lab.engine.token_info import TokenInfo
from clover_lab.hooks import points
from clover_lab.hooks.events import CommitEvent, Where
from clover_lab.hooks.registry import StopGeneration


class Run:
    """The rows of one generation. ``batched``: the request was a list of prompts (events and
    updates then carry their row, and the result is a BatchResult)."""

    def __init__(self, engine, prompts: list[list[int]], mode: str, max_new_tokens: int, s: SamplerSettings,
                 stop: list[str], emit: bool, number: int, batched: bool, policy=None, join=None,
                 length: int | None = None):
        model = engine.model
        self.engine, self.model, self.s, self.mode, self.emit = engine, model, s, mode, emit
        self.number, self.batched = number, batched  # number: counts generations on the engine
        self.device = model.device
        self.max_new = max_new_tokens
        self.hooks = model.hooks.view()
        self.policy = engine.policy if policy is None else policy  # the decoding rule (policies.py), every row's
        self.t0 = time.perf_counter()
        self.t_decode = self.t0
        self.stop, self.join = stop, join  # join: rows joining at block boundaries (Engine.stream)
        self.rows = [Row(self, r, ids, stop) for r, ids in enumerate(prompts)]
        self.clock = Clock(self.device)
        self.stats = BatchStats(mode=mode, rows=len(prompts), prompt_tokens=sum(map(len, prompts)))
        self.result: BatchResult | None = None
        self.runner = Runner(engine, self, length or max(map(len, prompts)) + max_new_tokens, len(prompts))

    @property
    def active(self) -> list[int]:
        """The request rows still going, in the cache's order."""
        return self.runner.rows

    def live(self) -> list["Row"]:
        return [self.rows[r] for r in self.active]

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def where(self, phase: str, block: int | None = None, step: int | None = None,
              commit_block: int | None = None, rows: list[int] | None = None) -> Where:
        rows = (tuple(self.active if rows is None else rows)) if self.batched else None
        return Where(self.number, phase, block, step, commit_block, rows)

    # ---------------------------------------------------------------- forwards, timed and counted
    @contextmanager
    def timed(self, kind: str, rows: list[int], fused: bool = False):
        """One forward of ``kind``: its time goes to the batch and to each of ``rows``; a forward
        that succeeded counts for them (a prefill's are counted by :meth:`prefill`)."""
        self.clock.start(kind)
        try:
            yield
        finally:
            self.clock.stop()
            span = self.clock.spans[kind][-1]
            for r in rows:
                self.rows[r].clock.spans[kind].append(span)
        if kind == "prefill":
            return
        self.stats.forwards += 1
        for r in rows:
            st = self.rows[r].stats
            if kind == "preview":
                st.preview_forwards += 1
                st.fused_forwards += fused
            else:
                st.commit_forwards += 1

    def prefill(self, logits: str | None, rows: list["Row"] | None = None) -> torch.Tensor | None:
        """Commit every prompt (``rows``: those of the rows joining now, into new rows of the
        cache); returns the last-position logits [R, V] when ``logits`` is "last". A model hook
        raising StopGeneration meanwhile propagates (the loops end the rows)."""
        chunk = self.engine.prefill_chunk_size

        @contextmanager
        def timed(rows):
            with self.timed("prefill", rows):
                yield
            forwards = math.ceil(len(self.rows[rows[0]].prompt_ids) / chunk)
            self.stats.prefill_forwards += forwards
            for r in rows:
                self.rows[r].stats.prefill_forwards = forwards

        prompts = {row.index: row.prompt_ids for row in (self.rows if rows is None else rows)}
        outs = self.runner.prefill(prompts, chunk, logits, lambda rows: self.where("prefill", rows=rows), timed,
                                   join=rows is not None)
        if rows is not None:
            return None
        if self.clock.cuda:  # once per generation: decode time starts after the prefill really ended
            torch.cuda.synchronize(self.device)
        self.t_decode = time.perf_counter()
        return torch.stack([outs[r] for r in range(len(self.rows))]) if outs else None

    def preview(self, rows: list[int], canvas: torch.Tensor, where: Where, pending: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Preview logits of ``rows``' blocks (``Runner.preview``), timed and counted."""
        with self.timed("preview", rows, fused=pending is not None):
            return self.runner.preview(rows, canvas, where, pending, positions)

    def commit(self, rows: list[int], ids: torch.Tensor, where: Where, logits: str | None = None):
        """Commit ``ids`` [R, c] for ``rows`` (``Runner.commit``), timed and counted."""
        with self.timed("commit", rows):
            return self.runner.commit(rows, ids, where, logits)

    def admit(self) -> None:
        """At a block boundary: the prompts ``join`` hands over become rows, prefilled into rows
        of their own added to the cache."""
        if self.join is None:
            return
        prompts = self.join(self.runner.cache.max_len - self.max_new)
        if not prompts:
            return
        start = len(self.rows)
        rows = [Row(self, start + k, list(ids), self.stop) for k, ids in enumerate(prompts)]
        self.rows += rows
        self.stats.rows += len(rows)
        self.stats.prompt_tokens += sum(len(row.prompt_ids) for row in rows)
        self.prefill(None, rows)

    def commit_draft(self, rows: list[int], ids: torch.Tensor, where: Where):
        """Commit every row's drafted block ``ids`` [R, m] (``Runner.commit_draft``), timed and counted."""
        with self.timed("commit", rows):
            return self.runner.commit_draft(rows, ids, where)

    # ---------------------------------------------------------------- rows end
    def end(self, rows: list[int], reason: str | dict[int, str], cache_complete: bool = True,
            index: int = 0):
        """These rows are done: their results (a "done" update each), and out of the cache."""
        rows = [r for r in rows if r in self.active]
        for r in rows:
            row = self.rows[r]
            if not cache_complete:
                row.stats.cache_complete = False
            row.finish(reason if isinstance(reason, str) else reason[r])
            if self.emit:
                yield row.update("done", index, None)
        self.runner.drop(rows)

    def finish(self, index: int):
        """Every row has ended: the batch's figures; a batched stream's last update."""
        if self.clock.cuda:
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        st = self.stats
        results = [row.result for row in self.rows]
        st.new_tokens = sum(len(r.token_ids) for r in results)
        st.stop_reasons = [r.stop_reason for r in results]
        st.tokens_per_forward = st.new_tokens / st.forwards if st.forwards else 0.0
        st.prefill_seconds = self.clock.total("prefill")
        st.preview_seconds, st.commit_seconds = self.clock.total("preview"), self.clock.total("commit")
        st.decode_seconds = end - self.t_decode
        st.total_seconds = end - self.t0
        st.tokens_per_second = st.new_tokens / st.decode_seconds if st.decode_seconds > 0 else 0.0
        st.path = self.runner.path()
        self.result = BatchResult(results, st)
        if self.emit and self.batched:
            yield StreamUpdate("batch", index, None, [], [], result=self.result)


class Row:
    """One prompt of a generation: its response and figures; the run runs its forwards."""
    thinking: Thinking | None = None  # the tokenizer's <think> tokens and the prompt's state (thinking.py)

    def __init__(self, run: Run, index: int, prompt_ids: list[int], stop: list[str]):
        engine, s = run.engine, run.s
        self.run, self.index, self.prompt_ids = run, index, prompt_ids
        self.row = index if run.batched else None  # the request row events and errors name
        self.engine, self.model, self.s, self.hooks, self.device = engine, run.model, s, run.hooks, run.device
        self.policy = run.policy
        self.seed = s.seed if s.seed is not None else random.SystemRandom().randrange(2**63)
        self.generator = None if s.greedy else torch.Generator(device=self.device).manual_seed(self.seed)
        self.counts = (torch.zeros(self.model.config.vocab_size, device=self.device, dtype=torch.float32)
                       if s.has_penalties else None)
        self.stop_strings = StopStrings(engine.tokenizer, stop) if stop else None
        self.eos = set(engine.eos_token_ids)
        self.clock = Clock(self.device)
        self.stats = GenerationStats(mode=run.mode, prompt_tokens=len(prompt_ids),
                                     seed=s.seed if s.greedy else self.seed,
                                     block_size=engine.block_size if run.mode != "ar" else None,
                                     coreset_size=(s.coreset_size or None) if run.mode == "diffusion" else None)
        self.committed: list[int] = []  # final response tokens
        self.info = TokenInfo(s.logprobs)  # per response token: unmask step, log-probabilities
        self.pending: tuple[list[int], int] | None = None  # a finished block waiting for its fused commit, its steps
        self.result: GenerationResult | None = None

    @property
    def cache(self):
        """This row's part of the cache, as a cache of its own (a copy: the error path inspects it)."""
        return self.run.runner.row_cache(self.index)

    def now(self) -> float:
        return self.run.now()

    def where(self, phase: str, block: int | None = None, step: int | None = None,
              commit_block: int | None = None) -> Where:
        return Where(self.run.number, phase, block, step, commit_block, None if self.row is None else (self.row,))

    # ---------------------------------------------------------------- the response
    def record_block(self, tokens: list[int], steps: int) -> None:
        """A block (an AR token) is final: part of the response, counted in the stats."""
        self.committed += tokens
        self.info.take(len(tokens))
        self.stats.blocks += 1
        self.stats.steps_per_block.append(steps)

    def fire_commit(self, block: int, tokens: list[int], steps: int, start: int,
                    acceptance: dict | None = None) -> bool:
        """``block.commit`` after a commit (``acceptance``: a speculative block's drafted,
        accepted and rejected counts); True when a hook asked to stop (``event.stop()`` or
        StopGeneration)."""
        if not self.hooks.active(points.BLOCK_COMMIT):
            return False
        event = CommitEvent(block, list(tokens), steps, start, self.now(), **(acceptance or {}),
                            forwards=self.stats.preview_forwards + self.stats.commit_forwards,
                            where=self.where("decode", commit_block=block))
        try:
            self.hooks.fire(points.BLOCK_COMMIT, event)
        except StopGeneration:
            return True
        return event.stopped

    def update(self, kind: str, block: int, step: int | None, block_tokens=(), unmasked=()) -> StreamUpdate:
        return StreamUpdate(kind, block, step, list(self.committed), list(block_tokens), list(unmasked),
                            self.now(), self.result, tokenizer=self.engine.tokenizer, row=self.row,
                            thinking=self.thinking)

    # ---------------------------------------------------------------- the end
    def finish(self, reason: str) -> GenerationResult:
        if self.clock.cuda:
            torch.cuda.synchronize(self.device)
        self.stats.stop_reason = reason
        self.stats.new_tokens = len(self.committed)
        self.stats.path = self.run.runner.path()
        self.clock.fill(self.stats, self.run.t0, self.run.t_decode)
        text = None
        tok = self.engine.tokenizer
        cut = self.stop_strings.cut if self.stop_strings is not None and reason == "stop_string" else None
        if tok is not None:
            text = tok.decode(self.committed, skip_special_tokens=True)
            if cut is not None:
                text = cut(text)
        reasoning, answer = texts(tok, self.thinking, self.committed, cut)
        self.result = GenerationResult(list(self.committed), text, list(self.prompt_ids), self.stats,
                                       reasoning=reasoning, answer=answer, unmask_steps=list(self.info.steps),
                                       logprobs=self.info.logprobs, top_logprobs=self.info.top)
        return self.result
