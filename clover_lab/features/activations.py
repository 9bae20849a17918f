"""The residual stream at one point over real generations, every preview of every denoising step
at every block position (masked and unmasked), with each row's coordinates: what an autoencoder
trains on and is measured on.

    acts = features.collect(engine, prompts, layer=2, max_new_tokens=64)   # batches of 16 prompts
    acts.values            # [rows, hidden] float32
    acts.step, acts.masked, acts.unmask_step   # per row: its denoising step, still masked?, and the
                                               # step that unmasked its position
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, fields

import torch

from clover_lab.errors import InputError, count
from clover_lab.hooks import points as P
from clover_lab.hooks.events import Where


@dataclass
class Activations:
    """Rows of one residual point with their coordinates, all [rows] tensors but ``values``:
    ``prompt`` (index into the prompts), ``block``, ``step`` (denoising step within the block),
    ``position`` (within the block), ``masked`` (still masked at that step), ``unmask_step`` (the
    step that unmasked the position; -1 for a position past the response's end) and ``token``
    (the token the generation put there; -1 likewise)."""

    values: torch.Tensor
    prompt: torch.Tensor
    block: torch.Tensor
    step: torch.Tensor
    position: torch.Tensor
    masked: torch.Tensor
    unmask_step: torch.Tensor
    token: torch.Tensor
    point: str = ""
    results: list | None = None  # the generations, one per prompt

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index) -> "Activations":
        """The rows picked by a boolean mask or an index tensor."""
        return Activations(*(getattr(self, f.name)[index] for f in fields(self)[:8]), point=self.point,
                           results=self.results)

    def __repr__(self) -> str:
        prompts = int(self.prompt.max()) + 1 if len(self) else 0
        return (f"Activations({self.point}: {len(self)} rows of {self.values.shape[-1]} from {prompts} generations, "
                f"{int(self.masked.sum())} masked)")


def check_prompts(prompts, what: str) -> list:
    """A non-empty list of prompts (strings, token-id lists or chat conversations)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise InputError(f"{what}: prompts must be a non-empty list of prompts")
    if all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompts):
        raise InputError(f"{what}: prompts is one prompt of token ids; give a list of prompts ([ids])")
    return list(prompts)


def batch_rows(where: Where) -> list[tuple[int, int]]:
    """(batch index, request row) of a model event's batch: a single generation is row 0."""
    return list(enumerate(where.rows if where.rows is not None else (0,)))


def collect(engine, prompts, layer: int | None = None, *, point: str | None = None, kind: str = P.OUTPUT,
            batch_size: int = 16, **generate) -> Activations:
    """Generate ``prompts`` (block diffusion, in batches of ``batch_size``; ``generate``: the
    request's settings) and keep the preview rows at ``layers.{layer}.{kind}`` (or ``point``): every
    block position at every denoising step. A look-ahead policy's next-block rows are left out."""
    prompts = check_prompts(prompts, "collect")
    batch_size = count("batch_size", batch_size)
    if generate.get("mode", "diffusion") != "diffusion":
        raise InputError(f"collect reads denoising steps: mode must be 'diffusion', got {generate['mode']!r}")
    point = residual_point(engine, layer, kind) if point is None else residual_point(engine, *_split(point))
    columns: dict[str, list] = {k: [] for k in ("values", "prompt", "block", "step", "position", "masked")}
    results = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        with engine.capture([point, P.DENOISE_STEP]) as cap:
            out = engine.generate(chunk, **generate)
        results += list(out)
        masked_at = {(rec.row if rec.row is not None else 0, rec.block, rec.step): set(rec["masked"])
                     for rec in cap[P.DENOISE_STEP]}
        for rec in cap[point]:
            if rec["mode"] != "preview":
                continue
            value = rec["value"]  # [B, T, H]
            T = min(value.shape[1], engine.block_size)  # past the block: a look-ahead's next block
            for b, r in batch_rows(rec.where):
                masked = masked_at.get((r, rec.block, rec.step), set())
                columns["values"].append(value[b, :T].float().cpu())
                columns["prompt"].append(torch.full((T,), start + r))
                columns["block"].append(torch.full((T,), rec.block))
                columns["step"].append(torch.full((T,), rec.step))
                columns["position"].append(torch.arange(T))
                columns["masked"].append(torch.tensor([p in masked for p in range(T)]))
    if not columns["values"]:
        raise InputError(f"collect: the generations had no preview at {point} (max_new_tokens=0?)")
    cols = {k: torch.cat(v) for k, v in columns.items()}
    unmask, token = final_tokens(results, cols["prompt"], cols["block"], cols["position"], engine.block_size)
    return Activations(cols["values"], cols["prompt"], cols["block"], cols["step"], cols["position"], cols["masked"],
                       unmask, token, point, results)


def final_tokens(results, prompt: torch.Tensor, block: torch.Tensor, position: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the step that unmasked its position and the token placed there (-1: past the
    response's end). Blocks are ``block_size`` long but the last, so response token t is block
    t // block_size, position t % block_size."""
    unmask = torch.full(prompt.shape, -1)
    token = torch.full(prompt.shape, -1)
    t = block * block_size + position
    for i, result in enumerate(results):
        rows = (prompt == i).nonzero().squeeze(1)
        if not len(rows):
            continue
        steps = torch.tensor(result.unmask_steps + [-1], dtype=torch.long)
        ids = torch.tensor(result.token_ids + [-1], dtype=torch.long)
        at = t[rows].clamp(max=len(result.token_ids))  # past the end: the -1 appended
        unmask[rows], token[rows] = steps[at], ids[at]
    return unmask, token


def _split(point: str) -> tuple[int | None, str]:
    if not isinstance(point, str):
        raise InputError(f"point must be a residual point name, got {type(point).__name__}")
    return P.parse(point)


def residual_point(engine, layer, kind: str = P.OUTPUT) -> str:
    """``layers.{layer}.{kind}`` of the engine's model, checked: an existing layer and a residual
    point it has."""
    layers = engine.model.config.num_hidden_layers
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or not 0 <= layer < layers:
        raise InputError(f"layer {layer!r}: the model has layers 0..{layers - 1}")
    try:
        name = P.layer_point(int(layer), kind)
    except KeyError as e:
        raise InputError(f"kind {kind!r}: {e.args[0]}") from None
    if name not in engine.model.hooks.points or not P.is_residual(name):
        raise InputError(f"{name} is not a residual point of this model (layer {layer} is "
                         f"{engine.model.config.layer_types[int(layer)]})")
    return name
