"""Kernels per layer of the engine's static steps, counted on any device (issue 26).

The embedded default model (fp32), the runner's static steps (``StepGraphs`` without capture: the
forward a CUDA graph would record), no hooks, the dispatch's Triton kernels (on a CPU:
the Triton backend forced (``dispatch.use_backend("triton")``) under ``TRITON_INTERPRET=1``, set
before triton is imported). Each step shape is counted by
``clover_kernels.launches.LaunchCounter`` (Triton launches plus aten ops that do work) at two
committed lengths: the counts, the host syncs and whether the op sequence stayed the same.

    python bench/step_launches.py [--json FILE]      (sets the two variables itself)

bench/bench_kernels.py --count prints the same table; tests/kernels/test_step_launches.py holds
the counts under a budget.
"""
from __future__ import annotations

import argparse
import datetime as dt
import functools
import os
import platform
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # result_file.py, when a test imports this (last: shadows nothing)
from result_file import write_json  # noqa: E402

SHAPES = ("AR", "preview", "fused", "preview, coreset record", "preview, coreset use")


def load_model(device: str = "cpu"):
    import torch

    from clover_lab import CloverModel
    from clover_lab.checkpoint.loading import default_model_dir

    return CloverModel.from_pretrained(default_model_dir(), dtype=torch.float32).to(device)


def count_static_steps(model, lengths=(21, 46), max_len: int = 256, coreset_size: int = 4,
                       outputs: dict | None = None) -> dict:
    """shape -> dict(kernels, per_layer, triton, by_name, syncs, same_sequence) at the first of
    ``lengths``; the others only check that the op sequence does not change with the length.
    Prefills and a coreset's recording for the routing previews run on the torch path (quick in
    the interpreter's runs); the counted step through the dispatch as the caller set it.
    ``outputs``: filled with shape -> (commit logits, preview logits, the coreset after the step)
    of the counted step at the first length (tests compare the kernels' with the torch path's)."""
    import torch

    from clover_kernels.launches import LaunchCounter
    from clover_lab.engine.graphs import StepGraphs

    cfg, dev = model.config, model.device
    B, mask, layers = cfg.block_size, cfg.mask_token_id, cfg.num_hidden_layers
    graphs = StepGraphs(model, max_len, capture=False)
    block = torch.full((1, B), mask, device=dev)
    block[0, ::3] = 7
    commit = torch.arange(5, 5 + B, device=dev)[None]
    out = {}
    for shape in SHAPES:
        core = graphs.coreset(coreset_size) if "coreset" in shape else None
        c, m, logits = {"AR": (1, 0, True), "fused": (B, B, False)}.get(shape, (0, B, False))
        ids = {"AR": commit[:, :1], "fused": torch.cat([commit, block], 1)}.get(shape, block)
        runs = []
        for n in lengths:
            graphs.reset()
            with torch_path():
                model.prefill(graphs.cache, torch.arange(2, 2 + n, device=dev)[None], logits=None)
                if core is not None:  # records the coreset (a routing preview uses it; a recording one
                    core.reset()      # finds its buffers made, as every block after the first does)
                    graphs.step(block, 0, B, coreset=core)
                    if shape.endswith("record"):
                        core.reset()
            with LaunchCounter() as count:
                result = graphs.step(ids, c, m, commit_logits=logits, coreset=core)
            if outputs is not None and not runs:
                outputs[shape] = (*result, None if core is None else {k: v.clone() for k, v in core.experts.items()})
            runs.append(count)
        first = runs[0]
        out[shape] = dict(kernels=first.kernels, per_layer=first.kernels / layers, triton=first.triton,
                          by_name=dict(first.by_name.most_common()), syncs=sorted({s for r in runs for s in r.syncs}),
                          same_sequence=all(r.sequence == first.sequence for r in runs[1:]), lengths=list(lengths))
    return out


