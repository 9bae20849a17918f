"""The generation engine: block diffusion (spec section 4), the AR baseline, requests and results."""
import math
import warnings

import pytest
import torch

import clover_lab
from clover_lab import (
    Engine,
    GenerationError,
    HookError,
)
from clover_lab.engine.requests import settings_for_mode
from clover_lab.model.cache import cache_bytes

pytestmark = pytest.mark.usefixtures("gen_one_thread")
PROMPT = [5, 17, 33, 100, 2, 9, 77, 301, 12, 64]


# --------------------------------------------------------------------------- basics and stats
def test_greedy_diffusion_is_deterministic_and_accounts_for_every_forward(tiny_engine):
    a = tiny_engine.generate(PROMPT, max_new_tokens=40, threshold=0.3)
    b = tiny_engine.generate(PROMPT, max_new_tokens=40, threshold=0.3)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 40
    assert a.text is None and a.prompt_ids == PROMPT
    st = a.stats
    assert st.mode == "diffusion" and st.stop_reason == "length" and st.new_tokens == 40
    assert st.blocks == 3 and len(st.steps_per_block) == 3  # 16 + 16 + 8
    assert st.preview_forwards == sum(st.steps_per_block)
    assert st.fused_forwards == st.blocks - 1  # the first preview of every later block carries the commit
    assert st.commit_forwards == 1  # only the final block is committed on its own
    assert st.forwards == st.preview_forwards + st.commit_forwards
    assert st.tokens_per_forward == pytest.approx(40 / st.forwards)
    assert st.tokens_per_forward > 1.0  # threshold 0.3 on this model unmasks several tokens per step
    assert st.mean_steps_per_block == pytest.approx(sum(st.steps_per_block) / 3)
    for key in ("forwards", "tokens_per_forward", "tokens_per_second", "steps_per_block", "preview_seconds",
                "commit_seconds"):
        assert key in st.to_dict() and st[key] is not None
    assert st.preview_seconds > 0 and st.commit_seconds > 0 and st.tokens_per_second > 0


def test_seeded_sampling_is_reproducible(tiny_engine):
    kw = dict(max_new_tokens=32, threshold=0.5, temperature=1.0, top_p=0.95, top_k=50)
    a = tiny_engine.generate(PROMPT, seed=11, **kw)
    b = tiny_engine.generate(PROMPT, seed=11, **kw)
    c = tiny_engine.generate(PROMPT, seed=12, **kw)
    assert a.token_ids == b.token_ids and a.stats.seed == 11
    assert a.token_ids != c.token_ids
    unseeded = tiny_engine.generate(PROMPT, max_new_tokens=16, temperature=1.0)
    again = tiny_engine.generate(PROMPT, max_new_tokens=16, temperature=1.0, seed=unseeded.stats.seed)
    assert again.token_ids == unseeded.token_ids  # the drawn seed is reported and replays the run


def test_every_unmasked_token_met_the_threshold_or_was_the_best(tiny_engine):
    thr = 0.35
    with tiny_engine.capture("denoise.step") as cap:
        r = tiny_engine.generate(PROMPT, max_new_tokens=48, threshold=thr)
    assert len(cap["denoise.step"]) == r.stats.preview_forwards
    multi = 0
    for rec in cap["denoise.step"]:
        conf = rec["confidences"]
        best = float(conf.max())
        assert rec["unmask"], "every step unmasks at least one position"
        for p in rec["unmask"]:
            c = float(conf[rec["masked"].index(p)])
            assert c >= thr or c == best
        untouched = set(rec["masked"]) - set(rec["unmask"])
        assert all(float(conf[rec["masked"].index(p)]) < thr for p in untouched)
        multi += len(rec["unmask"]) > 1
    assert multi > 0


def test_threshold_one_token_cap_and_step_limit(tiny_engine):
    one = tiny_engine.generate(PROMPT, max_new_tokens=32, threshold=1.0)
    assert one.stats.steps_per_block == [16, 16]
    with tiny_engine.capture("denoise.step") as cap:
        capped = tiny_engine.generate(PROMPT, max_new_tokens=32, threshold=0.05, max_tokens_per_step=3)
    assert max(len(r["unmask"]) for r in cap["denoise.step"]) == 3
    limited = tiny_engine.generate(PROMPT, max_new_tokens=32, threshold=1.0, max_steps_per_block=4)
    assert limited.stats.steps_per_block == [4, 4] and len(limited.token_ids) == 32
    assert len(capped.token_ids) == 32


