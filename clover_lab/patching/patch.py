"""Recording a run's residual stream (``Source``) and running another with values taken from it
at chosen sites (``patch``)."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Iterable

import torch

from clover_lab.engine.requests import is_batch
from clover_lab.errors import InputError
from clover_lab.hooks import points as P
from clover_lab.hooks.events import ResidualEvent


def one_prompt(prompt, what: str) -> None:
    """Refuse a batch where ``what`` reads one generation's positions and rows."""
    if is_batch(prompt):
        raise InputError(f"{what} reads one generation, and was given a batch of {len(prompt)} prompts; run it "
                         f"once per prompt (the rows of a batch share a forward but not positions)")


def _coordinate(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise InputError(f"Site {name}={value!r}: expected a block/step number (an int >= 0) or None")
    return int(value)


@dataclass(frozen=True)
class Site:
    """Where to patch: one residual point (``"layers.2.output"``, ``"final_norm.output"``), the
    rows of block ``block`` at denoising step ``step`` (``step`` None: the block's commit rows;
    both None: the prompt's prefill), at these absolute ``positions`` (None: every row there)."""

    point: str
    block: int | None
    step: int | None
    positions: tuple[int, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.point, str) or not P.is_residual(self.point):
            raise InputError(f"Site: {self.point!r} is not a residual-stream point (layers.{{i}}.input, "
                             f".attn.output, .gdn.output, .moe.output, .output or final_norm.output)")
        object.__setattr__(self, "block", _coordinate("block", self.block))
        object.__setattr__(self, "step", _coordinate("step", self.step))
        if self.block is None and self.step is not None:
            raise InputError(f"Site step={self.step} without a block: a denoising step belongs to a block")
        if self.positions is not None:
            given = self.positions
            if isinstance(given, (str, bytes)) or not isinstance(given, (list, tuple, range, torch.Tensor)):
                raise InputError(f"Site positions={given!r}: expected a list or tuple of absolute positions "
                                 f"(e.g. ({given!r},)), or None for every row")
            given = given.tolist() if isinstance(given, torch.Tensor) else list(given)
            if not given or not all(isinstance(p, numbers.Integral) and not isinstance(p, bool) and p >= 0
                                    for p in given):
                raise InputError(f"Site positions={self.positions!r}: expected one or more positions (ints >= 0)")
            object.__setattr__(self, "positions", tuple(int(p) for p in given))


class Source:
    """Run A's residual values by (point, block, step) and position; ``result`` its generation."""

    def __init__(self, records, result=None, prompt_ids=None):
        self.result = result
        self.prompt_ids = prompt_ids
        self._rows: dict[tuple, dict[int, tuple[torch.Tensor, int]]] = {}
        records = list(records)
        batched = next((rec for rec in records if rec.rows is not None), None)
        if batched is not None:  # several rows' positions: patching by position would mix them
            raise InputError(f"Source: the records are of a batched generation (rows {list(batched.rows)}); "
                             f"record one prompt at a time (patching.record(engine, prompt))")
        for rec in records:
            if "value" not in rec.data:
                continue
            rows = self._rows.setdefault((rec.point, rec.block, rec.step), {})
            for i, p in enumerate(rec["positions"].tolist()):
                rows[p] = (rec["value"], i)

    def rows(self, point: str, block: int | None, step: int | None) -> dict[int, tuple[torch.Tensor, int]]:
        """position -> (value [B, T, H], row) of one forward part; empty where A had none."""
        return self._rows.get((point, block, step), {})

    def value(self, point: str, block: int | None, step: int | None, position: int) -> torch.Tensor:
        """A's value [B, H] at one site and position (KeyError naming it when A has none)."""
        rows = self.rows(point, block, step)
        if position not in rows:
            raise KeyError(f"the source run has no {point} value at block {block}, step {step}, position {position}")
        v, i = rows[position]
        return v[:, i]

    def keys(self) -> list[tuple]:
        return list(self._rows)

    @property
    def points(self) -> list[str]:
        return sorted({k[0] for k in self._rows})


def residual_points(engine, pattern: str | Iterable[str] | None = None) -> list[str]:
    """The residual points of an engine's model, all of them or those matching ``pattern``(s)."""
    hooks = engine.model.hooks
    names = [p for p in hooks.points if P.is_residual(p)]
    if pattern is None:
        return names
    patterns = [pattern] if isinstance(pattern, str) else list(pattern)
    chosen = {n for pat in patterns for n in hooks.resolve(pat)}
    bad = sorted(n for n in chosen if not P.is_residual(n))
    if bad:
        raise InputError(f"patching records residual-stream points only; not: {', '.join(bad)}")
    return [n for n in names if n in chosen]


def record(engine, prompt, points: str | Iterable[str] | None = None, **generate) -> Source:
    """Run A: generate ``prompt`` recording ``points`` (default: every residual point)."""
    one_prompt(prompt, "record")
    with engine.capture(residual_points(engine, points)) as cap:
        result = engine.generate(prompt, **generate)
    return Source(cap.records, result, engine.encode(prompt))


@dataclass
class PatchRun:
    """Run B's result and the patches that took effect: (site, positions patched) per event."""

    result: object
    applied: list[tuple[Site, list[int]]] = field(default_factory=list)


class _Patcher:
    """The hook of one point: replaces the rows a site names with the source's values."""

    def __init__(self, source: Source, sites: list[Site] | None, applied: list):
        self.source, self.sites, self.applied = source, sites, applied

    def __call__(self, ev: ResidualEvent) -> None:
        src = self.source.rows(ev.point, ev.block, ev.step)
        if self.sites is None:  # every row the source has
            targets = [(None, None)] if src else []
        else:
            targets = [(s, s.positions) for s in self.sites if (s.block, s.step) == (ev.block, ev.step)]
        if not targets:
            return
        positions = ev.positions.tolist()
        rows, values = [], []
        for site, wanted in targets:
            if wanted is not None and (missing := [p for p in wanted if p in positions and p not in src]):
                raise InputError(f"patch {site}: the source run has no {ev.point} value at block {ev.block}, "
                                 f"step {ev.step}, positions {missing}")
            done = []
            for i, p in enumerate(positions):
                if p in src and (wanted is None or p in wanted):
                    v, j = src[p]
                    rows.append(i)
                    values.append(v[:, j])
                    done.append(p)
            if done:
                self.applied.append((site or Site(ev.point, ev.block, ev.step), done))
        if rows:
            new = ev.value.clone()
            new[:, rows] = torch.stack(values, dim=1).to(new.dtype)
            ev.value = new


def patch_hooks(source: Source, sites: str | list[Site], applied: list) -> dict:
    """The hooks that patch ``sites`` ("all": every value the source holds) from ``source``. A
    site the source has no value for (a point it did not record, a block, step or position its
    run did not reach) is an error here, before any run, rather than a patch that does nothing."""
    if isinstance(sites, str):
        if sites != "all":
            raise InputError(f"sites must be a list of Site or 'all', got {sites!r}")
        return {point: _Patcher(source, None, applied) for point in source.points}
    if isinstance(sites, Site) or not isinstance(sites, (list, tuple)):
        raise InputError(f"sites must be a list of Site or 'all', got {type(sites).__name__}")
    sites = list(sites)
    for s in sites:
        if not isinstance(s, Site):
            raise InputError(f"sites must be Site objects, got {type(s).__name__}")
        check_site(source, s)
    by_point: dict[str, list[Site]] = {}
    for s in sites:
        by_point.setdefault(s.point, []).append(s)
    return {point: _Patcher(source, group, applied) for point, group in by_point.items()}


def check_site(source: Source, site: Site) -> None:
    """``site`` names values ``source`` holds: its point, its (block, step) and its positions."""
    if site.point not in source.points:
        raise InputError(f"patch {site}: the source run did not record {site.point}; it recorded "
                         f"{', '.join(source.points) or 'nothing'}")
    rows = source.rows(site.point, site.block, site.step)
    if not rows:
        where = sorted({(b, s) for (p, b, s) in source.keys() if p == site.point},
                       key=lambda k: (-1 if k[0] is None else k[0], -1 if k[1] is None else k[1]))
        raise InputError(f"patch {site}: the source run has no {site.point} at block {site.block}, step "
                         f"{site.step}; its (block, step) pairs are {_span(where)}")
    if site.positions is not None and (missing := [p for p in site.positions if p not in rows]):
        raise InputError(f"patch {site}: the source run has no {site.point} value at block {site.block}, step "
                         f"{site.step}, positions {missing}; it has positions {min(rows)}..{max(rows)}")


def _span(pairs: list) -> str:
    shown = ", ".join(f"({b}, {s})" for b, s in pairs[:8])
    return shown + (f", ... ({len(pairs)} in all)" if len(pairs) > 8 else "")


def check_source_prompt(engine, prompt, source: Source) -> None:
    """Patching by absolute position needs run B's prompt as long as run A's."""
    if source.prompt_ids is None:
        return
    b = engine.encode(prompt)
    if len(b) != len(source.prompt_ids):
        raise InputError(f"patch: the source was recorded on a prompt of {len(source.prompt_ids)} tokens and "
                         f"this prompt has {len(b)}; positions are absolute, so the prompts must have the "
                         f"same length")


def patch(engine, prompt, source: Source, sites: str | list[Site] = "all", **generate) -> PatchRun:
    """Run B: generate ``prompt`` with the values at ``sites`` taken from ``source`` (run A).
    ``sites="all"`` patches every value A recorded: with A's own prompt and settings, every
    token comes out identical (the null patch). Run B's prompt must be as long as A's."""
    one_prompt(prompt, "patch")
    if not isinstance(source, Source):
        raise InputError(f"patch: source must be a Source (patching.record(...)), got {type(source).__name__}")
    check_source_prompt(engine, prompt, source)
    applied: list = []
    with engine.hooks(patch_hooks(source, sites, applied)):
        result = engine.generate(prompt, **generate)
    return PatchRun(result, applied)
