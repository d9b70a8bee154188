"""The routes a MoE engine returns, as the trainer lays them out for replay (pure CPU)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from vime.engines.generate_api import GenerationResult, add_choices, decode_routed_experts
from vime.rl.samples import pack_routes

pytestmark = pytest.mark.unit


def _encode(array: np.ndarray, allow_pickle: bool = False) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=allow_pickle)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def test_routed_experts_are_decoded_without_unpickling():
    routes = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2)
    result = GenerationResult("r", "http://e", [1, 2, 3])
    add_choices(result, [{"token_ids": [7, 8, 9], "routed_experts": _encode(routes)}])
    assert result.routed_experts is not None and np.array_equal(result.routed_experts, routes)
    with pytest.raises(ValueError, match="pickle"):  # an object array would need unpickling
        decode_routed_experts(_encode(np.array([{"a": 1}], dtype=object), allow_pickle=True))
    with pytest.raises(ValueError, match=r"\[tokens, layers, top-k\]"):
        decode_routed_experts(_encode(np.zeros((4, 2), dtype=np.int32)))


def test_routes_are_packed_per_forward_position_and_padded_with_valid_experts():
    short = np.full((3, 2, 2), 5, dtype=np.uint8)  # 4 tokens: 3 forwarded positions
    long = np.full((6, 2, 2), 6, dtype=np.int32)
    packed = pack_routes([short, long], seq_len=6)
    assert packed.shape == (2, 6, 2, 2) and packed.dtype == torch.int64
    assert (packed[0, :3] == 5).all() and (packed[1] == 6).all()
    assert packed[0, 3:].tolist() == [[[0, 1], [0, 1]]] * 3  # padding: experts 0..k-1
    with pytest.raises(ValueError, match="sample 1 has no routed experts"):
        pack_routes([short, None], seq_len=6)
    with pytest.raises(ValueError, match="do not fit"):
        pack_routes([short, np.zeros((3, 3, 2), dtype=np.int32)], seq_len=6)
