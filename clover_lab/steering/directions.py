"""Directions in the residual stream to steer along: the difference of means between contrastive
prompts over a capture (``contrast``), or a sparse autoencoder feature's decoder row (``feature``).

    comments = steering.contrast(engine, [("# read the file", "data = f.read()"), ...], layer=2)
    comments.norm, comments.info["mean_row_norm"]     # how long it is against the stream's rows
    f = steering.feature(sae, 117)                          # unit length, at the autoencoder's layer
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from clover_lab.engine.requests import is_batch
from clover_lab.errors import InputError
from clover_lab.features.activations import batch_rows, residual_point
from clover_lab.features.autoencoder import SparseAutoencoder
from clover_lab.hooks import points as P

ROWS = ("prompt", "last")  # every prompt row, or the last one (the row that predicts what follows)


@dataclass
class Direction:
    """A vector [hidden] (float32, CPU) with where it lives (``layer``, ``kind`` of residual point)
    and how it was made (``info``)."""

    vector: torch.Tensor
    name: str = "direction"
    layer: int | None = None
    kind: str = P.OUTPUT
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        v = self.vector
        if not isinstance(v, torch.Tensor) or v.dim() != 1 or not v.is_floating_point():
            raise InputError(f"Direction {self.name!r}: expected a 1-D float tensor, got "
                             f"{type(v).__name__}{list(v.shape) if isinstance(v, torch.Tensor) else ''}")
        self.vector = v.detach().to("cpu", torch.float32)

    @property
    def norm(self) -> float:
        return float(self.vector.norm())

    def unit(self) -> "Direction":
        """The same direction at length 1 (a zero vector stays zero)."""
        n = self.vector.norm()
        return Direction(self.vector / n if n > 0 else self.vector.clone(), self.name, self.layer, self.kind,
                         dict(self.info, scaled_from_norm=float(n)))

    def __repr__(self) -> str:
        where = "" if self.layer is None else f", {P.layer_point(self.layer, self.kind)}"
        return f"Direction({self.name!r}, norm {self.norm:.3g}{where})"


def _pairs(pairs) -> list[tuple]:
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, (list, tuple)) or not pairs:
        raise InputError("contrast: pairs must be a non-empty list of (positive, negative) prompts")
    out = []
    for i, pair in enumerate(pairs):
        if isinstance(pair, (str, bytes)) or not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise InputError(f"contrast: pairs[{i}] must be a (positive, negative) pair of prompts, got {pair!r}")
        for side in pair:
            if is_batch(side):
                raise InputError(f"contrast: pairs[{i}] holds a list of prompts; each side of a pair is one prompt")
        out.append(tuple(pair))
    return out


def prompt_means(engine, prompts: list, layer: int, kind: str = P.OUTPUT, rows: str = "prompt"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per prompt, the mean of its prefill rows at ``layers.{layer}.{kind}`` (``rows="last"``: its
    last row only), as [prompts, hidden] float32, and the mean norm of those rows (a scale to
    compare a direction's length with). The prompts run as one batch, prefill only (an AR request
    of one token: the prefill's rows are what is read)."""
    if rows not in ROWS:
        raise InputError(f"rows={rows!r}: expected one of {', '.join(ROWS)}")
    point = residual_point(engine, layer, kind)
    with engine.capture([point]) as cap:
        engine.generate(list(prompts), mode="ar", max_new_tokens=1)
    parts: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
    for rec in cap[point]:
        if rec.phase != "prefill":
            continue
        value = rec["value"].float()  # [b, T, H]
        for b, r in batch_rows(rec.where):
            parts[r].append(value[b])
    means, norms = [], []
    for i in range(len(prompts)):
        x = torch.cat(parts[i])  # [T, H] the prompt's rows, in order (chunks concatenated)
        x = x[-1:] if rows == "last" else x
        means.append(x.mean(0))
        norms.append(x.norm(dim=-1))
    return torch.stack(means).cpu(), torch.cat(norms).mean().cpu()


def contrast(engine, pairs, layer: int, *, kind: str = P.OUTPUT, rows: str = "prompt",
             name: str | None = None) -> Direction:
    """The difference of means between the positive and the negative prompts of ``pairs`` at the
    residual point ``layers.{layer}.{kind}`` over their prefill (``rows``: every prompt row, or
    the last): mean(positive) - mean(negative), each the mean over its prompts of the prompt's
    mean row. ``info`` says how many pairs, which rows and the rows' mean norm."""
    pairs = _pairs(pairs)
    pos, pos_norm = prompt_means(engine, [p for p, _ in pairs], layer, kind, rows)
    neg, neg_norm = prompt_means(engine, [n for _, n in pairs], layer, kind, rows)
    vector = pos.mean(0) - neg.mean(0)
    return Direction(vector, name or f"contrast of {len(pairs)} pairs", layer, kind,
                     dict(made="difference of means", pairs=len(pairs), rows=rows,
                          mean_row_norm=float((pos_norm + neg_norm) / 2)))


def feature(sae: SparseAutoencoder, index: int, name: str | None = None) -> Direction:
    """Feature ``index``'s decoder row, at unit length, placed where the autoencoder reads (its
    ``layer`` and ``kind``)."""
    if not isinstance(sae, SparseAutoencoder):
        raise InputError(f"feature: expected a sparse autoencoder (features.load, features.train), got {type(sae).__name__}")
    if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not 0 <= index < sae.d_sae:
        raise InputError(f"feature: index {index!r} is not a feature of this autoencoder (0..{sae.d_sae - 1})")
    if sae.d_out != sae.d_in or sae.architecture.endswith("transcoder"):
        raise InputError(f"feature: a {sae.architecture}'s decoder rows belong to {sae.metadata.get('hook_name_out')!r},"
                         f" not to the point it reads; steer along them there by hand")
    row = sae.W_dec.detach()[int(index)].float()
    n = row.norm()
    return Direction(row / n if n > 0 else row, name or f"feature {int(index)}", sae.layer, sae.kind,
                     dict(made="decoder row", feature=int(index), decoder_norm=float(n)))
