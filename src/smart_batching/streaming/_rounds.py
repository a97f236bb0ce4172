"""Planning rounds over the buffer: segments, what each strategy emits and keeps, emissions."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from smart_batching.planners import (
    GroupByLengthSpec,
    MaxLengthSpec,
    PackedSpec,
    PlannerSpec,
    RandomSpec,
    TokenBudgetSpec,
)
from smart_batching.planners._common import fixed_offsets, permutation, permute_batches, sort_by_length
from smart_batching.planners._kernels import group_by_row, token_budget_cuts
from smart_batching.planners.group_by_length import megabatch_order
from smart_batching.planners.packed import pack

STATE_VERSION = 1
DEFAULT_MIN_ROW_FILL = 0.999
DEFAULT_RESERVE = 0.1
_INF = 1 << 62
_END = object()
_READ_EXAMPLES = 4096  # examples read from the source at a time
_READ_LENGTHS = 1 << 16  # plain lengths read from the source at a time
_EMPTY = np.zeros(0, dtype=np.int64)

# --- Segments, rounds -----------------------------------------------------------------------------


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


class _Room(NamedTuple):
    """What may stay in the buffer after a round."""

    segments: int
    tokens: int


class _Tuning(NamedTuple):
    """Packed-only knobs of a round (see :class:`StreamingBatcher`)."""

    min_row_fill: float
    reserve: float


class _Cut(NamedTuple):
    """A round's decision, in positions of the buffer."""

    order: np.ndarray  # (num_emitted,) emitted positions in plan order
    row_offsets: np.ndarray  # (num_rows + 1,) into order
    batch_offsets: np.ndarray  # (num_batches + 1,) into rows
    batch_width: np.ndarray  # (num_batches,) padded tokens per row
    keep: np.ndarray  # positions that stay in the buffer, ascending
    drop: np.ndarray = _EMPTY  # positions left out (drop_last at the end of the stream)


def _fits(counts: np.ndarray, tokens: np.ndarray, room: _Room) -> int:
    """Length of the longest prefix whose segments and tokens fit ``room``."""
    if counts.size == 0:
        return 0
    k_count = np.searchsorted(np.cumsum(counts), room.segments, side="right")
    k_tokens = np.searchsorted(np.cumsum(tokens), room.tokens, side="right")
    return int(min(k_count, k_tokens))


