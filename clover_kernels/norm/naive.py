"""Torch references of the norms (the ground truth for the Triton kernels)."""
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Zero-centred RMSNorm: ``x / rms(x) * (1 + w)``, computed in fp32, returned in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GDN output norm: ``w * (x / rms(x)) * silu(gate)`` (weight not zero-centred), over the last dim."""
    dtype = x.dtype
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    y = weight * y
    return (y * torch.nn.functional.silu(gate.float())).to(dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    """A residual add and the norm after it: (``x + delta``, ``rms_norm(x + delta)``), both in x's dtype."""
    total = x + delta
    return total, rms_norm(total, weight, eps)
