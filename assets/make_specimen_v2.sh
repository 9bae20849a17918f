#!/usr/bin/env bash
# Specimen v2, the continuation of assets/clover-stdlib: starts from the exported specimen (its
# weights, tokenizer and config: `--init`, nothing re-learned) and runs ROUNDS rounds of
# self-distillation (the model's own greedy continuations of training prefixes, then a training
# stage that mixes them into each batch with the confidence term), exporting each round to
# RUN/round-N and measuring it there (python -m clover_lab.train.measure: tokens per forward at
# threshold 0.9, repeated lines, distinctness across prompts, next-token perplexity).
# EXPORT (e.g. assets/clover-stdlib; assets/make_default_model.sh sets it): after the last round,
# its checkpoint is exported there with GENERATION as its defaults and its model card written
# (python -m clover_lab.train.card, with the starting model's card, RUN/init_card.json, beside it).
# Without EXPORT a round's model replaces assets/clover-stdlib only by hand, if it is better on those targets.
# Every stage resumes: a finished round is skipped (its round-N/measure.json exists), a stopped
# training stage resumes from its checkpoint when the script runs again.
# The round's settings (LR, CONFIDENCE, SHARE; GENERATION: the exported sampler defaults, as
# space-separated SETTING=VALUE) are read each time the script runs: keep them for a run.
# SWEEP (e.g. "repetition_penalty=1.0,1.15,1.3"): also measure each round with those sampler
# settings, into round-N/sweep.json, to choose GENERATION by measurement (a swept setting replaces
# only that one of the exported defaults: sweep every penalty that GENERATION sets).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/specimen2}
INIT=${INIT:-assets/clover-stdlib}
ROUNDS=${ROUNDS:-3}
SEQUENCES=${SEQUENCES:-1024}  # self-distilled sequences per round (4096 made v1's round)
STEPS=${STEPS:-300}           # training steps per round, one for all or one per round ("250 500 500"; the last repeats)
THREADS=${THREADS:-2}          # 1 on a machine busy with other work: two threads there wait on each other (10x slower)
MINUTES=${MINUTES:-120}        # the wall-clock budget of each training stage
LR=${LR:-6e-4}                 # the peak learning rate of each round's schedule
CONFIDENCE=${CONFIDENCE:-0.5}  # the confidence term's weight
SHARE=${SHARE:-0.75}           # the share of each batch's rows from the round's corpus
GENERATION=${GENERATION-"repetition_penalty=1.3 frequency_penalty=0.5"}  # the shipped model's defaults (GENERATION= for none)
SWEEP=${SWEEP:-}
EXPORT=${EXPORT:-}
PY=${PY:-python}
GENERATION_ARGS=()
for G in $GENERATION; do GENERATION_ARGS+=(--generation "$G"); done
read -r -a STEPS_PER_ROUND <<< "$STEPS"
SWEEP_ARGS=()
for S in $SWEEP; do SWEEP_ARGS+=(--sweep "$S"); done
[ -f "$RUN/train_state.pt" ] || $PY -m clover_lab.train --out "$RUN" --init "$INIT" --minutes 0 --threads "$THREADS"
for N in $(seq 1 "$ROUNDS"); do
    [ -f "$RUN/round-$N/measure.json" ] && continue
    I=$((N <= ${#STEPS_PER_ROUND[@]} ? N - 1 : ${#STEPS_PER_ROUND[@]} - 1))
    [ -f "$RUN/distill$N.pt" ] || $PY -m clover_lab.train.distill --run "$RUN" --out "$RUN/distill$N.pt" \
        --sequences "$SEQUENCES" --seed "$N" --threads "$THREADS"
    # the round's stage: a fresh schedule on distill$N.pt once, then resumed to its last step
    if ! $PY -c "import torch,sys; s=torch.load(sys.argv[1], weights_only=False)['settings']; \
sys.exit(s['distill_data'] != sys.argv[2])" "$RUN/train_state.pt" "$RUN/distill$N.pt"; then
        $PY -m clover_lab.train --out "$RUN" --minutes "$MINUTES" --extend-steps "${STEPS_PER_ROUND[$I]}" --lr "$LR" \
            --threads "$THREADS" --confidence-weight "$CONFIDENCE" --distill "$RUN/distill$N.pt" --distill-share "$SHARE"
    fi
    # exported with GENERATION as its defaults (by default the shipped model's, so that its measure compares like with like)
    $PY -m clover_lab.train --out "$RUN" --minutes "$MINUTES" --threads "$THREADS" --export "$RUN/round-$N" \
        "${GENERATION_ARGS[@]}"
    [ -z "$SWEEP" ] || $PY -m clover_lab.train.measure --model "$RUN/round-$N" --run "$RUN" --threads "$THREADS" \
        "${SWEEP_ARGS[@]}" --out "$RUN/round-$N/sweep.json"
    $PY -m clover_lab.train.measure --model "$RUN/round-$N" --run "$RUN" --threads "$THREADS" \
        --out "$RUN/round-$N/measure.json"
done
if [ -n "$EXPORT" ]; then  # the last round's checkpoint (the run's last step: nothing is trained here)
    $PY -m clover_lab.train --out "$RUN" --minutes "$MINUTES" --threads "$THREADS" --export "$EXPORT" \
        "${GENERATION_ARGS[@]}"
    $PY -m clover_lab.train.card --run "$RUN" --model "$EXPORT" --baseline "$RUN/init_card.json" --threads "$THREADS"
fi
