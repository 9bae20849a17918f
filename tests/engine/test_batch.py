"""Batched generation (issue 18): several prompts share every forward, each row progresses on its
own, and greedy rows give exactly what each prompt gives alone."""
import pytest
import torch

from clover_lab import BatchResult, Engine, GenerationError, StopGeneration, load_trace
from clover_lab.engine.requests import settings_for_mode
from clover_lab.model.context import Coreset

pytestmark = pytest.mark.usefixtures("gen_one_thread")
# prompts of different lengths: rows stand at different cache lengths throughout
PROMPTS = [[5, 17, 33], [5, 17, 33, 100, 2, 9, 77, 301, 12, 64], [400, 3, 250, 7, 88, 19], [42]]
KW = dict(max_new_tokens=40, threshold=0.3)  # blocks of 16: 16 + 16 + 8


def one_by_one(engine, prompts, **kw):
    return [engine.generate(p, **kw) for p in prompts]


def assert_rows_equal(batch, singles):
    assert isinstance(batch, BatchResult) and len(batch) == len(singles)
    for r, (b, s) in enumerate(zip(batch, singles)):
        assert b.token_ids == s.token_ids, f"row {r}"
        assert b.stop_reason == s.stop_reason, f"row {r}"
        assert b.prompt_ids == s.prompt_ids and b.text == s.text
        assert b.stats.steps_per_block == s.stats.steps_per_block, f"row {r}"
        assert b.stats.blocks == s.stats.blocks and b.stats.new_tokens == s.stats.new_tokens


