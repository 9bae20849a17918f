"""One row's place in a grammar: which tokens may come next, after the row's accepted tokens and
after any path of tokens beyond them, without moving (:meth:`Constraint.masks`), and the row's
committed tokens followed (:meth:`Constraint.accept`).

This is the seam a decoder calls: autoregressive decoding masks its logits with ``masks([])[0]``
before it decides; speculative verification masks the drafted positions with ``masks(drafted)``;
block diffusion (``policy.py``) checks a step's candidates with it and keeps the prefix the grammar
accepts.
"""
from __future__ import annotations

import numpy as np
import torch

from clover_lab.errors import GrammarError


class Constraint:
    """Made by :meth:`Grammar.matcher <clover_lab.grammar.grammar.Grammar.matcher>`, one per row."""

    def __init__(self, grammar, matcher):
        self.grammar = grammar
        self.vocab_size, self.eos = grammar.vocabulary.size, grammar.vocabulary.eos
        self._m = matcher  # llguidance.LLMatcher, at the row's accepted tokens
        self.accepted: list[int] = []
        self._terminated: tuple[int, bool] | None = None  # (len(accepted), answer): asked once per state

    def masks(self, path: list[int]) -> torch.Tensor:
        """bool [len(path) + 1, V]: row ``i`` the tokens allowed next after the accepted tokens and
        ``path[:i]``. Past a token of ``path`` the grammar refuses (or an EOS), no token is allowed:
        that prefix is not in the grammar. The state does not change."""
        path = [int(t) for t in path]
        n = self._m.validate_tokens(path)  # the longest prefix the grammar accepts
        out = np.zeros((len(path) + 1, self.vocab_size), dtype=np.bool_)
        walked = 0
        try:
            for i in range(n + 1):
                out[i] = self._mask()
                if i == n or path[i] == self.eos:  # nothing follows an EOS
                    break
                if not self._m.consume_token(path[i]):
                    raise GrammarError(f"{self.grammar.what}: the grammar engine refused token {path[i]} that it "
                                       f"had accepted in validation, past its limits ({self._m.get_error()})",
                                       self.grammar.what)
                walked += 1
        finally:
            if walked:
                self._m.rollback(walked)
        return torch.from_numpy(out)

    def allows(self, path: list[int]) -> int:
        """How many tokens of ``path`` the grammar accepts after the accepted ones (its longest valid
        prefix), without moving."""
        return self._m.validate_tokens([int(t) for t in path])

    def accept(self, tokens: list[int]) -> None:
        """Advance by these committed tokens; a token the grammar refuses is a GrammarError naming
        it, and nothing is accepted."""
        tokens = [int(t) for t in tokens]
        n = self._m.validate_tokens(tokens)
        if n < len(tokens):
            decode = self.grammar.vocabulary.tokenizer.decode
            piece = decode([tokens[n]]) if 0 <= tokens[n] < self.vocab_size else ""
            raise GrammarError(f"{self.grammar.what}: token {tokens[n]} ({piece!r}) at position "
                               f"{len(self.accepted) + n} of the response is not allowed by the grammar after "
                               f"{decode(self.accepted + tokens[:n])[-60:]!r}", self.grammar.what)
        if tokens and not self._m.consume_tokens(tokens):
            raise GrammarError(f"{self.grammar.what}: the grammar engine refused tokens it had accepted in "
                               f"validation, past its limits ({self._m.get_error()})", self.grammar.what)
        self.accepted += tokens

    @property
    def terminated(self) -> bool:
        """The grammar is complete: the only token allowed next is EOS (or it was accepted)."""
        if self._terminated is None or self._terminated[0] != len(self.accepted):
            done = self._m.is_stopped() or (self._m.is_accepting() and self._only_eos(self._mask()))
            self._terminated = (len(self.accepted), done)
        return self._terminated[1]

    def _mask(self) -> np.ndarray:
        """bool [V]: the tokens allowed in the matcher's state now."""
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(np.bool_)

    def _only_eos(self, mask: np.ndarray) -> bool:
        return bool(mask[self.eos]) and int(mask.sum()) == 1

    def __repr__(self) -> str:
        return f"Constraint({self.grammar.what}, {len(self.accepted)} tokens accepted, terminated={self.terminated})"
