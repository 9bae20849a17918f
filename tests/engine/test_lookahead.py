"""Multi-block decoding through the seam (issue 30): LookAheadPolicy previews the next block beside
the current one and unmasks its sure positions ahead. Settings validated, tokens never the mask,
hooks see every step (the look-ahead's too), batches equal one-by-one, fewer forwards than the
threshold rule, and the committed output consistent: what each step placed is what the causal
commits committed, block by block, also when the look-ahead resolves a whole block or an EOS."""
import pytest
import torch

from clover_lab import Engine
from clover_lab.engine import LookAheadPolicy, make_policy
from clover_lab.engine.sampling import SettingsError

pytestmark = pytest.mark.usefixtures("gen_one_thread")
PROMPTS = [[5, 17, 33], [5, 17, 33, 100, 2, 9, 77, 301, 12, 64], [400, 3, 250, 7, 88, 19]]


@pytest.mark.parametrize("bad", [dict(start=-0.1), dict(start=1.5), dict(start="x"), dict(threshold=0),
                                 dict(threshold=1.2), dict(threshold=True), dict(start=float("nan"))])
def test_settings_are_validated(bad):
    with pytest.raises(SettingsError, match=next(iter(bad))):
        LookAheadPolicy(**bad)


def test_made_by_name():
    p = make_policy("lookahead:start=0.25,threshold=0.5")
    assert isinstance(p, LookAheadPolicy) and (p.start, p.threshold) == (0.25, 0.5)


def watched(engine, prompt, policy, **kw):
    """The result, the denoise.step and block.commit events, and the ids each forward committed."""
    log, committed = [], []
    forward = engine.model.forward

    def spy(cache, commit_ids=None, preview_ids=None, **k):
        if commit_ids is not None:
            committed.append(torch.as_tensor(commit_ids).reshape(-1).tolist())
        return forward(cache, commit_ids, preview_ids, **k)

    packed = engine.model.forward_packed

    def spy_packed(cache, segments, ids, wanted, **k):  # a packed step: each segment's commit
        committed.extend(ids[s.offset:s.offset + s.commit].tolist() for s in segments if s.commit)
        return packed(cache, segments, ids, wanted, **k)

    engine.model.forward, engine.model.forward_packed = spy, spy_packed
    try:
        with engine.hooks({"denoise.step": log.append, "block.commit": log.append}):
            r = engine.generate(prompt, policy=policy, **kw)
    finally:
        del engine.model.forward, engine.model.forward_packed
    steps = [e for e in log if hasattr(e, "unmask")]
    ahead = [e for i, e in enumerate(log) if e in steps and e.block and  # a step before the block before it was committed
             not any(c.block == e.block - 1 for c in log[:i] if c not in steps)]
    return r, steps, [e for e in log if e not in steps], committed, ahead


