"""VLLMEngine: one vLLM rollout engine and its HTTP control plane (pause, resume, weight sync).

Usable directly or as a Ray actor (`ray.remote(num_cpus=0)(VLLMEngine)`). It either launches a
server subprocess (and ends only that process group on `shutdown`) or connects to an external URL.

An engine spanning several nodes is controlled through its node 0, which serves HTTP (see
`vime.engines.server_command.EngineNodeRole`); give that node's URL.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from vime.cluster.addresses import node_address
from vime.config import EngineConfig
from vime.engines.auth import auth_headers, new_token
from vime.engines.server import ServerProcess, check_vllm_server, launch_server
from vime.utils.http import EngineHTTPError, request_json

PauseMode = Literal["keep", "wait", "abort"]

logger = logging.getLogger(__name__)


class FlushCacheError(RuntimeError):
    """The prefix cache could not be reset within the bound: requests still hold KV blocks."""


class VLLMEngine:
    """Control plane of one vLLM server, launched here or reached at `url`."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        rank: int = 0,
        url: str | None = None,
        port: int | None = None,
        log_dir: str | None = None,
        interface: str | None = None,
    ):
        """`interface`: a launched server binds to this interface's address on the node the
        engine runs on (else config.host, else the node address; see vime.cluster.addresses)."""
        self.config = config
        self.rank = rank
        self._external_url = url
        self._port = port
        self._interface = interface
        self._log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="vime-engine-"))
        self._server: ServerProcess | None = None
        self._url: str | None = None
        # A launched server always gets a token (the configured one, else a fresh one).
        self._token = config.auth_token if url is not None else config.auth_token or new_token()
        self.startup_s: float | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def init(self) -> str:
        """Launch the server (or check the external one) and return its base URL."""
        start = time.monotonic()
        if self._external_url is not None:
            url = self._external_url.rstrip("/")
            check_vllm_server(
                url, timeout_s=self.config.external_check_timeout_s, token=self._token
            )
            self._url = url
        else:
            log_path = self._log_dir / f"vllm-engine-{self.rank}.log"
            host = self.config.host or node_address(interface=self._interface)
            self._server = launch_server(
                self.config,
                host=host,
                port=self._launch_port(),
                log_path=log_path,
                rank=self.rank,
                token=self._token,
            )
            self._url = self._server.url
        self.startup_s = time.monotonic() - start
        logger.info("engine %d ready at %s in %.1f s", self.rank, self._url, self.startup_s)
        return self._url

    def _launch_port(self) -> int | None:
        if self._port is not None:
            return self._port
        if self.config.base_port is not None:
            return self.config.base_port + self.rank
        return None

    @property
    def url(self) -> str:
        if self._url is None and self._external_url is not None:
            return self._external_url.rstrip("/")
        if self._url is None:
            raise RuntimeError(f"engine {self.rank} has no URL yet: call init() first")
        return self._url

    @property
    def auth_token(self) -> str | None:
        """The token every route of this engine requires (None: an external engine without)."""
        return self._token

    def auth_headers(self) -> dict[str, str]:
        return auth_headers(self._token)

    def node_info(self) -> dict[str, str]:
        """Where this engine object runs: hostname, node address, Ray node id (if in Ray)."""
        info = {
            "hostname": socket.gethostname(),
            "address": node_address(interface=self._interface),
        }
        if "ray" in sys.modules:
            import ray

            if ray.is_initialized():
                info["ray_node_id"] = ray.get_runtime_context().get_node_id()
        if os.environ.get("SLURMD_NODENAME"):
            info["slurm_node"] = os.environ["SLURMD_NODENAME"]
        return info

    def server_pid(self) -> int | None:
        """Pid of the server this engine launched (None for an external one)."""
        return self._server.pid if self._server is not None else None

    def server_log_path(self) -> str | None:
        return str(self._server.log_path) if self._server is not None else None

    def restart(self) -> str:
        """End this engine's server, dead, stalled or alive, and launch it again on the same
        address (same URL, same token); return the URL once healthy. It serves the checkpoint's
        weights until the trainer syncs it (engine.fault_tolerance does, before it serves)."""
        if self._server is None:
            raise RuntimeError(
                f"engine {self.rank} at {self._url}: an external engine cannot be restarted by vime"
            )
        address = urlsplit(self._server.url)
        self._server.stop(grace_s=2.0)
        began = time.monotonic()
        self._server = launch_server(
            self.config,
            host=address.hostname or "127.0.0.1",
            port=address.port,
            log_path=self._server.log_path,
            rank=self.rank,
            token=self._token,
        )
        logger.info(
            "engine %d restarted at %s in %.1f s", self.rank, self._url, time.monotonic() - began
        )
        return self.url

    def shutdown(self) -> None:
        """End the server process group this engine started; an external server is left alone."""
        if self._server is not None:
            self._server.stop()
            self._server = None

    def preemption_notice(self) -> dict[str, float] | None:
        """A launched engine's preemption notice (engine.preemption_drain_s): {"age_s",
        "left_s"}, or None (none came, or the server is not this process's)."""
        return self._server.preemption_notice() if self._server is not None else None

    def health(self) -> bool:
        try:
            request_json("GET", f"{self.url}/health", timeout_s=5.0, headers=self.auth_headers())
        except EngineHTTPError:
            return False
        return True

    # ---- HTTP helper ---------------------------------------------------------------------

    def _call(
        self,
        method: str,
        endpoint: str,
        *,
        params: dict[str, Any] | None = None,
        json: Any = None,
        timeout_s: float | None = None,
    ) -> Any:
        """Every control call goes through here.

        A fresh connection per call, no pooled session: uvicorn drops idle keep-alive connections
        after 5 s, and a POST sent on such a connection fails with "connection reset" (seen in
        tests); retrying a POST like /pause is not safe, a new loopback connection costs ~0.1 ms.
        """
        try:
            return request_json(
                method,
                f"{self.url}/{endpoint.lstrip('/')}",
                params=params,
                json=json,
                timeout_s=timeout_s if timeout_s is not None else self.config.request_timeout_s,
                headers=self.auth_headers(),
            )
        except EngineHTTPError as exc:
            # Name the engine by its index too (the job's logs and metrics use it).
            raise EngineHTTPError(
                f"engine {self.rank} at {self.url}: {exc}",
                url=exc.url,
                status=exc.status,
                body=exc.body,
            ) from exc

    # ---- pause / resume --------------------------------------------------------------------

    def pause_generation(self, mode: PauseMode = "keep", clear_cache: bool = False) -> dict:
        """POST /pause. `keep` freezes every request (none lost); returns once the engine is idle.

        With clear_cache=True the engine preempts paused requests and frees their KV: they
        re-prefill on the new weights on resume. `wait` drains, `abort` drops what is in flight.
        """
        if mode not in ("keep", "wait", "abort"):
            raise ValueError(f"pause mode {mode!r} is not one of 'keep', 'wait', 'abort'")
        return self._call(
            "POST",
            "/pause",
            params={"mode": mode, "clear_cache": "true" if clear_cache else "false"},
        )

    def continue_generation(self) -> dict:
        """POST /resume: requests frozen by a keep pause continue generating."""
        return self._call("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self._call("GET", "/is_paused")["is_paused"])

    def flush_cache(
        self, timeout_s: float = 30.0, poll_s: float = 0.05, raise_on_timeout: bool = True
    ) -> bool:
        """POST /reset_prefix_cache until it succeeds; FlushCacheError after `timeout_s`.

        vLLM answers success=false while requests hold KV blocks (e.g. after a keep pause with
        clear_cache=false, the frozen requests keep theirs); the reset then cannot happen.
        With raise_on_timeout=False, False is returned instead of raising.
        """
        deadline = time.monotonic() + timeout_s
        attempts = 0
        while True:
            attempts += 1
            body = self._call(
                "POST", "/reset_prefix_cache", params={"reset_running_requests": "false"}
            )
            if body.get("success"):
                return True
            if time.monotonic() >= deadline:
                if not raise_on_timeout:
                    return False
                raise FlushCacheError(
                    f"engine {self.rank} at {self.url}: prefix cache not reset after {attempts} "
                    f"attempts in {timeout_s:g} s: requests still hold KV blocks. Pause with "
                    "clear_cache=true to free them, or wait for running requests to finish."
                )
            time.sleep(poll_s)

    # ---- weight-update lifecycle ---------------------------------------------------------

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> dict:
        """POST /init_weight_transfer_engine {"init_info": ...} (backend-specific fields)."""
        return self._call("POST", "/init_weight_transfer_engine", json={"init_info": init_info})

    def start_weight_update(self) -> dict:
        """POST /start_weight_update. A second start without finish is an error in vLLM."""
        return self._call("POST", "/start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> dict:
        """POST /update_weights {"update_info": one dict, or one per worker}."""
        return self._call("POST", "/update_weights", json={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | int | None = None) -> dict:
        """POST /finish_weight_update; tokens generated afterwards carry `weight_version`."""
        version = None if weight_version is None else str(weight_version)
        return self._call("POST", "/finish_weight_update", json={"weight_version": version})

    def get_weight_version(self) -> str:
        body = self._call("GET", "/weight_info")
        return body["weight_version"]

    def update_weight_version(self, weight_version: str | int) -> dict:
        return self._call(
            "POST", "/update_weight_version", json={"new_version": str(weight_version)}
        )

    def transfer_layout(self) -> dict[str, Any]:
        """What the engine was started with, from GET /server_info (dev mode): its
        weight-transfer backend (None without --weight-transfer-config) and its workers
        (tensor x pipeline x data parallel), as the weight sync must see them."""
        body = self._call("GET", "/server_info", params={"config_format": "json"})
        config = body["vllm_config"]
        parallel = config.get("parallel_config") or {}
        transfer = config.get("weight_transfer_config") or {}
        return {
            "backend": transfer.get("backend"),
            "world_size": int(parallel.get("tensor_parallel_size", 1))
            * int(parallel.get("pipeline_parallel_size", 1))
            * int(parallel.get("data_parallel_size", 1)),
        }

    def get_world_size(self, include_dp: bool = True) -> int:
        body = self._call(
            "GET", "/get_world_size", params={"include_dp": "true" if include_dp else "false"}
        )
        return int(body["world_size"])

    def collective_rpc(
        self,
        method: str,
        args: list[str] | None = None,
        kwargs: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """POST /collective_rpc: call a worker-extension method on every worker (strings only:
        nothing but JSON crosses the wire; `timeout_s` None: engine.request_timeout_s)."""
        body = self._call(
            "POST",
            "/collective_rpc",
            json={"method": method, "args": args or [], "kwargs": kwargs or {}},
            timeout_s=timeout_s,
        )
        return body.get("results") or []
