"""Resources and roofline of every Triton kernel compiled for the H200 (sm_90), without a GPU.

Two tables:

1. per kernel x dtype x launch config (everything ``bench/compile_check.py`` compiles at
   the Clover-35B-A3B shapes): registers per thread, spilled bytes, shared memory, and an
   occupancy estimate (resident warps per SM of 64, and what limits them);
2. per op call at the 35B shapes, bf16 (the GPU dtype), kernel by kernel: the bytes an ideal
   launch moves (each tensor once; routed experts: the distinct experts hit, under uniform
   routing E * (1 - (1 - k/E)^(T)), an ASSUMPTION), the FLOPs it executes (recomputation
   included), and the H200 roofline time max(bytes / 4.8 TB/s, FLOPs / peak). Peaks: 790 TFLOP/s
   for bf16/fp16 dots (the MoE kernels), 395 for tf32 dots (the GDN kernels' fp32 tiles), 67 for
   kernels without dots (CUDA cores, fp32).

``--triton 3.6.0`` compiles everything again under that Triton version (the H200 image's) in a
throwaway venv that sees this environment's torch and clover_kernels, and shows both side by side,
so a kernel that needs a newer Triton (or spills only under the older ptxas) is known before the
GPU run. ``--costs-only`` skips compiling (table 2 only; used by bench/gpu_check.sh).

    python bench/kernel_report.py [--json FILE] [--triton 3.6.0] [--jobs N] [--costs-only]
    python bench/kernel_report.py --costs-only --measured OUT/kernels_*.json   # GPU figures beside it
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:  # compile_check.py, the sm_90 gate, and result_file.py live beside this script
    sys.path.insert(0, str(BENCH))

from result_file import write_json  # noqa: E402

HBM_BYTES_PER_S = 4.8e12
PEAK_FLOPS = {"bf16_dot": 790e12, "tf32_dot": 395e12, "fp32": 67e12}  # H200 (SXM), dense
# the op calls of table 2 (tokens per call), also the shapes of bench/bench_kernels.py, so the GPU
# check can set its measured times beside these
COST_ROWS = dict(rms_norm=[1, 32, 4096], gated_rms_norm=[1, 32, 4096], gdn_commit=[1, 32, 64, 2048, 8192],
                 gdn_preview=[32, 64], moe_experts=[1, 8, 32, 64, 1024, 8192], cache_attention=[1, 32, 64])


def _shape(args, name):
    return args[name]["shape"]


def _es(args, name):
    return {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4, "int64": 8}[args[name]["dtype"]]


def _numel(args, name):
    n = 1
    for s in _shape(args, name):
        n *= s
    return n


def _nbytes(args, *names):
    return sum(_numel(args, n) * _es(args, n) for n in names)


def expected_distinct(E, k, T):
    return E * (1 - (1 - k / E) ** T)


def cost(kernel: str, a: dict) -> tuple[float, float, str]:
    """(bytes, FLOPs, peak key) of one launch, from its captured arguments (shapes, constexprs)."""
    if kernel == "_rms_norm_kernel":
        rows, n = _shape(a, "x_ptr")[0], a["N"]
        return _nbytes(a, "x_ptr", "out_ptr", "w_ptr"), 4 * rows * n, "fp32"
    if kernel == "_gated_rms_norm_kernel":
        rows, n = _shape(a, "x_ptr")[0], a["N"]
        return _nbytes(a, "x_ptr", "gate_ptr", "out_ptr", "w_ptr"), 9 * rows * n, "fp32"
    if kernel == "_conv_silu_kernel":
        B, T, C = _shape(a, "mixed_ptr")
        return _nbytes(a, "mixed_ptr", "ring_ptr", "cw_ptr", "act_ptr", "new_ring_ptr"), B * T * C * (2 * a["K"] + 5), "fp32"
    if kernel == "_recurrent_kernel":
        B, T, _ = _shape(a, "act_ptr")
        Hv, dk, dv = a["HV"], a["DK"], a["DV"]
        moved = _nbytes(a, "act_ptr", "g_ptr", "beta_ptr", "s0_ptr", "o_ptr", "sT_ptr")
        return moved, B * T * Hv * 8 * dk * dv, "fp32"
    if kernel == "_chunk_prep_kernel":
        B, T, C = _shape(a, "act_ptr")
        Hv, dk, dv, BT = a["HV"], a["DK"], a["DV"], a["BT"]
        kv = B * T * (C - a["KEY_DIM"]) * _es(a, "act_ptr")  # the k and v parts of act
        moved = kv + _nbytes(a, "g_ptr", "beta_ptr", "w_ptr", "u_ptr", "G_ptr")
        chunks = -(-T // BT)
        flops = B * Hv * chunks * (2 * BT * BT * (2 * dk + dv) + 2 * BT ** 3)  # A, u, w; substitution
        return moved, flops, "tf32_dot" if a["PREC"] != "ieee" else "fp32"
    if kernel == "_chunk_fwd_kernel":
        B, T, _ = _shape(a, "act_ptr")
        Hv, dk, dv, BT, BV = a["HV"], a["DK"], a["DV"], a["BT"], a["BV"]
        qk = B * T * 2 * a["KEY_DIM"] * _es(a, "act_ptr")
        moved = qk + _nbytes(a, "w_ptr", "u_ptr", "G_ptr", "s0_ptr", "o_ptr", "sT_ptr")
        chunks, tiles = -(-T // BT), -(-dv // BV)
        per_tile = 2 * BT * dk * BV * 3 + 2 * BT * BT * dk + 2 * BT * BT * BV  # wS, qS, k^T v; qk^T; Pv
        return moved, B * Hv * chunks * tiles * per_tile, "tf32_dot" if a["PREC"] != "ieee" else "fp32"
    if kernel == "_preview_kernel":
        B, m, C = _shape(a, "mixed_ptr")
        Hv, dk, dv, BV, K = a["HV"], a["DK"], a["DV"], a["BV"], a["K"]
        moved = _nbytes(a, "mixed_ptr", "ring_ptr", "cw_ptr", "rw_ptr", "s0_ptr", "o_ptr", "p_ptr")
        if a["RETURN_H"]:
            moved += _nbytes(a, "h_ptr")
        tiles = -(-dv // BV)
        conv = 2 * (2 * K - 1) * m * (2 * dk + BV)
        per_tile = conv + 2 * m * dk * BV + 2 * m * m * dk + 2 * m * m * BV
        return moved, B * Hv * tiles * per_tile, "tf32_dot" if a["PREC"] != "ieee" else "fp32"
    if kernel in ("_gate_up_kernel", "_down_kernel"):
        E = _shape(a, "gu_ptr" if kernel == "_gate_up_kernel" else "dn_ptr")[0]
        P, H, I = a["P"], a["H"], a["I"]
        topk = a.get("TOPK") or 8
        T = P // topk
        hit = expected_distinct(E, topk, T)
        peak = "bf16_dot" if a.get("PREC") != "ieee" else "fp32"
        if kernel == "_gate_up_kernel":
            es = _es(a, "gu_ptr")
            return hit * 2 * I * H * es + T * H * es + P * I * es + _nbytes(a, "pair_ptr", "blk_e_ptr"), 2 * P * H * 2 * I, peak
        es = _es(a, "dn_ptr")
        return hit * H * I * es + P * I * es + P * H * 4 + _nbytes(a, "wt_ptr", "pair_ptr", "blk_e_ptr"), 2 * P * I * H, peak
    if kernel == "_split_kv_kernel":  # a full buffer of live keys (the capture has no length): K,V once per row tile
        B, Hq, T, D = _shape(a, "q_ptr")
        _, Hkv, L, _ = _shape(a, "k_ptr")
        tiles = -(-a["ROWS"] // a["BLOCK_M"])
        moved = _nbytes(a, "q_ptr", "last_ptr") + tiles * 2 * B * Hkv * L * D * _es(a, "k_ptr") + \
            a["SPLITS"] * B * Hq * T * (D + 2) * 4
        return moved, 4 * B * Hq * T * L * D, "bf16_dot"
    if kernel == "_combine_kernel":  # the slices' partials read back, the gate read, the output written
        R, D = a["R"], a["D"]
        return a["SPLITS"] * R * (D + 2) * 4 + 2 * R * D * _es(a, "gate_ptr"), a["SPLITS"] * R * D * 3, "fp32"
    raise KeyError(kernel)


def cost_table(report: dict) -> list[dict]:
    """Table 2 rows from the captured bf16 launches of COST_ROWS."""
    import compile_check as cc

    d = cc.discover()
    launches, _, _ = cc.capture_35b(d, ("bf16",), rows=COST_ROWS)
    calls, buffer = {}, ""
    for l in (l for l in launches if l.op in COST_ROWS):  # table 2's ops: the others are captured whole
        a = dict(l.args, **{k: v for k, v in cc._constexpr_names(l).items()})
        try:
            moved, flops, peak = cost(l.kernel, a)
        except KeyError:
            moved, flops, peak = None, None, None
        if l.op == "rms_norm":  # the decoder norms [T, hidden] and the q/k norms [T * heads, head_dim]
            variant = "x".join(str(s) for s in l.args["x_ptr"]["shape"])
        elif l.op == "cache_attention":  # one call per buffer size; the combine follows its split kernel
            if "k_ptr" in l.args:
                buffer = f"{l.args['k_ptr']['shape'][2]} keys"
            variant = buffer
        else:
            variant = "+history" if l.args.get("RETURN_H") else ""
        call = calls.setdefault((l.op, l.rows, variant), dict(op=l.op, rows=l.rows, shape=variant, kernels=[]))
        row = dict(kernel=l.kernel, bytes=moved, flops=flops, peak=peak)
        if moved is not None:
            t = max(moved / HBM_BYTES_PER_S, flops / PEAK_FLOPS[peak])
            row.update(roofline_us=t * 1e6, bound="memory" if moved / HBM_BYTES_PER_S >= flops / PEAK_FLOPS[peak]
                       else "compute")
        call["kernels"].append(row)
    out = []
    for call in calls.values():
        ks = call["kernels"]
        if all(k["bytes"] is not None for k in ks):
            call.update(bytes=sum(k["bytes"] for k in ks), flops=sum(k["flops"] for k in ks),
                        roofline_us=sum(k["roofline_us"] for k in ks))
        out.append(call)
    report["cost_model_missing"] = sorted({k["kernel"] for c in out for k in c["kernels"] if k["bytes"] is None})
    return out


def other_triton(version: str, jobs: int, venv: str | None) -> dict:
    """compile_check under Triton ``version``, in a venv that adds only that triton."""
    import site

    root = Path(venv) if venv else Path(tempfile.mkdtemp(prefix=f"triton-{version}-"))
    py = root / "bin" / "python"
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, capture_output=True, text=True)
        got = subprocess.run([str(py), "-c", "import triton; print(triton.__version__)"], capture_output=True, text=True)
        if got.stdout.strip() != version:
            pip = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", f"triton=={version}"],
                                 capture_output=True, text=True)
            if pip.returncode:
                return dict(version=version, error=f"pip install triton=={version} failed: "
                            + (pip.stderr.strip().splitlines() or ["?"])[-1])
        # this environment's site-packages after the venv's own: its torch and clover_kernels,
        # with the venv's triton found first
        (Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()) / "zz_parent_env.pth"
         ).write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in site.getsitepackages()))
        out = root / "compile.json"
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CLOVER_KERNELS",
                                                                 "TRITON_CACHE_DIR", "PYTHONPATH")}
        run = subprocess.run([str(py), "-W", "ignore", str(BENCH / "compile_check.py"), "--json", str(out),
                              "--quiet", "--jobs", str(jobs)], capture_output=True, text=True, env=env)
        if run.returncode not in (0, 1) or not out.exists():
            return dict(version=version, error=f"compile_check under triton {version} failed (rc {run.returncode}): "
                        + (run.stdout + run.stderr).strip()[-1500:])
        report = json.loads(out.read_text())
        if report.get("triton") != version:
            return dict(version=version, error=f"the venv imported triton {report.get('triton')}, not {version}")
        return report
    except (OSError, subprocess.CalledProcessError) as exc:
        return dict(version=version, error=f"{type(exc).__name__}: {exc}")
    finally:
        if not venv:
            shutil.rmtree(root, ignore_errors=True)


def _case_key(row):
    return (row["kernel"], row["dtype"], json.dumps(row["config"], sort_keys=True), tuple(row["rows"]))


def _res(row):
    r = row.get("result") or {}
    if "error" in r:
        return "ERROR"
    spill = r["spill_store_bytes"] + r["spill_load_bytes"]
    return f"{r['regs']:>3} {spill:>5} {r['shared_bytes'] / 1024:>6.1f}"


def print_resources(report: dict, other: dict | None) -> None:
    print(f"Triton {report['triton']} ({report['ptxas']}) -> sm_{report['target'][1]}, shared memory limit "
          f"{report['smem_limit_bytes'] // 1024} KB per block")
    o_rows = {_case_key(r): r for r in (other or {}).get("cases", [])}
    head = f"{'kernel':<23} {'dt':<4} {'config':<58} {'rows':<13} {'regs spill smemKB':>18} {'warps/SM':>8} {'limit':<10}"
    if other and "cases" in other:
        head += f" | {'Triton ' + other['triton']:>18}"
    print(head + "\n" + "-" * len(head))
    for row in report["cases"]:
        cfg = row["config"]
        short = ",".join(f"{k}={v}" for k, v in cfg.items() if k in ("BT", "BV", "BM", "BN", "BK", "BC", "BLOCK",
                                                                     "RETURN_H", "num_warps", "num_stages"))
        rows = row["rows"]
        span = str(rows[0]) if len(rows) == 1 else f"{rows[0]}..{rows[-1]}"
        r = row.get("result", {})
        occ = f"{r.get('warps_per_sm', '-'):>8} {r.get('limited_by', ''):<10}" if "regs" in r else f"{'-':>8} {'':<10}"
        line = f"{row['kernel']:<23} {row['dtype']:<4} {short:<58} {span:<13} {_res(row):>18} {occ}"
        if other and "cases" in other:
            o = o_rows.get(_case_key(row))
            line += f" | {_res(o) if o else 'not compiled':>18}"
        if row.get("failures") or (other and (o_rows.get(_case_key(row)) or {}).get("failures")):
            line += "  <- FAIL"
        print(line)
    if other and "error" in other:
        print(f"\nTriton {other['version']}: NOT CHECKED: {other['error']}")


def print_costs(calls: list[dict]) -> None:
    print(f"\nroofline per op call at the 35B shapes, bf16 (H200: {HBM_BYTES_PER_S / 1e12:.1f} TB/s; "
          f"routed experts hit: uniform routing)")
    head = f"{'op':<15} {'rows':>5} {'shape':<9} {'kernel':<23} {'MB':>9} {'GFLOP':>8} {'roof us':>8} {'bound':<7}"
    print(head + "\n" + "-" * len(head))
    for c in calls:
        for i, k in enumerate(c["kernels"]):
            lead = f"{c['op']:<15} {c['rows']:>5} {c['shape']:<9}" if i == 0 else f"{'':<15} {'':>5} {'':<9}"
            if k["bytes"] is None:
                print(f"{lead} {k['kernel']:<23} no cost model")
                continue
            print(f"{lead} {k['kernel']:<23} {k['bytes'] / 1e6:>9.3f} {k['flops'] / 1e9:>8.3f} "
                  f"{k['roofline_us']:>8.2f} {k['bound']:<7}")
        if len(c["kernels"]) > 1 and "roofline_us" in c:
            print(f"{'':<15} {'':>5} {'':<9} {'= total':<23} {c['bytes'] / 1e6:>9.3f} {c['flops'] / 1e9:>8.3f} "
                  f"{c['roofline_us']:>8.2f}")


def _summary(report: dict) -> dict:
    """The compile report without its per-launch list and signatures (python
    bench/compile_check.py --json writes those)."""
    out = {k: v for k, v in report.items() if k != "launches"}
    if "cases" in out:
        out["cases"] = [{k: v for k, v in row.items() if k not in ("signature", "attrs")} for row in out["cases"]]
    return out


def print_beside(calls: list[dict], measured_path: str) -> None:
    """bench/bench_kernels.py's measured times (a GPU run) beside this roofline, op by op."""
    bench = json.loads(Path(measured_path).read_text())
    by = {(c["op"], c["rows"]): c for c in calls if c["shape"] in ("", f"{c['rows']}x2048")}
    if bench.get("interpret") or (bench.get("dims") or {}).get("H") != 2048:
        by = {}  # a smoke run at toy shapes: nothing to set beside the 35B roofline
    print(f"\nmeasured on {bench.get('device')} ({bench.get('dtype')}, triton {bench.get('triton')}) beside the "
          f"H200 roofline")
    head = f"{'op':<15} {'shape':<34} {'measured us':>11} {'roof us':>8} {'x roof':>7} {'torch us':>9} {'max dev':>9}"
    print(head + "\n" + "-" * len(head))
    for r in bench.get("rows", []):
        c = by.get((r["op"], r.get("tokens")))
        roof = c.get("roofline_us") if c else None
        if "triton_error" in r:
            print(f"{r['op']:<15} {r['shape']:<34} ERROR {r['triton_error'][:80]}")
            continue
        t = r["triton_s"] * 1e6
        print(f"{r['op']:<15} {r['shape']:<34} {t:>11.1f} {roof if roof else float('nan'):>8.1f} "
              f"{t / roof if roof else float('nan'):>7.1f} {r.get('torch_s', float('nan')) * 1e6:>9.1f} "
              f"{r.get('max_dev_vs_ref', float('nan')):>9.2e}")
        if "fla_delta_rule_only_s" in r:
            print(f"{'':<15} {'  fla chunk_gated_delta_rule':<34} {r['fla_delta_rule_only_s'] * 1e6:>11.1f} "
                  f"{'':>8} {'':>7} {'':>9} {r.get('fla_max_dev_vs_ours', float('nan')):>9.2e}")
        elif "fla_error" in r:
            print(f"{'':<15}   fla: {r['fla_error'][:90]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the report here")
    p.add_argument("--triton", help="also compile under this Triton version, in a throwaway venv (e.g. 3.6.0)")
    p.add_argument("--venv", help="with --triton: keep and reuse this venv instead of a throwaway one")
    p.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument("--costs-only", action="store_true", help="table 2 only, no compiling")
    p.add_argument("--measured", help="with --costs-only: a bench_kernels.py JSON to show beside the roofline")
    args = p.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: the compiler, not the interpreter
    import compile_check as cc

    if args.costs_only:
        report = dict(triton=__import__("triton").__version__)
    else:
        try:
            report = cc.run_check(jobs=args.jobs)
        except cc.CudaBackendMissing as exc:
            print(f"kernel_report: Triton cannot compile for CUDA here: {exc}")
            return 77
    other = other_triton(args.triton, args.jobs, args.venv) if args.triton else None
    calls = cost_table(report)
    if not args.costs_only:
        print_resources(report, other)
    if args.measured:
        print_beside(calls, args.measured)
    else:
        print_costs(calls)
    result = dict(benchmark="kernel_report", date=dt.date.today().isoformat(), computed_on="cpu (no GPU)",
                  target="sm_90 (H200)", python=platform.python_version(), hbm_bytes_per_s=HBM_BYTES_PER_S,
                  peak_flops=PEAK_FLOPS, cost_rows=COST_ROWS, compile=_summary(report), costs=calls)
    if other is not None:
        result["other_triton"] = _summary(other)
    if args.json:
        print(f"wrote {write_json(args.json, result, indent=None, default=str)}")
    failed = not args.costs_only and not report.get("ok")
    if other is not None and ("error" in other or not other.get("ok")):
        print(f"kernel_report: under Triton {args.triton}: " + (other.get("error") or "failures (marked above)"))
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
