#!/usr/bin/env bash
# Host time of a paged decode step against the table's width (issue: block tables on the
# device). The same ragged batch (B=32, lognormal prompts of mean 200) decoded by `paged` with
# --max-len 2,048 and 32,768: the table a sequence may reach is 128 or 2,048 blocks of 16
# wide, but a step's host work should depend on the blocks it opens, not on that width.
# Passes when the step at 32,768 is within 1.5x of the step at 2,048 (one run; the machine's
# noise applies). Then the host time of a triton ragged step against static's whole step
# (scripts/triton_host_time.py: within 2x). Usage: scripts/paged-host-time.sh [extra kvbench bench options]
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for max_len in 2048 32768; do
  python -m kvbench bench --impl paged --device cpu --batch 32 --len-dist lognormal:200:0.5 \
    --max-len "$max_len" --hidden 64 --q-heads 4 --kv-heads 2 --head-dim 16 --decode-len 64 \
    --block-size 16 --csv "$out/host.csv" "$@" > /dev/null 2> "$out/log" || { cat "$out/log"; exit 2; }
done
python - "$out/host.csv" <<'PY'
import sys
import pandas as pd

rows = pd.read_csv(sys.argv[1]).set_index("max_len")["cached_ms_per_step"]
narrow, wide = rows[2048], rows[32768]
ratio = wide / narrow
print(f"paged decode step: {narrow:.3f} ms at --max-len 2048, {wide:.3f} ms at 32768: "
      f"{ratio:.2f}x ({'within' if ratio <= 1.5 else 'ABOVE'} the 1.5x bound)")
sys.exit(0 if ratio <= 1.5 else 1)
PY
python scripts/triton_host_time.py
