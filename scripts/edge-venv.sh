#!/usr/bin/env bash
# Build the edge server's interpreter: a venv with torch (CPU), numpy < 2 and nvidia-pytriton, which
# bundles Triton Inference Server 2.51 and its Python backend. `orin-agent edge` runs the server
# under it (partition/offload/launch.py says why it is not the project's own environment).
# Usage: bash scripts/edge-venv.sh [DIR]   (default ~/.cache/orin-agent/edge-venv; PYTHON=... picks
# the base interpreter, which must have a shared libpython: pyenv builds and Debian's python3 do).
set -euo pipefail
dir=${1:-$HOME/.cache/orin-agent/edge-venv}
base=${PYTHON:-python3}
check='import numpy, torch, pytriton, safetensors, tokenizers; assert int(numpy.__version__.split(".")[0]) < 2'
if [ -x "$dir/bin/python" ] && "$dir/bin/python" -c "$check" 2>/dev/null; then
  echo "edge venv ready: $dir"; exit 0
fi
"$base" -c 'import sysconfig, sys; sys.exit(0 if sysconfig.get_config_var("Py_ENABLE_SHARED") else "this Python has no shared libpython, which the Triton Python backend stub needs")'
"$base" -m venv "$dir"
"$dir/bin/python" -m pip install -q --upgrade pip
# torch by version: the CPU build lies on this kind of machine's disk (no multi-GB CUDA download).
"$dir/bin/python" -m pip install -q torch==2.13.0
"$dir/bin/python" -m pip install -q "numpy>=1.24,<2" "nvidia-pytriton==0.7.0" "safetensors>=0.4" "tokenizers>=0.15" "gguf>=0.10"
"$dir/bin/python" -c "$check"
echo "edge venv ready: $dir"
