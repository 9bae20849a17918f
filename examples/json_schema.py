"""Structured output over `clover-lab serve` with the openai client: a JSON schema as the
response_format (strict), and the same through the client's `parse` with a pydantic model; the
server keeps block diffusion inside the schema's grammar, so the answer parses and validates
whatever the model.

    clover-lab serve &                       # the embedded model on 127.0.0.1:8000
    python examples/json_schema.py [--base-url http://127.0.0.1:8000/v1] [--model clover-stdlib]
"""
from __future__ import annotations

import argparse
import json

from openai import OpenAI
from pydantic import BaseModel

MODULE = {"type": "object", "properties": {
    "module": {"type": "string", "maxLength": 24},
    "functions": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    "lines": {"type": "integer", "minimum": 0}},
    "required": ["module", "functions", "lines"], "additionalProperties": False}


class Person(BaseModel):
    name: str
    age: int


def run(client: OpenAI, model: str) -> tuple[dict, Person]:
    """(a module described under MODULE, a Person parsed by the client)."""
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe the os module as JSON."}], max_tokens=96,
        response_format={"type": "json_schema", "json_schema": {"name": "module", "schema": MODULE, "strict": True}})
    module = json.loads(reply.choices[0].message.content)
    parsed = client.beta.chat.completions.parse(model=model, messages=[{"role": "user", "content": "A person."}],
                                                response_format=Person, max_tokens=64)
    return module, parsed.choices[0].message.parsed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="clover-stdlib")
    args = p.parse_args(argv)
    module, person = run(OpenAI(base_url=args.base_url, api_key="none"), args.model)
    print(json.dumps(module))
    print(person)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
