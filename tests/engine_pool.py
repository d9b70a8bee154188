"""vLLM CPU engines shared by several test modules, reset and checked before each hands one out.

A start costs 27-35 s here, so modules that only need "qwen2-tiny, float32, gloo (or shm)
backend, the test token" share one engine per backend for the session. Before a module gets it,
`EnginePool.get` puts it back in its first state and checks that: resumed, weights reloaded from
the checkpoint (vLLM's `reload_weights`), every served tensor's checksum equal to the
checkpoint's, the prefix cache empty, its first weight version label. A module that leaves the
engine in a state this cannot restore (dead, stuck mid-update) fails the next one's check,
naming it, instead of passing on stale state.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine_token import TOKEN
from safetensors.torch import load_file

from vime.config import EngineConfig
from vime.engines.vllm_engine import VLLMEngine
from vime.weight_sync.buckets import tensor_digest

MAX_MODEL_LEN = 2048  # the longest in-flight request of the weight-sync tests fits


class EnginePool:
    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir = model_dir
        self.log_dir = log_dir
        self._engines: dict[str, VLLMEngine] = {}
        self._first_version: dict[str, str | None] = {}
        self._lock = threading.Lock()
        self._checkpoint = {
            name: tensor_digest(t) for name, t in load_file(model_dir / "model.safetensors").items()
        }
        self.starts = 0  # engine starts this session (the README's count of what sharing saves)

    def get(self, *backends: str) -> dict[str, VLLMEngine]:
        """{backend: engine} for each backend, started (at once) if not yet, each reset."""
        with self._lock:
            missing = [b for b in backends if b not in self._engines]
            if missing:
                with ThreadPoolExecutor(len(missing)) as pool:
                    started = list(pool.map(self._start, missing))
                for backend, engine in zip(missing, started, strict=True):
                    self._engines[backend] = engine
                    self._first_version[backend] = engine.get_weight_version()
            for backend in backends:
                self._reset(backend)
            return {backend: self._engines[backend] for backend in backends}

    def _start(self, backend: str) -> VLLMEngine:
        config = EngineConfig(
            model_path=str(self.model_dir),
            weight_transfer_backend=backend,
            max_model_len=MAX_MODEL_LEN,
            startup_timeout_s=400,
            request_timeout_s=60,
            auth_token=TOKEN,
        )
        engine = VLLMEngine(config, rank=len(self._engines), log_dir=str(self.log_dir))
        engine.init()
        self.starts += 1
        return engine

    def _reset(self, backend: str) -> None:
        engine = self._engines[backend]
        engine.collective_rpc("vime_end_open_update")  # a module's trainer that died mid-sync
        if engine.is_paused():
            engine.continue_generation()
        engine.collective_rpc(
            "reload_weights",
            kwargs={"weights_path": str(self.model_dir), "is_checkpoint_format": True},
        )
        (served,) = engine.collective_rpc("vime_weight_checksums")
        stale = sorted(n for n in self._checkpoint if served.get(n) != self._checkpoint[n])
        assert not stale, f"shared {backend} engine does not serve the checkpoint again: {stale}"
        assert engine.flush_cache(timeout_s=10), f"shared {backend} engine: prefix cache in use"
        if self._first_version[backend] is not None:
            engine.update_weight_version(self._first_version[backend])
        assert engine.is_paused() is False

    def close(self) -> None:
        for engine in self._engines.values():
            engine.shutdown()
