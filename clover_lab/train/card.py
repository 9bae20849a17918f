"""The model card of a trained small Clover: figures measured on the held-out split.

    python -m clover_lab.train.card --run runs/stdlib --model assets/clover-stdlib

Writes ``README.md`` (the card), ``card.json`` (the figures) and ``loss_curve.png`` into the model
directory. Every figure is measured here, on held-out standard-library modules.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

import torch

from clover_lab.engine import load
from clover_lab.engine.requests import settings_for_mode
from clover_lab.hooks import points
from clover_lab.train.measure import LOOP_REPEATS, NEW_TOKENS, measure
from clover_lab.train.objective import evaluate, unigram_accuracy
from clover_lab.train.rounds import render_rounds, round_rows
from clover_lab.writes import atomic_path, write_text


@torch.no_grad()
def expert_usage(model, tokens: torch.Tensor, windows: int = 16, seq_len: int = 256) -> list[dict]:
    """Per MoE layer: the entropy of the routed-slot distribution over experts (bits; max log2 E)
    and the max/mean load, on held-out text in commit mode."""
    E = model.config.num_experts
    counts = {i: torch.zeros(E) for i in range(model.config.num_hidden_layers)}

    def count(event):
        counts[event.layer] += torch.bincount(event.expert_ids.reshape(-1).cpu(), minlength=E).float()

    gen = torch.Generator().manual_seed(7)
    with model.hooks.scoped({points.every_layer(points.MOE_ROUTE): count}):
        for s in torch.randint(0, len(tokens) - seq_len, (windows,), generator=gen).tolist():
            model.logits(tokens[s:s + seq_len].long()[None])
    rows = []
    for layer, c in counts.items():
        p = c / c.sum()
        entropy = float(-(p[p > 0] * p[p > 0].log2()).sum())
        rows.append({"layer": layer, "entropy_bits": entropy, "max_bits": math.log2(E),
                     "max_over_mean_load": float(c.max() / c.mean())})
    return rows


def speed(engine, tokens: torch.Tensor, prompts: int = 6, prompt_len: int = 48, new: int = 64,
          threshold: float = 0.9) -> dict:
    """Block diffusion vs AR on the same held-out prompts: tokens per forward and tokens/s."""
    gen = torch.Generator().manual_seed(11)
    out = {"diffusion": [], "ar": []}
    for s in torch.randint(0, len(tokens) - prompt_len, (prompts,), generator=gen).tolist():
        ids = tokens[s:s + prompt_len].tolist()
        for mode in out:
            r = engine.generate(ids, mode=mode, max_new_tokens=new, **settings_for_mode(mode, {"threshold": threshold}))
            out[mode].append((len(r.token_ids), r.stats["forwards"], r.stats["tokens_per_second"]))
    figures = {}
    for mode, runs in out.items():
        tokens_made = sum(n for n, _, _ in runs)
        figures[mode] = {"tokens_per_forward": tokens_made / sum(f for _, f, _ in runs),
                         "tokens_per_second": sum(t for _, _, t in runs) / len(runs)}
    figures["speedup_tokens_per_second"] = figures["diffusion"]["tokens_per_second"] / figures["ar"]["tokens_per_second"]
    figures["settings"] = {"prompts": prompts, "prompt_len": prompt_len, "new_tokens": new, "threshold": threshold,
                           "threads": torch.get_num_threads(), "machine": platform.machine(),
                           "load_average": os.getloadavg()[0]}
    return figures


def samples(engine, prompts: list[str], new: int = 96) -> list[dict]:
    rows = []
    for p in prompts:
        r = engine.generate(p, max_new_tokens=new, threshold=0.9)
        rows.append({"prompt": p, "completion": r.text, "tokens_per_forward": r.stats["tokens_per_forward"]})
    return rows


def loss_curve(run: Path, dest: Path, distillation: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = [json.loads(line) for line in (run / "loss_log.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in log]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for key, label in (("mask_ce", "masked-token CE"), ("ar_ce", "next-token CE")):
        ax[0].plot(steps, [r[key] for r in log], label=label, lw=1)
    ax[0].set_xlabel("step"), ax[0].set_ylabel("cross-entropy (nats)"), ax[0].legend()
    ax[1].plot(steps, [r["mask_acc"] for r in log], lw=1, color="tab:green")
    ax[1].set_xlabel("step"), ax[1].set_ylabel("masked-token accuracy (training batch)")
    if distillation:  # from here on the batches mix in the model's own continuations
        for a in ax:
            a.axvline(distillation["from_step"], color="grey", ls="--", lw=1)
        ax[0].text(distillation["from_step"], ax[0].get_ylim()[1], " self-distillation", va="top", fontsize=8)
    fig.tight_layout()
    with atomic_path(dest) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


SAMPLE_PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef list_files(path):\n",
                  "class Stack:\n    def __init__(self):\n"]


SWEEP_THRESHOLDS = (0.7, 0.5)


def write_card(run: Path, model_dir: Path, command: str, baseline: Path | None = None,
               continues: bool = False) -> dict:
    """Measure the model in ``model_dir`` (trained in ``run``) and write card.json, the loss curve
    and README.md there. ``baseline``: an earlier card.json to set the figures beside; ``continues``:
    that card is of an earlier export of this same run (this version is the steps since)."""
    engine = load(model_dir)
    torch.manual_seed(0)
    data = torch.load(run / "data.pt")
    state = torch.load(run / "train_state.pt", weights_only=False)
    held, train_tokens = data["heldout"], data["train"]
    t0 = time.time()
    figures = {
        "heldout": evaluate(engine.model, held, windows=48),
        "unigram_baseline_accuracy": unigram_accuracy(train_tokens, held),
        "expert_usage": expert_usage(engine.model, held),
        "speed_cpu": speed(engine, held),
        "speed_cpu_thresholds": {str(t): speed(engine, held, threshold=t) for t in SWEEP_THRESHOLDS},
        "samples": samples(engine, SAMPLE_PROMPTS),
        "parameters": sum(p.numel() for p in engine.model.parameters()),
        "training_steps": state["step"],
        "distillation": ({"from_step": state["settings"]["schedule_start"], "share": state["settings"]["distill_share"],
                          "confidence_weight": state["settings"]["confidence_weight"]}
                         if state["settings"].get("distill_data") else None),
        "functions_share": state["settings"].get("functions_share", 0.0),
        "split_newlines": state["settings"].get("split_newlines", 0.0),
        "init": state["settings"].get("init"),
        "distill_parts": distill_parts(state["settings"].get("distill_data")),
        "rounds": round_rows(run),
        "heldout_modules": len(data["heldout_modules"]),
        "heldout_tokens": len(held),
        "train_tokens": len(train_tokens),
    }
    figures["targets"] = measure(model_dir, held)
    figures["measure_seconds"] = time.time() - t0
    b = json.loads(Path(baseline).read_text()) if baseline is not None else None
    figures["stages"] = stages(b, figures, continues)
    if b is not None:
        figures["baseline"] = {k: b[k] for k in ("training_steps", "heldout", "speed_cpu", "speed_cpu_thresholds")
                               if k in b}
        figures["baseline"]["card"] = str(baseline)
        if "targets" in b:  # without its samples
            figures["baseline"]["targets"] = {k: ({n: x for n, x in v.items() if n != "samples"}
                                                  if isinstance(v, dict) else v) for k, v in b["targets"].items()}
    write_text(model_dir / "card.json", json.dumps(figures, indent=2) + "\n")
    # a run started from a model (--init) is self-distilled throughout: no step marks where that began
    loss_curve(run, model_dir / "loss_curve.png", None if figures["init"] else figures["distillation"])
    write_text(model_dir / "README.md", render(figures, engine.model.config, command))
    return figures


def distill_parts(corpus: str | None) -> list[dict] | None:
    """What the run's last self-distillation corpus continued, per merged part: ``prefixes``
    ("windows", or "function heads, ...") and ``rows``; None without a corpus, or when its file is gone."""
    if not corpus or not Path(corpus).is_file():
        return None
    c = torch.load(corpus, weights_only=False)
    parts = c["settings"].get("parts") or [{**c["settings"], "rows": len(c["sequences"])}]
    return [{"prefixes": part.get("prefixes", "windows"), "rows": part["rows"]} for part in parts]


def stages(baseline: dict | None, f: dict, continues: bool = False) -> list[dict]:
    """What made the model, oldest stage first: the baseline card's stages (a card written before
    cards kept them, v2's: v1 trained from scratch, then v2's self-distillation), then this run's:
    ``version``, ``steps``, ``kind`` ("scratch", "distillation", "functions": rows that start at a
    function's head) and the kind's settings. ``continues``: the baseline is an earlier export of
    this run, and this stage the steps since."""
    if baseline is None:
        earlier = []
    elif "stages" in baseline:
        earlier = baseline["stages"]
    else:
        earlier = stages(baseline.get("baseline"), baseline) if baseline.get("init") else [
            {"version": 1, "steps": baseline["training_steps"], "kind": "scratch"}]
    steps = f["training_steps"] - (baseline["training_steps"] if continues else 0)
    stage = {"version": len(earlier) + 1, "steps": steps, "kind": "scratch"}
    if continues:
        stage["continues"] = True
    d = f.get("distillation")
    if f.get("functions_share"):
        stage.update(kind="functions", share=f["functions_share"], distill_share=d["share"] if d else 0.0,
                     confidence_weight=d["confidence_weight"] if d else None,
                     split_newlines=f.get("split_newlines", 0.0), distill_parts=f.get("distill_parts"))
    elif d and f.get("init"):
        stage.update(kind="distillation", share=d["share"], confidence_weight=d["confidence_weight"],
                     rounds=len({r["round"] for r in f.get("rounds") or []}))
    return earlier + [stage]


def remeasure_generation(run: Path, model_dir: Path, command: str) -> dict:
    """Re-measure the figures that depend on the model directory's generation_config.json (speed,
    samples, targets) and keep the others from its card.json: for new generation defaults on the
    same weights."""
    engine = load(model_dir)
    torch.manual_seed(0)
    held = torch.load(run / "data.pt")["heldout"]
    figures = json.loads((model_dir / "card.json").read_text())
    t0 = time.time()
    targets = measure(model_dir, held, perplexity=False)
    if "ar_perplexity" in (figures.get("targets") or {}):  # the weights' figure: the card's still holds
        targets["ar_perplexity"] = figures["targets"]["ar_perplexity"]
    figures.update(speed_cpu=speed(engine, held),
                   speed_cpu_thresholds={str(t): speed(engine, held, threshold=t) for t in SWEEP_THRESHOLDS},
                   samples=samples(engine, SAMPLE_PROMPTS), targets=targets, generation_seconds=time.time() - t0)
    write_text(model_dir / "card.json", json.dumps(figures, indent=2) + "\n")
    write_text(model_dir / "README.md", render(figures, engine.model.config, command))
    return figures


def render_load(sp: dict) -> str:
    """The machine's load average while the speed was measured, when recorded (tokens/s on a
    shared machine are of that load; the diffusion / AR ratio is measured side by side)."""
    load = sp["settings"].get("load_average")
    return f" (load average {load:.1f}: absolute tokens/s are of that load)" if load is not None else ""


def render_targets(f: dict) -> str:
    t = f.get("targets")
    if not t:
        return ""
    defaults = {k: v for k, v in t["settings"].items() if k in GENERATION_SHOWN}
    names = [name for name in ("written", "heldout", "functions") if name in t]
    use = any(t[name].get("argument_use") is not None for name in names)
    rows = "\n".join(f"| {name} ({t[name]['prompts']} prompts) | {t[name]['tokens_per_forward']:.2f} | "
                     f"{t[name]['max_line_repeats']} | {t[name]['looping']} | {t[name]['distinct_first_lines']:.2f} | "
                     f"{t[name]['mean_distance']:.2f} |" + (f" {render_use(t[name])} |" if use else "")
                     for name in names)
    return f"""
