"""The trainer's GPU path on one GPU: the process group and device come from vime's own
`init_process_group` (NCCL, the device of LOCAL_RANK), `MegatronTrainer` moves the model there and
feeds it the packed batch's CPU tensors; an SFT step then two GRPO steps (KL penalty to the SFT
reference) must give what the same steps give on the CPU (gloo, CUDA hidden), and the weights the
GPU trainer gathers for a sync go through the shipped colocated transport (CUDA IPC) into a
second process that opens them with the engine receiver's plug-in code, bit for bit.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

pytestmark = pytest.mark.gpu

GROUPS, GROUP_SIZE, SEQ = 4, 4, 12
STEPS = 2
LR = 1e-2
GRAD_CLIP = 0.3
TIMEOUT = timedelta(minutes=3)


def _batch():
    from vime.testing.batches import synthetic_batch

    return synthetic_batch(GROUPS, GROUP_SIZE, SEQ)


def _worker(kind: str, model_dir: str, out: str) -> None:
    if kind == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything asks CUDA
    import torch.distributed as dist

    from vime.config import GRPOConfig, TrainerConfig
    from vime.megatron.gather import GatherGroups, gather_hf_weights
    from vime.megatron.model import initialize_model_parallel
    from vime.trainer import MegatronTrainer
    from vime.utils.dist_env import default_to_single_process, init_process_group

    default_to_single_process()  # a world of one on loopback, as torchrun would set it
    init_process_group(TIMEOUT)
    topology = initialize_model_parallel(tp=1, pp=1, timeout=TIMEOUT)
    config = TrainerConfig(lr=LR, micro_batch_size=4, grad_clip=GRAD_CLIP)
    trainer = MegatronTrainer(
        config, model_path=model_dir, topology=topology, grpo=GRPOConfig(kl_coef=0.5)
    )
    batch = _batch()
    trainer.start_sft(lr=1e-6)
    sft = trainer.sft_step(batch.input_ids, batch.loss_mask)
    trainer.start_rl()
    metrics = [trainer.train_step(_batch()) for _ in range(STEPS)]
    weights = dict(
        gather_hf_weights(
            trainer.model,
            converter=trainer.converter,
            topology=topology,
            groups=GatherGroups.from_parallel_state(),
            timeout=TIMEOUT,
        )
    )
    result = {
        "backend": dist.get_backend(),
        "device": str(trainer.device),
        "weight_devices": sorted({str(t.device) for t in weights.values()}),
        "sft": sft,
        "metrics": metrics,
        "weights": {name: t.detach().cpu().clone() for name, t in weights.items()},
    }
    if kind == "cuda":
        from vime.weight_sync.ipc_check import send_through_ipc

        # Small buckets: several per sync, the one staging buffer reused and regrown.
        result["ipc"] = send_through_ipc(weights, bucket_bytes=256 * 1024, repeats=2)
    torch.save(result, out)
    dist.destroy_process_group()


def _run(kind: str, model_dir: Path, out: Path) -> dict:
    process = mp.get_context("spawn").Process(target=_worker, args=(kind, str(model_dir), str(out)))
    process.start()
    process.join(timeout=300)
    if process.is_alive():
        process.kill()
        process.join(timeout=10)
        raise TimeoutError(f"the {kind} trainer did not finish within 300 s")
    assert process.exitcode == 0, f"the {kind} trainer exited with {process.exitcode}"
    return torch.load(out, weights_only=False)


def test_gpu_train_steps_equal_cpu_and_sync_through_ipc(tiny_model_dir, tmp_path):
    gpu = _run("cuda", tiny_model_dir, tmp_path / "cuda.pt")
    cpu = _run("cpu", tiny_model_dir, tmp_path / "cpu.pt")
    assert (gpu["backend"], gpu["device"]) == ("nccl", "cuda:0")
    assert gpu["weight_devices"] == ["cuda:0"]
    assert (cpu["backend"], cpu["device"]) == ("gloo", "cpu")
    for key in ("loss", "grad_norm"):
        assert gpu["sft"][key] == pytest.approx(cpu["sft"][key], rel=1e-4), key
    for step, (got, expected) in enumerate(zip(gpu["metrics"], cpu["metrics"], strict=True)):
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-4, abs=1e-6), step
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4), step
        assert got["kl_ref"] == pytest.approx(expected["kl_ref"], rel=1e-3, abs=1e-9), step
        assert got["num_tokens"] == expected["num_tokens"]
    assert cpu["metrics"][0]["grad_norm"] > GRAD_CLIP  # clipping acted
    original = load_file(tiny_model_dir / "model.safetensors")
    assert gpu["weights"].keys() == cpu["weights"].keys() == original.keys()
    for name, expected in cpu["weights"].items():
        assert not torch.equal(gpu["weights"][name], original[name]), f"{name} not updated"
        # AdamW moves an element by about lr whatever its gradient's size: float-noise gradients
        # may move it either way (see test_train_step_parallel).
        torch.testing.assert_close(gpu["weights"][name], expected, rtol=0, atol=2 * STEPS * LR)
    for run in gpu["ipc"]:
        assert run["buckets"] > 1, run
        assert run["bit_exact"], run
