"""Triton GDN preview operator (one launch per layer) against gdn/naive.py."""
import math

import pytest
import torch

pytest.importorskip("triton")

from clover_kernels.gdn import (
    naive,  # noqa: E402
    preview,  # noqa: E402
)


def make_inputs(B, m, Hk, Hv, dk, dv, dtype, device, K=4, seed=0, default_weights=False):
    g = torch.Generator().manual_seed(seed)
    C = 2 * Hk * dk + Hv * dv
    mixed = torch.randn(B, m, C, generator=g).to(dtype)
    ring = torch.randn(B, C, K - 1, generator=g).to(dtype)
    conv_weight = (torch.randn(C, K, generator=g) * 0.5).to(dtype)
    state = torch.randn(B, Hv, dk, dv, generator=g) * 0.5
    if default_weights:  # a plain Qwen checkpoint: untrained preview weights
        right = torch.zeros(C, K - 1)
        block_scale = torch.full((Hv,), math.log(math.sqrt(dk)))
        history_bias, history_log_n = torch.zeros(Hv), torch.ones(Hv)
    else:
        right = torch.randn(C, K - 1, generator=g) * 0.5
        block_scale = math.log(math.sqrt(dk)) + torch.randn(Hv, generator=g) * 0.5
        history_bias = torch.randn(Hv, generator=g)
        history_log_n = 0.5 + torch.rand(Hv, generator=g)
    args = (mixed, ring, conv_weight, right.to(dtype), state, block_scale, history_bias, history_log_n)
    return tuple(a.to(device) for a in args)


def check(args, Hk, dk, dv, dtype, close, return_history=True):
    ring_before, state_before = args[1].clone(), args[4].clone()
    o, p, h = preview.gdn_preview(*args, Hk, dk, dv, return_history)
    o_ref, p_ref, h_ref = naive.gdn_preview(*args, Hk, dk, dv, return_history)
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
    assert p.shape == p_ref.shape and p.dtype == torch.float32
    close(o, o_ref, dtype, scale=max(1.0, o_ref.abs().max().item()), what="o")
    close(p, p_ref, dtype, what="p_hist")
    if return_history:
        assert h.dtype == torch.float32
        close(h, h_ref, dtype, scale=max(1.0, h_ref.abs().max().item()), what="h")
    else:
        assert h is None
    assert torch.equal(args[1], ring_before) and torch.equal(args[4], state_before), "preview wrote its inputs"


