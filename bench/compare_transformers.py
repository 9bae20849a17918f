"""clover_lab vs transformers' Qwen3_5MoeForCausalLM on the same random checkpoint, side by side.

Prefill tokens/s (as generate runs it: cache filled, last position's logits) and AR decode tokens/s
(same weights, dtype and thread count, one process), plus clover_lab's block-diffusion tokens/s,
prefill and diffusion also with ``model.pack_weights()``, AR decode through
torch.compile (``StepGraphs(compile=True)``, the engine's ``compile_steps``), and two floors: the
bare matrix products of a prefill and the matrix-vector products of one decoded token (floor /
transformers bounds what any implementation using those kernels could gain). Prints a table of
ratios and writes JSON to bench/results/.

    python bench/compare_transformers.py [--sizes small,medium] [--prompt 256] [--decode 32]
"""
from __future__ import annotations

import argparse
import platform
import tempfile
import time
import warnings
from pathlib import Path

import torch
from result_file import DATE, RESULTS, stamp, write_result

SIZES = {
    # (layers, hidden, experts, top-k, expert FFN, GDN key/value heads, attention heads)
    "small": dict(num_hidden_layers=4, hidden_size=256, num_experts=32, num_experts_per_tok=4,
                  moe_intermediate_size=256, shared_expert_intermediate_size=256, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "medium": dict(num_hidden_layers=8, hidden_size=512, num_experts=64, num_experts_per_tok=8,
                   moe_intermediate_size=256, shared_expert_intermediate_size=256, linear_num_key_heads=4,
                   linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=64),
}


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def build(size: str, dtype: torch.dtype, path: Path):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5MoeTextConfig(vocab_size=8192, max_position_embeddings=8192, **SIZES[size])
    ref = Qwen3_5MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "A_log" not in name:
                p.add_(torch.randn_like(p) * 0.02)
    ref.save_pretrained(path)
    ref = ref.to(dtype)
    from clover_lab import CloverModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = CloverModel.from_pretrained(path, dtype=dtype)
    return ref, ours


def gemm_floor(model, rows: int, experts: int, expert_rows: int, repeat: int, packed: bool = False) -> float:
    """Seconds for the bare matrix products of one forward, back to back in this process: every
    2-D weight of every layer on ``rows`` rows, the first ``experts`` routed experts' gate_up and
    down on ``expert_rows`` rows each, and the LM head on one row, through
    ``clover_kernels.dense.linear`` (oneDNN in fp32 from 4 rows, ``F.linear`` otherwise; ``packed``: on
    weights kept in oneDNN's layout). No attention, no delta rule, no routing, no norms, no Python
    around them: a lower bound for any implementation using these kernels."""
    from clover_kernels.dense import PackedWeight, linear

    products = []
    for layer in model.model.layers:
        products += [(p, rows) for p in layer.parameters() if p.dim() == 2]
        routed = layer.mlp.experts
        for e in range(experts):
            products += [(routed.gate_up_proj[e], expert_rows), (routed.down_proj[e], expert_rows)]
    products.append((model.lm_head.weight, 1))
    inputs = {}
    for w, m in products:
        inputs.setdefault((w.shape[1], m), torch.randn(m, w.shape[1], dtype=w.dtype))

    packs = [PackedWeight() if packed else None for _ in products]

    def run():
        for (w, m), p in zip(products, packs):
            linear(inputs[w.shape[1], m], w, packed=p)

    run()
    return best_of(run, repeat)


def decode_floor(model, repeat: int) -> float:
    """Seconds per token of an AR step's matrix-vector products: every weight on one row, top-k experts."""
    return gemm_floor(model, 1, model.config.num_experts_per_tok, 1, max(repeat, 5))


def prefill_floor(model, T: int, repeat: int, packed: bool = False) -> float:
    """Seconds for a T-token prefill's matrix products: every weight on T rows, every expert on its
    even share T * top-k / experts of the rows. transformers' prefill time over this bounds what
    any implementation using these GEMM kernels could gain."""
    cfg = model.config
    share = max(1, round(T * cfg.num_experts_per_tok / cfg.num_experts))
    return gemm_floor(model, T, cfg.num_experts, share, repeat, packed)


def run_size(size: str, dtype: torch.dtype, prompt_len: int, decode: int, repeat: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        ref, ours = build(size, dtype, Path(tmp))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 8000, (1, prompt_len), generator=g)
    row = {"size": size, "dtype": str(dtype).removeprefix("torch."), "prompt": prompt_len, "decode": decode,
           "params": sum(p.numel() for p in ours.parameters())}

    with torch.inference_mode():
        ref(prompt[:, :8])  # warm-up: first calls pay one-time costs
        ours.logits(prompt[:, :8])
        # prefill, as generate runs it: the cache filled, logits of the last position only; the three
        # in turn in each round (this machine's speed drifts), best round of each
        def ref_prefill():
            ref(prompt, use_cache=True, logits_to_keep=1)

        def ours_prefill():
            ours.prefill(ours.new_cache(prompt_len + decode + 1), prompt)

        times = {"transformers": [], "clover_lab": [], "clover_lab_packed": []}
        for _ in range(repeat):
            times["transformers"].append(best_of(ref_prefill, 1))
            times["clover_lab"].append(best_of(ours_prefill, 1))
            ours.pack_weights()
            ours_prefill()  # warm: the first call on the packed copies creates oneDNN's primitives
            times["clover_lab_packed"].append(best_of(ours_prefill, 1))
            ours.pack_weights(False)
        row["prefill_tok_s"] = {k: prompt_len / min(v) for k, v in times.items()}
        row["prefill_floor_tok_s"] = prompt_len / prefill_floor(ours, prompt_len, repeat)
        row["prefill_floor_packed_tok_s"] = prompt_len / prefill_floor(ours, prompt_len, repeat, packed=True)

        # AR decode (greedy), the decode steps alone: transformers' own cache vs clover_lab's
        def ref_decode():
            out = ref(prompt, use_cache=True)
            cache, tokens = out.cache, []
            t = time.perf_counter()
            for _ in range(decode):
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(nxt)
                out = ref(nxt, cache=cache, use_cache=True)
            return time.perf_counter() - t, torch.cat(tokens, dim=1)[0]

        from clover_lab.engine.graphs import StepGraphs

        graphs = StepGraphs(ours, prompt_len + decode + 1, compile=True)

        def ours_decode(compiled: bool = False):
            # compiled: the engine's CPU fast path with compile_steps, static steps through torch.compile
            cache = graphs.reset() if compiled else ours.new_cache(prompt_len + decode + 1)
            logits = ours.prefill(cache, prompt)
            tokens = []
            t = time.perf_counter()
            for _ in range(decode):
                nxt = logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(nxt)
                logits = graphs.step(nxt, 1, 0, commit_logits=True)[0] if compiled else ours.commit(cache, nxt)
            return time.perf_counter() - t, torch.cat(tokens, dim=1)[0]

        t = time.perf_counter()
        ours_decode(compiled=True)  # compiles the step once
        row["compile_seconds"] = time.perf_counter() - t
        ref_runs = [ref_decode() for _ in range(repeat)]
        ours_runs = [ours_decode() for _ in range(repeat)]
        compiled_runs = [ours_decode(compiled=True) for _ in range(repeat)]
        row["ar_decode_tok_s"] = {"transformers": decode / min(r[0] for r in ref_runs),
                                  "clover_lab": decode / min(r[0] for r in ours_runs),
                                  "clover_lab_compiled": decode / min(r[0] for r in compiled_runs)}
        row["compiled_tokens_agree"] = int((compiled_runs[0][1] == ours_runs[0][1]).sum())
        row["greedy_tokens_agree"] = int((ref_runs[0][1] == ours_runs[0][1]).sum())
        row["decode_floor_tok_s"] = 1.0 / decode_floor(ours, repeat)

        try:
            from clover_lab import Engine
        except ImportError:
            Engine = None
        if Engine is not None:
            engine = Engine(ours)
            if engine.mask_token_id is None:  # a Qwen checkpoint names no mask token: take the last id
                engine.mask_token_id = ours.config.vocab_size - 1

            def diffuse():
                return engine.generate(prompt[0].tolist(), max_new_tokens=decode, threshold=0.9)

            best = best_of(diffuse, repeat)
            result = diffuse()
            ours.pack_weights()
            best_packed = best_of(diffuse, repeat)
            ours.pack_weights(False)
            row["diffusion"] = {"tok_s_incl_prefill": len(result.token_ids) / best,
                                "packed_tok_s_incl_prefill": len(result.token_ids) / best_packed,
                                "tokens_per_forward": result.stats["tokens_per_forward"],
                                "note": "random weights: tokens per forward says little about a trained model"}
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="small,medium")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from clover_lab import cpu

    tuned = cpu.tune_malloc()  # for both sides: this process's large activations from glibc's heap, reused
    dtype = getattr(torch, args.dtype)
    rows = [run_size(s, dtype, args.prompt, args.decode, args.repeat) for s in args.sizes.split(",")]

    print(f"\nclover_lab vs transformers, {args.dtype}, {args.threads} threads, prompt {args.prompt}, "
          f"decode {args.decode} ({platform.processor() or platform.machine()})")
    print(f"{'size':8} {'params':>9} | {'prefill tf':>10} {'ours':>8} {'ratio':>5} {'packed':>8} {'ratio':>5} "
          f"{'max x':>5} {'packed':>6} | "
          f"{'decode tf':>9} {'ours':>7} {'ratio':>5} {'compiled':>8} {'ratio':>5} {'floor':>7} {'max x':>5} | "
          f"{'diffusion':>9}")
    for r in rows:
        p, d = r["prefill_tok_s"], r["ar_decode_tok_s"]
        print(f"{r['size']:8} {r['params'] / 1e6:8.1f}M | {p['transformers']:10.1f} {p['clover_lab']:8.1f} "
              f"{p['clover_lab'] / p['transformers']:5.2f} {p['clover_lab_packed']:8.1f} "
              f"{p['clover_lab_packed'] / p['transformers']:5.2f} {r['prefill_floor_tok_s'] / p['transformers']:5.2f} "
              f"{r['prefill_floor_packed_tok_s'] / p['transformers']:6.2f} | {d['transformers']:9.1f} {d['clover_lab']:7.1f} "
              f"{d['clover_lab'] / d['transformers']:5.2f} {d['clover_lab_compiled']:8.1f} "
              f"{d['clover_lab_compiled'] / d['transformers']:5.2f} {r['decode_floor_tok_s']:7.1f} "
              f"{r['decode_floor_tok_s'] / d['transformers']:5.2f} | "
              f"{r['diffusion']['tok_s_incl_prefill'] if 'diffusion' in r else float('nan'):9.1f}")
    print("tokens/s. packed: model.pack_weights() (GEMM weights kept in oneDNN's layout). compiled: clover_lab's\n"
          "static steps through torch.compile. max x: transformers' time over the bare matrix products alone\n"
          "(prefill: every weight on its rows through clover_kernels.dense.linear, plain or packed; decode: one\n"
          "token's matvecs), the most those GEMM kernels allow. diffusion: threshold 0.9, incl. prefill.\n"
          f"glibc malloc tuned for both (clover_lab.cpu): {tuned}")
    day = stamp(DATE)
    write_result(args.out, f"compare_transformers-cpu-{day}-{args.dtype}-prompt{args.prompt}",
                 {"date": day, "device": "cpu", "threads": args.threads, "malloc_tuned": tuned,
                  "torch": torch.__version__, "rows": rows}, None, indent=2)


if __name__ == "__main__":
    main()
