"""Block diffusion (spec section 4): after the prompt's prefill, each block starts as mask tokens
and is resolved by previews, one denoising step each, until no position is masked. The first
preview of a block is fused with the commit of the previous block (one forward); the last
block is committed on its own, so the cache ends up holding the whole response.

Cost discipline: one device-to-host transfer per denoising step (the unmask decision, the
candidates, which the loop needs to know what is left to do, and whether the step's logits were
finite: NaN or inf logits end the run with a GenerationError naming block, step and source,
never a garbage token); ``denoise.step`` events are built only when a hook is attached, and
never add a transfer.

Ending early: ``event.stop()`` or StopGeneration in a ``denoise.step`` hook keeps the block's
resolved contiguous prefix, commits it and fires ``block.commit``; in a ``block.commit`` hook it
ends the run after that block. StopGeneration raised inside a forward (a model hook) abandons
that forward, which changed nothing; a finished block whose fused commit was abandoned is
still returned, and ``stats.cache_complete`` is then False. Raised during the prompt's prefill,
it ends the run with no tokens (``stop_reason`` "hook").
"""
from __future__ import annotations

from typing import Iterator

import torch

from .. import sampling
from ..hooks import points
from ..hooks.events import StepEvent
from ..hooks.registry import HookError, StopGeneration
from .faults import check_logits, collapsed, logits_health
from .results import StreamUpdate


class Block:
    """One block being resolved: the canvas on the device, and the host's copy of it (None where
    still masked). Positions at or past ``end`` are dropped (after an EOS, a stop string or a
    stopping hook)."""

    def __init__(self, index: int, length: int, mask_id: int, device, max_steps: int | None):
        self.index = index
        self.canvas = torch.full((length,), mask_id, dtype=torch.long, device=device)
        self.host: list[int | None] = [None] * length
        self.masked = list(range(length))
        self.end, self.end_reason = length, None
        self.prefix = 0  # length of the resolved contiguous prefix
        self.step = 0
        # without hooks a block never needs more than its length in steps (each unmasks >= 1)
        self.limit = min(max_steps or length, length)

    def __len__(self) -> int:
        return len(self.host)

    def masked_index(self) -> torch.Tensor | None:
        """The still-masked positions as a device index, or None while all are masked."""
        return None if len(self.masked) == len(self) else torch.tensor(self.masked, device=self.canvas.device)

    def place(self, tokens: dict[int, int], eos: set[int]) -> None:
        """Host side of a step: tokens placed, an EOS ends the block after itself."""
        for p, t in tokens.items():
            self.host[p] = t
            if t in eos and p < self.end:
                self.end, self.end_reason = p + 1, "eos"
        while self.prefix < len(self) and self.host[self.prefix] is not None:
            self.prefix += 1

    def cut(self, end: int, reason: str) -> None:
        if end < self.end or reason == "hook":
            self.end, self.end_reason = min(end, self.end), reason

    def next_step(self) -> None:
        self.masked = [p for p in self.masked if self.host[p] is None and p < self.end]
        self.step += 1

    def tokens(self) -> list[int]:
        return self.host[:self.end]


# --------------------------------------------------------------------------- the block loop
def run_diffusion(run) -> Iterator[StreamUpdate]:
    """Generate ``run.max_new`` tokens at most, block by block; yields "step" and "commit"
    updates (when the run emits) and a last "done" update."""
    loop = BlockLoop(run)
    try:
        run.prefill(None)
    except StopGeneration:  # a model hook stopped the prompt's prefill: no tokens, the prompt half cached
        run.stats.cache_complete = False
        loop.reason = "hook"
    else:
        try:
            yield from loop.run_blocks()
        except StopGeneration:  # a model hook stopped a forward; that forward changed nothing
            loop.abandon()
    run.finish(loop.reason)
    if run.emit:
        yield run.update("done", loop.index, None)