# (B, m, Hk, Hv, dk, dv): m=1, m < K-1, partial tiles, a full 32-token block, the 64 maximum
SHAPES = [
    (1, 1, 1, 1, 16, 16),
    (2, 2, 1, 2, 16, 32),
    (1, 13, 2, 2, 32, 16),
    (2, 32, 1, 2, 16, 16),
    (1, 64, 2, 4, 16, 16),
    (1, 20, 1, 2, 24, 20),  # head dims that are not powers of two
    (1, 9, 1, 1, 32, 128),  # production dv: two dv tiles per head
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_m{}_Hk{}_Hv{}_dk{}_dv{}".format(*s))
def test_preview(shape, dtype, device, close):
    B, m, Hk, Hv, dk, dv = shape
    check(make_inputs(*shape, dtype, device), Hk, dk, dv, dtype, close)


@pytest.mark.parametrize("m", [1, 32])
def test_preview_default_weights_no_history(m, device, close):
    check(make_inputs(1, m, 1, 2, 16, 16, torch.float32, device, default_weights=True), 1, 16, 16,
          torch.float32, close, return_history=False)


def test_preview_large_logits_stay_finite(device, close):
    """A sharp block softmax (large block_scale) and a dominant history slot."""
    args = list(make_inputs(1, 32, 1, 2, 16, 16, torch.float32, device, seed=2))
    args[5] = args[5] + 6.0  # exp(block_scale) ~ 1600
    args[6] = args[6] + 40.0  # history logit far above the block's
    check(tuple(args), 1, 16, 16, torch.float32, close)


def test_preview_long_block_falls_back_to_reference(device, close):
    check(make_inputs(1, 70, 1, 1, 16, 16, torch.float32, device), 1, 16, 16, torch.float32, close)


def test_preview_rejects_empty_block(device):
    args = make_inputs(1, 0, 1, 1, 16, 16, torch.float32, device)
    with pytest.raises(ValueError, match="m=0"):
        preview.gdn_preview(*args, 1, 16, 16)


def test_commit_then_preview_on_views_of_one_projection(device, close):
    """The fused commit + preview pass: both ops read slices of one [B, c + m, C] projection,
    and the preview reads the ring and state the commit just produced."""
    from clover_kernels.gdn import commit

    c, m, Hk, Hv, dk, dv = 21, 11, 1, 2, 16, 16
    mixed, ring, conv_w, right, state, bs, hb, hln = make_inputs(2, c + m, Hk, Hv, dk, dv, torch.float32, device)
    g = torch.Generator().manual_seed(9)
    log_decay = (-torch.rand(2, c, Hv, generator=g)).to(device)
    beta = torch.rand(2, c, Hv, generator=g).to(device)
    o_c, ring_c, state_c = commit.gdn_commit(mixed[:, :c], ring, conv_w, log_decay, beta, state, Hk, dk, dv)
    ref_c = naive.gdn_commit(mixed[:, :c], ring, conv_w, log_decay, beta, state, Hk, dk, dv)
    for a, b in zip((o_c, ring_c, state_c), ref_c):
        close(a, b, torch.float32, scale=max(1.0, b.abs().max().item()), what="commit")
    check((mixed[:, c:], ring_c, conv_w, right, state_c, bs, hb, hln), Hk, dk, dv, torch.float32, close)


@pytest.mark.parametrize("history", [False, True])
def test_commit_and_preview_write_into_one_output(device, dtype, close, history):
    """The fused step's GDN output: the commit kernels write rows [0, c) and the preview kernel rows
    [c, c + m) of one [B, c + m, Hv, dv] buffer through ``out`` (no concatenation), equal to the
    references' outputs; the torch path fills the same slices with the same values; h keeps its
    own layout."""
    from clover_kernels.gdn import commit
    from clover_kernels.gdn import torch as gdn_torch

    c, m, Hk, Hv, dk, dv = 5, 11, 1, 2, 16, 32
    mixed, ring, conv_w, right, state, bs, hb, hln = make_inputs(2, c + m, Hk, Hv, dk, dv, dtype, device)
    g = torch.Generator().manual_seed(3)
    log_decay = (-torch.rand(2, c, Hv, generator=g)).to(device)
    beta = torch.rand(2, c, Hv, generator=g).to(dtype).to(device)
    heads = (Hk, dk, dv)
    want = []
    for ops in (naive, gdn_torch):
        o_c, ring_c, state_c = ops.gdn_commit(mixed[:, :c], ring, conv_w, log_decay, beta, state, *heads)
        o_p, _, h_ref = ops.gdn_preview(mixed[:, c:], ring_c, conv_w, right, state_c, bs, hb, hln, *heads, history)
        ref = torch.cat([o_c, o_p], dim=1)
        out = torch.full_like(ref, float("nan"))
        o_c2, *_ = ops.gdn_commit(mixed[:, :c], ring, conv_w, log_decay, beta, state, *heads, out=out[:, :c])
        o_p2, _, _ = ops.gdn_preview(mixed[:, c:], ring_c, conv_w, right, state_c, bs, hb, hln, *heads, history,
                                     out=out[:, c:])
        assert o_c2.data_ptr() == out.data_ptr() and o_p2.data_ptr() == out[:, c:].data_ptr()
        assert torch.equal(out, ref), "the torch path's slices differ from its outputs"
        want.append((ref, ring_c, state_c, h_ref))
    ref, ring_c, state_c, h_ref = want[0]
    out = torch.full_like(ref, float("nan"))
    commit.gdn_commit(mixed[:, :c], ring, conv_w, log_decay, beta, state, *heads, out=out[:, :c])
    _, _, h = preview.gdn_preview(mixed[:, c:], ring_c, conv_w, right, state_c, bs, hb, hln, *heads, history,
                                  out=out[:, c:])
    close(out, ref, dtype, scale=max(1.0, ref.abs().max().item()), what="o")
    if history:
        assert h.is_contiguous() and h.shape == (2, m, Hv, dv)
        close(h, h_ref, dtype, scale=max(1.0, h_ref.abs().max().item()), what="h")
    for fn, args in ((commit.gdn_commit, (mixed[:, :c], ring, conv_w, log_decay, beta, state)),
                     (preview.gdn_preview, (mixed[:, c:], ring_c, conv_w, right, state_c, bs, hb, hln))):
        with pytest.raises(ValueError, match="out must be"):
            fn(*args, *heads, out=out[:, :c - 1])
