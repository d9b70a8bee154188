"""Launch a vLLM OpenAI server as a subprocess and wait until it is healthy.

The server (its command line: `vime.engines.server_command`) runs under a keeper in a new process
group, so that stopping it ends the server and every worker it spawned, and nothing else.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from vime.config import EngineConfig
from vime.engines import auth
from vime.engines.server_command import EngineNodeRole, build_server_command
from vime.utils.keeper import KeptProcess, spawn_kept
from vime.utils.net import free_port
from vime.utils.preemption import read_notice
from vime.utils.process_group import end_group

logger = logging.getLogger(__name__)

LOG_TAIL_CHARS = 4000
# Launches tried when the port this chose was bound by another process before vLLM bound it.
PORT_TRIES = 3


class EngineStartError(RuntimeError):
    """A launched server exited or never became healthy; the message carries its log tail."""


def read_log_tail(log_path: Path, num_chars: int = LOG_TAIL_CHARS) -> str:
    try:
        data = log_path.read_bytes()
    except FileNotFoundError:
        return "(no log written)"
    return data[-num_chars:].decode(errors="replace")


@dataclass
class ServerProcess:
    """A server this process started under a keeper (vime.utils.keeper); `stop` ends its whole
    process group. The keeper leads the group, so the group id is the keeper's pid."""

    process: KeptProcess | subprocess.Popen  # the keeper
    url: str
    log_path: Path
    token: str | None = None

    @property
    def pid(self) -> int:
        """The keeper's pid, which is also the process group's id."""
        return self.process.pid

    def server_pid(self) -> int | None:
        """Pid of the vLLM server process (the keeper's child), None once it is gone."""
        try:
            with open(f"/proc/{self.pid}/task/{self.pid}/children") as children:
                pids = [int(pid) for pid in children.read().split()]
        except OSError:
            return None
        return pids[0] if pids else None

    def preemption_notice(self) -> dict[str, float] | None:
        """{"age_s", "left_s"} of the keeper's preemption notice (vime.utils.preemption)."""
        return read_notice(getattr(self.process, "temp_dir", None))

    def stop(self, grace_s: float = 15.0) -> None:
        """End the server's whole process group, whatever the leader's state.

        SIGINT to the keeper (SIGTERM may be a preemption notice, see vime.utils.keeper), which
        ends the group and unlinks the segments its processes mapped; if the keeper is gone or
        does not finish in time, the group is ended from here.
        """
        try:
            self.process.send_signal(signal.SIGINT)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout=grace_s + 10)
        except subprocess.TimeoutExpired:
            pass
        try:
            end_group(self.pid, grace_s=0.5, reap=self.process.poll)
            self.process.wait(timeout=grace_s)
        finally:
            temp_dir = getattr(self.process, "temp_dir", None)
            if temp_dir:  # normally gone with the keeper; not if the keeper was SIGKILLed
                shutil.rmtree(temp_dir, ignore_errors=True)


def launch_server(
    config: EngineConfig,
    *,
    host: str,
    port: int | None,
    log_path: Path,
    rank: int = 0,
    node: EngineNodeRole | None = None,
    token: str | None = None,
) -> ServerProcess:
    """Start engine `rank`'s server on `host`; return once /health answers 200, else
    EngineStartError. A headless node of a multi-node engine serves no HTTP: it returns once
    started, and node 0's health says when the whole engine is up. A port this chooses (port
    None) that another process binds before vLLM does is chosen again, up to PORT_TRIES times."""
    tries = 1 if port is not None else PORT_TRIES
    for attempt in range(1, tries + 1):
        log_start = log_path.stat().st_size if log_path.exists() else 0
        try:
            return _launch_once(config, host, port or free_port(host), log_path, rank, node, token)
        except EngineStartError:
            if attempt == tries or not _lost_port_race(log_path, log_start):
                raise
            logger.warning("engine %d: its port was taken before vLLM bound it; another", rank)
    raise AssertionError("unreachable")


def _lost_port_race(log_path: Path, since: int) -> bool:
    """The launch whose log starts at byte `since` failed to bind its HTTP port."""
    try:
        with open(log_path, "rb") as log:
            log.seek(since)
            return b"Address already in use" in log.read()
    except FileNotFoundError:
        return False


