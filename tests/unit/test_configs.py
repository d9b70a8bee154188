"""Every file in configs/ parses into the job's config tree."""

from __future__ import annotations

import re
import sys
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
    # A misspelt or unknown key anywhere in the tree is refused by its dotted name.
    for key in ("weight_sync.verify_checksum", "engine.num_engine", "rollout.top_pp"):
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


def _gpu_matrix():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "tools" / "gpu_matrix.py"
    spec = importlib.util.spec_from_file_location("gpu_matrix", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_matrix", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_gpu_matrix_cases_are_valid_jobs_whose_placement_is_accepted(device, tmp_path):
    """tools/gpu_matrix.py's cases load as job configs, and on their GPUs (trainer rank r on GPU
    r, engines on engine.device_ids) pass the placement rules a sync checks before any byte."""
    from vime.weight_sync.placement import RankPlace, check_broadcast_placement, plan_holders

    matrix = _gpu_matrix()
    assert {case.kind for case in matrix.CASES} == {"ipc", "nccl"}
    for case in matrix.CASES:
        config = load_config(TrainConfig, CONFIGS[0], matrix.overrides(case, device, tmp_path))
        transport = config.weight_sync.transport
        assert (transport.kind, transport.device, transport.delta) == (case.kind, device, True)
        assert config.engine.num_engines == len(case.device_ids)
        if device == "cpu":
            assert config.engine.device_ids is None
            continue
        assert config.engine.device_ids == list(case.device_ids)
        pp, tp = config.trainer.pipeline_parallel_size, config.trainer.tensor_parallel_size
        assert pp * tp == case.nproc, case.name
        ranks = [RankPlace(r, r // tp, r % tp == 0, f"gpu-{r}") for r in range(case.nproc)]
        workers = [[f"gpu-{i}" for i in ids.split(",")] for ids in case.device_ids]
        assert [len(w) for w in workers] == [config.engine.tensor_parallel_size] * len(workers)
        if case.kind == "nccl":
            check_broadcast_placement([r for r in ranks if r.is_sender], workers)
        else:
            holders = plan_holders(ranks, workers)
            assert set(holders) == set(range(pp)), case.name


def test_sync_interval_syncs_every_nth_step_and_after_the_last():
    config = load_config(TrainConfig, CONFIGS[0], ["weight_sync.interval=3"])
    assert [s for s in range(7) if config.weight_sync.due(s, 7)] == [2, 5, 6]
    every = load_config(TrainConfig, CONFIGS[0])
    assert [s for s in range(4) if every.weight_sync.due(s, 4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="weight_sync.interval"):
        load_config(TrainConfig, CONFIGS[0], ["weight_sync.interval=0"])
