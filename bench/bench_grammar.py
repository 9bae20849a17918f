"""Grammar-constrained block diffusion against unconstrained, side by side in one run: the embedded
model in float32 over held-out code prompts and chat prompts, greedy and without the model's default
penalties, each prompt decoded freely (the threshold rule) and inside each grammar (GrammarPolicy
over the same rule): JSON schemas, any JSON object, and a named tool call.

Per grammar: tokens per forward (new tokens over forwards after the prefill) constrained and
unconstrained and their ratio, tokens/s both ways, and how many outputs parse and validate (all of
them, or GrammarPolicy is broken). Constrained decoding unmasks only a prefix the grammar accepts,
so positions right of the model's first mistake wait a step; the tokens the grammar forces cost
nothing. Prints a table and writes JSON to bench/results/. A benchmark, not a test.

    python bench/bench_grammar.py [--prompts 8] [--max-new-tokens 64] [--threshold 0.9] [--threads 2] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import jsonschema
import torch
from result_file import RESULTS, run_fields, write_result

from clover_lab import load
from clover_lab.grammar import Grammar, GrammarPolicy, tool_calls

GREEDY = {"temperature": 0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
RECORD = {"type": "object", "properties": {
    "module": {"type": "string", "maxLength": 24}, "functions": {"type": "array", "maxItems": 4,
                                                                "items": {"type": "string", "maxLength": 16}},
    "lines": {"type": "integer", "minimum": 0}, "tested": {"type": "boolean"}},
    "required": ["module", "functions", "lines", "tested"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"],
    "additionalProperties": False}}
CHATS = ["give me a person as JSON", "describe the os module", "what is the weather in Oslo?", "list three numbers"]


def grammars(engine) -> list[tuple[str, Grammar, object]]:
    """(label, grammar, a check of one output's text: raises when it does not validate)."""
    def schema_check(schema):
        return lambda text: jsonschema.validate(json.loads(text), schema)

    def call_check(text):
        content, calls = tool_calls.parse(text)
        assert content == "" and len(calls) == 1, text
        jsonschema.validate(calls[0].arguments, WEATHER["parameters"])

    return [("json_schema person", Grammar.json_schema(PERSON, engine), schema_check(PERSON)),
            ("json_schema record", Grammar.json_schema(RECORD, engine), schema_check(RECORD)),
            ("json_object", Grammar.json_object(engine), lambda text: isinstance(json.loads(text), dict) or 1 / 0),
            ("tool call get_weather", Grammar.tool_calls([WEATHER], engine, parallel=False), call_check)]


def prompts(engine, n: int) -> list:
    """Held-out code windows (bench_batch.py's) and chat conversations, ``n`` in all."""
    from clover_lab.train import encode_files, split_corpus

    ids = encode_files(engine.tokenizer, split_corpus()[1]).tolist()
    code = n - n // 2
    stride = len(ids) // code
    chats = [[{"role": "user", "content": CHATS[i % len(CHATS)]}] for i in range(n // 2)]
    return [ids[i * stride:i * stride + 32] for i in range(code)] + chats


def run(engine, batch, max_new: int, threshold: float, grammar=None):
    t = time.perf_counter()
    results = [engine.generate(p, max_new_tokens=max_new, threshold=threshold, **GREEDY,
                               policy=None if grammar is None else GrammarPolicy(grammar)) for p in batch]
    seconds = time.perf_counter() - t
    new = sum(len(r.token_ids) for r in results)
    forwards = sum(r.stats.forwards - r.stats.prefill_forwards for r in results)
    return results, {"new_tokens": new, "forwards": forwards, "tokens_per_forward": new / forwards,
                     "tokens_per_second": new / seconds, "seconds": seconds}


def validates(check, text: str) -> bool:
    try:
        check(text)
    except Exception:  # noqa: BLE001 - counted: a length cut, or a broken policy
        return False
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = load(dtype=torch.float32, threads=args.threads)
    batch = prompts(engine, args.prompts)
    run(engine, batch[:1], 8, args.threshold)  # warm-up
    _, free = run(engine, batch, args.max_new_tokens, args.threshold)
    rows = [{"grammar": "unconstrained", **free, "valid": None}]
    for label, grammar, check in grammars(engine):
        results, row = run(engine, batch, args.max_new_tokens, args.threshold, grammar)
        valid = sum(validates(check, r.text) for r in results)
        rows.append({"grammar": label, **row, "valid": valid, "outputs": len(results),
                     "ratio_to_unconstrained": row["tokens_per_forward"] / free["tokens_per_forward"],
                     "stop_reasons": [r.stop_reason for r in results], "texts": [r.text for r in results]})
    print(f"{'grammar':24s} {'tok/fwd':>8s} {'ratio':>6s} {'tok/s':>8s} {'tokens':>7s} {'valid':>6s}")
    for r in rows:
        valid = "" if r["valid"] is None else f"{r['valid']}/{r['outputs']}"
        print(f"{r['grammar']:24s} {r['tokens_per_forward']:8.2f} "
              f"{r.get('ratio_to_unconstrained', 1.0):5.2f}x {r['tokens_per_second']:8.1f} {r['new_tokens']:7d} "
              f"{valid:>6s}")
    write_result(args.out, "grammar-default-model-cpu", dict(**run_fields("bench_grammar", "cpu"), args=vars(args),
                                                             host=platform.node(), rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
