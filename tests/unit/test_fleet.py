"""The elastic fleet's pieces without engines: the generation client's routing as engines join
and drain (against in-process stand-ins of /inference/v1/generate on loopback), the requests a
running job reads, and the config's checks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator

import pydantic
import pytest
from aiohttp import web

from vime.config import FleetConfig, ScaleUpPolicy, TrainConfig
from vime.engines import generation
from vime.engines.generate_api import SamplingConfig
from vime.engines.generation import GenerationClient
from vime.fleet.requests import REQUESTS_FILE, request_change

pytestmark = pytest.mark.unit


async def _engine(
    name: str, served: list[str], release: asyncio.Event
) -> tuple[web.AppRunner, str]:
    """A stand-in engine: answers one token after `release`, noting who served."""

    async def generate(request: web.Request) -> web.Response:
        await release.wait()
        served.append(name)
        choice = {
            "token_ids": [7],
            "logprobs": {"content": [{"logprob": -0.1}]},
            "finish_reason": "length",
            "weight_versions": [{"start": 0, "end": 1, "version": "1"}],
        }
        return web.json_response({"choices": [choice]})

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def _two_engines() -> AsyncIterator[tuple[str, str, asyncio.Event, list[str]]]:
    """Two stand-in engines on loopback: their URLs, the event that lets them answer, and the
    names of the engines that served, in order."""
    served: list[str] = []
    release = asyncio.Event()
    (r0, url0), (r1, url1) = (
        await _engine("e0", served, release),
        await _engine("e1", served, release),
    )
    try:
        yield url0, url1, release, served
    finally:
        await r0.cleanup()
        await r1.cleanup()


def test_joiners_serve_only_once_marked_up_and_drained_engines_finish_what_they_hold():
    async def run() -> None:
        sampling = SamplingConfig(max_tokens=1)
        async with _two_engines() as (url0, url1, release, served):
            async with GenerationClient([url0]) as client:
                index = client.add_engine(url1)
                assert index == 1
                await asyncio.sleep(0)  # the change lands on the client's loop
                assert client.serving() == [0]  # down until it holds the trainer's weights
                held = [asyncio.ensure_future(client.generate([1], sampling)) for _ in range(3)]
                await asyncio.sleep(0.1)
                assert client.num_in_flight(0) == 3
                client.drain(0)
                client.mark_up(1)
                await asyncio.sleep(0)
                assert client.serving() == [1]
                new = [asyncio.ensure_future(client.generate([1], sampling)) for _ in range(4)]
                await asyncio.sleep(0.1)
                assert (client.num_in_flight(0), client.num_in_flight(1)) == (3, 4)
                release.set()
                results = await asyncio.gather(*held, *new)
                assert [r.engine_url for r in results] == [url0] * 3 + [url1] * 4
                assert client.num_in_flight(0) == 0
                with pytest.raises(ValueError, match="already engine 1"):
                    client.add_engine(url1 + "/")

    asyncio.run(run())


def test_an_engine_set_change_from_another_thread_is_seen_when_the_call_returns(
    monkeypatch, caplog
):
    """The job's thread marks engines up and down while the client's loop runs in another thread
    (the rollout's): the call returns once the loop has made the change, so `serving()` read right
    after it is current; a loop that does not run it within the timeout gets a warning, and the
    change lands when the loop frees up."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    client = GenerationClient(["http://127.0.0.1:9", "http://127.0.0.1:10"])
    try:
        # The client adopts the loop its first request runs on; engine 0 is up, so this returns.
        asyncio.run_coroutine_threadsafe(client._wait_for_engine(0), loop).result(timeout=10)
        client.mark_down(1)
        assert client.serving() == [0]

        # The loop is busy (a gate the test holds) when the change is asked for: the call waits.
        gate = threading.Event()
        loop.call_soon_threadsafe(gate.wait, 30)
        threading.Timer(0.05, gate.set).start()
        client.mark_up(1)
        assert gate.is_set() and client.serving() == [0, 1]

        # A loop busy past the timeout: a warning, and the change lands once the loop frees.
        monkeypatch.setattr(generation, "_LOOP_CALL_TIMEOUT_S", 0.2)
        gate = threading.Event()
        loop.call_soon_threadsafe(gate.wait, 30)
        with caplog.at_level(logging.WARNING, logger="vime.engines.generation"):
            client.drain(0)
        assert "did not run an engine-set change within" in caplog.text
        assert client.serving() == [0, 1]  # not yet: the loop is still held
        gate.set()
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=10)
        assert client.serving() == [1]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
    client.mark_down(1)  # the loop is closed: the change is made in the caller's thread
    assert client.serving() == []


