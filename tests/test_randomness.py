"""Batch randomness (order and membership across two epochs) on real plans, and where it is reported."""

from __future__ import annotations

import math

import numpy as np
import pytest

from smart_batching.analysis import analyze, batch_randomness, format_table
from smart_batching.errors import DataError
from smart_batching.planners import plan_batches

KEYS = {"order_corr", "pair_repeat", "pair_repeat_random"}


def lognormal(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(1, rng.lognormal(5.0, 0.8, n)).astype(np.int64)


def two_epochs(lengths, strategy: str, seed: int = 0, **options) -> dict[str, float]:
    plans = [plan_batches(lengths, strategy, seed=seed, epoch=e, **options) for e in (0, 1)]
    return batch_randomness(*plans)


def test_random_batches_are_as_random_as_their_sizes_allow():
    lengths = lognormal(5000)
    for seed in (0, 1):
        r = two_epochs(lengths, "random", seed=seed, batch_size=8)
        assert set(r) == KEYS
        # 625 batches of 8: a pair shares a batch again with probability 7 / 4999.
        assert r["pair_repeat_random"] == pytest.approx(625 * 8 * 7 / (5000 * 4999))
        assert r["pair_repeat"] < 4 * r["pair_repeat_random"]
        assert abs(r["order_corr"]) < 0.2


def test_megabatch_order_is_correlated_and_sorted_order_is_not():
    lengths = lognormal(5000)
    mega = two_epochs(lengths, "group_by_length", batch_size=8, mode="megabatch")
    flat = two_epochs(lengths, "group_by_length", batch_size=8, mode="sorted")
    assert mega["order_corr"] > 0.5  # batches run long to short within each megabatch
    assert abs(flat["order_corr"]) < 0.2  # sorted batches, shuffled
    # A global sort meets the same neighbours again, far more than a shuffle would.
    assert flat["pair_repeat"] > 50 * flat["pair_repeat_random"]
    assert flat["pair_repeat"] > mega["pair_repeat"]


def test_packing_distinct_lengths_repeats_its_rows():
    lengths = np.random.default_rng(3).permutation(np.arange(1, 2001)).astype(np.int64)
    r = two_epochs(lengths, "packed", capacity=4096)
    # No ties in length: best-fit-decreasing builds the same rows each epoch, only their order changes.
    assert r["pair_repeat"] > 0.9
    assert r["pair_repeat_random"] < 0.01
    assert abs(r["order_corr"]) < 0.3


def test_literal_sorted_pairs_repeat_exactly():
    # Distinct lengths, batches of 2 after a global sort: the same 4 batches every epoch.
    r = two_epochs([5, 1, 8, 3, 7, 2, 6, 4], "group_by_length", batch_size=2, mode="sorted")
    assert r["pair_repeat"] == 1.0
    assert r["pair_repeat_random"] == pytest.approx(4 * 2 * 1 / (8 * 7))


def test_undefined_values_are_nan():
    one_per_batch = two_epochs([3, 1, 2, 5], "random", batch_size=1)
    assert math.isnan(one_per_batch["pair_repeat"])  # no two examples share a batch
    assert one_per_batch["pair_repeat_random"] == 0.0
    two_batches = two_epochs([3, 1, 2, 5], "random", batch_size=2)
    assert math.isnan(two_batches["order_corr"])  # one lag pair is no correlation
    same = two_epochs([4] * 12, "random", batch_size=3)
    assert math.isnan(same["order_corr"])  # every batch has the same mean length


def test_split_examples_count_once_in_their_first_row():
    lengths = lognormal(400, seed=5)
    lengths[:20] = 3000  # over the capacity: split into several segments
    plans = [
        plan_batches(lengths, "packed", seed=0, epoch=e, capacity=1024, overlong="split") for e in (0, 1)
    ]
    assert plans[1].overlong.num_split >= 20 and plans[1].num_segments > lengths.size
    r = batch_randomness(*plans)
    # The baseline counts examples, not segments: N is the number of examples.
    rows = [np.unique(row) for b in range(len(plans[1])) for row in plans[1].rows(b)]
    first = {}
    for g, row in enumerate(rows):
        for e in row.tolist():
            first.setdefault(e, g)
    sizes = np.bincount(list(first.values()))
    n = lengths.size
    assert r["pair_repeat_random"] == pytest.approx(float(np.dot(sizes, sizes - 1)) / (n * (n - 1)))
    # Neighbours of epoch 0, brute force: together again when their first rows in epoch 1 are one row.
    pairs = [
        (a, b)
        for t in range(len(plans[0]))
        for row in plans[0].rows(t)
        for a, b in zip(row[:-1].tolist(), row[1:].tolist(), strict=True)
        if a != b
    ]
    assert r["pair_repeat"] == pytest.approx(np.mean([first[a] == first[b] for a, b in pairs]))


def test_refuses_plans_of_different_datasets():
    a = plan_batches([1, 2, 3, 4], "random", batch_size=2)
    b = plan_batches([1, 2, 3], "random", batch_size=2, epoch=1)
    with pytest.raises(DataError, match="same lengths"):
        batch_randomness(a, b)


def test_analyze_records_and_table_carry_randomness():
    lengths = lognormal(2000, seed=1)
    records = analyze(lengths, batch_size=8, strategies=["random", "group_by_length[megabatch]", "packed"])
    by = {r["strategy"]: r for r in records}
    for r in records:
        assert set(r) >= KEYS
    assert by["group_by_length[megabatch]"]["order_corr"] > 0.5
    assert abs(by["random"]["order_corr"]) < 0.2
    assert by["packed"]["pair_repeat"] > 10 * by["packed"]["pair_repeat_random"]
    table = format_table(records)
    header = table.splitlines()[0]
    assert "order corr" in header and "pairs again" in header
    random_line = next(line for line in table.splitlines() if line.startswith("random "))
    assert f"(r {100 * by['random']['pair_repeat_random']:.2f}%)" in random_line


def test_analyze_writes_none_for_undefined_randomness():
    (r,) = analyze([3, 1, 2, 5], batch_size=1, strategies=["random"])
    assert r["pair_repeat"] is None and r["order_corr"] is not None
    assert "n/a" in format_table([r]).splitlines()[-1]
