"""The logit lens per denoising step and the routing lens (issue 17)."""
import pytest
import torch

from clover_lab import lens
from clover_lab.errors import InputError

pytestmark = pytest.mark.usefixtures("gen_one_thread")
PROMPT = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64]
KW = dict(max_new_tokens=32, threshold=0.3)


def test_logit_lens_per_step_ends_in_the_models_own_decision(tiny_engine):
    steps = []
    with tiny_engine.hooks({"denoise.step": lambda ev: steps.append(ev)}):
        lz = lens.logit_lens(tiny_engine, PROMPT, k=3, **KW)
    r = lz.result
    assert r.token_ids == tiny_engine.generate(PROMPT, **KW).token_ids  # the lens changes nothing
    assert len(lz.steps) == r.stats.preview_forwards == len(steps)
    L = tiny_engine.model.config.num_hidden_layers
    for s, ev in zip(lz.steps, steps):
        assert (s.block, s.step, s.mode) == (ev.block, ev.step, "preview")
        start = len(PROMPT) + 16 * ev.block
        assert s.positions == [start + p for p in ev.masked]
        assert s.ids.shape == (L, len(ev.masked), 3) and s.probs.shape == s.ids.shape
        # the last layer's lens is the model's own distribution at this step
        assert s.ids[-1, :, 0].tolist() == ev.candidates.tolist()
        torch.testing.assert_close(s.probs[-1, :, 0], ev.logits.softmax(-1).max(-1).values)
        assert s.unmasked == [start + p for p in ev.unmask]
        assert (s.probs[:, :, :-1] >= s.probs[:, :, 1:]).all()
    decided = lz.decided()
    assert sorted(decided) == list(range(len(PROMPT), len(PROMPT) + 32))
    for p, (step, layer) in decided.items():
        assert 0 <= step < max(r.stats.steps_per_block) and 0 <= layer < L
        assert lz.at((p - len(PROMPT)) // 16, step).top(L - 1, p)[0][0] == \
            r.token_ids[p - len(PROMPT)]
    with pytest.raises(KeyError):
        lz.at(5, 0)


def test_logit_lens_of_an_ar_run(tiny_engine):
    lz = lens.logit_lens(tiny_engine, PROMPT, k=2, mode="ar", max_new_tokens=6)
    r = lz.result
    # the prefill reads the prompt's last row, each commit but the last its token's row
    assert [(s.block, s.step, s.mode) for s in lz.steps] == [(None, None, "commit")] + [(i, None, "commit")
                                                                                         for i in range(5)]
    assert [s.ids[-1, 0, 0].item() for s in lz.steps] == r.token_ids
    assert [s.positions for s in lz.steps] == [[len(PROMPT) - 1 + i] for i in range(6)]
    assert sorted(lz.decided()) == list(range(len(PROMPT), len(PROMPT) + 6))
    # a lens step's first layers need not agree with the last: decided_layer says from where they do
    s = lz.steps[0]
    layer = s.decided_layer()[0]
    assert all(s.ids[i, 0, 0] == s.ids[-1, 0, 0] for i in range(layer, s.ids.shape[0]))
    assert layer == 0 or s.ids[layer - 1, 0, 0] != s.ids[-1, 0, 0]


def test_routing_lens_counts_flips_between_steps_and_at_commit(tiny_engine):
    def force_previews(ev):
        if ev.mode == "preview":
            ev.force([0, 1])

    # the forcing hook first: a capture records what the hooks before it left
    with tiny_engine.hooks({"layers.*.moe.route": force_previews}), tiny_engine.capture("layers.*.moe.route") as cap:
        r = tiny_engine.generate(PROMPT, **KW)
    rl = lens.routing_lens(cap)
    L = tiny_engine.model.config.num_hidden_layers
    assert len(rl.rows) == L * r.stats.preview_forwards
    # a recording keeps the routing the hook set: every preview routes to {0, 1}, so nothing flips
    assert all(row["flip_rate"] in (None, 0.0) for row in rl.rows)
    assert {(c["layer"], c["block"]) for c in rl.commits} == {(i, b) for i in range(L) for b in range(2)}
    for c in rl.commits:
        commit = next(rec for rec in cap["layers.*.moe.route"]
                      if rec["layer"] == c["layer"] and rec["mode"] == "commit" and rec.block == c["block"])
        kept = torch.isin(commit["expert_ids"], torch.tensor([0, 1])).float().mean()
        assert c["overlap"] == pytest.approx(float(kept)) and c["flip_rate"] == pytest.approx(1 - float(kept))
    row = rl.rows[0]
    rec = next(x for x in cap["layers.0.moe.route"] if x["mode"] == "preview")
    p = rec["router_probs"]
    assert row["entropy"] == pytest.approx(float(-(p * p.log()).sum(-1).mean()), rel=1e-5)
    summary = rl.by_layer()
    assert [s["layer"] for s in summary] == list(range(L)) and all(s["step_flip_rate"] in (0.0, None) for s in summary)


def test_routing_lens_of_a_free_run(tiny_engine):
    rl = lens.routing_lens(tiny_engine, PROMPT, **KW)
    flips = [row["flip_rate"] for row in rl.rows if row["flip_rate"] is not None]
    assert flips and all(0 <= f <= 1 for f in flips)
    assert lens.overlap(torch.tensor([[1, 2]]), torch.tensor([[2, 5]])).tolist() == [0.5]


def test_coreset_sweep(tiny_engine):
    E = tiny_engine.model.config.num_experts
    rows = lens.coreset_sweep(tiny_engine, [PROMPT, PROMPT[::-1]], sizes=[2, E - 1], **KW)
    assert [row["coreset_size"] for row in rows] == [None, 2, E - 1]
    assert rows[0]["tokens_equal"] == 1.0  # the reference against itself
    assert all(0 <= row["tokens_equal"] <= 1 for row in rows)
    assert all(row["tokens_per_forward"] > 0 and row["seconds_per_step"] > 0 for row in rows)
    for bad in (E, E + 1, 1):  # every expert restricts nothing; fewer than top-k cannot route
        with pytest.raises(ValueError, match="coreset sizes"):
            lens.coreset_sweep(tiny_engine, [PROMPT], sizes=[bad], **KW)


OTHER = [7, 8, 9, 200, 300]


def test_the_routing_lens_of_a_batch_is_read_per_row(tiny_engine):
    from clover_lab import lens

    for r, prompt in enumerate([PROMPT, OTHER]):
        alone = lens.routing_lens(tiny_engine, prompt, **KW)
        row = lens.routing_lens(tiny_engine, [PROMPT, OTHER], row=r, **KW)
        assert [(x["layer"], x["block"], x["step"]) for x in row.rows] == \
               [(x["layer"], x["block"], x["step"]) for x in alone.rows]
        for a, b in zip(alone.by_layer(), row.by_layer()):
            assert b["step_flip_rate"] == pytest.approx(a["step_flip_rate"], abs=0.05)
            assert b["entropy"] == pytest.approx(a["entropy"], rel=1e-3)
    with pytest.raises(InputError, match=r"batch of 2 prompts.*row=0 .. 1"):
        lens.routing_lens(tiny_engine, [PROMPT, OTHER], **KW)
    with pytest.raises(InputError, match="one generation"):
        lens.routing_lens(tiny_engine, PROMPT, row=0, **KW)
    with tiny_engine.capture("layers.*.moe.route") as cap:  # a recording of a batch, read per row
        tiny_engine.generate([PROMPT, OTHER], **KW)
    with pytest.raises(InputError, match=r"batch of rows 0..1.*row=0 .. 1"):
        lens.routing_lens(cap)
    assert lens.routing_lens(cap, row=1).by_layer() == lens.routing_lens(tiny_engine, [PROMPT, OTHER], row=1,
                                                                          **KW).by_layer()


@pytest.mark.parametrize("call,match", [
    (lambda e, lens, pt: lens.logit_lens(e, PROMPT, k=0, **KW), "k=0"),
    (lambda e, lens, pt: lens.logit_lens(e, PROMPT, k=-3, **KW), "k=-3"),
    (lambda e, lens, pt: lens.logit_lens(e, [PROMPT, OTHER], **KW), "batch of 2"),
    (lambda e, lens, pt: lens.coreset_sweep(e, [PROMPT], sizes=[2], mode="ar", max_new_tokens=4), "mode='ar'"),
    (lambda e, lens, pt: lens.coreset_sweep(e, [PROMPT], sizes=4, **KW), "sizes=4"),
    (lambda e, lens, pt: lens.coreset_sweep(e, [PROMPT], sizes=["4"], **KW), "ints"),
    (lambda e, lens, pt: lens.coreset_sweep(e, [PROMPT], sizes=[2.5], **KW), "ints"),
    (lambda e, lens, pt: pt.Site("layers.0.output", 0, 0, positions=5), r"positions=5.*\(5,\)"),
    (lambda e, lens, pt: pt.Site("layers.0.output", 0, 0, positions=[]), "one or more"),
    (lambda e, lens, pt: pt.Site("layers.0.output", -1, 0), "block=-1"),
    (lambda e, lens, pt: pt.Site("layers.0.output", None, 2), "without a block"),
    (lambda e, lens, pt: pt.Site("layers.x.output", 0, 0), "layers.x.output"),
    (lambda e, lens, pt: pt.record(e, [PROMPT, OTHER], **KW), "batch"),
    (lambda e, lens, pt: pt.measure(e, PROMPT, pt.probability(11, 512), 0, 0, **KW), r"\[512\].*vocabulary"),
    (lambda e, lens, pt: pt.logit_diff(11, 3, -1), "token=-1"),
])
def test_lens_and_patching_arguments_are_named(tiny_engine, call, match):
    from clover_lab import lens, patching

    with pytest.raises(InputError, match=match):
        call(tiny_engine, lens, patching)
    assert len(tiny_engine.generate(PROMPT, max_new_tokens=4).token_ids) == 4


def test_coreset_sweep_takes_one_prompt_as_one(tiny_engine):
    from clover_lab import lens

    rows = lens.coreset_sweep(tiny_engine, PROMPT, sizes=[2], max_new_tokens=8, threshold=0.3)
    assert [r["prompts"] for r in rows] == [1, 1]


@pytest.mark.parametrize("repeat", [-3, 0, 1.5, True, "2"])
def test_coreset_sweep_repeat_is_a_positive_count(tiny_engine, repeat):
    """repeat=-3 (or 0) was read as 1: a setting silently ignored."""
    from clover_lab.errors import InputError
    from clover_lab.lens.coreset import coreset_sweep

    with pytest.raises(InputError, match=rf"coreset_sweep repeat={repeat!r}: expected a positive integer"):
        coreset_sweep(tiny_engine, [5, 6, 7], sizes=[2], repeat=repeat, max_new_tokens=4)


def test_coreset_sweep_interleaves_its_repeats(tiny_engine, monkeypatch):
    # notebook 07 timed no coreset at 67.7 ms a step against 53.9 ms with 15 of 16 experts: the
    # sizes ran one after another, the reference first, on a machine that changed meanwhile
    from clover_lab import lens

    order = []
    generate = tiny_engine.generate

    def spy(prompt, **kw):
        order.append(kw.get("coreset_size"))
        return generate(prompt, **kw)

    monkeypatch.setattr(tiny_engine, "generate", spy)
    E = tiny_engine.model.config.num_experts
    lens.coreset_sweep(tiny_engine, [PROMPT], sizes=[2, E - 1], repeat=2, max_new_tokens=4, threshold=0.3)
    assert order == [None, 2, E - 1] * 2
