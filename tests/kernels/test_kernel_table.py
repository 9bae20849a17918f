"""The op table (clover_kernels/ops.py): one row per op, its torch reference beside its Triton
implementation; a kernel that fails to import warns the first time it is needed."""
import importlib
import importlib.util
import inspect
import sys
import warnings

import pytest
import torch

pytest.importorskip("triton")

from clover_kernels import dispatch, ops  # noqa: E402
from clover_kernels.norm import naive as norm_naive


def test_every_op_is_public_and_its_kernel_takes_the_reference_arguments():
    for op in ops.TABLE:
        assert getattr(ops, op.name) is op, f"ops.{op.name} is not the op named {op.name!r}"
        kernel = dispatch.kernel_table()[op.name]
        ref = [p for p in inspect.signature(op.reference).parameters if p not in op.torch_only]
        got = list(inspect.signature(kernel).parameters)
        assert got[:len(ref)] == ref, f"{op.name}: kernel {got} vs reference {ref}"
        assert inspect.signature(op) == inspect.signature(op.reference)


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
    with pytest.warns(RuntimeWarning, match=r"'rms_norm'.*clover_kernels\.norm\.rms.*torch path"):
        torch.testing.assert_close(ops.rms_norm(x, w), ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(ops.rms_norm(x, w), ref)  # once per op
    with pytest.warns(RuntimeWarning, match="'gated_rms_norm'"):
        ops.gated_rms_norm(x, x, w)


def test_a_missing_kernel_warns_when_the_triton_backend_is_forced(rms_kernel_broken, monkeypatch):
    monkeypatch.setenv("CLOVER_KERNELS", "triton")
    x, w = torch.randn(3, 16), torch.randn(16)
    with pytest.warns(RuntimeWarning, match="'rms_norm'"):
        assert dispatch.backend_for("rms_norm", x, w) == "torch"
    assert dispatch.backend_for("gdn_commit", x) == "triton"  # the others keep their kernels


def test_torch_only_arguments_never_reach_the_kernel(monkeypatch):
    """moe_experts's packed (the CPU path's oneDNN weights) goes to the reference only."""
    seen = []
    monkeypatch.setitem(dispatch.kernel_table(), "moe_experts", lambda *a, **k: seen.append((len(a), k)) or a[0])
    monkeypatch.setenv("CLOVER_KERNELS", "triton")
    x = torch.randn(2, 8)
    ids, wts = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    gu, dn = torch.randn(1, 8, 8), torch.randn(1, 8, 4)
    ops.moe_experts(x, ids, wts, gu, dn, "packed")
    ops.moe_experts(x, ids, wts, gu, dn, packed="packed")
    assert seen == [(5, {}), (5, {})]


def test_the_sm90_compile_gate_is_not_part_of_the_installed_package():
    assert importlib.util.find_spec("clover_kernels.compile_check") is None
