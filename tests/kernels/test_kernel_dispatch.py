"""The dispatch: CPU tensors take the references unless CLOVER_KERNELS=triton forces the kernels;
CUDA tensors take the kernels unless CLOVER_KERNELS=torch."""
import importlib

import pytest
import torch

pytest.importorskip("triton")

from clover_kernels import dispatch, ops  # noqa: E402
from clover_kernels.gdn import naive as gdn_naive  # noqa: E402
from clover_kernels.norm import naive as norm_naive
from clover_kernels.moe import torch as moe_torch

NAMES = ["rms_norm", "gated_rms_norm", "gdn_commit", "gdn_preview", "moe_experts", "linear_fp8", "moe_experts_fp8",
         "route", "cache_attention", "add_rms_norm", "qk_norm_rope", "gdn_gates", "sigmoid_gate", "silu_mul",
         "moe_combine"]


def test_every_op_has_a_kernel():
    triton_ops = importlib.import_module("clover_kernels.triton_ops")
    assert not triton_ops.MISSING, triton_ops.MISSING
    assert sorted(dispatch.kernel_table()) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_cpu_defaults_to_reference(name, monkeypatch):
    x = torch.zeros(2, 4)
    assert dispatch.backend_for(name, x) == "torch"
    monkeypatch.setenv("CLOVER_KERNELS", "triton")
    assert dispatch.backend_for(name, x) == "triton"
    monkeypatch.setenv("CLOVER_KERNELS", "torch")
    assert dispatch.backend_for(name, x) == "torch"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", NAMES)
def test_cuda_defaults_to_kernel(name, monkeypatch):
    x = torch.zeros(2, 4, device="cuda")
    assert dispatch.backend_for(name, x) == "triton"
    monkeypatch.setenv("CLOVER_KERNELS", "torch")
    assert dispatch.backend_for(name, x) == "torch"


def _gdn_args(device):
    g = torch.Generator().manual_seed(0)
    B, T, Hk, Hv, dk, dv, K = 1, 5, 1, 2, 16, 16, 4
    C = 2 * Hk * dk + Hv * dv
    args = (torch.randn(B, T, C, generator=g), torch.randn(B, C, K - 1, generator=g),
            torch.randn(C, K, generator=g) * 0.5, -torch.rand(B, T, Hv, generator=g),
            torch.rand(B, T, Hv, generator=g), torch.randn(B, Hv, dk, dv, generator=g))
    return tuple(a.to(device) for a in args), (Hk, dk, dv)


def test_public_op_calls_the_kernel_when_selected(device, monkeypatch):
    """The public op calls the Triton implementation (spied on) exactly when it is selected."""
    calls = []
    kernel = dispatch.kernel_table()["gdn_commit"]

    def spy(*args):
        calls.append(1)
        return kernel(*args)

    monkeypatch.setitem(dispatch.kernel_table(), "gdn_commit", spy)
    args, heads = _gdn_args(device)
    ref = gdn_naive.gdn_commit(*args, *heads)
    monkeypatch.setenv("CLOVER_KERNELS", "torch")
    ops.gdn_commit(*args, *heads)
    assert calls == []
    monkeypatch.delenv("CLOVER_KERNELS")
    ops.gdn_commit(*args, *heads)
    assert calls == ([1] if device == "cuda" else [])  # the default: kernels for CUDA tensors only
    monkeypatch.setenv("CLOVER_KERNELS", "triton")
    out = ops.gdn_commit(*args, *heads)
    assert len(calls) == (2 if device == "cuda" else 1)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


def test_forced_triton_norms_and_moe_match(device, monkeypatch):
    monkeypatch.setenv("CLOVER_KERNELS", "triton")
    x, gate, w = (torch.randn(3, 32, device=device), torch.randn(3, 32, device=device),
                  torch.randn(32, device=device))
    torch.testing.assert_close(ops.rms_norm(x, w), norm_naive.rms_norm(x, w))
    torch.testing.assert_close(ops.gated_rms_norm(x, gate, w),
                               norm_naive.gated_rms_norm(x, gate, w))
    ids = torch.tensor([[0, 2], [2, 3]], device=device)
    wts = torch.rand(2, 2, device=device)
    gu, dn = torch.randn(4, 32, 32, device=device) * 0.2, torch.randn(4, 32, 16, device=device) * 0.2
    xm = torch.randn(2, 32, device=device)
    torch.testing.assert_close(ops.moe_experts(xm, ids, wts, gu, dn),
                               moe_torch.moe_experts(xm, ids, wts, gu, dn), atol=2e-4, rtol=1e-4)


def test_submodule_does_not_shadow_the_dispatch(device, monkeypatch):
    """Every op keeps dispatching after the `clover_kernels.triton_ops` submodule is imported, on every call."""
    importlib.import_module("clover_kernels.triton_ops")
    monkeypatch.setattr(dispatch, "_triton_ops", None)
    monkeypatch.setenv("CLOVER_KERNELS", "triton")
    x, w = torch.randn(2, 16, device=device), torch.randn(16, device=device)
    for _ in range(2):
        torch.testing.assert_close(ops.rms_norm(x, w), norm_naive.rms_norm(x, w))
    assert importlib.import_module("clover_kernels.triton_ops").KERNELS is dispatch.kernel_table()


def test_bad_backend_name(monkeypatch):
    monkeypatch.setenv("CLOVER_KERNELS", "cuda")
    with pytest.raises(ValueError, match="CLOVER_KERNELS"):
        dispatch.backend_for("rms_norm", torch.zeros(1))


@pytest.mark.parametrize("name", NAMES)
def test_a_gradient_takes_the_torch_path(name, monkeypatch):
    """The kernels are forward-only: an op autograd must differentiate runs the torch path,
    whether the gradient flows through the input or only through another tensor (a weight)."""
    monkeypatch.setenv("CLOVER_KERNELS", "triton")
    x, w = torch.zeros(2, 4), torch.zeros(4, requires_grad=True)
    assert dispatch.backend_for(name, x, w) == "torch"
    assert dispatch.backend_for(name, x.requires_grad_()) == "torch"
    with torch.no_grad():
        assert dispatch.backend_for(name, x, w) == "triton"


def test_training_through_forced_kernels_keeps_every_gradient(tiny_model, monkeypatch):
    """A training forward and backward with the Triton path forced gives every parameter the
    gradient it gets on the torch path (the kernels would silently cut the graph)."""
    from clover_lab.train import TrainSettings, block_diffusion_loss

    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, tiny_model.config.vocab_size, (2, 2 * tiny_model.config.block_size), generator=g)

    def grads():
        tiny_model.zero_grad(set_to_none=True)
        block_diffusion_loss(tiny_model, clean, TrainSettings(), torch.Generator().manual_seed(1))[0].backward()
        return {n: p.grad for n, p in tiny_model.named_parameters()}

    monkeypatch.setenv("CLOVER_KERNELS", "torch")
    expected = grads()
    monkeypatch.setenv("CLOVER_KERNELS", "triton")
    got = grads()
    missing = [n for n, gr in got.items() if gr is None and expected[n] is not None]
    assert not missing, f"no gradient through the kernels for {missing}"
    for n in expected:
        if expected[n] is not None:
            torch.testing.assert_close(got[n], expected[n], atol=1e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")
