"""Exact self-speculative decoding (issue 30): greedy output equals mode="ar" token for token, in
fp32, on the embedded model, a random transformers-equal model and the tiny generation model,
with EOS and stop strings inside a block, penalties, batches and hooks."""

import pytest
import torch

import clover_lab
from clover_lab import CloverConfig, CloverModel, Engine, GenerationError, SamplerSettings, StopGeneration
from clover_lab.engine.requests import settings_for_mode
from clover_lab.engine.sampling import SettingsError

pytestmark = pytest.mark.usefixtures("gen_one_thread")
PROMPTS = [[5, 17, 33], [5, 17, 33, 100, 2, 9, 77, 301, 12, 64], [400, 3, 250, 7, 88, 19]]


@pytest.fixture(scope="module")
def default_engine():
    return clover_lab.load(dtype=torch.float32)


def same_as_ar(engine, prompt, **kw):
    ar = engine.generate(prompt, mode="ar", **settings_for_mode("ar", kw))  # AR reads no draft settings
    spec = engine.generate(prompt, mode="speculative", **kw)
    assert spec.token_ids == ar.token_ids
    assert spec.stop_reason == ar.stop_reason
    st = spec.stats
    assert st.blocks == len(st.drafted) == len(st.accepted) == len(st.rejected) == len(st.steps_per_block)
    assert all(a + r == d for d, a, r in zip(st.drafted, st.accepted, st.rejected))
    assert st.new_tokens == len(ar.token_ids) and st.forwards == st.preview_forwards + st.commit_forwards
    return ar, spec


def test_greedy_equals_ar_on_the_default_model(default_engine):
    tokens = forwards = 0
    for p in ["def parse(line):\n", "import os\n", "class Stack:\n    def push(self, item):\n"]:
        _, spec = same_as_ar(default_engine, p, max_new_tokens=48)
        tokens, forwards = tokens + spec.stats.new_tokens, forwards + spec.stats.forwards
    # drafts of this model are often right: fewer forwards than AR over the prompts (not on each: specimen
    # v3's drafts after "import os\n" are mostly rejected, 0.96 tokens per forward)
    assert tokens / forwards > 1.0


@pytest.mark.parametrize("passes", [1, 3])
def test_greedy_equals_ar_on_a_transformers_model(clover_ref, passes):
    engine = Engine(clover_ref)
    engine.mask_token_id, engine.block_size = 511, 8
    for p in PROMPTS:
        same_as_ar(engine, p, max_new_tokens=20, draft_passes=passes,
                   **({"threshold": 0.5} if passes > 1 else {}))  # one pass reads no threshold


