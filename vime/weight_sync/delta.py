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
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from vime.weight_sync.buckets import Bucket, plan_buckets

logger = logging.getLogger(__name__)

INDICES = "::indices"
VALUES = "::values"

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (NaN, -0.0 and +0.0 compare apart)."""
    return tensor.contiguous().view(_BITS[tensor.element_size()])


def _changes(
    new: torch.Tensor, old: torch.Tensor, limit: int, index_dtype: torch.dtype
) -> tuple[int, tuple[torch.Tensor, torch.Tensor] | None]:
    """How many elements of `new` differ from `old` in their bits (flat, same dtype), and their
    (flat indices, values) unless more than `limit` changed (the tensor then goes whole); `old`
    equals `new` afterwards either way.

    On CPU by a compiled kernel (`delta_kernels`), in chunks spread over the machine's cores
    (`_pool`): one read of both copies finds the changes and updates `old` at them."""
    if new.device.type != "cpu" or old.device.type != "cpu":
        mask = bits(new) != bits(old)
        count = int(mask.sum())
        if count > limit:
            old.copy_(new)
            return count, None
        where = torch.nonzero(mask).squeeze(1)
        values = new[where]
        old[where] = values
        return count, (where.to(index_dtype), values)
    from vime.weight_sync import delta_kernels  # compiled on first use (numba's cache: once)

    new_bits, old_bits = bits(new).numpy(), bits(old).numpy()
    first, new_words, old_words = delta_kernels.words(new_bits, old_bits)
    # The tensor's changes counted so far, by every chunk.
    shared: np.ndarray = np.zeros(1, dtype=np.int64)
    numpy_index = _NUMPY_INDEX[index_dtype]

    def chunk(span: tuple[int, int]) -> tuple[int, tuple[np.ndarray, np.ndarray] | None]:
        start, end = span  # the buffers' untouched pages cost no memory
        indices: np.ndarray = np.empty(end - start, dtype=numpy_index)
        values = np.empty(end - start, dtype=new_bits.dtype)
        found, count, whole = delta_kernels.diff_chunk(
            new_bits, old_bits, new_words, old_words, first, start, end,
            indices, values, shared, limit,
        )  # fmt: skip
        return int(count), (indices[:found], values[:found]) if whole else None

    parts = list(_pool().map(chunk, _chunks(new.numel())))
    count = sum(changed for changed, _ in parts)
    if count > limit or any(found is None for _, found in parts):
        return count, None
    indices = np.concatenate([found[0] for _, found in parts if found is not None])
    values = np.concatenate([found[1] for _, found in parts if found is not None])
    return count, (torch.from_numpy(indices), torch.from_numpy(values).view(new.dtype))


CHUNK_ELEMENTS = 1 << 22  # per task of the compare at most: a task's overhead stays small
SPLIT_ELEMENTS = 1 << 16  # a tensor this large is split over every thread of the compare
MAX_COMPARE_THREADS = 8  # memory bandwidth, not cores, bounds the compare beyond a few threads


def _chunks(numel: int) -> list[tuple[int, int]]:
    """Equal spans of a tensor's elements for the compare's threads, a multiple of them (a
    4864 x 896 weight in chunks of 4M and 0.2M would leave one thread idle), each starting on
    an 8-byte word for 8-bit elements (and so for wider ones)."""
    if numel == 0:
        return []
    parts = -(-numel // CHUNK_ELEMENTS)
    if numel >= SPLIT_ELEMENTS:
        parts = -(-parts // _threads()) * _threads()
    size = -(-numel // max(parts, 1))
    size = -(-size // 8) * 8
    return [(start, min(start + size, numel)) for start in range(0, numel, size)]


def _threads() -> int:
    """The compare's threads: one per core of the machine, up to MAX_COMPARE_THREADS."""
    return min(os.cpu_count() or 1, MAX_COMPARE_THREADS)


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """The compare's threads, made once and kept: one per core of the machine, up to
    MAX_COMPARE_THREADS, each allowed on every core of this process's cpuset. A trainer pinned
    to its own core (trainer.cpu_cores) borrows the engines' cores: a delta is encoded before
    the engines pause (weight_sync.pack_before_pause), where they may be decoding
    on them, or inside the pause before any bucket reaches them."""
    cores = os.cpu_count() or 1

    def unpin() -> None:
        try:  # the kernel keeps the thread within the cpuset; this only lifts our own pinning
            os.sched_setaffinity(0, range(cores))
        except (AttributeError, OSError):
            pass

    return ThreadPoolExecutor(
        max_workers=_threads(),
        thread_name_prefix="vime-delta",
        initializer=unpin,
    )


@functools.cache
def warm_kernels() -> None:
    """Import the delta's compiled loops and compile them (or load numba's cache) for 16- and
    32-bit elements, once per process, on a thread of their own: called at the first full sync
    a delta will build on, so the first delta does not pay ~0.5 s of it (in an engine, inside
    the pause). Not a daemon: a process that exits meanwhile waits for the compile to end (an
    interpreter torn down under numba's compiler aborts)."""

    def warm() -> None:
        try:
            from vime.weight_sync import delta_kernels

            delta_kernels.warm()
        except Exception:  # the first delta compiles instead
            logger.warning("could not compile the delta kernels ahead", exc_info=True)

    threading.Thread(target=warm, name="vime-delta-warm").start()


_NUMPY_INDEX = {torch.int32: np.int32, torch.int64: np.int64}


def scatter(target: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """target[indices] = values for a flat contiguous `target`; an index outside it raises
    ValueError. On CPU by a compiled loop over the compare's threads (a worker patching its
    baseline in the engines' pause borrows the trainer's idle core): 2.7x NumPy's fancy
    assignment on two cores, which also copies int32 indices to int64 first."""
    if indices.numel() != values.numel():
        raise ValueError(f"delta: {indices.numel()} indices for {values.numel()} values")
    if target.device.type != "cpu" or values.device.type != "cpu":
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= target.numel()):
            raise ValueError(f"delta: an index falls outside a tensor of {target.numel()}")
        target[indices.long()] = values
        return
    from vime.weight_sync import delta_kernels

    flat, where, new = bits(target).numpy(), indices.numpy(), bits(values).numpy()
    count = where.size
    if count < SPLIT_ELEMENTS:  # one span: no hand-off to the pool
        outside = delta_kernels.scatter_span(flat, where, new, 0, count)
    else:
        parts = _threads()
        cuts = [count * part // parts for part in range(parts + 1)]
        outside = sum(
            _pool().map(
                lambda p: delta_kernels.scatter_span(flat, where, new, cuts[p], cuts[p + 1]),
                range(parts),
            )
        )
    if outside:
        raise ValueError(f"delta: {outside} indices fall outside a tensor of {flat.size}")


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
        warm_kernels()
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
        # The most changes that cost fewer bytes as indices and values than the whole tensor.
        limit = (numel * size - 1) // (index_dtype.itemsize + size)
        count, found = _changes(flat_new, flat_old, limit, index_dtype)
        stats.changed += count
        if count == 0:
            stats.unchanged += 1
            return []
        if found is not None:
            stats.sparse += 1
            stats.sent_bytes += count * (index_dtype.itemsize + size)
            return [(name + INDICES, found[0]), (name + VALUES, found[1])]
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
        warm_kernels()
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
                try:
                    scatter(target.view(-1), indices, tensor)
                except ValueError as exc:
                    self.valid = False
                    raise ValueError(f"delta bucket: {name!r}: {exc}") from None
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