class BlockLoop:
    """The loop's bookkeeping: the finished block waiting for its fused commit (``pending``), the
    block being resolved (``index``) and why the run ends."""

    def __init__(self, run):
        self.run = run
        self.coreset = run.new_coreset()
        self.pending: list[int] | None = None
        self.pending_steps = 0
        self.index = 0
        self.reason = "length"

    def produced(self) -> int:
        return len(self.run.committed) + len(self.pending or ())

    def run_blocks(self) -> Iterator[StreamUpdate]:
        run, engine = self.run, self.run.engine
        while self.produced() < run.max_new:
            block = Block(self.index, min(engine.block_size, run.max_new - self.produced()),
                          engine.mask_token_id, run.device, run.s.max_steps_per_block)
            if self.coreset is not None:
                self.coreset.reset()
            if (yield from self.resolve(block)):
                return
            tokens = block.tokens()
            if block.end_reason is not None:
                self.reason = block.end_reason
            if block.end_reason is not None or len(run.committed) + len(tokens) >= run.max_new:
                yield from self.commit_last(block.index, tokens, block.step)
                return
            self.pending, self.pending_steps = tokens, block.step
            self.index += 1

    def resolve(self, block: Block) -> Iterator[StreamUpdate]:
        """Denoising steps until no position of ``block`` is masked; returns True when a
        ``block.commit`` hook ended the run at the fused commit of the previous block."""
        run = self.run
        while block.masked:
            idx = block.masked_index()
            if block.step == 0 and self.pending is not None:
                where = run.where("decode", block.index, 0, commit_block=block.index - 1)
                logits = run.preview(block.canvas, idx, self.coreset, where, pending=self.pending)
                if (yield from self.publish_pending()):
                    self.reason = "hook"
                    return True
            else:
                logits = run.preview(block.canvas, idx, self.coreset, run.where("decode", block.index, block.step))
            unmask, stop_now = denoise_step(run, block, logits, idx)
            if run.emit:
                yield run.update("step", block.index, block.step - 1, block.host, unmask)
            if stop_now:
                break
        return False

    def publish_pending(self) -> Iterator[StreamUpdate]:
        """The fused forward committed the previous block: it joins the response and fires
        ``block.commit``; returns True when a hook asked to stop."""
        run = self.run
        start = len(run.prompt_ids) + len(run.committed)
        tokens, self.pending = self.pending, None
        run.record_block(tokens, self.pending_steps)
        stopped = run.fire_commit(self.index - 1, tokens, self.pending_steps, start)
        if run.emit:
            yield run.update("commit", self.index - 1, None)
        return stopped

    def commit_last(self, index: int, tokens: list[int], steps: int) -> Iterator[StreamUpdate]:
        """The last block, committed on its own so that the cache holds the whole response."""
        run = self.run
        if not tokens:
            return
        start = len(run.prompt_ids) + len(run.committed)
        try:
            run.commit(tokens, index)
        except StopGeneration:
            run.record_block(tokens, steps)
            run.stats.cache_complete = False
            self.reason = "hook"
            return
        run.record_block(tokens, steps)
        run.fire_commit(index, tokens, steps, start)  # the run ends anyway
        if run.emit:
            yield run.update("commit", index, None)

    def abandon(self) -> None:
        """A model hook stopped a forward: a finished block that was waiting for its (fused)
        commit is part of the response, but not in the cache."""
        self.reason = "hook"
        if self.pending:
            self.run.record_block(self.pending, self.pending_steps)
            self.run.stats.cache_complete = False


# --------------------------------------------------------------------------- one denoising step
def denoise_step(run, block: Block, logits: torch.Tensor, idx: torch.Tensor | None) -> tuple[list[int], bool]:
    """Decide, let ``denoise.step`` hooks change the decision, apply it to the canvas and the
    host copy. ``logits`` [1, N, V] at the masked positions ``idx`` (None: all). Returns (the
    positions unmasked, whether a hook asked to stop)."""
    mask_id = run.engine.mask_token_id
    logits = logits[0].float()  # [N, V]
    flat = collapsed(logits)  # before the mask column is -inf
    logits[:, mask_id] = float("-inf")  # the mask token is never a candidate
    force = block.step + 1 >= block.limit
    cand, conf, flags = sampling.decide(logits, run.counts, run.s, run.generator, force_all=force)
    logp = run.info.distribution(logits, run.counts, run.s)  # None unless log-probabilities are asked for
    # the one host transfer per step: decision, candidates, and whether the logits could be used
    # (NaN or inf logits make their row's confidence NaN, equal ones carry no answer: argmax would
    # pick token 0 either way)
    N = len(block.masked)
    host = torch.cat([flags.long(), cand, logits_health(flat, conf).reshape(1)]).tolist()
    flags_host, cand_host = host[:N], host[N:2 * N]
    check_logits(run, host[2 * N], f"block {block.index}, step {block.step}", block.canvas)
    unmask = [block.masked[i] for i, f in enumerate(flags_host) if f]
    chosen = dict(zip(block.masked, cand_host))
    overrides: dict[int, int] = {}
    stop_now = False
    if run.hooks.active(points.DENOISE_STEP):
        decided = unmask
        unmask, overrides, stop_now = fire_step(run, block, cand, conf, unmask, logits)
        if overrides or unmask != decided:
            _place_on_device(run, block, {p: overrides.get(p, chosen[p]) for p in unmask})
        else:
            _apply_decision(run, block, flags, cand, idx)
    else:
        _apply_decision(run, block, flags, cand, idx)
    placed = {p: overrides.get(p, chosen[p]) for p in unmask}
    block.place(placed, run.eos)
    run.info.note(block, block.step, placed,
                  run.info.chosen(logp, [block.masked.index(p) for p in placed], list(placed.values())))
    if run.stop_strings is not None and block.prefix:
        k = run.stop_strings.find(run.committed + block.host[:min(block.prefix, block.end)])
        if k is not None:
            block.cut(k - len(run.committed), "stop_string")
    if stop_now:
        block.cut(block.prefix, "hook")
    block.next_step()
    return unmask, stop_now


