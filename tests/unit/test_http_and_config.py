"""The HTTP helper against real loopback sockets, and the config tree's validation."""

from __future__ import annotations

import http.server
import importlib.util
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from vime.config import EngineConfig, apply_overrides, load_config
from vime.engines.cpu_binding import cpu_core_binding
from vime.engines.generate_api import SamplingConfig, expand_weight_versions
from vime.engines.server_command import build_server_command
from vime.utils.http import EngineHTTPError, request_json

pytestmark = pytest.mark.unit


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        if self.path.startswith("/bad"):
            body = b'{"error": "mode must be one of keep, wait, abort"}'
            self.send_response(400)
        else:
            body = b'{"ok": true}'
            self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def http_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_request_json_ok_and_error_body(http_server):
    assert request_json("POST", f"{http_server}/good", timeout_s=5) == {"ok": True}
    with pytest.raises(EngineHTTPError) as info:
        request_json("POST", f"{http_server}/bad", timeout_s=5)
    assert info.value.status == 400
    assert "mode must be one of" in str(info.value) and f"{http_server}/bad" in str(info.value)


def test_request_json_refused_names_url(unused_port):
    url = f"http://127.0.0.1:{unused_port}/pause"
    with pytest.raises(EngineHTTPError, match="cannot connect") as info:
        request_json("POST", url, timeout_s=5)
    assert url in str(info.value)


def test_request_json_silent_server_times_out():
    # A socket that accepts connections (kernel backlog) but never answers.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/pause"
    try:
        started = time.monotonic()
        with pytest.raises(EngineHTTPError, match="timed out after 0.5 s"):
            request_json("POST", url, timeout_s=0.5)
        assert time.monotonic() - started < 3
    finally:
        listener.close()


