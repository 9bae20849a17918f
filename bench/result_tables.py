"""Benchmark tables rendered from their results files (bench/results/*.json), so that a figure the
documentation shows has one source: the JSON a benchmark script wrote. The documentation site's build
(docs/hooks/site.py) puts ``render(file)`` where a page says ``{{ bench_table("FILE") }}``, and
``index()`` lists every results file with its rows; the scripts that print a table the site shows
print it through the same function (bench/placement_table.py: ``placement``).

Standard library only: the site builds without torch."""
from __future__ import annotations

import json
import math
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


class TableError(ValueError):
    """A table asked for that no results file or renderer gives: the site's build stops on it."""


def load(name: str) -> dict:
    path = RESULTS / name
    if path.suffix != ".json" or path.parent != RESULTS:
        raise TableError(f"{name!r}: name a results file of bench/results/, such as 'serve-...-cpu-20261203-072555.json'")
    if not path.is_file():
        raise TableError(f"bench/results/{name}: no such results file")
    return json.loads(path.read_text())


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def yes(flag) -> str:
    return "yes" if flag else "no"


def batch(doc: dict) -> str:
    """bench_batch.py: eager batches against batch 1, or (``--compiled``) compiled against eager."""
    mode = {"diffusion": "diffusion", "ar": "AR"}
    rows = doc["rows"]
    if "compiled_tokens_per_second" in rows[0]:
        return table(["mode", "batch", "eager tokens/s", "compiled tokens/s", "compiled vs eager",
                      "compiled gives the eager batch's tokens"],
                     [[mode[r["mode"]], r["batch_size"], f"{r['tokens_per_second']:.1f}",
                       f"{r['compiled_tokens_per_second']:.1f}", f"{r['compiled_ratio']:.2f}x",
                       yes(r["compiled_same_tokens"])] for r in rows])
    return table(["mode", "batch", "tokens/s", "vs batch 1", "forwards", "same tokens as batch 1"],
                 [[mode[r["mode"]], r["batch_size"], f"{r['tokens_per_second']:.1f}", f"{r['ratio']:.2f}x",
                   r["forwards"], yes(r["same_tokens"])] for r in rows])


def policies(doc: dict) -> str:
    """bench_policies.py: each decoding rule against AR greedy."""
    ar = next(r for r in doc["rows"] if r["policy"] == "ar")["tokens_per_second"]
    return table(["policy", "tokens per forward", "tokens/s", "vs AR", "continuations equal to AR",
                  "edits per token vs AR", "accepted drafted tokens per block"],
                 [[r["policy"], f"{r['tokens_per_forward']:.2f}", f"{r['tokens_per_second']:.1f}",
                   f"{r['tokens_per_second'] / ar:.2f}x", f"{r['exact_match']:.2f}", f"{r['edit_distance']:.3f}",
                   f"{r['mean_accepted']:.2f}" if "mean_accepted" in r else ""] for r in doc["rows"]])


def serve(doc: dict) -> str:
    """bench_serve.py's first table: throughput and latency by concurrency (its format)."""
    rows = doc["rows"]
    base = rows[0]["tokens_per_second"]
    out = []
    for r in rows:
        per_token = " / ".join("-" if x is None else f"{x * 1000:.0f}" for x in (r["per_token_median"], r["per_token_p90"]))
        out.append([r["concurrency"], r["requests"], f"{r['tokens_per_second']:.1f}",
                    f"{r['tokens_per_second'] / base:.2f}x", f"{r['ttft_median']:.2f} / {r['ttft_p90']:.2f}",
                    per_token, yes(r["same_text_as_alone"])])
    return table(["concurrency", "requests", "tokens/s", "vs 1", "first token median / p90 (s)",
                  "per token median / p90 (ms)", "same text as alone"], out)


