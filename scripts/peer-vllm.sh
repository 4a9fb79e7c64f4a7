#!/usr/bin/env bash
# serve-sim's scheduler against vLLM 0.33.0's own Scheduler, step for step, on the same traces
# (scripts/peer_vllm.py: 15 configurations, and any --trace FILE given). vLLM runs on this CPU
# with no model and no GPU, in a virtual environment of its own (built once, in $VLLM_ENV,
# default .vllm-env: the CPU build of torch 2.13.0, vllm 0.33.0 without its dependencies and
# the pure-Python packages its import chain needs; about 3 GB, a few minutes).
# Usage: scripts/peer-vllm.sh [OUT.csv] [--trace FILE ... [--blocks N] [--priority]]
#        [--reverse RULE]  (default: the committed trace results/sample/peer-vllm-trace.csv)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/sample/peer-vllm.csv}
shift || true
[ $# -gt 0 ] || set -- --trace results/sample/peer-vllm-trace.csv --blocks 400 --priority
env_dir=${VLLM_ENV:-.vllm-env}
if [ ! -x "$env_dir/bin/python" ] || ! "$env_dir/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$env_dir"
  "$env_dir/bin/pip" install --quiet torch==2.13.0
  "$env_dir/bin/pip" install --quiet --no-deps vllm==0.33.0
  "$env_dir/bin/pip" install --quiet packaging pydantic regex numpy cbor2 psutil pyzmq urllib3 \
    "transformers>=5.16.1,<5.21" aiohttp requests openai_harmony openai pillow pybase64 \
    cachetools msgspec cloudpickle uvloop py-cpuinfo prometheus_client xgrammar==0.2.8 fastapi \
    partial_json_parser llguidance einops sentencepiece tiktoken blake3 gguf
fi
VLLM_TARGET_DEVICE=cpu "$env_dir/bin/python" scripts/peer_vllm.py --out "$out" "$@"
