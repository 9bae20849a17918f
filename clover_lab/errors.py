"""The root of clover_lab's own errors.

Every error clover_lab raises about what it was given (a config field, a checkpoint tensor, a
request, a sampler setting, a hook's output) derives from :class:`CloverError` and from the
builtin error it always was (ValueError, TypeError, RuntimeError), so ``except CloverError``
catches exactly the errors clover_lab meant to raise and existing ``except ValueError`` keeps
working. Anything else escaping clover_lab is a bug.
"""
from __future__ import annotations

import numbers


class CloverError(Exception):
    """Base of clover_lab's errors; the message names what was wrong and what was expected."""


class CheckpointError(CloverError, ValueError):
    """A checkpoint directory or file that cannot be loaded; the message names what and where."""


class InputError(CloverError, ValueError, TypeError):
    """An argument of a lens, sweep, patch, corpus or save that is not what it must be, or that names
    a block, step, position, row or point the run it refers to does not have; the message names the
    argument and what was expected."""


class CorpusError(InputError):
    """A corpus (``route_stats`` / ``clover-lab routes`` data) that is empty, unreadable, binary,
    ambiguous or of the wrong type; the message names it."""


class CorpusNotFoundError(CorpusError, FileNotFoundError):
    """A corpus path that does not exist."""


class OutputError(CloverError, ValueError):
    """An output clover_lab refuses to write: it is one of the inputs, it would replace files
    clover_lab did not write, or it cannot be written; the message names it."""


class GrammarError(CloverError, ValueError):
    """A schema or grammar that cannot be compiled (``clover_lab.grammar``), or a token the grammar
    refuses; ``what`` names where it came from (a request field, an argument)."""

    def __init__(self, message: str, what: str | None = None):
        super().__init__(message)
        self.what = what


def flag(name: str, value, none: bool = True):
    """``value`` as a boolean setting: True or False (numpy's bools too), or None where ``none``;
    never a string ("false" is truthy) or a number taken for one."""
    if value is None and none:
        return None
    if type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    raise InputError(f"{name}={value!r}: expected True or False{' or None' if none else ''}, "
                     f"got {type(value).__name__}")


def count(name: str, value) -> int:
    """``value`` as a positive int (numpy's too); never 0 or a negative standing for a default."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InputError(f"{name}={value!r}: expected a positive integer")
    return int(value)
