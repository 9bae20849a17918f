"""The step loop's schedule: one packed forward per step against a forward per group, side by side.

The same requests are submitted together and stepped to the end twice per round, once with each
mode's rows and each prompt taking forwards of their own (``engine.loop.packed = False``: the step
as it was before rows in different phases and modes shared one forward; diffusion rows first
done, first out) and once packed (``StepLoop._step_packed``: every row's segment in one forward).
Workloads: ``rows`` identical requests (default 1, 8, 32), 8 requests whose ``max_tokens`` differ
(four lengths, two each), and 8 requests of three modes (diffusion, AR, speculative) with 2
more prompts arriving while they decode. Per workload and schedule: the forwards, the steps, the
forwards per step, the new tokens per second of wall time (the best of ``--rounds``), the mean
step at which a request ends, the host reads per step (tensor-to-host transfers from the engine,
``HostReads``), and whether every request gave the same tokens under both. Prints a table and
writes JSON to bench/results/. A benchmark, not a test.

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


def run(engine, requests: list[Request], packed: bool, late: list[Request] = (), at: int = 3) -> dict:
    """The requests submitted together (``late`` ones before step ``at``) and stepped to the end
    under one schedule."""
    engine.loop.packed = packed
    forwards, steps = engine.loop.forwards, 0
    handles = [engine.submit(r, emit=False) for r in requests]
    ended, reads = {}, 0
    t = time.perf_counter()
    while not all(h.done for h in handles) or steps < at <= len(late) * at:
        if steps == at:
            handles += [engine.submit(r, emit=False) for r in late]
        with HostReads() as counted:
            engine.step()
        steps += 1
        reads += sum(w.startswith("engine/") for w in counted.where)
        ended.update({i: steps for i, h in enumerate(handles) if h.done and i not in ended})
    seconds = time.perf_counter() - t
    engine.loop.packed = True
    if any(h.error is not None for h in handles):
        raise next(h.error for h in handles if h.error is not None)
    tokens = [h.result.token_ids for h in handles]
    n = engine.loop.forwards - forwards
    return dict(seconds=seconds, forwards=n, steps=steps, forwards_per_step=n / steps,
                new_tokens=sum(map(len, tokens)), mean_end_step=sum(ended.values()) / len(ended),
                host_reads_per_step=reads / steps, tokens=tokens)


MODES = ("diffusion", "ar", "speculative")


def workloads(args) -> dict[str, tuple[list[Request], list[Request]]]:
    out = {f"{n} identical": ([Request(PROMPTS[i % len(PROMPTS)], max_new_tokens=args.max_new_tokens)
                               for i in range(n)], []) for n in args.rows}
    out["8 of four lengths"] = ([Request(PROMPTS[i], max_new_tokens=args.lengths[i % len(args.lengths)])
                                 for i in range(8)], [])
    out["8 of 3 modes + 2 late"] = ([Request(PROMPTS[i], mode=MODES[i % 3], max_new_tokens=args.max_new_tokens)
                                     for i in range(8)],
                                    [Request(PROMPTS[i] * 4, max_new_tokens=args.max_new_tokens) for i in (1, 5)])
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    engine = load(args.model, dtype=getattr(torch, args.dtype), threads=args.threads)
    rows = []
    every = workloads(args)
    for packed in (False, True):  # warm-up: the first forwards of a shape cost more
        run(engine, every[next(iter(every))][0], packed)
    for name, (requests, late) in every.items():
        best: dict[bool, dict] = {}
        for _ in range(args.rounds):
            for packed in (False, True):  # side by side, in the same round
                r = run(engine, requests, packed, late)
                if packed not in best or r["seconds"] < best[packed]["seconds"]:
                    best[packed] = r
        before, after = best[False], best[True]
        row = dict(workload=name, same_tokens=before["tokens"] == after["tokens"])
        for label, r in (("per_group", before), ("packed", after)):
            row.update({f"{label}_{k}": v for k, v in r.items() if k != "tokens"})
            row[f"{label}_tokens_per_second"] = r["new_tokens"] / r["seconds"]
        rows.append(row)
    print(f"{'workload':<22} {'forwards':>15} {'steps':>11} {'forwards/step':>15} {'tokens/s':>15} "
          f"{'mean end step':>15} {'reads/step':>13} same")
    print(f"{'':<22} {'group -> packed':>15}")
    for r in rows:
        print(f"{r['workload']:<22} {r['per_group_forwards']:>6} -> {r['packed_forwards']:<6} "
              f"{r['per_group_steps']:>4} -> {r['packed_steps']:<4} "
              f"{r['per_group_forwards_per_step']:>6.2f} -> {r['packed_forwards_per_step']:<6.2f} "
              f"{r['per_group_tokens_per_second']:>6.1f} -> {r['packed_tokens_per_second']:<6.1f} "
              f"{r['per_group_mean_end_step']:>6.1f} -> {r['packed_mean_end_step']:<6.1f} "
              f"{r['per_group_host_reads_per_step']:>5.2f} -> {r['packed_host_reads_per_step']:<5.2f} "
              f"{r['same_tokens']}")
    write_result(args.out, "step-loop-default-model-cpu" if args.model is None else "step-loop-cpu",
                 dict(run_fields("bench_step_loop", "cpu"), settings=vars(args), rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
