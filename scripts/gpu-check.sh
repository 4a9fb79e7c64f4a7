#!/usr/bin/env bash
# Exercise every CUDA path of kvbench end to end in a few minutes and keep the results.
#   scripts/gpu-check.sh OUTDIR
# Writes OUTDIR/*.csv and OUTDIR/gpu-check.log; exits non-zero if any step fails.
set -uo pipefail
out=${1:?usage: scripts/gpu-check.sh OUTDIR}
mkdir -p "$out"
log="$out/gpu-check.log"
status=0
step() {
    echo "\$ $*" | tee -a "$log"
    if ! "$@" 2>&1 | tee -a "$log"; then status=1; echo "FAILED: $*" | tee -a "$log"; fi
}
export COLUMNS=140
step nvidia-smi
step python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
step python -m pytest -q -m cuda tests
for dtype in float32 float16 bfloat16; do
    step kvbench verify --device cuda --dtype "$dtype" --csv "$out/verify.csv"
    step kvbench bench --device cuda --dtype "$dtype" --csv "$out/bench.csv"
    step kvbench bench --device cuda --dtype "$dtype" --prompt-len 32768 --decode-len 32 \
        --batch 4 --hidden 4096 --q-heads 32 --kv-heads 8 --head-dim 128 --no-recompute \
        --csv "$out/bench-long.csv"
    step kvbench memory --device cuda --dtype "$dtype" --csv "$out/memory.csv"
done
step python -W error -m kvbench capacity --allocate --case both --csv "$out/allocation.csv"
echo "gpu-check finished with status $status" | tee -a "$log"
exit $status