def serve_lengths(doc: dict) -> str:
    """bench_serve.py's second table: requests that differ in max_tokens against identical ones."""
    out = []
    for name in ("identical", "differing"):
        r = doc["lengths"][name]
        rounds = ", ".join(f"{run['tokens_per_second']:.1f}" for run in r["runs"])
        forwards = sorted({run["forwards"] for run in r["runs"]})
        out.append([name, ", ".join(str(t) for t in r["max_tokens"]), f"{r['tokens_per_second']:.1f} (rounds {rounds})",
                    "-".join(str(f) for f in (forwards[0], forwards[-1]) if f is not None) if len(forwards) > 1
                    else forwards[0], f"{r['tokens_per_forward']:.2f}", f"{r['seconds_per_forward'] * 1000:.0f}",
                    f"{r['request_p99']:.2f}"])
    return table(["requests", "max_tokens", f"tokens/s (median of {len(doc['lengths']['identical']['runs'])} rounds)",
                  "forwards (each round)", "tokens per forward", "ms per forward", "p99 request seconds"], out)


def grammar(doc: dict) -> str:
    """bench_grammar.py: tokens per forward under each grammar, and how many outputs validate."""
    out = []
    for r in doc["rows"]:
        valid = "" if r.get("valid") is None else f"{r['valid']}/{r['outputs']}"
        out.append([r["grammar"], f"{r['tokens_per_forward']:.2f}", f"{r.get('ratio_to_unconstrained', 1.0):.2f}x", valid])
    return table(["grammar", "tokens per forward", "vs unconstrained", "valid"], out)


def coreset(doc: dict) -> str:
    """bench_coreset.py: a coreset's size against the tokens it keeps and its tokens per forward."""
    return table(["coreset", "tokens equal to no coreset", "tokens per forward", "ms per step"],
                 [["none" if r["coreset_size"] is None else r["coreset_size"], f"{r['tokens_equal']:.3f}",
                   f"{r['tokens_per_forward']:.2f}", f"{r['seconds_per_step'] * 1000:.1f}"] for r in doc["rows"]])


def placement_row(r: dict) -> str:
    host = f"{r['offloaded_layers']} layers, {r['host_gib']:.1f} GiB" if r["offloaded_layers"] else "none"
    per = " + ".join(f"{v:.1f}" for v in r["per_gpu_gib"].values())
    return (f"| {r['gpus']} | {r['dtype']} ({r['weights_gib']:.1f} GiB) | {yes(r['fits'])} | {per} | "
            f"{host} | `{r['command']}` |")


def placement(doc: dict) -> str:
    """placement_table.py: which GPU sets hold the 35B model, and the command for each."""
    return ("| GPUs | weights | fits on the GPUs | on the GPUs (GiB) | experts in host memory | command |\n"
            "|---|---|---|---|---|---|\n" + "".join(placement_row(r) + "\n" for r in doc["rows"]))


def roofline(doc: dict) -> str:
    """roofline.py: the 35B model's step shapes against the H200's roofline and the launch floor;
    tokens/s from the longer of the two (a preview of 32 rows at 1 / 2 / 3.5 tokens per forward)."""
    out = []
    for s in doc["steps"]:
        if s["commit_rows"] and not s["preview_rows"] and s["committed_length"] == 0:  # a prefill
            rate = f"{s['commit_rows'] / s['step_ms'] * 1000:,.0f} prefill"
        elif s["preview_rows"]:
            rate = " / ".join(f"{tpf / s['step_ms'] * 1000:.0f}" for tpf in (1, 2, 3.5))
        else:
            rate = f"{1000 / s['step_ms']:.0f} / - / -"
        out.append([s["step"], f"{s['experts_per_layer']:.1f}", f"{s['weight_bytes'] / 1e9:.2f}",
                    f"{s['cache_bytes'] / 1e9:.3f}", f"{s['flops'] / 1e9:,.0f}", f"{s['roofline_ms']:.2f}",
                    f"{s['launch_ms']:.2f}" if s["kernels_per_layer"] else "-", s["bound"], rate])
    return table(["step", "experts/layer", "weights GB", "cache GB", "GFLOP", "roofline ms", "launch ms", "bound",
                  "tok/s at 1 / 2 / 3.5 tokens per forward"], out)


