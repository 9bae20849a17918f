"""The standard patching sweeps: layers x positions at one forward, and denoising steps x layers
for one position. Each cell is one run of the corrupted prompt with one value taken from the
clean run, stopped as soon as the metric is read."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from clover_lab.errors import InputError
from clover_lab.hooks import points as P
from clover_lab.patching.metrics import Metric, measure
from clover_lab.patching.patch import Site, Source, check_site, one_prompt, patch_hooks, record


@dataclass
class Sweep:
    """``values`` [rows, cols] of the metric with one site patched per cell; ``clean`` and
    ``corrupt`` the metric of the two runs unpatched. NaN where the metric could not be read."""

    values: torch.Tensor
    rows: list
    cols: list
    row_name: str
    col_name: str
    clean: float
    corrupt: float
    metric: str
    title: str = ""
    applied: list = field(default_factory=list, repr=False)
    # per row, where the metric is read at a different forward in each row (steps x layers)
    clean_rows: list | None = None
    corrupt_rows: list | None = None

    def normalized(self) -> torch.Tensor:
        """(value - corrupt) / (clean - corrupt): 1 where the patch restores the clean run."""
        if self.clean_rows is None:
            return (self.values - self.corrupt) / (self.clean - self.corrupt)
        clean, corrupt = torch.tensor(self.clean_rows)[:, None], torch.tensor(self.corrupt_rows)[:, None]
        return (self.values - corrupt) / (clean - corrupt)

    def to_dict(self) -> dict:
        return dict(values=self.values.tolist(), rows=list(self.rows), cols=list(self.cols), row_name=self.row_name,
                    col_name=self.col_name, clean=self.clean, corrupt=self.corrupt, metric=self.metric,
                    title=self.title, clean_rows=self.clean_rows, corrupt_rows=self.corrupt_rows)


def _layers_with(engine, kind: str) -> list[int]:
    names = set(engine.model.hooks.points)
    return [i for i in range(engine.model.config.num_hidden_layers) if P.layer_point(i, kind) in names]


def _check_prompts(engine, clean, corrupt, metric) -> None:
    one_prompt(clean, "a patching sweep")
    one_prompt(corrupt, "a patching sweep")
    if not isinstance(metric, Metric):
        raise InputError(f"metric must be a Metric (logit_diff, probability), got {type(metric).__name__}")
    metric.check(engine.model.config.vocab_size)
    a, b = engine.encode(clean), engine.encode(corrupt)
    if len(a) != len(b):
        raise InputError(f"patching sweeps compare positions: the clean prompt has {len(a)} tokens and the "
                         f"corrupted one {len(b)}; make them the same length")


def _check_forward(source: Source, point: str, block, step, what: str) -> None:
    """(``block``, ``step``) is a forward the clean run had: a sweep read or patched anywhere else
    would fill its cells with "no effect"."""
    if not source.rows(point, block, step):
        steps = sorted({(b, s) for (p, b, s) in source.keys() if p == point and b is not None},
                       key=lambda k: (k[0], -1 if k[1] is None else k[1]))
        last = f"; its last is block {steps[-1][0]}, step {steps[-1][1]}" if steps else ""
        raise InputError(f"{what} block {block}, step {step}: the clean run has no such forward{last}")


def _list(name: str, values) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple, range)):
        raise InputError(f"{name}={values!r}: expected a list of ints")
    values = list(values)
    if not values:
        raise InputError(f"{name} is empty: give at least one, or None for every one the clean run has")
    return values


def _cell(engine, corrupt, source: Source, site: Site, metric: Metric, at: tuple, applied: list, generate) -> float:
    return measure(engine, corrupt, metric, *at, hooks=patch_hooks(source, [site], applied), **generate)


def sweep_layers_positions(engine, clean, corrupt, metric: Metric, block: int | None, step: int | None,
                           kind: str = P.OUTPUT, patch_at: tuple | None = None, positions=None,
                           **generate) -> Sweep:
    """Layers x positions: the metric at (``block``, ``step``) of the corrupted run with layer i's
    ``kind`` value at one position taken from the clean run. ``patch_at`` the (block, step) of the
    patched forward: default the metric's; ``(None, None)`` patches the prompt's prefill.
    ``positions`` default: every row the clean run has there."""
    _check_prompts(engine, clean, corrupt, metric)
    layers = _layers_with(engine, kind)
    at = (block, step)
    patch_at = at if patch_at is None else tuple(patch_at)
    positions = None if positions is None else _list("positions", positions)
    source = record(engine, clean, [P.layer_point(i, kind) for i in layers], **generate)
    first = P.layer_point(layers[0], kind)
    _check_forward(source, first, *at, "the metric's")
    _check_forward(source, first, *patch_at, "patch_at")
    if positions is None:
        positions = sorted(source.rows(first, *patch_at))
    sites = [[Site(P.layer_point(layer, kind), *patch_at, positions=(p,)) for p in positions] for layer in layers]
    for site in sites[0]:
        check_site(source, site)
    values = torch.full((len(layers), len(positions)), float("nan"))
    applied: list = []
    for r, row in enumerate(sites):
        for c, site in enumerate(row):
            values[r, c] = _cell(engine, corrupt, source, site, metric, at, applied, generate)
    return Sweep(values, layers, list(positions), "layer", "position", measure(engine, clean, metric, *at, **generate),
                 measure(engine, corrupt, metric, *at, **generate), metric.name,
                 f"{kind} patched at {_coordinate(*patch_at)}; read at {_coordinate(block, step)}",
                 applied)


def _coordinate(block, step) -> str:
    """A (block, step) coordinate in words: (None, None) is the prompt's prefill, (b, None) block
    b's commit."""
    if block is None:
        return "the prompt's prefill"
    return f"block {block}'s commit" if step is None else f"block {block}, step {step}"


