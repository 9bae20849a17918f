"""Before and after an adaptation run (``clover-lab adapt``), on the run's held-out files: tokens
per forward of block diffusion at threshold 0.9, masked-token accuracy, AR perplexity.

    python bench/adapt_figures.py --run runs/adapt-stdlib [--reference assets/clover-stdlib] --threads 2

"before" is the run's init as training started from it (preview parameters reset when the run
reset them); "after" is the run's output directory; ``--reference`` adds any other model (e.g.
the embedded model as shipped). Every model is measured in its stored dtype with the model
card's measurements (``train.objective.evaluate``: 48 windows of 256 tokens; ``train.card.speed``:
6 held-out prompts of 48 tokens, 64 new tokens, greedy). Prints a table; writes JSON to
bench/results/.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import torch
from result_file import DATE, RESULTS, result_path, write_json

from clover_lab import load
from clover_lab.train.card import speed
from clover_lab.train.objective import evaluate

THRESHOLDS = (0.9, 0.5)


def measure(engine, heldout: torch.Tensor) -> dict:
    t0 = time.time()
    figures = {"heldout": evaluate(engine.model, heldout, windows=48)}
    figures["speed"] = {str(t): speed(engine, heldout, threshold=t) for t in THRESHOLDS}
    figures["measure_seconds"] = time.time() - t0
    return figures


def models(run: Path, reference: str | None) -> dict:
    """name -> (engine, what it is)."""
    state = torch.load(run / "training" / "state.pt", weights_only=False)
    init, reset = state["adapt"]["init"], state["adapt"]["reset_preview"]
    before = load(init)
    if reset:
        before.model.reset_preview_parameters()
    out = {"before": (before, f"{init}" + (" with its preview parameters reset" if reset else "")),
           "after": (load(run), f"{run} after {state['step']} steps of --train {state['adapt']['train']}")}
    if reference:
        out["reference"] = (load(reference), reference)
    return out, state


def table(results: dict) -> str:
    rows = [("tokens per forward, threshold 0.9", lambda f: f["speed"]["0.9"]["diffusion"]["tokens_per_forward"], ".2f"),
            ("tokens per forward, threshold 0.5", lambda f: f["speed"]["0.5"]["diffusion"]["tokens_per_forward"], ".2f"),
            *((f"masked-token accuracy, ratio {r}", lambda f, r=r: f["heldout"][f"mask_acc@{r}"], ".3f")
              for r in (0.25, 0.5, 0.75, 1.0)),
            ("AR perplexity", lambda f: f["heldout"]["ar_perplexity"], ".2f")]  # tokens/s: in the JSON only
    names = list(results)
    lines = [f"| figure | {' | '.join(names)} |", "|---|" + "---|" * len(names)]
    lines += [f"| {label} | " + " | ".join(f"{get(results[n]):{fmt}}" for n in names) + " |" for label, get, fmt in rows]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="the adaptation's --out directory")
    ap.add_argument("--reference", help="another model directory to measure beside")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--command", default=None, help="the command that made the run (recorded)")
    ap.add_argument("--json", default=None, help="where to write (default bench/results/adapt-small-cpu-DATE.json)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run = Path(args.run)
    heldout = torch.load(run / "training" / "data.pt")["heldout"]
    engines, state = models(run, args.reference)
    results = {}
    for name, (engine, what) in engines.items():
        torch.manual_seed(0)
        results[name] = {"model": what, **measure(engine, heldout)}
        print(f"{name}: measured in {results[name]['measure_seconds']:.0f} s", flush=True)
    print(table(results))
    log = [json.loads(line) for line in (run / "training" / "loss_log.jsonl").read_text().splitlines()]
    out = {"date": str(date.today()), "machine": platform.machine(), "threads": torch.get_num_threads(),
           "run": {"adapt": state["adapt"], "settings": state["settings"], "steps": state["step"],
                   "train_seconds": state.get("train_seconds"), "last_log": log[-1] if log else None},
           "heldout_tokens": len(heldout), "command": args.command, "models": results}
    dest = write_json(args.json or result_path(RESULTS, "adapt-small-cpu", DATE), out, indent=2)
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
