#!/usr/bin/env bash
# kvbench under the lent GPU machine's versions, on the CPU: Python 3.12, torch 2.11.0,
# triton 3.6.0 and numpy 2.5.2 in a virtual environment of their own, the project on
# PYTHONPATH as gpu-check runs it there; then verify --impl all on the CPU and the CPU tests.
#   scripts/compat-check.sh [PYTEST ARGS...]
# COMPAT_VENV (default .compat-venv) keeps the environment between runs; PYTHON312 names the
# interpreter that makes it. PyPI's torch 2.11.0 is a CUDA build: the first run downloads
# about 3 GB (torch and NVIDIA's libraries), which import without a GPU.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${COMPAT_VENV:-$repo/.compat-venv}
py=${PYTHON312:-python3.12}
if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
fi
"$venv/bin/python" -m pip install --quiet torch==2.11.0 triton==3.6.0 numpy==2.5.2 \
    typer==0.27.2 click==8.5.0 rich==15.0.0 pandas==3.0.6 "pytest>=8,<9.2" "pytest-xdist>=3" "hypothesis>=6.100" \
    "matplotlib>=3.7" "numba>=0.60" transformers==5.17.0 safetensors  # the lent machine has numba, for splitk
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
# inductor's cache of its own: kernels another torch built into the shared default
# (/tmp/torchinductor_$USER) load here and abort the process (torch 2.11 reading 2.13's)
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$venv/inductor-cache}
cd "$repo"
"$venv/bin/python" - <<'PY'
import platform, numpy, torch, triton
print(f"compat-check: python {platform.python_version()}, torch {torch.__version__}, "
      f"triton {triton.__version__}, numpy {numpy.__version__}")
PY
echo "\$ python -m kvbench verify --impl all --device cpu --no-csv"
"$venv/bin/python" -m kvbench verify --impl all --device cpu --no-csv
echo "\$ python -m pytest -m 'not cuda' tests $*"
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not cuda" tests "$@"
