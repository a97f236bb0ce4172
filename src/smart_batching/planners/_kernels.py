"""Compiled loops shared by the planners (numba, cached on disk): seeded permutations, counting sorts,
and laying batches out in a new order. Packing's own loops are in :mod:`._packing_kernels`.

Outputs that grow with the number of examples are allocated by numpy (:func:`empty`) and filled by
the compiled loop (``_name(..., out)`` behind a Python ``name(...)``), never allocated inside it:
numpy's large arrays get transparent huge pages, numba's do not, and at 10M examples that halves the
time of a ``packed`` plan (``tests/test_kernel_outputs.py`` holds every kernel to it).
"""

from __future__ import annotations

import numpy as np
from numba import njit

_U64 = np.uint64
# --- Randomness: splitmix64 with Lemire's unbiased bounded integers, and cache-friendly shuffles. ---
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MASK32 = np.uint64(0xFFFFFFFF)
_SMALL_RANGE = 1 << 16  # ranges up to this many items are shuffled in place (they sit in cache)


@njit(cache=True, nogil=True, inline="always")
def _next64(state):  # pragma: no cover - compiled
    state[0] += _GOLDEN
    z = state[0]
    z = (z ^ (z >> _U64(30))) * _MIX1
    z = (z ^ (z >> _U64(27))) * _MIX2
    return z ^ (z >> _U64(31))


@njit(cache=True, nogil=True, inline="always")
def _below(state, bound):  # pragma: no cover - compiled
    """Uniform integer in [0, bound) for 0 < bound < 2**32 (Lemire's multiply-shift with rejection)."""
    b = _U64(bound)
    m = (_next64(state) >> _U64(32)) * b
    low = m & _MASK32
    if low < b:
        t = (_U64(0x100000000) - b) % b
        while low < t:
            m = (_next64(state) >> _U64(32)) * b
            low = m & _MASK32
    return np.int64(m >> _U64(32))


@njit(cache=True, nogil=True)
def _shuffle_small(arr, lo, hi, state):  # pragma: no cover - compiled
    """Fisher-Yates on arr[lo:hi] in place."""
    for i in range(hi - 1, lo, -1):
        j = lo + _below(state, i - lo + 1)
        t = arr[i]
        arr[i] = arr[j]
        arr[j] = t


@njit(cache=True, nogil=True)
def _shuffle_range(arr, lo, hi, state, bucket, out):  # pragma: no cover - compiled
    """Uniformly shuffle arr[lo:hi] in place; ``bucket`` (int32) and ``out`` (arr's dtype) are scratch
    of at least ``hi - lo`` items, reused from range to range.

    Large ranges are first scattered into random buckets of about 8k items and then each bucket is
    shuffled in place: every item lands in a uniform bucket, and every bucket gets a uniform order, so
    the result is a uniform permutation, with memory traffic that streams instead of missing the cache
    at every swap.
    """
    m = hi - lo
    if m <= _SMALL_RANGE:
        _shuffle_small(arr, lo, hi, state)
        return
    nb = m >> 13
    starts = np.zeros(nb + 1, dtype=np.int64)
    for i in range(m):
        b = _below(state, nb)
        bucket[i] = b
        starts[b + 1] += 1
    for b in range(nb):
        starts[b + 1] += starts[b]
    fill = starts[:-1].copy()
    for i in range(m):
        b = bucket[i]
        out[fill[b]] = arr[lo + i]
        fill[b] += 1
    for b in range(nb):
        _shuffle_small(out, starts[b], starts[b + 1], state)
    arr[lo:hi] = out[:m]


def empty(n: int, dtype: type = np.int64) -> np.ndarray:
    """A new array for a kernel to fill, allocated by numpy rather than inside compiled code: numpy
    asks the kernel for transparent huge pages on large arrays, where first touching 80 MB costs about
    a fifth of what it costs in 4 KiB pages (12 ms against 50 ms on the 2-core EPYC of
    ``benchmarks/RESULTS.md``), and a plan of 10M examples writes several such arrays."""
    return np.empty(n, dtype=dtype)


def shuffled_permutation(n: int, seed: int) -> np.ndarray:
    """A uniformly random permutation of 0..n-1, seeded (see :func:`_shuffled_permutation`)."""
    return _shuffled_permutation(empty(n), seed)


@njit(cache=True, nogil=True)
def _shuffled_permutation(out, seed):  # pragma: no cover - compiled
    """Fill ``out`` with a uniformly random permutation of 0..len(out)-1, seeded.

    Large n: every index goes to a uniform random bucket of about 8k (the bucket draws are replayed
    from the saved generator state instead of being stored), then each bucket is shuffled in place.
    """
    n = out.shape[0]
    state = np.array([seed], dtype=np.uint64)
    if n <= _SMALL_RANGE:
        for i in range(n):
            out[i] = i
        _shuffle_small(out, 0, n, state)
        return out
    nb = n >> 13
    start_state = state[0]
    starts = np.zeros(nb + 1, dtype=np.int64)
    for _i in range(n):
        starts[_below(state, nb) + 1] += 1
    for b in range(nb):
        starts[b + 1] += starts[b]
    fill = starts[:-1].copy()
    state[0] = start_state  # replay the same bucket draws
    for i in range(n):
        b = _below(state, nb)
        out[fill[b]] = i
        fill[b] += 1
    for b in range(nb):
        _shuffle_small(out, starts[b], starts[b + 1], state)
    return out


