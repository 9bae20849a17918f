"""Torch references of the small gating ops that sit between the GEMMs (the ground truth for
``fused.py``'s kernels):

- ``gdn_gates``: the GDN's log decay and write strength from in_proj_a / in_proj_b (spec 3.2);
- ``sigmoid_gate``: the attention output gate ``out * sigmoid(gate)``;
- ``silu_mul``: the SwiGLU activation ``silu(gate) * up`` (the shared expert);
- ``moe_combine``: the MoE block's output into the residual stream, ``residual + routed +
  sigmoid(x . w_gate) * shared`` (the shared expert's one-column gate computed here; the routed
  experts' sum over their k slots too, when handed the slots).
"""
import torch
import torch.nn.functional as F

from ..dense import linear
from ..norm.naive import rms_norm


def gdn_gates(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """b, a [..., Hv] (in_proj_b and in_proj_a's outputs), A_log, dt_bias [Hv] -> (g [..., Hv]
    fp32, the log decay ``-exp(A_log) * softplus(a + dt_bias)``; beta [..., Hv] in b's dtype,
    ``sigmoid(b)``)."""
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, beta


def sigmoid_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``out * sigmoid(gate)`` (same shapes), in out's dtype."""
    return out * torch.sigmoid(gate)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (same shapes), in gate's dtype."""
    return F.silu(gate) * up


def moe_combine(residual: torch.Tensor | None, routed: torch.Tensor, x: torch.Tensor | None = None,
                gate_weight: torch.Tensor | None = None, shared: torch.Tensor | None = None,
                gate_packed=None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6):
    """A MoE block's output ``routed (+ sigmoid(x @ gate_weight^T) * shared)`` added to the residual
    stream (``residual`` None: the output alone); with a shared expert x is the block's input
    [..., H], gate_weight [1, H] and shared its output [..., H]; every tensor [..., H] in one dtype,
    rounded where the unfused layer rounds. ``gate_packed``: the CPU's kept oneDNN layout of the
    gate weight (the kernel ignores it). ``norm_weight`` [H]: the next layer's input norm, and the
    result is (the stream, its ``rms_norm``). ``routed`` may be the experts' per-slot outputs
    [..., k, H] fp32 (``moe_experts(slots=True)``: one dim more than residual, or than x without
    a residual): summed over k in fp32 first, rounded to their dtype."""
    like = residual if residual is not None else x
    if like is not None and routed.dim() == like.dim() + 1:
        routed = routed.sum(-2).to(like.dtype)
    out = routed
    if shared is not None:
        out = out + torch.sigmoid(linear(x, gate_weight, packed=gate_packed)) * shared
    out = out if residual is None else residual + out
    return out if norm_weight is None else (out, rms_norm(out, norm_weight, eps))
