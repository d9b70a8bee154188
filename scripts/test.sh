#!/usr/bin/env bash
# Set up .venv if needed, lint and type check, then run the test suite (gpu tests skip without CUDA).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m unit`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Lint, format and type check first (seconds): a suite run must not hide a broken style or type.
.venv/bin/ruff check vime tests tools
.venv/bin/ruff format --check vime tests tools
.venv/bin/mypy  # config: mypy.ini (vime/)
exec .venv/bin/python -m pytest "$@"
