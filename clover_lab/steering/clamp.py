"""A sparse autoencoder's feature clamped or ablated during chosen denoising steps: a ``Steer``
that, on the rows its schedule picks, sets the feature's activation to a value instead of adding
a fixed vector.

    late_off = steering.ablate(sae, 117, steps="3:")                 # feature 117 removed from step 3 on
    forced = steering.clamp(sae, 117, 8.0, steps="0:2", positions="masked")
    run = steering.steer(engine, prompt, [late_off], max_new_tokens=64)

On a row x of the point the autoencoder reads, with a = the feature's activation there and d its
decoder row (what one unit of activation adds to the reconstruction),

    x' = x + (value - a) * d

the row with its reconstruction's share of the feature replaced and everything the autoencoder
does not explain (the error term) kept: SAELens' and Neuronpedia's clamping "with the error
term". Ablation is value 0 (rows where the feature is off are left as they are); a clamp also
writes the feature where it was off.
"""
from __future__ import annotations

import math
import numbers

import torch

from clover_lab.errors import InputError
from clover_lab.features.autoencoder import SparseAutoencoder
from clover_lab.steering.schedule import Steer


class FeatureClamp:
    """Feature ``feature`` of ``sae``: its activation on rows, and rows with it set to a value."""

    def __init__(self, sae: SparseAutoencoder, feature: int):
        if not isinstance(sae, SparseAutoencoder):
            raise InputError(f"clamp: expected a sparse autoencoder (features.load, features.train), got "
                             f"{type(sae).__name__}")
        if sae.d_out != sae.d_in or sae.architecture.endswith("transcoder"):
            raise InputError(f"clamp: a {sae.architecture} writes {sae.metadata.get('hook_name_out')!r}, not the "
                             f"point it reads; clamp an autoencoder's feature")
        self.sae, self.feature = sae, sae.feature_index(feature)
        self._direction: dict = {}

    def direction(self, like: torch.Tensor) -> torch.Tensor:
        key = like.device
        if key not in self._direction:
            self._direction[key] = self.sae.feature_direction(self.feature).to(like.device)
        return self._direction[key]

    @torch.no_grad()
    def activation(self, rows: torch.Tensor) -> torch.Tensor:
        """The feature's activation [..] on rows [.., d_in] (float32)."""
        return self.sae.to(rows.device).encode(rows)[..., self.feature]

    @torch.no_grad()
    def apply(self, rows: torch.Tensor, value: float) -> torch.Tensor:
        """Rows [.., d_in] with the feature's activation set to ``value`` (float32)."""
        x = rows.float()
        return x + (value - self.activation(x))[..., None] * self.direction(x)

    def describe(self) -> dict:
        return dict(feature=self.feature, architecture=self.sae.architecture, hook_name=self.sae.hook_name,
                    d_sae=self.sae.d_sae)

    def __repr__(self) -> str:
        return f"FeatureClamp(feature {self.feature} of a {self.sae.architecture} autoencoder at {self.sae.hook_name})"


def clamp(sae: SparseAutoencoder, feature: int, value: float, *, name: str | None = None, **where) -> Steer:
    """A Steer that sets ``feature``'s activation to ``value`` where ``where`` says (Steer's
    ``blocks``, ``steps``, ``positions``, ``parts``; ``layers``/``kind`` default to the point the
    autoencoder reads)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise InputError(f"clamp: value={value!r}: expected a finite number (the feature's activation)")
    fc = FeatureClamp(sae, feature)
    if sae.layer is None and "layers" not in where:
        raise InputError(f"clamp: the autoencoder reads {sae.hook_name!r}, not a clover_lab residual point; give "
                         f"layers= (and kind=)")
    for key in ("direction", "coefficient", "clamp"):
        if key in where:
            raise InputError(f"clamp: {key}= is set by the clamp itself")
    if sae.layer is not None and "layers" in where and where["layers"] not in (sae.layer, [sae.layer], (sae.layer,)):
        raise InputError(f"clamp: the autoencoder reads {sae.hook_name}; its feature is clamped there only "
                         f"(layers={where['layers']!r})")
    where.setdefault("layers", sae.layer)
    if sae.kind is not None:
        where.setdefault("kind", sae.kind)
    label = name or (f"feature {fc.feature} ablated" if value == 0 else f"feature {fc.feature} clamped to {value:g}")
    return Steer(fc.direction(torch.empty(0)), float(value), clamp=fc, name=label, **where)


def ablate(sae: SparseAutoencoder, feature: int, *, name: str | None = None, **where) -> Steer:
    """A Steer that removes ``feature`` (its activation set to 0) where ``where`` says."""
    return clamp(sae, feature, 0.0, name=name, **where)
