"""vime in your own Megatron-core training loop: rollout engines, a weight sync per optimizer step.

Every trainer rank, after torch.distributed and megatron's `initialize_model_parallel`:

    from vime.plugin import EngineConfig, RolloutEngines, SamplingConfig, WeightSync, \
        WeightSyncConfig

    sync_config = WeightSyncConfig(transport="gloo")                  # gloo|shm (CPU), nccl|ipc
    engines = RolloutEngines.start(EngineConfig(model_path=hf_dir), weight_sync=sync_config)
    sync = WeightSync(model, hf_path=hf_dir, engines=engines, config=sync_config)
    for step in range(num_steps):
        forward_backward_func(...)                                    # your step, unchanged
        optimizer.step()
        sync.update_weights()                                         # every rank, each step
        if rank == 0:
            results = engines.generate([prompt_ids], SamplingConfig(max_tokens=32))
            # results[0].token_ids, .logprobs, .weight_versions (one per token)
    sync.close()
    engines.shutdown()

`model` is what Megatron hands you: one GPTModel or the list of chunks (virtual pipeline stages),
each wrapped in DDP / Float16Module or not, bf16 or fp32 parameters, local-spec or Transformer
Engine layer names; the topology is read from megatron's parallel_state. The engines are launched
as Ray actors (one local Ray cluster unless `cluster.ray_address` / $RAY_ADDRESS names one), or
reached at `engine.external_urls` (plain HTTP, no Ray). vime's own job (`vime.train`) uses
exactly this API.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from vime.cluster.addresses import check_engines_reachable, node_address
from vime.config import BroadcastTransportConfig, ClusterConfig, EngineConfig, WeightSyncConfig
from vime.engines.generate_api import GenerationResult, SamplingConfig
from vime.engines.generation import GenerationClient
from vime.engines.ray_engine import launch_or_attach
from vime.utils.collectives import broadcast_object
from vime.utils.net import is_loopback
from vime.weight_sync.session import SyncReport, WeightSyncError

__all__ = [
    "EngineConfig",
    "RolloutEngines",
    "SamplingConfig",
    "SyncReport",
    "WeightSync",
    "WeightSyncConfig",
    "WeightSyncError",
]

logger = logging.getLogger(__name__)


def _gloo_group(timeout_s: float) -> Any:
    """A gloo group over every trainer rank (collective: every rank calls it)."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def with_transport_backend(engine: EngineConfig, weight_sync: WeightSyncConfig) -> EngineConfig:
    """The engine config with the weight-transfer backend the sync's transport needs."""
    kind = weight_sync.transport.kind
    if engine.weight_transfer_backend not in (None, kind):
        raise ValueError(
            f"engine.weight_transfer_backend={engine.weight_transfer_backend!r} but "
            f"weight_sync.transport is {kind!r}: leave the engine's unset, the transport sets it"
        )
    return engine.model_copy(update={"weight_transfer_backend": kind})


