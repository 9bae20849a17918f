"""An autoencoder's features over one generation, per (block, step, position): which features fire
on which block positions at each denoising step, and when against the step that unmasked each
position.

    tl = features.timeline(engine, sae, "def parse(line):\\n", max_new_tokens=64)
    tl = features.timeline_of(clover_lab.load_trace("runs/a"), sae)   # a capture or a saved trace
    tl.activation(117, block=1)     # [steps, positions] of feature 117 over block 1's denoising
    tl.top(block=1, step=0)         # the features most active at that step, summed over positions
    tl.relative(117)                # its mean activation by step minus the step that unmasked the position
    FeatureView(tl)                 # clover_lab.widgets: the same, drawn
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from clover_lab.engine.requests import is_batch
from clover_lab.errors import InputError
from clover_lab.features.autoencoder import SparseAutoencoder
from clover_lab.hooks import points as P
from clover_lab.hooks.records import RecordSet


@dataclass
class Frame:
    """One preview of a block: its (block, step), the positions masked during it and those it
    unmasked, and per block position the active features (``indices`` [positions, k], ``values``
    [positions, k], largest first)."""

    block: int
    step: int
    masked: list[int]
    unmasked: list[int]
    indices: torch.Tensor
    values: torch.Tensor


class FeatureTimeline:
    """Frames of one generation in firing order, with each block's final tokens and the step that
    unmasked each of its positions (None past the response's end), the autoencoder's size and the
    point it reads; ``result`` the GenerationResult when the timeline ran the generation itself."""

    def __init__(self, frames: list[Frame], block_tokens: dict[int, list], block_steps: dict[int, list], d_sae: int,
                 point: str, tokenizer=None, result=None):
        self.frames, self.d_sae, self.point, self.tokenizer, self.result = frames, d_sae, point, tokenizer, result
        self._tokens, self._steps = block_tokens, block_steps

    @property
    def blocks(self) -> list[int]:
        return sorted({f.block for f in self.frames})

    def frames_of(self, block: int) -> list[Frame]:
        frames = [f for f in self.frames if f.block == block]
        if not frames:
            raise InputError(f"block {block!r}: the generation has blocks {self.blocks}")
        return frames

    def positions(self, block: int) -> int:
        return self.frames_of(block)[0].indices.shape[0]

    def tokens(self, block: int) -> list[int | None]:
        """The block's final tokens (None past the response's end)."""
        have = self._tokens.get(block, [])
        return [have[p] if p < len(have) else None for p in range(self.positions(block))]

    def unmask_steps(self, block: int) -> list[int | None]:
        """Per block position, the step that unmasked it (None past the response's end)."""
        have = self._steps.get(block, [])
        return [have[p] if p < len(have) else None for p in range(self.positions(block))]

    def feature_index(self, feature: int) -> int:
        if isinstance(feature, bool) or not isinstance(feature, numbers.Integral) or not 0 <= feature < self.d_sae:
            raise InputError(f"feature {feature!r}: the autoencoder has features 0..{self.d_sae - 1}")
        return int(feature)

    def activation(self, feature: int, block: int) -> torch.Tensor:
        """Feature ``feature``'s activation [steps, positions] over ``block``'s previews (0 where it
        is not among a row's top k)."""
        feature = self.feature_index(feature)
        return torch.stack([(f.values * (f.indices == feature)).sum(-1) for f in self.frames_of(block)])

    def dense(self, block: int, step: int) -> torch.Tensor:
        """Every feature's activation [positions, d_sae] at one preview."""
        frame = next((f for f in self.frames_of(block) if f.step == step), None)
        if frame is None:
            raise InputError(f"block {block} has no step {step!r}; it took steps 0..{len(self.frames_of(block)) - 1}")
        return torch.zeros(frame.indices.shape[0], self.d_sae).scatter_(-1, frame.indices, frame.values)

    def top(self, block: int | None = None, step: int | None = None, n: int = 10) -> list[tuple[int, float]]:
        """The ``n`` features with the largest activation summed over positions (and over the frames
        of ``block`` / ``step``; None: every one), as (feature, sum) pairs."""
        total = torch.zeros(self.d_sae)
        frames = [f for f in self.frames if (block is None or f.block == block) and (step is None or f.step == step)]
        if not frames:
            raise InputError(f"no preview at block {block}, step {step}")
        for f in frames:
            total.index_add_(0, f.indices.reshape(-1), f.values.reshape(-1))
        values, ids = total.topk(min(n, self.d_sae))
        return [(int(i), float(v)) for i, v in zip(ids, values) if v > 0]

    def relative(self, feature: int, span: int = 8) -> dict[int, tuple[float, int]]:
        """Feature ``feature``'s mean activation by offset = step - the step that unmasked the position
        (-span..span), over every block: offset -> (mean, rows). Offset 0 is the step that unmasks."""
        feature = self.feature_index(feature)
        sums: dict[int, list] = {}
        for f in self.frames:
            steps = self.unmask_steps(f.block)
            act = (f.values * (f.indices == feature)).sum(-1)
            for p, s in enumerate(steps):
                if s is None or abs(f.step - s) > span:
                    continue
                entry = sums.setdefault(f.step - s, [0.0, 0])
                entry[0] += float(act[p])
                entry[1] += 1
        return {o: (v / n, n) for o, (v, n) in sorted(sums.items())}


def timeline(engine, sae: SparseAutoencoder, prompt, **generate) -> FeatureTimeline:
    """Generate ``prompt`` (one prompt, block diffusion) and encode every preview row at the
    autoencoder's point."""
    if not isinstance(sae, SparseAutoencoder):
        raise InputError(f"timeline: expected a sparse autoencoder (features.load, features.train), got {type(sae).__name__}")
    if is_batch(prompt):
        raise InputError(f"timeline reads one generation, and was given a batch of {len(prompt)} prompts")
    if generate.get("mode", "diffusion") != "diffusion":
        raise InputError(f"timeline follows denoising steps: mode must be 'diffusion', got {generate['mode']!r}")
    point = sae.point(engine)
    with engine.capture([point, P.DENOISE_STEP]) as cap:
        result = engine.generate(prompt, **generate)
    bs = engine.block_size
    tokens = {b: result.token_ids[b * bs:(b + 1) * bs] for b in range(len(result.stats.steps_per_block))}
    steps = {b: result.unmask_steps[b * bs:(b + 1) * bs] for b in tokens}
    return _encoded(cap, sae, point, tokens, steps, engine.tokenizer, result, cap.runs[-1] if cap.runs else None, bs)


def timeline_of(records, sae: SparseAutoencoder, run: int | None = None) -> FeatureTimeline:
    """The timeline of a generation recorded earlier: a Capture or a saved Trace holding the
    autoencoder's point (``sae.hook_name``) and ``denoise.step``, of one generation (``run``: which,
    when it holds several). Tokens and unmasking steps come from the step records (and, recorded
    too, ``block.commit``'s final tokens, which end at an EOS)."""
    if not isinstance(records, RecordSet):
        raise InputError(f"timeline_of: expected a Capture or a Trace, got {type(records).__name__}")
    point = sae.hook_name
    missing = [p for p in (point, P.DENOISE_STEP) if p not in records.points]
    if missing:
        raise InputError(f"timeline_of: the records hold no {' and no '.join(map(str, missing))} (they hold "
                         f"{', '.join(records.points) or 'nothing'}); record the autoencoder's point and the steps")
    runs = records.runs
    if run is None:
        if len(runs) != 1:
            raise InputError(f"timeline_of: the records hold {len(runs)} generations (runs {runs}); pick one with run=")
        run = runs[0]
    elif run not in runs:
        raise InputError(f"timeline_of: no run {run!r} among the records' runs {runs}")
    tokens: dict[int, list] = {}
    steps: dict[int, list] = {}
    for rec in records[P.DENOISE_STEP]:
        if rec.run != run:
            continue
        if rec.rows is not None:
            raise InputError("timeline_of: the records are of a batched generation; record one prompt at a time")
        cand, chosen = rec["candidates"].tolist(), rec["tokens"] or {}  # a hook's tokens over the candidates
        for p in rec["unmask"]:
            t = chosen.get(p, chosen.get(str(p), cand[rec["masked"].index(p)]))  # (a trace's JSON keys are strings)
            for table, value in ((tokens, t), (steps, rec.step)):
                row = table.setdefault(rec.block, [])
                row.extend([None] * (p + 1 - len(row)))
                row[p] = value
    if P.BLOCK_COMMIT in records.points:  # a block's final tokens: none past an EOS or a stop string
        for rec in records[P.BLOCK_COMMIT]:
            if rec.run == run and rec.block in tokens:
                tokens[rec.block] = list(rec["tokens"])
                steps[rec.block] = steps[rec.block][:len(rec["tokens"])]
    config = getattr(records, "config", None)
    return _encoded(records, sae, point, tokens, steps, getattr(records, "tokenizer", None), None, run,
                    getattr(config, "block_size", None))


def _encoded(records, sae, point: str, tokens: dict, steps: dict, tokenizer, result, run,
             block_size: int | None) -> FeatureTimeline:
    """Frames of the preview records of ``point`` in ``run``: each row's top-k features (rows past
    ``block_size``: a look-ahead's next block, left out)."""
    by_step = {(r.block, r.step): r for r in records[P.DENOISE_STEP] if r.run == run}
    frames = []
    with torch.no_grad():
        for rec in records[point]:
            if rec.run != run or rec["mode"] != "preview":
                continue
            ev = by_step.get((rec.block, rec.step))
            m = rec["value"].shape[1] if block_size is None else min(rec["value"].shape[1], block_size)
            values, indices = sae.encode_topk(rec["value"][0, :m])
            frames.append(Frame(rec.block, rec.step, list(ev["masked"]) if ev else [], list(ev["unmask"]) if ev else [],
                                indices.cpu(), values.cpu()))
    if not frames:
        raise InputError(f"timeline: the generation had no preview at {point} (max_new_tokens=0?)")
    return FeatureTimeline(frames, tokens, steps, sae.d_sae, point, tokenizer, result)
