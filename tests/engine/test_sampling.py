"""Sampler settings, penalties, candidates, confidences and the unmask rule (spec section 4)."""
import math

import pytest
import torch

from clover_lab import (
    SettingsError,
)
from clover_lab.engine import sampling
from clover_lab.engine.sampling import SamplerSettings

pytestmark = pytest.mark.usefixtures("gen_one_thread")

@pytest.mark.parametrize("name,value", [
    ("threshold", 0.0), ("threshold", 1.5), ("threshold", -0.1), ("threshold", float("nan")),
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.2), ("top_k", -1), ("top_k", 1.5),
    ("confidence", "loudness"), ("max_tokens_per_step", 0), ("max_steps_per_block", 0),
    ("repetition_penalty", 0.0), ("presence_penalty", float("inf")), ("coreset_size", -2), ("seed", -1),
])
def test_invalid_settings_name_the_argument(name, value):
    with pytest.raises(ValueError, match=name):
        SamplerSettings(**{name: value})


def test_valid_settings_and_unknown_names():
    s = SamplerSettings(threshold=1.0, temperature=0.7, top_p=0.9, top_k=5, confidence="margin",
                        max_tokens_per_step=3, max_steps_per_block=4, repetition_penalty=1.2,
                        presence_penalty=-0.5, frequency_penalty=0.3, coreset_size=4, seed=7)
    assert not s.greedy and s.has_penalties
    assert SamplerSettings.from_kwargs(s, threshold=0.5).threshold == 0.5
    with pytest.raises(TypeError, match="tempreature"):
        SamplerSettings.from_kwargs(tempreature=1.0)


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    counts = torch.tensor([1.0, 2.0, 0.0, 3.0])
    out = sampling.apply_penalties(logits, counts, SamplerSettings(repetition_penalty=2.0))
    torch.testing.assert_close(out, torch.tensor([[1.0, -4.0, 1.0, 0.25]]))
    out = sampling.apply_penalties(logits, counts, SamplerSettings(presence_penalty=0.5))
    torch.testing.assert_close(out, torch.tensor([[1.5, -2.5, 1.0, 0.0]]))
    out = sampling.apply_penalties(logits, counts, SamplerSettings(frequency_penalty=0.5))
    torch.testing.assert_close(out, torch.tensor([[1.5, -3.0, 1.0, -1.0]]))
    assert sampling.apply_penalties(logits, counts, SamplerSettings()) is logits


def test_filter_logits_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    k2 = sampling.filter_logits(logits, top_k=2)
    assert torch.isinf(k2[0, 2:]).all() and torch.isfinite(k2[0, :2]).all()
    p = sampling.filter_logits(logits, top_p=0.7)  # 0.5 < 0.7 <= 0.8: keeps two
    assert torch.isfinite(p[0, :2]).all() and torch.isinf(p[0, 2:]).all()
    p = sampling.filter_logits(logits, top_p=0.1)  # the best token always stays
    assert torch.isfinite(p[0, 0]) and torch.isinf(p[0, 1:]).all()


def test_candidates_greedy_and_seeded_sampling():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    tokens, probs = sampling.candidates(logits, SamplerSettings())
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(probs, logits.softmax(-1))
    hot = SamplerSettings(temperature=1.0)
    a = sampling.candidates(logits, hot, torch.Generator().manual_seed(5))[0]
    b = sampling.candidates(logits, hot, torch.Generator().manual_seed(5))[0]
    assert torch.equal(a, b)
    assert torch.equal(sampling.candidates(logits, SamplerSettings(temperature=2.0, top_k=1),
                                           torch.Generator().manual_seed(1))[0], logits.argmax(-1))
    draws = torch.stack([sampling.candidates(logits, hot, torch.Generator().manual_seed(s))[0] for s in range(20)])
    assert (draws != logits.argmax(-1)).any()  # sampling really samples


def test_confidence_rules():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.4, 0.5, 0.1]])
    tokens = torch.tensor([0, 0])
    torch.testing.assert_close(sampling.confidences(probs, tokens, "probability"), torch.tensor([0.7, 0.4]))
    torch.testing.assert_close(sampling.confidences(probs, tokens, "margin"), torch.tensor([0.5, -0.1]))
    ent = -(probs * probs.log()).sum(-1)
    torch.testing.assert_close(sampling.confidences(probs, tokens, "entropy"), torch.exp(-ent))
    sure = torch.tensor([[1.0, 0.0, 0.0]])
    assert math.isclose(float(sampling.confidences(sure, torch.tensor([0]), "entropy")[0]), 1.0)
    with pytest.raises(ValueError, match="confidence rule"):
        sampling.confidences(probs, tokens, "vibes")


def test_select_unmask_threshold_floor_cap_and_limit():
    conf = torch.tensor([0.2, 0.95, 0.5, 0.91, 0.99])
    assert sampling.select_unmask(conf, 0.9).tolist() == [False, True, False, True, True]
    # nothing reaches the threshold: still the most confident one
    assert sampling.select_unmask(conf, 1.0).tolist() == [False, False, False, False, True]
    # a cap keeps the most confident of the qualifying ones
    assert sampling.select_unmask(conf, 0.9, max_per_step=2).tolist() == [False, True, False, False, True]
    assert sampling.select_unmask(conf, 0.9, force_all=True).all()


def test_decide_applies_penalties_to_candidates():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    counts = torch.tensor([1.0, 0.0, 0.0])
    tokens, conf, flags = sampling.decide(logits, counts, SamplerSettings(presence_penalty=3.0))
    assert tokens.tolist() == [1] and flags.tolist() == [True]
    tokens, _, _ = sampling.decide(logits, None, SamplerSettings(presence_penalty=3.0))
    assert tokens.tolist() == [0]


PROMPT = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64]


def test_penalties_are_bounded_so_logits_stay_finite(tiny_engine):
    for name, value in (("presence_penalty", 1e39), ("frequency_penalty", -1e5), ("repetition_penalty", 1e-30),
                        ("repetition_penalty", 1e39), ("temperature", 1e-300), ("seed", 2**70)):
        with pytest.raises(SettingsError, match=name):
            tiny_engine.generate(PROMPT, **{name: value})
    r = tiny_engine.generate(PROMPT, max_new_tokens=20, presence_penalty=1e4, frequency_penalty=-1e4,
                             repetition_penalty=1e4)
    assert len(r.token_ids) == 20 and tiny_engine.mask_token_id not in r.token_ids
