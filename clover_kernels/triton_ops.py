"""The Triton implementations of the op table (``ops.TABLE``), by op name, for ``dispatch.py``.

``KERNELS[name]`` has exactly the signature and return contract of the op's torch reference.
Importing this module never fails: where triton (or one kernel module) cannot be imported, its
ops are absent, ``MISSING`` says why, and the dispatch warns the first time one is needed.
"""
import importlib

from .ops import TABLE

KERNELS: dict = {}
MISSING: dict = {}  # op name -> reason it has no Triton implementation here


def _load():
    for op in TABLE:
        try:
            KERNELS[op.name] = getattr(importlib.import_module(op.module), op.function)
        except Exception as exc:  # triton missing or broken: the op falls back to its reference
            MISSING[op.name] = f"{op.module}: {type(exc).__name__}: {exc}"


_load()
