"""One dispatch for every op: CUDA tensors take the Triton kernels, CPU tensors the torch
path. ``CLOVER_KERNELS=triton|torch`` forces either (with ``TRITON_INTERPRET=1``, ``triton``
runs the kernels on the CPU). The kernels are forward-only: whenever autograd needs a gradient
through an op, it runs the torch path, whatever the device or the forced backend."""
import importlib
import os

import torch

_BACKENDS = ("torch", "triton")
_triton_ops: dict | None = None


def forced_backend() -> str | None:
    value = os.environ.get("CLOVER_KERNELS", "").strip().lower()
    if not value:
        return None
    if value not in _BACKENDS:
        raise ValueError(f"CLOVER_KERNELS={value!r}: expected one of {', '.join(_BACKENDS)}")
    return value


def kernel_table() -> dict:
    """Name -> Triton implementation, for the ops that have one (empty when triton is missing)."""
    global _triton_ops
    if _triton_ops is None:
        try:
            _triton_ops = importlib.import_module(f"{__package__}.triton_ops").OPS
        except ImportError:
            _triton_ops = {}
    return _triton_ops


def needs_grad(*tensors: torch.Tensor) -> bool:
    """True when autograd would record a gradient through an op on these tensors."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors if isinstance(t, torch.Tensor))


def backend_for(name: str, x: torch.Tensor, *others: torch.Tensor) -> str:
    """"triton" or "torch" for op ``name`` on input ``x`` (its device decides); ``others``: the
    op's other tensors, which only matter for whether a gradient is needed."""
    forced = forced_backend()
    if forced == "torch" or needs_grad(x, *others):
        return "torch"
    has_kernel = name in kernel_table()
    if forced == "triton":
        if not has_kernel:
            return "torch"  # ops without a kernel (yet) always run the reference
        return "triton"
    return "triton" if (x.is_cuda and has_kernel) else "torch"
