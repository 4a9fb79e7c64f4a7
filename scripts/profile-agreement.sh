#!/usr/bin/env bash
# Does a cost profile's replay of a trace agree with the trace run for real? On one device:
# serve-sim runs a trace for real (every step timed), measures the engine's step-cost profile
# on the same layer, then replays the same trace from the profile, and prints requests/s,
# TTFT p50 and TPOT p50 of both with their ratio (the target: within 15%).
#   scripts/profile-agreement.sh [OUT_DIR] [extra serve-sim options, e.g. --device cuda]
set -euo pipefail
out=${1:-results/profile-agreement}
shift || true
mkdir -p "$out"
trace=(--requests 150 --len-dist lognormal:96:0.8 --output-dist lognormal:64:0.8
       --max-len 512 --rate 25 --kv-blocks 128 --block-size 16 --reserve paged "$@")
rm -f "$out"/real*.csv "$out"/replay*.csv "$out"/profile.csv
kvbench serve-sim "${trace[@]}" -q --csv "$out/real.csv"
kvbench serve-sim "${trace[@]}" -q --write-profile "$out/profile.csv" --profile-batch 64
kvbench serve-sim "${trace[@]}" -q --cost-profile "$out/profile.csv" --csv "$out/replay.csv"
python3 - "$out" <<'EOF'
import sys

import pandas as pd

out = sys.argv[1]
real, replay = (pd.read_csv(f"{out}/{n}.csv").iloc[-1] for n in ("real", "replay"))
print(f"{'figure':18s} {'real':>10s} {'replayed':>10s} {'replayed/real':>14s}")
for col in ("requests_per_s", "ttft_p50_ms", "tpot_p50_ms", "steps", "mean_batch"):
    a, b = real[col], replay[col]
    print(f"{col:18s} {a:10.3f} {b:10.3f} {b / a:14.3f}")
EOF
