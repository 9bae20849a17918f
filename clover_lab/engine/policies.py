"""Decoding policies: the seam (:class:`DecodingPolicy`), the spec's threshold rule
(:class:`ThresholdPolicy`: probability, margin or entropy confidence) and rules from the field:

- :class:`EntropyBoundedPolicy`, the EB-sampler (Ben-Hamu et al. 2025): the masked positions in
  order of rising entropy, unmasking the longest run whose summed entropy, less its largest,
  stays within ``gamma`` (the error bound); always at least the surest one.
- :class:`TopKPolicy`: the ``k`` most confident positions per step, ``k`` from a schedule (one
  value per step, the last repeated), as LLaDA's and Fast-dLLM's fixed-count decoding does.
- :class:`LookAheadPolicy`, multi-block decoding (D2F, SGLang's multi-block): the threshold rule
  on the current block; once ``start`` of it is resolved, each step also previews the next block
  in the same forward (the seam's look-ahead: one canvas of both blocks, so the next block sees
  this one's current guesses) and unmasks there the positions at ``threshold``; the next block
  starts with them, so it needs fewer steps, and the run fewer forwards.

The decoder (``diffusion.py``) owns the mechanics every rule shares: the forwards, the one
device-to-host transfer per step, the logits' health, the ``denoise.step`` hooks (which may
change any decision), the canvas, EOS and stop strings. A :class:`DecodingPolicy` owns the
decision: given a step's logits at a block's still-masked positions, which of them to unmask
and with which tokens (:meth:`~DecodingPolicy.propose`, on the device, no host sync), and when
the block is done (:meth:`~DecodingPolicy.finishes_block`: this step resolves every position
left). :meth:`~DecodingPolicy.begin_block` gives a rule a place of its own per row and block
(``block.memo``): one that needs the block's logits over several steps keeps them there. A new
rule is a subclass; the decoder does not change. The decoder holds the rule to its word, from the
step's one transfer: a step unmasks at least one position, a finishing step every one (a
GenerationError naming the policy otherwise).

Looking ahead (multi-block decoding): a rule whose :meth:`~DecodingPolicy.look_ahead` says so
for a step has the decoder preview the row's next block in the same forward, as a longer canvas
``[block ; next block]`` over the committed prefix, so the next block sees this block's current
guesses; :meth:`~DecodingPolicy.propose_ahead` then decides which of the next block's positions
to unmask already (none is required). The next block starts with them. Rules that do not look
ahead (the default) see no change.

Candidates come from the row's sampler settings (penalties, temperature, top-k / top-p) as in
the threshold rule; the step limit unmasks everything left. Each rule checks its settings when
made (a SettingsError naming the setting). :func:`make_policy` makes one by name
(``clover-lab generate --policy eb:gamma=0.5``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from clover_lab.engine import sampling
from clover_lab.engine.requests import GenerationError
from clover_lab.engine.sampling import SettingsError


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
        """Whether this step of ``block`` also previews the row's next block (the decoder does so
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


def _candidates(row, logits: torch.Tensor):
    """(tokens [N], probs [N, V]) from the row's sampler settings, after its penalties."""
    if row.counts is not None:
        logits = sampling.apply_penalties(logits, row.counts, row.s)
    return sampling.candidates(logits, row.s, row.generator)


class EntropyBoundedPolicy(DecodingPolicy):
    """EB-sampler: unmask the surest positions while their summed entropy minus the largest
    stays within ``gamma`` (nats; >= 0). ``gamma=0`` unmasks one position per step (ties aside)."""

    def __init__(self, gamma: float = 0.1):
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 <= gamma < float("inf"):
            raise SettingsError(f"EntropyBoundedPolicy gamma={gamma!r}: must be a finite number >= 0")
        self.gamma = float(gamma)

    def propose(self, row, block, logits: torch.Tensor, finish: bool) -> Proposal:
        tokens, probs = _candidates(row, logits)
        entropy = torch.special.entr(probs).sum(-1)  # [N]
        order = entropy.argsort(stable=True)
        sorted_h = entropy[order]
        bound = sorted_h.cumsum(0) - sorted_h  # summed entropy of the run up to i, less its largest (sorted_h[i])
        take = bound <= self.gamma
        take[0] = True
        flags = torch.zeros_like(take).scatter(0, order, take) | finish
        return Proposal(tokens, torch.exp(-entropy), flags)

    def __repr__(self) -> str:
        return f"EntropyBoundedPolicy(gamma={self.gamma})"


