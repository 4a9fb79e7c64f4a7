#!/usr/bin/env bash
# The needle map: retrieval on a trained model through every cache technique, at two budgets,
# query-aware and query-agnostic (kvbench needle), then its heatmaps and frontier.
#
#   scripts/needle-map.sh [--model MODEL] [OUT.csv] [CONTEXT] [DEPTHS] [TRIALS]
#
# Default: SmolLM2-135M, results/sample/needle-smollm2.csv at 1,024 tokens, depths 0, 0.5
# and 1, two trials a cell, budgets of 128 and 256 positions per KV head (an eighth and a
# quarter of the context). About 50 minutes on a quiet 2-core CPU; rows are appended as each
# cell finishes, so an interrupted map keeps what it measured (rerun to add the rest).
# --model gemma3-270m (results/sample/needle-gemma3.csv): a hybrid model, whose sliding
# layers keep their own windows, so --window and KIVI's layout (which the ring cannot store)
# are left out; the budgets apply to its full layers.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=smollm2-135m
if [ "${1:-}" = "--model" ]; then MODEL=$2; shift 2; fi
case $MODEL in
  smollm2-135m) default=results/sample/needle-smollm2.csv; hybrid=; channels=32,16 ;;
  gemma3-270m) default=results/sample/needle-gemma3.csv; hybrid=1; channels=128,64 ;;
  *) default=results/needle-$(basename "$MODEL").csv; hybrid=; channels=32,16 ;;
esac
OUT=${1:-$default}
CONTEXT=${2:-1024}
DEPTHS=${3:-0,0.5,1}
TRIALS=${4:-2}
B1=$((CONTEXT / 8))
B2=$((CONTEXT / 4))
run() { kvbench needle --model "$MODEL" --context "$CONTEXT" --depth "$DEPTHS" --trials "$TRIALS" --csv "$OUT" -q "$@"; }

for mode in "" --question-after-compression; do
  run $mode --impl static --kv-dtype none,int8,int4
  if [ -z "$hybrid" ]; then
    run $mode --impl static --kv-dtype int2 --k-quant per-channel --group-size 32 --kv-residual 32
  fi
  run $mode --impl think --k-channels "$channels"  # (a half and a quarter of D)
  for b in $B1 $B2; do
    if [ -z "$hybrid" ]; then
      run $mode --impl window --window "$b"
      run $mode --impl window --window $((b - 4)) --sinks 4
    fi
    run $mode --impl h2o,tova,knorm,snapkv,expected --kv-budget "$b" --kv-compress prefill
    run $mode --impl snapkv-paged --head-budgets ada --kv-budget "$b" --kv-compress prefill
    run $mode --impl snapkv-paged --head-budgets duo --kv-budget "$b" --kv-compress prefill
    run $mode --impl snapkv --layer-budgets pyramid --kv-budget "$b" --kv-compress prefill
  done
done
kvbench plot "$OUT"
echo "wrote $OUT and ${OUT%.csv}.png"
