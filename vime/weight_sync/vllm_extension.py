"""Engine side of vime's weight sync: two vLLM weight-transfer backends and a worker extension.

Pass this module's class to the server and pick a backend:

    python -m vllm.entrypoints.openai.api_server --model DIR ... \\
        --worker-extension-cls vime.weight_sync.vllm_extension.VimeWorkerExtension \\
        --weight-transfer-config '{"backend": "gloo"}'      # or "shm"

vLLM workers import the extension class before `load_model`, which is when they create their
weight-transfer engine, so importing this module is enough to register the backends:

- `gloo`: the worker joins torch.distributed gloo groups of its own (a TCPStore rendezvous with
  the trainer, never vLLM's default process group) and receives one broadcast per bucket. It can
  hold several groups at once, keyed by `group_name` (one per trainer pipeline stage, each with
  that stage's sender as rank 0); each update names the group its buckets come from.
- `shm`: the trainer writes each bucket into a POSIX shared-memory segment; the worker maps it
  read-only, keeps the mapping for later syncs, and loads from it without copying it first.

Both receive the bucket layout of `vime.weight_sync.buckets` and load through vLLM's layerwise
reload (start/finish wrap `initialize_layerwise_reload` / `finalize_layerwise_reload`), like
vLLM's own NCCL and IPC engines.

`VimeWorkerExtension` adds methods callable through `POST /collective_rpc`:
`vime_weight_metadata` (HF names, dtypes and shapes the engine expects, to check before sending),
`vime_weight_checksums` (sha256 per HF-named tensor, to check after) and
`vime_weight_update_stats` (where the last update's time went on the worker).
"""

from __future__ import annotations

import datetime
import logging
import mmap
import os
import stat
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from vime.cluster.addresses import HOST_IP_ENV
from vime.utils.rendezvous import gloo_group
from vime.weight_sync.buckets import Bucket, dtype_name, tensor_digest, unpack
from vime.weight_sync.names import DEFAULT_GROUP_NAME, SHM_DIR, check_segment_name

logger = logging.getLogger(__name__)


def worker_index(parallel_config: Any) -> int:
    """This worker's index among all workers of the engine (DP replicas included).

    The same formula as vLLM's NCCL engine, so trainers can use one rank layout for both.
    """
    return parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank


def _parse_buckets(buckets: list[dict[str, Any]]) -> list[Bucket]:
    if not isinstance(buckets, list) or not buckets:
        raise ValueError(f"update_info.buckets must be a non-empty list, got {buckets!r:.200}")
    return [Bucket.from_dict(b) for b in buckets]


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's TCPStore listens and which ranks this engine's workers take.

    Worker i of the engine (see `worker_index`) joins as rank `rank_offset + i`; the trainer is
    rank 0 of `world_size`.
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0
    group_name: str = DEFAULT_GROUP_NAME


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """The buckets (Bucket.to_dict) rank 0 of `group_name` broadcasts next, one each, in order."""

    buckets: list[dict[str, Any]]
    group_name: str = DEFAULT_GROUP_NAME

    def __post_init__(self) -> None:
        self.parsed = _parse_buckets(self.buckets)


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous; the directory the trainer creates segments in."""

    shm_dir: str = SHM_DIR


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    """Buckets (Bucket.to_dict) each with an extra "shm_name": the segment holding its bytes."""

    buckets: list[dict[str, Any]]

    def __post_init__(self) -> None:
        self.parsed = _parse_buckets(self.buckets)
        self.shm_names: list[str] = []
        for bucket in self.buckets:
            name = bucket.get("shm_name")
            check_segment_name(name if isinstance(name, str) else repr(name))
            self.shm_names.append(str(name))


class _BucketEngine(WeightTransferEngine):
    """Shared by the vime backends: layerwise reload around an update, loading from views.

    `stats` times the last weight update on this worker, phase by phase (seconds): start,
    receive (waiting for and mapping the bytes), load (vLLM's load_weights, including layerwise
    processing of the layers a bucket completes), finish; and counts its buckets and bytes.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stats: dict[str, float] = {}

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        began = time.perf_counter()
        initialize_layerwise_reload(self.model)
        started = time.perf_counter() - began
        self.stats = dict(start=started, receive=0.0, load=0.0, finish=0.0, buckets=0, bytes=0)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        began = time.perf_counter()
        finalize_layerwise_reload(self.model, self.model_config)
        self.stats["finish"] = time.perf_counter() - began

    def _count(self, phase: str, began: float) -> None:
        self.stats[phase] += time.perf_counter() - began

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only
        # machine; loads here are synchronous on CPU and only need a sync on an accelerator.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def _load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        # Layerwise reload may keep these views until the rest of their layer arrives, possibly
        # in a later bucket: each bucket's storage must therefore stay valid and unchanged until
        # finish_weight_update, which is why both backends reuse a buffer only in a later sync.
        began = time.perf_counter()
        with disable_mtp_completeness_check():
            self.model.load_weights(weights)
        self._count("load", began)
        self.stats["buckets"] += 1
        self.stats["bytes"] += sum(t.nbytes for _, t in weights)


