"""Ctrl-C (SIGINT) and SIGTERM noted instead of raised while something must not be cut in two: a
training step with its log line (``train/``), or the renames that put a saved file set in place
(``writes.FileSet``). Whoever holds them acts on them at its next whole boundary."""
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
