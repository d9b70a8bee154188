"""Every file in configs/ parses into the job's config tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from vime.config import load_config
from vime.train import TrainConfig

pytestmark = pytest.mark.unit

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_there_are_configs():
    assert {p.name for p in CONFIGS} >= {"tiny_cpu_async.yaml", "tiny_cpu_async_gloo.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_loads(path):
    config = load_config(TrainConfig, path)
    # The one switch sets the engines' backend; the resolved config loads back as it is.
    assert config.engine.weight_transfer_backend == config.weight_sync.transport.kind
    dumped = config.model_dump(exclude={"engine": {"weight_transfer_backend"}})
    assert TrainConfig.model_validate(dumped) == config


def test_old_backend_keys_say_what_to_write():
    path = CONFIGS[0]
    with pytest.raises(ValueError, match="weight_sync.transport .here 'shm'. sets the engines"):
        load_config(TrainConfig, path, ["engine.weight_transfer_backend=shm"])
    with pytest.raises(ValueError, match="remove weight_sync.mode"):
        load_config(TrainConfig, path, ["weight_sync.mode=tensor"])
    with pytest.raises(ValueError, match="always pauses with mode=keep"):
        load_config(TrainConfig, path, ["engine.pause_mode=keep"])
    for section in ("engine", "weight_sync"):
        with pytest.raises(ValueError, match=f"{section}.flush_cache_timeout_s .*remove it"):
            load_config(TrainConfig, path, [f"{section}.flush_cache_timeout_s=0.2"])


def test_transport_override_switches_the_engines_backend():
    config = load_config(TrainConfig, CONFIGS[0], ["weight_sync.transport=gloo"])
    assert config.engine.weight_transfer_backend == "gloo"


def test_reference_kl_is_configured_not_rejected():
    config = load_config(TrainConfig, CONFIGS[0], ["grpo.kl_coef=0.1", "grpo.kl_estimator=k1"])
    assert (config.grpo.kl_coef, config.grpo.kl_estimator) == (0.1, "k1")
    with pytest.raises(ValueError, match="kl_estimator"):
        load_config(TrainConfig, CONFIGS[0], ["grpo.kl_estimator=k2"])


def test_trainer_cpu_cores_auto_takes_the_core_vllm_leaves_free(monkeypatch):
    from vime.trainer import TrainerConfig

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert TrainerConfig(cpu_cores="auto").resolve_cpu_cores(1) == [3]
    assert TrainerConfig(cpu_cores="auto").resolve_cpu_cores(2) is None  # engines split all cores
    assert TrainerConfig(cpu_cores="auto").resolve_cpu_cores(0) is None  # external engines
    assert TrainerConfig(cpu_cores=[0, 1]).resolve_cpu_cores(1) == [0, 1]
    assert TrainerConfig().resolve_cpu_cores(1) is None
