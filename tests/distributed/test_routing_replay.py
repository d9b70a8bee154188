"""MoE routing replay on real megatron-core (one gloo rank, the tiny Qwen3-MoE): routes recorded
from the trainer's own routers stand for the engine's (vLLM CPU cannot return routed experts).

Replaying the routes a router chose itself changes no bit of the log-probs; replaying them with
one token's experts changed at one layer changes that token's log-prob and every later one of
its sample, and nothing before it or in the other sample (a causal model, tokens routed apart).
Through `MegatronTrainer.train_step` (trainer.moe_routing_replay, the batch's routes per
micro-batch): a GRPO step replaying the routers' own routes equals the step without replay bit
for bit; with other routes it differs.
"""

from __future__ import annotations

import pytest
import torch
from megatron_harness import COLLECTIVE_TIMEOUT, init_gloo_rank, spawn_ranks

pytestmark = pytest.mark.distributed

CHANGED_AT = 7  # the input position whose experts the test changes (sample 0, layer 0)


def _worker(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    from vime.megatron.forward import token_logprobs
    from vime.megatron.model import build_from_hf, initialize_model_parallel
    from vime.megatron.routing_replay import record_routes, replay_routes, routes_from_records

    init_gloo_rank(rank, world_size, port)
    topology = initialize_model_parallel(tp=1, pp=1, timeout=COLLECTIVE_TIMEOUT)
    model, converter = build_from_hf(model_dir, topology, moe_enable_routing_replay=True)
    model.eval()
    ids = torch.randint(
        0, converter.dims.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    vocab = converter.dims.vocab_size
    with torch.no_grad():
        records: dict[int, torch.Tensor] = {}
        with record_routes(model, records):
            own = token_logprobs(model, ids, vocab_size=vocab)
        routes = routes_from_records(records, batch=2)
        with replay_routes(model, routes):
            replayed = token_logprobs(model, ids, vocab_size=vocab)
        changed = routes.clone()
        experts = converter.dims.num_experts
        chosen = set(changed[0, CHANGED_AT, 0].tolist())
        others = [e for e in range(experts) if e not in chosen][: changed.shape[-1]]
        changed[0, CHANGED_AT, 0] = torch.tensor(others)
        with replay_routes(model, changed):
            moved = token_logprobs(model, ids, vocab_size=vocab)
        after = token_logprobs(model, ids, vocab_size=vocab)  # the routers route as trained again
    steps = _train_steps(model_dir, topology)
    torch.save(
        {
            "own": own,
            "replayed": replayed,
            "moved": moved,
            "after": after,
            "routes": routes,
            "steps": steps,
        },
        f"{out}/rank{rank}.pt",
    )


def _train_steps(model_dir: str, topology) -> dict[str, dict[str, float]]:
    """One GRPO step of a fresh trainer per variant: no replay, replaying the routers' own
    routes, replaying routes with every position's first expert moved to the next expert."""
    import dataclasses

    from vime.config import GRPOConfig, TrainerConfig
    from vime.megatron.forward import stage_forward
    from vime.megatron.routing_replay import record_routes, routes_from_records
    from vime.testing.batches import synthetic_batch
    from vime.trainer.trainer import MegatronTrainer

    batch = synthetic_batch(2, 4, 12)

    def trainer(replay: bool) -> MegatronTrainer:
        torch.manual_seed(0)
        config = TrainerConfig(moe_routing_replay=replay, micro_batch_size=4, lr=1e-2)
        return MegatronTrainer(config, model_path=model_dir, topology=topology, grpo=GRPOConfig())

    plain = trainer(False).train_step(batch)
    replaying = trainer(True)
    records: dict[int, torch.Tensor] = {}
    with torch.no_grad(), record_routes(replaying.model[0], records):
        stage_forward(replaying.model[0], batch.input_ids[:, :-1])
    own_routes = routes_from_records(records, batch=batch.input_ids.shape[0])
    own = replaying.train_step(dataclasses.replace(batch, routes=own_routes))
    experts = replaying.converter.dims.num_experts
    other_routes = own_routes.clone()
    other_routes[..., 0] = (own_routes[..., 0] + 1) % experts
    # No two of a token's top-k may be equal: move the first only where that stays true.
    clash = (other_routes[..., :1] == other_routes[..., 1:]).any(-1)
    other_routes[..., 0] = torch.where(clash, own_routes[..., 0], other_routes[..., 0])
    other = trainer(True).train_step(dataclasses.replace(batch, routes=other_routes))
    return {"plain": plain, "own": own, "other": other}


def test_replayed_routes_drive_the_routers_exactly(model_builder, tmp_path):
    model_dir = model_builder("qwen3-moe-tiny", "float32")
    spawn_ranks(_worker, 1, (str(model_dir), str(tmp_path)), timeout_s=150, what="routing replay")
    result = torch.load(tmp_path / "rank0.pt")
    own, replayed, moved, after = (result[k] for k in ("own", "replayed", "moved", "after"))
    routes = result["routes"]
    assert routes.shape[:2] == (2, 23) and routes.shape[2] >= 2  # [batch, positions, layers, k]
    assert torch.equal(replayed, own)
    assert torch.equal(after, own)  # nothing left set in the routers
    # Position t of the log-probs scores token t + 1 from the forward at position t.
    assert torch.equal(moved[0, :CHANGED_AT], own[0, :CHANGED_AT])
    assert not torch.equal(moved[0, CHANGED_AT], own[0, CHANGED_AT])
    assert torch.equal(moved[1], own[1])
    steps = result["steps"]
    for key in ("loss", "grad_norm"):
        assert steps["own"][key] == steps["plain"][key], (key, steps)
    assert steps["other"]["loss"] != steps["plain"]["loss"], steps
