#!/usr/bin/env bash
# Exercise every CUDA path of kvbench end to end and summarise it on one screen.
#   scripts/gpu-check.sh OUTDIR
# Runs from the checkout (python3 -m kvbench, the repository on PYTHONPATH): nothing to install.
# Writes OUTDIR/*.csv, OUTDIR/*.png, OUTDIR/gpu-check.log and OUTDIR/summary.txt, and exits
# non-zero if any step or check failed. No GPU has timed it yet: its first part was estimated
# at 5 to 8 minutes on one H200 (torch.compile and Triton compile on the first run), and the
# ragged, tensor-parallel and technique steps come after it. Where a call is capped at 10
# minutes, give it a timeout and read summary.txt for the steps that finished.
set -uo pipefail
out=${1:?usage: scripts/gpu-check.sh OUTDIR}
repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/gpu-check.log"
: > "$log"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" COLUMNS=140 PYTHONWARNINGS=ignore
cd "$repo"
py=${PYTHON:-python3}
start=$(date +%s)
failed=0
step() {  # run one step, log it, and count it when it exits non-zero
    echo "\$ $*" >> "$log"
    echo "[$(( $(date +%s) - start ))s] $*"
    if ! "$@" >> "$log" 2>&1; then failed=$((failed + 1)); echo "FAILED: $*" | tee -a "$log"; fi
}
kv() { step "$py" -m kvbench "$@"; }

"$py" - <<'PY' 2>&1 | tee -a "$log" || { echo "gpu-check: torch sees no CUDA device here; run it where a GPU is lent"; exit 2; }
import platform, sys
import torch
print(f"python {platform.python_version()}  torch {torch.__version__}  cuda {torch.version.cuda}")
try:
    import triton
    print(f"triton {triton.__version__}")
except ImportError:
    print("triton: not installed")
if not torch.cuda.is_available():
    sys.exit(1)
p = torch.cuda.get_device_properties(0)
print(f"device {p.name}  {p.total_memory / 2**30:.1f} GiB  {p.multi_processor_count} SMs")
PY
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv >> "$log" 2>&1

step "$py" -m pytest -q -m cuda -p no:cacheprovider tests
for dtype in float32 float16 bfloat16; do
    # the reference cases (and with no shape option, the small case) on every CUDA
    # implementation; compiled and flex (tens of seconds of compiling per shape) in fp16/bf16
    impls=all
    [ "$dtype" = float32 ] && impls=concat,static,sdpa,paged,triton
    kv verify --device cuda --dtype "$dtype" --impl "$impls" --csv "$out/verify.csv"
    kv bench --device cuda --dtype "$dtype" --impl "$impls" --csv "$out/bench.csv"
    kv memory --device cuda --dtype "$dtype" --impl "$impls" --csv "$out/memory.csv"
done
# long context, a Llama-3-8B-shaped layer: how close each cache gets to the copy bandwidth
# (issue target: triton >= 80% of copy here; concat's dense prefill would need 8 x 32 x 32k x
# 32k scores, so it is left out)
kv bench --device cuda --dtype float16,bfloat16 --impl static,sdpa,paged,triton \
    --batch 8 --prompt-len 32768 --decode-len 8 --hidden 4096 --q-heads 32 --kv-heads 8 \
    --head-dim 128 --no-recompute --no-prefill --csv "$out/bench-long.csv"
kv bench --device cuda --dtype float16 --impl compiled,flex \
    --batch 8 --prompt-len 32768 --decode-len 8 --hidden 4096 --q-heads 32 --kv-heads 8 \
    --head-dim 128 --no-recompute --no-prefill --csv "$out/bench-long.csv"
# the Triton kernel with a pinned split count against its own rule, and a block size of 1
kv bench --device cuda --dtype float16 --impl triton --splits 1 --batch 8 --prompt-len 32768 \
    --decode-len 8 --hidden 4096 --q-heads 32 --kv-heads 8 --head-dim 128 --no-recompute \
    --no-prefill --csv "$out/bench-splits.csv"
kv verify --device cuda --dtype bfloat16 --impl triton --block-size 1 --head-dim 80,96 \
    --prompt-len 1000 --decode-len 8 --csv "$out/verify.csv"
# quantized caches: the exact check on CUDA, then the Triton kernel decoding int8/fp8/int4 in
# registers against fp16 at the long-context shape (target: int8 or fp8 >= 1.6x faster)
kv verify --device cuda --dtype float16,bfloat16 --kv-dtype fp8,int8,int4 --impl static,paged,triton \
    --prompt-len 1000 --decode-len 8 --csv "$out/verify.csv"