class RolloutEngines:
    """The job's vLLM engines, as every trainer rank sees them.

    Rank 0 launched them (or reached the external URLs) and drives their control plane during a
    sync; every other rank holds plain HTTP clients of the same servers. Build it with `start`.
    """

    def __init__(
        self,
        *,
        config: EngineConfig,
        handles: list[Any],
        urls: list[str],
        infos: list[dict[str, str]],
        group: Any,
        launched: bool,
    ) -> None:
        self.config = config  # with the job's token in auth_token
        self.handles = handles  # what the updater calls: rank 0's actors or every rank's clients
        self.urls = urls
        self.infos = infos  # where each engine runs (hostname, address, Ray node)
        self.group = group  # gloo group over every trainer rank
        self.launched = launched  # rank 0 launched them (and shuts them down)
        self.retired: set[int] = set()  # engines that left the fleet

    @property
    def token(self) -> str | None:
        return self.config.auth_token

    @classmethod
    def start(
        cls,
        engine: EngineConfig,
        *,
        weight_sync: WeightSyncConfig | None = None,
        cluster: ClusterConfig | None = None,
        group: Any = None,
        log_dir: str | Path | None = None,
    ) -> RolloutEngines:
        """Launch `engine.num_engines` engines (or attach to `engine.external_urls`); every
        trainer rank calls it (collective).

        `weight_sync`: the sync these engines will take (its transport names their backend;
        default: gloo). `group`: a gloo group over every trainer rank (default: a new one).
        `log_dir`: where launched engines write their logs (default: a temporary directory).
        Raises ValueError on every rank for an engine that cannot be reached as configured.
        """
        from vime.engines.auth import new_token

        weight_sync = weight_sync or WeightSyncConfig()
        cluster = cluster or ClusterConfig()
        config = with_transport_backend(engine, weight_sync)
        group = group or _gloo_group(weight_sync.barrier_timeout_s)
        rank = dist.get_rank(group)
        address = node_address(cluster.node_address, cluster.interface)
        handles: list[Any] = []
        launched = not config.external_urls
        outcome: tuple[Any, ...] = (None, None, None, None)  # urls, infos, token, error
        if rank == 0:
            try:
                if launched and config.auth_token is None:
                    config = config.model_copy(update={"auth_token": new_token()})
                handles, urls, infos = launch_or_attach(
                    config, cluster, address, log_dir, weight_sync.transfer_timeout_s
                )
                outcome = (urls, infos, config.auth_token, None)
            except Exception as exc:
                outcome = (None, None, None, f"{type(exc).__name__}: {exc}")
        urls, infos, token, error = broadcast_object(outcome, group)
        if error is not None:
            raise RuntimeError(f"the rollout engines did not start: {error}")
        config = config.model_copy(update={"auth_token": token})
        engines = cls(
            config=config,
            handles=handles,
            urls=urls,
            infos=infos,
            group=group,
            launched=launched,
        )
        try:
            engines._check_reachable(address, weight_sync)
            if rank != 0:
                engines.handles = engines._attach_clients()
        except BaseException:
            if rank == 0:
                engines.shutdown()
            raise
        return engines

    # ---- where they run ---------------------------------------------------------------------

    def machines(self) -> list[str]:
        """The machine (hostname) each engine runs on. An external engine's machine is unknown:
        a loopback URL means this machine, any other URL counts as another one."""
        hostname = socket.gethostname()
        if not self.config.external_urls:
            return [info.get("hostname", hostname) for info in self.infos]
        hosts = [urlsplit(url).hostname or "" for url in self.urls]
        return [hostname if is_loopback(host) else host for host in hosts]

    def describe(self) -> list[dict[str, str]]:
        """Each engine's URL and where it runs (for the job's engines.json)."""
        return [{"url": url, **info} for url, info in zip(self.urls, self.infos, strict=True)]

    def num_local(self) -> int:
        """Engines launched on this machine (0 for external ones)."""
        if self.config.external_urls:
            return 0
        return self.machines().count(socket.gethostname())

    def _check_reachable(self, address: str, weight_sync: WeightSyncConfig) -> None:
        """Every rank: the engines can reach this node's rendezvous, rank 0 the engines' URLs."""
        transport = weight_sync.transport
        broadcast = isinstance(transport, BroadcastTransportConfig)
        master = transport.master_address if broadcast else None  # type: ignore[union-attr]
        check_engines_reachable(
            self.urls,
            self.machines(),
            rendezvous=(master or address) if broadcast else None,
            rendezvous_field="weight_sync.transport.master_address" if master else None,
        )

    def _attach_clients(self, first: int = 0) -> list[Any]:
        """Ranks > 0: control-plane clients of the same servers (from index `first`), by URL."""
        from vime.engines.vllm_engine import VLLMEngine

        clients = []
        for index, url in enumerate(self.urls[first:], start=first):
            client = VLLMEngine(self.config, rank=index, url=url)
            client.init()
            clients.append(client)
        return clients

    # ---- an elastic fleet: engines join and leave; indices are never reused -------------------

    def active(self) -> list[int]:
        """Indices of the engines in the fleet (not retired)."""
        return [i for i in range(len(self.urls)) if i not in self.retired]

    def active_handles(self) -> list[Any]:
        return [self.handles[i] for i in self.active()]

    def admit(self, urls: list[str], infos: list[dict[str, str]], handles: list[Any]) -> list[int]:
        """Every rank, with the same `urls` and `infos`: engines that joined (rank 0 launched
        them: its `handles`; other ranks attach clients). Their indices. They take part in syncs
        after the next `WeightSync.reconnect()`."""
        first = len(self.urls)
        self.urls += urls
        self.infos += infos
        if dist.get_rank(self.group) == 0:
            self.handles += handles
        else:
            self.handles += self._attach_clients(first)
        return list(range(first, len(self.urls)))

    def retire(self, index: int) -> None:
        """Every rank: engine `index` leaves the fleet (rank 0 ends it if this job launched it);
        later syncs skip it after the next `WeightSync.reconnect()`."""
        self.retired.add(index)
        if dist.get_rank(self.group) == 0 and self.launched:
            try:
                self.handles[index].shutdown()
            except Exception as exc:  # noqa: BLE001 (its keeper ends it with the job anyway)
                logger.warning("engine %d shutdown: %s", index, exc)
            self.handles[index].kill()  # the actor too (its placement-group bundle stays)

    # ---- generation (rank 0) ----------------------------------------------------------------

    def client(self, **kwargs: Any) -> GenerationClient:
        """An async token-in/token-out client of every engine, with the job's token; results
        carry each token's log-prob and the weight version that produced it."""
        return GenerationClient(self.urls, token=self.token, **kwargs)

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig | None = None
    ) -> list[GenerationResult]:
        """Generate for every prompt (token ids) at once and wait; for scripts that are not
        async. One call at a time per process (it runs its own event loop)."""
        sampling = sampling or SamplingConfig()

        async def run() -> list[GenerationResult]:
            async with self.client() as client:
                return list(
                    await asyncio.gather(*(client.generate(list(p), sampling) for p in prompts))
                )

        return asyncio.run(run())

    def shutdown(self) -> None:
        """End the engines this job launched (rank 0) and leave Ray; external ones stay up.
        Idempotent."""
        if not self.launched or not self.handles or dist.get_rank(self.group) != 0:
            return
        from vime.cluster.ray_cluster import disconnect

        for handle in self.active_handles():
            try:
                handle.shutdown()
            except Exception as exc:  # noqa: BLE001 (each engine's keeper ends it anyway)
                logger.warning("engine shutdown: %s", exc)
        self.handles = []
        disconnect()

    def __enter__(self) -> RolloutEngines:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


