"""Packing's compiled loops: best-fit and first-fit decreasing, exact row filling, spreading over a
number of rows (longest processing time), grouping by row.

Each runs over sizes already sorted in decreasing order (numba, cached on disk): best-fit in O(n) plus
O(1) word operations per item through a two-level bitmap, first-fit in O(n log rows) through a segment
tree, row filling by subset sum on bitsets (see :func:`fill_rows`), spreading in O(n) plus the mean load
through a bucket queue over loads (see :func:`spread_rows`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from smart_batching.planners._kernels import empty

_U64 = np.uint64
_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
# _CTZ_TABLE[((x & -x) * _DEBRUIJN) >> 58] is the index of the lowest set bit of x.
_CTZ_TABLE = np.zeros(64, dtype=np.int64)
with np.errstate(over="ignore"):  # the multiplication wraps modulo 2**64 by design
    for _i in range(64):
        _CTZ_TABLE[((np.uint64(1) << np.uint64(_i)) * _DEBRUIJN) >> np.uint64(58)] = _i
del _i


@njit(cache=True, nogil=True, inline="always")
def _ctz(x, table):  # pragma: no cover - compiled
    low = x & (~x + _U64(1))
    return table[(low * _DEBRUIJN) >> _U64(58)]


@njit(cache=True, nogil=True, inline="always")
def _set_bit(l0, l1, v):  # pragma: no cover - compiled
    w = v >> 6
    l0[w] |= _U64(1) << _U64(v & 63)
    l1[w >> 6] |= _U64(1) << _U64(w & 63)


@njit(cache=True, nogil=True, inline="always")
def _clear_bit(l0, l1, v):  # pragma: no cover - compiled
    w = v >> 6
    l0[w] &= ~(_U64(1) << _U64(v & 63))
    if l0[w] == _U64(0):
        l1[w >> 6] &= ~(_U64(1) << _U64(w & 63))


@njit(cache=True, nogil=True)
def _next_set(l0, l1, v, table):  # pragma: no cover - compiled
    """Smallest set value ≥ v in a two-level bitmap, or -1."""
    w = v >> 6
    if w >= l0.shape[0]:
        return -1
    m = l0[w] & (~_U64(0) << _U64(v & 63))
    if m != _U64(0):
        return w * 64 + _ctz(m, table)
    w += 1
    w1 = w >> 6
    if w1 >= l1.shape[0]:
        return -1
    m1 = l1[w1] & (~_U64(0) << _U64(w & 63)) if (w & 63) else l1[w1]
    while m1 == _U64(0):
        w1 += 1
        if w1 >= l1.shape[0]:
            return -1
        m1 = l1[w1]
    w = w1 * 64 + _ctz(m1, table)
    return w * 64 + _ctz(l0[w], table)


_NO_ROWS = np.zeros(0, dtype=np.int64)  # best-fit-decreasing: best fit into no given rows


def best_fit_decreasing(sizes: np.ndarray, capacity: int, table: np.ndarray) -> tuple[np.ndarray, int]:
    """Best-fit over sizes sorted in decreasing order: each item goes to the fullest row it fits.

    Rows are kept in buckets by remaining capacity, with a two-level bitmap over the buckets, so
    "the fullest row that fits" is found in O(1) word operations for capacities up to 262,143.

    Returns:
        (row_of, num_rows): (n,) row index of each item (rows numbered in opening order), row count.
    """
    return best_fit_into(sizes, capacity, _NO_ROWS, table)


def best_fit_into(
    sizes: np.ndarray, capacity: int, room: np.ndarray, table: np.ndarray
) -> tuple[np.ndarray, int]:
    """Best-fit decreasing into rows that already hold something: ``room`` (rows,) is each row's free
    tokens (0 to ``capacity``); each item (sizes decreasing) goes to the fullest row it fits, or opens a
    row after them. Returns ``(row_of, num_rows)``, rows numbered from 0 (the given ones first)."""
    n = sizes.shape[0]
    row_of = empty(n)
    return row_of, _best_fit_into(sizes, capacity, room, table, row_of, empty(n + room.shape[0] + 1))


@njit(cache=True, nogil=True)
def _best_fit_into(sizes, capacity, room, table, row_of, nxt):  # pragma: no cover - compiled
    """:func:`best_fit_into` (and :func:`best_fit_decreasing`, no given rows) into ``row_of``; ``nxt`` is
    scratch of n + rows + 1 (next row in the same remaining-capacity bucket). Returns the row count."""
    head = np.full(capacity + 1, -1, dtype=np.int64)  # first row in each remaining-capacity bucket
    nw0 = (capacity + 64) // 64
    l0 = np.zeros(nw0, dtype=np.uint64)
    l1 = np.zeros((nw0 + 63) // 64, dtype=np.uint64)
    num_rows = room.shape[0]
    for row in range(num_rows):
        rem = room[row]
        nxt[row] = head[rem]
        head[rem] = row
        _set_bit(l0, l1, rem)
    for i in range(sizes.shape[0]):
        s = sizes[i]
        r = _next_set(l0, l1, s, table)
        if r < 0:
            row = num_rows
            num_rows += 1
            rem = capacity - s
        else:
            row = head[r]
            head[r] = nxt[row]
            if head[r] < 0:
                _clear_bit(l0, l1, r)
            rem = r - s
        row_of[i] = row
        nxt[row] = head[rem]
        head[rem] = row
        _set_bit(l0, l1, rem)
    return num_rows


def spread_rows(sizes: np.ndarray, num_rows: int) -> tuple[np.ndarray, int]:
    """Longest-processing-time over sizes sorted in decreasing order: each item goes to the emptiest of
    ``num_rows`` rows; among rows of equal load, to the one that reached that load first (rows start
    empty in the order 0, 1, ...). O(n + total / num_rows + largest size).

    The first ``num_rows`` items open one row each and every later round tops the emptiest rows up, so
    each row holds about one item of every stretch of ``num_rows`` consecutive sizes: long and short
    together, with loads within the last item placed of each other.

    A bucket queue over loads rather than a heap: the emptiest row's load never falls (the row taken
    grows by its item, the others keep theirs), so a pointer to the lowest non-empty bucket only moves
    forward, and no load passes ``total // num_rows + sizes[0]`` (the row taken holds at most the mean).
    Rows of one load wait in a first-in first-out list.

    Returns:
        (row_of, max_load): (n,) row of each item, and the largest row's tokens.
    """
    n = sizes.shape[0]
    if num_rows < 1:
        raise ValueError(f"spread_rows needs at least one row, got num_rows={num_rows}")
    span = (int(sizes.sum()) // num_rows + int(sizes[0]) + 1) if n else 1
    if span > MAX_SPREAD_SPAN:
        raise ValueError(
            f"spread_rows: a mean load of {span:,} tokens per row is more than the bucket queue holds "
            f"({MAX_SPREAD_SPAN:,}); spread over more rows (num_rows={num_rows})"
        )
    row_of = empty(n)
    head = np.full(span, -1, dtype=np.int64)  # (span,) first row of each load, -1: none
    tail = np.full(span, -1, dtype=np.int64)  # (span,) last row of each load
    nxt = empty(num_rows)  # (num_rows,) the row after each in its load's list
    return row_of, int(_spread_rows(sizes, num_rows, row_of, head, tail, nxt))


MAX_SPREAD_SPAN = 1 << 26
"""Most loads :func:`spread_rows`'s bucket queue spans (512 MiB of lists); ``packed`` spreads over rows
of at most :data:`~smart_batching.planners.packed.MAX_CAPACITY` tokens on average."""


@njit(cache=True, nogil=True)
def _spread_rows(sizes, num_rows, row_of, head, tail, nxt):  # pragma: no cover - compiled
    """:func:`spread_rows` into ``row_of``; ``head``/``tail`` hold each load's list of rows (-1 when
    empty), ``nxt`` links them. Returns the largest load."""
    for r in range(num_rows - 1):
        nxt[r] = r + 1
    nxt[num_rows - 1] = -1
    head[0] = 0
    tail[0] = num_rows - 1
    low = 0  # the emptiest rows' load
    top = 0
    for i in range(sizes.shape[0]):
        while head[low] < 0:
            low += 1
        row = head[low]
        head[low] = nxt[row]
        if head[low] < 0:
            tail[low] = -1
        grown = low + sizes[i]
        row_of[i] = row
        if grown > top:
            top = grown
        nxt[row] = -1
        if tail[grown] < 0:
            head[grown] = row
        else:
            nxt[tail[grown]] = row
        tail[grown] = row
    return top


@njit(cache=True, nogil=True)
def tail_count(sizes, share):  # pragma: no cover - compiled
    """How many of the shortest ``sizes`` (sorted in decreasing order) hold less than ``share`` of the
    tokens together: the largest t with sizes[n - t:].sum() < share * sizes.sum(). O(n)."""
    n = sizes.shape[0]
    total = 0
    for i in range(n):
        total += sizes[i]
    goal = share * total
    acc = 0
    t = 0
    while t < n and acc + sizes[n - 1 - t] < goal:
        acc += sizes[n - 1 - t]
        t += 1
    return t


@njit(cache=True, nogil=True)
def row_loads(row_of, sizes, num_rows):  # pragma: no cover - compiled
    """(num_rows,) int64 tokens of each row: ``np.bincount(row_of, sizes, num_rows)`` in integers."""
    loads = np.zeros(num_rows, dtype=np.int64)
    for i in range(row_of.shape[0]):
        loads[row_of[i]] += sizes[i]
    return loads


def first_fit_decreasing(sizes: np.ndarray, capacity: int, max_rows: int) -> tuple[np.ndarray, int]:
    """First-fit over sizes sorted in decreasing order: each item goes to the first row it fits.

    A max-segment-tree over ``max_rows`` row slots (unopened rows hold the full capacity) finds the
    leftmost row with enough room in O(log rows).
    """
    row_of = empty(sizes.shape[0])
    return row_of, _first_fit_decreasing(sizes, capacity, max_rows, row_of)


@njit(cache=True, nogil=True)
def _first_fit_decreasing(sizes, capacity, max_rows, row_of):  # pragma: no cover - compiled
    """:func:`first_fit_decreasing` into ``row_of``; returns the row count."""
    n = sizes.shape[0]
    size = 1
    while size < max_rows:
        size *= 2
    tree = np.full(2 * size, capacity, dtype=np.int64)
    num_rows = 0
    for i in range(n):
        s = sizes[i]
        node = 1
        while node < size:
            node = 2 * node if tree[2 * node] >= s else 2 * node + 1
        row = node - size
        row_of[i] = row
        if row + 1 > num_rows:
            num_rows = row + 1
        tree[node] -= s
        node //= 2
        while node >= 1:
            a = tree[2 * node]
            b = tree[2 * node + 1]
            tree[node] = a if a > b else b
            node //= 2
    return num_rows


def group_by_row(
    row_of: np.ndarray, num_rows: int, ids: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Counting sort of items by row, items of a row in input order.

    Returns:
        ``(ids_by_row, sizes_by_row, row_offsets)``: ``ids`` and ``sizes`` regrouped by row, and
        (num_rows + 1,) offsets.
    """
    n = row_of.shape[0]
    out_ids, out_sizes = empty(n), empty(n)
    return out_ids, out_sizes, _group_by_row(row_of, num_rows, ids, sizes, out_ids, out_sizes)


