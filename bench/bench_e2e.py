"""End-to-end step times of Clover at batch 1 against the HBM weight-bytes roofline (issue 5).

A random model (full size, bf16 on the GPU by default) prefills a random prompt into a cache;
each step is then timed (warm-up first, median of --repeat calls between CUDA events, the cache
restored outside them):
  preview, all masked  a block's first preview: --block mask tokens, logits at every position
  preview              a later preview: --unmasked positions hold tokens, logits at the masked ones;
                       also with a no-op hook on every ``layers.*.moe.route`` (hook overhead), with
                       the torch backend (torch references, not Triton) and restricted to an expert
                       coreset (recorded by an untimed all-masked first preview, as in generation)
  commit+preview       the fused forward: commit --block tokens, first preview of the next block
  AR step              commit 1 token, logits of the last
  [CUDA graph]         preview (also with the coreset), commit+preview and AR step again through
                       clover_lab.engine.runner.StepGraphs:
                       the no-hook fast path the engine takes on CUDA, one graph replay per step
                       (on a CPU the same static-shape steps run eagerly); each such row says
                       whether its graph was captured (graph_captured, graph_error): a failed
                       capture relabels the row "static eager (capture failed)" and the script
                       exits 1
  [batch N]            preview and AR step over N rows at different committed lengths (prompts
                       of --prompt-len down to half of it, as engine.generate([...]) keeps them;
                       eager, logits at every block position); tokens/s counts every row
Roofline: the bytes a step must move, / 4.8e12 B/s (H200 HBM): every non-expert weight (the LM
head whole when logits are computed, embedding rows as gathered), 3 * H * I * dtype bytes per
*distinct* routed expert per MoE layer (counted by a route hook in a separate untimed run), the
K,V rows of the prefix, GDN states and rings, and what a commit writes; activations left out.
Previews also get tokens/s at an assumed --tpf tokens per forward (tpf / preview time). Random
weights send a block of identical mask tokens to few experts: the later preview is the
representative one. Prints a table; writes JSON to --out (date and device in name and content).

    python bench/bench_e2e.py [--preset clover-35b-a3b] [--device cuda] [--dtype bfloat16] [--out DIR]
    python bench/bench_e2e.py --preset clover-tiny --device cpu --dtype float32   # CPU smoke run

--init device (default): allocated in --dtype on the device, routed experts (93% of the full-size
weights) drawn there by the device RNG, the rest by init_weights (CloverModel.random's
distributions); --init seeded: CloverModel.random itself (minutes of CPU RNG at full size, and
an fp32 copy of the whole model on the device before the cast).
"""
from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import sys
import time
import warnings
from collections import defaultdict

import torch
from result_file import RESULTS, result_path, slug, write_json

from clover_kernels import dispatch
from clover_lab.config import CloverConfig
from clover_lab.engine.graphs import StepGraphs
from clover_lab.model.decoder import CloverModel, Coreset

HBM_BYTES_PER_S = 4.8e12  # H200
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="clover-35b-a3b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--repeat", type=int, default=20, help="timed calls per step (median reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--block", type=int, default=32, help="preview block length")
    p.add_argument("--unmasked", type=int, default=16, help="block positions already unmasked in 'preview'")
    p.add_argument("--coreset", type=int, default=64, help="expert coreset size of the restricted previews")
    p.add_argument("--tpf", type=float, default=3.5, help="assumed tokens per forward for tokens/s")
    p.add_argument("--batch", type=int, default=16, help="rows of the batched steps (below 2: none)")
    p.add_argument("--init", default="device", choices=("device", "seeded"))
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads on the CPU")
    p.add_argument("--out", default=str(RESULTS), help="folder for the JSON")
    return p.parse_args(argv)


