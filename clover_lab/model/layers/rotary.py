"""Rotary position embeddings on the first ``rotary_dim`` dims of each head (the formulas:
``clover_kernels.rope.naive``; the attention layers apply them fused with their q/k norms)."""
from __future__ import annotations

import torch
import torch.nn as nn

from clover_lab.config import CloverConfig


class Rotary(nn.Module):
    """Plain RoPE on the first ``rotary_dim`` dims (text positions: mRoPE reduces to this)."""

    def __init__(self, config: CloverConfig):
        super().__init__()
        dim = config.rotary_dim
        # kept out of the module's buffers on purpose: model.to(bf16) must never round it
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
        self._copies: dict = {}  # device -> inv_freq there (a placed model's attention layers lie on several)

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """The fp32 frequencies [rotary_dim / 2] on ``device`` (copied once per device)."""
        if self.inv_freq.device == device:
            return self.inv_freq
        if device not in self._copies:
            self._copies[device] = self.inv_freq.to(device)
        return self._copies[device]
