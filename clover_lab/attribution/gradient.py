"""Attribution patching (Nanda's gradient approximation of activation patching): the metric's
gradient at the corrupted run's forward, times the difference between the clean and the
corrupted value, at every (layer, position) of one forward part, in one backward pass instead
of one run per cell.

    est = attribution.attribution_patching(engine, clean, corrupt, metric, block=0, step=0,
                                           kind="input", patch_at=(None, None), positions=range(n))
    real = patching.sweep_layers_positions(engine, clean, corrupt, metric, block=0, step=0,
                                           kind="input", patch_at=(None, None), positions=range(n))
    attribution.correlation(est, real)

Both return a ``patching.Sweep`` (layers x positions, the metric after the patch): the estimate
is ``corrupt + grad . (clean - corrupt)``. The engine's forwards run without gradients, so the
corrupted run's forward at (block, step) is run again here with them: its committed prefix (the
prompt and the blocks before), then the block as the run had it at that step. What it computes is
checked against the metric the run itself read there, before any gradient is trusted.
"""
from __future__ import annotations

import math

import torch

from clover_lab.errors import InputError
from clover_lab.hooks import points as P
from clover_lab.hooks.events import Where
from clover_lab.model.context import ForwardContext
from clover_lab.patching.metrics import Metric, measure
from clover_lab.patching.patch import Source
from clover_lab.patching.sweeps import Sweep, _check_prompts, _coordinate, _layers_with


def _record(engine, prompt, points: list[str], generate: dict):
    """One run recording ``points``' values, its denoising steps and its commits."""
    with engine.capture(points + [P.DENOISE_STEP, P.BLOCK_COMMIT]) as cap:
        engine.generate(prompt, **generate)
    source = Source([r for r in cap.records if "value" in r.data], None, engine.encode(prompt))
    return source, cap


def _forward_with_grad(model, cache, ids: torch.Tensor, mode: str, where: Where) -> torch.Tensor:
    """One cached forward (``mode`` commit or preview) with autograd on: ``CloverModel.forward``'s
    steps, which that method runs under no_grad. Returns the preview rows' logits [1, m, V] (a
    commit returns None)."""
    c, m = (ids.shape[1], 0) if mode == "commit" else (0, ids.shape[1])
    ctx = ForwardContext.cached(cache, c, m, model.input_device, None, where)
    x = model.hidden_states(ids.to(model.input_device), ctx)
    for dst, src in ctx.pending:  # ctx.publish's writes, one by one: its multi-tensor copy has no gradient
        dst.copy_(src)
    cache.advance(c)
    return model.heads(x, ctx, None).preview_logits


