#!/usr/bin/env bash
# kvbench's eviction scorers against NVIDIA kvpress 0.5.5's presses on the same SmolLM2 prompt
# (512 tokens, compressed once to 256 and 128 positions per KV head; ThinK to 32 and 16 of 64
# channels), kvbench's own variant and --kv-reference kvpress: the share of (layer, KV head)
# pairs whose kept positions are identical, and for most methods the perplexity of the 511
# tokens after (scripts/peer_kvpress.py; about 1 h on 2 cores). kvpress pins
# transformers below 5.3, so it runs in a virtual environment of its own (built once, in
# $KVPRESS_ENV, default .kvpress-env). Usage: scripts/peer-kvpress.sh [OUT.csv]
# PEER_METHODS=ada,snapkv runs only those methods (the full cache's perplexity still runs).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/sample/peer-kvpress.csv}
env_dir=${KVPRESS_ENV:-.kvpress-env}
if [ ! -x "$env_dir/bin/python" ]; then
  python3 -m venv "$env_dir"
  "$env_dir/bin/pip" install --quiet torch==2.13.0 kvpress==0.5.5
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
python scripts/peer_kvpress.py kvbench "$work/kvbench.json"
"$env_dir/bin/python" scripts/peer_kvpress.py kvpress "$work/kvpress.json" "$work/kvbench.json"
python scripts/peer_kvpress.py compare "$work/kvbench.json" "$work/kvpress.json" "$out"
