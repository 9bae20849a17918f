"""Triton kernels vs their torch references (and fla's chunk_gated_delta_rule when installed).

For each op and shape (full-size Clover/Qwen3.5-35B-A3B dimensions): median time of the
Triton kernel and of the torch reference, the bytes an ideal kernel must move (inputs read
once, outputs written once, weights of the experts actually hit), the achieved bandwidth
and its fraction of the H200 HBM roofline (4.8 TB/s), and the max deviation from the
reference. Prints a table and writes JSON to bench/results/ (date and device in the name).

    python bench/bench_kernels.py [--out DIR] [--repeat N] [--only gdn_commit,moe_experts]
    python bench/bench_kernels.py --interpret   # tiny CPU smoke run under TRITON_INTERPRET=1
    python bench/bench_kernels.py --count [--interpret]   # kernels per layer of the static steps

Times include the launch overhead of each call (no CUDA graphs): at batch 1 that is part of
the real cost. The JSON is rewritten after every case ("complete": false until the end). Without CUDA and without --interpret the script refuses (exit 2).
"""
from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from result_file import RESULTS, result_path, slug, write_json

HBM_BYTES_PER_S = 4.8e12  # H200


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--interpret", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--out", default=str(RESULTS), help="folder for the JSON")
    p.add_argument("--repeat", type=int, default=50, help="timed calls per case (CUDA)")
    p.add_argument("--only", default="", help="comma-separated op names")
    p.add_argument("--count", action="store_true",
                   help="kernels per layer of the engine's static steps instead (bench/step_launches.py)")
    return p.parse_args(argv)


ARGS = parse_args()
if ARGS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates the kernels
os.environ.pop("CLOVER_KERNELS", None)

import torch  # noqa: E402

if not ARGS.interpret and not torch.cuda.is_available():
    print("bench_kernels: no CUDA device here; the kernels are benchmarked on a GPU "
          "(use --interpret for a tiny CPU smoke run of the script itself)")
    sys.exit(2)

from clover_kernels.gdn import torch as gdn_ref  # noqa: E402
from clover_kernels.moe import torch as moe_ref  # noqa: E402
from clover_kernels.norm import naive as norm_ref  # noqa: E402

try:
    import triton

    from clover_kernels.gdn import commit as gdn_commit_k
    from clover_kernels.gdn import preview as gdn_preview_k
    from clover_kernels.moe import fused as moe_k
    from clover_kernels.norm import rms as norm_k
except ImportError as exc:
    print(f"bench_kernels: triton kernels unavailable ({exc})")
    sys.exit(2)

DEVICE = "cpu" if ARGS.interpret else "cuda"
DTYPE = torch.float32 if ARGS.interpret else torch.bfloat16

# model dimensions (clover-architecture.md section 2); the smoke run shrinks them
if ARGS.interpret:
    DIMS = dict(H=64, Hk=1, Hv=2, dk=16, dv=16, K=4, E=8, I=32, topk=2)
    SHAPES = dict(rms=[1, 8], commit=[1, 20], preview=[8], moe=[1, 4])
else:
    DIMS = dict(H=2048, Hk=16, Hv=32, dk=128, dv=128, K=4, E=256, I=512, topk=8)
    SHAPES = dict(rms=[1, 32, 4096], commit=[1, 32, 64, 2048, 8192], preview=[32, 64], moe=[1, 8, 32, 64])


def timed(fn, repeat):
    """Median seconds per call."""
    if DEVICE == "cpu":
        fn()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def max_dev(a, b):
    if isinstance(a, (tuple, list)):
        return max(max_dev(x, y) for x, y in zip(a, b) if x is not None and y is not None)
    return (a.float() - b.float()).abs().max().item()


def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


ROWS = []
STARTED = dt.datetime.now()


def write_rows(complete: bool) -> Path:
    """The rows so far (after every case too: a run cut short keeps what it measured), whole or not
    at all under the name readers look for."""
    path = result_path(ARGS.out, f"kernels_{STARTED:%Y-%m-%d_%H%M}_{slug(device_name())}", None)
    return write_json(path, dict(
        date=STARTED.isoformat(timespec="seconds"), device=device_name(), interpret=ARGS.interpret,
        dtype=str(DTYPE), torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        hbm_roofline_bytes_per_s=HBM_BYTES_PER_S, dims=DIMS, complete=complete, rows=ROWS,
    ), indent=2)


