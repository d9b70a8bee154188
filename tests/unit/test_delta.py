"""Delta weight sync, both halves without an engine: the sender's encoder against the engine
worker's baseline, through real buckets (plan, pack, unpack), bit for bit."""

from __future__ import annotations

import pytest
import torch

from vime.weight_sync.buckets import pack, unpack
from vime.weight_sync.delta import Baseline, DeltaEncoder, DeltaStats, bits

pytestmark = pytest.mark.unit


def _weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(64, 16, generator=generator).to(torch.bfloat16),
        "norm": torch.randn(16, generator=generator),
        "proj": torch.randn(32, 16, generator=generator).to(torch.bfloat16),
    }


def _through_buckets(encoder, engine, tensors, cap=512):
    """One delta sync: encode, plan, pack each bucket, unpack and apply it on the engine side;
    returns (what the commit loads, stats, buckets)."""
    buckets, entries, stats = encoder.buckets(tensors, cap=cap, alignment=64)
    loaded = None
    for bucket in buckets:
        buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        pack(entries, bucket, buffer)
        received = [(name, t.clone()) for name, t in unpack(buffer, bucket)]
        if bucket.mode == "delta":
            engine.patch(received)
        else:
            assert bucket.mode == "commit" and bucket is buckets[-1]
            loaded = dict(engine.commit(bucket.commit_names))
    return loaded, stats, buckets


def _full(encoder, engine, tensors):
    for name, tensor in tensors.items():
        encoder.remember(name, tensor)
    engine.store(list(tensors.items()))


def test_delta_reproduces_every_bit_and_sends_only_changed_elements():
    encoder, engine = DeltaEncoder(), Baseline()
    old = _weights(0)
    engine.start()
    _full(encoder, engine, old)
    new = {name: t.clone() for name, t in old.items()}
    new["embed"][3, :5] += 1.0  # 5 of 1024 elements
    new["norm"][2] = -0.0 if old["norm"][2] == 0 else -old["norm"][2]
    new["proj"] = torch.randn(32, 16).to(torch.bfloat16)  # all of it: sent whole
    engine.start()
    loaded, stats, buckets = _through_buckets(encoder, engine, new)
    assert loaded.keys() == new.keys()
    for name, tensor in new.items():
        assert torch.equal(bits(loaded[name]), bits(tensor)), name
    assert (stats.sparse, stats.dense, stats.unchanged) == (2, 1, 0)
    assert stats.elements == 64 * 16 + 16 + 32 * 16
    assert stats.changed == 5 + 1 + int((new["proj"] != old["proj"]).sum())
    assert stats.sent_bytes == 5 * (4 + 2) + 1 * (4 + 4) + 32 * 16 * 2
    assert stats.sent_bytes < stats.full_bytes
    assert len(buckets) >= 2  # indices and values may sit in different buckets


def test_the_compare_in_chunks_on_several_threads_finds_every_change(monkeypatch):
    import vime.weight_sync.delta as delta

    monkeypatch.setattr(delta, "CHUNK_ELEMENTS", 100)  # 1001 elements: 11 chunks, a short last
    encoder = DeltaEncoder()
    old = torch.randn(1001).to(torch.bfloat16)
    encoder.remember("w", old)
    new = old.clone()
    changed = torch.tensor([0, 99, 100, 101, 555, 999, 1000])  # both sides of chunk edges
    new[changed] += 1.0
    stats = DeltaStats()
    (indices_entry, values_entry) = encoder.encode("w", new, stats)
    assert indices_entry[1].tolist() == changed.tolist() and stats.changed == len(changed)
    assert torch.equal(bits(values_entry[1]), bits(new[changed]))
    assert encoder.encode("w", new, DeltaStats()) == []  # the last-sent copy caught up


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_block_search_finds_sparse_dense_and_edge_changes(monkeypatch, dtype):
    """Blocks of 24 (a short last one: 1003 elements), chunks of 96: sparse blocks are searched
    by the mask's 8-byte words, denser ones directly; one chunk is locally past the dense share,
    stops collecting and is searched again by `take` (the tensor as a whole stays sparse)."""
    import vime.weight_sync.delta as delta

    monkeypatch.setattr(delta, "CHUNK_ELEMENTS", 96)
    monkeypatch.setattr(delta, "BLOCK_ELEMENTS", 24)
    monkeypatch.setattr(delta, "SPARSE_BLOCK_FRACTION", 0.2)  # up to 4 of 24: by words
    generator = torch.Generator().manual_seed(3)
    old = (torch.rand(1003, generator=generator) * 100).to(dtype)
    new = old.clone()
    flat = new.view(-1)
    sparse = [0, 7, 8, 23, 24, 95, 96, 500, 1002]  # word, block and chunk edges, the last one
    dense = list(range(200, 240))  # block 8 and 9 (of chunk 2) mostly changed
    changed = sorted(set(sparse + dense))
    bits(flat)[changed] ^= 1  # one bit flipped: a change every dtype sees
    encoder = DeltaEncoder()
    encoder.remember("w", old)
    stats = DeltaStats()
    (indices_entry, values_entry) = encoder.encode("w", new, stats)
    assert indices_entry[1].tolist() == changed and stats.changed == len(changed)
    assert torch.equal(bits(values_entry[1]), bits(flat[changed]))
    assert encoder.encode("w", new, DeltaStats()) == []  # the last-sent copy caught up
    # Mostly changed: sent whole; the last-sent copy is the new tensor.
    newer = new.clone()
    bits(newer.view(-1))[:900] ^= 1
    assert encoder.encode("w", newer, DeltaStats()) == [("w", newer)]
    assert encoder.encode("w", newer, DeltaStats()) == []


