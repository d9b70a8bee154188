"""Delta weight sync: send only the elements that changed since the last sync, bit for bit.

In RL fine-tuning most elements of a bf16 model are bit-identical from one step to the next
(an AdamW step of lr 1e-6 rarely moves a weight by one bf16 ulp), so a sync can send indices and
values of the changed elements instead of every byte.

Sender (`DeltaEncoder`, one per pipeline stage's sender): keeps a copy of every HF tensor as it
was last sent (the sent dtype, so "unchanged" means the same bits the engine last loaded). Per
tensor it sends the smaller of: nothing (unchanged), the changed elements (`<name>::indices`
int32/int64 flat indices, `<name>::values` in the tensor's dtype), or the whole tensor.

Engine (`Baseline`, one per worker, in `vime.weight_sync.engine.base`): keeps the tensors of
the last full sync as received, applies each delta to them (a scatter, O(changed)), and on the
final "commit" bucket loads every tensor of the patched baseline through the model's own loader,
exactly as a full sync of the same weights would (TP slicing, fused qkv / gate-up, vocab padding
and vLLM CPU's kernel repack all run as usual). Until the commit nothing is loaded: a delta that
fails midway leaves the engine serving the previous weights, whole.

Exact or nothing: the first sync, every sync after a reconnect (a restarted or new engine) and
every sync after a failure is full (`DeltaEncoder.reset`); the per-worker checksums (the verify
path) compare the engine with the full tensors after a delta as after a full sync.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from vime.weight_sync.buckets import Bucket, plan_buckets

INDICES = "::indices"
VALUES = "::values"

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (NaN, -0.0 and +0.0 compare apart)."""
    return tensor.contiguous().view(_BITS[tensor.element_size()])


