"""Which drafted tokens a causal check accepts (speculative decoding, issue 30): pure functions
of the draft and of the two models' distributions, no model and no engine.

- :func:`greedy_accept`: the draft's leading tokens equal to the causal argmax; with the causal
  token at the first difference, that is exactly greedy AR decoding.
- :func:`speculative_accept`: the speculative-sampling rule (Leviathan et al. 2023, Chen et al.
  2023): drafted token d_i, drawn from the draft's distribution q_i, is accepted with probability
  min(1, p_i(d_i) / q_i(d_i)); the first rejected position takes a token drawn from
  normalise(max(0, p_i - q_i)), and a fully accepted draft one more token from p_N. The tokens
  it returns are distributed exactly as tokens drawn one by one from p (tests/test_acceptance.py).
  It needs q_i to be what d_i was really drawn from, independent of the later drafted tokens:
  true of a one-pass draft (every position drawn at once from one preview).
"""
from __future__ import annotations

import torch


def greedy_accept(draft: list[int], targets: list[int]) -> int:
    """How many leading ``draft`` tokens equal the causal ``targets`` (the causal choice at each
    drafted position)."""
    n = 0
    for d, t in zip(draft, targets):
        if d != t:
            break
        n += 1
    return n


def speculative_accept(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                       generator: torch.Generator | None = None) -> tuple[int, int]:
    """``draft`` [N] long drawn from ``q`` [N, V]; ``p`` [N + 1, V] the causal distributions at
    the N drafted positions and the one after. Returns (accepted n in [0, N], the token at
    position n). One host transfer."""
    N = draft.shape[0]
    if q.shape[0] != N or p.shape[0] != N + 1 or q.shape[1] != p.shape[1]:
        raise ValueError(f"speculative_accept: draft [N], q [N, V] and p [N + 1, V] expected; got "
                         f"{tuple(draft.shape)}, {tuple(q.shape)}, {tuple(p.shape)}")
    q, p = q.float(), p.float()
    rows = torch.arange(N, device=draft.device)
    ratio = p[rows, draft] / q[rows, draft].clamp_min(torch.finfo(torch.float32).tiny)
    u = torch.rand(N, generator=generator, device=draft.device)
    residual = (p[:N] - q).clamp_min(0)
    # a residual of zero mass (p == q) is never sampled from: that position always accepts
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:N])
    fix = torch.multinomial(torch.cat([residual, p[N:]]), 1, generator=generator).squeeze(-1)  # [N + 1]
    host = torch.cat([(u < ratio).long(), fix]).tolist()
    accepted = greedy_accept(host[:N], [1] * N)
    return accepted, host[N + accepted]
