"""vime's two backends under vLLM's trainer-side contract (weight_transfer API).

Importing this module registers `vime_broadcast` and `vime_colocated` in vLLM's
`WeightTransferTrainerFactory`, the same names as the engine backends, so a trainer written
against vLLM's API can use vime's backends exactly as it uses vLLM's own NCCL or IPC ones:

    import vime.weight_sync.trainer_engines  # registers vime_broadcast and vime_colocated
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    sender = WeightTransferTrainerFactory.trainer_init(
        BroadcastTrainerInitInfo(rank=0, engine_world_size=1),
        client=VLLMEngine(config, url=url),   # any VLLMWeightSyncClient
        source=ModuleSource(model),           # (HF name, tensor) pairs, the same order each round
    )
    sender.send_weights()   # start_weight_update, update_weights (bucket after bucket), finish
    sender.shutdown()

One client, one engine, no pause: that is vLLM's contract. vime's jobs drive several engines and
pipeline stages per sync and pause them first (`session.run_sync_session`); they use the same
transports (`vime.weight_sync.transports`) through `WeightUpdater`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from vime.weight_sync.buckets import Bucket, pack, plan_buckets, take_bucket_tensors
from vime.weight_sync.devices import device_id, handles_class
from vime.weight_sync.names import BROADCAST_BACKEND, COLOCATED_BACKEND, DEFAULT_GROUP_NAME
from vime.weight_sync.transports.base import Transport
from vime.weight_sync.transports.broadcast import BroadcastTransport
from vime.weight_sync.transports.colocated import ColocatedTransport

DEFAULT_BUCKET_BYTES = 512 * 1024**2


@dataclass
class BroadcastTrainerInitInfo(TrainerInitInfo):
    """The sender's rendezvous for one engine of `engine_world_size` workers (rank offset 1)."""

    backend: ClassVar[str] = BROADCAST_BACKEND

    engine_world_size: int = 1
    master_address: str = "127.0.0.1"  # must be reachable from every engine worker
    master_port: int = 0  # 0: a free one
    group_name: str = DEFAULT_GROUP_NAME
    communicator: str = "gloo"  # or "nccl" (a GPU sender, `device`)
    device: str = "cpu"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 600.0


@dataclass
class ColocatedTrainerInitInfo(TrainerInitInfo):
    """Colocated: the engine opens the buffers this sender fills on its device (one device)."""

    backend: ClassVar[str] = COLOCATED_BACKEND

    handles: str = "shm"  # or "ipc" (a GPU sender, `device`)
    device: str = "cpu"

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 600.0


class BucketTrainerEngine(TrainerWeightTransferEngine):
    """A vime transport behind vLLM's trainer contract: rank 0 sends, other ranks only iterate
    the source (its materialisation may be a collective they must join)."""

    transport: Transport | None = None

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None,
        is_sender: bool,
        bucket_bytes: int,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes = bucket_bytes
        self.buckets: list[Bucket] | None = None

    @staticmethod
    def make_transport(init_info: Any) -> Transport:
        raise NotImplementedError

    @classmethod
    def trainer_init(
        cls,
        init_info: Any,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError(f"the {init_info.backend} trainer engine needs a WeightSource")
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            bucket_bytes=init_info.bucket_bytes,
        )
        if engine.is_sender:
            engine.transport = cls.make_transport(init_info)
            engine.transport.connect([client.init_weight_transfer_engine])
        return engine

    def send_weights(self) -> None:
        assert self.source is not None  # trainer_init checked it
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        transport = self.transport
        if transport is None:
            raise RuntimeError("call trainer_init before send_weights (or after shutdown)")
        if self.buckets is None:  # the layout is the same every round
            specs = [(m.name, m.dtype, tuple(m.shape)) for m in self.source.metadata()]
            self.buckets = plan_buckets(specs, self.bucket_bytes, alignment=transport.alignment)
        tensors = iter(self.source)

        def fill(bucket: Bucket, buffer: Any) -> None:
            pack(dict(take_bucket_tensors(tensors, bucket)), bucket, buffer)

        self.client.start_weight_update()
        try:
            transport.send_buckets(self.buckets, fill, [self.client.update_weights])
        except BaseException:
            transport.discard()  # the engine may still hold views of what was sent
            raise
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


class BroadcastTrainerEngine(BucketTrainerEngine):
    init_info_cls = BroadcastTrainerInitInfo

    @staticmethod
    def make_transport(init_info: Any) -> Transport:
        return BroadcastTransport(
            engine_world_sizes=[init_info.engine_world_size],
            communicator=init_info.communicator,
            device=init_info.device,
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            group_name=init_info.group_name,
            timeout_s=init_info.timeout_s,
        )


class ColocatedTrainerEngine(BucketTrainerEngine):
    init_info_cls = ColocatedTrainerInitInfo

    @staticmethod
    def make_transport(init_info: Any) -> Transport:
        device = torch.device(init_info.device)
        return ColocatedTransport(
            handles=handles_class(init_info.handles)(device),
            device_id=device_id(device),
            device=device,
            timeout_s=init_info.timeout_s,
        )


def register_trainer_engines() -> None:
    """Register vime's trainer engines with vLLM's factory (idempotent)."""
    for name, engine_cls in (
        (BROADCAST_BACKEND, BroadcastTrainerEngine),
        (COLOCATED_BACKEND, ColocatedTrainerEngine),
    ):
        if name not in WeightTransferTrainerFactory._registry:
            WeightTransferTrainerFactory.register_engine(name, engine_cls)


register_trainer_engines()
