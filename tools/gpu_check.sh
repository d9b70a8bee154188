#!/usr/bin/env bash
# For a lent single GPU (no vLLM there), in about 5 minutes:
#  1. the colocated transport with its CUDA IPC plug-in (vime.weight_sync.devices.cuda) into a
#     receiving process that opens each handle with the engine receiver's own plug-in code
#     (bit-exact, timed), at two bucket sizes and for a whole Qwen2.5-7B-shaped model (15.2 GB
#     bf16, 512 MiB buckets);
#  2. the gpu test tier: the trainer on the GPU (vime's init_process_group: NCCL, the device of
#     LOCAL_RANK; batches moved to the model's device) trains like the CPU, and the weights it
#     gathers go through the same colocated transport bit for bit.
# Not here, and never run anywhere: the NCCL plug-in (NCCL refuses two ranks of one group on one
# GPU, and it builds on vLLM's pynccl, which cannot be installed there), and the weight-sync
# matrix into real vLLM CUDA engines (ipc on 1 GPU, nccl with PP=2 on 3 GPUs): that needs a
# machine with vLLM's CUDA build, and a harness that starts GPU engines (not written). The CPU
# suite runs the same transports and receivers with the CPU plug-ins (weight_sync.transport
# device: cpu).
# Needs torch with CUDA, megatron-core, pydantic, pyyaml, safetensors, transformers, pytest.
# PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
nvidia-smi -L
"$py" -c "import torch, megatron.core; print('torch', torch.__version__, torch.cuda.get_device_name())"
failed=()  # every part runs, whatever an earlier one did; the exit status says if any failed
timeout 90 "$py" -m vime.weight_sync.ipc_check --mib 512 --repeats 5 || failed+=(ipc-512)
timeout 120 "$py" -m vime.weight_sync.ipc_check --mib 4096 --repeats 3 || failed+=(ipc-4096)
timeout 240 "$py" -m vime.weight_sync.ipc_check --shape qwen2.5-7b --mib 512 --repeats 2 ||
  failed+=(ipc-7b)
timeout 240 "$py" -m pytest -q -m gpu tests/gpu -p no:cacheprovider || failed+=(gpu-tests)
if ((${#failed[@]})); then
  echo "gpu_check FAILED: ${failed[*]}"
  exit 1
fi
echo "gpu_check passed"