## What a newcomer sees (measured by `python -m clover_lab.train.measure --model assets/clover-stdlib`)

Block diffusion with the model's own generation_config.json defaults ({", ".join(f"{k}={v}" for k, v in defaults.items())}),
{NEW_TOKENS} new tokens per prompt. `written`: code prompts of kinds the standard library does not hold
(`def is_prime(n):`, `class RunningAverage: ...`; `clover_lab/train/measure.py`), `heldout`: windows of held-out modules
(the interpreter's standard-library modules that training never saw, picked by a hash of their path){
", `functions`: the heads (signature and docstring) of held-out functions that take arguments" if "functions" in t
else ""}.
A completion loops when a non-blank line occurs more than {LOOP_REPEATS} times; distinctness compares the
completions of different prompts (mean distance: 1 - difflib's similarity ratio, 0 = identical){
"; uses an argument: of the prompts that give arguments (`self` aside), the share of completions that name one"
if use else ""}.

| prompts | tokens per forward | most repeats of a line | looping completions | distinct first lines | mean distance |{
" uses an argument |" if use else ""}
|---|---|---|---|---|---|{"---|" if use else ""}
{rows}{render_prompt_use(t)}{render_perplexity(t)}
"""


def render_use(s: dict) -> str:
    if s.get("argument_use") is None:
        return "-"
    return f"{s['argument_use']:.2f} of {s['argument_prompts']}"


def render_prompt_use(t: dict) -> str:
    """Whether the model follows its prompt, without generating: the prompt gain."""
    g = t.get("prompt_gain")
    empty = (t.get("functions") or {}).get("empty_after_newline")
    newline = ("" if empty is None else
               f"\n\nThe `functions` heads given with a newline after them (as typed with Enter at the end): "
               f"{empty:.0%} get no text\n(`empty_after_newline`: the tokenizer writes a newline and the next "
               f"line's indent as one token, so a\nprompt that ends on a bare newline ends on a token the "
               f"corpus holds only before column 0 or a function's end).")
    if not g:
        return newline
    return newline + (f"\n\nFollowing the prompt, without generating: on {g['functions']} held-out functions, a body's first "
            f"tokens cost {g['own']:.3f} nats each\nafter their own head (signature and docstring) and "
            f"{g['other']:.3f} after another function's: the head is worth {g['gain']:.3f} nats a token\n"
            f"(`clover_lab.train.functions.prompt_gain`; 0: the prompt is ignored).")


def render_perplexity(t: dict) -> str:
    if t.get("ar_perplexity") is None:
        return ""
    return f"\n\nNext-token perplexity there (16 held-out windows of 256 tokens): {t['ar_perplexity']:.1f}.\n"


def render_rounds_section(f: dict) -> str:
    """A run's rounds of self-distillation, each measured like the targets (``train.rounds``)."""
    table = render_rounds(f.get("rounds") or [])
    if not table:
        return ""
    return f"""
## The rounds (each exported to RUN/round-N and measured there by `python -m clover_lab.train.measure`)

The same measurements as above, per round and sampler setting (round-N/measure.json: the round
as exported; round-N/sweep.json: the penalty sweep that chose the shipped defaults). Looping: completions
that repeat a line more than {LOOP_REPEATS} times, of all; perplexity: 16 held-out windows. Each round's settings
(corpus size, steps, learning rate, confidence weight, share): the command under "Reproduce".

{table}"""


