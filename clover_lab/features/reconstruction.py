"""How well an autoencoder stands in for the stream it reads, on held-out generations:

- the fraction of variance unexplained (FVU) over every preview row of every step, masked and
  unmasked positions (and over each kind apart);
- the change in the model's masked-token loss when the reconstruction replaces the stream: each
  held-out prompt is generated once as it is (the clean run), then again with the autoencoder's
  output in place of its input on every preview row, and once with the rows' mean in place
  (mean ablation, the reference for "nothing left"). The replaced runs are teacher-forced: a
  ``denoise.step`` hook makes each step unmask the positions and tokens the clean run did, so the
  three runs preview the same canvases. The loss is the cross-entropy, at every position still
  masked at a step, of the token the clean run finally placed there, under that step's logits
  (the model's own distribution, before the sampler's penalties).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from clover_lab.errors import InputError, count
from clover_lab.features.activations import Activations, check_prompts, collect
from clover_lab.features.autoencoder import SparseAutoencoder
from clover_lab.hooks import points as P


@dataclass
class Reconstruction:
    """``fvu`` over all preview rows (``fvu_masked`` / ``fvu_unmasked``: over those rows alone,
    each against its own mean); masked-token losses (nats per masked position) of the clean run,
    with the reconstruction in place (``spliced_loss``) and with the mean in place
    (``ablated_loss``); ``delta`` = spliced - clean; ``recovered`` = the share of the ablation's
    loss increase the reconstruction avoids. ``rows`` preview rows, ``positions`` (step, masked
    position) pairs scored, over ``prompts`` held-out generations."""

    fvu: float
    fvu_masked: float
    fvu_unmasked: float
    clean_loss: float
    spliced_loss: float
    ablated_loss: float
    rows: int
    positions: int
    prompts: int
    point: str

    @property
    def delta(self) -> float:
        return self.spliced_loss - self.clean_loss

    @property
    def recovered(self) -> float:
        gap = self.ablated_loss - self.clean_loss
        return (self.ablated_loss - self.spliced_loss) / gap if gap else float("nan")

    def to_dict(self) -> dict:
        return dict(fvu=self.fvu, fvu_masked=self.fvu_masked, fvu_unmasked=self.fvu_unmasked,
                    clean_loss=self.clean_loss, spliced_loss=self.spliced_loss, ablated_loss=self.ablated_loss,
                    delta=self.delta, recovered=self.recovered, rows=self.rows, positions=self.positions,
                    prompts=self.prompts, point=self.point)

    def __str__(self) -> str:
        return (f"{self.point} on {self.prompts} held-out generations: FVU {self.fvu:.3f} over {self.rows} preview rows "
                f"(masked {self.fvu_masked:.3f}, unmasked {self.fvu_unmasked:.3f}); masked-token loss {self.clean_loss:.3f}"
                f" -> {self.spliced_loss:.3f} with the reconstruction ({self.delta:+.3f} nats), {self.ablated_loss:.3f} "
                f"mean-ablated ({self.recovered:.1%} of that recovered) over {self.positions} masked positions")


def _row(where) -> int:
    return where.row if where.row is not None else 0


class _Decisions:
    """A clean run's step decisions per (row, block, step): positions unmasked and their tokens."""

    clover_observer = True  # as a hook: reads the decision as the loop applies it (hooks.registry.observer)

    def __init__(self):
        self.steps: dict[tuple, tuple[list[int], dict[int, int]]] = {}
        self.final: dict[tuple, int] = {}  # (row, block, position) -> the token placed there

    def __call__(self, ev) -> None:
        cand = ev.candidates.tolist()
        tokens = {p: ev.tokens.get(p, cand[ev.masked.index(p)]) for p in ev.unmask}
        r = _row(ev.where)
        self.steps[(r, ev.block, ev.step)] = (list(ev.unmask), tokens)
        for p, t in tokens.items():
            self.final[(r, ev.block, p)] = t

    def force(self, ev) -> None:
        """A step of a replaced run takes the clean run's decision."""
        key = (_row(ev.where), ev.block, ev.step)
        if key not in self.steps:
            raise RuntimeError(f"the teacher-forced run took a step the clean run did not: row {key[0]}, block "
                               f"{key[1]}, step {key[2]}")
        unmask, tokens = self.steps[key]
        ev.unmask = list(unmask)
        ev.tokens = dict(tokens)


