"""The op table (clover_kernels/ops.py): each op its torch reference, its Triton implementation and
its calls, described once. Every call of every op, at small sizes, through the dispatch with the
kernels forced, equals the reference; a kernel that fails to import warns the first time it is needed."""
import importlib
import importlib.util
import inspect
import sys
import warnings

import pytest
import torch

pytest.importorskip("triton")

from small_calls import small_calls  # noqa: E402  (rootdir-relative: tests/ has no __init__)

from clover_kernels import dispatch, ops  # noqa: E402
from clover_kernels.norm import naive as norm_naive  # noqa: E402
from clover_kernels.shapes import CLOVER_35B  # noqa: E402

OPS = pytest.mark.parametrize("op", ops.TABLE, ids=lambda op: op.name)


def test_every_op_is_a_name_of_ops_and_its_kernel_takes_the_reference_arguments():
    assert ops.TABLE and len({op.name for op in ops.TABLE}) == len(ops.TABLE)
    for op in ops.TABLE:
        assert getattr(ops, op.name) is op, f"ops.{op.name} is not the op named {op.name!r}"
        kernel = dispatch.kernel_table()[op.name]
        ref = [p for p in inspect.signature(op.reference).parameters if p not in op.torch_only]
        got = list(inspect.signature(kernel).parameters)
        assert got[:len(ref)] == ref, f"{op.name}: kernel {got} vs reference {ref}"
        assert inspect.signature(op) == inspect.signature(op.reference)


def test_a_torch_only_name_the_reference_does_not_take_is_named():
    with pytest.raises(ValueError, match=r"'rms_norm2'.*\['packed'\].*rms_norm\(x"):
        ops.Op("rms_norm2", norm_naive.rms_norm, "norm.rms:rms_norm", ops.rms_norm.calls, torch_only=("packed",))


def test_the_35b_sizes_are_the_preset():
    from clover_lab.config import CloverConfig

    c = CloverConfig.preset("clover-35b-a3b")
    want = dict(hidden=c.hidden_size, gdn_key_heads=c.linear_num_key_heads, gdn_value_heads=c.linear_num_value_heads,
                gdn_head_k=c.linear_key_head_dim, gdn_head_v=c.linear_value_head_dim, conv=c.linear_conv_kernel_dim,
                attn_heads=c.num_attention_heads, attn_kv_heads=c.num_key_value_heads, attn_head_dim=c.head_dim,
                experts=c.num_experts, top_k=c.num_experts_per_tok, expert_width=c.moe_intermediate_size,
                shared_width=c.shared_expert_intermediate_size, block=c.block_size, rotary_dim=c.rotary_dim)
    assert {k: getattr(CLOVER_35B, k) for k in want} == want


def _leaves(x):
    if isinstance(x, (tuple, list)):
        for y in x:
            yield from _leaves(y)
    else:
        yield x


# the varlen ops' calls (several rows' segments each) take about 15 s in the interpreter: slow tier
# (tests/kernels/test_kernel_varlen.py holds them on ragged lengths there too; their dispatch is fast)
SLOW_IN_THE_INTERPRETER = {"gdn_commit_varlen", "gdn_preview_varlen", "cache_attention_varlen"}


@pytest.mark.parametrize("op", [pytest.param(op, marks=pytest.mark.slow) if op.name in SLOW_IN_THE_INTERPRETER
                                else op for op in ops.TABLE], ids=lambda op: op.name)