GENERATION_SHOWN = ("threshold", "temperature", "repetition_penalty", "presence_penalty", "frequency_penalty")


def render_stage(stage: dict) -> str:
    """One stage after v1, as a bullet of the card."""
    v = stage["version"]
    start = (f"\n- Specimen v{v}: it starts from v{v - 1} (the same architecture, tokenizer and held-out split) "
             f"and adds {stage['steps']} steps")
    if stage.get("continues"):
        start = (f"\n- Specimen v{v}: it continues v{v - 1}'s training run (the same optimizer state, tokenizer and "
                 f"held-out split) for {stage['steps']} more steps")
    if stage["kind"] == "distillation":
        return (f"{start} in {stage['rounds']} rounds of self-distillation\n  (`assets/make_specimen_v2.sh`): each "
                f"round the model's own greedy continuations of training prefixes\n  (`python -m "
                f"clover_lab.train.distill`, continuations that loop dropped) were {stage['share']:.0%} of every "
                f"batch, with the\n  confidence term at weight {stage['confidence_weight']}, so that it learns to be "
                f"sure of whole blocks and unmasks several tokens per pass.")
    if stage["kind"] == "functions":
        heads = ("greedy bodies for such heads\n  (`python -m clover_lab.train.distill --functions`: bodies that loop "
                 "or name none of their head's arguments dropped)")
        bodies, purpose = f"its own {heads}", "to follow its prompt"
        parts = stage.get("distill_parts") or []
        windows = sum(p["rows"] for p in parts if p["prefixes"] == "windows")
        if windows and windows < sum(p["rows"] for p in parts):
            bodies = (f"its own greedy continuations of {windows:,} training windows (`python -m\n  "
                      f"clover_lab.train.distill`: those that loop dropped) and its {sum(p['rows'] for p in parts) - windows:,}"
                      f" {heads},\n  merged (`distill --merge`)")
            purpose = "to be surer of whole blocks of code it has not seen while it follows its prompt"
        distilled = (f"; {stage['distill_share']:.0%} were {bodies},\n  with the confidence term at weight "
                     f"{stage['confidence_weight']}, so that it stays sure of whole blocks"
                     if stage.get("distill_share") else "")
        newlines = (f"; and {stage['split_newlines']:.0%} of the newline+indent tokens were written as the "
                    f"newline and the indent\n  apart (`clover_lab.train.newlines`), as a prompt that ends on a "
                    f"newline tokenizes them, so that such\n  a prompt is continued, not ended"
                    if stage.get("split_newlines") else "")
        return (f"{start} (`assets/make_specimen_v{v}.sh`) {purpose}; in its last schedule\n  "
                f"{stage['share']:.0%} of every batch were rows that start at a function's head, its signature and "
                f"docstring\n  cut out of the training modules and dedented (`clover_lab.train.functions`), then its "
                f"body{distilled}{newlines}.")
    return f"{start}."