@pytest.mark.parametrize("rule", ["probability", "margin", "entropy"])
def test_confidence_rules_run(tiny_engine, rule):
    r = tiny_engine.generate(PROMPT, max_new_tokens=16, threshold=0.5, confidence=rule)
    assert len(r.token_ids) == 16


def test_block_size_is_settable_and_last_block_is_short(tiny_engine):
    tiny_engine.block_size = 6
    r = tiny_engine.generate(PROMPT, max_new_tokens=20, threshold=0.3)
    assert len(r.token_ids) == 20 and r.stats.blocks == 4 and r.stats.block_size == 6
    with pytest.raises(ValueError, match="block_size"):
        tiny_engine.block_size = 0
    with pytest.raises(ValueError, match="mask_token_id"):
        tiny_engine.mask_token_id = 10_000


def test_cache_holds_prompt_and_whole_response(tiny_engine):
    with tiny_engine.capture("layers.0.gdn.state") as cap:
        r = tiny_engine.generate(PROMPT, max_new_tokens=40, threshold=0.3)
    lengths = [rec["length"] for rec in cap["layers.0.gdn.state"]]
    assert lengths[0] == len(PROMPT)  # the prefill
    assert lengths[-1] == len(PROMPT) + 40  # the final block was committed too
    assert lengths == [len(PROMPT), len(PROMPT) + 16, len(PROMPT) + 32, len(PROMPT) + 40]
    assert r.stats.cache_complete


def test_mask_token_is_never_a_candidate(gen_model):
    engine = Engine(gen_model)
    ar = engine.generate(PROMPT, mode="ar", max_new_tokens=1)
    engine.mask_token_id = ar.token_ids[0]  # the model's favourite next token
    with engine.capture("denoise.step") as cap:
        r = engine.generate(PROMPT, max_new_tokens=16, threshold=0.3)
    assert engine.mask_token_id not in r.token_ids
    assert all(engine.mask_token_id not in rec["candidates"].tolist() for rec in cap["denoise.step"])


# --------------------------------------------------------------------------- EOS and stop strings
def test_eos_ends_the_block_and_the_run(tiny_engine):
    with tiny_engine.capture("denoise.step") as cap:
        base = tiny_engine.generate(PROMPT, max_new_tokens=48, threshold=0.3)
    first = cap["denoise.step"][0]
    p = first["unmask"][-1]
    eos = int(first["candidates"][first["masked"].index(p)])
    tiny_engine.eos_token_ids = [eos]
    r = tiny_engine.generate(PROMPT, max_new_tokens=48, threshold=0.3)
    assert r.stats.stop_reason == "eos"
    assert r.token_ids[-1] == eos and eos not in r.token_ids[:-1]
    assert len(r.token_ids) <= 16 and r.stats.blocks == 1  # placed in the first block: the run ends there
    cands = first["candidates"].tolist()
    q = min(pos for pos in first["unmask"] if cands[first["masked"].index(pos)] == eos)
    assert len(r.token_ids) <= q + 1  # positions after the first EOS were dropped
    assert len(base.token_ids) == 48
    # AR: the response is the baseline up to the first EOS
    tiny_engine.eos_token_ids = []
    ar = tiny_engine.generate(PROMPT, mode="ar", max_new_tokens=12)
    tiny_engine.eos_token_ids = [ar.token_ids[5]]
    ar_eos = tiny_engine.generate(PROMPT, mode="ar", max_new_tokens=12)
    k = ar.token_ids.index(ar.token_ids[5])
    assert ar_eos.token_ids == ar.token_ids[:k + 1] and ar_eos.stats.stop_reason == "eos"


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_stop_strings(tiny_text_engine, gen_tokenizer, mode):
    prompt = "w5 w17 w33 w100 w2"
    base = tiny_text_engine.generate(prompt, mode=mode, max_new_tokens=40, **settings_for_mode(mode, {"threshold": 0.3}))
    assert base.text == gen_tokenizer.decode(base.token_ids, skip_special_tokens=True)
    stop = gen_tokenizer.decode([base.token_ids[21]])
    k = next(k for k in range(1, 41) if stop in gen_tokenizer.decode(base.token_ids[:k]))
    r = tiny_text_engine.generate(prompt, mode=mode, max_new_tokens=40, stop=[stop], **settings_for_mode(mode, {"threshold": 0.3}))
    assert r.stats.stop_reason == "stop_string"
    assert r.token_ids == base.token_ids[:k]  # everything before the stop string was already final
    full = gen_tokenizer.decode(base.token_ids[:k])
    assert r.text == full[:full.find(stop)] and stop not in r.text
    assert r.stats.blocks == math.ceil(k / 16) if mode == "diffusion" else r.stats.blocks == k