def test_the_kernel_equals_the_reference(op, dtype, device, close, monkeypatch):
    """Each call the table describes (the 35B calls' views and options at small sizes), through the
    op with the Triton backend forced, against the reference on equal inputs: the outputs, and every
    tensor the call writes into (a coreset record, the static cache), in dtype, shape and value."""
    dispatch.set_backend("triton")  # the conftest's fixture restores the setting
    ran = []
    kernel = dispatch.kernel_table()[op.name]
    monkeypatch.setitem(dispatch.kernel_table(), op.name, lambda *a, **k: ran.append(1) or kernel(*a, **k))
    on_kernel = device == "cpu" or dtype in op.gpu_dtypes  # a GPU runs the reference where the kernel is not built
    calls = 0
    for (rows, args), (_, ref_args) in zip(small_calls(op, dtype, device), small_calls(op, dtype, device)):
        calls += 1
        got, want = (op(*args), args), (op.reference(*ref_args), ref_args)
        what = f"{op.name} at {rows} rows, call {calls}"
        assert len(ran) == (calls if on_kernel else 0), f"{what}: the dispatch did not run the kernel"
        for i, (g, w) in enumerate(zip(_leaves(got), _leaves(want), strict=True)):
            if not isinstance(w, torch.Tensor):
                assert g == w, f"{what}, leaf {i}: {g!r} != {w!r}"
                continue
            assert (g.shape, g.dtype) == (w.shape, w.dtype), f"{what}, leaf {i}"
            if w.is_floating_point():
                scale = max(1.0, w.float().abs().max().item()) if w.numel() else 1.0
                close(g, w, dtype, scale=scale, what=f"{what}, leaf {i}")
            else:  # expert ids, coresets: exactly
                assert torch.equal(g.cpu(), w.cpu()), f"{what}, leaf {i}: {g} != {w}"
    assert calls, f"{op.name}: its calls describe none at the small sizes"


@pytest.fixture
def rms_kernel_broken(monkeypatch):
    """clover_kernels.norm.rms cannot be imported (as when triton is broken); the table reloaded."""
    triton_ops = importlib.import_module("clover_kernels.triton_ops")
    monkeypatch.setitem(sys.modules, "clover_kernels.norm.rms", None)  # importing it raises ImportError
    monkeypatch.setattr(triton_ops, "KERNELS", {})
    monkeypatch.setattr(triton_ops, "MISSING", {})
    triton_ops._load()
    monkeypatch.setattr(dispatch, "_triton_ops", None)
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setattr(dispatch, "_decisions", {})
    return triton_ops


def test_a_kernel_that_fails_to_import_warns_once_when_needed_on_cuda(rms_kernel_broken, monkeypatch):
    assert {"rms_norm", "gated_rms_norm"} <= set(rms_kernel_broken.MISSING)
    assert "gdn_commit" in dispatch.kernel_table() and "rms_norm" not in dispatch.kernel_table()
    x, w = torch.randn(3, 16), torch.randn(16)
    ref = norm_naive.rms_norm(x, w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(ops.rms_norm(x, w), ref)  # CPU: the kernel is not needed
    monkeypatch.setattr(dispatch, "_on_gpu", lambda t: True)  # as if x were a CUDA tensor
    monkeypatch.setattr(dispatch, "_decisions", {})  # (the CPU's decision was kept)
    with pytest.warns(RuntimeWarning, match=r"'rms_norm'.*clover_kernels\.norm\.rms.*torch path"):
        torch.testing.assert_close(ops.rms_norm(x, w), ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(ops.rms_norm(x, w), ref)  # once per op
    with pytest.warns(RuntimeWarning, match="'gated_rms_norm'"):
        ops.gated_rms_norm(x, x, w)


def test_a_missing_kernel_warns_when_the_triton_backend_is_forced(rms_kernel_broken):
    dispatch.set_backend("triton")
    x, w = torch.randn(3, 16), torch.randn(16)
    with pytest.warns(RuntimeWarning, match="'rms_norm'"):
        assert dispatch.backend_for("rms_norm", x, w) == "torch"
    assert dispatch.backend_for("gdn_commit", x) == "triton"  # the others keep their kernels


def test_torch_only_arguments_never_reach_the_kernel(monkeypatch):
    """moe_experts's packed (the CPU path's oneDNN weights) goes to the reference only."""
    seen = []
    monkeypatch.setitem(dispatch.kernel_table(), "moe_experts", lambda *a, **k: seen.append((len(a), k)) or a[0])
    dispatch.set_backend("triton")
    x = torch.randn(2, 8)
    ids, wts = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    gu, dn = torch.randn(1, 8, 8), torch.randn(1, 8, 4)
    ops.moe_experts(x, ids, wts, gu, dn, "packed")
    ops.moe_experts(x, ids, wts, gu, dn, packed="packed")
    assert seen == [(5, {}), (5, {})]


def test_the_sm90_compile_gate_is_not_part_of_the_installed_package():
    assert importlib.util.find_spec("clover_kernels.compile_check") is None
