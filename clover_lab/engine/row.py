"""A row and the request it belongs to. A :class:`Row` is one prompt's generation: its own
settings (mode, sampler settings and generator, decoding policy, block size, length, stop
strings, EOS), its response so far, where its decoder stands (the block it resolves, a finished
block waiting for its fused commit, the next causal token) and its figures. A :class:`Handle`
is what ``Engine.submit`` returns for a request: its rows, the updates they produce, the result
once every row has ended, and :meth:`Handle.cancel`.
"""
from __future__ import annotations

import random
import threading
import time
from collections import deque

import torch

from clover_lab.engine.requests import Plan, StopStrings
from clover_lab.engine.results import (
    BatchResult,
    Clock,
    GenerationResult,
    GenerationStats,
    StreamUpdate,
    Thinking,
    stop_ids,
    texts,
)
from clover_lab.engine.sampling import log_probs
from clover_lab.hooks import points
from clover_lab.hooks.events import CommitEvent, Where
from clover_lab.hooks.registry import StopGeneration

FORWARD_KINDS = ("preview", "fused", "commit", "prefill")


class Handle:
    """A submitted request. ``rows`` its rows (a prompt's ``n`` rows together); ``result`` the
    GenerationResult (a BatchResult for a batch or ``n`` > 1) once every row has ended, ``error``
    what ended it instead. :meth:`cancel` ends its rows at the next step boundary (thread-safe);
    :meth:`updates` hands over the StreamUpdates produced so far (``listener``, when given, gets
    each one as it is produced, in the thread that steps the engine; an exception it raises ends
    this request with it, and the step goes on with the others)."""

    def __init__(self, engine, plan: Plan, number: int, hooks, emit: bool, listener=None):
        self.engine, self.plan, self.number, self.hooks = engine, plan, number, hooks
        self.emit, self.listener = emit, listener
        self.loop = None  # the step loop that runs it (the engine's, or a nested generation's own)
        self.batched = plan.batched
        self.t0 = time.perf_counter()
        self.t_decode: float | None = None
        self.clock = Clock(engine.model.device)
        self.forwards = dict.fromkeys(FORWARD_KINDS, 0)
        self.paths: dict[str, int] = {}
        self.result = None
        self.error: BaseException | None = None
        self._cancelled = threading.Event()
        self._updates: deque[StreamUpdate] = deque()
        policy = plan.policy if plan.policy is not None else engine.policy
        if plan.grammar is not None and plan.mode == "diffusion":  # the grammar around the request's rule
            from clover_lab.grammar.policy import GrammarPolicy  # the grammar engine loads when a grammar is used

            policy = GrammarPolicy(plan.grammar, inner=policy)
        self.rows = [Row(self, i, ids, s, policy) for i, (ids, s) in enumerate(zip(plan.prompts, plan.settings))]

    def __repr__(self) -> str:
        state = "done" if self.done else "cancelled" if self.cancelled else "running"
        return f"Handle(request {self.number}, {len(self.rows)} row(s), {self.plan.mode}, {state})"

    # ---------------------------------------------------------------- the caller's side
    def cancel(self) -> None:
        """End this request's rows at the next step boundary with stop reason "cancelled", their
        partial results intact; a row still queued ends with no tokens. Safe from any thread."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    @property
    def started(self) -> bool:
        """The engine has admitted its rows (they run, or ran)."""
        return any(row.key is not None for row in self.rows)

    def updates(self) -> list[StreamUpdate]:
        """The updates produced since the last call (none without ``emit``)."""
        out = []
        while self._updates:
            out.append(self._updates.popleft())
        return out

    # ---------------------------------------------------------------- the engine's side
    def put(self, update: StreamUpdate) -> None:
        if self.loop is not None and self.loop.produced is not None:  # what Engine.step returns
            self.loop.produced.append(update)
        if self.listener is not None:
            try:
                self.listener(update)
            except Exception as e:  # noqa: BLE001 - this request ends with it; the step and other rows go on
                self.fail(e)
        else:
            self._updates.append(update)

    def took(self, kind: str, label: str | None) -> None:
        """One forward that some of this request's rows took part in."""
        self.forwards[kind] += 1
        if kind != "prefill" and label is not None:
            self.paths[label] = self.paths.get(label, 0) + 1

    def row_ended(self) -> None:
        """A row ended: when it was the last, the request's result."""
        if self.error is not None or any(row.result is None for row in self.rows):
            return
        results = [row.result for row in self.rows]
        if not self.batched:
            self.result = results[0]
        else:
            if self.clock.cuda:
                torch.cuda.synchronize(self.engine.model.device)
            stats = GenerationStats.of_rows([r.stats for r in results], self.clock, self.forwards, self.t0,
                                            self.t_decode or self.t0, path_label(self.paths))
            self.result = BatchResult(results, stats)
            if self.emit:
                self.put(StreamUpdate("batch", 0, None, [], [], result=self.result))

    def fail(self, error: BaseException) -> None:
        """The request ended with ``error``; its rows are out of the engine (``StepLoop.fail``)."""
        if self.error is None and self.result is None:
            self.error = error


