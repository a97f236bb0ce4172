"""Online planning rounds: what a strategy plans over a bounded buffer of a stream, and what it keeps.

The streaming planner (:mod:`smart_batching.streaming`) buffers examples, and each round asks the spec
(:meth:`~smart_batching.planners.PlannerSpec.plan_round`) to plan the buffer: the batches good enough
to emit now, and the examples to keep for the next round (a packed row still far from full, a batch
that could still grow), within ``room``. Pure NumPy, like the planners.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from smart_batching.planners._common import (
    costliest_in_plan,
    fixed_offsets,
    permutation,
    permute_batches,
    swap_to_front,
)

if TYPE_CHECKING:
    from smart_batching.planners._spec import PlannerSpec

EMPTY = np.zeros(0, dtype=np.int64)


class Room(NamedTuple):
    """What may stay in the buffer after a round."""

    segments: int
    tokens: int


class Tuning(NamedTuple):
    """Knobs of rounds that pack rows (see :class:`~smart_batching.streaming.StreamingBatcher`)."""

    min_row_fill: float
    reserve: float


class Cut(NamedTuple):
    """A round's decision, in positions of the buffer."""

    order: np.ndarray  # (num_emitted,) emitted positions in plan order
    row_offsets: np.ndarray  # (num_rows + 1,) into order
    batch_offsets: np.ndarray  # (num_batches + 1,) into rows
    batch_width: np.ndarray  # (num_batches,) padded tokens per row
    keep: np.ndarray  # positions that stay in the buffer, ascending
    drop: np.ndarray = EMPTY  # positions left out (drop_last at the end of the stream)


def fits(counts: np.ndarray, tokens: np.ndarray, room: Room) -> int:
    """Length of the longest prefix whose segments and tokens fit ``room``."""
    if counts.size == 0:
        return 0
    k_count = np.searchsorted(np.cumsum(counts), room.segments, side="right")
    k_tokens = np.searchsorted(np.cumsum(tokens), room.tokens, side="right")
    return int(min(k_count, k_tokens))


def batch_max(lens: np.ndarray, order: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Longest segment of each batch: ``(num_batches,)``."""
    if len(offsets) < 2:
        return EMPTY
    return np.maximum.reduceat(lens[order], offsets[:-1]).astype(np.int64)


def padded_cut(
    order: np.ndarray, offsets: np.ndarray, width: np.ndarray, keep: np.ndarray, drop=EMPTY
) -> Cut:
    """A cut of padded batches: one segment per row."""
    return Cut(order, np.arange(order.shape[0] + 1, dtype=np.int64), offsets, width, keep, drop)


def fixed_size_round(
    lens: np.ndarray,
    order: np.ndarray,
    rng: np.random.Generator,
    room: Room | None,
    *,
    batch_size: int,
    drop_last: bool,
    shuffle_batches: bool,
    width: int | None = None,
) -> Cut:
    """The round of a fixed-batch-size strategy, given its order of the buffer.

    The last incomplete batch stays in the buffer when ``room`` allows (it may fill up next round);
    at the end of the stream (``room`` None) it is emitted, or dropped with ``drop_last``.

    Args:
        width: padded tokens per row (fixed-width padding); None: each batch's longest.
    """
    full = order.shape[0] // batch_size * batch_size
    tail = order[full:]
    keep = drop = EMPTY
    if tail.size and room is None and drop_last:
        drop, order = tail, order[:full]
    elif (
        tail.size and room is not None and tail.size <= room.segments and int(lens[tail].sum()) <= room.tokens
    ):
        keep, order = np.sort(tail), order[:full]
    offsets = fixed_offsets(order.shape[0], batch_size, drop_last=False)
    if shuffle_batches:
        order, offsets = permute_batches(order, offsets, permutation(offsets.shape[0] - 1, rng))
    if width is not None:
        widths = np.full(offsets.shape[0] - 1, width, dtype=np.int64)
    else:
        widths = batch_max(lens, order, offsets)
    return padded_cut(order, offsets, widths, keep, drop)


def lead_with_costliest(spec: PlannerSpec, lens: np.ndarray, cut: Cut) -> Cut:
    """``cut`` with its costliest batch swapped to the front
    (:meth:`~smart_batching.planners.PlannerSpec.leads_with_costliest`); ``lens``: the buffer's
    segment lengths. The streaming planner asks it for the first round of an epoch only."""
    if cut.batch_offsets.shape[0] <= 2:
        return cut
    ordered = lens[cut.order]  # (num_emitted,)
    k = costliest_in_plan(spec, ordered, cut.row_offsets, cut.batch_offsets, cut.batch_width)
    (order,), rows, batches, width = swap_to_front(
        k, (cut.order,), cut.row_offsets, cut.batch_offsets, cut.batch_width
    )
    return cut._replace(order=order, row_offsets=rows, batch_offsets=batches, batch_width=width)
