"""Traces: a recording saved to disk and read back without a model (tensors in safetensors,
everything else in JSON), and ``diff``: where two runs part.

    cap.save("runs/a")                      # a directory: trace.json + tensors.safetensors
    a = clover_lab.load_trace("runs/a")
    a["layers.0.moe.route"][0]["expert_ids"]
    a.diff(clover_lab.load_trace("runs/b")) # the first (block, step, point, layer) that differs

A trace read back is checked before it is used: ``trace.json``'s structure (every record a
point, run, phase, block, step, where and data of their types) and each record's data against
the point it claims to be (its fields, their types, and the shapes that must agree: a route's
``expert_ids`` [T, k] for its ``positions`` [T], a residual ``value`` [B, T, H]). A damaged or
edited trace is a :class:`TraceError` naming the file, the record and the field, never a
KeyError later or a replay of wrong values.
"""
from __future__ import annotations

import json
import math
from dataclasses import astuple, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from clover_lab.errors import CloverError, InputError
from clover_lab.hooks import points as P
from clover_lab.hooks.events import Where
from clover_lab.hooks.records import Record, RecordSet
from clover_lab.writes import FileSet, refuse_foreign, refuse_unfinished

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
        _field(row, "where", at, _where_ok, "null or [run, phase, block, step, commit_block, rows, cached]", missing=True)


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
    if not isinstance(v, list) or len(v) not in (6, 7):  # traces saved before ``cached`` have 6
        return False
    run, phase, block, step, commit_block, rows, *cached = v
    return (_count(run) and phase in PHASES and all(x is None or _count(x) for x in (block, step, commit_block))
            and (rows is None or (isinstance(rows, list) and rows and all(_count(r) for r in rows)))
            and all(_count(c) for c in cached))


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
        if want.optional and data.get(name) is None:
            continue  # a field added later: a trace saved before it has none
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


FORMAT = "clover-lab-trace"
VERSION = 1
META_FILE, TENSOR_FILE = "trace.json", "tensors.safetensors"


