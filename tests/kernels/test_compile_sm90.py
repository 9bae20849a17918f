"""Every Triton kernel compiled for the H200 (sm_90) at the Clover-35B-A3B shapes, on a CPU.

Triton's interpreter (what the other kernel tests run on a CPU) hides compile errors, register
spills, shared-memory overflows and the bf16 code paths. ``bench/compile_check.py`` compiles
every call the op table (clover_kernels/ops.py) describes at the 35B sizes with Triton's own
compiler and ptxas for sm_90, in every dtype the op's kernel is built for. Per op here (``-k route``
compiles only route's cases); the coverage (every kernel and helper launched by some call, every
op launching) from one capture without compiling. Everything runs in a subprocess: this process
has TRITON_INTERPRET=1 (tests/kernels/conftest.py), under which triton.jit makes no compilable
kernels; so every test here is slow. Skips only where Triton has no CUDA backend.
"""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

from clover_kernels import ops  # noqa: E402

pytestmark = pytest.mark.slow  # every test starts a process that compiles or captures

# a development tool beside the benchmarks, not part of the installed package
SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "compile_check.py"
_spec = importlib.util.spec_from_file_location("compile_check", SCRIPT)
compile_check = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("compile_check", compile_check)  # its dataclasses look their module up there
_spec.loader.exec_module(compile_check)


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch):
    """Replaces the kernel conftest's fixture of this name: these tests need no interpreter (their
    subprocesses start without CLOVER_KERNELS: ``_env``)."""


def _env():
    env = dict(os.environ)
    for key in ("TRITON_INTERPRET", "CLOVER_KERNELS", "TRITON_CACHE_DIR"):
        env.pop(key, None)
    return env


def _run(args, timeout):
    proc = subprocess.run([sys.executable, *args], env=_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    return proc


def _report(path, *args, timeout):
    proc = _run([str(SCRIPT), "--json", str(path), "--quiet", *args], timeout=timeout)
    assert proc.returncode in (0, 1) and path.exists(), f"compile_check crashed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def discovery():
    """In this process: what the package holds, helpers and kernels."""
    return compile_check.discover()


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """Every call of the table captured at the 35B sizes, nothing compiled: the launch configs."""
    return _report(tmp_path_factory.mktemp("sm90") / "captured.json", "--no-compile", timeout=600)


def _label(row):
    return compile_check.case_label(row)


def _want_dtypes(kernel: str, op) -> set:
    if kernel in compile_check.ONE_BINARY_FOR_EVERY_DTYPE:
        return {"bf16"}
    return set(compile_check.op_dtypes(op))


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory):
    """The ops this session's tests select (``-k route``: route's), compiled in one process: it
    starts and captures the table once, and a kernel several ops launch compiles once (one process
    per op took about 3 min longer on 2 cores)."""
    names = sorted({item.callspec.params["op"].name for item in request.session.items
                    if getattr(item, "originalname", None) == "test_op_compiles_for_sm90_without_spills"
                    and not item.get_closest_marker("skip")})
    jobs = str(max(1, min(8, os.cpu_count() or 1)))
    return _report(tmp_path_factory.mktemp("sm90") / "compile.json", "--ops", ",".join(names), "--jobs", jobs,
                   timeout=3000)


# The varlen ops are VARLEN specialisations of the dense kernels compiled here (the same source, the
# branch compiled out); their own binaries (about 45 s more on 2 cores, which CI's 30 minutes do not
# hold) are compiled by hand: ``python bench/compile_check.py --ops gdn_commit_varlen,gdn_preview_varlen,
# cache_attention_varlen`` (figures in docs/kernels.md). The coverage test below still captures their calls.
COMPILED_BY_HAND = "a varlen op: compiled by hand with bench/compile_check.py (CI time), figures in docs/kernels.md"


@pytest.mark.parametrize("op", [pytest.param(op, marks=pytest.mark.skip(reason=COMPILED_BY_HAND))
                                if op.name.endswith("_varlen") else op for op in ops.TABLE],
                         ids=lambda op: op.name)
