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

from clover_lab.engine.sampling import SamplerSettings
from clover_lab.serve import schemas
from clover_lab.serve.jobs import make_jobs

pytest.importorskip("uvicorn")

NAME = "clover-stdlib"
OPEN = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": OPEN}}
ASK = [{"role": "user", "content": "weather in Oslo?"}]


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


def test_a_slow_compile_is_named_by_the_field_that_constrains():
    """constraint_field (what names a grammar that takes too long) reads the fields constraint reads."""
    from clover_lab.serve import tools
    for name, value in [("response_format", {"type": "json_object"}), ("structured_outputs", {"regex": "a"}),
                        ("regex", "a"), ("ebnf", 'root ::= "a"')]:
        body = schemas.CompletionRequest.model_validate({"model": NAME, "prompt": "x", name: value})
        assert tools.constraining(body) == [name] and tools.constraint_field(body) == name
    text = schemas.CompletionRequest.model_validate({"model": NAME, "prompt": "x", "response_format": {"type": "text"},
                                                     "regex": "a"})
    assert tools.constraining(text) == ["regex"]


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
    for extra, param in [({"top_k": -3}, "top_k"), ({"clover": {"top_k": -3}}, "clover.top_k"),
                         ({"temperature": 0.5, "seed": 2**64}, "seed")]:
        r = post(server, "/v1/completions", prompt="x", max_tokens=2, **extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_stop_strings_change_nothing_where_a_grammar_decides_the_end(server, client):
    """smolagents' ToolCallingAgent sends stop ["Observation:", "Calling tools:"] with tool_choice
    required: refused (a stop string could cut the call unparsable), the agent failed every step. With a
    grammar the stop strings are accepted and change nothing; the call is whole."""
    kw = dict(model=NAME, messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
              max_tokens=40)
    alone = client.chat.completions.create(**kw)
    stopped = client.chat.completions.create(stop=["Observation:", "Calling tools:", "\""], **kw)
    assert stopped.choices[0].finish_reason == "tool_calls" and stopped.choices[0].message.tool_calls
    assert [c.function.arguments for c in stopped.choices[0].message.tool_calls] == \
        [c.function.arguments for c in alone.choices[0].message.tool_calls]  # greedy: as without stop
    r = post(server, "/v1/completions", prompt="x = ", max_tokens=8, regex="[0-9]{3}", stop=["1", "2", "3"])
    assert r.status_code == 200 and re.fullmatch("[0-9]{3}", r.json()["choices"][0]["text"]), r.text
    bad = post(server, "/v1/completions", prompt="x", max_tokens=4, regex="a", stop=[""])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop"  # still checked


def test_sampler_settings_are_checked_once_on_a_requests_way_to_its_rows(server, monkeypatch):
    """The body's settings reach the rows as the engine's settings of the same names, checked by
    Engine.check alone (the server checked them three more times: one at a time, together, and with
    logprobs); n rows take seed, seed + 1 as the engine's n does."""
    engine, checks = server[1], []
    real = SamplerSettings.validate
    monkeypatch.setattr(SamplerSettings, "validate", lambda s: (checks.append(s), real(s)))
    body = schemas.ChatRequest.model_validate({"model": NAME, "messages": ASK, "top_k": 5, "min_p": 0.1,
                                               "repetition_penalty": 1.2, "logprobs": True})
    jobs = make_jobs(engine, body, [ASK], "messages", "chatcmpl")
    s = jobs[0].plan.settings[0]
    assert (s.top_k, s.min_p, s.repetition_penalty, s.logprobs) == (5, 0.1, 1.2, None) and len(checks) == 1
    jobs = make_jobs(engine, body.model_copy(update={"top_k": -1}), [ASK], "messages", "chatcmpl",
                     logprobs=(2, "top_logprobs"))
    assert (jobs[0].plan.settings[0].top_k, jobs[0].plan.settings[0].logprobs) == (0, 2)
    two = make_jobs(engine, body.model_copy(update={"n": 2, "seed": 7, "temperature": 0.5}), [ASK], "messages",
                    "chatcmpl")
    assert [j.plan.settings[0].seed for j in two] == [7, 8] and [len(j.plan.prompts) for j in two] == [1, 1]
    assert two[0].prompt_ids == two[1].prompt_ids == jobs[0].prompt_ids


def test_routes_tokenize_detokenize_version_model_and_usage_with_n(server):
    engine = server[1]
    r = post(server, "/tokenize", prompt="def f(x):", return_token_strs=True).json()
    assert r["tokens"] == engine.encode("def f(x):") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == engine.model.config.max_position_embeddings and len(r["token_strs"]) == r["count"]
    chat = post(server, "/tokenize", messages=ASK).json()
    assert chat["tokens"] == engine.encode(ASK) and chat["token_strs"] is None
    # vLLM's switches, as its own test_tokenization reads them: the template's text, encoded with or without specials
    tok, turns = engine.tokenizer, ASK + [{"role": "assistant", "content": "Sure,"}]
    for gen, cont, special in [(False, False, True), (False, True, False), (True, False, True)]:
        msgs = turns if cont else ASK
        text = tok.apply_chat_template(msgs, add_generation_prompt=gen, continue_final_message=cont, tokenize=False)
        got = post(server, "/tokenize", messages=msgs, add_generation_prompt=gen, continue_final_message=cont,
                   add_special_tokens=special).json()
        assert got["tokens"] == tok.encode(text, add_special_tokens=special), (gen, cont, special)
    assert got["tokens"] == chat["tokens"]  # the default: as a chat completion encodes it (this tokenizer adds none)
    bad = post(server, "/tokenize", messages=turns, continue_final_message=True).json()["error"]
    assert bad["param"] == "continue_final_message"
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


def test_responses_log_probabilities_and_no_model_named(client):
    """vLLM's responses test_basic: include message.output_text.logprobs with top_logprobs, and no model
    (the served one); streamed, each delta carries its tokens' log-probabilities."""
    kw = dict(input="def add(a, b):", max_output_tokens=6, include=["message.output_text.logprobs"], top_logprobs=3)
    r = client.responses.create(**kw)
    part = r.output[-1].content[-1]
    assert r.model == NAME and len(part.logprobs) == r.usage.output_tokens == 6
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 3 and lp.logprob <= 0 for lp in part.logprobs)
    events = list(client.responses.create(stream=True, **kw))
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in deltas] == [lp.token for lp in part.logprobs]  # greedy: the same tokens
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.token for lp in done.logprobs] == [lp.token for lp in deltas]
    assert not client.responses.create(input="x", max_output_tokens=2).output[-1].content[-1].logprobs


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
