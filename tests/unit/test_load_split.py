"""The engine's parallel weight load: how a bucket is split, and the pinned load threads."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from vime.engines.cpu_binding import sync_load_cores
from vime.weight_sync.engine.parallel_load import CoreThreads, parse_cores, split_by_layer

pytestmark = pytest.mark.unit


def _bucket() -> list[tuple[str, torch.Tensor]]:
    names_sizes = [
        ("model.embed_tokens.weight", 300),
        ("model.layers.0.self_attn.q_proj.weight", 40),
        ("model.layers.0.self_attn.k_proj.weight", 20),
        ("model.layers.0.mlp.gate_proj.weight", 60),
        ("model.layers.1.self_attn.q_proj.weight", 40),
        ("model.layers.1.mlp.experts.3.up_proj.weight", 60),
        ("model.layers.10.mlp.down_proj.weight", 100),
        ("model.layers.1.input_layernorm.weight", 2),
        ("model.norm.weight", 2),
        ("lm_head.weight", 300),
    ]
    return [(name, torch.zeros(size, dtype=torch.float32)) for name, size in names_sizes]


def _layer(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:3]) if "layers" in parts else "outside the blocks"


def test_split_keeps_each_layer_on_one_thread_and_balances_bytes():
    weights = _bucket()
    outside, groups = split_by_layer(weights, 2)
    assert len(groups) == 2
    # Every weight once; names outside the blocks apart, to be loaded first and alone.
    assert [n for n, _ in outside] == [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    everything = [n for g in [outside, *groups] for n, _ in g]
    assert sorted(everything) == sorted(n for n, _ in weights)
    order = [n for n, _ in weights]
    for group in groups:  # each group in the bucket's order
        positions = [order.index(n) for n, _ in group]
        assert positions == sorted(positions)
    # layers.1 (not contiguous in the bucket) and layers.10 are distinct blocks, each whole.
    owner = {}
    for index, group in enumerate(groups):
        for name, _ in group:
            assert owner.setdefault(_layer(name), index) == index, name
    assert owner.keys() == {"model.layers.0", "model.layers.1", "model.layers.10"}
    sizes = sorted(sum(t.nbytes for _, t in g) for g in groups)
    # Largest block first to the lighter group: layers.0 (120 floats), then layers.1 (102) and
    # layers.10 (100) to the other.
    assert sizes == [120 * 4, (102 + 100) * 4]


def test_split_keeps_other_numbered_blocks_whole():
    names = ["visual.blocks.0.attn.qkv.weight", "visual.blocks.0.attn.qkv.bias"]
    names += ["transformer.h.3.attn.c_attn.weight", "transformer.h.3.attn.c_attn.bias"]
    weights = [(name, torch.zeros(4)) for name in names]
    outside, groups = split_by_layer(weights, 4)
    assert outside == [] and sorted(len(group) for group in groups) == [2, 2]


def test_split_into_one_or_more_groups_than_blocks():
    weights = _bucket()
    outside, groups = split_by_layer(weights, 1)
    assert len(groups) == 1 and len(outside) + len(groups[0]) == len(weights)
    _, groups = split_by_layer(weights[:3], 8)  # one block: one group, no empty ones
    assert len(groups) == 1


def test_parse_cores():
    assert parse_cores(None) == [] and parse_cores("") == []
    assert parse_cores("3,1, 1") == [1, 3]
    with pytest.raises(ValueError, match="VIME_SYNC_LOAD_CORES='1-2'"):
        parse_cores("1-2")


def test_sync_load_cores_setting():
    allowed = sorted(os.sched_getaffinity(0))
    assert sync_load_cores("all") == allowed
    assert sync_load_cores("own") == []
    assert sync_load_cores([allowed[0], allowed[0]]) == [allowed[0]]
    with pytest.raises(ValueError, match=r"names cores \[4096\]"):
        sync_load_cores([4096])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_core_threads_run_on_the_extra_cores_and_raise_after_all_finished():
    before = os.sched_getaffinity(0)
    first, *others = sorted(before)
    os.sched_setaffinity(0, {first})  # as a vLLM worker's pinned thread
    try:
        threads = CoreThreads(sorted(before))
        assert threads.extra == others and threads.num_threads == len(before)
        seen: dict[int, set[int]] = {}
        lock = threading.Lock()
        # Every task waits for all: no idle helper can take two of them, so each runs on its own.
        barrier = threading.Barrier(threads.num_threads, timeout=30)

        def record(group):
            barrier.wait()
            with lock:
                seen[group[0]] = os.sched_getaffinity(0)

        threads.run(record, [[index] for index in range(threads.num_threads)])
        assert seen[0] == {first}
        assert set().union(*(seen[i] for i in range(1, threads.num_threads))) == set(others)

        finished = []

        def fail_first(group):
            if group[0] == 0:
                raise RuntimeError("load failed")
            finished.append(group[0])

        with pytest.raises(RuntimeError, match="load failed"):
            threads.run(fail_first, [[0], [1]])
        assert finished == [1]  # the helper's load ended before the error was raised
        threads.shutdown()
    finally:
        os.sched_setaffinity(0, before)
