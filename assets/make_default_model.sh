#!/usr/bin/env bash
# Reproduces assets/clover-stdlib, the embedded default model, from the running interpreter's
# standard library: tokenizer, training, a continuation with a fresh schedule, self-distillation
# (the model's own greedy continuations mixed into training, for confident parallel decoding),
# export with its generation defaults (repetition and frequency penalties, chosen by
# python -m clover_lab.train.measure: without them 9 of 24 prompts looped), model card.
# About 2 h 15 min on 2 CPU cores in all. assets/make_specimen_v2.sh continues from the result.
# Run it on a fresh RUN directory (each stage resumes from its checkpoint if interrupted: rerun
# that stage's line alone; an --extend-steps line extends a finished run each time it runs).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/stdlib}
python -m clover_lab.train --out "$RUN" --minutes 105 --max-steps 2400 --threads 2
python -m clover_lab.train --out "$RUN" --minutes 40 --extend-steps 1900 --lr 6e-4 --threads 2
python -m clover_lab.train.distill --run "$RUN" --sequences 4096 --threads 2
python -m clover_lab.train --out "$RUN" --minutes 30 --extend-steps 1200 --lr 6e-4 --threads 2 \
    --confidence-weight 0.5 --distill "$RUN/distill.pt" --distill-share 0.625 --export assets/clover-stdlib \
    --generation repetition_penalty=1.3 --generation frequency_penalty=0.5
python -m clover_lab.train.card --run "$RUN" --model assets/clover-stdlib
