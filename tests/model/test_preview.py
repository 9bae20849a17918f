"""Preview / commit invariants of Clover's three forward modes (spec section 3)."""
import math

import pytest
import torch

from clover_kernels import ops
from clover_kernels.gdn.naive import right_taps
from clover_lab import Coreset

MASK = 511


def snapshot(cache):
    return [t.clone() for t in cache.tensors()], cache.length


def assert_same(cache, snap):
    tensors, length = snap
    assert cache.length == length
    for a, b in zip(cache.tensors(), tensors):
        assert torch.equal(a, b)


@pytest.fixture
def prefixed(tiny_model):
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 500, (1, 40), generator=g)
    cache = tiny_model.new_cache(128)
    tiny_model.commit(cache, prefix)
    return tiny_model, cache, g


def block(g, m=16, masked=()):
    ids = torch.randint(0, 500, (1, m), generator=g)
    ids[0, list(masked)] = MASK
    return ids


def test_preview_leaves_cache_bit_identical(prefixed):
    model, cache, g = prefixed
    snap = snapshot(cache)
    model.preview(cache, block(g, masked=range(4, 16)))
    model.preview(cache, block(g, m=5), coreset=Coreset(4))
    assert_same(cache, snap)


def test_fused_commit_and_preview_equals_commit_then_preview(prefixed):
    model, cache, g = prefixed
    done, nxt = block(g), block(g, masked=range(3, 16))
    separate = cache.clone()
    model.commit(separate, done, logits=None)
    want = model.preview(separate, nxt)
    got = model.commit_and_preview(cache, done, nxt).preview_logits
    assert (got - want).abs().max().item() < 1e-5
    assert cache.length == separate.length
    for a, b in zip(cache.tensors(), separate.tensors()):
        assert torch.allclose(a, b, atol=1e-6)


def test_block_is_bidirectional_and_never_touches_the_prefix(prefixed):
    model, cache, g = prefixed
    ids = block(g, masked=range(8, 16))
    base_commit = model.commit_and_preview(cache.clone(), block(torch.Generator().manual_seed(9)), ids,
                                           commit_logits="all")
    changed = ids.clone()
    changed[0, 12] = 7  # a later position of the block
    out = model.commit_and_preview(cache.clone(), block(torch.Generator().manual_seed(9)), changed,
                                   commit_logits="all")
    # every earlier block position sees the change (both directions inside the block) ...
    assert (out.preview_logits[0, :12] - base_commit.preview_logits[0, :12]).abs().amax(-1).min() > 1e-6
    # ... and nothing of the committed part does (up to the rounding of grouped expert matmuls,
    # whose grouping depends on what the block's tokens route to)
    assert (out.commit_logits - base_commit.commit_logits).abs().max() < 1e-6


def test_committing_a_block_equals_committing_it_as_a_prompt_piece(prefixed):
    model, cache, g = prefixed
    done = block(g)
    as_prompt = cache.clone()
    model.commit(as_prompt, done, logits=None)
    model.commit_and_preview(cache, done, block(g, masked=range(16)))
    for a, b in zip(cache.tensors(), as_prompt.tensors()):
        assert torch.allclose(a, b, atol=1e-6)
    probe = block(g, m=3)
    assert torch.allclose(model.commit(cache, probe, "all"), model.commit(as_prompt, probe, "all"), atol=1e-5)


def history_weights(model, cache, ids):
    seen = {}
    with model.hooks.scoped({"layers.*.gdn.preview": lambda e: seen.setdefault(e.layer, e.history_weights)}):
        model.preview(cache, ids)
    return seen


def test_history_weight_in_unit_interval_and_moves_with_history_bias(prefixed):
    model, cache, g = prefixed
    ids = block(g, masked=range(5, 16))
    before = history_weights(model, cache, ids)
    assert set(before) == set(model.config.gdn_layers())
    for p in before.values():
        assert p.shape == (1, 16, model.config.linear_num_value_heads)
        assert ((p > 0) & (p < 1)).all()
    layer = model.config.gdn_layers()[0]
    gdn = model.model.layers[layer].linear_attn
    with torch.no_grad():
        gdn.history_bias += 2.0
    after = history_weights(model, cache, ids)
    assert (after[layer] > before[layer]).all()


