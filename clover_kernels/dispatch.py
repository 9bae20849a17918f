"""One dispatch for every op of the table (``ops.py``): CUDA tensors take the Triton kernels,
CPU tensors the torch path.

**The backend setting** forces either path: ``None`` (the default: the device decides),
``"torch"`` or ``"triton"`` (with ``TRITON_INTERPRET=1``, ``triton`` runs the kernels on the CPU),
for every op or for some. The environment variable ``CLOVER_KERNELS=triton|torch`` sets the
default once, when this module is imported; afterwards the setting changes only through

    dispatch.set_backend("torch")                       # from now on, every op
    with dispatch.use_backend("triton"):                # meanwhile (restored on exit)
        ...
    with dispatch.use_backend("triton", ops=("cache_attention",)):   # that op only
        ...

**The decision is made once per (op, device type, dtype)**: which path a call runs depends on
nothing else (its sizes never change it: the launchers choose among their kernels by shape
themselves), so it is kept and every later call of a generate looks it up. Changing the setting
forgets every decision.

The kernels are forward-only: whenever autograd needs a gradient through an op, it runs the torch
path, whatever the device or the setting (checked per call: it is a property of the call's
tensors, not of their shape). An op whose kernel failed to import runs its torch path, with a
warning the first time it is needed (a CUDA tensor, or the Triton backend forced)."""
from __future__ import annotations

import contextlib
import importlib
import os
import warnings
from typing import Iterable

import torch

BACKENDS = ("torch", "triton")
ENV = "CLOVER_KERNELS"
_triton_ops: dict | None = None
_warned: set = set()  # ops whose missing kernel was already reported


def backend_from_env(environ=os.environ) -> str | None:
    """The default setting that ``CLOVER_KERNELS`` asks for (None when unset or empty)."""
    value = environ.get(ENV, "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(BACKENDS)} (or unset)")
    return value


_default: str | None = backend_from_env()  # read once, here
_per_op: dict = {}  # op name -> its own forced backend (over _default)
_decisions: dict = {}  # (op name, device type, dtype, gpu dtypes) -> "torch" | "triton"


def _check(backend: str | None, what: str = "backend") -> None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"{what} {backend!r}: expected one of {', '.join(BACKENDS)} or None (the device decides)")


def forced_backend(name: str | None = None) -> str | None:
    """The backend the setting forces (on op ``name``, when given), or None: the device decides."""
    if name is not None and name in _per_op:
        return _per_op[name]
    return _default


def set_backend(backend: str | None, ops: Iterable[str] | None = None) -> None:
    """Force ``backend`` ("torch", "triton"; None: the device decides) from now on, on every op
    (which also drops the ops' own settings) or on the ops named."""
    global _default
    _check(backend)
    if ops is None:
        _default = backend
        _per_op.clear()
    else:
        for name in (ops,) if isinstance(ops, str) else ops:
            _per_op[name] = backend
    _decisions.clear()


@contextlib.contextmanager
def use_backend(backend: str | None, ops: Iterable[str] | None = None):
    """``set_backend(backend, ops)`` inside the ``with`` block; the previous setting after it."""
    _check(backend)
    before = (_default, dict(_per_op))
    set_backend(backend, ops)
    try:
        yield
    finally:
        _restore(before)


def _restore(setting) -> None:
    global _default
    _default = setting[0]
    _per_op.clear()
    _per_op.update(setting[1])
    _decisions.clear()


def decisions() -> dict:
    """The decisions made so far: (op name, device type, dtype) -> backend (a copy)."""
    return {key[:3]: value for key, value in _decisions.items()}


def _loader():
    """``triton_ops`` (importing it never fails), or None when even that cannot be imported."""
    try:
        return importlib.import_module(f"{__package__}.triton_ops")
    except ImportError:
        return None


def kernel_table() -> dict:
    """Name -> Triton implementation, for the ops whose kernel imported (empty when triton is missing)."""
    global _triton_ops
    if _triton_ops is None:
        loader = _loader()
        _triton_ops = loader.KERNELS if loader is not None else {}
    return _triton_ops


def missing_kernels() -> dict:
    """Op name -> why its Triton kernel did not import."""
    loader = _loader()
    return loader.MISSING if loader is not None else {}


def needs_grad(*tensors: torch.Tensor) -> bool:
    """True when autograd would record a gradient through an op on these tensors."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors if isinstance(t, torch.Tensor))


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda


def _warn_missing(name: str) -> None:
    reason = missing_kernels().get(name)
    if reason is not None and name not in _warned:
        _warned.add(name)
        warnings.warn(f"clover_kernels: the Triton kernel of {name!r} failed to import ({reason}); "
                      f"{name} runs its torch path", RuntimeWarning, stacklevel=5)


def _decide(name: str, x: torch.Tensor, gpu_dtypes) -> str:
    forced = forced_backend(name)
    if forced == "torch":
        return "torch"
    on_gpu = _on_gpu(x)
    if not (forced == "triton" or on_gpu):
        return "torch"
    if on_gpu and gpu_dtypes is not None and x.dtype not in gpu_dtypes:
        return "torch"  # the kernel is not built for this dtype on a GPU
    if name not in kernel_table():
        _warn_missing(name)  # ops without a kernel (yet) always run the reference
        return "torch"
    return "triton"


def backend_for(name: str, x: torch.Tensor, *others: torch.Tensor, gpu_dtypes: tuple | None = None) -> str:
    """"triton" or "torch" for op ``name`` on input ``x``: the setting, else its device (and, on
    a GPU, whether its dtype is among ``gpu_dtypes``, the ones the kernel is built for) decides,
    once per (op, device type, dtype); ``others``: the op's other tensors, which only matter for
    whether a gradient is needed."""
    if needs_grad(x, *others):
        return "torch"
    key = (name, x.device.type, x.dtype, gpu_dtypes)
    decision = _decisions.get(key)
    if decision is None:
        decision = _decisions[key] = _decide(name, x, gpu_dtypes)
    return decision
