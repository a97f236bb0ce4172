"""Building blocks shared by the planners: overlong policies, randomised length sorts, padded batches.

All functions are vectorised over int64 arrays; none loops in Python per example.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from smart_batching.errors import ConfigError, OverlongError
from smart_batching.plan import OverlongCounts
from smart_batching.planners._kernels import (
    counting_sort_shuffled,
    shuffled_permutation,
    sort_blocks_descending,
)
from smart_batching.planners._spec import OVERLONG_POLICIES, BatchShapes, PlannerSpec  # noqa: F401 (re-exported)


class Segments(NamedTuple):
    """The units a planner arranges: whole examples, or pieces of them after the overlong policy."""

    example_ids: np.ndarray  # (num_segments,) int64
    starts: np.ndarray  # (num_segments,) int64
    lengths: np.ndarray  # (num_segments,) int64
    overlong: OverlongCounts


class PlanParts(NamedTuple):
    """What a planner returns: an order over segments and the batch/row structure on that order."""

    segments: Segments
    order: np.ndarray  # (num_segments,) positions into `segments`, in plan order
    row_offsets: np.ndarray  # (num_rows + 1,)
    batch_offsets: np.ndarray  # (num_batches + 1,)
    batch_width: np.ndarray  # (num_batches,)
    capacity: int | None = None
    lower_bound_rows: int | None = None
    ordered_lengths: np.ndarray | None = None  # segments.lengths[order], when the planner has it already


def apply_overlong(lengths: np.ndarray, limit: int | None, policy: str, setting: str) -> Segments:
    """Apply an overlong policy to examples longer than ``limit`` tokens.

    Args:
        lengths: (num_examples,) int64 token lengths.
        limit: most tokens one segment may hold; None means no limit.
        policy: ``"error"`` (raise), ``"truncate"`` (keep the first ``limit`` tokens), ``"split"`` (cut
            into pieces of ``limit`` tokens, the last one shorter) or ``"drop"`` (leave the example out).
        setting: the name of the limit's setting, quoted in the error message.
    """
    n = lengths.shape[0]
    ids = np.arange(n, dtype=np.int64)
    if limit is None:
        return Segments(ids, np.zeros(n, dtype=np.int64), lengths, OverlongCounts(None, policy))
    over = lengths > limit
    num_over = int(np.count_nonzero(over))
    if num_over == 0:
        return Segments(ids, np.zeros(n, dtype=np.int64), lengths, OverlongCounts(limit, policy))
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
        return Segments(ids, np.zeros(n, dtype=np.int64), seg_len, counts)
    if policy == "drop":
        keep = ~over
        counts = OverlongCounts(
            limit, policy, num_over, num_dropped=num_over, dropped_tokens=int(lengths[over].sum())
        )
        return Segments(ids[keep], np.zeros(n - num_over, dtype=np.int64), lengths[keep], counts)
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
        return Segments(seg_ids, starts, seg_len, counts)
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
    """A random permutation of ``0..n-1`` drawn from ``rng`` (compiled; 2.5x numpy's at 10M)."""
    return shuffled_permutation(n, _seed(rng))


# Above this many distinct key values a counting sort stops paying; fall back to numpy's sort.
_COUNTING_MAX_KEY = 1 << 22


def sort_by_length(
    lengths: np.ndarray, rng: np.random.Generator | None, *, descending: bool = False
) -> np.ndarray:
    """Order of positions sorted by length, ties broken at random (or by position when rng is None).

    Returns:
        (n,) int64 positions. Counting sort: O(n + longest).
    """
    n = lengths.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    top = int(lengths.max())
    keys = (top - lengths) if descending else lengths
    if top <= _COUNTING_MAX_KEY:
        return counting_sort_shuffled(keys, top, -1 if rng is None else _seed(rng))
    if rng is None:
        return np.argsort(keys, kind="stable").astype(np.int64, copy=False)
    perm = permutation(n, rng)  # (n,) random tie-break
    return perm[np.argsort(keys[perm], kind="stable")]


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
) -> np.ndarray:
    """Shuffle, cut into windows of ``window`` positions, and sort each window by length (ties at
    random): the randomness knob of the length-aware strategies (``window=``)::

        lengths  9 2 7 4 8 1     shuffled   4 8 1 | 9 2 7     window 3, ascending   1 4 8 | 2 7 9

    Batches (or packs) cut from this order hold examples of one window, which is a fresh random draw
    every epoch: the smaller the window, the more random each batch's company, the more padding.

    Args:
        window: examples per window; None (or at least the number of examples) sorts the whole array,
            exactly as :func:`sort_by_length`.

    Returns:
        (n,) int64 positions. O(n) passes plus a counting sort per window.
    """
    n = lengths.shape[0]
    if window is None or window >= n:
        return sort_by_length(lengths, rng, descending=descending)
    perm = permutation(n, rng)  # (n,)
    return perm[sort_blocks(lengths[perm], window, descending=descending)]


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


