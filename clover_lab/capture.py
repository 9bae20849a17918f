"""Record chosen hook points over whole generations, tagged with block and step (the generation
counterpart of TransformerLens' ``run_with_cache``).

    with engine.capture(["layers.*.moe.route", "denoise.step"]) as cap:
        engine.generate(prompt)
    cap["layers.3.moe.route"]          # records of one point, in firing order
    cap["layers.*.moe.route"]          # records of every matching point
    cap.by_block("denoise.step")       # {block: [records]}

Tensors stay on the model's device (no copies to the host, no synchronisation) unless
``to="cpu"`` is given. Tensors that the engine or a later hook may change in place (the GDN
state and ring, the canvas) are cloned; the rest are fresh per event and kept by reference.
The hooks are removed when the ``with`` block ends, also on an exception.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .generate import Engine


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
    def __init__(self, engine: "Engine", points: str | Iterable[str], to: str | torch.device | None = None):
        self.engine = engine
        self.patterns = [points] if isinstance(points, str) else list(points)
        if not self.patterns:
            raise ValueError("capture: name at least one hook point or pattern")
        self.to = None if to is None else torch.device(to)
        self.records: list[Record] = []
        self._handle = None
        hooks = engine.model.hooks
        self._names = sorted({name for p in self.patterns for name in hooks.resolve(p)}, key=hooks.points.index)

    # ---------------------------------------------------------------- registration
    def __enter__(self) -> "Capture":
        hooks = self.engine.model.hooks
        mapping = {name: self._recorder(name) for name in self._names}
        self._handle = hooks.add_many(mapping)
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
        where = self.engine._where
        kind = name.rsplit(".", 2)[-2:]
        t = self._t

        def add(block, step, data):
            self.records.append(Record(name, where.run, where.phase, block, step, data))

        if name == "denoise.step":
            def record(ev):
                add(ev.block, ev.step, dict(canvas=t(ev.canvas, clone=True), masked=list(ev.masked),
                                            candidates=t(ev.candidates), confidences=t(ev.confidences),
                                            unmask=list(ev.unmask), time=ev.time))
        elif name == "block.commit":
            def record(ev):
                add(ev.block, None, dict(tokens=list(ev.tokens), steps=ev.steps, start=ev.start, time=ev.time))
        elif kind == ["moe", "route"]:
            def record(ev):
                if ev.mode == "commit":
                    block, step = where.commit_block, None
                else:
                    block, step = where.block, where.step
                add(block, step, dict(layer=ev.layer, mode=ev.mode, positions=t(ev.positions),
                                      router_probs=t(ev.router_probs), expert_ids=t(ev.expert_ids),
                                      weights=t(ev.weights)))
        elif kind == ["gdn", "preview"]:
            def record(ev):
                add(where.block, where.step, dict(layer=ev.layer, positions=t(ev.positions),
                                                  history_weights=t(ev.history_weights),
                                                  history_reads=t(ev.history_reads)))
        elif kind == ["gdn", "state"]:
            def record(ev):
                add(where.commit_block, None, dict(layer=ev.layer, state=t(ev.state, clone=True),
                                                   ring=t(ev.ring, clone=True), length=ev.length))
        else:  # a point added later: keep the event's public fields
            def record(ev):
                data = {k: (t(v) if isinstance(v, torch.Tensor) else v) for k, v in vars(ev).items()
                        if not k.startswith("_")}
                add(where.block, where.step, data)
        return record

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
