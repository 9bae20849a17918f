#!/usr/bin/env bash
# The GPU check, offline, in under 8 minutes on one H200 (torch 2.11, triton 3.6, Python 3.12).
# Built so that it cannot lose its results: whatever stops it, OUTDIR holds what it had.
#   0. no CUDA: one line, exit 2, nothing else runs;
#   1. install the project (editable, no deps, no network) and any wheels carried in .whl/
#      (flash-linear-attention for the comparison); if the project does not import after that,
#      a fall-back import path (PYTHONPATH: the checkout);
#   2. the CUDA-graph test first, alone in its own process (a failed capture fails it);
#   3. the kernel tests on CUDA (real Triton compilation, CLOVER_KERNELS unset; the FP8 model test
#      on the GPU), one pytest process per file and dtype, beside the other fast-path tests
#      (tests/test_graphs.py less its CPU torch.compile test, which CI runs); meanwhile, on the
#      CPU, the roofline plan (bench/roofline.py) and the kernels' roofline (bench/kernel_report.py);
#   4. bench/bench_kernels.py at the 35B shapes (fla's chunked gated delta rule against ours when
#      fla imports), then its times beside the kernels' roofline;
#   5. bench/bench_mtp.py on the embedded model on CUDA: block diffusion, speculative, AR and AR with
#      the model's own MTP head side by side (tokens per forward, tokens/s, equal to AR or not);
#   6. bench/bench_e2e.py at the 35B shapes, random bf16 weights (~70 GB), with the time left; its
#      CUDA-graph rows say whether the graphs were captured (a failed capture fails the check).
# Every step runs under `timeout -k` with its own limit (the LIMIT_* below); every benchmark writes
# its JSON row by row. Logs, XML and JSON are written to a work folder outside OUTDIR; after every
# step bench/gpu_check_summary.py rewrites OUTDIR/summary.txt (the one screen to read first; its
# verdict in gpu_check.json) and the work folder is packed into OUTDIR/gpu_check.tar.gz: OUTDIR
# never holds more than those two files.
#
#   bench/gpu_check.sh OUTDIR        (PYTHON=... to choose the interpreter, GPU_CHECK_BUDGET_S=...)
#   GPU_CHECK_REHEARSE=FAKEDIR bench/gpu_check.sh OUTDIR
#       the rehearsal, on any machine: no CUDA needed, every step's command replaced by FAKEDIR's
#       canned output (STEP.log, STEP.rc, files in STEP/), the rest (limits, summary, bundle) real;
#       GPU_CHECK_REAL="roofline kernels_vs_roofline" runs those CPU-side steps for real in it;
#       tests/test_gpu_check.py runs both.
set -uo pipefail

if [ $# -ne 1 ]; then
    echo "usage: bench/gpu_check.sh OUTDIR" >&2
    exit 2
fi
HERE=$(cd "$(dirname "$0")/.." && pwd)
REHEARSE=${GPU_CHECK_REHEARSE:-}
# the interpreter: $PYTHON, else the checkout's .venv (a development machine), else python on PATH
PY=${PYTHON:-}
[ -z "$PY" ] && [ -x "$HERE/.venv/bin/python" ] && PY="$HERE/.venv/bin/python"
[ -z "$PY" ] && PY=$(command -v python || command -v python3)
# 0. before anything else: a machine without CUDA stops here, at once, with one line
if [ -z "$REHEARSE" ]; then
    "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" >/dev/null 2>&1
    case $? in
        0) ;;
        3) echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing checked"; exit 2 ;;
        *) echo "gpu_check: no CUDA device here (torch is not importable by ${PY:-python}): nothing checked"; exit 2 ;;
    esac
fi

