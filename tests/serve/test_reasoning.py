"""A chat with thinking over HTTP (clover-tiny with a tokenizer of Qwen3.5/3.6's format, its response
written by a denoise.step hook): the reasoning comes apart as message.reasoning_content and, in a
stream, as delta.reasoning_content chunk by chunk, adding up to the whole; a constrained response
with the reasoning open is refused, naming the thinking switch."""
import json

import pytest
from qwen_format import qwen_tokenizer

import clover_lab
from clover_lab.hooks import points
from clover_lab.serve import create_app

REASONING = "The user asks a question. Let me think about it step by step: first the plan, then the answer."
ANSWER = "the answer to the question"


@pytest.fixture(scope="module")
def app(tmp_path_factory, gen_model):
    from fastapi.testclient import TestClient

    d = tmp_path_factory.mktemp("qwen_format")
    gen_model.save_pretrained(d)
    qwen_tokenizer().save_pretrained(str(d))
    engine = clover_lab.load(d)
    engine.block_size = 8  # the reasoning spans blocks: a stream sends it in pieces
    tok = engine.tokenizer
    script = tok(f"\n{REASONING}\n</think>\n\n{ANSWER}", add_special_tokens=False)["input_ids"] + [
        tok.convert_tokens_to_ids("<|im_end|>")]
    bs = engine.block_size

    def write(ev):  # the response, whatever the model
        for p in list(ev.masked):
            i = ev.block * bs + p
            ev.set_token(p, script[i] if i < len(script) else script[-1])

    engine.add_hook(points.DENOISE_STEP, write)
    with TestClient(create_app(engine, model_name="tiny")) as client:
        yield client


# traced: each request runs in a batch of its own. A request that joins a running batch at a block boundary
# becomes a row without its prompt's thinking state (engine/run.py's Run.admit makes the Row but not its
# Thinking, as Engine._start does), so its reasoning would not come apart: left to the engine of rows (issue 38)
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "What is the answer?"}], "max_tokens": 96,
        "clover": {"trace": True}}


def test_reasoning_comes_apart_in_the_message_and_the_stream(app):
    r = app.post("/v1/chat/completions", json=BODY)
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning_content"] == REASONING and msg["content"] == ANSWER, msg
    with app.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    thought = [d["reasoning_content"] for d in deltas if d.get("reasoning_content")]
    assert "".join(thought) == REASONING and len(thought) >= 2  # as blocks commit, not only at the end
    assert "".join(d.get("content") or "" for d in deltas) == ANSWER
    assert not any(d.get("reasoning_content") and d.get("content") for d in deltas[:2])


def test_a_constrained_response_with_the_reasoning_open_is_refused(app):
    r = app.post("/v1/chat/completions", json={**BODY, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "clover.thinking", r.text
    r = app.post("/v1/chat/completions", json={**BODY, "response_format": {"type": "json_object"},
                                               "chat_template_kwargs": {"enable_thinking": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.enable_thinking", r.text