def check_consistent(r, prompt, steps, commits, committed, block_size):
    """The causal commits hold the prompt then exactly the response; every block.commit's tokens are
    the response's at its start; each position was unmasked once, by a step whose token is the
    committed one (the look-ahead's steps of a block that began included)."""
    assert sum(committed, [])[:len(prompt)] == prompt and sum(committed, [])[len(prompt):] == r.token_ids
    assert sum((c.tokens for c in commits), []) == r.token_ids
    for c in commits:
        assert c.tokens == r.token_ids[c.start - len(prompt):][:len(c.tokens)]
    placed = {}
    for e in steps:
        for p in e.unmask:
            key = (e.block, p)
            assert key not in placed  # unmasked once
            placed[key] = e.tokens.get(p, int(e.candidates[e.masked.index(p)]))
    for i, t in enumerate(r.token_ids):
        assert placed[(i // block_size, i % block_size)] == t


def test_steps_hooks_and_commits_are_consistent(tiny_engine):
    policy = LookAheadPolicy(start=0.25, threshold=0.3)
    r, steps, commits, committed, ahead = watched(tiny_engine, PROMPTS[1], policy, max_new_tokens=48, threshold=0.5)
    assert tiny_engine.mask_token_id not in r.token_ids and len(r.token_ids) == 48
    assert len(steps) == sum(r.stats.steps_per_block)  # hooks see every step, the look-ahead's included
    assert any(e.unmask for e in ahead)  # tokens were unmasked in a next block before its predecessor's commit
    assert [c.block for c in commits] == list(range(r.stats.blocks))
    check_consistent(r, PROMPTS[1], steps, commits, committed, tiny_engine.block_size)


def test_fewer_forwards_than_the_threshold_rule(tiny_engine):
    fewer = 0
    for p in PROMPTS:
        base = tiny_engine.generate(p, max_new_tokens=48, threshold=0.5)
        look = tiny_engine.generate(p, max_new_tokens=48, threshold=0.5, policy=LookAheadPolicy(0.25, 0.3))
        assert look.stats.forwards <= base.stats.forwards, p  # a block resolved in one step each cannot go lower
        fewer += look.stats.forwards < base.stats.forwards
    assert fewer >= 2


def test_a_block_resolved_ahead_and_an_eos_ahead(tiny_engine):
    """threshold 0.01: the first look-ahead step resolves the whole next block, whose fused forward
    then only commits the block before it; an EOS placed ahead ends the row after its block."""
    policy = LookAheadPolicy(start=0.5, threshold=0.01)
    r, steps, commits, committed, ahead = watched(tiny_engine, PROMPTS[0], policy, max_new_tokens=64)
    assert 1 in r.stats.steps_per_block[1:]  # its one step was the look-ahead that resolved it
    check_consistent(r, PROMPTS[0], steps, commits, committed, tiny_engine.block_size)
    eos = r.token_ids[20]  # placed by a look-ahead step of block 1
    engine = Engine(tiny_engine.model)
    engine.eos_token_ids = [eos]
    r2, steps, commits, committed, _ = watched(engine, PROMPTS[0], policy, max_new_tokens=64)
    assert r2.stop_reason == "eos" and r2.token_ids[-1] == eos and eos not in r2.token_ids[:-1]
    check_consistent(r2, PROMPTS[0], steps, commits, committed, engine.block_size)


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.7, seed=5, repetition_penalty=1.3)], ids=["greedy", "sampled"])
def test_batches_equal_one_by_one(tiny_engine, kw):
    policy = LookAheadPolicy(start=0.25, threshold=0.3)
    batch = tiny_engine.generate(PROMPTS, max_new_tokens=40, policy=policy, threshold=0.5, **kw)
    for p, row in zip(PROMPTS, batch):
        alone = tiny_engine.generate(p, max_new_tokens=40, policy=policy, threshold=0.5, **kw)
        assert row.token_ids == alone.token_ids and row.stats.steps_per_block == alone.stats.steps_per_block


def test_the_command_line_takes_it(capsys):
    from clover_lab.cli.main import main

    assert main(["generate", "--prompt-ids", "5,17,33", "--max-new-tokens", "40", "--policy",
                 "lookahead:start=0.5,threshold=0.5", "--no-progress", "--json"]) == 0
    assert main(["generate", "--prompt-ids", "5,17,33", "--max-new-tokens", "8", "--policy",
                 "lookahead:start=2", "--no-progress"]) != 0
    assert "LookAheadPolicy start=2" in capsys.readouterr().err


def test_the_static_steps_and_a_coreset_take_the_longer_canvas(tiny_engine):
    policy = LookAheadPolicy(start=0.25, threshold=0.3)
    eager = tiny_engine.generate(PROMPTS[1:], max_new_tokens=40, policy=policy, threshold=0.5)
    static = Engine(tiny_engine.model)
    static.step_graphs = True  # the static-shape steps, eager on a CPU
    fast = static.generate(PROMPTS[1:], max_new_tokens=40, policy=policy, threshold=0.5)
    assert fast.stats.path == "static"
    assert [r.token_ids for r in fast] == [r.token_ids for r in eager]
    cored = tiny_engine.generate(PROMPTS[1], max_new_tokens=40, policy=policy, threshold=0.5, coreset_size=4)
    assert len(cored.token_ids) == 40 and tiny_engine.mask_token_id not in cored.token_ids
