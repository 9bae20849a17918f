"""Hooks inside the model on the static path (issue 24): which layers a step keeps static.

- **Observers read after the step.** When every model hook that applies is an observer
  (``hooks.registry.observer``: the notebook views) on a point the static step records
  (``RECORDED``: the routers' decisions), the whole step stays static (compiled, or a CUDA graph):
  the layers append what those events carry to ``ForwardContext.observations`` (device tensors
  the step produces anyway; no host sync, no hook call inside the step), and :func:`fire_observed`
  fires the events after the step, before its cache writes land, in the forward's order, over
  exactly the rows the eager forward would have run. A hook cannot tell them from the eager
  forward's events.
- **Live layers.** Any other hook runs live in the eager layer forward, on the forward's own
  context (so its events are the eager forward's); on compiled steps the layers between live
  layers stay compiled segments (``StepGraphs.split_step``). :func:`live_layers` names them.
"""
from __future__ import annotations

import torch

from ..hooks import points
from ..hooks.events import RouteEvent

RECORDED = (points.MOE_ROUTE,)  # the point kinds whose observers a static step serves


def observed_points(hooks) -> frozenset | None:
    """The model points with hooks (``hooks``: a HookView) when every hook on them observes and
    the static step records them, else None."""
    names = hooks.model_points()
    if names and all(points.parse(n)[1] in RECORDED and hooks.observers_only(n) for n in names):
        return frozenset(names)
    return None


def live_layers(names) -> tuple[int, ...]:
    """The layers holding these hooked points, sorted (``final_norm.output`` is in the tail)."""
    return tuple(sorted({layer for layer in (points.parse(n)[0] for n in names) if layer is not None}))


def describe(names, limit: int = 3) -> str:
    """``layers.2.moe.route`` or ``layers.0.moe.route, ... and 5 more points``."""
    names = list(names)
    more = f" and {len(names) - limit} more points" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _rows(t: torch.Tensor, batch: int, per_row: int, index: list[int] | None) -> torch.Tensor:
    """Rows ``index`` of a tensor flattened over ``batch`` rows of ``per_row`` each."""
    if index is None:
        return t
    return t.view(batch, per_row, *t.shape[1:])[torch.tensor(index, device=t.device)].reshape(-1, *t.shape[1:])


def fire_observed(model, hooks, observations: list, batch: int, index: list[int] | None, where) -> None:
    """Fire the events a static step of ``batch`` rows recorded, for its batch rows ``index``
    (None: every row; padding and rows sitting out are left out), with ``where`` theirs."""
    for point, mode, lo, hi, positions, probs, ids, weights, allowed in observations:
        layer = points.parse(point)[0]
        if allowed is not None and allowed.dim() == 2:
            allowed = _rows(allowed, batch, hi - lo, index)
        event = RouteEvent(layer, mode, _rows(positions[:, None], batch, hi - lo, index)[:, 0],
                           *(_rows(t, batch, hi - lo, index) for t in (probs, ids, weights)), allowed,
                           select=model.model.layers[layer].mlp.gate.select, where=where)
        hooks.fire(point, event)
