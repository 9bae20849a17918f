"""Hook points: named places in a forward or a generation where a function can observe and
intervene.

Names follow one scheme: ``layers.{i}.<module>.<point>`` per layer and ``<stage>.<point>`` for
the engine (see section 5 of the architecture spec). Register by exact name or by an fnmatch
pattern (``layers.*.moe.route``). A hook receives one event object. With no hook attached a
point costs one dict lookup: no copies, no device-to-host synchronisation.
"""
from __future__ import annotations

import fnmatch
import itertools
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

ENGINE_POINTS = ("denoise.step", "block.commit")


class HookError(RuntimeError):
    """A hook raised; the message names the hook point. The original exception is ``__cause__``."""

    def __init__(self, point: str, error: BaseException):
        super().__init__(f"hook on {point!r} raised {type(error).__name__}: {error}")
        self.point = point


class StopGeneration(Exception):
    """Raise from any hook (or call ``event.stop()`` on engine events) to end a generation cleanly."""


class HookHandle:
    """Removes exactly the registrations it was returned for."""

    def __init__(self, registry: "HookRegistry", keys: list[tuple[str, int]]):
        self._registry = registry
        self._keys = keys

    def remove(self) -> None:
        for name, ident in self._keys:
            fns = self._registry._fns.get(name)
            if fns is not None:
                fns.pop(ident, None)
                if not fns:
                    del self._registry._fns[name]
        self._keys = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


class HookRegistry:
    def __init__(self, points: Iterable[str]):
        self.points: tuple[str, ...] = tuple(points)
        self._fns: dict[str, dict[int, Callable]] = {}
        self._ids = itertools.count()

    def resolve(self, pattern: str) -> list[str]:
        """The known points a name or pattern refers to; unknown names are an error."""
        if pattern in self.points:
            return [pattern]
        hits = fnmatch.filter(self.points, pattern)
        if not hits:
            sample = ", ".join(self.points[:6]) + (", ..." if len(self.points) > 6 else "")
            raise KeyError(f"unknown hook point {pattern!r}; known points look like: {sample}")
        return hits

    def add(self, pattern: str, fn: Callable) -> HookHandle:
        if not callable(fn):
            raise TypeError(f"hook for {pattern!r} must be callable, got {type(fn).__name__}")
        keys = []
        for name in self.resolve(pattern):
            ident = next(self._ids)
            self._fns.setdefault(name, {})[ident] = fn
            keys.append((name, ident))
        return HookHandle(self, keys)

    def add_many(self, hooks: dict[str, Callable | list[Callable]]) -> HookHandle:
        handles = []
        try:
            for pattern, fns in hooks.items():
                for fn in (fns if isinstance(fns, (list, tuple)) else [fns]):
                    handles.append(self.add(pattern, fn))
        except Exception:
            for h in handles:
                h.remove()
            raise
        return HookHandle(self, [k for h in handles for k in h._keys])

    @contextmanager
    def scoped(self, hooks: dict[str, Callable | list[Callable]]):
        handle = self.add_many(hooks)
        try:
            yield handle
        finally:
            handle.remove()

    def active(self, name: str) -> bool:
        return name in self._fns

    def fire(self, name: str, event) -> None:
        for fn in list(self._fns.get(name, {}).values()):
            try:
                fn(event)
            except StopGeneration:
                raise
            except Exception as e:  # noqa: BLE001 - re-raised with the point's name
                raise HookError(name, e) from e

    def clear(self) -> None:
        self._fns.clear()

    def attached(self) -> dict[str, int]:
        return {name: len(fns) for name, fns in self._fns.items()}

    def model_hooks_attached(self) -> bool:
        """True when a hook sits on a point inside the model's forward (not an engine point)."""
        return any(name not in ENGINE_POINTS for name in self._fns)


# --------------------------------------------------------------------------- model events
@dataclass
class RouteEvent:
    """After the router of one MoE layer, for one part (commit or preview) of a forward.

    ``router_probs`` [T, E] fp32 (softmax over all experts), ``expert_ids`` [T, k] and ``weights``
    [T, k] (renormalised over the top-k). ``ban`` and ``force`` change what the layer computes.
    """

    layer: int
    mode: str  # "commit" | "preview"
    positions: torch.Tensor  # [T] absolute positions of the routed tokens (flattened over the batch)
    router_probs: torch.Tensor
    expert_ids: torch.Tensor
    weights: torch.Tensor
    selectable: torch.Tensor | None = field(default=None, repr=False)  # [E] bool (coreset), None = all

    @property
    def top_k(self) -> int:
        return self.expert_ids.shape[-1]

    def _reroute(self, allowed: torch.Tensor) -> None:
        if int(allowed.sum()) < self.top_k:
            raise ValueError(f"layer {self.layer}: fewer than top_k={self.top_k} experts left to route to")
        probs = self.router_probs.masked_fill(~allowed, -1.0)
        top, ids = probs.topk(self.top_k, dim=-1)
        self.expert_ids = ids
        self.weights = (top / top.sum(-1, keepdim=True)).to(self.weights.dtype)

    def ban(self, expert_ids) -> None:
        """Route around these experts: each token takes its top-k among the others, renormalised."""
        E = self.router_probs.shape[-1]
        ids = torch.as_tensor(expert_ids, dtype=torch.long, device=self.router_probs.device).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= E):
            raise ValueError(f"ban: expert ids must be in [0, {E}), got {ids.tolist()}")
        allowed = torch.ones(E, dtype=torch.bool, device=ids.device) if self.selectable is None else self.selectable.clone()
        allowed[ids] = False
        self.selectable = allowed
        self._reroute(allowed)

    def force(self, expert_ids, weights=None) -> None:
        """Use exactly these experts: ids [k] (every token) or [T, k]; weights default to the
        router's probabilities of those experts, renormalised."""
        T, E = self.router_probs.shape
        ids = torch.as_tensor(expert_ids, dtype=torch.long, device=self.router_probs.device)
        ids = ids.expand(T, -1) if ids.dim() == 1 else ids
        if ids.shape[0] != T or (ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= E)):
            raise ValueError(f"force: expected expert ids [k] or [{T}, k] in [0, {E}), got shape {tuple(ids.shape)}")
        if weights is None:
            w = self.router_probs.gather(-1, ids)
            w = w / w.sum(-1, keepdim=True).clamp_min(1e-20)
        else:
            w = torch.as_tensor(weights, dtype=torch.float32, device=ids.device).expand(ids.shape)
        self.expert_ids = ids.contiguous()
        self.weights = w.to(self.weights.dtype).contiguous()


@dataclass
class GDNPreviewEvent:
    """In a preview of one GDN layer: how much each block token leans on the compressed memory."""

    layer: int
    positions: torch.Tensor  # [m] absolute positions of the block
    history_weights: torch.Tensor  # [B, m, H_v] p_tH, fp32
    history_reads: torch.Tensor  # [B, m, H_v, d_v] h_t = (q_t / sqrt(d_k)) @ S0, fp32


@dataclass
class GDNStateEvent:
    """After a commit advanced one GDN layer. Edit ``state`` in place or assign a new tensor
    of the same shape; what it holds afterwards is what the cache keeps."""

    layer: int
    state: torch.Tensor  # [B, H_v, d_k, d_v] fp32
    ring: torch.Tensor  # [B, conv_dim, K-1]
    length: int  # committed length after this commit
