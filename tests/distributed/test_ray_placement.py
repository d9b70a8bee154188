"""Engine placement on a real multi-node Ray cluster (three Ray nodes on this machine, each its own
loopback address), the per-job namespace, and never joining a cluster by accident.

The probe actors are placed with exactly the options vime gives its engine actors
(`engine_actor_options`); they report the node they run on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from vime.cluster.ray_cluster import (
    NODE_RESOURCE_PREFIX,
    JobIdentity,
    connect,
    engine_actor_options,
    place_engines,
    wait_for_nodes,
)
from vime.config import ClusterConfig

pytestmark = pytest.mark.distributed

HEAD, ENGINE_A, ENGINE_B = "127.0.0.2", "127.0.0.3", "127.0.0.4"


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster()
    # The head (trainer) node offers no engine resource; two engine nodes do.
    cluster.add_node(
        node_ip_address=HEAD,
        num_cpus=1,
        include_dashboard=False,
        resources={f"{NODE_RESOURCE_PREFIX}vime-head": 1},  # as the Slurm job names its nodes
    )
    for address in (ENGINE_A, ENGINE_B):
        cluster.add_node(node_ip_address=address, num_cpus=2, resources={"vime_engine_node": 1000})
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def job(ray_cluster) -> JobIdentity:
    """This test process is the driver of job A, joined by explicit address."""
    import ray

    job = JobIdentity(name="shared", job_id="A")
    started = connect(ClusterConfig(ray_address=ray_cluster.address), job, node_address=HEAD)
    assert not started
    assert ray.get_runtime_context().namespace == "shared-A"
    return job


def _probe_class():
    import ray

    @ray.remote
    class Probe:
        def node_address(self) -> str:
            return ray.util.get_node_ip_address()

    return Probe


def _place(config: ClusterConfig, job: JobIdentity, num_engines: int) -> list[str]:
    import ray
    from ray.util.placement_group import remove_placement_group

    group = place_engines(config, job, num_engines)
    probe = _probe_class()
    actors = [
        probe.options(**engine_actor_options(config, job, group, rank)).remote()
        for rank in range(num_engines)
    ]
    addresses = ray.get([actor.node_address.remote() for actor in actors], timeout=120)
    for actor in actors:
        ray.kill(actor)
    remove_placement_group(group)
    return addresses


def test_engines_land_on_engine_nodes_packed_or_spread(job):
    packed = _place(ClusterConfig(placement_strategy="PACK"), job, 2)
    assert len(set(packed)) == 1 and packed[0] in (ENGINE_A, ENGINE_B), packed
    spread = _place(ClusterConfig(placement_strategy="STRICT_SPREAD"), job, 2)
    assert sorted(spread) == [ENGINE_A, ENGINE_B]
    # Without the engine resource any node with a CPU will do (a cluster vime did not start).
    anywhere = _place(
        ClusterConfig(placement_strategy="STRICT_SPREAD", engine_resource=None), job, 3
    )
    assert sorted(anywhere) == [HEAD, ENGINE_A, ENGINE_B]


def test_unplaceable_engines_fail_in_bounded_time_saying_what_is_free(job):
    too_big = ClusterConfig(engine_num_cpus=8, placement_timeout_s=3)
    with pytest.raises(TimeoutError, match=r"not placed within 3 s\. Free resources per node"):
        place_engines(too_big, job, 1)


SECOND_JOB = textwrap.dedent(
    """
    import json, sys
    import ray
    from vime.config import ClusterConfig
    from vime.cluster.ray_cluster import JobIdentity, connect, engine_actor_options, place_engines

    address, job_id = sys.argv[1:3]
    config = ClusterConfig(ray_address=address or None, job_name="shared")
    job = JobIdentity(name="shared", job_id=job_id)
    started = connect(config, job, node_address="{head}")

    @ray.remote
    class Probe:
        def ok(self):
            return True

    group = place_engines(config, job, 1)
    actor = Probe.options(**engine_actor_options(config, job, group, 0)).remote()
    assert ray.get(actor.ok.remote(), timeout=60)
    print(json.dumps({{
        "started": started,
        "gcs": ray.get_runtime_context().gcs_address,
        "num_nodes": len(ray.nodes()),
        "named": sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)),
    }}))
    """
)


def _run_job(address: str, job_id: str, node_address: str = HEAD) -> dict:
    code = SECOND_JOB.replace("{head}", node_address).replace("{{", "{").replace("}}", "}")
    done = subprocess.run(
        [sys.executable, "-c", code, address, job_id], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_jobs_share_one_cluster_without_collisions(ray_cluster, job):
    import ray

    config = ClusterConfig(ray_address=ray_cluster.address, job_name="shared")
    group = place_engines(config, job, 1)
    probe = _probe_class()
    mine = probe.options(**engine_actor_options(config, job, group, 0)).remote()
    assert ray.get(mine.node_address.remote(), timeout=60) in (ENGINE_A, ENGINE_B)
    # A second job, its own driver, same job name and engine rank: its own names, no clash.
    other = _run_job(ray_cluster.address, "B")
    assert not other["started"]
    assert {"shared-A-engine-0", "shared-B-engine-0"} <= set(other["named"])


def test_no_address_starts_a_cluster_of_its_own(ray_cluster, monkeypatch):
    """With a cluster running on this machine, a job given no address must not join it."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    own = _run_job("", "C", node_address="127.0.0.1")
    assert own["started"] and own["num_nodes"] == 1
    assert own["gcs"] != ray_cluster.address


def test_waiting_for_nodes_names_the_missing_one(job):
    wait_for_nodes(["vime-head"], timeout_s=10)
    with pytest.raises(
        TimeoutError, match=r"not joined after 2 s: vime-absent \(joined: vime-head\)"
    ):
        wait_for_nodes(["vime-head", "vime-absent"], timeout_s=2, poll_s=0.5)
