"""The streaming planner's state: the buffered segments, the batches a round emitted, and how both go
into and come out of a state dict. What a round plans is the spec's
(:meth:`~smart_batching.planners.PlannerSpec.plan_round`); both speak the plan's values
(:class:`~smart_batching.plan.Segments`, :class:`~smart_batching.plan.Batches`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from smart_batching.plan import Batches, Segments

STATE_VERSION = 1
DEFAULT_MIN_ROW_FILL = 0.999
DEFAULT_RESERVE = 0.1
_INF = 1 << 62
_END = object()
_READ_EXAMPLES = 4096  # examples read from the source at a time
_READ_LENGTHS = 1 << 16  # plain lengths read from the source at a time
_EMPTY = np.zeros(0, dtype=np.int64)

# A buffer's segments are a Segments table whose `example` is a stream position and whose
# `example_length` holds each whole example's tokens (the stream keeps no length array). In a state
# dict they keep the names of the first state version.
_STATE_COLUMNS = (
    ("ids", "example"),
    ("starts", "start"),
    ("seg_lengths", "length"),
    ("lengths", "example_length"),
)

NO_SEGMENTS = Segments(_EMPTY, _EMPTY, _EMPTY, _EMPTY)


def segments_to_state(segs: Segments) -> dict[str, list[int]]:
    return {key: getattr(segs, column).tolist() for key, column in _STATE_COLUMNS}


def segments_from_state(state: Mapping[str, Any]) -> Segments:
    return Segments(
        **{column: np.asarray(state[key], dtype=np.int64).reshape(-1) for key, column in _STATE_COLUMNS}
    )


class Emission:
    """The batches one round emitted: its segments in plan order and the laid-out batches over them."""

    __slots__ = ("segs", "batches", "bounds", "_ids")

    def __init__(self, segs: Segments, batches: Batches):
        self.segs = segs
        self.batches = batches
        self.bounds: list[int] = batches.bounds.tolist()  # segment range of each batch
        self._ids: list[int] | None = None

    @property
    def num_batches(self) -> int:
        return len(self.bounds) - 1

    @property
    def num_rows(self) -> int:
        return self.batches.num_rows

    @property
    def ids(self) -> list[int]:
        if self._ids is None:
            self._ids = self.segs.example.tolist()
        return self._ids

    def rest(self, b: int) -> dict[str, Any]:
        """State of batches ``b..``: segments and offsets rebased to start at 0."""
        batches = self.batches
        rows = batches.row_offsets
        if rows is None:
            rows = np.arange(self.segs.num_segments + 1, dtype=np.int64)
        r0 = int(batches.batch_offsets[b])
        s0 = int(rows[r0])
        return {
            **segments_to_state(self.segs.take(slice(s0, None))),
            "row_offsets": (rows[r0:] - s0).tolist(),
            "batch_offsets": (batches.batch_offsets[b:] - r0).tolist(),
            "batch_width": batches.width[b:].tolist(),
        }

    @staticmethod
    def from_state(state: Mapping[str, Any]) -> Emission:
        def arr(name: str) -> np.ndarray:
            return np.asarray(state[name], dtype=np.int64).reshape(-1)

        batches = Batches(arr("batch_offsets"), arr("batch_width"), arr("row_offsets"))
        return Emission(segments_from_state(state), batches)
