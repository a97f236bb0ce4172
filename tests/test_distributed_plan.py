"""Balancing across ranks: a pure function, tested with hand-built worlds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import smart_batching as sb
from smart_batching.distributed import World, distribute
from smart_batching.errors import ConfigError

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def seen_examples(d) -> np.ndarray:
    units = [u for r in range(d.world_size) for u in d.rank_units(r) if u >= 0]
    return np.concatenate([d.unit_examples(u) for u in units]) if units else np.zeros(0, np.int64)


@pytest.fixture(scope="module")
def heavy_tailed() -> np.ndarray:
    rng = np.random.default_rng(5)
    return np.clip(rng.lognormal(5.0, 0.7, 3001), 8, 2000).astype(np.int64)


STRATEGIES = [
    ("random", dict(batch_size=8)),
    ("group_by_length", dict(batch_size=8)),
    ("token_budget", dict(max_tokens=4096)),
    ("packed", dict(capacity=4096)),
    ("packed", dict(capacity=2048, rows_per_batch=2)),
]


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
        assert d.rank_units(r).shape[0] == d.num_steps * accum
    # The ragged tail is absorbed by splitting, not by empty slots, when units can be split.
    assert d.num_empty_slots == 0
    # Units respect the strategy's limits after balancing.
    for u in range(len(d.unit_start)):
        segs = d.unit_segments(u)
        lens = plan.seg_lengths[segs]
        if strategy == "packed":
            assert lens.sum() <= options["capacity"] * options.get("rows_per_batch", 1)
        if strategy == "token_budget":
            assert len(lens) * lens.max() <= options["max_tokens"]


@pytest.mark.parametrize("strategy, options", STRATEGIES)
@pytest.mark.parametrize("world_size", [2, 4])
def test_balanced_on_heavy_tailed_lengths(heavy_tailed, strategy, options, world_size) -> None:
    plan = sb.plan_batches(heavy_tailed, strategy, seed=2, **options)
    d = distribute(plan, world_size, seed=2)
    naive = distribute(plan, world_size, seed=2, balance_rounds=0)
    assert np.quantile(d.step_imbalance, 0.95) <= 1.02
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
    assert attention.unit_cost.sum() == (np.array([100, 100] + [10] * 10) ** 2).sum()
    assert tokens.unit_cost.sum() == 300


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


def gsm8k_lima_lengths() -> dict[str, np.ndarray]:
    import gzip  # noqa: F401
    import json

    out = {}
    gsm = [json.loads(line) for line in (DATA / "gsm8k" / "train.jsonl").open()]
    # Characters / 4 approximates BPE tokens well enough for a balance test on the real distribution.
    out["gsm8k"] = np.array([(len(x["question"]) + len(x["answer"])) // 4 for x in gsm], dtype=np.int64)
    lima = json.loads((DATA / "lima" / "lima.json").read_text())
    out["lima"] = np.array([(len(x["instruction"]) + len(x["output"])) // 4 for x in lima], dtype=np.int64)
    return out


@pytest.mark.skipif(not DATA.exists(), reason="shared data folder absent")
@pytest.mark.parametrize("world_size, accum", [(2, 1), (4, 1), (2, 4)])
def test_real_lengths_imbalance(world_size, accum) -> None:
    for name, lengths in gsm8k_lima_lengths().items():
        # Packing: every step within 2 % (the target), every example once.
        plan = sb.plan_batches(lengths, "packed", capacity=4096, overlong="split")
        d = distribute(plan, world_size, accum_steps=accum)
        np.testing.assert_array_equal(np.sort(seen_examples(d)), np.sort(plan.example_ids))
        assert d.max_step_imbalance <= 1.02, (name, d.max_step_imbalance)
        # Token budget: batches at the budget cannot take more, so single long examples leave a few
        # steps uneven on heavy-tailed LIMA (up to 1.2 with 4 ranks); nine steps in ten within 5 %.
        plan = sb.plan_batches(lengths, "token_budget", max_tokens=8192, overlong="split")
        d = distribute(plan, world_size, accum_steps=accum)
        np.testing.assert_array_equal(np.sort(seen_examples(d)), np.sort(plan.example_ids))
        assert np.quantile(d.step_imbalance, 0.9) <= 1.05, (name, np.quantile(d.step_imbalance, 0.9))
        assert d.num_empty_slots == 0
