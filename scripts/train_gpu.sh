#!/usr/bin/env bash
# Launch the RL job on one GPU node: bash scripts/train_gpu.sh CONFIG [a.b=value ...]
# Environment: NPROC (trainer ranks, default: all GPUs), MODEL (HF checkpoint dir), MASTER_PORT.
# Assumes `pip install -e '.[gpu]'` was done in the active environment.
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:?usage: train_gpu.sh CONFIG [overrides]}
shift
nproc=${NPROC:-$(nvidia-smi -L | wc -l)}
overrides=()
[ -n "${MODEL:-}" ] && overrides+=("engine.model_path=$MODEL")
exec torchrun --nproc-per-node "$nproc" --master-port "${MASTER_PORT:-29511}" \
  -m vime.train --config "$config" "${overrides[@]}" "$@"
