"""AR with the trunk's multi-token-prediction head (issue 53): the head's checkpoint names (a
Qwen3.5-MoE-shaped checkpoint with ``mtp.*``, per-expert and prefixed as Qwen ships it) round-trip
through load and save; a checkpoint without a head loads as before and refuses mode "mtp"; greedy
mode "mtp" equals AR token for token, alone and in a batch beside rows of the other modes; its
settings and errors."""
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from clover_lab import CloverConfig, CloverModel, Engine, GenerationError, Request
from clover_lab.checkpoint.loading import CheckpointError
from clover_lab.engine.sampling import SettingsError

pytestmark = pytest.mark.usefixtures("gen_one_thread")
PROMPTS = [[5, 17, 33], [5, 17, 33, 100, 2, 9, 77, 301, 12, 64], [400, 3, 250, 7, 88, 19]]


def load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CloverModel.from_pretrained(path)


def qwen_mtp_tensors(c, seed: int = 5) -> dict:
    """An MTP head as Qwen3.5/3.6-MoE checkpoints store it (names from vLLM's qwen3_5_mtp.py):
    experts one by one, the attention's q_proj with its output gate, every tensor random."""
    g = torch.Generator().manual_seed(seed)
    H, E, I = c.hidden_size, c.num_experts, c.moe_intermediate_size
    heads, kv, d, shared = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.shared_expert_intermediate_size

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    t = {"mtp.fc.weight": r(H, 2 * H), "mtp.pre_fc_norm_embedding.weight": r(H),
         "mtp.pre_fc_norm_hidden.weight": r(H), "mtp.norm.weight": r(H)}
    p = "mtp.layers.0."
    t.update({p + "input_layernorm.weight": r(H), p + "post_attention_layernorm.weight": r(H),
              p + "self_attn.q_proj.weight": r(heads * d * 2, H), p + "self_attn.k_proj.weight": r(kv * d, H),
              p + "self_attn.v_proj.weight": r(kv * d, H), p + "self_attn.o_proj.weight": r(H, heads * d),
              p + "self_attn.q_norm.weight": r(d), p + "self_attn.k_norm.weight": r(d),
              p + "mlp.gate.weight": r(E, H), p + "mlp.shared_expert.gate_proj.weight": r(shared, H),
              p + "mlp.shared_expert.up_proj.weight": r(shared, H), p + "mlp.shared_expert.down_proj.weight": r(H, shared),
              p + "mlp.shared_expert_gate.weight": r(1, H)})
    for e in range(E):
        t.update({f"{p}mlp.experts.{e}.gate_proj.weight": r(I, H), f"{p}mlp.experts.{e}.up_proj.weight": r(I, H),
                  f"{p}mlp.experts.{e}.down_proj.weight": r(H, I)})
    return t


@pytest.fixture(scope="module")
def qwen_with_mtp(reference, clover_ref, tmp_path_factory):
    """transformers' Qwen3.5-MoE checkpoint made multimodal-shaped (``model.language_model.``, a
    ``text_config``) with an MTP head beside it: (directory, the head's tensors)."""
    src = reference[1]
    out = tmp_path_factory.mktemp("qwen_mtp")
    tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in load_file(f"{src}/model.safetensors").items()}
    head = qwen_mtp_tensors(clover_ref.config)
    save_file({**tensors, **head}, str(out / "model.safetensors"))
    text = json.loads(open(f"{src}/config.json").read())
    text["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": text}))
    return out, head


def test_a_qwen_checkpoint_with_mtp_round_trips(qwen_with_mtp, tmp_path):
    path, head = qwen_with_mtp
    model = load(path)
    assert model.mtp is not None and model.config.mtp_num_hidden_layers == 1
    params = dict(model.named_parameters())
    for name, want in head.items():
        if ".experts." in name:
            continue
        assert torch.equal(params[name], want), name
    gate_up, I = params["mtp.layers.0.mlp.experts.gate_up_proj"], model.config.moe_intermediate_size
    assert torch.equal(gate_up[3, :I], head["mtp.layers.0.mlp.experts.3.gate_proj.weight"])
    assert torch.equal(gate_up[3, I:], head["mtp.layers.0.mlp.experts.3.up_proj.weight"])
    model.save_pretrained(tmp_path / "saved")
    written = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert {k for k in written if k.startswith("mtp.")} >= {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight",
                                                           "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
                                                           "mtp.layers.0.self_attn.q_proj.weight",
                                                           "mtp.layers.0.mlp.experts.gate_up_proj"}
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    again = load(tmp_path / "saved")
    for name, p in again.named_parameters():
        assert torch.equal(p, params[name]), name


