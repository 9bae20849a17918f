"""How much faster compiled steps can make a batch: the GEMMs inside the steps set a bound.

``engine.compile_steps = True`` runs a batch's steps as compiled static steps: the previews (and
fused commits) of block diffusion, the one-token commits of AR. The prefill, a block's own
commit and the loop between steps stay eager in both paths. A compiled step runs the same GEMM
kernels as the eager forward, so at best it removes the rest of the steps' time. For each batch
size this script times the eager batch (and with ``--compiled`` the compiled one beside it, in
the same rounds: best of ``--rounds``, as ``bench_batch.py``), then profiles one eager pass with
torch.profiler and sums the self time of
the GEMM kernels (mm, addmm, bmm, grouped_mm, oneDNN linear) that ran inside the runner's step
regions (``clover_lab.preview``; ``clover_lab.commit`` for AR):

    bound = eager seconds / (eager seconds - (eager step seconds - their GEMM seconds))

the compiled-vs-eager ratio compiled steps would give if everything in a step but its GEMMs
cost nothing. The profiled pass gives the GEMM seconds only (a GEMM's self time is barely
touched by the profiler); the step and total seconds are the unprofiled best round's. A
compiled pass is profiled too, to show its GEMM seconds beside the eager ones. Prints a table
and writes JSON to bench/results/. A benchmark, not a test.

    python bench/bench_batch_bound.py [--batch-sizes 4 16] [--prompts 16] [--modes diffusion ar]
                                      [--rounds 2] [--threads 2] [--compiled] [--model default|DIR]
                                      [--out DIR]
"""
from __future__ import annotations

import time

import torch
from bench_batch import best_rounds, build, model_name, parse_args
from result_file import run_fields, write_result
from torch.profiler import ProfilerActivity, profile

from clover_lab.engine.requests import settings_for_mode

GEMMS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm",
                   "mkldnn::_linear_pointwise"})
STEPS = {"diffusion": ("clover_lab.preview", "preview_seconds"),  # the runner's regions (engine/runner.py)
         "ar": ("clover_lab.commit", "commit_seconds")}  # and the stats that time them


def one_pass(engine, prompts, b: int, mode: str, args) -> dict:
    """Every prompt at batch ``b``: (wall seconds, the batches' step seconds, their tokens)."""
    kw = dict(mode=mode, max_new_tokens=args.max_new_tokens, temperature=0,
              **settings_for_mode(mode, {"threshold": args.threshold}))  # AR reads no threshold
    t, steps, tokens = time.perf_counter(), 0.0, []
    for i in range(0, len(prompts), b):
        batch = engine.generate(prompts[i:i + b], **kw)
        steps += getattr(batch.stats, STEPS[mode][1])
        tokens += [r.token_ids for r in batch]
    return time.perf_counter() - t, steps, tokens


def gemm_seconds(engine, prompts, b: int, mode: str, args) -> tuple[float, float]:
    """(GEMM self seconds inside the step regions, all GEMM self seconds) of one profiled pass."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        one_pass(engine, prompts, b, mode, args)
    inside = total = 0.0
    for e in prof.events():
        if e.name not in GEMMS:
            continue
        total += e.self_cpu_time_total
        parent = e.cpu_parent
        while parent is not None and parent.name != STEPS[mode][0]:
            parent = parent.cpu_parent
        if parent is not None:
            inside += e.self_cpu_time_total
    return inside / 1e6, total / 1e6


def measure(engine, prompts, mode: str, args) -> list[dict]:
    best = best_rounds(engine, prompts, args, lambda some, b: one_pass(engine, some, b, mode, args))
    rows = []
    for b in args.batch_sizes:
        seconds, steps, tokens = best[b, False]
        gemm_in, gemm_all = gemm_seconds(engine, prompts, b, mode, args)
        rest = max(steps - gemm_in, 0.0)  # what compiled steps could remove at best
        row = dict(mode=mode, batch_size=b, seconds=seconds, step_seconds=steps, step_gemm_seconds=gemm_in,
                   gemm_seconds=gemm_all, step_rest_seconds=rest, bound=seconds / (seconds - rest))
        if args.compiled:
            c_seconds, c_steps, c_tokens = best[b, True]
            engine.compile_steps = True
            row.update(compiled_seconds=c_seconds, compiled_step_seconds=c_steps,
                       compiled_step_gemm_seconds=gemm_seconds(engine, prompts, b, mode, args)[0],
                       compiled_ratio=seconds / c_seconds, compiled_same_tokens=c_tokens == tokens)
            engine.compile_steps = False
        rows.append(row)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine, prompts = build(args)
    rows = [row for mode in args.modes for row in measure(engine, prompts, mode, args)]

    from rich.console import Console
    from rich.table import Table

    name = model_name(args)
    table = Table(title=f"compiled batches, the bound: {name} ({args.dtype}) on {args.device}, {args.prompts} prompts, "
                        f"{args.max_new_tokens} new tokens, {torch.get_num_threads()} threads, best of {args.rounds}")
    compiled_cols = (("compiled s", "compiled steps s", "their GEMMs s ", "compiled vs eager", "same tokens")
                     if args.compiled else ())
    for col in ("mode", "batch", "eager s", "steps s", "their GEMMs s", "rest s", "bound") + compiled_cols:
        table.add_column(col, justify="right")
    for r in rows:
        compiled = ((f"{r['compiled_seconds']:.2f}", f"{r['compiled_step_seconds']:.2f}",
                     f"{r['compiled_step_gemm_seconds']:.2f}", f"{r['compiled_ratio']:.2f}x",
                     "yes" if r["compiled_same_tokens"] else "NO") if args.compiled else ())
        table.add_row(r["mode"], str(r["batch_size"]), f"{r['seconds']:.2f}", f"{r['step_seconds']:.2f}",
                      f"{r['step_gemm_seconds']:.2f}", f"{r['step_rest_seconds']:.2f}", f"{r['bound']:.2f}x",
                      *compiled)
    Console(width=160).print(table)
    tag = "cuda" if args.device.startswith("cuda") else "cpu"
    write_result(args.out, f"batch-bound-{name}-{tag}",
                 {**run_fields("bench_batch_bound", args.device), "args": vars(args), "rows": rows}, indent=2)
    return 0 if all(r.get("compiled_same_tokens", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