# --------------------------------------------------------------------------- penalties
def test_penalties_count_response_tokens_only(tiny_engine):
    ar = tiny_engine.generate(PROMPT, mode="ar", max_new_tokens=60)
    assert len(set(ar.token_ids)) < 60  # this model repeats itself now and then
    pen = tiny_engine.generate(PROMPT, mode="ar", max_new_tokens=60, presence_penalty=1e4)
    assert len(set(pen.token_ids)) == 60
    # the prompt does not count: find a prompt whose greedy next token is one of its own tokens
    ids = torch.tensor([PROMPT + [x] for x in range(500)])
    nxt = tiny_engine.model.logits(ids)[:, -1].argmax(-1)
    x = next(x for x in range(500) if int(nxt[x]) in PROMPT + [x])
    prompt = PROMPT + [x]
    first = tiny_engine.generate(prompt, mode="ar", max_new_tokens=1).token_ids[0]
    assert first in prompt
    assert tiny_engine.generate(prompt, mode="ar", max_new_tokens=3, presence_penalty=1e4).token_ids[0] == first
    base = tiny_engine.generate(PROMPT, max_new_tokens=32, threshold=0.3)
    assert len(set(base.token_ids)) < 10
    diff = tiny_engine.generate(PROMPT, max_new_tokens=32, threshold=0.3, presence_penalty=1e4, max_tokens_per_step=1)
    assert len(set(diff.token_ids)) == 32  # tokens already placed in the current block count too
    for kw in (dict(repetition_penalty=50.0), dict(frequency_penalty=5.0)):
        assert len(set(tiny_engine.generate(PROMPT, max_new_tokens=32, threshold=0.3, **kw).token_ids)) > \
            len(set(base.token_ids))


# --------------------------------------------------------------------------- coreset
def test_coreset_restricts_previews_never_commits(tiny_engine):
    M = 3
    with tiny_engine.capture("layers.*.moe.route") as cap:
        r = tiny_engine.generate(PROMPT, max_new_tokens=40, threshold=0.6, coreset_size=M, max_tokens_per_step=4)
    assert r.stats.coreset_size == M and min(r.stats.steps_per_block) > 1
    n_layers = tiny_engine.model.config.num_hidden_layers
    checked = 0
    for block, recs in cap.by_block("layers.*.moe.route").items():
        if block is None:  # prefill
            assert all(rec["mode"] == "commit" for rec in recs)
            continue
        for layer in range(n_layers):
            previews = [rec for rec in recs if rec["layer"] == layer and rec["mode"] == "preview"]
            first = [rec for rec in previews if rec.step == 0]
            assert len(first) == 1
            coreset = set(first[0]["router_probs"].sum(0).topk(M).indices.tolist())
            # the first preview routes over all experts
            assert torch.equal(first[0]["expert_ids"], first[0]["router_probs"].topk(2).indices)
            for rec in previews[1:]:
                assert set(rec["expert_ids"].unique().tolist()) <= coreset
                checked += 1
    assert checked > 0
    commits = cap["layers.*.moe.route"]
    commits = [rec for rec in commits if rec["mode"] == "commit"]
    assert commits and all(torch.equal(rec["expert_ids"], rec["router_probs"].topk(2).indices) for rec in commits)
    used = {layer: set() for layer in range(n_layers)}
    for rec in commits:
        used[rec["layer"]] |= set(rec["expert_ids"].unique().tolist())
    assert max(len(v) for v in used.values()) > M
    # commit rows are tagged with the block they commit
    tagged = {rec.block for rec in commits if rec.phase == "decode"}
    assert tagged == {0, 1, 2}
    plain = tiny_engine.generate(PROMPT, max_new_tokens=40, threshold=0.6)
    assert plain.stats.coreset_size is None


