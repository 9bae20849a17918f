"""Firing a residual-stream point (``layers.{i}.input`` ... ``final_norm.output``): one event per
part of the forward (its commit rows, then its preview rows), each of which a hook may replace.

Callers look the point up first (``ctx.hooks and hooks.active(name)``), so with nothing attached
a point costs one dict lookup and this module is never entered."""
from __future__ import annotations

import torch

from clover_lab.hooks.events import ResidualEvent
from clover_lab.hooks.registry import HookRegistry
from clover_lab.model.context import ForwardContext


def fire_residual(hooks: HookRegistry, name: str, layer: int | None, x: torch.Tensor,
                  ctx: ForwardContext) -> torch.Tensor:
    """``x`` [B, c + m, H] over the rows of ``ctx`` -> the same, with the parts hooks replaced.
    In-place edits of ``event.value`` reach ``x`` directly (a part is a view of it)."""
    parts, replaced = [], False
    for mode, lo, hi in (("commit", 0, ctx.c), ("preview", ctx.c, ctx.c + ctx.m)):
        if hi > lo:
            event = ResidualEvent(name, layer, mode, ctx.positions[..., lo:hi], x[:, lo:hi], where=ctx.where)
            hooks.fire(name, event)
            parts.append(event.value)
            replaced |= event.replaced
    if not replaced:
        return x
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def fire_head_rows(hooks: HookRegistry, name: str, rows: torch.Tensor, mode: str, positions: torch.Tensor,
                   ctx: ForwardContext) -> torch.Tensor:
    """The final norm's output for the rows of one mode the LM head reads (``positions`` theirs)."""
    event = ResidualEvent(name, None, mode, positions, rows, where=ctx.where)
    hooks.fire(name, event)
    return event.value
