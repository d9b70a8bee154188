"""The sync session's order and failure handling with fake engines, and WeightSyncConfig checks.

One process: a gloo group of size 1 stands in for the trainer ranks (the real multi-rank runs
against vLLM servers are in tests/distributed/test_weight_sync.py).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from vime.config import WeightSyncConfig
from vime.rollout.vllm_engine import FlushCacheError
from vime.weight_sync.session import WeightSyncError, call_engines, run_sync_session

pytestmark = pytest.mark.unit

ONE_STAGE = {"pp_rank": 0, "pp_size": 1}


class FakeEngine:
    """Records control calls; `fail` maps a method name to the exception it raises."""

    def __init__(self, log: list, name: str, fail: dict | None = None, hold_blocks=False):
        self.log, self.name, self.fail, self.hold_blocks = log, name, fail or {}, hold_blocks

    def _call(self, method: str, *args) -> None:
        self.log.append((self.name, method, *args))
        if method in self.fail:
            raise self.fail[method]

    def pause_generation(self, mode=None, clear_cache=None):
        self._call("pause", mode, clear_cache)

    def flush_cache(self, timeout_s=None, raise_on_timeout=True):
        self._call("flush")
        if self.hold_blocks:
            if not raise_on_timeout:
                return False
            raise FlushCacheError(f"{self.name}: requests still hold KV blocks")
        return True

    def start_weight_update(self):
        self._call("start")

    def finish_weight_update(self, weight_version):
        self._call("finish", weight_version)

    def continue_generation(self):
        self._call("resume")


@pytest.fixture(scope="module")
def group():
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        yield dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    finally:
        dist.destroy_process_group()


def test_session_runs_phases_in_order(group):
    log: list = []
    engines = [FakeEngine(log, "e0"), FakeEngine(log, "e1")]
    report = run_sync_session(
        engines=engines,
        group=group,
        weight_version=7,
        pp_rank=0,
        pp_size=1,
        send_stage=lambda: log.append(("trainer", "send")),
    )
    phases = [entry[1] for entry in log]
    assert (
        phases
        == ["pause"] * 2
        + ["flush"] * 2
        + ["start"] * 2
        + ["send"]
        + ["finish"] * 2
        + ["resume"] * 2
    )
    assert ("e0", "pause", "keep", False) in log and ("e1", "finish", "7") in log
    assert report.prefix_cache_flushed is True
    assert set(report.seconds) == {"pause", "flush", "start", "send", "finish", "resume"}


def test_clear_cache_pause_needs_no_flush_call(group):
    log: list = []
    report = run_sync_session(
        engines=[FakeEngine(log, "e0", hold_blocks=True)],
        group=group,
        weight_version=2,
        **ONE_STAGE,
        send_stage=lambda: None,
        clear_cache=True,
    )
    # The pause itself reset the prefix cache (vLLM 0.32); the engine got no flush request.
    assert [entry[1] for entry in log] == ["pause", "start", "finish", "resume"]
    assert log[0] == ("e0", "pause", "keep", True)
    assert report.prefix_cache_flushed is True


def test_unflushable_prefix_cache_is_reported_not_fatal(group):
    log: list = []
    engines = [FakeEngine(log, "e0", hold_blocks=True), FakeEngine(log, "e1")]
    report = run_sync_session(
        engines=engines, group=group, weight_version=1, **ONE_STAGE, send_stage=lambda: None
    )
    assert report.prefix_cache_flushed is False
    assert log[-1][1] == "resume"


@pytest.mark.parametrize("phase", ["start", "send", "finish"])
def test_failure_names_phase_and_engine_and_resumes(group, phase):
    log: list = []
    fail = {phase: RuntimeError("boom")} if phase != "send" else {}
    engines = [FakeEngine(log, "e0"), FakeEngine(log, "e1", fail=fail)]

    def send() -> None:
        if phase == "send":
            raise RuntimeError("transport broke")

    with pytest.raises(WeightSyncError) as info:
        run_sync_session(
            engines=engines, group=group, weight_version=3, **ONE_STAGE, send_stage=send
        )
    assert info.value.phase == phase
    if phase != "send":
        assert "engine 1" in str(info.value) and "boom" in str(info.value)
    # Nothing stays paused or mid-update: the open update is closed, every engine resumed.
    for name in ("e0", "e1"):
        calls = [entry[1:] for entry in log if entry[0] == name]
        assert calls[-1] == ("resume",)
        # The update is closed as failed; only a failing finish itself was tried as version 3.
        assert calls[-2] == ("finish", "3-failed"), calls
        tried = [call for call in calls if call == ("finish", "3")]
        assert tried == ([("finish", "3")] if phase == "finish" else []), calls


def test_hanging_engine_call_times_out():
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match="engine 1.*no answer"):
        call_engines(
            ["fast", "slow"],
            "pause",
            lambda e: release.wait(5) if e == "slow" else None,
            timeout_s=0.3,
        )
    release.set()
    assert time.monotonic() - started < 2


def test_transport_kind_alone_or_with_its_fields():
    assert WeightSyncConfig(transport="shm").transport.kind == "shm"
    config = WeightSyncConfig.model_validate(
        {"transport": {"kind": "gloo", "master_port_range": [29600, 29699]}}
    )
    assert config.transport.shape == "distributed"
    assert config.transport.master_port_range == (29600, 29699)
    assert WeightSyncConfig().transport.kind == "gloo"


@pytest.mark.parametrize("key", ["mode", "master_port_range", "flush_cache_timeout_s"])
def test_unknown_weight_sync_keys_are_refused(key):
    with pytest.raises(ValueError, match=rf"{key}\n.*Extra inputs are not permitted"):
        WeightSyncConfig.model_validate({key: 1})


def test_fields_of_another_transport_are_refused():
    with pytest.raises(ValueError, match="master_port_range"):
        WeightSyncConfig.model_validate({"transport": {"kind": "shm", "master_port_range": [1, 2]}})
    with pytest.raises(ValueError, match="'tcp'"):
        WeightSyncConfig.model_validate({"transport": "tcp"})


def test_registry_builds_each_kind_and_refuses_nccl_across_stages():
    from vime.config import IpcTransportConfig, NcclTransportConfig, ShmTransportConfig
    from vime.weight_sync.transports import TRANSPORTS, SenderPlace, make_transport

    assert set(TRANSPORTS) == {"gloo", "nccl", "shm", "ipc"}

    def place(pp_size: int) -> SenderPlace:
        return SenderPlace(
            pp_rank=1, pp_size=pp_size, engine_world_sizes=[1], bucket_bytes=1 << 20,
            timeout_s=5,
        )  # fmt: skip

    shm = make_transport(ShmTransportConfig(), place(2))
    try:
        assert shm.backend == "shm" and "-pp_1-" in shm.prefix  # each stage its own segments
    finally:
        shm.close()
    assert make_transport(IpcTransportConfig(), place(1)).backend == "ipc"
    with pytest.raises(ValueError, match="pipeline parallel size 2.*Use transport gloo"):
        make_transport(NcclTransportConfig(), place(2))


def test_ipc_placement_refuses_engine_workers_off_the_senders_gpu():
    from vime.weight_sync.transports.ipc import check_ipc_placement

    check_ipc_placement(["GPU-a"], ["GPU-a", "GPU-a"], engine=0)  # TP=2 engine on the one GPU
    with pytest.raises(ValueError, match=r"engine 1 worker 1 is on GPU GPU-b.*transport nccl"):
        check_ipc_placement(["GPU-a"], ["GPU-a", "GPU-b"], engine=1)
    with pytest.raises(ValueError, match=r"engine 0 worker 0 is on GPU GPU-a.*GPU-b"):
        check_ipc_placement(["GPU-a", "GPU-b"], ["GPU-a"], engine=0)  # PP=2 senders on 2 GPUs
    with pytest.raises(ValueError, match=r"engine 2 worker 0 runs on the CPU.*shm"):
        check_ipc_placement(["GPU-a"], [None], engine=2)
    with pytest.raises(ValueError, match=r"senders on a GPU"):
        check_ipc_placement([], ["GPU-a"], engine=0)
