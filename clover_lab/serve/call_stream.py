"""A streamed chat response's tool calls as deltas, each as soon as its closing tag commits: its
``index``, ``id``, ``type``, ``function.name`` and ``function.arguments``, the model's own text of
the arguments object. A call is sent only once it is closed, never while it is written: a call
its length cuts is no call (``responses.Shape.split_calls``), and a stream that had sent its start
could not take it back, so the stream would say what the whole response does not. The calls
are in Qwen3.5/3.6's format (``clover_lab.grammar.tool_calls``); a client that joins the pieces
per index has OpenAI's ``message.tool_calls``.
"""
from __future__ import annotations

import json
import re
import secrets

from clover_lab.grammar.tool_calls import CLOSE, OPEN

# a call's body up to its arguments' value: {"name": "...", "arguments":
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def object_end(text: str) -> int | None:
    """Where the JSON object at the start of ``text`` ends (exclusive), or None while it is open."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class CallStream:
    """One choice's calls: ``update(text)`` with the response's visible text so far returns the new
    deltas (a list of OpenAI's ``delta.tool_calls`` entries, one per call that changed)."""

    def __init__(self):
        self.ids: list[str] = []
        self.sent: list[str] = []  # the arguments text sent per call

    def update(self, text: str) -> list[dict]:
        out = []
        for k, body in enumerate(self._bodies(text)):
            head = _HEAD.match(body)
            if head is None:
                break  # this call's name is not written yet; the calls after it neither
            delta = {}
            if k == len(self.ids):
                self.ids.append(f"call_{secrets.token_hex(12)}")
                self.sent.append("")
                delta = {"id": self.ids[k], "type": "function",
                         "function": {"name": json.loads(f'"{head.group(1)}"'), "arguments": ""}}
            args = body[head.end():]
            if args.startswith("{"):  # an object: streamed as it is written (else sent whole at the end)
                end = object_end(args)
                piece = (args if end is None else args[:end])[len(self.sent[k]):]
                if piece:
                    self.sent[k] += piece
                    delta.setdefault("function", {})["arguments"] = delta.get("function", {}).get(
                        "arguments", "") + piece
            if delta:
                out.append({"index": k, **delta})
        return out

    def finish(self, text: str, calls: list[dict]) -> list[dict]:
        """The last deltas, once the response's ``calls`` (OpenAI's, parsed from its whole ``text``)
        are known: what of each is not sent yet (a call whose arguments were not written as an
        object gets ``calls``' JSON text of them whole)."""
        out = self.update(text)
        for k, call in enumerate(calls):
            if k >= len(self.ids):
                out.append({"index": k, **call})
            elif not self.sent[k]:
                out.append({"index": k, "function": {"arguments": call["function"]["arguments"]}})
        return _merged(out)

    @staticmethod
    def _bodies(text: str) -> list[str]:
        """The text of each closed call's body, between its opening and closing tags."""
        out, at = [], text.find(OPEN)
        while at >= 0:
            start = at + len(OPEN)
            end = text.find(CLOSE, start)
            if end < 0:
                break
            out.append(text[start:end])
            at = text.find(OPEN, end)
        return out


def _merged(deltas: list[dict]) -> list[dict]:
    """Deltas of one chunk, one entry per call (arguments joined in order)."""
    by: dict[int, dict] = {}
    for d in deltas:
        have = by.setdefault(d["index"], {"index": d["index"]})
        for key, value in d.items():
            if key == "function":
                f = have.setdefault("function", {})
                for fk, fv in value.items():
                    f[fk] = f.get(fk, "") + fv if fk == "arguments" else fv
            elif key != "index":
                have[key] = value
    return [by[k] for k in sorted(by)]