class GlooWeightTransferEngine(_BucketEngine):
    """Receives buckets by gloo broadcast from rank 0 of a named group (CPU, TCP; any host).

    Holds one group per `group_name`: initialising a name again replaces that group only.
    """

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # group_name -> (store, group, timeout); the store must outlive its group.
        self._groups: dict[str, tuple[dist.Store, dist.ProcessGroup, datetime.timedelta]] = {}
        # Receive buffers by their place in a sync, kept across syncs (about one model copy).
        self._pool: list[torch.Tensor] = []
        self._num_received = 0

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        rank = init_info.rank_offset + worker_index(self.parallel_config)
        if not 0 < rank < init_info.world_size:
            raise ValueError(
                f"worker rank {rank} (rank_offset {init_info.rank_offset} + worker index) is "
                f"outside 1..{init_info.world_size - 1}; rank 0 is the trainer"
            )
        self._groups.pop(init_info.group_name, None)
        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        store = dist.TCPStore(
            init_info.master_address,
            init_info.master_port,
            init_info.world_size,
            is_master=False,
            timeout=timeout,
        )
        prefixed = dist.PrefixStore(init_info.group_name, store)
        # Listen on this node's address (set by vime's launcher), not where the hostname points.
        group = gloo_group(
            prefixed,
            rank=rank,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
            address=os.environ.get(HOST_IP_ENV) or None,
        )
        self._groups[init_info.group_name] = (store, group, timeout)
        logger.info(
            "joined gloo group %r as rank %d of %d via %s:%d",
            init_info.group_name,
            rank,
            init_info.world_size,
            init_info.master_address,
            init_info.master_port,
        )

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if update_info.group_name not in self._groups:
            raise RuntimeError(
                f"gloo weight transfer group {update_info.group_name!r} not initialized "
                f"(have {sorted(self._groups)}): call init_weight_transfer_engine with that "
                "group_name first"
            )
        _, group, timeout = self._groups[update_info.group_name]
        options = dist.BroadcastOptions()
        options.rootRank = 0
        buckets = update_info.parsed

        pending: tuple[torch.Tensor, Any] | None

        def post(position: int) -> tuple[torch.Tensor, Any]:
            buffer = self._receive_buffer(buckets[position].nbytes)
            return buffer, group.broadcast([buffer], options)

        try:
            pending = post(0)
            for position, bucket in enumerate(buckets):
                began = time.perf_counter()
                assert pending is not None  # posted for every bucket before its turn
                buffer, work = pending
                work.wait(timeout)
                self._count("receive", began)
                # The next bucket arrives (on gloo's threads) while this one loads.
                pending = post(position + 1) if position + 1 < len(buckets) else None
                self._load(unpack(buffer, bucket))
        except BaseException:
            self._pool.clear()
            raise

    def _receive_buffer(self, nbytes: int) -> torch.Tensor:
        """The sync's next receive buffer, kept for the same place in later syncs.

        Never reused within a sync (views may be held until finish_weight_update); reused in
        later ones, so no page is allocated or faulted in after the first sync.
        """
        position = self._num_received
        self._num_received += 1
        if position == len(self._pool):
            self._pool.append(torch.empty(nbytes, dtype=torch.uint8))
        elif self._pool[position].numel() < nbytes:
            self._pool[position] = torch.empty(nbytes, dtype=torch.uint8)
        return self._pool[position][:nbytes]

    def start_weight_update(self) -> None:
        super().start_weight_update()
        self._num_received = 0

    def shutdown(self) -> None:
        self._groups.clear()
        self._pool.clear()