def test_history_slot_logit_follows_ln_m():
    """s_tH = history_bias + history_log_n * ln(m): with no block signal (q.k = 0 impossible to force,
    so block_scale -> -inf), p_tH = 1 / (1 + m * exp(-s_tH)) exactly."""
    torch.manual_seed(0)
    Hk, Hv, dk, dv, K = 1, 2, 8, 4, 4
    C = 2 * Hk * dk + Hv * dv
    for m in (1, 4, 16):
        mixed = torch.randn(1, m, C)
        bias, log_n = torch.tensor([0.3, -0.5]), torch.tensor([1.0, 0.25])
        _, p, _ = ops.gdn_preview(mixed, torch.randn(1, C, K - 1), torch.randn(C, K), torch.zeros(C, K - 1),
                                  torch.randn(1, Hv, dk, dv), torch.full((Hv,), -60.0), bias, log_n, Hk, dk, dv)
        s = bias + log_n * math.log(m)
        want = 1 / (1 + m * torch.exp(-s))
        assert torch.allclose(p[0], want.expand(m, Hv), atol=1e-6)


def test_right_taps_read_only_the_next_positions_of_the_block():
    torch.manual_seed(0)
    C, K, m = 6, 4, 9
    w = torch.randn(C, K - 1)
    mixed = torch.randn(1, m, C)
    base = right_taps(mixed, w)
    for t in range(m):
        for j in range(m):
            bumped = mixed.clone()
            bumped[0, j] += 1.0
            moved = (right_taps(bumped, w)[0, t] - base[0, t]).abs().max() > 0
            assert bool(moved) == (t < j <= t + K - 1), (t, j)
    # the last position has nothing to its right inside the block
    assert torch.equal(base[0, -1], torch.zeros(C))


def test_preview_never_reads_the_ring_through_the_right_taps():
    """Only the causal taps see the ring (the committed prefix): with them zeroed, the ring is invisible."""
    torch.manual_seed(0)
    Hk, Hv, dk, dv, K, m = 1, 2, 8, 4, 4, 6
    C = 2 * Hk * dk + Hv * dv
    args = dict(mixed=torch.randn(1, m, C), conv_weight=torch.zeros(C, K), right_weight=torch.randn(C, K - 1),
                state=torch.randn(1, Hv, dk, dv), block_scale=torch.zeros(Hv), history_bias=torch.zeros(Hv),
                history_log_n=torch.ones(Hv))
    conv_w = args.pop("conv_weight")
    a = ops.gdn_preview(args["mixed"], torch.randn(1, C, K - 1), conv_w, args["right_weight"], args["state"],
                        args["block_scale"], args["history_bias"], args["history_log_n"], Hk, dk, dv)[0]
    b = ops.gdn_preview(args["mixed"], torch.randn(1, C, K - 1), conv_w, args["right_weight"], args["state"],
                        args["block_scale"], args["history_bias"], args["history_log_n"], Hk, dk, dv)[0]
    assert torch.equal(a, b)


def test_coreset_restricts_later_previews_only(prefixed):
    model, cache, g = prefixed
    ids = block(g, masked=range(2, 16))
    core = Coreset(3)
    routed = []
    with model.hooks.scoped({"layers.*.moe.route": lambda e: routed.append((e.layer, e.mode, e.expert_ids.clone()))}):
        model.preview(cache, ids, coreset=core)  # records
        first = list(routed)
        routed.clear()
        model.commit_and_preview(cache.clone(), block(g), ids, coreset=core)  # restricted previews
    assert set(core.experts) == set(range(model.config.num_hidden_layers))
    for layer, mode, ids_ in routed:
        if mode == "preview":
            assert set(ids_.unique().tolist()) <= set(core.experts[layer].tolist())
    commit_experts = set().union(*(set(i.unique().tolist()) for _, mode, i in routed if mode == "commit"))
    assert len(commit_experts) > 3  # commit routes over all experts
    assert first


def test_denoise_logits_matches_commit_then_preview(tiny_model):
    g = torch.Generator().manual_seed(2)
    prefix, blk = torch.randint(0, 500, (1, 20), generator=g), block(g, masked=range(10))
    cache = tiny_model.new_cache(64)
    tiny_model.commit(cache, prefix)
    assert torch.equal(tiny_model.denoise_logits(prefix, blk), tiny_model.preview(cache, blk))
    assert tiny_model.denoise_logits(prefix, blk).shape == (1, 16, 512)


def test_preview_positions_select_logits(prefixed):
    model, cache, g = prefixed
    ids = block(g, masked=range(16))
    full = model.preview(cache, ids)
    some = model.preview(cache, ids, positions=torch.tensor([1, 5, 15]))
    assert torch.allclose(some, full[:, [1, 5, 15]], atol=1e-6)


