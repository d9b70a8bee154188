"""The typed config tree of vime (pydantic), loaded from YAML with dotted command-line overrides.

Every field has a description; validators say how to fix a bad value. Sections are added here as the
package grows; `load_config` is the only entry point scripts use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

WeightTransferBackend = Literal["gloo", "shm", "nccl", "ipc"]

VIME_WORKER_EXTENSION = "vime.weight_sync.vllm_extension.VimeWorkerExtension"


class StrictModel(BaseModel):
    """Base of every config section: unknown keys are errors, values are immutable once checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def reject_moved_keys(section: str, data: Any, moved: dict[str, str]) -> Any:
    """A `mode="before"` check: keys of older configs raise an error saying what to write now."""
    if isinstance(data, dict):
        for key, instead in moved.items():
            if key in data:
                raise ValueError(f"{section}.{key} is no longer read: {instead}")
    return data


FLUSH_TIMEOUT_GONE = (
    "remove it: a keep pause with clear_cache resets the prefix cache itself (vLLM 0.32), and "
    "without clear_cache one flush is tried (frozen requests hold their KV blocks until resume)"
)

ENGINE_MOVED_KEYS = {
    "pause_mode": "a weight sync always pauses with mode=keep (no request is lost); remove it",
    "clear_cache_on_pause": "write weight_sync.clear_cache_on_pause instead",
    "flush_cache_timeout_s": FLUSH_TIMEOUT_GONE,
}


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
    auth_token: str | None = Field(
        None,
        repr=False,
        exclude=True,  # never written to config.resolved.json
        description=(
            "Token every engine route requires (Authorization: Bearer ...). None: each job makes "
            "one for the engines it launches; external engines: the token they were started with "
            "(their server needs --middleware vime.rollout.auth.TokenMiddleware and "
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
    watchdog_interval_s: float = Field(
        2.0, gt=0, description="How often the job probes each engine (GET /health, /is_paused)."
    )
    request_timeout_s: float = Field(
        120.0, gt=0, description="Timeout of every control-plane HTTP call (pause, update, ...)."
    )

    @model_validator(mode="before")
    @classmethod
    def _reject_moved(cls, data: Any) -> Any:
        return reject_moved_keys("engine", data, ENGINE_MOVED_KEYS)

    @model_validator(mode="after")
    def _check_urls(self) -> EngineConfig:
        if self.tensor_parallel_size % self.num_nodes:
            raise ValueError(
                f"engine.tensor_parallel_size={self.tensor_parallel_size} does not split over "
                f"engine.num_nodes={self.num_nodes}: give a multiple of num_nodes"
            )
        for url in self.external_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(
                    f"external_urls entry {url!r} is not an http(s) URL; write e.g. "
                    "'http://10.0.0.5:8000'"
                )
        return self


def _check_port_range(port_range: tuple[int, int] | None) -> None:
    if port_range is not None:
        low, high = port_range
        if not 1024 <= low <= high <= 65535:
            raise ValueError(
                f"master_port_range={list(port_range)}: give [low, high] with "
                "1024 <= low <= high <= 65535"
            )


class BroadcastTransportConfig(StrictModel):
    """A broadcast group per pipeline stage: the stage's sender is rank 0, engine workers follow."""

    shape: ClassVar[str] = "distributed"  # the seed's UpdateWeightFromDistributed

    master_address: str | None = Field(
        None,
        description=(
            "Address each pp sender's rendezvous listens on, which every engine worker must reach. "
            "None: the sender's node address (cluster.node_address, $VIME_HOST_IP, "
            "cluster.interface, Slurm's NodeAddr, else 127.0.0.1)."
        ),
    )
    master_port_range: tuple[int, int] | None = Field(
        None,
        description=(
            "Inclusive port range for the senders' rendezvous (open it in the firewall between "
            "trainer and engine nodes); None: any free port."
        ),
    )

    @model_validator(mode="after")
    def _check_ports(self) -> BroadcastTransportConfig:
        _check_port_range(self.master_port_range)
        return self


class GlooTransportConfig(BroadcastTransportConfig):
    """CPU, engines reachable by TCP: broadcast over gloo (vime's `gloo` engine backend)."""

    kind: Literal["gloo"] = "gloo"


class NcclTransportConfig(BroadcastTransportConfig):
    """GPU, engines on other GPUs: broadcast over NCCL (vLLM's `nccl` engine backend)."""

    kind: Literal["nccl"] = "nccl"


class ShmTransportConfig(StrictModel):
    """CPU, colocated: the engines map the POSIX shared-memory segments the senders wrote."""

    shape: ClassVar[str] = "tensor"  # the seed's UpdateWeightFromTensor
    kind: Literal["shm"] = "shm"


class IpcTransportConfig(StrictModel):
    """GPU, colocated: CUDA IPC handles of the senders' buffers (vLLM's `ipc` engine backend)."""

    shape: ClassVar[str] = "tensor"  # the seed's UpdateWeightFromTensor
    kind: Literal["ipc"] = "ipc"


TransportConfig = Annotated[
    GlooTransportConfig | NcclTransportConfig | ShmTransportConfig | IpcTransportConfig,
    Field(discriminator="kind"),
]

WEIGHT_SYNC_MOVED_KEYS = {
    "mode": (
        "weight_sync.transport picks the shape (gloo, nccl: a broadcast group per pipeline stage; "
        "shm, ipc: colocated); remove weight_sync.mode"
    ),
    "master_address": "write it under weight_sync.transport (kind gloo or nccl)",
    "master_port_range": "write it under weight_sync.transport (kind gloo or nccl)",
    "flush_cache_timeout_s": FLUSH_TIMEOUT_GONE,
}


class WeightSyncConfig(StrictModel):
    """How trainer ranks push weights into the rollout engines after each optimizer step."""

    transport: TransportConfig = Field(
        default_factory=GlooTransportConfig,
        description=(
            "The one switch of a weight sync: `{kind: gloo|nccl|shm|ipc, ...}` or just the kind. "
            "It sets the engines' --weight-transfer-config backend and the updater's shape: "
            "gloo (CPU) / nccl (GPU) broadcast from each pipeline stage's sender to every engine "
            "worker; shm (CPU) / ipc (GPU) hand colocated engines the senders' buffers."
        ),
    )
    update_weight_buffer_size: int = Field(
        512 * 1024**2,
        gt=0,
        description="Cap of one bucket in bytes (a tensor larger than this gets a bucket alone).",
    )
    clear_cache_on_pause: bool = Field(
        False,
        description=(
            "clear_cache for the keep pause. True: in-flight requests re-prefill on the new "
            "weights. False: they keep KV from the old weights and the prefix cache cannot be "
            "flushed while they hold it (reported as prefix_cache_flushed=False)."
        ),
    )
    barrier_timeout_s: float = Field(
        600.0, gt=0, description="Timeout of every barrier between trainer ranks in a sync."
    )
    transfer_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Timeout of each engine call and of each bucket transfer in a sync.",
    )
    verify_checksums: bool = Field(
        False,
        description=(
            "After each sync, compare the engine's per-tensor sha256 with the sent tensors' "
            "(slow for big models: the engine reads back every weight)."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _accept_kind_alone(cls, data: Any) -> Any:
        data = reject_moved_keys("weight_sync", data, WEIGHT_SYNC_MOVED_KEYS)
        if isinstance(data, dict) and isinstance(data.get("transport"), str):
            data = {**data, "transport": {"kind": data["transport"]}}
        return data


def _set_dotted(tree: dict[str, Any], dotted_key: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted_key.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {dotted_key!r}: {part!r} is not a section")
        node = child
    node[leaf] = value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a raw config tree."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.field=value")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw))
    return tree


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One line per bad field: its dotted path, what was wrong, and the value given."""
    lines = [f"invalid config {source}:"]
    for error in exc.errors():
        path = ".".join(str(part) for part in error["loc"]) or "(root)"
        given = error.get("input")
        given_text = "" if isinstance(given, dict) else f" (given: {given!r})"
        lines.append(f"  {path}: {error['msg']}{given_text}")
    return "\n".join(lines)


def load_yaml_tree(path: str | Path | None, overrides: list[str] | None = None) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ValueError(f"config file {path}{where}: not valid YAML: {problem}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"config file {path} must hold a mapping at the top level")
        tree = loaded or {}
    return apply_overrides(tree, overrides or [])


def load_config(
    model: type[StrictModel], path: str | Path | None, overrides: list[str] | None = None
):
    """Load a config of type `model` from YAML plus overrides; errors name every bad field."""
    tree = load_yaml_tree(path, overrides)
    try:
        return model.model_validate(tree)
    except ValidationError as exc:
        raise ValueError(format_validation_error(exc, str(path or "<overrides>"))) from None