def test_eos_and_stop_strings_inside_a_block(default_engine):
    prompt = "def parse(line):\n"
    ar = default_engine.generate(prompt, mode="ar", max_new_tokens=40)
    eos = ar.token_ids[13]  # a token first produced inside the first block
    first = ar.token_ids.index(eos)
    engine = clover_lab.load(dtype=torch.float32)
    engine.eos_token_ids = [eos]
    _, spec = same_as_ar(engine, prompt, max_new_tokens=40)
    assert spec.stop_reason == "eos" and len(spec.token_ids) == first + 1
    stop = ar.text[len(ar.text) // 2:len(ar.text) // 2 + 3]
    _, spec = same_as_ar(default_engine, prompt, max_new_tokens=40, stop=[stop])
    assert spec.stop_reason == "stop_string" and stop not in spec.text


def test_penalties_and_draft_passes(tiny_engine):
    for kw in (dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
               dict(draft_passes=2, threshold=0.3), dict(max_new_tokens=5)):
        for p in PROMPTS:
            same_as_ar(tiny_engine, p, **{"max_new_tokens": 40, **kw})


def test_a_batch_equals_ar_and_one_by_one(tiny_engine):
    kw = dict(max_new_tokens=40, repetition_penalty=1.2)
    batch = tiny_engine.generate(PROMPTS, mode="speculative", **kw)
    for p, row in zip(PROMPTS, batch):
        alone = tiny_engine.generate(p, mode="speculative", **kw)
        assert row.token_ids == alone.token_ids == tiny_engine.generate(p, mode="ar", **kw).token_ids
        assert row.stats.accepted == alone.stats.accepted and row.stats.forwards == alone.stats.forwards


def test_hooks_see_every_draft_step_and_the_acceptance(tiny_engine):
    steps, commits, routes = [], [], []
    with tiny_engine.hooks({"denoise.step": steps.append, "block.commit": commits.append,
                            "layers.*.moe.route": lambda e: routes.append(e.mode)}):
        spec = tiny_engine.generate(PROMPTS[1], mode="speculative", max_new_tokens=40, draft_passes=2, threshold=0.3)
    assert spec.token_ids == tiny_engine.generate(PROMPTS[1], mode="ar", max_new_tokens=40).token_ids
    st = spec.stats
    assert len(steps) == sum(st.steps_per_block) and len(commits) == st.blocks
    assert [c.accepted for c in commits] == st.accepted and [c.drafted for c in commits] == st.drafted
    assert [c.rejected for c in commits] == st.rejected
    assert sum(len(c.tokens) for c in commits) == len(spec.token_ids)
    assert all(c.tokens == spec.token_ids[c.start - len(PROMPTS[1]):][:len(c.tokens)] for c in commits)
    assert "preview" in routes and "commit" in routes


def test_a_commit_hook_stops_after_its_block(tiny_engine):
    with tiny_engine.hooks({"block.commit": lambda e: e.stop()}):
        spec = tiny_engine.generate(PROMPTS[0], mode="speculative", max_new_tokens=40)
    assert spec.stop_reason == "hook" and spec.stats.blocks == 1
    assert spec.token_ids == tiny_engine.generate(PROMPTS[0], mode="ar", max_new_tokens=40).token_ids[
        :len(spec.token_ids)]


def test_sampled_runs_are_seeded_and_settings_are_checked(tiny_engine):
    kw = dict(mode="speculative", max_new_tokens=30, temperature=0.8, seed=3)
    a, b = tiny_engine.generate(PROMPTS[0], **kw), tiny_engine.generate(PROMPTS[0], **kw)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30
    with pytest.raises(GenerationError, match="draft_passes=1"):
        tiny_engine.generate(PROMPTS[0], draft_passes=2, **kw)
    with pytest.raises(SettingsError, match="draft_passes"):
        SamplerSettings(draft_passes=0)


def test_the_denoising_view_shows_accepted_and_rejected_drafts(default_engine):
    pytest.importorskip("ipywidgets")
    from clover_lab.widgets import DenoiseView

    view = DenoiseView(default_engine, fps=1000)
    try:
        with default_engine.capture(["block.commit"]) as cap:
            result = default_engine.generate("def parse(line):\n", mode="speculative", max_new_tokens=24)
        view.flush()
        page = view.grid_html(view.state)
    finally:
        view.close()
    commits = cap["block.commit"]
    assert view.tokens() == result.token_ids and len(commits) == result.stats.blocks
    # accepted drafted positions that the response kept (the length may cut the last block)
    assert page.count("accepted by the causal check") == sum(min(c["accepted"], len(c["tokens"]) - 1) for c in commits)
    assert page.count("rejected by the causal check") == sum(
        c["drafted"] - c["accepted"] for c in commits if len(c["tokens"]) == c["accepted"] + 1)


@pytest.mark.parametrize("mode", ["speculative", "mtp"])
def test_sampled_rows_beside_a_row_a_commit_hook_stopped_are_their_own(tiny_engine, mode):
    """A row's draft block took what the batch's longest row left of the cache: a row that ended (here
    stopped by a block.commit hook at its first verify) changed the other sampled rows' blocks, so
    their draws and their tokens. Each row's blocks are its own now: its tokens are its alone."""
    engine = tiny_engine
    if mode == "mtp":  # clover-tiny with a head
        model = CloverModel.random(CloverConfig.preset("clover-tiny", mtp_num_hidden_layers=1), seed=2)
        with torch.no_grad():
            model.lm_head.weight.mul_(30.0)
        engine = Engine(model)
    kw = dict(mode=mode, max_new_tokens=7, temperature=0.8, seed=5, repetition_penalty=1.0)

    def stop_row_1(ev):
        if ev.where.rows == (1,):
            ev.stop()

    with engine.hooks({"block.commit": stop_row_1}):
        batch = [r.token_ids for r in engine.generate(PROMPTS, **kw)]
    alone = [engine.generate(p, **kw).token_ids for p in PROMPTS]
    assert batch[0] == alone[0] and batch[2] == alone[2] and batch[1] == alone[1][:1]


STOPS = [(trigger, at, how) for trigger in ("commit", "rejected") for at, how in ((0, "stop"), (1, "raise"), (2, "stop"))]


@pytest.mark.slow
@pytest.mark.parametrize("mode, kw", [("speculative", {}), ("speculative", dict(draft_passes=2, threshold=0.5)),
                                      ("mtp", {}), ("mtp", dict(mtp_draft_tokens=1))])
def test_a_run_stopped_at_a_commit_keeps_a_prefix_of_ars_tokens(default_engine, mode, kw):
    """Issue 52 reported a speculative run stopped by a block.commit hook returning tokens that were not
    a prefix of AR's (a rejected draft token kept); not reproduced. The property over a sweep, in both
    drafting modes: stopped at the first, second or third verify, or at the first, second or third
    that rejected drafts, by ``event.stop()`` or StopGeneration, alone or one row of a batch, the
    tokens are a prefix of AR's, exactly the stopping row's committed events' tokens, and the other
    row goes on to AR's whole answer."""
    prompts = ["def parse(line):\n", "class Stack:\n    def push(self, item):\n"]
    greedy = dict(max_new_tokens=16, temperature=0, repetition_penalty=1.0)
    ar = [default_engine.generate(p, mode="ar", **greedy).token_ids for p in prompts]
    rejections = 0
    for (trigger, at, how), batch in [(stop, batch) for stop in STOPS for batch in (False, True)]:
        events = []

        def stop_there(ev):
            if batch and ev.where.rows != (1,):  # a batch: only row 1 stops
                return
            events.append(ev)
            hits = [e for e in events if trigger == "commit" or e.rejected]
            if (trigger == "commit" or ev.rejected) and len(hits) == at + 1:
                if how == "raise":
                    raise StopGeneration
                ev.stop()

        with default_engine.hooks({"block.commit": stop_there}):
            out = default_engine.generate(prompts if batch else prompts[0], mode=mode, **greedy, **kw)
        results = list(out) if batch else [out]
        stopped, want = results[-1], ar[1] if batch else ar[0]
        where = (trigger, at, how, batch)
        assert stopped.token_ids == want[:len(stopped.token_ids)], where
        assert stopped.token_ids == [t for e in events for t in e.tokens], where
        assert stopped.stop_reason == "hook" or stopped.token_ids == want, where
        assert not batch or results[0].token_ids == ar[0], where
        rejections += sum(bool(e.rejected) for e in events)
    assert rejections  # the sweep stopped at verifies that rejected drafts
