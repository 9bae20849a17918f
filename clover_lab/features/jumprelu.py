"""A JumpReLU sparse autoencoder (Rajamanoharan et al. 2024; Gemma Scope's architecture, SAELens'
``jumprelu``): a feature is active only above its own learned ``threshold``.

    pre = (x - b_dec) @ W_enc + b_enc           # b_dec subtracted when apply_b_dec_to_input
    acts = relu(pre) * (pre > threshold)        # [.., d_sae]
    x_hat = acts @ W_dec + b_dec

as SAELens' ``JumpReLUSAE.encode`` computes it (``sae_lens/saes/jumprelu_sae.py``: ``hidden_pre =
sae_in @ W_enc + b_enc``, ``activation_fn(hidden_pre) * (hidden_pre > threshold)``); its weights
file adds ``threshold`` [d_sae] to the four tensors.
"""
from __future__ import annotations

import torch
from torch import nn

from clover_lab.features.autoencoder import SparseAutoencoder


class JumpReLUAutoencoder(SparseAutoencoder):
    architecture = "jumprelu"

    def __init__(self, d_in: int, d_sae: int, *, hook_name: str | None = None, model_name: str | None = None,
                 apply_b_dec_to_input: bool = True, metadata: dict | None = None):
        super().__init__(d_in, d_sae, hook_name=hook_name, model_name=model_name,
                         apply_b_dec_to_input=apply_b_dec_to_input, metadata=metadata)
        self.threshold = nn.Parameter(torch.zeros(self.d_sae))

    def activation(self, pre: torch.Tensor) -> torch.Tensor:
        return pre.relu() * (pre > self.threshold)
