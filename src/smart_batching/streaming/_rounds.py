"""The streaming planner's buffer: segments, emissions and their state. What a round plans is the
spec's (:meth:`~smart_batching.planners.PlannerSpec.plan_round`, :mod:`smart_batching.planners._rounds`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

STATE_VERSION = 1
DEFAULT_MIN_ROW_FILL = 0.999
DEFAULT_RESERVE = 0.1
_INF = 1 << 62
_END = object()
_READ_EXAMPLES = 4096  # examples read from the source at a time
_READ_LENGTHS = 1 << 16  # plain lengths read from the source at a time
_EMPTY = np.zeros(0, dtype=np.int64)

# --- Segments, emissions ---------------------------------------------------------------------------


class _Segs(NamedTuple):
    """Buffered or emitted segments: parallel (n,) int64 arrays."""

    ids: np.ndarray  # stream position of the example
    starts: np.ndarray  # first token of the segment in the example
    seg_lengths: np.ndarray  # tokens of the segment
    lengths: np.ndarray  # tokens of the whole example

    def take(self, idx: np.ndarray) -> _Segs:
        return _Segs(self.ids[idx], self.starts[idx], self.seg_lengths[idx], self.lengths[idx])

    def tail(self, start: int) -> _Segs:
        return _Segs(self.ids[start:], self.starts[start:], self.seg_lengths[start:], self.lengths[start:])

    @staticmethod
    def concat(parts: list[_Segs]) -> _Segs:
        if len(parts) == 1:
            return parts[0]
        return _Segs(*(np.concatenate(cols) for cols in zip(*parts, strict=True)))

    def to_state(self) -> dict[str, list[int]]:
        return {name: arr.tolist() for name, arr in self._asdict().items()}

    @staticmethod
    def from_state(state: Mapping[str, Any]) -> _Segs:
        return _Segs(*(np.asarray(state[name], dtype=np.int64).reshape(-1) for name in _Segs._fields))


_NO_SEGS = _Segs(_EMPTY, _EMPTY, _EMPTY, _EMPTY)


class _Emission:
    """The batches one round emitted (same layout as :class:`~smart_batching.plan.BatchPlan`)."""

    __slots__ = ("segs", "row_offsets", "batch_offsets", "batch_width", "bounds", "_ids")

    def __init__(
        self, segs: _Segs, row_offsets: np.ndarray, batch_offsets: np.ndarray, batch_width: np.ndarray
    ):
        self.segs = segs
        self.row_offsets = row_offsets
        self.batch_offsets = batch_offsets
        self.batch_width = batch_width
        self.bounds: list[int] = row_offsets[batch_offsets].tolist()  # segment range of each batch
        self._ids: list[int] | None = None

    @property
    def num_batches(self) -> int:
        return len(self.bounds) - 1

    @property
    def ids(self) -> list[int]:
        if self._ids is None:
            self._ids = self.segs.ids.tolist()
        return self._ids

    def rest(self, b: int) -> dict[str, Any]:
        """State of batches ``b..``: segments and offsets rebased to start at 0."""
        r0 = int(self.batch_offsets[b])
        s0 = int(self.row_offsets[r0])
        return {
            **self.segs.tail(s0).to_state(),
            "row_offsets": (self.row_offsets[r0:] - s0).tolist(),
            "batch_offsets": (self.batch_offsets[b:] - r0).tolist(),
            "batch_width": self.batch_width[b:].tolist(),
        }

    @staticmethod
    def from_state(state: Mapping[str, Any]) -> _Emission:
        def arr(name: str) -> np.ndarray:
            return np.asarray(state[name], dtype=np.int64).reshape(-1)

        return _Emission(
            _Segs.from_state(state), arr("row_offsets"), arr("batch_offsets"), arr("batch_width")
        )
