"""Dealing an optimizer step's GRPO completions between ranks (:mod:`smart_batching.hf.grpo.ranks`): every
micro-batch keeps its count, every completion lands once, and the loads end at most the costliest
completion apart (the 2-rank training runs are in tests/conformance/test_vs_trl_grpo.py)."""

from __future__ import annotations

import numpy as np
import pytest

from smart_batching.hf.grpo.ranks import deal_equal_counts, deal_to_ranks


@pytest.mark.parametrize(
    ("n", "bins", "seed"), [(16, 4, 0), (256, 8, 1), (4096, 16, 2), (6, 6, 3), (5, 1, 4)]
)
def test_every_bin_gets_the_same_count_and_near_the_same_load(n, bins, seed):
    rng = np.random.default_rng(seed)
    costs = rng.integers(8, 600, size=n)  # prompt + completion tokens
    bin_of = deal_equal_counts(costs, bins)
    assert sorted(np.bincount(bin_of, minlength=bins).tolist()) == [n // bins] * bins
    load = np.bincount(bin_of, weights=costs, minlength=bins)
    assert load.sum() == costs.sum()
    assert load.max() - load.min() <= costs.max()
    # TRL's split (consecutive slices after a shuffle) is no better on these costs
    dealt_in_order = costs.reshape(bins, -1).sum(1)
    assert load.max() <= dealt_in_order.max()


def test_a_count_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="7 items cannot be dealt into 2 bins"):
        deal_equal_counts(np.arange(7), 2)


def test_ranks_are_dealt_only_where_that_is_more_even():
    rng = np.random.default_rng(5)
    uneven = np.concatenate([rng.integers(300, 600, size=8), rng.integers(8, 60, size=8)])  # rank 0 heavy
    rank_of, before, after = deal_to_ranks(uneven, 2)
    assert rank_of is not None and np.bincount(rank_of).tolist() == [8, 8]
    load = np.bincount(rank_of, weights=uneven)
    assert load.max() < uneven[:8].sum() and load.max() - load.min() <= uneven.max()
    assert before.tolist() == [uneven[:8].sum(), uneven[8:].sum()] and after.tolist() == load.tolist()
    kept, before, after = deal_to_ranks(np.full(16, 40), 2)
    assert kept is None and before.tolist() == after.tolist() == [320, 320]  # even already: TRL's deal kept
