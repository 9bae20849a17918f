"""A steering schedule applied to generations: the hooks that add its vectors to the residual
stream where and when it says, and one request run with them.

    with engine.hooks(steering.hooks(engine, plan)):      # every generation in the block
        engine.generate(prompt)
    run = steering.steer(engine, prompt, plan)            # one request; run.applied says where it added

Each steer's layers get one hook on their residual point (``layers.{i}.output`` by default); a
schedule that is not attached costs nothing (no hook, no event). The hooks read the forward's
coordinates from the event (``where``: its part, block and denoising step), so a forward outside
the schedule costs a Python call and leaves its rows alone. Steers that pick "masked" or
"unmasked" positions also observe ``denoise.step`` (an engine point, between forwards) to know
which block positions each step left masked.

On the fast path (``engine.compile_steps``) the steered layers run live and the others stay
compiled (a split step, ``engine/observed.py``); ``result.stats.path`` says which path ran.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from clover_lab.errors import InputError
from clover_lab.hooks import points as P
from clover_lab.hooks.events import ResidualEvent
from clover_lab.steering.schedule import Schedule, Steer

KEPT_RUNS = 16  # generations whose masked positions a Steering remembers (hooks that stay attached)


@dataclass(frozen=True)
class Applied:
    """Where one steer added its vector in one forward: its index in the schedule, the point, the
    forward part ("prompt", "commit", "preview"), (block, step), the request row, and how many of
    the part's rows it touched (``positions``: the block positions, for commit and preview rows)."""

    steer: int
    point: str
    part: str
    block: int | None
    step: int | None
    row: int
    positions: tuple[int, ...]
    rows: int


