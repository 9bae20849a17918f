"""Shared fixtures: small reference checkpoints written by transformers' own Qwen3.5-MoE."""
import warnings

import pytest
import torch

REF_SIZES = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
    num_experts_per_tok=2, max_position_embeddings=4096,
)


def make_reference(seed: int = 0):
    """A random transformers Qwen3_5MoeForCausalLM (6 GDN + 2 attention layers, 8 experts top-2, GQA,
    key heads != value heads, partial RoPE) with every weight perturbed, norms included, so that
    no parameter sits at a trivial value."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**REF_SIZES)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "A_log" not in name:
                p.add_(torch.randn_like(p) * 0.02)
    return model


@pytest.fixture(scope="session")
def reference():
    """(transformers model, its save_pretrained directory)."""
    import tempfile

    model = make_reference()
    path = tempfile.mkdtemp(prefix="clover-ref-")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="session")
def clover_ref(reference):
    from clover_lab import CloverModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CloverModel.from_pretrained(reference[1])


@pytest.fixture(scope="session")
def prompt_ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, REF_SIZES["vocab_size"], (1, 150), generator=g)


@pytest.fixture
def tiny_model():
    from clover_lab import CloverModel

    model = CloverModel.random("clover-tiny", seed=3)
    # non-default preview weights, so that the preview operator is exercised as trained models use it
    with torch.no_grad():
        g = torch.Generator().manual_seed(4)
        for name, p in model.named_parameters():
            if "conv1d_right" in name or "history" in name or "block_scale" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model