def test_op_compiles_for_sm90_without_spills(op, compiled):
    """Each kernel the op's calls launch compiles in every dtype the op's kernel is built for, with
    no compile error, no spill and shared memory within the per-block limit."""
    report = compiled
    cases = [row for row in report["cases"] if op.name in row["ops"]]
    assert cases, f"{op.name}: its calls launch no kernel at the 35B shapes"
    for kernel in sorted({row["kernel"] for row in cases}):
        got = {row["dtype"] for row in cases if row["kernel"] == kernel}
        assert got == _want_dtypes(kernel, op), f"{op.name}: {kernel} compiled only in {sorted(got)}"
    bad = [f"{_label(row)}: {'; '.join(row['failures'])}" for row in cases if row["failures"]]
    assert not bad, f"{op.name} on sm_90 ({report['triton']}):\n" + "\n".join(bad)
    assert op.name not in report["ops_missing"]


def test_every_kernel_and_helper_is_launched_by_a_call_of_the_table(captured, discovery):
    assert sorted(captured["discovered"]) == sorted(discovery.functions), "the subprocess saw other kernels"
    assert captured["kernels"] == discovery.kernels and captured["helpers"] == discovery.helpers
    assert captured["ops_missing"] == [], "ops of the table whose calls launch nothing"
    assert captured["uncovered_kernels"] == [], "kernels no call of the op table launches: describe the call in ops.py"
    assert captured["uncovered_helpers"] == [], "helpers no launched kernel calls"


@pytest.mark.parametrize("name", ["_gate_up_kernel", "_down_kernel", "_gate_up_fp8_kernel", "_down_fp8_kernel",
                                  "_align_kernel"])
def test_every_moe_tile_choice_is_launched(name, captured):
    """Tiles by workload: each row-block height moe.fused.block_m can choose (16 for decode and
    blocks up to 128 for prefill) is among the compiled cases, in every dtype of the kernel, for
    its token count."""
    from clover_kernels.moe.fused import BLOCK_MS
    from clover_kernels.shapes import CLOVER_35B

    cases = [row for row in captured["cases"] if row["kernel"] == name]
    for dtype in set().union(*(_want_dtypes(name, getattr(ops, op)) for row in cases for op in row["ops"])):
        heights = {row["config"]["BM"] for row in cases if row["dtype"] == dtype}
        assert heights == set(BLOCK_MS), f"{name} {dtype}: compiled at BM {sorted(heights)}"
    for bm, T in ops.moe_tile_rows(CLOVER_35B).items():
        assert any(row["config"]["BM"] == bm and T in row["rows"] for row in cases), (name, bm, T)


def test_fp8_block_widths_that_are_not_powers_of_two_are_launched(captured):
    """K steps of the largest power of two dividing the block width: 96 -> 32, 192 -> 64."""
    from clover_kernels.shapes import CLOVER_35B

    for name in ("_fp8_linear_kernel", "_gate_up_fp8_kernel", "_down_fp8_kernel"):
        for _, bk in CLOVER_35B.fp8_odd_blocks:
            cases = [row for row in captured["cases"] if row["kernel"] == name and row["config"]["QK"] == bk]
            assert cases and all(bk % row["config"]["BK"] == 0 for row in cases), (name, bk)
            assert all(row["config"]["BK"] & (row["config"]["BK"] - 1) == 0 for row in cases)


