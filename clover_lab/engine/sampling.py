"""Sampling for block diffusion and AR decoding: settings, penalties, candidates, confidences and
the unmask rule (spec section 4).

Everything here works on device tensors and never synchronises with the host: the engine makes
exactly one device-to-host transfer per denoising step (the unmask decision), and none of these
functions adds another.

Shapes: N positions being decided (the still-masked positions of a block, or 1 in AR), V vocabulary.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field

import torch

from clover_lab.errors import CloverError

CONFIDENCE_RULES = ("probability", "margin", "entropy")
# penalties beyond these would push float32 logits to inf and the distribution to NaN: far past
# any useful strength (a presence penalty of 100 already rules a seen token out)
MAX_ADDITIVE_PENALTY = 1e4
REPETITION_PENALTY_RANGE = (1e-4, 1e4)
# logits / temperature must stay finite in float32 (and -inf / inf would be NaN)
TEMPERATURE_RANGE = (1e-3, 1e3)
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range


class SettingsError(CloverError, ValueError, TypeError):
    """A sampler setting that is unknown, of the wrong type or out of range; the message names it,
    and ``field`` too where it is one setting."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass
class SamplerSettings:
    """How candidates are drawn and which positions are unmasked per denoising step.

    - ``threshold``: unmask every masked position whose confidence reaches it (and always at least
      the most confident one), in (0, 1].
    - ``temperature``: 0 takes the argmax; in [1e-3, 1e3] samples from softmax(logits / temperature),
      after ``top_k`` (0 = off), ``top_p`` (1 = off) and ``min_p`` (0 = off: tokens less probable than
      ``min_p`` times the most probable one dropped) filtering.
    - ``confidence``: "probability" (the candidate's probability), "margin" (its probability minus
      the best other token's) or "entropy" (``exp(-H)`` of the position's distribution: negative
      entropy mapped monotonically into (0, 1] so one threshold scale fits every rule).
      Confidences are measured on the model's distribution after penalties, before temperature and
      top-k/top-p, so the threshold means the same at every temperature.
    - ``max_tokens_per_step``: optional cap on positions unmasked per step (None = no cap).
    - ``max_steps_per_block``: step limit per block; the step that reaches it unmasks every
      remaining position (None = no limit beyond the block size).
    - penalties over response tokens only: ``repetition_penalty`` (in [1e-4, 1e4], 1 = off; divides
      positive logits and multiplies negative ones of seen tokens), ``presence_penalty`` (subtracted
      once from seen tokens) and ``frequency_penalty`` (subtracted per occurrence), both within
      +-1e4: beyond that float32 logits overflow.
    - ``penalty_window``: the penalties count only the last N response tokens (None: all of them);
      AR decoding only (block diffusion resolves positions out of order).
    - ``logit_bias``: {token id: bias in [-100, 100]} added to the logits before anything is chosen
      (OpenAI's: -100 bans the token, 100 all but forces it).
    - ``min_tokens``: the response's end tokens (EOS, ``</think>`` with thinking off) are not
      chosen before this many tokens (0 = off); ``ignore_eos``: EOS does not end the response (it
      runs to its length or a stop string: what benchmark clients ask for).
    - ``coreset_size``: per-block expert coreset M (spec 3.3); None or 0 = off. A request checks it
      against the model: at least ``num_experts_per_tok`` and at most ``num_experts``.
    - ``seed``: seeds the run's torch.Generator, in [0, 2**64); None draws a fresh seed (reported in
      the stats).
    - ``draft_passes``: speculative mode: denoising passes that draft each block (>= 1; the last
      unmasks every position left). Sampled speculative decoding takes one pass.
    - ``mtp_draft_tokens``: mtp mode: tokens the model's MTP head drafts before each verify (>= 1).
    - ``logprobs``: None (off: nothing computed) or k >= 0: the result carries each response
      token's log-probability and its k most probable alternatives' (``engine/row.py``'s TokenInfo).

    Invalid values raise :class:`SettingsError` naming the setting.
    """

    # ``help``: one line for the command line (cli.py builds its sampler options from these fields)
    threshold: float = field(default=0.9, metadata={"help": "confidence threshold per position, in (0, 1]"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy, else in [1e-3, 1e3]"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus filtering when sampling (1 = off)"})
    top_k: int = field(default=0, metadata={"help": "top-k filtering when sampling (0 = off)"})
    min_p: float = field(default=0.0, metadata={"help": "drop tokens below min_p x the top probability when "
                                                        "sampling, in [0, 1] (0 = off)"})
    confidence: str = field(default="probability", metadata={"help": " | ".join(CONFIDENCE_RULES)})
    max_tokens_per_step: int | None = field(default=None, metadata={"help": "cap on positions unmasked per step"})
    max_steps_per_block: int | None = field(default=None, metadata={"help": "step limit per block"})
    repetition_penalty: float = field(default=1.0, metadata={"help": "in [1e-4, 1e4], 1 = off"})
    presence_penalty: float = field(default=0.0, metadata={"help": "subtracted once from seen tokens"})
    frequency_penalty: float = field(default=0.0, metadata={"help": "subtracted per occurrence"})
    penalty_window: int | None = field(default=None, metadata={"help": "penalties count the last N response "
                                                                       "tokens only (AR; none: all)"})
    logit_bias: dict | None = field(default=None, metadata={"help": "token id -> bias in [-100, 100]; -100 bans it",
                                                            "cli": False})
    min_tokens: int = field(default=0, metadata={"help": "no end token before this many tokens (0 = off)"})
    ignore_eos: bool = field(default=False, metadata={"help": "EOS does not end the response"})
    coreset_size: int | None = field(default=None, metadata={"help": "per-block expert coreset size (off by default)"})
    seed: int | None = field(default=None, metadata={"help": "seeds sampling; none: a fresh seed, reported"})
    draft_passes: int = field(default=1, metadata={"help": "speculative mode: denoising passes per drafted block"})
    mtp_draft_tokens: int = field(default=3, metadata={"help": "mtp mode: tokens the MTP head drafts per verify"})
    logprobs: int | None = field(default=None, metadata={"help": "results carry each token's log-probability and "
                                                                 "this many alternatives' (0: the token's only)"})

    def __post_init__(self):
        for f in dataclasses.fields(self):  # numpy scalars and the like as plain Python numbers
            v = getattr(self, f.name)
            if f.name == "logit_bias":
                continue
            if not isinstance(v, (bool, int, float, str, type(None))):
                if isinstance(v, numbers.Integral):
                    setattr(self, f.name, int(v))
                elif isinstance(v, numbers.Real):
                    setattr(self, f.name, float(v))
        self.validate()

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, base: "SamplerSettings | None" = None, **kwargs) -> "SamplerSettings":
        """``base`` with ``kwargs`` replaced; unknown names are a TypeError naming them."""
        unknown = sorted(set(kwargs) - set(cls.names()))
        if unknown:
            raise SettingsError(f"unknown sampler setting(s) {', '.join(map(repr, unknown))}; "
                            f"known: {', '.join(cls.names())}")
        if base is None:
            return cls(**kwargs)
        if not isinstance(base, SamplerSettings):
            raise SettingsError(f"settings: expected a SamplerSettings, got {type(base).__name__} {base!r}; "
                                f"pass sampler settings as keyword arguments or SamplerSettings(...)")
        return dataclasses.replace(base, **kwargs)

    def validate(self) -> None:
        def bad(name: str, what: str):
            raise SettingsError(f"sampler setting {name}={getattr(self, name)!r}: {what}", name)

        def number(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(_float(v)):
                bad(name, "must be a finite number")
            return float(v)

        def integer(name: str, lo: int, allow_none: bool) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                bad(name, f"must be an integer >= {lo}" + (" or None" if allow_none else ""))

        if not 0.0 < number("threshold") <= 1.0:
            bad("threshold", "must be in (0, 1]")
        t = number("temperature")
        if t != 0 and not TEMPERATURE_RANGE[0] <= t <= TEMPERATURE_RANGE[1]:
            bad("temperature", f"must be 0 (greedy) or in [{TEMPERATURE_RANGE[0]:g}, {TEMPERATURE_RANGE[1]:g}]")
        if not 0.0 < number("top_p") <= 1.0:
            bad("top_p", "must be in (0, 1] (1 = off)")
        integer("top_k", 0, allow_none=False)
        if not 0.0 <= number("min_p") <= 1.0:
            bad("min_p", "must be in [0, 1] (0 = off)")
        if self.confidence not in CONFIDENCE_RULES:
            bad("confidence", f"unknown confidence rule; use one of {', '.join(CONFIDENCE_RULES)}")
        integer("max_tokens_per_step", 1, allow_none=True)
        integer("max_steps_per_block", 1, allow_none=True)
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= number("repetition_penalty") <= hi:
            bad("repetition_penalty", f"must be in [{lo:g}, {hi:g}] (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if abs(number(name)) > MAX_ADDITIVE_PENALTY:
                bad(name, f"must be within +-{MAX_ADDITIVE_PENALTY:g} (0 = off); beyond that float32 logits overflow")
        integer("penalty_window", 1, allow_none=True)
        integer("min_tokens", 0, allow_none=False)
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be True or False")
        if self.logit_bias is not None:
            bias = self.logit_bias
            if not isinstance(bias, dict):
                bad("logit_bias", "must be a dict of token id -> bias")
            for k, v in bias.items():
                # JSON's keys are strings; only ASCII digits are a number ("³" is a digit to str.isdigit)
                key = int(k) if isinstance(k, str) and k.strip().isascii() and k.strip().isdigit() else k
                if isinstance(key, bool) or not isinstance(key, numbers.Integral) or key < 0:
                    bad("logit_bias", f"{k!r} is no token id (a non-negative integer)")
                if isinstance(v, bool) or not isinstance(v, numbers.Real) or not -100 <= float(v) <= 100:
                    bad("logit_bias", f"the bias of token {k} must be a number in [-100, 100], got {v!r}")
            self.logit_bias = {int(k): float(v) for k, v in bias.items()} or None
        integer("coreset_size", 0, allow_none=True)
        integer("seed", 0, allow_none=True)
        integer("draft_passes", 1, allow_none=False)
        integer("mtp_draft_tokens", 1, allow_none=False)
        integer("logprobs", 0, allow_none=True)
        if self.seed is not None and self.seed > MAX_SEED:
            bad("seed", "must be below 2**64")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """Whether the logits are changed before anything is chosen (penalties, a bias): rows then
        keep counts of their tokens."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _float(v) -> float:
    try:
        return float(v)
    except OverflowError:  # an int beyond float's range
        return math.inf


# --------------------------------------------------------------------------- penalties
def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, s: SamplerSettings) -> torch.Tensor:
    """logits [N, V] float, counts [V] (or [N, V], one row each): occurrences of each token in
    the response so far (its last ``penalty_window``); and the ``logit_bias`` (-100: banned)."""
    if not s.has_penalties:
        return logits
    if s.logit_bias:
        ids = torch.tensor([t for t in s.logit_bias if t < logits.shape[-1]], device=logits.device, dtype=torch.long)
        bias = torch.tensor([b if b > -100 else float("-inf") for t, b in s.logit_bias.items() if t < logits.shape[-1]],
                            device=logits.device, dtype=logits.dtype)
        logits = logits.index_add(-1, ids, bias.expand(*logits.shape[:-1], len(ids)))
    seen = counts > 0  # [V]
    if s.repetition_penalty != 1.0:
        rp = s.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    if s.presence_penalty:
        logits = logits - s.presence_penalty * seen.to(logits.dtype)
    if s.frequency_penalty:
        logits = logits - s.frequency_penalty * counts.to(logits.dtype)
    return logits


# --------------------------------------------------------------------------- candidates
def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """Set logits outside the top-k / the top-p nucleus / below ``min_p`` times the best token's
    probability to -inf (the best token always stays)."""
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p  # mass before this token already >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0.0:  # p < min_p * p_max  <=>  logit < max logit + ln(min_p)
        logits = logits.masked_fill(logits < logits.max(-1, keepdim=True).values + math.log(min_p), float("-inf"))
    return logits


def sampling_probs(logits: torch.Tensor, counts: torch.Tensor | None, s: SamplerSettings) -> torch.Tensor:
    """The distribution [N, V] fp32 a sampled token is drawn from: ``logits`` [N, V] after the
    penalties of ``counts`` ([V] or [N, V]; None: none), temperature and top-k / top-p / min-p."""
    logits = logits.float()
    if counts is not None:
        logits = apply_penalties(logits, counts, s)
    return filter_logits(logits / s.temperature, s.top_k, s.top_p, s.min_p).softmax(-1)


def candidates(logits: torch.Tensor, s: SamplerSettings, generator: torch.Generator | None = None):
    """Candidate token per row and the model's distribution: (tokens [N] long, probs [N, V] fp32).

    ``logits`` [N, V] (penalties already applied)."""
    logits = logits.float()
    probs = logits.softmax(-1)
    if s.greedy:
        return logits.argmax(-1), probs
    sample_probs = sampling_probs(logits, None, s)
    # a row of NaN (non-finite logits) would make multinomial raise, or assert on CUDA: draw from
    # a uniform row instead; the engine sees the NaN confidence of that row and ends the run
    sample_probs = torch.where(sample_probs.isfinite().all(-1, keepdim=True), sample_probs, 1.0)
    tokens = torch.multinomial(sample_probs, 1, generator=generator).squeeze(-1)
    return tokens, probs


def confidences(probs: torch.Tensor, tokens: torch.Tensor, rule: str = "probability") -> torch.Tensor:
    """Confidence per row [N] fp32 of the candidate ``tokens`` [N] under ``probs`` [N, V]."""
    if rule == "probability":
        return probs.gather(-1, tokens[:, None]).squeeze(-1)
    if rule == "margin":
        p = probs.gather(-1, tokens[:, None]).squeeze(-1)
        top2 = probs.topk(min(2, probs.shape[-1]), dim=-1)
        if top2.values.shape[-1] < 2:
            return p
        best_other = torch.where(top2.indices[:, 0] == tokens, top2.values[:, 1], top2.values[:, 0])
        return p - best_other
    if rule == "entropy":
        return torch.exp(-torch.special.entr(probs).sum(-1))
    raise ValueError(f"unknown confidence rule {rule!r}; use one of {', '.join(CONFIDENCE_RULES)}")


def select_unmask(conf: torch.Tensor, threshold: float, max_per_step: int | None = None,
                  force_all: bool = False) -> torch.Tensor:
    """Which of the N positions to unmask now: bool [N].

    Every position at or above ``threshold`` and always the most confident one (low-confidence
    remasking); with ``max_per_step`` only the most confident of those; ``force_all`` (the step
    limit) unmasks everything."""
    if force_all:
        return torch.ones_like(conf, dtype=torch.bool)
    flags = conf >= threshold
    flags.scatter_(0, conf.argmax().reshape(1), True)  # the most confident one, without a host sync
    if max_per_step is not None and max_per_step < conf.shape[0]:
        order = conf.argsort(descending=True, stable=True)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.shape[0], device=order.device)
        flags &= rank < max_per_step
    return flags


def log_probs(logits: torch.Tensor, counts: torch.Tensor | None, s: SamplerSettings) -> torch.Tensor:
    """The log of the distribution candidates are chosen from and confidences measured on (after
    penalties, before temperature and filtering): [N, V] fp32."""
    logits = logits.float()
    if counts is not None:
        logits = apply_penalties(logits, counts, s)
    return logits.log_softmax(-1)


def decide(logits: torch.Tensor, counts: torch.Tensor | None, s: SamplerSettings,
           generator: torch.Generator | None = None, force_all: bool = False):
    """One denoising step's decision over N masked positions: (tokens [N], confidences [N], unmask [N] bool)."""
    if counts is not None:
        logits = apply_penalties(logits.float(), counts, s)
    tokens, probs = candidates(logits, s, generator)
    conf = confidences(probs, tokens, s.confidence)
    return tokens, conf, select_unmask(conf, s.threshold, s.max_tokens_per_step, force_all)


# --------------------------------------------------------------------------- whether a choice can be made
OK, NONFINITE, COLLAPSED = 1, 0, 2  # a step's logits_health: fine, NaN or inf, equal for every token


def collapsed(logits: torch.Tensor) -> torch.Tensor:
    """0-d bool on the device: some row of ``logits`` [.., V] is equal over the whole vocabulary
    (as when a norm's mean square overflowed and zeroed the hidden state)."""
    return (logits.amax(-1) == logits.amin(-1)).any()


def logits_health(flat: torch.Tensor, confidences: torch.Tensor) -> torch.Tensor:
    """A 0-d device flag to ride along a step's one host transfer: OK, NONFINITE (a confidence is
    NaN or inf: so were the logits) or COLLAPSED (``flat``, from :func:`collapsed`: argmax would
    answer token 0)."""
    return torch.where(confidences.isfinite().all(), torch.where(flat, COLLAPSED, OK), NONFINITE).long()
