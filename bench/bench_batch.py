"""Batched generation: tokens per second at batch 1, 4 and 16, block diffusion and AR.

The same prompts (held-out code of different lengths for a trained model, random tokens for a
random preset) are generated at each batch size: batch 1 is one ``engine.generate(prompt)`` per
prompt, batch b is ``engine.generate(prompts[i:i + b])``. The batch sizes are interleaved round
by round so that drift in machine load hits them alike; the table gives the best round's
tokens per second (every row's new tokens over the wall time), its ratio to batch 1, the
forwards run, and whether every batch gave the tokens of batch 1 (greedy; in float32, the
default: in bf16 a batch's GEMMs round differently from a single row's, and a near tie can
go the other way). ``--compiled`` adds a column: the same batches with
``engine.compile_steps = True`` (the runner's static steps through torch.compile, for any number
of rows), timed in the same rounds once every shape is warm, its speed over the eager batch's
and whether it gave the eager batch's tokens. Prints a table and writes JSON to bench/results/.
A benchmark, not a test.

    python bench/bench_batch.py [--model default|DIR] [--preset clover-tiny] [--prompts 16]
                                [--batch-sizes 1 4 16] [--max-new-tokens 64] [--threshold 0.9]
                                [--rounds 2] [--threads 2] [--device cpu] [--compiled] [--out DIR]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from result_file import RESULTS, run_fields, write_result

from clover_lab import CloverConfig, CloverModel, Engine, load
from clover_lab.engine.requests import settings_for_mode


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default", metavar="DIR",
                   help="a model directory ('default': the embedded model); 'random' uses --preset")
    p.add_argument("--preset", default="clover-tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32",
                   help="float32 (default: batches must then give batch 1's tokens) | bfloat16 | float16")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=["diffusion", "ar"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads on the CPU")
    p.add_argument("--compiled", action="store_true",
                   help="also time every batch with engine.compile_steps = True (a compiled column)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if any(b < 1 or args.prompts % b for b in args.batch_sizes):
        p.error(f"--batch-sizes must divide --prompts={args.prompts}")
    return args


def build(args) -> tuple[Engine, list[list[int]]]:
    """The engine and the prompts: held-out code windows of 24 to 64 tokens (a trained model)."""
    if args.model == "random":
        config = CloverConfig.preset(args.preset)
        model = CloverModel.random(config.replace(mask_token_id=config.mask_token_id or config.vocab_size - 1),
                                   device=args.device, dtype=getattr(torch, args.dtype))
        with torch.no_grad():
            model.lm_head.weight.mul_(30.0)  # sharper than random: several tokens per step
        engine = Engine(model)
        g = torch.Generator().manual_seed(0)
        return engine, [torch.randint(0, config.vocab_size - 1, (24 + 40 * i // max(args.prompts - 1, 1),),
                                      generator=g).tolist() for i in range(args.prompts)]
    engine = load(None if args.model == "default" else args.model, device=args.device, dtype=getattr(torch, args.dtype),
                  threads=args.threads)
    from clover_lab.train import encode_files, split_corpus

    ids = encode_files(engine.tokenizer, split_corpus()[1]).tolist()
    stride = len(ids) // args.prompts
    return engine, [ids[i * stride:i * stride + 24 + 40 * i // max(args.prompts - 1, 1)] for i in range(args.prompts)]


def generate_all(engine: Engine, prompts, batch_size: int, mode: str, args):
    """(seconds, token ids per prompt, shared forwards) for every prompt at this batch size."""
    kw = dict(mode=mode, max_new_tokens=args.max_new_tokens, temperature=0,
              **settings_for_mode(mode, {"threshold": args.threshold}))  # AR reads no threshold
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    tokens, forwards = [], 0
    for i in range(0, len(prompts), batch_size):
        if batch_size == 1:
            r = engine.generate(prompts[i], **kw)
            tokens.append(r.token_ids)
            forwards += r.stats.forwards
        else:
            batch = engine.generate(prompts[i:i + batch_size], **kw)
            tokens += [r.token_ids for r in batch]
            forwards += batch.stats.forwards
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t, tokens, forwards


def best_rounds(engine: Engine, prompts, args, run) -> dict:
    """(batch size, compiled) -> the fastest of ``args.rounds`` results of ``run(prompts, b)``
    (each with its ``seconds`` first), eager and, with ``args.compiled``, compiled batches side by
    side in every round, after a warm-up of every shape (the compiled steps compile there)."""
    paths = [False, True] if args.compiled else [False]  # compile_steps: eager batches, compiled ones
    for compiled in paths:
        engine.compile_steps = compiled
        for b in args.batch_sizes:
            run(prompts[:b], b)
    best: dict[tuple, tuple] = {}
    for _ in range(args.rounds):
        for b in args.batch_sizes:
            for compiled in paths:  # side by side, in the same round
                engine.compile_steps = compiled
                result = run(prompts, b)
                if (b, compiled) not in best or result[0] < best[b, compiled][0]:
                    best[b, compiled] = result
    engine.compile_steps = False
    return best


def measure(engine: Engine, prompts, mode: str, args) -> list[dict]:
    best = best_rounds(engine, prompts, args, lambda some, b: generate_all(engine, some, b, mode, args))
    base_tokens = best[min(args.batch_sizes), False][1]
    new = sum(len(t) for t in base_tokens)
    base_tps = new / best[min(args.batch_sizes), False][0]
    rows = []
    for b in args.batch_sizes:
        seconds, tokens, forwards = best[b, False]
        tps = sum(len(t) for t in tokens) / seconds
        row = dict(mode=mode, batch_size=b, seconds=seconds, new_tokens=sum(len(t) for t in tokens),
                   forwards=forwards, tokens_per_second=tps, ratio=tps / base_tps, same_tokens=tokens == base_tokens)
        if args.compiled:
            c_seconds, c_tokens, _ = best[b, True]
            row.update(compiled_seconds=c_seconds, compiled_tokens_per_second=sum(len(t) for t in c_tokens) / c_seconds,
                       compiled_ratio=seconds / c_seconds, compiled_same_tokens=c_tokens == tokens)
        rows.append(row)
    return rows


def model_name(args) -> str:
    """The model as result files name it: the preset, "default-model" or the directory's name."""
    return args.preset if args.model == "random" else ("default-model" if args.model == "default"
                                                       else Path(args.model).name)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine, prompts = build(args)
    rows = [row for mode in args.modes for row in measure(engine, prompts, mode, args)]

    from rich.console import Console
    from rich.table import Table

    name = model_name(args)
    table = Table(title=f"batched generation: {name} ({args.dtype}) on {args.device}, {args.prompts} prompts of 24-64 tokens, "
                        f"{args.max_new_tokens} new tokens, threshold {args.threshold}, {torch.get_num_threads()} "
                        f"threads, best of {args.rounds}")
    compiled_cols = ("compiled tokens/s", "compiled vs eager", "compiled same tokens") if args.compiled else ()
    for col in ("mode", "batch", "seconds", "tokens/s", "vs batch 1", "forwards", "same tokens") + compiled_cols:
        table.add_column(col, justify="right")
    for r in rows:
        compiled = ((f"{r['compiled_tokens_per_second']:.1f}", f"{r['compiled_ratio']:.2f}x",
                     "yes" if r["compiled_same_tokens"] else "NO") if args.compiled else ())
        table.add_row(r["mode"], str(r["batch_size"]), f"{r['seconds']:.2f}", f"{r['tokens_per_second']:.1f}",
                      f"{r['ratio']:.2f}x", str(r["forwards"]), "yes" if r["same_tokens"] else "NO", *compiled)
    Console(width=140).print(table)

    tag = "cuda" if args.device.startswith("cuda") else "cpu"
    write_result(args.out, f"batch-{name}-{tag}",
                 {**run_fields("bench_batch", args.device), "args": vars(args), "rows": rows}, indent=2)
    return 0 if all(r["same_tokens"] and r.get("compiled_same_tokens", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
