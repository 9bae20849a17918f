"""Tests moved from test_reliability.py."""
import pytest
import torch

import clover_lab
from clover_lab import (
    CheckpointError,
    Engine,
    GenerationError,
)

PROMPT = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64]


@pytest.fixture
def own_engine(new_gen_model):
    """An Engine over its own copy of the generation model, free to be damaged by the test."""
    model = new_gen_model()
    yield Engine(model)
    assert not model.hooks.attached()


# --------------------------------------------------------------------------- 1. non-finite values
def _nan_checkpoint(model, tmp_path, name="model.layers.1.mlp.shared_expert.down_proj.weight"):
    with torch.no_grad():
        model.get_parameter(name)[0, 0] = float("nan")
    model.save_pretrained(tmp_path)
    return tmp_path


def test_nan_weights_are_refused_at_load_and_named_at_generation(new_gen_model, tmp_path):
    path = _nan_checkpoint(new_gen_model(), tmp_path)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*'model\.layers\.1\.mlp\.shared_expert\.down_proj"
                                              r"\.weight' holds NaN or inf"):
        clover_lab.load(path)
    engine = clover_lab.load(path, check_finite=False)  # loads when asked, and then fails clearly, never [0]
    for mode, where in (("diffusion", "block 0, step 0"), ("ar", r"token 0 \(AR\)")):
        with pytest.raises(GenerationError, match=f"{where}: the logits are not finite.*"
                                                  r"layers\.1\.mlp\.shared_expert\.down_proj\.weight"):
            engine.generate(PROMPT, mode=mode, max_new_tokens=8)
    with torch.no_grad():  # the engine stays usable once the weight is repaired
        engine.model.get_parameter("model.layers.1.mlp.shared_expert.down_proj.weight").nan_to_num_(0.0)
    assert len(engine.generate(PROMPT, max_new_tokens=8).token_ids) == 8


def test_an_overflow_in_the_preview_names_the_first_layer(own_engine):
    """Finite weights and cache, non-finite preview logits: the preview is run again without hooks
    and the first layer whose output is not finite is named."""
    gdn = own_engine.model.model.layers[0].linear_attn
    with torch.no_grad():
        gdn.block_scale.fill_(1e30)  # preview-only: the commit path never reads it
    with pytest.raises(GenerationError, match=r"block 0, step 0: .*layer 0 is the first"):
        own_engine.generate(PROMPT, max_new_tokens=8)
    assert len(own_engine.generate(PROMPT, mode="ar", max_new_tokens=4).token_ids) == 4  # commits are fine


def test_sampling_with_nan_logits_is_a_generation_error_not_a_multinomial_error(own_engine):
    with torch.no_grad():
        own_engine.model.lm_head.weight[3, 0] = float("inf")
    with pytest.raises(GenerationError, match="not finite.*lm_head.weight"):
        own_engine.generate(PROMPT, max_new_tokens=8, temperature=0.8, seed=1)


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_a_residual_stream_past_the_norms_range_is_named_not_token_0(own_engine, mode):
    """Finite weights so large that a norm's mean square overflows: its output, and so the logits,
    are zero (equal for every token). That is a GenerationError, not a response of token 0."""
    with torch.no_grad():
        own_engine.model.model.embed_tokens.weight.mul_(1e22)  # finite in float32; squared, not
    with pytest.raises(GenerationError, match=r"(block 0, step 0|token 0 \(AR\)): the logits are equal for every "
                                              r"token.*float32's range"):
        own_engine.generate(PROMPT, mode=mode, max_new_tokens=8)
    with pytest.raises(GenerationError, match=r"row 0, .*logits are equal"):
        own_engine.generate([PROMPT, PROMPT[:3]], mode=mode, max_new_tokens=8)
    with torch.no_grad():  # repaired, the engine goes on
        own_engine.model.model.embed_tokens.weight.div_(1e22)
    assert len(own_engine.generate(PROMPT, mode=mode, max_new_tokens=8).token_ids) == 8
