"""What a generation returns: its figures (``GenerationStats``, timed by ``Clock``), the
result, and the updates ``Engine.stream`` yields. One statistics type: a row's figures, and a
request of several rows (a list of prompts, ``n`` > 1) returns one GenerationResult per row with
the request's figures in ``BatchResult.stats``, the same type aggregating its rows
(:meth:`GenerationStats.of_rows`).

Thinking mode (spec 4.5): a result holds a response's reasoning, written inside
``<think>...</think>``, apart from its answer, for tokenizers that have those two as single
tokens (Qwen3.5/3.6's; :class:`Thinking`). Qwen3.5/3.6's chat templates open ``<think>`` at the
end of the prompt when thinking is on, and write an empty ``<think>\\n\\n</think>\\n\\n`` there when
it is off; a model that writes the ``<think>`` itself is read the same way. With thinking off, a
``</think>`` in the response ends it, like an EOS: the model would be closing a reasoning it was
not asked for (:func:`stop_ids`)."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

# --------------------------------------------------------------------------- thinking (spec 4.5)
THINK_START, THINK_END = "<think>", "</think>"
REASONING, ANSWER = "reasoning", "answer"


@dataclass(frozen=True)
class Thinking:
    start: int  # <think>'s token id
    end: int  # </think>'s
    open: bool  # the prompt left a <think> open: the response starts inside the reasoning

    @classmethod
    def of(cls, tokenizer, prompt_ids: list[int]) -> "Thinking | None":
        """The thinking tokens of ``tokenizer`` and where ``prompt_ids`` leaves them, or None
        when the tokenizer lacks them."""
        if tokenizer is None or not callable(getattr(tokenizer, "convert_tokens_to_ids", None)):
            return None
        start, end = tokenizer.convert_tokens_to_ids(THINK_START), tokenizer.convert_tokens_to_ids(THINK_END)
        unk = getattr(tokenizer, "unk_token_id", None)
        if not isinstance(start, int) or not isinstance(end, int) or unk in (start, end):
            return None
        last = {t: i for i, t in enumerate(prompt_ids) if t in (start, end)}
        return cls(start, end, last.get(start, -1) > last.get(end, -1))

    def split(self, ids: list[int]) -> tuple[list[int] | None, list[int]]:
        """(the reasoning's tokens, or None when the response has none; the answer's tokens).
        The tags themselves belong to neither."""
        i, inside = 0, self.open
        if not inside and ids[:1] == [self.start]:
            i, inside = 1, True
        if not inside:
            return None, list(ids)
        if self.end in ids[i:]:
            k = ids.index(self.end, i)
            return list(ids[i:k]), list(ids[k + 1:])
        return list(ids[i:]), []

    def parts(self, ids: list[int | None]) -> list[str | None]:
        """Which part each token of ``ids`` (the response so far, None where still masked)
        belongs to: "reasoning" (its tags too), "answer", or None where masked."""
        out, inside = [], self.open
        for i, t in enumerate(ids):
            if t is not None and i == 0 and t == self.start and not inside:
                inside = True
            out.append(None if t is None else REASONING if inside else ANSWER)
            if t == self.end:
                inside = False
        return out


def texts(tokenizer, thinking: "Thinking | None", ids: list[int], cut=None) -> tuple[str | None, str | None]:
    """(reasoning, answer) of the response ``ids`` as text; ``cut``: the stop strings' cut of a
    text that ran into one (the reasoning's, if the stop is there: then no answer)."""
    if tokenizer is None:
        return None, None
    reasoning, answer = (None, ids) if thinking is None else thinking.split(ids)

    def decode(part: list[int]) -> str:
        return tokenizer.decode(part, skip_special_tokens=True).strip("\n")

    r_text, a_text = (None if reasoning is None else decode(reasoning)), decode(answer)
    if cut is not None:
        if r_text is not None and cut(r_text) != r_text:
            return cut(r_text), ""
        a_text = cut(a_text)
    return r_text, a_text


def stop_ids(thinking: "Thinking | None", enabled: bool | None) -> set[int]:
    """The tokens that end a response besides EOS: ``</think>`` when thinking is off."""
    return {thinking.end} if thinking is not None and enabled is False else set()


# --------------------------------------------------------------------------- figures and results
@dataclass
class GenerationStats:
    """Figures of one generation. Forwards and times exclude the prompt prefill unless named
    ``prefill_*``: ``tokens_per_forward`` is new tokens over the forwards after the prefill
    (``forward_split`` the parts they add up from); ``tokens_per_second`` is new tokens over ``decode_seconds`` (wall time after
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
    cached_positions: int = 0  # prompt positions that came from the prefix cache (not run), rows summed
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
    stop_reason: str = "length"  # "length" | "eos" | "stop_string" | "hook" | "cancelled" ("mixed": rows differ)
    seed: int | None = None
    block_size: int | None = None
    coreset_size: int | None = None
    cache_complete: bool = True  # the cache holds prompt + every returned token
    # speculative mode, per block: tokens drafted (positions after the causal one), drafted
    # tokens the causal check accepted, and those it rejected
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)
    mean_accepted: float | None = None  # accepted drafted tokens per block
    # which path the forwards after the prefill took ("cuda graph", "compiled", "static" steps, or
    # "eager: why"), with counts when it changed during the run (engine/runner.py)
    path: str | None = None
    # a request's figures over its rows (``of_rows``): how many, and each one's stop reason
    rows: int = 1
    stop_reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of_rows(cls, rows: list["GenerationStats"], clock: "Clock", forwards: dict[str, int], t0: float,
                t_decode: float, path: str | None) -> "GenerationStats":
        """A request's figures: its rows' tokens and blocks summed, the forwards any of them took
        part in counted once each (``forwards``: preview, fused, commit, prefill), timed by the
        request's ``clock``; ``tokens_per_second`` every row's new tokens over the wall time after
        the first prefill until the last row ended."""
        modes = {st.mode for st in rows}
        reasons = [st.stop_reason for st in rows]
        st = cls(mode=modes.pop() if len(modes) == 1 else "mixed", rows=len(rows), stop_reasons=reasons,
                 stop_reason=reasons[0] if len(set(reasons)) == 1 else "mixed",
                 prompt_tokens=sum(r.prompt_tokens for r in rows), new_tokens=sum(r.new_tokens for r in rows),
                 blocks=sum(r.blocks for r in rows), preview_forwards=forwards["preview"] + forwards["fused"],
                 fused_forwards=forwards["fused"], commit_forwards=forwards["commit"],
                 prefill_forwards=forwards["prefill"], cached_positions=sum(r.cached_positions for r in rows),
                 cache_complete=all(r.cache_complete for r in rows),
                 steps_per_block=[n for r in rows for n in r.steps_per_block], path=path)
        for name in ("seed", "block_size", "coreset_size"):
            values = {getattr(r, name) for r in rows}
            setattr(st, name, values.pop() if len(values) == 1 else None)
        clock.fill(st, t0, t_decode)
        return st

    @property
    def forward_split(self) -> dict[str, int]:
        """``forwards`` in parts that add up: "preview" (preview only), "fused" (the previous
        block's commit and a preview in one forward; ``preview_forwards`` counts them too) and
        "commit" (commit only: AR steps, a last block's commit)."""
        return {"preview": self.preview_forwards - self.fused_forwards, "fused": self.fused_forwards,
                "commit": self.commit_forwards}

    def record_draft(self, drafted: int, accepted: int, steps: int) -> None:
        """A speculative block: ``drafted`` tokens drafted in ``steps`` previews, ``accepted`` of them kept."""
        self.blocks += 1
        self.steps_per_block.append(steps)
        self.drafted.append(drafted)
        self.accepted.append(accepted)
        self.rejected.append(drafted - accepted)
        self.mean_accepted = sum(self.accepted) / len(self.accepted)

    def acceptance(self, block: int) -> dict:
        """``drafted``, ``accepted``, ``rejected`` of a speculative block (as ``block.commit`` carries them)."""
        return dict(drafted=self.drafted[block], accepted=self.accepted[block], rejected=self.rejected[block])

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
    without a tokenizer), ``prompt_ids`` the prompt as tokens, ``stats`` the run's figures.

    Thinking mode (:class:`Thinking`): ``reasoning`` what the response wrote inside
    ``<think>...</think>`` (None when it has no reasoning, or the tokenizer no such tokens),
    ``answer`` the rest (the whole text then); both without the tags, None without a tokenizer.

    Per response token (``row.py``'s ``TokenInfo``): ``unmask_steps`` the denoising step of its
    block that unmasked it (0 in AR); with ``logprobs`` asked for, ``logprobs`` its
    log-probability and ``top_logprobs`` the most probable alternatives as (token id,
    log-probability) pairs (None otherwise)."""

    token_ids: list[int]
    text: str | None
    prompt_ids: list[int]
    stats: GenerationStats
    reasoning: str | None = None
    answer: str | None = None
    unmask_steps: list[int | None] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None  # Request(prompt_logprobs=k): each prompt token's (first None)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    @property
    def stop_reason(self) -> str:
        return self.stats.stop_reason

    def to_dict(self) -> dict:
        return {"text": self.text, "reasoning": self.reasoning, "answer": self.answer, "token_ids": self.token_ids,
                "prompt_ids": self.prompt_ids, "unmask_steps": self.unmask_steps, "logprobs": self.logprobs,
                "top_logprobs": self.top_logprobs, "prompt_logprobs": self.prompt_logprobs,
                "prompt_top_logprobs": self.prompt_top_logprobs, "stats": self.stats.to_dict()}


@dataclass
class StreamUpdate:
    """One update of :meth:`Engine.stream`.

    ``kind``: "step" (provisional tokens of the current block changed), "commit" (a block became
    final and is in the cache) or "done" (``result`` holds the GenerationResult). A batched stream
    tags each update with its ``row`` (a "done" per row as it finishes) and ends with one
    "batch" update whose ``result`` is the :class:`BatchResult`.
    ``committed`` the final response tokens so far; ``block_tokens`` the current block, None where
    still masked. Its tokens are provisional: an unmasked position keeps its token, but the block
    may still be cut after an EOS or a stop string before it is committed. ``unmasked`` the block
    positions unmasked by this step.
    """

    kind: str
    block: int
    step: int | None
    committed: list[int]
    block_tokens: list[int | None]
    unmasked: list[int] = field(default_factory=list)
    time: float = 0.0
    result: "GenerationResult | None" = None  # the last update of a batched stream: its BatchResult
    tokenizer: object = field(default=None, repr=False)
    row: int | None = None  # the request row of a batched stream (None: a single generation)
    thinking: object = field(default=None, repr=False)  # the response's Thinking, or None
    # with SamplerSettings.logprobs: the committed tokens' log-probabilities and alternatives so far
    logprobs: list[float] | None = None
    top_logprobs: list | None = None
    unmask_steps: list = field(default_factory=list)  # the committed tokens' unmasking steps so far
    prompt_logprobs: list | None = None  # Request(prompt_logprobs=k): the prompt's scores (as the result's)
    prompt_top_logprobs: list | None = None

    @property
    def committed_text(self) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(self.committed, skip_special_tokens=True)

    def committed_texts(self) -> tuple[str | None, str | None]:
        """(reasoning, answer) of the committed tokens so far, as ``GenerationResult`` has them."""
        return texts(self.tokenizer, self.thinking, self.committed)

    def committed_parts(self) -> list[str]:
        """Which part of the response each committed token belongs to: "reasoning" (inside
        ``<think>...</think>``, the tags included) or "answer" (every token without thinking tokens)."""
        return self._parts()[:len(self.committed)]

    def block_parts(self) -> list[str | None]:
        """The same for each position of the current block (None where still masked)."""
        return self._parts()[len(self.committed):]

    def _parts(self) -> list[str | None]:
        ids = self.committed + list(self.block_tokens)
        if self.thinking is None:
            return [None if t is None else ANSWER for t in ids]
        return self.thinking.parts(ids)

    def block_pieces(self) -> list[str | None]:
        """The current block as one string per position (None where masked); ids without a tokenizer."""
        if self.tokenizer is None:
            return [None if t is None else str(t) for t in self.block_tokens]
        return [None if t is None else self.tokenizer.decode([t], skip_special_tokens=False)
                for t in self.block_tokens]


class Clock:
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

    def fill(self, st: GenerationStats, t0: float, t_decode: float) -> None:
        """The stats' forward counts and times, once the run has ended (``new_tokens`` set)."""
        end = time.perf_counter()
        st.forwards = st.preview_forwards + st.commit_forwards
        st.tokens_per_forward = st.new_tokens / st.forwards if st.forwards else 0.0
        st.prefill_seconds = self.total("prefill")
        st.preview_seconds = self.total("preview")
        st.commit_seconds = self.total("commit")
        st.seconds_per_preview = st.preview_seconds / st.preview_forwards if st.preview_forwards else None
        st.seconds_per_commit = st.commit_seconds / st.commit_forwards if st.commit_forwards else None
        st.decode_seconds = end - t_decode
        st.total_seconds = end - t0
        st.tokens_per_second = st.new_tokens / st.decode_seconds if st.decode_seconds > 0 else 0.0
        if st.steps_per_block:
            st.mean_steps_per_block = sum(st.steps_per_block) / len(st.steps_per_block)


class BatchResult(list):
    """The results of a request of several rows, one :class:`GenerationResult` per row in order
    (prompt by prompt; a prompt's ``n`` rows together), with the request's figures in ``stats``."""

    def __init__(self, results: list[GenerationResult], stats: GenerationStats):
        super().__init__(results)
        self.stats = stats

    def to_dict(self) -> dict:
        return {"results": [r.to_dict() for r in self], "stats": self.stats.to_dict()}
