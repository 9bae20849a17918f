"""The root of clover_lab's own errors.

Every error clover_lab raises about what it was given (a config field, a checkpoint tensor, a
request, a sampler setting, a hook's output) derives from :class:`CloverError` and from the
builtin error it always was (ValueError, TypeError, RuntimeError), so ``except CloverError``
catches exactly the errors clover_lab meant to raise and existing ``except ValueError`` keeps
working. Anything else escaping clover_lab is a bug.
"""
from __future__ import annotations


class CloverError(Exception):
    """Base of clover_lab's errors; the message names what was wrong and what was expected."""


class CheckpointError(CloverError, ValueError):
    """A checkpoint directory or file that cannot be loaded; the message names what and where."""
