"""The varlen kernels (rows' segments of different lengths packed on one token axis, cu_seqlens:
clover_kernels/varlen.py) against their torch references, which run each segment alone through
the dense op: the GDN commit, the GDN preview and the split-KV cache attention, on ragged lengths
(an AR token, a few rows, a block, a block and one, an empty segment) in the interpreter.
Every call the op table describes runs in tests/kernels/test_kernel_table.py too (small sizes)."""
import pytest
import torch

pytest.importorskip("triton")

from clover_kernels.attention import split_kv  # noqa: E402
from clover_kernels.attention import torch as attention_ref  # noqa: E402
from clover_kernels.gdn import commit, preview  # noqa: E402
from clover_kernels.gdn import torch as gdn_ref  # noqa: E402
from clover_kernels.varlen import offsets  # noqa: E402

RAGGED = (1, 5, 0, 32, 33)
Hk, Hv, DK, DV, K = 1, 2, 16, 16, 4
C = 2 * Hk * DK + Hv * DV


def _gdn_inputs(lengths, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    N, T = len(lengths), sum(lengths)
    mixed = torch.randn(1, T, C, generator=g).to(dtype)
    ring = torch.randn(N, C, K - 1, generator=g).to(dtype)
    conv_weight = (torch.randn(C, K, generator=g) * 0.5).to(dtype)
    log_decay = -torch.rand(1, T, Hv, generator=g) * 1.5
    beta = torch.rand(1, T, Hv, generator=g)
    state = torch.randn(N, Hv, DK, DV, generator=g) * 0.5
    return tuple(x.to(device) for x in (mixed, ring, conv_weight, log_decay, beta, state))


def _close_all(got, want, dtype, close, what):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}, output {i}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
        close(a, b, dtype, scale=max(1.0, b.float().abs().max().item()), what=f"{what}, output {i}")


@pytest.mark.slow  # the chunked rule over 33 rows in the interpreter: a few seconds per dtype
def test_gdn_commit_varlen_equals_each_segment_alone(dtype, device, close):
    args = _gdn_inputs(RAGGED, dtype, device)
    cu = offsets(RAGGED, device)
    state_before = args[5].clone()
    got = commit.gdn_commit_varlen(*args, Hk, DK, DV, cu, max_seqlen=max(RAGGED), chunk_size=32)
    _close_all(got, gdn_ref.gdn_commit_varlen(*args, Hk, DK, DV, cu), dtype, close, "commit")
    assert torch.equal(args[5], state_before), "the input state was modified"
    assert torch.equal(got[1][2], args[1][2]) and torch.equal(got[2][2], args[5][2]), "the empty segment changed"


@pytest.mark.slow
def test_gdn_preview_varlen_equals_each_block_alone(dtype, device, close):
    lengths = (1, 5, 32, 33)
    mixed, ring, conv_weight, _, _, state = _gdn_inputs(lengths, dtype, device, seed=1)
    g = torch.Generator().manual_seed(2)
    right = (torch.randn(C, K - 1, generator=g) * 0.5).to(dtype).to(device)
    scale, bias, log_n = (torch.randn(Hv, generator=g).to(device) for _ in range(3))
    args = (mixed, ring, conv_weight, right, state, scale * 0.3, bias, log_n.abs())
    cu = offsets(lengths, device)
    got = preview.gdn_preview_varlen(*args, Hk, DK, DV, cu, return_history=True)
    _close_all(got, gdn_ref.gdn_preview_varlen(*args, Hk, DK, DV, cu, return_history=True), dtype, close, "preview")


@pytest.mark.slow
def test_cache_attention_varlen_equals_each_segment_alone(dtype, device, close):
    """Segment n's queries over cache row n, each up to its own last key; the blocks' rows see their
    whole block (the last key of the block's last row, as block_last gives it)."""
    g = torch.Generator().manual_seed(3)
    N, T, HQ, HKV, D, L = len(RAGGED), sum(RAGGED), 2, 1, 16, 48
    q = torch.randn(1, T, HQ, D, generator=g).to(dtype).to(device).transpose(1, 2)
    k, v = (torch.randn(N, HKV, L, D, generator=g).to(dtype).to(device) for _ in range(2))
    gate = torch.randn(1, T, HQ * D, generator=g).to(dtype).to(device)
    starts = torch.randint(0, L - max(RAGGED), (N,), generator=g)
    last = torch.cat([attention_ref.block_last((s + torch.arange(n))[None], n if n >= 32 else 0)[0]
                      for s, n in zip(starts.tolist(), RAGGED)])[None].to(device)
    cu = offsets(RAGGED, device)
    got = split_kv.cache_attention_varlen(q, k, v, last, gate, cu, max_seqlen=max(RAGGED))
    want = attention_ref.cache_attention_varlen(q.float(), k.float(), v.float(), last, gate.float(), cu)
    assert got.shape == (1, T, HQ * D) and got.dtype == dtype
    close(got, want, dtype, what="cache attention")


def test_varlen_arguments_are_checked(device):
    """Offsets that are not [N + 1] integers, that do not cover the packed axis, per-row tensors of
    another row count, empty or too long preview blocks: each refused, naming what was wrong."""
    args = _gdn_inputs((1, 3), torch.float32, device)
    run = commit.gdn_commit_varlen
    with pytest.raises(ValueError, match=r"cu_seqlens must be \[N \+ 1\] int32 or int64.*torch.float32"):
        run(*args, Hk, DK, DV, torch.tensor([0.0, 1.0, 4.0], device=device))
    with pytest.raises(ValueError, match=r"cu_seqlens \[0, 1, 3\] must start at 0, never decrease and end at .* 4"):
        run(*args, Hk, DK, DV, torch.tensor([0, 1, 3], device=device))
    with pytest.raises(ValueError, match=r"ring must have one row per segment \(3\)"):
        run(*args, Hk, DK, DV, offsets((1, 3, 0), device))
    with pytest.raises(ValueError, match=r"packed input must be \[1, T, \.\.\.\]"):
        run(args[0].expand(2, -1, -1), *args[1:], Hk, DK, DV, offsets((1, 3), device))
    with pytest.raises(ValueError, match=r"gdn_commit_varlen: g must be \[1, 4, 2\]"):
        run(*args[:3], args[3][:, :2], *args[4:], Hk, DK, DV, offsets((1, 3), device))
    mixed, ring, cw, _, _, state = args
    right, heads = torch.zeros(C, K - 1, device=device), torch.zeros(Hv, device=device)
    with pytest.raises(ValueError, match=r"gdn_preview_varlen: cu_seqlens \[0, 4, 4\] holds an empty block"):
        preview.gdn_preview_varlen(mixed, ring, cw, right, state, heads, heads, heads, Hk, DK, DV, offsets((4, 0)))
    with pytest.raises(ValueError, match=r"gdn_preview_varlen: the longest block has 65 rows, expected 1 to 64"):
        preview.gdn_preview_varlen(mixed, ring, cw, right, state, heads, heads, heads, Hk, DK, DV, offsets((1, 3)),
                                   max_seqlen=65)
    q = torch.zeros(1, 4, 4, 16, device=device)
    kv = torch.zeros(3, 2, 8, 16, device=device)
    with pytest.raises(ValueError, match=r"cache_attention_varlen: k must have one row per segment \(2\)"):
        split_kv.cache_attention_varlen(q, kv, kv, torch.zeros(1, 4, dtype=torch.long), q.reshape(1, 4, -1),
                                        offsets((1, 3)))
