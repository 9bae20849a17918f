"""Tool calls streamed as deltas as their text commits: whatever prefixes the text arrives in, the
deltas joined per index are the calls parse() reads from the whole text (names, ids, arguments
that are the model's own JSON text), each call's header comes once, each call as soon as it is
closed, and a call not yet closed sends nothing (its length may cut it: then it is no call)."""
import json

import pytest

from clover_lab.grammar import tool_calls
from clover_lab.serve.call_stream import CallStream, object_end
from clover_lab.serve.tools import openai_calls

TEXT = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os\\"lo {x}", "unit": "C"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, {"c": "}"}]}}\n</tool_call>')


def joined(deltas):
    calls = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": "", "headers": 0})
        if "id" in d:
            c["id"], c["headers"] = d["id"], c["headers"] + 1
        f = d.get("function", {})
        c["name"] = f.get("name", c["name"])
        c["arguments"] += f.get("arguments", "")
    return [calls[k] for k in sorted(calls)]


@pytest.mark.parametrize("step", [1, 3, 7, 16, len(TEXT)])
def test_deltas_add_up_to_the_parsed_calls(step):
    stream, deltas = CallStream(), []
    for end in range(step, len(TEXT) + step, step):
        deltas += stream.update(TEXT[:end])
    _, parsed = tool_calls.parse(TEXT)
    deltas += stream.finish(TEXT, openai_calls(parsed))
    calls = joined(deltas)
    assert [c["name"] for c in calls] == ["get_weather", "add"]
    assert [json.loads(c["arguments"]) for c in calls] == [p.arguments for p in parsed]
    assert calls[0]["arguments"] == '{"city": "Os\\"lo {x}", "unit": "C"}'  # the model's own text
    assert all(c["headers"] == 1 and c["id"].startswith("call_") for c in calls)
    if step < 20:  # the first call is sent once it is closed, before the second is written
        first_end = TEXT.index("</tool_call>") + len("</tool_call>")
        early = CallStream().update(TEXT[:first_end])
        assert [d["function"]["name"] for d in early] == ["get_weather"]
        assert json.loads(early[0]["function"]["arguments"]) == parsed[0].arguments
        assert CallStream().update(TEXT[:first_end - 1]) == []


def test_nothing_before_the_name_is_written_and_arguments_as_a_string_come_whole():
    stream = CallStream()
    assert stream.update('<tool_call>\n{"name": "get_wea') == []
    assert stream.update('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os') == []  # not closed
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
    first = stream.update(text)
    assert first == [{"index": 0, "id": stream.ids[0], "type": "function", "function": {"name": "f", "arguments": ""}}]
    _, parsed = tool_calls.parse(text)
    last = stream.finish(text, openai_calls(parsed))
    assert [json.loads(d["function"]["arguments"]) for d in last] == [{"x": 1}] and "id" not in last[0]


def test_object_end():
    assert object_end('{"a": "}", "b": [1, {"c": 2}]} tail') == len('{"a": "}", "b": [1, {"c": 2}]}')
    assert object_end('{"a": "\\"}"') is None