def _apply_decision(run, block: Block, flags: torch.Tensor, cand: torch.Tensor, idx: torch.Tensor | None) -> None:
    """The rule's decision as it stands, on the device, without a host round trip."""
    sel = block.canvas[idx] if idx is not None else block.canvas
    new = torch.where(flags, cand, sel)
    if idx is None:
        block.canvas.copy_(new)
    else:
        block.canvas[idx] = new
    if run.counts is not None:
        run.counts.index_add_(0, cand, flags.to(run.counts.dtype))


def _place_on_device(run, block: Block, tokens: dict[int, int]) -> None:
    """A decision a hook changed: exactly these tokens at these positions."""
    if not tokens:
        return
    pos_t = torch.tensor(list(tokens), device=run.device)
    tok_t = torch.tensor(list(tokens.values()), device=run.device)
    block.canvas[pos_t] = tok_t
    if run.counts is not None:
        run.counts.index_add_(0, tok_t, torch.ones_like(tok_t, dtype=run.counts.dtype))


def fire_step(run, block: Block, cand, conf, unmask: list[int], logits) -> tuple[list[int], dict[int, int], bool]:
    """``denoise.step`` hooks on this step's decision; returns it (validated) as (positions to
    unmask, tokens overriding candidates, stop)."""
    # copies: the decision is taken, so edits of the event's tensors could only make the device
    # canvas and the returned tokens disagree; changes go through unmask / set_token
    event = StepEvent(block.index, block.step, block.canvas.clone(), list(block.masked), cand.clone(), conf.clone(),
                      list(unmask), run.now(), logits=logits, where=run.where("decode", block.index, block.step))
    try:
        run.hooks.fire(points.DENOISE_STEP, event)
    except StopGeneration:
        event.stopped = True
    unmask, overrides = checked_decision(event, block.masked, run.model.config.vocab_size, run.engine.mask_token_id)
    bound = len(block)  # the block's real length, not engine.block_size: a short block is bounded as tightly
    if block.step + 1 > block.limit + bound and unmask != block.masked:
        row = "" if getattr(run, "row", None) is None else f"row {run.row}, "
        raise HookError(points.DENOISE_STEP, RuntimeError(
            f"{row}block {block.index}: hooks kept positions masked {bound} steps past the step limit"))
    return unmask, overrides, event.stopped


def checked_decision(event: StepEvent, masked: list[int], vocab: int,
                     mask_id: int | None = None) -> tuple[list[int], dict[int, int]]:
    """The step hook's decision, validated: positions must be masked, tokens in the vocabulary and
    not the mask token (a mask in the result would be hidden by the text but kept in token_ids)."""
    allowed = set(masked)
    try:
        unmask = sorted({int(p) for p in (event.unmask.tolist() if isinstance(event.unmask, torch.Tensor)
                                           else event.unmask)})
        tokens = {int(p): int(t) for p, t in event.tokens.items()}
    except (TypeError, ValueError, AttributeError) as e:
        raise HookError(points.DENOISE_STEP, TypeError(f"unmask must be block positions and tokens a dict "
                                                       f"position -> token id ({e})")) from e
    bad = [p for p in unmask if p not in allowed]
    if bad:
        raise HookError(points.DENOISE_STEP, ValueError(f"positions {bad} cannot be unmasked: not masked "
                                                        f"(still masked: {masked})"))
    bad_tok = {p: t for p, t in tokens.items() if not 0 <= t < vocab}
    if bad_tok:
        raise HookError(points.DENOISE_STEP, ValueError(f"tokens {bad_tok} are outside the vocabulary [0, {vocab})"))
    masks = [p for p, t in tokens.items() if t == mask_id]
    if masks:
        raise HookError(points.DENOISE_STEP, ValueError(f"positions {masks} set to the mask token {mask_id}: an "
                                                        f"unmasked position needs a real token"))
    missing = [p for p in tokens if p not in unmask]
    if missing:
        raise HookError(points.DENOISE_STEP, ValueError(f"tokens set for positions {missing} that are not unmasked"))
    return unmask, tokens
