"""What a generation returns: its figures (``GenerationStats``, timed by ``Clock``), the
result, and the updates ``Engine.stream`` yields; a batch returns one GenerationResult per
prompt with the batch's own figures (``BatchResult``, ``BatchStats``). A single prompt is a batch
of one, run by the same loops (``diffusion.py``, ``ar.py``) and runner (``runner.py``)."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from clover_lab.engine.thinking import ANSWER, texts


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
    # speculative mode, per block: tokens drafted (positions after the causal one), drafted
    # tokens the causal check accepted, and those it rejected
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)
    mean_accepted: float | None = None  # accepted drafted tokens per block
    # which path the forwards after the prefill took ("cuda graph", "compiled", "static" steps, or
    # "eager: why"), with counts when it changed during the run (engine/runner.py)
    path: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

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

    Thinking mode (``engine/thinking.py``): ``reasoning`` what the response wrote inside
    ``<think>...</think>`` (None when it has no reasoning, or the tokenizer no such tokens),
    ``answer`` the rest (the whole text then); both without the tags, None without a tokenizer.

    Per response token (``engine/token_info.py``): ``unmask_steps`` the denoising step of its
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

    @property
    def stop_reason(self) -> str:
        return self.stats.stop_reason

    def to_dict(self) -> dict:
        return {"text": self.text, "reasoning": self.reasoning, "answer": self.answer, "token_ids": self.token_ids,
                "prompt_ids": self.prompt_ids, "unmask_steps": self.unmask_steps, "logprobs": self.logprobs,
                "top_logprobs": self.top_logprobs, "stats": self.stats.to_dict()}


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
    thinking: object = field(default=None, repr=False)  # engine/thinking.py's Thinking, or None

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


@dataclass
class BatchStats:
    """Figures of a batched generation. ``forwards`` counts the shared forwards after the prefill
    (each row's own stats count those it took part in); ``preview_seconds`` and
    ``commit_seconds`` time them (as ``GenerationStats`` does a row's); ``tokens_per_second`` is
    every row's new tokens over the wall time after the prefill, until the last row finished."""

    mode: str
    rows: int
    prompt_tokens: int = 0
    new_tokens: int = 0
    forwards: int = 0
    prefill_forwards: int = 0
    tokens_per_forward: float = 0.0
    prefill_seconds: float = 0.0
    preview_seconds: float = 0.0
    commit_seconds: float = 0.0
    decode_seconds: float = 0.0
    total_seconds: float = 0.0
    tokens_per_second: float = 0.0
    stop_reasons: list[str] = field(default_factory=list)
    path: str | None = None  # which path the shared forwards took (GenerationStats.path)

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
