"""The generation engine: the block-diffusion loop (spec section 4) and the AR baseline, over one
shared model and its caches.

Per generation: a fresh cache sized to the request, the prompt prefilled in commit mode (in
chunks), then per block a canvas of mask tokens resolved by previews; the first preview of each
block is fused with the commit of the previous block (one forward), and the last block is
committed on its own so the cache ends up holding the whole response.

Cost discipline: one device-to-host transfer per denoising step (the unmask decision and the
candidates, which the loop needs to know what is left to do); hook events are built only when a
hook is attached to their point, and never add a transfer.

Ending a run early: ``event.stop()`` or StopGeneration in a ``denoise.step`` hook keeps the
block's resolved contiguous prefix, commits it and fires ``block.commit``; in a ``block.commit``
hook it ends the run after that block. StopGeneration raised inside a forward (a model hook)
abandons that forward, which changed nothing; a finished block whose fused commit was abandoned
is still returned, and ``stats.cache_complete`` is then False. Any other exception in a hook
ends the run with HookError naming the point; the cache is per generation, so the engine is
ready for the next call either way.
"""
from __future__ import annotations

import math
import os
import random
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from . import malloc, sampling
from .events import CommitEvent, StepEvent, StreamUpdate
from .hooks import HookError, StopGeneration
from .model import CloverModel, Coreset
from .sampling import SamplerSettings

MODES = ("diffusion", "ar")
STEP_POINT = "denoise.step"
COMMIT_POINT = "block.commit"
# Where clover_lab.load() looks for the embedded default model: a model directory (one with a
# config.json) in one of these folders, "clover-default" first. None is shipped yet.
DEFAULT_MODEL_ROOTS = (Path(__file__).resolve().parent.parent / "assets", Path(__file__).resolve().parent / "assets")
DEFAULT_MODEL_NAME = "clover-stdlib"


class GenerationError(ValueError):
    """A request the engine refuses up front (context overflow, bad prompt, missing mask token)."""


# --------------------------------------------------------------------------- results
@dataclass
class GenerationStats:
    """Figures of one generation. Forwards and times exclude the prompt prefill unless named
    ``prefill_*``; ``tokens_per_second`` is new tokens over ``decode_seconds`` (wall time after
    the prefill). ``preview_seconds`` covers every forward with a preview part (fused ones
    included), ``commit_seconds`` the commit-only forwards after the prefill."""

    mode: str
    prompt_tokens: int = 0
    new_tokens: int = 0
    blocks: int = 0
    forwards: int = 0
    preview_forwards: int = 0
    fused_forwards: int = 0
    commit_forwards: int = 0
    prefill_forwards: int = 0
    tokens_per_forward: float = 0.0
    steps_per_block: list[int] = field(default_factory=list)
    mean_steps_per_block: float | None = None
    prefill_seconds: float = 0.0
    preview_seconds: float = 0.0
    commit_seconds: float = 0.0
    seconds_per_preview: float | None = None
    seconds_per_commit: float | None = None
    decode_seconds: float = 0.0
    total_seconds: float = 0.0
    tokens_per_second: float = 0.0
    stop_reason: str = "length"  # "length" | "eos" | "stop_string" | "hook"
    seed: int | None = None
    block_size: int | None = None
    coreset_size: int | None = None
    cache_complete: bool = True  # the cache holds prompt + every returned token

    def to_dict(self) -> dict:
        return asdict(self)

    def __getitem__(self, key: str):
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def keys(self):
        return self.__dataclass_fields__.keys()


@dataclass
class GenerationResult:
    """``token_ids`` the response (an EOS that ended it included; a stop string's tokens
    included), ``text`` its decoding without special tokens and cut before a stop string (None
    without a tokenizer), ``prompt_ids`` the prompt as tokens, ``stats`` the run's figures."""

    token_ids: list[int]
    text: str | None
    prompt_ids: list[int]
    stats: GenerationStats

    @property
    def stop_reason(self) -> str:
        return self.stats.stop_reason

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_ids": self.prompt_ids,
                "stats": self.stats.to_dict()}


# --------------------------------------------------------------------------- helpers
class _Where:
    """Where the engine is, for capture to tag model events: set before every forward."""

    __slots__ = ("run", "phase", "block", "step", "commit_block")

    def __init__(self):
        self.run, self.phase, self.block, self.step, self.commit_block = 0, None, None, None, None

    def set(self, phase, block=None, step=None, commit_block=None):
        self.phase, self.block, self.step, self.commit_block = phase, block, step, commit_block


