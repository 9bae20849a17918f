#!/usr/bin/env bash
# Reproduces assets/clover-stdlib, the embedded default model (specimen v2), from the running
# interpreter's standard library, in two parts:
# - v1 (RUN): tokenizer, training, a continuation with a fresh schedule, self-distillation (the
#   model's own greedy continuations mixed into training, for confident parallel decoding), export
#   with its generation defaults (repetition and frequency penalties, chosen by
#   python -m clover_lab.train.measure: without them 9 of 24 prompts looped), model card.
#   About 2 h 15 min on 2 CPU cores.
# - v2 (RUN2, assets/make_specimen_v2.sh): three more rounds of self-distillation from v1, each
#   measured (and swept over penalties) in RUN2/round-N; the last is exported over
#   assets/clover-stdlib with repetition_penalty 1.3 (the setting the sweep chose: no loops, held-out
#   2.04 tokens per forward at threshold 0.9) and its card written, with v1's beside it. One thread
#   (two OpenMP threads on a busy 2-core machine wait on each other): about 35-40 min a round
#   (distillation 7-15 min, 500 steps at 3-6 s, measurements 5 min), round 1 (250 steps) ~30 min.
#   The shipped v2 (/work/runs/specimen3 on the machine that made it) trained round 1 as 25 steps of a
#   500-step schedule and then a fresh 225-step one; STEPS="250 500 500" gives it one 250-step schedule.
# Run it on fresh RUN and RUN2 directories (each stage resumes from its checkpoint if interrupted:
# rerun that stage's line alone; an --extend-steps line extends a finished run each time it runs;
# make_specimen_v2.sh skips finished rounds).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/stdlib}
RUN2=${RUN2:-runs/specimen2}
python -m clover_lab.train --out "$RUN" --minutes 105 --max-steps 2400 --threads 2
python -m clover_lab.train --out "$RUN" --minutes 40 --extend-steps 1900 --lr 6e-4 --threads 2
python -m clover_lab.train.distill --run "$RUN" --sequences 4096 --threads 2
python -m clover_lab.train --out "$RUN" --minutes 30 --extend-steps 1200 --lr 6e-4 --threads 2 \
    --confidence-weight 0.5 --distill "$RUN/distill.pt" --distill-share 0.625 --export assets/clover-stdlib \
    --generation repetition_penalty=1.3 --generation frequency_penalty=0.5
python -m clover_lab.train.card --run "$RUN" --model assets/clover-stdlib
RUN="$RUN2" INIT=assets/clover-stdlib ROUNDS=3 SEQUENCES=2048 STEPS="250 500 500" THREADS=1 LR=6e-4 CONFIDENCE=1.0 \
    SHARE=0.75 GENERATION="repetition_penalty=1.3" SWEEP="repetition_penalty=1.0,1.15,1.3 frequency_penalty=0,0.5" \
    EXPORT=assets/clover-stdlib OMP_NUM_THREADS=1 bash assets/make_specimen_v2.sh
