"""Exploration over HTTP (issue 39): ``clover.step_map``, ``clover.experts`` and ``clover.policy``
against the engine's own answers: the step map is GenerationResult.unmask_steps, the experts are
what a Capture of ``layers.*.moe.route`` records for the committed positions, streamed chunk by
chunk they add up to the whole; a request that does not ask gets none of it and records nothing."""
import json

import pytest
import torch

from clover_lab.serve import create_app
from clover_lab.serve.explore import NOT_ROUTED, unpack

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

NAME = "clover-stdlib"
PROMPT = "def parse(line):\n"


@pytest.fixture(scope="module")
def refs(engine):
    """Per mode: the greedy result and the experts each response token's commit forward routed to."""
    out = {}
    for mode in ("diffusion", "ar", "speculative"):
        with engine.capture(["layers.*.moe.route"], to="cpu") as cap:
            r = engine.generate(PROMPT, mode=mode, max_new_tokens=20)
        L, k = engine.model.config.num_hidden_layers, engine.model.config.num_experts_per_tok
        experts = torch.full((len(r.token_ids), L, k), NOT_ROUTED, dtype=torch.uint8)
        for rec in cap["layers.*.moe.route"]:
            if rec["mode"] != "commit":
                continue
            for pos, ids in zip(rec["positions"].tolist(), rec["expert_ids"]):
                if 0 <= pos - len(r.prompt_ids) < len(r.token_ids):
                    experts[pos - len(r.prompt_ids), rec["layer"]] = ids.to(torch.uint8)
        out[mode] = r, experts
    out["topk"] = engine.generate(PROMPT, max_new_tokens=20, policy="topk:k=1")
    return out


@pytest.fixture(scope="module")
def client(engine, refs):
    with TestClient(create_app(engine, model_name=NAME)) as c:
        yield c


def body(**clover):
    return {"model": NAME, "prompt": PROMPT, "max_tokens": 20, "clover": clover}


@pytest.mark.parametrize("mode", ["diffusion", "ar", "speculative"])
def test_step_map_and_experts_are_the_engines(client, refs, mode):
    r, experts = refs[mode]
    out = client.post("/v1/completions", json=body(mode=mode, step_map=True, experts=True)).json()
    assert out["choices"][0]["text"] == r.text
    assert out["clover"]["step_map"] == [r.unmask_steps]
    wire = out["clover"]["experts"][0]
    assert wire["dtype"] == "uint8" and wire["shape"] == list(experts.shape)
    got = unpack(wire)
    assert torch.equal(got, experts) and not (got == NOT_ROUTED).any()  # every committed token was routed
    if mode == "diffusion":
        assert len(set(r.unmask_steps)) > 1  # a step map that says something
    elif mode == "ar":
        assert set(r.unmask_steps) == {0}


def test_streamed_frames_add_up_to_the_whole(client, refs):
    r, experts = refs["diffusion"]
    text = client.post("/v1/completions", json={**body(step_map=True, experts=True), "stream": True}).text
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    committed = [c["clover"] for c in chunks if c.get("clover", {}).get("kind") == "committed"]
    assert len(committed) > 1
    for c in committed:  # each chunk's frame is of its own tokens
        assert len(c["step_map"]) == len(c["tokens"]) == c["experts"]["shape"][0]
    assert [s for c in committed for s in c["step_map"]] == r.unmask_steps
    assert torch.equal(torch.cat([unpack(c["experts"]) for c in committed]), experts)


def test_off_by_default_and_nothing_recorded(client, engine, monkeypatch):
    hooks, opened = engine.model.hooks, []
    open_scope = hooks.open_scope
    monkeypatch.setattr(hooks, "open_scope", lambda fns: opened.append(open_scope(fns)) or opened[-1])
    out = client.post("/v1/completions", json=body()).json()
    assert set(out["clover"]) == {"stats"}
    text = client.post("/v1/completions", json={**body(), "stream": True}).text
    frames = [json.loads(line[6:])["clover"] for line in text.splitlines() if line.startswith("data: {")]
    assert all(set(f) == {"kind", "block", "tokens"} for f in frames if f["kind"] == "committed")
    assert not opened  # no hook for a request that asks for nothing
    client.post("/v1/completions", json=body(experts=True))
    assert len(opened) == 1 and not opened[0]._scope.open  # the request's scope closed with it


def test_policy_by_name(client, refs):
    out = client.post("/v1/completions", json=body(policy="topk:k=1", step_map=True)).json()
    want = refs["topk"]
    assert out["choices"][0]["text"] == want.text and out["clover"]["step_map"] == [want.unmask_steps]
    assert out["clover"]["stats"][0]["steps_per_block"] == want.stats.steps_per_block
    chat = client.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 8, "clover": {"policy": "eb:gamma=0.5"}})
    assert chat.status_code == 200


@pytest.mark.parametrize("clover,param", [
    ({"policy": "nope"}, "clover.policy"),
    ({"policy": "topk:k"}, "clover.policy"),
    ({"policy": "eb:gamma=0.5", "mode": "ar"}, "clover.policy"),
    ({"policy": 3}, "clover.policy"),
    ({"step_map": 1}, "clover.step_map"),
    ({"experts": "yes"}, "clover.experts"),
])
def test_bad_exploration_fields_name_themselves(client, clover, param):
    r = client.post("/v1/completions", json=body(**clover))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()


def test_readme_client_example(client, refs):
    """The example of docs/guides/serving.md (Exploration), with the openai client (its extra fields are attributes)."""
    import base64

    import numpy as np
    import openai

    oc = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0)
    r = oc.completions.create(model=NAME, prompt=PROMPT, max_tokens=20,
                              extra_body={"clover": {"step_map": True, "experts": True}})
    want, experts = refs["diffusion"]
    assert r.clover["step_map"][0] == want.unmask_steps
    wire = r.clover["experts"][0]
    got = np.frombuffer(base64.b64decode(wire["data"]), np.uint8).reshape(wire["shape"])
    assert (got == experts.numpy()).all()
    frames = [s.clover for s in oc.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, stream=True, extra_body={
        "clover": {"step_map": True, "stream_provisional": True}})]
    assert {f["kind"] for f in frames} == {"provisional", "committed", "done"}


def test_experts_on_the_fast_path_are_the_eager_ones(client, engine, refs):
    """The recorder's hook is an observer: on the fast path's static steps (CUDA graphs on a GPU; eager
    static steps here) it reads what each step recorded, and the experts are the eager path's."""
    r, experts = refs["diffusion"]
    engine.step_graphs = True
    try:
        out = client.post("/v1/completions", json=body(experts=True)).json()
    finally:
        engine.step_graphs = None
    assert out["clover"]["stats"][0]["path"].startswith("static (observers read after each step")
    assert out["choices"][0]["text"] == r.text and torch.equal(unpack(out["clover"]["experts"][0]), experts)
