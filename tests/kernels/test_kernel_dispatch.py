"""The dispatch, for every op of the table: CPU tensors take the reference unless the Triton backend
is forced (``dispatch.use_backend("triton")``); CUDA tensors take the kernel (where it is built for
their dtype) unless the torch backend is; a gradient always takes the reference. The setting is read
from CLOVER_KERNELS once, at import, and each decision is made once per (op, device type, dtype)."""
import importlib

import pytest
import torch

pytest.importorskip("triton")

from small_calls import small_calls  # noqa: E402  (rootdir-relative: tests/ has no __init__)

from clover_kernels import dispatch, ops  # noqa: E402
from clover_kernels.moe import torch as moe_torch  # noqa: E402
from clover_kernels.norm import naive as norm_naive  # noqa: E402

OPS = pytest.mark.parametrize("op", ops.TABLE, ids=lambda op: op.name)


@pytest.fixture
def kernel_runs(monkeypatch):
    """spy(op) -> a list that grows by one each time the op's Triton implementation runs."""
    def spy(op):
        runs = []
        kernel = dispatch.kernel_table()[op.name]
        monkeypatch.setitem(dispatch.kernel_table(), op.name, lambda *a, **k: runs.append(1) or kernel(*a, **k))
        return runs
    return spy


def _first_call(op, dtype, device):
    return next(iter(small_calls(op, dtype, device)))[1]


def test_every_op_has_a_kernel():
    triton_ops = importlib.import_module("clover_kernels.triton_ops")
    assert not triton_ops.MISSING, triton_ops.MISSING
    assert sorted(dispatch.kernel_table()) == sorted(op.name for op in ops.TABLE)


@OPS
def test_cpu_calls_take_the_reference_unless_the_kernel_is_forced(op, kernel_runs):
    runs = kernel_runs(op)
    args = _first_call(op, torch.float32, "cpu")
    op(*args)
    assert runs == [], "CPU tensors ran the kernel by default"
    with dispatch.use_backend("triton"):
        op(*_first_call(op, torch.float32, "cpu"))
    assert runs == [1], "the Triton backend forced did not run the kernel"
    with dispatch.use_backend("torch"):
        op(*_first_call(op, torch.float32, "cpu"))
    assert runs == [1], "the torch backend forced ran the kernel"
    op(*_first_call(op, torch.float32, "cpu"))
    assert runs == [1], "the setting was not restored after the with block"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@OPS
def test_cuda_calls_take_the_kernel_built_for_their_dtype(op, dtype, kernel_runs):
    runs = kernel_runs(op)
    op(*_first_call(op, dtype, "cuda"))
    assert runs == ([1] if dtype in op.gpu_dtypes else [])
    with dispatch.use_backend("torch"):
        op(*_first_call(op, dtype, "cuda"))
    assert len(runs) == (1 if dtype in op.gpu_dtypes else 0), "the torch backend forced ran the kernel"


def _needing_grad(args, which):
    """The arguments with one float tensor (the first: the input, or the last: a weight) made a leaf
    that requires a gradient."""
    floats = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dtype in ops.EVERY_DTYPE]
    i = floats[which]
    return tuple(a.detach().clone().requires_grad_() if j == i else a for j, a in enumerate(args))


def _outputs(out):
    return [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]


@OPS
def test_a_gradient_takes_the_torch_path(op, kernel_runs):
    """The kernels are forward-only: an op autograd must differentiate runs the torch path,
    whether the gradient flows through the input or only through another tensor (a weight)."""
    runs = kernel_runs(op)
    dispatch.set_backend("triton")  # the conftest's fixture restores the setting
    for which in (0, -1):
        args = _needing_grad(_first_call(op, torch.float32, "cpu"), which)
        assert any(t.requires_grad for t in _outputs(op(*args))), "no graph recorded: not the torch path"
    assert runs == []
    with torch.no_grad():
        op(*_needing_grad(_first_call(op, torch.float32, "cpu"), -1))
    assert runs == [1]


def test_forced_triton_norms_and_moe_match(device):
    dispatch.set_backend("triton")
    x, gate, w = (torch.randn(3, 32, device=device), torch.randn(3, 32, device=device),
                  torch.randn(32, device=device))
    torch.testing.assert_close(ops.rms_norm(x, w), norm_naive.rms_norm(x, w))
    torch.testing.assert_close(ops.gated_rms_norm(x, gate, w), norm_naive.gated_rms_norm(x, gate, w))
    ids = torch.tensor([[0, 2], [2, 3]], device=device)
    wts = torch.rand(2, 2, device=device)
    gu, dn = torch.randn(4, 32, 32, device=device) * 0.2, torch.randn(4, 32, 16, device=device) * 0.2
    xm = torch.randn(2, 32, device=device)
    torch.testing.assert_close(ops.moe_experts(xm, ids, wts, gu, dn),
                               moe_torch.moe_experts(xm, ids, wts, gu, dn), atol=2e-4, rtol=1e-4)


