#!/usr/bin/env bash
# The vLLM paper's latency against request rate (Fig. 12 style) from a step-cost profile:
# one profile of the engine's step on this device, then a ShareGPT-like trace replayed at
# each rate for paged blocks and the paper's Orca baselines, on OPT-13B's pool in tokens
# (987 blocks of 16, `kvbench capacity --model opt-13b --gpu-mem 40GiB --weight-dtype fp16
# --margin 0GiB`). Prints the normalized latency (mean of each request's end-to-end latency
# over its output length) per reserve and rate.
#   scripts/paper-latency.sh [OUT_DIR] [RATES] [extra serve-sim options, e.g. --device cuda]
set -euo pipefail
out=${1:-results/paper-latency}
rates=${2:-1,2,4,8,16}
shift 2 || true
mkdir -p "$out"
pool=(--kv-blocks 987 --block-size 16 --max-len 2048 --max-seqs 64 "$@")
if [ ! -f "$out/profile.csv" ]; then
    kvbench serve-sim "${pool[@]}" -q --write-profile "$out/profile.csv" --profile-batch 64
fi
rm -f "$out/latency.csv" "$out/latency-steps.csv"
for rate in ${rates//,/ }; do
    kvbench serve-sim "${pool[@]}" -q --workload sharegpt --requests 1000 --rate "$rate" \
        --reserve paged,orca-oracle,orca-pow2,orca-max --cost-profile "$out/profile.csv" \
        --csv "$out/latency.csv"
done
rm -f "$out/latency-steps.csv"  # every step of every run: about 1 GB, not needed here
python3 - "$out" <<'EOF'
import sys

import pandas as pd

df = pd.read_csv(f"{sys.argv[1]}/latency.csv")
table = df.pivot_table(index="rate_per_s", columns="reserve",
                       values="latency_per_token_mean_ms", sort=False)
print("normalized latency, ms per output token (mean over requests)")
print(table[["paged", "orca-oracle", "orca-pow2", "orca-max"]].round(2).to_string())
EOF
