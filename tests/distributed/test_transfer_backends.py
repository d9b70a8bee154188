"""The vime weight-sync backends against real vLLM CPU servers, one server per backend.

Each test syncs the weights of a differently seeded tiny Qwen2 into a server through the full
HTTP lifecycle (pause keep -> start -> update_weights in several buckets -> finish -> resume), then
checks that every served tensor equals the new weights bit for bit, that greedy output equals
HF transformers on the new weights, and that the server reports the new weight version.
"""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest
import requests
import torch
from engine_token import HEADERS, TOKEN

from vime.testing.hf import hf_greedy
from vime.testing.tiny_model import build_tiny_model
from vime.weight_sync.buckets import check_against_engine, pack, plan_buckets, tensor_digest
from vime.weight_sync.devices.cpu import ShmHandles
from vime.weight_sync.transports.base import filled_ahead
from vime.weight_sync.transports.broadcast import BroadcastTransport
from vime.weight_sync.transports.colocated import ColocatedTransport

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 240.0
HTTP_TIMEOUT_S = 120.0
# Smaller than the embedding and lm_head (256 KiB each): those get buckets of their own and
# the rest is cut into several buckets.
MAX_BUCKET_BYTES = 200_000
NUM_NEW_TOKENS = 12
PROMPT = "Q: 12+7= A:"


def _http(method: str, url: str, *, timeout_s: float = HTTP_TIMEOUT_S, **kwargs):
    response = requests.request(method, url, timeout=timeout_s, headers=HEADERS, **kwargs)
    if response.status_code >= 400:
        raise RuntimeError(f"{method} {url} -> HTTP {response.status_code}: {response.text[:2000]}")
    return response.json() if response.content else None