# --------------------------------------------------------------------------- requests refused up front
def test_requests_that_cannot_fit_are_refused(tiny_engine, monkeypatch):
    ctx = tiny_engine.model.config.max_position_embeddings
    with pytest.raises(GenerationError, match="max_position_embeddings"):
        tiny_engine.generate(PROMPT, max_new_tokens=ctx)
    with pytest.raises(GenerationError, match="max_position_embeddings"):
        tiny_engine.generate(PROMPT, mode="ar", max_new_tokens=ctx - len(PROMPT) + 1)
    monkeypatch.setattr("clover_lab.engine.requests.available_bytes", lambda device: 1000)
    with pytest.raises(GenerationError, match="GiB"):
        tiny_engine.generate(PROMPT, max_new_tokens=64)
    assert cache_bytes(tiny_engine.model.config, 100) < cache_bytes(tiny_engine.model.config, 200)


@pytest.mark.parametrize("kwargs,match", [
    (dict(threshold=0.0), "threshold"), (dict(threshold=1.01), "threshold"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_k=-3), "top_k"), (dict(confidence="loud"), "confidence"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(mode="beam"), "mode"), (dict(coreset_size=-1), "coreset_size"),
])
def test_invalid_settings_are_refused(tiny_engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_engine.generate(PROMPT, **kwargs)


def test_bad_prompts_and_missing_pieces(tiny_engine, gen_model):
    with pytest.raises(TypeError, match="thresold"):
        tiny_engine.generate(PROMPT, thresold=0.5)
    with pytest.raises(GenerationError, match="tokenizer"):
        tiny_engine.generate("hello")
    with pytest.raises(GenerationError, match="tokenizer"):
        tiny_engine.generate(PROMPT, stop=["x"])
    with pytest.raises(GenerationError, match="empty"):
        tiny_engine.generate([])
    with pytest.raises(GenerationError, match="vocabulary"):
        tiny_engine.generate([1, 2, 100_000])
    no_mask = Engine(gen_model)
    no_mask.mask_token_id = None
    with pytest.raises(GenerationError, match="mask_token_id"):
        no_mask.generate(PROMPT)
    assert len(no_mask.generate(PROMPT, mode="ar", max_new_tokens=3).token_ids) == 3
    assert tiny_engine.generate(torch.tensor([PROMPT]), max_new_tokens=4).prompt_ids == PROMPT


# --------------------------------------------------------------------------- text, chat, load
def test_text_and_chat_prompts(tiny_text_engine):
    r = tiny_text_engine.generate("w5 w6 w7", max_new_tokens=8, threshold=0.3)
    assert r.prompt_ids == [5, 6, 7]
    assert isinstance(r.text, str) and r.text.split() == [f"w{t}" for t in r.token_ids if t < 509]
    msgs = [{"role": "user", "content": "w8 w9"}]
    with pytest.raises(GenerationError, match="no <think> / </think> tokens"):  # no reasoning to tell apart
        tiny_text_engine.generate(msgs, thinking=True, max_new_tokens=4)
    plain = tiny_text_engine.generate(msgs, thinking=False, max_new_tokens=4)
    assert plain.prompt_ids == [1, 8, 9, 3, 5]
    with pytest.raises(GenerationError, match="role"):
        tiny_text_engine.generate([{"content": "w1"}])


def test_load(gen_text_model_dir, gen_model_dir, monkeypatch, tmp_path):
    engine = clover_lab.load(gen_text_model_dir)
    assert engine.tokenizer is not None and engine.mask_token_id == 511 and engine.block_size == 16
    assert isinstance(engine.generate("w5 w6", max_new_tokens=4).text, str)
    bare = clover_lab.load(gen_model_dir)
    assert bare.tokenizer is None
    monkeypatch.delenv("CLOVER_LAB_MODEL", raising=False)
    monkeypatch.setattr("clover_lab.checkpoint.loading.DEFAULT_MODEL_ROOTS", (tmp_path / "assets",))
    with pytest.raises(FileNotFoundError, match="no default model"):
        clover_lab.load()
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "README.md").write_text("images only")
    with pytest.raises(FileNotFoundError, match="no default model"):
        clover_lab.load()
    (tmp_path / "assets" / "some-model").symlink_to(gen_text_model_dir, target_is_directory=True)
    assert clover_lab.load().tokenizer is not None  # the one model directory in assets/


