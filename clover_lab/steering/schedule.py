"""Steering schedules as data: which direction is added to the residual stream, how strongly, and
where along the denoising axis (layers, blocks, denoising steps, block positions, and which rows
of a forward: the prompt's prefill, a block's commit, or its previews).

    early = Steer(direction, 8.0, layers=2, steps="0:2")            # steps 0-1 of every block
    late = Steer(direction, 8.0, layers=2, steps="3:")              # from step 3 on
    some = Steer(direction, 8.0, layers=[1, 2], blocks=[2, 3], positions="masked")
    plan = Schedule([early, some], name="docstrings")
    plan.save("runs/plan"); Schedule.load("runs/plan") == plan      # round-trips
    print(plan)                                                     # one line per intervention

A schedule does nothing by itself; ``steering.hooks(engine, plan)`` turns it into hooks for
``engine.hooks(...)`` and ``steering.steer(engine, prompt, plan)`` runs one request with it
(``steering/steer.py``).
"""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from clover_lab.errors import InputError
from clover_lab.hooks import points as P
from clover_lab.writes import FileSet, naming, refuse_foreign, refuse_unfinished

FORMAT = "clover_lab.steering_schedule"
VERSION = 1
META_FILE, TENSOR_FILE = "schedule.json", "directions.safetensors"
# the rows of a forward a steer may add to: the prompt's prefill, a finished block's commit (an AR
# token's forward), a block's denoising previews
PARTS = ("prompt", "commit", "preview")
POSITIONS = ("all", "masked", "unmasked")  # or a tuple of block positions


class ScheduleError(InputError):
    """A saved schedule that cannot be read (missing or foreign files, a damaged field); the message
    names the file and the field."""


def residual_kinds() -> tuple[str, ...]:
    """The per-layer residual points a steer may add to: ``input``, ``gdn.output`` / ``attn.output``,
    ``moe.output``, ``output``."""
    return tuple(p.kind for p in P.DECLARED.values() if p.residual and p.per_layer)


class Span:
    """A set of block or step indices: every one, ``start:stop`` (half-open; ``stop`` None: from
    ``start`` on) or a list. Given as None / "all", an int, a list or range of ints, a slice or a
    string ``"a:b"`` / ``"a:"`` / ``":b"``."""

    __slots__ = ("start", "stop", "only")

    def __init__(self, start: int = 0, stop: int | None = None, only: tuple[int, ...] | None = None):
        self.start, self.stop, self.only = start, stop, only

    @classmethod
    def parse(cls, value, name: str) -> "Span":
        if isinstance(value, Span):
            return value
        if value is None or value == "all":
            return cls()
        if isinstance(value, bool):
            raise InputError(f"{name}={value!r}: expected an int, a list of ints, 'a:b' or None (every one)")
        if isinstance(value, numbers.Integral):
            return cls(only=(_index(name, value),))
        if isinstance(value, slice):
            if value.step not in (None, 1):
                raise InputError(f"{name}={value!r}: a slice of {name} takes no step")
            return cls._bounds(name, value.start, value.stop)
        if isinstance(value, str):
            if value.count(":") != 1:
                raise InputError(f"{name}={value!r}: expected 'a:b', 'a:' (from a on) or ':b', or 'all'")
            a, b = (s.strip() for s in value.split(":"))
            try:
                start, stop = int(a) if a else None, int(b) if b else None
            except ValueError:
                raise InputError(f"{name}={value!r}: the bounds of 'a:b' are ints") from None
            return cls._bounds(name, start, stop)
        if isinstance(value, (list, tuple, range, torch.Tensor)):
            items = value.tolist() if isinstance(value, torch.Tensor) else list(value)
            if not items:
                raise InputError(f"{name} is empty: name at least one, or None for every one")
            return cls(only=tuple(sorted({_index(name, i) for i in items})))
        raise InputError(f"{name}={value!r}: expected an int, a list of ints, 'a:b' or None (every one), got "
                         f"{type(value).__name__}")

    @classmethod
    def _bounds(cls, name: str, start, stop) -> "Span":
        start = 0 if start is None else _index(name, start)
        stop = None if stop is None else _index(name, stop)
        if stop is not None and stop <= start:
            raise InputError(f"{name}={start}:{stop} is empty (the stop is not after the start)")
        return cls(start, stop)

    @property
    def every(self) -> bool:
        return self.only is None and self.start == 0 and self.stop is None

    def __contains__(self, i) -> bool:
        if i is None:
            return False
        if self.only is not None:
            return i in self.only
        return i >= self.start and (self.stop is None or i < self.stop)

    def to_json(self):
        if self.only is not None:
            return list(self.only)
        return "all" if self.every else f"{self.start}:{'' if self.stop is None else self.stop}"

    def __eq__(self, other) -> bool:
        return isinstance(other, Span) and self.to_json() == other.to_json()

    def __hash__(self):
        return hash(str(self.to_json()))

    def __str__(self) -> str:
        if self.only is not None:
            return ", ".join(map(str, self.only))
        if self.every:
            return "all"
        if self.stop is None:
            return f"{self.start} on"
        return f"{self.start}-{self.stop - 1}" if self.stop - self.start > 1 else str(self.start)

    def __repr__(self) -> str:
        return f"Span({self.to_json()!r})"


