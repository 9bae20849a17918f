"""Errors shared by the loader and its helpers (``loading.py``, ``fp8/``, ``placement/``)."""


class CheckpointError(ValueError):
    """A checkpoint directory or file that cannot be loaded; the message names what and where."""
