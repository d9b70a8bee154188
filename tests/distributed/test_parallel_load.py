"""The engine's weight load on every core (engine.cpu_sync_load_cores "all", the default), for every
architecture vLLM's CPU build serves here, into real vLLM CPU servers.

Dense models: each server starts on one random model and gets another one through the shm
backend (vLLM's trainer-side API, small buckets so that layers span buckets); every served
tensor must then equal the new weights bit for bit and greedy output must equal HF transformers
on them. The worker must have loaded buckets on more than one thread (its own pinned thread plus
one per extra core), so these checks cover the parallel path.

MoE models (Qwen3-MoE; Qwen2-MoE with its gated shared expert): vLLM's CPU MoE kernel and
transformers differ in their last bits, so the greedy reference is the server itself, fresh on
the new weights. It gets the old weights the same way (served per expert, bit for bit), then
the new ones from real megatron-core trainer ranks with expert parallelism 2 through vime's own
weight sync (`vime.plugin.WeightSync`, checksums compared): greedy output must then be the fresh
server's again. Before vime re-ran the CPU kernel's prepack after an update
(`vime.weight_sync.engine.moe`), vLLM 0.32 computed MoE layers from stale prepacked weights here.
Mistral runs on vLLM's Llama implementation (a subclass), covered by llama-tiny.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from engine_token import TOKEN
from megatron_harness import COLLECTIVE_TIMEOUT, init_gloo_rank, spawn_ranks
from safetensors.torch import load_file
from test_transfer_backends import NUM_NEW_TOKENS, Server

from vime.testing.hf import hf_greedy, load_hf_model
from vime.testing.tiny_model import build_tiny_model
from vime.weight_sync.buckets import tensor_digest

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.timeout(900),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores"),
]

# Qwen2 is synced into real engines by every weight-sync test; here Qwen3 (q/k norms) and Llama.
DENSE = ("qwen3-tiny", "llama-tiny")
MOE = ("qwen3-moe-tiny", "qwen2-moe-tiny")
BUCKET_BYTES = 300_000  # several buckets per model; layers cut across them
PROMPT = "Q: 12+7= A:"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """{preset: (server, old dir, new dir)}: one shm server per architecture, all started at
    once; dense ones on the old weights, MoE ones on the new (their greedy reference)."""
    root = tmp_path_factory.mktemp("parallel-load")
    dirs = {
        preset: (
            build_tiny_model(root / f"{preset}-old", preset, seed=0),
            build_tiny_model(root / f"{preset}-new", preset, seed=1),
        )
        for preset in DENSE + MOE
    }
    started: dict[str, Server] = {}
    try:
        with ThreadPoolExecutor(len(dirs)) as pool:
            futures = {
                preset: pool.submit(
                    Server, new if preset in MOE else old, "shm", root / f"{preset}.log"
                )
                for preset, (old, new) in dirs.items()
            }
            for preset, future in futures.items():
                started[preset] = future.result()
        yield {preset: (started[preset], *dirs[preset]) for preset in dirs}
    finally:
        for server in started.values():
            server.stop()


def _digests(model_dir: Path) -> dict[str, str]:
    """The checkpoint's tensors as the engine reports them: HF names, per expert."""
    return {
        name: tensor_digest(t) for name, t in load_file(model_dir / "model.safetensors").items()
    }


def _mismatched(expected: dict[str, str], served: dict[str, str]) -> list[str]:
    return sorted(n for n in expected.keys() | served.keys() if expected.get(n) != served.get(n))


def _send_through_vllm_api(server: Server, model_dir: Path) -> None:
    """The weights of `model_dir` into the server with vLLM's trainer-side API (vime's shm)."""
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from vime.engines.vllm_engine import VLLMEngine
    from vime.weight_sync.trainer_engines import ColocatedTrainerInitInfo

    client = VLLMEngine(server.config, url=server.url)
    client.init()
    sender = WeightTransferTrainerFactory.trainer_init(
        ColocatedTrainerInitInfo(rank=0, bucket_bytes=BUCKET_BYTES),
        client=client,
        source=ModuleSource(load_hf_model(model_dir)),
    )
    try:
        client.pause_generation()
        sender.send_weights()
        client.continue_generation()
    finally:
        sender.shutdown()
    assert sender.buckets is not None and len(sender.buckets) >= 3


