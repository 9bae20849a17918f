"""Block-scaled FP8 weights: quantization round trip, the torch path and the Triton kernels
(weights stored as float8_e4m3fn, upcast in the kernel) against fp8/naive.py.

In Triton's interpreter the activations are fp32/fp16 and the weight tiles are real fp8 storage
upcast in the kernel, so the scale indexing (partial edge blocks, gate's and up's blocks, the K
steps inside a block) is checked here. What only a GPU shows: bf16 activations through the tensor
cores, speed, and the compiled code (tests/kernels/test_compile_sm90.py compiles it for sm_90)."""
import pytest
import torch

pytest.importorskip("triton")

from test_kernel_moe import make_inputs  # noqa: E402  (rootdir-relative: tests/ has no __init__)

from clover_kernels.fp8 import gemm, moe, naive  # noqa: E402
from clover_kernels.fp8 import torch as fp8_torch  # noqa: E402


def test_quantize_round_trip_error_is_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 136, generator=g) * torch.logspace(-3, 1, 136)  # columns of very different size
    for block in [(128, 128), (32, 16), (7, 48)]:
        q, s = naive.quantize(w, block)
        assert q.dtype == naive.FP8 and s.shape == naive.scale_shape(w.shape, block)
        back = naive.dequantize(q, s, block)
        # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 of each block's scale * 448
        bound = naive.expand_scale(s, block, *w.shape) * 448 * 2 ** -4
        assert ((back - w).abs() <= bound + 1e-12).all()


def test_dequantize_rejects_scales_of_the_wrong_shape():
    q, s = naive.quantize(torch.randn(64, 64), (32, 32))
    with pytest.raises(ValueError, match=r"scales \(2, 1\) do not fit a weight \(64, 64\)"):
        naive.dequantize(q, s[:, :1], (32, 32))


LINEAR_CASES = [  # (M rows, N, K, block): decode, a block of 32, partial edge blocks, the real block
    (1, 96, 64, (32, 32)), (32, 80, 112, (16, 16)), (17, 50, 48, (32, 16)), (5, 256, 256, (128, 128)),
    (70, 64, 128, (64, 64)),
]


