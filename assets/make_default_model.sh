#!/usr/bin/env bash
# Reproduces assets/clover-stdlib, the embedded default model, from the running interpreter's
# standard library: tokenizer, training, a continuation with a fresh schedule, export, model card.
# Run it on a fresh RUN directory (each stage resumes from its checkpoint if interrupted: rerun
# that stage's line alone; the continuation line extends a finished run each time it runs).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/stdlib}
python -m clover_lab.train --out "$RUN" --minutes 105 --max-steps 2400 --threads 2
python -m clover_lab.train --out "$RUN" --minutes 40 --extend-steps 1900 --lr 6e-4 --threads 2 \
    --export assets/clover-stdlib
python -m clover_lab.card --run "$RUN" --model assets/clover-stdlib
