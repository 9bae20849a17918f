"""The hook registry: functions attached to named points (``points.py``), each receiving one
event object (``events.py``).

Register by exact name or by an fnmatch pattern (``layers.*.moe.route``). Two lifetimes:

- permanent hooks (``add`` / ``add_many``, what ``engine.add_hook`` and the notebook views use)
  apply engine-wide, to every generation in every thread, until ``handle.remove()``;
- scoped hooks (``scoped``, ``open_scope``: what ``with engine.hooks(...)`` and ``capture()`` use)
  apply to the generations started inside their scope, in that thread or context only (a
  ``contextvars`` context: a thread, an asyncio task). A generation remembers the scopes open
  where it started (:meth:`HookRegistry.view`); another thread's scopes never reach it.

With no hook attached a point costs one dict lookup and a context-variable read: no copies, no
device-to-host synchronisation.
"""
from __future__ import annotations

import contextvars
import fnmatch
import itertools
from contextlib import contextmanager
from typing import Callable, Iterable

from clover_lab.errors import CloverError, InputError
from clover_lab.hooks.points import is_model_point

# how deeply hook calls are nested in this context (a hook that generates fires hooks again):
# the engine refuses generations nested deeper than MAX_NESTED_GENERATIONS
_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("clover_lab_hook_depth", default=0)
MAX_NESTED_GENERATIONS = 4


def hook_depth() -> int:
    """How many hook calls enclose the caller (0 outside any hook)."""
    return _DEPTH.get()


class HookError(CloverError, RuntimeError):
    """A hook raised, or handed back something the engine cannot use; the message names the hook
    point. The original exception is ``__cause__``."""

    def __init__(self, point: str, error: BaseException):
        super().__init__(f"hook on {point!r} raised {type(error).__name__}: {error}")
        self.point = point


def observer(fn: Callable) -> Callable:
    """Mark ``fn`` as a hook that only reads: at each point it runs after every other hook, so it
    sees the event as the forward uses it (a route after bans and forcing, an edited state)."""
    fn.clover_observer = True
    return fn


class UnknownPointError(InputError, KeyError):
    """A hook point name or pattern that names no point of the model (still a KeyError)."""

    def __str__(self) -> str:  # the message, not KeyError's repr of it
        return str(self.args[0]) if self.args else ""


class StopGeneration(Exception):
    """Raise from any hook (or call ``event.stop()`` on engine events) to end a generation cleanly."""


class _Scope:
    """The hooks of one ``scoped`` block or capture: point -> {registration id: fn}. Closed on
    exit, so that a generation that remembered it stops calling them."""

    __slots__ = ("fns", "open")

    def __init__(self):
        self.fns: dict[str, dict[int, Callable]] = {}
        self.open = True


class HookHandle:
    """Removes exactly the registrations it was returned for (a scope: closes it)."""

    def __init__(self, registry: "HookRegistry", keys: list[tuple[str, int]], scope: _Scope | None = None):
        self._registry = registry
        self._keys = keys
        self._scope = scope

    def remove(self) -> None:
        if self._scope is not None:
            self._registry._close(self._scope)
            self._keys = []
            return
        for name, ident in self._keys:
            fns = self._registry._fns.get(name)
            if fns is not None:
                fns.pop(ident, None)
                if not fns:
                    self._registry._fns.pop(name, None)
        self._keys = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


class HookView:
    """The hooks that apply to one generation: the registry's permanent hooks (as they are now)
    and the scopes that were open where the generation started. The engine fires its own events
    through it and runs every forward inside :meth:`applied`, so that the model's events see the
    same hooks."""

    __slots__ = ("registry", "scopes")

    def __init__(self, registry: "HookRegistry", scopes: tuple[_Scope, ...]):
        self.registry = registry
        self.scopes = scopes

    def active(self, name: str) -> bool:
        return self.registry._active(name, self.scopes)

    def fire(self, name: str, event) -> None:
        self.registry._fire(name, event, self.scopes)

    def model_hooks_attached(self) -> bool:
        return self.registry._model_hooks(self.scopes)

    def model_points(self) -> list[str]:
        """The points inside the model's forward that have hooks here, sorted."""
        return self.registry._model_points(self.scopes)

    def observers_only(self, name: str) -> bool:
        """Whether every hook on ``name`` here only reads (:func:`observer`)."""
        return self.registry._observers_only(name, self.scopes)

    def applied(self) -> "_Applied":
        """``with view.applied():`` model events inside fire this view's hooks."""
        return _Applied(self.registry, self.scopes)


