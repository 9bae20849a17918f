"""min_p, per-token log-probabilities (and top-k alternatives) and the unmask step of every
response token, in both modes; nothing computed when log-probabilities are not asked for."""
import pytest
import torch

from clover_lab import SamplerSettings, SettingsError
from clover_lab.cli.main import build_parser
from clover_lab.engine import row, sampling

PROMPT = [5, 6, 7, 8, 9]


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), "0.1", True])
def test_min_p_is_validated(value):
    with pytest.raises(SettingsError, match="min_p"):
        SamplerSettings(min_p=value)


def test_min_p_filters_and_is_a_cli_option(tiny_engine):
    logits = torch.tensor([[2.0, 1.0, 0.0, -3.0]])
    kept = sampling.filter_logits(logits, min_p=0.3).isfinite()  # p / p_max: 1, 0.37, 0.14, 0.007
    assert kept.tolist() == [[True, True, False, False]]
    assert sampling.filter_logits(logits, min_p=0.0).isfinite().all()
    args = build_parser().parse_args(["generate", "--prompt", "x", "--min-p", "0.25"])
    assert args.min_p == 0.25
    greedy = tiny_engine.generate(PROMPT, mode="ar", max_new_tokens=12)
    only_top = tiny_engine.generate(PROMPT, mode="ar", max_new_tokens=12, temperature=1.0, min_p=1.0, seed=3)
    loose = tiny_engine.generate(PROMPT, mode="ar", max_new_tokens=12, temperature=1.0, seed=3)
    assert only_top.token_ids == greedy.token_ids != loose.token_ids


def test_ar_logprobs_match_the_model(tiny_engine):
    r = tiny_engine.generate(PROMPT, mode="ar", max_new_tokens=10, logprobs=3)
    assert r.unmask_steps == [0] * 10
    ids = torch.tensor([PROMPT + r.token_ids])
    logp = tiny_engine.model.logits(ids)[0].float().log_softmax(-1)
    for i, (t, lp, top) in enumerate(zip(r.token_ids, r.logprobs, r.top_logprobs)):
        want = logp[len(PROMPT) - 1 + i]
        assert lp == pytest.approx(float(want[t]), abs=1e-4)
        assert [tok for tok, _ in top] == want.topk(3).indices.tolist() and top[0][0] == t  # greedy: the best
        assert top[0][1] == pytest.approx(lp, abs=1e-6) and len(top) == 3


def test_diffusion_logprobs_and_unmask_steps(tiny_engine):
    r = tiny_engine.generate(PROMPT, max_new_tokens=32, threshold=0.5, logprobs=2)
    n, bs = len(r.token_ids), tiny_engine.block_size
    assert len(r.logprobs) == len(r.top_logprobs) == len(r.unmask_steps) == n
    for b, steps in enumerate(r.stats.steps_per_block):
        block = r.unmask_steps[b * bs:(b + 1) * bs]
        assert set(block) <= set(range(steps)) and max(block) == steps - 1
    for t, lp, top in zip(r.token_ids, r.logprobs, r.top_logprobs):
        assert top[0] == (t, pytest.approx(lp, abs=1e-6)) and lp <= 0  # greedy: each its step's best
    plain = tiny_engine.generate(PROMPT, max_new_tokens=32, threshold=0.5, logprobs=0)
    assert plain.token_ids == r.token_ids and plain.logprobs == r.logprobs and plain.top_logprobs is None
    d = r.to_dict()
    assert d["logprobs"] == r.logprobs and d["unmask_steps"] == r.unmask_steps


def test_batch_rows_have_their_own_logprobs(tiny_engine):
    for mode in ("diffusion", "ar"):
        single = tiny_engine.generate(PROMPT, mode=mode, max_new_tokens=20, logprobs=0)
        batch = tiny_engine.generate([PROMPT, [9, 10, 11]], mode=mode, max_new_tokens=20, logprobs=0)
        assert batch[0].token_ids == single.token_ids
        assert batch[0].logprobs == pytest.approx(single.logprobs, abs=1e-4)
        assert batch[0].unmask_steps == single.unmask_steps


def test_nothing_computed_without_logprobs(tiny_engine, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("log-probabilities computed although not asked for")

    monkeypatch.setattr(row, "log_probs", refuse)
    for mode in ("diffusion", "ar"):
        r = tiny_engine.generate(PROMPT, mode=mode, max_new_tokens=20)
        assert r.logprobs is None and r.top_logprobs is None and len(r.unmask_steps) == 20
    with pytest.raises(AssertionError, match="not asked for"):
        tiny_engine.generate(PROMPT, max_new_tokens=4, logprobs=0)


def test_speculative_tokens_carry_ars_logprobs_and_no_unmask_step(tiny_engine):
    """Speculative tokens are the causal pass's: no denoising step unmasked them, and their
    log-probabilities are AR's (they were refused; mode "mtp" shares the verify: test_mtp.py)."""
    r = tiny_engine.generate([1, 2, 3], mode="speculative", max_new_tokens=8, logprobs=1)
    ar = tiny_engine.generate([1, 2, 3], mode="ar", max_new_tokens=8, logprobs=1)
    assert r.token_ids == ar.token_ids and r.unmask_steps == [None] * len(r.token_ids)
    torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(ar.logprobs), rtol=0, atol=1e-4)
    assert [[t for t, _ in top] for top in r.top_logprobs] == [[t for t, _ in top] for top in ar.top_logprobs]
    assert tiny_engine.generate([1, 2, 3], mode="speculative", max_new_tokens=8).logprobs is None