def attribution_patching(engine, clean, corrupt, metric: Metric, block: int, step: int, kind: str = P.OUTPUT,
                         patch_at: tuple | None = None, positions=None, **generate) -> Sweep:
    """Layers x positions, estimated: the metric at (``block``, ``step``) of the corrupted run if
    layer i's ``kind`` value at one position were the clean run's, to first order. ``patch_at``:
    the metric's forward (default) or ``(None, None)``, the prompt's prefill (block 0 only).
    Same arguments and result as ``patching.sweep_layers_positions``; two recorded runs and one
    forward and backward, whatever the number of cells."""
    _check_prompts(engine, clean, corrupt, metric)
    if step is None or block is None:
        raise InputError("attribution_patching reads a preview's metric: give its block and step")
    at = (block, step)
    patch_at = at if patch_at is None else tuple(patch_at)
    if patch_at not in (at, (None, None)) or (patch_at == (None, None) and block != 0):
        raise InputError(f"attribution_patching patch_at={patch_at}: the metric's own forward {at}, or the prompt's "
                         f"prefill (None, None) for a metric in block 0")
    model = engine.model
    layers = _layers_with(engine, kind)
    names = [P.layer_point(i, kind) for i in layers]
    clean_src, _ = _record(engine, clean, names, generate)
    corrupt_src, cap = _record(engine, corrupt, names, generate)
    rows = corrupt_src.rows(names[0], *patch_at)
    if not rows or not clean_src.rows(names[0], *patch_at):
        raise InputError(f"attribution_patching: the runs have no {names[0]} at {_coordinate(*patch_at)}")
    positions = sorted(rows) if positions is None else [int(p) for p in positions]
    missing = [p for p in positions if p not in rows]
    if missing:
        raise InputError(f"attribution_patching positions {missing}: not rows of {_coordinate(*patch_at)} "
                         f"(it has {min(rows)}..{max(rows)})")
    steps = [r for r in cap[P.DENOISE_STEP] if (r.block, r.step) == at]
    if not steps:
        raise InputError(f"attribution_patching: the corrupted run took no step {step} of block {block}")
    canvas = steps[0]["canvas"]
    committed = [t for r in cap[P.BLOCK_COMMIT] if r.block < block for t in r["tokens"]]
    prompt_ids = torch.tensor([engine.encode(corrupt)])
    prefix_len = prompt_ids.shape[1] + len(committed)
    if not prefix_len <= metric.position < prefix_len + canvas.numel():
        raise InputError(f"attribution_patching: metric position {metric.position} is not in block {block} "
                         f"(positions {prefix_len}..{prefix_len + canvas.numel() - 1})")

    # zero deltas added where the sites are: their gradient is the metric's gradient there
    deltas: dict[str, torch.Tensor] = {}

    def add_delta(ev):
        if (ev.block, ev.step) != patch_at:
            return
        d = torch.zeros_like(ev.value, requires_grad=True)
        deltas[ev.point] = (d, ev.positions.reshape(-1).tolist())
        ev.value = ev.value + d

    corrupt_v = measure(engine, corrupt, metric, *at, **generate)
    if math.isnan(corrupt_v):
        raise InputError(f"attribution_patching: the corrupted run has no logits at position {metric.position} at "
                         f"{_coordinate(*at)} (a preview reads only the positions still masked)")
    cache = model.new_cache(prefix_len + canvas.numel())
    with torch.enable_grad(), model.hooks.scoped({name: add_delta for name in names}):
        if patch_at == (None, None):
            _forward_with_grad(model, cache, prompt_ids, "commit", Where(phase="prefill"))
        else:
            with torch.no_grad():
                _forward_with_grad(model, cache, prompt_ids, "commit", Where(phase="prefill"))
        if committed:
            with torch.no_grad():
                _forward_with_grad(model, cache, torch.tensor([committed]), "commit", Where(phase="decode"))
        logits = _forward_with_grad(model, cache, canvas[None].cpu(), "preview",
                                    Where(phase="decode", block=block, step=step))
        row = logits[0, metric.position - prefix_len].float()
        if engine.mask_token_id is not None:
            row = row.masked_fill(torch.arange(row.numel(), device=row.device) == engine.mask_token_id, float("-inf"))
        value = metric.fn(row)
        if not math.isclose(float(value.detach()), corrupt_v, rel_tol=1e-3, abs_tol=1e-4):
            raise InputError(f"attribution_patching: the forward run again with gradients gives {float(value.detach()):.6g} "
                             f"where the corrupted run read {corrupt_v:.6g} at {_coordinate(*at)}; the engine's "
                             f"forward there is not the cached commit-then-preview this reruns (a coreset?)")
        grads = torch.autograd.grad(value, [deltas[n][0] for n in names], allow_unused=True)
    values = torch.full((len(layers), len(positions)), float("nan"))
    for r, (name, grad) in enumerate(zip(names, grads)):
        where = deltas[name][1]
        for c, p in enumerate(positions):
            g = torch.zeros(deltas[name][0].shape[-1]) if grad is None else grad[0, where.index(p)].float()
            diff = (clean_src.value(name, *patch_at, p) - corrupt_src.value(name, *patch_at, p))[0].float()
            values[r, c] = corrupt_v + float(g @ diff)
    return Sweep(values, layers, positions, "layer", "position", measure(engine, clean, metric, *at, **generate),
                 corrupt_v, metric.name,
                 f"{kind} at {_coordinate(*patch_at)}, attribution patching (gradient x difference); read at "
                 f"{_coordinate(*at)}")


def correlation(a: Sweep, b: Sweep) -> float:
    """Pearson correlation of two sweeps' effects (value - corrupt) over the cells both have."""
    x, y = a.values - a.corrupt, b.values - b.corrupt
    ok = ~(x.isnan() | y.isnan())
    x, y = x[ok].double(), y[ok].double()
    if x.numel() < 2 or float(x.std()) == 0 or float(y.std()) == 0:
        return math.nan
    return float(torch.corrcoef(torch.stack([x, y]))[0, 1])
