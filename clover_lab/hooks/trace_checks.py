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
    """One record's data against its point's declaration (``points.py``): fields present, of their
    types, shapes agreeing (and, with the recorded model's ``config``, route shapes and expert ids
    within it). A point declared nowhere here is read as saved."""
    try:
        declared = P.declaration(point)
    except CloverError as e:
        raise TraceError(f"{at}: {e}") from None
    if declared is None:
        return
    for name, want in declared.fields.items():
        if want.tensor is None and not want.types:
            continue  # kept, not checked
        if name not in data:
            raise TraceError(f"{at}: field {name!r} is missing")
        _check_field(name, data[name], want, at)
    problem = None if declared.agree is None else declared.agree(data, config)
    if problem is not None:
        raise TraceError(f"{at}: {problem}")


def _check_field(name: str, value, want: P.Saved, at: str) -> None:
    if want.tensor is not None:
        if not isinstance(value, torch.Tensor):
            raise TraceError(f"{at}: field {name!r} must be a tensor, got {type(value).__name__}")
        floating = value.is_floating_point()
        if (want.tensor == P.FLOAT) != floating or value.dtype == torch.bool or value.dim() not in want.dims:
            raise TraceError(f"{at}: field {name!r} must be {'a floating' if want.tensor == P.FLOAT else 'an integer'} "
                             f"tensor of {' or '.join(map(str, want.dims))} dims, got {value.dtype} "
                             f"{tuple(value.shape)}")
    elif not isinstance(value, want.types) or isinstance(value, bool):
        raise TraceError(f"{at}: field {name!r} must be {' or '.join(t.__name__ for t in want.types)}, got "
                         f"{type(value).__name__} {value!r:.60}")
    elif want.choices and value not in want.choices:
        raise TraceError(f"{at}: field {name!r} = {value!r}: expected {' or '.join(map(repr, want.choices))}")
