#!/usr/bin/env bash
# Exercise every CUDA path of kvbench end to end in a few minutes and keep the results.
#   scripts/gpu-check.sh OUTDIR
# Writes OUTDIR/*.csv, OUTDIR/*.png and OUTDIR/gpu-check.log; exits non-zero if a step fails.
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
    # the reference cases, every implementation that runs on CUDA
    step kvbench verify --device cuda --dtype "$dtype" --csv "$out/verify.csv"
    step kvbench bench --device cuda --dtype "$dtype" --csv "$out/bench.csv"
    step kvbench memory --device cuda --dtype "$dtype" --csv "$out/memory.csv"
done
for dtype in float16 bfloat16; do
    # long context, a Llama-3-8B-shaped layer: the bandwidth limit (concat's dense prefill
    # would need a 32k x 32k score matrix per head, so it sits this one out)
    step kvbench bench --device cuda --dtype "$dtype" --impl static,sdpa,paged \
        --batch 4 --prompt-len 4096,32768 --decode-len 32 --hidden 4096 --q-heads 32 \
        --kv-heads 8 --head-dim 128 --no-recompute --no-prefill --csv "$out/bench-long.csv"
done
for backend in flash efficient cudnn math; do
    # which SDPA backends this GPU offers for decode (unavailable ones exit 2 by design)
    kvbench verify --device cuda --dtype float16 --impl sdpa --sdpa-backend "$backend" \
        --csv "$out/verify-sdpa-backends.csv" >> "$log" 2>&1 \
        && echo "sdpa backend $backend: ok" | tee -a "$log" \
        || echo "sdpa backend $backend: not available (see log)" | tee -a "$log"
done
step kvbench bench --device cuda --dtype float16 --prompt-len 16,64,256,1024,4096 \
    --decode-len 16 --csv "$out/bench-context.csv"
step kvbench plot "$out/bench-context.csv" -o "$out/bench-context.png"
step python -W error -m kvbench capacity --allocate --case both --csv "$out/allocation.csv"
echo "gpu-check finished with status $status" | tee -a "$log"
exit $status
