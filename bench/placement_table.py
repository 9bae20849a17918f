"""Which GPU sets hold Clover-35B-A3B, in bf16 and in FP8: computed from the released preset's
config (``CloverConfig.preset("clover-35b-a3b")``) on the meta device, planned exactly as
``clover_lab.load(..., device_map="auto", max_memory=...)`` plans it (accelerate), so the table
is the loader's own answer, not arithmetic by hand.

Each GPU's budget is its memory less the headroom: the cache of a ``--context``-token generation
(bf16 K,V of the 10 attention layers, GDN state) and ``--activations`` GiB for activations, the
CUDA context and the allocator. Experts that do not fit stay in host memory (CPU offload).

    python bench/placement_table.py [--context 32768] [--activations 3] [--coreset 0]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from clover_lab import CloverConfig, CloverModel
from clover_lab.model.cache import cache_bytes
from clover_lab.placement import meta_model, plan_placement

sys.path.append(str(Path(__file__).resolve().parent))  # result_file.py, when a test imports this (last: shadows nothing)
from result_file import DATE, RESULTS, write_result  # noqa: E402
from result_tables import placement  # noqa: E402

GiB = 1 << 30
# (label, GiB per GPU as the driver reports it, count)
GPU_SETS = [
    ("1 x 24 GB (RTX 4090, A5000)", 23.6, 1),
    ("2 x 24 GB", 23.6, 2),
    ("4 x 24 GB", 23.6, 4),
    ("1 x 48 GB (L40S, A6000)", 44.4, 1),
    ("2 x 48 GB", 44.4, 2),
    ("1 x 80 GB (A100, H100)", 79.1, 1),
    ("1 x 141 GB (H200)", 139.8, 1),
]
HOST = "cpu"


def row(label: str, per_gpu: float, count: int, fp8: bool, headroom: int, coreset: int) -> dict:
    config = CloverConfig.preset("clover-35b-a3b")
    model = meta_model(CloverModel, config, fp8_block=(128, 128) if fp8 else None)
    budget = {i: int(per_gpu * GiB) - headroom for i in range(count)}
    budget[HOST] = 512 * GiB
    placed = plan_placement(model, "auto", budget, torch.bfloat16, coreset_size=coreset)
    used = placed.bytes_by_device()
    total = sum(placed.sizes.values())
    on_gpus = sum(v for k, v in used.items() if k.startswith("cuda"))
    offloaded = placed.offloaded()
    caps = ",".join(f"{i}={budget[i] / GiB:.0f}GiB" for i in range(count))
    model_dir = "Clover-35B-A3B" + ("-FP8" if fp8 else "")
    if not offloaded and len([k for k in used if k.startswith("cuda")]) == 1:  # one GPU holds it all
        command = f"clover-lab generate --model {model_dir} --device cuda"
    else:
        host = f",cpu={used.get('cpu', 0) / GiB + 8:.0f}GiB" if offloaded else ""
        command = f"clover-lab generate --model {model_dir} --device-map auto --max-memory {caps}{host}"
    return {"gpus": label, "dtype": "fp8" if fp8 else "bf16", "weights_gib": total / GiB,
            "on_gpus_gib": on_gpus / GiB, "per_gpu_gib": {k: v / GiB for k, v in used.items() if k.startswith("cuda")},
            "offloaded_layers": len(offloaded), "host_gib": used.get("cpu", 0) / GiB,
            "fits": not offloaded, "command": command}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=32768, help="tokens of cache to leave room for")
    ap.add_argument("--activations", type=float, default=3.0, help="GiB per GPU for activations and the context")
    ap.add_argument("--coreset", type=int, default=0, help="coreset size whose staging room the plan reserves")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    config = CloverConfig.preset("clover-35b-a3b")
    headroom = cache_bytes(config, args.context, dtype=torch.bfloat16) + int(args.activations * GiB)
    rows = [row(label, per_gpu, n, fp8, headroom, args.coreset) for label, per_gpu, n in GPU_SETS for fp8 in (False, True)]
    print(f"headroom per GPU: {headroom / GiB:.2f} GiB ({args.context}-token cache + {args.activations} GiB)\n")
    print(placement({"rows": rows}), end="")  # the table the documentation renders from the JSON
    print()
    write_result(args.out, "placement-35b", {"context": args.context, "activations_gib": args.activations,
                                             "coreset": args.coreset, "headroom_gib": headroom / GiB, "rows": rows},
                 DATE, indent=2)


if __name__ == "__main__":
    main()