def test_a_checkpoint_without_mtp_loads_as_before_and_refuses_the_mode(clover_ref):
    assert clover_ref.mtp is None  # transformers' config declares a head; its weights hold none
    engine = Engine(clover_ref)
    with pytest.raises(GenerationError, match=r"mode='mtp' needs the model's multi-token-prediction head.*mtp\.fc") as e:
        engine.generate(PROMPTS[0], mode="mtp", max_new_tokens=4)
    assert e.value.field == "mode"
    assert engine.generate(PROMPTS[0], mode="ar", max_new_tokens=4).token_ids  # the engine goes on


def test_an_incomplete_head_is_refused_naming_what_is_missing(qwen_with_mtp, tmp_path):
    path, head = qwen_with_mtp
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["mtp.norm.weight"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="mtp.norm.weight"):
        load(tmp_path)
    only_fc = {k: v for k, v in tensors.items() if not k.startswith("mtp.") or k == "mtp.fc.weight"}
    save_file(only_fc, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"mtp.\* tensors but no mtp.layers.0"):
        load(tmp_path)


@pytest.fixture(scope="module")
def mtp_engine():
    """clover-tiny with a random head, its LM head sharpened (so drafts are sometimes right)."""
    model = CloverModel.random(CloverConfig.preset("clover-tiny", mtp_num_hidden_layers=1), seed=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return Engine(model)


@pytest.mark.parametrize("p, kw, k", [(PROMPTS[0], dict(max_new_tokens=16), 3),
                                     (PROMPTS[1], dict(max_new_tokens=11, repetition_penalty=1.3), 5)])
def test_greedy_equals_ar_alone_and_with_penalties(mtp_engine, p, kw, k):
    ar = mtp_engine.generate(p, mode="ar", **kw)
    got = mtp_engine.generate(p, mode="mtp", mtp_draft_tokens=k, **kw)
    assert got.token_ids == ar.token_ids and got.stop_reason == ar.stop_reason
    st = got.stats
    assert st.forwards == st.commit_forwards == len(st.drafted) == st.blocks
    assert all(d <= k for d in st.drafted) and sum(st.accepted) + st.blocks >= st.new_tokens


def test_greedy_in_a_batch_beside_the_other_modes(mtp_engine):
    reqs = [Request(PROMPTS[0], mode="mtp", max_new_tokens=12), Request(PROMPTS[1], mode="ar", max_new_tokens=6),
            Request(PROMPTS[2], mode="diffusion", max_new_tokens=8), Request(PROMPTS[1], mode="mtp", max_new_tokens=7,
                                                                             mtp_draft_tokens=2),
            Request(PROMPTS[2], mode="speculative", max_new_tokens=8)]
    alone = [mtp_engine.generate(r) for r in reqs]
    handles = [mtp_engine.submit(r, emit=False) for r in reqs]
    for _ in range(1000):
        if all(h.done for h in handles):
            break
        mtp_engine.step()
    for h, a, r in zip(handles, alone, reqs):
        assert h.error is None and h.result.token_ids == a.token_ids, r.mode
    for r, a in zip(reqs, alone):
        if r.mode == "mtp":
            assert a.token_ids == mtp_engine.generate(Request(r.prompt, mode="ar", max_new_tokens=r.max_new_tokens)).token_ids


def test_settings_and_errors(mtp_engine):
    with pytest.raises(SettingsError, match="mtp_draft_tokens=0"):
        mtp_engine.generate(PROMPTS[0], mode="mtp", max_new_tokens=4, mtp_draft_tokens=0)
    with pytest.raises(GenerationError, match="mtp_draft_tokens.*mode='ar' ignores it"):
        mtp_engine.generate(PROMPTS[0], mode="ar", max_new_tokens=2, mtp_draft_tokens=2)
    a = mtp_engine.generate(PROMPTS[2], mode="mtp", max_new_tokens=12, temperature=0.9, seed=3)
    b = mtp_engine.generate(PROMPTS[2], mode="mtp", max_new_tokens=12, temperature=0.9, seed=3)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12


def assert_same_logprobs(got, want):
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-4)
    assert [[t for t, _ in top] for top in got.top_logprobs] == [[t for t, _ in top] for top in want.top_logprobs]
    torch.testing.assert_close(torch.tensor([[v for _, v in top] for top in got.top_logprobs]),
                               torch.tensor([[v for _, v in top] for top in want.top_logprobs]), rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def embedded():
    """The embedded model with its trained head (its drafts are often accepted; the random head
    of ``mtp_engine`` has its drafts rejected)."""
    import clover_lab

    return clover_lab.load(dtype=torch.float32)


CODE = ["def parse(line):\n", "class Stack:\n    def push(self, item):\n", "import os\n"]


def test_logprobs_are_ars(embedded):
    """Mode "mtp" (and speculative) refused logprobs. Each kept token carries the verifier's
    log-probability and top alternatives, AR's for the same tokens: drafted tokens accepted, the
    verifier's own at a first difference, with penalties, in a batch; sampled, a plain forward's."""
    greedy = dict(temperature=0, repetition_penalty=1.3, logprobs=2)
    ar = embedded.generate(CODE[1], mode="ar", max_new_tokens=12, **greedy)
    for mode in ("mtp", "speculative"):
        got = embedded.generate(CODE[1], mode=mode, max_new_tokens=12, **greedy)
        assert got.token_ids == ar.token_ids and len(got.logprobs) == len(got.token_ids)
        assert sum(got.stats.accepted) > 0, mode  # drafted tokens among them
        assert_same_logprobs(got, ar)
    batch = embedded.generate(CODE[:2], mode="mtp", max_new_tokens=6, **greedy)
    for p, row in zip(CODE[:2], batch):
        assert_same_logprobs(row, embedded.generate(p, mode="ar", max_new_tokens=6, **greedy))
    s = embedded.generate(CODE[2], mode="mtp", max_new_tokens=10, temperature=0.9, repetition_penalty=1.0, seed=3,
                          logprobs=0)
    ids = embedded.encode(CODE[2])
    with torch.no_grad():
        logits = embedded.model.logits(torch.tensor([ids + s.token_ids]))[0, len(ids) - 1:-1]
    want = logits.float().log_softmax(-1).gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(s.logprobs), want, rtol=0, atol=1e-4)
    assert s.top_logprobs is None  # logprobs=0: the token's own only


