"""Activation patching over a dataset of prompt pairs: one site (a residual point at one forward,
some positions) patched from each pair's clean run into its corrupted run, the pairs batched on
the engine, a metric per pair, and their mean with a bootstrap confidence interval.

    pairs = [patching.Pair(clean, corrupt, patching.logit_diff(pos, good, bad)), ...]
    res = patching.patch_pairs(engine, pairs, "layers.2.output", block=None, step=None, positions=[-1])
    res.recovered          # per pair: (patched - corrupt) / (clean - corrupt)
    res.mean(), res.interval(0.95)     # of the recovered share (or of res.patched, res.effect)

Each batch of ``batch_size`` pairs runs three generations of the batch, each stopped as soon as
every row's metric is read: the clean prompts (recording the site), the corrupted prompts as they
are, and the corrupted prompts with each row's site values taken from its own clean row. A pair's
two prompts must have the same number of tokens (positions are compared one to one); pairs may
differ in length from each other. ``positions``: with ``block`` None (the prompt's prefill)
prompt positions, negative ones counted from the prompt's end (-1: its last token); with a
block, positions within the block (0..block_size-1). The metric is read at (``block``, ``step``)
unless ``read_at`` names another forward.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from clover_lab.errors import InputError
from clover_lab.features.activations import batch_rows
from clover_lab.hooks import points as P
from clover_lab.hooks.events import ResidualEvent
from clover_lab.hooks.registry import StopGeneration
from clover_lab.patching.metrics import Metric, head_logits
from clover_lab.patching.patch import one_prompt


@dataclass(frozen=True)
class Pair:
    """A clean and a corrupted prompt of the same length, and the metric read on both."""

    clean: object
    corrupt: object
    metric: Metric

    def __post_init__(self):
        one_prompt(self.clean, "Pair")
        one_prompt(self.corrupt, "Pair")
        if not isinstance(self.metric, Metric):
            raise InputError(f"Pair: metric must be a Metric (patching.logit_diff, patching.probability), got "
                             f"{type(self.metric).__name__}")


@dataclass
class PairsPatch:
    """Per pair, the metric of the clean run, the corrupted run and the corrupted run patched
    (``clean``, ``corrupt``, ``patched``: [pairs] float, NaN where it could not be read), and the
    site (``site``: point, block, step, positions)."""

    clean: torch.Tensor
    corrupt: torch.Tensor
    patched: torch.Tensor
    site: dict
    metrics: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.clean)

    @property
    def effect(self) -> torch.Tensor:
        """patched - corrupt per pair: what the patch moved the metric by."""
        return self.patched - self.corrupt

    @property
    def recovered(self) -> torch.Tensor:
        """(patched - corrupt) / (clean - corrupt) per pair: 1 where the patch restores the clean
        run, 0 where it does nothing (NaN where clean == corrupt)."""
        gap = self.clean - self.corrupt
        return torch.where(gap != 0, self.effect / gap, torch.tensor(float("nan")))

    def _values(self, of: str) -> torch.Tensor:
        if of not in ("recovered", "effect", "patched", "clean", "corrupt"):
            raise InputError(f"of={of!r}: expected recovered, effect, patched, clean or corrupt")
        v = getattr(self, of)
        return v[torch.isfinite(v)]

    def mean(self, of: str = "recovered") -> float:
        """The mean over the pairs where it is defined."""
        v = self._values(of)
        return float(v.mean()) if len(v) else float("nan")

    def interval(self, level: float = 0.95, of: str = "recovered", resamples: int = 2000,
                 seed: int = 0) -> tuple[float, float]:
        """A bootstrap percentile confidence interval of the mean (``resamples`` resamples of the
        pairs, with replacement, seeded)."""
        if isinstance(level, bool) or not isinstance(level, numbers.Real) or not 0 < level < 1:
            raise InputError(f"interval: level={level!r}: expected a number in (0, 1)")
        v = self._values(of).double()
        if len(v) < 2:
            return float("nan"), float("nan")
        g = torch.Generator().manual_seed(seed)
        means = v[torch.randint(0, len(v), (resamples, len(v)), generator=g)].mean(1)
        lo, hi = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
        return float(lo), float(hi)

    def summary(self, level: float = 0.95) -> str:
        lo, hi = self.interval(level)
        n = len(self._values("recovered"))
        s = self.site
        where = ("the prompt's prefill" if s["block"] is None else f"block {s['block']}" +
                 ("'s commit" if s["step"] is None else f", step {s['step']}"))
        return (f"{s['point']} at {where}, positions {s['positions']}: {self.mean():.3f} of the clean-corrupt gap "
                f"recovered on average over {n} pairs ({level:.0%} interval {lo:.3f} .. {hi:.3f}); "
                f"metric moved by {self.mean('effect'):+.3f} on average")


def _index(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise InputError(f"patch_pairs: {name}={value!r}: expected an int >= 0 or None")
    return int(value)


class _Batch:
    """The hooks of one batched generation: record the site per row (a clean run), or write each
    row's clean values there (a patched run), and read each row's metric."""

    def __init__(self, engine, pairs: list[Pair], site: dict, read_at: tuple, lengths: list[int],
                 values: dict | None = None):
        self.engine, self.pairs, self.site, self.read_at, self.lengths = engine, pairs, site, read_at, lengths
        self.values = values  # None: record into self.recorded; else row -> {position: value [H]}
        self.recorded: dict[int, dict[int, torch.Tensor]] = {}
        self.read: dict[int, float] = {}

    def _wanted(self, row: int) -> set[int]:
        """Absolute positions of the site in ``row``'s sequence."""
        n, block, positions = self.lengths[row], self.site["block"], self.site["positions"]
        if block is None:
            return {p if p >= 0 else n + p for p in positions} if positions is not None else set(range(n))
        start = n + block * self.engine.block_size
        span = range(self.engine.block_size) if positions is None else positions
        return {start + p for p in span}

    def at_site(self, ev: ResidualEvent) -> None:
        if (ev.block, ev.step) != (self.site["block"], self.site["step"]):
            return
        new = None
        for b, r in batch_rows(ev.where):
            wanted = self._wanted(r)
            pos = (ev.positions[b] if ev.positions.dim() == 2 else ev.positions).tolist()
            for i, p in enumerate(pos):
                if p not in wanted:
                    continue
                if self.values is None:
                    self.recorded.setdefault(r, {})[p] = ev.value[b, i].detach().clone()
                elif p in self.values.get(r, {}):
                    if new is None:
                        new = ev.value.clone()
                    new[b, i] = self.values[r][p].to(new.dtype)
        if new is not None:
            ev.value = new

    def at_head(self, ev: ResidualEvent) -> None:
        if (ev.block, ev.step) == self.read_at:
            for b, r in batch_rows(ev.where):
                if r in self.read:
                    continue
                metric = self.pairs[r].metric
                pos = (ev.positions[b] if ev.positions.dim() == 2 else ev.positions).tolist()
                self.read[r] = (metric(head_logits(self.engine, ev, b, pos.index(metric.position)))
                                if metric.position in pos else math.nan)
        if len(self.read) == len(self.pairs):
            raise StopGeneration  # every row's metric is read: the rest of the generation is not needed

    def hooks(self) -> dict:
        return {self.site["point"]: self.at_site, P.FINAL_NORM_OUTPUT: self.at_head}