def offload(doc: dict) -> str:
    """bench_offload.py: experts staged from host memory, per layer and forward, with the prefetch
    (and, in brackets, without it where that differs)."""
    out = []
    pairs = {}
    for r in doc["rows"]:
        pairs.setdefault((r["mode"], r["coreset"]), {})[r["prefetch"]] = r
    for (mode, coreset), by in pairs.items():
        on, off = by[True], by.get(False)
        differs = off is not None and (round(off["experts_per_layer_forward"], 2) != round(on["experts_per_layer_forward"], 2))

        def without(key, fmt):
            return f" ({fmt.format(off[key])} without{' prefetch' if key == 'experts_per_layer_forward' else ''})" if differs else ""
        name = {"diffusion": "block diffusion", "ar": "AR"}[mode] + (
            "" if mode == "ar" else (", no coreset" if coreset is None else f", coreset {coreset}"))
        experts = f"{on['experts_per_layer_forward']:.2f}" if on["experts_per_layer_forward"] < 1 or mode == "ar" \
            else f"{on['experts_per_layer_forward']:.1f} of {doc['experts']}"
        experts += without("experts_per_layer_forward", "{:.2f}" if mode == "ar" else "{:.1f}")
        used = "none prefetched" if not on["prefetched_experts"] else f"{on['prefetch_used_share']:.0%}"
        out.append([name, experts, f"{on['copies_per_layer_forward']:.2f} ({on['former_copies_per_layer_forward']:.1f})",
                    f"{on['kib_per_layer_forward']:,.0f}" + without("kib_per_layer_forward", "{:,.0f}"), used])
    return table(["mode", "experts copied per layer and forward",
                  "copies per layer and forward (before: one per expert and tensor)", "KiB per layer and forward",
                  "prefetched experts used"], out)


def sae(*docs: dict) -> str:
    """bench_sae.py: the autoencoder's training and held-out figures, one column per results file."""
    def column(f):
        return [f"{f['training rows']:,}, {f['masked share']:.1%} masked; collected in {f['collect s']:.0f} s",
                f"{f['train steps']} steps ({f['rows seen'] / 1e6:.2f}M rows seen); {f['dead features']:.0f} dead features",
                f"**{f['FVU']:.3f}** of {f['held-out rows']:,} (masked rows {f['FVU masked']:.3f}, "
                f"unmasked {f['FVU unmasked']:.3f})",
                f"{f['loss clean']:.3f} ({f['masked positions']:,} (step, position) pairs)",
                f"{f['loss spliced']:.3f} (**{f['loss delta']:+.3f}**)",
                f"{f['loss mean-ablated']:.3f}: the reconstruction avoids {f['recovered']:.1%} of that increase"]
    names = ["training rows (preview rows of the training generations)", "training",
             "FVU on the held-out generations' preview rows", "masked-token loss, clean (nats per masked position)",
             "... with the reconstruction in place of every preview row", "... with the rows' mean in place (layer ablated)"]
    # the figures rounded to 4 places, but the loss change at full precision (0.0775 is 0.07754...)
    columns = [column({**d["figures"], "loss delta": d["report"]["delta"]}) for d in docs]
    return table(["figure"] + [d["run"]["date"][:10] for d in docs], [[n] + [c[i] for c in columns] for i, n in enumerate(names)])


def compare_transformers(*docs: dict) -> str:
    """compare_transformers.py: clover_lab against transformers on one random checkpoint, the rows of
    every results file given, in order; the GEMM bound is transformers' time over the bare matrix
    products alone (plain / packed weights)."""
    def rate(v):
        return f"{v:.0f}" if v >= 100 else f"{v:.1f}"
    out, named = [], set()
    for doc in docs:
        for r in doc["rows"]:
            pre, dec = r["prefill_tok_s"], r["ar_decode_tok_s"]
            size = r["size"] if r["size"] in named else f"{r['size']} ({r['params'] / 1e6:.0f}M)"
            named.add(r["size"])
            dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(r["dtype"], r["dtype"])
            bound = (f"{r['prefill_floor_tok_s'] / pre['transformers']:.2f} / "
                     f"{r['prefill_floor_packed_tok_s'] / pre['transformers']:.2f}") if "prefill_floor_tok_s" in r else "-"
            out.append([f"{size}, {dtype}, {r['prompt']}", f"{pre['transformers']:.0f}", f"{pre['clover_lab']:.0f}",
                        f"{pre['clover_lab'] / pre['transformers']:.2f}",
                        f"{pre['clover_lab_packed'] / pre['transformers']:.2f}", bound, rate(dec["transformers"]),
                        rate(dec["clover_lab"]), f"{dec['clover_lab'] / dec['transformers']:.2f}",
                        rate(dec["clover_lab_compiled"]), f"**{dec['clover_lab_compiled'] / dec['transformers']:.2f}**"])
    return table(["size, dtype, prompt", "prefill tok/s transformers", "clover_lab", "ratio", "packed", "GEMM bound",
                  "AR decode tok/s transformers", "clover_lab", "ratio", "compiled", "ratio"], out)


