"""A tool-using agent over `clover-lab serve` with the openai client: the model is given a local
Python function as a tool, its calls are run here and their results sent back as tool messages,
until it answers in text (or the turns run out).

    clover-lab serve &                       # the embedded model on 127.0.0.1:8000
    python examples/agent_tools.py [--base-url http://127.0.0.1:8000/v1] [--model clover-stdlib]

The first turn names the tool (tool_choice), so even the small embedded model calls it, with
arguments that validate against the tool's parameters (the server enforces them with a grammar);
later turns leave the choice to the model (auto).
"""
from __future__ import annotations

import argparse
import json

from openai import OpenAI


def add(a: int, b: int) -> int:
    """The local function the agent may call."""
    return a + b


ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                                    "b": {"type": "integer", "minimum": -999, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False}}}
LOCAL = {"add": add}


def run(client: OpenAI, model: str, question: str = "What is 17 + 25?", turns: int = 3) -> list[dict]:
    """The conversation, ending with the model's answer; each call the model made was run here."""
    messages = [{"role": "system", "content": "You add numbers with the add tool."},
                {"role": "user", "content": question}]
    for turn in range(turns):
        choice = {"type": "function", "function": {"name": "add"}} if turn == 0 else "auto"
        reply = client.chat.completions.create(model=model, messages=messages, tools=[ADD], tool_choice=choice,
                                               max_tokens=48)
        message = reply.choices[0].message
        messages.append(message.model_dump())  # OpenAI's own shape, nulls and all, goes back as history
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            result = LOCAL[call.function.name](**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    return messages


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="clover-stdlib")
    args = p.parse_args(argv)
    for m in run(OpenAI(base_url=args.base_url, api_key="none"), args.model):
        calls = [f"{c['function']['name']}({c['function']['arguments']})" for c in m.get("tool_calls") or []]
        print(f"{m['role']:>9}: {m.get('content') or ''}{' -> ' + ', '.join(calls) if calls else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
