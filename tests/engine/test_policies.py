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


# --------------------------------------------------------------------------- a custom rule's word, checked
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from clover_lab import GenerationError  # noqa: E402
from clover_lab.engine.policies import DecodingPolicy, LookAheadPolicy, Proposal  # noqa: E402

# what a buggy rule may hand back: (field, how it is spoiled); None: a proposal left as it was
FAULTS = [None, ("tokens", "mask"), ("tokens", "vocab"), ("tokens", "negative"), ("tokens", "float"),
          ("tokens", "short"), ("tokens", "list"), ("confidences", "nan"), ("confidences", "inf"),
          ("confidences", "long"), ("confidences", "long_shape"), ("unmask", "long"), ("unmask", "short"),
          ("proposal", "tuple"), ("proposal", "none")]


class Spoiled(ThresholdPolicy):
    """The threshold rule whose proposal is spoiled as ``fault`` says from the ``at``-th step on."""

    def __init__(self, fault, at: int = 0, mask_id: int = 511, vocab: int = 512):
        self.fault, self.at, self.calls, self.mask_id, self.vocab = fault, at, 0, mask_id, vocab

    def propose(self, row, block, logits, finish):
        p = super().propose(row, block, logits, finish)
        self.calls += 1
        if self.fault is None or self.calls <= self.at:
            return p
        field, how = self.fault
        if field == "proposal":
            return (p.tokens, p.confidences, p.unmask) if how == "tuple" else None
        t = getattr(p, field)
        spoiled = {"mask": lambda: torch.full_like(t, self.mask_id), "vocab": lambda: t + self.vocab,
                   "negative": lambda: t - self.vocab, "float": lambda: t.float(), "short": lambda: t[:-1] if
                   len(t) > 1 else t[:0], "list": lambda: t.tolist(), "nan": lambda: torch.full_like(t, float("nan")),
                   "inf": lambda: torch.full_like(t, float("inf")), "long": lambda: t.long(),
                   "long_shape": lambda: t[None]}[how]()
        return Proposal(**{**vars(p), field: spoiled})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fault=st.sampled_from(FAULTS), at=st.integers(0, 6), mode=st.sampled_from(["diffusion", "speculative"]),
       batch=st.booleans())
def test_a_custom_policys_proposal_is_checked_where_it_enters_the_loop(tiny_engine, fault, at, mode, batch):
    """A rule proposing the mask token returned mask tokens as the answer; ids out of the vocabulary,
    negative, float or of the wrong length were raw IndexError / RuntimeError; NaN confidences were
    blamed on the logits. Every outcome is a result of real tokens or a GenerationError naming the
    rule's method and the field, and the engine's greedy tokens are unchanged afterwards."""
    prompts = [PROMPTS[0], PROMPTS[2]] if batch else PROMPTS[0]
    before = tiny_engine.generate(PROMPTS[1], max_new_tokens=20)
    policy = Spoiled(fault, at)
    try:
        r = tiny_engine.generate(prompts, mode=mode, max_new_tokens=24, policy=policy)
    except GenerationError as e:
        assert fault is not None, e
        assert "Spoiled.propose: " in str(e) and ("row " in str(e)) == batch, e
        field = "Proposal(tokens" if fault[0] == "proposal" else f"Proposal.{fault[0]}"
        assert field in str(e), e
    else:
        results = r if batch else [r]
        assert all(tiny_engine.mask_token_id not in x.token_ids for x in results)
        assert fault is None or policy.calls <= at  # a spoiled proposal never passes
    assert tiny_engine.generate(PROMPTS[1], max_new_tokens=20).token_ids == before.token_ids


def test_a_look_ahead_rules_proposal_is_checked_too(tiny_engine):
    class AheadMask(LookAheadPolicy):
        def propose_ahead(self, row, block, ahead, logits):
            p = super().propose_ahead(row, block, ahead, logits)
            return Proposal(torch.full_like(p.tokens, 511), p.confidences, torch.ones_like(p.unmask))

    with pytest.raises(GenerationError, match=r"AheadMask.propose_ahead: block \d+, step \d+: Proposal.tokens "
                                              r"proposes the mask token 511"):
        tiny_engine.generate(PROMPTS[1], max_new_tokens=48, policy=AheadMask(start=0.0, threshold=0.01))


def test_nan_confidences_from_finite_logits_are_the_rules(tiny_engine):
    class NaNs(DecodingPolicy):
        def propose(self, row, block, logits, finish):
            tokens = logits.argmax(-1)
            return Proposal(tokens, torch.full(tokens.shape, float("nan")), torch.ones_like(tokens, dtype=torch.bool))

    with pytest.raises(GenerationError, match="NaNs.propose: block 0, step 0: Proposal.confidences holds NaN or inf "
                                              "while the step's logits are finite"):
        tiny_engine.generate(PROMPTS[0], max_new_tokens=8, policy=NaNs())


@pytest.mark.parametrize("method", ["finishes_block", "look_ahead"])
@pytest.mark.parametrize("answer", [torch.tensor([True, False]), "yes", None, 1])
def test_a_rules_yes_or_no_is_a_bool(tiny_engine, method, answer):
    """finishes_block / look_ahead returning a tensor was 'Boolean value of Tensor ... is ambiguous'."""
    rule = type("Odd", (LookAheadPolicy,), {method: lambda self, row, block: answer})(start=0.0)
    with pytest.raises(GenerationError, match=rf"Odd.{method}: block 0, step 0: returned .*expected True or False"):
        tiny_engine.generate(PROMPTS[1], max_new_tokens=40, policy=rule)
    assert tiny_engine.generate(PROMPTS[1], max_new_tokens=8).token_ids