def adapt(*docs: dict) -> str:
    """adapt_figures.py: held-out figures of the AR-only start, of each run given after its steps,
    and of the shipped embedded model the runs set out to match (the reference)."""
    def speed(m, threshold):
        s = m["speed"].get(threshold)
        return f"{s['diffusion']['tokens_per_forward']:.2f}" if s else "-"

    def figures(m):
        h = m["heldout"]
        return ([speed(m, "0.9"), speed(m, "0.5")] + [f"{h[f'mask_acc@{r}']:.3f}" for r in ("0.25", "0.5", "0.75", "1.0")]
                + [f"{h['ar_perplexity']:.2f}"])
    reference = next((d["models"]["reference"] for d in docs if "reference" in d["models"]), None)
    columns = [("AR-only start", figures(docs[0]["models"]["before"]))]
    for d in docs:
        # no time in the label: train_seconds counts the last resumed stretch of a run only
        columns.append((f"`{d['run']['adapt']['train']}`, {d['run']['steps']} steps", figures(d["models"]["after"])))
    if reference is not None:
        columns.append((f"{reference['model']}, as shipped then", figures(reference)))
    names = ["tokens per forward, threshold 0.9", "tokens per forward, threshold 0.5"] + [
        f"masked-token accuracy, ratio {r}" for r in ("0.25", "0.5", "0.75", "1.0")] + ["AR perplexity (256-token windows)"]
    return table(["held-out figure"] + [c[0] for c in columns], [[n] + [c[1][i] for c in columns] for i, n in enumerate(names)])


def measured(columns: list[tuple[str, dict]]) -> list[list[str]]:
    """Rows of ``python -m clover_lab.train.measure``'s figures, one column per (label, figures)."""
    sets = ("written", "heldout", "functions")

    def per_set(f, key, fmt, which=sets):
        return " / ".join("-" if f[s].get(key) is None else fmt.format(f[s][key]) for s in which)
    rows = [("tokens per forward at 0.9: written / held-out windows / held-out function heads",
             lambda f: per_set(f, "tokens_per_forward", "{:.2f}")),
            ("looping completions: written / windows / heads", lambda f: per_set(f, "looping", "{}")),
            ("distinct first lines: written / windows / heads", lambda f: per_set(f, "distinct_first_lines", "{:.2f}")),
            ("completions that name an argument: written / heads",
             lambda f: per_set(f, "argument_use", "{:.2f}", ("written", "functions"))),
            ("prompt gain (nats per body token, 128 held-out functions)", lambda f: f"{f['prompt_gain']['gain']:.3f}"),
            ("next-token perplexity (16 held-out windows)", lambda f: f"{f['ar_perplexity']:.1f}")]
    return [[name] + [fn(f) for _, f in columns] for name, fn in rows]


def specimen(doc: dict) -> str:
    """The specimen's training rounds, each measured by clover_lab.train.measure: v2 and the rounds of
    v3 (specimen-prompt-following-*), or the rounds of v4 (specimen-v4-rounds-*)."""
    if "rounds" in doc:  # v4: rounds 6-9 at repetition_penalty 1.3, and round 9 at its exported 1.5 (v4)
        rounds = doc["rounds"]
        columns = [(f"round {r['round']}", r["figures_rp1.3"]) for r in rounds]
        columns.append((f"v4 (round {rounds[-1]['round']} at 1.5)", rounds[-1]["figures_rp1.5"]))
        setup = [["starts from"] + [r["from"] for r in rounds] + [""],
                 ["corpus (bodies + window continuations)"] + [r["corpus"] for r in rounds] + [""],
                 ["corpus share / head rows / confidence weight"] + [
                     f"{r['distill_share']:.0%} / {r['functions_share']:.0%} / {r['confidence_weight']:.1f}" for r in rounds] + [""]]
        return table(["figure"] + [c[0] for c in columns], setup + measured(columns))
    labels = {"v2": "v2", "v3_attempt": "round 1", "v3_attempt_round2": "round 2", "v3_attempt_round3": "round 3",
              "v3_attempt_round4": "round 4", "v3": "v3 (round 5)"}
    columns = [(label, doc[key]) for key, label in labels.items()]
    return table(["figure"] + [c[0] for c in columns], measured(columns))


