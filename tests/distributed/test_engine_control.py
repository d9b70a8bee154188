"""VLLMEngine against real vLLM CPU servers: generation, pauses, cache flush, Ray actors, errors.

Two servers are launched by two Ray actors for the whole module; single-engine tests reach the first
one through a second, external-URL VLLMEngine (which must leave the server alone on shutdown).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
import requests
from engine_token import HEADERS, TOKEN

from vime.config import EngineConfig
from vime.engines.generate_api import SamplingConfig
from vime.engines.generation import GenerationClient
from vime.engines.server import EngineStartError
from vime.engines.vllm_engine import FlushCacheError, VLLMEngine
from vime.utils.http import EngineHTTPError

pytestmark = pytest.mark.distributed

MAX_MODEL_LEN = 1024
PROMPT = [11, 22, 33]
NUM_STREAMING = 8
# Requests long enough that none can finish between the client seeing its first token and a
# pause landing, even on a loaded machine where streamed tokens reach the client seconds late.
GATED_TOKENS = 800


@pytest.fixture(scope="module")
def small_model_dir(model_builder):
    # qwen2-small, not qwen2-tiny: with the tiny model the engine outruns the API server's
    # per-token work on 2 cores and a streaming client sees tokens seconds late.
    return model_builder("qwen2-small")


@pytest.fixture(scope="module")
def ray_engines(small_model_dir, tmp_path_factory):
    """Two engines, each a Ray actor that launched its own server."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = EngineConfig(
        model_path=str(small_model_dir),
        max_model_len=MAX_MODEL_LEN,
        num_engines=2,
        auth_token=TOKEN,
    )
    log_dir = str(tmp_path_factory.mktemp("engine-logs"))
    actor_cls = ray.remote(num_cpus=0)(VLLMEngine)
    actors = [actor_cls.remote(config, rank=rank, log_dir=log_dir) for rank in range(2)]
    try:
        urls = ray.get([actor.init.remote() for actor in actors], timeout=900)
        asyncio.run(warm_up(urls))
        yield actors, urls
    finally:
        ray.get([actor.shutdown.remote() for actor in actors], timeout=120)
        ray.shutdown()


async def warm_up(urls: list[str]) -> None:
    """Take each fresh engine's first batch here, so the streaming checks time a warm engine (it
    was seconds slower while vLLM compiled its sampler helpers; vime now runs them eagerly)."""
    async with GenerationClient(urls, token=TOKEN) as client:
        prompts = [PROMPT + [i] for i in range(NUM_STREAMING)]
        for engine_index in range(len(urls)):
            await asyncio.gather(
                *(
                    client.generate(
                        prompt, SamplingConfig(max_tokens=16), engine_index=engine_index
                    )
                    for prompt in prompts
                )
            )


@pytest.fixture(scope="module")
def engine(ray_engines, small_model_dir):
    """The first server, reached by URL from this process."""
    _, urls = ray_engines
    config = EngineConfig(model_path=str(small_model_dir), request_timeout_s=60, auth_token=TOKEN)
    local = VLLMEngine(config, url=urls[0])
    local.init()
    yield local
    local.shutdown()
    assert ray.get(ray_engines[0][0].health.remote()), "external shutdown must not stop the server"


# Long enough (~4 s for 8 requests here) that a pause sent as soon as every request has shown its
# first token lands mid-stream; tests prove "mid-stream" after the fact from the server's own
# per-token weight-version labels.
def streaming_sampling(max_tokens: int = 300) -> SamplingConfig:
    # No per-request seed: vLLM 0.32 CPU kills the engine ("CPU Generator does not use offset")
    # when a seeded request is preempted, as clear_cache=True pauses do.
    return SamplingConfig(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)


def metric_total(url: str, name: str) -> float:
    """The server's own counter `name` (Prometheus /metrics), summed over its labels."""
    text = requests.get(f"{url}/metrics", timeout=30, headers=HEADERS).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def server_generated_tokens(url: str) -> float:
    """The server's own count of generated tokens; use it while idle."""
    return metric_total(url, "vllm:generation_tokens_total")


def version_runs(versions: list[str | None]) -> list[tuple[str | None, int]]:
    """[(version, count), ...] for consecutive equal versions."""
    runs: list[tuple[str | None, int]] = []
    for version in versions:
        if runs and runs[-1][0] == version:
            runs[-1] = (version, runs[-1][1] + 1)
        else:
            runs.append((version, 1))
    return runs