# Per-step limits, seconds (each step killed 10 s after its TERM); their sum along the critical
# path (install, graphs, tests, bench_kernels, e2e's minimum) fits the budget with a margin; the
# CPU-side steps (roofline, kernels_vs_roofline) run beside the GPU ones.
# tests/test_gpu_check.py holds them against the budget and against measured times.
BUDGET=${GPU_CHECK_BUDGET_S:-480}   # seconds for the whole check (8 minutes)
LIMIT_INSTALL=45                    # pip, editable, offline: seconds
LIMIT_GRAPHS=120                    # one test: a small model's kernels compiled cold, 4 captures
LIMIT_TESTS=150                     # each kernel-test process (about 20 in parallel on 16 cores)
LIMIT_BENCH=60                      # bench_kernels.py, rows written as they come
LIMIT_MTP=30                        # bench_mtp.py: the embedded model's four modes, one round
LIMIT_REPORT=60                     # kernel_report.py --costs-only (no compiling), beside bench_e2e
MIN_E2E=40                          # bench_e2e.py gets the time left, if at least this much
KILL_AFTER=10

mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
WORK=${GPU_CHECK_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}
mkdir -p "$WORK" || exit 2
cd "$HERE" || exit 2
START=$(date +%s)
unset CLOVER_KERNELS TRITON_INTERPRET
export PYTHONDONTWRITEBYTECODE=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET - $(elapsed) )); }
note() { echo "$*" >> "$WORK/steps.txt"; }   # the summary reads these lines
: > "$WORK/steps.txt"
note "budget $BUDGET"

# run_step NAME LIMIT CMD...: CMD under timeout -k, stdout+stderr to WORK/NAME.log; a line
# "step NAME rc=.. seconds=.. limit=.." in steps.txt. The rehearsal replays FAKEDIR's NAME.
run_step() {
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    if [ -n "$REHEARSE" ] && [[ " ${GPU_CHECK_REAL:-} " != *" $name "* ]]; then
        cp "$REHEARSE/$name.log" "$WORK/$name.log" 2>/dev/null || : > "$WORK/$name.log"
        [ -d "$REHEARSE/$name" ] && cp -r "$REHEARSE/$name/." "$WORK/"
        rc=$(cat "$REHEARSE/$name.rc" 2>/dev/null || echo 0)
        [ -f "$REHEARSE/$name.seconds" ] && t0=$(( t0 - $(cat "$REHEARSE/$name.seconds") ))
    else
        timeout -k "$KILL_AFTER" "$limit" "$@" > "$WORK/$name.log" 2>&1
        rc=$?
    fi
    note "step $name rc=$rc seconds=$(( $(date +%s) - t0 )) limit=$limit"
    return "$rc"
}

# bundle: the summary, then the work folder packed (a temporary name, then renamed: OUTDIR
# never holds half a tarball); run after every step and on any exit
bundle() {
    note "elapsed $(elapsed)"
    "$PY" "$HERE/bench/gpu_check_summary.py" "$WORK" > "$WORK/summary.txt" 2> "$WORK/summary.err"
    SUMMARY_RC=$?
    cp "$WORK/summary.txt" "$OUT/summary.txt.tmp" && mv -f "$OUT/summary.txt.tmp" "$OUT/summary.txt"
    tar -czf "$OUT/.gpu_check.tar.gz.tmp" -C "$WORK" . 2>/dev/null && mv -f "$OUT/.gpu_check.tar.gz.tmp" "$OUT/gpu_check.tar.gz"
    return "$SUMMARY_RC"
}
trap 'bundle >/dev/null 2>&1' EXIT
trap 'note "interrupted at $(elapsed)s"; exit 130' INT TERM

if [ -z "$REHEARSE" ]; then
    {
        date -Is
        nvidia-smi || true
        "$PY" -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda); print('device', torch.cuda.get_device_name())"
        "$PY" -c "import triton; print('triton', triton.__version__)"
    } > "$WORK/env.txt" 2>&1
else
    echo "rehearsal: no GPU, canned step outputs from $REHEARSE" > "$WORK/env.txt"
fi

