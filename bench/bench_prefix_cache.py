"""Time to first token with and without a prefix-cache hit (issue 50), side by side in one run.

Requests that share a long prefix (an agent's system prompt and tool schemas: ``--prefix``
tokens) and differ after it (a new question each). Per mode, each request runs twice, one right
after the other, round by round: with the prefix cache off (``engine.prefix_cache.budget = 0``)
and with it on, the prefix put there by a request of the prefix alone beforehand (not timed).
Time to first token is the wall time of a request for one new token; beside it, the positions
its forwards pushed through the model (a forward pre-hook on the first decoder layer counts
them) and the positions that came from the cache. A request of ``--check-tokens`` per mode
checks that the tokens are the same with and without (greedy). Prints a table, writes JSON to
bench/results/. Absolute times mean something on a GPU only; on a CPU the ratio measured side by
side does. A benchmark, not a test.

    python bench/bench_prefix_cache.py [--model DIR] [--device cuda] [--dtype bfloat16]
                                       [--prefix 1024] [--requests 4] [--rounds 2] [--out DIR]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_policies import GREEDY, held_out_prompts
from result_file import RESULTS, run_fields, slug, write_result

from clover_lab import Request, load

QUESTIONS = ["# Now write a function that parses a date.\n", "# Add a test for the empty input.\n",
             "# Explain what the code above returns.\n", "# Rename the variables to clearer names.\n",
             "# Make it handle a missing file.\n", "# Write the docstring of the first function.\n",
             "# Turn the loop into a comprehension.\n", "# Add type hints everywhere.\n"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prefix", type=int, default=1024, help="tokens the requests share")
    p.add_argument("--requests", type=int, default=4, help="requests per mode (each a new question)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=["diffusion", "ar"])
    p.add_argument("--check-tokens", type=int, default=16, help="tokens compared with and without the cache")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def shared_prefix(engine, n: int) -> list[int]:
    """``n`` tokens of held-out code, as an agent's long shared context."""
    ids: list[int] = []
    for window in held_out_prompts(engine, 64):
        ids += window
        if len(ids) >= n:
            return ids[:n]
    raise SystemExit(f"--prefix {n}: the held-out prompts hold only {len(ids)} tokens")


class Positions:
    """Positions every forward pushes through the first decoder layer."""

    def __init__(self, model):
        self.count = 0
        model.model.layers[0].register_forward_pre_hook(self._add)

    def _add(self, module, args):
        self.count += args[0].shape[0] * args[0].shape[1]


def timed(engine, positions: Positions, request: Request):
    """(seconds, positions pushed, the result) of one request."""
    sync = torch.cuda.synchronize if engine.model.device.type == "cuda" else (lambda: None)
    sync()
    before, t = positions.count, time.perf_counter()
    result = engine.generate(request)
    sync()
    return time.perf_counter() - t, positions.count - before, result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = load(args.model, device=args.device, dtype=args.dtype, threads=args.threads)
    positions = Positions(engine.model)
    cache = engine.prefix_cache
    budget = cache.budget or 1 << 30
    prefix = shared_prefix(engine, args.prefix)
    prompts = [prefix + engine.encode(q) for q in (QUESTIONS * (1 + args.requests // len(QUESTIONS)))[:args.requests]]
    rows = []
    for mode in args.modes:
        def request(ids, new=1):
            return Request(ids, mode=mode, max_new_tokens=new, **GREEDY)

        cache.budget = 0
        engine.generate(request(prompts[0][:64]))  # warm-up
        off_t, on_t, off_n, on_n, cached = [], [], [], [], []
        for _ in range(args.rounds):
            for ids in prompts:
                cache.budget = 0  # off (and empty)
                s, n, _ = timed(engine, positions, request(ids))
                off_t.append(s), off_n.append(n)
                cache.budget = budget
                engine.generate(request(prefix))  # the shared prefix into the cache (not timed)
                s, n, r = timed(engine, positions, request(ids))
                on_t.append(s), on_n.append(n), cached.append(r.stats.cached_positions)
        cache.budget = 0
        reference = engine.generate(request(prompts[0], args.check_tokens))
        cache.budget = budget
        engine.generate(request(prefix))
        hit = engine.generate(request(prompts[0], args.check_tokens))
        row = dict(mode=mode, prefix=len(prefix), prompt_tokens=statistics.mean(map(len, prompts)),
                   positions_off=statistics.mean(off_n), positions_hit=statistics.mean(on_n),
                   cached_positions=statistics.mean(cached), ttft_off=statistics.median(off_t),
                   ttft_hit=statistics.median(on_t), same_tokens=hit.token_ids == reference.token_ids,
                   check_cached=hit.stats.cached_positions)
        row["speedup"] = row["ttft_off"] / row["ttft_hit"]
        rows.append(row)
    cache.budget = budget
    print(f"{'mode':10s} {'prompt':>7s} {'cached':>7s} {'positions (off -> hit)':>23s} "
          f"{'TTFT ms (off -> hit)':>22s} {'speedup':>8s} {'same tokens':>12s}")
    for r in rows:
        print(f"{r['mode']:10s} {r['prompt_tokens']:7.0f} {r['cached_positions']:7.0f} "
              f"{r['positions_off']:11.0f} -> {r['positions_hit']:<8.0f} "
              f"{r['ttft_off'] * 1e3:10.1f} -> {r['ttft_hit'] * 1e3:<8.1f} {r['speedup']:7.2f}x "
              f"{'yes' if r['same_tokens'] else 'NO':>12s}")
    fields = run_fields("bench_prefix_cache", str(engine.model.device))
    write_result(args.out, f"prefix-cache-{slug(fields['device_name']) if args.device else 'cpu'}",
                 dict(**fields, args=vars(args), rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
