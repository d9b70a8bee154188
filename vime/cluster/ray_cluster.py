"""The job's Ray cluster: joined by explicit address only, one namespace per job, engines placed.

    job = JobIdentity.from_config(cluster)          # namespace "<job_name>-<job_id>"
    connect(cluster, job, node_address="10.0.0.5")  # cluster.ray_address / $RAY_ADDRESS, or a
                                                    # local cluster of the job's own
    group = place_engines(cluster, job, 4)           # one bundle per engine, waits with a timeout
    actor = ray.remote(VLLMEngine).options(**engine_actor_options(cluster, job, group, 0))

`ray.init()` without an address joins whatever cluster the node last knew
(/tmp/ray/ray_current_cluster); vime never does that: without an address it starts its own.
Actor names carry the job's name and id, so two jobs can share one Ray cluster.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any

from vime.config import ClusterConfig

logger = logging.getLogger(__name__)

# A local cluster (and every engine node of a Slurm job) offers this many units of
# cluster.engine_resource: the bound on engines per node comes from CPUs and GPUs, not from it.
ENGINE_RESOURCE_UNITS = 1000
# Each node of a Slurm job also offers {NODE_RESOURCE_PREFIX + slurm node name: 1}, so the job can
# tell which of its nodes have joined.
NODE_RESOURCE_PREFIX = "vime_node:"


@dataclass(frozen=True)
class JobIdentity:
    """What tells this job's Ray objects from another job's on the same cluster."""

    name: str
    job_id: str

    @classmethod
    def from_config(cls, cluster: ClusterConfig) -> JobIdentity:
        job_id = cluster.job_id or os.environ.get("SLURM_JOB_ID") or _fresh_id()
        return cls(name=cluster.job_name, job_id=job_id)

    @property
    def namespace(self) -> str:
        return f"{self.name}-{self.job_id}"

    def engine_actor_name(self, rank: int) -> str:
        return f"{self.namespace}-engine-{rank}"


def _fresh_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def ray_address(cluster: ClusterConfig) -> str | None:
    """cluster.ray_address, else $RAY_ADDRESS, else None (start a local cluster)."""
    return cluster.ray_address or os.environ.get("RAY_ADDRESS") or None


def connect(
    cluster: ClusterConfig,
    job: JobIdentity,
    *,
    node_address: str,
    runtime_env: dict[str, Any] | None = None,
) -> bool:
    """Join the configured cluster, or start a local one; True when this process started it
    (False too when this process is connected already).

        `node_address`: this node's address; on a node with several Ray nodes (one machine holding
        test nodes) it picks the raylet of this node.
    """
    import ray

    if ray.is_initialized():  # engines joining a running job: its driver is connected
        return False
    address = ray_address(cluster)
    common = dict(
        namespace=job.namespace,
        runtime_env=runtime_env,
        log_to_driver=False,
        _node_ip_address=node_address,
    )
    if address is not None:
        ray.init(address=address, **common)
        logger.info("joined Ray at %s, namespace %s", address, job.namespace)
        return False
    address = _start_local_head(cluster, node_address)
    _init_when_up(address, common)
    logger.info("started a local Ray cluster at %s, namespace %s", address, job.namespace)
    return True


# The local Ray head this process started (connect without an address), under a keeper.
_local_head: dict[str, Any] = {}


def _start_local_head(cluster: ClusterConfig, node_address: str) -> str:
    """`ray start --head --block` of this job's own, under a keeper (vime.utils.keeper) owned by
    this process: however this process ends, the keeper ends every Ray process of the cluster
    (`ray.init(address="local")` leaves Ray's agents running for minutes when its driver is
    SIGKILLed). Its own temp dir (no "current cluster" file another job would find) and token."""
    from vime.utils.keeper import spawn_kept
    from vime.utils.net import free_ports

    # Three distinct free ports: the GCS, Ray's client server, the dashboard agent. (The client
    # server once took port + 1, which something else held now and then: the head died.)
    port, client_port, agent_port = free_ports(node_address, 3)
    temp_dir = tempfile.mkdtemp(prefix="vime-ray-")  # short: Ray's socket paths must fit 107 chars
    argv = ray_start_argv(
        address=node_address,
        node_name=socket.gethostname(),
        head_port=port,
        engine_resource=cluster.engine_resource,
        temp_dir=temp_dir,
        # Ray's default (52365) is one fixed port per machine: a second Ray there fails to start.
        dashboard_agent_port=agent_port,
        client_server_port=client_port,
    )
    ray_cli = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; main()"]
    # Token auth for the head, its processes and this driver. Ray caches both the mode and the
    # token at import: refresh them as ray.init(address="local") itself does.
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    from ray._private.authentication.authentication_token_setup import _enable_token_auth
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]

    _enable_token_auth()
    AuthenticationTokenLoader.instance().reset_cache()
    with open(os.path.join(temp_dir, "ray-head.log"), "ab") as log:
        head = spawn_kept(
            [*ray_cli, *argv[1:]], env=dict(os.environ), log_file=log, remove_dir=temp_dir
        )
    _local_head.update(keeper=head, temp_dir=temp_dir)
    return f"{node_address}:{port}"


def _init_when_up(address: str, common: dict[str, Any], timeout_s: float = 120.0) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.init(address=address, **common)
            return
        except (ConnectionError, RuntimeError) as exc:
            if time.monotonic() > deadline:
                log = os.path.join(_local_head.get("temp_dir", "?"), "ray-head.log")
                raise RuntimeError(
                    f"local Ray head at {address} not up within {timeout_s:g} s (log {log}): {exc}"
                ) from exc
            time.sleep(1.0)


def disconnect() -> None:
    """Leave Ray; stop the local head this process started (and remove its temp dir)."""
    import ray

    ray.shutdown()
    head = _local_head.pop("keeper", None)
    if head is not None:
        head.send_signal(signal.SIGTERM)
        head.wait(timeout=60)  # the keeper removes the temp dir last


def engine_bundle(cluster: ClusterConfig) -> dict[str, float]:
    """The Ray resources one engine takes (its actor asks for exactly these)."""
    bundle = {"CPU": cluster.engine_num_cpus, "GPU": cluster.engine_num_gpus}
    if cluster.engine_resource:
        bundle[cluster.engine_resource] = 1
    return {name: amount for name, amount in bundle.items() if amount > 0}


def place_engines(
    cluster: ClusterConfig, job: JobIdentity, num_engines: int, first_rank: int = 0
) -> Any:
    """A ready placement group of one engine bundle per engine (engines `first_rank`.. of the
    job: engines that join later get a group of their own); TimeoutError says what's free."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = [engine_bundle(cluster) for _ in range(num_engines)]
    name = f"{job.namespace}-engines" + (f"-{first_rank}" if first_rank else "")
    group = placement_group(bundles, strategy=cluster.placement_strategy, name=name)
    try:
        ray.get(group.ready(), timeout=cluster.placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise TimeoutError(
            f"{num_engines} engine bundle(s) {bundles[0]} with strategy "
            f"{cluster.placement_strategy} not placed within {cluster.placement_timeout_s:g} s. "
            f"Free resources per node: {_free_resources()}. Engine nodes offer "
            f"{cluster.engine_resource!r} (the Slurm job and a local cluster do); on a cluster of "
            "your own, start them with `ray start --resources` naming it, or set "
            "cluster.engine_resource=null"
        ) from None
    return group


def _free_resources() -> dict[str, dict[str, float]]:
    import ray

    free = {}
    for node in ray.nodes():
        if node.get("Alive"):
            free[node["NodeManagerAddress"]] = {
                k: v for k, v in node["Resources"].items() if not k.startswith("node:")
            }
    return free


def engine_actor_options(
    cluster: ClusterConfig, job: JobIdentity, group: Any, rank: int, bundle_index: int | None = None
) -> dict[str, Any]:
    """`.options(...)` of engine `rank`'s actor: its name, its bundle (`bundle_index` in `group`,
    default `rank`), exactly its resources."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = engine_bundle(cluster)
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    return dict(
        name=job.engine_actor_name(rank),
        num_cpus=bundle.get("CPU", 0),
        num_gpus=bundle.get("GPU", 0),
        resources=custom or None,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group,
            placement_group_bundle_index=rank if bundle_index is None else bundle_index,
        ),
    )


def wait_for_nodes(node_names: list[str], timeout_s: float, poll_s: float = 1.0) -> None:
    """Wait until the Ray node of every Slurm node in `node_names` is alive (ray.init first).

    Raises TimeoutError naming the nodes that did not join.
    """
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        joined = {
            resource[len(NODE_RESOURCE_PREFIX) :]
            for node in ray.nodes()
            if node.get("Alive")
            for resource in node["Resources"]
            if resource.startswith(NODE_RESOURCE_PREFIX)
        }
        missing = [name for name in node_names if name not in joined]
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"Ray nodes not joined after {timeout_s:g} s: {', '.join(missing)} (joined: "
                f"{', '.join(sorted(joined)) or 'none'}); see that node's ray log in the job's "
                "log directory"
            )
        time.sleep(poll_s)


def ray_start_argv(
    *,
    address: str,
    node_name: str,
    head_port: int | None = None,
    head_address: str | None = None,
    engine_resource: str | None = None,
    temp_dir: str | None = None,
    dashboard_agent_port: int | None = None,
    client_server_port: int | None = None,
) -> list[str]:
    """`ray start --block` for this node: the head (head_port) or a worker (head_address).

    The head's client server listens on `client_server_port` (None: head_port + 1, which the
    caller must know to be free)."""
    if (head_port is None) == (head_address is None):
        raise ValueError("give exactly one of head_port (the head) and head_address (a worker)")
    resources = {f"{NODE_RESOURCE_PREFIX}{node_name}": 1}
    if engine_resource:
        resources[engine_resource] = ENGINE_RESOURCE_UNITS
    argv = ["ray", "start", "--block", "--disable-usage-stats", f"--node-ip-address={address}"]
    if head_port is not None:
        argv += [
            "--head",
            f"--port={head_port}",
            # Ray's client server takes 10001 unless told (one fixed port per machine).
            f"--ray-client-server-port={client_server_port or head_port + 1}",
            "--include-dashboard=false",
        ]
    else:
        argv.append(f"--address={head_address}")
    if temp_dir:
        # The job's own: sockets, logs and the "current cluster" file of no other Ray.
        argv.append(f"--temp-dir={temp_dir}")
    if dashboard_agent_port is not None:
        argv.append(f"--dashboard-agent-listen-port={dashboard_agent_port}")
    argv.append(f"--resources={json.dumps(resources, separators=(',', ':'))}")
    return argv
