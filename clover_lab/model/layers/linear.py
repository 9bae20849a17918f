"""Linear layers: ``nn.Linear`` through ``clover_kernels.dense.linear``, and the SwiGLU MLP."""
from __future__ import annotations

import torch
import torch.nn as nn

from clover_kernels import dense, ops


class Linear(nn.Linear):
    """``nn.Linear`` whose CPU inference GEMM is ``clover_kernels.dense.linear`` (oneDNN's fp32 GEMM where
    it beats the default BLAS); same parameters, same state-dict names, same results to fp32 rounding.
    ``packed``: the weight kept in oneDNN's layout (``CloverModel.pack_weights``), or None."""

    packed: dense.PackedWeight | None = None

    def forward(self, x):
        return dense.linear(x, self.weight, self.bias, packed=self.packed)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down(self.gate_proj(x), self.up_proj(x))

    def down(self, gate, up):
        """The MLP from its gate and up projections (computed elsewhere, e.g. in one fused GEMM)."""
        return self.down_proj(ops.silu_mul(gate, up))


class FusedProjections:
    """Projections of one input run as one GEMM (``in_proj_qkv / z / b / a``; q / k / v; the router
    with the shared expert's gate and up): ``fuse`` concatenates their weights into one
    tensor and makes each weight a view of it, so there is no second copy and the state dict keeps
    every name. A call checks (on the host, no kernel) that the parts are still those views, of the
    same modules, with no module hook and nothing needing a gradient; else each part runs alone
    (a model moved to another device or dtype, a LoRA wrapper, training) until ``fuse`` again.
    The product's columns are the parts' products to the bit on the CPU (each sums over the same K)
    where no part is a single column (a GEMV); what reads the strided views rounds like fp32 does
    (within ~2e-7 of the separate parts' forward: tests/test_fused_projections.py)."""

    def __init__(self, *names: str):
        self.names = names
        self.weight: torch.Tensor | None = None
        self.packed: dense.PackedWeight | None = None  # CPU: the fused weight in oneDNN's layout
        self._parts: list = []  # (module, its weight's data_ptr) as fused

    def modules(self, owner: nn.Module) -> list[nn.Module]:
        return [owner.get_submodule(name) for name in self.names]

    @torch.no_grad()
    def fuse(self, owner: nn.Module) -> bool:
        """Concatenate the parts' weights (they must be plain bias-free weights on one device, in
        one dtype); returns whether the fused GEMM is on."""
        self.weight, self.packed, self._parts = None, None, []
        mods = self.modules(owner)
        ws = [m._parameters.get("weight") for m in mods]  # a wrapper (peft LoRA) holds none: not fused
        if (any(not isinstance(w, nn.Parameter) or w.dim() != 2 or getattr(m, "bias", None) is not None
                for m, w in zip(mods, ws))
                or len({(w.device, w.dtype, w.shape[1]) for w in ws}) != 1 or ws[0].is_meta
                or not ws[0].is_floating_point() or ws[0].dtype.itemsize < 2):
            return False
        fused = torch.cat([w.detach() for w in ws])
        for m, w, piece in zip(mods, ws, fused.split([w.shape[0] for w in ws])):
            m.weight = nn.Parameter(piece, requires_grad=w.requires_grad)
        self.weight = fused
        self._parts = [(m, m.weight.data_ptr()) for m in mods]
        return True

    def current(self, owner: nn.Module) -> bool:
        """Whether the fused weight is still the parts' (the same modules, their weights still its
        views, on its device); a stale one is dropped. A host check that torch.compile cannot trace
        (it compares data pointers): a compiled step runs it before the step
        (``CloverModel.check_projections``), and the traced ``active`` trusts it."""
        if self.weight is None:
            return False
        for (held, ptr), m in zip(self._parts, self.modules(owner)):
            if held is not m or m.weight.data_ptr() != ptr or m.weight.device != self.weight.device:
                self.weight, self.packed, self._parts = None, None, []  # stale: the parts moved on
                return False
        return True

    def active(self, owner: nn.Module, x: torch.Tensor) -> bool:
        if self.weight is None or not (torch.compiler.is_compiling() or self.current(owner)):
            return False
        for m in self.modules(owner):
            if m._forward_hooks or m._forward_pre_hooks or (torch.is_grad_enabled() and m.weight.requires_grad):
                return False
        return not (torch.is_grad_enabled() and x.requires_grad)

    def __call__(self, owner: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
        """Each part's ``x @ W^T``, in the order of ``names`` (views of one product when fused)."""
        if self.active(owner, x):
            y = dense.linear(x, self.weight, packed=self.packed)
            return list(y.split([m.weight.shape[0] for m, _ in self._parts], dim=-1))
        # a module that holds no weight of its own (a peft LoRA wrapper) runs its own forward: the adapter too
        return [m(x) if isinstance(m, nn.Linear) or "weight" not in m._parameters
                else dense.linear(x, m.weight, packed=getattr(m, "packed", None)) for m in self.modules(owner)]
