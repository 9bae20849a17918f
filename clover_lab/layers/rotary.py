"""Rotary position embeddings on the first ``rotary_dim`` dims of each head."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..config import CloverConfig


class Rotary(nn.Module):
    """Plain RoPE on the first ``rotary_dim`` dims (text positions: mRoPE reduces to this)."""

    def __init__(self, config: CloverConfig):
        super().__init__()
        dim = config.rotary_dim
        # kept out of the module's buffers on purpose: model.to(bf16) must never round it
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [T] -> cos, sin [T, rotary_dim]; per-row positions [B, T] -> [B, 1, T,
        rotary_dim] (broadcast over the heads)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)  # [..., T, rotary_dim]
        if positions.dim() == 2:
            emb = emb[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; rotates the first cos.shape[-1] dims, passes the rest through."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)