def _assert_parallel_path_ran(server: Server, preset: str) -> None:
    # Buckets loaded on more than one thread, as the worker counted them.
    stats = server.rpc("vime_weight_update_stats")
    assert stats["parallel_buckets"] > 0, (preset, stats)


@pytest.mark.parametrize("preset", DENSE)
def test_parallel_load_serves_exact_weights(served, preset):
    from transformers import AutoTokenizer

    server, old_dir, new_dir = served[preset]
    prompt_ids = AutoTokenizer.from_pretrained(old_dir)(PROMPT)["input_ids"]
    expected = _digests(new_dir)
    assert _mismatched(expected, server.rpc("vime_weight_checksums")), "old and new alike"
    _send_through_vllm_api(server, new_dir)
    mismatched = _mismatched(expected, server.rpc("vime_weight_checksums"))
    assert not mismatched, f"{preset}: served tensors differ from the new weights: {mismatched}"
    _assert_parallel_path_ran(server, preset)
    assert server.greedy(prompt_ids) == hf_greedy(
        load_hf_model(new_dir), prompt_ids, NUM_NEW_TOKENS
    )


def _ep2_sync(rank: int, world_size: int, port: int, model_dir: str, url: str, out: str) -> None:
    """A megatron-core trainer rank (EP=2) loading `model_dir` and syncing it into `url`."""
    import torch.distributed as dist

    from vime.megatron.model import build_from_hf, initialize_model_parallel
    from vime.plugin import EngineConfig, RolloutEngines, WeightSync, WeightSyncConfig

    init_gloo_rank(rank, world_size, port)
    topology = initialize_model_parallel(ep=2, timeout=COLLECTIVE_TIMEOUT)
    model, _ = build_from_hf(model_dir, topology)
    config = WeightSyncConfig(
        transport="shm", verify_checksums=True, update_weight_buffer_size=BUCKET_BYTES
    )
    engine = EngineConfig(model_path=model_dir, external_urls=[url], auth_token=TOKEN)
    engines = RolloutEngines.start(engine, weight_sync=config)
    sync = WeightSync(model, hf_path=model_dir, engines=engines, config=config, weight_version=1)
    report = sync.update_weights()
    sync.close()
    torch.save(report, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("preset", MOE)
def test_moe_serves_exact_weights_from_the_api_and_from_megatron_ep2(served, preset, tmp_path):
    from transformers import AutoTokenizer

    server, old_dir, new_dir = served[preset]
    prompt_ids = AutoTokenizer.from_pretrained(old_dir)(PROMPT)["input_ids"]
    fresh = server.greedy(prompt_ids)  # the server started on the new weights

    _send_through_vllm_api(server, old_dir)
    mismatched = _mismatched(_digests(old_dir), server.rpc("vime_weight_checksums"))
    assert not mismatched, f"{preset}: served tensors differ from the old weights: {mismatched}"
    _assert_parallel_path_ran(server, preset)
    stats = server.rpc("vime_weight_update_stats")
    assert stats["moe_layers_repacked"] == 2, stats  # both layers' prepack refreshed
    assert server.greedy(prompt_ids) != fresh, "old and new weights generate alike"

    spawn_ranks(
        _ep2_sync,
        2,
        (str(new_dir), server.url, str(tmp_path)),
        timeout_s=300,
        what=f"{preset} ep2 sync",
    )
    report = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert report.verified and report.weight_version == 2
    assert not _mismatched(_digests(new_dir), server.rpc("vime_weight_checksums"))
    assert server.greedy(prompt_ids) == fresh