def _batch_max(lens: np.ndarray, order: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    if len(offsets) < 2:
        return _EMPTY
    return np.maximum.reduceat(lens[order], offsets[:-1]).astype(np.int64)


def _padded_cut(
    order: np.ndarray, offsets: np.ndarray, width: np.ndarray, keep: np.ndarray, drop=_EMPTY
) -> _Cut:
    return _Cut(order, np.arange(order.shape[0] + 1, dtype=np.int64), offsets, width, keep, drop)


def _round_packed(
    lens: np.ndarray, spec: PackedSpec, rng: np.random.Generator, room: _Room | None, tuning: _Tuning
) -> _Cut:
    cap = spec.capacity
    by_size = sort_by_length(lens, rng, descending=True)  # (m,)
    sizes = lens[by_size]  # (m,) decreasing
    row_of, num_rows = pack(sizes, cap, spec.algorithm)
    fill = np.bincount(row_of, weights=sizes, minlength=num_rows).astype(np.int64)  # (num_rows,) tokens
    keep_rows = _EMPTY
    if room is not None:
        count = np.bincount(row_of, minlength=num_rows)  # (num_rows,) segments
        full = fill >= tuning.min_row_fill * cap
        under = np.flatnonzero(~full)
        under = under[
            np.argsort(fill[under], kind="stable")
        ]  # emptiest first: most to gain from new arrivals
        # Then the full rows packed last: they hold the shortest examples, which close the next round's gaps.
        last = np.flatnonzero(full)[::-1]
        reserve = tuning.reserve * lens.shape[0]
        last = last[: int(np.searchsorted(np.cumsum(count[last]), reserve, side="right"))]
        candidates = np.concatenate([under, last])
        keep_rows = candidates[: _fits(count[candidates], fill[candidates], room)]
    emit = np.ones(num_rows, dtype=bool)
    emit[keep_rows] = False
    emit_rows = np.flatnonzero(emit)
    if spec.shuffle and emit_rows.shape[0] > 1:
        emit_rows = emit_rows[permutation(emit_rows.shape[0], rng)]
    extra = emit_rows.shape[0] % spec.rows_per_batch
    if room is not None and extra:
        # Rows that do not make a whole batch wait for the next round, room permitting.
        kept = np.concatenate([keep_rows, emit_rows[-extra:]])
        counts = np.bincount(row_of, minlength=num_rows)[kept]
        if _fits(counts, fill[kept], room) == kept.shape[0]:
            keep_rows, emit_rows = kept, emit_rows[:-extra]
    num_emit, num_keep = emit_rows.shape[0], keep_rows.shape[0]
    label = np.empty(num_rows, dtype=np.int64)  # (num_rows,) output row of each packed row
    label[emit_rows] = np.arange(num_emit, dtype=np.int64)
    label[keep_rows] = num_emit + np.arange(num_keep, dtype=np.int64)
    ids, _, offsets = group_by_row(label[row_of], num_rows, by_size, sizes)
    end = int(offsets[num_emit])
    batch_offsets = fixed_offsets(num_emit, spec.rows_per_batch, drop_last=False)
    width = np.full(batch_offsets.shape[0] - 1, cap, dtype=np.int64)
    return _Cut(ids[:end], offsets[: num_emit + 1], batch_offsets, width, ids[end:])


def _round_token_budget(
    lens: np.ndarray, spec: TokenBudgetSpec, rng: np.random.Generator, room: _Room | None, _: _Tuning
) -> _Cut:
    order = sort_by_length(lens, rng)  # (m,) ascending
    sorted_lens = lens[order]
    max_bs = spec.max_batch_size if spec.max_batch_size is not None else _INF
    offsets = token_budget_cuts(sorted_lens, spec.max_tokens, spec.batch_size_multiple, max_bs)
    keep = _EMPTY
    if room is not None and offsets.shape[0] > 1:
        lo = int(offsets[-2])
        size = order.shape[0] - lo
        can_grow = (size + 1) * int(sorted_lens[-1]) <= spec.max_tokens and size < max_bs
        if can_grow and size <= room.segments and int(sorted_lens[lo:].sum()) <= room.tokens:
            keep, order, offsets = np.sort(order[lo:]), order[:lo], offsets[:-1]
    order, offsets = permute_batches(order, offsets, permutation(offsets.shape[0] - 1, rng))
    return _padded_cut(order, offsets, _batch_max(lens, order, offsets), keep)


def _round_fixed(
    lens: np.ndarray,
    spec: GroupByLengthSpec | RandomSpec | MaxLengthSpec,
    rng: np.random.Generator,
    room: _Room | None,
    _: _Tuning,
) -> _Cut:
    bs = spec.batch_size
    shuffle_batches = False
    if isinstance(spec, GroupByLengthSpec) and spec.mode == "megabatch":
        order, _ = megabatch_order(lens, bs, spec.megabatch_mult, rng)
    elif isinstance(spec, GroupByLengthSpec):
        order, shuffle_batches = sort_by_length(lens, rng), True
    else:
        order = permutation(lens.shape[0], rng)
    full = order.shape[0] // bs * bs
    tail = order[full:]
    keep = drop = _EMPTY
    if tail.size and room is None and spec.drop_last:
        drop, order = tail, order[:full]
    elif (
        tail.size and room is not None and tail.size <= room.segments and int(lens[tail].sum()) <= room.tokens
    ):
        keep, order = np.sort(tail), order[:full]
    offsets = fixed_offsets(order.shape[0], bs, drop_last=False)
    if shuffle_batches:
        order, offsets = permute_batches(order, offsets, permutation(offsets.shape[0] - 1, rng))
    if isinstance(spec, MaxLengthSpec):
        width = np.full(offsets.shape[0] - 1, spec.max_length, dtype=np.int64)
    else:
        width = _batch_max(lens, order, offsets)
    return _padded_cut(order, offsets, width, keep, drop)


_Round = Callable[[np.ndarray, Any, np.random.Generator, "_Room | None", _Tuning], _Cut]
_ROUNDS: dict[str, _Round] = {
    PackedSpec.name: _round_packed,
    TokenBudgetSpec.name: _round_token_budget,
    GroupByLengthSpec.name: _round_fixed,
    RandomSpec.name: _round_fixed,
    MaxLengthSpec.name: _round_fixed,
}


def _limit_of(spec: PlannerSpec) -> tuple[int | None, str]:
    """Most tokens one segment may hold under ``spec``, and the setting's name."""
    if isinstance(spec, PackedSpec):
        return spec.capacity, "capacity"
    if isinstance(spec, TokenBudgetSpec) and spec.max_length is None:
        return spec.max_tokens, "max_tokens"
    return spec.max_length, "max_length"


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
