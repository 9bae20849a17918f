"""The coreset explorer on a model: coreset sizes swept over held-out prompts, measuring tokens
equal to the run without a coreset, tokens per forward and seconds per denoising step. Prints a
table, writes JSON to bench/results/ and (``--plot``) a PNG of the three against the size.
A benchmark, not a test.

    python bench/bench_coreset.py [--model default] [--sizes 2 4 8 16] [--prompts 6] [--prompt-len 48]
                                  [--max-new-tokens 64] [--threshold 0.9] [--repeat 2] [--threads 2]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from result_file import RESULTS, write_result

from clover_lab import load
from clover_lab.lens import coreset_sweep


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--plot", default=None, metavar="PNG")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def heldout_prompts(engine, n: int, length: int) -> list[list[int]]:
    """``n`` windows of ``length`` tokens from the held-out standard-library modules (fixed seed)."""
    from clover_lab.train import encode_files, split_corpus

    tokens = encode_files(engine.tokenizer, split_corpus()[1])
    gen = torch.Generator().manual_seed(11)
    starts = torch.randint(0, len(tokens) - length, (n,), generator=gen).tolist()
    return [tokens[s:s + length].tolist() for s in starts]


def plot(rows, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sized = [r for r in rows if r["coreset_size"]]
    x = [r["coreset_size"] for r in sized]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for ax, key, label in zip(axes, ("tokens_equal", "tokens_per_forward", "seconds_per_step"),
                              ("tokens equal to no coreset", "tokens per forward", "seconds per step")):
        ax.plot(x, [r[key] for r in sized], "o-")
        ax.axhline(rows[0][key], color="grey", linestyle="--", label="no coreset")
        ax.set_xlabel("coreset size (experts)")
        ax.set_title(label)
        ax.set_xscale("log", base=2)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = load(None if args.model == "default" else args.model, threads=args.threads)
    prompts = heldout_prompts(engine, args.prompts, args.prompt_len)
    rows = coreset_sweep(engine, prompts, args.sizes, repeat=args.repeat, max_new_tokens=args.max_new_tokens,
                         threshold=args.threshold)
    print(f"coreset sweep: {len(prompts)} held-out prompts of {args.prompt_len} tokens, {args.max_new_tokens} new, "
          f"threshold {args.threshold}, {engine.model.config.num_experts} experts top-"
          f"{engine.model.config.num_experts_per_tok}, best of {args.repeat}")
    print(f"{'coreset':>8} {'tokens equal':>13} {'tokens/fwd':>11} {'ms/step':>8}")
    for r in rows:
        print(f"{str(r['coreset_size'] or 'none'):>8} {r['tokens_equal']:>13.3f} {r['tokens_per_forward']:>11.3f} "
              f"{1000 * r['seconds_per_step']:>8.2f}")
    write_result(args.out, f"coreset-{Path(args.model).name}-cpu", dict(settings=vars(args), rows=rows))
    if args.plot:
        plot(rows, args.plot, f"expert coreset, {engine.model.config.num_experts} experts top-"
                              f"{engine.model.config.num_experts_per_tok}")
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
