"""How views keep up with a running model without slowing it: a redraw throttle, attachments
that remove their hooks, and callbacks that hold their view weakly."""
from __future__ import annotations

import math
import threading
import time
import weakref
from typing import Callable

from clover_lab.hooks.registry import observer


class Throttle:
    """Coalesces redraw requests: at most ``fps`` draws per second, the latest state wins, and
    the last request is always drawn: immediately when the interval has passed, else by a timer
    at the end of the interval (``trailing``), or by :meth:`flush`.

    ``draws`` and ``requests`` count what happened (tests and the overhead notebook read them).
    ``lock`` is shared with the view so that a timer draw never sees a half-applied event.
    """

    def __init__(self, draw: Callable[[], None], fps: float = 15.0, *, lock=None, clock=time.monotonic,
                 trailing: bool = True, on_error: Callable[[BaseException], None] | None = None):
        if not fps or fps <= 0:
            raise ValueError(f"fps must be positive, got {fps!r}")
        self._draw = draw
        self.interval = 1.0 / fps
        self.clock = clock
        self.trailing = trailing
        self.on_error = on_error
        self.lock = lock if lock is not None else threading.RLock()
        self._last = -math.inf
        self._dirty = False
        self._timer: threading.Timer | None = None
        self.pacer: Pacer | None = None  # set by Pacer.add: the pacer draws, one view at a time
        self.draws = 0
        self.requests = 0

    @property
    def pending(self) -> bool:
        """A request not drawn yet."""
        return self._dirty

    def request(self) -> None:
        with self.lock:
            self.requests += 1
            self._dirty = True
            if self.pacer is not None:
                self.pacer.wake()
                return
            wait = self._last + self.interval - self.clock()
            if wait <= 0:
                self._cancel_timer()
                self._run()
            elif self.trailing and self._timer is None:
                self._timer = threading.Timer(wait, self._on_timer)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        """Draw now if a request is pending (the final frame)."""
        with self.lock:
            self._cancel_timer()
            if self._dirty:
                self._run()

    def cancel(self) -> None:
        with self.lock:
            self._cancel_timer()
            self._dirty = False

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        with self.lock:
            self._timer = None
            if not self._dirty:
                return
            try:
                self._run()
            except Exception as e:  # noqa: BLE001 - a timer thread has nobody to raise to
                if self.on_error is not None:
                    self.on_error(e)

    def _run(self) -> None:
        self._dirty = False
        self._last = self.clock()
        self.draws += 1
        self._draw()


class Pacer:
    """Draws the pending redraws of a group of views (a dashboard's) one view at a time, at most one
    every ``gap`` seconds (``gaps``: another gap after a given view's draw, a short one after a cheap
    view), round robin in ``order`` (a name may come more than once: drawn more often). The browser
    then gets one view's figures at a time: four views each redrawing at its own rate sent their
    figures together, and the page took 1-2 s to answer (a Stop click waited behind them). The last
    request of each view is always drawn (its turn comes)."""

    def __init__(self, throttles: dict[str, Throttle], order: list[str] | None = None, gap: float = 0.25,
                 gaps: dict[str, float] | None = None):
        self.throttles = dict(throttles)
        self.order = list(order or self.throttles)
        unknown = set(self.order) - set(self.throttles)
        if unknown:
            raise ValueError(f"Pacer order names {sorted(unknown)}, not among {sorted(self.throttles)}")
        self.gap = gap
        self.gaps = dict(gaps or {})
        self._wake = threading.Condition()
        self._closed = False
        for t in self.throttles.values():
            t.cancel()  # a timer of its own would draw out of turn
            t.pacer = self
        self._thread = threading.Thread(target=Pacer._loop, args=(weakref.ref(self),), name="clover-pacer",
                                        daemon=True)
        self._thread.start()

    def wake(self) -> None:
        with self._wake:
            self._wake.notify()

    def close(self) -> None:
        """Stop pacing: every throttle draws on its own again (what is pending is drawn now)."""
        self._closed = True
        for t in self.throttles.values():
            t.pacer = None
            t.flush()
        self.wake()

    @staticmethod
    def _loop(ref) -> None:
        turn = 0
        while True:
            self = ref()
            if self is None or self._closed:
                return
            with self._wake:
                if not any(t.pending for t in self.throttles.values()):
                    self._wake.wait(0.5)
            gap = self.gap
            for _ in range(len(self.order)):  # the next view in turn with something to draw
                name = self.order[turn % len(self.order)]
                turn += 1
                throttle = self.throttles[name]
                if throttle.pending:
                    gap = self.gaps.get(name, self.gap)
                    try:
                        throttle.flush()
                    except Exception as e:  # noqa: BLE001 - a pacer thread has nobody to raise to
                        if throttle.on_error is not None:
                            throttle.on_error(e)
                    break
            del self  # the loop holds the pacer only while it draws
            time.sleep(gap)


class Attachment:
    """A view's hooks on one engine. ``remove()`` (or leaving the ``with`` block) takes them
    off and draws the final frame. It holds the view, so ``with DenoiseView().attach(engine) as
    view:`` keeps the view alive for the block."""

    def __init__(self, view, engine, handle):
        self.view = view
        self.engine = engine
        self.handle = handle

    def _view(self):
        return self.view

    @property
    def attached(self) -> bool:
        return bool(self.handle._keys)

    def remove(self) -> None:
        view = self._view()
        if view is not None and view._attachment is self:
            view.detach()
        else:
            self.handle.remove()

    def __enter__(self):
        return self._view()

    def __exit__(self, *exc) -> None:
        self.remove()


def weak_callback(obj, method: str) -> Callable:
    """A widget callback that calls ``obj.method(*args)`` without keeping ``obj`` alive
    (ipywidgets keeps every open widget, and so its callbacks, in a global registry)."""
    ref = weakref.ref(obj)

    def callback(*args):
        o = ref()
        if o is not None:
            return getattr(o, method)(*args)

    return callback


def _weak_hook(view, method: str) -> Callable:
    ref = weakref.ref(view)

    def hook(event):
        v = ref()
        if v is not None:
            v._dispatch(method, event)

    hook.__qualname__ = f"{type(view).__name__}.{method}"
    return observer(hook)  # a view shows what the forward used: it reads after the hooks that intervene
