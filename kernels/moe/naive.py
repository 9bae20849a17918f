"""Readable reference of the routed experts: the definition, token by token and slot by slot.

Every faster path (``torch.py``: grouped GEMMs, the CPU per-expert loop, the traced contraction;
``fused.py``: the Triton kernels) is tested against it.
"""
import torch
import torch.nn.functional as F


def moe_experts(
    x: torch.Tensor,  # [T, H]
    expert_ids: torch.Tensor,  # [T, k] int
    weights: torch.Tensor,  # [T, k]
    gate_up: torch.Tensor,  # [E, 2I, H]: gate rows first, then up rows
    down: torch.Tensor,  # [E, H, I]
) -> torch.Tensor:
    """sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = expert_ids[t, k];
    accumulated in fp32 (float64 stays float64), returned as [T, H] in x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    I = gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    for t in range(x.shape[0]):
        for slot in range(expert_ids.shape[1]):
            e = int(expert_ids[t, slot])
            h = gate_up[e].to(acc) @ x[t].to(acc)  # [2I]
            out[t] += weights[t, slot].to(acc) * (down[e].to(acc) @ (F.silu(h[:I]) * h[I:]))
    return out.to(x.dtype)