def patch_pairs(engine, pairs, point: str, block: int | None, step: int | None, positions=None, *,
                read_at: tuple | None = None, batch_size: int = 8, progress: bool = True, **generate) -> PairsPatch:
    """Patch ``point`` at (``block``, ``step``), ``positions``, from each pair's clean run into its
    corrupted run, and read each pair's metric (see the module's docstring)."""
    if isinstance(pairs, Pair) or not isinstance(pairs, (list, tuple)) or not pairs:
        raise InputError("patch_pairs: pairs must be a non-empty list of Pair")
    bad = [type(p).__name__ for p in pairs if not isinstance(p, Pair)]
    if bad:
        raise InputError(f"patch_pairs: pairs must be Pair objects, got {', '.join(sorted(set(bad)))}")
    if not isinstance(point, str) or not P.is_residual(point) or point not in engine.model.hooks.points:
        raise InputError(f"patch_pairs: {point!r} is not a residual point of this model (layers.{{i}}.output, ...)")
    block, step = _index("block", block), _index("step", step)
    if block is None and step is not None:
        raise InputError(f"patch_pairs: step={step} without a block: a denoising step belongs to a block")
    if positions is not None:
        if isinstance(positions, (str, bytes)) or not isinstance(positions, (list, tuple, range)) or not positions \
                or any(isinstance(p, bool) or not isinstance(p, numbers.Integral) for p in positions):
            raise InputError(f"patch_pairs: positions={positions!r}: expected a list of ints, or None (every one)")
        positions = [int(p) for p in positions]
        if block is not None and any(not 0 <= p < engine.block_size for p in positions):
            raise InputError(f"patch_pairs: positions {positions} within block {block}: expected 0.."
                             f"{engine.block_size - 1}")
    read_at = (block, step) if read_at is None else tuple(read_at)
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise InputError(f"patch_pairs: batch_size={batch_size!r}: expected a positive integer")
    lengths = []
    for i, pair in enumerate(pairs):
        pair.metric.check(engine.model.config.vocab_size)
        a, b = len(engine.encode(pair.clean)), len(engine.encode(pair.corrupt))
        if a != b:
            raise InputError(f"patch_pairs: pair {i}: the clean prompt has {a} tokens and the corrupted one {b}; "
                             f"positions are compared one to one")
        if block is None and positions is not None and any(not -a <= p < a for p in positions):
            raise InputError(f"patch_pairs: pair {i}: prompt positions {positions} outside its {a} tokens")
        lengths.append(a)
    site = dict(point=point, block=block, step=step, positions=positions)
    from tqdm.auto import tqdm

    out = {k: [] for k in ("clean", "corrupt", "patched")}
    with tqdm(total=len(pairs), disable=not progress, desc=f"patching {point}", unit="pair") as bar:
        for start in range(0, len(pairs), batch_size):
            chunk, lens = list(pairs[start:start + batch_size]), lengths[start:start + batch_size]
            runs = {}
            for name, prompts, values in (("clean", [p.clean for p in chunk], None),
                                          ("corrupt", [p.corrupt for p in chunk], {})):
                runs[name] = _Batch(engine, chunk, site, read_at, lens, values)
                with engine.hooks(runs[name].hooks()):
                    engine.generate(prompts, **generate)
            missing = [start + r for r in range(len(chunk)) if not runs["clean"].recorded.get(r)]
            if missing:
                raise InputError(f"patch_pairs: the clean runs of pairs {missing} have no {point} at block {block}, "
                                 f"step {step} (did the generation reach it? max_new_tokens, an EOS)")
            patched = _Batch(engine, chunk, site, read_at, lens, runs["clean"].recorded)
            with engine.hooks(patched.hooks()):
                engine.generate([p.corrupt for p in chunk], **generate)
            for name, batch in (("clean", runs["clean"]), ("corrupt", runs["corrupt"]), ("patched", patched)):
                out[name] += [batch.read.get(r, math.nan) for r in range(len(chunk))]
            bar.update(len(chunk))
    return PairsPatch(torch.tensor(out["clean"]), torch.tensor(out["corrupt"]), torch.tensor(out["patched"]), site,
                      [p.metric.name for p in pairs])
