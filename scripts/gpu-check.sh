#!/usr/bin/env bash
# kvbench's GPU check within a time budget; see scripts/gpu_check.py for the plan.
#   scripts/gpu-check.sh OUTDIR [SECONDS]              on a GPU (default budget 540 s)
#   scripts/gpu-check.sh --rehearse OUTDIR [SECONDS]   the same plan at small shapes on the CPU
# OUTDIR gets summary.txt (rewritten after every step), gpu-check.log and results.tar.gz.
exec "${PYTHON:-python3}" "$(dirname "$0")/gpu_check.py" "$@"
