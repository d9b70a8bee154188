"""MoE routing replay: the trainer's routers take the experts the rollout engine chose (R3).

A MoE model's router picks each token's top-k experts from logits that differ by float noise
between the engine and the trainer; near a tie the two pick different experts, and the
trainer's log-prob of a sampled token then comes from another sub-network than the one that
sampled it. Replaying the engine's choices in the trainer's forward removes that part of the
train/rollout mismatch (the gradient still flows through the chosen experts' gate scores).

The engine side: vLLM returns, with `--enable-return-routed-experts`, each request's
`routed_experts` as a base64 `.npy` array [prompt + output tokens - 1, MoE layers, top-k] (the
last sampled token was never forwarded); `vime.engines.generate_api.decode_routed_experts`
reads it without unpickling. Position t holds the experts that routed token t's forward, which
is input position t of the trainer's forward (`input_ids[:, :-1]`).

The trainer side: megatron-core's routers replay given top-k indices when the model is built
with `moe_enable_routing_replay` (`megatron.core.transformer.moe.router_replay.RouterReplay`);
`replay_routes(chunk, routes)` sets each of the chunk's routers to its layer's indices for one
forward (`vime.rl.samples.pack_routes` lays a batch's routes out). Every layer of the model
must be a MoE layer (Qwen3-MoE, Qwen2-MoE as vime converts them), so a router's layer number
is its index into the engine's layer axis.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def _routers(chunk: torch.nn.Module) -> Iterator[tuple[int, Any]]:
    """(0-based layer index, RouterReplay) of every MoE router in one model chunk."""
    for module in chunk.modules():
        replay = getattr(module, "router_replay", None)
        if replay is not None:
            yield module.layer_number - 1, replay


@contextmanager
def replay_routes(chunk: torch.nn.Module, routes: torch.Tensor | None) -> Iterator[None]:
    """One forward of `chunk` whose routers take `routes` ([batch, seq, layers, top-k]: the
    experts of each input position) instead of their own top-k; None: route as trained."""
    if routes is None:
        yield
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = list(_routers(chunk))
    if not routers:
        raise ValueError(
            "routing replay: the model has no replaying routers (build it with "
            "moe_enable_routing_replay=True: trainer.moe_routing_replay)"
        )
    batch, seq = routes.shape[:2]
    for layer, replay in routers:
        # Megatron routes [seq, batch, hidden] flattened: position-major, then the sample.
        indices = routes[:, :, layer].transpose(0, 1).reshape(seq * batch, -1)
        replay.set_target_indices(indices)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for _, replay in routers:
            replay.clear_indices()  # also the backward list set_target_indices appends to
            replay.clear_router_replay_action()


@contextmanager
def record_routes(chunk: torch.nn.Module, out: dict[int, torch.Tensor]) -> Iterator[None]:
    """One forward of `chunk` whose routers route as trained and record their choices into
    `out` (layer index -> [seq * batch, top-k], position-major as megatron routes them; see
    `routes_from_records`): what the engine's routes stand for in tests."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = list(_routers(chunk))
    for _, replay in routers:
        replay.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield
        for layer, replay in routers:
            recorded = replay.get_recorded_indices()
            out[layer] = recorded
    finally:
        for _, replay in routers:
            replay.clear_indices()
            replay.clear_router_replay_action()


def routes_from_records(records: dict[int, torch.Tensor], batch: int) -> torch.Tensor:
    """`record_routes`'s records as [batch, seq, layers, top-k], as `replay_routes` takes them."""
    layers = [records[layer] for layer in sorted(records)]
    stacked = torch.stack(layers, dim=1)  # [seq * batch, layers, top-k]
    seq = stacked.shape[0] // batch
    return stacked.reshape(seq, batch, *stacked.shape[1:]).transpose(0, 1).contiguous()
