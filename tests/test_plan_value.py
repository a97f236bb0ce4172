"""The one batch value (plan.Segments, plan.Batches): its layout, laying it out, and the costliest
batch first as one function over it."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
from strategy_cases import registered

import smart_batching as sb
from smart_batching.plan import Batches, Segments, lead_with_costliest
from smart_batching.planners import PlanParts, TokenBudgetSpec
from smart_batching.planners._common import apply_overlong, lay_out


def _table(n: int, seed: int) -> Segments:
    rng = np.random.default_rng(seed)
    return Segments(rng.permutation(n), rng.integers(0, 5, n), rng.integers(1, 50, n))


def _random_batches(n: int, seed: int, *, rows: bool, order: bool) -> Batches:
    rng = np.random.default_rng(seed)
    row_cuts = np.unique(np.concatenate([[0, n], rng.integers(1, n, n // 3)]))
    num_rows = row_cuts.shape[0] - 1 if rows else n
    batch_cuts = np.unique(np.concatenate([[0, num_rows], rng.integers(1, num_rows, num_rows // 4)]))
    nb = batch_cuts.shape[0] - 1
    return Batches(
        batch_cuts.astype(np.int64),
        rng.integers(1, 99, nb),
        row_cuts.astype(np.int64) if rows else None,
        rng.permutation(n) if order else None,
        rng.permutation(nb),
    )


def _expected(table: Segments, batches: Batches) -> tuple[list[list[list[int]]], list[int]]:
    """Batches as lists of rows of example ids, and their widths, in plan order: a plain loop."""
    rows = batches.row_offsets
    out = []
    for k in range(batches.num_batches):
        b = batches.batch_order[k] if batches.batch_order is not None else k
        batch = []
        for r in range(batches.batch_offsets[b], batches.batch_offsets[b + 1]):
            lo, hi = (rows[r], rows[r + 1]) if rows is not None else (r, r + 1)
            pos = np.arange(lo, hi)
            seg = pos if batches.order is None else batches.order[pos]
            batch.append(table.example[seg].tolist())
        out.append(batch)
    return out, [
        int(batches.width[b])
        for b in (batches.batch_order if batches.batch_order is not None else range(batches.num_batches))
    ]


def _as_lists(table: Segments, batches: Batches) -> tuple[list[list[list[int]]], list[int]]:
    rows = batches.row_offsets if batches.row_offsets is not None else np.arange(table.num_segments + 1)
    out = []
    for b in range(batches.num_batches):
        r0, r1 = batches.batch_offsets[b], batches.batch_offsets[b + 1]
        out.append([table.example[rows[r] : rows[r + 1]].tolist() for r in range(r0, r1)])
    return out, batches.width.tolist()


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("order", [False, True])
def test_laying_out_matches_a_plain_loop(rows: bool, order: bool) -> None:
    """The compiled lay-out (plan_batches) and the vectorised one (streams) give what a loop gives."""
    for seed in range(5):
        table, batches = _table(200, seed), _random_batches(200, seed, rows=rows, order=order)
        want = _expected(table, batches)
        positions, laid = batches.laid_out()
        assert _as_lists(table.take(positions), laid) == want
        got_table, got = lay_out(table, batches)
        assert got.batch_order is None and got.order is None
        assert _as_lists(got_table, got) == want


def test_the_costliest_batch_moves_by_two_entries_of_the_batch_order() -> None:
    lengths = np.array([3, 9, 1, 9, 2, 2, 5])
    table = Segments.whole(lengths)
    # Batches [3 9] [1] [9 2 2] [5], shuffled as 3, 0, 2, 1: footprints (rows x longest) 5, 18, 27, 1.
    batches = Batches(np.array([0, 2, 3, 6, 7]), np.array([9, 1, 9, 5]), batch_order=np.array([3, 0, 2, 1]))
    spec = sb.make_spec("token_budget")
    led = lead_with_costliest(spec, batches, lengths)
    assert led.batch_order.tolist() == [
        2,
        0,
        3,
        1,
    ]  # the stored batch 2 (27 slots) first, batch 3 where it was
    np.testing.assert_array_equal(batches.batch_order, [3, 0, 2, 1])  # the input is left as it was
    laid_table, laid = lay_out(table, led)
    assert _as_lists(laid_table, laid) == ([[[3], [4], [5]], [[0], [1]], [[6]], [[2]]], [9, 9, 5, 1])
    # Already first: nothing moves.
    assert lead_with_costliest(spec, led, lengths) is led


def test_a_swap_of_two_like_batches_is_done_in_place_unless_it_would_touch_the_input() -> None:
    lengths = np.array([4, 1, 2, 8, 7, 3])
    batches = Batches(np.array([0, 2, 4, 6]), np.array([4, 8, 3]), batch_order=np.array([1, 0, 2]))
    table = Segments(np.arange(6) + 10, np.zeros(6, dtype=np.int64), lengths.copy())
    laid_table, laid = lay_out(table, batches, protect=lengths)
    assert laid_table.example is table.example  # exchanged in place: O(batch), no copy of the plan
    assert laid_table.example.tolist() == [12, 13, 10, 11, 14, 15] and laid.width.tolist() == [8, 4, 3]
    # A table whose lengths are the caller's array is copied, never written.
    own = Segments(np.arange(6), np.zeros(6, dtype=np.int64), lengths)
    laid_table, _ = lay_out(own, batches, protect=lengths)
    assert lengths.tolist() == [4, 1, 2, 8, 7, 3] and laid_table.length.tolist() == [2, 8, 4, 1, 7, 3]


class _AsGivenSpec(TokenBudgetSpec):
    """A token budget whose planner keeps the caller's lengths as its table (a test strategy)."""

    name: ClassVar[str] = "test_as_given"


