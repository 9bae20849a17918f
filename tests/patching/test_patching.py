"""Activation patching along the denoising axis (issue 17)."""
import math

import pytest

from clover_lab import patching
from clover_lab.errors import InputError
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


PROMPT = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64]


OTHER = [7, 8, 9, 200, 300]


def test_patch_sites_must_exist_in_the_source(tiny_engine):
    from clover_lab import patching

    a = patching.record(tiny_engine, PROMPT, points="layers.*[0-9].output", **KW)
    site = patching.Site("layers.1.output", 0, 0, positions=(len(PROMPT) + 2,))
    assert patching.patch(tiny_engine, PROMPT[::-1], a, [site], **KW).applied  # same length: patched
    with pytest.raises(InputError, match="10 tokens and this prompt has 5"):
        patching.patch(tiny_engine, OTHER, a, "all", **KW)
    with pytest.raises(InputError, match="batch"):
        patching.patch(tiny_engine, [PROMPT, PROMPT], a, "all", **KW)
    for bad, match in [(patching.Site("layers.1.output", 99, 0), "no layers.1.output at block 99, step 0"),
                       (patching.Site("layers.1.output", 0, 99), "at block 0, step 99"),
                       (patching.Site("layers.1.output", 0, 0, positions=(5000,)), r"positions \[5000\]"),
                       (patching.Site("layers.1.input", 0, 0), "did not record layers.1.input")]:
        with pytest.raises(InputError, match=match):
            patching.patch(tiny_engine, PROMPT, a, [bad], **KW)
    with pytest.raises(InputError, match="list of Site"):
        patching.patch(tiny_engine, PROMPT, a, site, **KW)


def test_sweeps_refuse_forwards_steps_and_positions_that_do_not_exist(tiny_engine):
    from clover_lab import patching

    metric = patching.probability(len(PROMPT) + 1, 7)
    corrupt = PROMPT[:3] + [200] + PROMPT[4:]
    for kwargs, match in [(dict(block=0, step=99), "metric's block 0, step 99: the clean run has no such forward"),
                          (dict(block=0, step=0, patch_at=(7, 0)), "patch_at block 7"),
                          (dict(block=0, step=0, positions=[]), "positions is empty"),
                          (dict(block=0, step=0, positions=[9999]), r"positions \[9999\]")]:
        with pytest.raises(InputError, match=match):
            patching.sweep_layers_positions(tiny_engine, PROMPT, corrupt, metric, **kwargs, **KW)
    for kwargs, match in [(dict(steps=[]), "steps is empty"), (dict(steps=[0, 99]), "step 99"),
                          (dict(steps=5), "steps=5")]:
        with pytest.raises(InputError, match=match):
            patching.sweep_steps_layers(tiny_engine, PROMPT, corrupt, metric, block=0, **kwargs, **KW)
    with pytest.raises(InputError, match="outside the vocabulary"):
        patching.sweep_steps_layers(tiny_engine, PROMPT, corrupt, patching.logit_diff(11, 0, 10**6), block=0, **KW)
