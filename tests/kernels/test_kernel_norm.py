"""Triton RMSNorm kernels against norm/naive.py."""
import pytest
import torch

pytest.importorskip("triton")

from clover_kernels.norm import (
    naive,  # noqa: E402
    rms,  # noqa: E402
)

SHAPES = [(1, 16), (3, 5, 100), (7, 64), (2, 33)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm(shape, dtype, device, close):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(device)
    w = (torch.randn(shape[-1], generator=g) * 0.5).to(dtype).to(device)
    out = rms.rms_norm(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    close(out, naive.rms_norm(x, w, 1e-6), dtype, what="rms_norm")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("weight_fp32", [False, True], ids=["w_same", "w_fp32"])
def test_gated_rms_norm(shape, weight_fp32, dtype, device, close):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(device)
    gate = torch.randn(shape, generator=g).to(dtype).to(device)
    w = (1 + torch.randn(shape[-1], generator=g) * 0.2).to(torch.float32 if weight_fp32 else dtype).to(device)
    out = rms.gated_rms_norm(x, gate, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    close(out, naive.gated_rms_norm(x, gate, w, 1e-6), dtype, what="gated_rms_norm")


def test_rms_norm_strided_rows(device, close):
    x = torch.randn(6, 40, device=device)[:, :32]  # rows with stride 40
    w = torch.randn(32, device=device)
    close(rms.rms_norm(x, w), naive.rms_norm(x, w), torch.float32, what="strided rows")


def test_rms_norm_empty_and_bad_weight(device):
    x = torch.randn(0, 16, device=device)
    assert rms.rms_norm(x, torch.zeros(16, device=device)).shape == (0, 16)
    with pytest.raises(ValueError, match="weight"):
        rms.rms_norm(torch.randn(2, 16, device=device), torch.zeros(8, device=device))


def test_norms_bf16(device, close):
    """bf16 also under the interpreter: these kernels have no tl.dot."""
    g = torch.Generator().manual_seed(2)
    x, gate = (torch.randn(3, 100, generator=g) * 3).bfloat16().to(device), torch.randn(3, 100, generator=g).bfloat16().to(device)
    w = (torch.randn(100, generator=g) * 0.5).bfloat16().to(device)
    close(rms.rms_norm(x, w), naive.rms_norm(x, w), torch.bfloat16, scale=4.0, what="rms_norm bf16")
    close(rms.gated_rms_norm(x, gate, w), naive.gated_rms_norm(x, gate, w), torch.bfloat16, scale=4.0,
          what="gated_rms_norm bf16")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_add_rms_norm(shape, dtype, device, close):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(device)
    d = torch.randn(shape, generator=g).to(dtype).to(device)
    w = (torch.randn(shape[-1], generator=g) * 0.5).to(dtype).to(device)
    total, out = rms.add_rms_norm(x, d, w, 1e-6)
    ref_total, ref_out = naive.add_rms_norm(x, d, w, 1e-6)
    assert total.dtype == out.dtype == dtype and total.shape == out.shape == x.shape
    close(total, ref_total, dtype, what="sum")
    close(out, ref_out, dtype, what="normed")


def test_gated_rms_norm_reads_head_slices_in_place(dtype, device, close):
    """The GDN passes z as per-head views of in_proj's product: [B, T, Hv, dv] with a row stride."""
    g = torch.Generator().manual_seed(4)
    proj = torch.randn(2, 3, 10 + 4 * 16, generator=g).to(dtype).to(device)
    z = proj[..., 10:].reshape(2, 3, 4, 16)
    x = torch.randn(2, 3, 4, 16, generator=g).to(dtype).to(device)
    w = (1 + torch.randn(16, generator=g) * 0.2).to(dtype).to(device)
    close(rms.gated_rms_norm(x, z, w), naive.gated_rms_norm(x, z, w), dtype, what="strided gate")
