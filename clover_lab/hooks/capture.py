"""Record chosen hook points over whole generations, tagged with block and step (the generation
counterpart of TransformerLens' ``run_with_cache``).

    with engine.capture(["layers.*.moe.route", "denoise.step"]) as cap:
        engine.generate(prompt)
    cap["layers.3.moe.route"]          # records of one point, in firing order
    cap["layers.*.moe.route"]          # records of every matching point
    cap.by_block("denoise.step")       # {block: [records]}

A capture is scoped like ``engine.hooks(...)``: it records the generations started inside its
``with`` block in this thread or context, not those other threads run meanwhile.

Tensors stay on the model's device (no copies to the host, no synchronisation) unless
``to="cpu"`` is given. Tensors that the engine or a later hook may change in place (the GDN
state and ring, the canvas) are cloned; the rest are fresh per event and kept by reference.
The hooks are removed when the ``with`` block ends, also on an exception.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Iterable

import torch

from . import points as P
from .registry import HookRegistry


@dataclass
class Record:
    """One firing of a point. ``phase``: "prefill" or "decode"; ``block`` / ``step`` where the
    engine was (commit-mode model events carry the block being committed and ``step`` None;
    prefill events carry neither); ``run`` counts generations on the engine."""

    point: str
    run: int
    phase: str | None
    block: int | None
    step: int | None
    data: dict = field(repr=False)

    def __getitem__(self, key):
        return self.data[key]

    def __repr__(self):
        keys = ", ".join(self.data)
        return f"Record({self.point!r}, run={self.run}, phase={self.phase!r}, block={self.block}, step={self.step}, [{keys}])"


class Capture:
    """Records the points matching ``points`` on ``hooks`` (an engine's registry) over the
    generations started in this thread or context while entered."""

    def __init__(self, hooks: HookRegistry, points: str | Iterable[str], to: str | torch.device | None = None):
        self.hooks = hooks
        self.patterns = [points] if isinstance(points, str) else list(points)
        if not self.patterns:
            raise ValueError("capture: name at least one hook point or pattern")
        try:
            self.to = None if to is None else torch.device(to)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"capture: to={to!r} is not a device (cpu, cuda, ...)") from None
        self.records: list[Record] = []
        self._handle = None
        self._names = sorted({name for p in self.patterns for name in hooks.resolve(p)}, key=hooks.points.index)

    # ---------------------------------------------------------------- registration
    def __enter__(self) -> "Capture":
        self._handle = self.hooks.open_scope({name: self._recorder(name) for name in self._names})
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _t(self, x: torch.Tensor, clone: bool = False) -> torch.Tensor:
        if self.to is not None and x.device != self.to:
            return x.to(self.to)
        return x.clone() if clone else x

    def _recorder(self, name: str):
        """A hook that records one event of point ``name``: what it keeps, per kind of point."""
        fields = _FIELDS.get(P.parse(name)[1])

        def record(ev):
            data = self._fields(ev, fields)
            self.records.append(Record(name, ev.where.run, ev.where.phase, ev.block, ev.step, data))

        return record

    def _fields(self, ev, fields) -> dict:
        if fields is None:  # a point added later: keep the event's public fields
            fields = {k: False for k in vars(ev) if not k.startswith("_") and k != "where"}
        out = {}
        for key, clone in fields.items():
            value = getattr(ev, key)
            if isinstance(value, torch.Tensor):
                value = self._t(value, clone)
            elif isinstance(value, list):
                value = list(value)
            out[key] = value
        return out

    # ---------------------------------------------------------------- reading
    @property
    def points(self) -> list[str]:
        """The concrete points being recorded."""
        return list(self._names)

    def __getitem__(self, name: str) -> list[Record]:
        if name in self._names:
            return [r for r in self.records if r.point == name]
        names = set(fnmatch.filter(self._names, name))
        if not names:
            raise KeyError(f"capture has no point matching {name!r}; it records {', '.join(self._names)}")
        return [r for r in self.records if r.point in names]

    def __len__(self) -> int:
        return len(self.records)

    def by_block(self, name: str) -> dict[int | None, list[Record]]:
        out: dict[int | None, list[Record]] = {}
        for r in self[name]:
            out.setdefault(r.block, []).append(r)
        return out

    def by_step(self, name: str) -> dict[tuple[int | None, int | None], list[Record]]:
        out: dict[tuple, list[Record]] = {}
        for r in self[name]:
            out.setdefault((r.block, r.step), []).append(r)
        return out

    def clear(self) -> None:
        self.records.clear()


# point kind -> the event fields a record keeps, True where the tensor must be cloned: the engine
# or a later hook may change it in place (the GDN state and ring, the canvas)
_FIELDS = {
    P.DENOISE_STEP: dict(canvas=True, masked=False, candidates=False, confidences=False, unmask=False, time=False),
    P.BLOCK_COMMIT: dict(tokens=False, steps=False, start=False, time=False),
    P.MOE_ROUTE: dict(layer=False, mode=False, positions=False, router_probs=False, expert_ids=False, weights=False),
    P.GDN_PREVIEW: dict(layer=False, positions=False, history_weights=False, history_reads=False),
    P.GDN_STATE: dict(layer=False, state=True, ring=True, length=False),
}