def _launch_once(
    config: EngineConfig,
    host: str,
    port: int,
    log_path: Path,
    rank: int,
    node: EngineNodeRole | None,
    token: str | None,
) -> ServerProcess:
    cmd, env = build_server_command(config, port, rank, host, node, token)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        process = spawn_kept(
            cmd, env=env, log_file=log_file, preempt_grace_s=config.preemption_drain_s
        )
    server = ServerProcess(
        process=process, url=f"http://{host}:{port}", log_path=log_path, token=token
    )
    logger.info("launched vLLM (keeper pid %d) at %s (log %s)", process.pid, server.url, log_path)
    if node is not None and node.headless:
        return server
    try:
        wait_until_healthy(
            server.url,
            timeout_s=config.startup_timeout_s,
            process=process,
            log_path=log_path,
            token=token,
        )
    except BaseException:
        server.stop()
        raise
    return server


def check_vllm_server(url: str, *, timeout_s: float, token: str | None = None) -> None:
    """An external URL must answer as a vLLM server with the RL routes (dev mode) within
    timeout_s; else EngineStartError saying what answered instead."""
    deadline = time.monotonic() + timeout_s
    headers = auth.auth_headers(token)

    def get(route: str) -> requests.Response:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise EngineStartError(f"{url} did not answer as a vLLM server within {timeout_s:g} s")
        try:
            return requests.get(f"{url}{route}", headers=headers, timeout=min(5.0, remaining))
        except requests.RequestException as exc:
            raise EngineStartError(
                f"{url}: GET {route} failed ({type(exc).__name__}: {exc}); is a vLLM server "
                "running there?"
            ) from exc

    wait_until_healthy(url, timeout_s=timeout_s, token=token)
    version = get("/version")
    try:
        is_vllm = version.status_code == 200 and "version" in version.json()
    except ValueError:
        is_vllm = False
    if not is_vllm:
        raise EngineStartError(
            f"{url} is not a vLLM server: GET /version -> HTTP {version.status_code} "
            f"{version.text[:200]!r}"
        )
    paused = get("/is_paused")
    if paused.status_code == 404:
        raise EngineStartError(
            f"{url} (vLLM {version.json()['version']}) has no RL control routes: start it with "
            "VLLM_SERVER_DEV_MODE=1"
        )
    if paused.status_code != 200:
        raise EngineStartError(
            f"{url}: GET /is_paused -> HTTP {paused.status_code} {paused.text[:200]!r}"
        )


PROGRESS_EVERY_S = 15.0  # how often a wait for /health says it still waits


def wait_until_healthy(
    url: str,
    *,
    timeout_s: float,
    process: subprocess.Popen | KeptProcess | None = None,
    log_path: Path | None = None,
    poll_s: float = 0.5,
    token: str | None = None,
) -> float:
    """Poll GET {url}/health until it answers 200; return the seconds waited.

    Raises EngineStartError if the process exits first or the deadline passes; the message holds
    the tail of the server log when there is one.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    next_note = start + PROGRESS_EVERY_S
    last_error = "no answer yet"
    while True:
        if process is not None and process.poll() is not None:
            tail = read_log_tail(log_path) if log_path else ""
            raise EngineStartError(
                f"vLLM server for {url} exited before it was "
                f"healthy. Log tail ({log_path}):\n{tail}"
            )
        try:
            response = requests.get(
                f"{url}/health", timeout=min(5.0, timeout_s), headers=auth.auth_headers(token)
            )
            if response.status_code == 200:
                return time.monotonic() - start
            if response.status_code == 401:
                raise EngineStartError(
                    f"{url}/health answered 401: the server wants a token that "
                    f"{'differs from engine.auth_token' if token else 'was not given'}; set "
                    "engine.auth_token to the token the server was started with"
                )
            last_error = f"HTTP {response.status_code}: {response.text[:200]}"
        except requests.RequestException as exc:
            last_error = str(exc)
        now = time.monotonic()
        if now >= deadline:
            tail = f" Log tail ({log_path}):\n{read_log_tail(log_path)}" if log_path else ""
            raise EngineStartError(
                f"vLLM server at {url} not healthy after {timeout_s:g} s ({last_error}).{tail}"
            )
        if now >= next_note:  # a start takes tens of seconds: say that it is under way
            logger.info(
                "waiting for the engine at %s: %.0f s of at most %.0f s (log: %s)",
                url,
                now - start,
                timeout_s,
                log_path,
            )
            next_note = now + PROGRESS_EVERY_S
        time.sleep(poll_s)
