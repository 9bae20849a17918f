"""Records of hook points and the reading API shared by a live ``Capture`` and a saved ``Trace``."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from clover_lab.hooks.events import Where


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
    where: Where | None = field(default=None, repr=False)  # the whole forward's (a fused one: both blocks)

    def __getitem__(self, key):
        return self.data[key]

    @property
    def rows(self) -> tuple[int, ...] | None:
        """The request rows of a batched generation the event's batch dimension holds (None: single)."""
        return None if self.where is None or self.where.rows is None else tuple(self.where.rows)

    @property
    def row(self) -> int | None:
        """The request row a step or commit record of a batched generation concerns."""
        rows = self.rows
        return rows[0] if rows is not None and len(rows) == 1 else None

    def __repr__(self):
        keys = ", ".join(self.data)
        return f"Record({self.point!r}, run={self.run}, phase={self.phase!r}, block={self.block}, step={self.step}, [{keys}])"


class RecordSet:
    """Reading records by point (name or fnmatch pattern), block and step. Subclasses set
    ``records`` (firing order) and ``points`` (the concrete point names they hold)."""

    records: list[Record]
    points: list[str]

    def __getitem__(self, name: str) -> list[Record]:
        names = self.points
        if name in names:
            return [r for r in self.records if r.point == name]
        hits = set(fnmatch.filter(names, name))
        if not hits:
            raise KeyError(f"{type(self).__name__.lower()} has no point matching {name!r}; it records {', '.join(names)}")
        return [r for r in self.records if r.point in hits]

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

    @property
    def runs(self) -> list[int]:
        """The generations recorded, in order."""
        return sorted({r.run for r in self.records})
