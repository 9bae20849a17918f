"""Activation memory of the block-diffusion training forward, per token, at Clover-35B-A3B's widths,
beside the state plan of ``clover_lab.train.memory_plan`` (weights, gradients, AdamW moments per rank).

    python bench/adapt_memory.py [--ranks 8] [--seq-len 4096]

The saved-for-backward tensors of one training forward + loss are counted (unique storages,
``torch.autograd.graph.saved_tensors_hooks``) on a model with the full model's hidden size,
heads, head dims and expert widths (top-8), but 2 layers (one GDN, one attention), 16 experts
and a 4096-token vocabulary, in bf16, at two sequence lengths. Per decoder layer of each type
and per row that scales to 40 layers; the LM head and loss part scales per row and per
vocabulary entry. Fewer experts change only the router's [T, E] probabilities (added back per
expert). CPU SDPA with a mask keeps attention scores quadratic in the length; a GPU's
memory-efficient kernel keeps only O(T) statistics, so the fit below separates the two.
Prints a table; writes JSON to bench/results/.
"""
from __future__ import annotations

import argparse
from datetime import date

import torch
from result_file import DATE, RESULTS, write_result

from clover_lab import CloverConfig, CloverModel
from clover_lab.train.memory_plan import GIB, memory_plan, render
from clover_lab.train.objective import TrainSettings, block_diffusion_loss


def saved_bytes(model: CloverModel, length: int) -> dict[str, int]:
    """Bytes saved for backward by one training step on one row, by where they were saved."""
    where, out = ["outside"], {}
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}  # weights are not activations

    def pack(t):
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            out[where[-1]] = out.get(where[-1], 0) + t.untyped_storage().nbytes()
        return t

    def enter(module, args):
        where.append(module.layer_type)

    def leave(module, args, output):
        where.pop()

    for layer in model.model.layers:
        layer.register_forward_pre_hook(enter)
        layer.register_forward_hook(leave)
    clean = torch.randint(0, model.config.vocab_size - 1, (1, length), generator=torch.Generator().manual_seed(0))
    settings = TrainSettings(seq_len=length, batch_size=1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = block_diffusion_loss(model, clean, settings, torch.Generator().manual_seed(1))
    del loss
    return out


def probe_model(full: CloverConfig, experts: int = 16) -> CloverModel:
    config = full.replace(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], vocab_size=4096,
                          num_experts=experts, mask_token_id=4095)
    model = CloverModel.random(config, dtype=torch.bfloat16)
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def fit(short: dict, long: dict, a: int, b: int) -> dict:
    """Per part, bytes = lin * rows + quad * rows^2 through the two lengths' rows (2L each)."""
    ra, rb = 2 * a, 2 * b
    out = {}
    for part in short:
        quad = (long[part] / rb - short[part] / ra) / (rb - ra)
        out[part] = {"per_row": short[part] / ra - quad * ra, "per_row_squared": max(0.0, quad)}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="clover-35b-a3b")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens per row of the planned run")
    ap.add_argument("--probe", type=int, nargs=2, default=(64, 128), help="the two measured lengths")
    args = ap.parse_args()
    full = CloverConfig.preset(args.preset)
    model = probe_model(full)
    a, b = args.probe
    per = fit(saved_bytes(model, a), saved_bytes(model, b), a, b)
    rows = 2 * args.seq_len
    router_extra = (full.num_experts - model.config.num_experts) * 4  # fp32 router probs per row and layer
    layers = {"linear_attention": len(full.gdn_layers()), "full_attention": len(full.attention_layers())}
    linear = sum(n * (per[t]["per_row"] + router_extra) * rows for t, n in layers.items())
    quadratic = sum(n * per[t]["per_row_squared"] * rows ** 2 for t, n in layers.items())
    head = per["outside"]["per_row"] / model.config.vocab_size * full.vocab_size * rows
    # --activation-checkpointing: each layer keeps its input (bf16 hidden rows); backward
    # recomputes one layer at a time, so one layer's activations exist at once
    kept = full.num_hidden_layers * full.hidden_size * 2 * rows
    one_layer = max((per[t]["per_row"] + router_extra) * rows + per[t]["per_row_squared"] * rows ** 2 for t in layers)
    plan = memory_plan(full, args.ranks)
    result = {"date": str(date.today()), "preset": args.preset, "ranks": args.ranks, "seq_len": args.seq_len,
              "probe_lengths": [a, b], "per_part": per, "activations_gib": {
                  "decoder layers, O(T)": linear / GIB, "attention scores, O(T^2) (CPU math SDPA only)": quadratic / GIB,
                  "LM head + loss": head / GIB,
                  "with --activation-checkpointing: layer inputs + one layer recomputed": (kept + one_layer) / GIB},
              "state_plan": plan}
    print(render({"all, bf16": plan}))
    for k, v in result["activations_gib"].items():
        print(f"| activations, one row of {args.seq_len} tokens: {k} | {v:.1f} |")
    write_result(RESULTS, f"adapt-memory-{args.preset}", result, DATE, indent=2)


if __name__ == "__main__":
    main()
