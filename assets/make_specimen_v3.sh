#!/usr/bin/env bash
# Specimen v3 (assets/clover-stdlib since 2026-12-02): specimen v2 trained to follow its prompt.
# v2 continued every prompt the same way (`def is_prime(n):` and `def largest(numbers):` both
# became `def _get_from_name(cls, *args)`): it was trained on windows of modules, where a function's
# head comes after hundreds of tokens of its module, never first. Each stage resumable:
# - A: STEPS_A steps in which FUNCTIONS_A of every batch are rows that start at a function's head
#   (signature and docstring, cut out of the training modules with ast and dedented; then its body:
#   python -m clover_lab.train --functions-share, clover_lab/train/functions.py), the rest windows.
#   Real text makes the model less sure of whole blocks (tokens per forward fell from 2.4 to 1.9).
# - Then ROUNDS, one line each: STEPS DISTILL FUNCTIONS SPLIT CORPUS. CORPUS N is the model's own
#   greedy bodies for SEQUENCES function heads (python -m clover_lab.train.distill --functions,
#   seed N: bodies that loop, or that name none of their head's arguments, dropped), made from the
#   model as it is when a round first needs it; DISTILL of every batch is drawn from it, FUNCTIONS
#   are function rows, the rest windows, the confidence term at CONFIDENCE: sure of whole blocks
#   again, of bodies that use their prompt (tokens per forward on held-out windows 1.38, 1.70, 2.09
#   after rounds 1-3). SPLIT of the newline+indent tokens are written apart (--split-newlines,
#   clover_lab/train/newlines.py): after round 3 a head given with a newline after it (as typed
#   with Enter) got no text at all, 34 of 40 held-out heads; round 4 taught it to go on (1 of 40)
#   at the cost of sure blocks (held-out windows 1.80), which round 5's fresh corpus won back.
# RUN/rounds-done.txt lists the finished stages, each with the step its schedule began at: a stage
# whose schedule began after the last finished one is resumed, the others start theirs.
# Then the run is exported to RUN/v3 with GENERATION as its defaults and measured there
# (python -m clover_lab.train.measure: tokens per forward, loops, distinctness, argument use, empty
# completions after a trailing newline, prompt gain); with EXPORT (a model directory), exported there
# too with its model card (v2's card, RUN/init_card.json, beside it). About 3 h 10 min on 2 CPU
# cores (A 36 min, each distillation 8 min, the rounds 15, 21, 17, 12 and 15 min, export and
# measure 4 min).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/specimen3}
INIT=${INIT:-assets/clover-stdlib}
THREADS=${THREADS:-2}
MINUTES=${MINUTES:-120}         # the wall-clock budget of each training stage
LR=${LR:-5e-4}                  # the peak learning rate of each stage's schedule
CONFIDENCE=${CONFIDENCE:-1.0}   # the confidence term's weight
STEPS_A=${STEPS_A:-1200}
FUNCTIONS_A=${FUNCTIONS_A:-0.5}
SEQUENCES=${SEQUENCES:-1536}
ROUNDS=${ROUNDS:-"600 0.6 0.2 0 1
800 0.75 0.1 0 2
800 0.85 0.05 0 3
500 0.85 0.05 0.1 3
600 0.85 0.05 0.03 4"}
GENERATION=${GENERATION-"repetition_penalty=1.3"}  # the exported sampler defaults (GENERATION= for none)
EXPORT=${EXPORT:-}
PY=${PY:-python}
GENERATION_ARGS=()
for G in $GENERATION; do GENERATION_ARGS+=(--generation "$G"); done
DONE="$RUN/rounds-done.txt"
# the run's schedule: the step it began at, the step the run is at, the step it ends at
state() { $PY -c "import torch,sys; st=torch.load(sys.argv[1], weights_only=False); s=st['settings']; \
print(s.get('schedule_start', 0), st['step'], s['max_steps'])" "$RUN/train_state.pt"; }
train() { $PY -m clover_lab.train --out "$RUN" --minutes "$MINUTES" --threads "$THREADS" "$@"; }
# stage NAME, then the arguments that begin its schedule: skipped when done, resumed when begun
stage() {
    local name=$1 start step end
    shift
    grep -q "^$name " "$DONE" && return 0
    read -r start step end <<< "$(state)"
    if [ "$start" -gt "$(tail -n 1 "$DONE" | cut -d' ' -f2)" ]; then
        train
    else
        train --extend-steps "$@"
    fi
    read -r start step end <<< "$(state)"
    if [ "$step" -lt "$end" ]; then
        echo "stage $name stopped at step $step of $end (MINUTES=$MINUTES): run again to resume" >&2
        exit 1
    fi
    echo "$name $start" >> "$DONE"
}
[ -f "$RUN/train_state.pt" ] || $PY -m clover_lab.train --out "$RUN" --init "$INIT" --minutes 0 --threads "$THREADS"
[ -f "$DONE" ] || echo "init $(state | cut -d' ' -f1)" > "$DONE"
stage A "$STEPS_A" --lr "$LR" --confidence-weight "$CONFIDENCE" --functions-share "$FUNCTIONS_A"
N=0
while read -r -u 3 STEPS DISTILL FUNCTIONS SPLIT CORPUS; do
    N=$((N + 1))
    HEADS="$RUN/distill-heads-$CORPUS.pt"
    if ! grep -q "^$N " "$DONE" && [ ! -f "$HEADS" ]; then
        $PY -m clover_lab.train.distill --run "$RUN" --out "$HEADS" --functions --sequences "$SEQUENCES" \
            --seed "$CORPUS" --threads "$THREADS"
    fi
    stage "$N" "$STEPS" --lr "$LR" --confidence-weight "$CONFIDENCE" --distill "$HEADS" --distill-share "$DISTILL" \
        --functions-share "$FUNCTIONS" --split-newlines "$SPLIT"
done 3<<< "$ROUNDS"
train --export "$RUN/v3" "${GENERATION_ARGS[@]}"
$PY -m clover_lab.train.measure --model "$RUN/v3" --run "$RUN" --threads "$THREADS" --out "$RUN/v3/measure.json"
if [ -n "$EXPORT" ]; then  # the run's last step: nothing is trained here
    train --export "$EXPORT" "${GENERATION_ARGS[@]}"
    $PY -m clover_lab.train.card --run "$RUN" --model "$EXPORT" --baseline "$RUN/init_card.json" \
        --threads "$THREADS"
fi
