"""The `weight_sync:` section: the transport (one switch, a discriminated union) and the session."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import Field, model_validator

from vime.config.base import StrictModel

TransportKind = Literal["gloo", "nccl", "shm", "ipc"]


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

    # UpdateWeightFromDistributed: the engines receive broadcasts (vime_broadcast backend).
    sync_shape: ClassVar[str] = "broadcast"

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


DELTA_DESCRIPTION = (
    "Send only what changed since the last sync: per tensor nothing, the changed elements "
    "(indices + values) or the whole tensor, whichever is smallest; the engine patches the "
    "tensors of its last full sync and loads them whole (vime.weight_sync.delta). The first "
    "sync, every sync after a reconnect or a failure is full. Costs one copy of the stage's "
    "weights on the sender and one per engine worker."
)


DEVICE_DESCRIPTION = (
    "Where this transport's buffers live. cuda (the default): the GPU plug-in ({gpu}). cpu: the "
    "same transport and engine receiver run with the CPU plug-in ({cpu}): what vime's test suite "
    "runs on machines without a GPU; every line above the plug-in is the code a GPU job runs."
)


class GlooTransportConfig(BroadcastTransportConfig):
    """CPU, engines reachable by TCP: broadcast over gloo."""

    kind: Literal["gloo"] = "gloo"
    delta: bool = Field(False, description=DELTA_DESCRIPTION)

    @property
    def plugin(self) -> str:
        return "gloo"


class NcclTransportConfig(BroadcastTransportConfig):
    """GPU, engines on other GPUs: broadcast over NCCL, one group per pipeline stage."""

    kind: Literal["nccl"] = "nccl"
    delta: bool = Field(False, description=DELTA_DESCRIPTION)
    device: Literal["cuda", "cpu"] = Field(
        "cuda",
        description=DEVICE_DESCRIPTION.format(
            gpu="NCCL on the sender's GPU", cpu="a gloo group on CPU buffers"
        ),
    )

    @property
    def plugin(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"


class ShmTransportConfig(StrictModel):
    """CPU, colocated: the engines map the POSIX shared-memory segments trainer ranks wrote."""

    # UpdateWeightFromTensor: the engines open buffers on their device (vime_colocated backend).
    sync_shape: ClassVar[str] = "colocated"
    kind: Literal["shm"] = "shm"
    delta: bool = Field(False, description=DELTA_DESCRIPTION)

    @property
    def plugin(self) -> str:
        return "shm"


class IpcTransportConfig(StrictModel):
    """GPU, colocated: engine workers open CUDA IPC handles of the trainer ranks on their GPU."""

    sync_shape: ClassVar[str] = "colocated"
    kind: Literal["ipc"] = "ipc"
    delta: bool = Field(False, description=DELTA_DESCRIPTION)
    device: Literal["cuda", "cpu"] = Field(
        "cuda",
        description=DEVICE_DESCRIPTION.format(
            gpu="CUDA IPC handles of GPU buffers", cpu="POSIX shared-memory segments"
        ),
    )

    @property
    def plugin(self) -> str:
        return "ipc" if self.device == "cuda" else "shm"


TransportConfig = Annotated[
    GlooTransportConfig | NcclTransportConfig | ShmTransportConfig | IpcTransportConfig,
    Field(discriminator="kind"),
]

# The transport of every union member above, as vime's engine backends (gloo, shm) and vLLM's
# (nccl, ipc) name them; the engine's weight_transfer_backend takes the same values.
TRANSPORT_KINDS: tuple[str, ...] = get_args(TransportKind)
assert {cls.model_fields["kind"].default for cls in get_args(get_args(TransportConfig)[0])} == set(
    TRANSPORT_KINDS
), "a transport config without its kind in TransportKind"


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
    interval: int = Field(
        1,
        ge=1,
        description=(
            "Sync after every N-th optimizer step (and after the last): the engines serve one "
            "version for N steps. A weight version counts syncs, so rollout.max_staleness bounds "
            "a sample's lag in syncs; the trainer is up to N - 1 steps further ahead (the "
            "off-policy corrections see it). 1: sync after every step."
        ),
    )
    shadow: bool = Field(
        False,
        description=(
            "Load each update beside the served weights: the engines keep decoding while their "
            "workers load and repack the new weights into a second copy on a thread of their "
            "own, then pause (keep) only for the swap. Costs one more copy of the weights per "
            "engine worker until the swap (checked before each sync; refused when it does not "
            "fit). CPU engines with enforce_eager only."
        ),
    )
    pack_before_pause: bool = Field(
        True,
        description=(
            "Colocated transports (shm, ipc): gather and pack every bucket into its kept buffer "
            "before the engines pause, so the pause holds only the engines' load. False: bucket "
            "i+1 is packed while the engines load bucket i, inside the pause. The same memory "
            "either way (each bucket keeps its buffer). Broadcast transports (one buffer "
            "refilled per bucket in flight) pack as they send, but a delta's encode (a read of "
            "both copies of every weight) still runs before the pause; shadow syncs (no pause "
            "around the send) always pack and encode as they send."
        ),
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
            "After each sync, compare every engine worker's XXH3-128 digest of its part of "
            "each tensor with the trainer's digest of the same slice of what it sent."
        ),
    )
    verify_source: Literal["loaded", "served"] = Field(
        "loaded",
        description=(
            "Where the engine's digests come from. loaded: each layer's weights as vLLM's "
            "weight loaders placed them (names, fused layouts, slices, dtypes applied), taken "
            "just before vLLM's CPU backend repacks a linear weight into its kernel; the rest "
            "read as served (cheap: a hash of the bytes). served: every weight read back as "
            "served, repacked ones through their kernels (exact, also covers the repack; on "
            "CPU a matrix product per layer, ~0.4 s for 135M parameters on one core)."
        ),
    )

    @property
    def fills_ahead(self) -> bool:
        """Whether a sync gathers and packs before the engines pause (`pack_before_pause`
        where it applies: a colocated transport, no shadow)."""
        return (
            self.pack_before_pause and self.transport.sync_shape == "colocated" and not self.shadow
        )

    def prepares_ahead(self, mode: str) -> bool:
        """Whether a sync in `mode` ("dense", "full", "delta") gathers, and packs or encodes,
        before the engines pause: every colocated one (`fills_ahead`), and a delta over any
        transport (its encode reads two copies of every weight; what it then sends is small,
        packed in the pause)."""
        return self.fills_ahead or (mode == "delta" and self.pack_before_pause and not self.shadow)

    @model_validator(mode="before")
    @classmethod
    def _accept_kind_alone(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("transport"), str):
            data = {**data, "transport": {"kind": data["transport"]}}
        return data

    def due(self, step: int, num_steps: int) -> bool:
        """Whether the weights are synced after step `step` (0-based) of `num_steps`."""
        return (step + 1) % self.interval == 0 or step + 1 == num_steps