def test_rows_that_commit_and_rows_that_only_preview_share_one_forward(tiny_model):
    """``commit_rows``: a row that commits its block and previews the next beside a row that only
    previews (at another length), in one forward, each as it would alone; the previewing row's
    cache (K,V up to its length, GDN ring and state) and length are unchanged."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 500, (1, n), generator=g) for n in (40, 29)]
    done, nxt, other = block(g), block(g, masked=range(3, 16)), block(g, masked=range(16))
    alone = []
    for prompt, commit, preview in ((prompts[0], done, nxt), (prompts[1], None, other)):
        cache = tiny_model.new_cache(128)
        tiny_model.commit(cache, prompt)
        out = tiny_model.forward(cache, commit, preview, commit_logits=None)
        alone.append((out.preview_logits, cache))
    cache = tiny_model.new_cache(128, 2)
    for r, prompt in enumerate(prompts):
        tiny_model.commit(cache.row(r), prompt)
    cache.set_row_lengths([40, 29])
    before = cache.select([1])
    pad = torch.full((1, 16), MASK)
    out = tiny_model.forward(cache, torch.cat([done, pad]), torch.cat([nxt, other]), commit_logits=None,
                             commit_rows=[True, False])
    assert cache.row_lengths == [56, 29]
    for r in range(2):
        torch.testing.assert_close(out.preview_logits[r:r + 1], alone[r][0], rtol=1e-4, atol=1e-4)
    kept, solo = cache.select([1]), alone[1][1]
    for layer, part in kept.layers.items():
        for a, b, c in zip(vars(part).values(), vars(before.layers[layer]).values(), vars(solo.layers[layer]).values()):
            if a.dim() == 4 and a.shape[2] == 128:  # K,V: the row's own positions
                a, b, c = a[:, :, :29], b[:, :, :29], c[:, :, :29]
            assert torch.equal(a, b)
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
    committed = cache.select([0])
    ref = alone[0][1]
    for layer, part in committed.layers.items():
        for a, c in zip(vars(part).values(), vars(ref.layers[layer]).values()):
            if a.dim() == 4 and a.shape[2] == 128:
                a, c = a[:, :, :56], c[:, :, :56]
            torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)


def test_rows_in_different_phases_share_one_packed_forward(tiny_model):
    """``forward_packed``: a prompt chunk, an AR token, a block's commit fused with the next
    block's preview, a preview alone and a draft's verify (a commit whose every logit is read), of
    five rows at five lengths, in one forward: each row's logits and cache as it gets them alone,
    and the MoE and LM head ran once over the step's tokens."""
    from clover_lab.model.context import Segment

    g = torch.Generator().manual_seed(3)
    lengths = [0, 33, 40, 29, 21]
    prompts = [torch.randint(0, 500, (1, n), generator=g) for n in lengths]
    parts = [(torch.randint(0, 500, (1, 24), generator=g), None),  # a prompt's first chunk
             (torch.randint(0, 500, (1, 1), generator=g), None),  # an AR token
             (block(g), block(g, masked=range(3, 16))),  # fused commit + preview
             (None, block(g, masked=range(16))),  # a preview
             (torch.randint(0, 500, (1, 6), generator=g), None)]  # a verify
    alone = []
    for prompt, (commit, preview) in zip(prompts, parts):
        cache = tiny_model.new_cache(128)
        if prompt.shape[1]:
            tiny_model.commit(cache, prompt)
        out = tiny_model.forward(cache, commit, preview, commit_logits="all")
        alone.append((torch.cat([t[0] for t in (out.commit_logits, out.preview_logits) if t is not None]), cache))
    cache = tiny_model.new_cache(128, 5)
    for r, prompt in enumerate(prompts):
        if prompt.shape[1]:
            tiny_model.commit(cache.row(r), prompt)
    cache.set_row_lengths(lengths)
    segments, ids, at = [], [], 0
    for r, (commit, preview) in enumerate(parts):
        c, m = (0 if t is None else t.shape[1] for t in (commit, preview))
        segments.append(Segment(r, c, m, at))
        ids += [t[0] for t in (commit, preview) if t is not None]
        at += c + m
    calls = []
    hook = tiny_model.lm_head.register_forward_pre_hook(lambda mod, args: calls.append(args[0].shape))
    try:
        logits = tiny_model.forward_packed(cache, segments, torch.cat(ids), torch.arange(at))
    finally:
        hook.remove()
    assert len(calls) == 1 and cache.row_lengths == [24, 34, 56, 29, 27]
    for s, (want, solo) in zip(segments, alone):
        torch.testing.assert_close(logits[s.offset:s.offset + s.width], want, rtol=1e-4, atol=1e-4)
        mine, n = cache.select([s.row]), cache.row_lengths[s.row]
        for layer, part in mine.layers.items():
            for a, c in zip(vars(part).values(), vars(solo.layers[layer]).values()):
                if a.dim() == 4 and a.shape[2] == 128:  # K,V: the row's own positions
                    a, c = a[:, :, :n], c[:, :, :n]
                torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)
