"""Roofline plan of a whole Clover step on one H200, from the preset itself (no GPU, no weights).

The full preset is built on the ``meta`` device in bf16, so every parameter count is the model's
own. For each step kind the script counts what one forward must read from HBM at least (bytes
as ``bench_e2e.roofline_bytes`` counts them for the measured run, so the two tables compare
directly) and the FLOPs it does, and turns them into the H200's roofline time:
max(bytes / 4.8 TB/s, FLOPs / 790 TFLOP/s bf16).

  weights    every non-expert weight once (attention, GDN, router, shared expert, norms), the
             embedding rows of the step's tokens, the whole LM head when the step has logits,
             and 3 * H * I bf16 per *distinct* routed expert per MoE layer
  experts    ASSUMPTION, uniform routing: T tokens each picking top-k of E experts hit on
             average E * (1 - (1 - k/E)^T) distinct experts per layer (8 for one token, 163.2 for
             a 32-token block, 222.4 for 64 rows); with a coreset of M experts the block picks
             inside M: M * (1 - (1 - k/M)^T). Real routers are skewed: fewer distinct experts.
  cache      K,V rows of the attention layers read (committed prefix, --context tokens) and
             written (committed rows), GDN states (fp32) and conv rings read, and written on commit
  FLOPs      2 per weight per token for every product (routed experts: top-k per token), the
             LM head at the rows with logits, attention over the prefix and block, the GDN
             rule (chunked for commits, recurrent for one token, the preview operator)

  attention  per attention layer, at 1k / 4k / 32k committed tokens: the bytes the split-KV kernel
             reads (the live keys) against the whole-buffer SDPA it replaced (``attention_reads``)

  launches   kernels per layer (bench/step_launches.py, counted on the CPU) x layers x 2 us per
             kernel replayed in a CUDA graph: the launch floor; a step's predicted time is the
             longer of its roofline and that floor ("bound" says which)

Tokens per second at 1, 2 and 3.5 tokens per forward (TPF) are TPF / predicted step time; the block loop
rows add what a 32-token block costs at a given TPF: one fused commit+preview forward and
32/TPF - 1 previews. The memory plan: bf16 weights, cache per 1k tokens, an estimate of the
peak activations of an 8k prefill on the GPU path (Triton kernels, flash attention; itemised
in the JSON), and what is left of the H200's 139 GiB.

    python bench/roofline.py [--preset clover-35b-a3b] [--context 4096] [--json FILE]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import HBM_BYTES_PER_S, roofline_bytes  # noqa: E402  (one byte count for both tables)
from result_file import RESULTS, write_json  # noqa: E402

from clover_lab.config import CloverConfig  # noqa: E402
from clover_lab.model.decoder import CloverModel  # noqa: E402

BF16_FLOPS_PER_S = 790e12  # H200, dense bf16 tensor cores (what the issue plans against)
H200_GIB = 139  # usable HBM of one H200 as torch reports it
GIB = 1 << 30
TPFS = (1.0, 2.0, 3.5)
CHUNK = 32  # rows per chunk of the GDN commit kernels (clover_kernels/gdn/commit.py, bf16)


def expected_distinct(pool: int, k: int, tokens: int) -> float:
    """Distinct experts hit per layer by ``tokens`` tokens choosing top-``k`` of ``pool``, uniformly."""
    return pool * (1.0 - (1.0 - k / pool) ** tokens) if tokens else 0.0


def build(preset: str) -> CloverModel:
    config = CloverConfig.preset(preset)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # parameters in the GPU dtype: bytes come from element sizes
    try:
        with torch.device("meta"):
            return CloverModel(config)
    finally:
        torch.set_default_dtype(default)


def param_groups(model: CloverModel) -> dict:
    """Parameters (numel) by what uses them: routed experts are per token top-k, the rest dense."""
    groups = dict(embedding=0, lm_head=0, routed_experts=0, attention=0, gdn=0, router=0, shared_expert=0,
                  norms=0)
    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            key = "routed_experts"
        elif "embed_tokens" in name:
            key = "embedding"
        elif name.startswith("lm_head"):
            key = "lm_head"
        elif ".self_attn." in name and "norm" not in name:
            key = "attention"
        elif ".linear_attn." in name:
            key = "gdn"
        elif ".mlp.gate." in name:
            key = "router"
        elif "shared_expert" in name:
            key = "shared_expert"
        else:
            key = "norms"
        groups[key] += p.numel()
    return groups


def step_flops(cfg: CloverConfig, groups: dict, n: int, c: int, m: int, logit_rows: int) -> dict:
    """FLOPs of one forward: c committed rows at committed length n, then m previewed rows."""
    T = c + m
    H, E, k = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok
    per_expert = groups["routed_experts"] / (E * cfg.num_hidden_layers)
    dense = sum(groups[g] for g in ("attention", "gdn", "router", "shared_expert"))
    attn_layers, gdn_layers = len(cfg.attention_layers()), len(cfg.gdn_layers())
    # attention: QK^T and PV, 2 FLOPs per multiply-add each, per query over the keys it sees
    keys = c * n + c * (c + 1) / 2 + m * (n + c + m)
    attention = attn_layers * 4 * cfg.num_attention_heads * cfg.head_dim * keys
    Hv, dk, dv, K, C = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                        cfg.linear_conv_kernel_dim, cfg.conv_dim)
    if c == 1:  # recurrent: decay, prediction, update, read of the dk x dv state
        rule = c * Hv * 8 * dk * dv
    else:  # chunked: w S, q S, k^T v_new on the state; q k^T, P v, the UT transform inside a chunk
        bt = min(CHUNK, c) if c else 0
        rule = c * Hv * (6 * dk * dv + 2 * bt * (3 * dk + 2 * dv))
    preview = m * Hv * (2 * dk * dv + 2 * m * (dk + dv))  # history read, block softmax over m rows
    conv = 2 * K * C * c + 2 * (2 * K - 1) * C * m  # causal taps; previews also the right taps
    return dict(
        dense=2 * T * dense,
        routed_experts=2 * T * k * per_expert * cfg.num_hidden_layers,
        lm_head=2 * logit_rows * cfg.vocab_size * H,
        attention=attention,
        gdn=gdn_layers * (rule + preview + conv),
    )


# (name, committed length n, commit rows c, preview rows m, logit rows, coreset size or None)
def step_kinds(cfg: CloverConfig, context: int):
    B = cfg.block_size
    return [
        ("AR step", context, 1, 0, 1, None),
        (f"preview {B}, no coreset", context, 0, B, B, None),
        (f"preview {B}, coreset 64", context, 0, B, B, 64),
        (f"preview {B}, coreset 48", context, 0, B, B, 48),
        (f"commit+preview {B}+{B}", context, B, B, B, None),
        ("prefill 1k", 0, 1024, 0, 1, None),
        ("prefill 8k", 0, 8192, 0, 1, None),
    ]


# The launch floor: kernels per layer per forward as bench/step_launches.py counts them on the CPU
# (the newest bench/results/step-launches-*.json; these figures when there is none), times the
# layers, at LAUNCH_S per kernel replayed in a CUDA graph. A step cannot be faster than it.
LAUNCH_S = 2e-6
KERNELS_PER_LAYER = {"AR": 16.75, "preview": 15.0, "fused": 18.25, "preview, coreset use": 15.0}


def kernels_per_layer() -> dict:
    results = sorted(RESULTS.glob("step-launches-*.json"))
    if results:
        steps = json.loads(results[-1].read_text())["steps"]
        return {k: steps[k]["per_layer"] for k in KERNELS_PER_LAYER if k in steps}
    return dict(KERNELS_PER_LAYER)


def launch_kind(c: int, m: int, coreset) -> str | None:
    if m and c:
        return "fused"
    if m:
        return "preview, coreset use" if coreset else "preview"
    return "AR" if c == 1 else None  # prefill: compute- or memory-bound, not launch-bound


def plan_steps(model: CloverModel, context: int) -> list[dict]:
    cfg = model.config
    groups = param_groups(model)
    rows = []
    per_layer = kernels_per_layer()
    for name, n, c, m, logit_rows, coreset in step_kinds(cfg, context):
        E, k = cfg.num_experts, cfg.num_experts_per_tok
        hit = expected_distinct(coreset or E, k, c + m)
        parts = roofline_bytes(model, n, c, m, logits=logit_rows > 0, hit=[hit] * cfg.num_hidden_layers)
        weights = sum(parts[p] for p in ("dense_weights", "embedding_rows", "lm_head", "experts"))
        cache = sum(parts[p] for p in ("kv_cache_read", "gdn_state_read", "cache_write"))
        flops = step_flops(cfg, groups, n, c, m, logit_rows)
        total_flops = sum(flops.values())
        mem_s, compute_s = (weights + cache) / HBM_BYTES_PER_S, total_flops / BF16_FLOPS_PER_S
        kind = launch_kind(c, m, coreset)
        launch_s = per_layer[kind] * cfg.num_hidden_layers * LAUNCH_S if kind in per_layer else 0.0
        roof = max(mem_s, compute_s)
        t = max(roof, launch_s)  # the prediction: the roofline or the launch floor, whichever is longer
        row = dict(kernels_per_layer=per_layer.get(kind), launch_ms=launch_s * 1e3, step_ms=t * 1e3,step=name, committed_length=n, commit_rows=c, preview_rows=m, logit_rows=logit_rows,
                   coreset=coreset, experts_per_layer=hit, weight_bytes=weights, cache_bytes=cache,
                   bytes=parts, flops=total_flops, flops_parts=flops, memory_ms=mem_s * 1e3,
                   compute_ms=compute_s * 1e3, roofline_ms=roof * 1e3,
                   bound=max((mem_s, "memory"), (compute_s, "compute"), (launch_s, "launches"))[1])
        if m:  # a denoising forward: TPF tokens resolved per forward
            row["tokens_per_s"] = {str(tpf): tpf / t for tpf in TPFS}
        elif c == 1:  # AR: one token per forward
            row["tokens_per_s"] = {"1.0": 1 / t}
        else:
            row["prefill_tokens_per_s"] = c / t
        rows.append(row)
    return rows


ATTENTION_CONTEXTS = (1024, 4096, 32768)


def static_buffer(length: int) -> int:
    """The static steps' cache buffer for ``length`` positions (engine/graphs.py: a power of two, >= 1024)."""
    return max(1024, 1 << (length - 1).bit_length())


