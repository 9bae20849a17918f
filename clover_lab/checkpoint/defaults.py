"""What a checkpoint directory implies for generation, beyond its weights: the mask token, the
block size, EOS ids and the sampler defaults of generation_config.json.

The mask token, first found of:
1. config.json's ``mask_token_id`` (a Clover checkpoint has one);
2. generation_config.json's ``mask_token_id``;
3. the tokenizer's mask token (``tokenizer.mask_token_id``), or an added token spelled like one
   (``<|mask|>``, ``<mask>``, ``[MASK]``);
4. the last embedding row, when the embedding has rows past the tokenizer's vocabulary: no text
   ever encodes to it, so a canvas of masks cannot be confused with text. A plain Qwen3.5/3.6-MoE
   checkpoint lands here: 248,320 embedding rows for ~248,070 tokens, so its mask is id 248,319,
   the id the Clover-35B-A3B preset uses (its preview is untrained anyway; the loader says so);
5. none: block diffusion is refused with a message naming these places; AR still runs.
"""
from __future__ import annotations

import logging

log = logging.getLogger("clover_lab")

MASK_SPELLINGS = ("<|mask|>", "<mask>", "[MASK]", "<|MASK|>", "<|mask_token|>")


def mask_token(config, tokenizer, generation: dict) -> tuple[int | None, str]:
    """(the mask token id or None, where it came from)."""
    if config.mask_token_id is not None:
        return config.mask_token_id, "config.json"
    if generation.get("mask_token_id") is not None:
        return generation["mask_token_id"], "generation_config.json"
    if tokenizer is not None:
        if getattr(tokenizer, "mask_token_id", None) is not None:
            return tokenizer.mask_token_id, "the tokenizer's mask token"
        vocab = tokenizer.get_vocab()
        for spelling in MASK_SPELLINGS:
            if spelling in vocab:
                return vocab[spelling], f"the tokenizer's {spelling} token"
        if len(tokenizer) < config.vocab_size:
            return config.vocab_size - 1, (f"the last embedding row: the tokenizer has {len(tokenizer)} tokens, "
                                           f"the embedding {config.vocab_size} rows")
    return None, "none"


def apply(engine, config, generation: dict, sampler_settings_cls, coreset_size: int | None) -> dict:
    """Set the engine's mask token, block size and EOS ids from the checkpoint; returns the sampler
    defaults left in ``generation`` (plus ``coreset_size`` when given) for the caller to check."""
    generation = dict(generation)
    mask, source = mask_token(config, engine.tokenizer, generation)
    generation.pop("mask_token_id", None)
    if mask is not None and mask != engine.mask_token_id:
        engine.mask_token_id = mask
        log.info("mask token id %d from %s", mask, source)
    engine.mask_token_source = source
    if "block_size" in generation:
        engine.block_size = generation.pop("block_size")
    eos = generation.pop("eos_token_ids", None)
    if eos:  # generation_config.json's list is the one generation stops at (Qwen's adds <|im_end|>)
        engine.eos_token_ids = list(dict.fromkeys([*eos, *config.eos_token_ids]))
    if coreset_size is not None:
        generation["coreset_size"] = coreset_size
    return {k: v for k, v in generation.items() if k in sampler_settings_cls.names()}
