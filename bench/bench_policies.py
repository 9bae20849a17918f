"""Decoding policies side by side: every rule (threshold, EB-sampler, top-k, look-ahead), AR and exact
speculative decoding over the held-out prompts, on the embedded model in float32, greedy and
without the model's default repetition / frequency penalties (the rules compared as they are;
the penalties change every row alike).

Per policy and setting: tokens per forward (new tokens over forwards after the prefill),
tokens/s (best of ``--rounds``, the policies interleaved round by round), and agreement with AR
greedy as the field measures it: the exact-match rate of whole continuations and the per-token
edit distance (Levenshtein distance between the continuation and AR's, over AR's length), not
position-by-position equality, which collapses after the first difference. Speculative rows
also give the mean accepted draft length per block. Prints a table, writes JSON to
bench/results/ and (``--plot``) a PNG of agreement against tokens per forward. A benchmark, not
a test.

    python bench/bench_policies.py [--prompts 8] [--max-new-tokens 64] [--rounds 2] [--threads 2]
                                   [--plot assets/policies.png] [--out DIR]
"""
from __future__ import annotations

import argparse
import platform
import time

import torch
from result_file import RESULTS, write_result

from clover_lab import load

# plain greedy decoding: the embedded model's generation_config.json adds penalties against loops
GREEDY = dict(temperature=0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)

# (label, generate keyword arguments)
POLICIES = [
    ("ar", dict(mode="ar")),
    ("speculative, 1 pass", dict(mode="speculative", draft_passes=1)),
    ("speculative, 2 passes t0.9", dict(mode="speculative", draft_passes=2, threshold=0.9)),
    ("threshold 0.9", dict(threshold=0.9)),
    ("threshold 0.7", dict(threshold=0.7)),
    ("threshold 0.5", dict(threshold=0.5)),
    ("margin 0.5", dict(threshold=0.5, confidence="margin")),
    ("entropy 0.5", dict(threshold=0.5, confidence="entropy")),
    ("eb gamma 0.1", dict(policy="eb:gamma=0.1")),
    ("eb gamma 0.5", dict(policy="eb:gamma=0.5")),
    ("eb gamma 1.0", dict(policy="eb:gamma=1.0")),
    ("topk 2", dict(policy="topk:k=2")),
    ("topk 4", dict(policy="topk:k=4")),
    ("topk 1/2/4/8", dict(policy="topk:k=1/2/4/8")),
    ("lookahead 0.5 t0.9", dict(threshold=0.9, policy="lookahead:start=0.5,threshold=0.9")),
    ("lookahead 0.25 t0.7", dict(threshold=0.7, policy="lookahead:start=0.25,threshold=0.7")),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--only", nargs="*", default=None, help="labels to run (default: all)")
    p.add_argument("--plot", default=None, metavar="PNG")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def held_out_prompts(engine, n: int) -> list[list[int]]:
    """Held-out code windows of 24 to 64 tokens (bench_batch.py's)."""
    from clover_lab.train import encode_files, split_corpus

    ids = encode_files(engine.tokenizer, split_corpus()[1]).tolist()
    stride = len(ids) // n
    return [ids[i * stride:i * stride + 24 + 40 * i // max(n - 1, 1)] for i in range(n)]


def edit_distance(a: list[int], b: list[int]) -> int:
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def time_generations(engine, prompts, kw, max_new):
    """(seconds, results): every prompt generated greedily with ``kw``, one after the other, timed
    (a GPU synchronised before and after)."""
    cuda = engine.model.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    results = [engine.generate(p, max_new_tokens=max_new, **GREEDY, **kw) for p in prompts]
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t, results


def best_of_rounds(engine, prompts, settings, max_new: int, rounds: int) -> dict:
    """{label: (seconds, results)} of the fastest of ``rounds`` runs of each (label, keyword
    arguments) in ``settings``, interleaved round by round (a slow moment of the machine spread
    over all of them), after a short warm-up of each (bench_mtp.py's side by side too)."""
    for _, kw in settings:
        time_generations(engine, prompts[:1], kw, 8)
    best: dict[str, tuple] = {}
    for _ in range(rounds):
        for name, kw in settings:
            seconds, results = time_generations(engine, prompts, kw, max_new)
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, results)
    return best


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = load(dtype=torch.float32, threads=args.threads)
    prompts = held_out_prompts(engine, args.prompts)
    policies = [(n, kw) for n, kw in POLICIES if args.only is None or n in args.only or n == "ar"]
    best = best_of_rounds(engine, prompts, policies, args.max_new_tokens, args.rounds)
    ar = [r.token_ids for r in best["ar"][1]]
    rows = []
    for name, kw in policies:
        seconds, results = best[name]
        new = sum(len(r.token_ids) for r in results)
        forwards = sum(r.stats.forwards for r in results)
        row = dict(policy=name, settings={k: v for k, v in kw.items()}, new_tokens=new, forwards=forwards,
                   tokens_per_forward=new / forwards, tokens_per_second=new / seconds, seconds=seconds,
                   exact_match=sum(r.token_ids == a for r, a in zip(results, ar)) / len(ar),
                   edit_distance=sum(edit_distance(r.token_ids, a) / len(a) for r, a in zip(results, ar)) / len(ar),
                   per_prompt_tokens_per_forward=[r.stats.tokens_per_forward for r in results])
        if kw.get("mode") == "speculative":
            acc = [a for r in results for a in r.stats.accepted]
            row["mean_accepted"] = sum(acc) / len(acc)
        rows.append(row)
    ar_tps = next(r["tokens_per_second"] for r in rows if r["policy"] == "ar")
    print(f"{'policy':28s} {'tok/fwd':>8s} {'tok/s':>8s} {'vs AR':>6s} {'exact':>6s} {'edit/tok':>8s}")
    for r in rows:
        print(f"{r['policy']:28s} {r['tokens_per_forward']:8.2f} {r['tokens_per_second']:8.1f} "
              f"{r['tokens_per_second'] / ar_tps:5.2f}x {r['exact_match']:6.2f} {r['edit_distance']:8.3f}"
              + (f"  accepted/block {r['mean_accepted']:.2f}" if "mean_accepted" in r else ""))
    for r in rows:
        if "mean_accepted" in r:
            print(f"{r['policy']}: tokens per forward per prompt "
                  + " ".join(f"{x:.2f}" for x in r["per_prompt_tokens_per_forward"]))
    write_result(args.out, "policies-default-model-cpu", dict(args=vars(args), host=platform.node(),
                                                              threads=torch.get_num_threads(), rows=rows))
    if args.plot:
        plot(rows, args.plot)
    return 0


def plot(rows, path: str):
    """Agreement with AR against tokens per forward, one point per policy, written to ``path``;
    returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # a legend, not labels beside the points: policies that land close together (AR and the
    # speculative ones at 1.0, the threshold rules around 1.2-1.5) made their labels unreadable
    fig, ax = plt.subplots(figsize=(9.5, 4.4))
    colours = plt.get_cmap("tab20").colors
    for i, r in enumerate(rows):
        kind = "o" if "mode" not in r["settings"] else ("s" if r["settings"]["mode"] == "ar" else "*")
        ax.plot(r["tokens_per_forward"], 1 - r["edit_distance"], kind, markersize=10 if kind == "*" else 7,
                color=colours[i % len(colours)], alpha=0.85, label=r["policy"])
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7.5, frameon=False, borderaxespad=0)
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("agreement with AR greedy (1 - edits per token)")
    ax.set_title("decoding policies on the embedded model (held-out prompts, greedy)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return fig


if __name__ == "__main__":
    raise SystemExit(main())
