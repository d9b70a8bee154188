"""Checkpoints carry the KL reference (after SFT it is not the initial checkpoint any more).

One gloo rank, real megatron-core distributed checkpointing: a trainer whose reference became
its (changed) weights at `start_rl` saves; a fresh trainer loads the checkpoint and gets that
reference back, not the initial weights. A checkpoint saved without a reference (kl_coef 0)
still loads into a trainer with one, which keeps its initial reference (and says so).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_harness import COLLECTIVE_TIMEOUT, init_gloo_rank, spawn_ranks

pytestmark = pytest.mark.distributed


def _total(chunks: list[torch.nn.Module]) -> float:
    return sum(float(p.double().sum()) for chunk in chunks for p in chunk.parameters())


def _worker(rank: int, world_size: int, port: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    from vime.config import GRPOConfig, TrainerConfig
    from vime.megatron.checkpoint import TrainingState, load_checkpoint, save_checkpoint
    from vime.megatron.model import initialize_model_parallel
    from vime.trainer import MegatronTrainer

    init_gloo_rank(rank, world_size, port)
    topology = initialize_model_parallel(timeout=COLLECTIVE_TIMEOUT)

    def trainer(kl_coef: float) -> MegatronTrainer:
        grpo = GRPOConfig(kl_coef=kl_coef)
        return MegatronTrainer(TrainerConfig(), model_path=model_dir, topology=topology, grpo=grpo)

    tuned = trainer(0.1)
    with torch.no_grad():
        for param in tuned.parameters():
            param.add_(0.5)  # stands in for the SFT stage
    tuned.start_rl()
    save_checkpoint(tuned, Path(out_dir) / "kl", TrainingState(next_step=3, weight_version=4))
    plain = trainer(0.0)
    save_checkpoint(plain, Path(out_dir) / "plain", TrainingState(next_step=1, weight_version=1))

    resumed = trainer(0.1)
    initial_reference = _total(resumed.reference)
    load_checkpoint(resumed, Path(out_dir) / "kl" / "step_3")
    from_plain = trainer(0.1)
    load_checkpoint(from_plain, Path(out_dir) / "plain" / "step_1")
    result = {
        "saved_reference": _total(tuned.reference),
        "initial_reference": initial_reference,
        "resumed_reference": _total(resumed.reference),
        "resumed_model": _total(resumed.model),
        "saved_model": _total(tuned.model),
        "from_plain_reference": _total(from_plain.reference),
    }
    torch.save(result, Path(out_dir) / "result.pt")
    dist.destroy_process_group()


def test_checkpoint_restores_the_kl_reference(tiny_model_dir, tmp_path):
    spawn_ranks(_worker, 1, (str(tiny_model_dir), str(tmp_path)), timeout_s=240, what="ckpt")
    result = torch.load(tmp_path / "result.pt")
    assert result["saved_reference"] != pytest.approx(result["initial_reference"])
    assert result["resumed_reference"] == pytest.approx(result["saved_reference"], rel=1e-9)
    assert result["resumed_model"] == pytest.approx(result["saved_model"], rel=1e-9)
    assert result["from_plain_reference"] == pytest.approx(result["initial_reference"], rel=1e-9)
