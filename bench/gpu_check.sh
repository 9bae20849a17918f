#!/usr/bin/env bash
# The GPU check, offline, in under 8 minutes on one H200 (torch 2.11, triton 3.6, Python 3.12):
#   0. no CUDA: one line, exit 2, nothing else runs;
#   1. install the project (editable, no deps, no network) and any wheels carried in .whl/
#      (flash-linear-attention for the comparison);
#   2. the kernel tests on CUDA (real Triton compilation, no interpreter, CLOVER_KERNELS unset) and
#      the CUDA-graph tests (tests/test_graphs.py), in parallel pytest processes; meanwhile, on the
#      CPU, the roofline plan (bench/roofline.py) and the kernels' roofline (bench/kernel_report.py);
#   3. bench/bench_kernels.py at the 35B shapes (fla's chunked gated delta rule against ours when
#      fla imports), then its times beside the kernels' roofline;
#   4. bench/bench_e2e.py at the 35B shapes, random bf16 weights (~70 GB), with the time left.
# Everything goes to OUTDIR: env.txt, install.log, tests_*.log/xml, *.log, *.json, summary.txt
# (the one screen to read first).
#
#   bench/gpu_check.sh OUTDIR        (PYTHON=... to choose the interpreter, GPU_CHECK_BUDGET_S=...)
set -uo pipefail

if [ $# -ne 1 ]; then
    echo "usage: bench/gpu_check.sh OUTDIR" >&2
    exit 2
fi
HERE=$(cd "$(dirname "$0")/.." && pwd)
# the interpreter: $PYTHON, else the checkout's .venv (a development machine), else python on PATH
PY=${PYTHON:-}
[ -z "$PY" ] && [ -x "$HERE/.venv/bin/python" ] && PY="$HERE/.venv/bin/python"
[ -z "$PY" ] && PY=$(command -v python || command -v python3)
# 0. before anything else: a machine without CUDA stops here, at once, with one line
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" >/dev/null 2>&1
case $? in
    0) ;;
    3) echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing checked"; exit 2 ;;
    *) echo "gpu_check: no CUDA device here (torch is not importable by ${PY:-python}): nothing checked"; exit 2 ;;
esac

mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
cd "$HERE" || exit 2
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-450}   # seconds for the whole check (8 minutes, less a margin)
unset CLOVER_KERNELS TRITON_INTERPRET
export PYTHONDONTWRITEBYTECODE=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET - $(elapsed) )); }
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
: > "$OUT/summary.txt"

{
    date -Is
    nvidia-smi || true
    "$PY" -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda); print('device', torch.cuda.get_device_name())"
    "$PY" -c "import triton; print('triton', triton.__version__)"
} > "$OUT/env.txt" 2>&1
say "gpu_check on $("$PY" -c "import torch; print(torch.cuda.get_device_name())" 2>/dev/null), torch $("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null), triton $("$PY" -c "import triton; print(triton.__version__)" 2>/dev/null)"

