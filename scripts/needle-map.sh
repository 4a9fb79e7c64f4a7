#!/usr/bin/env bash
# The needle map: retrieval on SmolLM2-135M through every cache technique, at two budgets,
# query-aware and query-agnostic (kvbench needle), then its heatmaps and frontier.
#
#   scripts/needle-map.sh [OUT.csv] [CONTEXT] [DEPTHS] [TRIALS]
#
# Default: results/sample/needle-smollm2.csv at 1,024 tokens, depths 0, 0.5 and 1, two trials
# a cell, budgets of 128 and 256 positions per KV head (an eighth and a quarter of the
# context). About 50 minutes on a quiet 2-core CPU; rows are appended as each cell finishes,
# so an interrupted map keeps what it measured (rerun to add the rest).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/sample/needle-smollm2.csv}
CONTEXT=${2:-1024}
DEPTHS=${3:-0,0.5,1}
TRIALS=${4:-2}
B1=$((CONTEXT / 8))
B2=$((CONTEXT / 4))
run() { kvbench needle --context "$CONTEXT" --depth "$DEPTHS" --trials "$TRIALS" --csv "$OUT" -q "$@"; }

for mode in "" --question-after-compression; do
  run $mode --impl static --kv-dtype none,int8,int4
  run $mode --impl static --kv-dtype int2 --k-quant per-channel --group-size 32 --kv-residual 32
  run $mode --impl think --k-channels 32,16
  for b in $B1 $B2; do
    run $mode --impl window --window "$b"
    run $mode --impl window --window $((b - 4)) --sinks 4
    run $mode --impl h2o,tova,knorm,snapkv,expected --kv-budget "$b" --kv-compress prefill
    run $mode --impl snapkv-paged --head-budgets ada --kv-budget "$b" --kv-compress prefill
    run $mode --impl snapkv-paged --head-budgets duo --kv-budget "$b" --kv-compress prefill
    run $mode --impl snapkv --layer-budgets pyramid --kv-budget "$b" --kv-compress prefill
  done
done
kvbench plot "$OUT"
echo "wrote $OUT and ${OUT%.csv}.png"
