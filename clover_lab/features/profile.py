"""A feature's dashboard over a corpus of generations (SAEDashboard's reading of a feature, with
the denoising step as a coordinate): where it fires most (top activating contexts, each with its
block, denoising step, block position, whether the position was still masked and the step that
unmasked it), how its activations spread (histogram), how often it fires (density, over masked
and unmasked rows apart, and per denoising step), and what it writes toward the vocabulary
(logit effect: its decoder row times the unembedding, the final norm's gain folded in).

    acts = features.collect(engine, prompts, layer=2, max_new_tokens=64)
    dash = features.dashboard(acts, sae, 117, engine=engine)
    dash.top[0]                  # Context(activation, prompt, block, step, position, masked, unmask_step, ...)
    dash.density, dash.histogram, dash.by_step, dash.logit_top[:5]
    FeatureDashboardView(dash)   # clover_lab.widgets: the same, drawn
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from clover_lab.errors import InputError
from clover_lab.features.activations import Activations
from clover_lab.features.autoencoder import SparseAutoencoder


@dataclass(frozen=True)
class Context:
    """One top activating row: its ``activation``, where it was (``prompt`` index, ``block``,
    denoising ``step``, block ``position``), ``masked`` (still masked at that step),
    ``unmask_step`` (the step that unmasked the position; -1 past the response's end), ``token``
    (the token finally placed there) and the generation's text around it: ``before`` (prompt and
    response up to the position), ``piece`` (its token) and ``after``."""

    activation: float
    prompt: int
    block: int
    step: int
    position: int
    masked: bool
    unmask_step: int
    token: int
    before: str = ""
    piece: str = ""
    after: str = ""


@dataclass
class FeatureDashboard:
    """Feature ``feature`` of an autoencoder over ``rows`` preview rows of ``point`` (see the
    module). ``histogram``: (counts, bin edges) of its nonzero activations; ``by_step``: per
    denoising step, (mean activation, density, rows); ``logit_top`` / ``logit_bottom``: (token,
    text, effect) of the tokens its decoder row raises / lowers most."""

    feature: int
    point: str
    rows: int
    fires: int
    density: float
    density_masked: float
    density_unmasked: float
    max_activation: float
    histogram: tuple[list[int], list[float]]
    by_step: dict[int, tuple[float, float, int]]
    top: list[Context] = field(default_factory=list)
    logit_top: list[tuple[int, str, float]] = field(default_factory=list)
    logit_bottom: list[tuple[int, str, float]] = field(default_factory=list)

    def summary(self) -> str:
        return (f"feature {self.feature} at {self.point}: fires on {self.fires} of {self.rows} preview rows "
                f"(density {self.density:.2%}; masked rows {self.density_masked:.2%}, unmasked "
                f"{self.density_unmasked:.2%}), max activation {self.max_activation:.3g}")


@torch.no_grad()
def activations_of(acts: Activations, sae: SparseAutoencoder, features: list[int], chunk: int = 8192) -> torch.Tensor:
    """The activations [rows, len(features)] of ``features`` on every row of ``acts``."""
    index = torch.tensor([sae.feature_index(f) for f in features])
    return torch.cat([sae.encode(c)[:, index].cpu() for c in acts.values.split(chunk)]) if len(acts) else \
        torch.zeros(0, len(features))


def logit_effect(engine, sae: SparseAutoencoder, feature: int) -> torch.Tensor:
    """What one unit of the feature writes toward each token [V]: its decoder row, scaled by the
    final norm's gain (1 + weight; the norm's 1/rms, a positive factor per row, left out), times
    the unembedding; NaN at the mask token (never a candidate)."""
    d = sae.feature_direction(feature).float()
    model = engine.model
    if d.numel() != model.config.hidden_size:
        raise InputError(f"logit_effect: the decoder row has {d.numel()} values, the model's stream "
                         f"{model.config.hidden_size}")
    gain = 1 + model.model.norm.weight.detach().float().cpu()
    effect = model.lm_head.weight.detach().float().cpu() @ (d.cpu() * gain)
    if engine.mask_token_id is not None:
        effect[engine.mask_token_id] = float("nan")
    return effect


def _decode(tokenizer, ids: list[int]) -> str:
    if tokenizer is None:
        return " ".join(map(str, ids))
    return tokenizer.decode(ids)


def dashboard(acts: Activations, sae: SparseAutoencoder, feature: int, *, engine=None, tokenizer=None,
              top: int = 10, bins: int = 24, window: int = 12, logits: int = 10, distinct: bool = True,
              block_size: int | None = None) -> FeatureDashboard:
    """The dashboard of ``feature`` over the rows of ``acts`` (``features.collect``). ``engine``
    gives the logit effect, the tokenizer and the block size (else ``tokenizer`` / ``block_size``,
    default the generations' own). ``distinct``: one top context per generated position (its
    strongest step), not the same position at several steps; ``window`` tokens of text each side."""
    if not isinstance(acts, Activations):
        raise InputError(f"dashboard: expected Activations (features.collect), got {type(acts).__name__}")
    if not isinstance(sae, SparseAutoencoder):
        raise InputError(f"dashboard: expected a sparse autoencoder (features.load, features.train), got "
                         f"{type(sae).__name__}")
    for name, value in (("top", top), ("bins", bins), ("window", window), ("logits", logits)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < (0 if name == "window" else 1):
            raise InputError(f"dashboard: {name}={value!r}: expected a positive integer")
    if len(acts) == 0:
        raise InputError("dashboard: no rows (collect some generations first)")
    if acts.values.shape[-1] != sae.d_in:
        raise InputError(f"dashboard: the rows are {acts.values.shape[-1]} wide, the autoencoder reads {sae.d_in}")
    feature = sae.feature_index(feature)
    a = activations_of(acts, sae, [feature])[:, 0]  # [rows]
    on = a != 0
    masked = acts.masked
    dens = lambda sel: float(on[sel].float().mean()) if bool(sel.any()) else float("nan")  # noqa: E731
    nonzero = a[on]
    if len(nonzero):
        lo, hi = float(nonzero.min()), float(nonzero.max())
        hi = hi if hi > lo else lo + 1e-6
        counts = torch.histc(nonzero, bins=bins, min=lo, max=hi).long().tolist()
        edges = torch.linspace(lo, hi, bins + 1).tolist()
    else:
        counts, edges = [0] * bins, [0.0] * (bins + 1)
    by_step = {}
    for s in sorted(set(acts.step.tolist())):
        sel = acts.step == s
        by_step[int(s)] = (float(a[sel].mean()), dens(sel), int(sel.sum()))
    tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
    if block_size is None:
        block_size = getattr(engine, "block_size", None) or next(
            (r.stats.block_size for r in (acts.results or []) if getattr(r.stats, "block_size", None)), None)
    top_list = _top(acts, a, top, distinct, tokenizer, window, block_size)
    logit_top, logit_bottom = [], []
    if engine is not None:
        effect = logit_effect(engine, sae, feature)
        n = min(logits, int(torch.isfinite(effect).sum()))
        finite = effect.nan_to_num(float("-inf"))
        up = finite.topk(n)
        down = effect.nan_to_num(float("inf")).topk(n, largest=False)
        pieces = lambda ids: [_decode(tokenizer, [int(i)]) for i in ids]  # noqa: E731
        logit_top = [(int(i), p, float(v)) for i, p, v in zip(up.indices, pieces(up.indices), up.values)]
        logit_bottom = [(int(i), p, float(v)) for i, p, v in zip(down.indices, pieces(down.indices), down.values)]
    return FeatureDashboard(feature, acts.point, len(acts), int(on.sum()), float(on.float().mean()), dens(masked),
                            dens(~masked), float(a.max()), (counts, edges), by_step, top_list, logit_top, logit_bottom)


def _top(acts: Activations, a: torch.Tensor, n: int, distinct: bool, tokenizer, window: int,
         block_size: int | None) -> list[Context]:
    order = torch.argsort(a, descending=True)
    picked, seen = [], set()
    for i in order.tolist():
        if a[i] <= 0 or len(picked) == n:
            break
        key = (int(acts.prompt[i]), int(acts.block[i]), int(acts.position[i]))
        if distinct and key in seen:
            continue
        seen.add(key)
        picked.append(i)
    out = []
    for i in picked:
        p, b, pos = int(acts.prompt[i]), int(acts.block[i]), int(acts.position[i])
        before = piece = after = ""
        result = acts.results[p] if acts.results and p < len(acts.results) else None
        if result is not None and block_size:
            t = b * block_size + pos  # the response token's index
            ids = list(result.prompt_ids) + list(result.token_ids)
            at = len(result.prompt_ids) + t
            if t < len(result.token_ids):
                before = _decode(tokenizer, ids[max(0, at - window):at])
                piece = _decode(tokenizer, [ids[at]])
                after = _decode(tokenizer, ids[at + 1:at + 1 + window])
            else:
                before = _decode(tokenizer, ids[max(0, len(ids) - window):])
        out.append(Context(float(a[i]), p, b, int(acts.step[i]), pos, bool(acts.masked[i]), int(acts.unmask_step[i]),
                           int(acts.token[i]), before, piece, after))
    return out
