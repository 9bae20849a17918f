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
#   A line may go on with WINDOWS and CONFIDENCE (make_specimen_v4.sh's rounds): WINDOWS N ("-":
#   none) is the model's own greedy continuations of SEQUENCES training windows (distill without
#   --functions, seed N; continuations that loop dropped), made like CORPUS N and merged after it
#   (distill --merge) into the corpus DISTILL is drawn from; CONFIDENCE that round's confidence weight.
# RUN/rounds-done.txt lists the finished stages, each with the step its schedule began at: a stage
# whose schedule began after the last finished one is resumed, the others start theirs.
# Then the run is exported to RUN/NAME (v3) with GENERATION as its defaults and measured there
# (python -m clover_lab.train.measure: tokens per forward, loops, distinctness, argument use, empty
# completions after a trailing newline, prompt gain); with EXPORT (a model directory), exported there
# too with its model card (BASELINE's card beside it: v2's, RUN/init_card.json; CARD_ARGS more
# arguments of python -m clover_lab.train.card). About 3 h 10 min on 2 CPU
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
NAME=${NAME:-v3}                # the run's export (RUN/NAME) that is measured
BASELINE=${BASELINE:-$RUN/init_card.json}  # with EXPORT: the card its figures are set beside
read -r -a CARD_ARGS <<< "${CARD_ARGS:-}"  # with EXPORT: more arguments of the card (e.g. --continues)
COMMAND=${COMMAND:-bash assets/make_specimen_v3.sh}  # with EXPORT: the card's "Reproduce" command
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
# a corpus of the model's own continuations, made once (when a round first needs it, from the model
# as it is then): corpus SEED FILE [--functions]
corpus() {
    local seed=$1 file=$2
    shift 2
    if ! grep -q "^$N " "$DONE" && [ ! -f "$file" ]; then
        $PY -m clover_lab.train.distill --run "$RUN" --out "$file" "$@" --sequences "$SEQUENCES" --seed "$seed" \
            --threads "$THREADS"
    fi
}
while read -r -u 3 STEPS DISTILL FUNCTIONS SPLIT CORPUS WINDOWS ROUND_CONFIDENCE; do
    N=$((N + 1))
    DATA="$RUN/distill-heads-$CORPUS.pt"
    corpus "$CORPUS" "$DATA" --functions
    if [ -n "$WINDOWS" ] && [ "$WINDOWS" != - ]; then  # the bodies, then continuations of training windows
        corpus "$WINDOWS" "$RUN/distill-windows-$WINDOWS.pt"
        MIX="$RUN/distill-mix-$CORPUS-$WINDOWS.pt"
        if ! grep -q "^$N " "$DONE" && [ ! -f "$MIX" ]; then
            $PY -m clover_lab.train.distill --merge "$DATA" "$RUN/distill-windows-$WINDOWS.pt" --out "$MIX"
        fi
        DATA=$MIX
    fi
    stage "$N" "$STEPS" --lr "$LR" --confidence-weight "${ROUND_CONFIDENCE:-$CONFIDENCE}" --distill "$DATA" \
        --distill-share "$DISTILL" --functions-share "$FUNCTIONS" --split-newlines "$SPLIT"
done 3<<< "$ROUNDS"
train --export "$RUN/$NAME" "${GENERATION_ARGS[@]}"
$PY -m clover_lab.train.measure --model "$RUN/$NAME" --run "$RUN" --threads "$THREADS" --out "$RUN/$NAME/measure.json"
if [ -n "$EXPORT" ]; then  # the run's last step: nothing is trained here
    train --export "$EXPORT" "${GENERATION_ARGS[@]}"
    $PY -m clover_lab.train.card --run "$RUN" --model "$EXPORT" --baseline "$BASELINE" "${CARD_ARGS[@]}" \
        --command "$COMMAND" --threads "$THREADS"
fi