def test_engine_config_errors_name_the_field(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("model_path: /m\nnum_engines: 0\ndtype: float64\nbogus: 1\n")
    with pytest.raises(ValueError) as info:
        load_config(EngineConfig, path)
    message = str(info.value)
    assert "num_engines" in message and "dtype" in message and "bogus" in message
    assert "'float64'" in message


def test_external_url_must_be_http():
    with pytest.raises(ValueError, match="not an http"):
        EngineConfig(model_path="/m", external_urls=["127.0.0.1:8000"])


def test_dotted_overrides_parse_yaml_values():
    tree = apply_overrides({"a": {"b": 1}}, ["a.b=2", "a.c=[1, 2]", "d.e=true"])
    assert tree == {"a": {"b": 2, "c": [1, 2]}, "d": {"e": True}}
    with pytest.raises(ValueError, match="section.field=value"):
        apply_overrides({}, ["novalue"])


def test_server_command_has_dev_mode_backend_and_extension():
    config = EngineConfig(model_path="/m", weight_transfer_backend="gloo", cpu_kvcache_space_gib=2)
    cmd, env = build_server_command(config, 8123, host="127.0.0.3")
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--port") + 1] == "8123"
    # The server and vLLM's internal queues bind to the engine's node address, nowhere else.
    assert cmd[cmd.index("--host") + 1] == "127.0.0.3"
    assert env["VLLM_HOST_IP"] == "127.0.0.3" and env["VIME_HOST_IP"] == "127.0.0.3"
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    assert '{"backend": "vime_broadcast"}' in cmd and "--enable-scale-out" in cmd
    # The extension vLLM's workers import by that path really is vime's (checked without
    # importing vLLM): a renamed module would start servers without the gloo/shm backends.
    extension = cmd[cmd.index("--worker-extension-cls") + 1]
    module, _, name = extension.rpartition(".")
    assert (module, name) == ("vime.weight_sync.vllm_extension", "VimeWorkerExtension")
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    assert f"class {name}:" in Path(spec.origin).read_text()
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_weight_version_spans_expand_per_token():
    spans = [{"version": "1", "start": 0, "end": 3}, {"version": "2", "start": 3, "end": 5}]
    assert expand_weight_versions(spans, 5) == ["1", "1", "1", "2", "2"]
    assert expand_weight_versions(None, 2) == [None, None]


def test_switch_gaps_measure_the_stream_where_the_version_changes():
    from vime.engines.generate_api import GenerationResult

    result = GenerationResult("r", "http://e", [1], token_ids=list(range(5)))
    # Chunks of 2, 1 (the last old token), then 2 tokens (the first new one comes 0.5 s later),
    # and a closing chunk with no token.
    result.chunk_times, result.chunk_ends = [10.0, 10.1, 10.6, 10.7], [2, 3, 5, 5]
    result.version_spans = [
        {"version": "1", "start": 0, "end": 3},
        {"version": "2", "start": 3, "end": 5},
    ]
    assert result.switch_gaps() == [pytest.approx(0.5)]  # read from the spans while streaming
    result.weight_versions = ["1", "1", "2", "2", "2"]  # ended: the expanded versions win
    assert result.switch_gaps() == [pytest.approx(0.1)]  # tokens 1 and 2 were chunks 0 and 1
    result.weight_versions = ["1"] * 5
    assert result.switch_gaps() == []


def test_sampling_request_asks_for_sampled_logprob_only():
    params = SamplingConfig(max_tokens=4, temperature=0.0).to_request()
    assert params["logprobs"] == 0 and "seed" not in params
    assert params["detokenize"] is True  # needed for correct weight-version spans in vLLM 0.32


def test_cpu_engines_get_disjoint_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cpu_core_binding(0, 1, 1) is None  # one engine: vLLM's "auto"
    assert [cpu_core_binding(rank, 2, 1) for rank in range(2)] == ["0,1", "2,3"]
    assert cpu_core_binding(1, 2, 2) == "2|3"  # one core per TP worker
    # One TP engine: vLLM's "auto" refuses TP > 1 on one NUMA node, so vime binds it too,
    # leaving the last core to the trainer as "auto" would.
    assert cpu_core_binding(0, 1, 2) == "0|1"
    assert cpu_core_binding(0, 1, 3) == "0|1|2"
    assert cpu_core_binding(0, 1, 4) == "0|1|2|3"  # no core to spare
    # Fewer cores than workers: one core each, round robin.
    assert [cpu_core_binding(rank, 4, 2) for rank in range(3)] == ["0|1", "2|3", "0|1"]
    assert cpu_core_binding(0, 1, 8) == "0|1|2|3|0|1|2|3"
    assert cpu_core_binding(0, 8, 1) is None  # single-worker engines outnumber the cores


def test_served_slices_are_checked_and_taken_from_the_whole_tensor():
    from vime.weight_sync.shards import Shard, worker_layout

    layout = worker_layout(
        [
            {"name": "a", "dtype": "float32", "shape": [6, 4], "shard": [0, 3, 6]},
            {"name": "b", "dtype": "bfloat16", "shape": [4], "shard": None},
        ]
    )
    assert layout == {"a": ("float32", Shard(0, 3, 6)), "b": ("bfloat16", None)}
    whole = torch.arange(24.0).reshape(6, 4)
    assert torch.equal(Shard(0, 3, 6).take(whole), whole[3:])
    assert torch.equal(Shard(1, 2, 4).take(whole), whole[:, 2:])
    with pytest.raises(ValueError, match=r"c: the worker reports slice dim 0 \[4:8\]"):
        worker_layout([{"name": "c", "dtype": "float32", "shape": [6], "shard": [0, 4, 8]}])


def test_cpu_server_keeps_freed_memory_unless_told_not_to(monkeypatch):
    monkeypatch.setattr("vime.engines.server_command.has_cuda", lambda: False)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    _, env = build_server_command(EngineConfig(model_path="/m"), 8123)
    tunables = env["GLIBC_TUNABLES"].split(":")
    assert tunables[0] == "glibc.malloc.arena_max=2"  # the user's own tunables stay
    assert "glibc.malloc.mmap_max=0" in tunables
    _, env = build_server_command(EngineConfig(model_path="/m", cpu_reuse_freed_memory=False), 1)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"


def test_eager_cpu_server_runs_the_samplers_helpers_without_dynamo(monkeypatch):
    monkeypatch.setattr("vime.engines.server_command.has_cuda", lambda: False)
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    _, env = build_server_command(EngineConfig(model_path="/m"), 8123)
    assert env["TORCHDYNAMO_DISABLE"] == "1"
    _, env = build_server_command(EngineConfig(model_path="/m", enforce_eager=False), 8123)
    assert "TORCHDYNAMO_DISABLE" not in env
    monkeypatch.setattr("vime.engines.server_command.has_cuda", lambda: True)  # GPU: vLLM's choice
    _, env = build_server_command(EngineConfig(model_path="/m"), 8123)
    assert "TORCHDYNAMO_DISABLE" not in env


def test_engine_http_error_survives_pickling():
    """Ray moves exceptions between processes by pickling them."""
    import pickle

    error = EngineHTTPError(
        "POST http://h:1/pause -> HTTP 500", url="http://h:1", status=500, body="x"
    )
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is EngineHTTPError and str(copy) == str(error)
    assert (copy.url, copy.status, copy.body) == ("http://h:1", 500, "x")


def test_sync_errors_name_ray_engines_by_url():
    from vime.engines.ray_engine import RayEngine
    from vime.engines.vllm_engine import VLLMEngine
    from vime.weight_sync.session import describe_engine

    assert (
        describe_engine(2, RayEngine(object(), url="http://n2:8000")) == "engine 2 (http://n2:8000)"
    )
    external = VLLMEngine(EngineConfig(model_path="/m"), url="http://n3:8000")
    assert describe_engine(0, external) == "engine 0 (http://n3:8000)"


def test_base_port_gives_each_launched_engine_its_port():
    from vime.engines.vllm_engine import VLLMEngine

    config = EngineConfig(model_path="/m", base_port=28000)
    assert [VLLMEngine(config, rank=r)._launch_port() for r in range(3)] == [28000, 28001, 28002]
    assert VLLMEngine(EngineConfig(model_path="/m"))._launch_port() is None


def test_stop_ends_the_group_when_its_leader_is_already_dead(tmp_path):
    """A SIGKILLed api_server leaves its children (EngineCore, workers) in its process group."""
    import signal
    import subprocess
    import time

    from vime.engines.server import ServerProcess
    from vime.utils.process_group import group_members

    process = subprocess.Popen(
        ["bash", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True
    )
    deadline = time.monotonic() + 10
    while len(group_members(process.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    children = set(group_members(process.pid)) - {process.pid}
    assert len(children) == 2
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert set(group_members(process.pid)) == children  # orphans, still in the group
    ServerProcess(process=process, url="http://unused", log_path=tmp_path / "log").stop(grace_s=5)
    assert group_members(process.pid) == []
