"""The mask token an autoregressive checkpoint lacks: added to the tokenizer, given an embedding.

A block starts as mask tokens (spec section 4), so an adapted model needs one. An AR tokenizer
usually has none; ``<|mask|>`` is added as a special token. Its id falls in the embedding's
unused padding rows when the vocabulary has them (Qwen pads 248,077 tokens to 248,320), else the
embedding and the LM head grow by the rows needed. Either way the row starts at the mean of the
tokenizer's embeddings, so the mask token starts as an "average token" rather than at noise.
"""
from __future__ import annotations

import torch
import torch.nn as nn

MASK_TOKEN = "<|mask|>"


def ensure_mask_token(tokenizer, model) -> tuple[int, str]:
    """The mask token id, made consistent between ``tokenizer``, ``model.config`` and the model's
    vocabulary; returns (id, what was done: "kept", "named" or "added")."""
    config = model.config
    if tokenizer.mask_token_id is not None:
        mask_id = tokenizer.mask_token_id
        if config.mask_token_id is not None and config.mask_token_id != mask_id:
            raise ValueError(f"the tokenizer's mask token {tokenizer.mask_token!r} is id {mask_id}, but config.json "
                             f"says mask_token_id {config.mask_token_id}")
        how = "kept"
    elif config.mask_token_id is not None:
        if config.mask_token_id >= len(tokenizer):
            raise ValueError(f"config.json's mask_token_id {config.mask_token_id} is beyond the tokenizer's "
                             f"{len(tokenizer)} tokens, and the tokenizer names no mask token")
        tokenizer.mask_token = tokenizer.convert_ids_to_tokens(config.mask_token_id)
        mask_id, how = config.mask_token_id, "named"
    else:
        tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
        mask_id, how = tokenizer.mask_token_id, "added"
    if mask_id >= config.vocab_size:
        grow_vocabulary(model, mask_id + 1)
    if how == "added":
        with torch.no_grad():
            emb = model.model.embed_tokens.weight
            emb[mask_id] = emb[:min(len(tokenizer) - 1, emb.shape[0])].float().mean(0).to(emb.dtype)
    config.mask_token_id = mask_id
    config.validate()
    return mask_id, how


@torch.no_grad()
def grow_vocabulary(model, size: int) -> None:
    """The embedding and the LM head grown to ``size`` rows; the new rows at their mean."""
    old = model.config.vocab_size
    for owner, name in ((model.model, "embed_tokens"), (model, "lm_head")):
        module = getattr(owner, name)
        weight = torch.cat([module.weight, module.weight.float().mean(0, keepdim=True).to(module.weight.dtype)
                           .expand(size - old, -1)])
        module.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
        if name == "embed_tokens":
            module.num_embeddings = size
        else:
            module.out_features = size
    model.config.vocab_size = size
