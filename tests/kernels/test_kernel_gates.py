"""Triton gating kernels (gates/fused.py) against gates/naive.py: the GDN's g and beta, the
attention output gate, SwiGLU's silu * up and the MoE combine, on strided views as the layers
pass them."""
import pytest
import torch

pytest.importorskip("triton")

from clover_kernels.gates import fused, naive  # noqa: E402


def _randn(*shape, dtype, device, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


@pytest.mark.parametrize("rows", [1, 16, 33])
def test_gdn_gates_on_projection_slices(rows, dtype, device, close):
    hv = 4
    proj = _randn(2, rows, 40 + 2 * hv, dtype=dtype, device=device, scale=4.0)  # ... | b | a, as in_proj's product
    b, a = proj[..., 40:40 + hv], proj[..., 40 + hv:]
    A_log = _randn(hv, dtype=dtype, device=device, seed=1).abs().log()
    dt_bias = _randn(hv, dtype=dtype, device=device, seed=2)
    a[0, 0, 0] = 30.0  # past softplus's threshold
    g, beta = fused.gdn_gates(b, a, A_log, dt_bias)
    g_ref, beta_ref = naive.gdn_gates(b, a, A_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype and g.shape == b.shape
    close(g, g_ref, torch.float32, scale=4.0, what="g")
    close(beta, beta_ref, dtype, what="beta")


def test_gdn_gates_bad_shapes(device):
    b = torch.zeros(2, 3, 4, device=device)
    with pytest.raises(ValueError, match="A_log"):
        fused.gdn_gates(b, b, torch.zeros(3, device=device), torch.zeros(4, device=device))


@pytest.mark.parametrize("shape", [(1, 1, 4, 64), (2, 5, 3, 24), (1, 7, 2, 100)], ids=str)
def test_sigmoid_gate_on_head_views(shape, dtype, device, close):
    B, T, G, D = shape
    o = _randn(B, G, T, D, dtype=dtype, device=device).transpose(1, 2)  # attention's output, [B, T, G, D] view
    q = _randn(B, T, G, 2 * D, dtype=dtype, device=device, seed=1, scale=3.0)  # query and gate per head
    gate = q[..., D:]
    out = fused.sigmoid_gate(o, gate)
    assert out.shape == o.shape and out.is_contiguous()
    close(out, naive.sigmoid_gate(o, gate), dtype, what="sigmoid_gate")


@pytest.mark.parametrize("shape", [(1, 1, 256), (2, 9, 48), (37, 130)], ids=str)
def test_silu_mul_on_projection_slices(shape, dtype, device, close):
    n = shape[-1]
    proj = _randn(*shape[:-1], 16 + 2 * n, dtype=dtype, device=device, scale=3.0)  # router | gate | up
    gate, up = proj[..., 16:16 + n], proj[..., 16 + n:]
    close(fused.silu_mul(gate, up), naive.silu_mul(gate, up), dtype, scale=3.0, what="silu_mul")


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "alone"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "no_shared"])
@pytest.mark.parametrize("shape", [(1, 1, 256), (2, 16, 100)], ids=str)
def test_moe_combine(shape, shared, with_residual, dtype, device, close):
    residual, routed, x, s = (_randn(*shape, dtype=dtype, device=device, seed=i) for i in range(4))
    residual = residual if with_residual else None
    w = _randn(1, shape[-1], dtype=dtype, device=device, seed=5, scale=0.1)
    args = (x, w, s) if shared else ()
    out = fused.moe_combine(residual, routed, *args)
    assert out.shape == routed.shape and out.dtype == dtype
    close(out, naive.moe_combine(residual, routed, *args), dtype, scale=2.0, what="moe_combine")


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "no_shared"])
def test_moe_combine_sums_the_routed_slots(shared, dtype, device, close):
    """Routed outputs per (token, slot) [..., k, H] fp32 (the experts' ``slots=True``): the kernel sums
    them over k in its pass, as the reference sums them before the combine, with the next norm too."""
    B, T, k, n = 2, 3, 4, 96
    residual, x, s = (_randn(B, T, n, dtype=dtype, device=device, seed=i) for i in range(3))
    routed = _randn(B, T, k, n, dtype=torch.float32, device=device, seed=3)
    w = _randn(1, n, dtype=dtype, device=device, seed=5, scale=0.1)
    nw = _randn(n, dtype=dtype, device=device, seed=6, scale=0.3)
    args = (x, w, s) if shared else ()
    summed = routed.sum(-2).to(dtype)
    for res in (residual, None) if shared else (residual,):
        got = fused.moe_combine(res, routed, *args, norm_weight=nw)
        want = naive.moe_combine(res, routed, *args, norm_weight=nw)
        assert got[0].shape == (B, T, n) and got[0].dtype == dtype
        torch.testing.assert_close(want[0], naive.moe_combine(res, summed, *args), rtol=0, atol=0)
        close(got[0], want[0], dtype, scale=2.0, what="stream")
        close(got[1], want[1], dtype, scale=2.0, what="normed")


def test_moe_combine_bad_shapes(device):
    x = torch.zeros(2, 8, device=device)
    with pytest.raises(ValueError, match="gate weight"):
        fused.moe_combine(x, x, x, torch.zeros(1, 4, device=device), x)
    with pytest.raises(ValueError, match="shapes"):
        fused.silu_mul(x, torch.zeros(2, 4, device=device))


def test_moe_combine_with_the_next_norm(dtype, device, close):
    residual, routed, x, s = (_randn(2, 3, 64, dtype=dtype, device=device, seed=i) for i in range(4))
    w = _randn(1, 64, dtype=dtype, device=device, seed=5, scale=0.1)
    nw = _randn(64, dtype=dtype, device=device, seed=6, scale=0.3)
    out, normed = fused.moe_combine(residual, routed, x, w, s, norm_weight=nw)
    ref_out, ref_normed = naive.moe_combine(residual, routed, x, w, s, norm_weight=nw)
    close(out, ref_out, dtype, scale=2.0, what="stream")
    close(normed, ref_normed, dtype, scale=2.0, what="normed")