# 1. install
"$PY" -m pip install --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1
RC_INSTALL=$?
if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (fla and what it needs), offline
    "$PY" -m pip install --no-deps --no-index .whl/*.whl >> "$OUT/install.log" 2>&1 || RC_INSTALL=1
fi
FLA=$("$PY" -c "import fla; print(fla.__version__)" 2>/dev/null || echo "not importable")
say "install rc=$RC_INSTALL ($(elapsed)s); fla: $FLA"

# CPU side, in the background while the GPU tests run: the plan the GPU figures are read against
"$PY" bench/roofline.py --json "$OUT/roofline.json" > "$OUT/roofline.log" 2>&1 &
PID_ROOF=$!

# 2. tests: a cold run is dominated by Triton compilation, so every kernel test file is split by
#    dtype into its own pytest process (about 20 processes for 16 cores). test_compile_sm90.py is
#    the CPU-side gate (bench/kernel_report.py --triton covers this image's Triton there).
RC_TESTS=0
T_LIMIT=$(( $(left) * 40 / 100 ))
pids=(); names=()
for f in tests/kernels/test_*.py; do
    base=$(basename "$f" .py)
    [ "$base" = test_compile_sm90 ] && continue
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
declare -A FILE_RC FILE_PASSED FILE_FAILED
for i in "${!pids[@]}"; do
    wait "${pids[$i]}"; rc=$?
    [ $rc -eq 5 ] && rc=0  # nothing selected in this part
    [ $rc -ne 0 ] && RC_TESTS=1
    file=${names[$i]%_*}; [ "${names[$i]}" = graphs ] && file=graphs
    last=$(tail -n 1 "$OUT/tests_${names[$i]}.log")  # pytest's "N passed, M failed, K errors in ..."
    p=$(grep -oE '[0-9]+ passed' <<< "$last" | grep -oE '[0-9]+')
    FILE_PASSED[$file]=$(( ${FILE_PASSED[$file]:-0} + ${p:-0} ))
    for f in $(grep -oE '[0-9]+ (failed|errors?)' <<< "$last" | grep -oE '[0-9]+'); do
        FILE_FAILED[$file]=$(( ${FILE_FAILED[$file]:-0} + f ))
    done
    [ $rc -ne 0 ] && FILE_RC[$file]="rc=$rc in ${names[$i]}"
done
while read -r file; do
    say "tests $file: ${FILE_PASSED[$file]} passed, ${FILE_FAILED[$file]:-0} failed ${FILE_RC[$file]:-}"
done < <(printf '%s\n' "${!FILE_PASSED[@]}" | sort)
say "tests done at $(elapsed)s (limit ${T_LIMIT}s per process; logs tests_*.log)"

# 3. kernel benchmarks, then beside the roofline of each kernel call
B_LIMIT=$(( $(left) * 35 / 100 ))
timeout "$B_LIMIT" "$PY" bench/bench_kernels.py --out "$OUT" --repeat 30 > "$OUT/bench_kernels.log" 2>&1
RC_BENCH=$?
say "bench_kernels: rc=$RC_BENCH (limit ${B_LIMIT}s, done at $(elapsed)s)"
KJSON=$(ls -t "$OUT"/kernels_*.json 2>/dev/null | head -n 1)
if [ -n "$KJSON" ]; then
    "$PY" bench/kernel_report.py --costs-only --measured "$KJSON" --json "$OUT/kernel_roofline.json" \
        > "$OUT/kernels_vs_roofline.log" 2>&1
    sed -n '/^measured on/,/^wrote/p' "$OUT/kernels_vs_roofline.log" | grep -v '^wrote' | tee -a "$OUT/summary.txt"
fi

# 4. end-to-end at the 35B shapes (random bf16 weights on the GPU)
RC_E2E=0
E_LIMIT=$(( $(left) - 5 ))
if [ "$E_LIMIT" -gt 30 ]; then
    timeout "$E_LIMIT" "$PY" bench/bench_e2e.py --out "$OUT" > "$OUT/bench_e2e.log" 2>&1
    RC_E2E=$?
    say "bench_e2e: rc=$RC_E2E (limit ${E_LIMIT}s)"
    sed -n '/^step /,/^wrote/p' "$OUT/bench_e2e.log" | grep -v '^wrote' | tee -a "$OUT/summary.txt"
else
    RC_E2E=1
    say "bench_e2e: skipped, only ${E_LIMIT}s left"
fi
wait "$PID_ROOF" 2>/dev/null
say "H200 roofline plan (bench/roofline.py, uniform routing; e2e above counts the experts really hit):"
grep -E '^(AR step|preview 32|commit\+preview)' "$OUT/roofline.log" | tee -a "$OUT/summary.txt"

say "total $(elapsed)s; install rc=$RC_INSTALL tests rc=$RC_TESTS bench rc=$RC_BENCH e2e rc=$RC_E2E"
[ $RC_INSTALL -eq 0 ] && [ $RC_TESTS -eq 0 ] && [ $RC_BENCH -eq 0 ] && [ $RC_E2E -eq 0 ]
