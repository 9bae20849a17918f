"""Capture discipline of the engine's static steps (issue 26): each step shape (AR, preview,
fused commit+preview, a coreset's recording and routing previews) on the embedded model through
the Triton kernels forces no host synchronisation, launches the same op sequence whatever the
committed length (a CUDA graph of it stays valid), and stays under a kernel budget per layer."""
import importlib.util
from pathlib import Path

import pytest
import torch

from clover_kernels.launches import LaunchCounter

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("step_launches", REPO / "bench" / "step_launches.py")
step_launches = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step_launches)

# kernels per layer per forward (Triton launches plus aten ops that do work), counted as
# bench/step_launches.py counts them. Before issue 26: AR 76.0, preview 68.25, fused 83.75,
# coreset record 71.25, coreset use 72.25; with the one-launch block alignment, the fused router
# and the fused projections: 36.25, 31.25, 43.25, 34.25, 33.25; with the fused q/k norms + RoPE,
# residual adds + norms, GDN gates, output and shared-expert gates, MoE combine, one routing launch
# per step and one multi-tensor publish: 19.5, 18.0, 22.0, 21.0, 20.0 (the goal: 20); with the
# GDN's two parts written into one output, the experts' sum over k in moe_combine and the coreset
# passed to the router as ids (recorded by one more launch), a block's last visible key picked in the
# attention kernel, the K,V cache write inside the q/k norm + RoPE kernel: 16.75, 15.0, 18.25, 16.0, 15.0
BUDGET = {"AR": 16.75, "preview": 15.0, "fused": 18.25, "preview, coreset record": 16.0,
          "preview, coreset use": 15.0}


OUTPUTS = {}  # shape -> the counted step's (commit logits, preview logits, coreset), through the kernels

# slow tier: ten whole static steps of the embedded model through the Triton interpreter take about
# a minute on 2 cores (a tenth of the fast tier's 10-minute budget); the kernels one by one against
# their torch references stay in the fast tier (test_kernel_*.py)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model():
    return step_launches.load_model("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def counts(model):
    from clover_kernels import dispatch

    # on a CPU the kernels' interpreter run (tests/kernels/conftest.py); on a GPU the device decides
    with dispatch.use_backend(None if torch.cuda.is_available() else "triton"):
        return step_launches.count_static_steps(model, outputs=OUTPUTS)


def test_static_steps_through_the_kernels_equal_the_torch_path(model, counts):
    """Every counted step shape gives the torch path's logits (to fp32 tolerance: the kernels sum in
    their own order) and records the same coreset."""
    want = {}
    with step_launches.torch_path():
        step_launches.count_static_steps(model, lengths=(21,), outputs=want)
    for shape, (commit, preview, core) in want.items():
        got = OUTPUTS[shape]
        for name, a, b in (("commit logits", got[0], commit), ("preview logits", got[1], preview)):
            assert (a is None) == (b is None), f"{shape}: {name}"
            if b is not None:
                torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4, msg=lambda m: f"{shape}, {name}: {m}")
        assert (core is None) == (got[2] is None) and (core is None or (core.keys() == got[2].keys() and all(
            torch.equal(core[k].cpu(), got[2][k].cpu()) for k in core))), f"{shape}: coreset {got[2]} vs {core}"


@pytest.mark.parametrize("shape", step_launches.SHAPES)
def test_static_step_forces_no_host_sync_and_keeps_its_op_sequence(counts, shape):
    r = counts[shape]
    assert r["syncs"] == [], f"{shape}: host syncs {r['syncs']}"
    assert r["same_sequence"], f"{shape}: the op sequence changes with the committed length {r['lengths']}"


@pytest.mark.parametrize("shape", step_launches.SHAPES)
def test_static_step_stays_under_its_kernel_budget(counts, shape):
    r = counts[shape]
    assert r["triton"] > 0, "the Triton kernels did not run"
    assert r["per_layer"] <= BUDGET[shape], f"{shape}: {r['per_layer']:.2f} kernels per layer, {r['by_name']}"


def test_the_counter_sees_syncs_views_and_triton_launches():
    x = torch.arange(6.0).view(2, 3)
    with LaunchCounter() as count:
        y = x.t().reshape(-1)  # views and a copy
        _ = x[x > 2]  # boolean indexing: a sync
        _ = int(x.sum())  # .item(): a sync
        _ = torch.repeat_interleave(torch.tensor([1, 2]))  # no output size: a sync
        _ = torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)
    assert "index with a boolean index" in count.syncs and "_local_scalar_dense" in count.syncs
    assert count.syncs.count("repeat_interleave without output_size") == 1
    assert "t" not in count.by_name and "view" not in count.by_name and y.numel() == 6
    from clover_kernels.norm import rms

    w = torch.zeros(3, device="cuda" if torch.cuda.is_available() else "cpu")
    with LaunchCounter() as count:
        rms.rms_norm(x.to(w.device), w, 1e-6)
    assert count.triton == 1


# the decoding work between two forwards, per step (bench/step_launches.py: count_sampler_steps), on
# the embedded model with its generation defaults (repetition and frequency penalties): block
# diffusion's decide and take per row (policy, sampler, canvas update) and AR's sampling.decide per row
DECODING_BUDGET = {"diffusion": 36, "ar": 14}


def test_the_decoding_work_per_step_stays_on_the_device_under_its_budget():
    from clover_lab import load

    counts = step_launches.count_sampler_steps(load(dtype=torch.float32), new_tokens=16)
    for mode, r in counts.items():
        assert r["steps"] > 0 and r["syncs"] == [], (mode, r)
        assert r["max_kernels"] <= DECODING_BUDGET[mode], f"{mode}: {r['max_kernels']} kernels a step, {r['by_name']}"
