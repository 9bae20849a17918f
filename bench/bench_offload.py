"""Offloaded experts on the CPU: what each layer's forward copies, counted through the public API.

Loads a model with every layer's experts offloaded (``device_map``: the rest on the CPU, the
experts "offload"), generates, and prints per mode (block diffusion with and without a coreset,
AR): forwards, copies per layer and forward (the streaming store's: one gather and one copy; the
former store's: one per expert and tensor), bytes staged per layer and forward (at the forward
and by the prefetch), the share of prefetched experts a forward used, with the prefetch and
without it (side by side in one run), and the host bytes of the offloaded experts and of the
staging buffers. On a CPU the "device" is the CPU: counts and bytes are those a GPU run issues;
times are not measured.

    python bench/bench_offload.py [--model DIR] [--tokens N] [--json FILE]

Figures: bench/results/offload-default-model-cpu-2026-12-01.json (the table of docs/guides/real-model.md).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from result_file import write_json


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import clover_lab
    from clover_lab.checkpoint import loading

    path = args.model or loading.default_model_dir()
    config = loading.load_config(path)
    device_map = {"": "cpu", **{f"model.layers.{i}.mlp.experts": "offload" for i in range(config.num_hidden_layers)}}
    engine = clover_lab.load(path, device_map=device_map)
    chain = [layer.mlp.experts.store for layer in engine.model.model.layers]
    links = [s.next for s in chain]
    offloaded = sum(t.numel() * t.element_size() for layer in engine.model.model.layers
                    for t in layer.mlp.experts.expert_tensors().values())
    tensors_per_expert = len(engine.model.model.layers[0].mlp.experts.expert_tensors())
    prompt = list(range(3, 35))
    rows = []
    for (mode, coreset), prefetch in [(m, p) for m in (("diffusion", None), ("diffusion", 4), ("ar", None))
                                      for p in (True, False)]:
        for s, link in zip(chain, links):
            s.release()
            s.next = link if prefetch else None
        staging = chain[0].staging
        start = dict(copies=staging.copies, bytes=staging.bytes_copied,
                     stores=[(s.fetched, s.prefetched, s.prefetch_used) for s in chain])
        calls = {"forward": 0}
        run = chain[0].run

        def counted(*a, _run=run, **k):
            calls["forward"] += 1
            return _run(*a, **k)
        chain[0].run = counted
        extra = {} if mode == "ar" else dict(threshold=0.9, coreset_size=coreset)
        engine.generate(prompt, mode=mode, max_new_tokens=args.tokens, **extra)
        del chain[0].run
        forwards = calls["forward"]
        layer_forwards = forwards * len(chain)
        fetched = sum(s.fetched - f for s, (f, _, _) in zip(chain, start["stores"]))
        prefetched = sum(s.prefetched - pf for s, (_, pf, _) in zip(chain, start["stores"]))
        used = sum(s.prefetch_used - u for s, (_, _, u) in zip(chain, start["stores"]))
        rows.append(dict(mode=mode, coreset=coreset, prefetch=prefetch, forwards=forwards,
                         copies_per_layer_forward=(staging.copies - start["copies"]) / layer_forwards,
                         former_copies_per_layer_forward=fetched * tensors_per_expert / layer_forwards,
                         experts_per_layer_forward=fetched / layer_forwards,
                         kib_per_layer_forward=(staging.bytes_copied - start["bytes"]) / layer_forwards / 1024,
                         prefetched_experts=prefetched, prefetch_used=used,
                         prefetch_used_share=used / prefetched if prefetched else None))
    out = dict(model=str(path), experts=config.num_experts, top_k=config.num_experts_per_tok,
               layers=len(chain), offloaded_kib=offloaded / 1024, staging_host_kib=chain[0].staging.host_bytes / 1024,
               rows=rows)
    print(f"{path}: {len(chain)} offloaded layers, {config.num_experts} experts, top-{config.num_experts_per_tok}; "
          f"offloaded experts {out['offloaded_kib']:.0f} KiB in host memory (held once), staging buffers "
          f"{out['staging_host_kib']:.0f} KiB")
    print(f"{'mode':<10} {'coreset':>7} {'prefetch':>8} {'fwd':>4} {'copies/layer':>12} {'former':>7} {'experts':>8} "
          f"{'KiB/layer':>9} {'prefetched':>10} {'used':>6}")
    for r in rows:
        share = "-" if r["prefetch_used_share"] is None else f"{r['prefetch_used_share']:.2f}"
        print(f"{r['mode']:<10} {str(r['coreset']):>7} {str(r['prefetch']):>8} {r['forwards']:>4} "
              f"{r['copies_per_layer_forward']:>12.2f} "
              f"{r['former_copies_per_layer_forward']:>7.1f} {r['experts_per_layer_forward']:>8.2f} "
              f"{r['kib_per_layer_forward']:>9.1f} {r['prefetched_experts']:>10} {share:>6}")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
