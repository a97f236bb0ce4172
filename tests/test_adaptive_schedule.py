"""The batch-size schedule value: its text forms, its values, and cutting a stream into steps."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smart_batching import ConfigError
from smart_batching.adaptive import BatchSchedule, cut_steps, parse_count


@pytest.mark.parametrize(
    ("text", "value"),
    [("16384", 16384), ("16k", 16_000), ("16K", 16_000), ("16Ki", 16_384), ("2.5M", 2_500_000),
     ("250B", 250 * 10**9), ("1G", 10**9), ("3T", 3 * 10**12), ("1Mi", 2**20), (" 7 ", 7)],
)  # fmt: skip
def test_counts_take_megatron_and_binary_suffixes(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["", "abc", "1.5", "16kb", "-3", "1e6"])
def test_bad_counts_are_refused(text):
    with pytest.raises(ConfigError):
        parse_count(text)


def test_linear_ramp_interpolates_then_holds():
    s = BatchSchedule.parse("linear:16384->131072@1M")
    assert s.kind == "linear" and s.initial_size == 16384 and s.final_size == 131072
    assert s.size_at(0) == 16384
    assert s.size_at(500_000) == round(16384 + (131072 - 16384) * 0.5)
    assert s.size_at(1_000_000) == 131072 and s.size_at(10**9) == 131072
    np.testing.assert_array_equal(s.size_at(np.array([0, 1_000_000])), [16384, 131072])


def test_steps_hold_each_size_from_its_threshold():
    s = BatchSchedule.parse("0:16k 5M:64k 20M:128k")
    assert s.kind == "steps"
    got = [s.size_at(x) for x in (0, 4_999_999, 5_000_000, 19_999_999, 20_000_000, 10**12)]
    assert got == [16_000, 16_000, 64_000, 64_000, 128_000, 128_000]
    # Any ratio, not only integer factors (OLMo-core allows integer factors only).
    assert BatchSchedule.parse("0:3 10:7 20:5").size_at(np.array([0, 10, 25])).tolist() == [3, 7, 5]


def test_shares_of_the_epoch_resolve_against_its_total():
    s = BatchSchedule.parse("linear:100->300@20%")
    assert not s.is_resolved
    with pytest.raises(ConfigError, match="resolve"):
        s.size_at(0)
    r = s.resolve(10_000)
    assert r.points[-1].at == 2000 and r.size_at(1000) == 200 and r.size_at(5000) == 300
    assert BatchSchedule.parse("linear:1->3@150%").resolve(1000).points[-1].at == 1500  # past epoch 1
    mixed = BatchSchedule.parse("0:8 50%:16").resolve(1000)
    assert mixed.size_at(499) == 8 and mixed.size_at(500) == 16


def test_multi_piece_ramp_and_text_round_trip():
    s = BatchSchedule.parse("linear:16Ki->64Ki@5M->128Ki@20M")
    assert [p.size for p in s.points] == [16384, 65536, 131072]
    assert s.size_at(5_000_000) == 65536 and s.size_at(12_500_000) == (65536 + 131072) // 2
    for text in ("linear:100->300@20%", "0:16 1000:32 5000:64", "linear:1->2@10->9@20"):
        s = BatchSchedule.parse(text)
        assert BatchSchedule.parse(str(s)) == s


def test_unit_is_kept_or_filled_in():
    s = BatchSchedule.parse("0:4 100:8", unit="examples")
    assert s.unit == "examples"
    assert BatchSchedule.parse(s, unit="tokens").unit == "examples"  # an explicit unit wins
    assert BatchSchedule.parse(BatchSchedule.parse("0:4"), unit="tokens").unit == "tokens"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("10:16 20:32", "first threshold must be 0"),
        ("0:16 20:32 10:64", "thresholds must rise"),
        ("0:0", "sizes must be positive"),
        ("linear:16->32", "needs @OVER"),
        ("linear:16", "START->END@OVER"),
        ("0:16 20", "not AT:SIZE"),
        ("0:16 %:32", "not a count"),
        ("fast", "not AT:SIZE"),
    ],
)
def test_bad_schedules_say_what_is_expected(text, message):
    with pytest.raises(ConfigError, match=message) as info:
        BatchSchedule.parse(text)
    assert "batch_schedule" in str(info.value)


def test_cut_steps_follows_the_schedule_within_one_example():
    rng = np.random.default_rng(0)
    tokens = rng.integers(20, 400, size=5000)
    s = BatchSchedule.parse("linear:1000->8000@30%").resolve(int(tokens.sum()))
    offsets = cut_steps(tokens, s)
    assert offsets[0] == 0 and offsets[-1] == tokens.size and np.all(np.diff(offsets) >= 1)
    csum = np.concatenate([[0], np.cumsum(tokens)])
    seen = csum[offsets[:-1]]
    got = csum[offsets[1:]] - seen
    target = s.size_at(seen)
    # The step ends before or after the example that crosses its target: it misses the target by at
    # most half of that example (the last step takes what is left).
    last, following = tokens[offsets[1:-1] - 1], tokens[offsets[1:-1]]
    assert np.all(np.abs(got - target)[:-1] <= np.maximum(last, following) / 2)
    assert got[0] < got[-2]  # the ramp is realised: small steps first, large ones last


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 50), min_size=0, max_size=60),
    st.integers(1, 120),
    st.integers(1, 120),
    st.integers(0, 500),
)
def test_cut_steps_covers_the_stream_exactly_once(weights, a, b, seen):
    s = BatchSchedule.parse(f"0:{a} 100:{b}")
    offsets = cut_steps(np.asarray(weights, dtype=np.int64), s, seen=seen)
    assert offsets[0] == 0 and offsets[-1] == len(weights)
    assert np.all(np.diff(offsets) >= 1)  # every step holds at least one example


def test_cut_steps_counts_examples_with_unit_weights():
    offsets = cut_steps(np.ones(100, dtype=np.int64), BatchSchedule.parse("linear:4->16@40", unit="examples"))
    sizes = np.diff(offsets)
    assert sizes[0] == 4 and sizes[-2] == 16
    assert sizes.sum() == 100
