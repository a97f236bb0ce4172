"""Batch plans: the one value every planner produces and everything else consumes.

Ordered segments cut into rows and batches by flat offsets, never lists of lists, so a plan over tens
of millions of examples costs a few tens of bytes per example. Two values hold it:

* :class:`Segments`, a table of segments (``example``, ``start``, ``length`` columns): tokens
  ``[start, start + length)`` of example ``example``; a whole example unless the overlong policy
  truncated or split it. One row of the table is a :class:`Segment`, the key samplers yield.
* :class:`Batches`, how positions of that table are cut into rows and batches::

      batch b    = rows      [batch_offsets[b], batch_offsets[b+1])       padded to width[b] tokens per row
      row r      = positions [row_offsets[r], row_offsets[r+1])           (row_offsets None: one per row)
      position p = segment   order[p] of the table                        (order None: segment p)
      batch k of the plan = stored batch batch_order[k]                   (batch_order None: as stored)

  For padded strategies every row holds one segment (``row_offsets`` None); for packing a row holds
  several. ``batch_order`` lets a planner leave its shuffle of whole batches (and the costliest batch
  moved to the front, :func:`lead_with_costliest`) unapplied until the plan is laid out once.

:class:`BatchPlan` is the laid-out pair (the table in plan order, the batches in plan order) with what
produced it; the planners (:mod:`smart_batching.planners`), the streaming planner and the distributed
plan all speak these two values. The compute a batch costs is ``rows * width``: its token slots.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from smart_batching.errors import DataError

PLAN_FORMAT_VERSION = 1
_EMPTY = np.zeros(0, dtype=np.int64)


class Segment(NamedTuple):
    """A dataset key for a piece of an example: tokens ``[start, start + length)`` of ``example``.

    Samplers yield these in place of example indices when an overlong policy split or truncated an
    example (:class:`~smart_batching.sampler.SegmentDataset` fetches the window). One row of a
    :class:`Segments` table."""

    example: int
    start: int
    length: int


class Segments(NamedTuple):
    """A table of segments, one column per field, each ``(num_segments,)`` int64.

    Attributes:
        example: the example each segment comes from (a dataset index, or a stream position).
        start: first token of the segment in its example.
        length: tokens of the segment.
        example_length: tokens of the whole example, where the table travels without the dataset's
            lengths (a stream's buffer); None elsewhere.
    """

    example: np.ndarray
    start: np.ndarray
    length: np.ndarray
    example_length: np.ndarray | None = None

    @staticmethod
    def whole(lengths: np.ndarray) -> Segments:
        """Every example one segment, in dataset order."""
        n = lengths.shape[0]
        return Segments(np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64), lengths)

    @property
    def num_segments(self) -> int:
        return int(self.length.shape[0])

    def take(self, idx: np.ndarray | slice) -> Segments:
        """The segments at ``idx`` (positions or a slice), every column alike."""
        return Segments(*(None if col is None else col[idx] for col in self))

    @staticmethod
    def concat(parts: Sequence[Segments]) -> Segments:
        if len(parts) == 1:
            return parts[0]
        return Segments(
            *(None if cols[0] is None else np.concatenate(cols) for cols in zip(*parts, strict=True))
        )

    def key(self, i: int) -> Segment:
        return Segment(int(self.example[i]), int(self.start[i]), int(self.length[i]))


NO_SEGMENTS = Segments(_EMPTY, _EMPTY, _EMPTY)


MAX_EXAMPLE_TOKENS = 2**31 - 1
"""Longest example accepted, in tokens (int32 positions; no model takes more). Larger values are a
broken length column, and would overflow the int64 sums of the statistics."""


def as_lengths(lengths: Any, *, name: str = "lengths") -> np.ndarray:
    """Validate token lengths and return them as a 1-D int64 array (no copy when already int64).

    Raises:
        DataError: not 1-D, not integers, negative, over :data:`MAX_EXAMPLE_TOKENS`, or not convertible.
    """
    try:
        arr = np.asarray(lengths)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{name} must be a 1-D array of non-negative integers: {exc}") from exc
    if arr.ndim != 1:
        raise DataError(f"{name} must be 1-D (one token count per example), got shape {arr.shape}")
    if arr.dtype == np.bool_ or arr.dtype.kind not in "iuf":
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        raise DataError(f"{name} must hold integer token counts, got dtype {arr.dtype}")
    if arr.dtype.kind == "f":
        if arr.size and not (np.all(np.isfinite(arr)) and np.all(arr == np.floor(arr))):
            raise DataError(f"{name} must hold whole token counts; found non-integer values")
        arr = arr.astype(np.int64)
    elif arr.dtype != np.int64:
        if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
            raise DataError(f"{name} has values too large for int64")
        arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        bad = int(np.flatnonzero(arr < 0)[0])
        raise DataError(f"{name} must be non-negative; example {bad} has length {int(arr[bad])}")
    if arr.size and arr.max() > MAX_EXAMPLE_TOKENS:
        bad = int(np.argmax(arr))
        raise DataError(
            f"{name}: example {bad} has {int(arr[bad]):,} tokens, more than any model takes (at most "
            f"{MAX_EXAMPLE_TOKENS:,}); check where the lengths come from (a length column, a .npy file)"
        )
    return arr


def fingerprint_lengths(lengths: np.ndarray) -> str:
    """A short, stable digest of a length array (used to refuse resuming on changed data)."""
    arr = np.ascontiguousarray(lengths, dtype=np.int64)
    h = hashlib.blake2b(digest_size=8)
    h.update(str(arr.shape[0]).encode())
    h.update(memoryview(arr).cast("B"))
    return h.hexdigest()


def packing_lower_bound(lengths: np.ndarray, capacity: int) -> int:
    """Fewest rows of ``capacity`` tokens that can hold ``lengths`` (all ≤ capacity).

    ``max(ceil(total / capacity), #examples longer than capacity / 2)``: no two examples over half the
    capacity can share a row.
    """
    if lengths.size == 0:
        return 0
    total = int(lengths.sum())
    by_volume = -(-total // capacity)
    big = int(np.count_nonzero(lengths > capacity // 2))  # 2 * length > capacity, without a temporary
    return max(by_volume, big)


@dataclass(frozen=True)
class OverlongCounts:
    """What an overlong policy did to examples longer than the limit (all counts are examples)."""

    limit: int | None = None
    policy: str = "error"
    num_over_limit: int = 0
    num_truncated: int = 0
    truncated_tokens: int = 0
    num_split: int = 0
    num_dropped: int = 0
    dropped_tokens: int = 0


def _summary(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {"min": 0, "p50": 0, "mean": 0.0, "max": 0}
    return {
        "min": int(values.min()),
        "p50": float(np.median(values)),
        "mean": float(values.mean()),
        "max": int(values.max()),
    }


@dataclass(frozen=True)
class PlanStats:
    """Padding and shape figures of a plan. Tokens are counts of token positions.

    Attributes:
        efficiency: real tokens / token slots (1.0 means no padding at all; NaN when there are no
            token slots at all, e.g. every example dropped).
        padding_ratio: padding tokens / token slots (``1 - efficiency``).
        lower_bound_rows: fewest rows of ``capacity`` tokens that could hold the data (packing only).
    """

    strategy: str
    num_examples: int
    num_segments: int
    num_batches: int
    num_rows: int
    real_tokens: int
    token_slots: int
    padding_tokens: int
    efficiency: float
    padding_ratio: float
    examples_per_batch: dict[str, float]
    rows_per_batch: dict[str, float]
    tokens_per_batch: dict[str, float]
    capacity: int | None
    lower_bound_rows: int | None
    overlong: OverlongCounts = field(default_factory=OverlongCounts)

    @property
    def num_over_limit(self) -> int:
        return self.overlong.num_over_limit

    @property
    def num_dropped(self) -> int:
        return self.overlong.num_dropped

    @property
    def num_truncated(self) -> int:
        return self.overlong.num_truncated

    @property
    def num_split(self) -> int:
        return self.overlong.num_split

    @property
    def rows_over_lower_bound(self) -> float | None:
        """``num_rows / lower_bound_rows`` (1.0 is optimal), or None when no bound applies."""
        if not self.lower_bound_rows:
            return None
        return self.num_rows / self.lower_bound_rows

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rows_over_lower_bound"] = self.rows_over_lower_bound
        return d


def zeros(n: int) -> np.ndarray:
    """``(n,)`` int64 zeros that take no memory: a read-only broadcast of one 0 (every segment's start
    where no example was cut)."""
    return np.broadcast_to(np.zeros(1, dtype=np.int64), (n,))


def offsets_of(sizes: np.ndarray) -> np.ndarray:
    """``(len(sizes) + 1,)`` int64 offsets of consecutive chunks of ``sizes`` items: 0, then the running sum."""
    out = np.zeros(sizes.shape[0] + 1, dtype=np.int64)
    np.cumsum(sizes, out=out[1:])
    return out


def block_positions(offsets: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Positions of the chunks ``blocks`` of ``offsets`` (chunk ``i`` = ``[offsets[i], offsets[i+1])``),
    one chunk after the other: vectorised, O(positions)."""
    sizes = offsets[1:][blocks] - offsets[:-1][blocks]  # (num_blocks,)
    starts = offsets_of(sizes)
    # position j of new chunk k reads old position offsets[blocks[k]] + (j - starts[k])
    return np.arange(int(starts[-1]), dtype=np.int64) + np.repeat(offsets[:-1][blocks] - starts[:-1], sizes)


class Batches(NamedTuple):
    """Positions of a :class:`Segments` table cut into rows and batches (the module docstring draws it).

    Attributes:
        batch_offsets: ``(num_batches + 1,)`` into rows.
        width: ``(num_batches,)`` padded tokens per row of each batch.
        row_offsets: ``(num_rows + 1,)`` into positions; None: one position per row (padded batches).
        order: ``(num_positions,)`` the segment at each position; None: position ``p`` holds segment ``p``.
        batch_order: ``(num_batches,)`` batch ``k`` of the plan is stored batch ``batch_order[k]``; None:
            batches in stored order. ``width`` and the offsets describe the stored batches.
    """

    batch_offsets: np.ndarray
    width: np.ndarray
    row_offsets: np.ndarray | None = None
    order: np.ndarray | None = None
    batch_order: np.ndarray | None = None

    @property
    def num_batches(self) -> int:
        return int(self.batch_offsets.shape[0]) - 1

    @property
    def num_rows(self) -> int:
        return int(self.batch_offsets[-1])

    @property
    def bounds(self) -> np.ndarray:
        """``(num_batches + 1,)`` position bounds of the stored batches."""
        return self.batch_offsets if self.row_offsets is None else self.row_offsets[self.batch_offsets]

    def positioned(self, values: np.ndarray) -> np.ndarray:
        """A per-segment array (e.g. lengths) by stored position."""
        return values if self.order is None else values[self.order]

    def shapes(self, lengths: np.ndarray) -> BatchShapes:
        """The :class:`BatchShapes` of the stored batches; ``lengths``: per segment of the table."""
        b = self.bounds
        return BatchShapes(np.diff(self.batch_offsets), self.width, self.positioned(lengths), b[:-1], b[1:])

    def laid_out(self) -> tuple[np.ndarray | None, Batches]:
        """``(order, batches)`` with ``batch_order`` applied: the positions in plan order (None when they
        are the stored ones) and the batches over them. Vectorised, O(positions)."""
        if self.batch_order is None:
            return self.order, self._replace(order=None)
        bo = self.batch_order
        positions = block_positions(self.bounds, bo)
        rows = None
        if self.row_offsets is not None:
            rows_sizes = np.diff(self.row_offsets)[block_positions(self.batch_offsets, bo)]
            rows = offsets_of(rows_sizes)
        laid = Batches(offsets_of(np.diff(self.batch_offsets)[bo]), self.width[bo], rows)
        return (positions if self.order is None else self.order[positions]), laid


# --- What the costliest-first rule may ask of each batch ---------------------------------------------


def range_sums_and_maxima(
    values: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Sum and maximum of ``values[starts[i]:ends[i]]`` for each range ``i`` (0 for an empty one); the
    ranges may come in any order.

    Returns:
        ``(sums, maxima)``, each ``(len(starts),)`` int64. Two vectorised passes over ``values``.
    """
    if starts.shape[0] == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    csum = np.zeros(values.shape[0] + 1, dtype=np.int64)
    np.cumsum(values, out=csum[1:])
    sums = csum[ends] - csum[starts]
    # One reduceat over interleaved (start, end) bounds; the appended 0 keeps an end bound in range.
    # reduceat also reduces each gap [end_i, start_i+1): with the ranges in start order and disjoint
    # (every plan's batches, dealt to ranks in any order) the bounds only grow and the gaps hold each
    # value once, O(n); in their given order a gap can span most of the array (O(n × ranges)).
    padded = np.append(values, 0).astype(np.int64, copy=False)
    by_start = np.argsort(starts, kind="stable")  # (num_ranges,)
    s, e = starts[by_start], ends[by_start]
    maxima = np.zeros(starts.shape[0], dtype=np.int64)
    if np.all(s[1:] >= np.maximum(e[:-1], s[:-1])):  # disjoint (empty ranges anywhere)
        bounds = np.stack([s, np.maximum(e, s)], axis=1).reshape(-1)  # non-decreasing
        maxima[by_start] = np.maximum.reduceat(padded, bounds)[::2]
    else:  # overlapping ranges: each gap reduced in the given order (rare: no plan makes them)
        maxima[:] = np.maximum.reduceat(padded, np.stack([starts, ends], axis=1).reshape(-1))[::2]
    empty = ends <= starts
    sums[empty] = 0
    maxima[empty] = 0
    return sums, maxima


class BatchShapes:
    """What the costliest-first rule may ask of each batch (``spec.costliest_keys``), over
    ``(num_batches,)`` arrays; ``tokens`` and ``longest`` each cost one pass over the segments, made
    only when asked.

    Args:
        rows: rows of each batch.
        width: padded tokens per row of each batch; None: each batch's longest segment.
        lengths: segment lengths by position; batch ``b`` holds ``lengths[starts[b]:ends[b]]``.
    """

    def __init__(
        self,
        rows: np.ndarray,
        width: np.ndarray | None,
        lengths: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
    ) -> None:
        self.rows = rows
        self._width = width
        self._lengths, self._starts, self._ends = lengths, starts, ends
        # Consecutive, non-empty batches (every plan's): a reduceat each, no copies.
        self._consecutive = bool(
            starts.shape[0]
            and starts[0] == 0
            and np.all(ends > starts)
            and np.array_equal(starts[1:], ends[:-1])
        )

    @cached_property
    def width(self) -> np.ndarray:
        return self.longest if self._width is None else self._width

    def _reduce(self, ufunc: np.ufunc) -> np.ndarray:
        if self._consecutive:
            lengths = self._lengths[: int(self._ends[-1])]
            return ufunc.reduceat(lengths, self._starts).astype(np.int64, copy=False)
        sums, maxima = range_sums_and_maxima(self._lengths, self._starts, self._ends)
        return sums if ufunc is np.add else maxima

    @cached_property
    def tokens(self) -> np.ndarray:
        """Real tokens of each batch."""
        return self._reduce(np.add)

    @cached_property
    def longest(self) -> np.ndarray:
        """Tokens of each batch's longest segment."""
        return self._reduce(np.maximum)


def micro_batch_widths(plan: Any, order: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``(num_micro_batches,)`` padded tokens per row of the micro-batches ``order[offsets[m]:offsets[m+1]]``
    of ``plan``'s segments, one segment per row: where rows hold several examples, the strategy's
    capacity times rows (the collator flattens such a micro-batch into one row); else the strategy's
    fixed width, or each micro-batch's longest segment."""
    sizes = np.diff(offsets)
    spec = plan.spec
    limits = spec.micro_batch_limits()
    if spec.packs_rows and limits.capacity is not None:
        return np.full(sizes.shape[0], limits.capacity * limits.rows_per_micro_batch, dtype=np.int64)
    fixed = spec.fixed_width(int(plan.lengths.max(initial=0)))
    if fixed is not None:
        return np.full(sizes.shape[0], fixed, dtype=np.int64)
    shapes = BatchShapes(sizes, None, plan.seg_lengths[order], offsets[:-1], offsets[1:])
    return np.asarray(shapes.longest, dtype=np.int64)


def costliest_batch(key: np.ndarray, tie_break: np.ndarray) -> int:
    """Index of the batch with the largest ``key``, ties to the largest ``tie_break``, then to the first
    (a plan whose batch 0 already ties for the top stays as it is); -1 without batches. O(num_batches)."""
    if key.size == 0:
        return -1
    tied = np.flatnonzero(key == key.max())  # (num_tied,)
    return int(tied[np.argmax(tie_break[tied])])


def costliest(spec: Any, shapes: BatchShapes) -> int:
    """The batch ``spec.costliest_keys(shapes)`` ranks first (see :func:`costliest_batch`)."""
    key, tie_break = spec.costliest_keys(shapes)
    return costliest_batch(np.asarray(key), np.asarray(tie_break))


def lead_with_costliest(spec: Any, batches: Batches, lengths: np.ndarray) -> Batches:
    """``batches`` with the costliest one (as ``spec.costliest_keys`` ranks them) swapped with batch 0,
    not a sort: every other batch keeps its place::

        batches   B0 B1 B2 B3 B4      costliest B3   ->   B3 B1 B2 B0 B4

    The move is two entries of ``batch_order`` (O(1)); finding the batch is a sum or a maximum over
    the segments and a pass over the batch order. Whoever lays the plan out applies it
    (:meth:`Batches.laid_out`, or the planners' compiled copy).

    Args:
        lengths: token lengths per segment of the table ``batches`` cuts.
    """
    n = batches.num_batches
    if n < 2:
        return batches
    key, tie_break = (np.asarray(x) for x in spec.costliest_keys(batches.shapes(lengths)))
    bo = batches.batch_order
    if bo is None:
        k = costliest_batch(key, tie_break)
    else:
        # Ranked on the stored batches; of the best, the first in plan order (as costliest_batch does).
        best = np.flatnonzero(key == key.max())
        best = best[tie_break[best] == tie_break[best].max()]
        is_best = np.zeros(n, dtype=bool)
        is_best[best] = True
        k = int(np.argmax(is_best[bo]))
    if k <= 0:
        return batches
    bo = np.arange(n) if bo is None else bo.copy()
    bo[0], bo[k] = bo[k], bo[0]
    return batches._replace(batch_order=bo)


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """One epoch of ordered batches: a :class:`Segments` table in plan order and the :class:`Batches`
    over it (laid out: no ``order``, no ``batch_order``), with what produced them.

    Iterating yields, per batch, the example indices of its segments as an int64 array (in row
    order). ``len(plan)`` is the number of batches. The flat arrays of the layout are attributes:
    ``example_ids``, ``seg_starts``, ``seg_lengths`` (the table's columns), ``row_offsets``,
    ``batch_offsets``, ``batch_width`` (the batches').
    """

    segments: Segments
    batches: Batches
    strategy: str
    spec: Any
    seed: int
    epoch: int
    num_examples: int
    overlong: OverlongCounts
    lengths: np.ndarray = field(repr=False)  # (num_examples,) the input lengths (a reference, not a copy)
    capacity: int | None = None
    lower_bound_rows: int | None = None

    def __post_init__(self) -> None:
        if self.batches.order is not None or self.batches.batch_order is not None:
            raise ValueError("BatchPlan holds laid-out batches: apply order and batch_order first")

    # -- the flat layout ---------------------------------------------------------------------------

    @property
    def example_ids(self) -> np.ndarray:
        """(num_segments,) int64: the example of each segment, in plan order."""
        return self.segments.example

    @property
    def seg_starts(self) -> np.ndarray:
        """(num_segments,) int64: first token of each segment in its example."""
        return self.segments.start

    @property
    def seg_lengths(self) -> np.ndarray:
        """(num_segments,) int64: tokens of each segment."""
        return self.segments.length

    @cached_property
    def row_offsets(self) -> np.ndarray:
        """(num_rows + 1,) int64 into the segments (made on first use where every row holds one)."""
        rows = self.batches.row_offsets
        return np.arange(self.num_segments + 1, dtype=np.int64) if rows is None else rows

    @property
    def batch_offsets(self) -> np.ndarray:
        """(num_batches + 1,) int64 into the rows."""
        return self.batches.batch_offsets

    @property
    def batch_width(self) -> np.ndarray:
        """(num_batches,) int64: padded tokens per row of each batch."""
        return self.batches.width

    @cached_property
    def batch_bounds(self) -> np.ndarray:
        """(num_batches + 1,) int64: batch ``b`` is segments ``[batch_bounds[b], batch_bounds[b+1])``."""
        return self.batches.bounds

    def __len__(self) -> int:
        return len(self.batch_offsets) - 1

    def __iter__(self) -> Iterator[np.ndarray]:
        bounds = self.batch_bounds
        ids = self.example_ids
        for b in range(len(self)):
            yield ids[bounds[b] : bounds[b + 1]]

    def __getitem__(self, b: int) -> np.ndarray:
        """Example indices of batch ``b``."""
        lo, hi = self.segment_range(b)
        return self.example_ids[lo:hi]

    def segment_range(self, b: int) -> tuple[int, int]:
        """``(first, end)`` positions in the flat segment arrays of batch ``b``."""
        n = len(self)
        if b < 0:
            b += n
        if not 0 <= b < n:
            raise IndexError(f"batch {b} out of range for a plan of {n} batches")
        return int(self.batch_bounds[b]), int(self.batch_bounds[b + 1])

    def rows(self, b: int) -> list[np.ndarray]:
        """Example indices of batch ``b``, one array per row."""
        r0, r1 = int(self.batch_offsets[b]), int(self.batch_offsets[b + 1])
        off = self.row_offsets
        return [self.example_ids[off[r] : off[r + 1]] for r in range(r0, r1)]

    @property
    def num_batches(self) -> int:
        return len(self)

    @property
    def num_rows(self) -> int:
        return int(self.batch_offsets[-1])

    @property
    def num_segments(self) -> int:
        return self.segments.num_segments

    @cached_property
    def rows_per_batch(self) -> np.ndarray:
        return np.diff(self.batch_offsets)

    @cached_property
    def segments_per_batch(self) -> np.ndarray:
        return np.diff(self.batch_bounds)

    @cached_property
    def tokens_per_batch(self) -> np.ndarray:
        """Real (unpadded) tokens of each batch: (num_batches,) int64."""
        if self.num_segments == 0:
            return np.zeros(len(self), dtype=np.int64)
        csum = offsets_of(self.seg_lengths)
        bounds = self.batch_bounds
        return csum[bounds[1:]] - csum[bounds[:-1]]

    @cached_property
    def slots_per_batch(self) -> np.ndarray:
        """Token slots (rows × padded width) of each batch: (num_batches,) int64."""
        return self.rows_per_batch * self.batch_width

    @cached_property
    def lengths_fingerprint(self) -> str:
        return fingerprint_lengths(self.lengths)

    @cached_property
    def fingerprint(self) -> str:
        """Digest of what produced the plan: lengths, strategy, spec and seed (not the epoch)."""
        h = hashlib.blake2b(digest_size=8)
        h.update(
            f"{PLAN_FORMAT_VERSION}|{self.lengths_fingerprint}|{self.strategy}|{self.spec!r}|{self.seed}".encode()
        )
        return h.hexdigest()

    def stats(self) -> PlanStats:
        real = int(self.seg_lengths.sum())
        slots = int(self.slots_per_batch.sum())
        eff = real / slots if slots else float("nan")  # no token slots: efficiency is undefined, not 100 %
        return PlanStats(
            strategy=self.strategy,
            num_examples=self.num_examples,
            num_segments=self.num_segments,
            num_batches=len(self),
            num_rows=self.num_rows,
            real_tokens=real,
            token_slots=slots,
            padding_tokens=slots - real,
            efficiency=eff,
            padding_ratio=1.0 - eff,
            examples_per_batch=_summary(self.segments_per_batch),
            rows_per_batch=_summary(self.rows_per_batch),
            tokens_per_batch=_summary(self.tokens_per_batch),
            capacity=self.capacity,
            lower_bound_rows=self.lower_bound_rows,
            overlong=self.overlong,
        )

    def to_lists(self) -> list[list[int]]:
        """Batches as lists of example indices (for tests and small plans only)."""
        return [b.tolist() for b in self]
