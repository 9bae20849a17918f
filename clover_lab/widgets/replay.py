"""Views fed from a saved trace instead of a live engine, and the export of every frame.

``replay(view, trace)`` hands each record of the points the view listens to back to the view as
an event (``RecordedEvent``: the recorded fields, and ``where`` rebuilt from the record's run,
phase, block and step), so a trace saved by ``Capture.save`` shows in any view with no model.
``frames_html(view)`` renders every frame of a view into one page with a slider.
"""
from __future__ import annotations

import fnmatch
import html
from types import SimpleNamespace

from clover_lab.errors import InputError
from clover_lab.hooks import points as P
from clover_lab.hooks.events import Where

_NO_LOGITS = None  # a trace keeps no logits: views fall back to the recorded candidates


class RecordedEvent:
    """A record standing in for the event it was made from."""

    logits = _NO_LOGITS

    def __init__(self, record):
        self.__dict__.update(record.data)
        self.point = record.point
        self.block, self.step = record.block, record.step
        if record.where is not None:
            self.where = record.where
        elif record.step is None:  # a commit's rows (or the prefill's): the block being committed
            self.where = Where(record.run, record.phase, commit_block=record.block)
        else:
            self.where = Where(record.run, record.phase, record.block, record.step)
        self.selectable = record.data.get("selectable")
        self.tokens = record.data.get("tokens", {})

    def for_row(self, row: int):
        """As ``Event.for_row``: a batched trace's model record is cut to one row by the event
        class it was recorded from."""
        rows = self.where.rows
        if rows is None:
            return self
        if row not in rows:
            return None
        # the live event of its point (declared in points.py), rebuilt from the recorded fields
        return self if len(rows) == 1 else P.rebuild(self.point, self.__dict__, self.where).for_row(row)

    @property
    def run(self) -> int:
        return self.where.run

    @property
    def phase(self):
        return self.where.phase

    def __repr__(self):
        return f"RecordedEvent({self.point!r}, block={self.block}, step={self.step})"


def replay(view, trace, engine=None) -> int:
    """Feed ``trace``'s records of the points ``view`` listens to into it, in firing order;
    returns the number of records replayed. Raises when the trace holds none of them.
    ``engine``: for a view that computes from the model's weights (LensView), the engine whose
    model made the trace; it is read, never run."""
    methods = view.hook_methods()
    chosen = []
    for rec in trace.records:
        for pattern, method in methods.items():
            if rec.point == pattern or fnmatch.fnmatchcase(rec.point, pattern):
                chosen.append((method, rec))
                break
    if not chosen:
        raise ValueError(f"{type(view).__name__} listens to {', '.join(methods)}; the trace records "
                         f"{', '.join(trace.points)}: nothing to replay")
    lacking = [p for p in view.replay_needs if not any(fnmatch.fnmatchcase(rec.point, p) for _, rec in chosen)]
    if lacking:  # a LensView fed steps without the layer outputs drew nothing, or failed deep inside
        shown = [p.replace("*[0-9]", "*") for p in methods]  # the point patterns as a user writes them
        raise InputError(f"{type(view).__name__}.replay needs records of "
                         f"{', '.join(p.replace('*[0-9]', '*') for p in lacking)}, and the trace has none (it records "
                         f"{', '.join(trace.points)}); capture them too: engine.capture({shown!r})")
    rows = sorted({i for _, rec in chosen if rec.rows is not None for i in rec.rows})
    if rows and view.row not in rows:  # else it would show no frame at all
        raise InputError(f"{type(view).__name__}.row={view.row!r}: the trace is of a batch of rows {rows[0]}.."
                         f"{rows[-1]}; set view.row to one of them")
    config = getattr(trace, "config", None)
    view.replayed_tokenizer = getattr(trace, "tokenizer", None)  # token text saved with the trace, if any
    view.replayed_prompt_of = getattr(trace, "prompt_of", None)  # the prompts a capture saved, if any
    if engine is not None:
        same_model(type(view).__name__, config, [rec for _, rec in chosen], engine.model.config)
        view._on_attach(engine)
    elif view.needs_model:
        raise ValueError(f"{type(view).__name__}.replay needs the model that made the trace (engine=...): a "
                         f"trace holds the residual stream, not the weights that turn it into logits")
    elif config is not None:  # the views size their controls from the model's config, as when attached
        view._on_attach(SimpleNamespace(model=SimpleNamespace(config=config)))
    for method, rec in chosen:
        view._dispatch(method, RecordedEvent(rec))
    view.flush()
    return len(chosen)


def same_model(who: str, recorded, chosen, config) -> None:
    """An InputError when the records to replay through ``config``'s model were made by another
    model: the trace's config (``recorded``, when saved with one) differs in a field that decides a
    shape, or a record names a layer it lacks or holds a residual stream of another width (a
    shape error from inside the model's final norm otherwise)."""
    from clover_lab.config import REQUIRED_FIELDS

    if recorded is not None:
        differ = [f"{f} {getattr(recorded, f)} vs {getattr(config, f)}" for f in REQUIRED_FIELDS + ("layer_types",)
                  if getattr(recorded, f) != getattr(config, f)]
        if differ:
            raise InputError(f"{who}.replay: the trace was recorded on another model ({'; '.join(differ[:3])} in the "
                             f"trace and the engine's model): replay it with the engine of the model that made it")
    for rec in chosen:
        layer = P.parse(rec.point)[0]
        value = rec.data.get("value")
        width = value.shape[-1] if hasattr(value, "shape") and len(value.shape) else None
        if (layer is not None and layer >= config.num_hidden_layers) or (width is not None and width != config.hidden_size):
            raise InputError(f"{who}.replay: the trace's {rec.point} (a residual stream of width {width}) is not of the "
                             f"engine's model ({config.num_hidden_layers} layers, hidden_size {config.hidden_size}): "
                             f"replay it with the engine of the model that made it")


_SLIDER_JS = """
(function(){var root=document.currentScript.parentNode;var frames=root.querySelectorAll('.clover-frame');
var slider=root.querySelector('input.clover-frame-slider');var label=root.querySelector('.clover-frame-label');
function show(i){frames.forEach(function(f,j){f.style.display=(i==j)?'':'none';});
label.textContent=frames[i].getAttribute('data-label');
if(window.Plotly){frames[i].querySelectorAll('.plotly-graph-div').forEach(function(g){Plotly.Plots.resize(g);});}}
slider.addEventListener('input',function(){show(+slider.value);});show(+slider.value);})();
"""


def frames_html(view) -> list[str]:
    """Every frame of ``view`` as HTML fragments (each frame's state, one after another) under a
    slider that shows one at a time: a static page that replays the whole run."""
    n = len(view.frames)
    if n == 0:
        return view._html_parts(view.state, -1)
    out = []
    state = view._empty()
    for i, parts in enumerate(view.frames):
        for part in parts:
            view._apply_part(state, part)
        label = f"frame {i + 1}/{n} · {view.frame_labels[i]}"
        body = "\n".join(view._html_parts(state, i))
        out.append(f"<div class='clover-frame' data-frame='{i}' data-label='{html.escape(label, quote=True)}' "
                   f"style='display:none'>{body}</div>")
    slider = (f"<div><input type='range' class='clover-frame-slider' min='0' max='{n - 1}' value='{n - 1}' "
              f"style='width:420px'> <span class='clover-frame-label'></span></div>")
    return [f"<div class='clover-frames'>{slider}{''.join(out)}<script>{_SLIDER_JS}</script></div>"]
