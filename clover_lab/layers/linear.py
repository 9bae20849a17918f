"""Linear layers: ``nn.Linear`` through ``clover_kernels.linear``, and the SwiGLU MLP."""
from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

import clover_kernels as ops


class Linear(nn.Linear):
    """``nn.Linear`` whose CPU inference GEMM is ``clover_kernels.linear`` (oneDNN's fp32 GEMM where
    it beats the default BLAS); same parameters, same state-dict names, same results to fp32 rounding.
    ``packed``: the weight kept in oneDNN's layout (``CloverModel.pack_weights``), or None."""

    packed: ops.PackedWeight | None = None

    def forward(self, x):
        return ops.linear(x, self.weight, self.bias, packed=self.packed)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
