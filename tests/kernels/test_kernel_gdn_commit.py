"""Triton GDN commit (conv + SiLU + L2 norm + chunked gated delta rule) against gdn/naive.py."""
import pytest
import torch

pytest.importorskip("triton")

from clover_kernels.gdn import (
    commit,  # noqa: E402
    naive,  # noqa: E402
)


def make_inputs(B, T, Hk, Hv, dk, dv, dtype, device, K=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = 2 * Hk * dk + Hv * dv
    mixed = torch.randn(B, T, C, generator=g).to(dtype)
    ring = torch.randn(B, C, K - 1, generator=g).to(dtype)
    conv_weight = (torch.randn(C, K, generator=g) * 0.5).to(dtype)
    log_decay = -torch.rand(B, T, Hv, generator=g) * 1.5  # g <= 0, some strong decays
    beta = torch.rand(B, T, Hv, generator=g)
    state = torch.randn(B, Hv, dk, dv, generator=g) * 0.5
    args = (mixed, ring, conv_weight, log_decay, beta, state)
    return tuple(a.to(device) for a in args)


def check(args, Hk, dk, dv, dtype, close, **kw):
    state_before = args[5].clone()
    o, ring, state = commit.gdn_commit(*args, Hk, dk, dv, **kw)
    o_ref, ring_ref, state_ref = naive.gdn_commit(*args, Hk, dk, dv)
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
    assert ring.dtype == ring_ref.dtype and state.dtype == torch.float32
    close(o, o_ref, dtype, scale=max(1.0, o_ref.abs().max().item()), what="o")
    close(ring, ring_ref, dtype, what="ring")
    close(state, state_ref, dtype, scale=max(1.0, state_ref.abs().max().item()), what="state")
    assert torch.equal(args[5], state_before), "the input state was modified"


# (B, T, Hk, Hv, dk, dv): T=1 (decode), T < K-1 (ring shift), lengths not multiple of the
# chunk, exact multiples, key/value head ratio 1 and 2, dk != dv
SHAPES = [
    (1, 1, 1, 1, 16, 16),
    (2, 1, 1, 2, 32, 16),
    (1, 2, 2, 2, 16, 16),
    (2, 17, 1, 2, 16, 32),
    (1, 32, 2, 4, 32, 16),
    (1, 45, 1, 1, 16, 16),
    (1, 20, 1, 2, 24, 20),  # head dims that are not powers of two
    (1, 20, 1, 1, 128, 64),  # production dk: the state is split into two dv tiles
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_T{}_Hk{}_Hv{}_dk{}_dv{}".format(*s))
def test_commit_chunk16(shape, dtype, device, close):
    B, T, Hk, Hv, dk, dv = shape
    check(make_inputs(*shape, dtype, device), Hk, dk, dv, dtype, close, chunk_size=16)


@pytest.mark.parametrize("T", [33, 70])
def test_commit_default_chunk(T, dtype, device, close):
    """The default chunk size (32; 16 for fp32 inputs): several chunks and a partial one."""
    check(make_inputs(1, T, 1, 2, 16, 16, dtype, device, seed=T), 1, 16, 16, dtype, close)


@pytest.mark.parametrize("T", [3, 9])
def test_commit_recurrent_kernel_multi_token(T, device, close, monkeypatch):
    """The token-by-token kernel (used for T=1) is exact for any T."""
    monkeypatch.setattr(commit, "RECURRENT_MAX_T", 64)
    check(make_inputs(2, T, 1, 2, 16, 32, torch.float32, device), 1, 16, 32, torch.float32, close)


def test_commit_in_pieces_equals_commit_at_once(device, close):
    """Prefill in chunks, then a block, then decode: the state and ring carry over exactly."""
    dtype = torch.float32
    mixed, ring, w, gdecay, beta, state = make_inputs(1, 40, 1, 2, 16, 16, dtype, device, seed=3)
    o_all, ring_all, s_all = commit.gdn_commit(mixed, ring, w, gdecay, beta, state, 1, 16, 16, chunk_size=16)
    outs, r, s = [], ring, state
    for a, b in [(0, 23), (23, 39), (39, 40)]:
        o, r, s = commit.gdn_commit(mixed[:, a:b], r, w, gdecay[:, a:b], beta[:, a:b], s, 1, 16, 16,
                                    chunk_size=16)
        outs.append(o)
    close(torch.cat(outs, 1), o_all, dtype, what="o")
    close(r, ring_all, dtype, what="ring")
    close(s, s_all, dtype, scale=s_all.abs().max().item(), what="state")


def test_commit_strided_gates_and_fp32_ring(device, close):
    """g and beta as non-contiguous views (as sliced from a projection), ring kept in fp32."""
    mixed, ring, w, _, _, state = make_inputs(1, 20, 1, 2, 16, 16, torch.float16, device, seed=5)
    ba = torch.randn(1, 20, 4, device=device)
    gdecay, beta = -torch.nn.functional.softplus(ba[..., :2]), torch.sigmoid(ba[..., 2:])
    check((mixed, ring.float(), w, gdecay, beta, state), 1, 16, 16, torch.float16, close, chunk_size=16)


def test_commit_strong_decay_stays_finite(device, close):
    mixed, ring, w, gdecay, beta, state = make_inputs(1, 40, 1, 2, 16, 16, torch.float32, device, seed=7)
    gdecay = gdecay * 20  # down to -30 per token: exp(G) underflows inside a chunk
    o, r, s = commit.gdn_commit(mixed, ring, w, gdecay, beta, state, 1, 16, 16, chunk_size=16)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    check((mixed, ring, w, gdecay, beta, state), 1, 16, 16, torch.float32, close, chunk_size=16)


def test_commit_rejects_bad_shapes(device):
    mixed, ring, w, gdecay, beta, state = make_inputs(1, 4, 1, 2, 16, 16, torch.float32, device)
    with pytest.raises(ValueError, match="state"):
        commit.gdn_commit(mixed, ring, w, gdecay, beta, state[:, :1], 1, 16, 16)
    with pytest.raises(ValueError, match="beta"):
        commit.gdn_commit(mixed, ring, w, gdecay, beta[:, :2], state, 1, 16, 16)


@pytest.mark.parametrize("B", [1, 2])
def test_commit_decode_bf16(B, device, close):
    """AR decode (T=1: conv + recurrent kernels, no tl.dot) in bf16, also under the interpreter."""
    check(make_inputs(B, 1, 1, 2, 16, 32, torch.bfloat16, device, seed=B), 1, 16, 32, torch.bfloat16, close)