@pytest.mark.parametrize("M,N,K,block", LINEAR_CASES, ids=str)
def test_linear_kernel_matches_reference(M, N, K, block, dtype, device, close):
    g = torch.Generator().manual_seed(M + N)
    q, s = naive.quantize(torch.randn(N, K, generator=g) * K ** -0.5, block)
    x = torch.randn(M, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    q, s, x, bias = q.to(device), s.to(device), x.to(device), bias.to(device)
    ref = naive.linear(x, q, s, block, bias)
    for out in (gemm.linear(x, q, s, block, bias), fp8_torch.linear(x, q, s, block, bias)):
        assert out.shape == ref.shape and out.dtype == dtype
        close(out, ref, dtype, scale=max(1.0, ref.abs().max().item()), what="fp8 linear")


def test_linear_kernel_keeps_leading_dims_and_no_bias(device, close):
    q, s = naive.quantize(torch.randn(48, 32), (16, 16))
    x = torch.randn(2, 3, 32)
    q, s, x = q.to(device), s.to(device), x.to(device)
    out = gemm.linear(x, q, s, (16, 16))
    assert out.shape == (2, 3, 48)
    close(out, naive.linear(x, q, s, (16, 16)), torch.float32, what="fp8 linear")


def test_linear_kernel_rejects_bad_scales(device):
    q, s = naive.quantize(torch.randn(48, 32), (16, 16))
    with pytest.raises(ValueError, match="do not fit a weight"):
        gemm.linear(torch.randn(2, 32, device=device), q.to(device), s[:1].to(device), (16, 16))


def quantized_experts(E, H, I, block, dtype, device, k, T, unused=(), seed=0):
    x, ids, w, gate_up, down = make_inputs(T, k, torch.float32, "cpu", unused, seed=seed, E=E, H=H, I=I)
    # gate and up quantized apart, as per-expert checkpoints store them
    gq, gs = naive.quantize(gate_up[:, :I], block)
    uq, us = naive.quantize(gate_up[:, I:], block)
    dq, ds = naive.quantize(down, block)
    tensors = (x.to(dtype), ids, w, torch.cat([gq, uq], 1), dq, torch.cat([gs, us], 1), ds)
    return tuple(t.to(device) for t in tensors)


MOE_CASES = [  # (T, k, E, H, I, block, unused experts)
    (1, 2, 8, 64, 32, (16, 16), ()), (32, 4, 8, 64, 48, (32, 16), (0, 5)), (17, 3, 6, 80, 40, (16, 32), ()),
    (5, 2, 4, 128, 128, (128, 128), (3,)),
]


@pytest.mark.parametrize("T,k,E,H,I,block,unused", MOE_CASES, ids=str)
def test_moe_kernel_matches_reference(T, k, E, H, I, block, unused, dtype, device, close):
    x, ids, w, gu, dn, gs, ds = quantized_experts(E, H, I, block, dtype, device, k, T, unused)
    ref = naive.moe_experts(x, ids, w, gu, dn, gs, ds, block)
    torch_path = fp8_torch.moe_experts(x, ids, w, gu, dn, gs, ds, block)
    if unused:  # experts no token picks are never read, scales included: poison them
        gs[list(unused)] = float("nan")
        ds[list(unused)] = float("nan")
    out = moe.moe_experts(x, ids, w, gu, dn, gs, ds, block)
    for got in (out, torch_path):
        assert got.shape == ref.shape and got.dtype == dtype
        close(got, ref, dtype, scale=max(1.0, ref.abs().max().item()), what="fp8 moe")


# quantization blocks whose width is not a power of two: K steps of its largest power-of-two divisor
ODD_WIDTHS = [(32, 96), (64, 192), (16, 48)]


@pytest.mark.parametrize("block", ODD_WIDTHS, ids=str)
def test_block_widths_that_are_not_powers_of_two(block, dtype, device, close):
    """A block width of 96 (or 192, 48) used to reach tl.arange with a K step of 96: it did not
    compile. The K step is now 32 (64, 16): the linear and the experts equal the reference."""
    bn, bk = block
    assert gemm.k_step(bk, 128) == bk & -bk and bk % gemm.k_step(bk, 64) == 0
    g = torch.Generator().manual_seed(bk)
    N, K = 80, 2 * bk + 16  # a partial last block of columns
    q, s = naive.quantize(torch.randn(N, K, generator=g) * K ** -0.5, block)
    x = torch.randn(9, K, generator=g).to(dtype)
    q, s, x = q.to(device), s.to(device), x.to(device)
    ref = naive.linear(x, q, s, block)
    close(gemm.linear(x, q, s, block), ref, dtype, scale=max(1.0, ref.abs().max().item()), what="fp8 linear")
    x, ids, w, gu, dn, gs, ds = quantized_experts(6, K, bk + 32, block, dtype, device, 2, 7)
    ref = naive.moe_experts(x, ids, w, gu, dn, gs, ds, block)
    close(moe.moe_experts(x, ids, w, gu, dn, gs, ds, block), ref, dtype, scale=max(1.0, ref.abs().max().item()),
          what="fp8 moe")


def test_moe_reference_equals_the_bf16_reference_on_dequantized_weights():
    from clover_kernels.moe import naive as moe_naive

    block = (16, 16)
    x, ids, w, gu, dn, gs, ds = quantized_experts(6, 48, 24, block, torch.float32, "cpu", 2, 7)
    I, ni = 24, 2
    gate_up = torch.cat([naive.dequantize(gu[:, :I], gs[:, :ni], block), naive.dequantize(gu[:, I:], gs[:, ni:], block)], 1)
    expected = moe_naive.moe_experts(x, ids, w, gate_up, naive.dequantize(dn, ds, block))
    torch.testing.assert_close(naive.moe_experts(x, ids, w, gu, dn, gs, ds, block), expected)


def test_moe_kernel_rejects_bad_scales(device):
    x, ids, w, gu, dn, gs, ds = quantized_experts(4, 32, 16, (16, 16), torch.float32, device, 2, 3)
    with pytest.raises(ValueError, match="do not fit gate_up"):
        moe.moe_experts(x, ids, w, gu, dn, gs[:, :1], ds, (16, 16))


def test_an_fp8_model_through_the_kernels_matches_the_dequantized_model(tmp_path, monkeypatch):
    """A model loaded with keep_fp8 from an FP8 checkpoint, its FP8 linears and experts through
    the Triton kernels, gives the logits of the same checkpoint loaded dequantized, in commit and
    preview rows. On a CPU the other ops stay on their torch path (a short interpreter run); with
    CUDA both models run on the GPU in bf16 with the dispatch's own choices (Triton everywhere:
    fp32 activations would send the FP8 ops to torch there) and nothing is forced onto CPU tensors."""
    from clover_kernels import dispatch
    from clover_lab import CloverConfig, CloverModel
    from clover_lab.checkpoint.quantize import quantize_checkpoint

    on_cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if on_cuda else ("cpu", torch.float32)
    config = CloverConfig.preset("clover-tiny", num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    CloverModel.random(config, seed=3).save_pretrained(tmp_path / "src")
    quantize_checkpoint(tmp_path / "src", tmp_path / "fp8", block=(32, 32))
    deq = CloverModel.from_pretrained(tmp_path / "fp8", device=device, dtype=dtype)
    kept = CloverModel.from_pretrained(tmp_path / "fp8", keep_fp8=True, device=device, dtype=dtype)
    calls = []
    chosen = dispatch.backend_for
    monkeypatch.setattr(dispatch, "backend_for",
                        lambda name, *t, **k: calls.append((name, chosen(name, *t, **k))) or calls[-1][1])
    if not on_cuda:  # the FP8 kernels in the interpreter, every other op on its torch path
        dispatch.set_backend("triton", ops=("linear_fp8", "moe_experts_fp8"))  # the conftest restores it
    ids = torch.randint(0, 500, (1, 24), generator=torch.Generator().manual_seed(0)).to(device)
    outs = []
    for model in (deq, kept):  # one fused forward: 16 rows committed, 8 previewed
        out = model.forward(model.new_cache(64), ids[:, :16], ids[:, 16:], commit_logits="all")
        outs.append((out.commit_logits, out.preview_logits))
    # the dispatch sent the FP8 ops to their kernels (on a CUDA device by itself)
    assert {"linear_fp8", "moe_experts_fp8"} <= {name for name, backend in calls if backend == "triton"}
    for got, ref in zip(outs[1], outs[0]):
        assert got.device.type == device
        if on_cuda:  # bf16 activations: the kernels' K-step order against the dequantized GEMMs
            scale = ref.float().abs().max().item()
            torch.testing.assert_close(got.float(), ref.float(), atol=3e-2 * scale, rtol=3e-2)
        else:
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
