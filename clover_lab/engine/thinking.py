"""Thinking mode (spec 4.5): a response's reasoning, written inside ``<think>...</think>``, apart
from its answer, for tokenizers that have those two as single tokens (Qwen3.5/3.6's).

Qwen3.5/3.6's chat templates open ``<think>`` at the end of the prompt when thinking is on, and
write an empty ``<think>\\n\\n</think>\\n\\n`` there when it is off; a model that writes the
``<think>`` itself is read the same way. With thinking off, a ``</think>`` in the response ends
it, like an EOS: the model would be closing a reasoning it was not asked for.
"""
from __future__ import annotations

from dataclasses import dataclass

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
