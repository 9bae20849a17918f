"""What a batched generation returns: one GenerationResult per prompt, with the batch's own
figures (``BatchStats``). The rows themselves are ``run.Row``s: a single prompt is a batch of
one, run by the same loops (``diffusion.py``, ``ar.py``) and runner (``runner.py``)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .results import GenerationResult


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