class TopKPolicy(DecodingPolicy):
    """Unmask the ``k`` most confident positions per step (by the candidate's probability);
    ``k``: one count (every step) or a schedule, a list of counts per step, the last repeated."""

    def __init__(self, k: int | list[int] = 2):
        schedule = list(k) if isinstance(k, (list, tuple)) else [k]
        if not schedule or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in schedule):
            raise SettingsError(f"TopKPolicy k={k!r}: must be a positive integer or a non-empty list of them")
        self.schedule = schedule

    def k_at(self, step: int) -> int:
        return self.schedule[min(step, len(self.schedule) - 1)]

    def propose(self, row, block, logits: torch.Tensor, finish: bool) -> Proposal:
        tokens, probs = _candidates(row, logits)
        conf = sampling.confidences(probs, tokens)
        flags = rank_below(conf, self.k_at(block.step)) | finish
        return Proposal(tokens, conf, flags)

    def __repr__(self) -> str:
        return f"TopKPolicy(k={self.schedule if len(self.schedule) > 1 else self.schedule[0]})"


class LookAheadPolicy(ThresholdPolicy):
    """The threshold rule (the row's sampler settings) on the current block; once a fraction
    ``start`` (in [0, 1]) of it is resolved, the next block is previewed beside it, and its
    positions whose confidence is at least ``threshold`` (in (0, 1]) are unmasked ahead."""

    def __init__(self, start: float = 0.5, threshold: float = 0.9):
        for name, v, low_open in (("start", start, False), ("threshold", threshold, True)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v <= 1 if low_open else 0 <= v <= 1):
                raise SettingsError(f"LookAheadPolicy {name}={v!r}: must be a number in {'(0' if low_open else '[0'}, 1]")
        self.start, self.threshold = float(start), float(threshold)

    def look_ahead(self, row, block) -> bool:
        return 1 - len(block.masked) / len(block) >= self.start

    def propose_ahead(self, row, block, ahead, logits: torch.Tensor) -> Proposal:
        tokens, probs = _candidates(row, logits)
        conf = sampling.confidences(probs, tokens, row.s.confidence)
        return Proposal(tokens, conf, conf >= self.threshold)

    def __repr__(self) -> str:
        return f"LookAheadPolicy(start={self.start}, threshold={self.threshold})"


# --------------------------------------------------------------------------- a rule's word, checked
# where a proposal enters the block loop (diffusion.denoise_step): shapes and dtypes before the
# step's one host transfer (no sync: metadata only), the values from what that transfer brings
PROPOSAL_FIELDS = (("tokens", "integer token ids", lambda t: not t.is_floating_point() and not t.is_complex()
                    and t.dtype != torch.bool),
                   ("confidences", "floats", torch.is_floating_point),
                   ("unmask", "booleans", lambda t: t.dtype == torch.bool))


def checked_proposal(policy, proposal, n: int, device, where: str, ahead: bool = False):
    """(tokens, confidences, unmask) of a rule's ``proposal`` for the ``n`` still-masked positions,
    each a tensor of shape [n] and of its kind on the logits' ``device``; else a GenerationError
    naming the rule's method, the field and what was expected (a wrong length or a float token id
    was a raw IndexError or RuntimeError from deep inside)."""
    method = f"{type(policy).__name__}.{'propose_ahead' if ahead else 'propose'}"
    if not isinstance(proposal, Proposal):
        raise GenerationError(f"{method}: {where}: returned {type(proposal).__name__}, expected a "
                              f"Proposal(tokens, confidences, unmask) (clover_lab.engine.policies)")
    out = []
    for name, what, ok in PROPOSAL_FIELDS:
        t = getattr(proposal, name)
        if not isinstance(t, torch.Tensor):
            raise GenerationError(f"{method}: {where}: Proposal.{name} is {type(t).__name__}, expected a tensor of "
                                  f"{n} {what}")
        if tuple(t.shape) != (n,) or not ok(t):
            raise GenerationError(f"{method}: {where}: Proposal.{name} is {t.dtype} of shape {list(t.shape)}, "
                                  f"expected {what} of shape [{n}] (one per still-masked position)")
        if t.device != device:
            raise GenerationError(f"{method}: {where}: Proposal.{name} is on {t.device}, expected the logits' "
                                  f"device {device}")
        out.append(t.long() if name == "tokens" else t)
    return tuple(out)