def _index(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise InputError(f"{name}: {value!r} is not an index (an int >= 0)")
    return int(value)


@dataclass(frozen=True, eq=False)
class Steer:
    """One intervention: ``coefficient * direction`` added to the residual stream at ``kind``
    (default ``output``: what a layer hands the next) of each of ``layers``, on the rows of the
    forward parts ``parts`` (default the previews only), in ``blocks`` at denoising ``steps`` (steps
    count within a block; commit and prompt rows have none, and only ``blocks`` selects among
    them; the prompt has no block either), at block ``positions``: "all", "masked" (still masked at
    that step), "unmasked", or a list of positions within the block (commit rows: the block's
    tokens; prompt rows: every one). ``direction``: a tensor [hidden] or a ``Direction``.
    ``clamp``: a ``FeatureClamp`` (``steering.clamp`` / ``steering.ablate``): instead of adding,
    set that feature's activation to ``coefficient`` on those rows (``direction`` its decoder row)."""

    direction: torch.Tensor
    coefficient: float = 1.0
    layers: tuple[int, ...] = ()
    kind: str = P.OUTPUT
    blocks: Span = Span()
    steps: Span = Span()
    positions: str | tuple[int, ...] = "all"
    parts: tuple[str, ...] = ("preview",)
    name: str = ""
    clamp: object = None

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - a frozen dataclass
        vector, name = self.direction, self.name
        if hasattr(vector, "vector") and not isinstance(vector, torch.Tensor):  # a Direction
            vector, name = vector.vector, name or vector.name
        if not isinstance(vector, torch.Tensor) or vector.dim() != 1 or not vector.is_floating_point() \
                or vector.numel() == 0:
            raise InputError(f"Steer: the direction must be a 1-D float tensor [hidden] (or a Direction), got "
                             f"{type(vector).__name__}{'' if not isinstance(vector, torch.Tensor) else list(vector.shape)}")
        vector = vector.detach().to("cpu", torch.float32).clone()
        if not bool(torch.isfinite(vector).all()):
            raise InputError("Steer: the direction holds NaN or inf")
        set_("direction", vector)
        set_("name", str(name or "direction"))
        c = self.coefficient
        if isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(c):
            raise InputError(f"Steer: coefficient={c!r}: expected a finite number")
        set_("coefficient", float(c))
        layers = self.layers
        layers = [layers] if isinstance(layers, numbers.Integral) and not isinstance(layers, bool) else layers
        if isinstance(layers, (str, bytes)) or not isinstance(layers, (list, tuple, range)) or not layers:
            raise InputError(f"Steer: layers={self.layers!r}: expected a layer number or a list of them")
        set_("layers", tuple(sorted({_index("Steer layers", i) for i in layers})))
        if self.kind not in residual_kinds():
            raise InputError(f"Steer: kind={self.kind!r} is not a residual point of a layer; one of "
                             f"{', '.join(residual_kinds())}")
        set_("blocks", Span.parse(self.blocks, "blocks"))
        set_("steps", Span.parse(self.steps, "steps"))
        set_("positions", _positions(self.positions))
        parts = (self.parts,) if isinstance(self.parts, str) else self.parts
        if not isinstance(parts, (list, tuple)) or not parts or any(p not in PARTS for p in parts):
            raise InputError(f"Steer: parts={self.parts!r}: expected one or more of {', '.join(PARTS)}")
        set_("parts", tuple(p for p in PARTS if p in parts))
        if self.clamp is not None and not callable(getattr(self.clamp, "apply", None)):
            raise InputError(f"Steer: clamp={self.clamp!r}: expected a FeatureClamp (steering.clamp, steering.ablate)")

    @property
    def vector(self) -> torch.Tensor:
        """coefficient * direction [hidden], float32 on the CPU."""
        return self.coefficient * self.direction

    def at(self, part: str, block: int | None, step: int | None) -> bool:
        """Whether this steer adds to the rows of ``part`` at (block, step)."""
        if part not in self.parts:
            return False
        if part == "prompt":
            return self.blocks.every
        return block in self.blocks and (part != "preview" or step in self.steps)

    def to_dict(self) -> dict:
        """Everything but the direction's values (saved beside it)."""
        return dict(name=self.name, coefficient=self.coefficient, layers=list(self.layers), kind=self.kind,
                    blocks=self.blocks.to_json(), steps=self.steps.to_json(),
                    positions=self.positions if isinstance(self.positions, str) else list(self.positions),
                    parts=list(self.parts), hidden=self.direction.numel(),
                    **({} if self.clamp is None else {"clamp": self.clamp.describe()}))

    def row(self) -> dict:
        """One line of a listing: what, how strongly, where."""
        positions = self.positions if isinstance(self.positions, str) else ", ".join(map(str, self.positions))
        return dict(direction=self.name, norm=round(float(self.direction.norm()), 4), coefficient=round(self.coefficient, 4),
                    layers=", ".join(map(str, self.layers)), point=self.kind, parts=" + ".join(self.parts),
                    blocks=str(self.blocks), steps=str(self.steps) if "preview" in self.parts else "-",
                    positions=positions)

    def __eq__(self, other) -> bool:
        return (isinstance(other, Steer) and self.to_dict() == other.to_dict()
                and torch.equal(self.direction, other.direction))

    def __hash__(self):
        return hash((self.name, self.coefficient, self.layers))

    def __repr__(self) -> str:
        r = self.row()
        return (f"Steer({r['direction']!r} x {r['coefficient']:g}, layers {r['layers']}, {r['parts']}, blocks "
                f"{r['blocks']}, steps {r['steps']}, positions {r['positions']})")


def _positions(value):
    if isinstance(value, str):
        if value not in POSITIONS:
            raise InputError(f"Steer: positions={value!r}: expected one of {', '.join(POSITIONS)} or a list of "
                             f"block positions")
        return value
    if isinstance(value, numbers.Integral):
        raise InputError(f"Steer: positions={value!r}: a list of block positions, e.g. ({value},)")
    if not isinstance(value, (list, tuple, range, torch.Tensor)) or not len(value):
        raise InputError(f"Steer: positions={value!r}: expected 'all', 'masked', 'unmasked' or a list of block "
                         f"positions")
    items = value.tolist() if isinstance(value, torch.Tensor) else list(value)
    return tuple(sorted({_index("Steer positions", p) for p in items}))


class Schedule:
    """Steers applied together (each adds its own vector), with a name; saved as a directory
    (``schedule.json`` + ``directions.safetensors``) that ``Schedule.load`` reads back."""

    def __init__(self, steers=(), name: str = ""):
        steers = [steers] if isinstance(steers, Steer) else list(steers.steers if isinstance(steers, Schedule)
                                                                    else steers)
        bad = [type(s).__name__ for s in steers if not isinstance(s, Steer)]
        if bad:
            raise InputError(f"Schedule: expected Steer objects, got {', '.join(bad)}")
        self.steers: list[Steer] = steers
        self.name = str(name)

    @classmethod
    def of(cls, plan) -> "Schedule":
        """``plan`` as a Schedule: a Schedule, one Steer or a list of them."""
        return plan if isinstance(plan, Schedule) else cls(plan)

    def __iter__(self):
        return iter(self.steers)

    def __len__(self) -> int:
        return len(self.steers)

    def __getitem__(self, i) -> Steer:
        return self.steers[i]

    def __add__(self, other) -> "Schedule":
        return Schedule(self.steers + Schedule.of(other).steers, self.name)

    def __eq__(self, other) -> bool:
        return isinstance(other, Schedule) and self.name == other.name and self.steers == other.steers

    def scaled(self, factor: float) -> "Schedule":
        """Every coefficient times ``factor``."""
        from dataclasses import replace

        return Schedule([replace(s, coefficient=s.coefficient * factor) for s in self.steers], self.name)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({layer for s in self.steers for layer in s.layers}))

    def table(self) -> list[dict]:
        """One dict per steer: direction, norm, coefficient, layers, point, parts, blocks, steps, positions."""
        return [s.row() for s in self.steers]

    def __str__(self) -> str:
        rows = self.table()
        head = f"Schedule {self.name!r}: {len(rows)} steer{'s' * (len(rows) != 1)}"
        if not rows:
            return head
        cols = list(rows[0])
        width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
        lines = [" ".join(c.ljust(width[c]) for c in cols)] + [" ".join(str(r[c]).ljust(width[c]) for c in cols)
                                                               for r in rows]
        return head + "\n" + "\n".join("  " + line.rstrip() for line in lines)

    def __repr__(self) -> str:
        return f"Schedule({self.steers!r}, name={self.name!r})"

    # ---------------------------------------------------------------- files
    def save(self, path) -> Path:
        """Write the schedule to the directory ``path`` (new, empty or a schedule: replaced), the
        two files put in place together (``writes.FileSet``)."""
        path = Path(path)
        doc = dict(format=FORMAT, version=VERSION, name=self.name, steers=[s.to_dict() for s in self.steers])
        text = json.dumps(doc, indent=1)
        clamps = [f"steer {i} ({s.name!r})" for i, s in enumerate(self.steers) if s.clamp is not None]
        if clamps:
            raise InputError(f"Schedule.save: {', '.join(clamps)} clamps an autoencoder's feature; a schedule's files "
                             f"hold directions, not autoencoders: save the autoencoder and rebuild the clamp")
        refuse_foreign(path, {META_FILE, TENSOR_FILE}, "a steering schedule")
        tensors = {f"steer.{i}": s.direction.contiguous() for i, s in enumerate(self.steers)}
        with naming(path), FileSet(path) as files:
            save_file(tensors, str(files.path(path / TENSOR_FILE)))
            files.path(path / META_FILE).write_text(text)  # last: the file that makes it a schedule
        return path

    @classmethod
    def load(cls, path) -> "Schedule":
        """A schedule saved by :meth:`save`; anything else is a ScheduleError naming what is wrong."""
        path = Path(path)
        meta, tensors = path / META_FILE, path / TENSOR_FILE
        if not meta.is_file():
            raise ScheduleError(f"{path}: not a steering schedule (no {META_FILE})")
        refuse_unfinished(path, ScheduleError)
        try:
            doc = json.loads(meta.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ScheduleError(f"{meta}: not JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ScheduleError(f"{meta}: not a steering schedule (format {doc.get('format') if isinstance(doc, dict) else None!r}, "
                                f"expected {FORMAT!r})")
        if doc.get("version") != VERSION:
            raise ScheduleError(f"{meta}: version {doc.get('version')!r}; this clover_lab reads version {VERSION}")
        try:
            vectors = load_file(str(tensors))
        except (OSError, SafetensorError) as e:
            raise ScheduleError(f"{tensors}: cannot read the directions ({e})") from None
        steers = []
        if not isinstance(doc.get("steers") or [], list):
            raise ScheduleError(f"{meta}: 'steers' must be a list of steers, got {type(doc['steers']).__name__}")
        for i, d in enumerate(doc.get("steers") or []):
            where = f"{meta}: steers[{i}]"
            if not isinstance(d, dict):
                raise ScheduleError(f"{where}: expected an object")
            vector = vectors.get(f"steer.{i}")
            if vector is None:
                raise ScheduleError(f"{tensors}: no tensor 'steer.{i}' for {where}")
            if vector.numel() != d.get("hidden"):
                raise ScheduleError(f"{where}: the direction has {vector.numel()} values, the schedule says "
                                    f"{d.get('hidden')}")
            try:
                steers.append(Steer(vector, d["coefficient"], d["layers"], d["kind"], d["blocks"], d["steps"],
                                    d["positions"] if isinstance(d["positions"], str) else tuple(d["positions"]),
                                    tuple(d["parts"]), d["name"]))
            except KeyError as e:
                raise ScheduleError(f"{where}: no field {e}") from None
            except (InputError, TypeError, ValueError) as e:  # a number where a list goes, ...
                raise ScheduleError(f"{where}: {e}") from None
        return cls(steers, doc.get("name", ""))
