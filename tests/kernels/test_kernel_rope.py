"""The fused q/k norms + RoPE kernel (rope/fused.py) against rope/naive.py: the per-head views of
the attention's projection read in place, one position per token or per batch row."""
import pytest
import torch

pytest.importorskip("triton")

from clover_kernels.rope import fused, naive  # noqa: E402


def _inv_freq(rotary_dim, theta=10000.0):
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


@pytest.mark.parametrize("B,T,HQ,HK,D,R", [(1, 1, 4, 2, 64, 16), (2, 5, 4, 2, 64, 64), (1, 17, 3, 1, 48, 24)])
@pytest.mark.parametrize("per_row", [False, True], ids=["shared_positions", "row_positions"])
def test_qk_norm_rope(B, T, HQ, HK, D, R, per_row, dtype, device, close):
    g = torch.Generator().manual_seed(0)
    proj = (torch.randn(B, T, HQ * 2 * D + 2 * HK * D, generator=g) * 2).to(dtype).to(device)
    q = proj[..., :HQ * 2 * D].reshape(B, T, HQ, 2 * D)[..., :D]  # query part of query+gate per head
    k = proj[..., HQ * 2 * D:HQ * 2 * D + HK * D].reshape(B, T, HK, D)
    qw = (torch.randn(D, generator=g) * 0.3).to(dtype).to(device)
    kw = (torch.randn(D, generator=g) * 0.3).to(dtype).to(device)
    start = torch.tensor([[3], [40]])[:B] if per_row else torch.tensor(1000)
    positions = (start + torch.arange(T)).to(device)
    inv = _inv_freq(R).to(device)
    qo, ko = fused.qk_norm_rope(q, k, qw, kw, positions, inv)
    qr, kr = naive.qk_norm_rope(q, k, qw, kw, positions, inv)
    assert qo.shape == (B, HQ, T, D) and ko.shape == (B, HK, T, D) and qo.dtype == dtype
    close(qo, qr, dtype, scale=4.0, what="q")
    close(ko, kr, dtype, scale=4.0, what="k")


@pytest.mark.parametrize("B,T,HK,D,R", [(1, 1, 2, 64, 16), (2, 5, 1, 48, 24)])
def test_qk_norm_rope_writes_the_static_cache(B, T, HK, D, R, dtype, device, close):
    """``cache``: the static step's K,V cache write in the same launch: each row's normed, rotated k
    and its v at the row's position of the caches (each batch row from its own length), as the
    reference's scatters write them; every other cache row untouched."""
    g = torch.Generator().manual_seed(1)
    HQ, L = 2 * HK, 64
    q = (torch.randn(B, T, HQ, D, generator=g) * 2).to(dtype).to(device)
    k = (torch.randn(B, T, HK, D, generator=g) * 2).to(dtype).to(device)
    v = torch.randn(B, T, HK, D, generator=g).to(dtype).to(device)
    qw, kw = ((torch.randn(D, generator=g) * 0.3).to(dtype).to(device) for _ in range(2))
    positions = (torch.tensor([[7], [30]])[:B] + torch.arange(T)).to(device)
    inv = _inv_freq(R).to(device)
    caches = []
    for impl in (fused, naive):
        kc, vc = (torch.randn(B, HK, L, D, generator=torch.Generator().manual_seed(5)).to(dtype).to(device)
                  for _ in range(2))
        qo, ko = impl.qk_norm_rope(q, k, qw, kw, positions, inv, cache=(kc, vc, v))
        caches.append((qo, ko, kc, vc))
    (qo, ko, kc, vc), (qr, kr, kc_ref, vc_ref) = caches
    close(qo, qr, dtype, scale=4.0, what="q")
    close(ko, kr, dtype, scale=4.0, what="k")
    close(kc, kc_ref, dtype, scale=4.0, what="k cache")
    assert torch.equal(vc, vc_ref), "v cache"
    rows = torch.arange(B, device=device)[:, None]
    assert torch.equal(kc.transpose(1, 2)[rows, positions], ko.transpose(1, 2))
    with pytest.raises(ValueError, match="cache"):
        fused.qk_norm_rope(q, k, qw, kw, positions, inv, cache=(kc[:, :, :, :8], vc, v))


def test_qk_norm_rope_bad_input(device):
    q = torch.zeros(1, 2, 4, 16, device=device)
    with pytest.raises(ValueError, match="positions"):
        fused.qk_norm_rope(q, q, torch.zeros(16, device=device), torch.zeros(16, device=device),
                           torch.arange(3, device=device), _inv_freq(8).to(device))
    with pytest.raises(ValueError, match="rotary dims"):
        fused.qk_norm_rope(q, q, torch.zeros(16, device=device), torch.zeros(16, device=device),
                           torch.arange(2, device=device), _inv_freq(32).to(device))
