"""``packed[algorithm=spread]``: rows of mixed lengths with near-equal tokens (longest processing time
over the rows best-fit-decreasing needs), a golden table and what it changes against ``bfd``."""

from __future__ import annotations

import heapq

import numpy as np
import pytest

from smart_batching.planners import plan_batches
from smart_batching.planners._packing_kernels import (
    _CTZ_TABLE,
    best_fit_decreasing,
    best_fit_into,
    row_loads,
    spread_rows,
    tail_count,
)
from smart_batching.planners.packed import PackedSpec, spread, spread_fit


def test_spread_golden_table():
    # 45 tokens fit 3 rows of 15, but spreading 9..1 over 3 rows overflows one (13 + 3 = 16): 4 rows.
    # Over 4: 9, 8, 7, 6 open the rows, 5..2 top them up to 11 each, and 1 goes to the row that reached
    # 11 first (the one holding 6 and 5).
    lengths = np.array([9, 8, 7, 6, 5, 4, 3, 2, 1])
    plan = plan_batches(lengths, "packed", capacity=15, algorithm="spread", shuffle=False, seed=0)
    assert [np.asarray(b).tolist() for b in plan] == [[0, 7], [1, 6], [2, 5], [3, 4, 8]]
    assert [int(lengths[np.asarray(b)].sum()) for b in plan] == [11, 11, 11, 12]


def test_spread_rows_is_longest_processing_time():
    sizes = np.array([10, 9, 5, 4, 4, 1])
    row_of, top = spread_rows(sizes, 2)
    # 10 -> row 0, 9 -> row 1, 5 -> row 1 (9 < 10), 4 -> row 0 (10 < 14), 4 -> row 1 (14 = 14: row 1
    # reached 14 first), 1 -> row 0 (14 < 18).
    assert row_of.tolist() == [0, 1, 1, 0, 1, 0] and top == 18
    loads = np.bincount(row_of, weights=sizes)
    assert loads.tolist() == [15.0, 18.0]


def test_spread_rows_matches_a_heap_of_longest_processing_time():
    """The bucket queue against the textbook: a heap keyed by (load, the time the row reached it),
    on random sorted sizes and row counts; and it refuses a mean load past its span."""
    rng = np.random.default_rng(5)
    for _ in range(30):
        sizes = np.sort(rng.integers(1, 400, size=int(rng.integers(1, 600))))[::-1].copy()
        num_rows = int(rng.integers(1, 80))
        heap = [(0, r, r) for r in range(num_rows)]  # (load, arrival, row)
        want, arrival = [], num_rows
        for s in sizes.tolist():
            load, _, row = heapq.heappop(heap)
            want.append(row)
            heapq.heappush(heap, (load + s, arrival, row))
            arrival += 1
        row_of, top = spread_rows(sizes, num_rows)
        assert row_of.tolist() == want
        assert top == max(load for load, _, _ in heap)
    with pytest.raises(ValueError, match="num_rows"):
        spread_rows(np.full(10, 1 << 25, dtype=np.int64), 1)


def test_spread_mixes_lengths_at_near_bfd_rows():
    """Lognormal lengths (2,000, capacity 4,096): one row more than BFD, rows within 2 % of each other's
    tokens, and the length variance between rows gone (BFD's rows are length strata)."""
    lengths = np.random.default_rng(1).lognormal(5, 0.6, size=2000).astype(np.int64) + 1
    shares, rows, loads = {}, {}, {}
    for algorithm in ("bfd", "spread"):
        plan = plan_batches(lengths, "packed", capacity=4096, algorithm=algorithm, seed=0)
        steps = [np.asarray(b) for b in plan]
        grand = lengths.mean()
        between = sum(len(b) * (lengths[b].mean() - grand) ** 2 for b in steps)
        shares[algorithm] = between / ((lengths - grand) ** 2).sum()
        rows[algorithm] = len(plan)
        loads[algorithm] = np.array([lengths[b].sum() for b in steps])
        assert sorted(np.concatenate(steps).tolist()) == list(range(2000))
        assert loads[algorithm].max() <= 4096
    assert rows["spread"] <= rows["bfd"] + 1
    assert shares["bfd"] > 0.5 and shares["spread"] < 0.01
    assert loads["spread"].max() - loads["spread"].min() <= 0.02 * 4096


def test_spread_grows_rows_until_none_overflows():
    sizes = np.sort(np.random.default_rng(1).integers(1, 100, size=500))[::-1].copy()
    row_of, num_rows = spread(sizes, 120)
    assert np.bincount(row_of, weights=sizes, minlength=num_rows).max() <= 120
    assert (np.bincount(row_of, minlength=num_rows) > 0).all()
    # Spread over the rows BFD needs, the fullest row overflows here: spread took more rows.
    _, bfd_rows = best_fit_decreasing(sizes, 120, _CTZ_TABLE)
    assert spread_rows(sizes, bfd_rows)[1] > 120 and num_rows > bfd_rows
    # ... and the fewest that fit: bisection between the counts that overflow and fit, so one row fewer
    # overflows.
    assert spread_rows(sizes, num_rows - 1)[1] > 120


