"""Engine liveness: a dead engine is named within seconds, a stalled one within a progress timeout.

A long call (a generation, an /update_weights bucket, a gloo broadcast to the engine's workers)
cannot tell "slow" from "dead" by itself. The watchdog probes every engine on its own thread,
every `interval_s`, whatever the job is doing:
- GET /health: refused, reset or 5xx means the engine is dead (vLLM answers 503 once it has seen
  its EngineCore die, ~4 s after the fact);
- GET /is_paused: a round trip through the EngineCore's busy loop (a utility call, answered
  between two steps, paused or not). No answer within `progress_timeout_s` means the EngineCore
  (or the api_server) makes no progress: stalled (e.g. SIGSTOPped, or wedged in a kernel).

The first failure goes to `on_failure` once, as an EngineFailedError naming the engine and URL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

import requests

from vime.engines.auth import auth_headers

logger = logging.getLogger(__name__)


class EngineFailedError(RuntimeError):
    """An engine died or stalled. Picklable: every field has a default (Ray rebuilds exceptions
    from their args, then restores their fields)."""

    def __init__(
        self,
        message: str,
        *,
        engine_index: int = -1,
        url: str = "",
        kind: str = "dead",
        detected_after_s: float = 0.0,
    ):
        super().__init__(message)
        self.engine_index = engine_index
        self.url = url
        self.kind = kind  # "dead" or "stalled"
        self.detected_after_s = detected_after_s


def check_health(url: str, headers: dict[str, str], timeout_s: float) -> tuple[str, str] | None:
    """("dead", why) if GET /health is refused, reset or answers 5xx; None otherwise (a /health
    that times out decides nothing: the progress probe does)."""
    try:
        response = requests.get(f"{url}/health", headers=headers, timeout=timeout_s)
    except requests.Timeout:
        return None
    except requests.RequestException as exc:
        return "dead", f"GET /health: {type(exc).__name__}: {exc}"
    if response.status_code >= 500:
        return "dead", f"GET /health -> HTTP {response.status_code}: {response.text[:200]}"
    return None


def probe(
    url: str,
    headers: dict[str, str],
    *,
    health_timeout_s: float,
    progress_timeout_s: float,
    interval_s: float = 2.0,
) -> tuple[str, str] | None:
    """None if the engine at `url` is alive and its EngineCore answers GET /is_paused within
    progress_timeout_s; else (kind, detail). /health is checked every interval_s meanwhile: an
    EngineCore that dies during the probe leaves /is_paused unanswered (vLLM does not fail a
    utility call in flight), while /health says "dead" at once."""
    began = time.monotonic()
    progress = _in_daemon_thread(
        requests.get, f"{url}/is_paused", headers=headers, timeout=progress_timeout_s
    )
    while True:
        found = check_health(url, headers, health_timeout_s)
        if found is not None:
            return found
        try:
            response = progress.result(timeout=interval_s)
        except FutureTimeoutError:
            if time.monotonic() - began < progress_timeout_s:
                continue
            return "stalled", f"GET /is_paused not answered within {progress_timeout_s:g} s"
        except requests.Timeout:
            return "stalled", f"GET /is_paused not answered within {progress_timeout_s:g} s"
        except requests.RequestException as exc:
            return "dead", f"GET /is_paused: {type(exc).__name__}: {exc}"
        if response.status_code >= 500:
            return (
                "dead",
                f"GET /is_paused -> HTTP {response.status_code}: {response.text[:200]}",
            )
        return None


def _in_daemon_thread(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
    """`function(*args, **kwargs)` on a daemon thread: a probe abandoned mid-call (its engine was
    found dead) never holds up the interpreter's exit, as a ThreadPoolExecutor's worker would."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(function(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 (handed to the waiter)
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True, name="vime-probe").start()
    return future


class EngineWatchdog:
    """One daemon thread per engine, probing until `stop()`; reports the first failure."""

    def __init__(
        self,
        urls: Sequence[str],
        on_failure: Callable[[EngineFailedError], None],
        *,
        token: str | None = None,
        interval_s: float = 2.0,
        progress_timeout_s: float = 60.0,
        health_timeout_s: float = 5.0,
    ):
        self.urls = [url.rstrip("/") for url in urls]
        self._on_failure = on_failure
        self._headers = auth_headers(token)
        self._interval_s = interval_s
        self._progress_timeout_s = progress_timeout_s
        self._health_timeout_s = health_timeout_s
        self._stop = threading.Event()
        self._unwatched: set[int] = set()  # engines that left the fleet
        self.failure: EngineFailedError | None = None  # the first one

    def start(self) -> EngineWatchdog:
        for index in range(len(self.urls)):
            self.watch(index)
        return self

    def watch(self, index: int) -> None:
        """(Re)start probing engine `index`: each engine's watch ends at its first failure."""
        threading.Thread(
            target=self._watch, args=(index,), daemon=True, name=f"vime-watch-{index}"
        ).start()

    def add(self, url: str) -> int:
        """A new engine (its index, as the generation client's); call `watch` once it serves."""
        self.urls.append(url.rstrip("/"))
        return len(self.urls) - 1

    def unwatch(self, index: int) -> None:
        """Engine `index` leaves on purpose: its end is not a failure."""
        self._unwatched.add(index)

    def stop(self) -> None:
        self._stop.set()

    def _watch(self, index: int) -> None:
        url = self.urls[index]
        last_ok = time.monotonic()
        while not self._stop.wait(self._interval_s):
            found = probe(
                url,
                self._headers,
                health_timeout_s=self._health_timeout_s,
                progress_timeout_s=self._progress_timeout_s,
                interval_s=self._interval_s,
            )
            if self._stop.is_set() or index in self._unwatched:
                return
            if found is None:
                last_ok = time.monotonic()
                continue
            kind, detail = found
            since = time.monotonic() - last_ok
            failure = EngineFailedError(
                f"engine {index} at {url} is {kind}: {detail} (last healthy answer {since:.1f} s "
                "before this)",
                engine_index=index,
                url=url,
                kind=kind,
                detected_after_s=since,
            )
            self.failure = self.failure or failure
            logger.error("%s", failure)
            self._on_failure(failure)
            return
