"""Shared fixtures: tiny models built once per session, and real vLLM CPU servers on loopback.

Servers started here are ended here, by their own process group; nothing else is touched.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from vime.testing.tiny_model import build_tiny_model

REPO_ROOT = Path(__file__).resolve().parent.parent
# Built models are cached under the repo (gitignored) so repeated runs skip the build.
MODEL_CACHE = Path(os.environ.get("VIME_TEST_MODEL_CACHE", REPO_ROOT / "models" / "test-cache"))


TIERS = ("unit", "distributed", "gpu", "faults")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    # Markers, not keywords: a keyword match would take the directory tests/unit for a marker.
    untiered = [
        item.nodeid
        for item in items
        if not any(marker.name in TIERS for marker in item.iter_markers())
    ]
    if untiered:
        # A test outside every tier would be skipped by `-m unit` and the like without a word.
        raise pytest.UsageError(
            f"tests without a tier marker ({', '.join(TIERS)}): " + ", ".join(untiered[:10])
        )
    for item in items:
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """qwen2-tiny, float32, seed 0."""
    return build_tiny_model(MODEL_CACHE / "qwen2-tiny-float32-0", "qwen2-tiny", "float32", 0)


@pytest.fixture(scope="session")
def model_builder():
    """Build (or reuse) a tiny model: model_builder(preset, dtype="float32", seed=0) -> Path."""

    def build(preset: str, dtype: str = "float32", seed: int = 0) -> Path:
        return build_tiny_model(MODEL_CACHE / f"{preset}-{dtype}-{seed}", preset, dtype, seed)

    return build


@pytest.fixture(scope="session")
def engine_pool(tiny_model_dir, tmp_path_factory):
    """Shared qwen2-tiny engines, one per weight-transfer backend (see engine_pool.py)."""
    from engine_pool import EnginePool

    pool = EnginePool(Path(tiny_model_dir), tmp_path_factory.mktemp("shared-engine-logs"))
    yield pool
    pool.close()


@pytest.fixture
def unused_port() -> int:
    """A loopback port nothing listens on (bound once, then released)."""
    from vime.utils.net import free_port

    return free_port("127.0.0.1")