def padded_parts(
    segments: Segments,
    order: np.ndarray,
    batch_offsets: np.ndarray,
    *,
    fixed_width: int | None = None,
    ordered: np.ndarray | None = None,
) -> PlanParts:
    """PlanParts for strategies with one segment per row, padded to the longest (or a fixed width).

    ``batch_offsets`` index into ``order``; positions after its last offset are left out of the plan.
    """
    used = int(batch_offsets[-1])
    order = order[:used]
    # (used,) lengths in plan order, reused by plan_batches: one gather, not two (none if given)
    ordered = segments.lengths[order] if ordered is None else ordered[:used]
    num_batches = len(batch_offsets) - 1
    if fixed_width is not None:
        width = np.full(num_batches, fixed_width, dtype=np.int64)
    elif num_batches:
        width = np.maximum.reduceat(ordered, batch_offsets[:-1]).astype(np.int64)
    else:
        width = np.zeros(0, dtype=np.int64)
    row_offsets = np.arange(used + 1, dtype=np.int64)
    return PlanParts(segments, order, row_offsets, batch_offsets, width, ordered_lengths=ordered)


def drop_tail(segments: Segments, order: np.ndarray, batch_offsets: np.ndarray) -> Segments:
    """Count the segments a ``drop_last`` left out as dropped examples."""
    left = order[int(batch_offsets[-1]) :]
    if left.size == 0:
        return segments
    c = segments.overlong
    counts = OverlongCounts(
        c.limit,
        c.policy,
        c.num_over_limit,
        c.num_truncated,
        c.truncated_tokens,
        c.num_split,
        c.num_dropped + int(np.unique(segments.example_ids[left]).size),
        c.dropped_tokens + int(segments.lengths[left].sum()),
    )
    return segments._replace(overlong=counts)