class _Clock:
    """Forward timing without host syncs: CUDA events on GPUs (read once at the end), wall time
    on the CPU (where a forward is synchronous anyway)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: dict[str, list] = {"prefill": [], "preview": [], "commit": []}
        self._open = None

    def start(self, kind: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._open = (kind, ev)
        else:
            self._open = (kind, time.perf_counter())

    def stop(self) -> None:
        kind, begin = self._open
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.spans[kind].append((begin, end))
        else:
            self.spans[kind].append(time.perf_counter() - begin)
        self._open = None

    def total(self, kind: str) -> float:
        if self.cuda:
            return sum(b.elapsed_time(e) for b, e in self.spans[kind]) / 1000.0
        return float(sum(self.spans[kind]))


class _StopStrings:
    """Finds the first stop string in the decoded response; knows how many tokens it takes."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.longest = max(len(s) for s in stops)
        self.clean = 0  # this many leading tokens are known to decode to stop-free text

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def find(self, ids: list[int]) -> int | None:
        """Smallest k such that decode(ids[:k]) contains a stop string, or None."""
        if len(ids) <= self.clean:
            return None
        text = self.decode(ids)
        if not any(s in text for s in self.stops):
            self.clean = len(ids)
            return None
        for k in range(self.clean + 1, len(ids) + 1):
            t = self.decode(ids[:k])
            if any(s in t for s in self.stops):
                return k
        return len(ids)

    def cut(self, text: str) -> str:
        hits = [text.find(s) for s in self.stops if s in text]
        return text[:min(hits)] if hits else text