def attention_reads(cfg: CloverConfig, n: int, c: int, m: int, es: int = 2) -> dict:
    """HBM bytes of one attention layer's static-step attention for a step of c commit and m block
    rows after n committed tokens, batch 1, bf16.

    split_kv: what clover_kernels/attention/split_kv.py reads and writes: q and gate once, K,V of the live
    keys [0, n + c + m) once per tile of folded query rows (its tile sizes), the fp32 partials
    written and read back once per split (its split count), the output once.
    whole_buffer: the torch path it replaces (SDPA's math backend, as a mask with GQA forces): the
    whole buffer's K,V read, repeated G = Hq / Hkv times (the copies written and read), the scores
    [Hq, T, buffer] written by QK^T, read and written by the mask and by the softmax, read by PV,
    the bool mask read; q and the output once, the gate and the gated output once more."""
    from clover_kernels.attention.split_kv import min_split_keys, split_count, tiles_for

    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    T, live, L = c + m, n + c + m, static_buffer(n + c + m)
    G = Hq // Hkv
    rows_bytes = T * Hq * D * es  # q, the gate, the output: each [T, Hq * D]
    block_m, block_n, _ = tiles_for(torch.bfloat16, G * T)
    tiles = -(-G * T // block_m)
    splits = split_count(Hkv * tiles, L, block_n, min_split_keys(G * T, tiles, es))
    kv_live = 2 * Hkv * live * D * es
    split_kv = 3 * rows_bytes + tiles * kv_live + 2 * splits * Hq * T * (D + 2) * 4
    kv_buffer = 2 * Hkv * L * D * es
    scores = Hq * T * L * es
    whole = kv_buffer * (1 + 2 * G) + 6 * scores + T * L + 5 * rows_bytes
    return dict(committed=n, rows=T, live_keys=live, buffer=L, splits=splits, query_tiles=tiles,
                split_kv_bytes=split_kv, whole_buffer_bytes=whole, ratio=whole / split_kv,
                split_kv_us=split_kv / HBM_BYTES_PER_S * 1e6, whole_buffer_us=whole / HBM_BYTES_PER_S * 1e6)


def attention_table(cfg: CloverConfig) -> list[dict]:
    B = cfg.block_size
    out = []
    for context in ATTENTION_CONTEXTS:
        for step, c, m in (("AR step", 1, 0), (f"preview {B}", 0, B), (f"commit+preview {B}+{B}", B, B)):
            out.append(dict(step=step, **attention_reads(cfg, context, c, m)))
    return out


def block_loop(cfg: CloverConfig, rows: list[dict]) -> list[dict]:
    """Steady-state block diffusion: per block one fused commit+preview, then 32/TPF - 1 previews."""
    by = {r["step"]: r for r in rows}
    B = cfg.block_size
    fused = by[f"commit+preview {B}+{B}"]["step_ms"]
    out = []
    for label, preview in (("no coreset", f"preview {B}, no coreset"), ("coreset 64", f"preview {B}, coreset 64"),
                           ("coreset 48", f"preview {B}, coreset 48")):
        p = by[preview]["step_ms"]
        tps = {str(tpf): B / ((fused + (B / tpf - 1) * p) / 1e3) for tpf in TPFS}
        out.append(dict(loop=f"block of {B}, {label}", fused_ms=fused, preview_ms=p, tokens_per_s=tps))
    out.append(dict(loop="AR decode", tokens_per_s={"1.0": 1e3 / by["AR step"]["step_ms"]}))
    return out


def memory_plan(model: CloverModel, prefill: int = 8192) -> dict:
    cfg = model.config
    es = 2  # bf16
    H, T, E, k = cfg.hidden_size, prefill, cfg.num_experts, cfg.num_experts_per_tok
    weights = sum(p.numel() * es for p in model.parameters())
    attn, gdn = len(cfg.attention_layers()), len(cfg.gdn_layers())
    kv_per_token = attn * 2 * cfg.num_key_value_heads * cfg.head_dim * es
    Hv, dk, dv, C, K = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                        cfg.conv_dim, cfg.linear_conv_kernel_dim)
    gdn_state = gdn * (Hv * dk * dv * 4 + C * (K - 1) * es)
    # live tensors of the largest layer part of a T-row prefill on the GPU path (estimate, not measured)
    P = T * k
    blocks = -(-(P + min(E, P) * 15) // 16)  # moe/fused.py's bound on expert row blocks
    residual = 3 * T * H * es  # the stream, the normed input, the branch output
    gdn_live = dict(mixed=T * C * es, z=T * Hv * dv * es, gates=2 * T * Hv * 4, conv_out=T * C * es,
                    w_u=2 * Hv * T * max(dk, dv) * 4, decay=Hv * T * 4, o=T * Hv * dv * es, normed=T * Hv * dv * es)
    attn_live = dict(q_and_gate=T * 2 * cfg.num_attention_heads * cfg.head_dim * es,
                     q_normed_rotated=2 * T * cfg.num_attention_heads * cfg.head_dim * es,
                     k_v=6 * T * cfg.num_key_value_heads * cfg.head_dim * es,
                     o_gated=2 * T * cfg.num_attention_heads * cfg.head_dim * es)
    moe_live = dict(router=T * E * (es + 4), ids_weights=P * (8 + es), align=blocks * 16 * 4,
                    expert_act=blocks * 16 * cfg.moe_intermediate_size * es, per_pair_out_fp32=P * H * 4,
                    sum_fp32=T * H * 4, shared=3 * T * cfg.shared_expert_intermediate_size * es + T * H * es)
    parts = {"gdn layer": sum(gdn_live.values()), "attention layer": sum(attn_live.values()),
             "moe": sum(moe_live.values())}
    peak_part = max(parts, key=parts.get)
    activations = residual + parts[peak_part] + cfg.vocab_size * 4
    left = H200_GIB * GIB - weights - gdn_state - activations
    return dict(
        weights_bf16_bytes=weights, kv_cache_bytes_per_token=kv_per_token,
        cache_bytes_per_1k_tokens=kv_per_token * 1024, gdn_state_bytes=gdn_state,
        prefill_tokens=T, activation_peak_bytes=activations, activation_peak_in=peak_part,
        activation_parts=dict(residual=residual, gdn_layer=gdn_live, attention_layer=attn_live, moe=moe_live),
        cache_at_max_context_bytes=kv_per_token * cfg.max_position_embeddings + gdn_state,
        max_context=cfg.max_position_embeddings, hbm_bytes=H200_GIB * GIB,
        left_after_weights_state_activations_bytes=left,
        context_tokens_that_fit=int(left // kv_per_token),
        left_after_max_context_bytes=left - kv_per_token * cfg.max_position_embeddings,
        not_counted="CUDA context, cuBLAS/Triton workspaces, CUDA graph pools, allocator fragmentation",
    )


def print_tables(result: dict, file=sys.stdout) -> None:
    print(f"{result['preset']} ({result['params'] / 1e9:.2f}B params, bf16) on one H200: "
          f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s, {BF16_FLOPS_PER_S / 1e12:.0f} TFLOP/s; context {result['context']} "
          f"tokens; experts per layer: uniform routing", file=file)
    head = (f"{'step':<24} {'experts/layer':>13} {'weights GB':>10} {'cache GB':>8} {'GFLOP':>8} {'mem ms':>7} "
            f"{'math ms':>7} {'launch ms':>9} {'roof ms':>7} {'step ms':>7} {'tok/s @1':>9} {'@2':>7} {'@3.5':>7}")
    print(head + "\n" + "-" * len(head), file=file)
    for r in result["steps"]:
        tps = r.get("tokens_per_s", {})
        cols = [f"{tps[k]:.0f}" if k in tps else "-" for k in ("1.0", "2.0", "3.5")]
        if "prefill_tokens_per_s" in r:
            cols = [f"{r['prefill_tokens_per_s']:.0f} prefill", "", ""]
        print(f"{r['step']:<24} {r['experts_per_layer']:>13.1f} {r['weight_bytes'] / 1e9:>10.3f} "
              f"{r['cache_bytes'] / 1e9:>8.3f} {r['flops'] / 1e9:>8.0f} {r['memory_ms']:>7.3f} {r['compute_ms']:>7.3f} "
              f"{r['launch_ms']:>9.3f} {r['roofline_ms']:>7.3f} {r['step_ms']:>7.3f} {cols[0]:>9} {cols[1]:>7} {cols[2]:>7}", file=file)
    print(file=file)
    for r in result["block_loop"]:
        tps = "  ".join(f"TPF {k}: {v:.0f} tok/s" for k, v in r["tokens_per_s"].items())
        print(f"{r['loop']:<28} {tps}", file=file)
    print(f"\nattention per layer (split-KV over the live keys vs SDPA over the whole buffer, bf16, batch 1)",
          file=file)
    head = (f"{'context':>8} {'step':<24} {'buffer':>7} {'splits':>6} {'split-KV MB':>11} {'whole MB':>9} "
            f"{'ratio':>6} {'split-KV us':>11} {'whole us':>9}")
    print(head + "\n" + "-" * len(head), file=file)
    for r in result["attention"]:
        print(f"{r['committed']:>8} {r['step']:<24} {r['buffer']:>7} {r['splits']:>6} "
              f"{r['split_kv_bytes'] / 1e6:>11.2f} {r['whole_buffer_bytes'] / 1e6:>9.2f} {r['ratio']:>6.1f} {r['split_kv_us']:>11.2f} "
              f"{r['whole_buffer_us']:>9.2f}", file=file)
    mp = result["memory"]
    print(f"\nmemory: weights {mp['weights_bf16_bytes'] / GIB:.1f} GiB bf16; cache "
          f"{mp['cache_bytes_per_1k_tokens'] / 2**20:.1f} MiB per 1k tokens + GDN state "
          f"{mp['gdn_state_bytes'] / 2**20:.1f} MiB; peak activations of a {mp['prefill_tokens']}-token prefill "
          f"~{mp['activation_peak_bytes'] / GIB:.2f} GiB (in the {mp['activation_peak_in']}); left of "
          f"{H200_GIB} GiB: {mp['left_after_weights_state_activations_bytes'] / GIB:.1f} GiB = "
          f"{mp['context_tokens_that_fit']:,} tokens of K,V ({mp['max_context']:,}-token context: "
          f"{mp['left_after_max_context_bytes'] / GIB:.1f} GiB left)", file=file)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="clover-35b-a3b")
    p.add_argument("--context", type=int, default=4096, help="committed tokens before the step (not prefill)")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    model = build(args.preset)
    steps = plan_steps(model, args.context)
    result = dict(benchmark="roofline", date=dt.date.today().isoformat(), computed_on="cpu (meta device)",
                  target="H200", hbm_bytes_per_s=HBM_BYTES_PER_S, bf16_flops_per_s=BF16_FLOPS_PER_S,
                  preset=args.preset, params=sum(p.numel() for p in model.parameters()),
                  param_groups=param_groups(model), context=args.context, torch=torch.__version__,
                  python=platform.python_version(),
                  assumptions=["uniform routing: distinct experts per layer = pool * (1 - (1 - k/pool)^tokens)",
                               "bytes: each weight read once per forward, activations not counted",
                               "prefills start from an empty cache; other steps follow --context committed tokens"],
                  steps=steps, block_loop=block_loop(model.config, steps), memory=memory_plan(model),
                  attention=attention_table(model.config))
    print_tables(result)
    if args.json:
        print(f"wrote {write_json(args.json, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
