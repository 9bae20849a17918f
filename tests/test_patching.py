"""Activation patching along the denoising axis (issue 17)."""
import math

import pytest

from clover_lab import patching
from clover_lab.hooks import points as P

pytestmark = pytest.mark.usefixtures("gen_one_thread")
CLEAN = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64]
CORRUPT = [5, 17, 33, 200, 2, 9, 77, 301, 12, 64]  # position 3 differs
KW = dict(max_new_tokens=32, threshold=0.3)


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_null_patch_leaves_every_token_identical(tiny_engine, mode):
    kw = KW if mode == "diffusion" else dict(mode="ar", max_new_tokens=8)
    source = patching.record(tiny_engine, CLEAN, **kw)
    run = patching.patch(tiny_engine, CLEAN, source, "all", **kw)
    assert run.result.token_ids == source.result.token_ids
    patched_points = {site.point for site, _ in run.applied}
    assert patched_points == set(patching.residual_points(tiny_engine))
    # every forward part was patched: the prefill, every commit and (diffusion) every step
    keys = {(site.block, site.step) for site, _ in run.applied}
    assert (None, None) in keys and keys == {(b, s) for _, b, s in source.keys()}


def test_patching_everything_from_another_prompt_reproduces_its_run(tiny_engine):
    a = patching.record(tiny_engine, CLEAN, **KW)
    plain = tiny_engine.generate(CORRUPT, **KW)
    assert plain.token_ids != a.result.token_ids  # the two prompts part
    assert patching.patch(tiny_engine, CORRUPT, a, "all", **KW).result.token_ids == a.result.token_ids
    # one site only: a late layer at one position of one step changes less than everything
    site = patching.Site("layers.3.output", block=0, step=0, positions=(len(CLEAN) + 2,))
    run = patching.patch(tiny_engine, CORRUPT, a, [site], **KW)
    assert [s for s, _ in run.applied] == [site]


def test_sites_are_checked(tiny_engine):
    with pytest.raises(ValueError, match="not a residual-stream point"):
        patching.Site("layers.0.moe.route", 0, 0)
    a = patching.record(tiny_engine, CLEAN, points=P.every_layer("output"), max_new_tokens=4, threshold=0.3)
    with pytest.raises(ValueError, match="residual-stream points only"):
        patching.record(tiny_engine, CLEAN, points="denoise.step", max_new_tokens=4)
    with pytest.raises(TypeError, match="Site"):
        patching.patch(tiny_engine, CLEAN, a, [("layers.0.output", 0, 0)], max_new_tokens=4)
    assert patching.Site("layers.0.output", 0, 0, [12, 13]).positions == (12, 13)


def test_layers_by_positions_sweep_restores_exactly_where_it_must(tiny_engine):
    p = len(CLEAN) + 3  # a block position, masked at step 0
    good = int(tiny_engine.model.denoise_logits(CLEAN, [[511] * 16])[0, 3].argmax())
    metric = patching.logit_diff(p, good, (good + 1) % 500)
    cols = [p - 1, p, p + 4]
    sweep = patching.sweep_layers_positions(tiny_engine, CLEAN, CORRUPT, metric, block=0, step=0,
                                            positions=cols, **KW)
    assert sweep.values.shape == (4, 3) and sweep.rows == [0, 1, 2, 3] and sweep.cols == cols
    assert abs(sweep.clean - sweep.corrupt) > 1e-3
    # the last layer's output at the read position is all its logits depend on: the clean value
    assert sweep.values[3, 1].item() == pytest.approx(sweep.clean, abs=1e-4)
    # ...and at the other positions it changes nothing
    assert sweep.values[3, 0].item() == pytest.approx(sweep.corrupt, abs=1e-4)
    assert sweep.values[3, 2].item() == pytest.approx(sweep.corrupt, abs=1e-4)
    assert sweep.normalized()[3, 1].item() == pytest.approx(1.0, abs=1e-3)

    # patching the prompt's prefill: layer 0's input at the corrupted position is the clean token
    prompt = patching.sweep_layers_positions(tiny_engine, CLEAN, CORRUPT, metric, block=0, step=0, kind="input",
                                             patch_at=(None, None), positions=[2, 3], **KW)
    assert prompt.values[0, 1].item() == pytest.approx(prompt.clean, abs=1e-4)
    assert prompt.values[0, 0].item() == pytest.approx(prompt.corrupt, abs=1e-4)
    assert prompt.to_dict()["values"][0][1] == pytest.approx(prompt.clean, abs=1e-4)


def test_steps_by_layers_sweep_for_one_position(tiny_engine):
    p = len(CLEAN) + 5
    metric = patching.probability(p, 7)
    sweep = patching.sweep_steps_layers(tiny_engine, CLEAN, CORRUPT, metric, block=0, **KW)
    steps = sweep.rows
    assert steps[0] == 0 and sweep.cols == [0, 1, 2, 3] and sweep.values.shape == (len(steps), 4)
    assert sweep.values[0, 3].item() == pytest.approx(sweep.clean, abs=1e-6)
    assert len(sweep.clean_rows) == len(steps) and sweep.clean_rows[0] == sweep.clean
    # every row normalised against its own step's clean and corrupted values
    if sweep.clean_rows[0] != sweep.corrupt_rows[0]:
        assert sweep.normalized()[0, 3].item() == pytest.approx(1.0, abs=1e-4)
    assert 0 <= sweep.values[0, 0].item() <= 1


def test_measure_is_nan_where_the_run_never_reads(tiny_engine):
    metric = patching.probability(len(CLEAN) + 1, 7)
    assert math.isnan(patching.measure(tiny_engine, CLEAN, metric, 0, 99, **KW))
    v = patching.measure(tiny_engine, CLEAN, metric, 0, 0, **KW)
    ref = tiny_engine.model.denoise_logits(CLEAN, [[511] * 16])[0, 1]
    ref[511] = float("-inf")
    assert v == pytest.approx(float(ref.softmax(-1)[7]), abs=1e-6)
