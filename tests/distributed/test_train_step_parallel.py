"""`MegatronTrainer.train_step` on several gloo ranks equals the same step on one rank.

Every layout trains the same tiny Qwen2 on the same packed batch (fixed token ids, rewards and
rollout log-probs) for two AdamW steps: TP2 (vocab-parallel log-probs, the TP all-reduce of the
clipping norm), DP2 (each rank its half of the groups, gradients summed over DP, the loss
normalised by the whole batch's tokens), and the one-rank reference with micro-batches of the
same size; a KL penalty (k3) to the frozen reference model is part of the loss. The loss and
gradient norm of both steps and the first step's clipped gradients
(gathered back to HF names) must match the reference within float32 tolerance. The parameters
after both steps get a looser bound: AdamW's first steps move each element by about lr whatever
its gradient's size, so an element whose gradient is float noise may move either way (measured:
up to 1e-4 apart at lr 1e-2, and the second step's gradients 1e-4 apart in consequence).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_harness import COLLECTIVE_TIMEOUT, init_gloo_rank, spawn_ranks
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed

GROUPS, GROUP_SIZE, SEQ = 4, 4, 12  # 16 samples: 2 groups per rank at DP2
STEPS = 2
LR = 1e-2
KL_COEF = 0.5


def _batch():
    from vime.rl.samples import PackedBatch

    generator = torch.Generator().manual_seed(0)
    num = GROUPS * GROUP_SIZE
    input_ids = torch.randint(0, 500, (num, SEQ), generator=generator)
    mask = torch.zeros(num, SEQ - 1)
    for row in range(num):
        mask[row, 4 : 4 + 3 + row % 5] = (
            1.0  # responses of different lengths after a 5-token prompt
        )
    logprobs = -torch.rand(num, SEQ - 1, generator=generator) * 6 * mask
    rewards = torch.rand(num, generator=generator).round()
    return PackedBatch(input_ids, mask, logprobs, rewards, GROUP_SIZE)


def _worker(rank: int, world_size: int, port: int, tp: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from vime.megatron.gather import GatherGroups, gather_hf_weights
    from vime.megatron.model import initialize_model_parallel
    from vime.rl.loss import GRPOConfig
    from vime.trainer import MegatronTrainer, TrainerConfig

    init_gloo_rank(rank, world_size, port)
    topology = initialize_model_parallel(tp=tp, timeout=COLLECTIVE_TIMEOUT)
    dp_group = parallel_state.get_data_parallel_group() if topology.dp_size > 1 else None
    # grad_clip small enough that clipping acts: the TP-summed norm decides the factor.
    config = TrainerConfig(tensor_parallel_size=tp, lr=LR, micro_batch_size=4, grad_clip=0.5)
    # With a KL penalty to the frozen reference (sharded like the policy): 0 at the first step,
    # part of the loss and gradients at the second.
    grpo = GRPOConfig(kl_coef=KL_COEF)
    trainer = MegatronTrainer(
        config, model_path=model_dir, topology=topology, grpo=grpo, dp_group=dp_group
    )

    def gathered() -> dict[str, torch.Tensor]:
        pairs = gather_hf_weights(
            trainer.model,
            converter=trainer.converter,
            topology=topology,
            groups=GatherGroups.from_parallel_state(),
            timeout=COLLECTIVE_TIMEOUT,
        )
        return {name: tensor.clone() for name, tensor in pairs}

    def gathered_grads() -> dict[str, torch.Tensor]:
        # Gathered like the weights: swap the gradients into the parameters for the gather.
        params = list(trainer.model.parameters())
        kept = [p.data for p in params]
        for param in params:
            param.data = param.grad if param.grad is not None else torch.zeros_like(param)
        try:
            return gathered()
        finally:
            for param, data in zip(params, kept, strict=True):
                param.data = data

    metrics = [trainer.train_step(_batch())]
    grads = gathered_grads()  # of the first step, taken at the same weights on every layout
    metrics += [trainer.train_step(_batch()) for _ in range(STEPS - 1)]
    result = {"metrics": metrics, "weights": gathered(), "grads": grads}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _train(world_size: int, tp: int, model_dir: Path, out_dir: Path) -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    spawn_ranks(
        _worker, world_size, (tp, str(model_dir), str(out_dir)), timeout_s=300, what=f"tp{tp}"
    )
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    return _train(1, 1, tiny_model_dir, tmp_path_factory.mktemp("one-rank"))[0]


@pytest.mark.parametrize(("layout", "tp"), [("tp2", 2), ("dp2", 1)])
def test_two_ranks_train_like_one(reference, tiny_model_dir, tmp_path, layout, tp):
    ranks = _train(2, tp, tiny_model_dir, tmp_path / layout)
    for step, expected in enumerate(reference["metrics"]):
        for rank, result in enumerate(ranks):
            got = result["metrics"][step]
            # The loss is summed over this rank's micro-batches: at DP2 each rank holds its half.
            loss = sum(r["metrics"][step]["loss"] for r in ranks) if tp == 1 else got["loss"]
            assert loss == pytest.approx(expected["loss"], rel=1e-4, abs=1e-6), (rank, step)
            # grad_norm is global: after the DP sum, and summed over TP before clipping.
            assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    assert reference["metrics"][0]["grad_norm"] > 0.5  # clipping acted
    # The reference is the initial weights: no KL before the first update, some after it.
    assert reference["metrics"][0]["kl_ref"] == 0.0
    assert reference["metrics"][1]["kl_ref"] > 1e-6
    if tp == 2:
        kl = ranks[0]["metrics"][1]["kl_ref"]
        assert kl == pytest.approx(reference["metrics"][1]["kl_ref"], rel=1e-3)
    # Rank 0 is the pp sender: it holds the gathered model.
    grads, weights = ranks[0]["grads"], ranks[0]["weights"]
    assert grads.keys() == weights.keys() == reference["weights"].keys()
    for name, expected in reference["grads"].items():
        scale = float(expected.abs().max())
        torch.testing.assert_close(grads[name], expected, rtol=1e-3, atol=1e-5 * scale, msg=name)
    original = load_file(tiny_model_dir / "model.safetensors")
    for name, expected in reference["weights"].items():
        assert not torch.equal(expected, original[name]), f"{name} was not updated"
        torch.testing.assert_close(weights[name], expected, rtol=0, atol=2 * STEPS * LR, msg=name)