def render_distillation(f: dict) -> str:
    d = f.get("distillation")
    if f.get("init"):  # a continuation: each stage after v1
        return "".join(render_stage(stage) for stage in f.get("stages") or stages(f.get("baseline"), f)
                       if stage["version"] > 1)
    if not d:
        return ""
    return (f"\n- Self-distillation from step {d['from_step']} on: {d['share']:.0%} of every batch were the "
            f"model's own greedy continuations\n  of training prefixes (`python -m clover_lab.train.distill`), with "
            f"the confidence term at weight {d['confidence_weight']}, so that\n  it learns to be sure of "
            f"whole blocks and unmasks several tokens per pass.")


def version(f: dict) -> int:
    """The specimen's version: its stage's (v1 a run from scratch)."""
    return (f.get("stages") or stages(f.get("baseline"), f))[-1]["version"]


def run_version(f: dict) -> int:
    """The version whose training run made this model: its own, or the one it continues."""
    done = f.get("stages") or stages(f.get("baseline"), f)
    return next(s["version"] for s in reversed(done) if not s.get("continues"))


def card_command(f: dict) -> str:
    """The card's command line, as the recipe runs it."""
    if not f.get("baseline"):
        return "python -m clover_lab.train.card --run RUN --model assets/clover-stdlib"
    if (f.get("stages") or [{}])[-1].get("continues"):
        return (f"python -m clover_lab.train.card --run RUN --model assets/clover-stdlib --baseline "
                f"RUN/v{version(f) - 1}/card.json --continues")
    return "python -m clover_lab.train.card --run RUN --model assets/clover-stdlib --baseline RUN/init_card.json"


