"""`MegatronTrainer.train_step` on several gloo ranks equals the same step on one rank.

Every layout trains the same tiny Qwen2 on the same packed batch (fixed token ids, rewards and
rollout log-probs) for one supervised step (`sft_step`), then two GRPO steps with a fresh AdamW
(`start_rl`), all through megatron's own schedule: TP2 (vocab-parallel
log-probs, the TP all-reduce of the clipping norm), DP2 (each rank its half of the groups,
gradients summed over DP, the loss normalised by the whole batch's tokens), PP2 (1F1B over two
stages of one layer each: activations and their gradients sent between stages, the loss on the
last), TP2xPP2 (4 ranks), PP2 on a tied-embedding variant (the embedding's gradient summed
over its first- and last-stage copies, which must stay equal), and PP2 x VPP2 on a four-layer
tied variant (two chunks per rank through megatron's interleaved 1F1B: rank 0 holds layers 0
and 2, rank 1 layers 1 and 3; the tied copies on rank 0's first and rank 1's last chunk);
against the one-rank reference
with micro-batches of the same size; a KL penalty (k3) to the frozen reference (the SFT
weights, run through the same schedule, forward only) is part of the loss. The loss and
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
from megatron_harness import COLLECTIVE_TIMEOUT, build_tied_variant, init_gloo_rank, spawn_ranks
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed

GROUPS, GROUP_SIZE, SEQ = 4, 4, 12  # 16 samples: 2 groups per rank at DP2
STEPS = 2
LR = 1e-2
KL_COEF = 0.5
GRAD_CLIP = 0.1  # below every layout's first gradient norm: clipping acts


def _batch():
    from vime.testing.batches import synthetic_batch

    return synthetic_batch(GROUPS, GROUP_SIZE, SEQ)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    tp: int,
    pp: int,
    vp: int | None,
    model_dir: str,
    out_dir: str,
) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from vime.config import GRPOConfig, TrainerConfig
    from vime.megatron.gather import GatherGroups, gather_hf_weights
    from vime.megatron.model import initialize_model_parallel, unwrap
    from vime.trainer import MegatronTrainer

    init_gloo_rank(rank, world_size, port)
    topology = initialize_model_parallel(tp=tp, pp=pp, vp=vp, timeout=COLLECTIVE_TIMEOUT)
    dp_group = parallel_state.get_data_parallel_group() if topology.dp_size > 1 else None
    # grad_clip small enough that clipping acts: the TP-summed norm decides the factor.
    config = TrainerConfig(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        virtual_pipeline_parallel_size=vp,
        lr=LR,
        micro_batch_size=4,
        grad_clip=GRAD_CLIP,
    )
    # With a KL penalty to the frozen reference (sharded like the policy): 0 at the first step,
    # part of the loss and gradients at the second; and capped geometric importance weights of
    # the trainer over the (synthetic) rollout log-probs, their quantiles from every DP rank.
    grpo = GRPOConfig(kl_coef=KL_COEF, off_policy={"level": "geometric", "cap": 2.0})
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
        params = trainer.parameters()
        kept = [p.data for p in params]
        for param in params:
            param.data = param.grad if param.grad is not None else torch.zeros_like(param)
        try:
            return gathered()
        finally:
            for param, data in zip(params, kept, strict=True):
                param.data = data

    # A supervised step first (SFT warm start), then RL from those weights: the reference for
    # the KL penalty becomes them (start_rl), sharded like the policy on every layout.
    # (A small SFT lr: AdamW moves every element by about lr, so float-noise gradients would
    # leave the layouts' weights up to 2 lr apart before the RL gradients are compared.)
    batch = _batch()
    trainer.start_sft(lr=1e-6)
    sft = trainer.sft_step(batch.input_ids, batch.loss_mask)
    trainer.start_rl()
    metrics = [trainer.train_step(_batch())]
    grads = gathered_grads()  # of the first step, taken at the same weights on every layout
    metrics += [trainer.train_step(_batch()) for _ in range(STEPS - 1)]
    result = {
        "sft": sft,
        "metrics": metrics,
        "weights": gathered(),
        "grads": grads,
        "topology": topology,
    }
    result["num_chunks"] = len(trainer.model)
    for gpt in map(unwrap, trainer.model):
        if gpt.share_embeddings_and_output_weights and (gpt.pre_process or gpt.post_process):
            # The tied embedding on the first stage, its copy (the output layer) on the last.
            result["tied"] = gpt.shared_embedding_or_output_weight().detach().clone()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _train(
    world_size: int, tp: int, pp: int, model_dir: Path, out_dir: Path, vp: int | None = None
) -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    what = f"tp{tp} pp{pp} vp{vp} world {world_size}"
    args = (tp, pp, vp, str(model_dir), str(out_dir))
    spawn_ranks(_worker, world_size, args, timeout_s=300, what=what)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


@pytest.fixture(scope="module")
def tied_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return build_tied_variant(tiny_model_dir, tmp_path_factory.mktemp("tied"))


@pytest.fixture(scope="module")
def tied_4layer_dir(model_builder, tmp_path_factory) -> Path:
    return build_tied_variant(
        model_builder("qwen2-tiny-4layer"), tmp_path_factory.mktemp("tied-4layer")
    )


@pytest.fixture(scope="module")
def references(tiny_model_dir, tied_model_dir, tmp_path_factory):
    """One-rank runs, lazily: model dir -> rank 0's result."""
    results: dict[Path, dict] = {}

    def reference(model_dir: Path) -> dict:
        if model_dir not in results:
            out = tmp_path_factory.mktemp("one-rank")
            results[model_dir] = _train(1, 1, 1, model_dir, out)[0]
        return results[model_dir]

    return reference