# --------------------------------------------------------------------------- streaming
def test_stream_separates_provisional_and_committed(tiny_engine):
    updates = list(tiny_engine.stream(PROMPT, max_new_tokens=40, threshold=0.3))
    final = tiny_engine.generate(PROMPT, max_new_tokens=40, threshold=0.3)
    assert updates[-1].kind == "done" and updates[-1].result.token_ids == final.token_ids
    kinds = [u.kind for u in updates]
    assert kinds.count("commit") == 3 and kinds.count("step") == final.stats.preview_forwards
    committed_sizes = [len(u.committed) for u in updates if u.kind == "commit"]
    assert committed_sizes == [16, 32, 40]
    previous = {}
    for u in updates:
        if u.kind != "step":
            previous = {}
            continue
        assert None in u.block_tokens or not u.unmasked or u.step >= 0
        for pos, tok in previous.items():  # provisional tokens are never replaced inside a block
            assert u.block_tokens[pos] == tok
        previous = {i: t for i, t in enumerate(u.block_tokens) if t is not None}
        assert final.token_ids[len(u.committed):len(u.committed) + len(u.block_tokens)] == \
            [t if t is not None else final.token_ids[len(u.committed) + i] for i, t in enumerate(u.block_tokens)]
    ar = list(tiny_engine.stream(PROMPT, mode="ar", max_new_tokens=5))
    assert [u.kind for u in ar] == ["commit"] * 5 + ["done"]


# --------------------------------------------------------------------------- AR = transformers
def test_ar_equals_transformers_greedy(reference, clover_ref):
    hf, _ = reference
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 512, (1, 20), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = hf.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones_like(prompt))
    expected = out[0, 20:].tolist()
    engine = Engine(clover_ref)
    r = engine.generate(prompt[0].tolist(), mode="ar", max_new_tokens=len(expected))
    assert r.token_ids == expected
    assert r.stats.forwards == len(expected) and r.stats.tokens_per_forward == 1.0


KW = dict(max_new_tokens=20, threshold=0.3)


# --------------------------------------------------------------------------- 4. the no-progress guard
def test_no_progress_guard_is_bounded_by_the_real_block(tiny_engine):
    steps = []

    def veto_all(ev):
        steps.append(ev.step)
        ev.unmask = []

    tiny_engine.block_size = 100_000  # the block is only max_new_tokens = 16 long
    try:
        with tiny_engine.hooks({"denoise.step": veto_all}):
            with pytest.raises(HookError, match="16 steps past the step limit"):
                tiny_engine.generate(PROMPT, max_new_tokens=16, threshold=0.3)
    finally:
        tiny_engine.block_size = 16
    assert len(steps) <= 2 * 16 + 1


def test_prefill_chunk_size_commits_the_whole_prompt(tiny_engine):
    base = tiny_engine.generate(PROMPT, **KW)
    tiny_engine.prefill_chunk_size = 3
    try:
        r = tiny_engine.generate(PROMPT, **KW)
    finally:
        tiny_engine.prefill_chunk_size = 1024
    assert r.token_ids == base.token_ids and r.stats.prefill_forwards == math.ceil(len(PROMPT) / 3)


def test_generate_runs_a_list_of_requests_each_with_its_own_settings(tiny_engine):
    """``generate([Request, ...])``: the requests share forwards, each result in its place equals
    the request alone; a list mixing Requests and prompts, or holding a bad request, is refused
    before any runs (the engine stays usable)."""
    from clover_lab import Request

    requests = [Request([5, 17, 33], max_new_tokens=20, threshold=0.3), Request([42, 9], mode="ar", max_new_tokens=6),
                Request([[400, 3, 250], [7, 88]], max_new_tokens=16, temperature=0.8, seed=3)]
    alone = [tiny_engine.generate(r) for r in requests]
    together = tiny_engine.generate(requests)
    assert len(together) == 3 and type(together[2]) is type(alone[2])
    assert together[0].token_ids == alone[0].token_ids and together[1].token_ids == alone[1].token_ids
    assert [r.token_ids for r in together[2]] == [r.token_ids for r in alone[2]]
    with pytest.raises(TypeError, match="item 1 is a list"):
        tiny_engine.generate([requests[0], [5, 17]])
    with pytest.raises(TypeError, match="carries its own settings"):
        tiny_engine.generate(requests, max_new_tokens=4)
    forwards = tiny_engine.loop.forwards
    with pytest.raises(ValueError) as refused:
        tiny_engine.generate([requests[0], Request([5], mode="nope")])
    assert "request 1 of the list" in "".join(getattr(refused.value, "__notes__", []))
    assert tiny_engine.loop.forwards == forwards and tiny_engine.loop.idle  # nothing ran
    assert tiny_engine.generate(requests[0]).token_ids == alone[0].token_ids
