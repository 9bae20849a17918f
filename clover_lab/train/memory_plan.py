"""The memory plan of an adaptation run under FSDP2, computed from a config.

    python -m clover_lab.train.memory_plan --preset clover-35b-a3b --ranks 8

Per rank, FSDP2 holds 1/ranks of every parameter, of every trained parameter's gradient and of
its AdamW state (two moments), plus, while it runs, what it gathers whole: the root unit
(embedding, final norm, LM head; the root stays gathered from forward to backward) and the
decoder layers in flight (the one computing and the one prefetched; in backward also the
layer's gradient before its reduce-scatter). Activations are not in this plan: they depend on
the batch (``bench/adapt_memory.py`` measures them per token).
"""
from __future__ import annotations

import argparse
import json

import torch

from clover_lab.config import CloverConfig
from clover_lab.model.decoder import CloverModel

GIB = 1 << 30


def parameter_counts(config: CloverConfig) -> dict[str, int]:
    """Parameters by part, counted on a model built on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = CloverModel(config)
    parts = {"embedding": 0, "lm_head": 0, "routed experts": 0, "attention + GDN mixers": 0,
             "shared experts + routers": 0, "norms": 0}
    for name, p in model.named_parameters():
        if name.startswith("model.embed_tokens"):
            part = "embedding"
        elif name.startswith("lm_head"):
            part = "lm_head"
        elif ".mlp.experts." in name:
            part = "routed experts"
        elif ".mlp." in name:
            part = "shared experts + routers"
        elif "norm" in name.rsplit(".", 2)[-2] and "linear_attn.norm" not in name and "_norm" not in name:
            part = "norms"
        else:
            part = "attention + GDN mixers"
        parts[part] += p.numel()
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    return {**parts, "total": sum(parts.values()), "largest layer": max(layers),
            "root unit": parts["embedding"] + parts["lm_head"] + config.hidden_size}


def memory_plan(config: CloverConfig, ranks: int = 8, weight_bytes: int = 2, grad_bytes: int = 2,
                state_bytes: int = 2, trained: int | None = None) -> dict:
    """Bytes per rank. ``trained``: parameters that get gradients and optimizer state (default:
    all). Defaults: bf16 weights, bf16 gradients, bf16 AdamW moments."""
    n = parameter_counts(config)
    everything = trained is None or trained >= n["total"]
    trained = n["total"] if trained is None else trained
    sharded = {"weights": n["total"] * weight_bytes / ranks, "gradients": trained * grad_bytes / ranks,
               "AdamW moments": 2 * trained * state_bytes / ranks}
    # gathered gradients exist for trained parameters only: with preview, the embedding's, not the layers'
    root_grads = n["root unit"] if everything else n["embedding"]
    gathered = {"root unit (gathered)": n["root unit"] * weight_bytes + root_grads * grad_bytes,
                "2 layers in flight + 1 layer's gradient": n["largest layer"] * (2 * weight_bytes
                                                                                 + (grad_bytes if everything else 0))}
    return {"parameters": n, "ranks": ranks, "trained": trained,
            "bytes": {"sharded": sharded, "gathered": gathered},
            "per_rank_gib": (sum(sharded.values()) + sum(gathered.values())) / GIB}


def render(plans: dict[str, dict]) -> str:
    """A markdown table: one column per plan."""
    names = list(plans)
    first = plans[names[0]]
    rows = [f"| per rank (GiB) | {' | '.join(names)} |", "|---|" + "---|" * len(names)]
    for group in ("sharded", "gathered"):
        for key in first["bytes"][group]:
            rows.append(f"| {key} | " + " | ".join(f"{plans[n]['bytes'][group][key] / GIB:.1f}" for n in names) + " |")
    rows.append("| **total** | " + " | ".join(f"**{plans[n]['per_rank_gib']:.1f}**" for n in names) + " |")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m clover_lab.train.memory_plan", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="clover-35b-a3b")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    config = CloverConfig.preset(args.preset)
    n = parameter_counts(config)
    plans = {"all, bf16 weights/grads/moments": memory_plan(config, args.ranks),
             "all, --dtype float32": memory_plan(config, args.ranks, 4, 4, 4),
             "preview, bf16": memory_plan(config, args.ranks, trained=preview_parameters(config))}
    if args.json:
        print(json.dumps(plans, indent=2))
        return
    print(f"{args.preset}: " + ", ".join(f"{k} {v / 1e9:.2f}B" for k, v in n.items()))
    print(render(plans))


def preview_parameters(config: CloverConfig) -> int:
    """The parameters ``--train preview`` trains: the GDN layers' preview weights and the embedding
    (of which only the mask token's row moves, but FSDP keeps its whole gradient and state)."""
    K, C, Hv = config.linear_conv_kernel_dim, config.conv_dim, config.linear_num_value_heads
    return len(config.gdn_layers()) * (C * (K - 1) + 3 * Hv) + config.vocab_size * config.hidden_size


if __name__ == "__main__":
    main()