def count_sampler_steps(engine, prompt: str = "def fibonacci(n):\n", new_tokens: int = 32) -> dict:
    """mode -> kernels and host syncs of the decoding work between two forwards, per step: the
    policy's decision, the sampler (penalties, temperature, top-k/p as the model's generation
    defaults set them), the canvas update and the one host transfer. Block diffusion: each row's
    step, ``diffusion.decide`` and ``diffusion.take`` together; AR: each row's ``sampling.decide``.
    The model's forwards are not
    in these counts (``count_static_steps`` has them). ``syncs``: the ops the dispatcher sees force
    one; the step's one host transfer (``.tolist()`` of the decision) reads a CPU tensor's memory
    without an aten op, so it is not among them on a CPU."""
    from clover_kernels.launches import LaunchCounter
    from clover_lab.engine import diffusion, sampling

    out = {}
    for mode, module, names in (("diffusion", diffusion, ("decide", "take")), ("ar", sampling, ("decide",))):
        originals, parts = {name: getattr(module, name) for name in names}, {name: [] for name in names}

        def counted(*args, _original, _calls, **kwargs):
            with LaunchCounter() as count:
                result = _original(*args, **kwargs)
            _calls.append(count)
            return result

        for name in names:
            setattr(module, name, functools.partial(counted, _original=originals[name], _calls=parts[name]))
        try:
            engine.generate(prompt, max_new_tokens=new_tokens, mode=mode)
        finally:
            for name, original in originals.items():
                setattr(module, name, original)
        calls = [merged(counts) for counts in zip(*parts.values())]  # one prompt: a row's step's halves pair up
        kernels = [c.kernels for c in calls]
        by_name = sum((c.by_name for c in calls), start=type(calls[0].by_name)())
        out[mode] = dict(steps=len(calls), kernels_per_step=sum(kernels) / len(calls), max_kernels=max(kernels),
                         syncs=sorted({x for c in calls for x in c.syncs}), by_name={k: v / len(calls) for k, v in by_name.most_common()})
    return out


def merged(counts):
    """Several LaunchCounters' counts as one (a step counted in halves)."""
    out = counts[0]
    for c in counts[1:]:
        out.by_name.update(c.by_name)
        out.syncs += c.syncs
        out.sequence += c.sequence
    return out


def torch_path():
    """The torch backend meanwhile (the set-up of a count, not what is counted)."""
    from clover_kernels import dispatch

    return dispatch.use_backend("torch")


def print_table(counts: dict, layers: int, file=sys.stdout) -> None:
    head = f"{'step':<26} {'kernels':>8} {'per layer':>10} {'triton':>7} {'syncs':>6}  same ops at every length"
    print(head + "\n" + "-" * len(head), file=file)
    for shape, r in counts.items():
        print(f"{shape:<26} {r['kernels']:>8} {r['per_layer']:>10.1f} {r['triton']:>7} {len(r['syncs']):>6}  "
              f"{r['same_sequence']}", file=file)
    print(f"({layers} layers; most launched: "
          + ", ".join(f"{k} {v}" for k, v in list(counts['AR']['by_name'].items())[:8]) + " in AR)", file=file)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the counts here")
    args = p.parse_args(argv)
    import torch

    from clover_kernels import dispatch

    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    model = load_model("cpu" if on_cpu else "cuda")
    with dispatch.use_backend("triton" if on_cpu else dispatch.forced_backend()):
        counts = count_static_steps(model)
    layers = model.config.num_hidden_layers
    print_table(counts, layers)
    from clover_lab import load

    with torch_path():  # the forwards between the counted steps need not run in the interpreter
        sampler = count_sampler_steps(load(device=str(model.device), dtype=torch.float32))
    for mode, r in sampler.items():
        print(f"decoding work per step outside the forward, {mode}: {r['kernels_per_step']:.1f} kernels "
              f"(at most {r['max_kernels']}); at 40 layers "
              f"{r['kernels_per_step'] / 40:.2f} per layer")
    if args.json:
        write_json(args.json, dict(
            benchmark="step_launches", date=dt.datetime.now().isoformat(timespec="seconds"), device=str(model.device),
            kernels_backend="triton" if on_cpu else dispatch.forced_backend(), interpret=os.environ.get("TRITON_INTERPRET") == "1",
            torch=torch.__version__, python=platform.python_version(), layers=layers, steps=counts,
            decoding=sampler))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
