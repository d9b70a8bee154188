#!/usr/bin/env bash
# Set up .venv if needed, then run the main job. Extra arguments go to the job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m vime.demo "$@"
