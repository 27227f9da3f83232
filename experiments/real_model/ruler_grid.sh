#!/usr/bin/env bash
# The RULER-style grid of experiments/configs/smollm2_ruler_grid.yaml (every policy at 0.25 / 0.5 / 0.75 / 0.875 and
# the int8 cache; 22 prompts of 2,048 tokens per cell) as one resumable run split over two processes (about 5 hours
# of cells on a 2-core CPU; rerun after a kill and it resumes), kvpress's presses on the same prompts, then one
# macro-average table and plot over both: runs/ruler_grid.{md,csv,png} (docs/real_model/README.md, section (d)).
# Usage (from the repository root, after experiments/real_model/run.sh fetched the model and `pip install -e
# ".[test]"` for kvpress):  bash experiments/real_model/ruler_grid.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
C=experiments/configs/smollm2_ruler_grid.yaml
lcx ablate $C --shard 0/2 & shard0=$!
lcx ablate $C --shard 1/2
wait "$shard0"
python experiments/kvpress_eval.py $C --ratios 0.75 --presses expected_attention tova snapkv \
  --out runs/kvpress_ruler_075
python experiments/real_model/ruler_grid.py runs/smollm2_ruler_grid/ablate/results.csv \
  runs/kvpress_ruler_075/results.csv --out runs/ruler_grid
