#!/usr/bin/env bash
# A hybrid model's decode against the same model with every layer full, at long contexts:
# Gemma-3-270M (15 sliding layers of window 512, 3 full) at 1k, 4k and 16k positions, each
# length run hybrid then --all-full back to back, so the two sit under the same load.
#
#   scripts/hybrid-bench.sh [OUT.csv] [LENGTHS] [IMPLS]
#
# Verified on a 1,024-token prompt before each timing (--no-recompute: path A at 16k is a
# quadratic forward per step); --no-prefill (the prompt is filled once, untimed, and
# transformers' generate row, which would prefill twice a round, is left out).
# Needs the gemma3-270m packages (docs/models.md). About 10 minutes on a quiet 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/hybrid-gemma3.csv}
LENGTHS=${2:-1024,4096,16384}
IMPLS=${3:-static,paged}
for T in ${LENGTHS//,/ }; do
  for full in "" --all-full; do
    kvbench bench --model gemma3-270m --prompt-len "$T" --decode-len 8 --impl "$IMPLS" \
      --no-recompute --no-prefill --warmup 1 --rounds 5 --csv "$OUT" -q $full
  done
done
echo "wrote $OUT"
