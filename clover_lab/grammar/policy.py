"""Grammar-constrained block diffusion: :class:`GrammarPolicy`, a decoding rule that keeps every
row's response inside a grammar although a block's positions unmask out of order.

A position's allowed tokens depend on every token left of it, so the rule unmasks only from the
left: each step it takes the inner rule's candidates for the block's still-masked positions (the
first one's logits masked to what the grammar allows there), finds the longest prefix of them the
grammar accepts (``Constraint.allows``), and unmasks the part of that prefix the inner rule is sure
of (its own unmask decisions, counted from the left; always at least the first position). The
candidates right of the prefix stay masked, to be decided again next step with their left
neighbours known. Tokens are accepted into the row's :class:`~clover_lab.grammar.constraint.Constraint`
as the positions left of them resolve (read from the block's host copy, so a ``denoise.step`` hook's
override is followed, or refused by name). A step that must finish the block fills the positions
left one by one, each from its logits masked by the grammar after its left neighbours; a complete
grammar proposes EOS. So the response parses whatever the model; it is cut only by its length
(``max_new_tokens``) or a stop string.

The price is parallelism: positions right of the first one the model gets wrong for the grammar
wait a step (bench/bench_grammar.py measures tokens per forward against the unconstrained rule).
Each step also reads its candidates on the host (one transfer) to walk the grammar.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from clover_lab.engine import sampling
from clover_lab.engine.policies import DecodingPolicy, Proposal, ThresholdPolicy
from clover_lab.engine.requests import GenerationError
from clover_lab.grammar.constraint import Constraint
from clover_lab.grammar.grammar import Grammar


@dataclass
class _RowState:
    constraint: Constraint
    block: object = None  # the row's block being resolved (diffusion.Block)
    eos: frozenset = frozenset()  # the row's EOS tokens (its thinking's end too, with thinking off)
    done: int = 0  # its positions accepted into the constraint
    ended: bool = False  # an EOS was placed: nothing more is accepted


class GrammarPolicy(DecodingPolicy):
    """Block diffusion inside ``grammar``; ``inner`` (default: the threshold rule with the row's
    settings) decides how sure a position must be, and the candidates. Rows of a batch share the
    instance; each has its own Constraint, made at its first block. Tokens the grammar forces are
    unmasked beyond the inner rule's cap per step (``max_tokens_per_step``): they are not the
    model's guesses. The inner rule's look-ahead is not used (the next block's left is unknown)."""

    def __init__(self, grammar: Grammar, inner: DecodingPolicy | None = None):
        if not isinstance(grammar, Grammar):
            raise TypeError(f"GrammarPolicy grammar={grammar!r}: expected a Grammar (clover_lab.grammar)")
        if inner is not None and not isinstance(inner, DecodingPolicy):
            raise TypeError(f"GrammarPolicy inner={inner!r}: expected a DecodingPolicy or None")
        self.grammar, self.inner = grammar, inner or ThresholdPolicy()
        self._rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # row -> _RowState

    def constraint(self, row) -> Constraint:
        """The row's Constraint (made at its first block)."""
        return self._rows[row].constraint

    # ---------------------------------------------------------------- the seam
    def begin_block(self, row, block) -> object:
        state = self._rows.get(row)
        if state is None:
            state = self._rows[row] = _RowState(self.grammar.matcher(), eos=frozenset(row.eos))
        else:
            self._catch_up(state)  # the previous block's last positions
        state.block, state.done = block, 0
        return self.inner.begin_block(row, block)

    def finishes_block(self, row, block) -> bool:
        return self.inner.finishes_block(row, block)

    def propose(self, row, block, logits: torch.Tensor, finish: bool) -> Proposal:
        state = self._rows[row]
        self._catch_up(state)
        c, n, device = state.constraint, len(block.masked), logits.device
        if c.terminated or state.ended:  # the grammar is complete: the response ends here
            return Proposal(torch.full((n,), c.eos, dtype=torch.long, device=device),
                            torch.ones(n, device=device), torch.ones(n, dtype=torch.bool, device=device))
        allowed = c.masks([])[0].to(device)
        if not bool(allowed.any()):
            raise GenerationError(f"{self.grammar.what}: the grammar allows no token after "
                                  f"{len(c.accepted)} response tokens and is not complete")
        shaped = logits.clone()
        shaped[0].masked_fill_(~allowed, float("-inf"))  # the first masked position: its left is known
        p = self.inner.propose(row, block, shaped, False)
        cand, flags = p.tokens.tolist(), p.unmask.tolist()  # the step's host transfer, to walk the grammar
        if not allowed[cand[0]]:  # an inner rule that did not take its candidate from the logits
            cand[0] = int(shaped[0].argmax())
        lead = 0  # the masked positions that continue the resolved prefix
        while lead < n and block.masked[lead] == block.prefix + lead:
            lead += 1
        if finish:
            tokens = self._fill(row, block, logits, c, cand)
            unmask = [True] * n
        else:
            tokens, take = self._prefix(c, cand, flags, lead, state.eos)
            unmask = [i < take for i in range(n)]
        return Proposal(torch.tensor(tokens, dtype=torch.long, device=device), p.confidences,
                        torch.tensor(unmask, dtype=torch.bool, device=device))

    # ---------------------------------------------------------------- the row's grammar state
    def _catch_up(self, state: _RowState) -> None:
        """Accept the row's block's resolved positions left of the first masked one."""
        block = state.block
        if block is None or state.ended:
            return
        upto = min(block.prefix, block.end)
        tokens = block.host[state.done:upto]
        if not tokens:
            return
        ends = [i for i, t in enumerate(tokens) if t in state.eos]
        if ends:  # the response ended: what follows is dropped
            tokens, state.ended = tokens[:ends[0]], True
        state.constraint.accept(tokens)
        state.done = upto

    @staticmethod
    def _prefix(c: Constraint, cand: list[int], flags: list[bool], lead: int, eos) -> tuple[list[int], int]:
        """(tokens, how many to unmask from the left): the candidates while the grammar accepts them
        and the inner rule is sure of them (the first always), and every token the grammar forces
        (the only one it allows there), sure or not: it costs the model nothing."""
        tokens, take = list(cand), 0
        allowed = c.masks(tokens[:lead])  # [lead + 1, V], row i valid while tokens[:i] is in the grammar
        for i in range(lead):
            if int(allowed[i].sum()) == 1:
                forced = int(allowed[i].nonzero()[0, 0])
                if forced != tokens[i]:
                    tokens[i] = forced
                    allowed = c.masks(tokens[:lead])
            elif not (i == 0 or flags[i]) or not allowed[i, tokens[i]]:
                break
            take = i + 1
            if tokens[i] in eos:
                break
        return tokens, max(take, 1)

    def _fill(self, row, block, logits: torch.Tensor, c: Constraint, cand: list[int]) -> list[int]:
        """A finishing step: every masked position, from the left, a token the grammar allows after
        its left neighbours (the candidate where it is allowed, else the row's choice among the
        allowed), resolved positions kept; EOS once the grammar is complete."""
        masked = {p: i for i, p in enumerate(block.masked)}
        end = min(len(block), block.end)
        path, out = [], list(cand)
        for p in range(block.prefix, end):
            if p not in masked:
                path.append(block.host[p])  # resolved out of order (a hook): the grammar must take it
                continue
            i = masked[p]
            allowed = c.masks(path)[len(path)]
            if not bool(allowed.any()):  # past an EOS (or a refused token): nothing matters any more
                out[i] = c.eos
            elif not allowed[cand[i]]:
                one = logits[i:i + 1].clone()
                one[0].masked_fill_(~allowed.to(logits.device), float("-inf"))
                if row.counts is not None:
                    one = sampling.apply_penalties(one, row.counts, row.s)
                out[i] = int(sampling.candidates(one, row.s, row.generator)[0][0])
            path.append(out[i])
        return out

    def __repr__(self) -> str:
        return f"GrammarPolicy({self.grammar!r}, inner={self.inner!r})"
