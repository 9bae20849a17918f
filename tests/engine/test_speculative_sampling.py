"""Sampled speculative decoding gives AR's distribution, measured on the engine (issue 30): a random
model with a vocabulary of 8 (the mask token included: AR may sample it, a draft never does),
six prompts in one batch, two tokens each (the causal token c0 and one drafted, accepted or
replaced by the acceptance rule), many seeds. The counts of each prompt's (x0, x1) pairs are
checked against the exact AR distribution p(x0) p(x1 | x0) (from the model's causal logits) by
a chi-square test, cells of small expectation binned together; the same test with the acceptance
rule broken (every draft accepted, or greedy acceptance in a sampled run) fails by far. Mode "mtp"
(issue 53: drafts from the model's multi-token-prediction head, a random one here) is held to the
same test.
The function-level test of the rule, with 40,000 draws, is tests/test_acceptance.py."""
import pytest
import torch

from clover_lab import CloverConfig, CloverModel, Engine
from clover_lab.engine import speculative
from clover_lab.engine.acceptance import greedy_accept

pytestmark = pytest.mark.usefixtures("gen_one_thread")
V = 8
PROMPTS = [[1, 2, 3], [4, 0, 6], [2, 2, 5], [6, 1, 0], [3, 5, 1], [0, 4, 4]]
P_VALUE = 1e-3  # the right rule must pass at this level; a broken one fall below it


@pytest.fixture(scope="module")
def small_vocab():
    config = CloverConfig.preset("clover-tiny", vocab_size=V, mask_token_id=V - 1, eos_token_id=None,
                                 block_size=4, hidden_size=32, num_hidden_layers=2, mtp_num_hidden_layers=1)
    model = CloverModel.random(config, seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # distributions far from uniform, drafts far from the causal ones
        model.mtp.norm.weight.fill_(3.0)  # the head's drafts sharper still (x4), far from the causal ones
    exact = []
    for p in PROMPTS:  # AR's distribution of the first two tokens, [V * V]
        p0 = model.logits(torch.tensor([p]))[0, -1].softmax(-1)
        nxt = model.logits(torch.tensor([p + [a] for a in range(V)]))[:, -1].softmax(-1)
        exact.append((p0[:, None] * nxt).flatten())
    return Engine(model), torch.stack(exact)


def p_value(engine, exact, seeds: int, mode: str = "speculative") -> float:
    counts = torch.zeros_like(exact)
    for seed in range(seeds):
        batch = engine.generate(PROMPTS, mode=mode, max_new_tokens=2, temperature=1.0, seed=seed)
        for k, row in enumerate(batch):
            counts[k, row.token_ids[0] * V + row.token_ids[1]] += 1
    return chi_square_p(counts, exact * seeds)


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square over every row's cells, binned in order of rising expectation until each
    bin expects >= 5; the p-value of the sum (degrees of freedom: bins less one, per row)."""
    chi2, df = 0.0, 0
    for o, e in zip(observed.tolist(), expected.tolist()):
        bins, so, se = [], 0.0, 0.0
        for i in sorted(range(len(e)), key=e.__getitem__):
            so, se = so + o[i], se + e[i]
            if se >= 5:
                bins.append([so, se])
                so = se = 0.0
        bins[-1][0] += so
        bins[-1][1] += se
        chi2 += sum((a - b) ** 2 / b for a, b in bins)
        df += len(bins) - 1
    return torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(chi2 / 2)).item()


def accept_every_draft(draft, q, p, generator):
    n = draft.shape[0]
    return n, int(torch.multinomial(p[n], 1, generator=generator))


def greedy_acceptance(draft, q, p, generator):
    n = greedy_accept(draft.tolist(), p.argmax(-1).tolist())
    return n, int(p[n].argmax())


def test_sampled_speculative_follows_the_ar_distribution(small_vocab):
    engine, exact = small_vocab
    assert p_value(engine, exact, seeds=60) > P_VALUE


@pytest.mark.parametrize("rule", [accept_every_draft, greedy_acceptance], ids=lambda f: f.__name__)
def test_a_broken_acceptance_rule_fails_the_same_test(small_vocab, monkeypatch, rule):
    engine, exact = small_vocab
    monkeypatch.setattr(speculative, "speculative_accept", rule)
    assert p_value(engine, exact, seeds=20) < P_VALUE


def test_sampled_mtp_follows_the_ar_distribution(small_vocab, monkeypatch):
    engine, exact = small_vocab
    assert p_value(engine, exact, seeds=60, mode="mtp") > P_VALUE
    monkeypatch.setattr(speculative, "speculative_accept", accept_every_draft)  # the head's drafts taken as they come
    assert p_value(engine, exact, seeds=20, mode="mtp") < P_VALUE
