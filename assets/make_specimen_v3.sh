#!/usr/bin/env bash
# A specimen v3: the continuation of specimen v2 (assets/clover-stdlib) trained to follow its prompt.
# NOT SHIPPED: run with its defaults on 2 CPU cores (2026-12-02) it read its prompt a little more
# (prompt gain 0.045 -> 0.078 nats per body token, perplexity 60.1 -> 51.6) but generated worse
# (tokens per forward at threshold 0.9: written 2.43 -> 1.86, held-out 2.01 -> 1.38; completions
# that use an argument: written 0.40 -> 0.20, held-out function heads 0.17 -> 0.25), so
# assets/clover-stdlib is still v2 (the README's "The embedded default model" has the table). It is
# the recipe to continue from with more time (more steps, more rounds of stage B).
# v2 continued every prompt the same way (`def is_prime(n):` and `def largest(numbers):` both
# became `def _get_from_name(cls, *args)`): it was trained on windows of modules, where a function's
# head comes after hundreds of tokens of its module, never first. Two stages, each resumable:
# - A: STEPS_A steps in which FUNCTIONS_A of every batch are rows that start at a function's head
#   (signature and docstring, cut out of the training modules with ast and dedented; then its body:
#   python -m clover_lab.train --functions-share, clover_lab/train/functions.py), the rest windows.
#   Real text makes the model less sure of whole blocks (tokens per forward fell from 2.4 to 1.1).
# - B: the model's own greedy bodies for SEQUENCES function heads (python -m clover_lab.train.distill
#   --functions: bodies that loop, or that name none of their head's arguments, dropped), DISTILL_B of
#   every batch, with FUNCTIONS_B function rows and the rest windows, the confidence term at
#   CONFIDENCE, STEPS_B steps: sure of whole blocks again, of bodies that use their prompt.
# Then the run is exported to RUN/v3 with GENERATION as its defaults and measured there
# (python -m clover_lab.train.measure: tokens per forward, loops, distinctness, argument use, prompt
# gain); with EXPORT (a model directory), exported there too with its model card (v2's card,
# RUN/init_card.json, beside it). About 1 h 10 min on 2 CPU cores (A 36 min, distillation 7 min,
# B 15 min, export and measure 3 min).
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
STEPS_B=${STEPS_B:-600}
DISTILL_B=${DISTILL_B:-0.6}
FUNCTIONS_B=${FUNCTIONS_B:-0.2}
GENERATION=${GENERATION-"repetition_penalty=1.3"}  # the exported sampler defaults (GENERATION= for none)
EXPORT=${EXPORT:-}
PY=${PY:-python}
GENERATION_ARGS=()
for G in $GENERATION; do GENERATION_ARGS+=(--generation "$G"); done
HEADS="$RUN/distill-heads.pt"
# whether the run's current schedule is the one a stage begins: "functions" (A) or the corpus file (B)
begun() { $PY -c "import torch,sys; s=torch.load(sys.argv[1], weights_only=False)['settings']; \
sys.exit(not (s.get('functions_share') if sys.argv[2] == 'functions' else s.get('distill_data') == sys.argv[2]))" \
    "$RUN/train_state.pt" "$1"; }
[ -f "$RUN/train_state.pt" ] || $PY -m clover_lab.train --out "$RUN" --init "$INIT" --minutes 0 --threads "$THREADS"
if [ ! -f "$HEADS" ]; then
    if begun functions; then  # resumed to the end of its schedule
        $PY -m clover_lab.train --out "$RUN" --minutes "$MINUTES" --threads "$THREADS"
    else
        $PY -m clover_lab.train --out "$RUN" --minutes "$MINUTES" --extend-steps "$STEPS_A" --lr "$LR" \
            --threads "$THREADS" --confidence-weight "$CONFIDENCE" --functions-share "$FUNCTIONS_A"
    fi
    $PY -m clover_lab.train.distill --run "$RUN" --out "$HEADS" --functions --sequences "$SEQUENCES" --seed 1 \
        --threads "$THREADS"
fi
if begun "$HEADS"; then
    $PY -m clover_lab.train --out "$RUN" --minutes "$MINUTES" --threads "$THREADS"
else
    $PY -m clover_lab.train --out "$RUN" --minutes "$MINUTES" --extend-steps "$STEPS_B" --lr "$LR" \
        --threads "$THREADS" --confidence-weight "$CONFIDENCE" --distill "$HEADS" --distill-share "$DISTILL_B" \
        --functions-share "$FUNCTIONS_B"
fi
$PY -m clover_lab.train --out "$RUN" --minutes "$MINUTES" --threads "$THREADS" --export "$RUN/v3" \
    "${GENERATION_ARGS[@]}"
$PY -m clover_lab.train.measure --model "$RUN/v3" --run "$RUN" --threads "$THREADS" --out "$RUN/v3/measure.json"
if [ -n "$EXPORT" ]; then  # the run's last step: nothing is trained here
    $PY -m clover_lab.train --out "$RUN" --minutes "$MINUTES" --threads "$THREADS" --export "$EXPORT" \
        "${GENERATION_ARGS[@]}"
    $PY -m clover_lab.train.card --run "$RUN" --model "$EXPORT" --baseline "$RUN/init_card.json" \
        --threads "$THREADS"
fi