def test_the_word_search_equals_numpys_flatnonzero():
    import numpy as np

    from vime.weight_sync.delta import _flat_nonzero

    rng = np.random.default_rng(0)
    for size in (0, 1, 7, 8, 9, 64, 1001):
        for density in (0.0, 0.01, 0.3, 1.0):
            mask = rng.random(size) < density
            assert _flat_nonzero(mask).tolist() == np.flatnonzero(mask).tolist(), (size, density)


def test_unchanged_tensors_send_nothing_and_signed_zero_and_nan_count_as_changes():
    encoder, engine = DeltaEncoder(), Baseline()
    old = {"w": torch.tensor([0.0, 1.0, float("nan"), 2.0])}
    engine.start()
    _full(encoder, engine, old)
    stats = DeltaStats()
    assert encoder.encode("w", old["w"].clone(), stats) == []  # NaN bits equal: unchanged
    assert stats.unchanged == 1 and stats.changed == 0
    flipped = torch.tensor([-0.0, 1.0, float("nan"), 2.0])
    engine.start()
    loaded, stats, _ = _through_buckets(encoder, engine, {"w": flipped})
    assert stats.changed == 1
    assert torch.equal(bits(loaded["w"]), bits(flipped))


def test_a_delta_needs_a_full_sync_first_and_a_broken_one_invalidates_the_baseline():
    encoder, engine = DeltaEncoder(), Baseline()
    with pytest.raises(ValueError, match="was not sent before"):
        encoder.encode("w", torch.zeros(4), DeltaStats())
    engine.start()
    with pytest.raises(ValueError, match="without a valid baseline"):
        engine.patch([("w", torch.zeros(4))])
    # A full sync, then a delta whose commit never arrives (its sender died).
    engine.start()
    _full(encoder, engine, {"w": torch.zeros(8)})
    engine.start()
    engine.patch([("w::indices", torch.tensor([1], dtype=torch.int32))])
    with pytest.raises(ValueError, match="missing values"):
        engine.commit(("w",))
    engine.start()
    with pytest.raises(ValueError, match="without a valid baseline"):
        engine.patch([("w", torch.ones(8))])
    # A delta left open by an update that ended without its commit.
    engine.store([("w", torch.zeros(8))])
    engine.start()
    engine.patch([("w", torch.ones(8))])
    engine.start()  # the next update begins: the open delta made the baseline unknown
    assert not engine.valid


def test_each_stage_commits_its_own_tensors_only():
    """Two pipeline stages, each a delta then its commit: a commit loads its stage's tensors (a
    second load of the other stage's would reach layers the update already finished)."""
    stages = [{"layers.0.w": torch.zeros(8)}, {"layers.1.w": torch.ones(8)}]
    encoders, engine = [DeltaEncoder(), DeltaEncoder()], Baseline()
    engine.start()
    for encoder, tensors in zip(encoders, stages, strict=True):
        _full(encoder, engine, tensors)
    engine.start()
    for encoder, tensors in zip(encoders, stages, strict=True):
        changed = {name: t + 1 for name, t in tensors.items()}
        loaded, _, buckets = _through_buckets(encoder, engine, changed)
        assert buckets[-1].commit_names == tuple(tensors)
        assert set(loaded) == set(tensors)
        for name, tensor in changed.items():
            assert torch.equal(loaded[name], tensor)
    with pytest.raises(ValueError, match="lacks"):
        engine.commit(("layers.2.w",))
