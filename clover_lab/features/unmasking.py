"""Which features carry the decoding order: over collected rows (``Activations``), each feature's
correlation with when a masked position gets unmasked.

    order = features.unmasking_order(held, sae)      # at each block's first step, every position masked
    order.early(5)     # features whose activation foretells an early unmasking (negative correlation)
    order.late(5)      # ... a late one (positive)

``at_step=0`` (the default) reads the block's first preview, where every position is still masked
and nothing is decided: the target is the step that will unmask the position. ``at_step=None``
reads every masked row, and the target is the steps left until the position is unmasked.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from clover_lab.errors import InputError
from clover_lab.features.activations import Activations
from clover_lab.features.autoencoder import SparseAutoencoder


@dataclass(frozen=True)
class OrderFeature:
    """One feature's tie to the unmasking order: Pearson ``correlation`` of its activation with the
    target over the rows read, the rows where it fires (``fires``), and the mean target where it
    fires against every row's (``mean_when_firing`` vs ``mean_overall``)."""

    feature: int
    correlation: float
    fires: int
    mean_when_firing: float
    mean_overall: float


class UnmaskingOrder:
    """Per feature, the correlation of its activation with the unmasking target (see the module)."""

    def __init__(self, correlation: torch.Tensor, fires: torch.Tensor, mean_firing: torch.Tensor, mean: float,
                 rows: int, at_step: int | None, min_fires: int):
        self.correlation, self.fires, self.mean_firing = correlation, fires, mean_firing
        self.mean, self.rows, self.at_step, self.min_fires = mean, rows, at_step, min_fires

    @property
    def target(self) -> str:
        return ("the step that unmasks the position" if self.at_step is not None
                else "the steps left until the position is unmasked")

    def _pick(self, n: int, sign: float) -> list[OrderFeature]:
        score = torch.where(self.fires >= self.min_fires, sign * self.correlation, torch.tensor(float("-inf")))
        score = score.nan_to_num(float("-inf"))
        picked = score.topk(min(n, len(score)))
        return [OrderFeature(int(i), float(self.correlation[i]), int(self.fires[i]), float(self.mean_firing[i]),
                             self.mean) for v, i in zip(picked.values, picked.indices) if v > float("-inf")]

    def early(self, n: int = 10) -> list[OrderFeature]:
        """The features most tied to early unmasking (most negative correlation)."""
        return self._pick(n, -1.0)

    def late(self, n: int = 10) -> list[OrderFeature]:
        """The features most tied to late unmasking (most positive correlation)."""
        return self._pick(n, 1.0)


def unmasking_order(acts: Activations, sae: SparseAutoencoder, *, at_step: int | None = 0, min_fires: int = 10,
                    chunk: int = 8192) -> UnmaskingOrder:
    """Each feature's correlation with when masked positions are unmasked (see the module's
    docstring), over the rows of ``acts`` that were masked (at ``at_step``, or at any step) and
    were unmasked in the end; features firing on fewer than ``min_fires`` of them are not ranked."""
    if not isinstance(acts, Activations):
        raise InputError(f"unmasking_order: expected Activations (features.collect), got {type(acts).__name__}")
    if not isinstance(sae, SparseAutoencoder):
        raise InputError(f"unmasking_order: expected a sparse autoencoder (features.load, features.train), got {type(sae).__name__}")
    if at_step is not None and (isinstance(at_step, bool) or not isinstance(at_step, numbers.Integral) or at_step < 0):
        raise InputError(f"unmasking_order: at_step={at_step!r}: expected a step (an int >= 0) or None")
    keep = acts.masked & (acts.unmask_step >= 0)
    if at_step is not None:
        keep &= acts.step == at_step
    if int(keep.sum()) < 2:
        raise InputError(f"unmasking_order: {int(keep.sum())} masked rows"
                         f"{'' if at_step is None else f' at step {at_step}'} with a known unmasking step; "
                         f"collect more generations")
    x = acts.values[keep]
    target = (acts.unmask_step[keep] - (0 if at_step is not None else acts.step[keep])).float()
    n, t_mean = len(target), float(target.mean())
    sum_a = torch.zeros(sae.d_sae, dtype=torch.float64)
    sum_aa = torch.zeros(sae.d_sae, dtype=torch.float64)
    sum_at = torch.zeros(sae.d_sae, dtype=torch.float64)
    fires = torch.zeros(sae.d_sae, dtype=torch.long)
    t_fire = torch.zeros(sae.d_sae, dtype=torch.float64)
    with torch.no_grad():
        for xs, ts in zip(x.split(chunk), target.split(chunk)):
            a = sae.encode(xs).double()  # [rows, d_sae]
            sum_a += a.sum(0)
            sum_aa += a.pow(2).sum(0)
            sum_at += (a * ts.double()[:, None]).sum(0)
            on = a > 0
            fires += on.sum(0)
            t_fire += (on.double() * ts.double()[:, None]).sum(0)
    cov = sum_at / n - (sum_a / n) * t_mean
    var_a = (sum_aa / n - (sum_a / n).pow(2)).clamp_min(0)
    var_t = float(target.double().var(unbiased=False))
    corr = (cov / (var_a.sqrt() * var_t ** 0.5)).float() if var_t > 0 else torch.full((sae.d_sae,), float("nan"))
    corr = torch.where(var_a > 0, corr, torch.tensor(float("nan")))
    mean_firing = (t_fire / fires.clamp_min(1)).float()
    return UnmaskingOrder(corr, fires, mean_firing, t_mean, n, at_step, min_fires)
