#!/usr/bin/env bash
# Specimen v4 (assets/clover-stdlib since 2026-12-03): specimen v3's training run, continued to be sure
# of whole blocks of code it has not seen. v3 followed its prompt (prompt gain 0.086 nats per body
# token, 3.05 tokens per forward on held-out function heads) but made 1.85 tokens per forward at
# threshold 0.9 on 48 windows of held-out modules, under the 2 it aimed at: it had trained mostly on
# its own bodies for function heads. The v3 recipe (make_specimen_v3.sh, run first here when RUN has
# not finished it) goes on with V4_ROUNDS, in its round format with WINDOWS and CONFIDENCE: each
# round's corpus is the model's own bodies for function heads merged with its own continuations of
# training windows (python -m clover_lab.train.distill, then distill --merge), 1536 of each.
# - round 6: v3's last bodies (corpus 4) and v3's continuations of windows, 85% of every batch
#   (held-out windows 1.90 tokens per forward, but prompt gain 0.074);
# - round 7: fresh corpora from round 6's model, 75%, and 15% function rows to read the prompt
#   again (gain 0.091, windows 1.89, 3 of 48 windows looping);
# - round 8: round 7's corpora again, the confidence term at 2.0 instead of 1.0 (windows 2.15, but
#   written prompts 8 of 12 distinct first lines and 1 of 10 naming an argument);
# - round 9: fresh corpora from round 8's model, the confidence term at 1.5 (windows 2.27, written
#   9 of 12 and 3 of 10, prompt gain 0.084).
# At repetition_penalty 1.3 rounds 7-9 loop on some held-out windows (3, 1, 3 of 48); at 1.5, v4's
# GENERATION, none does (v4: 2.44 on the windows, 0 of 48 looping), so 1.5 is exported.
# Then RUN/v4 is exported and measured, and with EXPORT (a model directory) exported there with its
# card, v3's beside it (RUN/v3/card.json: v3's own card, written by the v3 recipe's EXPORT, or
# BASELINE). About 1 h 50 min on 2 CPU cores after v3 (each corpus 6-8 min, each round 17-19 min,
# export and measure 8 min).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/specimen3}
V3_ROUNDS="600 0.6 0.2 0 1
800 0.75 0.1 0 2
800 0.85 0.05 0 3
500 0.85 0.05 0.1 3
600 0.85 0.05 0.03 4"
V4_ROUNDS=${V4_ROUNDS:-"600 0.85 0.05 0.03 4 5 1.0
600 0.75 0.15 0.03 6 6 1.0
600 0.75 0.15 0.03 6 6 2.0
600 0.75 0.15 0.03 8 8 1.5"}
GENERATION=${GENERATION-"repetition_penalty=1.5"}  # v4's exported sampler defaults (GENERATION= for none)
BASELINE=${BASELINE:-$RUN/v3/card.json}
EXPORT=${EXPORT:-}
V3=assets/make_specimen_v3.sh
if [ ! -f "$RUN/v3/measure.json" ]; then  # v3 first: its rounds, its export to RUN/v3 and its card there
    RUN=$RUN ROUNDS=$V3_ROUNDS NAME=v3 EXPORT=$RUN/v3 BASELINE=$RUN/init_card.json CARD_ARGS= \
        GENERATION="repetition_penalty=1.3" bash "$V3"
fi
if [ -n "$EXPORT" ] && [ ! -f "$BASELINE" ]; then
    echo "no card of v3 at $BASELINE (give BASELINE=, e.g. v3's assets/clover-stdlib/card.json)" >&2
    exit 1
fi
RUN=$RUN ROUNDS="$V3_ROUNDS
$V4_ROUNDS" NAME=v4 EXPORT=$EXPORT BASELINE=$BASELINE CARD_ARGS=--continues GENERATION=$GENERATION \
    COMMAND="bash assets/make_specimen_v4.sh" bash "$V3"
