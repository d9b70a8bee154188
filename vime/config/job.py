"""The root of a job's config tree (configs/*.yaml): `TrainConfig`, and how its sections combine."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from vime.config.base import StrictModel
from vime.config.checkpoint import CheckpointConfig
from vime.config.cluster import ClusterConfig
from vime.config.engine import EngineConfig
from vime.config.fleet import FleetConfig
from vime.config.rl import EvalConfig, GRPOConfig, RolloutConfig, SFTConfig
from vime.config.trainer import TrainerConfig
from vime.config.weight_sync import WeightSyncConfig


class ModelBuildConfig(StrictModel):
    """Build the checkpoint at engine.model_path if it is absent (no downloads)."""

    preset: str | None = Field(
        None, description="vime.testing.tiny_model preset to build (random weights)."
    )
    pretrained: str | None = Field(
        None,
        description=(
            "vime.pretrained model to build from the package that ships its weights, e.g. "
            "smollm2-135m-instruct. None (and no preset): engine.model_path must exist."
        ),
    )
    dtype: str = Field("float32", description="dtype of the built checkpoint.")
    seed: int = Field(0, description="Seed of the built random weights (preset).")

    @model_validator(mode="after")
    def _one_source(self) -> ModelBuildConfig:
        if self.preset is not None and self.pretrained is not None:
            raise ValueError(
                f"model.preset={self.preset!r} and model.pretrained={self.pretrained!r}: "
                "give one (a random tiny model, or a real pretrained one)"
            )
        return self

    @property
    def builds(self) -> bool:
        """Whether the job builds engine.model_path (if absent)."""
        return self.preset is not None or self.pretrained is not None


class TrainConfig(StrictModel):
    """The root of a job's config tree (configs/*.yaml)."""

    run_dir: str = Field("runs/tiny-cpu-async", description="Where metrics, plots and logs go.")
    num_steps: int = Field(20, ge=1, description="Optimizer steps (= weight syncs).")
    save_rollouts: bool = Field(
        False,
        description=(
            "Append every step's samples (prompt and response token ids, rollout log-probs, "
            "per-token weight versions, reward, lag) to run_dir/rollouts.jsonl, for debugging "
            "and replay."
        ),
    )
    model: ModelBuildConfig = Field(default_factory=ModelBuildConfig)
    engine: EngineConfig = Field(description="The rollout engines.")
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    rollout: RolloutConfig = Field(description="Prompts, sampling and rewards.")
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    sft: SFTConfig = Field(
        default_factory=SFTConfig,
        description="Supervised warm start on demonstrations before RL (off by default).",
    )
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(
        default_factory=EvalConfig,
        description="Held-out evaluation before training, after SFT (if any) and after RL.",
    )
    cluster: ClusterConfig = Field(
        default_factory=ClusterConfig,
        description="Ray cluster, node addresses, engine placement, Slurm job (`vime slurm`).",
    )
    fleet: FleetConfig = Field(
        default_factory=FleetConfig, description="Engines joining and leaving while the job runs."
    )

    @model_validator(mode="before")
    @classmethod
    def _derive_engine_backend(cls, data: Any) -> Any:
        """The engines run the backend named by weight_sync.transport; nobody writes it twice."""
        if not isinstance(data, dict) or "engine" not in data:
            return data
        sync = data.get("weight_sync") or {}
        transport = sync.transport if isinstance(sync, WeightSyncConfig) else sync.get("transport")
        kind = getattr(transport, "kind", None) or (
            transport.get("kind") if isinstance(transport, dict) else transport
        )
        kind = kind or "gloo"
        engine = data["engine"]
        if isinstance(engine, EngineConfig):
            if engine.weight_transfer_backend not in (None, kind):
                raise ValueError(
                    f"engine.weight_transfer_backend={engine.weight_transfer_backend!r} but "
                    f"weight_sync.transport is {kind!r}: leave the engine's unset, the transport "
                    "sets it"
                )
            engine = engine.model_copy(update={"weight_transfer_backend": kind})
        elif isinstance(engine, dict):
            if "weight_transfer_backend" in engine:
                raise ValueError(
                    "engine.weight_transfer_backend is not written in a job config: "
                    f"weight_sync.transport (here {kind!r}) sets the engines' backend; remove it"
                )
            engine = {**engine, "weight_transfer_backend": kind}
        return {**data, "engine": engine}

    @model_validator(mode="after")
    def _check_combination(self) -> TrainConfig:
        if self.engine.num_nodes > 1 and not self.engine.external_urls:
            raise ValueError(
                f"engine.num_nodes={self.engine.num_nodes}: the RL job launches each engine on "
                "one node (Ray places one bundle per engine); start an engine spanning nodes "
                "yourself (vime.engines.server.launch_server with an EngineNodeRole) and give its "
                "URL in engine.external_urls, or set engine.num_nodes=1"
            )
        if self.eval.prompts_path and self.eval.timeout_s >= self.weight_sync.barrier_timeout_s:
            raise ValueError(
                f"eval.timeout_s={self.eval.timeout_s:g} must be below "
                f"weight_sync.barrier_timeout_s={self.weight_sync.barrier_timeout_s:g}: the other "
                "trainer ranks wait at a barrier while rank 0 evaluates; lower the first or raise "
                "the second"
            )
        if (self.fleet.schedule or self.fleet.scale_up) and self.engine.external_urls:
            raise ValueError(
                "fleet.schedule and fleet.scale_up launch and end engines, which vime cannot do "
                "for engine.external_urls: launch the engines from the job or remove them"
            )
        if self.engine.fault_tolerance and self.engine.external_urls:
            raise ValueError(
                "engine.fault_tolerance=true restarts failed engines, which vime cannot do for "
                "engine.external_urls: launch the engines from the job or turn it off"
            )
        return self
