"""Model-level behaviour: cache branching, input checks, failures that leave the cache untouched."""
import pytest
import torch

from clover_lab import CacheFullError, CloverModel, HookError


def test_clone_and_restore_branch_a_generation(tiny_model):
    cache = tiny_model.new_cache(64)
    tiny_model.commit(cache, torch.arange(10)[None])
    branch_point = cache.clone()
    a = tiny_model.commit(cache, torch.tensor([[5, 6, 7]]))
    tiny_model.commit(cache, torch.tensor([[9, 9]]))
    cache.restore(branch_point)
    assert cache.length == 10
    assert torch.equal(tiny_model.commit(cache, torch.tensor([[5, 6, 7]])), a)


def test_bad_token_ids_are_refused(tiny_model):
    cache = tiny_model.new_cache(32)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
        tiny_model.commit(cache, torch.tensor([[1, 512]]))
    with pytest.raises(ValueError, match="expected integer token ids"):
        tiny_model.commit(cache, torch.zeros(1, 3))
    with pytest.raises(ValueError, match="batch size 2 does not match the cache's 1"):
        tiny_model.preview(cache, torch.zeros(2, 3, dtype=torch.long))
    assert cache.length == 0


def test_cache_full_and_context_length(tiny_model):
    cache = tiny_model.new_cache(8)
    tiny_model.commit(cache, torch.arange(6)[None])
    with pytest.raises(CacheFullError, match="committing 3 tokens at length 6 would exceed"):
        tiny_model.commit(cache, torch.arange(3)[None])
    assert cache.length == 6
    with pytest.raises(CacheFullError, match="exceeds the context length"):
        tiny_model.new_cache(tiny_model.config.max_position_embeddings + 1)


def test_a_raising_hook_leaves_the_cache_untouched(tiny_model):
    cache = tiny_model.new_cache(64)
    tiny_model.commit(cache, torch.arange(10)[None])
    before = [t.clone() for t in cache.tensors()]

    def boom(event):
        raise RuntimeError("nope")

    last_gdn = tiny_model.config.gdn_layers()[-1]
    with tiny_model.hooks.scoped({f"layers.{last_gdn}.gdn.state": boom}):
        with pytest.raises(HookError, match=f"layers.{last_gdn}.gdn.state"):
            tiny_model.commit(cache, torch.tensor([[1, 2, 3]]))
    assert cache.length == 10
    assert all(torch.equal(a, b) for a, b in zip(cache.tensors(), before))
    assert not tiny_model.hooks.attached()


def test_state_hook_edit_reaches_the_cache(tiny_model):
    cache = tiny_model.new_cache(64)
    layer = tiny_model.config.gdn_layers()[0]

    def zero(event):
        event.state.zero_()

    with tiny_model.hooks.scoped({f"layers.{layer}.gdn.state": zero}):
        tiny_model.commit(cache, torch.arange(10)[None])
    assert torch.equal(cache.layers[layer].state, torch.zeros_like(cache.layers[layer].state))


def test_unknown_hook_point_is_named(tiny_model):
    with pytest.raises(KeyError, match="unknown hook point 'layers.99.moe.route'"):
        tiny_model.hooks.add("layers.99.moe.route", print)


def test_hook_handles_remove_exactly_what_they_added(tiny_model):
    seen = []
    h1 = tiny_model.hooks.add("layers.*.moe.route", lambda e: seen.append(1))
    h2 = tiny_model.hooks.add("layers.0.moe.route", lambda e: seen.append(2))
    h1.remove()
    tiny_model.logits(torch.arange(4)[None])
    assert seen == [2]
    h2.remove()
    assert not tiny_model.hooks.attached()


def test_route_ban_and_force(tiny_model):
    ids = torch.arange(12)[None]
    seen = []

    def ban(e):
        e.ban([0, 1])
        seen.append(e.expert_ids.clone())

    with tiny_model.hooks.scoped({"layers.*.moe.route": ban}):
        banned = tiny_model.logits(ids)
    assert all(not ({0, 1} & set(s.unique().tolist())) for s in seen)
    assert not torch.allclose(banned, tiny_model.logits(ids))
    with tiny_model.hooks.scoped({"layers.*.moe.route": lambda e: e.force([3, 4])}):
        forced = tiny_model.logits(ids)
    assert torch.isfinite(forced).all()


def test_random_full_size_materialises_on_meta_first():
    """The full-size preset is never built with real random weights on CPU in tests (35B);
    construction on meta costs no memory and yields the right parameter shapes."""
    from clover_lab import CloverConfig

    with torch.device("meta"):
        model = CloverModel(CloverConfig.preset("clover-35b-a3b"))
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (256, 1024, 2048) and experts.gate_up_proj.is_meta


def test_packed_weights_give_the_same_model(tiny_model):
    """pack_weights: the same logits on the kept oneDNN copies; edits made in place after packing
    are followed; pack_weights(False) drops the copies; the state dict is untouched."""
    from clover_kernels.dense import can_pack

    if not can_pack(tiny_model.lm_head.weight):
        pytest.skip("torch has no oneDNN linear on this machine")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 40), generator=g)
    block = torch.randint(0, tiny_model.config.vocab_size, (1, 8), generator=g)
    keys = list(tiny_model.state_dict())
    with torch.inference_mode():
        plain = tiny_model.logits(ids)
        plain_preview = tiny_model.denoise_logits(ids, block)
        from clover_lab.model.layers.linear import Linear
        from clover_lab.model.layers.moe import Experts, Router

        gemm_weights = [t for m in tiny_model.modules() if isinstance(m, (Linear, Router, Experts))
                        for t in m.parameters(recurse=False) if t.dim() >= 2]
        assert tiny_model.pack_weights() >= sum(t.numel() * t.element_size() for t in gemm_weights)  # a whole copy
        assert tiny_model.packed_weights
        torch.testing.assert_close(tiny_model.logits(ids), plain, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tiny_model.denoise_logits(ids, block), plain_preview, atol=1e-5, rtol=1e-5)
    assert list(tiny_model.state_dict()) == keys
    experts = tiny_model.model.layers[0].mlp.experts
    with torch.no_grad():
        experts.down_proj.mul_(3.0)  # an ablation made after packing
    with torch.inference_mode():
        edited = tiny_model.logits(ids)
        tiny_model.pack_weights(False)
        assert not tiny_model.packed_weights and experts.packed is None
        torch.testing.assert_close(edited, tiny_model.logits(ids), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(edited, plain, atol=1e-3)


def test_packed_weights_refuse_what_they_cannot_pack(tiny_model):
    with pytest.raises(ValueError, match="float16"):
        tiny_model.half().pack_weights()
    assert not tiny_model.packed_weights