@njit(cache=True, nogil=True)
def _group_by_row(row_of, num_rows, ids, sizes, out_ids, out_sizes):  # pragma: no cover - compiled
    """:func:`group_by_row` into ``out_ids`` and ``out_sizes``; returns the row offsets."""
    n = row_of.shape[0]
    offsets = np.zeros(num_rows + 1, dtype=np.int64)
    for i in range(n):
        offsets[row_of[i] + 1] += 1
    for r in range(num_rows):
        offsets[r + 1] += offsets[r]
    fill = offsets[:-1].copy()
    for i in range(n):
        r = row_of[i]
        out_ids[fill[r]] = ids[i]
        out_sizes[fill[r]] = sizes[i]
        fill[r] += 1
    return offsets


@njit(cache=True, nogil=True)
def _shift_or(src, dst, shift, nwords):  # pragma: no cover - compiled
    """dst |= src << shift over little-endian multiword bitsets of nwords words."""
    q = shift >> 6
    b = shift & 63
    if b == 0:
        for w in range(nwords - 1, q - 1, -1):
            dst[w] |= src[w - q]
    else:
        for w in range(nwords - 1, q, -1):
            dst[w] |= (src[w - q] << _U64(b)) | (src[w - q - 1] >> _U64(64 - b))
        dst[q] |= src[0] << _U64(b)