def record(op, shape, kernel, reference, args, bytes_moved, extra=None):
    row = dict(op=op, shape=shape, bytes=bytes_moved)
    try:
        out = kernel(*args)
        row["triton_s"] = timed(lambda: kernel(*args), ARGS.repeat)
        try:
            ref = reference(*args)
            row["max_dev_vs_ref"] = max_dev(out, ref)
            row["torch_s"] = timed(lambda: reference(*args), max(3, ARGS.repeat // 5))
        except Exception as exc:  # e.g. grouped_mm without support for this dtype/device
            row["torch_error"] = f"{type(exc).__name__}: {exc}"[:200]
        row["GB_per_s"] = bytes_moved / row["triton_s"] / 1e9
        row["roofline_frac"] = bytes_moved / row["triton_s"] / HBM_BYTES_PER_S
    except Exception as exc:
        row["triton_error"] = f"{type(exc).__name__}: {exc}"[:300]
    row.update(extra or {})
    ROWS.append(row)
    write_rows(complete=False)
    return row


def bench_norms():
    H, Hv, dv = DIMS["H"], DIMS["Hv"], DIMS["dv"]
    for T in SHAPES["rms"]:
        x = torch.randn(T, H, device=DEVICE, dtype=DTYPE)
        w = torch.randn(H, device=DEVICE, dtype=DTYPE) * 0.1
        record("rms_norm", f"T={T} H={H}", norm_k.rms_norm, norm_ref.rms_norm, (x, w, 1e-6), 2 * nbytes(x) + nbytes(w),
               {"tokens": T})
        xg = torch.randn(T * Hv, dv, device=DEVICE, dtype=DTYPE)
        gate = torch.randn_like(xg)
        wg = torch.ones(dv, device=DEVICE, dtype=DTYPE)
        record("gated_rms_norm", f"rows={T * Hv} d={dv}", norm_k.gated_rms_norm, norm_ref.gated_rms_norm,
               (xg, gate, wg, 1e-6), 3 * nbytes(xg) + nbytes(wg), {"tokens": T})


def gdn_inputs(T, seed=0):
    Hk, Hv, dk, dv, K = DIMS["Hk"], DIMS["Hv"], DIMS["dk"], DIMS["dv"], DIMS["K"]
    g = torch.Generator(device="cpu").manual_seed(seed)
    C = 2 * Hk * dk + Hv * dv
    mixed = torch.randn(1, T, C, generator=g).to(DEVICE, DTYPE)
    ring = torch.randn(1, C, K - 1, generator=g).to(DEVICE, DTYPE)
    conv_w = (torch.randn(C, K, generator=g) * 0.5).to(DEVICE, DTYPE)
    log_decay = (-torch.rand(1, T, Hv, generator=g)).to(DEVICE)
    beta = torch.rand(1, T, Hv, generator=g).to(DEVICE)
    state = (torch.randn(1, Hv, dk, dv, generator=g) * 0.1).to(DEVICE)
    return mixed, ring, conv_w, log_decay, beta, state


def bench_gdn_commit():
    Hk, Hv, dk, dv = DIMS["Hk"], DIMS["Hv"], DIMS["dk"], DIMS["dv"]
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except Exception:
        fla_chunk = None
    for T in SHAPES["commit"]:
        mixed, ring, conv_w, log_decay, beta, state = gdn_inputs(T)
        args = (mixed, ring, conv_w, log_decay, beta, state, Hk, dk, dv)
        o_bytes = T * Hv * dv * mixed.element_size()
        moved = nbytes(mixed, conv_w, log_decay, beta) + 2 * nbytes(ring) + 2 * nbytes(state) + o_bytes
        extra = {"tokens": T}
        if fla_chunk is not None and T > 1:
            try:  # the delta rule alone (conv and head split done beforehand), fla's layout
                conv, _ = gdn_ref.causal_conv(mixed, ring, conv_w)
                q, k, v = gdn_ref.split_heads(torch.nn.functional.silu(conv), Hk, dk, dv)
                q, k, v = (t.to(DTYPE).contiguous() for t in (q, k, v))

                def run_fla():
                    return fla_chunk(q, k, v, log_decay, beta, initial_state=state, output_final_state=True)

                extra["fla_delta_rule_only_s"] = timed(run_fla, ARGS.repeat)
                # the same rule: fla's output and final state against ours (conv included in ours)
                o_fla, s_fla = run_fla()
                o_ours, _, s_ours = gdn_commit_k.gdn_commit(*args)
                extra["fla_max_dev_vs_ours"] = max_dev(o_fla, o_ours)
                extra["fla_state_max_dev_vs_ours"] = max_dev(s_fla, s_ours)
            except Exception as exc:
                extra["fla_error"] = f"{type(exc).__name__}: {exc}"[:200]
        record("gdn_commit", f"T={T} Hv={Hv} dk={dk} dv={dv}", gdn_commit_k.gdn_commit, gdn_ref.gdn_commit,
               args, moved, extra)


def bench_gdn_preview():
    Hk, Hv, dk, dv = DIMS["Hk"], DIMS["Hv"], DIMS["dk"], DIMS["dv"]
    for m in SHAPES["preview"]:
        mixed, ring, conv_w, _, _, state = gdn_inputs(m, seed=1)
        C = mixed.shape[-1]
        right = torch.randn(C, DIMS["K"] - 1, device=DEVICE, dtype=DTYPE) * 0.3
        bs = torch.full((Hv,), math.log(math.sqrt(dk)), device=DEVICE)
        hb, hln = torch.zeros(Hv, device=DEVICE), torch.ones(Hv, device=DEVICE)
        args = (mixed, ring, conv_w, right, state, bs, hb, hln, Hk, dk, dv, False)
        moved = nbytes(mixed, ring, conv_w, right, state) + m * Hv * dv * mixed.element_size() + m * Hv * 4
        record("gdn_preview", f"m={m} Hv={Hv} dk={dk} dv={dv}", gdn_preview_k.gdn_preview, gdn_ref.gdn_preview,
               args, moved, {"tokens": m})


def bench_moe():
    H, E, I, topk = DIMS["H"], DIMS["E"], DIMS["I"], DIMS["topk"]
    g = torch.Generator(device="cpu").manual_seed(2)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(DEVICE, DTYPE)
    down = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(DEVICE, DTYPE)
    for T in SHAPES["moe"]:
        x = torch.randn(T, H, generator=g).to(DEVICE, DTYPE)
        ids = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(T)]).to(DEVICE)
        w = torch.softmax(torch.randn(T, topk, generator=g), -1).to(DEVICE)
        hit = int(torch.unique(ids).numel())
        expert_bytes = (2 * I * H + H * I) * gate_up.element_size()
        moved = 2 * nbytes(x) + nbytes(ids, w) + hit * expert_bytes
        record("moe_experts", f"T={T} k={topk} E={E} hit={hit}", moe_k.moe_experts, moe_ref.moe_experts,
               (x, ids, w, gate_up, down), moved, {"experts_hit": hit, "tokens": T})


