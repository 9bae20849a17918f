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
