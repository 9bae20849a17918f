"""bench/gpu_check.sh rehearsed on the CPU: every step's command replaced by canned output
(GPU_CHECK_REHEARSE), the rest real: the per-step limits, the summary and its verdict, the bundle
that comes back from the GPU machine (at most 8 files)."""
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"
MAX_FILES = 8  # what the GPU machine brings back from its output folder

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="the check is a bash script using coreutils' timeout")


def junit(passed=0, failed=0, skipped=0):
    n = passed + failed + skipped
    return (f'<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="{n}" failures="{failed}" '
            f'errors="0" skipped="{skipped}"></testsuite></testsuites>')


def e2e_rows(captured=True):
    row = dict(step="AR step", median_s=0.004, roofline_s=0.00127, time_over_roofline=3.1, tokens_per_s=None)
    graph = dict(row, variant="CUDA graph" if captured else "static eager (capture failed)", graph_captured=captured,
                 graph_error=None if captured else "RuntimeError: operation not permitted when stream is capturing")
    return [dict(row, variant="default"), graph]


def fake_run(tmp_path, captured=True, slow=None, killed=None):
    """A folder of canned step outputs, as a GPU run would leave them."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "install.log").write_text("Successfully installed clover-lab-0.1.0\n")
    steps = {"tests_graphs_capture": (1, 0, 0) if captured else (0, 1, 0),
             "tests_test_kernel_moe_fp32": (12, 0, 0), "tests_test_kernel_moe_bf16": (12, 0, 0),
             "tests_graphs": (6, 0, 1)}
    for name, (p, f, s) in steps.items():
        (fake / name).mkdir()
        (fake / name / f"{name}.xml").write_text(junit(p, f, s))
        log = f"{p} passed in 12.0s\n" if not f else f"FAILED tests/test_graphs.py::test_cuda_graph_replays_equal_eager\n"
        (fake / f"{name}.log").write_text(log)
        (fake / f"{name}.rc").write_text("0" if not f else "1")
    if not captured:  # what the runner warns when it falls back to eager
        (fake / "bench_e2e.log").write_text("runner.py:201: RuntimeWarning: CUDA graph capture failed, running steps "
                                            "eagerly from now on (RuntimeError: ...)\n")
        (fake / "bench_e2e.rc").write_text("1")
    (fake / "bench_kernels").mkdir()
    (fake / "bench_kernels" / "kernels_2026-12-01_1000_nvidia-h200.json").write_text(json.dumps(
        dict(complete=True, rows=[dict(op="rms_norm", shape="T=1 H=2048", triton_s=3e-6)])))
    (fake / "kernels_vs_roofline.log").write_text("measured on NVIDIA H200 (torch.bfloat16)\nrms_norm 1 3.0 us\nwrote x\n")
    (fake / "bench_mtp").mkdir()
    (fake / "bench_mtp" / "mtp-nvidia-h200-20261203-170000.json").write_text(json.dumps(dict(rows=[
        dict(mode=m, tokens_per_forward=t, tokens_per_second=s, vs_ar=s / 60.0, equals_ar=m != "diffusion")
        for m, t, s in (("diffusion", 2.4, 120.0), ("speculative", 1.6, 80.0), ("ar", 1.0, 60.0),
                        ("ar+mtp", 1.5, 75.0))])))
    (fake / "bench_e2e").mkdir()
    (fake / "bench_e2e" / "e2e_clover-35b-a3b_2026-12-01_100000_nvidia-h200.json").write_text(json.dumps(
        dict(complete=True, rows=e2e_rows(captured))))
    (fake / "roofline.log").write_text("AR step 8.0 5.89 1.27 ms\npreview 32, coreset 64 4.15 ms\n")
    for name, seconds in (slow or {}).items():
        (fake / f"{name}.seconds").write_text(str(seconds))
    if killed:
        (fake / f"{killed}.rc").write_text("124")
    return fake


def rehearse(tmp_path, fake, real=""):
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, GPU_CHECK_REHEARSE=str(fake), GPU_CHECK_WORK=str(work), PYTHON=sys.executable,
               GPU_CHECK_REAL=real, OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", str(SCRIPT), str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    return proc, out, work


def limits():
    text = SCRIPT.read_text()
    return {k: int(v) for k, v in re.findall(r"^(BUDGET|LIMIT_\w+|MIN_E2E|KILL_AFTER)=\$?\{?[A-Z_]*:?-?(\d+)",
                                             text, flags=re.M)}


def test_limits_fit_the_budget():
    """Along the critical path every step at its full limit still leaves bench_e2e its minimum
    (and 25 s for the summary and the bundle) inside the budget."""
    lim = limits()
    path = ["LIMIT_INSTALL", "LIMIT_GRAPHS", "LIMIT_TESTS", "LIMIT_BENCH", "LIMIT_MTP"]  # the CPU-side ones run beside
    assert set(path) <= set(lim) and {"BUDGET", "MIN_E2E", "LIMIT_REPORT"} <= set(lim)
    assert sum(lim[k] for k in path) + lim["MIN_E2E"] + 25 <= lim["BUDGET"]
    assert lim["BUDGET"] <= 480  # 8 minutes on the device, its start and the transfers outside it


@pytest.mark.slow  # bash
def test_rehearsal_passes_and_brings_everything_back_in_two_files(tmp_path):
    proc, out, work = rehearse(tmp_path, fake_run(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert files == ["gpu_check.tar.gz", "summary.txt"] and len(files) <= MAX_FILES
    summary = (out / "summary.txt").read_text()
    assert summary.rstrip().endswith("PASS")
    assert "capture test passed" in summary and "tests graphs_capture: 1 passed" in summary
    assert "AR step" in summary and "CUDA graph" in summary and "measured on NVIDIA H200" in summary
    assert "bench_mtp: rc=0, 4 modes" in summary and "ar+mtp" in summary and "1.25x AR" in summary
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"gpu_check.json", "steps.txt", "summary.txt", "tests_graphs_capture.xml", "install.log",
            "bench_e2e.log"} <= names
    verdict = json.loads((work / "gpu_check.json").read_text())
    assert verdict["passed"] and verdict["graphs"]["ok"]
    # the graph test ran first, before any kernel test process
    order = [line.split()[1] for line in (work / "steps.txt").read_text().splitlines() if line.startswith("step ")]
    assert order.index("tests_graphs_capture") < min(i for i, n in enumerate(order) if n.startswith("tests_test_"))


@pytest.mark.slow  # bash
def test_a_failed_capture_fails_the_check_and_is_recorded(tmp_path):
    proc, out, work = rehearse(tmp_path, fake_run(tmp_path, captured=False))
    assert proc.returncode == 1
    summary = (out / "summary.txt").read_text()
    assert "FAIL" in summary and "CUDA graph capture not shown to work" in summary
    graphs = json.loads((work / "gpu_check.json").read_text())["graphs"]
    assert graphs["capture_test"].startswith("failed") and len(graphs["warnings"]) == 1
    assert graphs["e2e_rows_not_captured"] == ["AR step [static eager (capture failed)]: RuntimeError: "
                                               "operation not permitted when stream is capturing"]


@pytest.mark.slow  # bash
def test_steps_near_or_past_their_limit_are_flagged(tmp_path):
    lim = limits()
    fake = fake_run(tmp_path, slow={"tests_graphs": lim["LIMIT_TESTS"] - 5}, killed="bench_kernels")
    proc, out, _ = rehearse(tmp_path, fake)
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 1
    assert f"LIMIT: step tests_graphs took {lim['LIMIT_TESTS'] - 5}s of its {lim['LIMIT_TESTS']}s limit" in summary
    assert "bench_kernels: rc=124" in summary and summary.rstrip().split("\n")[-1].startswith("FAIL")


@pytest.mark.slow  # bash
def test_a_check_cut_short_still_leaves_its_bundle(tmp_path):
    """The summary and the tarball are rewritten after every step: killed mid-run (here: the
    summary alone, over a work folder whose later steps never ran), the verdict says what is missing."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "steps.txt").write_text("budget 450\nimport_path installed\nstep install rc=0 seconds=9 limit=45\n"
                                    "step tests_graphs_capture rc=137 seconds=130 limit=120\n")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check_summary.py"), str(work)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "was killed at 130s of its 120s limit" in proc.stdout and "bench_e2e: rc=not run" in proc.stdout