def sweep_steps_layers(engine, clean, corrupt, metric: Metric, block: int, kind: str = P.OUTPUT, position=None,
                       steps=None, **generate) -> Sweep:
    """Denoising steps x layers for one position (default the metric's): the corrupted run with
    layer i's ``kind`` value at ``position`` taken from the clean run at step s of ``block``, the
    metric read at that same step. ``steps`` default: every step the clean run took on the block."""
    _check_prompts(engine, clean, corrupt, metric)
    layers = _layers_with(engine, kind)
    position = metric.position if position is None else Site(P.layer_point(layers[0], kind), block, 0,
                                                             positions=(position,)).positions[0]
    steps = None if steps is None else _list("steps", steps)
    source = record(engine, clean, [P.layer_point(i, kind) for i in layers], **generate)
    point = P.layer_point(layers[0], kind)
    if steps is None:
        steps = sorted(s for (name, b, s) in source.keys() if name == point and b == block and s is not None)
        if not steps:
            raise InputError(f"the clean run has no denoising step on block {block}")
    for s in steps:
        check_site(source, Site(point, block, s, positions=(position,)))
    values = torch.full((len(steps), len(layers)), float("nan"))
    clean_v, corrupt_v = [], []
    applied: list = []
    for r, s in enumerate(steps):
        clean_v.append(measure(engine, clean, metric, block, s, **generate))
        corrupt_v.append(measure(engine, corrupt, metric, block, s, **generate))
        for c, layer in enumerate(layers):
            site = Site(P.layer_point(layer, kind), block, s, positions=(position,))
            values[r, c] = _cell(engine, corrupt, source, site, metric, (block, s), applied, generate)
    return Sweep(values, list(steps), layers, "step", "layer", clean_v[0], corrupt_v[0], metric.name,
                 f"{kind} at position {position} patched at each step of block {block}; read at that step", applied,
                 clean_v, corrupt_v)
