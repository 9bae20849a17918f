"""What the notebook views' observers cost a generation on the fast path (issue 24).

The embedded model (or ``--model DIR``) with compiled steps on a CPU (``engine.compile_steps``;
on CUDA the engine's CUDA graphs): a block-diffusion generation with no hooks; with no-op
observers on every point a static step records (``layers.*.moe.route``, ``layers.*.gdn.state``,
``layers.*.gdn.preview``: what ExpertView and MemoryView attach), which is the recording's cost
alone; and with ExpertView and MemoryView themselves attached (their own work: copies to the
host, plotly redraws at ``--fps``). The settings run interleaved, after one warm-up each (the
compiles); median wall time and its ratio to the no-hook run. Prints a table and writes JSON to
bench/results/. A benchmark, not a test.

    python bench/bench_observers.py [--model DIR] [--max-new-tokens 64] [--repeat 3] [--threads 1]
                                    [--fps 10] [--out DIR]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from result_file import RESULTS, write_result

from clover_lab import load
from clover_lab.hooks import points
from clover_lab.hooks.registry import observer

SETTINGS = ("none", "observers", "views")
PROMPT = "def fibonacci(n):\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, metavar="DIR", help="a model directory (default: the embedded one)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fps", type=float, default=10.0, help="the views' redraw rate (their default: 10)")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def run_once(engine, setting: str, args):
    """(seconds, result) of one generation in ``setting``."""
    from clover_lab.widgets import ExpertView, MemoryView

    views, handle = [], None
    if setting == "observers":
        recorded = [points.every_layer(k) for k, p in points.DECLARED.items() if p.recorded]
        handle = engine.model.hooks.add_many({name: observer(lambda ev: None) for name in recorded})
    elif setting == "views":
        views = [ExpertView(engine, fps=args.fps), MemoryView(engine, fps=args.fps)]
    try:
        t = time.perf_counter()
        result = engine.generate(PROMPT, max_new_tokens=args.max_new_tokens)
        if engine.model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t, result
    finally:
        for v in views:
            v.close()
        if handle is not None:
            handle.remove()


def main(argv=None) -> int:
    args = parse_args(argv)
    engine = load(args.model, threads=args.threads)
    engine.compile_steps = engine.model.device.type != "cuda"
    for s in SETTINGS:
        run_once(engine, s, args)  # warm-up: each setting's step shapes compiled (or captured) once
    times, last = {s: [] for s in SETTINGS}, {}
    for _ in range(args.repeat):
        for s in SETTINGS:
            t, last[s] = run_once(engine, s, args)
            times[s].append(t)
    base = statistics.median(times["none"])
    rows = [dict(setting=s, median_s=statistics.median(times[s]), ratio=statistics.median(times[s]) / base,
                 tokens=last[s].stats.new_tokens, same_tokens=last[s].token_ids == last["none"].token_ids,
                 path=last[s].stats.path) for s in SETTINGS]
    print(f"{'setting':10s} {'median s':>9s} {'ratio':>6s} {'tokens':>6s}  same tokens  path")
    for r in rows:
        print(f"{r['setting']:10s} {r['median_s']:9.2f} {r['ratio']:6.2f} {r['tokens']:6d}  {str(r['same_tokens']):11s}  "
              f"{r['path']}")
    write_result(args.out, f"observers-{engine.model.device.type}", dict(args=vars(args), rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
