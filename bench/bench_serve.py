"""clover-lab serve under load: throughput and latency against the number of concurrent streams.

The server runs in this process (uvicorn on a free loopback port, in a thread) over the embedded
model (or --model DIR). At each concurrency c, c clients each stream ``--requests-per-client``
completions one after another (prompts from a fixed list, greedy, ``--max-tokens`` each, EOS
ignored as serving benchmarks do), so
that requests arrive while others run and join the running batch at block boundaries. Per
request: the time to its first committed token (request sent to the first chunk with text) and
the per-token latency (first to last text chunk, over the tokens after the first block); per
level: generated tokens per second of wall time, the median and p90 of both latencies, and
whether every response equals that prompt's single-request text. Bounded: c x requests-per-client
requests per level.

Then requests that differ (``--lengths``, issue 38): 8 clients whose requests ask for four different
``max_tokens`` (16, 32, 64, 80 by default; each client asks for each length once, starting at its own,
so every client has the same work) against 8 clients whose requests are identical (the mean, 48: as
many blocks per client), measured side by side, alternately, ``--rounds`` times each; the ratio of
their tokens per second is what per-request settings cost (before the engine scheduled rows,
requests that differed only in max_tokens could not share a forward). Prints tables and writes
JSON to bench/results/. A benchmark, not a test.

    python bench/bench_serve.py [--model DIR] [--concurrency 1 4 16 32] [--requests-per-client 2]
                                [--max-tokens 32] [--lengths 16 32 48 64] [--rounds 3] [--threads 2]
                                [--dtype float32] [--out DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx
import torch
import uvicorn
from result_file import RESULTS, write_result

import clover_lab
from clover_lab.serve import create_app

PROMPTS = ["def parse(line):\n", "import os\n", "class Stack:\n", "def f(x):\n    return", "for i in range(",
           "# read a file\n", "x = [", "with open(path) as f:\n", "def main():\n", "try:\n", "if __name__ ==",
           "from collections import"]
NAME = "bench"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, metavar="DIR", help="a model directory (default: the embedded model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 80],
                   help="the max_tokens of the differing requests (8 clients; the identical ones ask for their mean)")
    p.add_argument("--rounds", type=int, default=3, help="alternate runs of identical and differing requests")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def start(engine, max_batch: int):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine, model_name=NAME, max_batch=max_batch),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


async def one(client, base, prompt, max_tokens):
    # ignore_eos (vLLM's and SGLang's extension, as their serving benchmarks send it): every request
    # writes its max_tokens, so the work per client is what the levels and the two arms say it is
    # (specimen v3 ends most of these prompts with EOS within 48 tokens)
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    first = last = None
    text, tokens, first_tokens = "", 0, 0
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            piece = chunk["choices"][0]["text"]
            if chunk.get("clover", {}).get("kind") == "committed":
                tokens += len(chunk["clover"]["tokens"])
            if piece:
                text += piece
                now = time.perf_counter()
                if first is None:
                    first, first_tokens = now, tokens
                last = now
    after = tokens - first_tokens
    return dict(prompt=prompt, text=text, tokens=tokens, seconds=time.perf_counter() - t0,
                ttft=None if first is None else first - t0,
                per_token=(last - first) / after if first is not None and after > 0 else None)


async def level(base, c, per_client, max_tokens):
    """``c`` clients, each ``per_client`` requests in turn; ``max_tokens``: one for all, or a function
    (client, request) -> max_tokens."""
    length = max_tokens if callable(max_tokens) else (lambda k, i: max_tokens)
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker(k):
            return [await one(client, base, PROMPTS[(k * per_client + i) % len(PROMPTS)], length(k, i))
                    for i in range(per_client)]

        t0 = time.perf_counter()
        out = await asyncio.gather(*(worker(k) for k in range(c)))
        return [r for rs in out for r in rs], time.perf_counter() - t0


def quantile(xs, q):
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = clover_lab.load(args.model, dtype=getattr(torch, args.dtype), threads=args.threads)
    alone = {p: engine.generate(p, max_new_tokens=args.max_tokens, ignore_eos=True).text for p in PROMPTS}
    server, thread, base = start(engine, max(args.concurrency))
    rows = []
    try:
        asyncio.run(level(base, 1, 1, args.max_tokens))  # warm up
        for c in args.concurrency:
            results, wall = asyncio.run(level(base, c, args.requests_per_client, args.max_tokens))
            tokens = sum(r["tokens"] for r in results)
            rows.append(dict(concurrency=c, requests=len(results), tokens=tokens, wall_seconds=wall,
                             tokens_per_second=tokens / wall,
                             ttft_median=quantile([r["ttft"] for r in results], 0.5),
                             ttft_p90=quantile([r["ttft"] for r in results], 0.9),
                             per_token_median=quantile([r["per_token"] for r in results], 0.5),
                             per_token_p90=quantile([r["per_token"] for r in results], 0.9),
                             same_text_as_alone=all(r["text"] == alone[r["prompt"]] for r in results)))
            print(f"concurrency {c}: {rows[-1]['tokens_per_second']:.1f} tokens/s", flush=True)
        lengths = compare_lengths(engine, base, args)
    finally:
        server.should_exit = True
        thread.join(60)
    base1 = rows[0]["tokens_per_second"]
    print("\n| concurrency | requests | tokens/s | vs 1 | first token median / p90 (s) | per token median / p90 (ms) "
          "| same text as alone |\n|---|---|---|---|---|---|---|")
    for r in rows:
        pt = " / ".join("-" if x is None else f"{x * 1000:.0f}" for x in (r["per_token_median"], r["per_token_p90"]))
        print(f"| {r['concurrency']} | {r['requests']} | {r['tokens_per_second']:.1f} | "
              f"{r['tokens_per_second'] / base1:.2f}x | {r['ttft_median']:.2f} / {r['ttft_p90']:.2f} | {pt} | "
              f"{'yes' if r['same_text_as_alone'] else 'NO'} |")
    print(f"\n8 clients x {len(args.lengths)} requests, {args.rounds} alternate rounds each:\n"
          f"| requests | max_tokens | tokens/s (median of rounds) | forwards | tokens per forward | ms per forward "
          f"| p99 request seconds |\n|---|---|---|---|---|---|---|")
    for name in ("identical", "differing"):
        r = lengths[name]
        print(f"| {name} | {r['max_tokens']} | {r['tokens_per_second']:.1f} | {r['forwards']:.0f} | "
              f"{r['tokens_per_forward']:.2f} | {r['seconds_per_forward'] * 1000:.0f} | {r['request_p99']:.2f} |")
    print(f"differing / identical: {lengths['ratio']:.2f}x\n")
    write_result(args.out, f"serve-{'default-model' if args.model is None else Path(args.model).name}-cpu",
                 dict(args=vars(args), host=platform.node(), torch=torch.__version__, threads=args.threads, rows=rows,
                      lengths=lengths))


def compare_lengths(engine, base, args, clients: int = 8) -> dict:
    """Tokens per second of ``clients`` clients whose requests differ in max_tokens (client k's i-th
    request asks for ``lengths[(k + i) % n]``: each client asks for every length once) against as
    many whose requests are identical (the mean length), alternately, ``args.rounds`` rounds each.
    Each run also counts the engine's forwards after the prefills (``engine.loop.forwards``), which
    splits the ratio in two: tokens per forward (how many rows each forward served: scheduling) and
    seconds per forward (what a forward cost: the per-row settings' overhead)."""
    n = len(args.lengths)
    same = sum(args.lengths) // n
    plans = {"identical": (lambda k, i: same), "differing": (lambda k, i: args.lengths[(k + i) % n])}
    runs = {"identical": [], "differing": []}
    for _ in range(args.rounds):
        for name, length in plans.items():
            t0, before = time.perf_counter(), engine.loop.forwards
            results, wall = asyncio.run(level(base, clients, n, length))
            seconds = time.perf_counter() - t0  # with the event loop's start and end
            tokens, forwards = sum(r["tokens"] for r in results), engine.loop.forwards - before
            runs[name].append(dict(tokens=tokens, wall_seconds=wall, seconds=seconds, forwards=forwards,
                                   tokens_per_second=tokens / wall, tokens_per_forward=tokens / forwards,
                                   seconds_per_forward=wall / forwards,
                                   request_seconds=[r["seconds"] for r in results]))
            r = runs[name][-1]
            print(f"{name}: {r['tokens_per_second']:.1f} tokens/s, {forwards} forwards, "
                  f"{r['tokens_per_forward']:.2f} tokens and {r['seconds_per_forward'] * 1000:.0f} ms per forward",
                  flush=True)
    out = {}
    for name, lengths in (("identical", [same]), ("differing", sorted(args.lengths))):
        tps = statistics.median(r["tokens_per_second"] for r in runs[name])
        out[name] = dict(max_tokens=lengths, tokens_per_second=tps, runs=runs[name],
                         forwards=statistics.median(r["forwards"] for r in runs[name]),
                         tokens_per_forward=statistics.median(r["tokens_per_forward"] for r in runs[name]),
                         seconds_per_forward=statistics.median(r["seconds_per_forward"] for r in runs[name]),
                         request_p99=quantile([x for r in runs[name] for x in r["request_seconds"]], 0.99))
    out["ratio"] = out["differing"]["tokens_per_second"] / out["identical"]["tokens_per_second"]
    return out


if __name__ == "__main__":
    main()