def counting_sort_shuffled(
    values: np.ndarray, max_value: int, seed: int, descending: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Positions sorted by integer value, ascending (or descending); ties in uniformly random order, or
    in position order when seed < 0. O(n + max_value).

    Returns:
        ``(order, sorted_values)``: (n,) positions, and ``values[order]`` written run by run (no gather).
    """
    n = values.shape[0]
    order, ordered = empty(n), empty(n)
    _counting_sort_shuffled(values, max_value, seed, descending, order, ordered)
    return order, ordered


@njit(cache=True, nogil=True)
def _counting_sort_shuffled(
    values, max_value, seed, descending, order, ordered
):  # pragma: no cover - compiled
    """:func:`counting_sort_shuffled` into ``order`` and ``ordered``."""
    n = values.shape[0]
    starts = np.zeros(max_value + 2, dtype=np.int64)
    for i in range(n):
        k = max_value - values[i] if descending else values[i]
        starts[k + 1] += 1
    for k in range(max_value + 1):
        starts[k + 1] += starts[k]
    fill = starts[:-1].copy()
    for i in range(n):
        k = max_value - values[i] if descending else values[i]
        order[fill[k]] = i
        fill[k] += 1
    if seed >= 0:
        state = np.array([seed], dtype=np.uint64)
        largest = 0
        for k in range(max_value + 1):
            largest = max(largest, starts[k + 1] - starts[k])
        scratch = largest if largest > _SMALL_RANGE else 0
        bucket = np.empty(scratch, dtype=np.int32)
        out = np.empty(scratch, dtype=np.int64)
        for k in range(max_value + 1):
            if starts[k + 1] - starts[k] > 1:
                _shuffle_range(order, starts[k], starts[k + 1], state, bucket, out)
    for k in range(max_value + 1):
        v = max_value - k if descending else k
        for i in range(starts[k], starts[k + 1]):
            ordered[i] = v
    return order, ordered


@njit(cache=True, nogil=True)
def block_sources(blocks, bounds):  # pragma: no cover - compiled
    """Where the chunks ``blocks`` of ``bounds`` start, and their sizes: ``(src, size)``, each
    ``(len(blocks),)``, for :func:`copy_blocks`."""
    nb = blocks.shape[0]
    src = np.empty(nb, dtype=np.int64)
    size = np.empty(nb, dtype=np.int64)
    for k in range(nb):
        b = blocks[k]
        src[k] = bounds[b]
        size[k] = bounds[b + 1] - bounds[b]
    return src, size


def copy_blocks(
    src: np.ndarray, size: np.ndarray, column: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """``column[src[0]:src[0]+size[0]]``, then the next chunk, and so on, into one new array (or into
    ``out``, of ``size.sum()`` items of ``column``'s dtype, which must not overlap ``column``)."""
    return _copy_blocks(src, size, column, empty(int(size.sum()), column.dtype) if out is None else out)


@njit(cache=True, nogil=True)
def _copy_blocks(src, size, column, out):  # pragma: no cover - compiled
    """:func:`copy_blocks` into ``out``.

    Unsigned indices let LLVM vectorise the copy of each chunk (signed ones carry numba's
    negative-index check): fewer instructions per chunk let the CPU keep many chunks' cache misses in
    flight, which is what a gather of short chunks costs.
    """
    p = np.uint64(0)
    for k in range(src.shape[0]):
        s = np.uint64(src[k])
        m = np.uint64(size[k])
        for j in range(m):
            out[p + j] = column[s + j]
        p += m
    return out


def sort_blocks_descending(values: np.ndarray, block: int, max_value: int) -> np.ndarray:
    """Within each consecutive block of ``block`` items, positions sorted by value, descending and
    stable (a counting sort per block: O(n + num_blocks * max_value))."""
    return _sort_blocks_descending(values, block, max_value, empty(values.shape[0]))


@njit(cache=True, nogil=True)
def _sort_blocks_descending(values, block, max_value, out):  # pragma: no cover - compiled
    """:func:`sort_blocks_descending` into ``out``."""
    n = values.shape[0]
    counts = np.zeros(max_value + 2, dtype=np.int64)
    for lo in range(0, n, block):
        hi = min(lo + block, n)
        if hi - lo < 64:  # tiny block: insertion sort beats clearing the counts
            for i in range(lo, hi):
                out[i] = i
            for i in range(lo + 1, hi):
                x = out[i]
                j = i - 1
                while j >= lo and values[out[j]] < values[x]:
                    out[j + 1] = out[j]
                    j -= 1
                out[j + 1] = x
            continue
        counts[:] = 0
        for i in range(lo, hi):
            counts[max_value - values[i] + 1] += 1
        for k in range(max_value + 1):
            counts[k + 1] += counts[k]
        for i in range(lo, hi):
            k = max_value - values[i]
            out[lo + counts[k]] = i
            counts[k] += 1
    return out
