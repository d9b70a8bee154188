#!/usr/bin/env bash
# For a lent single GPU (no vLLM there), in under 5 minutes: the shipped IpcTransport into a
# receiving process (bit-exact, timed), then the gpu test tier. NcclTransport needs vLLM's pynccl,
# which cannot be installed there: it stays unchecked until a GPU machine with vLLM runs it.
# Needs torch with CUDA and numpy/pydantic/pyyaml importable; prints JSON figures.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 240 python -m vime.weight_sync.ipc_check --mib 512 --repeats 5
timeout 60 python -m pytest -q -m gpu tests/gpu -p no:cacheprovider
