"""OpenAI completeness over the engine's new settings (issue 39): completions' echo with the prompt's
log-probabilities (lm-eval's loglikelihood: echo, max_tokens 0, logprobs 1, token-id prompts in a
batch), log-probabilities streamed with the chunk whose tokens they score, ignore_eos, min_tokens and
logit_bias; every value is the engine's own (engine.generate with the same Request)."""
import json

import pytest

from clover_lab.engine.requests import Request
from clover_lab.serve import create_app

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

NAME = "clover-stdlib"
PROMPT = "def parse(line):\n"


@pytest.fixture(scope="module")
def refs(engine):
    return {"score": engine.generate(Request(PROMPT, max_new_tokens=0, prompt_logprobs=1)),
            "echo": engine.generate(Request(PROMPT, max_new_tokens=12, prompt_logprobs=2, logprobs=2)),
            "long": engine.generate(Request(PROMPT, max_new_tokens=40, logprobs=2)),
            "chat": engine.generate(Request([{"role": "user", "content": "write a loop"}], max_new_tokens=24,
                                            logprobs=2))}


@pytest.fixture(scope="module")
def client(engine, refs):
    with TestClient(create_app(engine, model_name=NAME)) as c:
        yield c


def post(client, **body):
    r = client.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, **body})
    assert r.status_code == 200, r.text
    return r.json()


def events(client, path, **body):
    text = client.post(path, json={"model": NAME, "stream": True, **body}).text
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_loglikelihood_as_lm_eval_asks(client, engine, refs):
    ref = refs["score"]
    ids = engine.encode(PROMPT)
    out = client.post("/v1/completions", json={"model": NAME, "prompt": [ids, ids[:3]], "echo": True, "max_tokens": 0,
                                                "logprobs": 1, "temperature": 0}).json()
    assert [c["text"] for c in out["choices"]] == [engine.tokenizer.decode(ids), engine.tokenizer.decode(ids[:3])]
    lp = out["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(ref.prompt_logprobs[1:], abs=1e-4)  # a batch's forward
    assert lp["tokens"] == [engine.tokenizer.decode([t]) for t in ids]
    for token, top, value in zip(lp["tokens"][1:], lp["top_logprobs"][1:], lp["token_logprobs"][1:]):
        assert top[token] == pytest.approx(value) and 1 <= len(top) <= 2  # lm-eval's greedy check reads these
    assert out["choices"][1]["logprobs"]["token_logprobs"][1:] == pytest.approx(ref.prompt_logprobs[1:3], abs=1e-4)
    assert out["usage"]["completion_tokens"] == 0


def test_echo_before_a_completion_and_its_stream(client, refs):
    ref = refs["echo"]
    out = post(client, max_tokens=12, echo=True, logprobs=2)["choices"][0]
    assert out["text"] == PROMPT + ref.text
    assert out["logprobs"]["token_logprobs"] == pytest.approx([None] + ref.prompt_logprobs[1:] + ref.logprobs)
    chunks = [e["choices"][0] for e in events(client, "/v1/completions", prompt=PROMPT, max_tokens=12, echo=True,
                                              logprobs=2)]
    assert chunks[0]["text"] == PROMPT and chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chunks) == out["text"]
    streamed = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(out["logprobs"]["token_logprobs"])
    offsets = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["text_offset"]]
    assert offsets == out["logprobs"]["text_offset"]


def test_streamed_logprobs_come_with_their_tokens(client, refs):
    ref = refs["long"]
    chunks = events(client, "/v1/completions", prompt=PROMPT, max_tokens=40, logprobs=2, clover={})
    scored = [(c["clover"]["tokens"], c["choices"][0]["logprobs"]) for c in chunks
              if c.get("clover", {}).get("kind") == "committed"]
    assert len(scored) > 1 and all(len(lp["token_logprobs"]) == len(tokens) for tokens, lp in scored)
    assert [v for _, lp in scored for v in lp["token_logprobs"]] == pytest.approx(ref.logprobs)
    assert chunks[-1]["choices"][0]["logprobs"] is None  # the finish chunk scores no token twice
    chat = refs["chat"]
    chunks = events(client, "/v1/chat/completions", messages=[{"role": "user", "content": "write a loop"}],
                    max_tokens=24, logprobs=True, top_logprobs=2)
    content = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
               for t in c["choices"][0]["logprobs"]["content"]]
    assert [t["logprob"] for t in content] == pytest.approx(chat.logprobs)
    assert all(t["token"] in [a["token"] for a in t["top_logprobs"]] for t in content)


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_ignore_eos_min_tokens_and_logit_bias(client, engine, mode):
    eos = engine.eos_token_ids[0]
    bias = {"logit_bias": {str(eos): 100}, "max_tokens": 8, "clover": {"mode": mode}}
    ended = post(client, **bias)
    assert ended["choices"][0]["finish_reason"] == "stop" and ended["usage"]["completion_tokens"] <= 1
    held = post(client, **bias, min_tokens=5)  # no end token before 5 tokens, then the biased EOS
    assert ended["usage"]["completion_tokens"] < held["usage"]["completion_tokens"] and \
        held["clover"]["stats"][0]["stop_reason"] == "eos" and held["usage"]["completion_tokens"] >= 5
    ignored = post(client, **bias, ignore_eos=True)
    assert ignored["choices"][0]["finish_reason"] == "length" and ignored["usage"]["completion_tokens"] == 8
    banned = post(client, max_tokens=8, clover={"mode": mode}, temperature=0)
    first = engine.encode(PROMPT + banned["choices"][0]["text"])[len(engine.encode(PROMPT))]
    other = post(client, max_tokens=8, clover={"mode": mode}, logit_bias={str(first): -100})
    assert other["choices"][0]["text"] != banned["choices"][0]["text"]


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"echo": "yes"}, "echo"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "high"}}, "logit_bias.5"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
])
def test_bad_scoring_fields_name_themselves(client, body, param):
    r = client.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()


def test_chat_takes_min_tokens_and_refuses_max_tokens_0(client):
    msgs = [{"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"model": NAME, "messages": msgs, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = client.post("/v1/chat/completions", json={"model": NAME, "messages": msgs, "max_tokens": 6, "min_tokens": 6,
                                                  "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
