"""The one place hook points are declared: each point once, with its name pattern, the event
class it fires and how each field of that event is saved. Capture (what it keeps and clones),
traces (what a trace read back must hold), replay (the event a record is rebuilt as), the static
step (which fields it records for observers that read after it) and the layout test all read
these declarations, so a new point is one :func:`declare` and its fire site.

Names follow one scheme (section 5 of the architecture spec): ``<stage>.<point>`` for the
engine, between forwards (``denoise.step``, ``block.commit``), and ``layers.{i}.<module>.<point>``
inside a forward (``layers.3.moe.route``, ``layers.0.gdn.preview``, ``layers.0.gdn.state``), the
residual stream per layer (``layers.2.input``, ``layers.2.attn.output`` / ``layers.2.gdn.output``,
``layers.2.moe.output``, ``layers.2.output``) and the final norm's output (``final_norm.output``).
Everything else (the model, the engine, capture, the widgets) builds and parses names here.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

from clover_lab.errors import InputError
from clover_lab.hooks.events import CommitEvent, GDNPreviewEvent, GDNStateEvent, ResidualEvent, RouteEvent, StepEvent

LAYER_PREFIX = "layers.{i}."  # a declared name starting so is a point of each layer
INT, FLOAT = "int", "float"
MODES = ("commit", "preview")


@dataclass(frozen=True)
class Saved:
    """How one event field is saved: ``clone`` when a capture must copy it (the engine or a later
    hook may change it in place); what a trace read back must hold there: a ``tensor`` of that
    kind (INT / FLOAT) with one of ``dims`` dims, or one of the Python ``types`` (and, with
    ``choices``, one of those values). Neither: kept as it is, not checked. ``optional``: a field
    added later, which traces saved before it lack (or hold as null)."""

    clone: bool = False
    tensor: str | None = None
    dims: tuple[int, ...] = ()
    types: tuple[type, ...] = ()
    choices: tuple = ()
    optional: bool = False


def tensor(kind: str, dims: int | tuple[int, ...], clone: bool = False, optional: bool = False) -> Saved:
    return Saved(clone, kind, dims if isinstance(dims, tuple) else (dims,), optional=optional)


def value(*types: type, choices: tuple = ()) -> Saved:
    return Saved(types=types, choices=choices)


KEPT = Saved()  # kept by reference, not checked when read back


@dataclass(frozen=True)
class Point:
    """One hook point. ``name``: the point (``"denoise.step"``) or, starting with ``layers.{i}.``,
    a point of every layer whose type is in ``layer_types``; ``event``: the class it fires;
    ``fields``: the event fields a capture keeps, in order, and how (:class:`Saved`); ``engine``:
    fired by the engine between forwards (a static step or CUDA graph never calls it);
    ``residual``: a residual-stream ``value`` a hook may replace; ``agree``: (data, config) ->
    what is wrong with how a saved record's fields agree in shape, or None; ``recorded``: the
    event fields a static step (compiled, or a CUDA graph) writes into its outputs so that
    observers of the point read after it (``engine/observed.py``; the other fields, such as the
    layer, mode, lengths and positions, are the host's), empty for a point whose hooks split a
    static step."""

    name: str
    event: type
    fields: dict[str, Saved]
    layer_types: tuple[str, ...] = ()
    engine: bool = False
    residual: bool = False
    agree: Callable | None = field(default=None, repr=False)
    recorded: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        """What ``parse`` returns as a name's second part: ``moe.route`` for ``layers.{i}.moe.route``."""
        return self.name.removeprefix(LAYER_PREFIX)

    @property
    def per_layer(self) -> bool:
        return self.name.startswith(LAYER_PREFIX)


DECLARED: dict[str, Point] = {}  # kind -> its declaration; per-layer points in firing order within a layer


def declare(name: str, event: type, fields: dict[str, Saved], **how) -> str:
    """Declare a point (see :class:`Point`) and return its kind, the string code names it by."""
    point = Point(name, event, dict(fields), **how)
    if point.kind in DECLARED:
        raise InputError(f"hook point {point.kind!r} is declared twice")
    if point.per_layer != bool(point.layer_types):
        raise InputError(f"hook point {name!r}: a per-layer point ({LAYER_PREFIX}...) names the layer types that "
                         f"have it, and only such a point")
    if not set(point.recorded) <= set(point.fields):
        raise InputError(f"hook point {name!r}: recorded fields {sorted(set(point.recorded) - set(point.fields))} "
                         f"are not among its fields")
    DECLARED[point.kind] = point
    return point.kind


def _route_agrees(data: dict, config) -> str | None:
    T = data["positions"].shape[0]
    ids, probs, weights = data["expert_ids"], data["router_probs"], data["weights"]
    if ids.shape[0] != T or probs.shape[0] != T or weights.shape != ids.shape:
        return (f"route fields disagree in shape: positions [{T}], expert_ids {list(ids.shape)}, "
                f"weights {list(weights.shape)}, router_probs {list(probs.shape)}")
    if config is not None:
        E, k = config.num_experts, config.num_experts_per_tok
        if probs.shape[1] != E or ids.shape[1] != k:
            return (f"router_probs {list(probs.shape)} and expert_ids {list(ids.shape)} do not fit the recorded "
                    f"model's {E} experts, top-{k}")
        if ids.numel() and not bool(((ids >= 0) & (ids < E)).all()):
            return f"expert_ids outside [0, {E})"
    return None


def _rows_agree(data: dict, config) -> str | None:
    T = data["positions"].shape[-1]
    if data["value"].shape[1] != T:
        return (f"field 'value' has shape {tuple(data['value'].shape)}, whose rows do not match the {T} "
                f"positions")
    return None


# --------------------------------------------------------------------------- the points
_BOTH = ("linear_attention", "full_attention")
_GDN, _ATTN = ("linear_attention",), ("full_attention",)
# a residual value is a view of the forward's stream, which a later hook may edit in place
_RESIDUAL = dict(event=ResidualEvent, residual=True, agree=_rows_agree,
                 fields=dict(layer=value(int, type(None)), mode=value(str, choices=MODES),
                             positions=tensor(INT, (1, 2)), value=tensor(FLOAT, 3, clone=True)))

DENOISE_STEP = declare("denoise.step", StepEvent, engine=True, fields=dict(
    canvas=tensor(INT, 1, clone=True), masked=value(list), candidates=tensor(INT, 1), confidences=tensor(FLOAT, 1),
    unmask=value(list), time=KEPT, tokens=KEPT, top_ids=tensor(INT, 2, optional=True),
    top_probs=tensor(FLOAT, 2, optional=True)))
BLOCK_COMMIT = declare("block.commit", CommitEvent, engine=True, fields=dict(
    tokens=value(list), steps=value(int), start=value(int), time=KEPT, drafted=KEPT, accepted=KEPT, rejected=KEPT,
    forwards=KEPT))
ENGINE_POINTS = (DENOISE_STEP, BLOCK_COMMIT)

# per-layer points, in the order they fire within a layer. The residual stream: entering a layer,
# the token mixer's and the MoE block's outputs (what each adds to the stream), leaving the layer.
# ``recorded``: what a static step keeps for the notebook views' observers (MemoryView: the GDN
# state and history weights, ExpertView: the routers' decisions)
INPUT = declare("layers.{i}.input", layer_types=_BOTH, **_RESIDUAL)
GDN_STATE = declare("layers.{i}.gdn.state", GDNStateEvent, layer_types=_GDN, recorded=("state", "ring"), fields=dict(
    layer=value(int), state=tensor(FLOAT, 4, clone=True), ring=tensor(FLOAT, 3, clone=True), length=value(int),
    row_lengths=KEPT))
GDN_PREVIEW = declare("layers.{i}.gdn.preview", GDNPreviewEvent, layer_types=_GDN,
                      recorded=("history_weights", "history_reads"), fields=dict(
    layer=value(int), positions=tensor(INT, (1, 2)), history_weights=tensor(FLOAT, 3),
    history_reads=tensor(FLOAT, 4)))
ATTN_OUTPUT = declare("layers.{i}.attn.output", layer_types=_ATTN, **_RESIDUAL)
GDN_OUTPUT = declare("layers.{i}.gdn.output", layer_types=_GDN, **_RESIDUAL)
MOE_ROUTE = declare("layers.{i}.moe.route", RouteEvent, layer_types=_BOTH, agree=_route_agrees,
                    recorded=("positions", "router_probs", "expert_ids", "weights", "selectable"), fields=dict(
    layer=value(int), mode=value(str, choices=MODES), positions=tensor(INT, 1), router_probs=tensor(FLOAT, 2),
    expert_ids=tensor(INT, 2), weights=tensor(FLOAT, 2), selectable=KEPT))
MOE_OUTPUT = declare("layers.{i}.moe.output", layer_types=_BOTH, **_RESIDUAL)
OUTPUT = declare("layers.{i}.output", layer_types=_BOTH, **_RESIDUAL)
# after the last layer: the rows the LM head reads
FINAL_NORM_OUTPUT = declare("final_norm.output", **_RESIDUAL)


# --------------------------------------------------------------------------- names
def declaration(name: str) -> Point | None:
    """The declaration of a point name (``layers.3.moe.route``, ``denoise.step``), or None."""
    layer, kind = parse(name)
    point = DECLARED.get(kind)
    return point if point is not None and point.per_layer == (layer is not None) else None


def _layer_kind(kind: str) -> Point:
    point = DECLARED.get(kind)
    if point is None or not point.per_layer:
        known = ", ".join(k for k, p in DECLARED.items() if p.per_layer)
        raise KeyError(f"unknown layer point kind {kind!r}; known: {known}")
    return point


def layer_point(layer: int, kind: str) -> str:
    """``layer_point(3, "moe.route")`` -> ``"layers.3.moe.route"``."""
    return _layer_kind(kind).name.replace("{i}", str(layer))


def every_layer(kind: str) -> str:
    """``every_layer("moe.route")`` -> ``"layers.*.moe.route"``: the pattern of a point on every layer.
    fnmatch's ``*`` also matches dots, so ``"layers.*.output"`` would match ``moe.output`` too: the
    patterns of one-word kinds (``input``, ``output``) end the layer number with a digit
    (``"layers.*[0-9].output"``)."""
    _layer_kind(kind)
    return f"layers.*.{kind}" if "." in kind else f"layers.*[0-9].{kind}"


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
    point = DECLARED.get(name)
    return point is None or not point.engine


def is_residual(name: str) -> bool:
    """True for the residual-stream points (per layer and ``final_norm.output``): events whose
    ``value`` a hook may replace."""
    point = declaration(name)
    return point is not None and point.residual


def hook_points(layer_types) -> list[str]:
    """Every point of a model with these layer types (``config.layer_types``): the engine's, then
    per layer its points in firing order, then the points after the last layer (``final_norm.output``)."""
    declared = list(DECLARED.values())
    points = [p.name for p in declared if p.engine]
    for i, layer_type in enumerate(layer_types):
        points += [layer_point(i, p.kind) for p in declared if p.per_layer and layer_type in p.layer_types]
    return points + [p.name for p in declared if not p.engine and not p.per_layer]


def rebuild(name: str, data: dict, where):
    """The live event of point ``name`` made again from a record's fields (and ``where``): what a
    trace's record is turned back into to narrow a batch's event to one row (``for_row``)."""
    point = declaration(name)
    if point is None:
        raise KeyError(f"hook point {name!r} is not declared: its records cannot be rebuilt as events")
    given = {**data, "point": name}
    params = inspect.signature(point.event).parameters
    return point.event(**{k: given[k] for k in params if k in given and k != "where"}, where=where)
