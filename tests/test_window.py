"""The randomness knob of the length-aware strategies (``window=``): sort or pack only within shuffled
windows of W examples. Measured with :func:`smart_batching.analysis.batch_randomness` on fixed lengths:
a smaller window gives batches whose company changes more from epoch to epoch, at more padding, and
every example is still planned exactly once (the contract suite in test_planners.py holds the
``[window]`` configurations too)."""

from __future__ import annotations

import numpy as np
import pytest
from strategy_cases import cases

import smart_batching as sb
from smart_batching.analysis import batch_randomness
from smart_batching.errors import ConfigError
from smart_batching.planners import parse_strategy, split_strategies
from smart_batching.streaming import StreamingBatcher

# Every registered strategy with a window= option, with the first option set its spec gives for
# examples of up to 2,048 tokens (these lengths hold at most 1,000).
KNOBS = {
    p.values[0]: p.values[1]
    for p in cases(2048, lambda spec: "window" in type(spec).__dataclass_fields__, first_only=True)
}


@pytest.fixture(scope="module")
def lengths() -> np.ndarray:
    # 4,000 lengths, most of them distinct: a full sort puts the same neighbours together every epoch.
    return np.random.default_rng(3).integers(20, 1000, size=4000)


def _measure(lengths: np.ndarray, name: str, window: int | None) -> tuple[float, float]:
    """How many times more often than at random neighbours share a group again next epoch, and the
    plan's efficiency."""
    options = {**KNOBS[name], "window": window}
    plans = [sb.plan_batches(lengths, name, seed=11, epoch=e, **options) for e in (0, 1)]
    for plan in plans:  # every example exactly once
        np.testing.assert_array_equal(np.sort(plan.example_ids), np.arange(lengths.shape[0]))
    r = batch_randomness(*plans)
    return r["pair_repeat"] / r["pair_repeat_random"], plans[0].stats().efficiency


@pytest.mark.parametrize("name", list(KNOBS))
def test_smaller_windows_give_more_random_company_at_more_padding(lengths: np.ndarray, name: str) -> None:
    repeat = {}
    efficiency = {}
    for window in (None, 1000, 100):
        repeat[window], efficiency[window] = _measure(lengths, name, window)
    # A whole-dataset sort keeps neighbours together from one epoch to the next (here 190 to 390
    # times as often as random company would) ...
    assert repeat[None] > 100
    # ... windows break that up, the more the smaller they are (100 examples: 5 to 12 times random).
    assert repeat[None] > 2 * repeat[1000] > 4 * repeat[100]
    assert repeat[100] < 20
    # What it costs: efficiency falls (padded slots or pack rows) as the window shrinks.
    assert efficiency[None] >= efficiency[1000] >= efficiency[100]
    assert efficiency[None] > efficiency[100]


@pytest.mark.parametrize("name", list(KNOBS))
def test_a_window_as_large_as_the_data_is_the_whole_dataset_sort(lengths: np.ndarray, name: str) -> None:
    whole = sb.plan_batches(lengths, name, seed=5, **KNOBS[name])
    same = sb.plan_batches(lengths, name, seed=5, window=lengths.shape[0], **KNOBS[name])
    np.testing.assert_array_equal(whole.example_ids, same.example_ids)
    np.testing.assert_array_equal(whole.batch_offsets, same.batch_offsets)


def test_token_budget_batches_never_cross_a_window() -> None:
    # Two kinds of lengths far apart: a batch that crossed a window could hold both, but within a
    # window every batch is cut under the budget from that window's sorted lengths alone.
    lengths = np.array([10] * 50 + [500] * 50)
    plan = sb.plan_batches(lengths, "token_budget", seed=0, max_tokens=1000, window=10)
    for batch in plan:
        assert len(batch) * int(lengths[batch].max()) <= 1000
    # 10 windows of 10 examples: each window yields at least one batch of its own.
    assert len(plan) >= 10


def test_window_errors_name_the_setting() -> None:
    with pytest.raises(ConfigError, match="window="):
        sb.plan_batches([5, 6, 7], "token_budget", window=0)
    with pytest.raises(ConfigError, match="mode='sorted'"):
        sb.plan_batches([5, 6, 7], "group_by_length", mode="megabatch", window=16)  # HF's windows already
    with pytest.raises(ConfigError, match="buffer_size"):
        list(StreamingBatcher([5, 6, 7, 8], "packed", capacity=64, buffer_size=2, window=2))


def test_strategy_rows_take_options_by_name() -> None:
    assert parse_strategy("token_budget[window=512,max_tokens=4096]") == (
        "token_budget",
        {"window": 512, "max_tokens": 4096},
    )
    assert parse_strategy("group_by_length[sorted]") == ("group_by_length", {"mode": "sorted"})
    assert parse_strategy("packed[window=None]") == ("packed", {"window": None})
    assert split_strategies("random, group_by_length[mode=sorted,window=64],packed") == [
        "random",
        "group_by_length[mode=sorted,window=64]",
        "packed",
    ]
    with pytest.raises(ConfigError, match=r"random\[name=value\]"):
        parse_strategy("random[fast]")