def _plan_as_given(lengths, spec, rng):  # batches of 2 in dataset order, the costliest last
    segments, counts = apply_overlong(lengths, None, "error", "max_length")
    offsets = np.arange(0, lengths.shape[0] + 1, 2)
    width = np.maximum.reduceat(lengths, offsets[:-1])
    return PlanParts(segments, Batches(offsets, width), counts)


def test_plan_batches_never_writes_the_lengths_it_is_given() -> None:
    """A strategy that keeps the caller's lengths as its table, costliest batch not first: the swap
    goes through a copy."""
    with registered(_AsGivenSpec, _plan_as_given) as name:
        lengths = np.array([1, 2, 3, 4, 9, 9], dtype=np.int64)
        plan = sb.plan_batches(lengths, name, max_tokens=100)
        assert plan.to_lists() == [[4, 5], [2, 3], [0, 1]]
        assert lengths.tolist() == [1, 2, 3, 4, 9, 9]


def test_segments_and_batches_views() -> None:
    table = _table(10, 0)
    assert table.take(slice(2, 5)).num_segments == 3
    both = Segments.concat([table.take(slice(0, 4)), table.take(slice(4, None))])
    assert all(np.array_equal(a, b) for a, b in zip(both, table, strict=True) if a is not None)
    assert table.key(3) == (int(table.example[3]), int(table.start[3]), int(table.length[3]))
    b = Batches(np.array([0, 2, 3]), np.array([5, 6]), np.array([0, 3, 4, 10]))
    assert b.num_batches == 2 and b.num_rows == 3 and b.bounds.tolist() == [0, 4, 10]
    plan = sb.plan_batches(np.arange(1, 30), "random", batch_size=4)
    assert plan.batches.row_offsets is None  # one segment per row: offsets made on first use
    np.testing.assert_array_equal(plan.row_offsets, np.arange(plan.num_segments + 1))
    assert (
        plan.seg_starts.strides == (0,) and not plan.seg_starts.any()
    )  # no example cut: starts take no memory
