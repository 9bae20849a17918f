"""Agents and structured output over HTTP against a live server on 127.0.0.1 (the embedded model in
float32): a tool-using agent loop with the openai client calling a local Python function, json_schema
responses that validate, named and required tool calls whose arguments validate, tools written into
the prompt, history as OpenAI's client dumps it, tool calls streamed as deltas, the model entry and
the 4xx cases of issue 39."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import pytest

from clover_lab.serve.tools import written_out

uvicorn = pytest.importorskip("uvicorn")

NAME = "clover-stdlib"
ROOT = Path(__file__).resolve().parents[2]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                                    "b": {"type": "integer", "minimum": -999, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def example(name: str):
    """A script of examples/, imported by path (examples/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_agent_example_calls_its_local_function_and_answers(client):
    """examples/agent_tools.py: the model must call add (the first turn names it), the loop runs the
    Python function and sends the result back as a tool message; the next turn answers in text."""
    agent = example("agent_tools")
    messages = agent.run(client, NAME)
    assert [m["role"] for m in messages[:4]] == ["system", "user", "assistant", "tool"]
    call = messages[2]["tool_calls"][0]
    assert call["id"].startswith("call_") and call["type"] == "function" and call["function"]["name"] == "add"
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, agent.ADD["function"]["parameters"])
    assert json.loads(messages[3]["content"]) == args["a"] + args["b"] and messages[3]["tool_call_id"] == call["id"]
    assert messages[-1]["role"] == "assistant" and len(messages) >= 5  # the next turn went through


def test_the_json_schema_example_validates(client):
    schema = example("json_schema")
    module, person = schema.run(client, NAME)
    jsonschema.validate(module, schema.MODULE)
    assert isinstance(person, schema.Person)


@pytest.mark.slow  # a process: the examples as a user runs them
def test_the_examples_run_as_scripts(server):
    for name in ("agent_tools", "json_schema"):
        out = subprocess.run([sys.executable, str(ROOT / "examples" / f"{name}.py"), "--base-url",
                              server[0] + "/v1", "--model", NAME], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip(), out.stderr


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_json_schema_output_validates(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for i, content in enumerate(["Give me a person as JSON.", "Who wrote os.py?", "A user record, please."]):
        kw = {"temperature": 0.9, "seed": i} if i else {}
        messages = [{"role": "user", "content": content}]
        if stream:
            chunks = list(client.chat.completions.create(model=NAME, messages=messages, response_format=fmt,
                                                         max_tokens=64, stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            r = client.chat.completions.create(model=NAME, messages=messages, response_format=fmt, max_tokens=64,
                                               **kw)
            text = r.choices[0].message.content
            assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object(client):
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "JSON please"}],
                                       response_format={"type": "json_object"}, max_tokens=64)
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_required_tool_calls_validate_and_stream_as_deltas(client):
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    r = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER, ADD], tool_choice="required",
                                       max_tokens=96)
    calls = r.choices[0].message.tool_calls
    # parallel calls: one more may be cut by max_tokens; then it is dropped and the response ends "length"
    assert calls and r.choices[0].finish_reason == ("length" if r.usage.completion_tokens == 96 else "tool_calls")
    specs = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), specs[call.function.name])
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER],
                                                 tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                 max_tokens=96, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    # as soon as the call's closing tag commits (call_stream.py): its header and arguments once
    assert {d.index for d in deltas} == {0}
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tools_are_written_into_the_prompt_as_qwen_writes_them(server):
    _, engine = server
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
                {"role": "tool", "content": "12", "tool_call_id": "call_1"},
                {"role": "tool", "content": "13", "tool_call_id": "call_2"}]
    out = written_out(messages, [WEATHER["function"]])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("# Tools")
    assert json.dumps({"type": "function", "function": WEATHER["function"]}) in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                      '{"city": "Oslo", "unit": "C"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n12\n</tool_response>\n<tool_response>\n13\n"
                                                 "</tool_response>"}
    assert "# Tools" in engine.tokenizer.decode(engine.encode(out))