# 1. install, and the import path the rest uses
# (carried wheels in .whl/: fla and what it needs, offline)
run_step install "$LIMIT_INSTALL" bash -c '"$0" -m pip install --no-build-isolation --no-deps -e . &&
    if ls .whl/*.whl >/dev/null 2>&1; then "$0" -m pip install --no-deps --no-index .whl/*.whl; fi' "$PY"
IMPORTS="import clover_lab, clover_kernels, clover_kernels.triton_ops"
if [ -z "$REHEARSE" ] && ! "$PY" -c "$IMPORTS" >> "$WORK/install.log" 2>&1; then
    # the fall-back: the checkout itself (clover_lab/ and clover_kernels/ at its root)
    export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
    if "$PY" -c "$IMPORTS" >> "$WORK/install.log" 2>&1; then note "import_path PYTHONPATH"; else note "import_path broken"; fi
else
    note "import_path installed"
fi
note "fla $("$PY" -c "import fla; print(fla.__version__)" 2>/dev/null || echo "not importable")"
bundle

# CPU side, in the background from here on: the plans the GPU figures are read against
( run_step roofline 120 "$PY" bench/roofline.py --json "$WORK/roofline.json" ) &
PID_ROOF=$!

# 2. the CUDA-graph test, first and alone: nothing else compiles meanwhile, so it cannot be lost
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rfE)
run_step tests_graphs_capture "$LIMIT_GRAPHS" "${PYTEST[@]}" \
    "tests/test_graphs.py::test_cuda_graph_replays_equal_eager" --junitxml="$WORK/tests_graphs_capture.xml"
bundle

# 3. tests: a cold run is dominated by Triton compilation, so every kernel test file is split by
#    dtype into its own pytest process (about 20 processes for 16 cores). test_compile_sm90.py is
#    the CPU-side gate (bench/kernel_report.py --triton covers this image's Triton there).
pids=()
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
        name="tests_${base}_${part}"
        ( run_step "$name" "$LIMIT_TESTS" "${PYTEST[@]}" "$f" -k "$sel" --junitxml="$WORK/$name.xml" ) &
        pids+=($!)
    done
done
# the rest of the fast path on CUDA; its CPU torch.compile test is CI's (it alone outlasts a limit here)
( run_step tests_graphs "$LIMIT_TESTS" "${PYTEST[@]}" tests/test_graphs.py \
    -k "not compiled_steps and not cuda_graph_replays" --junitxml="$WORK/tests_graphs.xml" ) &
pids+=($!)
for pid in "${pids[@]}"; do wait "$pid"; done
bundle

# 4. kernel benchmarks (rows written as they come), then beside the roofline of each kernel call
run_step bench_kernels "$LIMIT_BENCH" "$PY" bench/bench_kernels.py --out "$WORK" --repeat 30
KJSON=$(ls -t "$WORK"/kernels_*.json 2>/dev/null | head -n 1)
PID_REPORT=
if [ -n "$KJSON" ]; then  # on the CPU, beside bench_e2e on the GPU
    ( run_step kernels_vs_roofline "$LIMIT_REPORT" "$PY" bench/kernel_report.py --costs-only --measured "$KJSON" \
        --json "$WORK/kernel_roofline.json" ) &
    PID_REPORT=$!
fi
bundle

# 5. end-to-end at the 35B shapes (random bf16 weights on the GPU), with the time left
run_step bench_mtp "$LIMIT_MTP" "$PY" bench/bench_mtp.py --device cuda --prompts 4 --max-new-tokens 48 \
    --rounds 1 --out "$WORK"
bundle

E_LIMIT=$(( $(left) - KILL_AFTER - 15 ))
if [ "$E_LIMIT" -ge "$MIN_E2E" ]; then
    run_step bench_e2e "$E_LIMIT" "$PY" bench/bench_e2e.py --out "$WORK"
else
    note "skipped bench_e2e: only ${E_LIMIT}s left (at least $MIN_E2E needed)"
fi
wait "$PID_ROOF" $PID_REPORT 2>/dev/null
trap - EXIT
bundle
RC=$?
cat "$OUT/summary.txt"
exit "$RC"
