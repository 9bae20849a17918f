"""A TopK sparse autoencoder on the embedded model's residual stream, trained on the CPU and
measured on held-out generations (issue 42): the figures of docs/guides/steering-and-features.md.

    python bench/bench_sae.py                    # 256 training and 32 held-out prompts, 64 new tokens
    python bench/bench_sae.py --seconds 60 --d-sae 1024 --save runs/sae

Prompts are windows of the standard-library modules the model never trained on (its held-out
split), seeded; the autoencoder's training prompts and its held-out prompts are disjoint. Prints a
table and writes bench/results/sae-default-model-cpu-<time>.json.
"""
from __future__ import annotations

import argparse
import time

import torch

from result_file import RESULTS, run_fields, write_result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model directory (default: the embedded model)")
    p.add_argument("--train-prompts", type=int, default=256)
    p.add_argument("--held-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--layer", type=int, default=2)
    p.add_argument("--d-sae", type=int, default=2048)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--seconds", type=float, default=180.0, help="training time budget")
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default=None, metavar="DIR", help="also save the autoencoder (SAELens' layout)")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def prompts(engine, n: int, seed: int) -> list[list[int]]:
    """``n`` windows of 24 to 48 tokens of the held-out stdlib modules, at seeded starts."""
    from clover_lab.train.stdlib_corpus import encode_files, split_corpus

    ids = encode_files(engine.tokenizer, split_corpus()[1])
    starts = torch.randint(0, len(ids) - 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [ids[s:s + 24 + s % 25].tolist() for s in starts]


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import clover_lab
    from clover_lab import features

    engine = clover_lab.load(args.model, threads=args.threads)
    windows = prompts(engine, args.train_prompts + args.held_prompts, args.seed)
    held, train = windows[:args.held_prompts], windows[args.held_prompts:]
    t = time.perf_counter()
    acts = features.collect(engine, train, layer=args.layer, max_new_tokens=args.max_new_tokens)
    collect_s = time.perf_counter() - t
    sae = features.train(acts, d_sae=args.d_sae, k=args.k, seconds=args.seconds, batch_size=args.batch_size,
                         lr=args.lr, seed=args.seed, model_name="clover-stdlib" if args.model is None else args.model)
    t = time.perf_counter()
    report, held_acts = features.evaluate(engine, sae, held, max_new_tokens=args.max_new_tokens)
    eval_s = time.perf_counter() - t
    if args.save:
        sae.metadata["clover_lab"].update(heldout=report.to_dict())
        sae.save(args.save)
    rows = {"training rows": len(acts), "masked share": round(float(acts.masked.float().mean()), 3),
            "collect s": round(collect_s, 1), "train steps": sae.log.steps, "train s": round(sae.log.seconds, 1),
            "rows seen": sae.log.rows_seen, "dead features": round(sae.log.dead_fraction, 4),
            "held-out rows": report.rows, "FVU": round(report.fvu, 4), "FVU masked": round(report.fvu_masked, 4),
            "FVU unmasked": round(report.fvu_unmasked, 4), "loss clean": round(report.clean_loss, 4),
            "loss spliced": round(report.spliced_loss, 4), "loss delta": round(report.delta, 4),
            "loss mean-ablated": round(report.ablated_loss, 4), "recovered": round(report.recovered, 4),
            "masked positions": report.positions, "eval s": round(eval_s, 1)}
    width = max(map(len, rows))
    for k, v in rows.items():
        print(f"{k:<{width}}  {v}")
    write_result(args.out, "sae-default-model-cpu" if args.model is None else "sae-cpu",
                 dict(run=run_fields("bench_sae", "cpu"), settings=vars(args), figures=rows, report=report.to_dict(),
                      curve=sae.log.curve, training=sae.log.settings))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