# ----------------------------------------------------------------- the check itself can fail
SYNTHETIC = '''
import torch
import triton
import triton.language as tl


@triton.jit
def _orphan_kernel(x_ptr, n, BLOCK: tl.constexpr):  # launched by no op of the dispatch
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)


@triton.jit
def _spilling_kernel(a_ptr, b_ptr, c_ptr):  # an fp32 ieee dot of 64 x 64 x 64 on one warp
    r = tl.arange(0, 64)
    a = tl.load(a_ptr + r[:, None] * 64 + r[None, :])
    b = tl.load(b_ptr + r[:, None] * 64 + r[None, :])
    tl.store(c_ptr + r[:, None] * 64 + r[None, :], tl.dot(a, b, input_precision="ieee"))


@triton.jit
def _big_smem_kernel(a_ptr, b_ptr, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    m = tl.arange(0, BM)
    n = tl.arange(0, BN)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + m[:, None] * K + k[None, :])
        b = tl.load(b_ptr + k[:, None] * BN + n[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + m[:, None] * BN + n[None, :], acc)


@triton.autotune(configs=[triton.Config({"BLOCK": 64}, num_warps=1), triton.Config({"BLOCK": 128}, num_warps=2),
                          triton.Config({"BLOCK": 256}, num_warps=4)], key=["n"])
@triton.jit
def _tuned_kernel(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


def launch_tuned(x):
    _tuned_kernel[lambda meta: (triton.cdiv(x.numel(), meta["BLOCK"]),)](x, x.numel())
'''

PROBE = '''
import json, sys
sys.path.insert(0, sys.argv[2])  # bench/, where the tool lives
import compile_check as cc

path = sys.argv[1]
d = cc.discover(extra_modules=[path])
mod = sys.modules[d.modules["_tuned_kernel"]]
import torch
with cc.capturing(d) as (launches, label):
    mod.launch_tuned(torch.empty(1000, device="meta"))
tuned = sorted(l.constexprs[(2,)] for l in launches if l.kernel == "_tuned_kernel")
module = d.modules["_spilling_kernel"]
spill = cc.compile_case(module, "_spilling_kernel", {"a_ptr": "*fp32", "b_ptr": "*fp32", "c_ptr": "*fp32"}, [], [],
                        {"num_warps": 1})
div16 = [["tt.divisibility", 16]]  # aligned pointers and K, as a launch would specialise them: pipelined loads
smem = cc.compile_case(module, "_big_smem_kernel",
                       {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "K": "i32", "BM": "constexpr",
                        "BN": "constexpr", "BK": "constexpr"},
                       [[[4], 128], [[5], 128], [[6], 64]], [[[i], div16] for i in range(4)],
                       {"num_warps": 4, "num_stages": 8})  # 8 stages x 32 KB of a and b tiles
broken = cc.compile_case(module, "_orphan_kernel", {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                         [[[2], 100]], [], {"num_warps": 1})  # tl.arange needs a power of two
print(json.dumps(dict(tuned=tuned, spill=cc.failures_of(spill), smem=cc.failures_of(smem),
                      smem_bytes=smem.get("shared_bytes"), broken=cc.failures_of(broken))))
'''


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    path = tmp_path_factory.mktemp("synthetic") / "synthetic_kernels.py"
    path.write_text(SYNTHETIC)
    return path


def test_a_kernel_no_op_launches_fails_the_check(synthetic):
    proc = _run([str(SCRIPT), "--no-compile", "--extra-module", str(synthetic),
                 "--json", str(synthetic.with_suffix(".json"))], timeout=300)
    out = json.loads(synthetic.with_suffix(".json").read_text())
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert {"_orphan_kernel", "_spilling_kernel", "_big_smem_kernel", "_tuned_kernel"} <= set(out["uncovered_kernels"])


def test_spills_shared_memory_and_compile_errors_fail_and_autotune_lists_are_enumerated(synthetic):
    proc = _run(["-c", textwrap.dedent(PROBE), str(synthetic), str(SCRIPT.parent)], timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["tuned"] == [64, 128, 256], "every autotune config is a config the launcher can choose"
    assert any("spill" in f for f in got["spill"]), got["spill"]
    assert got["smem_bytes"] > compile_check.SMEM_PER_BLOCK_SM90
    assert got["smem"] and all("shared memory" in f for f in got["smem"]), got["smem"]
    assert any("compile error" in f for f in got["broken"]), got["broken"]
