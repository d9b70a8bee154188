"""The engine's weight load on every core (engine.cpu_sync_load_cores "all", the default), for every
architecture in the converter registry, into real vLLM CPU servers.

Each server starts on one random model and gets another one through the shm backend (vLLM's
trainer-side API, small buckets so that layers span buckets); every served tensor must then equal
the new weights bit for bit and greedy output must equal HF transformers on them. The worker must
have loaded buckets on more than one thread (its own pinned thread plus one per extra core), so
these checks cover the parallel path. The MoE case's greedy comparison is an expected failure:
vLLM 0.32's CPU MoE kernel keeps its old prepacked weights after any weight update
(MOE_STALE_PREPACK).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_transfer_backends import Server, _hf_greedy

from vime.testing.tiny_model import build_tiny_model
from vime.weight_sync.buckets import tensor_digest

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.timeout(900),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores"),
]

ARCHITECTURES = ("qwen2-tiny", "qwen3-tiny", "llama-tiny", "qwen3-moe-tiny")
VLLM_REFERENCE = "qwen3-moe-tiny"  # greedy compared with a vLLM server started on the new weights
BUCKET_BYTES = 300_000  # several buckets per model; layers cut across them
PROMPT = "Q: 12+7= A:"
# transformers' fused expert tensors and vLLM's, same layout ([experts, 2 x moe_inter, hidden]
# with gate before up; [experts, hidden, moe_inter]); the engine reports its own names for them.
SERVED_NAMES = {
    ".mlp.experts.gate_up_proj": ".mlp.experts.routed_experts.w13_weight",
    ".mlp.experts.down_proj": ".mlp.experts.routed_experts.w2_weight",
}


def served_name(name: str) -> str:
    for hf, served in SERVED_NAMES.items():
        if name.endswith(hf):
            return name[: -len(hf)] + served
    return name


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """{preset: (server, old dir, new dir, reference server or None)}: one shm server per
    architecture on the old weights, and for the MoE one a second server started on the new
    weights, the greedy reference (vLLM's CPU MoE kernel and transformers' differ in their last
    bits, and greedy output with them); all started at once."""
    root = tmp_path_factory.mktemp("parallel-load")
    dirs = {
        preset: (
            build_tiny_model(root / f"{preset}-old", preset, seed=0),
            build_tiny_model(root / f"{preset}-new", preset, seed=1),
        )
        for preset in ARCHITECTURES
    }
    wanted = {preset: old for preset, (old, _) in dirs.items()}
    wanted[VLLM_REFERENCE] = dirs[VLLM_REFERENCE][1]
    keys = [*ARCHITECTURES, "reference"]
    started: dict[str, Server] = {}
    try:
        with ThreadPoolExecutor(len(keys)) as pool:
            futures = {
                key: pool.submit(
                    Server,
                    wanted[key if key != "reference" else VLLM_REFERENCE],
                    "shm",
                    root / f"{key}.log",
                )
                for key in keys
            }
            for key, future in futures.items():
                started[key] = future.result()
        yield {
            preset: (
                started[preset],
                *dirs[preset],
                started["reference"] if preset == VLLM_REFERENCE else None,
            )
            for preset in ARCHITECTURES
        }
    finally:
        for server in started.values():
            server.stop()


MOE_STALE_PREPACK = (
    "vLLM 0.32 on CPU: a weight update leaves the MoE experts' grouped-gemm prepack stale "
    "(UnquantizedFusedMoEMethod._setup_kernel skips fused_experts.process_weights_after_loading "
    "when moe_kernel is set, copying logical weights into the prepacked storage), so greedy "
    "output after a sync differs from a fresh engine on the same weights; vLLM's own one-thread "
    "load does the same (checked). Served bytes equal the new weights."
)


@pytest.mark.parametrize("preset", ARCHITECTURES)
def test_parallel_load_serves_exact_weights(served, preset):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from vime.rollout.vllm_engine import VLLMEngine
    from vime.weight_sync.trainer_engines import ShmTrainerInitInfo

    server, old_dir, new_dir, reference = served[preset]
    prompt_ids = AutoTokenizer.from_pretrained(old_dir)(PROMPT)["input_ids"]
    new = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    expected = {served_name(n): tensor_digest(p.detach()) for n, p in new.named_parameters()}
    assert server.rpc("vime_weight_checksums") != expected, "old and new weights alike"

    client = VLLMEngine(server.config, url=server.url)
    client.init()
    sender = WeightTransferTrainerFactory.trainer_init(
        ShmTrainerInitInfo(rank=0, bucket_bytes=BUCKET_BYTES),
        client=client,
        source=ModuleSource(new),
    )
    try:
        client.pause_generation()
        sender.send_weights()
        client.continue_generation()
    finally:
        sender.shutdown()
    assert sender.buckets is not None and len(sender.buckets) >= 3

    served_digests = server.rpc("vime_weight_checksums")
    mismatched = sorted(n for n in expected.keys() | served_digests.keys()
                        if expected.get(n) != served_digests.get(n))  # fmt: skip
    assert not mismatched, f"{preset}: served tensors differ from the new weights: {mismatched}"
    # The parallel path ran: buckets loaded on more than one thread, as the worker counted them.
    stats = server.rpc("vime_weight_update_stats")
    assert stats["parallel_buckets"] > 0, (preset, stats)
    if reference is None:
        assert server.greedy(prompt_ids) == _hf_greedy(new, prompt_ids)
        return
    # Qwen3-MoE: only the greedy comparison is an expected failure, and it must fail as expected.
    synced, fresh = server.greedy(prompt_ids), reference.greedy(prompt_ids)
    assert synced != fresh, "vLLM's CPU MoE now refreshes its prepack: drop MOE_STALE_PREPACK"
    pytest.xfail(MOE_STALE_PREPACK)
