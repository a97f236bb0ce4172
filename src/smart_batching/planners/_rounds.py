"""Pieces of online planning rounds: what a strategy plans over a bounded buffer of a stream, and what
it keeps (:meth:`~smart_batching.planners.PlannerSpec.plan_round` returns a :class:`Cut`).

The streaming planner (:mod:`smart_batching.streaming`) buffers examples, and each round asks the spec
to plan the buffer: the batches good enough to emit now, and the examples to keep for the next round
(a packed row still far from full, a batch that could still grow), within ``room``. Pure NumPy, like
the planners; rounds are buffer-sized, so they shuffle batches eagerly.
"""

from __future__ import annotations

import numpy as np

from smart_batching.plan import Batches
from smart_batching.planners._common import fixed_offsets, permutation, permute_batches
from smart_batching.planners._spec import Cut, Room, Tuning

EMPTY = np.zeros(0, dtype=np.int64)


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
    order: np.ndarray, offsets: np.ndarray, width: np.ndarray, keep: np.ndarray, drop: np.ndarray = EMPTY
) -> Cut:
    """A cut of padded batches: one segment per row, ``order`` positions of the buffer."""
    return Cut(Batches(offsets, width, order=order), keep, drop)


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


__all__ = ["EMPTY", "Cut", "Room", "Tuning", "batch_max", "fits", "fixed_size_round", "padded_cut"]