class _Applied:
    __slots__ = ("registry", "scopes", "token")

    def __init__(self, registry, scopes):
        self.registry, self.scopes = registry, scopes

    def __enter__(self):
        self.token = self.registry._running.set(self.scopes)

    def __exit__(self, *exc):
        self.registry._running.reset(self.token)


class HookRegistry:
    def __init__(self, points: Iterable[str]):
        self.points: tuple[str, ...] = tuple(points)
        self._fns: dict[str, dict[int, Callable]] = {}  # permanent hooks
        self._ids = itertools.count()
        self._context_vars()

    def _context_vars(self) -> None:
        # the scopes open in this context, and those of the generation whose forward runs now
        self._scopes: contextvars.ContextVar[tuple[_Scope, ...]] = contextvars.ContextVar(
            f"clover_lab_hook_scopes_{id(self)}", default=())
        self._running: contextvars.ContextVar[tuple[_Scope, ...] | None] = contextvars.ContextVar(
            f"clover_lab_hook_running_{id(self)}", default=None)

    def __getstate__(self):  # a copied model (deepcopy) keeps the permanent hooks; scopes stay here
        return {k: v for k, v in self.__dict__.items() if k not in ("_scopes", "_running")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._context_vars()

    def resolve(self, pattern: str) -> list[str]:
        """The known points a name or pattern refers to; unknown names are an error."""
        if not isinstance(pattern, str):
            raise InputError(f"a hook point is named by a string, got {type(pattern).__name__} {pattern!r}")
        if pattern in self.points:
            return [pattern]
        hits = fnmatch.filter(self.points, pattern)
        if not hits:
            sample = ", ".join(self.points[:6]) + (", ..." if len(self.points) > 6 else "")
            raise UnknownPointError(f"unknown hook point {pattern!r}; known points look like: {sample}")
        return hits

    # ---------------------------------------------------------------- registering
    def _register(self, table: dict[str, dict[int, Callable]], pattern: str, fn: Callable) -> list[tuple[str, int]]:
        if not callable(fn):
            raise TypeError(f"hook for {pattern!r} must be callable, got {type(fn).__name__}")
        keys = []
        for name in self.resolve(pattern):
            ident = next(self._ids)
            table.setdefault(name, {})[ident] = fn
            keys.append((name, ident))
        return keys

    @staticmethod
    def _pairs(hooks: dict[str, Callable | list[Callable]]):
        if not isinstance(hooks, dict):
            raise TypeError(f"hooks: expected a dict point -> function(s), got {type(hooks).__name__}")
        for pattern, fns in hooks.items():
            for fn in (fns if isinstance(fns, (list, tuple)) else [fns]):
                yield pattern, fn

    def add(self, pattern: str, fn: Callable) -> HookHandle:
        """A permanent hook: every generation, every thread, until ``handle.remove()``."""
        return HookHandle(self, self._register(self._fns, pattern, fn))

    def add_many(self, hooks: dict[str, Callable | list[Callable]]) -> HookHandle:
        """Permanent hooks, all or none (a bad name or function adds nothing)."""
        staged: dict[str, dict[int, Callable]] = {}
        keys = [k for pattern, fn in self._pairs(hooks) for k in self._register(staged, pattern, fn)]
        for name, fns in staged.items():
            self._fns.setdefault(name, {}).update(fns)
        return HookHandle(self, keys)

    def open_scope(self, hooks: dict[str, Callable | list[Callable]]) -> HookHandle:
        """Scoped hooks for the generations started in this context from now until
        ``handle.remove()``; all or none."""
        scope = _Scope()
        keys = [k for pattern, fn in self._pairs(hooks) for k in self._register(scope.fns, pattern, fn)]
        self._scopes.set(self._scopes.get() + (scope,))
        return HookHandle(self, keys, scope)

    @contextmanager
    def scoped(self, hooks: dict[str, Callable | list[Callable]]):
        handle = self.open_scope(hooks)
        try:
            yield handle
        finally:
            handle.remove()

    def _close(self, scope: _Scope) -> None:
        scope.open = False  # wherever a generation remembered it
        here = self._scopes.get()
        if scope in here:
            self._scopes.set(tuple(s for s in here if s is not scope))

    # ---------------------------------------------------------------- what applies
    def _here(self) -> tuple[_Scope, ...]:
        running = self._running.get()
        return running if running is not None else self._scopes.get()

    def view(self) -> HookView:
        """The hooks for a generation starting here: permanent ones and this context's scopes."""
        return HookView(self, tuple(s for s in self._scopes.get() if s.open))

    def _active(self, name: str, scopes: tuple[_Scope, ...]) -> bool:
        if name in self._fns:
            return True
        for s in scopes:
            if s.open and name in s.fns:
                return True
        return False

    def _fire(self, name: str, event, scopes: tuple[_Scope, ...]) -> None:
        calls = list(self._fns.get(name, {}).items())
        scoped = [(i, fn) for s in scopes if s.open for i, fn in s.fns.get(name, {}).items()]
        if scoped:  # in registration order, as if they were all in one table
            calls = sorted(calls + scoped, key=lambda c: c[0])
        if any(getattr(fn, "clover_observer", False) for _, fn in calls):  # readers after the writers
            calls.sort(key=lambda c: getattr(c[1], "clover_observer", False))
        token = _DEPTH.set(_DEPTH.get() + 1)
        try:
            for _, fn in calls:
                try:
                    fn(event)
                except (StopGeneration, HookError):  # a HookError already names its hook: not wrapped again
                    raise
                except Exception as e:  # noqa: BLE001 - re-raised with the point's name
                    raise HookError(name, e) from e
        finally:
            _DEPTH.reset(token)

    def _model_hooks(self, scopes: tuple[_Scope, ...]) -> bool:
        if any(is_model_point(name) for name in list(self._fns)):
            return True
        return any(s.open and any(is_model_point(name) for name in s.fns) for s in scopes)

    def _model_points(self, scopes: tuple[_Scope, ...]) -> list[str]:
        names = {name for name in list(self._fns) if is_model_point(name)}
        for s in scopes:
            if s.open:
                names.update(name for name in s.fns if is_model_point(name))
        return sorted(names)

    def _calls(self, name: str, scopes: tuple[_Scope, ...]) -> list[Callable]:
        return [*self._fns.get(name, {}).values(), *(fn for s in scopes if s.open for fn in s.fns.get(name, {}).values())]

    def _observers_only(self, name: str, scopes: tuple[_Scope, ...]) -> bool:
        return all(getattr(fn, "clover_observer", False) for fn in self._calls(name, scopes))

    def active(self, name: str) -> bool:
        """Whether a hook on ``name`` applies here (permanent, or scoped in this context)."""
        return self._active(name, self._here())

    def fire(self, name: str, event) -> None:
        self._fire(name, event, self._here())

    def model_hooks_attached(self) -> bool:
        """True when a hook that applies here sits on a point inside the model's forward (not an
        engine point)."""
        return self._model_hooks(self._here())

    def model_points(self) -> list[str]:
        """The points inside the model's forward that have hooks applying here, sorted."""
        return self._model_points(self._here())

    def observers_only(self, name: str) -> bool:
        """Whether every hook on ``name`` that applies here only reads (:func:`observer`)."""
        return self._observers_only(name, self._here())

    def attached(self) -> dict[str, int]:
        """Point -> number of hooks that apply here: permanent ones and this context's scopes."""
        out = {name: len(fns) for name, fns in list(self._fns.items())}
        for s in self._here():
            if s.open:
                for name, fns in s.fns.items():
                    out[name] = out.get(name, 0) + len(fns)
        return out

    def clear(self) -> None:
        """Remove every permanent hook and close this context's scopes."""
        self._fns.clear()
        for s in self._scopes.get():
            s.open = False
        self._scopes.set(())
