"""A prompt that ends on a newline, as the model meets it: the newline alone.

The specimen's tokenizer writes a newline and the next line's indent as one token (``"\\n   "``,
then ``" if"``), so the encoded corpus never holds a bare newline before an indented line: a bare
``"\\n"`` ends a line before column 0, or ends a function (``function_rows`` puts EOS after it). A
prompt typed as ``'def f(x):\\n'`` ends on exactly that token, and a model trained only on the
whole text's tokens reads it as the function's end: specimen v3's third round ended 34 of 40
held-out function heads at once when each was given with a newline after it, none without.

``split_newlines`` writes a share of a batch's newline+indent tokens as the newline and the indent
apart: the same text, tokenized as it is when a prompt ends between the two, so that the model
learns to go on after a bare newline.
"""
from __future__ import annotations

import torch


def one_token(tokenizer, text: str) -> int | None:
    """The id of the one token ``text`` encodes to (and decodes back from), or None."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return ids[0] if len(ids) == 1 and tokenizer.decode(ids) == text else None


def newline_splits(tokenizer) -> tuple[int, torch.Tensor] | None:
    """(the bare newline's id, a [vocab] table of each newline+indent token's indent as one token,
    -1 for every other token), or None when the vocabulary has no bare newline or no such pair."""
    newline = one_token(tokenizer, "\n")
    if newline is None:
        return None
    size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
    table = torch.full((size,), -1, dtype=torch.long)
    for i in range(size):
        text = tokenizer.decode([i])
        if len(text) > 1 and text[0] == "\n" and text[1:].strip(" ") == "":
            indent = one_token(tokenizer, text[1:])
            if indent is not None:
                table[i] = indent
    return (newline, table) if bool((table >= 0).any()) else None


def split_newlines(rows: torch.Tensor, splits: tuple[int, torch.Tensor], share: float,
                   gen: torch.Generator) -> torch.Tensor:
    """``rows`` [B, L] with each newline+indent token written as the newline and the indent apart
    with probability ``share``; every row keeps its length L (what a split pushes past the end is
    cut)."""
    newline, table = splits
    out = []
    for row in rows:
        indent = table[row.clamp(0, len(table) - 1)]
        split = (indent >= 0) & (torch.rand(row.shape, generator=gen) < share)
        if not bool(split.any()):
            out.append(row)
            continue
        pairs = torch.stack([torch.where(split, torch.full_like(row, newline), row), indent], 1)  # [L, 2]
        keep = torch.stack([torch.ones_like(split), split], 1)
        out.append(pairs[keep][:row.shape[0]])
    return torch.stack(out)