class Server:
    """One vLLM CPU server this test launched with vime's launcher (a keeper ends it and every
    /dev/shm file its processes mapped), or a shared one (`attach`), the test token on every
    route."""

    def __init__(self, model_dir: Path, backend: str, log_path: Path):
        from vime.config import EngineConfig
        from vime.engines.server import launch_server

        self.backend = backend
        config = EngineConfig(
            model_path=str(model_dir),
            weight_transfer_backend=backend,
            max_model_len=512,
            startup_timeout_s=STARTUP_TIMEOUT_S,
        )
        self.config = config.model_copy(update={"auth_token": TOKEN})
        self.process = launch_server(config, host=HOST, port=None, log_path=log_path, token=TOKEN)
        self.url = self.process.url

    @classmethod
    def attach(cls, engine, backend: str) -> Server:
        """The same methods over an engine someone else started (and stops)."""
        server = cls.__new__(cls)
        server.backend, server.config, server.url = backend, engine.config, engine.url
        server.process = None
        return server

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def post(self, path: str, **kwargs):
        return _http("POST", self.url + path, **kwargs)

    def get(self, path: str, **kwargs):
        return _http("GET", self.url + path, **kwargs)

    def rpc(self, method: str):
        (result,) = self.post("/collective_rpc", json={"method": method})["results"]
        return result

    def greedy(self, prompt_ids: list[int]) -> list[int]:
        body = {
            "model": self.config.model_path,
            "prompt": prompt_ids,
            "max_tokens": NUM_NEW_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        return self.post("/v1/completions", json=body)["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    """ "old": the shared engines' checkpoint (qwen2-tiny, seed 0); "new": seed 1."""
    root = tmp_path_factory.mktemp("models")
    return {"old": tiny_model_dir, "new": build_tiny_model(root / "new", seed=1)}


@pytest.fixture(scope="module")
def servers(engine_pool):
    """The session's shared gloo and shm engines, on the "old" weights (the checkpoint)."""
    engines = engine_pool.get("gloo", "shm")
    return {backend: Server.attach(engine, backend) for backend, engine in engines.items()}


@pytest.fixture(scope="module")
def reference(models):
    """HF models, their weights in checkpoint order, and the prompt's token ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["old"])
    loaded = {}
    for key, path in models.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        loaded[key] = {
            "model": model,
            "weights": {name: p.detach() for name, p in model.named_parameters()},
        }
    return {"prompt_ids": tokenizer(PROMPT)["input_ids"], **loaded}


def _specs(weights: dict[str, torch.Tensor]):
    return [(name, t.dtype, tuple(t.shape)) for name, t in weights.items()]


def _sync(server: Server, send, version: str) -> None:
    """The weight-update lifecycle around `send`, which moves the buckets."""
    server.post("/pause", params={"mode": "keep"})
    server.post("/start_weight_update")
    send()
    server.post("/finish_weight_update", json={"weight_version": version})
    server.post("/resume")


def _update_call(server: Server):
    return lambda info: server.post("/update_weights", json={"update_info": info})


def _filler(weights: dict[str, torch.Tensor]):
    def fill(bucket, buffer):
        pack(weights, bucket, buffer)

    return fill


def _init_call(server: Server):
    return lambda info: server.post("/init_weight_transfer_engine", json={"init_info": info})


def _check_served(server: Server, reference, key: str, version: str) -> None:
    expected = {name: tensor_digest(t) for name, t in reference[key]["weights"].items()}
    served = server.rpc("vime_weight_checksums")
    mismatched = sorted(
        name for name in expected.keys() | served.keys() if expected.get(name) != served.get(name)
    )
    assert not mismatched, f"served tensors differ from the {key} weights: {mismatched}"
    hf_tokens = hf_greedy(reference[key]["model"], reference["prompt_ids"], NUM_NEW_TOKENS)
    assert server.greedy(reference["prompt_ids"]) == hf_tokens
    assert server.get("/weight_info") == {"weight_version": version}


def _segment_names(infos: list[dict]) -> list[str]:
    return [b["handles"]["cpu"]["shm_name"] for info in infos for b in info["buckets"]]


def test_gloo_backend_syncs_exact_weights(servers, reference):
    server = servers["gloo"]
    prompt_ids = reference["prompt_ids"]
    old_tokens = server.greedy(prompt_ids)
    assert old_tokens == hf_greedy(reference["old"]["model"], prompt_ids, NUM_NEW_TOKENS)
    assert old_tokens != hf_greedy(reference["new"]["model"], prompt_ids, NUM_NEW_TOKENS), (
        "seeds too alike"
    )

    new = reference["new"]["weights"]
    check_against_engine(_specs(new), server.rpc("vime_weight_metadata"))
    assert server.rpc("vime_device_id") == "cpu"  # the host: no GPU, no stand-in number
    buckets = plan_buckets(_specs(new), MAX_BUCKET_BYTES, alignment=BroadcastTransport.alignment)
    assert len(buckets) >= 4
    assert any(b.nbytes > MAX_BUCKET_BYTES for b in buckets)  # an oversize tensor alone

    (world_size,) = server.get("/get_world_size").values()
    transport = BroadcastTransport(engine_world_sizes=[world_size], timeout_s=60)
    (init,) = transport.connect([_init_call(server)])
    assert init["world_size"] == 1 + world_size and init["rank_offset"] == 1
    try:
        # All buckets in one update_weights request, one broadcast per bucket.
        sent = []

        def send_all() -> None:
            sent.extend(transport.send_buckets(buckets, _filler(new), [_update_call(server)]))

        _sync(server, send_all, version="1")
        assert len(sent) == 1 and len(sent[0]["buckets"]) == len(buckets)
        _check_served(server, reference, "new", "1")

        # Same group again, now one request per bucket, back to the old weights.
        old = reference["old"]["weights"]

        def send_each() -> None:
            for bucket in buckets:
                buffer = transport.buffer_for(bucket)
                pack(old, bucket, buffer)
                transport.send_bucket(bucket, buffer, [_update_call(server)])

        _sync(server, send_each, version="2")
        _check_served(server, reference, "old", "2")

        # An engine that rejects the update (here: no start_weight_update) never joins the
        # broadcast; the transport must surface its error at once, not wait for the timeout.
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="start_weight_update"):
            transport.send_buckets(buckets, _filler(new), [_update_call(server)])
        assert time.monotonic() - started < 10
        with pytest.raises(RuntimeError, match="connect"):
            transport.send_buckets(buckets, _filler(new), [_update_call(server)])
        # Neither close() nor a new group waits for the abandoned broadcast's timeout.
        started = time.monotonic()
        transport.close()
        transport.connect([_init_call(server)])

        def send_again() -> None:
            transport.send_buckets(buckets, _filler(new), [_update_call(server)])

        _sync(server, send_again, version="3")
        assert time.monotonic() - started < 20
        _check_served(server, reference, "new", "3")
    finally:
        transport.close()


def test_shm_backend_syncs_exact_weights_and_cleans_up(servers, reference):
    server = servers["shm"]
    new = reference["new"]["weights"]
    check_against_engine(_specs(new), server.rpc("vime_weight_metadata"))
    buckets = plan_buckets(_specs(new), MAX_BUCKET_BYTES, alignment=ColocatedTransport.alignment)

    handles = ShmHandles()
    transport = ColocatedTransport(handles=handles, device_id="cpu", timeout_s=60)
    shm_dir = Path(handles.shm_dir)
    transport.connect([_init_call(server)])
    modes = []
    update = _update_call(server)

    def update_and_inspect(info: dict) -> None:
        # While the engine reads, the segment exists, private to this user.
        for described in info["buckets"]:
            name = described["handles"]["cpu"]["shm_name"]
            modes.append(stat.S_IMODE((shm_dir / name).stat().st_mode))
        update(info)

    try:
        infos = []

        def send_all() -> None:
            infos.extend(transport.send_buckets(buckets, _filler(new), [update_and_inspect]))

        _sync(server, send_all, version="1")
        assert len(infos) == len(buckets) >= 4
        assert modes == [0o600] * len(buckets)
        assert not list(shm_dir.glob(f"{handles.prefix}*")), "segments left behind"
        _check_served(server, reference, "new", "1")
        first_names = _segment_names(infos)

        # The next sync refills the same (now unlinked) segments, which the engine still maps.
        old = reference["old"]["weights"]
        infos.clear()

        def send_old() -> None:
            infos.extend(transport.send_buckets(buckets, _filler(old), [update]))

        _sync(server, send_old, version="2")
        assert _segment_names(infos) == first_names
        assert transport.num_bytes_held >= sum(b.nbytes for b in buckets)
        _check_served(server, reference, "old", "2")

        # Filled ahead (weight_sync.pack_before_pause): every segment refilled before the
        # engine pauses, while it serves; send_buckets then only posts them.
        transport.prefill(buckets, _filler(new))
        infos.clear()

        def post_filled() -> None:
            infos.extend(transport.send_buckets(buckets, filled_ahead, [update]))

        _sync(server, post_filled, version="3")
        assert _segment_names(infos) == first_names
        _check_served(server, reference, "new", "3")
        # Between syncs the engine holds no view of a segment: refilling them all (what the
        # next sync's prepare does while the engine serves) leaves the served weights alone.
        transport.prefill(buckets, _filler(old))
        _check_served(server, reference, "new", "3")

        # A rejected update (no start_weight_update) drops every segment: the engine may hold
        # views of them, so the next sync starts with new ones.
        with pytest.raises(RuntimeError, match="start_weight_update"):
            transport.send_buckets(buckets, _filler(old), [update])
        assert transport.num_bytes_held == 0
        infos.clear()
        _sync(server, send_old, version="4")
        assert not set(_segment_names(infos)) & set(first_names)
        _check_served(server, reference, "old", "4")
        # Posting other buckets than those filled ahead is refused, and drops the buffers.
        transport.prefill(buckets, _filler(new))
        with pytest.raises(ValueError, match="send exactly the buckets that were filled ahead"):
            transport.send_buckets(buckets[1:], filled_ahead, [update])
        assert transport.num_bytes_held == 0
        # A new segment handed out but never sent is unlinked by close().
        transport.discard()
        transport.buffer_for(buckets[0])
        assert len(list(shm_dir.glob(f"{handles.prefix}*"))) == 1
    finally:
        transport.close()
    assert not list(shm_dir.glob(f"{handles.prefix}*")), "segments left behind"


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_vllm_trainer_factory_drives_vime_backends(servers, reference, backend):
    """vLLM's trainer-side API (`WeightTransferTrainerFactory.trainer_init` + `send_weights`)
    with vime's backends registered under their engine names; vime's VLLMEngine is the client."""
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from vime.engines.vllm_engine import VLLMEngine
    from vime.weight_sync.trainer_engines import BroadcastTrainerInitInfo, ColocatedTrainerInitInfo

    server = servers[backend]
    client = VLLMEngine(server.config, url=server.url)
    client.init()
    init_info = (
        BroadcastTrainerInitInfo(rank=0, engine_world_size=1, bucket_bytes=MAX_BUCKET_BYTES)
        if backend == "gloo"
        else ColocatedTrainerInitInfo(rank=0, bucket_bytes=MAX_BUCKET_BYTES)
    )
    for key in ("new", "old"):
        sender = WeightTransferTrainerFactory.trainer_init(
            init_info, client=client, source=ModuleSource(reference[key]["model"])
        )
        try:
            client.pause_generation()
            sender.send_weights()  # start, update_weights, finish on the client
            client.continue_generation()
            assert sender.buckets is not None and len(sender.buckets) >= 4
        finally:
            sender.shutdown()
        expected = {name: tensor_digest(t) for name, t in reference[key]["weights"].items()}
        assert server.rpc("vime_weight_checksums") == expected
        stats = server.rpc("vime_weight_update_stats")
        # gloo streams all buckets in one request; shm posts one request per bucket.
        assert stats["requests"] == (1 if backend == "gloo" else len(sender.buckets))
        assert server.greedy(reference["prompt_ids"]) == hf_greedy(
            reference[key]["model"], reference["prompt_ids"], NUM_NEW_TOKENS
        )
