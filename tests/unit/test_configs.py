"""Every file in configs/ parses into the job's config tree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vime.config import TrainConfig, load_config

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


def test_engine_backend_is_the_transports_and_unknown_keys_name_themselves():
    path = CONFIGS[0]
    with pytest.raises(ValueError, match="weight_sync.transport .here 'shm'. sets the engines"):
        load_config(TrainConfig, path, ["engine.weight_transfer_backend=shm"])
    for key in ("weight_sync.mode", "engine.pause_mode", "engine.flush_cache_timeout_s"):
        with pytest.raises(ValueError, match=rf"{re.escape(key)}: Extra inputs are not permitted"):
            load_config(TrainConfig, path, [f"{key}=1"])


def test_transport_override_switches_the_engines_backend():
    config = load_config(TrainConfig, CONFIGS[0], ["weight_sync.transport=gloo"])
    assert config.engine.weight_transfer_backend == "gloo"


def test_reference_kl_is_configured_not_rejected():
    config = load_config(TrainConfig, CONFIGS[0], ["grpo.kl_coef=0.1", "grpo.kl_estimator=k1"])
    assert (config.grpo.kl_coef, config.grpo.kl_estimator) == (0.1, "k1")
    with pytest.raises(ValueError, match="kl_estimator"):
        load_config(TrainConfig, CONFIGS[0], ["grpo.kl_estimator=k2"])


def test_a_single_local_engine_leaves_its_last_core_to_the_trainer():
    from vime.utils.cores import spare_core

    assert spare_core([0, 1, 2, 3], 1, 1) == 3
    assert spare_core([0, 1, 2, 3], 2, 1) is None  # engines split all cores
    assert spare_core([0, 1, 2, 3], 0, 1) is None  # external engines
    assert spare_core([0, 1], 1, 2) is None  # a TP=2 engine needs both cores
    assert spare_core([0, 1, 2], 1, 2) == 2