class _Loss:
    """Cross-entropy of the clean run's final tokens at the still-masked positions of each step."""

    clover_observer = True

    def __init__(self, final: dict):
        self.final, self.total, self.n = final, 0.0, 0

    def __call__(self, ev) -> None:
        r = _row(ev.where)
        rows = [(i, self.final[(r, ev.block, p)]) for i, p in enumerate(ev.masked) if (r, ev.block, p) in self.final]
        if not rows or ev.logits is None:
            return
        index = torch.tensor([i for i, _ in rows], device=ev.logits.device)
        target = torch.tensor([t for _, t in rows], device=ev.logits.device)
        logp = ev.logits.float()[index].log_softmax(-1)
        self.total += float(-logp.gather(1, target[:, None]).sum())
        self.n += len(rows)


def _replace_preview(fn):
    def hook(ev) -> None:
        if ev.mode == "preview":
            ev.value = fn(ev.value).to(ev.value.dtype)
    return hook


def concat(parts: list[Activations]) -> Activations:
    """Activations of several collections as one (prompt indices offset to stay distinct)."""
    offset, prompts = 0, []
    for a in parts:
        prompts.append(a.prompt + offset)
        offset += len(a.results or []) or (int(a.prompt.max()) + 1 if len(a) else 0)
    cols = [torch.cat([getattr(a, name) for a in parts]) for name in
            ("values", "block", "step", "position", "masked", "unmask_step", "token")]
    return Activations(cols[0], torch.cat(prompts), *cols[1:], point=parts[0].point,
                       results=[r for a in parts for r in (a.results or [])])


def evaluate(engine, sae: SparseAutoencoder, prompts, *, batch_size: int = 16, mean: torch.Tensor | None = None,
             **generate) -> tuple[Reconstruction, Activations]:
    """The autoencoder's reconstruction on held-out ``prompts`` (see the module's docstring), and
    the held-out rows it was measured on. ``mean``: the rows the ablation puts in place (default:
    the held-out rows' mean)."""
    if not isinstance(sae, SparseAutoencoder):
        raise InputError(f"evaluate: expected a sparse autoencoder (features.load, features.train), got {type(sae).__name__}")
    if sae.d_out != sae.d_in or sae.architecture.endswith("transcoder"):
        raise InputError(f"evaluate splices an autoencoder's reconstruction in place of its input; a "
                         f"{sae.architecture} writes another point ({sae.metadata.get('hook_name_out')!r})")
    point = sae.point(engine)
    prompts = check_prompts(prompts, "evaluate")
    batch_size = count("batch_size", batch_size)
    chunks = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    clean, decisions = [], []
    for chunk in chunks:
        d = _Decisions()
        with engine.hooks({P.DENOISE_STEP: d}):
            clean.append(collect(engine, chunk, point=point, batch_size=batch_size, **generate))
        decisions.append(d)
    held = concat(clean)
    rows = held.values
    fill = rows.mean(0) if mean is None else mean.float()
    losses = {}
    with torch.no_grad():
        for name, fn in (("clean", None), ("spliced", lambda v: sae(v)),
                         ("ablated", lambda v: fill.to(v.device).expand(v.shape))):
            total, n = 0.0, 0
            for chunk, d in zip(chunks, decisions):
                loss = _Loss(d.final)
                hooks = {P.DENOISE_STEP: [d.force, loss]}
                if fn is not None:
                    hooks[point] = _replace_preview(fn)
                with engine.hooks(hooks):
                    engine.generate(chunk, **generate)
                total, n = total + loss.total, n + loss.n
            losses[name] = (total / n if n else float("nan"), n)
    masked = held.masked
    report = Reconstruction(sae.fvu(rows), sae.fvu(rows[masked]) if int(masked.sum()) > 1 else float("nan"),
                            sae.fvu(rows[~masked]) if int((~masked).sum()) > 1 else float("nan"),
                            losses["clean"][0], losses["spliced"][0], losses["ablated"][0], len(rows),
                            losses["clean"][1], len(prompts), point)
    return report, held
