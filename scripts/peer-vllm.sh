#!/usr/bin/env bash
# serve-sim's scheduler against vLLM's own Scheduler, step for step, on the same traces
# (scripts/peer_vllm.py: 15 configurations, 17 with 0.34's cache-aware admission, and any
# --trace FILE given), after the release's own defaults are compared with kvbench's table
# for it (configs/engines/vllm-X.toml). The version: VLLM_VERSION (0.33.0 or 0.34.0; default
# 0.34.0, the newest kvbench follows). vLLM runs on this CPU with no model and no GPU, in a
# virtual environment of its own per version (built once, in $VLLM_ENV, default
# .vllm-env-VERSION: the CPU build of torch 2.13.0, vllm without its dependencies and the
# pure-Python packages its import chain needs; about 3 GB, a few minutes).
# Usage: [VLLM_VERSION=0.33.0] scripts/peer-vllm.sh [OUT.csv] [--trace FILE ... [--blocks N]
#        [--priority]] [--reverse RULE]  (default: the committed trace
#        results/sample/peer-vllm-trace.csv; OUT: results/sample/peer-vllm-X.Y.csv, and the
#        defaults' comparison beside it, peer-vllm-defaults-X.Y.csv)
set -euo pipefail
cd "$(dirname "$0")/.."
version=${VLLM_VERSION:-0.34.0}
case $version in
  0.33|0.33.0) version=0.33.0 ;;
  0.34|0.34.0) version=0.34.0 ;;
  *) echo "peer-vllm.sh: VLLM_VERSION=$version: kvbench has tables for 0.33.0 and 0.34.0" >&2
     exit 2 ;;
esac
short=${version%.*}
out=${1:-results/sample/peer-vllm-$short.csv}
shift || true
[ $# -gt 0 ] || set -- --trace results/sample/peer-vllm-trace.csv --blocks 400 --priority
env_dir=${VLLM_ENV:-.vllm-env-$version}
if [ ! -x "$env_dir/bin/python" ] || ! "$env_dir/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$env_dir"
  "$env_dir/bin/pip" install --quiet torch==2.13.0
  "$env_dir/bin/pip" install --quiet --no-deps "vllm==$version" || {
    echo "peer-vllm.sh: cannot install vllm==$version (pip install --no-deps vllm==$version)" >&2
    exit 2; }
  "$env_dir/bin/pip" install --quiet packaging pydantic regex numpy cbor2 psutil pyzmq urllib3 \
    "transformers>=5.16.1,<5.21" aiohttp requests openai_harmony openai pillow pybase64 \
    cachetools msgspec cloudpickle uvloop py-cpuinfo prometheus_client xgrammar==0.2.8 fastapi \
    partial_json_parser llguidance einops sentencepiece tiktoken blake3 gguf
  got=$("$env_dir/bin/python" -c "import vllm; print(vllm.__version__)" 2>&1) || {
    echo "peer-vllm.sh: vllm==$version does not import in $env_dir: $got" >&2; exit 2; }
fi
VLLM_TARGET_DEVICE=cpu "$env_dir/bin/python" scripts/peer_vllm.py --out "$out" \
  --defaults-out "${out%/*}/peer-vllm-defaults-$short.csv" "$@"