def render_steps(f: dict) -> str:
    """The training steps: a run started from a model (--init) adds its own to the stages before."""
    done = f.get("stages") or stages(f.get("baseline"), f)
    if not f.get("init") or len(done) < 2:
        return f"{f['training_steps']} training steps"
    steps = " + ".join(str(s["steps"]) for s in done)
    versions = " + ".join(f"v{s['version']}" for s in done)
    return f"{steps} = {sum(s['steps'] for s in done)} training steps ({versions})"


def render_baseline(f: dict) -> str:
    b = f.get("baseline")
    if not b:
        return ""
    rows = [("masked-token accuracy, ratio 0.5", lambda x: x["heldout"]["mask_acc@0.5"], ".3f"),
            ("masked-token accuracy, ratio 1.0", lambda x: x["heldout"]["mask_acc@1.0"], ".3f"),
            ("next-token perplexity", lambda x: x["heldout"]["ar_perplexity"], ".1f"),
            ("tokens per forward, threshold 0.9", lambda x: x["speed_cpu"]["diffusion"]["tokens_per_forward"], ".2f"),
            ("diffusion / AR tokens/s, threshold 0.9", lambda x: x["speed_cpu"]["speedup_tokens_per_second"], ".2f")]
    for t in SWEEP_THRESHOLDS:
        if str(t) in b.get("speed_cpu_thresholds", {}):
            rows.append((f"tokens per forward, threshold {t}",
                         lambda x, t=t: x["speed_cpu_thresholds"][str(t)]["diffusion"]["tokens_per_forward"], ".2f"))
    if "targets" in b and "targets" in f:  # train.measure's, each model with its own defaults
        for name, key, fmt in (("tokens per forward", "tokens_per_forward", ".2f"), ("looping completions", "looping", "d"),
                               ("most repeats of a line", "max_line_repeats", "d"),
                               ("distinct first lines", "distinct_first_lines", ".2f")):
            for prompts in ("heldout", "written", "functions"):  # only sets of as many prompts compare
                if (all(prompts in x["targets"] for x in (b, f))
                        and b["targets"][prompts].get("prompts") == f["targets"][prompts].get("prompts")):
                    rows.append((f"{prompts} prompts, {name} (its own defaults)",
                                 lambda x, p=prompts, k=key: x["targets"][p][k], fmt))
        for prompts in ("written", "functions"):
            if all(x["targets"].get(prompts, {}).get("argument_use") is not None for x in (b, f)):
                rows.append((f"{prompts} prompts, completions that use an argument (its own defaults)",
                             lambda x, p=prompts: x["targets"][p]["argument_use"], ".2f"))
        if all("prompt_gain" in x["targets"] for x in (b, f)):
            rows.append(("prompt gain, nats per body token", lambda x: x["targets"]["prompt_gain"]["gain"], ".3f"))
    body = "\n".join(f"| {name} | {get(b):{fmt}} | {get(f):{fmt}} |" for name, get, fmt in rows)
    # a baseline set measured again after its card (e.g. on more prompts) says so under the table
    later = "".join(f"\nIts {name} prompts: {t['remeasured']}." for name, t in (b.get("targets") or {}).items()
                    if isinstance(t, dict) and t.get("remeasured"))
    if f.get("init"):
        v = version(f)
        return (f"\nv{v - 1} (the model this one started from, its card's figures) and v{v} (the same "
                f"measurements):\n\n| figure | v{v - 1} | v{v} |\n|---|---|---|\n{body}\n{later}\n")
    return (f"\nBefore and after the last training stage (the same measurements; before: step "
            f"{b['training_steps']}):\n\n| figure | step {b['training_steps']} | step {f['training_steps']} |\n"
            f"|---|---|---|\n{body}\n")


