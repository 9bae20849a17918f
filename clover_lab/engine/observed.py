"""Hooks inside the model on the static path (issue 24): which layers a step keeps static.

- **Observers read after the step.** When every model hook that applies is an observer
  (``hooks.registry.observer``: the notebook views) on a point the static step records (a point
  declared with ``recorded`` fields, ``hooks/points.py``: the routers' decisions for ExpertView,
  the GDN states and history weights for MemoryView), the whole step stays static (compiled, or
  a CUDA graph): the layers write what those events carry into the step's outputs
  (``ForwardContext.record``: device tensors the step produces anyway; no host sync, no hook
  call inside the step), and :func:`fire_observed` fires the events after the step, before its
  cache writes land, in the forward's order, over exactly the rows the eager forward would have
  run, with the host's fields (layer, lengths, positions) as the eager forward has them. A hook
  cannot tell them from the eager forward's events.
- **Live layers.** Any other hook runs live in the eager layer forward, on the forward's own
  context (so its events are the eager forward's); on compiled steps the layers between live
  layers stay compiled segments (``StepGraphs.split_step``). :func:`live_layers` names them.
"""
from __future__ import annotations

import torch

from clover_lab.hooks import points
from clover_lab.model.context import row_positions


def observed_points(hooks) -> frozenset | None:
    """The model points with hooks (``hooks``: a HookView) when every hook on them observes and
    the static step records them (their declarations' ``recorded`` fields), else None."""
    names = hooks.model_points()
    if names and all(_recorded(n) and hooks.observers_only(n) for n in names):
        return frozenset(names)
    return None


def _recorded(name: str) -> tuple[str, ...]:
    point = points.declaration(name)
    return () if point is None else point.recorded


def live_layers(names) -> tuple[int, ...]:
    """The layers holding these hooked points, sorted (``final_norm.output`` is in the tail)."""
    return tuple(sorted({layer for layer in (points.parse(n)[0] for n in names) if layer is not None}))


def describe(names, limit: int = 3) -> str:
    """``layers.2.moe.route`` or ``layers.0.moe.route, ... and 5 more points``."""
    names = list(names)
    more = f" and {len(names) - limit} more points" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _rows(t, batch: int, per_row: int, index: list[int] | None):
    """Rows ``index`` of a tensor laid out over ``batch`` rows of ``per_row`` entries each; one
    held once for every row (one row's coreset [E]) or None as it is."""
    if index is None or batch == 1 or not isinstance(t, torch.Tensor) or t.shape[0] != batch * per_row:
        return t
    return t.view(batch, per_row, *t.shape[1:])[torch.tensor(index, device=t.device)].reshape(-1, *t.shape[1:])


def fire_observed(model, hooks, observations: list, lengths: list[int], c: int, index: list[int] | None,
                  where) -> None:
    """Fire the events a static step recorded (``ForwardContext.record``) of its batch rows
    ``index`` (None: every row; padding and rows sitting out are left out), with ``where`` theirs:
    ``lengths`` the batch rows' committed lengths before the step, ``c`` its commit rows."""
    batch = len(lengths)
    rows = lengths if index is None else [lengths[i] for i in index]
    host = dict(length=max(rows) + c, row_lengths=[n + c for n in rows] if len(set(rows)) > 1 else None)
    positions = None  # the eager forward's, [c + m] or [R, c + m]: made once a point does not record its own
    for point, mode, lo, hi, flat, fields in observations:
        layer = points.parse(point)[0]
        data = {k: _rows(fields[k], batch, hi - lo if flat else 1, index) for k in _recorded(point)}
        if "positions" not in data:
            if positions is None:
                device = next(t.device for t in data.values() if isinstance(t, torch.Tensor))
                positions = row_positions(rows, max(o[3] for o in observations), device)
            data["positions"] = positions[..., lo:hi]
        # each event class takes the host fields it has (a route event its router's rule)
        host.update(layer=layer, mode=mode, select=model.model.layers[layer].mlp.gate.select)
        hooks.fire(point, points.rebuild(point, {**host, **data}, where))


def copied(observations: list) -> list:
    """A replayed CUDA graph's observations as fresh tensors (the next replay overwrites its own)."""
    return [(*o[:-1], {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in o[-1].items()})
            for o in observations]