BAD = [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"a": {"type": "strang"}}}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, "response_format.json_schema.schema"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strang"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "tool", "content": "3"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "robot", "content": "3"}]}, "messages.0.role"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[p for _, p in BAD])
def test_bad_tool_and_format_bodies_are_400_naming_the_field(server, extra, param):
    body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **extra}
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_history_from_openais_client_and_a_text_format_are_accepted(server):
    body = {"model": NAME, "max_tokens": 4, "response_format": {"type": "text"}, "tool_choice": "none",
            "tools": [WEATHER], "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": None, "function_call": None,
                 "audio": None, "annotations": []},
                {"role": "user", "content": "again"}]}
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None


def test_the_model_entry_states_its_context_and_unknown_ids_are_404(server, client):
    base, engine = server
    ctx = engine.model.config.max_position_embeddings
    entry = httpx.get(f"{base}/v1/models/{NAME}").json()
    assert entry["id"] == NAME and entry["max_model_len"] == ctx == entry["context_length"]
    assert client.models.retrieve(NAME).id == NAME
    r = httpx.get(f"{base}/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{base}/v1/models").json()["data"][0]["max_model_len"] == ctx


def test_zero_alternatives_give_empty_or_self_top_logprobs(server):
    base, _ = server
    r = httpx.post(base + "/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                                        "max_tokens": 4, "logprobs": True, "top_logprobs": 0})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(e["top_logprobs"] == [] for e in content)
    r = httpx.post(base + "/v1/completions", json={"model": NAME, "prompt": "import os\n", "max_tokens": 4,
                                                   "logprobs": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"])]


def test_the_sampled_token_is_always_among_its_alternatives(server):
    base, _ = server
    body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 24, "logprobs": True,
            "top_logprobs": 1, "temperature": 1.5, "seed": 4}
    content = httpx.post(base + "/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    assert all(e["token"] in [a["token"] for a in e["top_logprobs"]] for e in content)
    assert any(len(e["top_logprobs"]) == 2 for e in content), "no sampled token below the top one: test too weak"
    r = httpx.post(base + "/v1/completions", json={"model": NAME, "prompt": "import os\n", "max_tokens": 24,
                                                   "logprobs": 1, "temperature": 1.5, "seed": 4}).json()
    lp = r["choices"][0]["logprobs"]
    assert all(t in top for t, top in zip(lp["tokens"], lp["top_logprobs"]))


TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for tc in message.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_reads_tools_gets_them_and_the_calls_as_objects(server, monkeypatch):
    """A chat template that renders tools itself (Qwen3.5/3.6's do) is given them through
    apply_chat_template(tools=...), and a history call's arguments as an object, not JSON text."""
    from clover_lab.serve.tools import chat_ids, reads_tools

    _, engine = server
    monkeypatch.setattr(engine.tokenizer, "chat_template", TOOLS_TEMPLATE)
    assert reads_tools(engine.tokenizer)
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
                {"role": "tool", "content": "12", "tool_call_id": "call_1"}]
    text = engine.tokenizer.decode(chat_ids(engine, messages, [WEATHER["function"]], None))
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in text.split("<|im_end|>")[0]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>' in text
    assert "<|im_start|>tool\n12<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert "# Tools" not in engine.tokenizer.decode(chat_ids(engine, messages[:1], [], None))


def test_completions_take_a_response_format_too(client, server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for prompt in ("import os\n", "def parse(line):\n"):
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=64, extra_body={"response_format": fmt})
        jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    bad = httpx.post(server[0] + "/v1/completions", json={"model": NAME, "prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strang"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format.json_schema.schema", bad.text
    for mode in ("ar", "speculative"):  # every mode follows the grammar
        r = client.completions.create(model=NAME, prompt="import os\n", max_tokens=64,
                                      extra_body={"response_format": fmt, "clover": {"mode": mode}})
        jsonschema.validate(json.loads(r.choices[0].text), PERSON)
