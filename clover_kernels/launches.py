"""Counting what a forward launches, on any device (the interpreter's CPU runs included).

``LaunchCounter`` is a TorchDispatchMode: every aten op that does work on a tensor counts as one
kernel (views, reshapes and allocations launch nothing and are left out), every Triton launch
(``kernel[grid](...)``, compiled or interpreted) counts as one, and the aten ops the interpreter
itself runs inside a Triton launch are not counted. It also names the ops that force a host
synchronisation (which a CUDA graph cannot capture and which stall the launch queue):
``_local_scalar_dense`` (``.item()``, ``.tolist()``, ``int(t)``), ``nonzero``, ``unique``,
``masked_select``, boolean indexing, ``repeat_interleave`` without an output size, ``bincount``.

    with LaunchCounter() as count:
        step()
    count.kernels, count.by_name, count.syncs, count.sequence
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that read a device value back to the host (always, or in the form named)
_SYNC_OPS = {"_local_scalar_dense", "nonzero", "nonzero_static_", "_unique", "_unique2", "unique_dim",
             "unique_consecutive", "unique_dim_consecutive", "masked_select", "bincount", "item"}
# ops that only describe memory: no kernel
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "detach",
              "alias", "_unsafe_view", "view", "_reshape_alias", "set_", "resize_", "_has_compatible_shallow_copy_type",
              "is_same_size", "_to_copy_meta", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim",
              "size", "stride", "is_contiguous", "is_nonzero_meta", "record_stream"}


def _is_view(func) -> bool:
    """An op whose output aliases its input without writing it (view, slice, transpose, expand...)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _bool_index(args) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool
               for a in args if isinstance(a, (list, tuple)) for t in a)


def _sync_reason(name: str, overload: str, args, kwargs) -> str | None:
    if name in _SYNC_OPS:
        return name
    if name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1 and _bool_index(args[1:2]):
        return f"{name} with a boolean index"
    if name == "repeat_interleave" and overload.startswith("Tensor") and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size"
    return None


class LaunchCounter(TorchDispatchMode):
    """Counts kernels (aten ops that do work, Triton launches) and host syncs while active."""

    def __init__(self):
        super().__init__()
        self.by_name: Counter = Counter()
        self.sequence: list[tuple] = []  # (name, shapes of the tensor arguments), in launch order
        self.syncs: list[str] = []
        self._in_triton = 0
        self._patches = contextlib.ExitStack()

    @property
    def kernels(self) -> int:
        return sum(self.by_name.values())

    @property
    def triton(self) -> int:
        return sum(n for k, n in self.by_name.items() if k.startswith("triton:"))

    def __enter__(self):
        for cls in _triton_launchers():
            original = cls.run
            self._patches.callback(setattr, cls, "run", original)
            cls.run = self._counted(original)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()

    def _counted(self, run):
        counter = self

        def counted_run(fn, *args, **kwargs):
            if kwargs.get("warmup"):
                return run(fn, *args, **kwargs)
            name = "triton:" + getattr(getattr(fn, "fn", None), "__name__", getattr(fn, "__name__", "kernel"))
            if not counter._in_triton:
                counter.by_name[name] += 1
                counter.sequence.append((name, ()))
            counter._in_triton += 1
            try:
                return run(fn, *args, **kwargs)
            finally:
                counter._in_triton -= 1
        return counted_run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._in_triton:
            name, overload = func._schema.name.split("::")[-1], func._overloadname
            reason = _sync_reason(name, overload, args, kwargs)
            if reason:
                self.syncs.append(reason)
            if name not in _NO_KERNEL and not _is_view(func):
                self.by_name[name] += 1
                shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
                self.sequence.append((name, shapes))
        return func(*args, **kwargs)


def _triton_launchers() -> list:
    """The classes whose ``run`` launches a Triton kernel (absent without triton)."""
    out = []
    try:
        from triton.runtime.jit import JITFunction
        out.append(JITFunction)
    except ImportError:
        return out
    try:
        from triton.runtime.interpreter import InterpretedFunction
        out.append(InterpretedFunction)
    except ImportError:
        pass
    return out


class HostReads:
    """Counts the reads of tensor values back to the host while active, on any device (on a CPU
    they launch no aten op, so :class:`LaunchCounter` cannot see them): ``.tolist()``,
    ``.item()``, ``.cpu()``, ``.numpy()`` and ``int()``, ``float()``, ``bool()`` of a tensor. On a
    GPU each is a synchronisation. ``where`` names the caller of each (folder/file:line).

        with HostReads() as reads:
            engine.step()
        reads.count, reads.where
    """

    METHODS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self):
        self.where: list[str] = []
        self._inside = 0
        self._patches = contextlib.ExitStack()

    @property
    def count(self) -> int:
        return len(self.where)

    def __enter__(self):
        import sys

        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def read(t, *args, _original=original, **kwargs):
                if not self._inside:
                    frame = sys._getframe(1)
                    self.where.append(f"{'/'.join(frame.f_code.co_filename.split('/')[-2:])}:{frame.f_lineno}")
                self._inside += 1  # a read made by another (``tolist`` calling ``__index__``...) counts once
                try:
                    return _original(t, *args, **kwargs)
                finally:
                    self._inside -= 1

            if name in vars(torch.Tensor):
                self._patches.callback(setattr, torch.Tensor, name, original)
            else:  # inherited from the C base: removing ours restores it
                self._patches.callback(delattr, torch.Tensor, name)
            setattr(torch.Tensor, name, read)
        return self

    def __exit__(self, *exc):
        self._patches.close()
        return False