def test_the_kernel_table_is_loaded_once(device, monkeypatch):
    """Every op keeps dispatching after the `clover_kernels.triton_ops` submodule is imported, on every
    call, through the one table that submodule loaded."""
    triton_ops = importlib.import_module("clover_kernels.triton_ops")
    monkeypatch.setattr(dispatch, "_triton_ops", None)
    dispatch.set_backend("triton")
    x, w = torch.randn(2, 16, device=device), torch.randn(16, device=device)
    for _ in range(2):
        torch.testing.assert_close(ops.rms_norm(x, w), norm_naive.rms_norm(x, w))
    assert triton_ops.KERNELS is dispatch.kernel_table()


def test_bad_backend_names_are_refused():
    with pytest.raises(ValueError, match="CLOVER_KERNELS='cuda': expected one of torch, triton"):
        dispatch.backend_from_env({"CLOVER_KERNELS": "cuda"})
    assert dispatch.backend_from_env({"CLOVER_KERNELS": " Triton "}) == "triton"
    assert dispatch.backend_from_env({}) is None and dispatch.backend_from_env({"CLOVER_KERNELS": ""}) is None
    for bad in ("cuda", "TORCH"):
        with pytest.raises(ValueError, match=f"backend {bad!r}: expected one of torch, triton or None"):
            dispatch.set_backend(bad)
        with pytest.raises(ValueError, match="expected one of"):
            with dispatch.use_backend(bad):
                pass
    assert dispatch.forced_backend() is None, "a refused setting changed the setting"


def test_the_environment_variable_is_read_once_at_import(monkeypatch):
    """CLOVER_KERNELS sets the default when the module is imported; changing it afterwards changes
    nothing (the setting changes through set_backend / use_backend only)."""
    x, w = torch.randn(2, 16), torch.randn(16)
    monkeypatch.setenv("CLOVER_KERNELS", "triton")
    assert dispatch.backend_for("rms_norm", x, w) == "torch"
    monkeypatch.setattr(dispatch, "_default", dispatch.backend_from_env())  # what an import does
    monkeypatch.setattr(dispatch, "_decisions", {})
    assert dispatch.backend_for("rms_norm", x, w) == "triton"


def test_each_decision_is_made_once_per_op_device_and_dtype(monkeypatch):
    """Repeated calls at any size look the decision up (no second decision); a new dtype or a new
    setting decides again; a per-op setting forces that op only."""
    made = []
    decide = dispatch._decide
    monkeypatch.setattr(dispatch, "_decide", lambda *a: made.append(a[0]) or decide(*a))
    monkeypatch.setattr(dispatch, "_decisions", {})
    w = torch.randn(16)
    for rows in (1, 2, 7, 1, 33):
        ops.rms_norm(torch.randn(rows, 16), w)
    assert made == ["rms_norm"]
    ops.rms_norm(torch.randn(3, 16, dtype=torch.float16), w.half())
    assert made == ["rms_norm", "rms_norm"]
    assert dispatch.decisions() == {("rms_norm", "cpu", torch.float32): "torch",
                                    ("rms_norm", "cpu", torch.float16): "torch"}
    with dispatch.use_backend("triton", ops=["gated_rms_norm"]):
        assert dispatch.backend_for("gated_rms_norm", w) == "triton"
        assert dispatch.backend_for("rms_norm", w) == "torch"
        assert dispatch.forced_backend("gated_rms_norm") == "triton" and dispatch.forced_backend() is None
    assert dispatch.backend_for("gated_rms_norm", w) == "torch"
    assert dispatch.decisions() == {("gated_rms_norm", "cpu", torch.float32): "torch"}


def test_a_model_forward_decides_nothing_twice(tiny_model):
    """A second commit through the whole model makes no decision at all: every op's path was decided
    by the first (the dispatch used to read the environment at every op call)."""
    made = []
    decide = dispatch._decide
    cache = tiny_model.new_cache(32)
    tokens = torch.randint(0, 100, (1, 5))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch, "_decide", lambda *a: made.append(a[0]) or decide(*a))
        mp.setattr(dispatch, "_decisions", {})
        with torch.no_grad():
            tiny_model.commit(cache, tokens)
            first = len(made)
            tiny_model.commit(cache, tokens[:, :3])
    assert first > 0 and len(made) == first, f"{len(made) - first} decisions made again: {made[first:]}"


def test_training_through_forced_kernels_keeps_every_gradient(tiny_model):
    """A training forward and backward with the Triton path forced gives every parameter the
    gradient it gets on the torch path (the kernels would silently cut the graph)."""
    from clover_lab.train import TrainSettings, block_diffusion_loss

    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, tiny_model.config.vocab_size, (2, 2 * tiny_model.config.block_size), generator=g)

    def grads():
        tiny_model.zero_grad(set_to_none=True)
        block_diffusion_loss(tiny_model, clean, TrainSettings(), torch.Generator().manual_seed(1))[0].backward()
        return {n: p.grad for n, p in tiny_model.named_parameters()}

    with dispatch.use_backend("torch"):
        expected = grads()
    with dispatch.use_backend("triton"):
        got = grads()
    missing = [n for n, gr in got.items() if gr is None and expected[n] is not None]
    assert not missing, f"no gradient through the kernels for {missing}"
    for n in expected:
        if expected[n] is not None:
            torch.testing.assert_close(got[n], expected[n], atol=1e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")
