"""The one place hook point names are made and read.

Names follow one scheme (section 5 of the architecture spec): ``<stage>.<point>`` for the
engine, between forwards (``denoise.step``, ``block.commit``), and ``layers.{i}.<module>.<point>``
inside a forward (``layers.3.moe.route``, ``layers.0.gdn.preview``, ``layers.0.gdn.state``).
Everything else (the model, the engine, capture, the widgets) builds and parses names here.
"""
from __future__ import annotations

DENOISE_STEP = "denoise.step"
BLOCK_COMMIT = "block.commit"
ENGINE_POINTS = (DENOISE_STEP, BLOCK_COMMIT)

MOE_ROUTE = "moe.route"
GDN_PREVIEW = "gdn.preview"
GDN_STATE = "gdn.state"
# per-layer points and the layer types that have them
LAYER_POINTS = {
    MOE_ROUTE: ("linear_attention", "full_attention"),
    GDN_PREVIEW: ("linear_attention",),
    GDN_STATE: ("linear_attention",),
}


def layer_point(layer: int, kind: str) -> str:
    """``layer_point(3, "moe.route")`` -> ``"layers.3.moe.route"``."""
    if kind not in LAYER_POINTS:
        raise KeyError(f"unknown layer point kind {kind!r}; known: {', '.join(LAYER_POINTS)}")
    return f"layers.{layer}.{kind}"


def every_layer(kind: str) -> str:
    """``every_layer("moe.route")`` -> ``"layers.*.moe.route"``: the pattern of a point on every layer."""
    if kind not in LAYER_POINTS:
        raise KeyError(f"unknown layer point kind {kind!r}; known: {', '.join(LAYER_POINTS)}")
    return f"layers.*.{kind}"


def parse(name: str) -> tuple[int | None, str]:
    """``"layers.3.moe.route"`` -> ``(3, "moe.route")``; an engine point -> ``(None, name)``."""
    if name.startswith("layers."):
        _, layer, kind = name.split(".", 2)
        return int(layer), kind
    return None, name


def is_model_point(name: str) -> bool:
    """True for points inside the model's forward (a static step or CUDA graph cannot call them)."""
    return name not in ENGINE_POINTS


def hook_points(layer_types) -> list[str]:
    """Every point of a model with these layer types (``config.layer_types``): the engine's, then
    per layer its route, preview and state points."""
    points = list(ENGINE_POINTS)
    for i, layer_type in enumerate(layer_types):
        for kind in (MOE_ROUTE, GDN_PREVIEW, GDN_STATE):
            if layer_type in LAYER_POINTS[kind]:
                points.append(layer_point(i, kind))
    return points
