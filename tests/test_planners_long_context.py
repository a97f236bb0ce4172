"""Long-context packing: near the lower bound, with work bounded at any capacity up to the limit.

Timing targets (50k heavy-tailed lengths at capacity 32,768 in ≤ 1 s, no capacity slower than 10x
``algorithm="bfd"``) live in ``benchmarks/planner_speed.py --long-context``; these tests hold the row
counts and the work bound, which do not depend on the machine.
"""

from __future__ import annotations

import numpy as np
import pytest

import smart_batching as sb
from smart_batching.planners import packed
from smart_batching.planners._packing_kernels import fill_rows


def _heavy_tailed(n: int, capacity: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(4000), 1.0, n), 1, capacity).astype(np.int64)


@pytest.mark.parametrize("capacity", [8192, 32768, 131072, packed.MAX_CAPACITY])
def test_long_context_rows_near_lower_bound(capacity: int) -> None:
    lengths = _heavy_tailed(20_000, capacity)
    auto = sb.plan_batches(lengths, "packed", capacity=capacity, algorithm="auto").stats()
    bfd = sb.plan_batches(lengths, "packed", capacity=capacity, algorithm="bfd").stats()
    assert auto.num_rows <= 1.005 * auto.lower_bound_rows, (capacity, auto.num_rows, auto.lower_bound_rows)
    assert auto.num_rows <= bfd.num_rows


def test_fill_rows_memory_does_not_scale_with_distinct_sizes_times_capacity() -> None:
    # 20k distinct sizes at the largest capacity: the subset-sum layers were allocated for distinct
    # sizes x log2(capacity) x capacity / 64 words up front (about 2.7 GB here); they now grow on demand.
    capacity = packed.MAX_CAPACITY
    sizes = np.arange(20_000, 0, -1, dtype=np.int64) * 13 % capacity + 1
    sizes = np.sort(sizes)[::-1].copy()
    row_of, num_rows = fill_rows(sizes, capacity, packed.FILL_WINDOW)
    assert num_rows <= 1.005 * sb.packing_lower_bound(sizes, capacity)
    assert np.bincount(row_of, weights=sizes, minlength=num_rows).max() <= capacity


def test_refine_work_is_bounded_per_example(monkeypatch) -> None:
    # Items just over a third of the row: two per row at best, while the volume bound counts three, so
    # the bound is out of reach and refinement runs until its work bound, not for all its rounds.
    capacity = 65536
    n = 3000
    sizes = np.full(n, capacity // 3 + 1, dtype=np.int64)
    calls = []
    real = packed.best_fit_decreasing
    monkeypatch.setattr(packed, "best_fit_decreasing", lambda *a: calls.append(1) or real(*a))
    row_of, num_rows = packed.fill_rows(sizes, capacity, packed.FILL_WINDOW)
    row_of, num_rows = packed.refine(sizes, row_of, num_rows, capacity, np.random.default_rng(0))
    assert num_rows == n // 2
    rows_pooled = 9 * max(2, num_rows // 100)  # the emptiest 1 % and eight times as many others
    per_round = 2 * rows_pooled * (capacity // 64 + 1)  # two examples per pooled row
    assert len(calls) <= packed.REFINE_WORK * n // per_round + 1 < packed.REFINE_ITERS


def test_refine_still_runs_its_rounds_at_short_capacities(monkeypatch) -> None:
    # The same shape at capacity 1,024: cheap rounds, so the round limit binds, not the work bound.
    capacity = 1024
    n = 3000
    sizes = np.full(n, capacity // 3 + 1, dtype=np.int64)
    calls = []
    real = packed.best_fit_decreasing
    monkeypatch.setattr(packed, "best_fit_decreasing", lambda *a: calls.append(1) or real(*a))
    row_of, num_rows = packed.fill_rows(sizes, capacity, packed.FILL_WINDOW)
    packed.refine(sizes, row_of, num_rows, capacity, np.random.default_rng(0))
    assert len(calls) == packed.REFINE_ITERS
