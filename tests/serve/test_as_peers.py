"""What agent clients send, as vLLM and SGLang serve it (issue 54), against a live server on
127.0.0.1 (the embedded model in float32): schemas closed where silent (and open on request),
vLLM's ``structured_outputs`` and SGLang's ``regex``/``ebnf``, a tool call cut by max_tokens
("length", streamed as not), the fields clients send accepted as no-ops or mapped to the engine's
settings, ``/v1/responses`` through the openai client, ``/tokenize``, ``/detokenize``, ``/version``,
usage with ``n``, and a client gone as one INFO line."""
import json
import logging
import re
import time

import httpx
import openai
import pytest

from clover_lab.serve import create_app, schemas
from clover_lab.serve.jobs import sampler_settings

pytest.importorskip("uvicorn")

NAME = "clover-stdlib"
OPEN = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": OPEN}}
ASK = [{"role": "user", "content": "weather in Oslo?"}]


@pytest.fixture(scope="module")
def server(engine, live):
    return live(create_app(engine, model_name=NAME, max_batch=8)), engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def post(server, path, timeout=120, **body):
    return httpx.post(server[0] + path, json={"model": NAME, **body}, timeout=timeout)


def test_structured_outputs_in_vllms_and_sglangs_spellings(server):
    cases = [({"structured_outputs": {"choice": ["yes", "no"]}}, r"(yes|no)"),
             ({"structured_outputs": {"regex": "[0-9]{3}"}}, r"[0-9]{3}"),
             ({"regex": "[a-c]{2}x"}, r"[a-c]{2}x"),
             ({"ebnf": 'root ::= "x = " ("1" | "2")'}, r"x = [12]"),
             ({"structured_outputs": {"json": json.dumps(OPEN)}}, None)]
    for extra, pattern in cases:
        r = post(server, "/v1/completions", prompt="x = ", max_tokens=16, **extra)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        if pattern is None:  # closed: the one key
            assert set(json.loads(text)) == {"city"}
        else:
            assert re.fullmatch(pattern, text), (extra, text)
    for extra, param in [({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
                         ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
                         ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
                         ({"regex": "a", "response_format": {"type": "json_object"}}, "regex")]:
        r = post(server, "/v1/completions", prompt="x", max_tokens=4, **extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_a_forced_call_of_an_open_schema_takes_no_other_key_unless_asked(server, client):
    r = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], max_tokens=40,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.choices[0].finish_reason == "tool_calls"
    assert set(json.loads(r.choices[0].message.tool_calls[0].function.arguments)) == {"city"}
    # open on request: the grammar the request runs with is the open one (the tool call is no different here)
    from clover_lab.serve import tools
    body = schemas.ChatRequest.model_validate({"model": NAME, "messages": ASK, "tools": [WEATHER],
                                               "clover": {"open_schemas": True}})
    assert not tools.closes(body) and tools.closes(body.model_copy(update={"clover": schemas.CloverOptions()}))
    assert tools.closes(body, open_schemas=True) is False
    assert tools.closes(schemas.ChatRequest.model_validate({"model": NAME, "messages": ASK}), open_schemas=True) \
        is False


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_call_cut_by_max_tokens_ends_length_and_is_neither_call_nor_content(client, stream):
    kw = dict(model=NAME, messages=ASK, tools=[WEATHER], max_tokens=8,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        assert not [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    else:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "length"
        assert not r.choices[0].message.tool_calls and not r.choices[0].message.content


def test_fields_clients_send_are_accepted_or_mapped(server):
    r = post(server, "/v1/chat/completions", messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "12", "tool_call_id": "c1", "name": "get_weather"}],
        max_tokens=2, store=False, metadata={"k": "v"}, service_tier="auto", reasoning_effort="low", prediction=None,
        top_k=-1, min_p=0.05, repetition_penalty=1.1, stop_token_ids=server[1].eos_token_ids,
        include_stop_str_in_output=False, skip_special_tokens=True, user="u", skip_reading_prefix_cache=True)
    assert r.status_code == 200, r.text
    for extra, param in [({"stop_token_ids": [5]}, "stop_token_ids"), ({"include_stop_str_in_output": True},
                                                                         "include_stop_str_in_output"),
                         ({"min_p": 2.0}, "min_p"), ({"frobnicate": 1}, "frobnicate"),
                         ({"prediction": {"type": "content", "content": "x"}}, "prediction")]:
        r = post(server, "/v1/chat/completions", messages=ASK, max_tokens=2, **extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    body = schemas.ChatRequest.model_validate({"model": NAME, "messages": ASK, "top_k": 5, "min_p": 0.1,
                                               "repetition_penalty": 1.2})
    s = sampler_settings(server[1], body)
    assert (s.top_k, s.min_p, s.repetition_penalty) == (5, 0.1, 1.2)
    assert sampler_settings(server[1], body.model_copy(update={"top_k": -1})).top_k == 0


def test_routes_tokenize_detokenize_version_model_and_usage_with_n(server):
    engine = server[1]
    r = post(server, "/tokenize", prompt="def f(x):", return_token_strs=True).json()
    assert r["tokens"] == engine.encode("def f(x):") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == engine.model.config.max_position_embeddings and len(r["token_strs"]) == r["count"]
    chat = post(server, "/tokenize", messages=ASK).json()
    assert chat["tokens"] == engine.encode(ASK) and chat["token_strs"] is None
    assert post(server, "/detokenize", tokens=r["tokens"]).json() == {"prompt": "def f(x):"}
    assert post(server, "/detokenize", tokens=[10 ** 7]).json()["error"]["param"] == "tokens"
    assert httpx.get(server[0] + "/version").json()["version"]
    card = httpx.get(server[0] + f"/v1/models/{NAME}").json()
    assert card["root"] == NAME and card["parent"] is None
    u = post(server, "/v1/completions", prompt="def f(x):", max_tokens=2, n=3, temperature=1.0, seed=0).json()["usage"]
    assert u["prompt_tokens"] == len(r["tokens"]) and u["completion_tokens"] == 6  # the prompt once, as OpenAI


def test_responses_text_and_its_stream(client):
    r = client.responses.create(model=NAME, input="def add(a, b):", instructions="Write Python.",
                                max_output_tokens=8, store=False, metadata={"k": "v"})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.output_text
    assert r.usage.output_tokens == 8 and r.usage.total_tokens == r.usage.input_tokens + 8 and r.store is False
    events = list(client.responses.create(model=NAME, input="def add(a, b):", instructions="Write Python.",
                                          max_output_tokens=8, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text \
        == events[-1].response.output_text  # greedy: the same text as the response object's
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=NAME, input="x", previous_response_id="resp_1")


@pytest.mark.slow  # ~5 s: a forced call over a 200-token prompt, its follow-up, a schema
def test_responses_function_call_round_trip_and_text_format(client):
    weather = {"type": "function", "name": "get_weather", "parameters": OPEN}
    r = client.responses.create(model=NAME, input="weather in Oslo?", tools=[weather], max_output_tokens=40,
                                tool_choice={"type": "function", "name": "get_weather"})
    call = r.output[-1]
    assert r.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city"}
    follow = client.responses.create(model=NAME, max_output_tokens=4, tools=[weather], input=[
        {"role": "user", "content": "weather in Oslo?"}, call.model_dump(),
        {"type": "function_call_output", "call_id": call.call_id, "output": "12 C"}])
    assert follow.output and follow.usage.input_tokens > r.usage.input_tokens
    r = client.responses.create(model=NAME, input="a city as JSON", max_output_tokens=40, text={"format": {
        "type": "json_schema", "name": "city", "schema": OPEN}})
    assert set(json.loads(r.output_text)) == {"city"}


def test_a_client_gone_is_one_info_line(server):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("uvicorn.error")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)  # the test server logs warnings only
    try:
        with pytest.raises(httpx.ReadTimeout):
            post(server, "/v1/completions", prompt="def f(x):", max_tokens=2000, ignore_eos=True, timeout=0.5)
        deadline = time.time() + 10
        while not records and time.time() < deadline:
            time.sleep(0.05)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert [(r.levelno, "went away" in r.getMessage()) for r in records] == [(logging.INFO, True)]