@njit(cache=True, nogil=True, inline="always")
def _bit(bits, v):  # pragma: no cover - compiled
    return (bits[v >> 6] >> _U64(v & 63)) & _U64(1)


@njit(cache=True, nogil=True)
def _next_left(parent, d):  # pragma: no cover - compiled
    """First distinct size at index ≥ d with items left (``nd`` when none): union-find with path halving
    over exhausted sizes, each pointing past itself."""
    while parent[d] != d:
        parent[d] = parent[parent[d]]
        d = parent[d]
    return d


@njit(cache=True, nogil=True)
def _first_at_most(vals, lo, hi, r):  # pragma: no cover - compiled
    """First index in [lo, hi) with vals[i] ≤ r over descending vals (hi when none): binary search."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if vals[mid] > r:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True, nogil=True)
def _highest_at_most(bits, v):  # pragma: no cover - compiled
    """Highest set bit ≤ v of a multiword bitset, word by word (0 when none: bit 0 is always set)."""
    w = v >> 6
    m = bits[w] & (~_U64(0) >> _U64(63 - (v & 63)))
    while m == _U64(0) and w > 0:
        w -= 1
        m = bits[w]
    if m == _U64(0):
        return 0
    hi = 63
    while not (m >> _U64(hi)) & _U64(1):
        hi -= 1
    return w * 64 + hi


def fill_rows(sizes: np.ndarray, capacity: int, window: int) -> tuple[np.ndarray, int]:
    """Row-by-row exact filling by subset sum (see :func:`_fill_rows`): ``(row_of, num_rows)``."""
    row_of = np.zeros(sizes.shape[0], dtype=np.int64)
    return row_of, _fill_rows(sizes, capacity, window, row_of)


@njit(cache=True, nogil=True)
def _fill_rows(sizes, capacity, window, row_of):  # pragma: no cover - compiled
    """Row-by-row exact filling ("minimum bin slack" by subset sum) over sizes sorted decreasing.

    Each row takes the longest example left, then the multiset of remaining examples that fills the rest
    of the row most exactly. The subset sum runs on bitsets over the *distinct* sizes with their counts,
    adding sizes from the longest down and stopping as soon as the row can be filled exactly, so a row
    costs a few word operations per distinct size. Preferring long examples keeps the short ones for
    the last rows, where they close the gaps. Zero-length items go to the first row.

    Distinct sizes that fit a gap are found by binary search and those with no item left are skipped
    through a union-find, so a row costs O(log d) plus its subset sum, not O(d) over all d distinct
    sizes; the subset-sum layers grow on demand (memory O(layers used × gap / 64 words)).

    Fills ``row_of`` (zeros on entry) and returns the row count.
    """
    n = sizes.shape[0]
    # Distinct sizes, descending, with the run of items holding each: sizes[run_start[d]:run_end[d]].
    nd = 0
    for i in range(n):
        if i == 0 or sizes[i] != sizes[i - 1]:
            nd += 1
    vals = np.empty(nd, dtype=np.int64)
    nxt_item = np.empty(nd, dtype=np.int64)  # next unassigned item of each size
    run_end = np.empty(nd, dtype=np.int64)
    d = -1
    for i in range(n):
        if i == 0 or sizes[i] != sizes[i - 1]:
            d += 1
            vals[d] = sizes[i]
            nxt_item[d] = i
        run_end[d] = i + 1
    nwords = (capacity + 64) // 64
    log_cap = 1
    while (1 << log_cap) <= capacity:
        log_cap += 1
    max_layers = nd * log_cap + 1  # binary splitting gives each size at most log2(capacity) + 1 layers
    num_layers = min(max_layers, 64)
    layers = np.zeros((num_layers, nwords), dtype=np.uint64)
    layer_size = np.empty(max_layers, dtype=np.int64)  # distinct-size index of each layer
    layer_copies = np.empty(max_layers, dtype=np.int64)  # copies of that size the layer adds
    num_rows = 0
    top = 0  # first distinct size with items left
    left = n
    zero_items = 0
    if nd > 0 and vals[nd - 1] == 0:
        zero_items = run_end[nd - 1] - nxt_item[nd - 1]
        left -= zero_items
        nd -= 1  # zero-length items are placed at the end
    parent = np.arange(nd + 1)  # parent[d] == d while size d has items left; nd is the sentinel
    while left > 0:
        top = _next_left(parent, top)
        row = num_rows
        num_rows += 1
        row_of[nxt_item[top]] = row
        nxt_item[top] += 1
        if nxt_item[top] == run_end[top]:
            parent[top] = top + 1
        left -= 1
        r = capacity - vals[top]
        # Greedy: longest example that fits, while the gap is wider than the exact-fill window.
        dd = top
        while r > window and left > 0:
            dd = _next_left(parent, _first_at_most(vals, dd, nd, r))
            if dd == nd:
                break
            row_of[nxt_item[dd]] = row
            nxt_item[dd] += 1
            if nxt_item[dd] == run_end[dd]:
                parent[dd] = dd + 1
            left -= 1
            r -= vals[dd]
        nw = (r + 64) // 64  # words that hold bits 0..r
        # Subset sum over the remaining sizes ≤ r, longest first, until r is reachable. A size with k
        # copies enters as 0/1 layers of 1, 2, 4, ... copies (binary splitting): O(log k) shifts.
        for w in range(nw):
            layers[0, w] = _U64(0)
        layers[0, 0] = _U64(1)
        nl = 0
        found = False
        dd = _next_left(parent, _first_at_most(vals, top, nd, r))
        while dd < nd:
            avail = run_end[dd] - nxt_item[dd]
            v = vals[dd]
            k = min(avail, r // v)
            piece = 1
            while k > 0 and not found:
                p = piece if piece < k else k
                k -= p
                piece *= 2
                if nl + 1 >= num_layers:
                    if num_layers >= max_layers:
                        break
                    num_layers = min(max_layers, 2 * num_layers)
                    grown = np.zeros((num_layers, nwords), dtype=np.uint64)
                    grown[: nl + 1] = layers[: nl + 1]
                    layers = grown
                cur = layers[nl + 1]
                for w in range(nw):
                    cur[w] = layers[nl, w]
                _shift_or(layers[nl], cur, p * v, nw)
                layer_size[nl] = dd
                layer_copies[nl] = p
                nl += 1
                if _bit(cur, r):
                    found = True
            if found:
                break
            dd = _next_left(parent, dd + 1)
        # Best reachable total ≤ r.
        t = r if found else _highest_at_most(layers[nl], r)
        # Backtrack from the last layer: take a layer only when the total is not reachable without it,
        # so the shorter sizes (added last) are used as little as possible.
        for li in range(nl - 1, -1, -1):
            if t == 0:
                break
            if _bit(layers[li], t):
                continue
            dd = layer_size[li]
            c = layer_copies[li]
            for _k in range(c):
                row_of[nxt_item[dd]] = row
                nxt_item[dd] += 1
            if nxt_item[dd] == run_end[dd]:
                parent[dd] = dd + 1
            left -= c
            t -= c * vals[dd]
    if zero_items and num_rows == 0:
        num_rows = 1
    return num_rows