class WeightSync:
    """Pushes the trainer's weights into the engines after each optimizer step.

    Built (collectively) on every trainer rank from the rank's model chunks and the HF checkpoint
    or config directory the engines serve: the architecture's converter maps Megatron names and
    layouts (fused QKV, [gate; up], vocab padding, experts) to HF ones; a tensor it cannot map is
    an error before any byte moves, listing every such name. `update_weights()` runs one sync
    session: rank 0 pauses every engine (keep) and flushes caches, each pipeline stage gathers and
    sends in its turn, rank 0 finishes with the new weight version and resumes; in-flight requests
    continue on the new weights.
    """

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        *,
        hf_path: str | Path,
        engines: RolloutEngines,
        config: WeightSyncConfig | None = None,
        weight_version: int = 0,
        topology: Any = None,
    ) -> None:
        """`weight_version`: the version the engines serve now (each sync adds one).
        `topology`: a `vime.megatron.topology.Topology`; default: read from parallel_state."""
        from vime.megatron.converters import get_converter
        from vime.megatron.gather import GatherGroups
        from vime.megatron.model import load_hf_config
        from vime.megatron.param_names import model_chunks, padded_vocab_size
        from vime.megatron.topology import Topology
        from vime.weight_sync.updater import WeightUpdater

        self.config = config or WeightSyncConfig()
        self.engines = engines
        self.model: list[torch.nn.Module] = (
            list(model) if isinstance(model, (list, tuple)) else [model]
        )
        self.topology = topology or Topology.from_parallel_state()
        hf_config = load_hf_config(hf_path)
        chunks = model_chunks(self.model)
        self.converter = get_converter(
            hf_config, padded_vocab_size=padded_vocab_size(chunks, self.topology.tp_size)
        )
        self.updater = WeightUpdater(
            config=self.config,
            engines=engines.active_handles(),
            model=self.model,
            converter=self.converter,
            topology=self.topology,
            gather_groups=GatherGroups.from_parallel_state(),
            sync_group=engines.group,
            weight_version=weight_version,
        )
        self.updater.connect()

    @property
    def group(self) -> Any:
        """The gloo group over every trainer rank that the sync (and the engines) use."""
        return self.engines.group

    @property
    def weight_version(self) -> int:
        """The version the engines serve (the last successful sync's)."""
        return self.updater.weight_version

    def update_weights(self, version: int | None = None) -> SyncReport:
        """Sync the current weights as `version` (None: the next version); every rank calls it
        after the optimizer step. Raises WeightSyncError on every rank if the sync failed (the
        engines then hold a mix of versions until a sync succeeds)."""
        self._finish_param_gather()
        return self.updater.update_weights(version=version)

    def resync(self) -> SyncReport:
        """Push the current weights again as the current version (e.g. into a restarted
        engine, or fresh engines of a resumed job)."""
        self._finish_param_gather()
        return self.updater.resync()

    def reconnect(self, keep_delta: bool = False) -> None:
        """Rebuild the transports to the fleet's engines (one restarted, joined or left: groups,
        rank offsets); collective. The next sync is full, unless `keep_delta` (every engine
        holds the last sync's tensors: engines left, or joiners got a live one's weights)."""
        self.updater.close()
        self.updater.engines = self.engines.active_handles()
        self.updater.connect(keep_delta=keep_delta)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The trainer's current weights as HF tensors (copies) on each stage's pp sender; {}
        on other ranks. Collective over the model's parallel groups."""
        self._finish_param_gather()
        plan = self.updater.plan
        assert plan is not None
        with torch.no_grad():
            pairs = plan.gather(self.updater.gather_groups, timeout=self.updater._timeout)
            return {name: tensor.detach().clone() for name, tensor in pairs}

    def _finish_param_gather(self) -> None:
        """megatron DDP with overlap_param_gather leaves the bf16 params of other DP shards stale
        after optimizer.step() until the next forward's pre-hook gathers them: gather them now."""
        for chunk in self.model:
            ddp_config = getattr(chunk, "ddp_config", None)
            if ddp_config is not None and getattr(ddp_config, "overlap_param_gather", False):
                chunk.start_param_sync(force_sync=True)

    def close(self) -> None:
        self.updater.close()
