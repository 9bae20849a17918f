"""Fused MoE experts (grouped by expert, only experts hit are read) against moe/naive.py."""
import pytest
import torch

pytest.importorskip("triton")

from clover_kernels.moe import (
    fused,  # noqa: E402
    naive,  # noqa: E402
)

E, H, I = 8, 64, 32


def make_inputs(T, k, dtype, device, unused=(), seed=0, E=E, H=H, I=I):
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if e not in unused])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(T)]) \
        if T else torch.zeros(0, k, dtype=torch.long)
    weights = torch.softmax(torch.randn(T, k, generator=g), -1)
    x = torch.randn(T, H, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(dtype)
    return tuple(a.to(device) for a in (x, ids, weights, gate_up, down))


# (T, k, experts hit by no token): one token top-1 (decode), top-8 of 8, a block of 32 with
# experts left out, odd counts that leave partly filled expert blocks, a 64-token block
CASES = [(1, 1, ()), (1, 8, ()), (3, 2, (1, 6)), (32, 4, (0, 5, 7)), (17, 3, ()), (64, 8, ())]


@pytest.mark.parametrize("T,k,unused", CASES, ids=lambda c: str(c))
def test_moe_experts(T, k, unused, dtype, device, close):
    x, ids, w, gate_up, down = make_inputs(T, k, dtype, device, unused)
    ref = naive.moe_experts(x, ids, w, gate_up, down)
    if unused:  # experts hit by no token must never be read: poison them
        gate_up[list(unused)] = float("nan")
        down[list(unused)] = float("nan")
    out = fused.moe_experts(x, ids, w, gate_up, down)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    close(out, ref, dtype, scale=max(1.0, ref.abs().max().item()), what="moe")


@pytest.mark.parametrize("T,k,unused", CASES[1:4], ids=lambda c: str(c))
def test_moe_experts_slots(T, k, unused, dtype, device, close):
    """``slots=True``: each (token, slot) pair's weighted output [T, k, H] fp32, unsummed (what
    moe_combine sums), from the kernels and from the torch path, against the reference's terms;
    summed over k they are the experts' output."""
    from clover_kernels.moe import torch as moe_torch

    x, ids, w, gate_up, down = make_inputs(T, k, dtype, device, unused)
    ref = naive.moe_experts(x, ids, w, gate_up, down, slots=True)
    assert ref.shape == (T, k, H) and ref.dtype == torch.float32
    torch.testing.assert_close(ref.sum(1).to(dtype), naive.moe_experts(x, ids, w, gate_up, down), rtol=0, atol=0)
    scale = max(1.0, ref.abs().max().item())
    for got in (fused.moe_experts(x, ids, w, gate_up, down, slots=True),
                moe_torch.moe_experts(x.cpu(), ids.cpu(), w.cpu(), gate_up.cpu(), down.cpu(), slots=True)):
        assert got.shape == (T, k, H) and got.dtype == torch.float32
        close(got.to(device), ref, dtype, scale=scale, what="slots")
    assert fused.moe_experts(x[:0], ids[:0], w[:0], gate_up, down, slots=True).shape == (0, k, H)


def test_block_m_follows_the_pairs_per_expert():
    """16 rows for decode and blocks, up to 128 for a prefill chunk, from the shapes alone."""
    assert fused.BLOCK_MS == (16, 32, 64, 128)
    at_35b = {T: fused.block_m(T * 8, 256) for T in (1, 32, 64, 512, 1024, 2048, 4096, 8192)}
    assert at_35b == {1: 16, 32: 16, 64: 16, 512: 16, 1024: 32, 2048: 64, 4096: 128, 8192: 128}
    assert fused.block_m(0, 256) == 16 and fused.block_m(100, 1) == 64


@pytest.mark.parametrize("bm", [16, 32, 64, 128])
def test_moe_experts_at_each_tile_choice(bm, dtype, device, close, monkeypatch):
    """Each row-block height the launcher can choose, against the reference: the token count is
    set so that the mean pairs per expert selects it, and the alignment pads to that height."""
    from clover_kernels.fp8 import moe as fp8_moe
    from clover_kernels.fp8 import naive as fp8_naive

    E_, k = 4, 2
    T = bm * E_ // k + 3  # a few pairs past the mean: partly filled blocks
    assert fused.block_m(T * k, E_) == bm
    padded = []
    align_blocks = fused.align.align_blocks
    monkeypatch.setattr(fused.align, "align_blocks", lambda ids, n, block_m, nb: padded.append(block_m) or
                        align_blocks(ids, n, block_m, nb))
    x, ids, w, gate_up, down = make_inputs(T, k, torch.float32, "cpu", E=E_, H=48, I=40, seed=bm)
    ids[: T // 2] = torch.tensor([0, 1])  # skewed: experts 0 and 1 own several blocks
    x, ids, w, gate_up, down = (t.to(device) for t in (x.to(dtype), ids, w, gate_up.to(dtype), down.to(dtype)))
    ref = naive.moe_experts(x, ids, w, gate_up, down)
    close(fused.moe_experts(x, ids, w, gate_up, down), ref, dtype, scale=max(1.0, ref.abs().max().item()), what="moe")
    block = (16, 16)  # the FP8 experts' launcher chooses the same height
    (gq, gs), (uq, us), (dq, ds) = (fp8_naive.quantize(t.float().cpu(), block)
                                    for t in (gate_up[:, :40], gate_up[:, 40:], down))
    fp8 = [t.to(device) for t in (torch.cat([gq, uq], 1), dq, torch.cat([gs, us], 1), ds)]
    ref = fp8_naive.moe_experts(x, ids, w, *fp8[:2], *fp8[2:], block)
    close(fp8_moe.moe_experts(x, ids, w, *fp8[:2], *fp8[2:], block), ref, dtype,
          scale=max(1.0, ref.abs().max().item()), what="fp8 moe")
    assert padded == [bm, bm]


def test_moe_uneven_dims_and_many_experts(device, close):
    """Sizes that are not tile multiples, more experts than pairs."""
    x, ids, w, gate_up, down = make_inputs(5, 2, torch.float32, device, E=40, H=48, I=40, seed=3)
    close(fused.moe_experts(x, ids, w, gate_up, down), naive.moe_experts(x, ids, w, gate_up, down),
          torch.float32, what="moe")


def test_moe_no_tokens(device):
    x, ids, w, gate_up, down = make_inputs(0, 2, torch.float32, device)
    assert fused.moe_experts(x, ids, w, gate_up, down).shape == (0, H)


def test_align_blocks_covers_every_pair_once(device):
    ids = torch.tensor([[3, 1], [3, 0], [1, 3], [7, 3]], device=device)
    pair_of_row, expert_of_block = fused.align_blocks(ids, 8, block_m=16)
    P = ids.numel()
    rows = pair_of_row.view(-1, 16)
    real = expert_of_block >= 0
    assert sorted(expert_of_block[real].tolist()) == [0, 1, 3, 7]  # one block per expert hit, none else
    assert (rows[~real] == P).all()
    assert sorted(pair_of_row[pair_of_row < P].tolist()) == list(range(P))
    for blk, e in zip(rows[real], expert_of_block[real]):
        pairs = blk[blk < P].long()
        assert (ids.reshape(-1)[pairs] == e).all()
    assert expert_of_block.numel() == fused.max_blocks(P, 8)


@pytest.mark.parametrize("T,k,E,block_m", [(1, 1, 8, 16), (1, 8, 256, 16), (32, 8, 256, 16), (64, 8, 256, 16),
                                           (17, 3, 6, 16), (5, 2, 40, 32), (100, 4, 16, 64), (300, 2, 4, 128)],
                         ids=str)
def test_align_kernel_equals_its_reference(T, k, E, block_m, device):
    """The one-launch counting sort gives the torch reference's table exactly (stable order
    within each expert, padding, unused blocks), skewed routing included."""
    g = torch.Generator().manual_seed(T * k + E)
    for skew in (False, True):
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        if skew:  # most pairs on few experts: groups spanning several blocks
            ids = torch.where(torch.rand(T, k, generator=g) < 0.6, ids % 3, ids)
        ids = ids.to(device)
        want = naive.align_blocks(ids, E, block_m)
        got = fused.align_blocks(ids, E, block_m=block_m)
        for a, b in zip(got, want):
            assert a.dtype == torch.int32 and torch.equal(a.cpu(), b.cpu())


def test_moe_rejects_bad_shapes(device):
    x, ids, w, gate_up, down = make_inputs(2, 2, torch.float32, device)
    with pytest.raises(ValueError, match="down"):
        fused.moe_experts(x, ids, w, gate_up, down[:, :, :8])


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (16, 16, 2), (32, 256, 8), (5, 40, 3), (3, 6, 6)], ids=str)
def test_route_kernel_equals_the_routing_rule(T, E, k, dtype, device):
    """Softmax, top-k among the allowed experts (all, a coreset, one per token) and renormalisation
    in one launch, against ``naive.route``: the same experts in the same order, the same weights."""
    from clover_kernels.moe import route

    g = torch.Generator().manual_seed(T + E)
    # distinct logits in every dtype (torch.topk promises no order among equal probabilities)
    logits = torch.stack([torch.randperm(E, generator=g) for _ in range(T)]).float().mul(6.0 / E).sub(3.0)
    logits = logits.to(dtype).to(device)
    coreset = torch.zeros(E, dtype=torch.bool)
    coreset[torch.randperm(E, generator=g)[:max(k, E // 2)]] = True
    per_token = torch.rand(T, E, generator=g) < 0.7
    per_token[:, :k] = True  # at least k allowed in every row
    for allowed in (None, coreset.to(device), per_token.to(device)):
        want = naive.route(logits, k, allowed)
        got = route.route(logits, k, allowed)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        assert got[1].dtype == torch.int64 and torch.equal(got[1].cpu(), want[1].cpu())
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
        assert torch.allclose(got[2].sum(-1), torch.ones(T, device=device))


@pytest.mark.parametrize("T,E,k,S,G", [(1, 8, 2, 4, 1), (32, 256, 8, 64, 1), (12, 40, 3, 5, 3), (32, 64, 4, 40, 2)],
                         ids=str)
def test_route_kernel_within_a_coreset_and_recording_one(T, E, k, S, G, dtype, device):
    """A coreset handed as its expert ids (one for every row, or one per group of rows: a batch's
    blocks), compared in the kernel, routes as the mask ``allowed_experts`` builds; recording one
    writes each group's top-S experts of summed probability into the buffer, as
    ``naive.record_coreset``, in its order."""
    from clover_kernels.moe import route

    g = torch.Generator().manual_seed(T * E + S)
    logits = torch.stack([torch.randperm(E, generator=g) for _ in range(T)]).float().mul(6.0 / E).sub(3.0)
    logits = logits.to(dtype).to(device)
    within = torch.stack([torch.randperm(E, generator=g)[:S] for _ in range(G)]).to(device)
    for core in (within[0], within) if G == 1 else (within,):
        want = naive.route(logits, k, naive.allowed_experts(core, E, T))
        assert all(torch.equal(a, b) for a, b in zip(want, naive.route(logits, k, within=core)))
        got = route.route(logits, k, within=core)
        assert torch.equal(got[1].cpu(), want[1].cpu())
        assert set(got[1].reshape(G, -1).cpu()[0].tolist()) <= set(core.reshape(G, -1)[0].cpu().tolist())
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    shape = (S,) if G == 1 else (G, S)
    want_core = torch.full(shape, -1, dtype=torch.long, device=device)
    got_core = torch.full(shape, -1, dtype=torch.long, device=device)
    want = naive.route(logits, k, record=want_core)
    got = route.route(logits, k, record=got_core)
    assert torch.equal(got_core.cpu(), want_core.cpu()), f"{got_core} vs {want_core}"
    assert torch.equal(got[1].cpu(), want[1].cpu())
    with pytest.raises(ValueError, match="not both"):
        route.route(logits, k, naive.allowed_experts(within, E, T), within=within)
    with pytest.raises(ValueError, match="dividing"):
        route.route(logits, k, within=torch.zeros(T + 1, S, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="int64"):
        route.route(logits, k, record=torch.zeros(shape, dtype=torch.int32, device=device))