def _available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` for a new cache, or None when unknown."""
    try:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free)
        if device.type == "cpu":
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
    except (OSError, RuntimeError, ValueError):
        return None
    return None


def cache_bytes(model: CloverModel, max_len: int, batch_size: int = 1) -> int:
    """Bytes of a cache of ``max_len`` positions (K,V grow with length; GDN state does not)."""
    c = model.config
    item = torch.empty((), dtype=model.dtype).element_size()
    kv = 2 * batch_size * c.num_key_value_heads * max_len * c.head_dim * item * len(c.attention_layers())
    gdn = len(c.gdn_layers()) * batch_size * (c.conv_dim * (c.linear_conv_kernel_dim - 1) * item
                                             + c.linear_num_value_heads * c.linear_key_head_dim
                                             * c.linear_value_head_dim * 4)
    return kv + gdn


# --------------------------------------------------------------------------- one generation
class _Run:
    """The state of one generation; nothing here outlives it."""

    def __init__(self, engine: "Engine", prompt_ids: list[int], mode: str, max_new_tokens: int,
                 s: SamplerSettings, stop: list[str], emit: bool):
        model = engine.model
        self.engine, self.model, self.s, self.mode, self.emit = engine, model, s, mode, emit
        self.device = model.device
        self.prompt_ids = prompt_ids
        self.max_new = max_new_tokens
        self.hooks = model.hooks
        self.seed = s.seed if s.seed is not None else random.SystemRandom().randrange(2**63)
        self.generator = None if s.greedy else torch.Generator(device=self.device).manual_seed(self.seed)
        self.counts = (torch.zeros(model.config.vocab_size, device=self.device, dtype=torch.float32)
                       if s.has_penalties else None)
        self.stop_strings = _StopStrings(engine.tokenizer, stop) if stop else None
        self.eos = set(engine.eos_token_ids)
        self.clock = _Clock(self.device)
        self.stats = GenerationStats(mode=mode, prompt_tokens=len(prompt_ids), seed=s.seed if s.greedy else self.seed,
                                     block_size=engine.block_size if mode == "diffusion" else None,
                                     coreset_size=s.coreset_size or None)
        self.committed: list[int] = []  # final response tokens
        self.t0 = time.perf_counter()
        self.t_decode = self.t0
        self.result: GenerationResult | None = None
        self.where = engine._where
        self.where.run += 1
        length = len(prompt_ids) + max_new_tokens
        try:
            self.graphs = engine._graphs_for(self, length)
            self.cache = self.graphs.reset() if self.graphs is not None else model.new_cache(length)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            raise GenerationError(f"cannot allocate a cache of {length} positions "
                                  f"({cache_bytes(model, length) / 2**30:.2f} GiB) on "
                                  f"{self.device}: {e}") from e

    def now(self) -> float:
        return time.perf_counter() - self.t0

    # ---------------------------------------------------------------- forwards
    def prefill(self, logits: str | None):
        self.where.set("prefill")
        chunk = self.engine.prefill_chunk_size
        self.clock.start("prefill")
        out = self.model.prefill(self.cache, self.prompt_ids, chunk_size=chunk, logits=logits)
        self.clock.stop()
        self.stats.prefill_forwards = math.ceil(len(self.prompt_ids) / chunk)
        if self.clock.cuda:  # once per generation: decode time starts after the prefill really ended
            torch.cuda.synchronize(self.device)
        self.t_decode = time.perf_counter()
        return out

    def fast(self) -> bool:
        """Take the static-shape step (a CUDA graph on CUDA): no hook inside the model right now."""
        return self.graphs is not None and not self.hooks.model_hooks_attached()

    def block_forward(self, pending: list[int] | None, canvas: torch.Tensor, idx, coreset):
        """Preview logits [1, N, V] of the block ``canvas`` at positions ``idx`` (None: all), after
        committing ``pending`` (the previous block) in the same forward when given."""
        if self.fast():
            ids = canvas if pending is None else torch.cat([torch.tensor(pending, device=self.device), canvas])
            logits = self.graphs.step(ids[None], len(pending or ()), len(canvas), coreset=coreset)[1]
            return logits if idx is None else logits[:, idx]
        if pending is None:
            return self.model.preview(self.cache, canvas[None], positions=idx, coreset=coreset)
        return self.model.commit_and_preview(self.cache, pending, canvas[None], positions=idx,
                                             coreset=coreset).preview_logits

    def commit(self, ids: list[int], block: int, logits: str | None = None):
        self.where.set("decode", commit_block=block)
        self.clock.start("commit")
        if len(ids) == 1 and self.fast():  # the AR step
            out = self.graphs.step(torch.tensor([ids], device=self.device), 1, 0, commit_logits=True)[0]
        else:
            out = self.model.commit(self.cache, ids, logits=logits)
        self.clock.stop()
        self.stats.commit_forwards += 1
        return out

    def fire_commit(self, block: int, tokens: list[int], steps: int, start: int) -> bool:
        """block.commit after a commit; True when a hook asked to stop."""
        if not self.hooks.active(COMMIT_POINT):
            return False
        event = CommitEvent(block, list(tokens), steps, start, self.now())
        self.hooks.fire(COMMIT_POINT, event)
        return event.stopped

    def update(self, kind: str, block: int, step: int | None, block_tokens, unmasked=()) -> StreamUpdate:
        return StreamUpdate(kind, block, step, list(self.committed), list(block_tokens), list(unmasked),
                            self.now(), tokenizer=self.engine.tokenizer)

    # ---------------------------------------------------------------- the end
    def finish(self, reason: str) -> GenerationResult:
        st = self.stats
        if self.clock.cuda:
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        st.stop_reason = reason
        st.new_tokens = len(self.committed)
        st.forwards = st.preview_forwards + st.commit_forwards
        st.tokens_per_forward = st.new_tokens / st.forwards if st.forwards else 0.0
        st.prefill_seconds = self.clock.total("prefill")
        st.preview_seconds = self.clock.total("preview")
        st.commit_seconds = self.clock.total("commit")
        st.seconds_per_preview = st.preview_seconds / st.preview_forwards if st.preview_forwards else None
        st.seconds_per_commit = st.commit_seconds / st.commit_forwards if st.commit_forwards else None
        st.decode_seconds = end - self.t_decode
        st.total_seconds = end - self.t0
        st.tokens_per_second = st.new_tokens / st.decode_seconds if st.decode_seconds > 0 else 0.0
        if st.steps_per_block:
            st.mean_steps_per_block = sum(st.steps_per_block) / len(st.steps_per_block)
        text = None
        tok = self.engine.tokenizer
        if tok is not None:
            text = tok.decode(self.committed, skip_special_tokens=True)
            if self.stop_strings is not None and reason == "stop_string":
                text = self.stop_strings.cut(text)
        self.result = GenerationResult(list(self.committed), text, list(self.prompt_ids), st)
        return self.result

    # ---------------------------------------------------------------- AR
    def run_ar(self) -> Iterator[StreamUpdate]:
        s, model = self.s, self.model
        logits = self.prefill("last")[0]  # [1, V]
        reason = "length"
        for i in range(self.max_new):
            tokens, _, _ = sampling.decide(logits, self.counts, s, self.generator)
            t = int(tokens[0])  # the one sync per token
            if self.counts is not None:
                self.counts[tokens] += 1
            self.committed.append(t)
            if t in self.eos:
                reason = "eos"
            elif self.stop_strings is not None and self.stop_strings.find(self.committed) is not None:
                reason = "stop_string"
            last = reason != "length" or i + 1 == self.max_new
            try:
                out = self.commit([t], i, logits=None if last else "last")
            except StopGeneration:
                self.stats.cache_complete = False
                reason = "hook"
                break
            self.stats.blocks += 1
            try:
                stop = self.fire_commit(i, [t], 1, len(self.prompt_ids) + i)
            except StopGeneration:
                stop = True
            if self.emit:
                yield self.update("commit", i, None, [])
            if stop:
                reason = "hook"
                break
            if last:
                break
            logits = out[0]
        self.finish(reason)
        if self.emit:
            yield StreamUpdate("done", self.stats.blocks, None, list(self.committed), [], [], self.now(),
                               self.result, self.engine.tokenizer)

    # ---------------------------------------------------------------- block diffusion
    def run_diffusion(self) -> Iterator[StreamUpdate]:
        s, model, eng = self.s, self.model, self.engine
        B, mask_id = eng.block_size, eng.mask_token_id
        vocab = model.config.vocab_size
        coreset = None
        if s.coreset_size:  # on the fast path, the coreset whose buffers its graphs share
            coreset = self.graphs.coreset(s.coreset_size) if self.graphs is not None else Coreset(s.coreset_size)
        self.prefill(None)
        pending: list[int] | None = None  # a finished block waiting to be committed (fused)
        pending_steps = 0
        reason = "length"
        block = 0
        try:
            while len(self.committed) + (len(pending) if pending else 0) < self.max_new:
                done_before = len(self.committed) + (len(pending) if pending else 0)
                m = min(B, self.max_new - done_before)
                canvas = torch.full((m,), mask_id, dtype=torch.long, device=self.device)
                host: list[int | None] = [None] * m  # the block as the host knows it
                masked = list(range(m))
                end, end_reason = m, None  # positions >= end are dropped (after an EOS / stop string)
                prefix = 0  # length of the block's resolved contiguous prefix
                if coreset is not None:
                    coreset.reset()
                step = 0
                stop_now = False
                # step limit: without hooks a block never needs more than m steps (each unmasks >= 1)
                limit = min(s.max_steps_per_block or m, m)
                while masked:
                    all_masked = len(masked) == m
                    idx = None if all_masked else torch.tensor(masked, device=self.device)
                    self.clock.start("preview")
                    if step == 0 and pending is not None:
                        self.where.set("decode", block=block, step=0, commit_block=block - 1)
                        logits = self.block_forward(pending, canvas, idx, coreset)
                        self.clock.stop()
                        self.stats.preview_forwards += 1
                        self.stats.fused_forwards += 1
                        start = len(self.prompt_ids) + len(self.committed)
                        self.committed += pending
                        self.stats.blocks += 1
                        self.stats.steps_per_block.append(pending_steps)
                        done_block, pending = pending, None
                        try:
                            stopped = self.fire_commit(block - 1, done_block, pending_steps, start)
                        except StopGeneration:
                            stopped = True
                        if self.emit:
                            yield self.update("commit", block - 1, None, [])
                        if stopped:
                            reason = "hook"
                            raise _Ended
                    else:
                        self.where.set("decode", block=block, step=step)
                        logits = self.block_forward(None, canvas, idx, coreset)
                        self.clock.stop()
                        self.stats.preview_forwards += 1
                    logits = logits[0].float()  # [N, V]
                    logits[:, mask_id] = float("-inf")  # the mask token is never a candidate
                    force = step + 1 >= limit
                    cand, conf, flags = sampling.decide(logits, self.counts, s, self.generator, force_all=force)
                    packed = torch.stack([flags.long(), cand]).tolist()  # the one host transfer per step
                    unmask = [masked[i] for i, f in enumerate(packed[0]) if f]
                    chosen = {masked[i]: packed[1][i] for i in range(len(masked))}
                    overrides: dict[int, int] = {}
                    changed = False
                    if self.hooks.active(STEP_POINT):
                        event = StepEvent(block, step, canvas.clone(), list(masked), cand, conf, list(unmask),
                                          self.now(), logits=logits)
                        try:
                            self.hooks.fire(STEP_POINT, event)
                        except StopGeneration:
                            event.stopped = True
                        new_unmask, overrides = self._checked(event, masked, vocab)
                        changed = bool(overrides) or new_unmask != unmask
                        unmask = new_unmask
                        stop_now = event.stopped
                        if step + 1 > limit + B and unmask != masked:
                            raise HookError(STEP_POINT, RuntimeError(
                                f"block {block}: hooks kept positions masked {B} steps past the step limit"))
                    # apply the decision: device canvas, penalty counts, host mirror
                    if not changed:
                        sel = canvas[idx] if idx is not None else canvas
                        new = torch.where(flags, cand, sel)
                        if idx is None:
                            canvas.copy_(new)
                        else:
                            canvas[idx] = new
                        if self.counts is not None:
                            self.counts.index_add_(0, cand, flags.to(self.counts.dtype))
                    elif unmask:
                        toks = [overrides.get(p, chosen[p]) for p in unmask]
                        pos_t = torch.tensor(unmask, device=self.device)
                        tok_t = torch.tensor(toks, device=self.device)
                        canvas[pos_t] = tok_t
                        if self.counts is not None:
                            self.counts.index_add_(0, tok_t, torch.ones_like(tok_t, dtype=self.counts.dtype))
                    for p in unmask:
                        host[p] = overrides.get(p, chosen[p])
                        if host[p] in self.eos and p < end:
                            end, end_reason = p + 1, "eos"
                    while prefix < m and host[prefix] is not None:
                        prefix += 1
                    if self.stop_strings is not None and prefix:
                        k = self.stop_strings.find(self.committed + host[:min(prefix, end)])
                        if k is not None:
                            cut = k - len(self.committed)
                            if cut < end:
                                end, end_reason = cut, "stop_string"
                    if stop_now:
                        end, end_reason = min(end, prefix), "hook"
                    masked = [p for p in masked if host[p] is None and p < end]
                    step += 1
                    if self.emit:
                        yield self.update("step", block, step - 1, host, unmask)
                    if stop_now:
                        break
                # the block is resolved
                tokens = host[:end]
                if end_reason is not None:
                    reason = end_reason
                if end_reason is not None or len(self.committed) + len(tokens) >= self.max_new:
                    if tokens:
                        start = len(self.prompt_ids) + len(self.committed)
                        try:
                            self.commit(tokens, block)
                        except StopGeneration:
                            self.committed += tokens
                            self.stats.cache_complete = False
                            self.stats.steps_per_block.append(step)
                            reason = "hook"
                            raise _Ended from None
                        self.committed += tokens
                        self.stats.blocks += 1
                        self.stats.steps_per_block.append(step)
                        try:
                            self.fire_commit(block, tokens, step, start)  # the run ends anyway
                        except StopGeneration:
                            pass
                        if self.emit:
                            yield self.update("commit", block, None, [])
                    raise _Ended
                pending, pending_steps = tokens, step
                block += 1
        except _Ended:
            pass
        except StopGeneration:
            # a model hook stopped a forward; that forward changed nothing. A finished block that
            # was waiting for its (fused) commit is part of the response but not in the cache.
            reason = "hook"
            if pending:
                self.committed += pending
                self.stats.blocks += 1
                self.stats.steps_per_block.append(pending_steps)
                self.stats.cache_complete = False
        self.finish(reason)
        if self.emit:
            yield StreamUpdate("done", block, None, list(self.committed), [], [], self.now(), self.result,
                               self.engine.tokenizer)

    @staticmethod
    def _checked(event: StepEvent, masked: list[int], vocab: int) -> tuple[list[int], dict[int, int]]:
        """The step hook's decision, validated: positions must be masked, tokens in the vocabulary."""
        allowed = set(masked)
        try:
            unmask = sorted({int(p) for p in (event.unmask.tolist() if isinstance(event.unmask, torch.Tensor)
                                               else event.unmask)})
            tokens = {int(p): int(t) for p, t in event.tokens.items()}
        except (TypeError, ValueError) as e:
            raise HookError(STEP_POINT, TypeError(f"unmask must be block positions and tokens a dict "
                                                  f"position -> token id ({e})")) from e
        bad = [p for p in unmask if p not in allowed]
        if bad:
            raise HookError(STEP_POINT, ValueError(f"positions {bad} cannot be unmasked: not masked "
                                                   f"(still masked: {masked})"))
        bad_tok = {p: t for p, t in tokens.items() if not 0 <= t < vocab}
        if bad_tok:
            raise HookError(STEP_POINT, ValueError(f"tokens {bad_tok} are outside the vocabulary [0, {vocab})"))
        missing = [p for p in tokens if p not in unmask]
        if missing:
            raise HookError(STEP_POINT, ValueError(f"tokens set for positions {missing} that are not unmasked"))
        return unmask, tokens


class _Ended(Exception):
    """Internal: the diffusion loop is done."""


# --------------------------------------------------------------------------- the engine
class Engine:
    """Runs generations on one model: ``generate`` (a result), ``stream`` (updates as it goes),
    ``hooks`` / ``add_hook`` (interventions), ``capture`` (recordings). For a model on the CPU it
    applies ``clover_lab.malloc.tune()`` once per process (``CLOVER_MALLOC=system`` opts out)."""

    def __init__(self, model: CloverModel, tokenizer=None, settings: SamplerSettings | None = None):
        if not isinstance(model, CloverModel):
            raise TypeError(f"Engine needs a CloverModel, got {type(model).__name__}")
        if model.device.type == "cpu":
            malloc.tune()  # large activations from glibc's heap, reused: no page fault per fresh page
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings or SamplerSettings()
        self.prefill_chunk_size = 1024
        self._block_size = model.config.block_size
        self._mask_token_id = model.config.mask_token_id
        eos = list(model.config.eos_token_ids)
        if not eos and tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos = [tokenizer.eos_token_id]
        self.eos_token_ids: list[int] = eos
        self._where = _Where()
        # the no-hook fast path (clover_lab.graphs): None = on where it pays (CUDA, as CUDA graphs),
        # True = also on a CPU (static-shape steps run eagerly: tests), False = off
        self.step_graphs: bool | None = None
        # on a CPU, run the fast path's steps through torch.compile (~10 s of compilation per step
        # shape on first use, then steps 2-3x faster: bench/compare_transformers.py)
        self.compile_steps = False
        self._graphs = None
        self._graphs_holder = None  # weakref to the generation running on them

    def _graphs_for(self, run: "_Run", length: int):
        """The StepGraphs to run a generation of ``length`` positions on, or None for the plain path
        (also while another unfinished generation of this engine holds them: streams interleaved)."""
        cuda = self.model.device.type == "cuda"
        use = self.step_graphs if self.step_graphs is not None else (cuda or self.compile_steps)
        if not use:
            return None
        from .graphs import StepGraphs

        if self._graphs_holder is not None and self._graphs_holder() is not None:
            return None  # another generation of this engine is still running on them
        self._graphs_holder = weakref.ref(run)

        g = self._graphs
        compile_steps = self.compile_steps and not cuda
        if (g is None or not g.fits(length) or (g.device, g.dtype) != (self.model.device, self.model.dtype)
                or g.compile != compile_steps):
            size = max(1024, 1 << (length - 1).bit_length())  # a power of two: few re-allocations
            size = min(size, self.model.config.max_position_embeddings)
            self._graphs = None  # free the old cache and graphs first
            self._graphs = StepGraphs(self.model, size, compile=compile_steps)
        return self._graphs

    def __repr__(self):
        c = self.model.config
        return (f"Engine(layers={c.num_hidden_layers}, hidden={c.hidden_size}, experts={c.num_experts}, "
                f"block_size={self.block_size}, mask_token_id={self.mask_token_id}, device={self.model.device}, "
                f"dtype={self.model.dtype}, tokenizer={'yes' if self.tokenizer is not None else 'no'})")

    # ---------------------------------------------------------------- settings
    @property
    def block_size(self) -> int:
        return self._block_size

    @block_size.setter
    def block_size(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"block_size must be a positive integer, got {value!r}")
        self._block_size = value

    @property
    def mask_token_id(self) -> int | None:
        return self._mask_token_id

    @mask_token_id.setter
    def mask_token_id(self, value: int | None) -> None:
        V = self.model.config.vocab_size
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < V):
            raise ValueError(f"mask_token_id must be a token id in [0, {V}) or None, got {value!r}")
        self._mask_token_id = value

    # ---------------------------------------------------------------- hooks
    def hooks(self, hooks: dict[str, Callable | list[Callable]]):
        """``with engine.hooks({"denoise.step": fn, "layers.*.moe.route": fn2}):`` - removed on exit."""
        return self.model.hooks.scoped(hooks)

    def add_hook(self, name: str, fn: Callable):
        """A permanent hook; ``handle.remove()`` takes it off."""
        return self.model.hooks.add(name, fn)

    def capture(self, points, to: str | torch.device | None = None):
        """``with engine.capture(["layers.*.moe.route", "denoise.step"]) as cap:`` records those
        points over every generation inside the block, tagged with block and step."""
        from .capture import Capture

        return Capture(self, points, to=to)

    # ---------------------------------------------------------------- requests
    def encode(self, prompt, thinking: bool | None = None) -> list[int]:
        """A prompt as token ids: a string (needs a tokenizer), token ids, or chat messages."""
        V = self.model.config.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise GenerationError("a text prompt needs a tokenizer, and this engine has none; "
                                      "pass token ids instead (a list of ints)")
            ids = list(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, torch.Tensor):
            if prompt.dim() == 2 and prompt.shape[0] == 1:
                prompt = prompt[0]
            if prompt.dim() != 1 or prompt.dtype not in (torch.int64, torch.int32):
                raise GenerationError(f"prompt tensor: expected integer token ids of shape [T], got "
                                      f"{tuple(prompt.shape)} {prompt.dtype}")
            ids = prompt.tolist()
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            if self.tokenizer is None:
                raise GenerationError("chat messages need a tokenizer with a chat template; this engine has none")
            for i, msg in enumerate(prompt):
                if "role" not in msg or "content" not in msg:
                    raise GenerationError(f"chat message {i}: expected keys 'role' and 'content', got {sorted(msg)}")
            kwargs = {} if thinking is None else {"enable_thinking": bool(thinking)}
            try:
                out = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True,
                                                         **kwargs)
            except Exception as e:  # noqa: BLE001 - re-raised with what was asked
                raise GenerationError(f"the tokenizer cannot apply a chat template to these messages ({e})") from e
            if hasattr(out, "keys") and "input_ids" in out:
                out = out["input_ids"]
            if isinstance(out, torch.Tensor):
                out = out.reshape(-1).tolist()
            if out and isinstance(out[0], (list, tuple)):
                out = out[0]
            ids = list(out)
        elif isinstance(prompt, (list, tuple)):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise GenerationError("prompt: expected a string, a list of token ids (ints) or chat messages "
                                      "(dicts with 'role' and 'content')")
            ids = list(prompt)
        else:
            raise GenerationError(f"prompt: expected a string, token ids or chat messages, got {type(prompt).__name__}")
        if not ids:
            raise GenerationError("prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise GenerationError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {V})")
        return [int(t) for t in ids]

    def check_request(self, prompt_len: int, max_new_tokens: int, mode: str) -> None:
        """Refuse up front what cannot run: unknown mode, no mask token, context or memory overflow."""
        if mode not in MODES:
            raise GenerationError(f"mode={mode!r}: expected one of {', '.join(MODES)}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens={max_new_tokens!r}: expected a positive integer")
        if mode == "diffusion" and self.mask_token_id is None:
            raise GenerationError("block diffusion needs a mask token, but the model config has no mask_token_id; "
                                  "set engine.mask_token_id or use mode='ar'")
        ctx = self.model.config.max_position_embeddings
        if prompt_len + max_new_tokens > ctx:
            raise GenerationError(f"the prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) is "
                                  f"{prompt_len + max_new_tokens} positions, over the context length "
                                  f"max_position_embeddings={ctx}; shorten the prompt or lower max_new_tokens")
        need = cache_bytes(self.model, prompt_len + max_new_tokens)
        free = _available_bytes(self.model.device)
        if free is not None and need > free:
            raise GenerationError(f"the cache for {prompt_len + max_new_tokens} positions needs "
                                  f"{need / 2**30:.2f} GiB, but only {free / 2**30:.2f} GiB is free on "
                                  f"{self.model.device}; lower max_new_tokens or shorten the prompt")

    def _start(self, prompt, mode, max_new_tokens, stop, thinking, settings, sampler, emit) -> _Run:
        s = SamplerSettings.from_kwargs(settings or self.settings, **sampler)
        if isinstance(stop, str):
            stop = [stop]
        stop = [x for x in (stop or [])]
        if stop:
            if not all(isinstance(x, str) and x for x in stop):
                raise GenerationError(f"stop: expected non-empty strings, got {stop!r}")
            if self.tokenizer is None:
                raise GenerationError("stop strings need a tokenizer, and this engine has none; "
                                      "use eos token ids (engine.eos_token_ids) instead")
        ids = self.encode(prompt, thinking)
        self.check_request(len(ids), max_new_tokens, mode)
        return _Run(self, ids, mode, max_new_tokens, s, stop, emit)

    # ---------------------------------------------------------------- generation
    def stream(self, prompt, *, mode: str = "diffusion", max_new_tokens: int = 256, stop=None,
               thinking: bool | None = None, settings: SamplerSettings | None = None,
               **sampler: Any) -> Iterator[StreamUpdate]:
        """Like :meth:`generate`, yielding a :class:`StreamUpdate` per denoising step ("step":
        provisional tokens of the current block), per committed block ("commit") and one "done"
        whose ``result`` is the GenerationResult. Requests are checked before the first update."""
        run = self._start(prompt, mode, max_new_tokens, stop, thinking, settings, sampler, emit=True)
        return self._drive(run)

    def _drive(self, run: _Run) -> Iterator[StreamUpdate]:
        # no inference_mode around the yields: it would leak into the consumer's code between updates
        try:
            yield from (run.run_diffusion() if run.mode == "diffusion" else run.run_ar())
        finally:  # ended, failed or abandoned: the fast path's cache is free for the next generation
            if self._graphs_holder is not None and self._graphs_holder() is run:
                self._graphs_holder = None

    def generate(self, prompt, *, mode: str = "diffusion", max_new_tokens: int = 256, stop=None,
                 thinking: bool | None = None, settings: SamplerSettings | None = None,
                 **sampler: Any) -> GenerationResult:
        """Generate a response to ``prompt`` (a string, token ids, or chat messages).

        ``mode``: "diffusion" (block diffusion) or "ar" (one token per forward, the baseline).
        ``stop``: stop strings (need a tokenizer). ``thinking``: the chat template's
        ``enable_thinking`` flag. Sampler settings (see :class:`SamplerSettings`) come as keyword
        arguments (``threshold=0.9, temperature=0, top_p, top_k, confidence, max_tokens_per_step,
        max_steps_per_block, repetition_penalty, presence_penalty, frequency_penalty,
        coreset_size, seed``) or as ``settings``; they override ``engine.settings``.
        """
        run = self._start(prompt, mode, max_new_tokens, stop, thinking, settings, sampler, emit=False)
        for _ in self._drive(run):
            pass
        return run.result


# --------------------------------------------------------------------------- loading
def default_model_dir() -> Path | None:
    """The embedded default model's directory, or None when there is none."""
    for root in DEFAULT_MODEL_ROOTS:
        if (root / DEFAULT_MODEL_NAME / "config.json").exists():
            return root / DEFAULT_MODEL_NAME
        found = sorted(p.parent for p in root.glob("*/config.json")) if root.is_dir() else []
        if found:
            return found[0]
    return None


def load(path=None, device=None, dtype=None) -> Engine:
    """An Engine over the model (and tokenizer, when present) in the Hugging Face directory ``path``.

    With no path: ``$CLOVER_LAB_MODEL`` when set, else the embedded default model (a model
    directory in ``assets/``, ``assets/clover-default`` first). Without one that is a
    FileNotFoundError saying so; there is deliberately no random-weights fallback, whose output
    would look like a broken model."""
    from .loading import load_tokenizer

    if path is None:
        path = os.environ.get("CLOVER_LAB_MODEL") or default_model_dir()
        if path is None:
            raise FileNotFoundError(
                "no default model is shipped with clover_lab yet (looked for a model directory in "
                + ", ".join(str(d) for d in DEFAULT_MODEL_ROOTS)
                + "); pass a model directory: clover_lab.load('path/to/model'), or set CLOVER_LAB_MODEL")
    model = CloverModel.from_pretrained(path, device=device, dtype=dtype)
    return Engine(model, load_tokenizer(path))