def _merged(ranks: list[dict], key: str) -> dict[str, torch.Tensor]:
    """The pp senders' gathered tensors (each its stage's), as one state dict."""
    merged: dict[str, torch.Tensor] = {}
    for result in ranks:
        if result["topology"].is_pp_sender:
            assert not merged.keys() & result[key].keys()
            merged.update(result[key])
    return merged


@pytest.mark.parametrize(
    ("layout", "world_size", "tp", "pp", "vp", "tied"),
    [
        ("tp2", 2, 2, 1, None, False),
        ("dp2", 2, 1, 1, None, False),
        ("pp2", 2, 1, 2, None, False),
        ("tp2pp2", 4, 2, 2, None, False),
        ("pp2-tied", 2, 1, 2, None, True),
        ("pp2vpp2-tied", 2, 1, 2, 2, True),
    ],
)
def test_parallel_layouts_train_like_one_rank(
    references,
    tiny_model_dir,
    tied_model_dir,
    tied_4layer_dir,
    tmp_path,
    layout,
    world_size,
    tp,
    pp,
    vp,
    tied,
):
    model_dir = tied_model_dir if tied else tiny_model_dir
    if vp:
        model_dir = tied_4layer_dir
    reference = references(model_dir)
    ranks = _train(world_size, tp, pp, model_dir, tmp_path / layout, vp=vp)
    assert all(r["num_chunks"] == (vp or 1) for r in ranks)
    for result in ranks:
        for key in ("loss", "grad_norm", "confident_fraction"):
            assert result["sft"][key] == pytest.approx(reference["sft"][key], rel=1e-4), key
    for step, expected in enumerate(reference["metrics"]):
        for rank, result in enumerate(ranks):
            got = result["metrics"][step]
            # Every rank reports the step's metrics: summed over DP, sent from the last stage.
            assert got["loss"] == pytest.approx(expected["loss"], rel=1e-4, abs=1e-6), (rank, step)
            assert got["num_tokens"] == expected["num_tokens"]
            assert got["kl_ref"] == pytest.approx(expected["kl_ref"], rel=1e-3, abs=1e-9)
            # grad_norm is global: after the DP sum, and summed over TP and PP before clipping.
            assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
            for key in ("is_weight_mean", "is_capped_fraction", "mismatch_kl"):
                assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-9), key
            for key in ("is_weight_p10", "is_weight_p50", "is_weight_p90"):
                # Quantiles to a bin (5%): a weight on a bin's edge may fall either side.
                assert got[key] == pytest.approx(expected[key], rel=0.06), key
    assert reference["metrics"][0]["grad_norm"] > GRAD_CLIP  # clipping acted
    # The weights acted: spread out, below 1 for most samples (random rollout log-probs).
    first = reference["metrics"][0]
    assert first["is_weight_p10"] < first["is_weight_p90"] and first["is_weight_mean"] != 1.0
    # The reference is the SFT model: no KL before the first RL update, some after it.
    assert reference["metrics"][0]["kl_ref"] == 0.0
    assert reference["metrics"][1]["kl_ref"] > 1e-6
    grads, weights = _merged(ranks, "grads"), _merged(ranks, "weights")
    assert grads.keys() == weights.keys() == reference["weights"].keys()
    if tied:
        # The tied embedding's two copies (first stage, last stage) took the same updates.
        copies = [r["tied"] for r in ranks if "tied" in r]
        assert len(copies) == 2
        torch.testing.assert_close(copies[0], copies[1], rtol=0, atol=0)
    for name, expected in reference["grads"].items():
        scale = float(expected.abs().max())
        torch.testing.assert_close(
            grads[name],
            expected,
            rtol=1e-3,
            atol=1e-4 * scale,
            msg=lambda m, name=name: f"{name}: {m}",
        )
    original = load_file(model_dir / "model.safetensors")
    for name, expected in reference["weights"].items():
        assert not torch.equal(expected, original[name]), f"{name} was not updated"
        torch.testing.assert_close(weights[name], expected, rtol=0, atol=2 * STEPS * LR, msg=name)
