#!/usr/bin/env bash
# Specimen v2, the continuation of assets/clover-stdlib: starts from the exported specimen (its
# weights, tokenizer and config: `--init`, nothing re-learned) and runs ROUNDS rounds of
# self-distillation (the model's own greedy continuations of training prefixes, then a training
# stage that mixes them into each batch with the confidence term), exporting each round to
# RUN/round-N and measuring it there (python -m clover_lab.train.measure: tokens per forward at
# threshold 0.9, repeated lines, distinctness across prompts, next-token perplexity).
# A round's model replaces assets/clover-stdlib only by hand, if it is better on those targets:
#   python -m clover_lab.train --out "$RUN" --export assets/clover-stdlib ... (or copy RUN/round-N),
#   then python -m clover_lab.train.card --run "$RUN" --model assets/clover-stdlib --baseline "$RUN/init_card.json"
# Every stage resumes: a finished round is skipped (its round-N/measure.json exists), a stopped
# training stage resumes from its checkpoint when the script runs again.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/specimen2}
INIT=${INIT:-assets/clover-stdlib}
ROUNDS=${ROUNDS:-3}
SEQUENCES=${SEQUENCES:-1024}  # self-distilled sequences per round (4096 made v1's round)
STEPS=${STEPS:-300}           # training steps per round (1200 made v1's round)
THREADS=${THREADS:-2}
MINUTES=${MINUTES:-120}        # the wall-clock budget of each training stage
PY=${PY:-python}
[ -f "$RUN/train_state.pt" ] || $PY -m clover_lab.train --out "$RUN" --init "$INIT" --minutes 0 --threads "$THREADS"
for N in $(seq 1 "$ROUNDS"); do
    [ -f "$RUN/round-$N/measure.json" ] && continue
    [ -f "$RUN/distill$N.pt" ] || $PY -m clover_lab.train.distill --run "$RUN" --out "$RUN/distill$N.pt" \
        --sequences "$SEQUENCES" --seed "$N" --threads "$THREADS"
    # the round's stage: a fresh schedule on distill$N.pt once, then resumed to its last step
    if ! $PY -c "import torch,sys; s=torch.load(sys.argv[1], weights_only=False)['settings']; \
sys.exit(s['distill_data'] != sys.argv[2])" "$RUN/train_state.pt" "$RUN/distill$N.pt"; then
        $PY -m clover_lab.train --out "$RUN" --minutes "$MINUTES" --extend-steps "$STEPS" --lr 6e-4 \
            --threads "$THREADS" --confidence-weight 0.5 --distill "$RUN/distill$N.pt" --distill-share 0.75
    fi
    # exported with the shipped model's generation defaults, so that its measure compares like with like
    $PY -m clover_lab.train --out "$RUN" --minutes "$MINUTES" --threads "$THREADS" --export "$RUN/round-$N" \
        --generation repetition_penalty=1.3 --generation frequency_penalty=0.5
    $PY -m clover_lab.train.measure --model "$RUN/round-$N" --run "$RUN" --threads "$THREADS" \
        --out "$RUN/round-$N/measure.json"
done
