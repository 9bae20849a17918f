"""Training a TopK autoencoder on collected rows (``Activations``), on the CPU, in minutes for the
embedded model. The recipe of Gao et al. 2024 ("Scaling and evaluating sparse autoencoders"), as
SAELens' ``topk`` trainer has it too:

- rows scaled to a mean squared norm of d_in for training (the scale is folded back into the
  weights at the end, so the saved autoencoder reads the raw stream);
- ``b_dec`` starts at the rows' mean, the decoder rows at random unit vectors, the encoder at the
  decoder's transpose; decoder rows are kept at unit norm after every step;
- the loss is the reconstruction's squared error over the batch's variance, plus the AuxK term:
  latents that have not fired for ``dead_rows`` rows reconstruct what the live ones left over
  (``aux_k`` of them per row, weight ``aux_coef``), which keeps features from dying;
- Adam, the learning rate decayed linearly over the last fifth of the steps.

``seconds`` bounds the run by wall clock instead of (or before) ``steps``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from clover_lab.errors import InputError, count
from clover_lab.features.activations import Activations
from clover_lab.features.autoencoder import TopKAutoencoder


@dataclass
class TrainingLog:
    """What a training run did: steps, rows seen, seconds, the training FVU every ``every`` steps
    ((step, fvu) pairs) and the share of features that never fired in the last ``dead_rows`` rows."""

    steps: int = 0
    rows_seen: int = 0
    seconds: float = 0.0
    curve: list = field(default_factory=list)
    dead_fraction: float = 0.0
    settings: dict = field(default_factory=dict)


def _finite(value) -> bool:
    """A real number (no bool), finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _rows(acts) -> torch.Tensor:
    x = acts.values if isinstance(acts, Activations) else acts
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise InputError(f"train: expected Activations or a float tensor [rows, hidden], got "
                         f"{type(x).__name__}{list(x.shape) if isinstance(x, torch.Tensor) else ''}")
    if len(x) < 2:
        raise InputError(f"train: {len(x)} rows; an autoencoder needs rows to learn from (an empty capture?)")
    if not bool(torch.isfinite(x).all()):
        raise InputError("train: the rows hold NaN or inf")
    return x.to(torch.float32)


