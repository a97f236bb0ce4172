"""Balancing across ranks: a pure function, tested with hand-built worlds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from strategy_cases import cases

import smart_batching as sb
from smart_batching.distributed import World, distribute
from smart_batching.errors import ConfigError

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def seen_examples(d) -> np.ndarray:
    mbs = [m for r in range(d.world_size) for m in d.rank_micro_batches(r) if m >= 0]
    return np.concatenate([d.micro_batch_examples(m) for m in mbs]) if mbs else np.zeros(0, np.int64)


@pytest.fixture(scope="module")
def heavy_tailed() -> np.ndarray:
    rng = np.random.default_rng(5)
    return np.clip(rng.lognormal(5.0, 0.7, 3001), 8, 2000).astype(np.int64)


# Every registered strategy with the option sets its spec gives for lengths of at most 2,000 tokens;
# DEFAULTS: each strategy's first set (the balance targets hold for those).
STRATEGIES = cases(2000)
DEFAULTS = cases(2000, first_only=True)


def check_limits(plan, segs: np.ndarray, options: dict) -> None:
    """A micro-batch within the strategy's limits, and within those its options name."""
    lens = plan.seg_lengths[segs]
    assert plan.spec.micro_batch_limits().fits(lens)
    if "capacity" in options:
        assert lens.sum() <= options["capacity"] * options.get("rows_per_batch", 1)
    if "max_tokens" in options:
        assert lens.size * lens.max() <= options["max_tokens"]
    if "batch_size" in options:
        bs = options["batch_size"]
        assert lens.size <= bs + max(1, bs // 8)


@pytest.mark.parametrize("strategy, options", STRATEGIES)
@pytest.mark.parametrize("world_size, accum", [(1, 1), (2, 1), (4, 1), (2, 3), (3, 2)])
def test_every_example_once_equal_steps(heavy_tailed, strategy, options, world_size, accum) -> None:
    plan = sb.plan_batches(heavy_tailed, strategy, seed=1, **options)
    d = distribute(plan, world_size, accum_steps=accum, seed=1)
    # Exactly once across ranks, nothing dropped.
    np.testing.assert_array_equal(np.sort(seen_examples(d)), np.sort(plan.example_ids))
    # Every rank has the same number of micro-batches: steps × accum.
    assert d.assignment.shape == (d.num_steps, world_size, accum)
    for r in range(world_size):
        assert d.rank_micro_batches(r).shape[0] == d.num_steps * accum
    # The ragged tail is absorbed by splitting, not by empty slots, when micro-batches can be split.
    assert d.num_empty_slots == 0
    # Micro-batches respect the strategy's limits after balancing.
    for m in np.unique(d.assignment):
        check_limits(plan, d.micro_batch_segments(int(m)), options)


@pytest.mark.parametrize("strategy, options", DEFAULTS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_balanced_on_heavy_tailed_lengths(heavy_tailed, strategy, options, world_size) -> None:
    plan = sb.plan_batches(heavy_tailed, strategy, seed=2, **options)
    d = distribute(plan, world_size, seed=2)
    naive = distribute(plan, world_size, seed=2, balance_rounds=0)
    assert d.max_step_imbalance <= 1.02, d.max_step_imbalance
    assert d.max_step_imbalance <= naive.max_step_imbalance + 1e-9


def test_deterministic_and_seeded(heavy_tailed) -> None:
    plan = sb.plan_batches(heavy_tailed, "packed", capacity=4096, seed=3)
    a = distribute(plan, 4, seed=3)
    b = distribute(plan, 4, seed=3)
    c = distribute(plan, 4, seed=4)
    np.testing.assert_array_equal(a.assignment, b.assignment)
    assert not np.array_equal(a.assignment, c.assignment)


def test_hand_built_world_tail_and_empty_slots() -> None:
    # One example on two ranks: one empty slot (the sampler turns it into a zero-loss step).
    d = distribute(sb.plan_batches([5], "random", batch_size=1), 2)
    assert d.num_steps == 1 and d.num_empty_slots == 1
    np.testing.assert_array_equal(seen_examples(d), [0])
    # Three single-example batches on two ranks: the tail is dealt again, 9 | 7 + 5, no empty slot.
    plan = sb.plan_batches([5, 7, 9], "random", batch_size=1)
    d = distribute(plan, 2)
    assert d.num_steps == 1 and d.num_empty_slots == 0
    assert sorted(d.rank_cost[0].tolist()) == [9, 12]
    np.testing.assert_array_equal(np.sort(seen_examples(d)), [0, 1, 2])
    # Three batches of two on two ranks: 6 examples → one step of two balanced micro-batches... or two.
    plan = sb.plan_batches([5, 7, 9, 4, 6, 8], "random", batch_size=2)
    d = distribute(plan, 2)
    assert d.num_empty_slots == 0
    assert d.max_step_imbalance <= 1.1


def test_attention_cost() -> None:
    plan = sb.plan_batches(
        [100, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 100], "packed", capacity=200, shuffle=False
    )
    tokens = distribute(plan, 2, cost="tokens")
    attention = distribute(plan, 2, cost="attention")
    assert attention.micro_batch_cost.sum() == (np.array([100, 100] + [10] * 10) ** 2).sum()
    assert tokens.micro_batch_cost.sum() == 300


def test_world_validation_and_detect(monkeypatch) -> None:
    with pytest.raises(ConfigError, match="rank="):
        World(2, 2)
    with pytest.raises(ConfigError, match="world_size="):
        World(0, 0)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert World.detect() == World(1, 3)
    with pytest.raises(ConfigError, match="cost="):
        distribute(sb.plan_batches([1, 2], "random"), 2, cost="flops")


def test_impossible_balance_meets_the_documented_bound() -> None:
    # One example longer than all the others together: no step holding it can be even. The bound is
    # max/mean >= world_size * c_max / (sum of the step's costs); the balancer reaches it.
    lengths = [1000, 10, 10, 10]
    d = distribute(sb.plan_batches(lengths, "random", batch_size=4), 2)
    bound = 2 * 1000 / sum(lengths)
    assert d.num_steps == 1 and d.num_empty_slots == 0
    assert d.max_step_imbalance == pytest.approx(bound)
    # With one example per batch the limit (batch size + 1 row) keeps [1000, 10] | [10, 10]: the best
    # two rows a rank can hold.
    d = distribute(sb.plan_batches(lengths, "random", batch_size=1), 2)
    assert sorted(d.rank_cost.sum(axis=0).tolist()) == [20, 1010]
    np.testing.assert_array_equal(np.sort(seen_examples(d)), [0, 1, 2, 3])


def gsm8k_lima_lengths() -> dict[str, np.ndarray]:
    import json

    out = {}
    gsm = [json.loads(line) for line in (DATA / "gsm8k" / "train.jsonl").open()]
    # Characters / 4 approximates BPE tokens well enough for a balance test on the real distribution.
    out["gsm8k"] = np.array([(len(x["question"]) + len(x["answer"])) // 4 for x in gsm], dtype=np.int64)
    lima = json.loads((DATA / "lima" / "lima.json").read_text())
    out["lima"] = np.array([(len(x["instruction"]) + len(x["output"])) // 4 for x in lima], dtype=np.int64)
    return out


# Every registered strategy with the first option set its spec gives for examples of up to 4,096
# tokens (longer ones are split), and those bounded by tokens (budgets, capacities) at 2,048 too.
REAL_STRATEGIES = cases(4096, first_only=True) + cases(
    2048, lambda spec: spec.micro_batch_limits().batch_size is None, first_only=True
)


@pytest.fixture(scope="module")
def real_lengths() -> dict[str, np.ndarray]:
    if not DATA.exists():
        pytest.skip("shared data folder absent (../shared/data)")
    return gsm8k_lima_lengths()


@pytest.mark.parametrize("strategy, options", REAL_STRATEGIES)
@pytest.mark.parametrize("world_size, accum", [(2, 1), (4, 1), (2, 4)])
def test_real_lengths_every_step_within_two_percent(
    real_lengths, strategy, options, world_size, accum
) -> None:
    """The issue's target on GSM8K and LIMA: every step within 2 % (max/mean rank tokens), every example
    exactly once, the same number of micro-batches on every rank, no empty micro-batch."""
    for name, lengths in real_lengths.items():
        plan = sb.plan_batches(lengths, strategy, overlong="split", seed=7, **options)
        d = distribute(plan, world_size, accum_steps=accum, seed=7)
        np.testing.assert_array_equal(np.sort(seen_examples(d)), np.sort(plan.example_ids))
        assert d.assignment.shape == (d.num_steps, world_size, accum)
        assert d.num_empty_slots == 0
        assert d.max_step_imbalance <= 1.02, (name, d.max_step_imbalance)
        # Balancing never exceeds the strategy's limits.
        for u in np.unique(d.assignment):
            check_limits(plan, d.micro_batch_segments(int(u)), options)


def test_extra_steps_only_where_needed(real_lengths) -> None:
    """A long example alone in a token budget makes its step light: evening LIMA out takes a few more
    steps. ``max_extra_steps=0`` keeps ``ceil(num_batches / G)`` steps (what the Trainer sizes an epoch
    on) at the price of a few uneven steps; GSM8K needs no extra step either way."""
    for name, lengths in real_lengths.items():
        plan = sb.plan_batches(lengths, "token_budget", max_tokens=8192, overlong="split", seed=7)
        kept = distribute(plan, 2, seed=7, max_extra_steps=0)
        grown = distribute(plan, 2, seed=7)
        assert kept.num_steps <= -(-len(plan) // 2)
        assert grown.max_step_imbalance <= 1.02
        for d in (kept, grown):
            np.testing.assert_array_equal(np.sort(seen_examples(d)), np.sort(plan.example_ids))
        if name == "gsm8k":
            assert grown.num_steps == kept.num_steps and kept.max_step_imbalance <= 1.02
        else:
            assert kept.num_steps < grown.num_steps <= kept.num_steps + 4