class Steering:
    """A schedule checked against an engine's model, as hooks (:meth:`hooks`), with a log of where
    it added (``applied``, when ``log`` is on)."""

    def __init__(self, engine, schedule, log: bool = True, block_size: int | None = None):
        self.engine, self.schedule, self.log = engine, Schedule.of(schedule), log
        config = engine.model.config
        bs = block_size or engine.block_size  # the request's, when it sets its own
        self.by_point: dict[str, list[tuple[int, Steer]]] = {}
        for i, s in enumerate(self.schedule):
            if s.direction.numel() != config.hidden_size:
                raise InputError(f"steer {i} ({s.name!r}): its direction has {s.direction.numel()} values, the model's "
                                 f"residual stream {config.hidden_size}")
            for layer in s.layers:
                if layer >= config.num_hidden_layers:
                    raise InputError(f"steer {i} ({s.name!r}): unknown layer {layer}; the model has layers 0.."
                                     f"{config.num_hidden_layers - 1}")
                name = P.layer_point(layer, s.kind)
                if name not in engine.model.hooks.points:
                    raise InputError(f"steer {i} ({s.name!r}): layer {layer} ({config.layer_types[layer]}) has no "
                                     f"{s.kind} point")
                self.by_point.setdefault(name, []).append((i, s))
            if isinstance(s.positions, tuple) and s.positions[-1] >= bs:
                raise InputError(f"steer {i} ({s.name!r}): block position {s.positions[-1]} is past the block "
                                 f"(block_size {bs})")
            first = s.steps.start if s.steps.only is None else s.steps.only[0]
            if "preview" in s.parts and first >= bs:  # each denoising step unmasks a position at least
                raise InputError(f"steer {i} ({s.name!r}): steps {s.steps} start at step {first}, which a block of "
                                 f"{bs} positions never reaches (it takes at most {bs} denoising steps); it would "
                                 f"never apply")
        self.tracks = any(s.positions in ("masked", "unmasked") and "preview" in s.parts for s in self.schedule)
        self.applied: list[Applied] = []
        self._vectors: dict[tuple, torch.Tensor] = {}
        self._masked: dict[tuple, set[int]] = {}  # (run, row, block) -> positions still masked
        self._steps: dict[tuple, int] = {}  # (run, row, block) -> denoising steps it has taken
        self._runs: list[int] = []  # the generations those hold, oldest first

    def hooks(self) -> dict:
        """point -> hook, for ``engine.hooks(...)``."""
        out = {name: self._adder(name, entries) for name, entries in self.by_point.items()}
        if self.tracks:
            out[P.DENOISE_STEP] = self._track
        return out

    # ---------------------------------------------------------------- masked positions
    def _track(self, ev) -> None:
        run = ev.where.run
        if run not in self._runs:  # what earlier generations left, beyond the last few (threads may overlap)
            self._runs.append(run)
            if len(self._runs) > KEPT_RUNS:
                old = self._runs.pop(0)
                for table in (self._masked, self._steps):
                    for key in [k for k in table if k[0] == old]:
                        del table[key]
        key = (run, ev.where.row or 0, ev.block)
        done = set(ev.unmask)
        self._masked[key] = {p for p in ev.masked if p not in done}
        self._steps[key] = ev.step + 1

    _track.clover_observer = True  # after the hooks that change the decision: it reads the final one

    def _still_masked(self, run: int, row: int, block: int) -> set[int] | None:
        """Positions still masked in the row's block (None: no step yet, every position)."""
        return self._masked.get((run, row, block))

    # ---------------------------------------------------------------- adding
    def _vector(self, i: int, s: Steer, like: torch.Tensor) -> torch.Tensor:
        key = (i, like.device, like.dtype)
        v = self._vectors.get(key)
        if v is None:
            v = self._vectors[key] = s.vector.to(like.device, like.dtype)
        return v

    def _adder(self, point: str, entries: list[tuple[int, Steer]]):
        def add(ev: ResidualEvent) -> None:
            where = ev.where
            part = "preview" if ev.mode == "preview" else "prompt" if where.phase == "prefill" else "commit"
            block, step = ev.block, ev.step
            B, T = ev.value.shape[0], ev.value.shape[1]
            bs = self._block_size(where.run)
            # a look-ahead forward previews the next block after this one: its rows have their own coordinates
            ahead = part == "preview" and T > bs
            active = [(i, s) for i, s in entries if s.at(part, block, step)
                      or (ahead and "preview" in s.parts and block + 1 in s.blocks)]
            if not active:
                return
            rows = where.rows if where.rows is not None else (0,)
            new = None
            for i, s in active:
                mask = torch.zeros(B, T, dtype=torch.bool)
                for b, r in enumerate(rows):
                    for lo, hi, blk, st in self._spans(part, block, step, T, bs, where.run, r):
                        if s.at(part, blk, st):
                            picked = self._positions(s, part, where.run, r, blk, hi - lo)
                            mask[b, [lo + p for p in picked]] = True
                            if self.log and picked:
                                self.applied.append(Applied(i, point, part, blk, st, r, tuple(picked) if part != "prompt"
                                                            else (), len(picked)))
                if not bool(mask.any()):
                    continue
                if new is None:
                    new = ev.value.clone()
                m = mask.to(new.device)
                if s.clamp is None:
                    new[m] += self._vector(i, s, new)
                else:  # the feature's activation set to the coefficient, the rest of the row kept
                    new[m] = s.clamp.apply(new[m], s.coefficient).to(new.dtype)
            if new is not None:
                ev.value = new

        return add

    def _block_size(self, run: int) -> int:
        """The block size of the generation ``run`` (a request may set its own), else the engine's."""
        for row in self.engine.loop.rows:
            if row.handle.number == run:
                return row.block_size
        return self.engine.block_size

    def _spans(self, part: str, block, step, T: int, bs: int, run: int, row: int):
        """(lo, hi, block, step) of the part's rows: a look-ahead preview's rows past the block are
        the next block's, at the steps that block has taken."""
        if part != "preview" or T <= bs:
            return [(0, T, block, step)]
        return [(0, bs, block, step), (bs, T, block + 1, self._steps.get((run, row, block + 1), 0))]

    def _positions(self, s: Steer, part: str, run: int, row: int, block, n: int) -> list[int]:
        """The rows of a span of ``n`` rows a steer adds to (block positions; prompt rows: all)."""
        if part == "prompt":
            return [] if s.positions == "masked" else list(range(n))
        if part == "commit":  # a committed block's tokens: none of them masked
            if s.positions == "masked":
                return []
            return list(range(n)) if isinstance(s.positions, str) else [p for p in s.positions if p < n]
        if isinstance(s.positions, tuple):
            return [p for p in s.positions if p < n]
        if s.positions == "all":
            return list(range(n))
        masked = self._still_masked(run, row, block)
        masked = set(range(n)) if masked is None else masked
        return [p for p in range(n) if (p in masked) == (s.positions == "masked")]


def hooks(engine, schedule) -> dict:
    """The hooks that apply ``schedule`` (a Schedule, a Steer or a list of them) on ``engine``:
    ``with engine.hooks(steering.hooks(engine, plan)):``. Checked against the model here."""
    return Steering(engine, schedule, log=False).hooks()


@dataclass
class SteeredRun:
    """A steered request's result and where its steers added (``Applied`` per steer, forward and row)."""

    result: object
    applied: list[Applied] = field(default_factory=list)

    def where(self) -> list[tuple]:
        """(steer, part, block, step) of each forward a steer touched, in order, without repeats."""
        seen = []
        for a in self.applied:
            key = (a.steer, a.part, a.block, a.step)
            if key not in seen:
                seen.append(key)
        return seen


def steer(engine, prompt, schedule, **generate) -> SteeredRun:
    """Generate ``prompt`` (one prompt or a batch; ``generate``: the request's settings, ``mode``
    included) with ``schedule`` applied, for this request only."""
    block_size = getattr(prompt, "block_size", None) or generate.get("block_size")  # a Request's own
    steering = Steering(engine, schedule, block_size=block_size)
    with engine.hooks(steering.hooks()):
        result = engine.generate(prompt, **generate)
    return SteeredRun(result, steering.applied)
