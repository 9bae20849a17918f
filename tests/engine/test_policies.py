"""Decoding rules through the seam (issue 30): EB-sampler and top-k with a schedule, beside the
threshold rule; settings validated, tokens never the mask, batches equal one-by-one, hooks see
every step, selectable from generate and the command line."""
import pytest

from clover_lab.engine import EntropyBoundedPolicy, ThresholdPolicy, TopKPolicy, make_policy
from clover_lab.engine.sampling import SettingsError

pytestmark = pytest.mark.usefixtures("gen_one_thread")
PROMPTS = [[5, 17, 33], [5, 17, 33, 100, 2, 9, 77, 301, 12, 64], [400, 3, 250, 7, 88, 19]]
POLICIES = [EntropyBoundedPolicy(0.5), EntropyBoundedPolicy(0.0), TopKPolicy(3), TopKPolicy([1, 2, 4])]


@pytest.mark.parametrize("bad", [dict(cls=EntropyBoundedPolicy, gamma=-1), dict(cls=EntropyBoundedPolicy, gamma="x"),
                                 dict(cls=EntropyBoundedPolicy, gamma=float("nan")), dict(cls=TopKPolicy, k=0),
                                 dict(cls=TopKPolicy, k=[]), dict(cls=TopKPolicy, k=[2, 1.5]),
                                 dict(cls=TopKPolicy, k=True)])
def test_settings_are_validated(bad):
    cls = bad.pop("cls")
    with pytest.raises(SettingsError, match=next(iter(bad))):
        cls(**bad)


def test_make_policy_by_name():
    assert isinstance(make_policy("threshold"), ThresholdPolicy)
    assert make_policy("eb:gamma=0.5").gamma == 0.5
    assert make_policy("topk:k=1/2/4").schedule == [1, 2, 4]
    for bad in ("nope", "topk:k", "topk:q=2", 3):
        with pytest.raises(SettingsError):
            make_policy(bad)


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_steps_follow_the_rule_and_never_place_the_mask(tiny_engine, policy):
    steps = []
    with tiny_engine.hooks({"denoise.step": steps.append}):
        r = tiny_engine.generate(PROMPTS[1], max_new_tokens=40, policy=policy)
    assert tiny_engine.mask_token_id not in r.token_ids and len(r.token_ids) == 40
    assert len(steps) == sum(r.stats.steps_per_block)  # hooks see every step
    for e in steps:
        n = len(e.unmask)
        last = e.step + 1 >= len(e.masked) or n == len(e.masked)
        if isinstance(policy, TopKPolicy) and not last:
            assert n == min(policy.k_at(e.step), len(e.masked))
        if isinstance(policy, EntropyBoundedPolicy) and n > 1:
            h = -(e.logits.softmax(-1).clamp_min(1e-30).log() * e.logits.softmax(-1)).sum(-1)
            picked = sorted(h[[e.masked.index(p) for p in e.unmask]].tolist())
            assert sum(picked) - picked[-1] <= policy.gamma + 1e-4


def test_a_faster_rule_takes_fewer_steps(tiny_engine):
    one = tiny_engine.generate(PROMPTS[0], max_new_tokens=32, policy=TopKPolicy(1))
    four = tiny_engine.generate(PROMPTS[0], max_new_tokens=32, policy=TopKPolicy(4))
    assert one.stats.steps_per_block == [16, 16] and four.stats.steps_per_block == [4, 4]


@pytest.mark.parametrize("policy", POLICIES[::2], ids=repr)
def test_batches_equal_one_by_one(tiny_engine, policy):
    batch = tiny_engine.generate(PROMPTS, max_new_tokens=40, policy=policy)
    for p, row in zip(PROMPTS, batch):
        alone = tiny_engine.generate(p, max_new_tokens=40, policy=policy)
        assert row.token_ids == alone.token_ids and row.stats.steps_per_block == alone.stats.steps_per_block


def test_speculative_drafts_through_a_policy_stay_exact(tiny_engine):
    ar = tiny_engine.generate(PROMPTS[2], mode="ar", max_new_tokens=40)
    for policy in ("eb:gamma=1", "topk:k=4"):
        spec = tiny_engine.generate(PROMPTS[2], mode="speculative", max_new_tokens=40, draft_passes=3, policy=policy)
        assert spec.token_ids == ar.token_ids


def test_the_command_line_takes_a_policy(capsys):
    from clover_lab.cli.main import main

    assert main(["generate", "--prompt-ids", "5,17,33", "--max-new-tokens", "8", "--policy", "topk:k=2",
                 "--no-progress", "--json"]) == 0
    assert main(["generate", "--prompt-ids", "5,17,33", "--max-new-tokens", "8", "--policy", "topk:k=0",
                 "--no-progress"]) != 0
    assert "TopKPolicy k=0" in capsys.readouterr().err
