"""The rounds of a specimen run (``assets/make_specimen_v2.sh``) as the model card shows them: each
round's ``round-N/measure.json`` (exported with the round's own defaults) and ``round-N/sweep.json``
(the same measurements under other sampler settings, when the round was swept), one row a setting."""
from __future__ import annotations

import json
from pathlib import Path

PENALTIES = (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0))


def penalties(settings: dict) -> str:
    """The penalties a measurement ran with, in words ("no penalties" when all are neutral)."""
    shown = [f"{name} {settings[name]:g}" for name, neutral in PENALTIES if settings.get(name, neutral) != neutral]
    return ", ".join(shown) or "no penalties"


def row(round_number: int, figures: dict) -> dict:
    """One measurement (``train.measure``'s figures) without its samples."""
    out = {"round": round_number, "settings": penalties(figures["settings"])}
    for name in ("written", "heldout"):
        out[name] = {k: figures[name][k] for k in ("tokens_per_forward", "looping", "max_line_repeats",
                                                   "distinct_first_lines", "mean_distance", "prompts")}
    out["ar_perplexity"] = figures.get("ar_perplexity")
    return out


def round_rows(run: str | Path) -> list[dict]:
    """Every measured round of ``run`` in order (round-1, round-2, ...): its measure.json row, then
    its sweep.json rows (a sweep's first entry carries the perplexity, the same weights')."""
    rows = []
    number = 1
    while (Path(run) / f"round-{number}" / "measure.json").is_file():
        folder = Path(run) / f"round-{number}"
        rows.append(row(number, json.loads((folder / "measure.json").read_text())))
        if (folder / "sweep.json").is_file():
            rows += [row(number, f) for f in json.loads((folder / "sweep.json").read_text())]
        number += 1
    return rows


def render_rounds(rows: list[dict]) -> str:
    """The rows as a markdown table (empty when the run had no rounds)."""
    if not rows:
        return ""

    def cells(s: dict) -> str:
        return (f"{s['tokens_per_forward']:.2f} | {s['looping']}/{s['prompts']} | {s['max_line_repeats']} | "
                f"{s['distinct_first_lines']:.2f}")

    body = "\n".join(f"| {r['round']} | {r['settings']} | {cells(r['written'])} | {cells(r['heldout'])} | "
                     f"{'' if r['ar_perplexity'] is None else format(r['ar_perplexity'], '.1f')} |" for r in rows)
    return ("| round | sampler settings | written tokens per forward | looping | most repeats | distinct first "
            "lines | held-out tokens per forward | looping | most repeats | distinct first lines | perplexity |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n" + body + "\n")
