"""Transcoders: a sparse map from one point of the residual stream to another (a layer's MoE input
to its output, say), SAELens' ``transcoder``, ``jumprelu_transcoder`` and ``skip_transcoder``
(``sae_lens/saes/transcoder.py``). The input is not centred by ``b_dec`` (it is as wide as the
output, not the input):

    pre = x @ W_enc + b_enc                                  # [.., d_sae]
    acts = relu(pre)                      (transcoder, skip_transcoder)
         = relu(pre) * (pre > threshold)  (jumprelu_transcoder)
    out = acts @ W_dec + b_dec  (+ x @ W_skip.T for a skip transcoder)   # [.., d_out]

``W_dec`` is [d_sae, d_out], ``b_dec`` [d_out], ``W_skip`` [d_out, d_in]; ``hook_name`` is the
point read and ``hook_name_out`` the point it stands in for (SAELens' cfg fields ``d_out`` and
``hook_name_out``). As an encoder (features, dashboards, timelines, clamps of the input) it
works like an autoencoder; ``fvu`` and ``features.evaluate`` are for autoencoders only.
"""
from __future__ import annotations

import torch
from torch import nn

from clover_lab.errors import InputError
from clover_lab.features.autoencoder import SparseAutoencoder

KINDS = ("transcoder", "jumprelu_transcoder", "skip_transcoder")


class Transcoder(SparseAutoencoder):
    def __init__(self, d_in: int, d_sae: int, d_out: int, *, architecture: str = "transcoder",
                 hook_name: str | None = None, hook_name_out: str | None = None, model_name: str | None = None,
                 metadata: dict | None = None):
        if architecture not in KINDS:
            raise InputError(f"Transcoder: architecture={architecture!r}: expected one of {', '.join(KINDS)}")
        super().__init__(d_in, d_sae, d_out=d_out, hook_name=hook_name, model_name=model_name,
                         apply_b_dec_to_input=False, metadata=metadata)
        self.architecture = architecture
        if hook_name_out is not None:
            self.metadata["hook_name_out"] = hook_name_out
        if architecture == "jumprelu_transcoder":
            self.threshold = nn.Parameter(torch.zeros(self.d_sae))
        if architecture == "skip_transcoder":
            self.W_skip = nn.Parameter(torch.zeros(self.d_out, self.d_in))

    @property
    def hook_name_out(self) -> str | None:
        return self.metadata.get("hook_name_out")

    def activation(self, pre: torch.Tensor) -> torch.Tensor:
        acts = pre.relu()
        return acts * (pre > self.threshold) if self.architecture == "jumprelu_transcoder" else acts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.decode(self.encode(x))
        if self.architecture == "skip_transcoder":
            out = out + self._rows(x) @ self.W_skip.T
        return out

    def extra_repr(self) -> str:
        return (f"{self.architecture}: d_in={self.d_in}, d_sae={self.d_sae}, d_out={self.d_out}, "
                f"{self.hook_name!r} -> {self.hook_name_out!r}")
