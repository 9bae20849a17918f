"""The kernel op table: every op of clover_kernels declared once, beside its torch reference.

An ``Op`` names the op, its torch path (the reference: CPU tensors, autograd,
``CLOVER_KERNELS=torch``) and the Triton implementation (``"module:function"`` under this package,
with the reference's signature and return contract). Calling the op dispatches (``dispatch.py``);
``triton_ops.py`` imports the implementations. Each op is a name of this module (``ops.rms_norm``);
``TABLE`` lists them. A new kernel is one ``Op`` here.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import dispatch
from .attention import torch as _attention
from .fp8 import torch as _fp8
from .gates import naive as _gates
from .gdn import torch as _gdn
from .moe import naive as _moe_naive
from .moe import torch as _moe
from .norm import naive as _norm
from .rope import naive as _rope


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

    def runs_kernel(self, *args, **kwargs) -> bool:
        """Whether a call with these arguments (its tensors, at least) runs the Triton kernel."""
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        # through the module attribute: tests and tools replace dispatch.backend_for
        return (self.takes is None or self.takes(tensors[0])) and dispatch.backend_for(self.name, *tensors) == "triton"

    def __call__(self, *args, **kwargs):
        if self.runs_kernel(*args, **kwargs):
            args = tuple(a for i, a in enumerate(args) if i not in self._dropped)
            kwargs = {k: v for k, v in kwargs.items() if k not in self.torch_only}
            return dispatch.kernel_table()[self.name](*args, **kwargs)
        return self.reference(*args, **kwargs)

    def __repr__(self):
        return f"Op({self.name!r}, {self.reference.__module__}.{self.reference.__name__}, {self.kernel!r})"


def _not_fp32_on_gpu(x: torch.Tensor) -> bool:
    """The FP8 and attention kernels are built for bf16 / fp16 activations: their fp32 tiles spill
    on sm_90 (tests/kernels/test_compile_sm90.py), so fp32 activations on a GPU run the torch path."""
    return not (x.dtype == torch.float32 and x.is_cuda)


rms_norm = Op("rms_norm", _norm.rms_norm, "norm.rms:rms_norm")
# (x + delta, rms_norm(x + delta)): a residual add and the norm after it
add_rms_norm = Op("add_rms_norm", _norm.add_rms_norm, "norm.rms:add_rms_norm")
gated_rms_norm = Op("gated_rms_norm", _norm.gated_rms_norm, "norm.rms:gated_rms_norm")
# the attention's q/k norms and RoPE: q [B, T, Hq, D], k [B, T, Hkv, D] -> [B, heads, T, D] each
# (``cache``: a static step's K,V also written into the cache at the rows' positions)
qk_norm_rope = Op("qk_norm_rope", _rope.qk_norm_rope, "rope.fused:qk_norm_rope")
# in_proj_b / in_proj_a's outputs -> (log decay g fp32, beta)
gdn_gates = Op("gdn_gates", _gates.gdn_gates, "gates.fused:gdn_gates")
sigmoid_gate = Op("sigmoid_gate", _gates.sigmoid_gate, "gates.fused:sigmoid_gate")  # the attention output gate
silu_mul = Op("silu_mul", _gates.silu_mul, "gates.fused:silu_mul")  # SwiGLU's activation
# a MoE block's output into the residual stream (the residual may be None), the shared expert's
# sigmoid gate included, and optionally the next norm of it; gate_packed: the CPU's oneDNN layout;
# routed may be the experts' per-slot outputs [..., k, H] (summed over k in the same pass)
moe_combine = Op("moe_combine", _gates.moe_combine, "gates.fused:moe_combine", torch_only=("gate_packed",))
gdn_commit = Op("gdn_commit", _gdn.gdn_commit, "gdn.commit:gdn_commit")
gdn_preview = Op("gdn_preview", _gdn.gdn_preview, "gdn.preview:gdn_preview")
# packed: the CPU path's kept oneDNN weights (see ``dense.PackedWeight``); slots: each (token, slot) pair's
# weighted output [T, k, H] fp32, unsummed (moe_combine sums it over k)
moe_experts = Op("moe_experts", _moe.moe_experts, "moe.fused:moe_experts", torch_only=("packed",))
# the router's rule over logits [T, E]: (probs fp32 [T, E], expert ids [T, k], weights fp32 [T, k]);
# ``allowed`` [E] or [T, E] bool restricts the picks, or ``within`` a coreset's expert ids; ``record``:
# a coreset buffer the rows' coreset is written into (one more launch)
route = Op("route", _moe_naive.route, "moe.route:route")
# the static step's attention: over the live keys (each row's last from the device), GQA folded, gated
cache_attention = Op("cache_attention", _attention.cache_attention, "attention.split_kv:cache_attention",
                     takes=_not_fp32_on_gpu)
linear_fp8 = Op("linear_fp8", _fp8.linear, "fp8.gemm:linear", takes=_not_fp32_on_gpu)
moe_experts_fp8 = Op("moe_experts_fp8", _fp8.moe_experts, "fp8.moe:moe_experts", takes=_not_fp32_on_gpu)

# every op above, in the order written
TABLE = tuple(value for value in list(globals().values()) if isinstance(value, Op))
