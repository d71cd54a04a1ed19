#!/usr/bin/env bash
# Trains the shipped models one after another (each under its own time limit), logging to
# runs/<name>.log. Run from the repository root:
#   nohup nice -n 5 bash model/train/train_shipped.sh > runs/shipped.log 2>&1 &
# fill-mask-en is a masked-LM head on the all-MiniLM-L6-v2 encoder (model.train.fill_mask_head,
# see weights/fill-mask-en/README.md for the exact run). The small from-scratch encoder it
# replaced is still trainable: model/train/configs/fill-mask-en-scratch.json (25 minutes, 7.8% top-1).
set -euo pipefail
PY=${PYTHON:-python}
mkdir -p runs
for spec in translate-en-de:45 generate-en:57; do
  name=${spec%%:*}; minutes=${spec##*:}
  "$PY" -m model.train --config "model/train/configs/$name.json" --time-limit-min "$minutes" \
    > "runs/$name.log" 2>&1
done
{
  "$PY" -m model.train.fill_mask_head data
  "$PY" -m model.train.fill_mask_head features --unfreeze-top 1 --passes 2 --max-shards 14
  "$PY" -m model.train.fill_mask_head train --unfreeze-top 1 --epochs 1 --lr 2e-3 --layer-lr 3e-4 --warmup 50 \
    --log-every 20 --eval-every 200 --restart
} > runs/fill-mask-en.log 2>&1
