"""The `cluster:` section of a job's config: where its processes run and how they find each other.

One job = trainer ranks (torchrun) on the trainer nodes, vLLM engines as Ray actors on the engine
nodes (disaggregated) or on the trainer nodes (colocated), one Ray cluster under both. A single-host
run needs none of this section; `vime slurm` renders a multi-node job from `cluster.slurm`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from vime.config.base import StrictModel

# Ray 2.60 starts its workers on ports 10002-19999; a GCS port inside that range can be taken.
RAY_WORKER_PORT_RANGE = (10002, 19999)

PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


def _check_port_outside_ray_workers(name: str, port: int) -> None:
    low, high = RAY_WORKER_PORT_RANGE
    if low <= port <= high:
        raise ValueError(
            f"{name}={port} lies in Ray's worker-port range {low}-{high}, where a Ray worker may "
            f"already listen; pick a port outside it (e.g. 6379 or 26379)"
        )


class SlurmConfig(StrictModel):
    """What `vime slurm` renders into the sbatch script (see vime/cluster/job.sbatch.tmpl)."""

    nodes: int = Field(1, ge=1, description="Nodes of the allocation (sbatch --nodes).")
    trainer_nodes: int = Field(
        1,
        ge=1,
        description=(
            "The first `trainer_nodes` nodes run the trainer ranks; the others serve the engines. "
            "Equal to `nodes`: colocated (engines on the trainer nodes)."
        ),
    )
    trainer_procs_per_node: int | None = Field(
        None, ge=1, description="torchrun --nproc-per-node; None: gpus_per_node, or 1 without GPUs."
    )
    gpus_per_node: int = Field(0, ge=0, description="sbatch --gpus-per-node (0: none asked).")
    cpus_per_node: int | None = Field(
        None, ge=1, description="sbatch --cpus-per-task for the one task per node; None: default."
    )
    partition: str | None = Field(None, description="sbatch --partition.")
    account: str | None = Field(None, description="sbatch --account.")
    time: str = Field("01:00:00", description="sbatch --time (wall-clock limit).")
    exclusive: bool = Field(False, description="sbatch --exclusive.")
    sbatch_args: list[str] = Field(
        default_factory=list, description="Further #SBATCH lines, e.g. ['--qos=high']."
    )
    setup: list[str] = Field(
        default_factory=lambda: ["source .venv/bin/activate"],
        description=(
            "Shell lines the batch script runs first (module load, venv); every step inherits "
            "the environment they leave. `python`, `ray` and `torchrun` must be on PATH after."
        ),
    )
    srun_args: list[str] = Field(
        default_factory=list,
        description="Further options of every srun step, e.g. ['--container-image=IMAGE'].",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment of every process, e.g. NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME.",
    )
    workdir: str | None = Field(
        None, description="Directory the job runs in (relative paths start here); None: cwd."
    )
    log_dir: str = Field(
        "runs/slurm", description="Batch output (%x-%j.out) and one log per node and role."
    )
    script_dir: str = Field("runs/slurm", description="Where `vime slurm` writes the script.")
    ray_port: int = Field(
        6379,
        ge=1024,
        le=65534,
        description="The Ray head's GCS port, its client server's the next one (both outside "
        "Ray's worker ports 10002-19999).",
    )
    rdzv_port: int = Field(
        29400, ge=1024, le=65535, description="torchrun's c10d rendezvous port on trainer node 0."
    )
    join_timeout_s: float = Field(
        180.0, gt=0, description="How long the job waits for every node's Ray to join."
    )

    @model_validator(mode="after")
    def _check(self) -> SlurmConfig:
        if self.trainer_nodes > self.nodes:
            raise ValueError(
                f"slurm.trainer_nodes={self.trainer_nodes} exceeds slurm.nodes={self.nodes}; "
                "the trainer runs on the first trainer_nodes nodes of the allocation"
            )
        _check_port_outside_ray_workers("slurm.ray_port", self.ray_port)
        return self

    @property
    def engine_nodes(self) -> int:
        """Nodes that serve engines only (0: colocated on the trainer nodes)."""
        return self.nodes - self.trainer_nodes

    @property
    def colocated(self) -> bool:
        return self.engine_nodes == 0

    @property
    def procs_per_node(self) -> int:
        if self.trainer_procs_per_node is not None:
            return self.trainer_procs_per_node
        return self.gpus_per_node or 1


class ClusterConfig(StrictModel):
    """Ray cluster, node addresses and engine placement; all defaults suit one host."""

    job_name: str = Field(
        "vime",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Names the Slurm job, the Ray namespace and the engine actors.",
    )
    job_id: str | None = Field(
        None,
        description=(
            "Tells this job's Ray namespace and actors from other jobs' on one cluster; "
            "None: $SLURM_JOB_ID, else a fresh id per run."
        ),
    )
    ray_address: str | None = Field(
        None,
        description=(
            "Ray cluster to join (host:port); None: $RAY_ADDRESS, else vime starts a local cluster "
            "of its own (never one it happens to find on the node)."
        ),
    )
    node_address: str | None = Field(
        None,
        description=(
            "This node's address; every listener of the job binds to it. None: $VIME_HOST_IP, "
            "else the address of `interface`, else Slurm's NodeAddr of this node, else 127.0.0.1."
        ),
    )
    interface: str | None = Field(
        None, description="Network interface whose IPv4 address is the node address (e.g. ib0)."
    )
    placement_strategy: PlacementStrategy = Field(
        "PACK",
        description=(
            "Ray placement-group strategy of the engine bundles: PACK fills a node first, "
            "SPREAD spreads them, STRICT_* insist."
        ),
    )
    engine_num_cpus: float = Field(1.0, ge=0, description="CPUs of one engine's Ray bundle.")
    engine_num_gpus: float = Field(
        0.0, ge=0, description="GPUs of one engine's Ray bundle (tensor_parallel_size on GPU)."
    )
    engine_resource: str | None = Field(
        "vime_engine_node",
        description=(
            "Custom Ray resource that marks the nodes engines may run on (the Slurm job gives "
            "it to its engine nodes, a local cluster to its one node); each engine bundle asks "
            "for 1. None: any node with the CPUs/GPUs."
        ),
    )
    placement_timeout_s: float = Field(
        300.0, gt=0, description="How long to wait for the engines' placement group."
    )
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)

    @field_validator("job_id", mode="before")
    @classmethod
    def _job_id_as_text(cls, value: object) -> object:
        # A Slurm job id given as an override (cluster.job_id=1234) parses as a YAML integer.
        return str(value) if isinstance(value, int) else value

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if self.node_address is not None and self.slurm.nodes > 1:
            raise ValueError(
                f"cluster.node_address={self.node_address!r} is one address, but the job spans "
                f"{self.slurm.nodes} nodes: set cluster.interface (each node takes that "
                "interface's address) or leave both unset (each node takes Slurm's NodeAddr)"
            )
        return self
