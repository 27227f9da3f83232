#!/usr/bin/env bash
# The RULER-style grid of experiments/configs/smollm2_ruler_grid.yaml in the slices a 2-core CPU can run in an
# afternoon and an evening (each ~4 minutes per setting, KVzip ~8), then one table and plot over them and the
# earlier runs whose results sit in docs/real_model/ (KVzip per head and pooled at 0.5 / 0.75, DuoAttention at 0.75, full,
# streaming, SnapKV and TOVA at 0.5, KVzip int8 at 0.5) - the same 22 prompts everywhere.
# Usage (from the repository root, after experiments/real_model/run.sh fetched the model and `pip install -e
# ".[test]"` for kvpress):  bash experiments/real_model/ruler_grid_slices.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
C=experiments/configs/smollm2_ruler_grid.yaml
SNAP='policy: snapkv, window: 32, kernel: 5'
POOLED='policy: kvzip, sinks: 4, chunk: 2048, head_budget: global, head_floor: 0.0, head_cap: 8.0'
lcx run $C name=smollm2_ruler_grid_075 'ablate.compressions=[0.75]' "ablate.policies=[{policy: streaming, sinks: 4}, \
{policy: h2o, recent: 32}, {$SNAP}, {$SNAP, head_budget: adaptive}, {$SNAP, budget_schedule: pyramid}, tova, knorm, \
{policy: expected_attention, sinks: 4, horizon: 512}, {policy: chunkkv, window: 32, kernel: 5, chunk: 20}]"
lcx run $C name=smollm2_ruler_grid_int8 'ablate.compressions=[0.75]' \
  'ablate.policies=[{policy: full, kv_dtype: int8}, {policy: tova, kv_dtype: int8}]'
python experiments/kvpress_eval.py $C --ratios 0.75 --presses expected_attention tova snapkv --out runs/kvpress_ruler_075
lcx run $C name=smollm2_ruler_grid_05 'ablate.compressions=[0.5]' "ablate.policies=[{policy: expected_attention, \
sinks: 4, horizon: 512}, {policy: chunkkv, window: 32, kernel: 5, chunk: 20}, {$SNAP, head_budget: adaptive}, \
{$SNAP, budget_schedule: pyramid}]"
lcx run $C name=smollm2_ruler_grid_0875 'ablate.compressions=[0.875]' "ablate.policies=[tova, {$POOLED}]"
lcx run $C name=smollm2_ruler_grid_0875b 'ablate.compressions=[0.875]' \
  'ablate.policies=[{policy: streaming, sinks: 4}, {policy: chunkkv, window: 32, kernel: 5, chunk: 20}]'
lcx run $C name=smollm2_ruler_grid_05b 'ablate.compressions=[0.5]' \
  'ablate.policies=[{policy: h2o, recent: 32}, knorm, {policy: duo, sinks: 4, recent: 64}]'
KVZ='policy: kvzip, sinks: 4, chunk: 2048'
lcx run $C name=smollm2_ruler_grid_0875c 'ablate.compressions=[0.875]' "ablate.policies=[{policy: h2o, recent: 32}, \
{$SNAP}, {$SNAP, head_budget: adaptive}, {$SNAP, budget_schedule: pyramid}, knorm]"
lcx run $C name=smollm2_ruler_grid_0875d 'ablate.compressions=[0.875]' "ablate.policies=[{policy: expected_attention, \
sinks: 4, horizon: 512}, {policy: duo, sinks: 4, recent: 64}, {$KVZ}]"
lcx run $C name=smollm2_ruler_grid_025 'ablate.compressions=[0.25]' "ablate.policies=[{policy: streaming, sinks: 4}, \
{policy: h2o, recent: 32}, {$SNAP}, {$SNAP, head_budget: adaptive}, {$SNAP, budget_schedule: pyramid}, tova]"
lcx run $C name=smollm2_ruler_grid_025b 'ablate.compressions=[0.25]' "ablate.policies=[knorm, {policy: expected_attention, \
sinks: 4, horizon: 512}, {policy: chunkkv, window: 32, kernel: 5, chunk: 20}, {policy: duo, sinks: 4, recent: 64}]"
lcx run $C name=smollm2_ruler_grid_025c 'ablate.compressions=[0.25]' "ablate.policies=[{$KVZ}, {$POOLED}]"
lcx run $C name=smollm2_ruler_grid_int8b 'ablate.compressions=[0.75]' "ablate.policies=[{$POOLED, kv_dtype: int8}]"
lcx run $C name=smollm2_ruler_grid_075c 'ablate.compressions=[0.75]' "ablate.policies=[{$POOLED}]"
d=docs/real_model
python experiments/real_model/ruler_grid.py $d/ruler.csv $d/ruler_kvzip.csv $d/ruler_kvzip_05.csv \
  $d/ruler_kvzip_05_int8.csv $d/ruler_kvzip_global_05.csv $d/ruler_kvzip_global_075.csv \
  runs/smollm2_ruler_grid_*/ablate/results.csv runs/kvpress_ruler_075/results.csv --out runs/ruler_grid
