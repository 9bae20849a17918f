"""Linear probes over (layer, step): when, during denoising, is a property of a block position
linearly readable from the residual stream?

For every preview row of some generations (a block position while it is still masked, at step s
of its block) a label is asked of a user function, given a :class:`ProbeRow` (its block, step,
position, the step that unmasked it, the token it became); a logistic-regression probe per
(layer, step) is trained on the rows of some prompts and scored on the rows of the others
(held out by prompt, so no generation is in both). The control trains the same probe on the
same rows with their labels shuffled: it must score no better than chance, or the probe is
reading something other than the label. Scores are balanced accuracies (the mean of each label's
recall: chance is 1 / the number of labels however rare one is).

    rows = attribution.probe_rows(engine, prompts, **generate)    # one generation per prompt
    pm = attribution.probe_map(rows, attribution.unmasks_next_step)
    pm.accuracy[layer, step], pm.control[layer, step], pm.chance[step]

Plain torch logistic regression (full-batch L-BFGS on standardised features, an L2 penalty
``l2 * |w|^2`` summed over rows, as scikit-learn's ``C = 1 / l2``): no scikit-learn needed.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Callable

import torch

from clover_lab.engine.requests import is_batch
from clover_lab.errors import InputError
from clover_lab.hooks import points as P


@dataclass(frozen=True)
class ProbeRow:
    """One preview row: ``prompt`` its index among the prompts, ``block``, ``step`` and
    ``position`` (absolute), ``unmask_step`` the step of its block that unmasked it, ``token``
    the token it became."""

    prompt: int
    block: int
    step: int
    position: int
    unmask_step: int
    token: int


def unmasks_next_step(row: ProbeRow) -> int:
    """1 if this still-masked position is unmasked at the next step of its block, else 0."""
    return int(row.unmask_step == row.step + 1)


def unmasks_this_step(row: ProbeRow) -> int:
    """1 if the step reading this row unmasks it, else 0."""
    return int(row.unmask_step == row.step)


@dataclass
class ProbeRows:
    """Residual rows of several generations: ``rows`` [N] the rows' coordinates; ``values``
    {layer: [N, H]} each layer's ``kind`` value at each row."""

    rows: list[ProbeRow]
    values: dict[int, torch.Tensor]
    kind: str
    prompts: int


def probe_rows(engine, prompts, kind: str = P.OUTPUT, **generate) -> ProbeRows:
    """Generate each prompt (diffusion or speculative) and keep, at every preview, each layer's
    ``kind`` value at every block position still masked there."""
    if not is_batch(prompts) or len(prompts) < 2:
        raise InputError("probe_rows: give a list of at least two prompts (the probes are scored on held-out ones)")
    layers = [i for i in range(engine.model.config.num_hidden_layers)
              if P.layer_point(i, kind) in engine.model.hooks.points]
    if not layers:
        raise InputError(f"probe_rows kind={kind!r}: no layer has that point")
    rows: list[ProbeRow] = []
    values: dict[int, list] = {i: [] for i in layers}
    for k, prompt in enumerate(prompts):
        seen: dict[tuple, dict] = {}  # (block, step) -> layer -> (positions, value [T, H])
        unmask: dict[tuple, int] = {}  # (block, block position) -> step
        starts: dict[int, tuple] = {}  # block -> (start, tokens)

        def keep(ev):
            if ev.mode == "preview":
                seen.setdefault((ev.block, ev.step), {})[ev.layer] = (ev.positions.reshape(-1).tolist(),
                                                                      ev.value[0].detach().float().cpu())

        def step(ev):
            for p in ev.unmask:
                unmask[(ev.block, p)] = ev.step

        def commit(ev):
            starts[ev.block] = (ev.start, list(ev.tokens))

        with torch.no_grad(), engine.hooks({P.every_layer(kind): keep, P.DENOISE_STEP: step,
                                            P.BLOCK_COMMIT: commit}):
            engine.generate(prompt, **generate)
        for (block, s), by_layer in sorted(seen.items()):
            if block not in starts:
                continue
            start, tokens = starts[block]
            positions = by_layer[layers[0]][0]
            for j, p in enumerate(positions):
                u = unmask.get((block, p - start))
                if u is None or u < s or p - start >= len(tokens):  # unmasked already (the block's rows all flow
                    continue  # through the layers), never unmasked (cut by a stop), or past the end
                rows.append(ProbeRow(k, block, s, p, u, tokens[p - start]))
                for i in layers:
                    values[i].append(by_layer[i][1][j])
    if not rows:
        raise InputError("probe_rows: the generations had no preview rows (AR runs have none)")
    return ProbeRows(rows, {i: torch.stack(v) for i, v in values.items()}, kind, len(prompts))