def _encode(value, name: str, tensors: dict):
    """A record field as JSON, its tensors moved to ``tensors`` under ``name``."""
    if isinstance(value, torch.Tensor):
        if value.is_meta:  # capture(to="meta") keeps shapes, not values
            raise InputError(f"save: record field {name} is a tensor on the meta device (a capture made with "
                             f"to='meta' keeps shapes, not values), which a trace cannot hold; capture with "
                             f"to='cpu' (or the model's device) to save")
        tensors[name] = value.detach().to("cpu").contiguous().clone()
        return {"tensor": name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (list, tuple)):
        return [_encode(v, f"{name}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _encode(v, f"{name}.{k}", tensors) for k, v in value.items()}}
    if isinstance(value, dict) and all(isinstance(k, int) for k in value):  # e.g. position -> token
        return {"int_dict": [[k, _encode(v, f"{name}.{k}", tensors)] for k, v in value.items()]}
    raise TypeError(f"{name}: cannot save a {type(value).__name__} in a trace")


def _decode(value, tensors: dict, where: str):
    if isinstance(value, list):
        return [_decode(v, tensors, where) for v in value]
    if isinstance(value, dict):
        if "tensor" in value:
            if value["tensor"] not in tensors:
                raise TraceError(f"{where}: tensor {value['tensor']!r} is missing from {TENSOR_FILE}")
            return tensors[value["tensor"]]
        if "float" in value:
            return float(value["float"])
        if "int_dict" in value:
            return {int(k): _decode(v, tensors, where) for k, v in value["int_dict"]}
        return {k: _decode(v, tensors, where) for k, v in value["dict"].items()}
    return value


def check_meta(meta) -> None:
    """``save(meta=...)``: a dict whose values JSON holds (str, int, float, bool, None, lists and
    dicts of them, string keys); else an InputError naming the key, before anything is written
    (a set or an object was json's TypeError from deep inside)."""
    if meta is None:
        return
    if not isinstance(meta, dict):
        raise InputError(f"save: meta must be a dict, got {type(meta).__name__}")

    def check(value, where: str) -> None:
        if value is None or isinstance(value, (bool, int, float, str)):
            return
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                check(v, f"{where}[{i}]")
        elif isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise InputError(f"save: meta{where} has the key {k!r}, not a string: JSON keys are strings")
                check(v, f"{where}[{k!r}]")
        else:
            raise InputError(f"save: meta{where} is {type(value).__name__} {value!r:.60}, which JSON cannot hold; "
                             f"give str, int, float, bool, None, or lists and dicts of them")

    check(meta, "")


def save_trace(path, records: list[Record], points: list[str], meta: dict | None = None) -> None:
    """Write ``records`` to the directory ``path``: a new or empty one, or a trace (replaced).
    Refused when it holds other files (nothing of a user's is ever removed); the two files are
    put in place together (``writes.FileSet``), so an error leaves nothing half-written and a
    trace replaced stays whole until the new one is."""
    path = Path(path)
    check_meta(meta)
    tensors: dict[str, torch.Tensor] = {}
    rows = []
    for i, r in enumerate(records):
        data = {k: _encode(v, f"{i}.{k}", tensors) for k, v in r.data.items()}
        where = None if r.where is None else list(astuple(r.where))
        rows.append(dict(point=r.point, run=r.run, phase=r.phase, block=r.block, step=r.step, where=where, data=data))
    doc = dict(format=FORMAT, version=VERSION, points=list(points), meta=meta or {}, records=rows)
    try:
        text = json.dumps(doc)  # fails here, before anything is written, on what JSON cannot hold
    except (TypeError, ValueError) as e:
        raise InputError(f"save: a record holds a value JSON cannot hold ({e})") from None
    refuse_foreign(path, {META_FILE, TENSOR_FILE}, "a trace")
    with FileSet(path) as files:
        save_file(tensors, str(files.path(path / TENSOR_FILE)))
        files.path(path / META_FILE).write_text(text)  # last: the file that makes it a trace


@dataclass
class Divergence:
    """Where two runs part: the first record (in firing order) whose ``field`` differs."""

    block: int | None
    step: int | None
    point: str
    layer: int | None
    field: str
    max_abs_diff: float | None = None
    reason: str = "values differ"

    def __str__(self):
        at = f"block {self.block}, step {self.step}, {self.point}"
        diff = "" if self.max_abs_diff is None else f" (max |diff| {self.max_abs_diff:.3g})"
        if self.reason == "values differ":  # "value values differ" read as a stutter: name the field
            return f"{at}: field {self.field!r} differs{diff}"
        return f"{at}: {self.field} {self.reason}{diff}"


class Trace(RecordSet):
    """A saved recording, read back on the CPU: the same reading API as ``Capture``."""

    def __init__(self, records: list[Record], points: list[str], meta: dict | None = None, path=None):
        records = list(records)
        odd = next((r for r in records if not isinstance(r, Record)), None)
        if odd is not None:
            raise TraceError(f"Trace: records must be Record objects (a Capture's or a loaded trace's), got "
                             f"{type(odd).__name__}")
        self.records, self.points, self.meta, self.path = records, list(points), dict(meta or {}), path

    def __repr__(self):
        runs = self.runs  # the engine's run ids: a run is named by its id, not shown as a list
        said = f"run {runs[0]}" if len(runs) == 1 else f"{len(runs)} runs (ids {', '.join(map(str, runs))})"
        return f"Trace({len(self.records)} records of {len(self.points)} points, {said})"

    @property
    def tokenizer(self) -> "TokenText | None":
        """The text of the recorded token ids, as a tokenizer's ``decode`` (views replayed without
        an engine show text); None for a trace saved without a tokenizer, or before there was one."""
        table = self.meta.get("token_text")
        return None if not isinstance(table, dict) else TokenText(table)

    def prompt_of(self, where) -> list[int] | None:
        """The prompt's token ids of the row an event's ``where`` names (its ``run`` and, in a batch,
        its ``row``), as the capture saw it at that row's prefill; None for a trace saved without it."""
        for p in self.meta.get("prompts") or []:
            if isinstance(p, dict) and p.get("run") == where.run and p.get("row") == where.row:
                return [int(i) for i in p.get("ids") or []]
        return None

    @property
    def config(self):
        """The recorded model's CloverConfig (None when the trace was saved without one)."""
        from clover_lab.config import CloverConfig

        d = self.meta.get("config")
        return None if d is None else CloverConfig.from_dict(d, source=f"{self.path}/{META_FILE}")

    def save(self, path, meta: dict | None = None) -> None:
        check_meta(meta)
        save_trace(path, self.records, self.points, {**self.meta, **(meta or {})})

    def diff(self, other: "Trace", atol: float = 1e-5, rtol: float = 1e-4,
             ignore: tuple[str, ...] = ("time",)) -> Divergence | None:
        """The first (block, step, point, layer) where ``other`` differs from this trace beyond the
        tolerance (records matched by point, phase, block, step, mode and order), or None.
        ``ignore``: fields never compared (wall-clock times by default)."""
        if not isinstance(other, RecordSet):
            raise InputError(f"Trace.diff: other must be a Trace or a Capture (records of a run), got "
                             f"{type(other).__name__}")
        theirs = _keyed(other.records)
        seen: dict[tuple, int] = {}
        for r in self.records:
            key = _key(r)
            n = seen[key] = seen.get(key, -1) + 1
            layer = P.parse(r.point)[0]
            match = theirs.get(key, [])
            if n >= len(match):
                return Divergence(r.block, r.step, r.point, layer, "record", reason="is missing from the other run")
            for name, value in r.data.items():
                if name in ignore:
                    continue
                found = _differs(value, match[n].data.get(name), atol, rtol)
                if found is not None:
                    return Divergence(r.block, r.step, r.point, layer, name, found[1], found[0])
        extra = sum(len(v) for v in theirs.values()) - len(self.records)
        if extra > 0:
            return Divergence(None, None, "*", None, "record", reason=f"the other run has {extra} more records")
        return None


def _key(r: Record) -> tuple:
    return (r.point, r.phase, r.block, r.step, r.data.get("mode"))


def _keyed(records) -> dict[tuple, list[Record]]:
    out: dict[tuple, list[Record]] = {}
    for r in records:
        out.setdefault(_key(r), []).append(r)
    return out


def _differs(a, b, atol: float, rtol: float) -> tuple[str, float | None] | None:
    """None when equal within tolerance, else (reason, max |difference| for tensors)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return "is a tensor in one run only", None
        if a.shape != b.shape:
            return f"has shape {tuple(a.shape)} vs {tuple(b.shape)}", None
        if a.is_floating_point() or b.is_floating_point():
            x, y = a.double().cpu(), b.double().cpu()
            if torch.allclose(x, y, atol=atol, rtol=rtol, equal_nan=True):
                return None
            return "values differ", float((x - y).abs().nan_to_num(nan=math.inf).max()) if x.numel() else 0.0
        return None if torch.equal(a.cpu(), b.cpu()) else ("values differ", float((a.cpu() - b.cpu()).abs().max()))
    if isinstance(a, float) and isinstance(b, float) and not isinstance(a, bool):
        return None if math.isclose(a, b, rel_tol=rtol, abs_tol=atol) or a == b else ("values differ", abs(a - b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for x, y in zip(a, b):
            found = _differs(x, y, atol, rtol)
            if found is not None:
                return found
        return None
    return None if a == b else (f"is {a!r} vs {b!r}", None)


class TokenText:
    """A trace's table of token id -> text, read like a tokenizer: ``decode([id])``. An id the
    table lacks reads as ``<id>``."""

    def __init__(self, table: dict):
        self.table = {int(k): str(v) for k, v in table.items()}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.table.get(int(i), f"<{int(i)}>") for i in ids)


def token_table(records, tokenizer, vocab_size: int | None, prompts=()) -> dict[str, str]:
    """The text of every integer the records (and the ``prompts``' ids) hold that can be a token id
    (below ``vocab_size``): enough for a view to show text without the tokenizer, far smaller than
    the vocabulary."""
    ids: set[int] = {int(i) for p in prompts for i in p["ids"]}

    def collect(value):
        if isinstance(value, torch.Tensor):
            if not value.is_meta and not value.is_floating_point() and not value.is_complex() \
                    and value.dtype != torch.bool:  # meta: no values (save names it)
                ids.update(value.detach().flatten().cpu().tolist())
        elif isinstance(value, bool):
            return
        elif isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                collect(v)
        elif isinstance(value, dict):
            for v in value.values():
                collect(v)

    for r in records:
        collect(r.data)
    table = {}
    for i in sorted(ids):
        if i < 0 or (vocab_size is not None and i >= vocab_size):
            continue
        try:
            table[str(i)] = tokenizer.decode([i], skip_special_tokens=False)
        except Exception:  # noqa: BLE001 - an id the tokenizer cannot decode: left out (shown as <id>)
            pass
    return table


def load_trace(path) -> Trace:
    """Read a trace written by ``Capture.save`` (a directory); errors name the file at fault."""
    path = Path(path)
    refuse_unfinished(path, TraceError)
    meta_file, tensor_file = path / META_FILE, path / TENSOR_FILE
    for f in (meta_file, tensor_file):
        if not f.is_file():
            raise FileNotFoundError(f"{f}: not found; a trace is a directory written by Capture.save")
    try:
        doc = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"{meta_file}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TraceError(f"{meta_file}: not a clover_lab trace (format {doc.get('format') if isinstance(doc, dict) else None!r})")
    if doc.get("version") != VERSION:
        raise TraceError(f"{meta_file}: trace version {doc.get('version')!r}; this clover_lab reads version {VERSION}")
    check_document(doc, str(meta_file))
    try:
        tensors = load_file(str(tensor_file))
    except Exception as e:  # noqa: BLE001 - safetensors' own error (truncated, not a header): named
        raise TraceError(f"{tensor_file}: cannot be read as safetensors ({e}); the trace is damaged") from None
    trace = Trace([], doc["points"], doc.get("meta"), path)
    try:
        config = trace.config
    except CloverError as e:
        raise TraceError(f"{meta_file}: meta.config: {e}") from None
    for i, row in enumerate(doc["records"]):
        where = f"{meta_file}: record {i} ({row['point']})"
        data = {}
        for k, v in row["data"].items():
            try:
                data[k] = _decode(v, tensors, where)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise TraceError(f"{where}: field {k!r} cannot be decoded ({type(e).__name__}: {e})") from None
        check_record(row["point"], data, where, config)
        rec_where = None if row.get("where") is None else _where(row["where"])
        trace.records.append(Record(row["point"], row["run"], row["phase"], row["block"], row["step"], data, rec_where))
    return trace


def _where(fields: list) -> Where:
    """A saved Where (its fields in order; rows, when saved, back as a tuple)."""
    where = Where(*fields)
    return where if where.rows is None else replace(where, rows=tuple(where.rows))
