"""The multi-token-prediction (MTP) head of Qwen3.5/3.6 (``mtp.*``): the trunk's own drafter.

Names, shapes and forward as the published serving code has them (read, not copied):
vLLM ``vllm/model_executor/models/qwen3_5_mtp.py`` (``Qwen3_5MultiTokenPredictor``,
``Qwen3_5MoeMTP``: ``mtp.*`` -> its ``model.*``, the embedding and the LM head shared with the
trunk), ``vllm/model_executor/models/qwen3_next_mtp.py`` (the same head for Qwen3-Next) and
LightLLM ``lightllm/models/qwen3next_mtp/layer_weights/pre_and_post_layer_weight.py``
(``mtp.fc.weight``, ``mtp.norm.weight``, ``mtp.pre_fc_norm_embedding.weight``,
``mtp.pre_fc_norm_hidden.weight``, all norms zero-centred "Gemma" RMSNorms):

| tensor | shape |
|---|---|
| ``mtp.pre_fc_norm_embedding.weight`` | [H] |
| ``mtp.pre_fc_norm_hidden.weight`` | [H] |
| ``mtp.fc.weight`` | [H, 2H]: input ``[norm(embedding) ; norm(hidden)]``, embedding first |
| ``mtp.layers.{j}.*`` | one decoder layer each (config ``mtp_num_hidden_layers``, 1 in Qwen3.5/3.6): a gated full-attention layer with the trunk's MoE, the trunk's names (``self_attn.*``, ``mlp.*``, ``input_layernorm``, ``post_attention_layernorm``) |
| ``mtp.norm.weight`` | [H], then the trunk's ``lm_head`` |

One head step at slot i reads the trunk's last hidden state at position i (after its final
norm) and the token at position i + 1, and predicts the token at i + 2; its attention rotates at
position i and attends over the head's own K,V cache of the slots before (one attention layer:
``CloverCache`` of ``cache_config``). Chained drafting feeds the head's own output (after
``mtp.norm``) back as the next slot's hidden state, the layer taken as ``step % layers``.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from clover_lab.config import CloverConfig
from clover_lab.errors import CloverError
from clover_lab.hooks import points
from clover_lab.hooks.registry import HookRegistry
from clover_lab.model.cache import CloverCache
from clover_lab.model.context import ForwardContext
from clover_lab.model.layers.linear import Linear
from clover_lab.model.layers.norm import RMSNorm


class MTPUnavailable(CloverError, ValueError):
    """Mode "mtp" asked of a model without an MTP head."""


def cache_config(config: CloverConfig) -> CloverConfig:
    """The head's own layers as a config of full-attention layers (its cache's and layers' shape)."""
    n = config.mtp_num_hidden_layers
    return config.replace(num_hidden_layers=n, layer_types=["full_attention"] * n, mtp_num_hidden_layers=0)


class MTPHead(nn.Module):
    def __init__(self, config: CloverConfig, layer_class):
        """``layer_class``: the trunk's decoder layer (``decoder.DecoderLayer``), each head layer one."""
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.head_config = cache_config(config)
        # hook points of its own, never attached: the trunk's ``layers.{i}.*`` points stay the trunk's
        hooks = HookRegistry(points.hook_points(self.head_config.layer_types))
        self.pre_fc_norm_embedding = RMSNorm(H, eps)
        self.pre_fc_norm_hidden = RMSNorm(H, eps)
        self.fc = Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList(layer_class(self.head_config, j, hooks)
                                    for j in range(config.mtp_num_hidden_layers))
        self.norm = RMSNorm(H, eps)

    def new_cache(self, max_len: int, batch_size: int, device, dtype) -> CloverCache:
        """An empty K,V cache of the head's layers, ``max_len`` slots per row (past the context's
        length too: a drafting cycle's scratch slots after a row's last position)."""
        config = self.head_config
        if max_len > config.max_position_embeddings:
            config = config.replace(max_position_embeddings=max_len)
        return CloverCache.allocate(config, max_len, batch_size, device=device, dtype=dtype)

    def forward(self, model, cache: CloverCache, hidden: torch.Tensor, ids: torch.Tensor,
                step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [n, n + T) of the head (n = ``cache.length``): ``hidden`` [B, T, H] the trunk's
        states after its final norm (or the head's own output, chained), ``ids`` [B, T] the tokens
        one position later -> (the head's output after ``mtp.norm`` [B, T, H], logits [B, T, V]).
        The cache advances by T; ``model`` lends its embedding, rotary and LM head."""
        T = ids.shape[1]
        embedded = self.pre_fc_norm_embedding(model.model.embed_tokens(ids))
        x = self.fc(torch.cat([embedded, self.pre_fc_norm_hidden(hidden.to(embedded.dtype))], dim=-1))
        ctx = ForwardContext.cached(cache, T, 0, x.device)
        ctx.hooks = False
        ctx.rope = model.model.rotary
        layer = self.layers[step % len(self.layers)]
        x, _ = layer(x, ctx)
        ctx.publish()
        cache.advance(T)
        out = self.norm(x)
        return out, model.lm_head(out)
