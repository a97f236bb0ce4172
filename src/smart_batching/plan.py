"""Batch plans: the value every planner produces and everything else consumes.

A plan is one epoch of ordered batches over a dataset of token lengths. It is stored as flat arrays
with offsets, never as lists of lists, so a plan over tens of millions of examples costs a few tens of
bytes per example::

    batch b  = rows    [batch_offsets[b], batch_offsets[b+1])
    row r    = segments [row_offsets[r], row_offsets[r+1])
    segment s = tokens [seg_starts[s], seg_starts[s] + seg_lengths[s]) of example example_ids[s]

For padded strategies every row holds one segment (one example); for packing a row holds several. A
segment is a whole example unless the overlong policy truncated or split it. Each batch is padded to
``batch_width[b]`` tokens per row (the longest segment, a fixed ``max_length``, or the pack capacity),
so the compute a batch costs is ``rows * batch_width``: its token slots.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from smart_batching.errors import DataError

PLAN_FORMAT_VERSION = 1


class Segment(NamedTuple):
    """A dataset key for a piece of an example: tokens ``[start, start + length)`` of ``example``.

    Samplers yield these in place of example indices when an overlong policy split or truncated an
    example (:class:`~smart_batching.sampler.SegmentDataset` fetches the window)."""

    example: int
    start: int
    length: int


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


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """One epoch of ordered batches (see the module docstring for the layout).

    Iterating yields, per batch, the example indices of its segments as an int64 array (in row
    order). ``len(plan)`` is the number of batches.
    """

    example_ids: np.ndarray  # (num_segments,) int64
    seg_starts: np.ndarray  # (num_segments,) int64
    seg_lengths: np.ndarray  # (num_segments,) int64
    row_offsets: np.ndarray  # (num_rows + 1,) int64
    batch_offsets: np.ndarray  # (num_batches + 1,) int64
    batch_width: np.ndarray  # (num_batches,) int64: padded tokens per row
    strategy: str
    spec: Any
    seed: int
    epoch: int
    num_examples: int
    overlong: OverlongCounts
    lengths: np.ndarray = field(repr=False)  # (num_examples,) the input lengths (a reference, not a copy)
    capacity: int | None = None
    lower_bound_rows: int | None = None

    def __len__(self) -> int:
        return len(self.batch_offsets) - 1

    def __iter__(self) -> Iterator[np.ndarray]:
        seg_bounds = self.row_offsets[self.batch_offsets]
        ids = self.example_ids
        for b in range(len(self)):
            yield ids[seg_bounds[b] : seg_bounds[b + 1]]

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
        r0, r1 = self.batch_offsets[b], self.batch_offsets[b + 1]
        return int(self.row_offsets[r0]), int(self.row_offsets[r1])

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
        return len(self.row_offsets) - 1

    @property
    def num_segments(self) -> int:
        return len(self.example_ids)

    @cached_property
    def rows_per_batch(self) -> np.ndarray:
        return np.diff(self.batch_offsets)

    @cached_property
    def segments_per_batch(self) -> np.ndarray:
        return np.diff(self.row_offsets[self.batch_offsets])

    @cached_property
    def tokens_per_batch(self) -> np.ndarray:
        """Real (unpadded) tokens of each batch: (num_batches,) int64."""
        if self.num_segments == 0:
            return np.zeros(len(self), dtype=np.int64)
        csum = np.concatenate([[0], np.cumsum(self.seg_lengths)])
        bounds = self.row_offsets[self.batch_offsets]
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
