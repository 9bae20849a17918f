"""What the residual-stream hook points cost with nothing attached: a whole ``engine.generate``
as shipped against the same engine with those points' lookups taken out (the decoder layer and
the head as they were before the points existed), interleaved run by run in one process. Prints a
table and writes JSON to bench/results/. A benchmark, not a test.

    python bench/bench_idle_points.py [--model default] [--max-new-tokens 128] [--repeat 7] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from result_file import RESULTS, write_result

from clover_lab import load
from clover_lab.engine.requests import settings_for_mode
from clover_lab.model.decoder import CloverModel, DecoderLayer


def bare_layer_forward(self, x, ctx, normed=None, next_layer=None):
    """DecoderLayer.forward without the residual points' lookups (issue 17): the same kernels (the
    norms fused after the adds), no hook checks."""
    h = self.input_layernorm(x) if normed is None else normed
    h = self.linear_attn(h, ctx) if self.layer_type == "linear_attention" else self.self_attn(h, ctx)
    x, h = self.post_attention_layernorm.after_add(x, h)
    if next_layer is None:
        return self.mlp(h, ctx, residual=x), None
    return self.mlp(h, ctx, residual=x, next_norm=next_layer.input_layernorm)


def bare_head(self, rows, ctx=None, mode=None, positions=None):
    return self.lm_head(self.model.norm(rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = load(None if args.model == "default" else args.model)
    prompt = "import os\nimport sys\n\n\ndef main(argv):\n"
    shipped = (DecoderLayer.forward, CloverModel.head)
    rows = []
    for mode in ("diffusion", "ar"):
        times = {"with points": [], "without": []}
        for i in range(args.repeat + 1):  # the first round warms up
            for setting in times:
                DecoderLayer.forward, CloverModel.head = shipped if setting == "with points" else (bare_layer_forward,
                                                                                               bare_head)
                t = time.perf_counter()
                r = engine.generate(prompt, mode=mode, max_new_tokens=args.max_new_tokens,
                                    **settings_for_mode(mode, {"threshold": 0.9}))
                if i:
                    times[setting].append(time.perf_counter() - t)
        DecoderLayer.forward, CloverModel.head = shipped
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append(dict(mode=mode, with_points_s=med["with points"], without_s=med["without"],
                         ratio=med["with points"] / med["without"], tokens=r.stats.new_tokens,
                         forwards=r.stats.forwards))
    print(f"idle residual points: {args.model}, {args.max_new_tokens} new tokens, {args.threads} thread(s), "
          f"median of {args.repeat}")
    print(f"{'mode':10} {'with points s':>14} {'without s':>10} {'ratio':>6}")
    for row in rows:
        print(f"{row['mode']:10} {row['with_points_s']:>14.4f} {row['without_s']:>10.4f} {row['ratio']:>6.3f}")
    write_result(args.out, f"idle-points-{Path(args.model).name}-cpu", dict(settings=vars(args), rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