class Row:
    """One prompt of a request, as the engine runs it. ``key`` names it in the runner's cache;
    ``index`` is its place in the request (``row``, what events and errors name, is that index in a
    batch and None for a single prompt)."""
    thinking: Thinking | None = None  # the tokenizer's <think> tokens and the prompt's state (results.py)

    def __init__(self, handle: Handle, index: int, prompt_ids: list[int], s, policy):
        engine, plan = handle.engine, handle.plan
        self.handle, self.index, self.prompt_ids, self.s, self.policy = handle, index, prompt_ids, s, policy
        self.key: int | None = None  # given when the engine admits the row (with ``loop``, its step loop)
        self.loop = None
        self.row = index if handle.batched else None
        self.engine, self.model, self.hooks = engine, engine.model, handle.hooks
        self.device = self.model.device
        self.mode, self.max_new, self.block_size = plan.mode, plan.max_new_tokens, plan.block_size
        self.seed = s.seed if s.seed is not None else random.SystemRandom().randrange(2**63)
        self.generator = None if s.greedy else torch.Generator(device=self.device).manual_seed(self.seed)
        self.counts = (torch.zeros(self.model.config.vocab_size, device=self.device, dtype=torch.float32)
                       if s.has_penalties else None)
        self.stop_strings = StopStrings(engine.tokenizer, plan.stop) if plan.stop else None
        self.thinking = Thinking.of(engine.tokenizer, prompt_ids)
        self.eos = (set() if s.ignore_eos else set(engine.eos_token_ids)) | stop_ids(self.thinking, plan.thinking)
        self.prompt_logprobs = plan.prompt_logprobs  # k: the prompt's tokens scored at its prefill (None: not)
        self.prompt_scores: tuple[list, list | None] | None = None
        self.skip_reading_prefix_cache = plan.skip_reading_prefix_cache  # Request's (None: read where it can)
        self.prefix = None  # while its prompt is prefilled: what the prefix cache does for it (prefix_cache.Lookup)
        self.clock = Clock(self.device)
        self.stats = GenerationStats(mode=self.mode, prompt_tokens=len(prompt_ids),
                                     seed=s.seed if s.greedy else self.seed,
                                     block_size=self.block_size if self.mode != "ar" else None,
                                     coreset_size=(s.coreset_size or None) if self.mode == "diffusion" else None)
        self.paths: dict[str, int] = {}
        self.t_decode = handle.t0
        self.committed: list[int] = []  # final response tokens
        self.info = TokenInfo(s.logprobs)  # per response token: unmask step, log-probabilities
        self.result: GenerationResult | None = None
        # where the row's decoder stands (diffusion.py, ar.py, speculative.py)
        self.block = None  # the block being resolved (or drafted)
        self.ahead = None  # its next block, begun early by a look-ahead policy
        self.closing = None  # why the row ends, while its last block (``pending``) waits for its commit
        self.pending: tuple[list[int], int] | None = None  # a finished block waiting for its fused commit, its steps
        self.produced = 0  # response tokens before the current block
        self.logits: torch.Tensor | None = None  # [V]: the causal logits at the next position (AR, speculative)
        self.next_token: int | None = None  # speculative: the causal token at the next position, when known
        self.next_details: tuple = (None, None)  # its (log-probability, top alternatives), when asked for
        self.draft = None  # speculative: what a draft must give back (penalty counts, the stop strings' scan)
        self.stopped = False  # speculative: a step hook asked to stop; the row ends after this cycle
        # AR and speculative rows' place in the request's grammar (diffusion's is its GrammarPolicy's)
        self.constraint = plan.grammar.matcher() if plan.grammar is not None and self.mode != "diffusion" else None

    @property
    def live(self) -> bool:
        return self.result is None and self.handle.error is None

    @property
    def cache(self):
        """This row's part of the cache, as a cache of its own (a copy: the error path inspects it)."""
        return self.loop.runner.row_cache(self.key)

    def now(self) -> float:
        return time.perf_counter() - self.handle.t0

    def allowed(self, logits: torch.Tensor, path: list[int] = (), skip: int = 0) -> torch.Tensor:
        """``logits`` [N, V] with what the row's grammar does not allow next at -inf: row i after
        the response and ``path[:skip + i]``; rows past a token the grammar refuses stay as they
        are (no choice there is kept). Without a grammar, ``logits``."""
        if self.constraint is None:
            return logits
        masks = self.constraint.masks(list(path))[skip:skip + logits.shape[0]].to(logits.device)
        masks[~masks.any(-1)] = True
        return logits.masked_fill(~masks[:, :logits.shape[-1]], float("-inf"))

    def keep_going(self, logits: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """``logits`` [N, V] at these response positions, with the row's end tokens at -inf where a
        position comes before ``min_tokens`` (in place; ``logits`` as it is otherwise)."""
        early = [i for i, q in enumerate(positions) if q < self.s.min_tokens]
        if early and self.eos:
            rows = torch.tensor(early, device=logits.device)[:, None]
            logits[rows, torch.tensor(sorted(self.eos), device=logits.device)[None]] = float("-inf")
        return logits

    def follow(self, tokens: list[int]) -> None:
        """The row's grammar follows these committed tokens (up to an end of the response)."""
        if self.constraint is not None:
            ends = [i for i, t in enumerate(tokens) if t in self.eos]
            self.constraint.accept(tokens[:ends[0]] if ends else tokens)

    def where(self, phase: str, block: int | None = None, step: int | None = None,
              commit_block: int | None = None) -> Where:
        return Where(self.handle.number, phase, block, step, commit_block, None if self.row is None else (self.row,))

    # ---------------------------------------------------------------- the response
    def record_block(self, tokens: list[int], steps: int) -> None:
        """A block (an AR token) is final: part of the response, counted in the stats."""
        self.committed += tokens
        self.info.take(len(tokens))
        self.stats.blocks += 1
        self.stats.steps_per_block.append(steps)

    def keep_pending(self) -> None:
        """The row ends before its finished block's fused commit: the block is part of its response,
        but not in the cache."""
        if self.pending is not None:
            (tokens, steps), self.pending = self.pending, None
            self.record_block(tokens, steps)
            self.stats.cache_complete = False

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
        except Exception as e:  # noqa: BLE001 - a HookError ends this row's request only, not its forward's others
            self.handle.fail(e)
            return True
        return event.stopped

    def update(self, kind: str, block: int, step: int | None, block_tokens=(), unmasked=()) -> None:
        """A StreamUpdate to the request, when it streams."""
        if self.handle.emit:
            info, n = self.info, len(self.committed)
            prompt_lp, prompt_top = self.prompt_scores or (None, None)
            self.handle.put(StreamUpdate(kind, block, step, list(self.committed), list(block_tokens), list(unmasked),
                                         self.now(), self.result, tokenizer=self.engine.tokenizer, row=self.row,
                                         thinking=self.thinking,
                                         logprobs=None if info.logprobs is None else info.logprobs[:n],
                                         top_logprobs=None if info.top is None else info.top[:n],
                                         unmask_steps=info.steps[:n], prompt_logprobs=prompt_lp,
                                         prompt_top_logprobs=prompt_top))

    # ---------------------------------------------------------------- the end
    def finish(self, reason: str) -> GenerationResult:
        if self.clock.cuda:
            torch.cuda.synchronize(self.device)
        self.stats.stop_reason = reason
        self.stats.new_tokens = len(self.committed)
        self.stats.path = path_label(self.paths)
        self.clock.fill(self.stats, self.handle.t0, self.t_decode)
        text = None
        tok = self.engine.tokenizer
        cut = self.stop_strings.cut if self.stop_strings is not None and reason == "stop_string" else None
        if tok is not None:
            text = tok.decode(self.committed, skip_special_tokens=True)
            if cut is not None:
                text = cut(text)
        reasoning, answer = texts(tok, self.thinking, self.committed, cut)
        prompt_lp, prompt_top = self.prompt_scores or (None, None)
        self.result = GenerationResult(list(self.committed), text, list(self.prompt_ids), self.stats,
                                       reasoning=reasoning, answer=answer, unmask_steps=list(self.info.steps),
                                       logprobs=self.info.logprobs, top_logprobs=self.info.top,
                                       prompt_logprobs=prompt_lp, prompt_top_logprobs=prompt_top)
        return self.result


def path_label(paths: dict[str, int]) -> str | None:
    """Which path the forwards took ("compiled", "eager: a hook on layers.2.moe.route"), each with
    its count when they changed."""
    if len(paths) <= 1:
        return next(iter(paths), None)
    return "; ".join(f"{label} ({n} forwards)" for label, n in paths.items())


class TokenInfo:
    """What a result says about each response token beside its id: the denoising step that unmasked
    it (0 for every AR token), and, when ``SamplerSettings.logprobs`` asks, its log-probability and
    the ``logprobs`` most probable alternatives', under the distribution it was chosen from (after
    penalties, before temperature and filtering: the one confidences are measured on).

    The decoders note tokens where they choose them (``note``: a block's positions as a step unmasks
    them; AR tokens as they are appended) and ``Row.record_block`` takes a block's notes when it
    joins the response, oldest block first. Without ``logprobs`` nothing is computed on the device.
    """

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
