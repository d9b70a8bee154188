"""vime's typed config tree (pydantic): one section per module, loaded from YAML with dotted
command-line overrides by `load_config`. Imports neither torch nor the rest of vime.

    config = load_config(TrainConfig, "configs/tiny_cpu_sft_rl.yaml", ["num_steps=5"])
"""

from vime.config.base import StrictModel, apply_overrides, format_validation_error, load_config
from vime.config.checkpoint import CheckpointConfig, complete_checkpoints, latest_checkpoint
from vime.config.cluster import ClusterConfig, SlurmConfig
from vime.config.engine import VIME_WORKER_EXTENSION, EngineConfig, WeightTransferBackend
from vime.config.fleet import FleetChange, FleetConfig, ScaleUpPolicy
from vime.config.job import ModelBuildConfig, TrainConfig
from vime.config.rl import EvalConfig, GRPOConfig, OffPolicyConfig, RolloutConfig, SFTConfig
from vime.config.trainer import TrainerConfig
from vime.config.weight_sync import (
    TRANSPORT_KINDS,
    BroadcastTransportConfig,
    GlooTransportConfig,
    IpcTransportConfig,
    NcclTransportConfig,
    ShmTransportConfig,
    TransportConfig,
    WeightSyncConfig,
)

__all__ = [
    "TRANSPORT_KINDS",
    "VIME_WORKER_EXTENSION",
    "BroadcastTransportConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "EngineConfig",
    "EvalConfig",
    "FleetChange",
    "FleetConfig",
    "ScaleUpPolicy",
    "GRPOConfig",
    "OffPolicyConfig",
    "GlooTransportConfig",
    "IpcTransportConfig",
    "ModelBuildConfig",
    "NcclTransportConfig",
    "RolloutConfig",
    "SFTConfig",
    "ShmTransportConfig",
    "SlurmConfig",
    "StrictModel",
    "TrainConfig",
    "TrainerConfig",
    "TransportConfig",
    "WeightSyncConfig",
    "WeightTransferBackend",
    "apply_overrides",
    "complete_checkpoints",
    "format_validation_error",
    "latest_checkpoint",
    "load_config",
]