def reference_best_fit(sizes: list[int], capacity: int, room: list[int]) -> tuple[list[int], int]:
    """Best fit by a scan of every row: the fullest row (least room) the item fits, ties to the row
    that reached that room last (the kernel's buckets are last-in first-out), else a new row."""
    room, when, row_of = list(room), list(range(len(room))), []
    for t, s in enumerate(sizes, start=len(room)):
        fits = [r for r in range(len(room)) if room[r] >= s]
        if fits:
            row = min(fits, key=lambda r: (room[r], -when[r]))
        else:
            row = len(room)
            room.append(capacity)
            when.append(t)
        room[row] -= s
        when[row] = t
        row_of.append(row)
    return row_of, len(room)


def test_best_fit_matches_a_scan_of_every_row():
    """``best_fit_into`` (and ``best_fit_decreasing``, no given rows) against a scan of every row, on
    random decreasing sizes with and without given rows; and a hand-checked case."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        sizes = np.sort(rng.integers(1, 300, size=int(rng.integers(1, 400))))[::-1].copy()
        room = rng.integers(0, 1025, size=int(rng.integers(0, 30)))
        for given in (room, np.zeros(0, dtype=np.int64)):
            want, want_rows = reference_best_fit(sizes.tolist(), 1024, given.tolist())
            got, got_rows = best_fit_into(sizes, 1024, given, _CTZ_TABLE)
            assert got_rows == want_rows and got.tolist() == want
        bfd, bfd_rows = best_fit_decreasing(sizes, 1024, _CTZ_TABLE)
        assert (bfd.tolist(), bfd_rows) == reference_best_fit(sizes.tolist(), 1024, [])
    # Given rows take items first, the fullest that fits: rooms 5 and 9; 7 fits only the second.
    row_of, num_rows = best_fit_into(np.array([7, 4, 4]), 10, np.array([5, 9]), _CTZ_TABLE)
    assert row_of.tolist() == [1, 0, 2] and num_rows == 3


def test_spread_fit_fills_like_bfd_with_few_examples_to_a_row():
    """Uniform 1-599 at capacity 2,048 (about 7 to a row): `spread` alone leaves 1.7 points of fill, as
    longest processing time ends with rows as far apart as its last examples are long; the short tail
    best-fit closes it, and rows still mix lengths far more than BFD's."""
    lengths = np.random.default_rng(0).integers(1, 600, size=10_000)
    stats, shares = {}, {}
    for algorithm in ("bfd", "spread", "spread_fit"):
        plan = plan_batches(lengths, "packed", capacity=2048, algorithm=algorithm, seed=0)
        steps = [np.asarray(b) for b in plan]
        assert sorted(np.concatenate(steps).tolist()) == list(range(10_000))
        assert max(int(lengths[b].sum()) for b in steps) <= 2048
        grand = lengths.mean()
        between = sum(len(b) * (lengths[b].mean() - grand) ** 2 for b in steps)
        shares[algorithm] = between / ((lengths - grand) ** 2).sum()
        stats[algorithm] = plan.stats()
    assert stats["spread"].efficiency < stats["bfd"].efficiency - 0.01
    assert stats["spread_fit"].efficiency >= stats["bfd"].efficiency - 0.001
    assert shares["spread_fit"] < shares["bfd"] / 2


def test_spread_fit_costs_rows_where_few_examples_share_one():
    """Lognormal lengths, median 350, at capacity 1,024 (about three to a row): spreading nine tenths of the
    tokens over BFD's rows overflows, and the rows it adds are the price of mixing lengths (here over 5 %
    more than BFD), where many examples share a row (capacity 4,096) it needs under 1 % more. No row
    overflows and every example is placed once."""
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(np.log(350), 0.5, 3_000), 1, 1024).astype(np.int64)
    extra = {}
    for capacity in (1024, 4096):
        sizes = np.sort(lengths)[::-1]
        row_of, rows = spread_fit(sizes, capacity)
        assert np.bincount(row_of, weights=sizes).max() <= capacity and np.unique(row_of).shape[0] == rows
        _, bfd_rows = best_fit_decreasing(sizes, capacity, _CTZ_TABLE)
        extra[capacity] = rows / bfd_rows - 1
    assert extra[1024] > 0.05 and extra[4096] < 0.01


def test_spread_fit_is_the_default():
    assert PackedSpec().algorithm == "spread_fit"


def test_tail_count_and_row_loads_match_numpy():
    rng = np.random.default_rng(5)
    for _ in range(20):
        sizes = np.sort(rng.integers(1, 900, size=int(rng.integers(1, 3000))))[::-1]
        share = float(rng.choice([0.0, 0.1, 0.37, 1.0]))
        from_short = np.cumsum(sizes[::-1])
        assert tail_count(sizes, share) == int(np.searchsorted(from_short, share * int(from_short[-1])))
        rows = int(rng.integers(1, 50))
        row_of = rng.integers(0, rows, size=sizes.shape[0])
        assert np.array_equal(
            row_loads(row_of, sizes, rows), np.bincount(row_of, sizes, rows).astype(np.int64)
        )
