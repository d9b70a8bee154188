"""vime's gloo and shm backends under vLLM's trainer-side contract (weight_transfer API).

Importing this module registers `gloo` and `shm` in vLLM's `WeightTransferTrainerFactory`, the
same names as the engine backends, so a trainer written against vLLM's API can use vime's CPU
backends exactly as it uses vLLM's own NCCL or IPC ones:

    import vime.weight_sync.trainer_engines  # registers "gloo" and "shm"
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    sender = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo(rank=0, engine_world_size=1),
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

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from vime.weight_sync.buckets import Bucket, pack, plan_buckets, take_bucket_tensors
from vime.weight_sync.names import DEFAULT_GROUP_NAME
from vime.weight_sync.transports.base import Transport
from vime.weight_sync.transports.gloo import GlooTransport
from vime.weight_sync.transports.shm import ShmTransport

DEFAULT_BUCKET_BYTES = 512 * 1024**2


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The sender's rendezvous for one engine of `engine_world_size` workers (rank offset 1)."""

    backend: ClassVar[str] = "gloo"

    engine_world_size: int = 1
    master_address: str = "127.0.0.1"  # must be reachable from every engine worker
    master_port: int = 0  # 0: a free one
    group_name: str = DEFAULT_GROUP_NAME
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 600.0


@dataclass
class ShmTrainerInitInfo(TrainerInitInfo):
    """Colocated: the engine maps the segments this sender writes in /dev/shm."""

    backend: ClassVar[str] = "shm"

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


class GlooTrainerEngine(BucketTrainerEngine):
    init_info_cls = GlooTrainerInitInfo

    @staticmethod
    def make_transport(init_info: Any) -> Transport:
        return GlooTransport(
            engine_world_sizes=[init_info.engine_world_size],
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            group_name=init_info.group_name,
            timeout_s=init_info.timeout_s,
        )


class ShmTrainerEngine(BucketTrainerEngine):
    init_info_cls = ShmTrainerInitInfo

    @staticmethod
    def make_transport(init_info: Any) -> Transport:
        return ShmTransport(timeout_s=init_info.timeout_s)


def register_trainer_engines() -> None:
    """Register vime's trainer engines with vLLM's factory (idempotent)."""
    for name, engine_cls in (("gloo", GlooTrainerEngine), ("shm", ShmTrainerEngine)):
        if name not in WeightTransferTrainerFactory._registry:
            WeightTransferTrainerFactory.register_engine(name, engine_cls)


register_trainer_engines()
