"""``packed``: several examples per fixed-capacity row (sample packing), near the fewest rows possible.

Sort by length, descending (ties at random, radix sort), then best-fit-decreasing: each example goes to
the fullest row it still fits, found through buckets of rows keyed by remaining capacity and a two-level
bitmap over the buckets: O(n) plus O(1) word operations per example. First-fit-decreasing is available
for comparison (a segment tree over rows, O(n log rows)). Rows are shuffled and grouped
``rows_per_batch`` to a batch. 10M examples at capacity 4096 plan in about 0.47x the time of numpy's
stable argsort of their lengths after compile warm-up (0.39 s on a 2-core EPYC with transparent huge
pages), against minutes for TRL's BFD (``benchmarks/planner_speed.py``).

``auto`` also fills rows exactly (subset sum on bitsets over the distinct sizes, O(log d) plus the
subset sum per row) and repairs the plan by large-neighbourhood search, whose work is bounded linearly
in n at any capacity (:data:`REFINE_WORK`); at long-context capacities it stops within 0.1 % of the
lower bound. 50k lognormal lengths (median 4,000) at capacity 32,768: a few milliseconds, rows 1.0001 x
the lower bound.

``spread`` mixes lengths in every row instead of filling rows tightly: longest processing time (each
example, longest first, into the emptiest of as many rows as BFD needs, more where one would overflow;
a bucket queue over loads, O(n) plus the mean load per pass; where rows overflow, more rows and then a
bisection to the fewest that fit). Lognormal lengths (median 149) at capacity 4,096: 1M in 0.08 s, rows
99.72 % full; 10M in 0.88 s, 99.66 % (BFD: 0.04 and 0.41 s, 99.97 %; ``auto``: 0.10 and 0.42 s, 100.00
and 99.97 %; ``benchmarks/spread_speed.py``). Longest processing time leaves rows as far apart as the
last round's examples are long, so it fills worse where few examples share a row (a stream of about 7
to a row at capacity 2,048: 98.25 %). ``spread_fit`` closes that gap: it spreads the longest examples
(90 % of the tokens) and best-fits the shortest into the rows' gaps: 99.95 % at 1M and 10M (0.05 and
0.54 s), 100.00 % in that stream; it is ``packed``'s default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from smart_batching.errors import ConfigError
from smart_batching.plan import Batches, packing_lower_bound
from smart_batching.planners._common import (
    PlanParts,
    apply_overlong,
    fixed_offsets,
    in_order,
    permutation,
    sort_by_length,
)
from smart_batching.planners._packing_kernels import (
    _CTZ_TABLE,
    best_fit_decreasing,
    best_fit_into,
    fill_rows,
    first_fit_decreasing,
    group_by_row,
    row_loads,
    spread_rows,
    tail_count,
)
from smart_batching.planners._rounds import EMPTY, fits
from smart_batching.planners._spec import Cut, Knobs, MicroBatchLimits, PlannerSpec, Room, Tuning

ALGORITHMS = ("auto", "bfd", "fill", "ffd", "spread", "spread_fit")
MAX_CAPACITY = 262_143
FILL_WINDOW = 512  # gap (tokens) below which `fill` solves the row exactly
AUTO_BOTH_MAX = 1_000_000  # up to this many examples, `auto` tries both algorithms when one misses the bound
# Above this many examples `auto` uses BFD alone: its gap to the bound shrinks with n (0.35 % at 10M GSM8K
# lengths, 4096 capacity) while exact filling costs ~3x more time.
AUTO_FILL_MAX = 2_000_000
# Up to this many examples, `auto` then repairs the plan by large-neighbourhood search (below).
REFINE_MAX = 200_000
REFINE_ITERS = 400
# and once it has spent this many bitset word operations per example (each pooled example costs about
# one subset-sum layer of capacity / 64 words): work linear in n at any capacity. No shared dataset
# reaches it at capacities up to 4,096 (SGD dialogues at 1,024: about 600 per example).
REFINE_WORK = 1_000
# From this capacity on (long context: many examples per row, fill and BFD already within 0.05 % of the
# bound at 50k examples), refinement also stops once rows are within REFINE_TOLERANCE of the bound,
# where it would spend far more than the row it could still save.
LONG_CONTEXT = 8192
REFINE_TOLERANCE = 1e-3
SPREAD_BISECT = 8  # bisection passes of `spread` between a row count that overflows and one that fits
SPREAD_FIT_TAIL = 0.1  # `spread_fit`: the shortest examples holding this share of the tokens fill the gaps


@dataclass(frozen=True, kw_only=True)
class PackedSpec(PlannerSpec):
    """Rows of ``capacity`` tokens, each filled with several whole examples.

    Attributes:
        capacity: tokens per row.
        rows_per_batch: rows per batch (a padding-free collator flattens them into one sequence).
        algorithm: ``"spread_fit"`` (the default): rows of mixed lengths. The longest examples (nine
            tenths of the tokens) are spread over the rows BFD needs, each into the emptiest row (longest
            processing time), then the shortest best-fit into the gaps. Every row then holds long and
            short examples alike, so no optimizer step is one of short examples only (the weight of a
            token stays level across lengths; in the study of benchmarks/RESULTS.md it reached random's
            held-out loss sooner than ``auto``). Where many examples share a row it needs BFD's rows or a
            few tenths of a percent more; where few do, more (12.5 % more than BFD on Schema-Guided
            dialogues at capacity 1,024): with the padding-free collator those are more, smaller steps,
            not padding; ``"auto"`` gives the fewest rows.
            ``"auto"``: the fewest rows, with rows of like lengths: ``bfd`` where examples over half the
            capacity set the lower bound or above 2M examples, else ``fill``; up to 1M examples, the
            other one too when the first misses the bound, keeping the fewer rows; up to 200k examples,
            then :func:`refine` (large-neighbourhood search) while above the lower bound.
            ``"bfd"`` (best-fit-decreasing), ``"fill"`` (row-by-row exact filling by subset sum),
            ``"ffd"`` (first-fit-decreasing). ``"spread"``: longest processing time over all the
            examples, on as many rows as ``bfd`` needs (more where they would overflow): rows hold
            near-equal tokens, a few rows more than ``bfd`` (``benchmarks/step_weights.py``).
        overlong: ``"error"``, ``"truncate"``, ``"split"`` or ``"drop"`` for examples over ``capacity``.
        shuffle: shuffle rows (True) or keep them in packing order (longest first).
        window: the randomness knob: pack only within shuffled windows of this many examples, drawn
            afresh every epoch, so which examples share a row changes from epoch to epoch (None: the
            whole dataset, the fewest rows; best-fit-decreasing puts much the same examples together
            every epoch). Axolotl's multipack packs within shuffled groups (``group_size``) the same way.
        costliest_first: with ``shuffle``, put the batch with the largest footprint (its real tokens,
            which the packing collator flattens into one sequence; ties to the longest example) first in
            every epoch, so a capacity that does not fit fails at step 1. Its cost in randomness: that one
            batch is swapped with batch 0 (a random one, which takes its place); every other batch keeps
            its shuffled position. Without ``shuffle`` the packing order is kept as it is.
    """

    name: ClassVar[str] = "packed"
    description: ClassVar[str] = "several examples per fixed-capacity row, rows of mixed lengths"
    packs_rows: ClassVar[bool] = True
    budget_option: ClassVar[str | None] = "capacity"
    variant_option: ClassVar[str | None] = "algorithm"
    option_limits: ClassVar[dict[str, int]] = {"capacity": MAX_CAPACITY}
    capacity: int = 4096
    rows_per_batch: int = 1
    algorithm: str = "spread_fit"
    overlong: str = "error"
    shuffle: bool = True
    window: int | None = None
    costliest_first: bool = True

    def __post_init__(self) -> None:
        self._check_positive("capacity", self.capacity)
        self._check_positive("window", self.window, allow_none=True)
        self._check_positive("rows_per_batch", self.rows_per_batch)
        self._check_overlong(self.overlong)
        self._check_bool("costliest_first", self.costliest_first)
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(
                f"PackedSpec: algorithm= must be one of {', '.join(ALGORITHMS)}; got {self.algorithm!r}"
            )
        if self.capacity > MAX_CAPACITY:
            raise ConfigError(f"PackedSpec: capacity= must be at most {MAX_CAPACITY}; got {self.capacity}")

    @classmethod
    def options_from(cls, knobs: Knobs) -> dict[str, Any]:
        given = knobs.given(capacity="capacity", overlong="overlong")
        return {**given, "rows_per_batch": 1} if knobs.capacity is not None else given

    @classmethod
    def example_options(cls, longest: int) -> dict[str, dict[str, Any]]:
        cap = max(longest, 1)
        return {
            "": {"capacity": cap},
            "window": {"capacity": cap, "window": 37},
            "auto": {"capacity": cap, "algorithm": "auto"},
            "bfd": {"capacity": cap, "algorithm": "bfd"},
            "ffd": {"capacity": cap, "algorithm": "ffd"},
            "fill,3 rows": {"capacity": cap, "algorithm": "fill", "rows_per_batch": 3},
            "spread": {"capacity": cap, "algorithm": "spread"},
        }

    def token_limit(self) -> tuple[int | None, str]:
        return self.capacity, "capacity"

    def leads_with_costliest(self) -> bool:
        return self.costliest_first and self.shuffle

    def micro_batch_limits(self) -> MicroBatchLimits:
        return MicroBatchLimits(self.capacity, self.rows_per_batch, None, None)

    def plan_round(
        self, lens: np.ndarray, rng: np.random.Generator, room: Room | None, tuning: Tuning
    ) -> Cut:
        """Pack the buffer; rows still under ``tuning.min_row_fill`` (emptiest first) and a reserve of
        the last, fullest rows (they hold the shortest examples, which close the next round's gaps) stay
        in the buffer, room permitting."""
        cap = self.capacity
        by_size, sizes = sort_by_length(lens, rng, descending=True)  # (m,) positions, decreasing sizes
        row_of, num_rows = pack(sizes, cap, self.algorithm)
        fill = np.bincount(row_of, weights=sizes, minlength=num_rows).astype(np.int64)  # (num_rows,) tokens
        keep_rows = EMPTY
        if room is not None:
            count = np.bincount(row_of, minlength=num_rows)  # (num_rows,) segments
            full = fill >= tuning.min_row_fill * cap
            under = np.flatnonzero(~full)
            under = under[np.argsort(fill[under], kind="stable")]  # emptiest first: most to gain
            last = np.flatnonzero(full)[::-1]
            reserve = tuning.reserve * lens.shape[0]
            last = last[: int(np.searchsorted(np.cumsum(count[last]), reserve, side="right"))]
            candidates = np.concatenate([under, last])
            keep_rows = candidates[: fits(count[candidates], fill[candidates], room)]
        emit = np.ones(num_rows, dtype=bool)
        emit[keep_rows] = False
        emit_rows = np.flatnonzero(emit)
        if self.shuffle and emit_rows.shape[0] > 1:
            emit_rows = emit_rows[permutation(emit_rows.shape[0], rng)]
        extra = emit_rows.shape[0] % self.rows_per_batch
        if room is not None and extra:
            # Rows that do not make a whole batch wait for the next round, room permitting.
            kept = np.concatenate([keep_rows, emit_rows[-extra:]])
            counts = np.bincount(row_of, minlength=num_rows)[kept]
            if fits(counts, fill[kept], room) == kept.shape[0]:
                keep_rows, emit_rows = kept, emit_rows[:-extra]
        num_emit, num_keep = emit_rows.shape[0], keep_rows.shape[0]
        label = np.empty(num_rows, dtype=np.int64)  # (num_rows,) output row of each packed row
        label[emit_rows] = np.arange(num_emit, dtype=np.int64)
        label[keep_rows] = num_emit + np.arange(num_keep, dtype=np.int64)
        ids, _, offsets = group_by_row(label[row_of], num_rows, by_size, sizes)
        end = int(offsets[num_emit])
        batch_offsets = fixed_offsets(num_emit, self.rows_per_batch, drop_last=False)
        width = np.full(batch_offsets.shape[0] - 1, cap, dtype=np.int64)
        return Cut(Batches(batch_offsets, width, offsets[: num_emit + 1], ids[:end]), ids[end:])


def refine(
    sizes: np.ndarray,
    row_of: np.ndarray,
    num_rows: int,
    capacity: int,
    rng: np.random.Generator,
    iters: int = REFINE_ITERS,
) -> tuple[np.ndarray, int]:
    """Large-neighbourhood search toward the lower bound: repeatedly take the 1 % emptiest rows and
    eight times as many random full ones, pack their examples again (exact filling and BFD), and keep
    the result when it needs fewer rows. Deterministic in ``rng``; stops at the lower bound (within
    :data:`REFINE_TOLERANCE` of it from capacity :data:`LONG_CONTEXT` on), after ``iters`` rounds, or
    when the work bound :data:`REFINE_WORK` (bitset word operations per example) is spent, so its
    cost stays linear in n at any capacity. It pays where few examples share a row (short rows of
    long dialogues), where exact filling alone stays above the bound.
    """
    lower = packing_lower_bound(sizes, capacity)
    tolerance = REFINE_TOLERANCE if capacity >= LONG_CONTEXT else 0.0
    good_enough = max(lower, int(lower * (1 + tolerance)))
    budget = REFINE_WORK * sizes.shape[0]
    words = capacity // 64 + 1  # bitset words of one subset-sum layer over a whole row
    row_of = row_of.copy()
    for _ in range(iters):
        if num_rows <= good_enough or budget <= 0:
            break
        slack = capacity - np.bincount(row_of, weights=sizes, minlength=num_rows)  # (num_rows,)
        k = max(2, num_rows // 100)
        worst = np.argsort(-slack, kind="stable")[:k]
        rest = np.ones(num_rows, dtype=bool)
        rest[worst] = False
        others = rng.choice(np.flatnonzero(rest), size=min(int(rest.sum()), 8 * k), replace=False)
        rows = np.concatenate([worst, others])
        in_pool = np.zeros(num_rows, dtype=bool)
        in_pool[rows] = True
        idx = np.flatnonzero(in_pool[row_of])
        idx = idx[np.argsort(-sizes[idx], kind="stable")]
        sub = sizes[idx]
        budget -= idx.shape[0] * words
        best_rows, best_n = fill_rows(sub, capacity, FILL_WINDOW)
        for alt_rows, alt_n in (
            fill_rows(sub, capacity, capacity),
            best_fit_decreasing(sub, capacity, _CTZ_TABLE),
        ):
            if alt_n < best_n:
                best_rows, best_n = alt_rows, alt_n
        if best_n < rows.shape[0]:
            row_of[idx] = rows[best_rows]
            keep = np.ones(num_rows, dtype=bool)
            keep[rows[best_n:]] = False
            row_of = (np.cumsum(keep) - 1)[row_of]
            num_rows -= rows.shape[0] - int(best_n)
    return row_of, int(num_rows)


def pack(sizes: np.ndarray, capacity: int, algorithm: str = "auto") -> tuple[np.ndarray, int]:
    """Assign sizes (sorted in decreasing order) to rows.

    Returns:
        ``(row_of, num_rows)``: (n,) row of each size, rows numbered from 0.
    """
    if sizes.shape[0] == 0:
        return np.zeros(0, dtype=np.int64), 0
    if algorithm == "auto" and sizes.shape[0] > AUTO_FILL_MAX:
        algorithm = "bfd"
    if algorithm == "auto":
        # Where examples over half the capacity set the bound, each needs a row of its own and BFD
        # fills their gaps best; where volume sets it, rows must be filled exactly.
        lower = packing_lower_bound(sizes, capacity)
        big_bound = int(np.count_nonzero(sizes * 2 > capacity)) >= lower
        first, second = ("bfd", "fill") if big_bound else ("fill", "bfd")
        row_of, num_rows = pack(sizes, capacity, first)
        if num_rows > lower and sizes.shape[0] <= AUTO_BOTH_MAX:
            alt_rows, alt_num = pack(sizes, capacity, second)
            if alt_num < num_rows:
                row_of, num_rows = alt_rows, alt_num
    elif algorithm == "bfd":
        row_of, num_rows = best_fit_decreasing(sizes, capacity, _CTZ_TABLE)
    elif algorithm == "fill":
        row_of, num_rows = fill_rows(sizes, capacity, FILL_WINDOW)
    elif algorithm == "spread":
        row_of, num_rows = spread(sizes, capacity)
    elif algorithm == "spread_fit":
        row_of, num_rows = spread_fit(sizes, capacity)
    else:
        # Any-fit packing leaves at most one row half empty or worse, so rows ≤ 2 * ceil(total / capacity) + 1.
        max_rows = min(sizes.shape[0], 2 * (-(-int(sizes.sum()) // capacity)) + 1)
        row_of, num_rows = first_fit_decreasing(sizes, capacity, max(max_rows, 1))
    return row_of, int(num_rows)


def spread(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Rows of mixed lengths: sizes (decreasing) spread over the fewest rows BFD needs, longest first into
    the emptiest row (:func:`~._packing_kernels.spread_rows`); where the fullest row overflows
    ``capacity``, over more rows: first enough for the mean row to sit as far below capacity as the
    fullest stood above the mean (at least one more), then bisection between the last count that
    overflowed and the first that fits, keeping the fewest rows found to fit (up to
    :data:`SPREAD_BISECT` more O(n) passes). Rows that stay empty (more rows than sizes) are dropped."""
    _, num_rows = best_fit_decreasing(sizes, capacity, _CTZ_TABLE)
    low = num_rows  # the most rows known to overflow (none: the first count, which then fits)
    while True:
        row_of, top = spread_rows(sizes, num_rows)
        if top <= capacity or num_rows >= sizes.shape[0]:
            break
        low = num_rows
        # The fullest row stands (top - mean) above the mean: aim the mean that far below capacity.
        total = int(sizes.sum())
        room = max(capacity - (top - total / num_rows), capacity / 2)
        num_rows = max(num_rows + 1, int(np.ceil(total / room)))
    if top <= capacity:
        high = num_rows  # fits
        for _ in range(SPREAD_BISECT):
            if high - low <= 1:
                break
            mid = (low + high) // 2
            mid_row_of, mid_top = spread_rows(sizes, mid)
            if mid_top <= capacity:
                high, row_of, num_rows = mid, mid_row_of, mid
            else:
                low = mid
    return _without_empty_rows(row_of, num_rows)


def _without_empty_rows(row_of: np.ndarray, num_rows: int) -> tuple[np.ndarray, int]:
    """``(row_of, num_rows)`` with the rows that hold nothing dropped, the others numbered in order."""
    used = np.bincount(row_of, minlength=num_rows) > 0  # (num_rows,)
    if used.all():
        return row_of, int(num_rows)
    return (np.cumsum(used) - 1)[row_of], int(used.sum())


def spread_fit(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Rows of mixed lengths: the longest examples, holding all but :data:`SPREAD_FIT_TAIL` of the tokens,
    spread over the rows BFD needs (:func:`spread_rows`; more, one percent at a time, where a row would
    overflow), then the shortest best-fit into the rows' gaps (:func:`~._packing_kernels.best_fit_into`),
    a new row where none fits. Longest processing time alone leaves rows as far apart as its last
    examples are long; the short tail closes that gap.

    Where many examples share a row it needs BFD's rows or within a few tenths of a percent of them;
    where few do (a long example and its fillers), spreading the head costs rows (12.5 % more than BFD
    on Schema-Guided dialogues at capacity 1,024): that is the price of mixing lengths there, and
    forcing BFD's row count back gives BFD's rows of like lengths, as the study measured (benchmarks/
    RESULTS.md, version 2)."""
    n = sizes.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64), 0
    _, num_rows = best_fit_decreasing(sizes, capacity, _CTZ_TABLE)
    head = sizes[: n - int(tail_count(sizes, SPREAD_FIT_TAIL))]
    while True:
        head_row, top = spread_rows(head, num_rows)
        if top <= capacity or num_rows >= head.shape[0]:
            break
        num_rows += max(1, num_rows // 100)
    load = row_loads(head_row, head, num_rows)  # (num_rows,) tokens
    tail_row, total_rows = best_fit_into(sizes[head.shape[0] :], capacity, capacity - load, _CTZ_TABLE)
    row_of = np.concatenate([head_row, tail_row])
    # Every spread row holds a head item unless there were fewer items than rows; new rows hold tail items.
    return (row_of, total_rows) if head.shape[0] >= num_rows else _without_empty_rows(row_of, total_rows)


def _pack_window(
    seg_len: np.ndarray, positions: np.ndarray | None, spec: PackedSpec, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Pack the segments at ``positions`` (None: all of them): ``(by_size, sizes, row_of, num_rows)``,
    positions in decreasing size, their sizes, and the row of each (rows numbered from 0)."""
    if positions is None:
        by_size, sizes = sort_by_length(seg_len, rng, descending=True)  # (m,) positions, (m,) decreasing
    else:
        local, sizes = sort_by_length(seg_len[positions], rng, descending=True)
        by_size = positions[local]
    row_of, num_rows = pack(sizes, spec.capacity, spec.algorithm)
    if spec.algorithm == "auto" and sizes.shape[0] <= REFINE_MAX:
        row_of, num_rows = refine(sizes, row_of, num_rows, spec.capacity, rng)
    return by_size, sizes, row_of, num_rows


def plan_packed(lengths: np.ndarray, spec: PackedSpec, rng: np.random.Generator) -> PlanParts:
    segments, counts = apply_overlong(lengths, spec.capacity, spec.overlong, "capacity")
    seg_len = segments.length
    n = seg_len.shape[0]
    if spec.window is None or spec.window >= n:
        by_size, sizes, row_of, num_rows = _pack_window(seg_len, None, spec, rng)
    else:
        perm = permutation(n, rng)  # (n,) windows of `window` shuffled positions, a fresh draw per epoch
        parts = [
            _pack_window(seg_len, perm[lo : lo + spec.window], spec, rng) for lo in range(0, n, spec.window)
        ]
        firsts = np.cumsum([0] + [p[3] for p in parts[:-1]])  # (num_windows,) first row of each window
        by_size = np.concatenate([p[0] for p in parts])
        sizes = np.concatenate([p[1] for p in parts])
        row_of = np.concatenate([p[2] + first for p, first in zip(parts, firsts, strict=True)])
        num_rows = int(firsts[-1]) + parts[-1][3]
    shuffle = (
        permutation(num_rows, rng) if spec.shuffle and num_rows > 1 else None
    )  # (num_rows,) new row numbers
    batch_order = None
    if shuffle is not None and spec.rows_per_batch == 1:
        # One row per batch: rows stay in packing order, and their shuffle (with the costliest batch
        # first) is applied when the plan is laid out. Row r goes to place shuffle[r].
        batch_order = np.empty(num_rows, dtype=np.int64)
        batch_order[shuffle] = np.arange(num_rows, dtype=np.int64)
    elif shuffle is not None:
        row_of = shuffle[row_of]  # relabel rows at random: the counting sort below shuffles them
    order, ordered_lengths, row_offsets = group_by_row(row_of, num_rows, by_size, sizes)
    batch_offsets = fixed_offsets(num_rows, spec.rows_per_batch, drop_last=False)
    width = np.full(len(batch_offsets) - 1, spec.capacity, dtype=np.int64)
    return PlanParts(
        in_order(segments, counts, order, ordered_lengths),
        Batches(batch_offsets, width, row_offsets, batch_order=batch_order),
        counts,
        capacity=spec.capacity,
        lower_bound_rows=packing_lower_bound(seg_len, spec.capacity),
        spare=(by_size, sizes),  # the sorted order and lengths: grouped by row above, free now
    )
