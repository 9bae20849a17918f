"""The tool-call format of Qwen3.5/3.6's chat template: each call a JSON object with the function's
``name`` and its ``arguments`` between tags, calls one after another on their own lines::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:func:`calls_lark` writes it as a grammar (the functions a request allows, their parameters'
schemas); :func:`parse` reads it back from a response's text.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# the JSON style of the chat template's tojson (and json.dumps): ", " between items, ": " after keys
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict


def call_schema(functions: list[dict]) -> dict:
    """The JSON schema of one call: ``{"name": <one of the functions>, "arguments": <its
    parameters>}`` in that order; ``functions``: OpenAI's function objects (``name``, optional
    ``parameters``, a JSON schema; none: any object)."""
    defs: dict = {}
    options = [{"type": "object",
                "properties": {"name": {"const": f["name"]},
                               "arguments": hoisted(f.get("parameters") or {"type": "object"}, f"f{i}_", defs)},
                "required": ["name", "arguments"], "additionalProperties": False} for i, f in enumerate(functions)]
    return {"anyOf": options, "x-guidance": JSON_STYLE, **({"$defs": defs} if defs else {})}


def hoisted(parameters, prefix: str, defs: dict):
    """A function's parameters as a part of the call's schema: their own definitions (``$defs``,
    ``definitions``) moved into ``defs`` (the call schema's root ``$defs``) under ``prefix``, and their
    references to them rewritten: ``#/$defs/X`` inside the parameters meant the parameters' root, which is
    no longer the schema's root (pydantic writes such references for every nested model)."""
    if not isinstance(parameters, dict):
        return parameters

    def ref(value: str) -> str:
        for head in ("#/$defs/", "#/definitions/"):
            if value.startswith(head):
                return "#/$defs/" + prefix + value[len(head):]
        return value

    def rebase(node):
        if isinstance(node, dict):
            return {k: ref(v) if k == "$ref" and isinstance(v, str) else rebase(v) for k, v in node.items()}
        if isinstance(node, list):
            return [rebase(v) for v in node]
        return node

    for key in ("definitions", "$defs"):
        for name, schema in (parameters.get(key) or {}).items():
            defs[prefix + name] = rebase(schema)
    return rebase({k: v for k, v in parameters.items() if k not in ("$defs", "definitions")})


def calls_lark(functions: list[dict], parallel: bool = True) -> str:
    """A Lark grammar (llguidance's dialect) of one call, or of one or more (``parallel``)."""
    body = json.dumps(call_schema(functions))
    many = ' ("\\n" call)*' if parallel else ""
    return f'start: call{many}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\nbody: %json {body}\n'


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """(the text outside the calls, stripped; the calls, in order). A call whose body is not a JSON
    object with a string ``name`` stays in the text: it is not a call a client could run."""
    calls, kept, at = [], [], 0
    for m in _CALL.finditer(text):
        try:
            body = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        args = body.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                continue
        if not isinstance(args, dict):
            continue
        calls.append(ToolCall(body["name"], args))
        kept.append(text[at:m.start()])
        at = m.end()
    kept.append(text[at:])
    return "".join(kept).strip(), calls


def opens_call(text: str) -> int:
    """Where in ``text`` a tool call begins (or may begin: a tail that is a prefix of the tag), else -1;
    a stream holds the text from there back until it knows."""
    at = text.find(OPEN)
    if at >= 0:
        return at
    for k in range(len(OPEN) - 1, 0, -1):
        if text.endswith(OPEN[:k]):
            return len(text) - k
    return -1
