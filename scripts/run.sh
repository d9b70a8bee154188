#!/usr/bin/env bash
# Set up .venv if needed, then run the main job: the tiny CPU SFT -> async-RL run, end to end (builds
# the tiny model if absent, launches a vLLM CPU engine, a supervised warm start, then GRPO with
# megatron-core, weights synced every step; held-out pass@1 before, after SFT, after RL).
# Extra arguments are dotted config overrides, e.g. `bash scripts/run.sh num_steps=10`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/torchrun --nproc-per-node "${NPROC:-1}" --master-addr 127.0.0.1 \
  --master-port "${MASTER_PORT:-29511}" \
  -m vime.train --config "${CONFIG:-configs/tiny_cpu_sft_rl.yaml}" "$@"
