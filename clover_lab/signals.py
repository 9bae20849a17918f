"""Ctrl-C (SIGINT) and SIGTERM noted instead of raised while something must not be cut in two: a
training step with its log line (``train/``), or the renames that put a saved file set in place
(``writes.FileSet``). Whoever holds them acts on them at its next whole boundary. ``Interrupts``: the
command line's Ctrl-C, raised at once and remembered in case a library swallows it."""
from __future__ import annotations

import signal
import threading

STOPS = (signal.SIGINT, signal.SIGTERM)


class NotedSignals:
    """While entered (in the main thread, where Python runs signal handlers), SIGINT and SIGTERM
    are noted in ``received`` instead of interrupting. ``second_raises``: a second one raises
    KeyboardInterrupt at once (the user insists). ``redeliver``: on exit, the signals noted are
    raised again for the handlers in place before (nested uses pass them outwards)."""

    def __init__(self, second_raises: bool = False, redeliver: bool = False):
        self.second_raises, self.redeliver = second_raises, redeliver
        self.received: list[int] = []
        self._previous: dict = {}

    def __enter__(self) -> "NotedSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in STOPS:
                if signal.getsignal(sig) is not signal.SIG_IGN:  # e.g. SIGINT in a background job
                    self._previous[sig] = signal.signal(sig, self._note)
        return self

    def _note(self, signum, frame) -> None:
        if self.received and self.second_raises:
            raise KeyboardInterrupt
        self.received.append(signum)

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
        if self.redeliver:
            for sig in dict.fromkeys(self.received):
                signal.raise_signal(sig)

    def __bool__(self) -> bool:
        return bool(self.received)

    @property
    def names(self) -> str:
        return ", ".join(signal.Signals(s).name for s in dict.fromkeys(self.received))


class Interrupts:
    """While entered (main thread), Ctrl-C raises KeyboardInterrupt as Python's own handler does,
    and is also noted: a library that swallows the KeyboardInterrupt (torch's import catches every
    error of its optional numpy import, so a Ctrl-C in the first second of a command was lost and the
    generation went on) cannot make it forgotten; :func:`check_interrupted` raises it again at the
    next point that looks (after a model is loaded)."""

    def __enter__(self) -> "Interrupts":
        self._previous = None
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self._previous = signal.signal(signal.SIGINT, self._note)
        _noted.clear()
        return self

    @staticmethod
    def _note(signum, frame) -> None:
        _noted.append(signum)
        raise KeyboardInterrupt

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        _noted.clear()


_noted: list[int] = []


def interrupted() -> bool:
    """Whether a Ctrl-C was noted (by :class:`Interrupts`): an error raised after one (a module whose
    import it cut short, left half made) is its consequence, not a fault of its own."""
    return bool(_noted)


def check_interrupted() -> None:
    """A KeyboardInterrupt if a Ctrl-C was noted (by :class:`Interrupts`) and swallowed since."""
    if _noted:
        raise KeyboardInterrupt