class _Changed:
    """Which elements of `new` differ from `old` in their bits (flat, same dtype).

    On CPU by NumPy, in chunks spread over the machine's cores (`_pool`; NumPy releases the GIL),
    each chunk compared in blocks whose mask stays in the core's cache: one pass reads both
    copies once and finds the changed elements' indices (`_chunk_changes`). A chunk (or one of
    its blocks) with more than `dense_fraction` of its elements changed stops collecting indices
    (the tensor is then most likely sent whole); `take` finds them if it goes sparse after all."""

    def __init__(self, new: torch.Tensor, old: torch.Tensor, dense_fraction: float = 1.0):
        self.new, self.old = new, old
        self.on_cpu = new.device.type == "cpu" and old.device.type == "cpu"
        if self.on_cpu:
            new_bits, old_bits = bits(new).numpy(), bits(old).numpy()
            self._chunks = _chunks(new_bits.size)

            def chunk(c: tuple[int, int]) -> tuple[int, np.ndarray | None]:
                return _chunk_changes(new_bits, old_bits, *c, dense_fraction)

            self._found = list(_pool().map(chunk, self._chunks))
            self.count = sum(count for count, _ in self._found)
        else:
            self._mask_t = bits(new) != bits(old)
            self.count = int(self._mask_t.sum())

    def take(self, index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values) of the changed elements; `old` is updated to `new` at them."""
        if self.on_cpu:
            new_bits, old_bits = bits(self.new).numpy(), bits(self.old).numpy()
            numpy_index = _NUMPY_INDEX[index_dtype]

            def chunk(item: tuple[tuple[int, int], tuple]) -> tuple[np.ndarray, np.ndarray]:
                (start, end), (_, where) = item
                if where is None:  # collecting stopped: a denser chunk
                    _, where = _chunk_changes(new_bits, old_bits, start, end, 1.0)
                    assert where is not None
                values = new_bits[where]
                old_bits[where] = values  # old's storage: the last-sent copy now equals new
                return where.astype(numpy_index), values

            parts = list(_pool().map(chunk, zip(self._chunks, self._found, strict=True)))
            indices = np.concatenate([where for where, _ in parts])
            values = np.concatenate([values for _, values in parts])
            return torch.from_numpy(indices), torch.from_numpy(values).view(self.new.dtype)
        where_t = torch.nonzero(self._mask_t).squeeze(1)
        values_t = self.new[where_t]
        self.old[where_t] = values_t
        return where_t.to(index_dtype), values_t


CHUNK_ELEMENTS = 1 << 22  # per task of the compare: large enough to amortise a task's overhead
BLOCK_ELEMENTS = 1 << 18  # per compare within a chunk: its 256 KiB mask stays in the L2 cache


def _chunk_changes(
    new_bits: np.ndarray, old_bits: np.ndarray, start: int, end: int, dense_fraction: float
) -> tuple[int, np.ndarray | None]:
    """(count, flat indices) of the elements in [start, end) whose bits differ; indices None
    once more than `dense_fraction` of the chunk's elements, or of one block's, changed (only
    counted from there)."""
    mask: np.ndarray = np.empty(BLOCK_ELEMENTS, dtype=np.bool_)
    limit = dense_fraction * (end - start)
    count = 0
    found: list[np.ndarray] | None = []
    for block in range(start, end, BLOCK_ELEMENTS):
        stop = min(block + BLOCK_ELEMENTS, end)
        changed = np.not_equal(new_bits[block:stop], old_bits[block:stop], out=mask[: stop - block])
        in_block = int(np.count_nonzero(changed))
        count += in_block
        if count > limit or in_block > dense_fraction * (stop - block):
            found = None  # most likely sent whole: `take` searches again if not
        if found is None or not in_block:
            continue
        sparse = in_block < SPARSE_BLOCK_FRACTION * (stop - block)
        found.append((_flat_nonzero(changed) if sparse else np.flatnonzero(changed)) + block)
    if found is None:
        return count, None
    return count, np.concatenate(found) if found else np.empty(0, dtype=np.int64)


SPARSE_BLOCK_FRACTION = 0.03  # below it a block's indices are found by its mask's 8-byte words


def _flat_nonzero(mask: np.ndarray) -> np.ndarray:
    """np.flatnonzero(mask) for a bool mask with few set, 2.5x faster: the mask's 8-byte words
    find the groups of 8 with any set, and only those groups are searched."""
    whole = mask.size // 8 * 8
    words = mask[:whole].view(np.uint64)
    groups = np.flatnonzero(words != 0)
    within = np.flatnonzero(words[groups].view(np.bool_))
    where = groups[within >> 3] * 8 + (within & 7)
    if whole < mask.size:
        where = np.concatenate([where, whole + np.flatnonzero(mask[whole:])])
    return where


def _chunks(numel: int) -> list[tuple[int, int]]:
    return [
        (start, min(start + CHUNK_ELEMENTS, numel)) for start in range(0, numel, CHUNK_ELEMENTS)
    ]


MAX_COMPARE_THREADS = 8  # memory bandwidth, not cores, bounds the compare beyond a few threads


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """The compare's threads, made once and kept: one per core of the machine, up to
    MAX_COMPARE_THREADS, each allowed on every core of this process's cpuset. A trainer pinned
    to its own core (trainer.cpu_cores) borrows the engines' cores: during a sync the engines
    are paused, and a delta is encoded before any bucket reaches them."""
    cores = os.cpu_count() or 1

    def unpin() -> None:
        try:  # the kernel keeps the thread within the cpuset; this only lifts our own pinning
            os.sched_setaffinity(0, range(cores))
        except (AttributeError, OSError):
            pass

    return ThreadPoolExecutor(
        max_workers=min(cores, MAX_COMPARE_THREADS),
        thread_name_prefix="vime-delta",
        initializer=unpin,
    )


_NUMPY_INDEX = {torch.int32: np.int32, torch.int64: np.int64}


def scatter(target: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """target[indices] = values for a flat contiguous `target` (NumPy on CPU: no int64 copy of
    int32 indices, 3x faster than torch's index_put there)."""
    if target.device.type == "cpu" and values.device.type == "cpu":
        bits(target).numpy()[indices.numpy()] = bits(values).numpy()
    else:
        target[indices.long()] = values


@dataclass
class DeltaStats:
    """What one stage's sync sent, against what a full sync would have."""

    elements: int = 0
    changed: int = 0
    full_bytes: int = 0
    sent_bytes: int = 0
    dense: int = 0  # tensors sent whole (most of them changed)
    sparse: int = 0  # tensors sent as indices + values
    unchanged: int = 0  # tensors not sent at all
    names: list[str] = field(default_factory=list, repr=False)

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements if self.elements else 0.0


class DeltaEncoder:
    """The last-sent copy of one stage's HF tensors, and the delta of new ones against it."""

    def __init__(self) -> None:
        self._last: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        """The engines' weights are unknown (first sync, reconnect, failure): send in full."""
        self._last.clear()

    def remember(self, name: str, tensor: torch.Tensor) -> None:
        """A full sync sent `tensor` under `name`."""
        kept = self._last.get(name)
        if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype:
            self._last[name] = tensor.detach().clone().contiguous()
        else:
            kept.copy_(tensor)

    def encode(
        self, name: str, tensor: torch.Tensor, stats: DeltaStats
    ) -> list[tuple[str, torch.Tensor]]:
        """The entries that bring the engines from the last-sent `name` to `tensor`, cheapest
        first: [] (unchanged), sparse (indices, values) or dense ([(name, tensor)]); the
        last-sent copy then equals `tensor`."""
        old = self._last.get(name)
        if old is None or old.shape != tensor.shape or old.dtype != tensor.dtype:
            raise ValueError(f"delta sync: {name!r} was not sent before in this shape and dtype")
        numel, size = tensor.numel(), tensor.element_size()
        stats.elements += numel
        stats.full_bytes += numel * size
        flat_old = old.view(-1)
        flat_new = tensor.detach().contiguous().view(-1)
        index_dtype = torch.int32 if numel < 2**31 else torch.int64
        # More than this share changed: the indices would cost more than the tensor.
        dense_fraction = size / (index_dtype.itemsize + size)
        changed = _Changed(flat_new, flat_old, dense_fraction)
        stats.changed += changed.count
        if changed.count == 0:
            stats.unchanged += 1
            return []
        sparse_bytes = changed.count * (index_dtype.itemsize + size)
        if sparse_bytes < numel * size:
            indices, values = changed.take(index_dtype)
            stats.sparse += 1
            stats.sent_bytes += sparse_bytes
            return [(name + INDICES, indices), (name + VALUES, values)]
        flat_old.copy_(flat_new)
        stats.dense += 1
        stats.sent_bytes += numel * size
        return [(name, tensor)]

    def buckets(
        self, tensors: dict[str, torch.Tensor], cap: int, alignment: int
    ) -> tuple[list[Bucket], dict[str, torch.Tensor], DeltaStats]:
        """The delta of one stage's `tensors` as "delta" buckets of at most `cap` bytes, then an
        empty "commit"; the entries to pack into them; what it saved."""
        stats = DeltaStats()
        entries: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            entries.update(self.encode(name, tensor, stats))
        specs = [(name, t.dtype, tuple(t.shape)) for name, t in entries.items()]
        buckets = [replace(b, mode="delta") for b in plan_buckets(specs, cap, alignment)]
        commit = Bucket(
            index=len(buckets), tensors=(), nbytes=0, mode="commit", commit_names=tuple(tensors)
        )
        buckets.append(commit)
        return buckets, entries, stats


class Baseline:
    """Engine side, one per worker: the tensors of the last full sync, patched by every delta.

    `store` keeps a full bucket's tensors (copies: the bucket's buffer is reused by a later sync),
    `patch` applies a delta bucket's entries (a sparse entry's indices and values may arrive in
    different buckets), `tensors` is what a commit loads. Any delta that cannot be applied, or an
    update that ends without its commit, makes the baseline invalid until the next full sync.
    """

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self._indices: dict[str, torch.Tensor] = {}  # sparse entries waiting for their values
        self.valid = False
        self.open_delta = False  # delta buckets arrived in this update, not yet committed

    def start(self) -> None:
        """A weight update begins."""
        if self.open_delta:  # the previous update ended without its commit
            self.valid = False
        self.open_delta = False
        self._indices.clear()

    def invalidate(self) -> None:
        """An update failed on this worker: only a full sync makes the baseline known again."""
        self.valid = False
        self.open_delta = False
        self._indices.clear()

    def store(self, entries: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in entries:
            kept = self._tensors.get(name)
            if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype:
                self._tensors[name] = tensor.detach().clone()
            else:
                kept.copy_(tensor)
        self.valid = True
        self.open_delta = False  # a full sync supersedes a delta left open in this update

    def patch(self, entries: list[tuple[str, torch.Tensor]]) -> None:
        if not self.valid:
            self.open_delta = True
            raise ValueError(
                "delta bucket without a valid baseline on this worker (restarted, or a delta "
                "failed before): the trainer must send a full sync"
            )
        self.open_delta = True
        for name, tensor in entries:
            if name.endswith(INDICES):
                self._indices[name.removesuffix(INDICES)] = tensor
                continue
            if name.endswith(VALUES):
                base = name.removesuffix(VALUES)
                indices = self._indices.pop(base, None)
                target = self._tensors.get(base)
                if indices is None or target is None or target.dtype != tensor.dtype:
                    self.valid = False
                    raise ValueError(f"delta bucket: {name!r} has no indices or no baseline")
                scatter(target.view(-1), indices, tensor)
                continue
            target = self._tensors.get(name)
            if target is None or target.shape != tensor.shape or target.dtype != tensor.dtype:
                self.valid = False
                raise ValueError(f"delta bucket: {name!r} does not replace a baseline tensor")
            target.copy_(tensor)

    @property
    def whole(self) -> bool:
        """The tensors are one synced version, whole (no delta half-applied)."""
        return self.valid and not self.open_delta

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors as they stand (read-only use: a peer copy sends them to a joining engine)."""
        return dict(self._tensors)

    def commit(self, names: tuple[str, ...]) -> list[tuple[str, torch.Tensor]]:
        """The patched baseline's tensors `names` (one sender's pipeline stage), to load; that
        stage's delta is complete. With several stages each commits its own tensors: loading
        another stage's again would reach layers the update already finished."""
        missing = sorted(set(names) - set(self._tensors))
        if self._indices or not self.valid or missing:
            self.valid = False
            raise ValueError(
                f"delta commit with sparse entries missing values: {sorted(self._indices)}"
                if not missing
                else f"delta commit of tensors the baseline lacks: {missing[:10]}"
            )
        self.open_delta = False
        return [(name, self._tensors[name]) for name in names]
