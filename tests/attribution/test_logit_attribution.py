"""Direct logit attribution at (block, step, position) (issue 51): the parts sum to the logit the
engine decided from, down to single heads and experts, in diffusion, AR and speculative runs."""
import pytest

from clover_lab import attribution
from clover_lab.errors import InputError
from clover_lab.patching import measure
from clover_lab.patching.metrics import Metric

pytestmark = pytest.mark.usefixtures("gen_one_thread")
PROMPT = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64]
KW = dict(max_new_tokens=16, threshold=0.5)


def _sums(a):
    assert abs(a.total() - a.logit) <= 1e-4 * max(abs(a.logit), 1.0), (a.total(), a.logit)


def _engine_logit(engine, prompt, a, **kw):
    """The logit the engine itself computed at the attributed row (read off final_norm.output)."""
    return measure(engine, prompt, Metric(a.row, lambda lg: lg[a.token], "logit"),
                   a.block if a.mode == "preview" else (None if a.block == 0 else a.block - 1),
                   a.step, **kw)


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_parts_sum_to_the_engine_logit_at_every_decision(tiny_engine, mode):
    kw = KW if mode == "diffusion" else dict(mode="ar", max_new_tokens=6)
    decisions, attrs = attribution.decision_attributions(tiny_engine, PROMPT, **kw)
    assert len(decisions) == kw["max_new_tokens"]
    steps = {(d.block, d.step) for d in decisions}
    assert len(steps) >= (3 if mode == "diffusion" else 6)  # several coordinates, not one forward
    names = set(attribution.component_names(tiny_engine.model))
    k = tiny_engine.model.config.num_experts_per_tok
    for d, a in zip(decisions, attrs):
        _sums(a)
        assert set(a.contributions) <= names
        assert (a.block, a.step, a.position, a.token) == (d.block, d.step, d.position, d.token)
        # every layer split per head and per routed expert, the shared expert apart
        assert sum(".moe.experts." in n for n in a.contributions) == k * 4
        assert sum(n.endswith("shared_expert") for n in a.contributions) == 4
        assert {"layers.0.gdn.heads.3", "layers.3.attn.heads.0", "embed"} <= set(a.contributions)
    for a in attrs[:3]:  # the logit is the one the engine decided from
        assert abs(_engine_logit(tiny_engine, PROMPT, a, **kw) - a.logit) < 1e-4 * max(1, abs(a.logit))


def test_one_coordinate_and_a_chosen_token(tiny_engine):
    decisions, attrs = attribution.decision_attributions(tiny_engine, PROMPT, **KW)
    d = decisions[-1]
    a = attribution.logit_attribution(tiny_engine, PROMPT, d.block, d.step, d.position, **KW)
    assert a.contributions == attrs[-1].contributions and a.token == d.token
    other = attribution.logit_attribution(tiny_engine, PROMPT, d.block, d.step, d.position, token=7, **KW)
    _sums(other)
    assert other.token == 7 and other.logit != a.logit
    # per sub-block sums agree with the parts
    assert abs(sum(a.by_layer().values()) - a.total()) < 1e-9


def test_over_steps_in_every_mode(tiny_engine):
    decisions, _ = attribution.decision_attributions(tiny_engine, PROMPT, **KW)
    late = max((d for d in decisions if d.block == 0), key=lambda d: d.step)
    over = attribution.attribution_over_steps(tiny_engine, PROMPT, 0, late.position, **KW)
    assert [a.step for a in over] == list(range(late.step + 1))  # masked until its step
    assert len({a.token for a in over}) == 1
    for a in over:
        _sums(a)
    ar = attribution.attribution_over_steps(tiny_engine, PROMPT, 2, len(PROMPT) + 2, mode="ar", max_new_tokens=4)
    assert [(a.step, a.mode) for a in ar] == [(None, "commit")]
    spec = attribution.attribution_over_steps(tiny_engine, PROMPT, 0, len(PROMPT) + 1, mode="speculative",
                                              max_new_tokens=6)
    assert spec and spec[0].mode == "preview"
    for a in ar + spec:
        _sums(a)


def test_removing_a_last_layer_part_moves_the_logit_by_its_share(tiny_engine):
    """A part of the last layer has no later layer to amplify or undo its removal: the logit moves
    by its share, up to the final norm's scale (frozen in the attribution, not in the rerun)."""
    _, attrs = attribution.decision_attributions(tiny_engine, PROMPT, limit=3, **KW)
    for a in attrs:
        last = {n: v for n, v in a.contributions.items() if n.startswith("layers.3.")}
        name = max(last, key=lambda n: abs(last[n]))
        moved = a.logit - attribution.ablated_logit(tiny_engine, PROMPT, a, name, **KW)
        assert abs(moved - last[name]) < 0.25 * abs(last[name]), (name, moved, last[name])


def test_bad_coordinates_are_named(tiny_engine):
    with pytest.raises(InputError, match="no preview row at position 3"):
        attribution.logit_attribution(tiny_engine, PROMPT, 0, 0, 3, **KW)
    with pytest.raises(InputError, match="step=-1"):
        attribution.logit_attribution(tiny_engine, PROMPT, 0, -1, 12, **KW)
    with pytest.raises(InputError, match="outside the vocabulary"):
        attribution.logit_attribution(tiny_engine, PROMPT, 0, 0, 12, token=10**6, **KW)
    with pytest.raises(InputError, match="committed by block 1, not block 0"):
        attribution.logit_attribution(tiny_engine, PROMPT, 0, None, len(PROMPT) + 1, mode="ar", max_new_tokens=3)
    with pytest.raises(InputError, match="one generation"):
        attribution.logit_attribution(tiny_engine, [PROMPT, PROMPT], 0, 0, 12, **KW)