@dataclass
class ProbeMap:
    """Held-out balanced accuracy per (layer, step) (:func:`balanced_accuracy`): ``accuracy`` and
    ``control`` (shuffled labels) [layers, steps] (NaN where a step has too few rows or one label),
    ``chance`` [steps] a constant guess's (1 / the labels present in the held-out rows),
    ``counts`` [steps] the held-out rows."""

    layers: list[int]
    steps: list[int]
    accuracy: torch.Tensor
    control: torch.Tensor
    chance: torch.Tensor
    counts: list[int]
    label: str = ""
    train_prompts: list[int] = field(default_factory=list)

    def best(self) -> tuple[int, int, float]:
        """(layer, step, accuracy) of the best cell above chance."""
        gain = self.accuracy - self.chance[None]
        flat = torch.nan_to_num(gain, nan=-1.0).argmax()
        r, c = divmod(int(flat), len(self.steps))
        return self.layers[r], self.steps[c], float(self.accuracy[r, c])

    def to_dict(self) -> dict:
        return dict(layers=self.layers, steps=self.steps, accuracy=self.accuracy.tolist(),
                    control=self.control.tolist(), chance=self.chance.tolist(), counts=self.counts, label=self.label)


def fit_logistic(x: torch.Tensor, y: torch.Tensor, classes: int, l2: float = 1.0, iterations: int = 50):
    """Multinomial logistic regression on standardised features: returns a predict function."""
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    xs = (x - mean) / std
    w = torch.zeros(x.shape[1], classes, requires_grad=True)
    b = torch.zeros(classes, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=iterations, line_search_fn="strong_wolfe")
    xs, y = xs.float(), y.long()
    penalty = l2 / len(y)  # the L2 penalty of a sum over rows, per row: stronger on fewer rows

    def loss():
        opt.zero_grad()
        out = torch.nn.functional.cross_entropy(xs @ w + b, y) + penalty * w.pow(2).sum()
        out.backward()
        return out

    with torch.enable_grad():
        opt.step(loss)
    w, b = w.detach(), b.detach()
    return lambda z: (((z - mean) / std).float() @ w + b).argmax(-1)


def balanced_accuracy(predicted: torch.Tensor, truth: torch.Tensor) -> float:
    """The mean over the true labels present of the share of their rows predicted right: 1 / (labels
    present) for a constant guess, however rare a label is (plain accuracy rewards guessing the
    common label: 0.9 where nine rows in ten are 0)."""
    return float(torch.stack([(predicted[truth == k] == k).float().mean() for k in truth.unique()]).mean())


def probe_map(data: ProbeRows, label: Callable[[ProbeRow], int | None], train_fraction: float = 0.5,
              min_rows: int = 8, seed: int = 0, l2: float = 1.0) -> ProbeMap:
    """Train a probe per (layer, step) on ``label`` (a function of a :class:`ProbeRow` returning
    a class, an int >= 0, or None to leave the row out) over the first ``train_fraction`` of the
    prompts (shuffled by ``seed``), score it on the rest; the control the same with the training
    labels shuffled."""
    if not callable(label):
        raise InputError(f"probe_map label must be a function of a ProbeRow, got {type(label).__name__}")
    if not 0 < train_fraction < 1:
        raise InputError(f"probe_map train_fraction={train_fraction!r}: expected a number in (0, 1)")
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(data.prompts, generator=g).tolist()
    n_train = min(max(1, round(train_fraction * data.prompts)), data.prompts - 1)
    train_prompts = set(order[:n_train])
    labels = []
    for r in data.rows:
        v = label(r)
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0):
            raise InputError(f"probe_map label returned {v!r} for {r}: expected an int >= 0 or None")
        labels.append(None if v is None else int(v))
    layers = sorted(data.values)
    steps = sorted({r.step for r, v in zip(data.rows, labels) if v is not None})
    acc = torch.full((len(layers), len(steps)), float("nan"))
    ctl = acc.clone()
    chance = torch.full((len(steps),), float("nan"))
    counts = []
    for c, s in enumerate(steps):
        idx = [i for i, (r, v) in enumerate(zip(data.rows, labels)) if v is not None and r.step == s]
        tr = [i for i in idx if data.rows[i].prompt in train_prompts]
        te = [i for i in idx if data.rows[i].prompt not in train_prompts]
        counts.append(len(te))
        y = torch.tensor([labels[i] for i in idx])
        ytr, yte = torch.tensor([labels[i] for i in tr], dtype=torch.long), torch.tensor([labels[i] for i in te])
        if len(tr) < min_rows or len(te) < min_rows or len(set(ytr.tolist())) < 2:
            continue
        classes = int(y.max()) + 1
        chance[c] = 1.0 / len(set(yte.tolist()))
        shuffled = ytr[torch.randperm(len(tr), generator=g)]
        for r, layer in enumerate(layers):
            x = data.values[layer]
            acc[r, c] = balanced_accuracy(fit_logistic(x[tr], ytr, classes, l2)(x[te]), yte)
            ctl[r, c] = balanced_accuracy(fit_logistic(x[tr], shuffled, classes, l2)(x[te]), yte)
    return ProbeMap(layers, steps, acc, ctl, chance, counts, getattr(label, "__name__", "label"),
                    sorted(train_prompts))