def device_name():
    if DEVICE == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu-interpreter ({platform.processor() or platform.machine()})"


def print_table():
    head = f"{'op':<15} {'shape':<34} {'triton us':>10} {'torch us':>10} {'speedup':>8} {'GB/s':>8} {'roof%':>6} {'max dev':>9}"
    print(head)
    print("-" * len(head))
    for r in ROWS:
        if "triton_error" in r:
            print(f"{r['op']:<15} {r['shape']:<34} ERROR {r['triton_error']}")
            continue
        tt = r["triton_s"] * 1e6
        tr = r.get("torch_s")
        print(f"{r['op']:<15} {r['shape']:<34} {tt:>10.1f} {tr * 1e6 if tr else float('nan'):>10.1f} "
              f"{tr / r['triton_s'] if tr else float('nan'):>8.2f} {r['GB_per_s']:>8.1f} "
              f"{100 * r['roofline_frac']:>6.1f} {r.get('max_dev_vs_ref', float('nan')):>9.2e}")
        if "fla_delta_rule_only_s" in r:
            print(f"{'':<15} {'  fla chunk_gated_delta_rule (rule only)':<34} {r['fla_delta_rule_only_s'] * 1e6:>10.1f}"
                  f"   max dev vs ours: o {r.get('fla_max_dev_vs_ours', float('nan')):.2e}, "
                  f"state {r.get('fla_state_max_dev_vs_ours', float('nan')):.2e}")
        for key in ("torch_error", "fla_error"):
            if key in r:
                print(f"{'':<15}   {key}: {r[key]}")


def count_steps():
    """Kernels per layer per forward of the static steps (AR, preview, fused, coreset previews) on
    the embedded model: the table of bench/step_launches.py, its JSON in --out."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("step_launches", Path(__file__).with_name("step_launches.py"))
    step_launches = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_launches)
    path = result_path(ARGS.out, f"step-launches_{STARTED:%Y-%m-%d_%H%M}_{slug(device_name())}", None)
    return step_launches.main(["--json", str(path)])


def main():
    if ARGS.count:
        return count_steps()
    only = {s for s in ARGS.only.split(",") if s}
    benches = {"rms_norm": bench_norms, "gdn_commit": bench_gdn_commit, "gdn_preview": bench_gdn_preview,
               "moe_experts": bench_moe}
    for name, fn in benches.items():
        if not only or name in only or (name == "rms_norm" and "gated_rms_norm" in only):
            fn()
    print(f"device: {device_name()}  dtype: {DTYPE}  torch {torch.__version__}  triton {triton.__version__}")
    if ARGS.interpret:
        print("(interpreter smoke run: times and bandwidths mean nothing)")
    print_table()
    print(f"wrote {write_rows(complete=True)}")
    return 1 if any("triton_error" in r for r in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
