"""Logits no token can be chosen from: non-finite ones (the error names where the NaN or inf came
from) and collapsed ones (every token equal: the hidden state reaching the LM head is zero).

The decoders learn that a step's logits are not finite from the one device-to-host transfer they
make per step anyway (a flag stacked onto the decision: ``sampling.logits_health``); only on a
flag other than OK do they come here (:func:`check_logits`), which looks for the source on the
error path, where reading the device costs nothing that matters: the weights, the cache, and (for
a preview) the same preview again without hooks, layer by layer.
"""
from __future__ import annotations

import torch

from clover_lab.engine.requests import GenerationError
from clover_lab.engine.sampling import COLLAPSED, NONFINITE
from clover_lab.model.cache import AttentionCache
from clover_lab.model.context import ForwardContext


def check_logits(run, health: int, where: str, block_ids: torch.Tensor | None = None) -> None:
    """Raise what a step's :func:`logits_health` flag calls for. Collapsed logits while a hook is
    attached inside the model are that intervention's outcome (zeroing the stream ablates it),
    not an error."""
    if health == NONFINITE:
        raise nonfinite_error(run, where, block_ids)
    if health == COLLAPSED and not run.hooks.model_hooks_attached():
        raise collapsed_error(run, where)


def collapsed_error(run, where: str) -> GenerationError:
    """The error for logits equal over the whole vocabulary at ``where``."""
    where = where if run.row is None else f"row {run.row}, {where}"
    dtype = str(run.model.dtype).removeprefix("torch.")
    return GenerationError(f"{where}: the logits are equal for every token (the hidden state reaching the LM head is "
                           f"zero), so no token can be chosen; the generation stopped instead of returning token 0. "
                           f"A residual stream past the square root of {dtype}'s range makes a norm's mean square "
                           f"overflow and its output zero, as an overflowing weight does")


def first_nonfinite_weight(model) -> str | None:
    """The name of the first parameter holding NaN or inf, or None."""
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            return name
    return None


def first_nonfinite_cache(cache) -> str | None:
    """The first cache tensor (in layer order) holding NaN or inf, described, or None."""
    for i in sorted(cache.layers):
        layer = cache.layers[i]
        if isinstance(layer, AttentionCache):
            parts = {"attention keys": layer.k[:, :, :cache.length], "attention values": layer.v[:, :, :cache.length]}
        else:
            parts = {"GDN state": layer.state, "GDN conv ring": layer.ring}
        for what, t in parts.items():
            if not bool(torch.isfinite(t).all()):
                return f"layer {i}'s {what}"
    return None


@torch.no_grad()
def first_nonfinite_layer(model, cache, block_ids: torch.Tensor) -> str | None:
    """Preview ``block_ids`` [m] once more against ``cache`` with no hook called (the cache is only
    read) and name the first decoder layer whose output is not finite, or None when the whole
    preview is finite."""
    ctx = ForwardContext.cached(cache, 0, block_ids.shape[0], model.device)
    ctx.hooks = False
    bad: list[int] = []

    def check(i):
        def hook(module, args, out):
            out = out[0] if isinstance(out, tuple) else out  # a layer returns (stream, next norm of it)
            if not bad and not bool(torch.isfinite(out).all()):
                bad.append(i)
        return hook

    handles = [layer.register_forward_hook(check(i)) for i, layer in enumerate(model.model.layers)]
    try:
        x = model.hidden_states(block_ids[None].to(model.device), ctx)
        head_finite = bool(torch.isfinite(model.head(x)).all())
    finally:
        for h in handles:
            h.remove()
    if bad:
        return f"layer {bad[0]}"
    return None if head_finite else "the final norm and LM head"


def nonfinite_error(run, where: str, block_ids: torch.Tensor | None = None) -> GenerationError:
    """The error for non-finite logits at ``where`` ("block 2, step 0"), naming their source when
    it can be found: a weight, the cache, or (``block_ids``: a preview) the first layer."""
    model = run.model
    where = where if run.row is None else f"row {run.row}, {where}"
    head = (f"{where}: the logits are not finite (NaN or inf), so no token can be chosen; "
            f"the generation stopped instead of returning garbage")
    name = first_nonfinite_weight(model)
    if name is not None:
        return GenerationError(f"{head}. The weight {name!r} holds NaN or inf (load with check_finite=True "
                               f"to refuse such checkpoints)")
    part = first_nonfinite_cache(run.cache)
    if part is not None:
        return GenerationError(f"{head}. The cache's {part} holds NaN or inf: a hook's edit of a GDN state, or "
                               f"an overflow in {str(model.dtype).removeprefix('torch.')} while committing")
    if block_ids is not None:
        layer = first_nonfinite_layer(model, run.cache, block_ids)
        if layer is not None:
            return GenerationError(f"{head}. The weights and the cache are finite; previewed again without hooks, "
                                   f"{layer} is the first to give non-finite values (an overflow in "
                                   f"{str(model.dtype).removeprefix('torch.')}?)")
        return GenerationError(f"{head}. The weights and the cache are finite and the same preview without hooks is "
                               f"finite: a hook's output (route weights, an edited tensor) made them non-finite")
    return GenerationError(f"{head}. The weights and the cache are finite: a hook's output or an overflow in "
                           f"this forward made them non-finite")
