"""What hooks cost a generation: no hooks vs every point observed vs capture() of every point.

For a random model of a preset: median wall time of a whole ``engine.generate`` (block
diffusion, plus the AR baseline for reference) in each setting, its ratio to the no-hook run,
tokens per forward and tokens per second. Prints a table and writes JSON to bench/results/
(date and device in the name). A benchmark, not a test.

    python bench/bench_hooks.py [--preset clover-tiny] [--device cuda] [--dtype bfloat16]
                                [--max-new-tokens 128] [--repeat 5] [--threshold 0.9]
                                [--lm-head-scale 30] [--threads 1] [--out DIR]

"observing" attaches a no-op function to every hook point ("*"): engine events are then built
each step, route events each layer, and the GDN preview computes its history weights (work the
observed point asks for). "capture" records every point (tensors kept on the device).
Random weights make near-uniform next-token distributions, so few positions reach the
threshold; ``--lm-head-scale`` sharpens them (the test suite uses 30) to get several tokens per
step, closer to a trained model's tokens per forward.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from result_file import RESULTS, run_fields, write_result

from clover_lab import CloverConfig, CloverModel, Engine
from clover_lab.engine.requests import settings_for_mode


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="clover-tiny")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="a trained model directory instead of a random preset ('default': the embedded one)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--lm-head-scale", type=float, default=30.0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads on the CPU")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def build_engine(args) -> Engine:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")]
    if args.model:
        from clover_lab import load

        engine = load(None if args.model == "default" else args.model, device=args.device, dtype=dtype,
                      threads=args.threads)
        args.preset = "default-model" if args.model == "default" else Path(args.model).name  # for the table
        return engine
    config = CloverConfig.preset(args.preset)
    if config.mask_token_id is None:  # e.g. clover-small: no tokenizer yet, take the last id
        config = config.replace(mask_token_id=config.vocab_size - 1)
    model = CloverModel.random(config, device=args.device, dtype=dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(args.lm_head_scale)
    return Engine(model)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


SETTINGS = ("none", "observing", "capture")


def run_once(engine: Engine, prompt, args, setting: str, mode: str):
    """(seconds, result, records captured)."""
    kw = dict(mode=mode, max_new_tokens=args.max_new_tokens, **settings_for_mode(mode, {"threshold": args.threshold}))
    records = None
    sync(args.device)
    t = time.perf_counter()
    if setting == "none":
        r = engine.generate(prompt, **kw)
    elif setting == "observing":
        with engine.hooks({"*": lambda ev: None}):
            r = engine.generate(prompt, **kw)
    else:
        with engine.capture(["*"]) as cap:
            r = engine.generate(prompt, **kw)
        records = len(cap)
    sync(args.device)
    return time.perf_counter() - t, r, records


def measure(engine: Engine, prompt, args, mode: str) -> list[dict]:
    """The settings interleaved run by run, so that drift in machine load hits them alike."""
    times = {s: [] for s in SETTINGS}
    last = {}
    for s in SETTINGS:
        run_once(engine, prompt, args, s, mode)  # warm-up
    for _ in range(args.repeat):
        for s in SETTINGS:
            t, r, records = run_once(engine, prompt, args, s, mode)
            times[s].append(t)
            last[s] = (r, records)
    rows = []
    base_med, base_min = statistics.median(times["none"]), min(times["none"])
    for s in SETTINGS:
        r, records = last[s]
        st = r.stats
        med = statistics.median(times[s])
        rows.append(dict(setting=s, mode=mode, median_s=med, min_s=min(times[s]), ratio=med / base_med,
                         ratio_min=min(times[s]) / base_min, tokens=st.new_tokens, forwards=st.forwards,
                         tokens_per_forward=st.tokens_per_forward, tokens_per_second=st.new_tokens / med,
                         mean_steps_per_block=st.mean_steps_per_block, records=records))
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = build_engine(args)
    if engine.tokenizer is not None:
        # a trained model: real code, the first tokens of the first held-out stdlib module
        from clover_lab.train import encode_files, split_corpus

        prompt = encode_files(engine.tokenizer, split_corpus()[1][:1])[:args.prompt_len].tolist()
    else:  # random weights: random tokens are as good as any
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, engine.model.config.vocab_size - 1, (args.prompt_len,), generator=g).tolist()
    rows = measure(engine, prompt, args, "diffusion") + measure(engine, prompt, args, "ar")

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"hook overhead: {args.preset} on {args.device}, {args.max_new_tokens} new tokens, "
                        f"threshold {args.threshold}, median of {args.repeat}")
    for col in ("mode", "hooks", "median s", "ratio (median)", "ratio (min)", "tokens/fwd", "tokens/s",
                "steps/block", "records"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["mode"], r["setting"], f"{r['median_s']:.4f}", f"{r['ratio']:.3f}", f"{r['ratio_min']:.3f}",
                      f"{r['tokens_per_forward']:.2f}", f"{r['tokens_per_second']:.1f}",
                      "-" if r["mean_steps_per_block"] is None else f"{r['mean_steps_per_block']:.2f}",
                      "-" if r["records"] is None else str(r["records"]))
    Console(width=140).print(table)

    tag = "cuda" if args.device.startswith("cuda") else "cpu"
    write_result(args.out, f"hooks-{args.preset}-{tag}",
                 {**run_fields("bench_hooks", args.device), "args": vars(args), "rows": rows}, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
