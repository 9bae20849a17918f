"""What every view shares: attaching to an engine's hook points, throttled redraws, frames for
replay, and static HTML export.

A view listens to hook points through one :class:`~clover_lab.hooks.HookHandle`; ``detach()`` /
``close()`` (or leaving ``with view.attach(engine):``) removes exactly that handle, so an engine
with no view attached fires nothing. Hooks hold the view weakly: a view dropped without
``close()`` takes its hooks with it when it is garbage-collected.

Every hook call turns its event into a small host-side *part* (numbers copied off the device),
appends it to ``view.frames`` (one frame per denoising step or forward), folds it into the live
state and asks the :class:`Throttle` for a redraw. Redraws run at most ``fps`` times a second;
the latest state wins and the last request is always drawn (by a timer thread, or by ``flush()``).
"""
from __future__ import annotations

import html
import threading
import weakref
from pathlib import Path
from typing import Any

from clover_lab.widgets.pieces import page, require_notebook, section, view_inputs
from clover_lab.widgets.throttle import Attachment, Throttle, _weak_hook, weak_callback
from clover_lab.writes import refuse_inputs, write_text

# --------------------------------------------------------------------------- throttling


# --------------------------------------------------------------------------- attachment


# --------------------------------------------------------------------------- the base view
class View:
    """Base of the notebook views. Subclasses set ``title``, return their hook points from
    :meth:`hook_methods`, turn events into parts (``self._push(part, key)``), fold parts into a
    state (:meth:`_empty`, :meth:`_apply_part`) and draw a state (:meth:`_render`)."""

    title = "view"
    needs_model = False  # replaying a trace needs the model's weights (engine=...)
    replay_needs: tuple = ()  # the points (patterns) a trace must record for this view to replay it

    def __init__(self, engine=None, *, fps: float = 15.0):
        require_notebook()
        import ipywidgets as W

        self.engine = None
        self.fps = fps
        self._lock = threading.RLock()
        self._attachment: Attachment | None = None
        self._finalizer = None
        self.frames: list[list] = []  # one list of parts per frame (a denoising step, a forward)
        self.frame_labels: list[str] = []
        self._frame_key = object()
        self.run: int | None = None  # the engine's generation counter of the run shown
        self.row = 0  # of a batched generation, the request row shown (its events, narrowed to it)
        self.errors: list[BaseException] = []
        self.replayed_tokenizer = None  # a replayed trace's token text (Trace.tokenizer), without an engine
        self.replayed_prompt_of = None  # a replayed trace's prompts (Trace.prompt_of), without an engine
        self._live = self._empty()
        self._follow = True  # the slider sits at the newest frame and follows it
        self._setting_slider = False
        self._drawing = False
        self._closed = False
        self.throttle = Throttle(weak_callback(self, "_draw"), fps, lock=self._lock,
                                on_error=weak_callback(self, "_draw_failed"))
        self.slider = W.IntSlider(value=0, min=0, max=0, description="replay", continuous_update=True,
                                  readout=False, layout=W.Layout(width="420px"))
        self.slider.observe(weak_callback(self, "_on_slider"), names="value")
        self.frame_label = W.HTML(layout=W.Layout(margin="0 0 0 8px"))
        self.status = W.HTML()
        self.replay_bar = W.HBox([self.slider, self.frame_label], layout=W.Layout(align_items="center"))
        body = self._build()
        self.widget = W.VBox([W.HTML(f"<b>{html.escape(self.title)}</b>"), body, self.replay_bar, self.status],
                             layout=W.Layout(border="1px solid #ddd", padding="6px", margin="4px 0"))
        self.widget.add_class("clover-view")
        self.widget.add_class(f"clover-{type(self).__name__.lower()}")
        if engine is not None:
            self.attach(engine)
        self._draw()

    # ---------------------------------------------------------------- subclass interface
    def hook_methods(self) -> dict[str, str]:
        """Hook point (or pattern) -> name of the method that receives its events."""
        raise NotImplementedError

    def _build(self):
        raise NotImplementedError

    def _empty(self) -> dict:
        return {}

    def _apply_part(self, state: dict, part: Any) -> None:
        raise NotImplementedError

    def _render(self, state: dict, frame: int) -> None:
        raise NotImplementedError

    def _html_parts(self, state: dict, frame: int) -> list[str]:
        """Static HTML fragments of a state (figures without plotly.js, grids)."""
        return []

    # ---------------------------------------------------------------- attaching
    def attach(self, engine) -> Attachment:
        """Attach to ``engine``'s hook points until :meth:`detach` (or the end of a ``with``
        block). Replaces an earlier attachment."""
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed; make a new view")
        self.detach()
        mapping = {point: _weak_hook(self, method) for point, method in self.hook_methods().items()}
        handle = engine.model.hooks.add_many(mapping)
        self.engine = engine
        self._attachment = Attachment(self, engine, handle)
        self._finalizer = weakref.finalize(self, handle.remove)
        self._on_attach(engine)
        return self._attachment

    def _on_attach(self, engine) -> None:
        pass

    def token_source(self):
        """What turns token ids into text: the engine's tokenizer, else a replayed trace's table,
        else None (ids are shown)."""
        tokenizer = getattr(self.engine, "tokenizer", None) if self.engine is not None else None
        return tokenizer if tokenizer is not None else self.replayed_tokenizer

    def prompt_of(self, where) -> list[int] | None:
        """The prompt ids of the row an event's ``where`` names: the engine's running row, else the
        replayed trace's record of it (None when neither knows)."""
        if self.engine is not None:
            return self.engine.prompt_of(where)
        return None if self.replayed_prompt_of is None else self.replayed_prompt_of(where)

    @property
    def attached(self) -> bool:
        return self._attachment is not None and self._attachment.attached

    def detach(self) -> None:
        """Remove this view's hooks and draw the final frame; the recorded frames stay."""
        att, self._attachment = self._attachment, None
        if att is not None:
            att.handle.remove()
            if self._finalizer is not None:
                self._finalizer.detach()
                self._finalizer = None
            self.flush()

    def close(self) -> None:
        """Detach and close the widgets."""
        self.detach()
        self.throttle.cancel()
        self._closed = True
        close_tree(self.widget)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------- events -> frames
    def _check_run(self, event) -> bool:
        """Start over when ``event`` belongs to a new generation; True when it did."""
        run = event.where.run
        if run != self.run:
            self.run = run
            self._new_run()
            return True
        return False

    def _new_run(self) -> None:
        self.frames.clear()
        self.frame_labels.clear()
        self._frame_key = object()
        self._live = self._empty()
        self._follow = True

    def _push(self, part, key=None, label: str = "") -> None:
        """Add a part to the current frame (same ``key``) or start a new frame; None = new frame."""
        if key is None or key != self._frame_key or not self.frames:
            self.frames.append([part])
            self.frame_labels.append(label)
            self._frame_key = object() if key is None else key
        else:
            self.frames[-1].append(part)
        self._apply_part(self._live, part)
        self.throttle.request()

    def _dispatch(self, method: str, event) -> None:
        event = event.for_row(self.row)  # a batch: only this row's events, only its slice of them
        if event is None:
            return
        with self._lock:
            self._check_run(event)
            getattr(self, method)(event)

    # ---------------------------------------------------------------- drawing
    def flush(self) -> None:
        """Draw the newest state now if anything is pending."""
        self.throttle.flush()

    def redraw(self, *_) -> None:
        """Draw the shown frame again (after a control changed)."""
        with self._lock:
            if not self._drawing:
                self._draw()

    def _draw_failed(self, e: BaseException) -> None:
        self.errors.append(e)
        try:
            self.status.value = f"<span style='color:#b00'>redraw failed: {html.escape(repr(e))}</span>"
        except Exception:  # noqa: BLE001
            pass

    def _draw(self) -> None:
        n = len(self.frames)
        self._drawing = True
        self._setting_slider = True
        try:
            self.slider.max = max(n - 1, 0)
            if self._follow:
                self.slider.value = max(n - 1, 0)
            self._setting_slider = False
            frame = self.slider.value if n else -1
            state = self._live if (self._follow or frame == n - 1) else self.state_at(frame)
            self._label(frame, n)
            self._render(state, frame)
        finally:
            self._setting_slider = False
            self._drawing = False

    def _label(self, frame: int, n: int) -> None:
        if n == 0:
            self.frame_label.value = "<span style='color:#888'>no frames yet</span>"
        else:
            what = self.frame_labels[frame] if 0 <= frame < len(self.frame_labels) else ""
            self.frame_label.value = f"frame {frame + 1}/{n} <span style='color:#666'>{html.escape(what)}</span>"

    def _on_slider(self, change) -> None:
        if self._setting_slider:
            return
        with self._lock:
            n = len(self.frames)
            self._follow = change["new"] >= n - 1
            self.throttle._cancel_timer()
            self.throttle._dirty = False
            self._draw()

    def show_frame(self, frame: int) -> None:
        """Replay: show the state after ``frame`` (negative counts from the end); the newest
        frame follows new events again."""
        n = len(self.frames)
        if not n:
            raise IndexError(f"{type(self).__name__} has no frames yet")
        if frame < 0:
            frame += n
        if not 0 <= frame < n:
            raise IndexError(f"frame {frame} out of range: the view holds {n} frames")
        self.slider.value = frame  # -> _on_slider

    def state_at(self, frame: int) -> dict:
        """The state after frames [0, frame] (a replay)."""
        state = self._empty()
        for parts in self.frames[:frame + 1]:
            for part in parts:
                self._apply_part(state, part)
        return state

    @property
    def state(self) -> dict:
        return self._live

    # ---------------------------------------------------------------- display and export
    async def drawn(self, timeout: float = 15.0, page: float = 5.0) -> bool:
        """``await view.drawn()`` before a run in the next cell: under Run All the page is still
        loading plotly when a short run ends, and the run would never be seen live. True once a page
        has drawn every figure of the view; False after ``page`` seconds with no page (headless) or
        after ``timeout`` (clover_lab.widgets.figure.figures_drawn)."""
        from clover_lab.widgets.figure import figures_drawn

        return await figures_drawn(self.widget, timeout, page)

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def to_html(self, frame: int | str | None = None, *, full_html: bool = True) -> str:
        """This view as HTML, plotly.js inline: works offline. ``frame``: one frame's index, None
        (the shown frame) or "all" (every frame under a slider: the whole run replayed)."""
        from clover_lab.widgets.replay import frames_html

        with self._lock:
            if frame == "all":
                body = section(self.title, frames_html(self))
            else:
                frame = self._shown_frame() if frame is None else frame
                state = self._live if frame in (-1, len(self.frames) - 1) else self.state_at(frame)
                body = section(self.title, self._html_parts(state, frame))
        return page(self.title, [body]) if full_html else body

    def replay(self, trace, engine=None) -> "View":
        """Show a saved trace (``clover_lab.load_trace``) or a capture: its records of this view's
        points become frames, as if the run were live. No model needed, except by a view that
        computes from the weights (``needs_model``: LensView), which reads ``engine``'s."""
        from clover_lab.widgets.replay import replay

        replay(self, trace, engine)
        return self

    def _shown_frame(self) -> int:
        n = len(self.frames)
        return -1 if not n else (n - 1 if self._follow else self.slider.value)

    def export_html(self, path, frame: int | str | None = "all") -> Path:
        """Write :meth:`to_html` to ``path``: by default every frame with a slider (a
        self-contained file; nothing loads from the network). Never over the model's own files."""
        refuse_inputs(path, view_inputs([self]), "export_html")
        return write_text(path, self.to_html(frame))


# --------------------------------------------------------------------------- helpers
def close_tree(widget) -> None:
    seen = set()

    def walk(w):
        if id(w) in seen:
            return
        seen.add(id(w))
        for child in getattr(w, "children", ()) or ():
            walk(child)
        try:
            w.close()
        except Exception:  # noqa: BLE001 - closing is best effort
            pass

    walk(widget)


