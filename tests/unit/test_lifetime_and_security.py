"""Unit checks of what keeps a job contained: token middleware, engine probes, no unpickling, shm
names and sweep, the external-URL check, picklable errors, the launcher watch. Real loopback
sockets, no vLLM (tests/faults runs each against real engines and the real job)."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import time

import pytest

from vime.config import EngineConfig
from vime.engines import auth
from vime.engines.server import EngineStartError, check_vllm_server
from vime.engines.server_command import build_server_command
from vime.engines.watchdog import EngineFailedError, EngineWatchdog, probe
from vime.utils.http import EngineHTTPError
from vime.weight_sync.devices.cpu import ShmHandles, sweep_stale_segments
from vime.weight_sync.names import SEGMENT_NAME, check_segment_name

pytestmark = pytest.mark.unit


def _asgi_call(app, path: str, headers: list[tuple[bytes, bytes]]) -> int:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"]


def test_token_middleware_refuses_every_request_without_the_token(monkeypatch):
    reached = []

    async def inner(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    monkeypatch.setenv(auth.TOKEN_ENV, "s3cret")
    app = auth.TokenMiddleware(inner)
    for path in ("/pause", "/update_weights", "/collective_rpc", "/health", "/v1/models"):
        assert _asgi_call(app, path, []) == 401
        assert _asgi_call(app, path, [(b"authorization", b"Bearer wrong")]) == 401
    assert reached == []
    assert _asgi_call(app, "/pause", [(b"authorization", b"Bearer s3cret")]) == 200
    assert reached == ["/pause"]


def test_token_middleware_without_a_token_refuses_to_start(monkeypatch):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    with pytest.raises(RuntimeError, match=auth.TOKEN_ENV):
        auth.TokenMiddleware(lambda *a: None)


def test_server_command_installs_the_token_check():
    cmd, env = build_server_command(EngineConfig(model_path="/m"), 8000, token="t0k")
    assert cmd[cmd.index("--middleware") + 1] == auth.MIDDLEWARE
    assert env[auth.TOKEN_ENV] == "t0k"
    cmd, env = build_server_command(EngineConfig(model_path="/m"), 8000)
    assert "--middleware" not in cmd and auth.TOKEN_ENV not in env


@pytest.mark.parametrize("kind", ["gloo", "nccl", "shm", "ipc"])
def test_no_engine_backend_needs_insecure_serialization(kind):
    """vime's receivers take CUDA IPC handles as JSON fields: nothing arriving over HTTP is
    unpickled, whatever the transport (vLLM's own ipc engine needs pickles; vime never runs
    it)."""
    config = EngineConfig(model_path="/m", weight_transfer_backend=kind)
    cmd, env = build_server_command(config, 8000, host="10.0.0.5", token="t0k")
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in env
    backend = {"gloo": "vime_broadcast", "nccl": "vime_broadcast"}.get(kind, "vime_colocated")
    assert json.dumps({"backend": backend}) in cmd


def test_engine_token_never_reaches_the_resolved_config():
    config = EngineConfig(model_path="/m", auth_token="t0k")
    assert "t0k" not in config.model_dump_json() and "t0k" not in repr(config)


@pytest.mark.parametrize(
    "name",
    ["evil", "vime-1-0", "vime-12-abcdefgh-0", "../vime-12-0123abcd-0", "vimex-12-0123abcd-0"],
)
def test_shm_backend_accepts_only_vime_segment_names(name):
    with pytest.raises(ValueError, match="not one of vime's"):
        check_segment_name(name)


def test_sweep_removes_only_segments_whose_creator_is_gone(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"vime-pp_0-{dead_pid}-0123abcd-0"
    live = tmp_path / f"vime-{os.getpid()}-0123abcd-0"
    other = tmp_path / f"psm_{dead_pid}"
    for path in (stale, live, other):
        path.write_bytes(b"x")
    assert SEGMENT_NAME.fullmatch(stale.name) and SEGMENT_NAME.fullmatch(live.name)
    assert sweep_stale_segments(str(tmp_path)) == [stale.name]
    assert not stale.exists() and live.exists() and other.exists()
    ShmHandles(shm_dir=str(tmp_path))  # the plug-in sweeps when it starts
    with pytest.raises(ValueError, match="prefix"):
        ShmHandles(shm_dir=str(tmp_path), prefix="evil")


def test_errors_keep_their_type_and_fields_across_pickling():
    failure = EngineFailedError("engine 1 at http://h:1 is dead", engine_index=1, url="http://h:1")
    copy = pickle.loads(pickle.dumps(failure))
    assert type(copy) is EngineFailedError and copy.engine_index == 1 and copy.url == "http://h:1"
    error = pickle.loads(pickle.dumps(EngineHTTPError("engine 0: x", url="http://h:2", status=503)))
    assert type(error) is EngineHTTPError and error.status == 503 and error.url == "http://h:2"


class _NotVllm(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = b"<html>hello</html>"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def not_vllm():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotVllm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_url_that_is_not_vllm_fails_fast_saying_so(not_vllm):
    began = time.monotonic()
    with pytest.raises(EngineStartError, match="is not a vLLM server"):
        check_vllm_server(not_vllm, timeout_s=15)
    assert time.monotonic() - began < 15


def test_url_that_never_answers_fails_within_the_bound():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts (kernel backlog), never answers
    try:
        began = time.monotonic()
        with pytest.raises(EngineStartError):
            check_vllm_server(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=3)
        assert time.monotonic() - began < 3 + 6
    finally:
        listener.close()


def test_probe_and_watchdog_name_a_dead_engine(unused_port, not_vllm):
    dead = f"http://127.0.0.1:{unused_port}"
    kind, detail = probe(dead, {}, health_timeout_s=1, progress_timeout_s=1)
    assert kind == "dead" and "/health" in detail
    failures = []
    watchdog = EngineWatchdog(
        [not_vllm, dead], failures.append, interval_s=0.1, progress_timeout_s=1
    ).start()
    deadline = time.monotonic() + 10
    while not failures and time.monotonic() < deadline:
        time.sleep(0.05)
    watchdog.stop()
    (failure,) = failures
    assert failure.engine_index == 1 and failure.url == dead and failure.kind == "dead"
    assert str(failure).startswith(f"engine 1 at {dead} is dead")


def test_watchdog_names_a_stalled_engine():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)  # a server that accepts and never answers: stalled, not refused
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    failures = []
    try:
        watchdog = EngineWatchdog(
            [url], failures.append, interval_s=0.1, progress_timeout_s=1, health_timeout_s=0.5
        ).start()
        deadline = time.monotonic() + 10
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        watchdog.stop()
    finally:
        listener.close()
    (failure,) = failures
    assert failure.kind == "stalled" and "not answered within 1 s" in str(failure)


def test_a_rank_whose_launcher_dies_is_told(tmp_path):
    out, ready = tmp_path / "out", tmp_path / "ready"
    rank = (
        "import os, time\n"
        "from vime.utils.lifetime import watch_parent\n"
        "def orphaned(why):\n"
        f"    open({str(out)!r}, 'w').write(why)\n"
        "    os._exit(0)\n"
        "watch_parent(orphaned, 0.1)\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "time.sleep(30)\n"
    )
    # The launcher starts the rank, waits until it watches, and exits (as a SIGKILLed torchrun).
    launcher = (
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {rank!r}])\n"
        f"while not os.path.exists({str(ready)!r}): time.sleep(0.05)\n"
    )
    subprocess.run([sys.executable, "-c", launcher], check=True, timeout=60)
    deadline = time.monotonic() + 10
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "launcher pid" in out.read_text() and "exited" in out.read_text()


def test_engine_half_imports_no_trainer_code():
    """A vLLM worker loading vime's backends imports no trainer transport and no megatron."""
    import subprocess
    import sys

    code = (
        "import sys, vime.weight_sync.vllm_extension; "
        "print(' '.join(m for m in sys.modules if m.startswith(('vime', 'megatron'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    assert "vime.weight_sync.vllm_extension" in out
    trainer_side = [m for m in out if m.startswith(("vime.weight_sync.transports", "megatron"))]
    assert trainer_side == [], trainer_side
