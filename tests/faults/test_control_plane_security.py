"""The locked control plane against a real vLLM CPU engine that vime launched (shm backend).

Every route the server serves (read from its own OpenAPI schema) answers 401 without the token and
changes nothing; the shm backend maps nothing but vime's own private segments from /dev/shm.
"""

from __future__ import annotations

import os
import uuid

import pytest
import requests

from vime.engines.vllm_engine import VLLMEngine
from vime.utils.http import EngineHTTPError

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def engine(engine_pool):
    """The session's shared shm engine (reset to the checkpoint), locked with the test token."""
    return engine_pool.get("shm")["shm"]


def _greedy(engine: VLLMEngine) -> list[int]:
    body = {
        "model": engine.config.model_path,
        "prompt": [5, 6, 7],
        "max_tokens": 8,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    response = requests.post(
        f"{engine.url}/v1/completions", json=body, headers=engine.auth_headers(), timeout=60
    )
    response.raise_for_status()
    return response.json()["choices"][0]["token_ids"]


def test_every_route_answers_401_without_the_token_and_changes_nothing(engine):
    engine.update_weight_version("v-before")
    before = _greedy(engine)
    schema = requests.get(f"{engine.url}/openapi.json", headers=engine.auth_headers(), timeout=30)
    routes = [
        (method.upper(), path.replace("{response_id}", "x"))
        for path, methods in schema.json()["paths"].items()
        for method in methods
    ]
    dev_routes = {
        "/pause",
        "/resume",
        "/collective_rpc",
        "/update_weights",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/finish_weight_update",
        "/update_weight_version",
    }
    assert dev_routes <= {path for _, path in routes}, "the server runs without dev mode?"
    answers = {}
    for method, path in routes + [("GET", "/openapi.json"), ("GET", "/docs")]:
        for headers in ({}, {"Authorization": "Bearer not-the-token"}):
            # Bodies that would act if they got through (pause, a new version, a reload).
            body = {"new_version": "v-attacker", "method": "reload_weights", "args": []}
            response = requests.request(
                method,
                f"{engine.url}{path}",
                json=body,
                headers=headers,
                timeout=30,
                params={"mode": "abort"},
            )
            answers[(method, path, bool(headers))] = response.status_code
    assert set(answers.values()) == {401}, {k: v for k, v in answers.items() if v != 401}
    print(f"{len(routes) + 2} routes x (no token, wrong token): all 401")
    assert engine.get_weight_version() == "v-before"
    assert engine.is_paused() is False
    assert _greedy(engine) == before


def test_colocated_backend_refuses_unknown_handles_and_gpu_handles_on_cpu(engine):
    with pytest.raises(EngineHTTPError, match="unknown handle kind 'file'"):
        engine.init_weight_transfer_engine({"handles": "file"})
    with pytest.raises(EngineHTTPError, match="CUDA IPC handles; this worker runs on cpu"):
        engine.init_weight_transfer_engine({"handles": "ipc"})


@pytest.mark.parametrize("case", ["foreign name", "symlink", "shared mode"])
def test_shm_backend_maps_only_private_vime_segments(engine, tmp_path, case):
    engine.init_weight_transfer_engine({"handles": "shm"})
    name = f"vime-{os.getpid()}-{uuid.uuid4().hex[:8]}-0"
    path = f"/dev/shm/{name}"
    if case == "foreign name":
        name = f"attacker-{uuid.uuid4().hex[:8]}"
        path = f"/dev/shm/{name}"
        with open(path, "wb") as handle:
            handle.write(b"\0" * 512)
        os.chmod(path, 0o600)
        expected = "not one of vime's"
    elif case == "symlink":
        target = tmp_path / "weights"
        target.write_bytes(b"\0" * 512)
        os.symlink(target, path)
        expected = "Too many levels of symbolic links|symbolic"
    else:
        with open(path, "wb") as handle:
            handle.write(b"\0" * 512)
        os.chmod(path, 0o644)
        expected = "not a private regular file"
    bucket = {
        "index": 0,
        "names": ["model.norm.weight"],
        "dtype_names": ["float32"],
        "shapes": [[128]],
        "offsets": [0],
        "nbytes": 512,
        "handles": {"cpu": {"shm_name": name}},  # this worker's device: the shared host
    }
    before = engine.get_weight_version()
    try:
        engine.start_weight_update()
        with pytest.raises(EngineHTTPError, match=expected):
            engine.update_weights({"buckets": [bucket]})
    finally:
        os.unlink(path)
    # The failed update ended the engine's update session; nothing was loaded.
    assert engine.get_weight_version() == before
    assert engine.is_paused() is False
