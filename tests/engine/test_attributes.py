"""Tests moved from test_reliability.py."""
import pytest


# --------------------------------------------------------------------------- 6. public setters
@pytest.mark.parametrize("name,value", [
    ("prefill_chunk_size", -1), ("prefill_chunk_size", 0), ("prefill_chunk_size", 2.5), ("prefill_chunk_size", True),
    ("max_new_tokens", 0), ("max_new_tokens", "64"), ("block_size", -3), ("mask_token_id", 512),
    ("eos_token_ids", [99_999]), ("eos_token_ids", "510"), ("settings", "fast"), ("step_graphs", "yes"),
    ("compile_steps", 1), ("tokenizer", "gpt2"),
])
def test_public_setters_are_validated(tiny_engine, name, value):
    before = getattr(tiny_engine, name)
    with pytest.raises(ValueError, match=name):
        setattr(tiny_engine, name, value)
    assert getattr(tiny_engine, name) == before
