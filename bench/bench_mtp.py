"""Clover's modes beside the baseline users would pick (issue 53): block diffusion, exact
self-speculative decoding, plain AR and AR with the model's own multi-token-prediction head
(mode "mtp", ``mtp_draft_tokens`` drafts per verify), on the same held-out prompts in one run,
greedy and without the model's default penalties.

Per mode: tokens per forward (new tokens over the trunk's forwards after the prefill; the MTP
head's small forwards are not counted, as vLLM and SGLang count an MTP step as one), tokens/s
(best of ``--rounds``, the modes interleaved round by round), the speed ratio to AR, and whether
the greedy tokens equal AR's (exact modes: they must). Prints a table, writes JSON to
bench/results/. Absolute tokens/s mean something on a GPU only (``bench/gpu_check.sh`` runs it
there); on a CPU only the ratios measured side by side do. A benchmark, not a test.

    python bench/bench_mtp.py [--model DIR] [--device cuda] [--dtype bfloat16] [--prompts 8]
                              [--max-new-tokens 64] [--draft-tokens 3] [--rounds 2] [--out DIR]
"""
from __future__ import annotations

import argparse

import torch
from bench_policies import best_of_rounds, held_out_prompts
from result_file import RESULTS, run_fields, slug, write_result

from clover_lab import load

# (label, generate keyword arguments); the threshold is the embedded model's own default
MODES = [("diffusion", dict(mode="diffusion")), ("speculative", dict(mode="speculative")),
         ("ar", dict(mode="ar")), ("ar+mtp", dict(mode="mtp"))]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--draft-tokens", type=int, default=3, help="mode mtp: the head's drafts per verify")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = load(args.model, device=args.device, dtype=args.dtype, threads=args.threads)
    prompts = held_out_prompts(engine, args.prompts)
    modes = [(name, {**kw, "mtp_draft_tokens": args.draft_tokens} if kw["mode"] == "mtp" else kw)
             for name, kw in MODES if kw["mode"] != "mtp" or engine.model.mtp is not None]
    best = best_of_rounds(engine, prompts, modes, args.max_new_tokens, args.rounds)
    ar = [r.token_ids for r in best["ar"][1]]
    rows = []
    for name, kw in modes:
        seconds, results = best[name]
        new = sum(len(r.token_ids) for r in results)
        forwards = sum(r.stats.forwards for r in results)
        row = dict(mode=name, settings=kw, new_tokens=new, forwards=forwards, tokens_per_forward=new / forwards,
                   tokens_per_second=new / seconds, seconds=seconds,
                   equals_ar=all(r.token_ids == a for r, a in zip(results, ar)))
        acc = [a for r in results for a in (r.stats.accepted or [])]
        if acc:
            row["mean_accepted"] = sum(acc) / len(acc)
        rows.append(row)
    ar_tps = next(r["tokens_per_second"] for r in rows if r["mode"] == "ar")
    for r in rows:
        r["vs_ar"] = r["tokens_per_second"] / ar_tps
    print(f"{'mode':12s} {'tok/fwd':>8s} {'tok/s':>9s} {'vs AR':>6s} {'= AR':>5s} {'accepted':>8s}")
    for r in rows:
        print(f"{r['mode']:12s} {r['tokens_per_forward']:8.2f} {r['tokens_per_second']:9.1f} {r['vs_ar']:5.2f}x "
              f"{'yes' if r['equals_ar'] else 'no':>5s} "
              + (f"{r['mean_accepted']:8.2f}" if "mean_accepted" in r else f"{'':8s}"))
    fields = run_fields("bench_mtp", str(engine.model.device))
    write_result(args.out, f"mtp-{slug(fields['device_name']) if args.device else 'cpu'}",
                 dict(**fields, args=vars(args), prompts=len(prompts), rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
