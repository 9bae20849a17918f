"""The step loop's schedule: first done, first out against rows kept in step, side by side.

The same requests are submitted together and stepped to the end twice per round, once with
diffusion rows kept in step (``engine.loop.in_step = True``: rows begin their blocks together, the
schedule every step had before first done, first out) and once without (a row whose block is done
commits it in its next forward, packed beside the others' previews). Workloads: ``rows`` identical
requests (default 1, 8, 32), and 8 requests whose ``max_tokens`` differ (four lengths, two each).
Per workload and schedule: the forwards, the steps, the new tokens per second of wall time (the
best of ``--rounds``), the mean step at which a request ends, the host reads per step (tensor-to-
host transfers from the engine, ``HostReads``), and whether every request gave the same tokens
under both. Prints a table and writes JSON to bench/results/. A benchmark, not a test.

    python bench/bench_step_loop.py [--model DIR] [--rows 1 8 32] [--lengths 16 32 64 80]
                                    [--max-new-tokens 48] [--rounds 2] [--threads 2] [--out DIR]
"""
from __future__ import annotations

import argparse
import time

import torch
from result_file import RESULTS, run_fields, write_result

from clover_kernels.launches import HostReads
from clover_lab import Request, load

PROMPTS = ["def parse(line):\n", "import os\n", "class Stack:\n", "def f(x):\n    return", "for i in range(",
           "# read a file\n", "x = [", "with open(path) as f:\n"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, metavar="DIR", help="a model directory (default: the embedded model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 80],
                   help="max_tokens of the differing workload (8 requests, two of each)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="of the identical workloads")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def run(engine, requests: list[Request], in_step: bool) -> dict:
    """The requests submitted together and stepped to the end under one schedule."""
    engine.loop.in_step = in_step
    forwards, steps = engine.loop.forwards, 0
    handles = [engine.submit(r, emit=False) for r in requests]
    ended, reads = {}, 0
    t = time.perf_counter()
    while not all(h.done for h in handles):
        with HostReads() as counted:
            engine.step()
        steps += 1
        reads += sum(w.startswith("engine/") for w in counted.where)
        ended.update({i: steps for i, h in enumerate(handles) if h.done and i not in ended})
    seconds = time.perf_counter() - t
    engine.loop.in_step = False
    if any(h.error is not None for h in handles):
        raise next(h.error for h in handles if h.error is not None)
    tokens = [h.result.token_ids for h in handles]
    return dict(seconds=seconds, forwards=engine.loop.forwards - forwards, steps=steps,
                new_tokens=sum(map(len, tokens)), mean_end_step=sum(ended.values()) / len(ended),
                host_reads_per_step=reads / steps, tokens=tokens)


def workloads(args) -> dict[str, list[Request]]:
    out = {f"{n} identical": [Request(PROMPTS[i % len(PROMPTS)], max_new_tokens=args.max_new_tokens)
                              for i in range(n)] for n in args.rows}
    out["8 of four lengths"] = [Request(PROMPTS[i], max_new_tokens=args.lengths[i % len(args.lengths)])
                                for i in range(8)]
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    engine = load(args.model, dtype=getattr(torch, args.dtype), threads=args.threads)
    rows = []
    every = workloads(args)
    for in_step in (True, False):  # warm-up: the first forwards of a shape cost more
        run(engine, every[next(iter(every))], in_step)
    for name, requests in every.items():
        best: dict[bool, dict] = {}
        for _ in range(args.rounds):
            for in_step in (True, False):  # side by side, in the same round
                r = run(engine, requests, in_step)
                if in_step not in best or r["seconds"] < best[in_step]["seconds"]:
                    best[in_step] = r
        before, after = best[True], best[False]
        row = dict(workload=name, same_tokens=before["tokens"] == after["tokens"])
        for label, r in (("in_step", before), ("first_done", after)):
            row.update({f"{label}_{k}": v for k, v in r.items() if k != "tokens"})
            row[f"{label}_tokens_per_second"] = r["new_tokens"] / r["seconds"]
        rows.append(row)
    print(f"{'workload':<20} {'forwards':>15} {'steps':>11} {'tokens/s':>15} {'mean end step':>15} "
          f"{'reads/step':>10} same")
    print(f"{'':<20} {'in step -> fdfo':>15} {'':>11} {'':>15} {'':>15} {'(fdfo)':>10}")
    for r in rows:
        print(f"{r['workload']:<20} {r['in_step_forwards']:>6} -> {r['first_done_forwards']:<6} "
              f"{r['in_step_steps']:>4} -> {r['first_done_steps']:<4} "
              f"{r['in_step_tokens_per_second']:>6.1f} -> {r['first_done_tokens_per_second']:<6.1f} "
              f"{r['in_step_mean_end_step']:>6.1f} -> {r['first_done_mean_end_step']:<6.1f} "
              f"{r['first_done_host_reads_per_step']:>10.2f} {r['same_tokens']}")
    write_result(args.out, "step-loop-default-model-cpu" if args.model is None else "step-loop-cpu",
                 dict(run_fields("bench_step_loop", "cpu"), settings=vars(args), rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
