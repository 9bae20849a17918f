"""A trace read back is checked before it is used: ``trace.json``'s structure (every record a
point, run, phase, block, step, where and data of their types) and each record's data against
the point it claims to be (its fields, their types, and the shapes that must agree: a route's
``expert_ids`` [T, k] for its ``positions`` [T], a residual ``value`` [B, T, H]). A damaged or
edited trace is a :class:`TraceError` naming the file, the record and the field, never a
KeyError later or a replay of wrong values."""
from __future__ import annotations

import torch

from ..errors import CloverError
from . import points as P

PHASES = (None, "prefill", "decode")
MODES = ("commit", "preview")
INT, FLOAT = "int", "float"
# per kind of point: field -> (tensor dtype kind, dims) for tensors, or the Python types allowed
_ROUTE = dict(layer=(int,), mode=(str,), positions=(INT, 1), router_probs=(FLOAT, 2), expert_ids=(INT, 2),
              weights=(FLOAT, 2))
_RESIDUAL = dict(layer=(int, type(None)), mode=(str,), positions=(INT, (1, 2)), value=(FLOAT, 3))
FIELDS = {
    P.DENOISE_STEP: dict(canvas=(INT, 1), masked=(list,), candidates=(INT, 1), confidences=(FLOAT, 1),
                         unmask=(list,)),
    P.BLOCK_COMMIT: dict(tokens=(list,), steps=(int,), start=(int,)),
    P.MOE_ROUTE: _ROUTE,
    P.GDN_PREVIEW: dict(layer=(int,), positions=(INT, (1, 2)), history_weights=(FLOAT, 3), history_reads=(FLOAT, 4)),
    P.GDN_STATE: dict(layer=(int,), state=(FLOAT, 4), ring=(FLOAT, 3), length=(int,)),
    **{kind: _RESIDUAL for kind in P.RESIDUAL_KINDS + (P.FINAL_NORM_OUTPUT,)},
}


class TraceError(CloverError, ValueError):
    """A trace directory that cannot be read back as written: the message names the file, the
    record and the field."""


def check_document(doc: dict, where: str) -> None:
    """``trace.json``'s structure: points, and records whose fields have their types."""
    if not isinstance(doc.get("points"), list) or not all(isinstance(p, str) for p in doc["points"]):
        raise TraceError(f"{where}: 'points' must be a list of point names")
    if not isinstance(doc.get("records"), list):
        raise TraceError(f"{where}: 'records' must be a list, got {type(doc.get('records')).__name__}")
    if doc.get("meta") is not None and not isinstance(doc["meta"], dict):
        raise TraceError(f"{where}: 'meta' must be an object")
    for i, row in enumerate(doc["records"]):
        at = f"{where}: record {i}"
        if not isinstance(row, dict):
            raise TraceError(f"{at}: expected an object, got {type(row).__name__}")
        _field(row, "point", at, lambda v: isinstance(v, str) and v in doc["points"], "a point listed in 'points'")
        _field(row, "run", at, _count, "an int >= 0")
        _field(row, "phase", at, lambda v: v in PHASES, "null, 'prefill' or 'decode'")
        for name in ("block", "step"):
            _field(row, name, at, lambda v: v is None or _count(v), "null or an int >= 0")
        _field(row, "data", at, lambda v: isinstance(v, dict), "an object")
        _field(row, "where", at, _where_ok, "null or [run, phase, block, step, commit_block, rows]", missing=True)


def _field(row: dict, name: str, at: str, ok, what: str, missing: bool = False) -> None:
    if name not in row:
        if missing:
            return
        raise TraceError(f"{at}: field {name!r} is missing")
    if not ok(row[name]):
        raise TraceError(f"{at} ({row.get('point')}): field {name!r} = {row[name]!r:.80}: expected {what}")


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _where_ok(v) -> bool:
    if v is None:
        return True
    if not isinstance(v, list) or len(v) != 6:
        return False
    run, phase, block, step, commit_block, rows = v
    return (_count(run) and phase in PHASES and all(x is None or _count(x) for x in (block, step, commit_block))
            and (rows is None or (isinstance(rows, list) and rows and all(_count(r) for r in rows))))


def check_record(point: str, data: dict, at: str, config=None) -> None:
    """One record's data against its point's kind: fields present, of their types, shapes agreeing
    (and, with the recorded model's ``config``, route shapes and expert ids within it)."""
    try:
        kind = P.parse(point)[1]
    except CloverError as e:
        raise TraceError(f"{at}: {e}") from None
    spec = FIELDS.get(kind)
    if spec is None:
        return
    for name, want in spec.items():
        if name not in data:
            raise TraceError(f"{at}: field {name!r} is missing")
        value = data[name]
        if isinstance(want[0], str):
            dims = want[1] if isinstance(want[1], tuple) else (want[1],)
            if not isinstance(value, torch.Tensor):
                raise TraceError(f"{at}: field {name!r} must be a tensor, got {type(value).__name__}")
            floating = value.is_floating_point()
            if (want[0] == FLOAT) != floating or value.dtype == torch.bool or value.dim() not in dims:
                raise TraceError(f"{at}: field {name!r} must be {'a floating' if want[0] == FLOAT else 'an integer'} "
                                 f"tensor of {' or '.join(map(str, dims))} dims, got {value.dtype} "
                                 f"{tuple(value.shape)}")
        elif not isinstance(value, want) or isinstance(value, bool):
            raise TraceError(f"{at}: field {name!r} must be {' or '.join(t.__name__ for t in want)}, got "
                             f"{type(value).__name__} {value!r:.60}")
    if "mode" in spec and data["mode"] not in MODES:
        raise TraceError(f"{at}: field 'mode' = {data['mode']!r}: expected 'commit' or 'preview'")
    if kind == P.MOE_ROUTE:
        _route_shapes(data, at, config)
    elif "value" in spec:
        T = data["positions"].shape[-1]
        if data["value"].shape[1] != T:
            raise TraceError(f"{at}: field 'value' has shape {tuple(data['value'].shape)}, whose rows do not match "
                             f"the {T} positions")


def _route_shapes(data: dict, at: str, config) -> None:
    T = data["positions"].shape[0]
    ids, probs, weights = data["expert_ids"], data["router_probs"], data["weights"]
    if ids.shape[0] != T or probs.shape[0] != T or weights.shape != ids.shape:
        raise TraceError(f"{at}: route fields disagree in shape: positions [{T}], expert_ids {list(ids.shape)}, "
                         f"weights {list(weights.shape)}, router_probs {list(probs.shape)}")
    if config is not None:
        E, k = config.num_experts, config.num_experts_per_tok
        if probs.shape[1] != E or ids.shape[1] != k:
            raise TraceError(f"{at}: router_probs {list(probs.shape)} and expert_ids {list(ids.shape)} do not fit "
                             f"the recorded model's {E} experts, top-{k}")
        if ids.numel() and not bool(((ids >= 0) & (ids < E)).all()):
            raise TraceError(f"{at}: expert_ids outside [0, {E})")