@pytest.mark.slow
def test_the_cpu_side_steps_run_well_inside_their_limits(tmp_path):
    """The steps that run on the device's CPU (the roofline plan, the kernels' roofline beside the
    measured kernels) run for real here, on 2 shared cores: measured 5-8 s and 10-15 s against limits
    of 120 s and LIMIT_REPORT (60 s)."""
    proc, out, work = rehearse(tmp_path, fake_run(tmp_path), real="roofline kernels_vs_roofline")
    assert proc.returncode == 0, (out / "summary.txt").read_text()
    steps = {line.split()[1]: dict(f.split("=") for f in line.split()[2:])
             for line in (work / "steps.txt").read_text().splitlines() if line.startswith("step ")}
    for name in ("roofline", "kernels_vs_roofline"):
        assert int(steps[name]["rc"]) == 0
        assert int(steps[name]["seconds"]) < int(steps[name]["limit"]) / 2, steps[name]


@pytest.mark.slow  # bash
def test_without_cuda_it_stops_at_once_with_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a machine with CUDA runs the real check")
    env = {k: v for k, v in os.environ.items() if k != "GPU_CHECK_REHEARSE"}
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], cwd=ROOT, env=dict(env, PYTHON=sys.executable),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout.count("\n") == 1 and "no CUDA device" in proc.stdout
    assert not (tmp_path / "out").exists()
