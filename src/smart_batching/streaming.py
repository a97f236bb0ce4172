"""Smart batching for streamed datasets: an online planner over a bounded buffer.

A streamed dataset (``datasets.load_dataset(..., streaming=True)``, a generator) has no length array up
front, so the map-style planners cannot see it whole. :class:`StreamingBatcher` reads it into a bounded
buffer and, whenever the next example does not fit, plans the buffer with the same specs and compiled
kernels as :func:`~smart_batching.planners.plan_batches` (a *round*), emits the batches that are good
enough and keeps the rest to combine with new arrivals::

    source ──► buffer: ≤ buffer_size segments, ≤ buffer_tokens tokens ──► round: plan the buffer
                  ▲                                                          │
                  └────────── kept: what could still get better ◄────────────┤
                                                                             ▼
                                                         emitted batches, in plan order

What a round keeps (at the end of the stream everything left is planned and emitted):

===================  ===========================================================================
``packed``           the examples of rows filled below ``min_row_fill`` x capacity (emptiest first),
                     and the full rows packed last (short examples, to fill the next round's gaps)
                     up to ``reserve`` x the buffer
``token_budget``     the batch of the longest examples, while one more example would still fit it
``group_by_length``  the last incomplete batch (fewer than ``batch_size`` examples)
``random``           the last incomplete batch
``max_length``       the last incomplete batch (needs ``max_length=``)
===================  ===========================================================================

Kept examples hold at most half the bound (the fullest of the rows that could stay are emitted
otherwise), so every round admits at least half a buffer of new examples: planning is O(buffer) per
half buffer, O(n) over the stream, and memory is O(buffer) whatever the stream's length. Each example
is used exactly once: in one batch, or (``overlong="drop"``, ``drop_last``) counted as dropped.
Overlong examples follow the spec's policy as they enter the buffer; a split example's pieces are
separate segments (the buffer bound counts segments).

Rounds are deterministic: round ``k`` of epoch ``e`` draws from ``SeedSequence([seed, e, k])``.

Resuming. :meth:`StreamingBatcher.state_dict` stores a cursor, not the examples: the number of examples
consumed from the source, the round counter, and the buffered and emitted-but-unyielded segments as
(stream position, start, length) triples. :meth:`~StreamingBatcher.load_state_dict` re-opens the
source and skips to the saved position, re-reading the examples still buffered on the way (their
lengths are checked against the state, which catches a changed source). So the source must yield the
same examples in the same order each time it is iterated (a list, a ``datasets`` dataset or
``IterableDataset``), or be a callable ``open(start) -> iterable`` that yields the stream from
position ``start`` on (seekable sources: resuming then reads only from the oldest buffered example).
Storing positions instead of examples keeps the state a few ints per buffered segment and JSON- and
``torch.load(weights_only=True)``-safe; the price is re-reading the consumed prefix on resume.

Measured (2-CPU x86_64 shared with other jobs, load average ~5; 10M lengths resampled from GSM8K fed
as arrays of 65,536, capacity 2048, 10,000-example buffer): packed fill 99.9996 % against 99.9988 % for
the global plan, 2.3M examples/s wall (3.4M/s of process time) including handing out every batch. On
GSM8K, LIMA, SGD and SST-2 the 10k buffer is within 0.05 points of the global plan, where TRL's
per-1,000-row BFD gets 93.7-99.7 % (``benchmarks/streaming.py``).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from smart_batching.distributed import World
from smart_batching.errors import ConfigError, DataError, OverlongError
from smart_batching.plan import as_lengths
from smart_batching.planners import (
    GroupByLengthSpec,
    MaxLengthSpec,
    PackedSpec,
    PlannerSpec,
    RandomSpec,
    TokenBudgetSpec,
    make_spec,
)
from smart_batching.planners._common import (
    apply_overlong,
    fixed_offsets,
    permutation,
    permute_batches,
    sort_by_length,
)
from smart_batching.planners._kernels import group_by_row, token_budget_cuts
from smart_batching.planners.group_by_length import megabatch_order
from smart_batching.planners.packed import pack
from smart_batching.sampler import Segment

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


# --- Reading the source ------------------------------------------------------------------------------


def _is_opener(source: Any) -> bool:
    return callable(source) and not isinstance(source, Iterable)


class _Reader:
    """Reads a source from a position on, in chunks of lengths (and the examples, when it yields them).

    The source's items decide its kind, from the first one: mappings (or anything, with ``length_fn``)
    are examples; integers are lengths; 1-D integer arrays are chunks of lengths.
    """

    def __init__(self, source: Any, length_fn: Callable[[Any], int] | None, start: int) -> None:
        if _is_opener(source):
            self._it: Iterator[Any] = iter(source(start))
            self.pos = start
        else:
            self._it = iter(source)
            self.pos = 0
        self.length_fn = length_fn
        self.kind: str | None = None  # "examples" | "lengths" | "chunks"
        self._chunk = _EMPTY
        self._chunk_at = 0

    def _detect(self) -> bool:
        first = next(self._it, _END)
        if first is _END:
            return False
        self._it = itertools.chain([first], self._it)
        if self.length_fn is not None or isinstance(first, Mapping):
            self.kind = "examples"
        elif isinstance(first, np.ndarray) and first.ndim == 1:
            self.kind = "chunks"
        elif isinstance(first, (int, np.integer)) and not isinstance(first, bool):
            self.kind = "lengths"
        else:
            raise DataError(
                f"cannot batch stream items of type {type(first).__name__}: yield mappings with 'input_ids', "
                "integer token lengths or 1-D arrays of lengths, or pass length_fn="
            )
        return True

    def _length(self, item: Any) -> int:
        if self.length_fn is not None:
            return int(self.length_fn(item))
        try:
            return len(item["input_ids"])
        except (KeyError, TypeError) as exc:
            keys = sorted(item) if isinstance(item, Mapping) else type(item).__name__
            raise DataError(
                f"stream example at position {self.pos} has no 'input_ids' ({keys}); pass length_fn= to "
                "say how many tokens an example holds"
            ) from exc

    def read(self, n: int) -> tuple[np.ndarray, list[Any] | None] | None:
        """Up to ``n`` items from the current position (fewer at a chunk's end); None at the stream's end."""
        if self.kind is None and not self._detect():
            return None
        examples = None
        if self.kind == "examples":
            examples = list(itertools.islice(self._it, min(n, _READ_EXAMPLES)))
            if not examples:
                return None
            lengths = np.fromiter(map(self._length, examples), dtype=np.int64, count=len(examples))
        elif self.kind == "lengths":
            try:
                lengths = np.fromiter(itertools.islice(self._it, min(n, _READ_LENGTHS)), dtype=np.int64)
            except (TypeError, ValueError) as exc:
                raise DataError(f"stream of lengths near position {self.pos}: {exc}") from exc
            if lengths.size == 0:
                return None
        else:
            while self._chunk_at >= self._chunk.shape[0]:
                chunk = next(self._it, _END)
                if chunk is _END:
                    return None
                self._chunk = as_lengths(chunk, name=f"chunk of lengths at stream position {self.pos}")
                self._chunk_at = 0
            lengths = self._chunk[self._chunk_at : self._chunk_at + n]
            self._chunk_at += lengths.shape[0]
        if lengths.size and lengths.min() < 0:
            bad = int(np.flatnonzero(lengths < 0)[0])
            raise DataError(
                f"stream example at position {self.pos + bad} has a negative length {int(lengths[bad])}"
            )
        self.pos += lengths.shape[0]
        return lengths, examples


# --- The batcher -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamingStats:
    """Running figures of a :class:`StreamingBatcher`. Tokens count token positions.

    Batches count once planned (emitted by a round), including those queued but not yet yielded.

    Attributes:
        num_examples: examples read from the source so far.
        efficiency: real tokens / token slots of the emitted batches (1.0: no padding).
        num_buffered: segments in the buffer now; ``max_buffered`` the most it has held.
    """

    strategy: str
    num_examples: int
    num_segments: int
    num_batches: int
    num_rows: int
    real_tokens: int
    token_slots: int
    efficiency: float
    padding_ratio: float
    num_over_limit: int
    num_truncated: int
    truncated_tokens: int
    num_split: int
    num_dropped: int
    dropped_tokens: int
    num_rounds: int
    num_buffered: int
    max_buffered: int
    max_buffered_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_COUNTERS = (
    "num_examples",
    "num_segments",
    "num_batches",
    "num_rows",
    "real_tokens",
    "token_slots",
    "num_over_limit",
    "num_truncated",
    "truncated_tokens",
    "num_split",
    "num_dropped",
    "dropped_tokens",
    "max_buffered",
    "max_buffered_tokens",
)


def _positive_or_none(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name}= must be a positive integer or None, got {value!r}")
    return int(value)


def _non_negative(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ConfigError(f"{name}= must be a non-negative integer, got {value!r}")
    return int(value)


class StreamingBatcher:
    """Plan batches over a stream with a bounded buffer; iterate it to get them.

    Example::

        ds = load_dataset("json", data_files=..., split="train", streaming=True).map(tokenize)
        batcher = StreamingBatcher(ds, "packed", capacity=4096, buffer_size=10_000)
        for features in batcher:           # list of example dicts: one packed row per batch
            batch = PackingCollator()(features)

    Args:
        source: The stream: an iterable of tokenized examples (mappings with ``input_ids``), of integer
            token lengths, or of 1-D integer arrays of lengths (chunks: the fast path, no Python work
            per example); or a callable ``open(start) -> iterable`` yielding the stream from example
            ``start`` on. It must yield the same items each time it is opened for resuming.
            Examples cost Python work each (reading, ``len``); lengths in arrays cost none.
        spec_or_name: A planner spec (``PackedSpec``, ``TokenBudgetSpec``, ``GroupByLengthSpec``,
            ``RandomSpec``, ``MaxLengthSpec`` with ``max_length``) or its name.
        buffer_size: Most segments (examples, or pieces of split ones) the buffer holds; None means no
            count bound (then ``buffer_tokens`` is needed). One example bigger than the whole bound is
            admitted alone.
        buffer_tokens: Most tokens the buffer holds; None means no token bound.
        seed: Base seed; batches are a pure function of (stream, spec, buffer bounds, seed, epoch).
        epoch: Epoch to start at; :meth:`set_epoch` moves to another one.
        length_fn: Tokens of one example; None means ``len(example["input_ids"])``. With it, every
            item is an example, whatever its type.
        min_row_fill: ``packed`` only: a row is emitted before the stream ends once it holds at least
            this fraction of ``capacity``; None means 0.999.
        reserve: ``packed`` only: a round also keeps back the full rows it packed last (they hold the
            shortest examples, the best gap fillers for the next round) up to this fraction of the
            buffer's examples; None means 0.1. It matters most for short streams, whose last rounds
            pack what is left (SGD, 12k examples, 10k buffer: 99.50 % fill with 0, 99.77 % with 0.1,
            99.82 % with 0.25 = the global plan); each kept example is planned again, so 0.1 costs
            about 1.2x the rounds of 0 and 0.25 about 1.5x.
        progress: Show a tqdm bar with examples read and the running efficiency.
        **options: The spec's fields when ``spec_or_name`` is a name, e.g. ``capacity=4096``.

    Yields:
        One batch at a time: the examples of the batch (row after row) when the source yields
        examples, with ``segment_start``/``segment_length`` added to examples the overlong policy cut
        (the collators in :mod:`smart_batching.collate` slice by them); stream positions (ints) when
        it yields lengths, with :class:`~smart_batching.sampler.Segment` keys in place of the
        examples the overlong policy truncated or split (``SegmentDataset`` takes both).
    """

    def __init__(
        self,
        source: Any,
        spec_or_name: Any,
        *,
        buffer_size: int | None = 10_000,
        buffer_tokens: int | None = None,
        seed: int = 0,
        epoch: int = 0,
        length_fn: Callable[[Any], int] | None = None,
        min_row_fill: float | None = None,
        reserve: float | None = None,
        progress: bool = False,
        **options: Any,
    ) -> None:
        self.spec = make_spec(spec_or_name, **options)
        if self.spec.name not in _ROUNDS:
            raise ConfigError(
                f"strategy {self.spec.name!r} cannot stream; choose one of: {', '.join(_ROUNDS)}"
            )
        self.buffer_size = _positive_or_none("buffer_size", buffer_size)
        self.buffer_tokens = _positive_or_none("buffer_tokens", buffer_tokens)
        if self.buffer_size is None and self.buffer_tokens is None:
            raise ConfigError(
                "give buffer_size= (examples) or buffer_tokens= (tokens): the buffer must be bounded"
            )
        batch_size = getattr(self.spec, "batch_size", None)
        if batch_size is not None and self.buffer_size is not None and self.buffer_size < batch_size:
            raise ConfigError(
                f"buffer_size={self.buffer_size} is smaller than batch_size={batch_size}: raise buffer_size="
            )
        if isinstance(self.spec, MaxLengthSpec) and self.spec.max_length is None:
            raise ConfigError(
                "max_length streaming needs max_length=: a stream's longest example is unknown until its end"
            )
        for name, value in (("min_row_fill", min_row_fill), ("reserve", reserve)):
            if value is not None and not isinstance(self.spec, PackedSpec):
                raise ConfigError(f"{name}= applies to packed only, not to {self.spec.name!r}; leave it out")
        self.min_row_fill = DEFAULT_MIN_ROW_FILL if min_row_fill is None else float(min_row_fill)
        if not 0.0 <= self.min_row_fill <= 1.0:
            raise ConfigError(f"min_row_fill= must be a fraction in [0, 1], got {min_row_fill!r}")
        self.reserve = DEFAULT_RESERVE if reserve is None else float(reserve)
        if not 0.0 <= self.reserve <= 0.5:
            raise ConfigError(f"reserve= must be a fraction in [0, 0.5] of the buffer, got {reserve!r}")
        self.source = source
        self.seed = _non_negative("seed", seed)
        self.length_fn = length_fn
        self.progress = progress
        self._limit, self._setting = _limit_of(self.spec)
        self._policy: str = self.spec.overlong
        self._generation = 0
        self._reset(_non_negative("epoch", epoch))

    # -- state ----------------------------------------------------------------------------------------

    def _reset(self, epoch: int) -> None:
        self._epoch = epoch
        self._consumed = 0  # examples taken from the source into the buffer
        self._rounds = 0
        self._flushed = False  # the stream ended and the last round emitted everything
        self._done = False  # an iterator ran to the end of this epoch: the next one starts the next epoch
        self._buffer = _NO_SEGS
        self._buffered_tokens = 0
        self._ready: _Emission | None = None  # the last round's batches ...
        self._ready_next = 0  # ... from this one on not yet yielded
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._examples: dict[int, list[Any]] = {}  # stream position -> [example, segments not yet yielded]
        self._reader: _Reader | None = None
        self._pending: tuple[np.ndarray, list[Any] | None] | None = None  # read but not yet taken

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def num_consumed(self) -> int:
        """Examples taken from the source so far in this epoch."""
        return self._consumed

    @property
    def stats(self) -> StreamingStats:
        c = self._counters
        slots = c["token_slots"]
        eff = c["real_tokens"] / slots if slots else 1.0
        return StreamingStats(
            strategy=self.spec.name,
            efficiency=eff,
            padding_ratio=1.0 - eff,
            num_rounds=self._rounds,
            num_buffered=int(self._buffer.ids.shape[0]),
            **c,
        )

    def _config(self) -> dict[str, Any]:
        return {
            "strategy": self.spec.name,
            "spec": repr(self.spec),
            "seed": self.seed,
            "buffer_size": self.buffer_size,
            "buffer_tokens": self.buffer_tokens,
            "min_row_fill": self.min_row_fill,
            "reserve": self.reserve,
        }

    def state_dict(self) -> dict[str, Any]:
        """The cursor after the last batch yielded: JSON-serialisable ints, lists and strings.

        ``{version, config, epoch, num_consumed, num_rounds, flushed, done, buffer, ready, counters}``: the
        settings it was made with, the examples consumed from the source, the buffered segments and
        the emitted segments not yet yielded, as stream positions (see the module docstring).
        """
        em = self._ready
        ready = em.rest(self._ready_next) if em is not None and self._ready_next < em.num_batches else None
        return {
            "version": STATE_VERSION,
            "config": self._config(),
            "epoch": self._epoch,
            "num_consumed": self._consumed,
            "num_rounds": self._rounds,
            "flushed": self._flushed,
            "done": self._done,
            "buffer": self._buffer.to_state(),
            "ready": ready,
            "counters": dict(self._counters),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next iteration re-opens the source at the saved position.

        Raises:
            ConfigError: the state was saved with other settings (the message names them).
        """
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ConfigError(f"not a StreamingBatcher state of version {STATE_VERSION}")
        ours = self._config()
        changed = [
            f"{k}={state['config'].get(k)!r} (now {v!r})"
            for k, v in ours.items()
            if state["config"].get(k) != v
        ]
        if changed:
            raise ConfigError(
                "cannot resume the streaming batcher: the state was saved with "
                + ", ".join(changed)
                + ". Create the batcher with the saved settings."
            )
        self._reset(_non_negative("epoch", state["epoch"]))
        self._consumed = _non_negative("num_consumed", state["num_consumed"])
        self._rounds = _non_negative("num_rounds", state["num_rounds"])
        self._flushed = bool(state["flushed"])
        self._done = bool(state["done"])
        self._buffer = _Segs.from_state(state["buffer"])
        self._buffered_tokens = int(self._buffer.seg_lengths.sum())
        if state["ready"] is not None:
            self._ready = _Emission.from_state(state["ready"])
        self._counters.update({k: int(state["counters"][k]) for k in _COUNTERS})
        self._generation += 1

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from the stream's beginning; a no-op when it is already the current epoch.

        At the start of each epoch the source's own ``set_epoch`` (HF ``IterableDataset``) is called too.
        """
        epoch = _non_negative("epoch", epoch)
        if epoch != self._epoch:
            self._reset(epoch)
            self._generation += 1

    # -- iteration ------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[list[Any]]:
        self._generation += 1
        if self._done:
            self._reset(self._epoch + 1)
        return self._iterate(self._generation)

    def _iterate(self, generation: int) -> Iterator[list[Any]]:
        if self._reader is None:
            self._open()
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(desc=f"streaming {self.spec.name}", unit="ex", initial=self._consumed)
        try:
            while True:
                em = self._ready
                if em is not None and self._ready_next < em.num_batches:
                    make = self._batch_maker(em)
                    for b in range(self._ready_next, em.num_batches):
                        if generation != self._generation:
                            return
                        self._ready_next = b + 1  # a state taken while the batch is in use counts it
                        yield make(b)
                if generation != self._generation:
                    return
                if self._flushed:
                    self._done = True
                    return
                self._round(self._fill())
                if bar is not None:
                    bar.update(self._consumed - bar.n)
                    bar.set_postfix(efficiency=f"{self.stats.efficiency:.2%}", refresh=False)
        finally:
            if bar is not None:
                bar.close()

    def _open(self) -> None:
        """Open the source at the cursor, re-reading the examples still buffered or queued."""
        if not _is_opener(self.source) and hasattr(self.source, "set_epoch"):
            self.source.set_epoch(self._epoch)
        held = (
            _Segs.concat([self._buffer, self._ready.segs.tail(self._ready.bounds[self._ready_next])])
            if (self._ready is not None)
            else self._buffer
        )
        want, first = np.unique(held.ids, return_index=True)  # (num_held,) ascending positions
        want_lengths = held.lengths[first]
        refs = np.bincount(np.searchsorted(want, held.ids), minlength=want.shape[0])
        start = int(want[0]) if want.size else self._consumed
        reader = _Reader(self.source, self.length_fn, start)
        self._reader = reader
        self._pending = None
        self._examples = {}
        got = 0
        while reader.pos < self._consumed:
            chunk = reader.read(self._consumed - reader.pos)
            if chunk is None:
                raise DataError(
                    f"the source ended after {reader.pos} examples, but the state was saved after "
                    f"{self._consumed}: it changed, or it cannot be re-read from its start (pass a re-iterable "
                    "source or an open(start) callable)"
                )
            lengths, examples = chunk
            p0 = reader.pos - lengths.shape[0]
            lo, hi = np.searchsorted(want, [p0, reader.pos])
            rel = want[lo:hi] - p0
            if not np.array_equal(lengths[rel], want_lengths[lo:hi]):
                bad = int(rel[np.flatnonzero(lengths[rel] != want_lengths[lo:hi])[0]])
                raise DataError(
                    f"the source changed since the state was saved: the example at stream position {p0 + bad} "
                    f"has {int(lengths[bad])} tokens, the state says {int(want_lengths[lo + np.searchsorted(rel, bad)])}"
                )
            if examples is not None:
                for j, r in zip(range(lo, hi), rel.tolist(), strict=True):
                    self._examples[int(want[j])] = [examples[r], int(refs[j])]
            got += hi - lo
        if got != want.shape[0]:
            raise DataError(
                f"re-read {got} of the {want.shape[0]} buffered examples: the state does not fit this source"
            )

    def _costs(self, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(segments, tokens) each example needs in the buffer under the overlong policy."""
        pieces = np.ones(lens.shape[0], dtype=np.int64)
        limit = self._limit
        if limit is None:
            return pieces, lens
        over = lens > limit
        if not over.any():
            return pieces, lens
        tokens = lens.copy()
        if self._policy == "drop":
            pieces[over] = 0
            tokens[over] = 0
        elif self._policy == "truncate":
            tokens[over] = limit
        elif self._policy == "split":
            pieces[over] = -(-lens[over] // limit)
        return pieces, tokens

    def _fill(self) -> tuple[int, int] | None:
        """Take examples into the buffer until the next one does not fit.

        Returns:
            ``(segments, tokens)`` the next example needs, or None when the stream has ended.
        """
        assert self._reader is not None
        bound_count = self.buffer_size or _INF
        bound_tokens = self.buffer_tokens or _INF
        parts = [self._buffer]
        count = int(self._buffer.ids.shape[0])
        need = None
        while True:
            if self._pending is None:
                self._pending = self._reader.read(
                    max(bound_count - count, 1) if self.buffer_size else _READ_LENGTHS
                )
                if self._pending is None:
                    break
            lens, examples = self._pending
            pieces, tokens = self._costs(lens)
            k = _fits(pieces, tokens, _Room(bound_count - count, bound_tokens - self._buffered_tokens))
            if k == 0 and count == 0:
                k = 1  # an example bigger than the whole bound enters alone
            if k:
                new = self._ingest(lens[:k], None if examples is None else examples[:k])
                parts.append(new)
                count += new.ids.shape[0]
                self._buffered_tokens += int(new.seg_lengths.sum())
            if k < lens.shape[0]:
                self._pending = (lens[k:], None if examples is None else examples[k:])
                need = (int(pieces[k]), int(tokens[k]))
                break
            self._pending = None
        self._buffer = _Segs.concat(parts)
        c = self._counters
        c["max_buffered"] = max(c["max_buffered"], count)
        c["max_buffered_tokens"] = max(c["max_buffered_tokens"], self._buffered_tokens)
        return need

    def _ingest(self, lens: np.ndarray, examples: list[Any] | None) -> _Segs:
        """Apply the overlong policy to examples leaving the source; returns their segments."""
        p0 = self._consumed
        limit = self._limit
        if self._policy == "error" and limit is not None and lens.size and int(lens.max()) > limit:
            bad = int(np.flatnonzero(lens > limit)[0])
            raise OverlongError(
                f"the example at stream position {p0 + bad} has {int(lens[bad])} tokens, more than "
                f"{self._setting}={limit}. Raise {self._setting}=, or choose overlong='truncate', 'split' or 'drop'."
            )
        segs = apply_overlong(lens, limit, self._policy, self._setting)
        o = segs.overlong
        c = self._counters
        c["num_examples"] += lens.shape[0]
        c["num_over_limit"] += o.num_over_limit
        c["num_truncated"] += o.num_truncated
        c["truncated_tokens"] += o.truncated_tokens
        c["num_split"] += o.num_split
        c["num_dropped"] += o.num_dropped
        c["dropped_tokens"] += o.dropped_tokens
        self._consumed += lens.shape[0]
        if examples is not None:
            refs = np.bincount(segs.example_ids, minlength=lens.shape[0])
            for i in np.flatnonzero(refs).tolist():
                self._examples[p0 + i] = [examples[i], int(refs[i])]
        return _Segs(segs.example_ids + p0, segs.starts, segs.lengths, lens[segs.example_ids])

    def _round(self, need: tuple[int, int] | None) -> None:
        """Plan the buffer; emit what is good enough (everything when ``need`` is None: the stream ended)."""
        buf = self._buffer
        room = None
        if need is not None:
            bc, bt = self.buffer_size or _INF, self.buffer_tokens or _INF
            room = _Room(max(0, min(bc // 2, bc - need[0])), max(0, min(bt // 2, bt - need[1])))
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, self._epoch, self._rounds]))
        tuning = _Tuning(self.min_row_fill, self.reserve)
        cut = _ROUNDS[self.spec.name](buf.seg_lengths, self.spec, rng, room, tuning)
        self._rounds += 1
        em = _Emission(buf.take(cut.order), cut.row_offsets, cut.batch_offsets, cut.batch_width)
        self._buffer = buf.take(cut.keep)
        self._buffered_tokens = int(self._buffer.seg_lengths.sum())
        c = self._counters
        if cut.drop.size:
            dropped = buf.take(cut.drop)
            ids = np.unique(dropped.ids)
            c["num_dropped"] += ids.shape[0]
            c["dropped_tokens"] += int(dropped.seg_lengths.sum())
            for pos in ids.tolist():
                self._examples.pop(pos, None)
        c["num_segments"] += em.segs.ids.shape[0]
        c["num_batches"] += em.num_batches
        c["num_rows"] += em.row_offsets.shape[0] - 1
        c["real_tokens"] += int(em.segs.seg_lengths.sum())
        c["token_slots"] += int((np.diff(em.batch_offsets) * em.batch_width).sum())
        self._ready, self._ready_next = em, 0
        self._flushed = need is None

    def _batch_maker(self, em: _Emission) -> Callable[[int], list[Any]]:
        """A function from batch number to what iteration yields for it (see the class docstring)."""
        bounds, ids = em.bounds, em.ids
        if self._reader is not None and self._reader.kind == "examples":
            starts, seg_lengths = em.segs.starts.tolist(), em.segs.seg_lengths.tolist()
            cut = (em.segs.seg_lengths != em.segs.lengths).tolist()
            store = self._examples

            def examples(b: int) -> list[Any]:
                out = []
                for j in range(bounds[b], bounds[b + 1]):
                    pos = ids[j]
                    entry = store[pos]
                    entry[1] -= 1
                    if entry[1] == 0:
                        del store[pos]
                    ex = entry[0]
                    if cut[j]:
                        if not isinstance(ex, Mapping):
                            raise DataError(
                                f"the example at stream position {pos} was cut by overlong="
                                f"{self._policy!r}, but it is a {type(ex).__name__}, not a mapping that "
                                "can carry segment_start/segment_length; use overlong='drop' or 'error'"
                            )
                        ex = {**ex, "segment_start": starts[j], "segment_length": seg_lengths[j]}
                    out.append(ex)
                return out

            return examples
        cut = np.flatnonzero(em.segs.seg_lengths != em.segs.lengths)
        if cut.size:
            # Keys of the segments the overlong policy cut; whole examples stay plain positions.
            ids = list(ids)
            segs = em.segs
            for j, e, s, n in zip(
                cut.tolist(),
                segs.ids[cut].tolist(),
                segs.starts[cut].tolist(),
                segs.seg_lengths[cut].tolist(),
                strict=True,
            ):
                ids[j] = Segment(e, s, n)
        return lambda b: ids[bounds[b] : bounds[b + 1]]

    def __repr__(self) -> str:
        return (
            f"StreamingBatcher({self.spec!r}, buffer_size={self.buffer_size}, buffer_tokens={self.buffer_tokens}, "
            f"seed={self.seed}, epoch={self._epoch}, num_consumed={self._consumed})"
        )


# --- Sharding and the torch dataset ------------------------------------------------------------------


def _strided(it: Iterator[Any], step: int, offset: int) -> Iterator[Any]:
    """Items ``offset, offset + step, ...`` of a stream; chunks of lengths are strided element-wise."""
    first = next(it, _END)
    if first is _END:
        return
    it = itertools.chain([first], it)
    if isinstance(first, np.ndarray):
        skip = offset
        for chunk in it:
            chunk = np.asarray(chunk)
            if skip < chunk.shape[0]:
                yield chunk[skip::step]
            skip = (skip - chunk.shape[0]) % step
        return
    yield from itertools.islice(it, offset, None, step)


class _Strided:
    """A re-iterable (or re-openable) round-robin shard of a source."""

    def __init__(self, source: Any, step: int, offset: int) -> None:
        self.source, self.step, self.offset = source, step, offset

    def __iter__(self) -> Iterator[Any]:
        return _strided(iter(self.source), self.step, self.offset)

    def open(self, start: int) -> Iterator[Any]:
        return _strided(iter(self.source(start * self.step + self.offset)), self.step, 0)


def _is_hf_iterable(obj: Any) -> bool:
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(obj, datasets.IterableDataset)


def _to_global(batch: list[Any], step: int, offset: int) -> list[Any]:
    return [
        Segment(x.example * step + offset, x.start, x.length) if isinstance(x, Segment) else x * step + offset
        for x in batch
    ]


class StreamingBatchDataset(IterableDataset):
    """A torch ``IterableDataset`` of planned batches over a stream, sharded over ranks and workers.

    Use it with ``batch_size=None`` (each item already is a batch)::

        ds = StreamingBatchDataset(hf_stream, "packed", capacity=4096, collate_fn=PackingCollator())
        loader = DataLoader(ds, batch_size=None, num_workers=2)

    Every DataLoader worker of every rank plans its own disjoint shard of the stream with its own
    :class:`StreamingBatcher`, so each example is used exactly once overall:

    * a ``datasets.IterableDataset`` is split across ranks with ``datasets.distributed.split_dataset_by_node``
      (by shards when ``num_shards`` is a multiple of ``world_size``, else by examples); ``datasets``
      then deals its shards to the DataLoader workers itself (workers beyond ``num_shards`` get none);
    * any other source is dealt round-robin: shard ``rank * num_workers + worker`` of
      ``world_size * num_workers`` takes every that-many-th example (each shard reads the whole stream
      and keeps its share; chunks of lengths are strided element-wise). Stream positions in the
      batches of a lengths source are global. So do not pass a source that already splits itself
      by worker or rank (another ``IterableDataset`` that reads ``get_worker_info``): its examples
      would be dealt twice and most of them lost.

    Ranks may get different numbers of batches (their shards differ): wrap each rank's loader in
    :class:`~smart_batching.even_steps.EvenSteps` to step in lockstep (the Trainer integration does).

    Args:
        source, spec_or_name, buffer_size, buffer_tokens, seed, length_fn, min_row_fill, reserve, progress,
        **options: As :class:`StreamingBatcher` (per worker: the bounds apply to each worker).
        rank: This process's rank; None (with ``world_size=None``) reads it from ``torch.distributed``
            via :meth:`~smart_batching.distributed.World.detect`. Create the dataset after
            ``init_process_group``.
        world_size: Number of ranks; see ``rank``.
        collate_fn: Applied to each batch in the worker (e.g. :class:`~smart_batching.collate.PackingCollator`);
            None yields the batch as a list.
    """

    def __init__(
        self,
        source: Any,
        spec_or_name: Any,
        *,
        buffer_size: int | None = 10_000,
        buffer_tokens: int | None = None,
        seed: int = 0,
        length_fn: Callable[[Any], int] | None = None,
        min_row_fill: float | None = None,
        reserve: float | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        progress: bool = False,
        **options: Any,
    ) -> None:
        self.spec = make_spec(spec_or_name, **options)
        if rank is None and world_size is None:
            self.world = World.detect()
        elif rank is None or world_size is None:
            raise ConfigError(
                "pass both rank= and world_size=, or neither (to read them from torch.distributed)"
            )
        else:
            self.world = World(int(rank), int(world_size))
        self.source = source
        self.collate_fn = collate_fn
        self._kwargs: dict[str, Any] = {
            "buffer_size": buffer_size,
            "buffer_tokens": buffer_tokens,
            "seed": seed,
            "length_fn": length_fn,
            "min_row_fill": min_row_fill,
            "reserve": reserve,
            "progress": progress,
        }
        StreamingBatcher([], self.spec, **self._kwargs)  # validate the settings here, not in a worker
        self._epoch = 0
        self._batcher: StreamingBatcher | None = None
        self._shard_key: tuple[int, int, int, int] | None = None
        self._resume: Mapping[str, Any] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Plan epoch ``epoch`` on the next iteration (HF Trainer calls this at each epoch start)."""
        self._epoch = _non_negative("epoch", epoch)

    def _shard(self, worker: int, num_workers: int) -> tuple[Any, int, int]:
        """This worker's source and how its positions map to the stream's: ``global = local * step + offset``."""
        rank, world_size = self.world.rank, self.world.world_size
        if _is_hf_iterable(self.source):
            if world_size == 1:
                return self.source, 1, 0
            from datasets.distributed import split_dataset_by_node

            return split_dataset_by_node(self.source, rank=rank, world_size=world_size), 1, 0
        step, offset = world_size * num_workers, rank * num_workers + worker
        if step == 1:
            return self.source, 1, 0
        strided = _Strided(self.source, step, offset)
        return (strided.open if _is_opener(self.source) else strided), step, offset

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        source, step, offset = self._shard(worker, num_workers)
        batcher = StreamingBatcher(source, self.spec, epoch=self._epoch, **self._kwargs)
        key = (self.world.rank, self.world.world_size, worker, num_workers)
        if self._resume is not None:
            saved = tuple(self._resume["shard"])
            if saved != key:
                raise ConfigError(
                    f"cannot resume: the state was saved by (rank, world_size, worker, num_workers)={saved}, "
                    f"this is {key}; resume with the same number of ranks and DataLoader workers"
                )
            batcher.load_state_dict(self._resume["batcher"])
            self._resume = None
        self._batcher, self._shard_key = batcher, key
        if batcher._done:  # this worker had finished the epoch: the next one starts at set_epoch
            return
        for batch in batcher:
            if step != 1 and batch and not isinstance(batch[0], Mapping):
                batch = _to_global(batch, step, offset)
            yield batch if self.collate_fn is None else self.collate_fn(batch)

    def state_dict(self) -> dict[str, Any]:
        """This worker's cursor (``torchdata``'s ``StatefulDataLoader`` collects one per worker)."""
        if self._batcher is None:
            return {"epoch": self._epoch, "shard": None, "batcher": None}
        return {"epoch": self._epoch, "shard": list(self._shard_key), "batcher": self._batcher.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` on the next iteration."""
        self._epoch = _non_negative("epoch", state["epoch"])
        self._resume = state if state.get("batcher") is not None else None


__all__ = ["STATE_VERSION", "StreamingBatchDataset", "StreamingBatcher", "StreamingStats"]
