"""The decoding seam: what the block loop asks of a decoding rule, per row and block.

The loop (``diffusion.py``) owns the mechanics every rule shares: the forwards, the one
device-to-host transfer per step, the logits' health, the ``denoise.step`` hooks (which may
change any decision), the canvas, EOS and stop strings. A :class:`DecodingPolicy` owns the
decision: given a step's logits at a block's still-masked positions, which of them to unmask
and with which tokens (:meth:`~DecodingPolicy.propose`, on the device, no host sync), and when
the block is done (:meth:`~DecodingPolicy.finishes_block`: this step resolves every position
left). :meth:`~DecodingPolicy.begin_block` gives a rule a place of its own per row and block
(``block.memo``): one that needs the block's logits over several steps keeps them there. A new
rule is a subclass; the loop does not change. The loop holds the rule to its word, from the
step's one transfer: a step unmasks at least one position, a finishing step every one (a
GenerationError naming the policy otherwise).

Looking ahead (multi-block decoding): a rule whose :meth:`~DecodingPolicy.look_ahead` says so
for a step has the loop preview the row's next block in the same forward, as a longer canvas
``[block ; next block]`` over the committed prefix, so the next block sees this block's current
guesses; :meth:`~DecodingPolicy.propose_ahead` then decides which of the next block's positions
to unmask already (none is required). The next block starts with them. Rules that do not look
ahead (the default) see no change.

Today's rule, :class:`ThresholdPolicy`, is the spec's low-confidence remasking (section 4):
candidates from the sampler settings, confidence by probability, margin or negative entropy,
every position at the threshold and always the most confident one, an optional cap per step,
everything left at the step limit (``clover_lab.sampling``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import sampling


@dataclass
class Proposal:
    """A rule's decision for one step of one row, as device tensors over the N still-masked
    positions of its block (in ``block.masked`` order)."""

    tokens: torch.Tensor  # [N] long: the candidate token at each masked position
    confidences: torch.Tensor  # [N] float: how sure the rule is of each (what denoise.step events carry)
    unmask: torch.Tensor  # [N] bool: the positions to unmask now (at least one, or the block never ends)


class DecodingPolicy:
    """A decoding rule behind the block loop; subclass it and set ``engine.policy``.

    ``row`` is the generation's row (``engine/run.py``: its sampler settings ``row.s``, generator
    ``row.generator``, penalty counts ``row.counts``, response ``row.committed``), ``block`` the
    block being resolved (``diffusion.Block``: ``index``, ``step``, ``masked``, ``limit``,
    ``canvas`` on the device, ``host`` on the host, ``memo``)."""

    def begin_block(self, row, block) -> object:
        """A block starts for this row; what is returned is kept as ``block.memo``."""
        return None

    def finishes_block(self, row, block) -> bool:
        """Whether this step is the block's last: its proposal must then unmask every masked
        position (default: at the step limit, ``max_steps_per_block`` or the block's length)."""
        return block.step + 1 >= block.limit

    def look_ahead(self, row, block) -> bool:
        """Whether this step of ``block`` also previews the row's next block (the loop does so
        only when the row has one: this block does not end it). Default: never."""
        return False

    def propose_ahead(self, row, block, ahead, logits: torch.Tensor) -> Proposal:
        """A look-ahead step's decision for ``ahead``, the next block, from ``logits`` [N, V] at
        its N still-masked positions (previewed beside ``block``, whose step came first); its
        ``unmask`` may be all False. Asked only of a rule whose :meth:`look_ahead` said so."""
        raise NotImplementedError(f"{type(self).__name__} looks ahead but has no propose_ahead")

    def propose(self, row, block, logits: torch.Tensor, finish: bool) -> Proposal:
        """This step's decision from ``logits`` [N, V] (float32, the mask token already -inf) at
        the block's N still-masked positions; ``finish``: :meth:`finishes_block`'s answer. Must
        not read the device from the host."""
        raise NotImplementedError


class ThresholdPolicy(DecodingPolicy):
    """Low-confidence remasking with the row's sampler settings (threshold, confidence rule,
    cap per step, temperature / top-p / top-k, penalties)."""

    def propose(self, row, block, logits: torch.Tensor, finish: bool) -> Proposal:
        tokens, conf, flags = sampling.decide(logits, row.counts, row.s, row.generator, force_all=finish)
        return Proposal(tokens, conf, flags)
