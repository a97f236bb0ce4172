"""The planners' compiled kernels write their large outputs into arrays numpy allocated.

numpy asks the kernel for transparent huge pages on large arrays; arrays allocated inside numba code
do not get them, and first touching 80 MB in 4 KiB pages cost a 10M-example plan about 40 ms per
array (``benchmarks/RESULTS.md``, planner speed). An array numba allocated carries numba's
``MemInfo`` as its base, one numpy allocated does not: these tests fail if a kernel goes back to
allocating its output itself.
"""

from __future__ import annotations

import numpy as np
import pytest

from smart_batching import plan_batches
from smart_batching.planners._kernels import (
    copy_blocks,
    counting_sort_shuffled,
    shuffled_permutation,
    sort_blocks_descending,
)
from smart_batching.planners._packing_kernels import (
    _CTZ_TABLE,
    best_fit_decreasing,
    fill_rows,
    first_fit_decreasing,
    group_by_row,
)


def numba_allocated(a: np.ndarray) -> bool:
    """Whether ``a`` (or an array it views) was allocated inside compiled code."""
    while isinstance(a, np.ndarray):
        a = a.base
    return a is not None and type(a).__name__ == "_MemInfo"


def test_the_check_tells_numba_arrays_apart() -> None:
    from numba import njit

    @njit
    def fresh(n):  # pragma: no cover - compiled
        return np.zeros(n, dtype=np.int64)

    assert numba_allocated(fresh(3)) and numba_allocated(fresh(3)[1:])
    assert not numba_allocated(np.zeros(3))


@pytest.fixture(scope="module")
def sizes() -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.sort(rng.integers(1, 300, 200_000))[::-1].copy()


def test_sort_and_permutation_outputs(sizes: np.ndarray) -> None:
    order, ordered = counting_sort_shuffled(sizes, int(sizes.max()), 7, True)
    assert not numba_allocated(order) and not numba_allocated(ordered)
    assert np.array_equal(np.sort(order), np.arange(sizes.shape[0]))
    assert np.array_equal(ordered, sizes[order]) and np.all(np.diff(ordered) <= 0)
    perm = shuffled_permutation(sizes.shape[0], 3)
    assert not numba_allocated(perm)
    assert np.array_equal(np.sort(perm), np.arange(sizes.shape[0]))
    blocks = sort_blocks_descending(sizes[::-1].copy(), 1000, int(sizes.max()))
    assert not numba_allocated(blocks)


def test_packing_outputs(sizes: np.ndarray) -> None:
    for row_of, num_rows in (
        best_fit_decreasing(sizes, 1024, _CTZ_TABLE),
        first_fit_decreasing(sizes, 1024, sizes.shape[0]),
        fill_rows(sizes, 1024, 512),
    ):
        assert not numba_allocated(row_of)
        assert np.bincount(row_of, weights=sizes, minlength=num_rows).max() <= 1024
        ids, by_row, offsets = group_by_row(row_of, num_rows, np.arange(sizes.shape[0]), sizes)
        assert not numba_allocated(ids) and not numba_allocated(by_row)
        assert np.array_equal(by_row, sizes[ids]) and offsets[-1] == sizes.shape[0]
    src, size = np.array([5, 0]), np.array([3, 2])
    out = copy_blocks(src, size, np.arange(10))
    assert not numba_allocated(out) and out.tolist() == [5, 6, 7, 0, 1]


@pytest.mark.parametrize("strategy", ["random", "max_length", "group_by_length", "token_budget", "packed"])
def test_plan_columns_are_numpy_arrays(sizes: np.ndarray, strategy: str) -> None:
    plan = plan_batches(sizes, strategy, seed=1)
    for column in (plan.example_ids, plan.seg_lengths, plan.batch_offsets):
        assert not numba_allocated(column), strategy


def test_lay_out_writes_into_spare_arrays(sizes: np.ndarray) -> None:
    """A planner's spare arrays take the laid-out columns (no fresh memory to first-touch), with the
    same plan as without them; a spare that overlaps a column or the caller's lengths is not used."""
    from smart_batching.plan import Batches, Segments
    from smart_batching.planners._common import lay_out

    n = sizes.shape[0]
    rng = np.random.default_rng(2)
    example, length = rng.permutation(n), sizes.copy()
    offsets = np.arange(0, n + 1, 100)
    bo = rng.permutation(offsets.shape[0] - 1)
    segments = Segments(example, np.zeros(n, dtype=np.int64), length)
    batches = Batches(offsets, np.full(bo.shape[0], 300), None, batch_order=bo)
    want, want_batches = lay_out(segments, batches)
    spare = (np.full(n, -1), np.full(n, -1), np.full(n, -1))
    got, got_batches = lay_out(segments, batches, spare=spare)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(w, g)
    np.testing.assert_array_equal(want_batches.batch_offsets, got_batches.batch_offsets)
    assert sum(any(np.shares_memory(c, s) for s in spare) for c in got) == 3  # example, start, length
    overlapping = (example, length)  # the columns themselves
    got, _ = lay_out(segments, batches, spare=overlapping)
    assert not any(np.shares_memory(c, s) for c in got for s in overlapping)
    np.testing.assert_array_equal(got.example, want.example)
    theirs = np.full(n, -1)  # the caller's lengths
    got, _ = lay_out(segments, batches, protect=theirs, spare=(theirs,))
    assert not any(np.shares_memory(c, theirs) for c in got) and (theirs == -1).all()
