"""The `engine:` section: how to start (or reach) the vLLM rollout engines and drive them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from vime.config.base import StrictModel
from vime.config.weight_sync import TransportKind

WeightTransferBackend = TransportKind

VIME_WORKER_EXTENSION = "vime.weight_sync.vllm_extension.VimeWorkerExtension"


class EngineConfig(StrictModel):
    """How to start (or reach) the vLLM rollout engines and how to drive their control plane."""

    model_path: str = Field(description="HF checkpoint directory the engines serve.")
    num_engines: int = Field(1, ge=1, description="Engines to launch (ignored with external_urls).")
    external_urls: list[str] = Field(
        default_factory=list,
        description="URLs of already running vLLM servers; when set, vime launches nothing.",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="vLLM --tensor-parallel-size per engine."
    )
    num_nodes: int = Field(
        1,
        ge=1,
        description=(
            "Nodes one engine spans (vLLM --nnodes, mp executor): node 0 serves HTTP, the others "
            "run --headless workers; tensor_parallel_size / num_nodes workers per node."
        ),
    )
    host: str | None = Field(
        None,
        description=(
            "Address launched servers bind to; None: the engine's node address ($VIME_HOST_IP, "
            "else the Ray node's address, else 127.0.0.1)."
        ),
    )
    base_port: int | None = Field(
        None,
        ge=1024,
        le=65535,
        description=(
            "Launched engine `rank` serves on base_port + rank (open those in the firewall); "
            "None: a free port each."
        ),
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="vLLM --dtype. Pass it explicitly: auto turns fp32 into bf16 on x86."
    )
    max_model_len: int = Field(512, ge=16, description="vLLM --max-model-len.")
    max_num_seqs: int = Field(64, ge=1, description="vLLM --max-num-seqs (concurrent sequences).")
    cpu_kvcache_space_gib: int = Field(
        1, ge=1, description="VLLM_CPU_KVCACHE_SPACE for the CPU build (whole GiB of KV cache)."
    )
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="vLLM --gpu-memory-utilization (GPU build only)."
    )
    enforce_eager: bool = Field(True, description="vLLM --enforce-eager (no graph capture).")
    weight_transfer_backend: WeightTransferBackend | None = Field(
        None,
        description=(
            "vLLM --weight-transfer-config backend: gloo/shm (vime, CPU), nccl/ipc (GPU). In a "
            "job config it is derived from weight_sync.transport and must not be written; set it "
            "only for an engine launched on its own."
        ),
    )
    worker_extension_cls: str | None = Field(
        VIME_WORKER_EXTENSION,
        description="vLLM --worker-extension-cls; vime's registers the gloo and shm backends.",
    )
    cpu_reuse_freed_memory: bool = Field(
        True,
        description=(
            "CPU build only: run the server with glibc's malloc keeping freed memory "
            "(GLIBC_TUNABLES mmap_max=0, trim_threshold=64 GiB), so the buffers each weight "
            "update allocates reuse pages instead of faulting fresh ones in (0.5B fp32: engine "
            "load 1.74 -> 1.07 s per sync). The server then keeps its peak heap."
        ),
    )
    cpu_sync_load_cores: Literal["all", "own"] | list[int] = Field(
        "all",
        description=(
            "CPU build only: the cores a worker may load weights on during a sync. 'all': "
            "every core the server may run on (during a sync the engine is paused and a "
            "colocated trainer waits for it), one thread per extra core, whole decoder layers "
            "per thread; 'own': the worker's own cores only (vLLM's load as it is); or a list "
            "of CPU ids. Passed as VIME_SYNC_LOAD_CORES; an engine vime does not launch reads "
            "that variable from its own environment."
        ),
    )
    extra_args: list[str] = Field(
        default_factory=list, description="Further `vllm serve` arguments, passed as they are."
    )
    extra_env: dict[str, str] = Field(
        default_factory=dict, description="Further environment variables for the server."
    )
    device_ids: list[str] | None = Field(
        None,
        description=(
            "Per launched engine, the devices its workers run on, comma-separated, one per "
            "worker (tensor_parallel_size of them), e.g. ['4', '5'] for two TP=1 engines on "
            "GPUs 4 and 5. On a GPU machine it is the engine's CUDA_VISIBLE_DEVICES (keep the "
            "trainer's GPUs out of it for nccl; give them for ipc); on CPU the workers' stand-in "
            "device ids (cpu:<n>, VIME_DEVICE_IDS). None: wherever the launcher (Ray) puts them."
        ),
    )
    auth_token: str | None = Field(
        None,
        repr=False,
        exclude=True,  # never written to config.resolved.json
        description=(
            "Token every engine route requires (Authorization: Bearer ...). None: each job makes "
            "one for the engines it launches; external engines: the token they were started with "
            "(their server needs --middleware vime.engines.auth.TokenMiddleware and "
            "$VIME_ENGINE_TOKEN), or None if they have none."
        ),
    )
    startup_timeout_s: float = Field(600.0, gt=0, description="Deadline for /health after launch.")
    external_check_timeout_s: float = Field(
        15.0,
        gt=0,
        description="Deadline for an external URL to answer as a vLLM server in dev mode.",
    )
    progress_timeout_s: float = Field(
        60.0,
        gt=0,
        description=(
            "An engine whose EngineCore answers no probe (GET /is_paused) for this long is "
            "stalled: the job stops naming it."
        ),
    )
    fault_tolerance: bool = Field(
        False,
        description=(
            "Restart a dead or stalled engine, sync it to the trainer's current weights before it "
            "serves again and resubmit its lost requests (as slime's --use-fault-tolerance). "
            "False: the job stops with an error naming the engine."
        ),
    )
    preemption_drain_s: float = Field(
        0.0,
        ge=0,
        description=(
            "> 0: a SIGTERM to a launched engine's keeper (the leader of its process group) is "
            "a preemption notice: the engine keeps serving this many seconds while the job "
            "drains it (no new requests; those in flight finish, or are handed to the other "
            "engines when the time runs out), then it leaves the fleet and ends. 0: SIGTERM "
            "ends the engine at once (with fault_tolerance, it is restarted)."
        ),
    )
    watchdog_interval_s: float = Field(
        2.0, gt=0, description="How often the job probes each engine (GET /health, /is_paused)."
    )
    request_timeout_s: float = Field(
        120.0, gt=0, description="Timeout of every control-plane HTTP call (pause, update, ...)."
    )

    @model_validator(mode="after")
    def _check_urls(self) -> EngineConfig:
        if self.tensor_parallel_size % self.num_nodes:
            raise ValueError(
                f"engine.tensor_parallel_size={self.tensor_parallel_size} does not split over "
                f"engine.num_nodes={self.num_nodes}: give a multiple of num_nodes"
            )
        if self.device_ids is not None:
            if len(self.device_ids) != self.num_engines or self.external_urls:
                raise ValueError(
                    f"engine.device_ids has {len(self.device_ids)} entries for "
                    f"{self.num_engines} launched engines: give one per engine (none with "
                    "external_urls)"
                )
            for index, ids in enumerate(self.device_ids):
                if len(ids.split(",")) != self.tensor_parallel_size // self.num_nodes:
                    raise ValueError(
                        f"engine.device_ids[{index}]={ids!r} names {len(ids.split(','))} "
                        f"devices for {self.tensor_parallel_size // self.num_nodes} workers per "
                        "node: give one per worker, comma-separated"
                    )
        for url in self.external_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(
                    f"external_urls entry {url!r} is not an http(s) URL; write e.g. "
                    "'http://10.0.0.5:8000'"
                )
        return self
