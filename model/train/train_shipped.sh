#!/usr/bin/env bash
# Trains the shipped models one after another (each under its own time limit), logging to
# runs/<name>.log. Run from the repository root:
#   nohup nice -n 5 bash model/train/train_shipped.sh > runs/shipped.log 2>&1 &
# fill-mask-en is the all-MiniLM-L6-v2 encoder fine-tuned as a masked LM with a head
# (model.train.fill_mask_head finetune, see weights/fill-mask-en/README.md for the exact run: its
# step total was cut five times while it ran, which the --stop-after/--extend stages below replay). The
# small from-scratch encoder of before is still trainable: model/train/configs/fill-mask-en-scratch.json.
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
  ft=(finetune --warmup 300 --encoder-lr 2e-4 --lr 1e-3 --mask-prob 0.2 --log-every 20 --eval-every 400
      --save-every 100)
  # The shipped run's plan shrank as the shared CPU slowed it: 6000 planned steps, then 3000 from
  # step 100, 2400 from 400, 1800 from 800, 1400 from 900, 1600 from 1100 (cosine over each plan).
  "$PY" -m model.train.fill_mask_head "${ft[@]}" --steps 6000 --stop-after 100 --restart
  for stage in 3000:400 2400:800 1800:900 1400:1100; do
    "$PY" -m model.train.fill_mask_head "${ft[@]}" --steps "${stage%%:*}" --extend --stop-after "${stage##*:}"
  done
  "$PY" -m model.train.fill_mask_head "${ft[@]}" --steps 1600 --extend
} > runs/fill-mask-en.log 2>&1
