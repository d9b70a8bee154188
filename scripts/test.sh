#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite (unit + distributed; gpu tests skip without CUDA).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m unit`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
