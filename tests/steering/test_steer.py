"""Steering schedules applied to generations (issue 42): a zero direction changes nothing, a steer
from step k on cannot change a token unmasked before step k, steers add exactly where their
schedule says (parts, blocks, steps, masked positions), a saved schedule replays, and bad input is
named before a run."""
import pytest
import torch

from clover_lab import steering
from clover_lab.errors import InputError
from clover_lab.hooks import points as P
from clover_lab.steering import Schedule, Steer

pytestmark = pytest.mark.usefixtures("gen_one_thread")
PROMPT = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64]
KW = dict(max_new_tokens=48, threshold=0.3, max_tokens_per_step=3)  # several steps per block
H = 64  # clover-tiny's hidden size


def _strong(seed=0, scale=40.0):
    return torch.randn(H, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("steer", [
    dict(layers=[0, 1, 2, 3]),
    dict(layers=[1, 3], kind="input", parts=("prompt", "commit", "preview")),
    dict(layers=2, kind="moe.output", positions="masked"),
    dict(layers=[0, 3], kind="gdn.output", steps="1:", positions="unmasked"),
])
def test_a_zero_direction_leaves_every_token_unchanged(tiny_engine, steer):
    if steer.get("kind") == "gdn.output":
        steer["layers"] = [0]  # layer 3 is an attention layer
    base = tiny_engine.generate(PROMPT, **KW)
    run = steering.steer(tiny_engine, PROMPT, Steer(torch.zeros(H), 3.0, **steer), **KW)
    assert run.result.token_ids == base.token_ids and run.result.unmask_steps == base.unmask_steps
    assert run.applied  # it did add (zeros), at every forward its schedule names
    assert not tiny_engine.model.hooks.attached()  # and left no hook behind


@pytest.mark.parametrize("mode", ["ar", "batch"])
def test_a_zero_direction_in_ar_and_in_a_batch(tiny_engine, mode):
    prompts = [PROMPT, [400, 3, 250, 7, 88, 19], [5, 17, 33]] if mode == "batch" else PROMPT
    kw = dict(mode="ar", max_new_tokens=12) if mode == "ar" else KW
    parts = ("prompt", "commit") if mode == "ar" else ("prompt", "commit", "preview")
    base = tiny_engine.generate(prompts, **kw)
    run = steering.steer(tiny_engine, prompts, Steer(torch.zeros(H), 1.0, layers=[0, 2], parts=parts), **kw)
    tokens = lambda out: [r.token_ids for r in out] if isinstance(out, list) else out.token_ids  # noqa: E731
    assert tokens(run.result) == tokens(base) and run.applied


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_steer_from_step_k_leaves_the_tokens_unmasked_before_k(tiny_engine, k):
    base = tiny_engine.generate(PROMPT, **KW)
    late = steering.steer(tiny_engine, PROMPT, Steer(_strong(), 1.0, layers=[1, 2], steps=f"{k}:"), **KW)
    fx = steering.compare(base, late.result, from_step=k)
    assert fx.n_changed > 0, "the steer must change something for the test to mean anything"
    kept, total = fx.kept_before
    assert total > 0 and kept == total
    # in the first block that differs (its prefix is the same), every changed token was unmasked at k or later
    assert all(c.step_before >= k for c in fx.in_first_block())
    assert {a.step for a in late.applied} <= set(range(k, 64)) and all(a.part == "preview" for a in late.applied)


def test_steers_add_only_where_their_schedule_says(tiny_engine):
    with tiny_engine.capture([P.DENOISE_STEP]) as cap:
        base = tiny_engine.generate(PROMPT, **KW)
    masked = {(r.block, r.step): set(r["masked"]) for r in cap[P.DENOISE_STEP]}
    # masked positions only, block 1, steps 0-1: block 0 is untouched, so its tokens are the unsteered ones
    run = steering.steer(tiny_engine, PROMPT, Steer(_strong(1), 1.0, layers=2, blocks=[1], steps="0:2",
                                                     positions="masked"), **KW)
    assert {(a.block, a.step) for a in run.applied} == {(1, 0), (1, 1)}
    assert run.result.token_ids[:16] == base.token_ids[:16]
    for a in run.applied:
        if (a.block, a.step) == (1, 0):
            assert a.positions == tuple(range(16))  # every position is masked at a block's first step
    # the positions added to at step 1 are those the steered run still had masked (the same as the
    # unsteered run's unless step 0 already differed)
    with tiny_engine.capture([P.DENOISE_STEP]) as cap2:
        steering.steer(tiny_engine, PROMPT, Steer(_strong(1), 1.0, layers=2, blocks=[1], steps="0:2",
                                                   positions="masked"), **KW)
    steered_masked = {(r.block, r.step): set(r["masked"]) for r in cap2[P.DENOISE_STEP]}
    step1 = next(a for a in run.applied if (a.block, a.step) == (1, 1))
    assert set(step1.positions) == steered_masked[(1, 1)] and len(step1.positions) < 16
    assert masked[(1, 0)] == set(range(16))
    # explicit positions, commit rows of blocks 0-1, the prompt
    run = steering.steer(tiny_engine, PROMPT, [Steer(_strong(2), 1.0, layers=0, positions=(3, 5), steps=[0]),
                                               Steer(_strong(3), 1.0, layers=3, parts=("commit",), blocks="0:2"),
                                               Steer(_strong(4), 1.0, layers=1, parts="prompt")], **KW)
    by = {i: [a for a in run.applied if a.steer == i] for i in range(3)}
    assert {a.positions for a in by[0]} == {(3, 5)} and {a.step for a in by[0]} == {0}
    assert {(a.part, a.block, a.step) for a in by[1]} == {("commit", 0, None), ("commit", 1, None)}
    assert [(a.part, a.rows) for a in by[2]] == [("prompt", len(PROMPT))]
    # AR has no previews: a preview steer adds nowhere and changes nothing
    ar = tiny_engine.generate(PROMPT, mode="ar", max_new_tokens=8)
    run = steering.steer(tiny_engine, PROMPT, Steer(_strong(), 1.0, layers=2), mode="ar", max_new_tokens=8)
    assert not run.applied and run.result.token_ids == ar.token_ids
    run = steering.steer(tiny_engine, PROMPT, Steer(_strong(), 1.0, layers=2, parts=("prompt", "commit")),
                         mode="ar", max_new_tokens=8)
    assert run.result.token_ids != ar.token_ids


def test_a_saved_schedule_replays_and_scoped_hooks_do_what_steer_does(tiny_engine, tmp_path):
    plan = Schedule([Steer(_strong(5), 0.5, layers=[1], steps="0:2", name="early"),
                     Steer(_strong(6), 0.5, layers=[2], blocks="1:", positions="masked", name="late")], name="p")
    first = steering.steer(tiny_engine, PROMPT, plan, **KW).result
    plan.save(tmp_path / "plan")
    again = steering.steer(tiny_engine, PROMPT, Schedule.load(tmp_path / "plan"), **KW).result
    assert again.token_ids == first.token_ids
    with tiny_engine.hooks(steering.hooks(tiny_engine, plan)):
        scoped = tiny_engine.generate(PROMPT, **KW)
    assert scoped.token_ids == first.token_ids
    assert tiny_engine.generate(PROMPT, **KW).token_ids != first.token_ids  # off after the block
    assert steering.hooks(tiny_engine, Schedule([])) == {}  # nothing to add: no hook at all
    assert set(steering.hooks(tiny_engine, plan)) == {"layers.1.output", "layers.2.output", P.DENOISE_STEP}


def test_bad_schedules_are_named_before_a_run(tiny_engine):
    for plan, match in [(Steer(torch.zeros(H), 1.0, layers=7), "unknown layer 7; the model has layers 0..3"),
                        (Steer(torch.zeros(H + 1), 1.0, layers=0), "65 values, the model's residual stream 64"),
                        (Steer(torch.zeros(H), 1.0, layers=3, kind="gdn.output"), "full_attention.*no gdn.output"),
                        (Steer(torch.zeros(H), 1.0, layers=0, positions=(16,)), "past the block"),
                        (Steer(torch.zeros(H), 1.0, layers=0, steps="40:"), "never reaches"),  # 16-step blocks
                        (Steer(torch.zeros(H), 1.0, layers=0, steps=[16, 17]), "never reaches")]:
        with pytest.raises(InputError, match=match):
            steering.steer(tiny_engine, PROMPT, plan, **KW)
    with pytest.raises(InputError, match="Steer objects"):
        steering.steer(tiny_engine, PROMPT, [torch.zeros(H)], **KW)


def test_directions_from_contrastive_prompts(tiny_engine):
    pairs = [([5, 17, 33, 100], [5, 17, 33, 200]), ([9, 77, 301], [9, 77, 302, 12])]
    d = steering.contrast(tiny_engine, pairs, layer=2)
    assert d.layer == 2 and d.kind == "output" and d.info["pairs"] == 2 and d.info["mean_row_norm"] > 0
    # by hand: each prompt's mean prefill row at layers.2.output, averaged per side
    means = []
    for prompt in [p for pair in pairs for p in pair]:
        with tiny_engine.capture(["layers.2.output"]) as cap:
            tiny_engine.generate(prompt, mode="ar", max_new_tokens=1)
        means.append(torch.cat([r["value"][0] for r in cap["layers.2.output"] if r.phase == "prefill"]).mean(0))
    want = (means[0] + means[2]) / 2 - (means[1] + means[3]) / 2
    torch.testing.assert_close(d.vector, want)
    last = steering.contrast(tiny_engine, pairs, layer=2, rows="last")
    assert not torch.equal(last.vector, d.vector)
    assert d.unit().norm == pytest.approx(1.0)
    for bad, match in [([], "non-empty"), ([("a",)], r"pairs\[0\]"), ("a b", "non-empty"),
                       ([([[1], [2]], [3])], "one prompt")]:
        with pytest.raises(InputError, match=match):
            steering.contrast(tiny_engine, bad, layer=2)
    with pytest.raises(InputError, match="layers 0..3"):
        steering.contrast(tiny_engine, pairs, layer=4)
    with pytest.raises(InputError, match="rows="):
        steering.contrast(tiny_engine, pairs, layer=1, rows="middle")


def test_compare_names_the_changes(tiny_engine, gen_tokenizer):
    base = tiny_engine.generate(PROMPT, **KW)
    run = steering.steer(tiny_engine, PROMPT, Steer(_strong(7), 1.0, layers=2, steps="0:1"), **KW)
    fx = steering.compare(base, run.result, from_step=0, name="early", tokenizer=gen_tokenizer)
    assert fx.n_changed == sum(a != b for a, b in zip(base.token_ids, run.result.token_ids)) + abs(
        len(base.token_ids) - len(run.result.token_ids))
    c = fx.changed[0]
    assert (c.before, c.after) == (base.token_ids[c.index], run.result.token_ids[c.index])
    assert c.block == c.index // 16 and fx.summary()["changed"] == fx.n_changed
    assert f"block {c.block} pos {c.position}" in fx.describe() and fx.pieces
    same = steering.compare(base, base)
    assert same.n_changed == 0 and same.first_block is None and same.describe() == "no token changed"
    with pytest.raises(InputError, match="GenerationResult"):
        steering.compare(base, "text")
    with pytest.raises(InputError, match="different prompts"):
        steering.compare(base, tiny_engine.generate([1, 2, 3], max_new_tokens=4))


@pytest.mark.slow
def test_steering_on_the_compiled_path_splits_at_its_layer(gen_model):
    """Compiled steps (torch.compile): the steered layer runs live, the others stay compiled, and
    the tokens are the eager path's."""
    from clover_lab import Engine

    plain, fast = Engine(gen_model), Engine(gen_model)
    plain.step_graphs, fast.compile_steps = False, True
    plan = Steer(_strong(8), 0.3, layers=2, parts=("prompt", "commit"))
    a = steering.steer(plain, PROMPT, plan, mode="ar", max_new_tokens=8).result
    b = steering.steer(fast, PROMPT, plan, mode="ar", max_new_tokens=8).result
    assert b.token_ids == a.token_ids
    assert b.stats.path == "compiled, layer 2 eager: a hook on layers.2.output"


def test_a_steering_that_stays_attached_forgets_old_generations(tiny_engine):
    from clover_lab.steering.steer import KEPT_RUNS

    s = steering.Steering(tiny_engine, Steer(torch.zeros(H), 1.0, layers=2, positions="masked"))
    with tiny_engine.hooks(s.hooks()):
        for _ in range(KEPT_RUNS + 3):
            tiny_engine.generate(PROMPT, max_new_tokens=4, threshold=0.3)
    assert len({k[0] for k in s._masked}) <= KEPT_RUNS and len(s._runs) == KEPT_RUNS


@pytest.mark.slow  # 1.6 s: two steered generations of 32-position blocks
def test_a_request_with_its_own_block_size_is_steered_at_its_blocks(tiny_engine):
    """Steering a request with its own block_size used the engine's: block 0 of a 32-position
    request was steered at 16 of its 32 positions."""
    from clover_lab import Request

    request = Request(PROMPT, max_new_tokens=32, block_size=32, threshold=0.3, max_tokens_per_step=3)
    run = steering.steer(tiny_engine, request, Steer(_strong(1), 1.0, layers=2, blocks=[0], steps=[0]))
    assert [a.positions for a in run.applied] == [tuple(range(32))]
    assert steering.steer(tiny_engine, request, Steer(_strong(1), 1.0, layers=2, steps="20:"))  # 32 steps reach it
