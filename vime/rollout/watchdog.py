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

import requests

from vime.rollout.auth import auth_headers

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


def probe(
    url: str, headers: dict[str, str], *, health_timeout_s: float, progress_timeout_s: float
) -> tuple[str, str] | None:
    """None if the engine at `url` is alive and its EngineCore answers; else (kind, detail)."""
    try:
        response = requests.get(f"{url}/health", headers=headers, timeout=health_timeout_s)
    except requests.Timeout:
        response = None  # the api_server is busy or hung: the progress probe below decides
    except requests.RequestException as exc:
        return "dead", f"GET /health: {type(exc).__name__}: {exc}"
    if response is not None and response.status_code >= 500:
        return "dead", f"GET /health -> HTTP {response.status_code}: {response.text[:200]}"
    try:
        response = requests.get(f"{url}/is_paused", headers=headers, timeout=progress_timeout_s)
    except requests.Timeout:
        return "stalled", f"GET /is_paused not answered within {progress_timeout_s:g} s"
    except requests.RequestException as exc:
        return "dead", f"GET /is_paused: {type(exc).__name__}: {exc}"
    if response.status_code >= 500:
        return "dead", f"GET /is_paused -> HTTP {response.status_code}: {response.text[:200]}"
    return None


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
            )
            if self._stop.is_set():
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