# --------------------------------------------------------------------------- the model's ragged rows
def test_rows_at_different_lengths_forward_as_they_would_alone(tiny_model):
    """A cache whose rows hold prompts of different lengths: a fused commit + preview (and a
    preview with each row's own coreset) equals each row run alone."""
    cfg = tiny_model.config
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (5, 11, 8)]
    block = torch.randint(0, cfg.vocab_size, (3, 16), generator=g)
    nxt = torch.randint(0, cfg.vocab_size, (3, 16), generator=g)
    cache = tiny_model.new_cache(64, 3)
    for r, p in enumerate(prompts):
        tiny_model.prefill(cache.row(r), p, logits=None)
    cache.set_row_lengths([5, 11, 8])
    assert cache.ragged
    coreset = Coreset(4)
    fused = tiny_model.commit_and_preview(cache, block, nxt, coreset=coreset, commit_logits="all")
    again = tiny_model.preview(cache, nxt, coreset=coreset)
    assert cache.row_lengths == [21, 27, 24] and cache.length == 27
    assert coreset.experts[0].shape == (3, 4)  # each row its own coreset
    with pytest.raises(ValueError, match="a cache of 3 rows cannot fill rows"):
        cache.put([0], cache)
    for r, p in enumerate(prompts):
        alone = tiny_model.new_cache(64, 1)
        tiny_model.prefill(alone, p, logits=None)
        own = Coreset(4)
        out = tiny_model.commit_and_preview(alone, block[r:r + 1], nxt[r:r + 1], coreset=own, commit_logits="all")
        torch.testing.assert_close(fused.commit_logits[r], out.commit_logits[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fused.preview_logits[r], out.preview_logits[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(again[r], tiny_model.preview(alone, nxt[r:r + 1], coreset=own)[0],
                                   atol=1e-5, rtol=1e-5)
        assert torch.equal(coreset.experts[0][r], own.experts[0])


# --------------------------------------------------------------------------- equality with one by one
@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_greedy_batch_equals_one_by_one(tiny_engine, mode):
    singles = one_by_one(tiny_engine, PROMPTS, mode=mode, **settings_for_mode(mode, KW))
    batch = tiny_engine.generate(PROMPTS, mode=mode, **settings_for_mode(mode, KW))
    assert_rows_equal(batch, singles)
    if mode == "diffusion":  # the rows did progress on their own: not every row took as many steps
        assert len({tuple(r.stats.steps_per_block) for r in batch}) > 1
    st = batch.stats
    assert st.rows == 4 and st.mode == mode and st.new_tokens == 4 * 40
    assert st.prompt_tokens == sum(map(len, PROMPTS)) and st.prefill_forwards == 4
    # each row took part in the forwards it would have run alone (a row whose block is done sits
    # out the others' steps); the batch ran far fewer forwards than the rows one by one
    for b, s in zip(batch, singles):
        assert (b.stats.preview_forwards, b.stats.fused_forwards, b.stats.commit_forwards) == \
            (s.stats.preview_forwards, s.stats.fused_forwards, s.stats.commit_forwards)
    assert max(s.stats.forwards for s in singles) <= st.forwards < sum(s.stats.forwards for s in singles)
    assert st.tokens_per_forward == pytest.approx(st.new_tokens / st.forwards)
    assert st.tokens_per_second > 0 and st.stop_reasons == ["length"] * 4
    assert batch.to_dict()["stats"]["rows"] == 4


def test_batch_with_a_coreset_equals_one_by_one(tiny_engine):
    kw = dict(KW, coreset_size=4)
    assert_rows_equal(tiny_engine.generate(PROMPTS, **kw), one_by_one(tiny_engine, PROMPTS, **kw))


def test_route_hooks_ban_within_each_rows_coreset(tiny_engine):
    kw = dict(KW, coreset_size=4)
    ban = {"layers.*.moe.route": lambda ev: ev.ban([3])}
    with tiny_engine.hooks(ban):
        singles = one_by_one(tiny_engine, PROMPTS, **kw)
    with tiny_engine.hooks(ban), tiny_engine.capture("layers.2.moe.route") as cap:
        batch = tiny_engine.generate(PROMPTS, **kw)
    assert_rows_equal(batch, singles)
    assert all(3 not in rec["expert_ids"].tolist() for rec in cap["layers.2.moe.route"])


def test_text_prompts_chat_and_a_batch_of_one(tiny_text_engine):
    prompts = ["w5 w17 w33", [{"role": "user", "content": "w1 w2"}], "w9"]
    assert_rows_equal(tiny_text_engine.generate(prompts, **KW), one_by_one(tiny_text_engine, prompts, **KW))
    one = tiny_text_engine.generate(["w5 w17"], **KW)
    assert len(one) == 1 and one[0].token_ids == tiny_text_engine.generate("w5 w17", **KW).token_ids


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_eos_ends_one_row_mid_batch(tiny_engine, mode):
    base = one_by_one(tiny_engine, PROMPTS, mode=mode, **settings_for_mode(mode, KW))
    # an EOS that row 1 produces in its second block and row 3 never does
    eos = next(t for t in base[1].token_ids[18:] if t not in base[3].token_ids)
    tiny_engine.eos_token_ids = [eos]
    singles = one_by_one(tiny_engine, PROMPTS, mode=mode, **settings_for_mode(mode, KW))
    batch = tiny_engine.generate(PROMPTS, mode=mode, **settings_for_mode(mode, KW))
    assert_rows_equal(batch, singles)
    assert batch[1].stop_reason == "eos" and len(batch[1].token_ids) < 40
    assert batch[3].stop_reason == "length" and len(batch[3].token_ids) == 40
    assert all(r.stats.cache_complete for r in batch)
    assert batch[1].stats.forwards < batch[3].stats.forwards  # it left the batch


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_stop_strings_end_rows_independently(tiny_text_engine, gen_tokenizer, mode):
    prompts = ["w5 w17 w33 w100 w2", "w7", "w300 w301 w302 w303 w304 w305 w306"]
    base = one_by_one(tiny_text_engine, prompts, mode=mode, **settings_for_mode(mode, KW))
    # a word row 1 writes in its second block and the other rows never do
    stop = next(w for w in base[1].text.split()[18:] if w not in base[0].text and w not in base[2].text)
    singles = one_by_one(tiny_text_engine, prompts, mode=mode, stop=[stop], **settings_for_mode(mode, KW))
    batch = tiny_text_engine.generate(prompts, mode=mode, stop=[stop], **settings_for_mode(mode, KW))
    assert_rows_equal(batch, singles)
    assert batch[1].stop_reason == "stop_string" and stop not in batch[1].text
    assert batch[0].stop_reason == batch[2].stop_reason == "length"


# --------------------------------------------------------------------------- hooks, capture, stream
def test_hooks_and_capture_see_the_row(tiny_engine, tmp_path):
    with tiny_engine.capture(["denoise.step", "block.commit", "layers.3.moe.route", "layers.0.gdn.state"]) as cap:
        batch = tiny_engine.generate(PROMPTS, **KW)
    steps = cap["denoise.step"]
    assert {rec.row for rec in steps} == {0, 1, 2, 3}
    for r, result in enumerate(batch):
        mine = [rec for rec in steps if rec.row == r]
        assert len(mine) == sum(result.stats.steps_per_block)
        commits = [rec for rec in cap["block.commit"] if rec.row == r]
        assert [rec["tokens"] for rec in commits] == [result.token_ids[:16], result.token_ids[16:32],
                                                      result.token_ids[32:]]
        assert [rec["start"] for rec in commits] == [len(PROMPTS[r]) + k for k in (0, 16, 32)]
    # rows unmasked different numbers of positions in the same step
    first = [rec for rec in steps if rec.block == 0 and rec.step == 0]
    assert len({len(rec["unmask"]) for rec in first}) > 1
    # a model event's batch dimension holds the rows in where.rows; a prefill is one row at a time
    for rec in cap["layers.3.moe.route"]:
        if rec.phase == "prefill":
            assert len(rec.rows) == 1 and rec["positions"].tolist() == list(range(len(PROMPTS[rec.row])))
        else:
            assert set(rec.rows) <= {0, 1, 2, 3} and list(rec.rows) == sorted(rec.rows)
        assert rec["expert_ids"].shape[0] == rec["positions"].numel()
        assert rec["positions"].numel() % len(rec.rows) == 0
    for r, result in enumerate(batch):  # a row takes part in its own steps' previews only
        previews = [rec for rec in cap["layers.3.moe.route"] if rec["mode"] == "preview" and r in rec.rows]
        assert len(previews) == sum(result.stats.steps_per_block)
    preview = next(rec for rec in cap["layers.3.moe.route"] if rec.phase == "decode" and rec["mode"] == "preview")
    starts = preview["positions"].view(4, -1)[:, 0].tolist()
    assert starts == [len(p) for p in PROMPTS]  # each row's block at its own positions
    assert all(rec["state"].shape[0] in (1, 4) for rec in cap["layers.0.gdn.state"])
    cap.save(tmp_path / "trace")
    loaded = load_trace(tmp_path / "trace")
    assert [rec.row for rec in loaded["denoise.step"]] == [rec.row for rec in steps]


def test_stream_tags_updates_with_their_row(tiny_engine):
    updates = list(tiny_engine.stream(PROMPTS, **KW))
    last = updates[-1]
    assert last.kind == "batch" and isinstance(last.result, BatchResult) and last.row is None
    done = [u for u in updates if u.kind == "done"]
    assert sorted(u.row for u in done) == [0, 1, 2, 3]
    for u in done:
        assert u.result.token_ids == last.result[u.row].token_ids == u.committed
    for r in range(4):
        commits = [u.committed for u in updates if u.kind == "commit" and u.row == r]
        assert commits == [last.result[r].token_ids[:k] for k in (16, 32, 40)]
        assert all(u.kind in ("step", "commit", "done") for u in updates if u.row == r)


def test_a_step_hook_stops_its_own_row(tiny_engine):
    singles = one_by_one(tiny_engine, PROMPTS, **KW)

    def stop_row_2(ev):
        if ev.where.row == 2 and ev.block == 1:
            ev.stop()

    with tiny_engine.hooks({"denoise.step": stop_row_2}):
        batch = tiny_engine.generate(PROMPTS, **KW)
    assert batch[2].stop_reason == "hook" and len(batch[2].token_ids) < 40
    assert batch[2].token_ids == singles[2].token_ids[:len(batch[2].token_ids)]
    for r in (0, 1, 3):
        assert batch[r].token_ids == singles[r].token_ids and batch[r].stop_reason == "length"


def test_a_commit_hook_stops_its_own_row_and_a_model_hook_every_row(tiny_engine):
    singles = one_by_one(tiny_engine, PROMPTS, **KW)
    with tiny_engine.hooks({"block.commit": lambda ev: ev.stop() if ev.where.row == 0 else None}):
        batch = tiny_engine.generate(PROMPTS, **KW)
    assert batch[0].token_ids == singles[0].token_ids[:16] and batch[0].stop_reason == "hook"
    assert all(batch[r].token_ids == singles[r].token_ids for r in (1, 2, 3))
    calls = []

    def stop_in_block_1(ev):
        calls.append(ev.where.rows)
        if ev.where.block == 1 and ev.mode == "preview":
            raise StopGeneration

    with tiny_engine.hooks({"layers.1.moe.route": stop_in_block_1}):
        batch = tiny_engine.generate(PROMPTS, **KW)
    assert [r.stop_reason for r in batch] == ["hook"] * 4
    for r in range(4):  # the first block was resolved, then waited for a fused commit that never ran
        assert batch[r].token_ids == singles[r].token_ids[:16]
        assert not batch[r].stats.cache_complete
    assert tiny_engine.generate(PROMPTS, **KW)[1].token_ids == singles[1].token_ids  # still usable


# --------------------------------------------------------------------------- requests
def test_bad_prompts_name_their_row_and_leave_the_engine_usable(tiny_engine):
    with pytest.raises(GenerationError, match="prompt 1 of the batch.*empty"):
        tiny_engine.generate([[1, 2], []], **KW)
    with pytest.raises(GenerationError, match="prompt 2 of the batch.*outside the vocabulary"):
        tiny_engine.generate([[1, 2], [3], [4, 99999]], **KW)
    with pytest.raises(GenerationError, match="prompt 0 of the batch.*tokenizer"):
        tiny_engine.generate(["text"], **KW)
    with pytest.raises(GenerationError, match="prompt 1 of the batch.*context length"):
        tiny_engine.generate([[1], [2] * 4090], max_new_tokens=40)
    assert len(tiny_engine.generate([[1, 2], [3]], **KW)) == 2


def test_seeded_sampled_batches_are_reproducible(tiny_engine):
    kw = dict(KW, temperature=1.0, top_p=0.95, seed=7)
    a, b = tiny_engine.generate(PROMPTS, **kw), tiny_engine.generate(PROMPTS, **kw)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    # the rows draw from generators of their own: a row's draws do not depend on the other rows
    c = tiny_engine.generate(PROMPTS[:2], **kw)
    assert [r.token_ids for r in c] == [r.token_ids for r in a[:2]]


def test_penalties_count_each_rows_tokens(tiny_engine):
    kw = dict(KW, presence_penalty=1e4, max_tokens_per_step=1, max_new_tokens=24)
    batch = tiny_engine.generate(PROMPTS[:2], **kw)
    assert all(len(set(r.token_ids)) == 24 for r in batch)
    assert_rows_equal(batch, one_by_one(tiny_engine, PROMPTS[:2], **kw))


def test_engine_stays_a_plain_engine_for_single_prompts(gen_model):
    engine = Engine(gen_model)
    single = engine.generate(PROMPTS[1], **KW)
    assert not isinstance(single, list) and single.token_ids == engine.generate([PROMPTS[1]], **KW)[0].token_ids


def test_events_narrowed_to_a_row_equal_the_row_alone(tiny_engine):
    """``event.for_row(r)``: a model event of a batch, cut to row r, holds what r's own generation
    gave (residual values, routing, GDN states with the row's own length)."""
    points = ["layers.1.output", "layers.2.moe.route", "layers.0.gdn.state", "layers.0.gdn.preview"]

    def collect(row):
        seen = {p: [] for p in points}

        def hook(name):
            def fn(ev):
                mine = ev.for_row(row)
                if mine is not None and mine.where.phase == "decode":
                    seen[name].append(mine)
            return fn

        return seen, {p: hook(p) for p in points}

    batch_seen, hooks = collect(2)
    with tiny_engine.hooks(hooks):
        tiny_engine.generate(PROMPTS, **KW)
    alone_seen, hooks = collect(0)  # outside a batch for_row is the event itself
    with tiny_engine.hooks(hooks):
        tiny_engine.generate(PROMPTS[2], **KW)
    for p in points:
        assert len(batch_seen[p]) == len(alone_seen[p]) > 0, p
    for a, b in zip(batch_seen["layers.1.output"], alone_seen["layers.1.output"]):
        assert (a.block, a.step, a.mode) == (b.block, b.step, b.mode) and a.where.row == 2
        assert torch.equal(a.positions, b.positions)
        torch.testing.assert_close(a.value, b.value, atol=1e-5, rtol=1e-5)
    for a, b in zip(batch_seen["layers.2.moe.route"], alone_seen["layers.2.moe.route"]):
        assert torch.equal(a.expert_ids, b.expert_ids) and torch.equal(a.positions, b.positions)
    for a, b in zip(batch_seen["layers.0.gdn.state"], alone_seen["layers.0.gdn.state"]):
        assert a.length == b.length and a.state.shape == b.state.shape
        torch.testing.assert_close(a.state, b.state, atol=1e-5, rtol=1e-5)
    for a, b in zip(batch_seen["layers.0.gdn.preview"], alone_seen["layers.0.gdn.preview"]):
        torch.testing.assert_close(a.history_weights, b.history_weights, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
@pytest.mark.parametrize("prompts,groups", [
    ([[5, 17, 33, 100], [9, 9, 9, 9], [400, 3, 250, 7]], [(0, 1, 2)]),
    ([[5, 17, 33], [9, 9, 9], [400, 3, 250, 7, 8], [1, 2, 3]], [(0, 1, 3), (2,)]),
])
def test_prompts_as_long_prefill_in_one_forward(tiny_engine, mode, prompts, groups):
    with tiny_engine.capture("layers.3.moe.route") as cap:
        batch = tiny_engine.generate(prompts, mode=mode, **settings_for_mode(mode, KW))
    assert_rows_equal(batch, one_by_one(tiny_engine, prompts, mode=mode, **settings_for_mode(mode, KW)))
    assert batch.stats.prefill_forwards == len(groups)
    prefill = [rec for rec in cap["layers.3.moe.route"] if rec.phase == "prefill"]
    assert [rec.rows for rec in prefill] == groups


@pytest.mark.slow  # the benchmark's process
def test_the_batch_benchmark_runs_and_its_batches_give_batch_1s_tokens(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "bench_batch.py"
    proc = subprocess.run([sys.executable, str(script), "--model", "random", "--prompts", "4",
                           "--batch-sizes", "1", "4", "--max-new-tokens", "16", "--threshold", "0.3", "--rounds", "1", "--threads", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (result,) = tmp_path.glob("batch-*.json")
    rows = json.loads(result.read_text())["rows"]
    assert [(r["mode"], r["batch_size"]) for r in rows] == [("diffusion", 1), ("diffusion", 4), ("ar", 1), ("ar", 4)]
    assert all(r["same_tokens"] and r["new_tokens"] == 64 for r in rows)


@pytest.mark.slow  # the benchmark's process
def test_the_bound_benchmark_sums_the_gemms_inside_the_steps(tmp_path):
    """bench_batch_bound.py profiles an eager pass and finds GEMMs inside the step regions of
    both modes (a part of every GEMM, of the steps' time), and a bound of at least 1."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "bench_batch_bound.py"
    proc = subprocess.run([sys.executable, str(script), "--model", "random", "--prompts", "2", "--batch-sizes", "2",
                           "--max-new-tokens", "16", "--threshold", "0.3", "--rounds", "1", "--threads", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (result,) = tmp_path.glob("batch-bound-*.json")
    rows = json.loads(result.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["diffusion", "ar"]
    for r in rows:
        assert 0 < r["step_gemm_seconds"] <= r["gemm_seconds"] and r["step_gemm_seconds"] < r["step_seconds"]
        assert r["step_seconds"] < r["seconds"] and r["bound"] >= 1


def test_a_batch_whose_cache_does_not_fit_is_refused_up_front(tiny_engine, monkeypatch):
    from clover_lab.engine import requests
    from clover_lab.model.cache import cache_bytes

    one = cache_bytes(tiny_engine.model.config, 10 + 40, 1, dtype=tiny_engine.model.dtype)
    monkeypatch.setattr(requests, "available_bytes", lambda device: 2 * one)  # room for two rows, not three
    assert len(tiny_engine.generate([[1] * 10, [2] * 10], **KW)) == 2
    with pytest.raises(GenerationError, match=r"the cache for 3 rows of 50 positions needs .* batch fewer prompts"):
        tiny_engine.generate([[1] * 10, [2] * 10, [3] * 10], **KW)


# --------------------------------------------------------------------------- one row state (issue 24)
TIMINGS = {"prefill_seconds", "preview_seconds", "commit_seconds", "seconds_per_preview", "seconds_per_commit",
           "decode_seconds", "total_seconds", "tokens_per_second"}


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
@pytest.mark.parametrize("fast", [False, True])
def test_a_prompt_and_a_batch_of_it_alone_are_the_same_generation(tiny_engine, mode, fast):
    """A single prompt is a batch of one: ``generate(p)`` and ``generate([p])[0]`` give the same
    tokens and every figure but the clock's (forwards of each kind, steps per block, the stop)."""
    tiny_engine.step_graphs = fast
    kw = dict(KW, coreset_size=4) if mode == "diffusion" else KW
    for prompt in PROMPTS[1:3]:
        single = tiny_engine.generate(prompt, mode=mode, **settings_for_mode(mode, kw))
        (one,) = tiny_engine.generate([prompt], mode=mode, **settings_for_mode(mode, kw))
        assert one.token_ids == single.token_ids and one.text == single.text
        a, b = single.stats.to_dict(), one.stats.to_dict()
        assert {k: v for k, v in a.items() if k not in TIMINGS} == {k: v for k, v in b.items() if k not in TIMINGS}
        assert a["forwards"] > 0 and a["preview_forwards" if mode == "diffusion" else "commit_forwards"] > 0


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_batches_take_the_fast_path_and_give_the_eager_batchs_tokens(tiny_engine, mode):
    """The static steps serve any number of rows at their own lengths: a batch of 4, then of 3
    (a bucket of 4 with a padded row), rows leaving one by one at an EOS (the bucket shrinks
    to 2 and 1), with a coreset, give the eager batch's tokens and figures."""
    base = one_by_one(tiny_engine, PROMPTS, mode=mode, **settings_for_mode(mode, KW))
    tiny_engine.eos_token_ids = [next(t for t in base[1].token_ids[18:] if t not in base[3].token_ids)]
    kw = dict(KW, coreset_size=4) if mode == "diffusion" else KW
    for prompts in (PROMPTS, PROMPTS[1:]):
        tiny_engine.step_graphs = False
        eager = tiny_engine.generate(prompts, mode=mode, **settings_for_mode(mode, kw))
        tiny_engine.step_graphs = True
        fast = tiny_engine.generate(prompts, mode=mode, **settings_for_mode(mode, kw))
        assert_rows_equal(fast, eager)
        assert fast.stats.forwards == eager.stats.forwards
        for a, b in zip(fast, eager):
            assert a.stats.forwards == b.stats.forwards and a.stats.cache_complete
    # 3 rows step in a bucket of 4, then, once the EOS row has left, in a bucket of 2
    assert tiny_engine.fast_path.graphs.shapes['caches'] == {1, 2, 4}


def test_a_model_hook_attached_mid_batch_moves_the_rows_to_the_eager_forward(tiny_engine):
    tiny_engine.step_graphs = False
    want = tiny_engine.generate(PROMPTS[:3], **KW)
    tiny_engine.step_graphs = True
    seen, handles, results = [], [], None
    for u in tiny_engine.stream(PROMPTS[:3], **KW):  # 3 rows: a bucket of 4, one row padding
        if u.kind == "commit" and not handles:
            handles.append(tiny_engine.add_hook("layers.*.moe.route", lambda e: seen.append(e.where.rows)))
        if u.kind == "batch":
            results = u.result
    handles[0].remove()
    assert_rows_equal(results, want)
    assert seen and all(rows is None or len(rows) <= 3 for rows in seen)  # no padding row in an event


# --------------------------------------------------------------------------- the decoding seam (issue 24)
def test_a_new_decoding_policy_needs_no_loop_change(tiny_engine):
    """A rule of its own through ``engine.policy``: one position per step, left to right, with a
    memo of the block's logits over its steps; batched rows each get their own blocks and memos."""
    import torch

    from clover_lab.engine.policies import DecodingPolicy, Proposal

    class LeftToRight(DecodingPolicy):
        def __init__(self):
            self.memos = []

        def begin_block(self, row, block):
            self.memos.append([])
            return self.memos[-1]

        def propose(self, row, block, logits, finish):
            block.memo.append(logits.shape[0])  # N masked positions this step
            unmask = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
            unmask[0] = True
            return Proposal(logits.argmax(-1), logits.softmax(-1).amax(-1), unmask | finish)

    want = tiny_engine.generate(PROMPTS[0], **KW).token_ids  # today's rule, the default
    policy = tiny_engine.policy = LeftToRight()
    with tiny_engine.capture("denoise.step") as cap:
        batch = tiny_engine.generate(PROMPTS[:2], **KW)
    for r in batch:
        assert r.stats.steps_per_block == [16, 16, 8] and len(r.token_ids) == 40
    assert [rec["unmask"] for rec in cap["denoise.step"] if rec.row == 0][:3] == [[0], [1], [2]]
    assert policy.memos[0] == list(range(16, 0, -1)) and len(policy.memos) == 2 * 3  # rows x blocks

    class Idle(DecodingPolicy):
        def propose(self, row, block, logits, finish):
            return Proposal(logits.argmax(-1), logits.amax(-1), torch.zeros_like(logits[:, 0], dtype=torch.bool))

    tiny_engine.policy = Idle()
    with pytest.raises(GenerationError, match="Idle.propose: block 0, step 0: a step must unmask at least one"):
        tiny_engine.generate(PROMPTS[0], **KW)
    with pytest.raises(ValueError, match="policy must be a DecodingPolicy"):
        tiny_engine.policy = "threshold"
    from clover_lab.engine.policies import ThresholdPolicy

    tiny_engine.policy = ThresholdPolicy()
    assert tiny_engine.generate(PROMPTS[0], **KW).token_ids == want  # the engine stays usable


# --------------------------------------------------------------------------- which path ran (issue 24)
def test_the_stats_say_which_path_ran_and_why(tiny_engine):
    tiny_engine.step_graphs = False
    off = tiny_engine.generate(PROMPTS[0], **KW)
    assert off.stats.path == "eager: engine.step_graphs is False"
    tiny_engine.step_graphs = None  # a CPU without compile_steps
    assert tiny_engine.generate(PROMPTS, **KW).stats.path.startswith("eager: on a CPU the fast path takes")
    tiny_engine.step_graphs = True
    fast = tiny_engine.generate(PROMPTS, **KW)
    assert fast.stats.path == "static" and all(r.stats.path == "static" for r in fast)
    with tiny_engine.hooks({"layers.2.moe.route": lambda e: None}):
        hooked = tiny_engine.generate(PROMPTS[0], mode="ar", max_new_tokens=4)
    assert hooked.stats.path == "eager: a hook on layers.2.moe.route"
    assert [r.token_ids for r in fast] == [r.token_ids for r in tiny_engine.generate(PROMPTS, **KW)]


def test_speed_view_shows_which_path_ran(view_engine):
    from clover_lab.widgets import SpeedView

    view = SpeedView(view_engine, fps=1000)
    try:
        view_engine.step_graphs = False
        view.add_result(view_engine.generate("w5 w17", max_new_tokens=8, threshold=0.3))
        assert view.summary()[-1]["path"] == "eager: engine.step_graphs is False"
        assert "eager: engine.step_graphs is False" in view.table_html(view.summary())
    finally:
        view_engine.step_graphs = None
        view.close()


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_a_batch_times_its_forwards_by_kind_and_a_profile_names_them(tiny_engine, mode):
    """A batch's stats time its shared forwards by kind, as a row's do (previews, commits: within
    the decode time); under torch.profiler every forward is a named region of the trace
    (``bench/bench_batch_bound.py`` reads them), and outside one no region is entered."""
    from torch.profiler import profile

    from clover_lab.engine.runner import NO_REGION, region

    with profile() as prof:
        batch = tiny_engine.generate(PROMPTS[:2], mode=mode, **settings_for_mode(mode, KW))
    st = batch.stats
    steps = st.preview_seconds if mode == "diffusion" else st.commit_seconds
    assert steps > 0 and st.preview_seconds + st.commit_seconds <= st.decode_seconds
    assert (st.preview_seconds > 0) is (mode == "diffusion")
    names = {e.name for e in prof.events()}
    kinds = {"prefill", "commit"} | ({"preview"} if mode == "diffusion" else set())
    assert {f"clover_lab.{kind}" for kind in kinds} <= names
    assert region("preview") is NO_REGION
