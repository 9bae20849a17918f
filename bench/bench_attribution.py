"""Direct logit attribution against ablation, over many decisions: for each token a generation
placed (a diffusion unmask at its (block, step), or an AR token), the largest part of its logit
(an embedding, a head, a routed or shared expert), then a rerun with that part removed at its
source at that row only: how far the logit moves against the part's direct share. Prints a
table and the Pearson correlation of share and move over the decisions (the largest parts, and
the largest part of the last layer, which no later layer can amplify or undo); writes JSON to
bench/results/. Also the largest relative gap between the parts' sum and the logit (float32).
A benchmark, not a test.

    python bench/bench_attribution.py [--model default] [--decisions 50] [--max-new-tokens 16]
                                      [--threshold 0.9] [--mode diffusion] [--threads 1]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from result_file import RESULTS, write_result

from clover_lab import attribution, load

PROMPTS = ["import os\n\ndef main(path):\n", "def area(width, height):\n", "print(len(",
           "class Stack:\n    def __init__(self):\n", "for i in range(10):\n", "def parse(line):\n    parts = ",
           "import re\n\npattern = re.", "with open(path) as f:\n", "def fibonacci(n):\n", "if __name__ == "]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--decisions", type=int, default=50)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--mode", default="diffusion", choices=["diffusion", "ar", "speculative"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def pearson(x: list[float], y: list[float]) -> float:
    return float(torch.corrcoef(torch.tensor([x, y], dtype=torch.float64))[0, 1])


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = load(None if args.model == "default" else args.model, dtype=torch.float32, threads=args.threads)
    kw = dict(max_new_tokens=args.max_new_tokens, mode=args.mode)
    if args.mode != "ar":
        kw["threshold"] = args.threshold
    last = engine.model.config.num_hidden_layers - 1
    rows, worst_sum = [], 0.0
    for prompt in PROMPTS:
        if len(rows) >= args.decisions:
            break
        decisions, attrs = attribution.decision_attributions(engine, prompt, **kw)
        for d, a in zip(decisions, attrs):
            if len(rows) >= args.decisions:
                break
            worst_sum = max(worst_sum, abs(a.total() - a.logit) / max(abs(a.logit), 1e-6))
            name, share = a.top(1)[0]
            tail = {n: v for n, v in a.contributions.items() if n.startswith(f"layers.{last}.")}
            last_name = max(tail, key=lambda n: abs(tail[n]))
            rows.append(dict(prompt=prompt, block=d.block, step=d.step, position=d.position,
                             token=engine.tokenizer.decode([d.token]), logit=a.logit, part=name, share=share,
                             moved=a.logit - attribution.ablated_logit(engine, prompt, a, name, **kw),
                             last_part=last_name, last_share=tail[last_name],
                             last_moved=a.logit - attribution.ablated_logit(engine, prompt, a, last_name, **kw)))
    r_all = pearson([r["share"] for r in rows], [r["moved"] for r in rows])
    r_last = pearson([r["last_share"] for r in rows], [r["last_moved"] for r in rows])
    print(f"{len(rows)} decisions ({args.mode}, {args.max_new_tokens} new tokens a prompt), float32")
    print(f"{'block':>5} {'step':>4} {'pos':>4} {'token':>12} {'logit':>7} {'largest part':>28} {'share':>7} "
          f"{'moved':>7}")
    for r in rows:
        print(f"{r['block']!s:>5} {r['step']!s:>4} {r['position']:>4} {r['token']!r:>12} {r['logit']:>7.2f} "
              f"{r['part']:>28} {r['share']:>7.2f} {r['moved']:>7.2f}")
    print(f"correlation of share and move, largest parts: {r_all:.3f}; largest last-layer parts: {r_last:.3f}")
    print(f"largest |sum of parts - logit| / |logit|: {worst_sum:.2e}")
    write_result(args.out, f"attribution-{Path(args.model).name}-cpu",
                 dict(settings=vars(args), correlation_largest=r_all, correlation_last_layer=r_last,
                      worst_relative_sum_gap=worst_sum, rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