def test_a_group_shares_one_engine_least_loaded_between_groups_and_moves_when_it_goes_down():
    """Routing by affinity (a GRPO group): a key's requests go to one engine, picked least-loaded
    when the key is new; without a key each request goes least-loaded; a key whose engine drains
    or goes down moves (least-loaded again), its requests lost there resubmitted with it;
    `release` forgets a key."""
    sampling = SamplingConfig(max_tokens=1)

    def submit(client: GenerationClient, count: int, key: str | None) -> list[asyncio.Future]:
        return [
            asyncio.ensure_future(client.generate([1], sampling, affinity=key))
            for _ in range(count)
        ]

    async def urls_of(futures: list[asyncio.Future]) -> list[str]:
        return [result.engine_url for result in await asyncio.gather(*futures)]

    async def run() -> None:
        async with _two_engines() as (url0, url1, release, served):
            async with GenerationClient([url0, url1]) as client:
                groups = [submit(client, 4, f"g{index}") for index in range(3)]
                await asyncio.sleep(0)  # every task has picked its engine
                # g0 -> e0 (both idle); g1 -> e1 (e0 holds 4); g2 -> e0 (4 and 4: the first).
                assert (client.num_in_flight(0), client.num_in_flight(1)) == (8, 4)
                loose = submit(client, 4, None)
                await asyncio.sleep(0)
                assert (client.num_in_flight(0), client.num_in_flight(1)) == (8, 8)
                # g1's engine drains: g1's next request moves (least-loaded: e0); g0 stays.
                client.drain(1)
                await asyncio.sleep(0)
                moved, stayed = submit(client, 1, "g1"), submit(client, 1, "g0")
                release.set()
                assert [set(await urls_of(group)) for group in groups] == [{url0}, {url1}, {url0}]
                assert await urls_of(loose) == [url1] * 4
                assert await urls_of(moved + stayed) == [url0, url0]

            release.clear()
            async with GenerationClient([url0, url1]) as client:
                held = submit(client, 2, "busy")  # e0: both idle, the first
                await asyncio.sleep(0)
                assert (client.num_in_flight(0), client.num_in_flight(1)) == (2, 0)
                client.mark_down(0)  # cancelled there, resubmitted: the key moves to e1
                for _ in range(1000):
                    if client.num_in_flight(1) == 2:
                        break
                    await asyncio.sleep(0.01)
                after_down = submit(client, 1, "busy")
                await asyncio.sleep(0)
                client.mark_up(0)
                client.release("busy")
                await asyncio.sleep(0)
                fresh = submit(client, 1, "busy")  # released: least-loaded now, e0
                release.set()
                assert await urls_of(held + after_down) == [url1] * 3
                assert await urls_of(fresh) == [url0]
                assert client.num_resubmitted == 2

    asyncio.run(run())


def test_fleet_requests_are_lines_the_job_reads(tmp_path):
    with pytest.raises(ValueError, match="not a job's run_dir"):
        request_change(tmp_path, join=1)
    (tmp_path / "config.resolved.json").write_text("{}")
    with pytest.raises(ValueError, match="join >= 1 or leave"):
        request_change(tmp_path)
    request_change(tmp_path, join=2)
    request_change(tmp_path, leave=[0, 3])
    lines = [json.loads(line) for line in (tmp_path / REQUESTS_FILE).read_text().splitlines()]
    assert [(r["join"], r["leave"]) for r in lines] == [(2, []), (0, [0, 3])]


def test_fleet_config_names_what_is_wrong():
    with pytest.raises(pydantic.ValidationError, match="neither joins nor leaves"):
        FleetConfig(schedule=[{"step": 3}])
    base = {"engine": {"model_path": "/m"}, "rollout": {"prompts_path": "p.jsonl"}}
    fleet = {"schedule": [{"step": 1, "join": 1}]}
    with pytest.raises(pydantic.ValidationError, match="cannot do for engine.external_urls"):
        external = {"model_path": "/m", "external_urls": ["http://h:1"]}
        TrainConfig(**{**base, "fleet": fleet, "engine": external})
    assert TrainConfig(**{**base, "fleet": fleet}).fleet.schedule[0].join == 1
    with pytest.raises(pydantic.ValidationError, match="cannot do for engine.external_urls"):
        TrainConfig(**{**base, "fleet": {"scale_up": {"wait_s": 1}}, "engine": external})


def test_scale_up_asks_for_engines_only_after_enough_slow_steps_in_a_row():
    policy = ScaleUpPolicy(wait_s=1.0, steps=2)
    assert not policy.is_behind([])
    assert not policy.is_behind([5.0])  # one slow step is not enough
    assert policy.is_behind([0.1, 5.0, 1.5])
    assert not policy.is_behind([5.0, 0.2])  # the last step kept up
    assert not policy.is_behind([1.0, 1.0])  # strictly longer than wait_s
    with pytest.raises(pydantic.ValidationError):
        ScaleUpPolicy(wait_s=1.0, steps=0)


def test_auto_first_weights_follow_what_was_cheaper_in_this_job():
    """fleet.first_weights=auto copies a live engine's weights (the join step's sync stays a
    delta) unless the job's full syncs were faster than its delta syncs (medians), as on a 2-core
    CPU host."""
    from vime.fleet.first_weights import copies_from_peer, delta_is_cheaper

    assert delta_is_cheaper({}) and delta_is_cheaper({"full": [2.0]})
    assert delta_is_cheaper({"full": [2.1, 9.0, 2.0], "delta": [0.4, 0.5]})
    assert not delta_is_cheaper({"full": [2.1], "delta": [4.0, 3.3, 5.7]})
    base = {"engine": {"model_path": "/m"}, "rollout": {"prompts_path": "p.jsonl"}}
    shm_delta = {"transport": {"kind": "shm", "delta": True}}
    assert copies_from_peer(TrainConfig(**base, weight_sync=shm_delta))
    assert not copies_from_peer(TrainConfig(**base, weight_sync={"transport": "shm"}))
    trainer_way = TrainConfig(**base, weight_sync=shm_delta, fleet={"first_weights": "trainer"})
    assert not copies_from_peer(trainer_way)
    with pytest.raises(pydantic.ValidationError, match="first_weights"):
        TrainConfig(**base, fleet={"first_weights": "peer"})