def test_hooks_on_mtp_rows_act_as_on_ar_rows(embedded):
    """A residual edit at every position is AR's under the same edit (the verify forward applies it to
    each kept position once, as AR's forwards do; the head's own layer fires no trunk point);
    block.commit events carry the response in order with the acceptance, and stopping at one, or a
    StopGeneration from inside the model, ends the row with a prefix of AR's tokens."""
    from clover_lab.hooks.registry import StopGeneration

    greedy = dict(max_new_tokens=12, temperature=0, repetition_penalty=1.0)
    push = torch.randn(embedded.model.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 2

    def steer(ev):
        ev.value = ev.value + push.to(ev.value.dtype)

    plain = embedded.generate(CODE[0], mode="ar", **greedy)
    with embedded.hooks({"layers.1.output": steer}):
        ar = embedded.generate(CODE[0], mode="ar", **greedy)
        got = embedded.generate(CODE[0], mode="mtp", **greedy)
    assert got.token_ids == ar.token_ids != plain.token_ids
    events = []
    with embedded.hooks({"block.commit": events.append}):
        got = embedded.generate(CODE[0], mode="mtp", **greedy)
    assert [t for ev in events for t in ev.tokens] == got.token_ids == plain.token_ids
    assert all(ev.accepted + ev.rejected == ev.drafted and len(ev.tokens) <= 1 + ev.accepted for ev in events)
    assert any(ev.accepted for ev in events)

    def second(ev):
        if ev.block == 1:
            ev.stop()

    with embedded.hooks({"block.commit": second}):
        stopped = embedded.generate(CODE[0], mode="mtp", **greedy)
    assert stopped.stop_reason == "hook" and stopped.token_ids == [t for ev in events[:2] for t in ev.tokens]
    forwards = []

    def third_decode(ev):
        if ev.phase == "decode" and ev.layer == 0:
            forwards.append(ev)
            if len(forwards) == 3:
                raise StopGeneration

    with embedded.hooks({"layers.0.input": third_decode}):
        stopped = embedded.generate(CODE[0], mode="mtp", **greedy)
    assert stopped.stop_reason == "hook" and stopped.token_ids == plain.token_ids[:len(stopped.token_ids)]
    assert stopped.token_ids == [t for ev in events[:2] for t in ev.tokens]  # the third verify changed nothing


def test_a_steps_rows_draft_in_one_head_forward(embedded):
    """The head ran row by row. A step's mtp rows (different prompts, lengths and draft lengths, beside
    an AR row) now draft together, one head forward per draft position: each row's tokens and its
    drafts' acceptance are the row's alone, in fewer head forwards."""
    greedy = dict(temperature=0, repetition_penalty=1.0)
    reqs = [Request(CODE[0], mode="mtp", max_new_tokens=10, **greedy),
            Request(CODE[1], mode="mtp", max_new_tokens=8, mtp_draft_tokens=2, **greedy),
            Request(CODE[2], mode="ar", max_new_tokens=6, **greedy)]
    sizes = []
    hook = embedded.model.mtp.register_forward_hook(lambda m, args, out: sizes.append(args[2].shape[0]))
    try:
        alone = [embedded.generate(r) for r in reqs]
        forwards_alone, sizes[:] = len(sizes), []
        handles = [embedded.submit(r, emit=False) for r in reqs]
        while not all(h.done for h in handles):
            embedded.step()
    finally:
        hook.remove()
    for h, a in zip(handles, alone):
        assert h.error is None and h.result.token_ids == a.token_ids
        assert h.result.stats.accepted == a.stats.accepted  # the same drafts
    assert max(sizes) == 2 and len(sizes) < forwards_alone


def test_mtp_runs_up_to_the_context_length():
    """The head's cache was allocated for the row's positions plus scratch, past the context: a
    prompt and max_new_tokens filling the context failed with a CacheFullError."""
    model = CloverModel.random(CloverConfig.preset("clover-tiny", mtp_num_hidden_layers=1,
                                                   max_position_embeddings=48), seed=2)
    engine, prompt = Engine(model), list(range(5, 49))
    got = engine.generate(prompt, mode="mtp", max_new_tokens=4)
    assert got.token_ids == engine.generate(prompt, mode="ar", max_new_tokens=4).token_ids


def test_cancel_and_stream(mtp_engine):
    updates = list(mtp_engine.stream(Request(PROMPTS[1], mode="mtp", max_new_tokens=10)))
    assert updates[-1].kind == "done"
    h = mtp_engine.submit(Request(PROMPTS[1], mode="mtp", max_new_tokens=40), emit=False)
    mtp_engine.step()
    mtp_engine.step()
    h.cancel()
    mtp_engine.step()
    assert h.done and h.result.stop_reason == "cancelled" and 0 < len(h.result.token_ids) < 40


def test_the_server_takes_mode_mtp_per_request_and_the_start_switch(mtp_engine, gen_tokenizer):
    from fastapi.testclient import TestClient

    from clover_lab.engine.mtp import speculative_config
    from clover_lab.serve.app import create_app

    engine = Engine(mtp_engine.model, gen_tokenizer)
    body = {"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 8}
    with TestClient(create_app(engine, model_name="tiny")) as client:
        ar = client.post("/v1/completions", json={**body, "clover": {"mode": "ar"}})
        got = client.post("/v1/completions", json={**body, "clover": {"mode": "mtp"}})
        assert ar.status_code == got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == ar.json()["choices"][0]["text"]
        scored = [client.post("/v1/completions", json={**body, "logprobs": 2, "clover": {"mode": mode}}).json()
                  for mode in ("ar", "mtp")]  # refused (a 400) before
        assert scored[1]["choices"][0]["logprobs"]["tokens"] == scored[0]["choices"][0]["logprobs"]["tokens"]
        assert scored[1]["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
            scored[0]["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
        engine.default_mode = "mtp"  # what serve --speculative-config sets
        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == ar.json()["choices"][0]["text"]
    assert speculative_config('{"method": "mtp", "num_speculative_tokens": 4}') == 4
    assert speculative_config('{"method": "mtp"}') == 3
    for bad, what in [('{"method": "eagle"}', "method 'eagle'"), ('{"method": "mtp", "num_speculative_tokens": 0}',
                                                                  "num_speculative_tokens"),
                      ('{"method": "mtp", "draft_model": "x"}', "unknown field"), ("mtp", "not JSON")]:
        with pytest.raises(ValueError, match=what):
            speculative_config(bad)


def test_the_embedded_model_has_a_trained_head(embedded):
    engine = embedded
    assert engine.model.mtp is not None
    greedy = dict(max_new_tokens=24, temperature=0, repetition_penalty=1.0)
    ar = engine.generate("def parse(line):\n", mode="ar", **greedy)
    got = engine.generate("def parse(line):\n", mode="mtp", **greedy)
    assert got.token_ids == ar.token_ids
    assert got.stats.tokens_per_forward > 1.0  # drafts accepted: fewer trunk forwards than AR
