#!/usr/bin/env bash
# The GPU check of the kernel core, offline, in under 5 minutes on one H200:
#   1. install the project (editable, no deps, no network),
#   2. the kernel tests on CUDA (real Triton compilation, no interpreter, CLOVER_KERNELS unset),
#      and the CUDA-graph tests (tests/test_graphs.py),
#      in parallel pytest processes (compilation dominates a cold run),
#   3. bench/bench_kernels.py (table + JSON),
#   4. bench/bench_e2e.py when it exists, with the time that is left.
# Everything goes to OUTDIR: env.txt, install.log, tests_*.log/xml, bench_*.log, *.json, summary.txt.
#
#   bench/gpu_check.sh OUTDIR        (PYTHON=... to choose the interpreter)
set -uo pipefail

if [ $# -ne 1 ]; then
    echo "usage: bench/gpu_check.sh OUTDIR" >&2
    exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python}
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-285}   # seconds for the whole check
unset CLOVER_KERNELS TRITON_INTERPRET
export PYTHONDONTWRITEBYTECODE=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
: > "$OUT/summary.txt"

{
    date -Is
    nvidia-smi || true
    "$PY" -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
    "$PY" -c "import triton; print('triton', triton.__version__)"
    "$PY" -c "import fla; print('fla', fla.__version__)" 2>/dev/null || echo "fla not installed"
} > "$OUT/env.txt" 2>&1

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    say "no CUDA device: nothing to check (see $OUT/env.txt)"
    exit 2
fi

"$PY" -m pip install --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1
say "install: rc=$? ($(( $(date +%s) - START ))s)"

# 2. kernel tests: a cold run is dominated by Triton compilation, so every test file is split
#    by dtype into its own pytest process (about 20 processes for 16 cores)
RC_TESTS=0
if "$PY" -c "import pytest" 2>/dev/null; then
    T_LIMIT=$(( $(left) * 55 / 100 ))
    pids=(); names=()
    for f in tests/kernels/test_*.py; do
        base=$(basename "$f" .py)
        for part in fp32 fp16 bf16 other; do
            case $part in
                fp32) sel="float32" ;;
                fp16) sel="float16 and not bfloat16" ;;
                bf16) sel="bfloat16" ;;
                other) sel="not float32 and not float16 and not bfloat16" ;;
            esac
            name="${base}_${part}"
            timeout "$T_LIMIT" "$PY" -m pytest "$f" -q -p no:cacheprovider -rfE -k "$sel" \
                --junitxml="$OUT/tests_$name.xml" > "$OUT/tests_$name.log" 2>&1 &
            pids+=($!); names+=("$name")
        done
    done
    # the CUDA-graph fast path (clover_lab.engine.runner): captured replays against eager static steps
    timeout "$T_LIMIT" "$PY" -m pytest tests/test_graphs.py -q -p no:cacheprovider -rfE \
        --junitxml="$OUT/tests_graphs.xml" > "$OUT/tests_graphs.log" 2>&1 &
    pids+=($!); names+=("graphs")
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}"; rc=$?
        [ $rc -eq 5 ] && rc=0  # nothing selected in this part
        [ $rc -ne 0 ] && RC_TESTS=1
        say "tests ${names[$i]}: rc=$rc  $(tail -n 1 "$OUT/tests_${names[$i]}.log")"
    done
else
    RC_TESTS=1
    say "tests: pytest is not installed here"
fi
say "tests done at $(( $(date +%s) - START ))s"

# 3. kernel benchmarks
B_LIMIT=$(( $(left) * 60 / 100 ))
timeout "$B_LIMIT" "$PY" bench/bench_kernels.py --out "$OUT" --repeat 30 > "$OUT/bench_kernels.log" 2>&1
RC_BENCH=$?
say "bench_kernels: rc=$RC_BENCH (limit ${B_LIMIT}s, done at $(( $(date +%s) - START ))s)"

# 4. end-to-end benchmark, when there is one
RC_E2E=0
if [ -f bench/bench_e2e.py ]; then
    E_LIMIT=$(( $(left) - 5 ))
    if [ "$E_LIMIT" -gt 20 ]; then
        E_ARGS=()
        if "$PY" bench/bench_e2e.py --help 2>/dev/null | grep -q -- "--out"; then E_ARGS=(--out "$OUT"); fi
        timeout "$E_LIMIT" "$PY" bench/bench_e2e.py "${E_ARGS[@]}" > "$OUT/bench_e2e.log" 2>&1
        RC_E2E=$?
        say "bench_e2e: rc=$RC_E2E (limit ${E_LIMIT}s)"
    else
        say "bench_e2e: skipped, ${E_LIMIT}s left"
    fi
else
    say "bench_e2e: bench/bench_e2e.py not present"
fi

say "total $(( $(date +%s) - START ))s; tests rc=$RC_TESTS bench rc=$RC_BENCH e2e rc=$RC_E2E"
[ $RC_TESTS -eq 0 ] && [ $RC_BENCH -eq 0 ] && [ $RC_E2E -eq 0 ]
