"""Planner contract suite (run against every strategy), golden tables and property tests."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategy_cases import cases

import smart_batching as sb
from smart_batching.errors import ConfigError, DataError, OverlongError
from smart_batching.planners import REGISTRY, make_spec

# Every registered strategy with each option set its spec gives for these lengths (at most 250 tokens);
# the contract below runs against each.
CONFIGS = {param.id: param.values[1] for param in cases(250)}
STRATEGY_OF = {param.id: param.values[0] for param in cases(250)}


def strategy_of(key: str) -> str:
    return STRATEGY_OF.get(key, key.split("[")[0])


def check_plan(plan: sb.BatchPlan, lengths: np.ndarray, options: dict) -> None:
    """Invariants every plan must hold."""
    n = lengths.shape[0]
    # Structure: offsets are monotone and cover the flat arrays exactly.
    assert plan.batch_offsets[0] == 0 and plan.batch_offsets[-1] == plan.num_rows
    assert plan.row_offsets[0] == 0 and plan.row_offsets[-1] == plan.num_segments
    assert np.all(np.diff(plan.batch_offsets) > 0)
    assert np.all(np.diff(plan.row_offsets) > 0)
    assert len(list(plan)) == len(plan) == len(plan.batch_width)
    # Coverage: tokens of every example covered exactly once, unless a policy truncated or dropped it.
    covered = np.zeros(n, dtype=np.int64)
    np.add.at(covered, plan.example_ids, plan.seg_lengths)
    ov = plan.overlong
    expected = lengths.copy()
    if ov.policy == "truncate" and ov.limit is not None:
        expected = np.minimum(lengths, ov.limit)
    if ov.policy == "drop" and ov.limit is not None:
        expected[lengths > ov.limit] = 0
    if not options.get("drop_last"):
        np.testing.assert_array_equal(covered, expected)
        # Every example appears (even zero-length ones), split ones once per piece.
        seen = np.bincount(plan.example_ids, minlength=n)
        assert np.all(seen[expected > 0] >= 1)
        if ov.policy != "split":
            kept = np.ones(n, bool) if ov.policy != "drop" or ov.limit is None else lengths <= ov.limit
            np.testing.assert_array_equal(seen, kept.astype(np.int64))
    # Pieces of a split example tile it: starts are distinct multiples of the limit.
    assert np.all(plan.seg_starts + plan.seg_lengths <= lengths[plan.example_ids])
    # Limits.
    rows_per_batch = np.diff(plan.batch_offsets)
    seg_per_row = np.diff(plan.row_offsets)
    row_tokens = np.add.reduceat(plan.seg_lengths, plan.row_offsets[:-1]) if plan.num_rows else np.zeros(0)
    row_batch = np.repeat(np.arange(len(plan)), rows_per_batch)
    assert np.all(row_tokens <= plan.batch_width[row_batch]), "a row is wider than its batch"
    if "batch_size" in options:
        assert rows_per_batch.max(initial=0) <= options["batch_size"]
        assert np.all(seg_per_row == 1)
    if "max_tokens" in options:
        assert np.all(plan.slots_per_batch <= options["max_tokens"])
        m = options.get("batch_size_multiple", 1)
        sizes = rows_per_batch
        full = sizes[sizes >= m]
        # All but possibly one (the tail of the sorted order) are multiples when large enough.
        assert np.count_nonzero(full % m) <= 1
    if "capacity" in options:
        assert np.all(row_tokens <= options["capacity"])
        assert np.all(plan.batch_width == options["capacity"])
        assert rows_per_batch.max(initial=0) <= options.get("rows_per_batch", 1)
    # Stats agree with the arrays.
    s = plan.stats()
    assert s.real_tokens == int(plan.seg_lengths.sum())
    assert s.token_slots == int(plan.slots_per_batch.sum())
    assert s.num_batches == len(plan)
    if s.token_slots:
        assert 0.0 <= s.padding_ratio <= 1.0
        assert s.efficiency == pytest.approx(s.real_tokens / s.token_slots)
    else:  # no token slots at all: efficiency is undefined (NaN), not 100 %
        assert np.isnan(s.efficiency) and np.isnan(s.padding_ratio)


@pytest.fixture(scope="module")
def lengths() -> np.ndarray:
    rng = np.random.default_rng(123)
    return np.clip(rng.lognormal(4.0, 0.8, 997), 1, 250).astype(np.int64)


@pytest.mark.parametrize("key", list(CONFIGS))
def test_contract(key: str, lengths: np.ndarray) -> None:
    options = CONFIGS[key]
    plan = sb.plan_batches(lengths, strategy_of(key), seed=7, **options)
    check_plan(plan, lengths, options)
    # Deterministic in (seed, epoch).
    again = sb.plan_batches(lengths, strategy_of(key), seed=7, **options)
    np.testing.assert_array_equal(plan.example_ids, again.example_ids)
    np.testing.assert_array_equal(plan.batch_offsets, again.batch_offsets)
    assert plan.fingerprint == again.fingerprint
    # Different across epochs and seeds; the fingerprint ignores the epoch.
    other_epoch = sb.plan_batches(lengths, strategy_of(key), seed=7, epoch=1, **options)
    assert not np.array_equal(plan.example_ids, other_epoch.example_ids)
    assert other_epoch.fingerprint == plan.fingerprint
    other_seed = sb.plan_batches(lengths, strategy_of(key), seed=8, **options)
    assert not np.array_equal(plan.example_ids, other_seed.example_ids)
    assert other_seed.fingerprint != plan.fingerprint


@pytest.mark.parametrize("key", [k for k, options in CONFIGS.items() if not options.get("drop_last")])
@pytest.mark.parametrize("policy", ["truncate", "split", "drop"])
def test_overlong_policies(key: str, policy: str) -> None:
    options = dict(CONFIGS[key])
    limit_key = "capacity" if "capacity" in options else "max_length"
    lengths = np.array([10, 300, 40, 700, 5, 120, 60, 90, 255, 256, 257], dtype=np.int64)
    if "max_tokens" in options:
        options["max_length"] = 128
    else:
        options[limit_key] = options.get(limit_key, 128) if limit_key == "capacity" else 128
    plan = sb.plan_batches(lengths, strategy_of(key), overlong=policy, **options)
    check_plan(plan, lengths, options)
    limit = plan.overlong.limit
    over = lengths > limit
    s = plan.stats()
    assert s.num_over_limit == int(over.sum()) > 0
    if policy == "truncate":
        assert s.num_truncated == int(over.sum())
        assert s.overlong.truncated_tokens == int((lengths[over] - limit).sum())
    if policy == "drop":
        assert s.num_dropped == int(over.sum())
        assert s.overlong.dropped_tokens == int(lengths[over].sum())
        assert not set(np.flatnonzero(over)) & set(plan.example_ids.tolist())
    if policy == "split":
        assert s.num_split == int(over.sum())
        assert s.real_tokens == int(lengths.sum())


@pytest.mark.parametrize("key", list(CONFIGS))
def test_overlong_error_names_the_setting(key: str) -> None:
    options = dict(CONFIGS[key])
    lengths = np.array([10, 1000, 20], dtype=np.int64)
    if "batch_size" in options:
        options["max_length"] = 100
    with pytest.raises(OverlongError) as err:
        sb.plan_batches(lengths, strategy_of(key), **options)
    msg = str(err.value)
    assert "example 1 has 1000 tokens" in msg
    assert "overlong=" in msg
    assert any(f"{name}=" in msg for name in ("capacity", "max_length", "max_tokens"))


# --- Golden tables: literal lengths in, literal batches out. -------------------------------------

GOLDEN_LENGTHS = [5, 3, 9, 1, 7, 2, 8, 4, 6, 10]


def test_golden_packed_unshuffled() -> None:
    # Decreasing: 10 9 8 7 6 5 4 3 2 1 into rows of 12 → exact fills 10+2, 9+3, 8+4, 7+5, 6+1+(…).
    plan = sb.plan_batches(GOLDEN_LENGTHS, "packed", capacity=12, shuffle=False, algorithm="bfd")
    assert plan.to_lists() == [[9, 5], [2, 1], [6, 7], [4, 0], [8, 3]]
    assert plan.stats().num_rows == 5 == plan.stats().lower_bound_rows


def test_golden_packed_fill_beats_bfd() -> None:
    # BFD: 13 | 11 | 10 open rows; 8 → 11 (gap 1), 6 → 13 (gap 1), 5 → 10, 4 → 10+5 (gap 1): 2 needs a 4th row.
    # Exact filling: 13+5+2, 11+8 (+1 free), 10+6+4: the lower bound of 3 rows.
    lengths = [2, 13, 4, 10, 11, 5, 8, 6]
    bfd = sb.plan_batches(lengths, "packed", capacity=20, algorithm="bfd", shuffle=False)
    fill = sb.plan_batches(lengths, "packed", capacity=20, algorithm="fill", shuffle=False)
    auto = sb.plan_batches(lengths, "packed", capacity=20, algorithm="auto", shuffle=False)
    assert bfd.stats().num_rows == 4
    assert fill.to_lists() == [[1, 5, 0], [4, 6], [3, 7, 2]]
    assert fill.stats().num_rows == fill.stats().lower_bound_rows == 3
    assert auto.to_lists() == fill.to_lists()


def test_golden_token_budget() -> None:
    plan = sb.plan_batches(GOLDEN_LENGTHS, "token_budget", max_tokens=20)
    # Ascending 1 2 3 4 | 5 6 | 7 8 | 9 10: the largest batches with rows × longest ≤ 20; order shuffled.
    assert sorted(sorted(b) for b in plan.to_lists()) == [[0, 8], [1, 3, 5, 7], [2, 9], [4, 6]]
    for batch, width in zip(plan, plan.batch_width, strict=True):
        assert width == max(GOLDEN_LENGTHS[i] for i in batch)


def test_golden_group_by_length_sorted() -> None:
    plan = sb.plan_batches(GOLDEN_LENGTHS, "group_by_length", batch_size=3, mode="sorted")
    # Ascending 1 2 3 | 4 5 6 | 7 8 9 | 10.
    assert sorted(sorted(b) for b in plan.to_lists()) == [[0, 7, 8], [1, 3, 5], [2, 4, 6], [9]]


def test_golden_group_by_length_sorted_exact() -> None:
    # Lengths 1..10 in order: sorted batches of 3 are {1,2,3} {4,5,6} {7,8,9} {10}.
    lengths = list(range(1, 11))
    plan = sb.plan_batches(lengths, "group_by_length", batch_size=3, mode="sorted")
    assert sorted(sorted(b) for b in plan.to_lists()) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert sorted(plan.batch_width.tolist()) == [3, 6, 9, 10]


def test_golden_max_length_widths() -> None:
    plan = sb.plan_batches(GOLDEN_LENGTHS, "max_length", batch_size=4)
    assert plan.batch_width.tolist() == [10, 10, 10]
    assert plan.stats().token_slots == 100
    plan = sb.plan_batches(GOLDEN_LENGTHS, "max_length", batch_size=4, max_length=16)
    assert plan.stats().token_slots == 160
    assert plan.stats().real_tokens == 55


def check_megabatches(lengths: np.ndarray, order: np.ndarray, mega: int) -> None:
    # The global longest example leads; apart from the swapped first elements, megabatches descend.
    assert lengths[order[0]] == lengths.max()
    for start in range(0, len(order), mega):
        block = lengths[order[start : start + mega]]
        assert np.all(np.diff(block[1:]) <= 0)


def test_megabatch_matches_hf_semantics() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 500, 1000)
    plan = sb.plan_batches(
        lengths, "group_by_length", batch_size=4, mode="megabatch", megabatch_mult=5, seed=3
    )
    check_megabatches(lengths, plan.example_ids, 20)


def test_hf_default_megabatch_mult() -> None:
    lengths = np.random.default_rng(1).permutation(np.arange(1, 41))
    plan = sb.plan_batches(lengths, "group_by_length", batch_size=4, mode="megabatch")
    # HF default: mult = min(n // (4 * batch_size), 50) = 2 → megabatches of 8.
    check_megabatches(lengths, plan.example_ids, 8)
    with pytest.raises(AssertionError):
        check_megabatches(lengths, plan.example_ids, 16)


# --- Bad input. ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, match",
    [
        ([1, -2, 3], "non-negative"),
        ([1.5, 2.0], "whole token counts"),
        ([[1, 2], [3, 4]], "1-D"),
        (["a", "b"], "integer"),
    ],
)
def test_bad_lengths(bad, match) -> None:
    with pytest.raises(DataError, match=match):
        sb.plan_batches(bad, "random", batch_size=2)


@pytest.mark.parametrize(
    "strategy, options, field",
    [
        ("random", dict(batch_size=0), "batch_size="),
        ("packed", dict(capacity=-1), "capacity="),
        ("packed", dict(algorithm="nope"), "algorithm="),
        ("packed", dict(overlong="ignore"), "overlong="),
        ("token_budget", dict(max_tokens=100, max_length=200), "max_length="),
        ("group_by_length", dict(mode="weird"), "mode="),
        ("random", dict(capacity=4), "capacity"),
        ("nonexistent", dict(), "unknown strategy"),
    ],
)
def test_bad_settings_name_the_field(strategy, options, field) -> None:
    with pytest.raises(ConfigError, match=field):
        sb.plan_batches([1, 2, 3], strategy, **options)


def test_seed_must_be_non_negative() -> None:
    with pytest.raises(ConfigError, match="seed="):
        sb.plan_batches([1, 2], "random", seed=-1)


def test_spec_objects_and_names_agree() -> None:
    lengths = np.arange(1, 50)
    a = sb.plan_batches(lengths, sb.PackedSpec(capacity=64), seed=1)
    b = sb.plan_batches(lengths, "packed", capacity=64, seed=1)
    np.testing.assert_array_equal(a.example_ids, b.example_ids)
    assert make_spec("packed", capacity=64) == sb.PackedSpec(capacity=64)
    with pytest.raises(ConfigError):
        make_spec(sb.PackedSpec(), capacity=3)


def test_registry_lists_every_strategy() -> None:
    # The built-in strategies are registered first, and the contract suite above covers every
    # registered strategy through the options its spec gives (a new one needs no entry here).
    assert sb.planners.strategy_names()[: len(sb.planners.STRATEGIES)] == sb.planners.STRATEGIES
    assert set(REGISTRY) == set(STRATEGY_OF.values())
    for name, (spec_cls, planner) in REGISTRY.items():
        assert spec_cls.name == name and callable(planner)
        assert spec_cls.example_options(250), f"{name}: example_options() gives no option set"


# --- Property tests. ----------------------------------------------------------------------------

length_arrays = st.one_of(
    st.just([]),
    st.lists(st.integers(0, 300), min_size=1, max_size=1),
    st.integers(0, 300).flatmap(lambda v: st.lists(st.just(v), min_size=1, max_size=60)),  # all equal
    st.lists(st.integers(0, 300), min_size=0, max_size=120),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=length_arrays,
    key=st.sampled_from(list(CONFIGS)),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 5),
)
def test_property_contract(lengths, key, seed, epoch) -> None:
    lengths = np.asarray(lengths, dtype=np.int64)
    options = dict(CONFIGS[key])
    # Over-capacity inputs are part of the space: exercise every policy.
    options["overlong"] = ["split", "truncate", "drop"][seed % 3]
    if "batch_size" in options:
        options["max_length"] = 200
    plan = sb.plan_batches(lengths, strategy_of(key), seed=seed, epoch=epoch, **options)
    check_plan(plan, lengths, options)
    if lengths.size == 0:
        assert len(plan) == 0 and np.isnan(plan.stats().efficiency)  # no token slots: n/a, not 100 %


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 256), min_size=1, max_size=200), capacity=st.sampled_from([256, 300, 512])
)
def test_property_packing_quality(lengths, capacity) -> None:
    lengths = np.asarray(lengths, dtype=np.int64)
    plan = sb.plan_batches(lengths, "packed", capacity=capacity, algorithm="auto")  # the tightest rows
    s = plan.stats()
    assert s.lower_bound_rows <= s.num_rows
    # Any-fit packing: at most one row is half empty or worse.
    row_tokens = np.add.reduceat(plan.seg_lengths, plan.row_offsets[:-1])
    assert np.count_nonzero(row_tokens * 2 <= capacity) <= 1
    # ...so rows ≤ 2 * ceil(total / capacity) + 1, and auto is never worse than BFD.
    bfd = sb.plan_batches(lengths, "packed", capacity=capacity, algorithm="bfd")
    assert s.num_rows <= bfd.stats().num_rows


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 3000), seed=st.integers(0, 2**31))
def test_property_permutation_is_uniformly_a_permutation(n, seed) -> None:
    from smart_batching.planners._common import permutation

    p = permutation(n, np.random.default_rng(seed))
    np.testing.assert_array_equal(np.sort(p), np.arange(n))


def test_permutation_is_unbiased_enough() -> None:
    """Large shuffles go through random buckets: each position must still be uniform."""
    from smart_batching.planners._common import permutation

    n, trials = 70_000, 40  # above the in-place range, so the bucketed path runs
    first = np.zeros(n // 1000 + 1)
    for t in range(trials):
        p = permutation(n, np.random.default_rng(t))
        np.add.at(first, p[:1000] // 1000, 1)
    # 40,000 draws over 71 coarse cells: no cell far from its share.
    expected = trials * 1000 / (n / 1000)
    assert np.all(np.abs(first[:-1] - expected) < 6 * np.sqrt(expected))
