"""One dispatch for every op of the table (``ops.py``): CUDA tensors take the Triton kernels,
CPU tensors the torch path. ``CLOVER_KERNELS=triton|torch`` forces either (with
``TRITON_INTERPRET=1``, ``triton`` runs the kernels on the CPU). The kernels are forward-only:
whenever autograd needs a gradient through an op, it runs the torch path, whatever the device or
the forced backend. An op whose kernel failed to import runs its torch path, with a warning the
first time it is needed (a CUDA tensor, or the Triton backend forced)."""
import importlib
import os
import warnings

import torch

_BACKENDS = ("torch", "triton")
_triton_ops: dict | None = None
_warned: set = set()  # ops whose missing kernel was already reported


def forced_backend() -> str | None:
    value = os.environ.get("CLOVER_KERNELS", "").strip().lower()
    if not value:
        return None
    if value not in _BACKENDS:
        raise ValueError(f"CLOVER_KERNELS={value!r}: expected one of {', '.join(_BACKENDS)}")
    return value


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
                      f"{name} runs its torch path", RuntimeWarning, stacklevel=4)


def backend_for(name: str, x: torch.Tensor, *others: torch.Tensor) -> str:
    """"triton" or "torch" for op ``name`` on input ``x`` (its device decides); ``others``: the
    op's other tensors, which only matter for whether a gradient is needed."""
    forced = forced_backend()
    if forced == "torch" or needs_grad(x, *others):
        return "torch"
    if not (forced == "triton" or _on_gpu(x)):
        return "torch"
    if name not in kernel_table():
        _warn_missing(name)  # ops without a kernel (yet) always run the reference
        return "torch"
    return "triton"