def render(f: dict, config, command: str) -> str:
    h, sp = f["heldout"], f["speed_cpu"]
    acc = " | ".join(f"{h[f'mask_acc@{r}']:.3f}" for r in (0.25, 0.5, 0.75, 1.0))
    conf = " | ".join(f"{h[f'confident@{r}']:.3f}" for r in (0.25, 0.5, 0.75, 1.0))
    usage = "\n".join(f"| {u['layer']} | {u['entropy_bits']:.2f} / {u['max_bits']:.0f} | {u['max_over_mean_load']:.2f} |"
                      for u in f["expert_usage"])
    sweep = "\n".join(f"| {t} | {x['diffusion']['tokens_per_forward']:.2f} | {x['diffusion']['tokens_per_second']:.1f} | "
                      f"{x['ar']['tokens_per_second']:.1f} |" for t, x in f.get("speed_cpu_thresholds", {}).items())
    samples_md = "\n\n".join(f"Prompt:\n```python\n{s['prompt']}```\nCompletion (tokens per forward "
                             f"{s['tokens_per_forward']:.2f}):\n```python\n{s['completion']}\n```" for s in f["samples"])
    return f"""# clover-stdlib: the embedded default model of clover_lab{f" (specimen v{version(f)})" if f.get("init") else ""}

A {f['parameters'] / 1e6:.1f}M-parameter Clover (block-diffusion Qwen3.5-MoE architecture) trained from scratch
on 2 CPU cores on the Python standard library's own source (the interpreter's stdlib `.py` files, no test
suites, no site-packages). It exists so that clover_lab runs offline on a CPU with a model whose block
unmasking, expert routing and GDN memory show real structure. It is a small code model, not an assistant.

- {config.num_hidden_layers} layers ({config.layer_types.count('linear_attention')} GDN + {config.layer_types.count('full_attention')} gated attention), hidden {config.hidden_size},
  {config.num_experts} experts top-{config.num_experts_per_tok} plus a shared expert, block size {config.block_size},
  byte-level BPE vocabulary of {config.vocab_size} (mask token id {config.mask_token_id}).
- {render_steps(f)} over {f['train_tokens'] / 1e6:.1f}M training tokens;
  held out: {f['heldout_modules']} modules, {f['heldout_tokens'] / 1e3:.0f}k tokens.{render_distillation(f)}

Reproduce (from the repository root):

```bash
{command}
```

## Held-out figures (measured by `{card_command(f)}`)

RUN: the training run the command above makes ({f"`runs/specimen{run_version(f)}`, v{version(f)}'s" if f.get("init") else "`runs/stdlib`"}); every figure is measured on its held-out split.

Masked-token accuracy, each block of 16 masked at exactly the given ratio, previewed against the clean prefix:

| mask ratio | 0.25 | 0.5 | 0.75 | 1.0 |
|---|---|---|---|---|
| accuracy | {acc} |
| share with confidence >= 0.9 | {conf} |

Unigram baseline (always the most frequent token): {f['unigram_baseline_accuracy']:.3f}.
Next-token perplexity (causal, 256-token windows): {h['ar_perplexity']:.1f}.

Generation on {sp['settings']['prompts']} held-out prompts of {sp['settings']['prompt_len']} tokens, {sp['settings']['new_tokens']} new tokens,
threshold {sp['settings']['threshold']}, greedy, {sp['settings']['threads']} CPU threads ({sp['settings']['machine']}), measured side by side{render_load(sp)}:

| mode | tokens per forward | tokens/s |
|---|---|---|
| block diffusion | {sp['diffusion']['tokens_per_forward']:.2f} | {sp['diffusion']['tokens_per_second']:.1f} |
| AR | {sp['ar']['tokens_per_forward']:.2f} | {sp['ar']['tokens_per_second']:.1f} |

Lower thresholds, same prompts (greedy candidates; a lower threshold trades some agreement with
the threshold-0.9 output for fewer forwards):

| threshold | diffusion tokens per forward | diffusion tokens/s | AR tokens/s |
|---|---|---|---|
{sweep}
{render_baseline(f)}{render_targets(f)}{render_rounds_section(f)}
Expert usage on held-out text (entropy of the routed-slot distribution; uniform = max):

| layer | entropy (bits) | max / mean load |
|---|---|---|
{usage}

![loss curve](loss_curve.png)

## Unedited samples (greedy block diffusion, threshold 0.9)

{samples_md}
"""


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m clover_lab.train.card", description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="the training run directory")
    ap.add_argument("--model", required=True, help="the exported model directory")
    ap.add_argument("--command", default="bash assets/make_default_model.sh", help="the command that reproduces it")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--baseline", help="an earlier card.json to set the figures beside")
    ap.add_argument("--continues", action="store_true",
                    help="the baseline is the card of an earlier export of this same run: this version is the "
                         "steps since (a recipe that continues the run, e.g. make_specimen_v4.sh)")
    ap.add_argument("--generation-only", action="store_true",
                    help="re-measure only what depends on generation_config.json (speed, samples, targets), "
                         "keeping the model's other figures from its card.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.generation_only:
        figures = remeasure_generation(Path(args.run), Path(args.model), args.command)
        print(json.dumps({k: figures[k] for k in ("speed_cpu", "generation_seconds")}, indent=2))
        return
    if args.continues and not args.baseline:
        ap.error("--continues: give --baseline, the card of the earlier export of this run")
    figures = write_card(Path(args.run), Path(args.model), args.command,
                         Path(args.baseline) if args.baseline else None, args.continues)
    print(json.dumps({k: v for k, v in figures.items() if k not in ("samples", "baseline")}, indent=2))


if __name__ == "__main__":
    main()