def permute_batches(
    order: np.ndarray, offsets: np.ndarray, perm: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Reorder whole batches (chunks ``offsets`` of ``order``) by ``perm``, vectorised.

    Returns:
        ``(order, offsets)`` with batch ``k`` of the result being batch ``perm[k]`` of the input.
    """
    sizes = np.diff(offsets)[perm]  # (num_batches,)
    new_offsets = np.zeros(len(perm) + 1, dtype=np.int64)
    np.cumsum(sizes, out=new_offsets[1:])
    # position j of new batch k reads old position offsets[perm[k]] + (j - new_offsets[k])
    shift = np.repeat(offsets[:-1][perm] - new_offsets[:-1], sizes)
    src = np.arange(int(new_offsets[-1]), dtype=np.int64) + shift
    return order[src], new_offsets


# --- The costliest batch first (PlannerSpec.leads_with_costliest) ----------------------------------


def costliest_batch(key: np.ndarray, tie_break: np.ndarray) -> int:
    """Index of the batch with the largest ``key``, ties to the largest ``tie_break``, then to the first
    (a plan whose batch 0 already ties for the top stays as it is); -1 without batches. O(num_batches)."""
    if key.size == 0:
        return -1
    tied = np.flatnonzero(key == key.max())  # (num_tied,)
    return int(tied[np.argmax(tie_break[tied])])


def costliest_in_plan(
    spec: PlannerSpec,
    ordered_lengths: np.ndarray,
    row_offsets: np.ndarray,
    batch_offsets: np.ndarray,
    batch_width: np.ndarray,
) -> int:
    """The batch :meth:`PlannerSpec.costliest_keys` ranks first, in a plan laid out as ``batch b = rows
    [batch_offsets[b], batch_offsets[b+1])``, ``row r = segments [row_offsets[r], row_offsets[r+1])``
    over ``ordered_lengths`` (segment lengths in plan order)."""
    bounds = row_offsets[batch_offsets]  # (num_batches + 1,) into the segments
    shapes = BatchShapes(np.diff(batch_offsets), batch_width, ordered_lengths, bounds[:-1], bounds[1:])
    key, tie_break = spec.costliest_keys(shapes)
    return costliest_batch(np.asarray(key), np.asarray(tie_break))


def _blocks_swapped(a: np.ndarray, i: int, j: int, k: int) -> np.ndarray:
    """``a[j:k], a[i:j], a[:i], a[k:]``: the block ``[j, k)`` and the block ``[0, i)`` swapped."""
    return np.concatenate([a[j:k], a[i:j], a[:i], a[k:]])


def _exchanged(a: np.ndarray, size: int, j: int) -> np.ndarray:
    """A copy of ``a`` with the blocks ``[0, size)`` and ``[j, j + size)`` exchanged."""
    out = a.copy()
    out[:size], out[j : j + size] = a[j : j + size], a[:size]
    return out


def _offsets_of(sizes: np.ndarray) -> np.ndarray:
    out = np.zeros(sizes.shape[0] + 1, dtype=np.int64)
    np.cumsum(sizes, out=out[1:])
    return out


def swap_to_front(
    k: int,
    segment_arrays: tuple[np.ndarray, ...],
    row_offsets: np.ndarray,
    batch_offsets: np.ndarray,
    batch_width: np.ndarray,
) -> tuple[tuple[np.ndarray, ...], np.ndarray, np.ndarray, np.ndarray]:
    """Swap batch ``k`` with batch 0 (not a sort: every other batch keeps its place)::

        batches   B0 B1 B2 B3 B4      k = 3      ->   B3 B1 B2 B0 B4

    Args:
        segment_arrays: arrays over segments in plan order (the order, its lengths), swapped alike.

    Returns:
        ``(segment_arrays, row_offsets, batch_offsets, batch_width)`` of the new plan. Vectorised
        copies, no Python work per batch or example.
    """
    if k <= 0:
        return segment_arrays, row_offsets, batch_offsets, batch_width
    r1, rk, rk1 = (int(x) for x in batch_offsets[[1, k, k + 1]])
    s1, sk, sk1 = (int(x) for x in row_offsets[[r1, rk, rk1]])
    width = _blocks_swapped(batch_width, 1, k, k + 1)
    if sk1 - sk == s1 and np.array_equal(np.diff(row_offsets[: r1 + 1]), np.diff(row_offsets[rk : rk1 + 1])):
        # Batches of one shape (fixed batch sizes): exchange the two blocks, all offsets stay.
        arrays = tuple(_exchanged(a, s1, sk) for a in segment_arrays)
        return arrays, row_offsets, batch_offsets, width
    arrays = tuple(_blocks_swapped(a, s1, sk, sk1) for a in segment_arrays)
    # Row offsets of each moved block, shifted to where the block now starts (one pass, no cumsum).
    ro = row_offsets
    rows = np.concatenate([ro[rk:rk1] - sk, ro[r1:rk] + (sk1 - sk - s1), ro[:r1] + (sk1 - s1), ro[rk1:]])
    batches = _offsets_of(_blocks_swapped(np.diff(batch_offsets), 1, k, k + 1))
    return arrays, rows, batches, width


def lead_with_costliest(spec: PlannerSpec, parts: PlanParts) -> PlanParts:
    """``parts`` with its costliest batch swapped to the front (see
    :meth:`PlannerSpec.leads_with_costliest`); the segments stay the same, only the order of batches
    changes. O(num_segments) in vectorised passes (a sum, a maximum, a copy)."""
    ordered = parts.segments.lengths[parts.order] if parts.ordered_lengths is None else parts.ordered_lengths
    parts = parts._replace(ordered_lengths=ordered)
    if parts.batch_offsets.shape[0] <= 2:
        return parts
    k = costliest_in_plan(spec, ordered, parts.row_offsets, parts.batch_offsets, parts.batch_width)
    if k <= 0:
        return parts
    (order, ordered), rows, batches, width = swap_to_front(
        k, (parts.order, ordered), parts.row_offsets, parts.batch_offsets, parts.batch_width
    )
    return parts._replace(
        order=order, row_offsets=rows, batch_offsets=batches, batch_width=width, ordered_lengths=ordered
    )