def train(acts, d_sae: int | None = None, k: int = 32, *, steps: int | None = None, seconds: float | None = None,
          batch_size: int = 2048, lr: float = 1e-3, aux_k: int | None = None, aux_coef: float = 1 / 32,
          dead_rows: int | None = None, seed: int = 0, every: int = 50, hook_name: str | None = None,
          model_name: str | None = None) -> TopKAutoencoder:
    """A TopK autoencoder of ``d_sae`` features (default 8 x hidden), ``k`` active per row, trained
    on ``acts`` (``Activations`` or a tensor [rows, hidden]) for ``steps`` batches of ``batch_size``
    rows (default 1000) or ``seconds``, whichever ends first. ``sae.log`` is the TrainingLog;
    ``hook_name`` defaults to the point the activations were collected at."""
    x = _rows(acts)
    n, d_in = x.shape
    d_sae = 8 * d_in if d_sae is None else count("d_sae", d_sae)
    k = count("k", k)
    if k > d_sae:
        raise InputError(f"train: k={k} is more than d_sae={d_sae}")
    batch_size = min(count("batch_size", batch_size), n)
    if steps is None and seconds is None:
        steps = 1000
    if steps is not None:
        steps = count("steps", steps)
    if seconds is not None and (not _finite(seconds) or seconds <= 0):
        raise InputError(f"train: seconds={seconds!r}: expected a positive finite number (no limit: leave it out "
                         f"and give steps)")
    if not (_finite(lr) and lr > 0):  # lr=inf trained NaN weights without a word
        raise InputError(f"train: lr={lr!r}: expected a positive finite number")
    if not (_finite(aux_coef) and aux_coef >= 0):
        raise InputError(f"train: aux_coef={aux_coef!r}: expected a finite number >= 0 (0: no AuxK term)")
    every = count("every", every)
    aux_k = min(d_in // 2, d_sae) if aux_k is None else count("aux_k", aux_k)
    dead_rows = min(10 * n, 200_000) if dead_rows is None else count("dead_rows", dead_rows)
    point = acts.point if isinstance(acts, Activations) else None
    gen = torch.Generator().manual_seed(seed)

    scale = math.sqrt(d_in / float(x.pow(2).sum(-1).mean()))  # rows at a mean squared norm of d_in
    sae = TopKAutoencoder(d_in, d_sae, k, hook_name=hook_name or point, model_name=model_name)
    with torch.no_grad():
        w = torch.randn(d_sae, d_in, generator=gen)
        sae.W_dec.copy_(w / w.norm(dim=-1, keepdim=True))
        sae.W_enc.copy_(sae.W_dec.T)
        sae.b_dec.copy_(x.mean(0) * scale)
    opt = torch.optim.Adam(sae.parameters(), lr=lr)
    since_fired = torch.zeros(d_sae, dtype=torch.long)
    log = TrainingLog(settings=dict(d_sae=d_sae, k=k, batch_size=batch_size, lr=lr, aux_k=aux_k, aux_coef=aux_coef,
                                    dead_rows=dead_rows, seed=seed, rows=n, scale=scale))
    start = time.perf_counter()
    step = 0
    while True:
        if steps is not None and step >= steps:
            break
        if seconds is not None and time.perf_counter() - start >= seconds:
            break
        total = steps if steps is not None else max(step + 1, int(seconds / max((time.perf_counter() - start) /
                                                                                  max(step, 1), 1e-6)))
        for group in opt.param_groups:  # flat, then linear decay over the last fifth
            group["lr"] = lr * min(1.0, 5 * (1 - step / total)) if step > 0.8 * total else lr
        batch = x[torch.randint(0, n, (batch_size,), generator=gen)] * scale
        pre = sae.pre(batch)
        values, indices = pre.topk(k, dim=-1)
        acts_ = torch.zeros_like(pre).scatter_(-1, indices, values.relu())
        recon = sae.decode(acts_)
        err = batch - recon
        variance = (batch - batch.mean(0)).pow(2).sum(-1).mean()
        loss = err.pow(2).sum(-1).mean() / variance
        fired = torch.zeros(d_sae, dtype=torch.bool)
        fired[indices[values > 0]] = True
        since_fired = torch.where(fired, 0, since_fired + batch_size)
        dead = since_fired >= dead_rows
        if aux_coef > 0 and bool(dead.any()):  # the dead latents reconstruct the residual error
            kd = min(aux_k, int(dead.sum()))
            aux_pre = pre.masked_fill(~dead, float("-inf"))
            av, ai = aux_pre.topk(kd, dim=-1)
            aux = torch.zeros_like(pre).scatter_(-1, ai, av.relu()) @ sae.W_dec
            target = err.detach()
            aux_loss = (target - aux).pow(2).sum(-1).mean() / (target - target.mean(0)).pow(2).sum(-1).mean().clamp_min(1e-12)
            loss = loss + aux_coef * aux_loss.nan_to_num(0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            sae.W_dec.div_(sae.W_dec.norm(dim=-1, keepdim=True).clamp_min(1e-12))
        step += 1
        if step % every == 0 or step == 1:
            log.curve.append((step, float(err.detach().pow(2).sum(-1).mean() / variance.detach())))
    with torch.no_grad():  # the scale folded back: the autoencoder reads and writes the raw stream
        sae.b_enc.div_(scale)
        sae.b_dec.div_(scale)
    log.steps, log.rows_seen, log.seconds = step, step * batch_size, time.perf_counter() - start
    log.dead_fraction = float((since_fired >= dead_rows).float().mean())
    sae.requires_grad_(False)
    sae.log = log
    sae.metadata["clover_lab"] = dict(trained_on=f"{n} rows of {point or 'a tensor'}", steps=log.steps,
                                      seconds=round(log.seconds, 1), dead_fraction=round(log.dead_fraction, 4))
    return sae
