"""One generation's state and the forwards it runs; nothing here outlives the generation.

The loops (``diffusion.py``, ``ar.py``) decide; a ``Run`` holds what they share: the cache (a
fresh one, or the fast path's), the sampler's generator and penalty counts, the response so
far, the clock and the stats, where the generation stands for the events it fires, and the
hooks that apply to it (the engine's permanent ones and the scopes open where it started: every
forward runs inside ``hooks.applied()`` so that the model's events see the same ones).
"""
from __future__ import annotations

import math
import random
import time

import torch

from ..context import Coreset
from ..hooks import points
from ..hooks.events import CommitEvent, Where
from ..hooks.registry import StopGeneration
from ..sampling import SamplerSettings
from .requests import GenerationError, StopStrings
from .results import Clock, GenerationResult, GenerationStats, StreamUpdate
from .thinking import Thinking, texts
from .token_info import TokenInfo
from ..cache import cache_bytes


class Run:
    row: int | None = None  # the request row, in a batch (engine/batch.py)
    thinking: Thinking | None = None  # the tokenizer's <think> tokens and the prompt's state (thinking.py)

    def __init__(self, engine, prompt_ids: list[int], mode: str, max_new_tokens: int, s: SamplerSettings,
                 stop: list[str], emit: bool, number: int):
        model = engine.model
        self.engine, self.model, self.s, self.mode, self.emit = engine, model, s, mode, emit
        self.device = model.device
        self.prompt_ids = prompt_ids
        self.max_new = max_new_tokens
        self.hooks = model.hooks.view()
        self.number = number  # counts generations on the engine: events carry it
        self.seed = s.seed if s.seed is not None else random.SystemRandom().randrange(2**63)
        self.generator = None if s.greedy else torch.Generator(device=self.device).manual_seed(self.seed)
        self.counts = (torch.zeros(model.config.vocab_size, device=self.device, dtype=torch.float32)
                       if s.has_penalties else None)
        self.stop_strings = StopStrings(engine.tokenizer, stop) if stop else None
        self.eos = set(engine.eos_token_ids)
        self.clock = Clock(self.device)
        self.stats = GenerationStats(mode=mode, prompt_tokens=len(prompt_ids), seed=s.seed if s.greedy else self.seed,
                                     block_size=engine.block_size if mode == "diffusion" else None,
                                     coreset_size=(s.coreset_size or None) if mode == "diffusion" else None)
        self.committed: list[int] = []  # final response tokens
        self.info = TokenInfo(s.logprobs)  # per response token: unmask step, log-probabilities
        self.t0 = time.perf_counter()
        self.t_decode = self.t0
        self.result: GenerationResult | None = None
        self.open_cache(len(prompt_ids) + max_new_tokens)

    def open_cache(self, length: int) -> None:
        """The generation's cache: the fast path's when it applies, else a fresh one."""
        engine, model = self.engine, self.model
        try:
            self.graphs = engine._fast_path.acquire(self, model, length, engine._uses_fast_path(),
                                                    engine.compile_steps and self.device.type != "cuda")
            self.cache = self.graphs.reset() if self.graphs is not None else model.new_cache(length)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            raise allocation_error(model, length, 1, e) from e

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def where(self, phase: str, block: int | None = None, step: int | None = None,
              commit_block: int | None = None) -> Where:
        return Where(self.number, phase, block, step, commit_block, None if self.row is None else (self.row,))

    def new_coreset(self) -> Coreset | None:
        """The run's expert coreset (on the fast path, the one whose buffers its graphs share)."""
        size = self.s.coreset_size
        if not size:
            return None
        return self.graphs.coreset(size) if self.graphs is not None else Coreset(size)

    # ---------------------------------------------------------------- forwards
    def prefill(self, logits: str | None):
        """Commit the prompt; a model hook raising StopGeneration meanwhile propagates (the loops
        end the run with no tokens)."""
        chunk = self.engine.prefill_chunk_size
        self.clock.start("prefill")
        try:
            with self.hooks.applied():
                out = self.model.prefill(self.cache, self.prompt_ids, chunk_size=chunk, logits=logits,
                                         where=self.where("prefill"))
        finally:
            self.clock.stop()
        self.stats.prefill_forwards = math.ceil(len(self.prompt_ids) / chunk)
        if self.clock.cuda:  # once per generation: decode time starts after the prefill really ended
            torch.cuda.synchronize(self.device)
        self.t_decode = time.perf_counter()
        return out

    def fast(self) -> bool:
        """Take the static-shape step (a CUDA graph on CUDA): no hook inside the model right now."""
        return self.graphs is not None and not self.hooks.model_hooks_attached()

    def preview(self, canvas: torch.Tensor, idx, coreset, where: Where, pending: list[int] | None = None):
        """Preview logits [1, N, V] of the block ``canvas`` at positions ``idx`` (None: all), after
        committing ``pending`` (the previous block) in the same forward when given."""
        self.clock.start("preview")
        with self.hooks.applied():
            if self.fast():
                ids = canvas if pending is None else torch.cat([torch.tensor(pending, device=self.device), canvas])
                logits = self.graphs.step(ids[None], len(pending or ()), len(canvas), coreset=coreset)[1]
                logits = logits if idx is None else logits[:, idx]
            elif pending is None:
                logits = self.model.preview(self.cache, canvas[None], positions=idx, coreset=coreset, where=where)
            else:
                logits = self.model.commit_and_preview(self.cache, pending, canvas[None], positions=idx,
                                                       coreset=coreset, where=where).preview_logits
        self.clock.stop()
        self.stats.preview_forwards += 1
        self.stats.fused_forwards += pending is not None
        return logits

    def commit(self, ids: list[int], block: int, logits: str | None = None):
        self.clock.start("commit")
        with self.hooks.applied():
            if len(ids) == 1 and self.fast():  # the AR step
                out = self.graphs.step(torch.tensor([ids], device=self.device), 1, 0, commit_logits=True)[0]
            else:
                out = self.model.commit(self.cache, ids, logits=logits,
                                        where=self.where("decode", commit_block=block))
        self.clock.stop()
        self.stats.commit_forwards += 1
        return out

    # ---------------------------------------------------------------- the response
    def record_block(self, tokens: list[int], steps: int) -> None:
        """A block (an AR token) is final: part of the response, counted in the stats."""
        self.committed += tokens
        self.info.take(len(tokens))
        self.stats.blocks += 1
        self.stats.steps_per_block.append(steps)

    def fire_commit(self, block: int, tokens: list[int], steps: int, start: int) -> bool:
        """``block.commit`` after a commit; True when a hook asked to stop (``event.stop()`` or
        StopGeneration)."""
        if not self.hooks.active(points.BLOCK_COMMIT):
            return False
        event = CommitEvent(block, list(tokens), steps, start, self.now(),
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
        self.clock.fill(self.stats, self.t0, self.t_decode)
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


def allocation_error(model, length: int, rows: int, e: BaseException) -> GenerationError:
    """A cache of ``rows`` x ``length`` positions could not be allocated: what it needed, where."""
    what = f"{length} positions" if rows == 1 else f"{rows} rows x {length} positions"
    return GenerationError(f"cannot allocate a cache of {what} "
                           f"({cache_bytes(model.config, length, rows, dtype=model.dtype) / 2**30:.2f} GiB) "
                           f"on {model.device}: {e}")