def policy_flag(policy, method: str, value, where: str) -> bool:
    """A rule's yes-or-no answer (``finishes_block``, ``look_ahead``): a bool (numpy's too), never a
    tensor whose truth is ambiguous or a value taken for one."""
    if type(value).__name__ not in ("bool", "bool_"):
        raise GenerationError(f"{type(policy).__name__}.{method}: {where}: returned {type(value).__name__} "
                              f"{value!r:.60}, expected True or False")
    return bool(value)


def check_proposal_values(policy, tokens: list[int], vocab: int, mask_id: int, where: str, ahead: bool = False):
    """The proposal's candidate tokens (from the step's host transfer) are real tokens: in
    [0, vocab) and not the mask token (a mask returned as an answer, a negative or past-the-end id
    an IndexError on the device)."""
    method = f"{type(policy).__name__}.{'propose_ahead' if ahead else 'propose'}"
    bad = sorted({t for t in tokens if not 0 <= t < vocab})
    if bad:
        raise GenerationError(f"{method}: {where}: Proposal.tokens holds {bad[:5]}, outside the vocabulary "
                              f"[0, {vocab})")
    if mask_id in tokens:
        raise GenerationError(f"{method}: {where}: Proposal.tokens proposes the mask token {mask_id} at position(s) "
                              f"{[i for i, t in enumerate(tokens) if t == mask_id][:5]} of the masked ones: a "
                              f"candidate must be a real token")


def blame_confidences(policy, logits: torch.Tensor, mask_id: int, where: str, ahead: bool = False) -> None:
    """Non-finite confidences from finite logits are the rule's, not the model's: a
    GenerationError naming the rule (on the error path: reading the logits costs nothing that
    matters). ``logits``: the step's [N, V], the mask column set to -inf."""
    keep = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
    keep[mask_id] = False
    if bool(torch.isfinite(logits[:, keep]).all()):
        method = f"{type(policy).__name__}.{'propose_ahead' if ahead else 'propose'}"
        raise GenerationError(f"{method}: {where}: Proposal.confidences holds NaN or inf while the step's logits are "
                              f"finite: the rule's confidences must be finite numbers")


def rank_below(conf: torch.Tensor, k: int) -> torch.Tensor:
    """bool [N]: the ``k`` largest of ``conf`` (ties by position)."""
    order = conf.argsort(descending=True, stable=True)
    return torch.zeros_like(conf, dtype=torch.bool).scatter(0, order[:k], True)


POLICIES = {"threshold": ThresholdPolicy, "eb": EntropyBoundedPolicy, "topk": TopKPolicy,
            "lookahead": LookAheadPolicy}


def make_policy(spec) -> DecodingPolicy:
    """A policy from a DecodingPolicy (itself), a name (``"eb"``) or ``"name:setting=value,..."``
    (``"topk:k=4"``, ``"topk:k=1/2/4"`` for a schedule, ``"eb:gamma=0.5"``,
    ``"lookahead:start=0.5,threshold=0.9"``)."""
    if isinstance(spec, DecodingPolicy):
        return spec
    if not isinstance(spec, str):
        raise SettingsError(f"policy={spec!r}: expected a DecodingPolicy or one of {', '.join(POLICIES)}")
    name, _, args = spec.partition(":")
    if name not in POLICIES:
        raise SettingsError(f"policy {name!r}: unknown; use one of {', '.join(POLICIES)}")
    kwargs = {}
    for item in filter(None, args.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SettingsError(f"policy {spec!r}: settings are name=value, got {item!r}")
        if key.strip() in kwargs:  # which one was meant cannot be guessed: the last would win silently
            raise SettingsError(f"policy {spec!r}: {key.strip()} is given twice; give each setting once")
        kwargs[key.strip()] = _value(value.strip())
    try:
        return POLICIES[name](**kwargs)
    except TypeError as e:
        raise SettingsError(f"policy {spec!r}: {e}") from None


def _value(text: str):
    if "/" in text:
        return [_value(v) for v in text.split("/")]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
