"""Delta weight sync, both halves without an engine: the sender's encoder against the engine
worker's baseline, through real buckets (plan, pack, unpack), bit for bit."""

from __future__ import annotations

import numpy as np
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.float64])
def test_the_compare_finds_word_chunk_and_tail_changes_and_a_locally_dense_chunk(
    monkeypatch, dtype
):
    """Chunks of 96 over 1003 elements (a short last one): changes at 8-byte word, chunk and
    tensor edges, and one chunk mostly changed while the tensor as a whole stays sparse (its
    changes are still collected); then a mostly changed tensor, sent whole."""
    import vime.weight_sync.delta as delta

    monkeypatch.setattr(delta, "CHUNK_ELEMENTS", 96)
    generator = torch.Generator().manual_seed(3)
    old = (torch.rand(1003, generator=generator) * 100).to(dtype)
    new = old.clone()
    flat = new.view(-1)
    sparse = [0, 1, 3, 4, 7, 8, 23, 24, 95, 96, 500, 1001, 1002]
    dense = list(range(200, 260))  # most of chunk 2
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
    stats = DeltaStats()
    assert encoder.encode("w", newer, stats) == [("w", newer)]
    assert stats.changed == 900 and stats.dense == 1
    assert encoder.encode("w", newer, DeltaStats()) == []


@pytest.mark.parametrize("offset", [0, 1, 3])
@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.uint8])
def test_the_compare_kernel_equals_numpy_at_any_alignment_and_range(offset, dtype):
    """`diff_chunk` over views that start `offset` elements into 8-byte-aligned buffers (both
    alike: words from element `first`; apart: elements only), over sub-ranges that cut words:
    the changes NumPy finds, and `old` equal to `new` in the range only."""
    import numpy as np

    from vime.weight_sync.delta_kernels import diff_chunk, words

    rng = np.random.default_rng(offset)
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    for old_offset in (offset, 0):
        new = rng.integers(0, 50, 300 + offset).astype(np_dtype)[offset:]
        old_buffer = np.empty(300 + old_offset, dtype=np_dtype)
        old = old_buffer[old_offset:]
        old[:] = new
        hit = rng.random(new.size) < 0.1
        new[hit] += 1
        first, new_words, old_words = words(new, old)
        assert (new_words.size > 0) == (old_offset == offset)
        for start, end in ((0, new.size), (5, 7), (9, 260), (250, new.size)):
            before = old.copy()
            expected = start + np.flatnonzero(new[start:end] != old[start:end])
            indices = np.empty(end - start, dtype=np.int64)
            values = np.empty(end - start, dtype=np_dtype)
            shared = np.zeros(1, dtype=np.int64)
            found, count, whole = diff_chunk(
                new, old, new_words, old_words, first, start, end,
                indices, values, shared, end,
            )  # fmt: skip
            assert whole and found == count == expected.size == shared[0]
            assert indices[:found].tolist() == expected.tolist()
            assert values[:found].tolist() == new[expected].tolist()
            assert (old[start:end] == new[start:end]).all()
            assert (old[:start] == before[:start]).all() and (old[end:] == before[end:]).all()
            old[:] = before
        # Past the limit (checked after each block of words) it stops collecting, still counts,
        # and still brings `old` up to date; elements alone are collected whole.
        shared = np.zeros(1, dtype=np.int64)
        indices = np.empty(new.size, dtype=np.int64)
        values = np.empty(new.size, dtype=np_dtype)
        found, count, whole = diff_chunk(
            new, old, new_words, old_words, first, 0, new.size,
            indices, values, shared, 0,
        )  # fmt: skip
        assert whole == (new_words.size == 0) and count == int(hit.sum()) and (old == new).all()


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


@pytest.mark.parametrize("threads", [1, 2])
def test_the_engines_scatter_writes_every_value_and_refuses_indices_outside(monkeypatch, threads):
    """The worker's patch: split over the compare's threads from SPLIT_ELEMENTS indices on;
    an index outside the tensor is refused, and the baseline becomes unknown."""
    import vime.weight_sync.delta as delta

    monkeypatch.setattr(delta, "SPLIT_ELEMENTS", 4 if threads == 2 else 1 << 30)
    target = torch.zeros(1000, dtype=torch.bfloat16)
    indices = torch.tensor([0, 3, 4, 500, 998, 999], dtype=torch.int32)
    values = torch.arange(1, 7).to(torch.bfloat16)
    delta.scatter(target, indices, values)
    expected = torch.zeros(1000, dtype=torch.bfloat16)
    expected[indices.long()] = values
    assert torch.equal(bits(target), bits(expected))
    with pytest.raises(ValueError, match="1 indices fall outside a tensor of 1000"):
        delta.scatter(target, torch.tensor([1, 1000], dtype=torch.int64), values[:2])
    with pytest.raises(ValueError, match="2 indices for 1 values"):
        delta.scatter(target, indices[:2], values[:1])
    encoder, engine = DeltaEncoder(), Baseline()
    engine.start()
    _full(encoder, engine, {"w": torch.zeros(8)})
    engine.start()
    with pytest.raises(ValueError, match="'w::values'.*outside"):
        engine.patch([("w::indices", torch.tensor([-1])), ("w::values", torch.ones(1))])
    assert not engine.valid


def test_an_empty_tensor_is_unchanged():
    encoder = DeltaEncoder()
    encoder.remember("empty", torch.zeros(0, dtype=torch.bfloat16))
    stats = DeltaStats()
    assert encoder.encode("empty", torch.zeros(0, dtype=torch.bfloat16), stats) == []
    assert stats.unchanged == 1 and stats.changed == 0


def test_a_process_that_exits_right_after_its_first_full_sync_exits_cleanly(tmp_path):
    """A process that ends right after its first full sync, while the kernels' warm-up thread
    still compiles (an empty numba cache), exits cleanly: the thread is waited for and uses no
    thread pool, which the interpreter's shutdown refuses (an earlier version, a daemon thread on
    the compare's pool, could abort the process or print "cannot schedule new futures")."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from vime.weight_sync.delta import DeltaEncoder\n"
        "DeltaEncoder().remember('w', torch.zeros(8, dtype=torch.bfloat16))\n"
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300, env=env)
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr.decode()[-2000:]


def test_kernels_compile_without_a_writable_cache(monkeypatch):
    """numba refuses cache=True where no cache directory is writable: the loop is then
    compiled per process."""
    import numba

    from vime.weight_sync import delta_kernels

    calls, real = [], numba.njit

    def njit(**options):
        calls.append(options)
        if options.get("cache"):
            raise RuntimeError("cannot cache function: no locator available")
        return real(**options)

    monkeypatch.setattr(delta_kernels.numba, "njit", njit)

    def first(values):
        return values[0]

    compiled = delta_kernels._compiled(first)
    monkeypatch.undo()
    assert calls == [{"nogil": True, "cache": True}, {"nogil": True}]
    assert compiled(np.arange(3, dtype=np.int16) + 5) == 5
