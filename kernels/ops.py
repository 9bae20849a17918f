"""The kernel op table: every op of clover_kernels declared once, beside its torch reference.

An ``Op`` names the op, its torch path (the reference: CPU tensors, autograd,
``CLOVER_KERNELS=torch``) and the Triton implementation (``"module:function"`` under this package,
with the reference's signature and return contract). Calling the op dispatches (``dispatch.py``);
``triton_ops.py`` imports the implementations. A new kernel is one row of ``TABLE``.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

import clover_kernels as _package  # backend_for through the package, where tests and tools replace it

from . import dispatch
from .fp8 import torch as _fp8
from .gdn import torch as _gdn
from .moe import naive as _moe_naive
from .moe import torch as _moe
from .norm import naive as _norm


@dataclass(eq=False)
class Op:
    name: str
    reference: Callable  # the torch path
    kernel: str  # "module:function" of the Triton implementation, the module relative to clover_kernels
    takes: Callable[[torch.Tensor], bool] | None = None  # False: the kernel is not built for this input
    torch_only: tuple = ()  # arguments only the reference takes (the kernel is called without them)
    _dropped: tuple = field(init=False, default=())

    def __post_init__(self):
        params = list(inspect.signature(self.reference).parameters)
        self._dropped = tuple(params.index(n) for n in self.torch_only)
        functools.update_wrapper(self, self.reference, assigned=("__doc__", "__module__"), updated=())
        self.__signature__ = inspect.signature(self.reference)

    @property
    def module(self) -> str:
        return f"{__package__}.{self.kernel.split(':')[0]}"

    @property
    def function(self) -> str:
        return self.kernel.split(":")[1]

    def __call__(self, *args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if (self.takes is None or self.takes(tensors[0])) and _package.backend_for(self.name, *tensors) == "triton":
            args = tuple(a for i, a in enumerate(args) if i not in self._dropped)
            kwargs = {k: v for k, v in kwargs.items() if k not in self.torch_only}
            return dispatch.kernel_table()[self.name](*args, **kwargs)
        return self.reference(*args, **kwargs)

    def __repr__(self):
        return f"Op({self.name!r}, {self.reference.__module__}.{self.reference.__name__}, {self.kernel!r})"


def _not_fp32_on_gpu(x: torch.Tensor) -> bool:
    """The FP8 kernels are built for bf16 / fp16 activations: fp32 tiles spill on sm_90
    (tests/kernels/test_compile_sm90.py), so fp32 activations on a GPU run the torch path."""
    return not (x.dtype == torch.float32 and x.is_cuda)


TABLE = (
    Op("rms_norm", _norm.rms_norm, "norm.rms:rms_norm"),
    Op("gated_rms_norm", _norm.gated_rms_norm, "norm.rms:gated_rms_norm"),
    Op("gdn_commit", _gdn.gdn_commit, "gdn.commit:gdn_commit"),
    Op("gdn_preview", _gdn.gdn_preview, "gdn.preview:gdn_preview"),
    # packed: the CPU path's kept oneDNN weights (see ``PackedWeight``)
    Op("moe_experts", _moe.moe_experts, "moe.fused:moe_experts", torch_only=("packed",)),
    # the router's rule over logits [T, E]: (probs fp32 [T, E], expert ids [T, k], weights fp32 [T, k]);
    # ``allowed`` [E] or [T, E] bool restricts the picks (a coreset)
    Op("route", _moe_naive.route, "moe.route:route"),
    Op("linear_fp8", _fp8.linear, "fp8.gemm:linear", takes=_not_fp32_on_gpu),
    Op("moe_experts_fp8", _fp8.moe_experts, "fp8.moe:moe_experts", takes=_not_fp32_on_gpu),
)
OPS = {op.name: op for op in TABLE}
