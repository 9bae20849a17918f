"""Attribution patching (gradient x activation difference) beside real activation patching (issue 51)."""
import math

import pytest

from clover_lab import attribution, patching
from clover_lab.errors import InputError

pytestmark = pytest.mark.usefixtures("gen_one_thread")
CLEAN = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64]
CORRUPT = [5, 17, 33, 200, 2, 9, 77, 301, 12, 64]  # position 3 differs
KW = dict(max_new_tokens=16, threshold=0.5)


def test_estimate_tracks_activation_patching(tiny_engine):
    good, bad = tiny_engine.generate(CLEAN, **KW).token_ids[0], 7
    metric = patching.logit_diff(len(CLEAN), good, bad)
    kw = dict(block=0, step=0, kind="output", positions=[10, 11, 12], **KW)
    est = attribution.attribution_patching(tiny_engine, CLEAN, CORRUPT, metric, **kw)
    real = patching.sweep_layers_positions(tiny_engine, CLEAN, CORRUPT, metric, **kw)
    assert est.values.shape == real.values.shape == (4, 3)
    assert est.corrupt == pytest.approx(real.corrupt) and est.clean == pytest.approx(real.clean)
    assert (est.values - est.corrupt).abs().max() > 1e-3  # it estimates something
    # within one forward the residual stream's effect is near linear: the estimate is close to the truth
    assert attribution.correlation(est, real) > 0.95
    assert (est.values - real.values).abs().max() < 0.2 * (real.values - real.corrupt).abs().max() + 1e-3


def test_bad_requests_are_named(tiny_engine):
    metric = patching.logit_diff(len(CLEAN), 3, 7)
    with pytest.raises(InputError, match="patch_at"):
        attribution.attribution_patching(tiny_engine, CLEAN, CORRUPT, metric, 0, 1, patch_at=(0, 0), **KW)
    with pytest.raises(InputError, match="not rows of"):
        attribution.attribution_patching(tiny_engine, CLEAN, CORRUPT, metric, 0, 0, positions=[2], **KW)
    assert math.isnan(attribution.correlation(*[patching.Sweep(__import__("torch").zeros(1, 1), [0], [0], "l", "p",
                                                                              0.0, 0.0, "m")] * 2))