def _check_private(path: str, info: os.stat_result) -> None:
    """A segment is mapped only if it is a regular file of this user that no one else can write."""
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(
            f"shm segment {path} is not a private regular file of uid {os.getuid()} (uid "
            f"{info.st_uid}, mode {stat.filemode(info.st_mode)}): vime's segments are 0600"
        )


class ShmWeightTransferEngine(_BucketEngine):
    """Loads buckets straight from the trainer's POSIX shared-memory segments (same host).

    Each segment is mapped once (shared, read-only, page tables populated up front) and the
    mapping is kept: the trainer refills the same segments sync after sync and unlinks their names
    once acknowledged, so later syncs find them here by name. Mappings a sync did not use are
    dropped when it finishes (the trainer made new segments), and all of them on a new
    init_transfer_engine or after a failed update.
    """

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shm_dir = SHM_DIR
        self._mappings: dict[str, torch.Tensor] = {}  # segment name -> read-only mapping
        self._used: set[str] = set()  # segment names this sync read

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        # Whoever reaches the route chooses shm_dir and the names: only vime's own segments in
        # /dev/shm, owned by this user and private to it, are ever mapped into the weights.
        if os.path.realpath(init_info.shm_dir) != SHM_DIR:
            raise ValueError(
                f"shm_dir {init_info.shm_dir!r} is not {SHM_DIR}: the shm backend maps vime's "
                f"segments from {SHM_DIR} only"
            )
        self._shm_dir = SHM_DIR
        self._mappings.clear()

    def start_weight_update(self) -> None:
        super().start_weight_update()
        self._used = set()

    def finish_weight_update(self) -> None:
        super().finish_weight_update()
        for name in set(self._mappings) - self._used:
            del self._mappings[name]

    def _mapping(self, name: str, nbytes: int) -> torch.Tensor:
        mapping = self._mappings.get(name)
        if mapping is None or mapping.numel() < nbytes:
            check_segment_name(name)
            path = os.path.join(self._shm_dir, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    _check_private(path, os.fstat(fd))
                    buffer = mmap.mmap(
                        fd, 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ
                    )
                finally:
                    os.close(fd)
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"shm segment {path} does not exist and is not mapped by this worker (a "
                    "restarted engine?): the trainer makes new segments after a failed sync"
                ) from None
            if len(buffer) < nbytes:
                raise ValueError(f"shm segment {path} has {len(buffer)} bytes, need {nbytes}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only buffer: nothing here writes to it
                mapping = torch.frombuffer(buffer, dtype=torch.uint8)
            self._mappings[name] = mapping
        self._used.add(name)
        return mapping[:nbytes]

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        try:
            for bucket, name in zip(update_info.parsed, update_info.shm_names, strict=True):
                began = time.perf_counter()
                if bucket.nbytes == 0:
                    view = torch.empty(0, dtype=torch.uint8)
                else:
                    view = self._mapping(name, bucket.nbytes)
                self._count("receive", began)
                self._load(unpack(view, bucket))
        except BaseException:
            self._mappings.clear()
            raise

    def shutdown(self) -> None:
        self._mappings.clear()


def hf_named_parameters(
    model: torch.nn.Module, materialize: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights the model serves, under checkpoint (HF) names.

    vLLM fuses some checkpoint tensors (q/k/v into qkv_proj, gate/up into gate_up_proj, per the
    model's `packed_modules_mapping`) and pads vocab rows; this splits and trims them back. With
    `materialize=False` the tensors are meta tensors (names, dtypes and shapes only, no compute).
    Only for tensor-parallel size 1, where every worker holds whole tensors.
    """
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    tp_size = get_tensor_model_parallel_world_size()
    if tp_size != 1:
        raise ValueError(
            f"HF-named weights need whole tensors; this engine has tensor-parallel size "
            f"{tp_size}. Compare with POST /weight_checker instead."
        )
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    seen: set[int] = set()  # a tied lm_head shares the embedding's parameter: list it once
    for module_name, module in model.named_modules():
        leaf = module_name.rsplit(".", 1)[-1]
        parent = module_name[: -len(leaf)]
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            full_name = f"{module_name}.{param_name}" if module_name else param_name
            tensor = _served_tensor(module, param_name, param, materialize)
            if leaf in packed and hasattr(module, "output_sizes"):
                dim = getattr(param, "output_dim", 0)
                parts = tensor.split(list(module.output_sizes), dim=dim)
                for sub_name, part in zip(packed[leaf], parts, strict=True):
                    yield f"{parent}{sub_name}.{param_name}", part
            elif isinstance(module, VocabParallelEmbedding):
                yield full_name, tensor[: module.num_embeddings]
            else:
                yield full_name, tensor


def _served_tensor(
    module: torch.nn.Module, param_name: str, param: torch.Tensor, materialize: bool
) -> torch.Tensor:
    """`param` itself, except for linear weights that vLLM's CPU backend moved into a kernel.

    On CPU, vLLM repacks each linear weight into a oneDNN/SGL kernel and leaves an empty
    `weight`. The served matrix is read back through the kernel itself, from identity rows: each
    output element is a single product with 1.0, so the result is exact.
    """
    cpu_linear = getattr(module, "cpu_linear", None)
    if param_name != "weight" or param.numel() != 0 or cpu_linear is None:
        return param if materialize else torch.empty(param.shape, dtype=param.dtype, device="meta")
    rows = getattr(module, "output_size_per_partition", None) or module.output_size
    cols = getattr(module, "input_size_per_partition", None) or module.input_size
    if not materialize:
        return torch.empty((rows, cols), dtype=param.dtype, device="meta")
    transposed = torch.empty((cols, rows), dtype=param.dtype)
    chunk = 1024
    with torch.no_grad():
        for start in range(0, cols, chunk):
            stop = min(start + chunk, cols)
            identity = torch.zeros((stop - start, cols), dtype=param.dtype)
            identity[torch.arange(stop - start), torch.arange(start, stop)] = 1
            transposed[start:stop] = cpu_linear(identity, param, None)
    return transposed.t()


class VimeWorkerExtension:
    """Mixed into vLLM's Worker by `--worker-extension-cls`; methods reachable by collective_rpc.

    Names start with `vime_` so they cannot clash with Worker attributes (vLLM rejects clashes).
    Each worker answers for its own part of the model; /collective_rpc returns one result per
    worker.
    """

    def vime_weight_metadata(self) -> list[dict[str, Any]]:
        """[{"name", "dtype", "shape"}] of every weight this worker serves, under HF names."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return [
            {"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
            for name, t in hf_named_parameters(model, materialize=False)
        ]

    def vime_weight_update_stats(self) -> dict[str, float]:
        """This worker's `stats` of its last weight update (empty before the first one)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "stats", {}))

    def vime_weight_checksums(self) -> dict[str, str]:
        """{HF name: sha256 hex of the tensor's bytes} for every weight this worker serves."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {name: tensor_digest(t) for name, t in hf_named_parameters(model)}


def register_backends() -> None:
    """Register the vime backends with vLLM's factory (idempotent)."""
    for name, engine_cls in (("gloo", GlooWeightTransferEngine), ("shm", ShmWeightTransferEngine)):
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, engine_cls)


register_backends()
