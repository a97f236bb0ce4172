"""analyze / format_table / length_summary / plot_analysis: golden numbers, shared settings, overlong accounting."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smart_batching.analysis import (
    DEFAULT_STRATEGIES,
    analyze,
    default_max_tokens,
    format_table,
    length_summary,
    parse_strategy,
)
from smart_batching.errors import ConfigError, DataError, OverlongError

OVERLONG_FIELDS = ("num_over_limit", "num_truncated", "num_split", "num_dropped")


def _by_name(records):
    return {r["strategy"]: r for r in records}


def test_length_summary_golden():
    s = length_summary([1, 2, 3, 4, 100])
    assert s["n"] == 5 and s["total"] == 110 and s["max"] == 100 and s["min"] == 1
    assert s["mean"] == pytest.approx(22.0)
    assert s["p50"] == 3.0
    assert set(s) >= {"n", "total", "mean", "p50", "p90", "p99", "max"}
    assert length_summary([])["n"] == 0


def test_default_max_tokens_rounds_to_64():
    assert default_max_tokens(np.full(10, 100), 8) == 832  # 8 * 100 = 800 -> 832
    assert default_max_tokens(np.full(10, 64), 1) == 64
    assert default_max_tokens(np.zeros(3, dtype=np.int64), 8) == 64  # never below 64


def test_golden_two_lengths():
    # 8 short (10) and 8 long (100) examples, batch size 8.
    lengths = np.array([10] * 8 + [100] * 8)
    recs = _by_name(analyze(lengths, batch_size=8, max_tokens=800, seed=3))
    assert [r for r in recs] == list(DEFAULT_STRATEGIES)
    real = 8 * 10 + 8 * 100
    # max_length pads every row to the longest example (100).
    assert recs["max_length"]["token_slots"] == 16 * 100
    assert recs["max_length"]["efficiency"] == pytest.approx(real / 1600)
    # A full sort puts the 10s together and the 100s together: no padding.
    assert recs["group_by_length"]["efficiency"] == 1.0
    assert recs["group_by_length"]["num_batches"] == 2
    # Packing into rows of 800 tokens: 8 x 100 fill one row, 8 x 10 another.
    assert recs["packed"]["num_rows"] == recs["packed"]["lower_bound_rows"] == 2
    assert recs["packed"]["token_slots"] == 1600
    for r in recs.values():
        assert r["real_tokens"] == real
        assert r["padding_pct"] == pytest.approx(100 * (1 - r["efficiency"]))
        assert r["num_examples"] == 16
    assert min(r["relative_compute"] for r in recs.values()) == 1.0
    assert recs["max_length"]["relative_compute"] == pytest.approx(1600 / 880)


def test_record_fields_and_settings():
    lengths = np.random.default_rng(0).integers(1, 300, size=500)
    recs = analyze(lengths, batch_size=4)
    p95 = np.percentile(lengths, 95)
    expected_max_tokens = int(np.ceil(4 * p95 / 64) * 64)
    for r in recs:
        for key in (
            "strategy",
            "efficiency",
            "padding_ratio",
            "padding_pct",
            "num_batches",
            "num_rows",
            "token_slots",
            "real_tokens",
            "relative_compute",
            "lower_bound_rows",
            "plan_seconds",
            "settings",
            *OVERLONG_FIELDS,
        ):
            assert key in r, key
        assert r["settings"]["max_tokens"] == expected_max_tokens
        assert r["settings"]["capacity"] == expected_max_tokens  # capacity defaults to max_tokens
        assert r["plan_seconds"] >= 0
        json.dumps(r)  # JSON-ready
    packed = _by_name(recs)["packed"]
    assert packed["lower_bound_rows"] <= packed["num_rows"]
    assert packed["rows_over_lower_bound"] == packed["num_rows"] / packed["lower_bound_rows"]
    assert _by_name(recs)["random"]["lower_bound_rows"] is None


def test_strategy_variants_and_subset():
    lengths = np.arange(1, 200)
    recs = analyze(lengths, strategies=["packed[ffd]", "group_by_length[megabatch]", "token_budget"])
    assert [r["strategy"] for r in recs] == ["packed[ffd]", "group_by_length[megabatch]", "token_budget"]
    assert recs[0]["settings"]["spec"]["algorithm"] == "ffd"
    assert parse_strategy("group_by_length[sorted]") == ("group_by_length", {"mode": "sorted"})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "batch_size="),
        ({"max_tokens": -5}, "max_tokens="),
        ({"capacity": 0}, "capacity="),
        ({"overlong": "ignore"}, "overlong="),
        ({"seed": -1}, "seed="),
        ({"strategies": ["nope"]}, "strategies="),
        ({"strategies": []}, "strategies="),
        ({"strategies": ["random[x]"]}, "strategies="),
        ({"strategies": ["packed[nope]"]}, "algorithm="),
    ],
)
def test_bad_settings_name_the_setting(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        analyze([5, 6, 7], **kwargs)


def test_empty_raises():
    with pytest.raises(DataError, match="no examples"):
        analyze([])


def test_overlong_error_names_setting():
    with pytest.raises(OverlongError, match="max_tokens=64"):
        analyze([10, 20, 100], max_tokens=64, overlong="error")
    with pytest.raises(OverlongError, match="capacity=32"):
        analyze([10, 20, 100], max_tokens=64, capacity=32, overlong="error")


@pytest.mark.parametrize(
    ("policy", "field"), [("truncate", "num_truncated"), ("split", "num_split"), ("drop", "num_dropped")]
)
def test_overlong_counts_in_every_record(policy, field):
    lengths = np.array([10, 20, 30, 500, 700, 15])
    recs = analyze(lengths, batch_size=2, max_tokens=128, overlong=policy)
    for r in recs:
        assert r["num_over_limit"] == 2, r["strategy"]
        assert r[field] == 2, r["strategy"]
        assert r["settings"]["max_length"] == 128
    table = format_table(recs)
    assert {"truncate": "trunc", "split": "split", "drop": "drop"}[policy] in table
    if policy == "truncate":
        assert all(r["real_tokens"] == 10 + 20 + 30 + 128 + 128 + 15 for r in recs)
    if policy == "drop":
        assert all(r["real_tokens"] == 75 for r in recs)


def test_capacity_below_max_tokens_sets_the_limit():
    recs = analyze([10, 50, 90], max_tokens=256, capacity=64, overlong="truncate")
    assert all(r["num_over_limit"] == 1 and r["settings"]["max_length"] == 64 for r in recs)


def test_deterministic_in_seed():
    lengths = np.random.default_rng(1).integers(1, 500, size=2000)

    def strip(recs):
        return [{k: v for k, v in r.items() if k != "plan_seconds"} for r in recs]

    assert strip(analyze(lengths, seed=5)) == strip(analyze(lengths, seed=5))
    a = _by_name(analyze(lengths, seed=5))["random"]["token_slots"]
    b = _by_name(analyze(lengths, seed=6))["random"]["token_slots"]
    assert a != b


def test_format_table_aligned():
    recs = analyze(np.arange(1, 100), max_tokens=64, overlong="split")
    lines = format_table(recs).splitlines()
    assert lines[0].startswith("strategy") and "efficiency" in lines[0] and "rel. compute" in lines[0]
    assert set(lines[1]) <= {"-", " "}
    assert len(lines) == 2 + len(recs)
    for r, line in zip(recs, lines[2:], strict=True):
        assert line.startswith(r["strategy"])
        assert f"{100 * r['efficiency']:.1f}%" in line
    # Right-aligned numeric columns end at the same place.
    col = lines[0].index("batches") + len("batches")
    assert all(line[col - 1] != " " for line in lines[2:])


def test_all_empty_examples():
    """Empty examples are left out of every plan (as the samplers and the Trainer do), counted and warned
    about; with nothing left no strategy spends a slot."""
    from smart_batching.units import EmptyExamplesWarning

    with pytest.warns(EmptyExamplesWarning, match="3 empty example"):
        recs = analyze([0, 0, 0])
    assert all(r["real_tokens"] == 0 and r["token_slots"] == 0 for r in recs)
    assert all(r["num_examples"] == 3 and r["num_empty"] == 3 for r in recs)
    assert all(r["relative_compute"] == 1.0 and r["efficiency"] is None for r in recs)
    format_table(recs)


def test_empty_examples_skipped_or_refused():
    from smart_batching.errors import DataError
    from smart_batching.units import EmptyExamplesWarning

    with pytest.warns(EmptyExamplesWarning, match="rows 1, 3"):
        recs = analyze([5, 0, 7, 0, 3], batch_size=2)
    assert all(r["num_empty"] == 2 and r["num_segments"] == 3 and r["real_tokens"] == 15 for r in recs)
    with pytest.raises(DataError, match="empty_examples='skip'"):
        analyze([5, 0, 7], empty_examples="error")


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 700), min_size=1, max_size=120),
    batch_size=st.integers(1, 9),
    policy=st.sampled_from(["truncate", "split", "drop"]),
)
def test_property_consistent_accounting(lengths, batch_size, policy):
    arr = np.array(lengths, dtype=np.int64)
    recs = analyze(arr, batch_size=batch_size, max_tokens=256, overlong=policy)
    over = int(np.count_nonzero(arr > 256))
    reals = {r["real_tokens"] for r in recs}
    assert len(reals) == 1  # every strategy sees the same tokens after the overlong policy
    for r in recs:
        assert r["num_over_limit"] == over
        assert r["real_tokens"] <= r["token_slots"] or r["token_slots"] == 0
        if r["token_slots"]:
            assert 0.0 <= r["efficiency"] <= 1.0
        else:  # nothing planned (every example dropped): n/a, not 100 %
            assert r["efficiency"] is None and r["padding_pct"] is None
        if r["relative_compute"] is not None:
            assert r["relative_compute"] >= 1.0
    if policy == "split":
        assert reals == {int(arr.sum())}


def test_plot_analysis_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from smart_batching.analysis.plots import plot_analysis

    lengths = np.random.default_rng(0).lognormal(4, 1, 3000).astype(np.int64) + 1
    recs = analyze(lengths, max_tokens=256, overlong="truncate")
    out = plot_analysis(lengths, recs, tmp_path / "sub" / "a.png", title="t")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    with pytest.raises(DataError):
        plot_analysis([], recs, tmp_path / "b.png")


def test_default_capacity_respects_the_packed_limit():
    # Long-context lengths: batch size x p95 is far over what the packed planner takes; the derived
    # default must not ask for it (it failed with "capacity= must be at most 262143").
    from smart_batching.planners.packed import MAX_CAPACITY

    lengths = np.full(40, 100_000, dtype=np.int64)
    recs = analyze(lengths, strategies=["packed", "token_budget"])
    settings = recs[0]["settings"]
    assert settings["max_tokens"] > MAX_CAPACITY
    assert settings["capacity"] == MAX_CAPACITY
    packed = {r["strategy"]: r for r in recs}["packed"]
    assert packed["num_over_limit"] == 0 and packed["num_rows"] == 20  # two examples per row
