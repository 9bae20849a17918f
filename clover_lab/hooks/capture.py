"""Record chosen hook points over whole generations, tagged with block and step (the generation
counterpart of TransformerLens' ``run_with_cache``).

    with engine.capture(["layers.*.moe.route", "denoise.step"]) as cap:
        engine.generate(prompt)
    cap["layers.3.moe.route"]          # records of one point, in firing order
    cap["layers.*.moe.route"]          # records of every matching point
    cap.by_block("denoise.step")       # {block: [records]}

A capture is scoped like ``engine.hooks(...)``: it records the generations started inside its
``with`` block in this thread or context, not those other threads run meanwhile.

Tensors stay on the model's device (no copies to the host, no synchronisation) unless
``to="cpu"`` is given. Tensors that the engine or a later hook may change in place (the GDN
state and ring, the canvas, residual-stream values) are cloned; the rest are fresh per event and kept by reference.
The hooks are removed when the ``with`` block ends, also on an exception.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable

import torch

from clover_lab.errors import InputError
from clover_lab.hooks import points as P
from clover_lab.hooks.records import Record, RecordSet
from clover_lab.hooks.registry import HookRegistry
from clover_lab.hooks.trace import save_trace


class Capture(RecordSet):
    """Records the points matching ``points`` on ``hooks`` (an engine's registry) over the
    generations started in this thread or context while entered."""

    def __init__(self, hooks: HookRegistry, points: str | Iterable[str], to: str | torch.device | None = None,
                 config=None, tokenizer=None, prompt_of=None):
        self.hooks = hooks
        self.patterns = [points] if isinstance(points, str) else list(points)
        if not self.patterns:
            raise ValueError("capture: name at least one hook point or pattern")
        try:
            self.to = None if to is None else torch.device(to)
        except (RuntimeError, TypeError, ValueError):
            raise InputError(f"capture: to={to!r} is not a device (cpu, cuda, ...)") from None
        if self.to is not None and self.to.type != "meta":  # meta: shapes only (a trace refuses to save them)
            try:
                torch.empty(0, device=self.to)
            except (RuntimeError, AssertionError, ValueError) as e:
                raise InputError(f"capture: to={to!r} cannot be used here ({str(e).splitlines()[0]})") from None
        self.records: list[Record] = []
        self.config = config  # the model's CloverConfig: saved with a trace, so views replay without the model
        self.tokenizer = tokenizer  # the text of the recorded token ids is saved with a trace (token_text)
        # each recorded row's prompt ids, asked of the engine at its prefill (Engine.prompt_of) and saved
        # with a trace: a replayed view names the prompt's tokens as the live one did
        self._prompt_of = prompt_of
        self.prompts: list[dict] = []
        self._handle = None
        self._names = sorted({name for p in self.patterns for name in hooks.resolve(p)}, key=hooks.points.index)

    # ---------------------------------------------------------------- registration
    def __enter__(self) -> "Capture":
        self._handle = self.hooks.open_scope({name: self._recorder(name) for name in self._names})
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _t(self, x: torch.Tensor, clone: bool = False) -> torch.Tensor:
        if self.to is not None and x.device != self.to:
            return x.to(self.to)
        return x.clone() if clone else x

    def _recorder(self, name: str):
        """A hook that records one event of point ``name``: what it keeps, per kind of point."""
        declared = P.declaration(name)
        fields = None if declared is None else {key: saved.clone for key, saved in declared.fields.items()}

        def record(ev):
            data = self._fields(ev, fields)
            self.records.append(Record(name, ev.where.run, ev.where.phase, ev.block, ev.step, data, ev.where))
            if ev.where.phase == "prefill" and self._prompt_of is not None:
                self._note_prompts(ev.where)

        return record

    def _fields(self, ev, fields) -> dict:
        if fields is None:  # a point of a registry not declared in points.py: keep the event's public fields
            fields = {k: False for k in vars(ev) if not k.startswith("_") and k != "where"}
        out = {}
        for key, clone in fields.items():
            value = getattr(ev, key)
            if isinstance(value, torch.Tensor):
                value = self._t(value, clone)
            elif isinstance(value, (list, dict)):
                value = type(value)(value)
            out[key] = value
        return out

    def _note_prompts(self, where) -> None:
        """The prompt ids of the rows a prefill event holds, once per row."""
        for row in where.rows or (None,):
            if any(p["run"] == where.run and p["row"] == row for p in self.prompts):
                continue
            ids = self._prompt_of(replace(where, rows=None if row is None else (row,)))
            if ids is not None:
                self.prompts.append({"run": where.run, "row": row, "ids": list(ids)})

    @property
    def points(self) -> list[str]:
        """The concrete points being recorded."""
        return list(self._names)

    def clear(self) -> None:
        self.records.clear()

    def save(self, path, meta: dict | None = None) -> None:
        """Write the records to the directory ``path`` (tensors in safetensors, the rest in JSON):
        ``clover_lab.load_trace(path)`` reads them back, with no model. ``path`` is a new or empty
        directory or a trace (replaced); one holding other files is refused (``OutputError``)."""
        from clover_lab.hooks.trace import check_meta, token_table

        check_meta(meta)
        config = {} if self.config is None else {"config": self.config.to_dict()}
        vocab = None if self.config is None else self.config.vocab_size
        text = {} if self.tokenizer is None else {
            "token_text": token_table(self.records, self.tokenizer, vocab, self.prompts)}
        prompts = {"prompts": self.prompts} if self.prompts else {}
        save_trace(path, self.records, self.points, {**config, **text, **prompts, **(meta or {})})

