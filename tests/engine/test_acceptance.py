"""The acceptance rules of speculative decoding (issue 30): greedy is AR's argmax, and the
speculative-sampling rule gives AR's distribution (measured on a tiny vocabulary)."""
import pytest
import torch

from clover_lab.engine.acceptance import greedy_accept, speculative_accept


def test_greedy_accepts_the_leading_agreement():
    assert greedy_accept([4, 5, 6], [4, 5, 7]) == 2
    assert greedy_accept([4, 5, 6], [1, 5, 6]) == 0
    assert greedy_accept([4, 5], [4, 5]) == 2
    assert greedy_accept([], []) == 0


def test_speculative_sampling_gives_the_causal_distribution():
    """V = 3, two drafted tokens drawn independently from q0, q1 (a one-pass draft); the causal
    model: p0 for the first token, p(. | x0) for the second. The first two output tokens of the
    rule (continued by the causal model when it stops early) follow p0(x0) p(x1 | x0): chi-square
    over the 9 cells, and each cell within 4 standard errors, over 40,000 draws."""
    g = torch.Generator().manual_seed(0)
    q = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    p0 = torch.tensor([0.2, 0.5, 0.3])
    table = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.3, 0.4, 0.3]])  # p(x1 | x0)
    trials = 40_000
    counts = torch.zeros(3, 3)
    drafts = torch.multinomial(q, trials, replacement=True, generator=g).T  # [trials, 2]
    for d in drafts:
        p = torch.stack([p0, table[d[0]], table[d[1]]])  # the causal rows given the draft prefix
        n, tok = speculative_accept(d, q, p, g)
        seq = d[:n].tolist() + [tok]
        if len(seq) < 2:
            seq.append(int(torch.multinomial(table[seq[0]], 1, generator=g)))
        counts[seq[0], seq[1]] += 1
    want = p0[:, None] * table
    freq = counts / trials
    se = (want * (1 - want) / trials).sqrt()
    assert ((freq - want).abs() <= 4 * se).all(), (freq, want)
    chi2 = ((counts - trials * want) ** 2 / (trials * want)).sum().item()
    assert chi2 < 26.1, chi2  # 8 degrees of freedom: p = 0.001


def test_speculative_accepts_everything_when_draft_and_causal_agree():
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert speculative_accept(torch.tensor([1, 2]), p[:2], p, g) == (2, 0)


def test_speculative_accept_checks_shapes():
    with pytest.raises(ValueError, match="q \\[N, V\\]"):
        speculative_accept(torch.tensor([1]), torch.ones(2, 3) / 3, torch.ones(2, 3) / 3)
