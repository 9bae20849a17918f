"""The hook registry: functions attached to named points (``points.py``), each receiving one
event object (``events.py``).

Register by exact name or by an fnmatch pattern (``layers.*.moe.route``). With no hook attached
a point costs one dict lookup: no copies, no device-to-host synchronisation.
"""
from __future__ import annotations

import fnmatch
import itertools
from contextlib import contextmanager
from typing import Callable, Iterable

from .points import is_model_point


class HookError(RuntimeError):
    """A hook raised; the message names the hook point. The original exception is ``__cause__``."""

    def __init__(self, point: str, error: BaseException):
        super().__init__(f"hook on {point!r} raised {type(error).__name__}: {error}")
        self.point = point


class StopGeneration(Exception):
    """Raise from any hook (or call ``event.stop()`` on engine events) to end a generation cleanly."""


class HookHandle:
    """Removes exactly the registrations it was returned for."""

    def __init__(self, registry: "HookRegistry", keys: list[tuple[str, int]]):
        self._registry = registry
        self._keys = keys

    def remove(self) -> None:
        for name, ident in self._keys:
            fns = self._registry._fns.get(name)
            if fns is not None:
                fns.pop(ident, None)
                if not fns:
                    del self._registry._fns[name]
        self._keys = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


class HookRegistry:
    def __init__(self, points: Iterable[str]):
        self.points: tuple[str, ...] = tuple(points)
        self._fns: dict[str, dict[int, Callable]] = {}
        self._ids = itertools.count()

    def resolve(self, pattern: str) -> list[str]:
        """The known points a name or pattern refers to; unknown names are an error."""
        if pattern in self.points:
            return [pattern]
        hits = fnmatch.filter(self.points, pattern)
        if not hits:
            sample = ", ".join(self.points[:6]) + (", ..." if len(self.points) > 6 else "")
            raise KeyError(f"unknown hook point {pattern!r}; known points look like: {sample}")
        return hits

    def add(self, pattern: str, fn: Callable) -> HookHandle:
        if not callable(fn):
            raise TypeError(f"hook for {pattern!r} must be callable, got {type(fn).__name__}")
        keys = []
        for name in self.resolve(pattern):
            ident = next(self._ids)
            self._fns.setdefault(name, {})[ident] = fn
            keys.append((name, ident))
        return HookHandle(self, keys)

    def add_many(self, hooks: dict[str, Callable | list[Callable]]) -> HookHandle:
        handles = []
        try:
            for pattern, fns in hooks.items():
                for fn in (fns if isinstance(fns, (list, tuple)) else [fns]):
                    handles.append(self.add(pattern, fn))
        except Exception:
            for h in handles:
                h.remove()
            raise
        return HookHandle(self, [k for h in handles for k in h._keys])

    @contextmanager
    def scoped(self, hooks: dict[str, Callable | list[Callable]]):
        handle = self.add_many(hooks)
        try:
            yield handle
        finally:
            handle.remove()

    def active(self, name: str) -> bool:
        return name in self._fns

    def fire(self, name: str, event) -> None:
        for fn in list(self._fns.get(name, {}).values()):
            try:
                fn(event)
            except StopGeneration:
                raise
            except Exception as e:  # noqa: BLE001 - re-raised with the point's name
                raise HookError(name, e) from e

    def clear(self) -> None:
        self._fns.clear()

    def attached(self) -> dict[str, int]:
        return {name: len(fns) for name, fns in self._fns.items()}

    def model_hooks_attached(self) -> bool:
        """True when a hook sits on a point inside the model's forward (not an engine point)."""
        return any(is_model_point(name) for name in self._fns)