def build_model(config: CloverConfig, device, dtype, init: str, seed: int = 0) -> CloverModel:
    if init == "seeded":
        return CloverModel.random(config, device=device, dtype=dtype, seed=seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters born in the target dtype: no fp32 copy of the model
    try:
        with torch.device("meta"):
            model = CloverModel(config)
    finally:
        torch.set_default_dtype(default)
    model = model.to_empty(device=device).to(dtype)
    experts = [(layer.mlp.experts, leaf) for layer in model.model.layers for leaf in ("gate_up_proj", "down_proj")]
    held = [getattr(module, leaf) for module, leaf in experts]
    for module, leaf in experts:  # hidden from init_weights, which draws on the CPU
        setattr(module, leaf, None)
    model.init_weights(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for (module, leaf), param in zip(experts, held):
            param.normal_(0.0, config.initializer_range, generator=gen)
            setattr(module, leaf, param)
    return model.eval()


def timed(fn, args, before=None) -> list[float]:
    """Seconds per call of ``fn``; ``before`` (e.g. restoring the cache) runs outside the timing."""
    cuda = torch.device(args.device).type == "cuda"
    times = []
    for i in range(args.warmup + args.repeat):
        if before is not None:
            before()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            t = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(t)
    return times


def experts_hit(model: CloverModel, fn) -> list[int]:
    """Distinct routed experts per MoE layer in one (untimed) call of ``fn``, over all its parts."""
    ids = defaultdict(list)
    with model.hooks.scoped({"layers.*.moe.route": lambda ev: ids[ev.layer].append(ev.expert_ids.reshape(-1))}):
        fn()
    return [int(torch.cat(ids[i]).unique().numel()) for i in sorted(ids)]


def roofline_bytes(model: CloverModel, n: float, c: int, m: int, logits: bool, hit: list[int], batch: int = 1) -> dict:
    """Bytes a forward of c committed + m previewed rows at committed length n must move at least
    (``batch`` rows of them: n their mean length)."""
    cfg, es = model.config, model.dtype.itemsize
    H, I, V = cfg.hidden_size, cfg.moe_intermediate_size, cfg.vocab_size
    skip = ("experts.gate_up_proj", "experts.down_proj", "embed_tokens.weight", "lm_head.weight")
    dense = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if not name.endswith(skip))
    attn, gdn = len(cfg.attention_layers()), len(cfg.gdn_layers())
    kv_row = 2 * cfg.num_key_value_heads * cfg.head_dim * es  # K and V of one position, one layer
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4  # fp32 S
    ring = cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * es
    return dict(
        dense_weights=dense,
        embedding_rows=batch * (c + m) * H * es,
        lm_head=V * H * es if logits else 0,
        experts=sum(hit) * 3 * H * I * es,
        kv_cache_read=int(batch * attn * (n + c) * kv_row),
        gdn_state_read=batch * gdn * (state + ring),
        cache_write=batch * (attn * c * kv_row + gdn * (state + ring)) if c else 0,
    )


def batch_rows(model: CloverModel, args, prompt, later, token, max_len: int, write) -> list[dict]:
    """The preview and the AR step over ``args.batch`` rows at different committed lengths."""
    N, B = args.batch, later.shape[1]
    lengths = [args.prompt_len - (args.prompt_len // (2 * N)) * r for r in range(N)]
    cache = model.new_cache(max_len, N)
    for r, length in enumerate(lengths):  # each row its own prompt length, unpadded, as the engine does
        model.prefill(cache.row(r), prompt[:, :length], logits=None)
    cache.set_row_lengths(lengths)
    snapshot = cache.clone()
    restore = lambda: cache.restore(snapshot)  # noqa: E731
    blocks, tokens = later.expand(N, -1).contiguous(), token.expand(N, -1).contiguous()
    out = []
    for step, call, (c, m), before in (("preview", lambda: model.preview(cache, blocks), (0, B), None),
                                       ("AR step", lambda: model.commit(cache, tokens, logits="last"), (1, 0), restore)):
        if before:
            before()
        hit = experts_hit(model, call)
        times = timed(call, args, before)
        restore()
        parts = roofline_bytes(model, sum(lengths) / N, c, m, True, hit, batch=N)
        total, med = sum(parts.values()), statistics.median(times)
        out.append(dict(step=step, variant=f"batch {N}", batch=N, row_lengths=lengths, commit_rows=c, preview_rows=m,
                        committed_length=max(lengths), median_s=med, min_s=min(times), times_s=times,
                        experts_hit_per_layer=hit, mean_experts_hit=sum(hit) / max(len(hit), 1), bytes=parts,
                        total_bytes=total, roofline_s=total / HBM_BYTES_PER_S,
                        time_over_roofline=med * HBM_BYTES_PER_S / total,
                        tokens_per_s=N * (args.tpf if m else 1) / med))
        print(f"  {step} [batch {N}]: {med * 1e3:.2f} ms", flush=True)
    return out


def graph_status(graphs: StepGraphs, caught) -> dict:
    """Whether a graph row's step really replayed a captured CUDA graph: the runner falls back to
    eager static steps (with a RuntimeWarning) when a capture fails, and on a CPU never captures."""
    failed = [str(w.message) for w in caught if "graph capture failed" in str(w.message)]
    captured = graphs.capture and graphs.disabled is None and not failed
    error = graphs.disabled or (failed[0] if failed else None) or (None if graphs.capture else "no CUDA: not captured")
    return dict(graph_captured=bool(captured), graph_error=error)


def device_name(device) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def main(argv=None) -> int:
    args = parse_args(argv)
    if not 0 <= args.unmasked <= args.block:
        raise SystemExit(f"bench_e2e: --unmasked {args.unmasked} must be in [0, --block {args.block}]")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print(f"bench_e2e: --device {args.device} but CUDA is not available here; the full-size model is "
              f"benchmarked on a GPU (CPU smoke run: --preset clover-tiny --device cpu --dtype float32)")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    dispatch.set_backend(None)  # "default" means the dispatch's own choice
    config = CloverConfig.preset(args.preset)
    mask = config.mask_token_id if config.mask_token_id is not None else config.vocab_size - 1
    dtype, dev = DTYPES[args.dtype], args.device
    t0 = time.perf_counter()
    cuda = torch.device(dev).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = build_model(config, dev, dtype, args.init)
    sync()
    print(f"built {args.preset} ({sum(p.numel() for p in model.parameters()) / 1e6:,.1f}M params, {args.dtype}) "
          f"on {dev} in {time.perf_counter() - t0:.1f}s", flush=True)

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size - 1, (1, args.prompt_len), generator=g).to(dev)
    commit_ids = torch.randint(0, config.vocab_size - 1, (1, args.block), generator=g).to(dev)
    block = torch.full((1, args.block), mask, dtype=torch.long, device=dev)
    later = block.clone()  # a block part-way through its denoising: every other position unmasked first
    filled = torch.cat([torch.arange(0, args.block, 2), torch.arange(1, args.block, 2)])[:args.unmasked]
    later[0, filled] = torch.randint(0, config.vocab_size - 1, (len(filled),), generator=g).to(dev)
    masked = (later[0] == mask).nonzero().flatten()  # logits only there
    cache = model.new_cache(args.prompt_len + max(128, 2 * args.block))  # modest: prompt + the steps
    t0 = time.perf_counter()
    model.prefill(cache, prompt, logits=None)
    sync()
    print(f"prefilled {args.prompt_len} tokens in {time.perf_counter() - t0:.2f}s", flush=True)
    snapshot, n, B = cache.clone(), cache.length, args.block
    restore = lambda: cache.restore(snapshot)  # noqa: E731
    coreset = Coreset(args.coreset)
    graphs = StepGraphs(model, cache.max_len)  # the fast path, on its own cache holding the same prompt
    model.prefill(graphs.reset(), prompt, logits=None)
    g_snapshot = graphs.cache.clone()
    g_restore = lambda: graphs.cache.restore(g_snapshot)  # noqa: E731

    steps = {  # name -> (call, (c, m, logits), restore before each call)
        "preview, all masked": (lambda: model.preview(cache, block), (0, B, True), None),
        "preview": (lambda: model.preview(cache, later, positions=masked), (0, B, len(masked) > 0), None),
        "commit+preview": (lambda: model.commit_and_preview(cache, commit_ids, block), (B, B, True), restore),
        "AR step": (lambda: model.commit(cache, commit_ids[:, :1], logits="last"), (1, 0, True), restore),
        "preview, coreset": (lambda: model.preview(cache, later, positions=masked, coreset=coreset),
                             (0, B, len(masked) > 0), None),
    }
    graph_steps = {  # the same steps on the fast path (all block logits: the engine picks rows after)
        "preview": (lambda: graphs.step(later, 0, B), g_restore),
        "commit+preview": (lambda: graphs.step(torch.cat([commit_ids, block], 1), B, B), g_restore),
        "AR step": (lambda: graphs.step(commit_ids[:, :1], 1, 0, commit_logits=True), g_restore),
        "preview, coreset": (lambda: graphs.step(later, 0, B, coreset=g_core), g_restore),
    }
    g_core = graphs.coreset(args.coreset)
    graphs.step(block, 0, B, coreset=g_core)  # records the fast path's coreset (untimed)
    variants = [  # (step, variant label, setting: None | "hook" | "torch")
        ("preview, all masked", "default", None), ("preview", "default", None), ("commit+preview", "default", None),
        ("AR step", "default", None), ("preview", "route hook", "hook"), ("preview", "torch backend", "torch"),
        ("preview, coreset", f"coreset {args.coreset}", None),
        ("preview", "CUDA graph", "graph"), ("commit+preview", "CUDA graph", "graph"), ("AR step", "CUDA graph", "graph"),
        ("preview, coreset", f"coreset {args.coreset}, CUDA graph", "graph"),
    ]
    model.preview(cache, block, coreset=coreset)  # the block's first preview records the coreset (untimed)
    name, now = device_name(dev), dt.datetime.now()
    path = result_path(args.out, f"e2e_{args.preset}_{now:%Y-%m-%d_%H%M%S}_{slug(name)}", None)

    def write(complete: bool) -> None:  # after every step too: a run cut short keeps what it measured
        write_json(path, dict(
            benchmark="bench_e2e", date=now.isoformat(timespec="seconds"), device=dev, device_name=name,
            preset=args.preset, dtype=args.dtype, torch=torch.__version__, python=platform.python_version(),
            hbm_roofline_bytes_per_s=HBM_BYTES_PER_S, args=vars(args), prompt_len=n, block=B,
            complete=complete, rows=rows), indent=2)

    rows = []
    for step, variant, setting in variants:
        call, (c, m, logits), before = steps[step]
        if before:
            before()
        hit = experts_hit(model, call)  # graphs take no hooks: the eager twin's experts
        if setting == "graph":
            restore()
            call, before = graph_steps[step]
            before()
        handle = model.hooks.add("layers.*.moe.route", lambda ev: None) if setting == "hook" else None
        try:
            with warnings.catch_warnings(record=True) as caught, \
                    dispatch.use_backend("torch" if setting == "torch" else None):
                warnings.simplefilter("always")
                times = timed(call, args, before)
        finally:
            if handle is not None:
                handle.remove()
        for w in caught:  # seen, and passed on
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        graph = graph_status(graphs, caught) if setting == "graph" else {}
        if graph and not graph["graph_captured"]:  # never eager times under a graph label
            variant = variant.replace("CUDA graph", "static eager" + (" (capture failed)" if graphs.capture else ""))
        restore()
        g_restore()
        parts = roofline_bytes(model, n, c, m, logits, hit)
        total = sum(parts.values())
        med = statistics.median(times)
        rows.append(dict(step=step, variant=variant, commit_rows=c, preview_rows=m, committed_length=n,
                         median_s=med, min_s=min(times), times_s=times, experts_hit_per_layer=hit,
                         mean_experts_hit=sum(hit) / max(len(hit), 1), bytes=parts, total_bytes=total,
                         roofline_s=total / HBM_BYTES_PER_S, time_over_roofline=med * HBM_BYTES_PER_S / total,
                         tokens_per_s=args.tpf / med if m and not c else None, **graph))
        print(f"  {step} [{variant}]: {med * 1e3:.2f} ms", flush=True)
        write(complete=False)

    if args.batch > 1:
        rows += batch_rows(model, args, prompt, later, commit_ids[:, :1], cache.max_len, write)
        write(complete=False)

    print(f"\n{args.preset} {args.dtype} on {name}, prompt {n}, block {B}, median of {args.repeat}; "
          f"torch {torch.__version__}; roofline at {HBM_BYTES_PER_S / 1e12:.1f} TB/s")
    head = (f"{'step':<20} {'variant':<21} {'ms':>9} {'roof ms':>8} {'x roof':>7} {'GB':>8} {'experts/layer':>13} "
            f"{'tok/s @' + str(args.tpf):>11}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        tps = f"{r['tokens_per_s']:.1f}" if r["tokens_per_s"] else "-"
        print(f"{r['step']:<20} {r['variant']:<21} {r['median_s'] * 1e3:>9.2f} {r['roofline_s'] * 1e3:>8.3f} "
              f"{r['time_over_roofline']:>7.1f} {r['total_bytes'] / 1e9:>8.3f} {r['mean_experts_hit']:>13.1f} {tps:>11}")
    if not cuda:
        print("(not a GPU: the roofline is the H200's; times and ratios only show the script runs)")

    write(complete=True)
    print(f"wrote {path}")
    failed = [r for r in rows if r.get("graph_captured") is False and cuda]
    if failed:  # the graph rows timed eager code: the check must not pass on them
        print(f"bench_e2e: {len(failed)} CUDA-graph rows ran eagerly: {failed[0]['graph_error']}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
