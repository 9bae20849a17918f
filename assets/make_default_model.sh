#!/usr/bin/env bash
# Reproduces assets/clover-stdlib, the embedded default model, from the running interpreter's
# standard library: tokenizer, training, a continuation with a fresh schedule, self-distillation
# (the model's own greedy continuations mixed into training, for confident parallel decoding),
# export, model card. About 2 h 15 min on 2 CPU cores in all.
# Run it on a fresh RUN directory (each stage resumes from its checkpoint if interrupted: rerun
# that stage's line alone; an --extend-steps line extends a finished run each time it runs).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/stdlib}
python -m clover_lab.train --out "$RUN" --minutes 105 --max-steps 2400 --threads 2
python -m clover_lab.train --out "$RUN" --minutes 40 --extend-steps 1900 --lr 6e-4 --threads 2
python -m clover_lab.train.distill --run "$RUN" --sequences 4096 --threads 2
python -m clover_lab.train --out "$RUN" --minutes 30 --extend-steps 1200 --lr 6e-4 --threads 2 \
    --confidence-weight 0.5 --distill "$RUN/distill.pt" --distill-share 0.625 --export assets/clover-stdlib
python -m clover_lab.train.card --run "$RUN" --model assets/clover-stdlib