# results file name prefix -> renderer (the longest prefix that matches wins)
RENDERERS = {"batch-default-model-": batch, "policies-": policies, "serve-": serve, "serve-lengths": serve_lengths,
             "grammar-": grammar, "coreset-": coreset, "placement-35b-": placement,
             "roofline-": roofline, "offload-": offload, "sae-": sae,
             "compare_transformers-": compare_transformers, "adapt-small-": adapt,
             "specimen-prompt-following-": specimen, "specimen-v4-rounds-": specimen}
# renderers that set several results files side by side, one column each
SIDE_BY_SIDE = {"sae-", "compare_transformers-", "adapt-small-"}
PARTS = {("serve-", "lengths"): serve_lengths}


def render(name: str, *more: str) -> str:
    """The table of results file ``name`` (a file name in bench/results/). ``more``: either the part
    to render of a file that holds several tables (serve: ``"lengths"``), or, for a benchmark in
    ``SIDE_BY_SIDE``, more results files to set beside it as columns."""
    doc = load(name)
    if more and not more[0].endswith(".json"):
        (part,) = more
        for (prefix, p), fn in PARTS.items():
            if name.startswith(prefix) and p == part:
                return fn(doc)
        raise TableError(f"bench/results/{name}: no table part {part!r}")
    prefixes = sorted((p for p in RENDERERS if name.startswith(p)), key=len, reverse=True)
    if not prefixes:
        raise TableError(f"bench/results/{name}: no renderer for it in bench/result_tables.py (RENDERERS)")
    if more:
        if prefixes[0] not in SIDE_BY_SIDE or not all(m.startswith(prefixes[0]) for m in more):
            raise TableError(f"bench/results/{name}: its table sets no other results file beside it ({', '.join(more)})")
        return RENDERERS[prefixes[0]](doc, *(load(m) for m in more))
    return RENDERERS[prefixes[0]](doc)


def latest(prefix: str) -> str:
    """The newest results file whose name starts with ``prefix`` (names end in their date)."""
    names = sorted(p.name for p in RESULTS.glob(prefix + "*.json"))
    if not names:
        raise TableError(f"bench/results/: no results file named {prefix}*.json")
    return names[-1]


def cell(value) -> str:
    if isinstance(value, bool):
        return yes(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4g}"
    if value is None:
        return "-"
    return str(value).replace("|", "\\|").replace("\n", " ")


def rows_table(rows: list[dict]) -> str:
    columns = []
    for r in rows:
        columns += [k for k, v in r.items() if k not in columns and not isinstance(v, (list, dict))]
    return table(columns, [[cell(r.get(c)) for c in columns] for r in rows])


def index() -> str:
    """Every results file, newest first within each benchmark: what ran where, and its rows (each
    top-level list of records, its scalar fields as columns)."""
    out = []
    for path in sorted(RESULTS.glob("*.json"), key=lambda p: p.name):
        doc = json.loads(path.read_text())
        where = ", ".join(f"{k} {doc[k]}" for k in ("date", "device_name", "torch", "threads") if k in doc)
        settings = doc.get("args") or doc.get("settings") or {}
        said = ", ".join(f"{k}={v}" for k, v in settings.items() if k not in ("out",) and not isinstance(v, dict))
        out.append(f"### {path.stem}\n")
        out.append(f"`bench/results/{path.name}`" + (f": {where}" if where else "") + "\n")
        if said:
            out.append(f"Settings: `{said}`\n")
        tables = [(k, v) for k, v in doc.items() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)]
        for key, rows in tables:
            out.append(f"{key}:\n\n" + rows_table(rows))
        if not tables:
            scalars = {k: v for k, v in doc.items() if not isinstance(v, (list, dict))}
            if scalars:
                out.append(table(["field", "value"], [[k, cell(v)] for k, v in scalars.items()]))
    return "\n".join(out)
