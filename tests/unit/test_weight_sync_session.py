"""The sync session's order and failure handling with fake engines, and WeightSyncConfig checks.

One process: a gloo group of size 1 stands in for the trainer ranks (the real multi-rank runs
against vLLM servers are in tests/distributed/test_weight_sync.py).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from vime.config import WeightSyncConfig
from vime.engines.vllm_engine import FlushCacheError
from vime.weight_sync.engine import core_commit
from vime.weight_sync.session import WeightSyncError, call_engines, run_sync_session

pytestmark = pytest.mark.unit

ONE_STAGE = {"pp_size": 1}


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
        pp_size=1,
        stage_part=lambda stage: lambda: log.append(("trainer", "send")),
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


def test_prepare_runs_before_any_engine_call_and_its_failure_calls_no_engine(group):
    """`prepare` (a colocated sender's gather and pack, weight_sync.pack_before_pause) runs
    before the pause, outside `paused_s`; when it fails no engine was paused or started."""
    log: list = []
    report = run_sync_session(
        engines=[FakeEngine(log, "e0")],
        group=group,
        weight_version=3,
        **ONE_STAGE,
        stage_part=lambda stage: lambda: log.append(("trainer", "post")),
        prepare=lambda: (time.sleep(0.2), log.append(("trainer", "pack"))),
    )
    assert [entry[1] for entry in log] == [
        "pack", "pause", "flush", "start", "post", "finish", "resume"
    ]  # fmt: skip
    assert list(report.seconds)[0] == "prepare" and report.seconds["prepare"] >= 0.2
    assert report.paused_s < report.total_s - 0.2  # the pack is not in the engines' pause

    log.clear()
    with pytest.raises(WeightSyncError, match="'prepare' failed") as failed:
        run_sync_session(
            engines=[FakeEngine(log, "e0")],
            group=group,
            weight_version=4,
            **ONE_STAGE,
            stage_part=lambda stage: lambda: log.append(("trainer", "post")),
            prepare=lambda: (_ for _ in ()).throw(RuntimeError("gather timed out")),
        )
    assert failed.value.phase == "prepare"
    assert [entry[1] for entry in log] == []  # no pause, so nothing to resume either


def test_clear_cache_pause_needs_no_flush_call(group):
    log: list = []
    report = run_sync_session(
        engines=[FakeEngine(log, "e0", hold_blocks=True)],
        group=group,
        weight_version=2,
        **ONE_STAGE,
        stage_part=lambda stage: None,
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
        engines=engines, group=group, weight_version=1, **ONE_STAGE, stage_part=lambda stage: None
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
            engines=engines,
            group=group,
            weight_version=3,
            **ONE_STAGE,
            stage_part=lambda stage: send,
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
    assert config.transport.sync_shape == "broadcast"
    assert config.transport.master_port_range == (29600, 29699)
    assert WeightSyncConfig().transport.kind == "gloo"


def test_which_syncs_gather_and_encode_before_the_pause():
    """Colocated: every sync (packed into kept buffers); broadcast: only a delta (its encode,
    not its few bytes); never with shadow or with pack_before_pause off."""
    modes = ("dense", "full", "delta")

    def ahead(**fields) -> list[bool]:
        config = WeightSyncConfig.model_validate(fields)
        return [config.prepares_ahead(mode) for mode in modes]

    assert ahead(transport={"kind": "shm", "delta": True}) == [True, True, True]
    assert ahead(transport={"kind": "gloo", "delta": True}) == [False, False, True]
    assert ahead(transport={"kind": "gloo", "delta": True}, shadow=True) == [False] * 3
    assert ahead(transport={"kind": "shm", "delta": True}, shadow=True) == [False] * 3
    assert ahead(transport="shm", pack_before_pause=False) == [False] * 3


@pytest.mark.parametrize("key", ["mode", "master_port_range", "flush_cache_timeout_s"])
def test_unknown_weight_sync_keys_are_refused(key):
    with pytest.raises(ValueError, match=rf"{key}\n.*Extra inputs are not permitted"):
        WeightSyncConfig.model_validate({key: 1})


def test_fields_of_another_transport_are_refused():
    with pytest.raises(ValueError, match="master_port_range"):
        WeightSyncConfig.model_validate({"transport": {"kind": "shm", "master_port_range": [1, 2]}})
    with pytest.raises(ValueError, match="'tcp'"):
        WeightSyncConfig.model_validate({"transport": "tcp"})


@pytest.mark.parametrize("kind", ["gloo", "nccl", "shm", "ipc"])
def test_each_kind_builds_its_shapes_transport_at_any_stage(kind):
    """nccl and ipc with device: cpu are the same transports with the CPU plug-ins; any stage."""
    from vime.weight_sync.transports import SenderPlace, make_transport

    config = WeightSyncConfig.model_validate(
        {"transport": {"kind": kind, **({"device": "cpu"} if kind in ("nccl", "ipc") else {})}}
    ).transport
    place = SenderPlace(
        pp_rank=3,
        engine_world_sizes=[2, 1],
        timeout_s=5,
        device=torch.device("cpu"),
        device_id="cpu",
    )
    transport = make_transport(config, place)
    try:
        if kind in ("gloo", "nccl"):
            assert transport.backend == "vime_broadcast"
            assert transport.communicator_cls.name == "gloo"  # the CPU plug-in
            assert transport.group_name == "vime-pp_3" and transport.world_size == 4
        else:
            assert transport.backend == "vime_colocated"
            assert transport.handles.name == "shm"
            assert "-pp_3-" in transport.handles.prefix  # each stage its own segments
    finally:
        transport.close()


def test_gpu_plugins_are_the_default_of_nccl_and_ipc_and_delta_runs_on_every_kind():
    for kind, plugin in (("nccl", "nccl"), ("ipc", "ipc"), ("gloo", "gloo"), ("shm", "shm")):
        config = WeightSyncConfig.model_validate({"transport": {"kind": kind, "delta": True}})
        assert config.transport.plugin == plugin and config.transport.delta


def test_broadcast_placement_refuses_two_group_members_on_one_device():
    from vime.weight_sync.placement import RankPlace, check_broadcast_placement

    sender = RankPlace(rank=2, pp_rank=1, is_sender=True, device="cuda:a")
    check_broadcast_placement([sender], [["cuda:b", "cuda:c"], ["cuda:d"]])
    check_broadcast_placement([sender], [["cpu", "cpu"]])  # the shared host: no device to clash
    with pytest.raises(
        ValueError, match=r"trainer rank 2 .*engine 1 worker 0 .*cuda:a.*device_ids"
    ):
        check_broadcast_placement([sender], [["cuda:b"], ["cuda:a"]])
    with pytest.raises(ValueError, match=r"engine 0 worker 0 and engine 0 worker 1 .*cuda:b"):
        check_broadcast_placement([sender], [["cuda:b", "cuda:b"]])


def test_colocated_holders_one_rank_per_engine_device_the_sender_first():
    from vime.weight_sync.placement import RankPlace, plan_holders

    ranks = [
        RankPlace(rank=0, pp_rank=0, is_sender=True, device="cuda:a"),
        RankPlace(rank=1, pp_rank=0, is_sender=False, device="cuda:b"),
        RankPlace(rank=2, pp_rank=1, is_sender=True, device="cuda:c"),
        RankPlace(rank=3, pp_rank=1, is_sender=False, device="cuda:d"),
    ]
    # One TP=4 engine over the four GPUs: each stage's sender holds its own device only.
    holders = plan_holders(ranks, [["cuda:a", "cuda:b", "cuda:c", "cuda:d"]])
    assert holders[0] == {"cuda:a": 0, "cuda:b": 1, "cuda:c": 2, "cuda:d": 3}
    assert holders[1] == holders[0]
    # One engine on the second stage's sender's GPU: stage 0's bytes go to rank 2.
    assert plan_holders(ranks, [["cuda:c"]]) == {0: {"cuda:c": 2}, 1: {"cuda:c": 2}}
    # On one host (no distinct devices) every stage's sender holds its own buckets.
    host = [RankPlace(r, r, True, "cpu") for r in range(2)]
    assert plan_holders(host, [["cpu", "cpu"]]) == {0: {"cpu": 0}, 1: {"cpu": 1}}
    with pytest.raises(ValueError, match=r"engine 0 worker 1 is on device cuda:e.*nccl"):
        plan_holders(ranks, [["cuda:a", "cuda:e"]])


def test_broadcast_rendezvous_gives_up_at_the_configured_deadline():
    """An engine that never joins its group (its init call returns without joining): the
    sender's rendezvous fails after the transport's timeout, not vLLM's fixed 300 s."""
    from vime.weight_sync.transports.broadcast import BroadcastTransport

    transport = BroadcastTransport(engine_world_sizes=[1], timeout_s=2)
    started = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 (gloo's own timeout error type varies)
        transport.connect([lambda info: None])
    assert time.monotonic() - started < 15
    transport.close()


def test_engine_device_ids_become_each_engines_devices():
    from vime.config import EngineConfig
    from vime.engines.server_command import build_server_command

    config = EngineConfig(
        model_path="/m", num_engines=2, tensor_parallel_size=2, device_ids=["0,1", "2,3"]
    )
    _, env = build_server_command(config, 8000, rank=1)
    assert env["VIME_DEVICE_IDS"] == "2,3"  # CPU: the workers' stand-in device ids
    with pytest.raises(ValueError, match="engine rank 2"):
        build_server_command(config, 8000, rank=2)
    for bad in (["0,1"], ["0", "1"]):
        with pytest.raises(ValueError, match="device_ids"):
            EngineConfig(model_path="/m", num_engines=2, tensor_parallel_size=2, device_ids=bad)


class ShadowEngine(FakeEngine):
    """An engine loading beside its served weights: its workers answer vime_shadow_ready
    "not yet" `polls` times, then ready (or `error`); `hook`: its engine core has vime's hook
    (`core_commit`), whose answers these are."""

    def __init__(self, log, name, polls=2, error=None, hook=False, flushed=True):
        super().__init__(log, name)
        self.polls, self.error, self.hook, self.flushed = polls, error, hook, flushed

    def collective_rpc(self, method, args=None, kwargs=None, timeout_s=None):
        if method == "vime_end_open_update":
            self._call("drop")
            return [{"ended": True}]
        if method == core_commit.PROBE:
            self._call("probe")
            return [{"available": self.hook, "why": None if self.hook else "no hook"}]
        if method == core_commit.COMMIT:
            assert self.hook
            self._call("commit", kwargs["weight_version"], kwargs["flush"])
            return [
                {"weight_version": kwargs["weight_version"], "prefix_cache_flushed": self.flushed}
            ]
        assert method == "vime_shadow_ready" and float(kwargs["wait_s"]) < 1
        self._call("ready?")
        if self.error is not None:
            return [{"ready": False, "error": self.error}]
        self.polls -= 1
        return [{"ready": self.polls < 0, "error": None}]


def _shadow_sync(group, engines, weight_version, log=None, clear_cache=False):
    """A shadow sync of `engines`; the trainer's send appends ("trainer", "send") to `log`."""
    return run_sync_session(
        engines=engines,
        group=group,
        weight_version=weight_version,
        pp_size=1,
        stage_part=lambda stage: (
            (lambda: log.append(("trainer", "send"))) if log is not None else None
        ),
        shadow=True,
        clear_cache=clear_cache,
    )


def test_shadow_session_loads_before_the_pause_which_covers_only_the_swap(group):
    """Engines without vime's engine-core hook: a keep pause brackets the swap."""
    log: list = []
    engines = [ShadowEngine(log, "e0"), ShadowEngine(log, "e1", polls=0)]
    report = _shadow_sync(group, engines, 4, log)
    e0 = [entry[1] for entry in log if entry[0] in ("e0", "trainer")]
    # Decoding goes on through start, send and the load; the keep pause brackets the swap.
    assert e0 == ["start", "send", "ready?", "ready?", "ready?", "probe", "pause", "flush"] + [
        "finish",
        "resume",
    ]
    assert ("e1", "finish", "4") in log
    assert set(report.seconds) >= {"start", "send", "stage", "pause", "finish", "resume"}
    swap = sum(report.seconds[k] for k in ("pause", "flush", "finish", "resume"))
    assert report.paused_s <= swap + 0.05 < report.total_s + 0.05


@pytest.mark.parametrize("flushed", [True, False])
def test_shadow_session_with_the_hook_swaps_between_two_steps_and_never_pauses(group, flushed):
    """Every engine has the hook: one call per engine swaps, labels and flushes; no pause, no
    resume; the prefix cache counts as flushed only where every engine reset it."""
    log: list = []
    engines = [
        ShadowEngine(log, "e0", hook=True),
        ShadowEngine(log, "e1", polls=0, hook=True, flushed=flushed),
    ]
    report = _shadow_sync(group, engines, 7, log)
    e0 = [entry[1:] for entry in log if entry[0] == "e0"]
    assert e0 == [
        ("start",),
        ("ready?",),
        ("ready?",),
        ("ready?",),
        ("probe",),
        ("commit", "7", "1"),
    ]
    assert ("e1", "commit", "7", "1") in log
    assert report.prefix_cache_flushed is flushed
    assert report.paused_s == report.seconds["finish"]


def test_shadow_session_pauses_for_the_swap_when_one_engine_lacks_the_hook_or_the_cache_is_cleared(
    group,
):
    for hooks, clear_cache in (((True, False), False), ((True, True), True)):
        log: list = []
        engines = [ShadowEngine(log, f"e{i}", polls=0, hook=hook) for i, hook in enumerate(hooks)]
        _shadow_sync(group, engines, 8, clear_cache=clear_cache)
        for name in ("e0", "e1"):
            calls = [entry[1] for entry in log if entry[0] == name]
            assert "commit" not in calls and "pause" in calls, calls
            assert calls[-2:] == ["finish", "resume"], calls
            # clear_cache: the keep pause clears the cache itself; the hook is not asked.
            assert ("probe" in calls) is not clear_cache


def test_a_failed_shadow_load_is_never_swapped_in_nor_paused(group):
    log: list = []
    engines = [ShadowEngine(log, "e0"), ShadowEngine(log, "e1", error="RuntimeError: no memory")]
    with pytest.raises(WeightSyncError) as info:
        run_sync_session(
            engines=engines,
            group=group,
            weight_version=5,
            pp_size=1,
            stage_part=lambda stage: None,
            shadow=True,
        )
    assert info.value.phase == "stage"
    assert "engine 1" in str(info.value) and "no memory" in str(info.value)
    for name in ("e0", "e1"):
        calls = [entry[1:] for entry in log if entry[0] == name]
        assert ("pause", "keep", False) not in calls  # never paused for a swap that cannot be
        # Dropped, never finished (a finish would swap in what had loaded): nothing swapped in,
        # the engines serve their version under its label.
        assert ("drop",) in calls and not any(call[0] == "finish" for call in calls)


def test_the_engine_core_hook_wraps_collective_rpc_once():
    """vLLM loads general plugins more than once per process: one wrap, vLLM's method inside."""
    from vllm.v1.engine.core import EngineCore

    core_commit.register()
    wrapped = EngineCore.collective_rpc
    assert wrapped.vime_hook
    core_commit.register()
    assert EngineCore.collective_rpc is wrapped
