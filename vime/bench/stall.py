"""The stall a weight sync causes, as a client streaming through it sees it.

A `StreamProbe` streams one long greedy request on its own thread and event loop. Started before
a sync and stopped once a token of the sync's version has arrived, its `stall_s()` is the gap
between the chunk with the last token of the old version and the chunk with the first token of
the new one: everything the sync held the stream for, one decode step and the stream's delay
included. NaN when the request ended before the sync paused it (too few tokens for the engine's
speed: raise `max_tokens`).
"""

from __future__ import annotations

import asyncio
import bisect
import math
import threading
import time

from vime.engines.generate_api import GenerationResult, SamplingConfig
from vime.engines.generation import GenerationClient

PROMPT_IDS = (11, 22, 33, 44, 55)


class StreamProbe:
    def __init__(self, url: str, token: str | None, max_tokens: int, version: str):
        """Stream a greedy request of `max_tokens` tokens from the engine at `url`, watching
        for the first token of weight version `version`."""
        self.version = version
        self.streaming = threading.Event()  # a token arrived
        self.switched = threading.Event()  # a token of `version` arrived, or the request ended
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.sync_began: float | None = None  # mark_sync's clock (time.monotonic)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Future | None = None
        sampling = SamplingConfig(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

        def on_tokens(result: GenerationResult) -> None:
            self.result = result
            if result.token_ids:
                self.streaming.set()
            spans = result.version_spans or []
            if spans and spans[-1].get("version") == self.version:
                self.switched.set()

        async def generate() -> None:
            self._loop = asyncio.get_running_loop()
            async with GenerationClient([url], token=token, timeout_s=600) as client:
                self._task = asyncio.ensure_future(
                    client.generate(list(PROMPT_IDS), sampling, on_tokens=on_tokens)
                )
                try:
                    self.result = await self._task
                except asyncio.CancelledError:
                    pass  # stopped once the switch was seen: self.result holds the stream so far

        def run() -> None:
            try:
                asyncio.run(generate())
            except BaseException as exc:  # noqa: BLE001 (handed to the caller by stall_s)
                self.error = exc
            finally:
                self.streaming.set()
                self.switched.set()

        self._thread = threading.Thread(target=run, name="vime-stream-probe", daemon=True)
        self._thread.start()

    def wait_streaming(self, timeout_s: float = 120, chunks: int = 8) -> None:
        """Until the stream has delivered `chunks` chunks (its pace before the sync, `step_gap_s`)
        or ended."""
        if not self.streaming.wait(timeout_s):
            raise TimeoutError(f"the probe request produced no token in {timeout_s:g} s")
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            result = self.result
            if result is not None and len(result.chunk_times) >= chunks:
                return
            time.sleep(0.005)

    def mark_sync(self) -> None:
        """The sync starts now: `longest_gap_s` looks at the stream from here on."""
        self.sync_began = time.monotonic()

    def longest_gap_s(self) -> float:
        """After `stall_s`: the longest gap between two chunks of the stream from `mark_sync` to
        the first chunk of the new version: the switch's gap, or a slower stretch while the
        engine loaded beside its served weights (NaN before the switch was seen)."""
        from vime.engines.generate_api import expand_weight_versions

        result = self.result
        if result is None or self.sync_began is None or not result.chunk_times:
            return math.nan
        versions = result.weight_versions or expand_weight_versions(
            result.version_spans, len(result.token_ids)
        )
        if self.version not in versions:
            return math.nan
        switched = bisect.bisect_left(result.chunk_ends, versions.index(self.version) + 1)
        times = result.chunk_times
        first = max(bisect.bisect_left(times, self.sync_began) - 1, 0)
        window = times[first : switched + 1]
        return max((b - a for a, b in zip(window, window[1:], strict=False)), default=math.nan)

    def step_gap_s(self) -> float:
        """The stream's own pace: the median gap between two chunks before `mark_sync` (about
        one decode step and the stream's delivery), against which the stall reads."""
        result = self.result
        if result is None or self.sync_began is None:
            return math.nan
        before = [t for t in result.chunk_times if t <= self.sync_began]
        gaps = sorted(b - a for a, b in zip(before, before[1:], strict=False))
        return gaps[len(gaps) // 2] if gaps else math.nan

    def stall_s(self, timeout_s: float = 120) -> float:
        """Once the sync is done: wait for a token of the new version, stop the request, and
        return the gap the switch shows (NaN if the request ended on the old version)."""
        if not self.switched.wait(timeout_s):
            raise TimeoutError(f"no token of weight version {self.version} in {timeout_s:g} s")
        loop, task = self._loop, self._task
        if loop is not None and task is not None and not task.done():
            loop.call_soon_threadsafe(task.cancel)
        self._thread.join(timeout_s)
        if self.error is not None:
            raise self.error
        gaps = self.result.switch_gaps() if self.result is not None else []
        return max(gaps) if gaps else math.nan
