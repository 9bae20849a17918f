"""The norms: zero-centred RMSNorm and the GDN output's gated RMSNorm."""
from __future__ import annotations

import torch
import torch.nn as nn

from clover_kernels import ops


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm ``x / rms(x) * (1 + w)``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)

    def after_add(self, x, delta):
        """A residual add and this norm after it: (``x + delta``, the norm of it), one kernel on a GPU."""
        return ops.add_rms_norm(x, delta, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """GDN output norm ``w * x / rms(x) * silu(z)`` (weight not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, z):
        return ops.gated_rms_norm(x, z, self.weight, self.eps)
