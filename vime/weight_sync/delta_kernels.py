"""The delta's loops over every element, compiled (numba, `nogil`: several threads run them).

`diff_chunk` (sender): one pass over a chunk of the two copies, read as 8-byte words where both
are aligned alike. A word whose bits differ is searched element by element; every changed
element's flat index and new value are collected, and the old copy takes the new word. So one
read of both copies finds the changes and brings the last-sent copy up to date (NumPy took a
compare, a count, an index search, and a gather and scatter over the changes: about 1.5x the
time, `docs/benchmarks.md`).

A tensor with more than its dense share changed is sent whole, so collecting its changes would be
wasted: the chunks of one tensor add their counts into one shared cell every block of words, and
all of them stop collecting once the cell passes the tensor's limit. The cell is updated without
a lock, so it can only undercount (a lost update): the stop is never wrong, only sometimes late.

`scatter_span` (engine worker): a delta's values written at their indices, each index checked
against the target's size (the indices arrive from another process).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
import numpy as np

WORDS_PER_BLOCK = 1 << 14  # between two updates of the shared count


def _compiled(function: Callable[..., Any]) -> Any:
    """`function` compiled without the GIL, cached on disk by numba (next to this file, else in
    NUMBA_CACHE_DIR or the user's cache); where no cache directory is writable, compiled once
    per process instead (numba refuses cache=True there)."""
    try:
        return numba.njit(nogil=True, cache=True)(function)
    except RuntimeError:
        return numba.njit(nogil=True)(function)


@_compiled
def _elements(new, old, lo, hi, indices, values, k, collecting):  # pragma: no cover - compiled
    count = 0
    for i in range(lo, hi):
        if new[i] != old[i]:
            old[i] = new[i]
            count += 1
            if collecting:
                indices[k] = i
                values[k] = new[i]
                k += 1
    return k, count


@_compiled
def diff_chunk(
    new, old, new_words, old_words, first, start, end, indices, values, shared, limit
):  # pragma: no cover - compiled
    """Elements [start, end) of the flat integer arrays `new` and `old`: each that differs is
    counted, collected into `indices`/`values` (room for end - start) while collecting, and set
    in `old`. `new_words`/`old_words` are the same memory as 8-byte words, word w holding
    elements first + w * lanes ... + lanes - 1, lanes = 8 // the element size (empty: elements
    only). Returns (collected, changed, still collecting)."""
    lanes = 8 // new.itemsize
    n_words = new_words.size
    w0 = 0 if start <= first else min(n_words, (start - first + lanes - 1) // lanes)
    w1 = 0 if end <= first else min(n_words, (end - first) // lanes)
    if w1 < w0:
        w1 = w0
    collecting = shared[0] <= limit
    head_end = min(end, first + w0 * lanes) if w1 > w0 else end
    k, count = _elements(new, old, start, head_end, indices, values, 0, collecting)
    reported = 0
    w = w0
    while w < w1:
        stop = min(w + WORDS_PER_BLOCK, w1)
        for j in range(w, stop):
            if new_words[j] != old_words[j]:
                base = first + j * lanes
                for e in range(base, base + lanes):
                    if new[e] != old[e]:
                        count += 1
                        if collecting:
                            indices[k] = e
                            values[k] = new[e]
                            k += 1
                old_words[j] = new_words[j]
        w = stop
        shared[0] += count - reported
        reported = count
        if shared[0] > limit:
            collecting = False
    if w1 > w0:
        k, tail = _elements(
            new, old, max(start, first + w1 * lanes), end, indices, values, k, collecting
        )
        count += tail
    shared[0] += count - reported
    return k, count, collecting


def words(new: np.ndarray, old: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """(first, new_words, old_words) for `diff_chunk`: the 8-byte words both flat arrays share
    from element `first` (none where their addresses differ modulo 8)."""
    size = new.itemsize
    lanes = 8 // size
    first = (-new.ctypes.data) % 8 // size
    if (-old.ctypes.data) % 8 // size != first or new.ctypes.data % size or old.ctypes.data % size:
        empty: np.ndarray = np.empty(0, dtype=np.uint64)
        return 0, empty, empty
    n_words = max(0, (new.size - first) // lanes)
    end = first + n_words * lanes
    return first, new[first:end].view(np.uint64), old[first:end].view(np.uint64)


@_compiled
def scatter_span(target, indices, values, lo, hi):  # pragma: no cover - compiled
    """target[indices[k]] = values[k] for k in [lo, hi); returns how many indices fell outside
    the target (those are not written)."""
    size = target.size
    outside = 0
    for k in range(lo, hi):
        i = indices[k]
        if i < 0 or i >= size:
            outside += 1
            continue
        target[i] = values[k]
    return outside


def warm() -> None:
    """Compile the loops (or load them from numba's cache) for 16- and 32-bit elements with
    int32 indices, the signatures a bf16 or fp32 model's delta uses."""
    for dtype in (np.int16, np.int32):
        new: np.ndarray = np.ones(16, dtype=dtype)
        old: np.ndarray = np.zeros(16, dtype=dtype)
        first, new_words, old_words = words(new, old)
        indices: np.ndarray = np.empty(16, dtype=np.int32)
        values: np.ndarray = np.empty(16, dtype=dtype)
        shared: np.ndarray = np.zeros(1, dtype=np.int64)
        diff_chunk(new, old, new_words, old_words, first, 0, 16, indices, values, shared, 16)
        scatter_span(old, indices, values, 0, 16)
