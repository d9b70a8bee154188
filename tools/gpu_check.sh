#!/usr/bin/env bash
# For a lent single GPU (no vLLM there): the GPU halves of vime's transports, in under 5 minutes.
# Needs torch with CUDA and numpy/pydantic/pyyaml importable; prints JSON figures.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 240 python -m vime.weight_sync.ipc_check --mib 512 --repeats 5
timeout 60 python -m pytest -q -m gpu tests/gpu -p no:cacheprovider
