"""The one place hook point names are made and read.

Names follow one scheme (section 5 of the architecture spec): ``<stage>.<point>`` for the
engine, between forwards (``denoise.step``, ``block.commit``), and ``layers.{i}.<module>.<point>``
inside a forward (``layers.3.moe.route``, ``layers.0.gdn.preview``, ``layers.0.gdn.state``), the
residual stream per layer (``layers.2.input``, ``layers.2.attn.output`` / ``layers.2.gdn.output``,
``layers.2.moe.output``, ``layers.2.output``) and the final norm's output (``final_norm.output``).
Everything else (the model, the engine, capture, the widgets) builds and parses names here.
"""
from __future__ import annotations

from ..errors import InputError

DENOISE_STEP = "denoise.step"
BLOCK_COMMIT = "block.commit"
ENGINE_POINTS = (DENOISE_STEP, BLOCK_COMMIT)

MOE_ROUTE = "moe.route"
GDN_PREVIEW = "gdn.preview"
GDN_STATE = "gdn.state"
# the residual stream: entering a layer, the token mixer's and the MoE block's outputs (what each
# adds to the stream), leaving the layer
INPUT = "input"
ATTN_OUTPUT = "attn.output"
GDN_OUTPUT = "gdn.output"
MOE_OUTPUT = "moe.output"
OUTPUT = "output"
RESIDUAL_KINDS = (INPUT, ATTN_OUTPUT, GDN_OUTPUT, MOE_OUTPUT, OUTPUT)
FINAL_NORM_OUTPUT = "final_norm.output"  # after the last layer: the rows the LM head reads
_BOTH = ("linear_attention", "full_attention")
# per-layer points and the layer types that have them, in the order they fire within a layer
LAYER_POINTS = {
    INPUT: _BOTH,
    GDN_STATE: ("linear_attention",),
    GDN_PREVIEW: ("linear_attention",),
    ATTN_OUTPUT: ("full_attention",),
    GDN_OUTPUT: ("linear_attention",),
    MOE_ROUTE: _BOTH,
    MOE_OUTPUT: _BOTH,
    OUTPUT: _BOTH,
}


def layer_point(layer: int, kind: str) -> str:
    """``layer_point(3, "moe.route")`` -> ``"layers.3.moe.route"``."""
    if kind not in LAYER_POINTS:
        raise KeyError(f"unknown layer point kind {kind!r}; known: {', '.join(LAYER_POINTS)}")
    return f"layers.{layer}.{kind}"


def every_layer(kind: str) -> str:
    """``every_layer("moe.route")`` -> ``"layers.*.moe.route"``: the pattern of a point on every layer.
    fnmatch's ``*`` also matches dots, so ``"layers.*.output"`` would match ``moe.output`` too: the
    patterns of ``input`` and ``output`` end the layer number with a digit (``"layers.*[0-9].output"``)."""
    if kind not in LAYER_POINTS:
        raise KeyError(f"unknown layer point kind {kind!r}; known: {', '.join(LAYER_POINTS)}")
    return f"layers.*[0-9].{kind}" if kind in (INPUT, OUTPUT) else f"layers.*.{kind}"


def mixer_output(layer_type: str) -> str:
    """The kind of a layer's token-mixer output point: ``attn.output`` or ``gdn.output``."""
    return GDN_OUTPUT if layer_type == "linear_attention" else ATTN_OUTPUT


def parse(name: str) -> tuple[int | None, str]:
    """``"layers.3.moe.route"`` -> ``(3, "moe.route")``; an engine point or ``final_norm.output``
    -> ``(None, name)``."""
    if name.startswith("layers."):
        parts = name.split(".", 2)
        if len(parts) < 3 or not parts[1].isdigit() or not parts[2]:
            raise InputError(f"point name {name!r}: expected layers.{{i}}.<point> with a layer number i, e.g. "
                             f"layers.3.moe.route, layers.2.output")
        return int(parts[1]), parts[2]
    return None, name


def is_model_point(name: str) -> bool:
    """True for points inside the model's forward (a static step or CUDA graph cannot call them)."""
    return name not in ENGINE_POINTS


def is_residual(name: str) -> bool:
    """True for the residual-stream points (per layer and ``final_norm.output``): events whose
    ``value`` a hook may replace."""
    return name == FINAL_NORM_OUTPUT or parse(name)[1] in RESIDUAL_KINDS


def hook_points(layer_types) -> list[str]:
    """Every point of a model with these layer types (``config.layer_types``): the engine's, then
    per layer its points in firing order, then ``final_norm.output``."""
    points = list(ENGINE_POINTS)
    for i, layer_type in enumerate(layer_types):
        for kind, types in LAYER_POINTS.items():
            if layer_type in types:
                points.append(layer_point(i, kind))
    points.append(FINAL_NORM_OUTPUT)
    return points
