"""Patching over a dataset of prompt pairs (issue 51), a few pairs on the tiny model (the 50-pair
run is notebook 08's): batched pairs give what each pair gives
alone through the one-pair machinery (record, patch_hooks, measure); patching every prompt row of
the embedding restores the clean metric exactly; the mean and its bootstrap interval are those of
the per-pair values; bad pairs and sites are named."""
import math

import pytest
import torch

from clover_lab import patching
from clover_lab.errors import InputError
from clover_lab.patching.patch import patch_hooks

pytestmark = pytest.mark.usefixtures("gen_one_thread")
KW = dict(max_new_tokens=16, threshold=0.3)
CLEAN = [[5, 17, 33, 100, 2, 9, 77, 301], [400, 3, 250, 7, 8, 1], [9, 77, 301, 12, 64, 8, 1, 4, 6]]


def _pairs():
    out = []
    for i, clean in enumerate(CLEAN):
        corrupt = list(clean)
        corrupt[-1] = 200 + i  # the last prompt token differs
        out.append(patching.Pair(clean, corrupt, patching.logit_diff(len(clean), 11, 12)))  # first response slot
    return out


def test_batched_pairs_match_each_pair_alone(tiny_engine):
    pairs = _pairs()
    res = patching.patch_pairs(tiny_engine, pairs, "layers.1.output", None, None, positions=[-1], read_at=(0, 0),
                               batch_size=2, progress=False, **KW)
    assert len(res) == 3 and torch.isfinite(res.patched).all() and not torch.allclose(res.patched, res.corrupt)
    for i, pair in enumerate(pairs):
        n = len(pair.clean)
        source = patching.record(tiny_engine, pair.clean, ["layers.1.output"], **KW)
        site = patching.Site("layers.1.output", None, None, positions=(n - 1,))
        hooks = patch_hooks(source, [site], [])
        patched = patching.measure(tiny_engine, pair.corrupt, pair.metric, 0, 0, hooks=hooks, **KW)
        clean = patching.measure(tiny_engine, pair.clean, pair.metric, 0, 0, **KW)
        corrupt = patching.measure(tiny_engine, pair.corrupt, pair.metric, 0, 0, **KW)
        assert [float(res.clean[i]), float(res.corrupt[i]), float(res.patched[i])] == pytest.approx(
            [clean, corrupt, patched], rel=1e-4, abs=1e-4)
    assert not tiny_engine.model.hooks.attached()


def test_patching_the_whole_embedding_restores_the_clean_metric_and_the_interval_is_the_means(tiny_engine):
    pairs = _pairs()
    res = patching.patch_pairs(tiny_engine, pairs, "layers.0.input", None, None, read_at=(0, 0), batch_size=3,
                               progress=False, **KW)
    torch.testing.assert_close(res.patched, res.clean)
    assert not torch.allclose(res.corrupt, res.clean)
    assert res.recovered.tolist() == pytest.approx([1.0, 1.0, 1.0])
    # a patch at one block position of the preview, read at the same forward
    one = patching.patch_pairs(tiny_engine, pairs, "layers.2.output", 0, 0, positions=[0], batch_size=3,
                               progress=False, **KW)
    effect = (one.patched - one.corrupt)
    assert one.mean("effect") == pytest.approx(float(effect.mean()))
    lo, hi = one.interval(0.9, of="effect", resamples=500)
    assert lo <= one.mean("effect") <= hi and one.interval(0.9, of="effect", resamples=500) == (lo, hi)
    assert float(effect.min()) <= lo and hi <= float(effect.max())
    assert "pairs" in one.summary() and "block 0, step 0" in one.summary()
    with pytest.raises(InputError, match="level"):
        one.interval(1.5)


def test_bad_pairs_and_sites_are_named(tiny_engine):
    good = _pairs()
    for call, match in [
        (lambda: patching.Pair([1, 2, 3], [[1, 2], [3]], good[0].metric), "batch"),
        (lambda: patching.Pair([1, 2], [3, 4], "metric"), "metric must be a Metric"),
        (lambda: patching.patch_pairs(tiny_engine, [], "layers.1.output", None, None), "non-empty"),
        (lambda: patching.patch_pairs(tiny_engine, [1], "layers.1.output", None, None), "Pair objects"),
        (lambda: patching.patch_pairs(tiny_engine, good, "layers.9.output", None, None), "not a residual point"),
        (lambda: patching.patch_pairs(tiny_engine, good, "layers.1.output", None, 2), "without a block"),
        (lambda: patching.patch_pairs(tiny_engine, good, "layers.1.output", 0, 0, positions=[16]), "0..15"),
        (lambda: patching.patch_pairs(tiny_engine, good, "layers.1.output", None, None, positions=[-7]),
         "pair 1: prompt positions"),
        (lambda: patching.patch_pairs(tiny_engine, [patching.Pair([1, 2, 3], [1, 2], good[0].metric)],
                                      "layers.1.output", None, None), "pair 0: the clean prompt has 3 tokens"),
        (lambda: patching.patch_pairs(tiny_engine, good, "layers.1.output", 0, 40, progress=False, **KW),
         "have no layers.1.output at block 0, step 40"),
    ]:
        with pytest.raises(InputError, match=match):
            call()
    assert not tiny_engine.model.hooks.attached()
    assert math.isnan(patching.PairsPatch(torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([2.0]),
                                          {}).recovered[0])