class FirstTokens:
    """Streaming callback: which requests the client has seen at least one token of."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, result) -> None:
        if result.token_ids:
            self.seen.add(result.request_id)

    async def wait(self, num_requests: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.seen) < num_requests:
            assert time.monotonic() < deadline, "requests produced no tokens"
            await asyncio.sleep(0.001)


def _ignore_progress(result) -> None:
    pass


def start_streams(client, num_requests=NUM_STREAMING, sampling=None, on_tokens=_ignore_progress):
    """Send requests (streamed when on_tokens is given) and return their tasks."""
    sampling = sampling or streaming_sampling()
    return [
        asyncio.create_task(client.generate(PROMPT + [i], sampling, on_tokens=on_tokens))
        for i in range(num_requests)
    ]


def test_generate_returns_ids_logprobs_and_versions(engine):
    greedy = SamplingConfig(max_tokens=12, temperature=0.0)

    async def run():
        async with GenerationClient([engine.url], token=TOKEN) as client:
            plain = await client.generate(PROMPT, greedy)
            streamed = await client.generate(PROMPT, greedy, on_tokens=lambda result: None)
        return plain, streamed

    result, streamed = asyncio.run(run())
    assert streamed.token_ids == result.token_ids
    assert streamed.weight_versions == result.weight_versions
    assert streamed.logprobs == pytest.approx(result.logprobs, abs=1e-5)
    assert len(result.token_ids) == 12
    assert len(result.logprobs) == 12 and all(lp <= 0.0 for lp in result.logprobs)
    assert result.weight_versions == [engine.get_weight_version()] * 12
    assert result.finish_reason == "length"


def test_keep_pause_freezes_and_resume_completes_everything(engine):
    sampling = streaming_sampling(max_tokens=GATED_TOKENS)
    url = engine.url
    old_version = engine.get_weight_version()

    async def run():
        first_tokens = FirstTokens()
        before = server_generated_tokens(url)
        async with GenerationClient([url], token=TOKEN) as client:
            tasks = start_streams(client, sampling=sampling, on_tokens=first_tokens)
            await first_tokens.wait(NUM_STREAMING)
            await asyncio.to_thread(engine.pause_generation, "keep", False)
            # Any token produced while paused would carry this label.
            engine.update_weight_version("paused-window")
            at_pause = server_generated_tokens(url)
            await asyncio.sleep(1.2)
            after_wait = server_generated_tokens(url)
            paused = engine.is_paused()
            engine.update_weight_version("after-resume")
            engine.continue_generation()
            results = await asyncio.gather(*tasks)
        return at_pause - before, at_pause, after_wait, paused, results

    made, at_pause, after_wait, paused, results = asyncio.run(run())
    assert paused is True
    assert after_wait == at_pause, "the server generated tokens while paused with keep"
    assert engine.is_paused() is False
    for result in results:
        assert len(result.token_ids) == sampling.max_tokens
        assert result.finish_reason == "length" and not result.aborted
        # Old-version tokens, then only new-version ones, none in between (the pause lands
        # mid-stream as a rule: every request had streamed a token when it was sent).
        runs = version_runs(result.weight_versions)
        assert [v for v, _ in runs] in ([old_version, "after-resume"], [old_version]), runs
    # Exactly the tokens made after the resume (the server's count at the pause) are new.
    resumed = sum(r.weight_versions.count("after-resume") for r in results)
    assert resumed == NUM_STREAMING * sampling.max_tokens - made > 0


def test_abort_pause_returns_partial_results_marked_aborted(engine):
    sampling = streaming_sampling(max_tokens=GATED_TOKENS)
    url = engine.url

    async def run():
        first_tokens = FirstTokens()
        before = server_generated_tokens(url)
        async with GenerationClient([url], token=TOKEN) as client:
            tasks = start_streams(client, sampling=sampling, on_tokens=first_tokens)
            await first_tokens.wait(NUM_STREAMING)
            # A keep pause freezes every request still running (as a rule all of them: the client
            # has seen each stream a token), then the abort pause aborts exactly those (vLLM's
            # abort finishes every request the scheduler holds).
            await asyncio.to_thread(engine.pause_generation, "keep", False)
            made = server_generated_tokens(url) - before
            await asyncio.to_thread(engine.pause_generation, "abort", True)
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
            engine.continue_generation()
        return made, results

    made, results = asyncio.run(run())
    aborted = [result for result in results if result.aborted]
    # Whatever had not finished at the pause is aborted with what it had; what had finished is
    # whole; every token the server made came back (the server's own count at the pause).
    assert all(len(r.token_ids) == sampling.max_tokens for r in results if not r.aborted)
    assert all(len(result.token_ids) < sampling.max_tokens for result in aborted)
    assert sum(len(result.token_ids) for result in results) == made
    assert bool(aborted) == (made < NUM_STREAMING * sampling.max_tokens), made
    assert all(len(result.logprobs) == len(result.token_ids) for result in results)


def test_wait_pause_returns_after_running_requests_finish(engine):
    sampling = streaming_sampling(max_tokens=60)
    url = engine.url

    async def run():
        base = server_generated_tokens(url)
        first_tokens = FirstTokens()
        async with GenerationClient([url], token=TOKEN) as client:
            tasks = start_streams(client, sampling=sampling, on_tokens=first_tokens)
            # Every request is running (it streamed a token) before the pause: all must finish.
            await first_tokens.wait(NUM_STREAMING)
            await asyncio.to_thread(engine.pause_generation, "wait", False)
            generated_at_return = server_generated_tokens(url) - base
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
            # A request sent while paused is queued, not run, until resume.
            before_late = server_generated_tokens(url)
            # ignore_eos: a sampled end-of-sequence token would end it short (1 in ~60 runs).
            late_sampling = SamplingConfig(max_tokens=8, ignore_eos=True)
            late = asyncio.create_task(client.generate(PROMPT, late_sampling))
            await asyncio.sleep(1.0)
            generated_while_paused = server_generated_tokens(url) - before_late
            engine.continue_generation()
            late_result = await asyncio.wait_for(late, timeout=60)
        return generated_at_return, results, generated_while_paused, late_result

    generated_at_return, results, generated_while_paused, late_result = asyncio.run(run())
    # Everything that was running had finished when the pause returned.
    assert generated_at_return == NUM_STREAMING * sampling.max_tokens
    for result in results:
        assert len(result.token_ids) == sampling.max_tokens and result.finish_reason == "length"
    assert generated_while_paused == 0
    assert len(late_result.token_ids) == 8


def test_flush_cache_after_keep_pause(engine):
    sampling = streaming_sampling(max_tokens=GATED_TOKENS)
    url = engine.url

    async def run(clear_cache: bool):
        first_tokens = FirstTokens()
        before = server_generated_tokens(url)
        async with GenerationClient([url], token=TOKEN) as client:
            tasks = start_streams(client, sampling=sampling, on_tokens=first_tokens)
            await first_tokens.wait(NUM_STREAMING)
            await asyncio.to_thread(engine.pause_generation, "keep", clear_cache)
            made = server_generated_tokens(url) - before
            # The check needs requests frozen mid-stream (the server's count says so): every
            # request had streamed a token when the pause was sent, so as a rule all are.
            assert made < NUM_STREAMING * sampling.max_tokens, "every request ended first"
            try:
                if clear_cache:
                    outcome = engine.flush_cache(timeout_s=10)
                else:
                    started = time.monotonic()
                    with pytest.raises(FlushCacheError, match="hold KV blocks"):
                        engine.flush_cache(timeout_s=0.5)
                    outcome = time.monotonic() - started
            finally:
                engine.update_weight_version(f"flushed-{clear_cache}")
                engine.continue_generation()
            results = await asyncio.gather(*tasks)
        assert all(r.weight_versions[0] != f"flushed-{clear_cache}" for r in results)
        flushed = sum(r.weight_versions.count(f"flushed-{clear_cache}") for r in results)
        assert flushed == NUM_STREAMING * sampling.max_tokens - made
        return outcome, results

    # clear_cache=True preempts the frozen requests: their blocks are free, the flush succeeds.
    flushed, results = asyncio.run(run(clear_cache=True))
    assert flushed is True
    assert all(len(r.token_ids) == sampling.max_tokens for r in results)
    # clear_cache=False: frozen requests keep their KV; the flush fails within its bound, no hang.
    waited_s, results = asyncio.run(run(clear_cache=False))
    assert waited_s < 15  # 0.5 s and the last call (slow on a loaded machine), never a hang
    assert all(len(r.token_ids) == sampling.max_tokens for r in results)
    # Idle engine: the flush succeeds at once.
    assert engine.flush_cache(timeout_s=5) is True


def test_two_ray_engines_pause_and_resume_concurrently(ray_engines):
    actors, urls = ray_engines
    sampling = streaming_sampling(max_tokens=GATED_TOKENS)

    def pause_all() -> list:
        return ray.get(
            [actor.pause_generation.remote("keep", False) for actor in actors], timeout=60
        )

    # Each engine gets NUM_STREAMING requests and is paused (keep) the moment the client has seen
    # all of them stream a token (so that, as a rule, the pause lands mid-stream); the concurrent
    # pause below then finds both paused. What is asserted does not depend on where the pause
    # landed: the servers' own token counts at the pause say how many tokens each engine made
    # before it, and exactly the rest must carry the label set while paused.
    seen: list[set[str]] = [set() for _ in urls]
    gates: list = [None for _ in urls]

    def on_tokens(result) -> None:
        index = urls.index(result.engine_url)
        if result.token_ids:
            seen[index].add(result.request_id)
        if len(seen[index]) == NUM_STREAMING and gates[index] is None:
            gates[index] = actors[index].pause_generation.remote("keep", False)

    async def run():
        before = [server_generated_tokens(url) for url in urls]
        async with GenerationClient(urls, token=TOKEN) as client:
            tasks = [
                asyncio.create_task(
                    client.generate(PROMPT + [i], sampling, engine_index=index, on_tokens=on_tokens)
                )
                for index in range(len(urls))
                for i in range(NUM_STREAMING)
            ]
            deadline = time.monotonic() + 120
            while any(gate is None for gate in gates):
                assert time.monotonic() < deadline, f"requests produced no tokens: {seen}"
                await asyncio.sleep(0.001)
            await asyncio.to_thread(ray.get, gates, timeout=60)
            await asyncio.to_thread(pause_all)
            at_pause = [server_generated_tokens(url) for url in urls]
            paused = ray.get([actor.is_paused.remote() for actor in actors], timeout=60)
            await asyncio.sleep(1.0)
            after_wait = [server_generated_tokens(url) for url in urls]
            ray.get(
                [actor.update_weight_version.remote("v-resumed") for actor in actors], timeout=60
            )
            await asyncio.to_thread(
                ray.get, [actor.continue_generation.remote() for actor in actors], timeout=60
            )
            results = await asyncio.gather(*tasks)
        return before, paused, at_pause, after_wait, results

    before, paused, at_pause, after_wait, results = asyncio.run(run())
    assert paused == [True, True]
    assert after_wait == at_pause
    assert [urls.index(r.engine_url) for r in results] == [
        index for index in range(len(urls)) for _ in range(NUM_STREAMING)
    ]
    assert all(len(r.token_ids) == sampling.max_tokens and not r.aborted for r in results)
    for index in range(len(urls)):
        mine = [r for r in results if urls.index(r.engine_url) == index]
        made_before = at_pause[index] - before[index]
        resumed = sum(r.weight_versions.count("v-resumed") for r in mine)
        # Every token made after the resume, and no other, carries the new label; each request
        # holds one run of the old label (if it had started) followed by one of the new.
        assert resumed == NUM_STREAMING * sampling.max_tokens - made_before, (index, made_before)
        for result in mine:
            runs = version_runs(result.weight_versions)
            assert len(runs) <= 2 and all(v != "v-resumed" for v, _ in runs[:-1]), runs


def test_bad_request_error_carries_response_body(engine):
    with pytest.raises(EngineHTTPError) as info:
        engine.collective_rpc("vime_no_such_method")
    assert info.value.status is not None and info.value.status >= 400
    assert info.value.body, "the error must carry the response body"
    assert engine.url in str(info.value)


def test_unreachable_url_fails_within_timeout_naming_it(tiny_model_dir, unused_port):
    url = f"http://127.0.0.1:{unused_port}"
    config = EngineConfig(model_path=str(tiny_model_dir), external_check_timeout_s=2)
    started = time.monotonic()
    with pytest.raises(EngineStartError, match=url):
        VLLMEngine(config, url=url).init()
    assert time.monotonic() - started < 2 + 3


def test_server_that_dies_at_start_reports_its_log_tail(tmp_path):
    missing = tmp_path / "no-such-model"
    config = EngineConfig(model_path=str(missing), startup_timeout_s=300)
    engine = VLLMEngine(config, log_dir=str(tmp_path))
    with pytest.raises(EngineStartError) as info:
        engine.init()
    message = str(info.value)
    assert "exited with code" in message
    assert "Log tail" in message and "no-such-model" in message.split("Log tail", 1)[1]


def _prefix_cache_hits(url: str) -> float:
    return metric_total(url, "vllm:prefix_cache_hits_total")


def test_keep_pause_with_clear_cache_empties_the_prefix_cache(engine):
    """What lets a sync with clear_cache skip its /reset_prefix_cache round trip: in vLLM 0.32 the
    pause itself resets the prefix cache. Without clear_cache the cache survives the pause."""
    prompt = [(7 * i) % 500 + 1 for i in range(300)]  # several KV blocks of a fresh prefix

    def complete() -> None:
        body = {"model": str(engine.config.model_path), "prompt": prompt, "max_tokens": 1}
        response = requests.post(
            f"{engine.url}/v1/completions", json=body, timeout=60, headers=HEADERS
        )
        response.raise_for_status()

    for clear_cache in (False, True):
        prompt[0] += 1  # a prefix not cached yet
        complete()
        cached = _prefix_cache_hits(engine.url)
        complete()
        assert _prefix_cache_hits(engine.url) > cached, "the prefix was not cached"
        engine.pause_generation("keep", clear_cache=clear_cache)
        engine.continue_generation()
        before = _prefix_cache_hits(engine.url)
        complete()
        reused = _prefix_cache_hits(engine.url) > before
        assert reused is not clear_cache, f"clear_cache={clear_cache}: prefix reused={reused}"