kv bench --device cuda --dtype float16 --kv-dtype none,int8,fp8,int4 --impl triton --batch 8 \
    --prompt-len 32768 --decode-len 8 --hidden 4096 --q-heads 32 --kv-heads 8 --head-dim 128 \
    --no-recompute --no-prefill --csv "$out/bench-kv.csv"
# ragged batches: every implementation exact per sequence, then the share of KV memory that
# holds tokens (preallocated vs paged) and the ragged decode timed (triton reads only real
# positions; static the padded maximum)
kv verify --device cuda --dtype float16 --impl all --rope --seq-lens 1,17,64,300,1000,2047 \
    --max-len 2100 --csv "$out/verify-ragged.csv"
kv memory --device cuda --config configs/sweeps/serving-waste.toml --csv "$out/memory-serving.csv"
kv plot "$out/memory-serving.csv" -o "$out/memory-serving.png"
kv bench --device cuda --dtype float16 --impl static,sdpa,paged,triton,compiled --batch 32 \
    --len-dist lognormal:2000:1.0 --max-len 32768 --decode-len 8 --hidden 4096 --q-heads 32 \
    --kv-heads 8 --head-dim 128 --no-recompute --no-prefill --csv "$out/bench-ragged.csv"
# the other cache techniques on CUDA: a sliding window with sinks, a shared prefix (paged and
# the Triton kernel reading shared blocks), eviction; then all of them side by side
kv verify --device cuda --dtype float16 --impl window --window 256 --sinks 4 --rope \
    --prompt-len 1000 --decode-len 16 --csv "$out/verify-techniques.csv"
kv verify --device cuda --dtype float16 --impl paged,triton --shared-prefix 512 --block-size 16 \
    --batch 4 --prompt-len 1000 --decode-len 16 --csv "$out/verify-techniques.csv"
kv verify --device cuda --dtype float16 --impl h2o --kv-budget 256 --prompt-len 1000 \
    --decode-len 16 --csv "$out/verify-techniques.csv"
kv bench --device cuda --config configs/sweeps/cache-techniques.toml \
    --csv "$out/bench-techniques.csv"
kv plot "$out/bench-techniques.csv" -o "$out/bench-techniques.png"
# tensor parallelism: two ranks on two GPUs (NCCL), every implementation against path A on one
# device, then the sharded step, its all-reduce and each rank's memory; skipped on one GPU
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())')
if [ "$gpus" -ge 2 ]; then
    tp() { step "$py" -m torch.distributed.run --standalone --nproc-per-node 2 -m kvbench "$@"; }
    tp verify --tp 2 --device cuda --dtype float16 --impl all --csv "$out/verify-tp.csv"
    tp bench --tp 2 --device cuda --dtype float16 --impl static,sdpa,paged,triton --batch 8 \
        --prompt-len 8192 --decode-len 8 --hidden 4096 --q-heads 32 --kv-heads 8 --head-dim 128 \
        --no-recompute --no-prefill --csv "$out/bench-tp.csv"
    tp memory --tp 2 --device cuda --dtype float16 --impl static,paged --kv-heads 2,1 \
        --csv "$out/memory-tp.csv"
else
    echo "tensor parallel: skipped, $gpus GPU here (--tp 2 needs two)" | tee -a "$log" \
        >> "$out/notes.txt"
fi
for backend in flash efficient cudnn math; do
    # which SDPA backends take decode here, at the reference shape (exit 2 = not available)
    echo "\$ verify --impl sdpa --sdpa-backend $backend" >> "$log"
    "$py" -m kvbench verify --device cuda --dtype float16 --impl sdpa --sdpa-backend "$backend" \
        --batch 2 --prompt-len 256 --decode-len 32 --csv "$out/verify-sdpa-backends.csv" \
        >> "$log" 2>&1
    echo "sdpa backend $backend: exit $?" >> "$out/sdpa-backends.txt"
done
kv bench --device cuda --dtype float16 --prompt-len 16,64,256,1024,4096 --decode-len 16 \
    --csv "$out/bench-context.csv"
kv plot "$out/bench-context.csv" -o "$out/bench-context.png"
step "$py" -W error -m kvbench capacity --allocate --case both --csv "$out/allocation.csv"

echo "steps failed: $failed; $(( $(date +%s) - start ))s" >> "$log"
"$py" scripts/gpu_summary.py "$out" "$failed" "$(( $(date +%s) - start ))" | tee "$out/summary.txt"
exit "${PIPESTATUS[0]}"
