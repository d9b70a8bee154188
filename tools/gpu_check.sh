#!/usr/bin/env bash
# On a GPU machine (a lent single GPU without vLLM: parts 1-2, about 5 minutes):
#  1. the colocated transport with its CUDA IPC plug-in (vime.weight_sync.devices.cuda) into a
#     receiving process that opens each handle with the engine receiver's own plug-in code
#     (bit-exact, timed), at two bucket sizes and for a whole Qwen2.5-7B-shaped model (15.2 GB
#     bf16, 512 MiB buckets);
#  2. the gpu test tier: the trainer on the GPU (vime's init_process_group: NCCL, the device of
#     LOCAL_RANK; batches moved to the model's device) trains like the CPU, and the weights it
#     gathers go through the same colocated transport bit for bit.
#  3. where vLLM's CUDA build is importable: the weight-sync matrix as whole RL jobs into real
#     vLLM CUDA engines (tools/gpu_matrix.py: ipc on 1 GPU and on 2 GPUs at PP=2; nccl at PP=2
#     and PP=2 x VPP=2 on 3 GPUs, into a TP=2 engine and into two engines on 4), each case
#     verified bit for bit by the engines' checksums with delta syncs; cases that need more GPUs
#     than the machine has are listed as skipped. Without vLLM this part says so and is skipped.
# Never run on a GPU so far: the lent machines have no vLLM (parts 1 and 2 ran there in an
# earlier form; part 3 only on CPU: `python tools/gpu_matrix.py --device cpu`). The NCCL plug-in
# (vime.weight_sync.devices.cuda.NcclCommunicator) builds on vLLM's pynccl, so it runs only in
# part 3. The CPU suite runs the same transports and receivers with the CPU plug-ins
# (weight_sync.transport device: cpu).
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
if "$py" -c "import vllm" 2>/dev/null; then
  timeout 3600 "$py" tools/gpu_matrix.py --device cuda || failed+=(gpu-matrix)
else
  echo "gpu_check: no vLLM in $py: the weight-sync matrix into vLLM CUDA engines is SKIPPED"
fi
if ((${#failed[@]})); then
  echo "gpu_check FAILED: ${failed[*]}"
  exit 1
fi
echo "gpu_check passed"
