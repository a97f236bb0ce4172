"""Building blocks shared by the planners: overlong policies, randomised length sorts, padded batches,
and laying a plan out once.

A planner returns :class:`PlanParts`: a :class:`~smart_batching.plan.Segments` table in the order it
planned (sorted, packed) and the :class:`~smart_batching.plan.Batches` over it, its shuffle of whole
batches left in ``batch_order``; :func:`lay_out` applies that order (and the costliest batch moved to
the front) in one compiled pass. All functions are vectorised over int64 arrays; none loops in Python
per example.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from smart_batching.errors import ConfigError, OverlongError
from smart_batching.plan import Batches, OverlongCounts, Segments, block_positions, offsets_of, zeros
from smart_batching.planners._kernels import (
    block_sources,
    copy_blocks,
    counting_sort_shuffled,
    shuffled_permutation,
    sort_blocks_descending,
)
from smart_batching.planners._spec import OVERLONG_POLICIES

_EMPTY = np.zeros(0, dtype=np.int64)


class PlanParts(NamedTuple):
    """What a planner returns (:func:`~smart_batching.planners.plan_batches` lays it out).

    Attributes:
        segments: the segments, in the order the batches cut them (``batches.order`` None) or in any
            order ``batches.order`` indexes.
        batches: the batches over them; ``batch_order`` may hold a shuffle of whole batches not yet applied.
        overlong: what the overlong policy (and ``drop_last``) left out or cut.
        capacity: tokens per packed row, for the plan's statistics (None: rows are padded).
        lower_bound_rows: fewest rows of ``capacity`` that could hold the data (packing).
        spare: int64 arrays the planner made and no longer needs, each written in full: :func:`lay_out`
            writes the laid-out columns into them instead of new arrays (first touching fresh memory
            is most of a copy's cost where the kernel gives no huge pages).
    """

    segments: Segments
    batches: Batches
    overlong: OverlongCounts
    capacity: int | None = None
    lower_bound_rows: int | None = None
    spare: tuple[np.ndarray, ...] = ()


def apply_overlong(
    lengths: np.ndarray, limit: int | None, policy: str, setting: str
) -> tuple[Segments, OverlongCounts]:
    """Apply an overlong policy to examples longer than ``limit`` tokens.

    Args:
        lengths: (num_examples,) int64 token lengths.
        limit: most tokens one segment may hold; None means no limit.
        policy: ``"error"`` (raise), ``"truncate"`` (keep the first ``limit`` tokens), ``"split"`` (cut
            into pieces of ``limit`` tokens, the last one shorter) or ``"drop"`` (leave the example out).
        setting: the name of the limit's setting, quoted in the error message.

    Returns:
        ``(segments, counts)``: the table of segments in example order, and what the policy did.
    """
    n = lengths.shape[0]
    ids = np.arange(n, dtype=np.int64)
    if limit is None:
        return Segments(ids, np.zeros(n, dtype=np.int64), lengths), OverlongCounts(None, policy)
    over = lengths > limit
    num_over = int(np.count_nonzero(over))
    if num_over == 0:
        return Segments(ids, np.zeros(n, dtype=np.int64), lengths), OverlongCounts(limit, policy)
    if policy == "error":
        first = int(np.flatnonzero(over)[0])
        raise OverlongError(
            f"{num_over} example(s) are longer than {setting}={limit} (example {first} has "
            f"{int(lengths[first])} tokens). Raise {setting}=, or choose overlong='truncate', 'split' or 'drop'."
        )
    excess = int((lengths[over] - limit).sum())
    if policy == "truncate":
        seg_len = np.minimum(lengths, limit)
        counts = OverlongCounts(limit, policy, num_over, num_over, excess)
        return Segments(ids, np.zeros(n, dtype=np.int64), seg_len), counts
    if policy == "drop":
        keep = ~over
        counts = OverlongCounts(
            limit, policy, num_over, num_dropped=num_over, dropped_tokens=int(lengths[over].sum())
        )
        return Segments(ids[keep], np.zeros(n - num_over, dtype=np.int64), lengths[keep]), counts
    if policy == "split":
        pieces = np.maximum(
            1, -(-lengths // limit)
        )  # (n,) pieces per example; a 0-length example stays whole
        seg_ids = np.repeat(ids, pieces)
        first_of = np.concatenate([[0], np.cumsum(pieces)[:-1]])
        piece_no = np.arange(seg_ids.shape[0], dtype=np.int64) - np.repeat(first_of, pieces)
        starts = piece_no * limit
        seg_len = np.minimum(lengths[seg_ids] - starts, limit)
        counts = OverlongCounts(limit, policy, num_over, num_split=num_over)
        return Segments(seg_ids, starts, seg_len), counts
    raise ConfigError(f"overlong= must be one of {', '.join(OVERLONG_POLICIES)}; got {policy!r}")


def _radix_dtype(max_value: int) -> np.dtype:
    # numpy's stable argsort is a radix sort for integers of 16 bits or fewer: O(n) instead of O(n log n).
    if max_value < 2**16:
        return np.dtype(np.uint16)
    if max_value < 2**32:
        return np.dtype(np.uint32)
    return np.dtype(np.int64)


def _seed(rng: np.random.Generator) -> int:
    return int(rng.integers(0, 2**31 - 1))


def permutation(n: int, rng: np.random.Generator) -> np.ndarray:
    """A random permutation of ``0..n-1`` drawn from ``rng`` (compiled: cache-friendly buckets, see
    :func:`~._kernels.shuffled_permutation`)."""
    return shuffled_permutation(n, _seed(rng))


# Above this many distinct key values a counting sort stops paying; fall back to numpy's sort.
_COUNTING_MAX_KEY = 1 << 22


def sort_by_length(
    lengths: np.ndarray, rng: np.random.Generator | None, *, descending: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Order of positions sorted by length, ties broken at random (or by position when rng is None).

    Returns:
        ``(order, sorted_lengths)``: (n,) int64 positions and ``lengths[order]``. Counting sort:
        O(n + longest), the sorted lengths written run by run rather than gathered.
    """
    n = lengths.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    top = int(lengths.max())
    if top <= _COUNTING_MAX_KEY:
        return counting_sort_shuffled(lengths, top, -1 if rng is None else _seed(rng), descending)
    keys = (top - lengths) if descending else lengths
    if rng is None:
        order = np.argsort(keys, kind="stable").astype(np.int64, copy=False)
    else:
        perm = permutation(n, rng)  # (n,) random tie-break
        order = perm[np.argsort(keys[perm], kind="stable")]
    return order, lengths[order]


def sort_blocks(values: np.ndarray, block: int, *, descending: bool) -> np.ndarray:
    """Within each consecutive block of ``block`` items, positions sorted by value (stable).

    Returns:
        (n,) int64 positions into ``values``. A counting sort per block, O(n + num_blocks × largest),
        where that is cheap; else numpy's stable sort per block.
    """
    n = values.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    top = int(values.max())
    down = values if descending else top - values  # the kernel sorts descending
    if top * (n // block + 1) <= 8 * n + (1 << 20):
        return sort_blocks_descending(down, block, top)
    keys = (top - down).astype(_radix_dtype(top), copy=False)  # ascending keys of the wanted order
    out = np.empty(n, dtype=np.int64)
    num_full = n // block
    cut = num_full * block
    if num_full:
        blocks = np.argsort(keys[:cut].reshape(num_full, block), axis=1, kind="stable")  # (num_full, block)
        blocks += (np.arange(num_full, dtype=np.int64) * block)[:, None]
        out[:cut] = blocks.ravel()
    if cut < n:
        out[cut:] = cut + np.argsort(keys[cut:], kind="stable")
    return out


def sort_within_windows(
    lengths: np.ndarray, rng: np.random.Generator, window: int | None, *, descending: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle, cut into windows of ``window`` positions, and sort each window by length (ties at
    random): the randomness knob of the length-aware strategies (``window=``)::

        lengths  9 2 7 4 8 1     shuffled   4 8 1 | 9 2 7     window 3, ascending   1 4 8 | 2 7 9

    Batches (or packs) cut from this order hold examples of one window, which is a fresh random draw
    every epoch: the smaller the window, the more random each batch's company, the more padding.

    Args:
        window: examples per window; None (or at least the number of examples) sorts the whole array,
            exactly as :func:`sort_by_length`.

    Returns:
        ``(order, sorted_lengths)`` as :func:`sort_by_length`. O(n) passes plus a counting sort per window.
    """
    n = lengths.shape[0]
    if window is None or window >= n:
        return sort_by_length(lengths, rng, descending=descending)
    perm = permutation(n, rng)  # (n,)
    order = perm[sort_blocks(lengths[perm], window, descending=descending)]
    return order, lengths[order]


def window_bounds(n: int, window: int | None) -> int:
    """The window size the compiled cuts take: ``window``, or one window over all ``n`` positions."""
    return max(n, 1) if window is None or window >= n else window


def fixed_offsets(n: int, size: int, *, drop_last: bool) -> np.ndarray:
    """Offsets of consecutive chunks of ``size`` over ``n`` items (the last one shorter unless dropped)."""
    num_full = n // size
    offsets = np.arange(num_full + 1, dtype=np.int64) * size
    if not drop_last and n % size:
        offsets = np.append(offsets, n)
    return offsets


def in_order(
    segments: Segments, counts: OverlongCounts, order: np.ndarray, lengths: np.ndarray | None = None
) -> Segments:
    """The table of :func:`apply_overlong` taken at ``order``; ``lengths``: ``segments.length[order]``
    when the caller has it. Where the policy cut nothing the segments are the examples, and their ids
    are ``order`` itself: no gather."""
    length = segments.length[order] if lengths is None else lengths
    if counts.num_over_limit == 0 or counts.policy == "truncate":  # ids 0..n-1, every start 0
        return Segments(order, zeros(order.shape[0]), length)
    return Segments(segments.example[order], segments.start[order], length)


def padded_parts(
    segments: Segments,
    counts: OverlongCounts,
    order: np.ndarray,
    batch_offsets: np.ndarray,
    *,
    fixed_width: int | None = None,
    ordered: np.ndarray | None = None,
    batch_order: np.ndarray | None = None,
) -> PlanParts:
    """PlanParts for strategies with one segment per row, padded to the longest (or a fixed width).

    Args:
        order: positions of ``segments`` in the order the batches cut them; positions after the last
            of ``batch_offsets`` are left out of the plan.
        ordered: ``segments.length[order]``, when the caller has it (saves a gather).
        batch_order: the strategy's shuffle of whole batches, left for :func:`lay_out` to apply.
    """
    used = int(batch_offsets[-1])
    order = order[:used]
    table = in_order(segments, counts, order, None if ordered is None else ordered[:used])
    num_batches = len(batch_offsets) - 1
    if fixed_width is not None:
        width = np.full(num_batches, fixed_width, dtype=np.int64)
    elif num_batches:
        width = np.maximum.reduceat(table.length, batch_offsets[:-1]).astype(np.int64)
    else:
        width = np.zeros(0, dtype=np.int64)
    return PlanParts(table, Batches(batch_offsets, width, batch_order=batch_order), counts)


def drop_tail(
    segments: Segments, counts: OverlongCounts, order: np.ndarray, batch_offsets: np.ndarray
) -> OverlongCounts:
    """``counts`` with the segments a ``drop_last`` left out counted as dropped examples."""
    left = order[int(batch_offsets[-1]) :]
    if left.size == 0:
        return counts
    c = counts
    return OverlongCounts(
        c.limit,
        c.policy,
        c.num_over_limit,
        c.num_truncated,
        c.truncated_tokens,
        c.num_split,
        c.num_dropped + int(np.unique(segments.example[left]).size),
        c.dropped_tokens + int(segments.length[left].sum()),
    )


def permute_batches(
    order: np.ndarray, offsets: np.ndarray, perm: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Reorder whole batches (chunks ``offsets`` of ``order``) by ``perm``, vectorised (a stream's
    buffer; whole datasets leave the order to :func:`lay_out`).

    Returns:
        ``(order, offsets)`` with batch ``k`` of the result being batch ``perm[k]`` of the input.
    """
    return order[block_positions(offsets, perm)], offsets_of(np.diff(offsets)[perm])


def lay_out(
    segments: Segments,
    batches: Batches,
    *,
    protect: np.ndarray | None = None,
    spare: tuple[np.ndarray, ...] = (),
) -> tuple[Segments, Batches]:
    """The plan laid out: the table in plan order and the batches over it (no ``order``, no ``batch_order``).

    A ``batch_order`` that only exchanges two batches of one shape (the costliest batch moved to the
    front of a plan with no shuffle left to apply) is done in place, O(batch), unless a column shares
    memory with ``protect`` (the caller's lengths); any other is one compiled pass over the segments.
    """
    bo, order = batches.batch_order, batches.order
    if bo is None:
        if order is None:
            return segments, batches
        return segments.take(order), batches._replace(order=None)
    if order is None and _swap_in_place(segments, batches, protect):
        width = batches.width.copy()
        width[bo[0]], width[0] = width[0], width[bo[0]]
        return segments, batches._replace(width=width, batch_order=None)
    if order is not None:  # a planner that cut positions of its table: take them first
        segments = segments.take(order)
    src, size = block_sources(bo, batches.bounds)
    total = int(size.sum())
    columns = [c for c in segments if c is not None]
    free = [
        a
        for a in spare
        if a.shape == (total,)
        and a.dtype == np.int64
        and a.flags.writeable
        and not any(np.may_share_memory(a, c) for c in columns)
        and (protect is None or not np.may_share_memory(a, protect))
    ]

    def copy(column: np.ndarray) -> np.ndarray:
        out = free.pop() if free and column.dtype == np.int64 else None
        return copy_blocks(src, size, column, out)

    start = segments.start
    # Every start 0 (a broadcast zero, see in_order): nothing to copy.
    start = zeros(total) if start.strides == (0,) else copy(start)
    whole = segments.example_length
    table = Segments(
        copy(segments.example),
        start,
        copy(segments.length),
        None if whole is None else copy(whole),
    )
    rows = None
    if batches.row_offsets is not None:
        rows = offsets_of(np.diff(batches.row_offsets)[block_positions(batches.batch_offsets, bo)])
    laid = Batches(offsets_of(np.diff(batches.batch_offsets)[bo]), batches.width[bo], rows)
    return table, laid


def _swap_in_place(segments: Segments, batches: Batches, protect: np.ndarray | None) -> bool:
    """Exchange stored batches 0 and ``k`` of the table in place when ``batch_order`` is exactly that
    swap and both batches have the same rows; returns whether it did."""
    bo = batches.batch_order
    moved = np.flatnonzero(bo != np.arange(bo.shape[0]))
    if moved.shape[0] != 2 or moved[0] != 0:
        return False
    k = int(moved[1])
    b_off, r_off = batches.batch_offsets, batches.row_offsets
    if b_off[1] - b_off[0] != b_off[k + 1] - b_off[k]:
        return False
    if r_off is not None and not np.array_equal(
        np.diff(r_off[b_off[0] : b_off[1] + 1]), np.diff(r_off[b_off[k] : b_off[k + 1] + 1])
    ):
        return False
    # A column with stride 0 holds one value (every start 0): nothing to exchange.
    columns = [c for c in segments if c is not None and c.strides != (0,)]
    if any(
        not c.flags.writeable or (protect is not None and np.may_share_memory(c, protect)) for c in columns
    ):
        return False
    lo, hi = (int(x) for x in batches.bounds[[k, k + 1]])
    size = hi - lo
    for c in columns:
        first = c[:size].copy()
        c[:size] = c[lo:hi]
        c[lo:hi] = first
    return True
