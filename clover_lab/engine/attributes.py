"""The engine's public settings, checked when they are set: one descriptor (:class:`Checked`) and
the checks it takes. A bad value is a ValueError naming the attribute and what it takes, and the
attribute keeps the value it had.

    class Engine:
        max_new_tokens = Checked(positive_int, "The default length of a response.")
"""
from __future__ import annotations

import numbers
from typing import Any, Callable


class Checked:
    """An attribute whose every assignment passes ``check(owner, name, value)``, which returns the
    value kept (possibly converted) or raises ValueError. ``copy``: what a read hands out instead of
    the kept value itself (``list`` for a list the caller must not edit in place)."""

    def __init__(self, check: Callable[[Any, str, Any], Any], doc: str = "", copy: Callable | None = None):
        self.check, self.copy, self.__doc__ = check, copy, doc

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = obj.__dict__[self.slot]
        return value if self.copy is None else self.copy(value)

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = self.check(obj, self.name, value)


def plain_int(value):
    """numpy integers and the like as Python ints; anything else as it is (checked by the caller)."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value


def positive_int(owner, name: str, value) -> int:
    value = plain_int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def one_of(*allowed, what: str) -> Callable:
    """A check that the value is one of ``allowed`` (compared by identity: True is not 1)."""
    def check(owner, name: str, value):
        if not any(value is a for a in allowed):
            raise ValueError(f"{name} must be {what}, got {value!r}")
        return value

    return check


def instance_of(cls: type, what: str) -> Callable:
    def check(owner, name: str, value):
        if not isinstance(value, cls):
            raise ValueError(f"{name} must be {what}, got {type(value).__name__} {value!r:.80}")
        return value

    return check


def tokenizer(owner, name: str, value):
    """A transformers tokenizer (callable, with ``decode``), or None."""
    if value is not None and not (callable(value) and callable(getattr(value, "decode", None))):
        raise ValueError(f"{name} must be a tokenizer (callable, with decode) or None, got {type(value).__name__}")
    return value


def token_ids(owner, name: str, value) -> list[int]:
    """Token ids of the owner's model (``owner.model.config.vocab_size``): one id or a list, possibly empty."""
    V = owner.model.config.vocab_size
    ids = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < V for t in ids):
        raise ValueError(f"{name} must be token ids in [0, {V}) (a list, possibly empty), got {value!r}")
    return list(ids)


def token_id_or_none(owner, name: str, value) -> int | None:
    V = owner.model.config.vocab_size
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < V):
        raise ValueError(f"{name} must be a token id in [0, {V}) or None, got {value!r}")
    return value
