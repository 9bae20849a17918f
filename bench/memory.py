"""Peak memory (RSS) of loading and generating: the embedded model and a ~2B-parameter random bf16
checkpoint. Each measurement runs in a fresh process; the table shows peak RSS against the
checkpoint's size: (peak after generating - RSS before loading) / checkpoint, once every weight
has been used. A loader that held two copies of the weights would show a ratio near 2. Weights
load memory-mapped, so right after loading little is resident yet. Each model is measured again
with ``model.pack_weights()`` (a second, oneDNN-layout copy of the GEMM weights, opt-in), to show
what that costs.

    python bench/memory.py [--big-layers 8] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from result_file import DATE, RESULTS, stamp, write_result

CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(2)
from clover_lab import load
def status_mb(key):  # VmHWM: this process's peak RSS (ru_maxrss would carry the parent's over a fork)
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
def peak_mb():
    return status_mb("VmHWM")
start = status_mb("VmRSS")
t = time.perf_counter()
engine = load(sys.argv[1])
load_s = time.perf_counter() - t
after_load = peak_mb()
packed_mb = engine.model.pack_weights() / 2**20 if sys.argv[2:] == ["pack"] else 0.0
engine.mask_token_id = engine.mask_token_id if engine.mask_token_id is not None else engine.model.config.vocab_size - 1
prompt = list(range(5, 69))
for mode in ("ar", "diffusion"):
    engine.generate(prompt, mode=mode, max_new_tokens=32, **({} if mode == "ar" else {"threshold": 0.9}))
print(json.dumps({"baseline_mb": start, "after_load_mb": after_load, "after_generate_mb": peak_mb(),
                  "load_seconds": load_s, "dtype": str(engine.model.dtype), "packed_mb": packed_mb}))
"""


def checkpoint_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20


def measure(path: Path, pack: bool = False) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)] + (["pack"] if pack else []),
                         capture_output=True, text=True, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["checkpoint_mb"] = checkpoint_mb(path)
    row["params"] = None
    return row


def make_big(path: Path, layers: int) -> Path:
    import torch

    from clover_lab import CloverConfig, CloverModel

    config = CloverConfig.preset("clover-35b-a3b", num_hidden_layers=layers, num_experts=64, vocab_size=32000,
                                 mask_token_id=31999)
    model = CloverModel.random(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    del model
    return path, n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big-layers", type=int, default=8, help="layers of the random bf16 checkpoint (8: ~2B)")
    ap.add_argument("--keep", default=None, help="keep the random checkpoint in this directory")
    ap.add_argument("--skip-big", action="store_true", help="only the embedded model")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    from clover_lab.checkpoint.loading import default_model_dir

    rows = []
    small = default_model_dir()
    if small is not None:
        rows += [{"model": small.name + (", packed" if pack else ""), **measure(small, pack)} for pack in (False, True)]
    if not args.skip_big:
        with tempfile.TemporaryDirectory() as tmp:
            big_dir, n = make_big(Path(args.keep or tmp) / "random-2b", args.big_layers)
            rows += [{"model": f"random bf16, {n / 1e9:.2f}B params" + (", packed" if pack else ""),
                      **measure(big_dir, pack), "params": n} for pack in (False, True)]
    print(f"\n{'model':34} {'checkpoint MB':>14} {'RSS before':>11} {'peak after load':>16} "
          f"{'peak after generate':>20} {'used / ckpt':>12} {'load s':>7}")
    for r in rows:
        grown = r["after_generate_mb"] - r["baseline_mb"]
        print(f"{r['model']:34} {r['checkpoint_mb']:14.0f} {r['baseline_mb']:11.0f} {r['after_load_mb']:16.0f} "
              f"{r['after_generate_mb']:20.0f} "
              f"{grown / r['checkpoint_mb']:12.2f} {r['load_seconds']:7.1f}")
    day = stamp(DATE)
    write_result(args.out, f"memory-cpu-{day}{'-small' if args.skip_big else ''}",
                 {"date": day, "device": "cpu", "rows": rows}, None, indent=2)


if __name__ == "__main__":
    main()
