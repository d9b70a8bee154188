"""Engines as Ray actors: `launch_engines` places them; `RayEngine` makes an actor a plain engine.

Weight updaters call engine methods synchronously (`engine.pause_generation(...)`). Wrap each
actor handle once and pass the wrappers instead of local engines:

    actors = [ray.remote(num_cpus=0)(VLLMEngine).remote(config, rank=i) for i in range(n)]
    engines = [RayEngine(actor, timeout_s=600) for actor in actors]
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from vime.config import ClusterConfig, EngineConfig

logger = logging.getLogger(__name__)


class RayEngine:
    """Forwards method calls to a Ray actor and waits for the result at most `timeout_s`."""

    def __init__(self, actor: Any, *, timeout_s: float = 600.0, url: str | None = None):
        """`url`: the engine's base URL when known, so errors can name it."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self._actor = actor
        self._timeout_s = timeout_s
        self.url = url

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        method = getattr(self._actor, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            import ray

            ref = method.remote(*args, **kwargs)
            try:
                return ray.get(ref, timeout=self._timeout_s)
            except ray.exceptions.GetTimeoutError as exc:
                ray.cancel(ref)
                raise TimeoutError(
                    f"Ray engine actor: {name}() did not return within {self._timeout_s:g} s"
                ) from exc

        call.__name__ = name
        return call

    def kill(self) -> None:
        """End the actor now, even mid-call (its engine's keeper then ends the server, see
        vime.utils.keeper): for aborts, when a call in flight may never return."""
        import ray

        ray.kill(self._actor, no_restart=True)

    def __repr__(self) -> str:
        return f"RayEngine({self._actor!r})"


def launch_engines(
    engine: EngineConfig,
    cluster: ClusterConfig,
    *,
    node_address: str,
    log_dir: str,
    call_timeout_s: float,
    first_rank: int = 0,
) -> tuple[list[RayEngine], list[str], list[dict[str, str]]]:
    """Join (or start) the job's Ray cluster and bring up its engines as named actors.

    The engines are placed by a placement group (one bundle per engine, see
    vime.cluster.ray_cluster) and each serves on its own node's address (external engines need
    no Ray: `vime.plugin` reaches them by URL). Returns the engine handles, their URLs and where
    each runs (node_info). On failure, every engine that came up is shut down. `first_rank`:
    the job's index of the first of them (engines joining a running job come after the others).
    """
    if engine.external_urls:
        raise ValueError("launch_engines launches engines; external_urls are reached by URL")
    import ray

    from vime.cluster.ray_cluster import (
        JobIdentity,
        connect,
        engine_actor_options,
        place_engines,
    )
    from vime.engines.vllm_engine import VLLMEngine

    job = JobIdentity.from_config(cluster)
    connect(
        cluster,
        job,
        node_address=node_address,
        runtime_env={"env_vars": {"PYTHONPATH": _python_path()}},
    )
    actor_cls = ray.remote(VLLMEngine)
    group = place_engines(cluster, job, engine.num_engines, first_rank)
    ranks = range(first_rank, first_rank + engine.num_engines)
    actors = [
        actor_cls.options(
            **engine_actor_options(cluster, job, group, rank, bundle_index=rank - first_rank),
            # Threaded: restart() (fault tolerance) must run while a call is stuck on a
            # stalled engine.
            max_concurrency=4,
        ).remote(engine, rank=rank, log_dir=log_dir, interface=cluster.interface)
        for rank in ranks
    ]
    try:
        urls = ray.get([actor.init.remote() for actor in actors], timeout=startup_bound(engine))
        infos = ray.get([actor.node_info.remote() for actor in actors], timeout=call_timeout_s)
    except BaseException:
        # An engine that failed stopped its own server; stop the ones that came up.
        ray.get([actor.shutdown.remote() for actor in actors], timeout=120)
        raise
    for rank, url, info in zip(ranks, urls, infos, strict=True):
        logger.info("engine %d at %s on %s", rank, url, info)
    engines = [
        RayEngine(actor, timeout_s=call_timeout_s, url=url)
        for actor, url in zip(actors, urls, strict=True)
    ]
    return engines, urls, infos


def _python_path() -> str:
    """PYTHONPATH for the engine actors: where this vime is imported from (the repository for an
    editable install), then the caller's own entries, whatever the working directory."""
    import vime

    here = str(Path(vime.__file__).resolve().parents[1])
    return os.pathsep.join(
        [here, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )


def startup_bound(engine: EngineConfig) -> float:
    """How long launching (or reaching) every engine may take before the job gives up."""
    return engine.startup_timeout_s + 60


def launch_or_attach(
    config: EngineConfig,
    cluster: ClusterConfig,
    address: str,
    log_dir: str | Path | None,
    call_timeout_s: float,
) -> tuple[list[Any], list[str], list[dict[str, str]]]:
    """Rank 0: engine handles, URLs, where each runs. Launched engines are Ray actors (RayEngine
    wrappers); external ones are plain HTTP clients, checked to answer as vLLM in dev mode."""
    import tempfile

    from vime.engines.vllm_engine import VLLMEngine

    if config.external_urls:
        urls_given = config.external_urls
        clients = [VLLMEngine(config, rank=i, url=url) for i, url in enumerate(urls_given)]
        urls = [client.init() for client in clients]
        return clients, urls, [{"external": "true"} for _ in urls]

    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="vime-engines-"))
    return launch_engines(
        config,
        cluster,
        node_address=address,
        log_dir=str(log_dir),
        call_timeout_s=call_timeout_s,
    )
