#!/usr/bin/env bash
# Reproduces assets/clover-stdlib, the embedded default model, from the running interpreter's
# standard library: tokenizer, training (resumable: rerun to continue), export, model card.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/stdlib}
python -m clover_lab.train --out "$RUN" --minutes "${MINUTES:-105}" --max-steps 2400 --threads 2 \
    --export assets/clover-stdlib
python -m clover_lab.card --run "$RUN" --model assets/clover-stdlib
