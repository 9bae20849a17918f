#!/usr/bin/env bash
# The embedded specimen's multi-token-prediction head (issue 53): mode "mtp" runs offline on it and
# its acceptance is measured. The trunk (assets/clover-stdlib, specimen v4) is frozen and written
# back unchanged; the head (mtp.*: fc, two norms, one full-attention decoder layer with the trunk's
# MoE, the final norm, about 7 MB in bf16) learns the trunk's own next-next-token distribution
# (python -m clover_lab.train.mtp_head): windows of 128 tokens of the standard library's training
# split, 32 a batch, each batch's trunk states taught twice (REUSE), the first draft only (CHAIN 0:
# the chained drafts' loss doubles the head's cost), from the trunk's last attention layer.
# MINUTES of wall time (32 on 2 CPU cores shared with other work: about 20 batches), then
# measured: tokens per trunk forward at greedy on 24 held-out windows (mtp_training.json's
# "measured"). With INSTALL=1 the trunk with its head replaces assets/clover-stdlib's weights and
# config.json (the other files stay).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/mtp_head}
MINUTES=${MINUTES:-32}
REUSE=${REUSE:-2}
CHAIN=${CHAIN:-0}
PY=${PYTHON:-python}
$PY -m clover_lab.train.mtp_head --model assets/clover-stdlib --out "$RUN" --minutes "$MINUTES" --files 400 \
    --batch 32 --length 128 --lr 3e-3 --chain "$CHAIN" --reuse "$REUSE"
$PY -m clover_lab.train.mtp_head --model "$RUN" --measure --windows 24 | tee "$RUN/measured.json"
if [ "${INSTALL:-0}" = 1 ]; then
    cp "$RUN/model.safetensors" "$RUN/config.json" assets/clover-stdlib/
fi
