"""Token-in/token-out generation over several vLLM engines: ids, log-probs and weight versions.

Uses vLLM's `/inference/v1/generate` (servers launched with `--enable-scale-out`), streamed, so a
caller can watch progress per request; the final chunk carries the weight-version spans, which are
expanded here into one version per generated token.

    client = GenerationClient(["http://127.0.0.1:8000"])
    result = await client.generate([1, 2, 3], SamplingConfig(max_tokens=16))
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from vime.engines.auth import auth_headers
from vime.engines.generate_api import (
    GenerationError,
    GenerationResult,
    SamplingConfig,
    add_choices,
    cached_tokens,
    expand_weight_versions,
)

logger = logging.getLogger(__name__)

# How long a change of the engine sets from another thread waits for the client's loop to run it.
_LOOP_CALL_TIMEOUT_S = 30.0

MAX_RESUBMISSIONS = 8  # a request lost with its engine is resubmitted at most this often


class GenerationClient:
    """Async client spreading requests over engines (least requests in flight first).

    Requests that share an `affinity` key (a GRPO group: one prompt, several samples) go to the
    same engine, picked least-loaded when the key is first seen, so the prompt's KV is computed
    once and reused from that engine's prefix cache; the key keeps its engine (for retries too)
    until `release(key)`, or until that engine goes down or drains (the key then moves, least-
    loaded again).
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        token: str | None = None,
        timeout_s: float = 1800.0,
        connect_timeout_s: float = 10.0,
        fault_tolerant: bool = False,
        failure_wait_s: float = 30.0,
    ):
        """`token`: the engines' token (vime.engines.auth), sent with every request."""
        if not urls:
            raise ValueError("GenerationClient needs at least one engine URL")
        self.urls = [url.rstrip("/") for url in urls]
        self._in_flight = {url: 0 for url in self.urls}
        # total covers pauses for weight sync too: a keep-paused request is silent, not dead.
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._headers = auth_headers(token)
        # Fault tolerance (engine.fault_tolerance): a request whose engine fails is resubmitted if
        # the job's watchdog marks that engine down within failure_wait_s of the failure.
        self.fault_tolerant = fault_tolerant
        self.failure_wait_s = failure_wait_s
        self.num_resubmitted = 0
        self._down: set[str] = set()
        # Engines leaving the fleet (`drain`): no new request goes to them, those in flight finish.
        self._draining: set[str] = set()
        self._num_engines = len(self.urls)  # including those add_engine has scheduled
        self._tasks: dict[str, set[asyncio.Task]] = {url: set() for url in self.urls}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._affinity: dict[str, str] = {}  # key -> its engine's url
        # Seconds each engine had at least one request in flight (see `occupied_seconds`).
        self._occupied_s: dict[str, float] = {url: 0.0 for url in self.urls}
        self._occupied_since: dict[str, float] = {}

    async def __aenter__(self) -> GenerationClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # Close idle connections before uvicorn does (its keep-alive timeout is 5 s), so a
            # request is never sent on a connection the server is dropping.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=connector, headers=self._headers
            )
        return self._session

    def in_flight(self) -> dict[str, int]:
        return dict(self._in_flight)

    def _pick_engine(self, engine_index: int | None) -> str:
        if engine_index is not None:
            if not 0 <= engine_index < len(self.urls):
                raise ValueError(
                    f"engine_index {engine_index} out of range 0..{len(self.urls) - 1}"
                )
            return self.urls[engine_index]
        return min(self.urls, key=lambda url: self._in_flight[url])

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingConfig,
        *,
        engine_index: int | None = None,
        on_tokens: Callable[[GenerationResult], None] | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        affinity: str | None = None,
    ) -> GenerationResult:
        """Generate one completion; `on_tokens(result)` is called after each streamed chunk.

        `cache_salt`: vLLM's prefix-cache salt; requests with different salts never share KV
        blocks (the RL job salts each request with the weight version the engines serve).
        `affinity`: requests with the same key share an engine (see the class); `engine_index`
        pins one engine instead.

        With fault tolerance, a request lost with its engine (the engine is marked down, see
        `mark_down`) is submitted again, from scratch, once an engine is back.
        """
        request_id = request_id or f"vime-{uuid.uuid4().hex[:16]}"
        for attempt in range(MAX_RESUBMISSIONS + 1):
            url = await self._wait_for_engine(engine_index, affinity)
            result = GenerationResult(
                request_id=request_id if attempt == 0 else f"{request_id}-r{attempt}",
                engine_url=url,
                prompt_token_ids=list(prompt_token_ids),
                start_time=time.time(),
            )
            payload = {
                "request_id": result.request_id,
                "token_ids": result.prompt_token_ids,
                "sampling_params": sampling.to_request(),
                # Streaming costs the client a JSON chunk per token: only when progress is watched.
                "stream": on_tokens is not None,
            }
            if cache_salt is not None:
                payload["cache_salt"] = cache_salt
            if await self._attempt(url, payload, result, on_tokens):
                result.end_time = time.time()
                return result
            self.num_resubmitted += 1
        raise GenerationError(f"request {request_id} lost {MAX_RESUBMISSIONS + 1} times")

    async def _attempt(self, url, payload, result, on_tokens) -> bool:
        """True when the request completed; False when it was lost with its engine."""
        task = asyncio.ensure_future(self._stream(url, payload, result, on_tokens))
        self._tasks[url].add(task)
        self._in_flight[url] += 1
        if self._in_flight[url] == 1:
            self._occupied_since[url] = time.monotonic()
        try:
            await task
            return True
        except asyncio.CancelledError:
            # Cancelled by mark_down (the engine is gone), or is this caller being cancelled?
            current = asyncio.current_task()
            if (current is not None and current.cancelling()) or url not in self._down:
                raise
            return False
        except GenerationError:
            if not self.fault_tolerant or not await self._goes_down(url):
                raise
            return False
        finally:
            self._in_flight[url] -= 1
            self._tasks[url].discard(task)
            if self._in_flight[url] == 0:
                since = self._occupied_since.pop(url)
                self._occupied_s[url] += time.monotonic() - since

    # ---- fault tolerance: engines marked down and up by the job's watchdog ---------------------

    def mark_down(self, index: int) -> None:
        """Engine `index` is dead or stalled (any thread): its requests in flight are cancelled and
        resubmitted once an engine is up; nothing new goes to it until `mark_up`."""
        self._call_in_loop(lambda: self._set_down(self.urls[index], True))

    def mark_up(self, index: int) -> None:
        """Engine `index` serves the trainer's weights again (any thread)."""
        self._call_in_loop(lambda: self._set_down(self.urls[index], False))

    # ---- an elastic fleet: engines join and leave while the job runs ---------------------------

    def add_engine(self, url: str) -> int:
        """A new engine, marked down until `mark_up` (it must first hold the trainer's weights);
        its index. From the thread that owns the fleet (the change happens on the client's loop,
        as every other change of its engines)."""
        url = url.rstrip("/")
        if url in self.urls:
            raise ValueError(f"engine {url} is already engine {self.urls.index(url)}")
        index, self._num_engines = self._num_engines, self._num_engines + 1
        self._call_in_loop(self._add_engine, url)
        return index

    def _add_engine(self, url: str) -> None:
        self._in_flight[url] = 0
        self._occupied_s[url] = 0.0
        self._tasks[url] = set()
        self._down.add(url)
        self.urls.append(url)

    def drain(self, index: int) -> None:
        """Engine `index` leaves: no new request goes to it; those in flight finish there (any
        thread). Its index stays (engine indices are never reused)."""
        self._call_in_loop(lambda: self._set_draining(self.urls[index]))

    def occupied_seconds(self) -> float:
        """Seconds summed over the engines during which each had at least one request in flight
        (generating, or held by a keep pause), up to now."""
        # list(): one C call, so a snapshot even while the client's loop (another thread) runs.
        since, done = list(self._occupied_since.values()), list(self._occupied_s.values())
        now = time.monotonic()
        return sum(done) + sum(now - t for t in since)

    def num_in_flight(self, index: int) -> int:
        return self._in_flight[self.urls[index]]

    def serving(self) -> list[int]:
        """Indices of the engines that take new requests now."""
        return [i for i, url in enumerate(self.urls) if url not in self._down | self._draining]

    def _set_draining(self, url: str) -> None:
        self._draining.add(url)
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    def _call_in_loop(self, function: Callable[..., None], *args: Any) -> None:
        """Run a change of the engine sets where the client's requests see it: on its event loop.
        From another thread this returns once the loop has made the change (a caller that reads
        `serving()` right after sees it). A loop busy for `_LOOP_CALL_TIMEOUT_S` (a slow reward
        function runs on it) gets a warning; the change stays queued and lands when it frees."""
        loop = self._loop
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        # No loop yet (nothing generated), the loop's own thread, or a loop no longer running
        # (the client is closed): no other thread can read or change the sets concurrently.
        if loop is None or here is loop or loop.is_closed() or not loop.is_running():
            function(*args)
            return
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        claim = threading.Lock()  # whoever takes it makes the change: exactly once

        def run() -> None:
            if not claim.acquire(blocking=False):
                return
            try:
                function(*args)
                done.set_result(None)
            except BaseException as error:  # the caller's thread raises it
                done.set_exception(error)

        loop.call_soon_threadsafe(run)
        try:
            done.result(timeout=_LOOP_CALL_TIMEOUT_S)
            return
        except concurrent.futures.TimeoutError:
            pass
        if (loop.is_closed() or not loop.is_running()) and claim.acquire(blocking=False):
            function(*args)  # the loop stopped before it ran the change: nothing runs there now
            return
        logger.warning(
            "the generation client's event loop did not run an engine-set change within %.0f s "
            "(is something blocking that loop's thread?); it lands when the loop frees up",
            _LOOP_CALL_TIMEOUT_S,
        )

    def _set_down(self, url: str, down: bool) -> None:
        if down:
            self._down.add(url)
            for task in list(self._tasks[url]):
                task.cancel()
        else:
            self._down.discard(url)
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    def release(self, affinity: str) -> None:
        """The requests of `affinity` are done: its next request picks an engine afresh."""
        self._affinity.pop(affinity, None)

    async def _wait_for_engine(self, engine_index: int | None, affinity: str | None = None) -> str:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._changed = asyncio.Event()
        while True:
            if engine_index is not None:
                url = self._pick_engine(engine_index)
                if url not in self._down and url not in self._draining:
                    return url
            else:
                up = [url for url in self.urls if url not in self._down | self._draining]
                if affinity is not None and self._affinity.get(affinity) in up:
                    return self._affinity[affinity]
                if up:
                    url = min(up, key=lambda url: self._in_flight[url])
                    if affinity is not None:
                        self._affinity[affinity] = url
                    return url
            assert self._changed is not None  # made with the loop above
            await self._changed.wait()

    async def _goes_down(self, url: str) -> bool:
        """After a failed request: is its engine marked down within failure_wait_s?"""
        deadline = time.monotonic() + self.failure_wait_s
        while url not in self._down:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._changed is None:  # no engine was waited for yet: nothing can change it
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=left)
            except TimeoutError:
                return False
        return True

    async def _stream(
        self,
        url: str,
        payload: dict[str, Any],
        result: GenerationResult,
        on_tokens: Callable[[GenerationResult], None] | None,
    ) -> None:
        # Errors name the engine by index and URL (the index is what the job's logs use).
        endpoint = f"engine {self.urls.index(url)} at {url}/inference/v1/generate"
        try:
            post = self._get_session().post(f"{url}/inference/v1/generate", json=payload)
            async with post as response:
                if response.status >= 400:
                    body = (await response.text())[:2000]
                    raise GenerationError(f"POST {endpoint} -> HTTP {response.status}: {body}")
                if not payload["stream"]:
                    body = await response.json()
                    add_choices(result, body["choices"])
                    result.num_cached_tokens = cached_tokens(body)
                    return self._finish(endpoint, result)
                async for raw_line in response.content:
                    line = raw_line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise GenerationError(f"POST {endpoint}: stream error {chunk['error']}")
                    add_choices(result, chunk["choices"])
                    result.chunk_times.append(time.monotonic())
                    result.chunk_ends.append(len(result.token_ids))
                    result.num_cached_tokens = cached_tokens(chunk, result.num_cached_tokens)
                    if on_tokens is not None:
                        on_tokens(result)
        except aiohttp.ClientError as exc:
            raise GenerationError(f"POST {endpoint}: {type(exc).__name__}: {exc}") from exc
        except TimeoutError as exc:
            raise GenerationError(
                f"POST {endpoint}: no completion within {self._timeout.total:g} s"
            ) from exc
        self._finish(endpoint, result)

    @staticmethod
    def _finish(endpoint: str, result: GenerationResult) -> None:
        if len(result.logprobs) != len(result.token_ids):
            raise GenerationError(
                f"{endpoint}: {len(result.token_ids)} tokens but {len(result.logprobs)} log-probs "
                f"for request {result.request_id}"
            )
        result.weight_versions = expand_weight_versions(result.version_spans, len(result.token_ids))
