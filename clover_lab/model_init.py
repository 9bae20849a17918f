"""Random weights for a CloverModel: ``CloverModel.random`` and ``init_weights``, the part of the
class that makes a model from nothing (``model.py`` holds the rest; a checkpoint's weights come
through ``loading.py``)."""
from __future__ import annotations

import math

import torch

from .config import CloverConfig
from .layers.gdn import GatedDeltaNet


class RandomWeights:
    """CloverModel's random construction (a base of CloverModel)."""

    @classmethod
    def random(cls, config: CloverConfig | str, device=None, dtype=torch.float32, seed: int = 0) -> "CloverModel":
        """Random weights, materialised directly on ``device`` (built on ``meta`` first, so a
        full-size preset never exists twice in memory)."""
        if isinstance(config, str):
            config = CloverConfig.preset(config)
        with torch.device("meta"):
            model = cls(config)
        model = model.to(dtype).to_empty(device=device or "cpu")  # allocated once, in the target dtype
        model.init_weights(seed)
        return model.eval()

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        device = self.device
        gen = torch.Generator(device=device).manual_seed(seed)  # drawn where the weights live
        std = self.config.initializer_range

        def normal_(t: torch.Tensor, s: float = std):
            t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32, device=device).mul_(s))

        for name, param in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("linear_attn.norm.weight"):
                param.fill_(1.0)
            elif "norm" in name:
                param.zero_()  # zero-centred norms
            elif leaf == "dt_bias":
                param.fill_(1.0)
            elif leaf == "A_log":
                param.copy_(torch.empty(param.shape, device=device).uniform_(1.0, 16.0, generator=gen).log())
            elif leaf in ("block_scale", "history_bias", "history_log_n") or "conv1d_right" in name:
                continue
            elif "conv1d" in name:
                normal_(param, 1.0 / math.sqrt(param.shape[-1]))
            else:
                normal_(param)
        for module in self.modules():
            if isinstance(module, GatedDeltaNet):
                module.reset_preview_parameters()
