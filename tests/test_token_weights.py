"""``analysis.token_weights``: the weight of a target token per length quarter of the examples, against a
loop over the plan's batches, and what it says of steps of like and of mixed lengths."""

from __future__ import annotations

import numpy as np
import pytest

from smart_batching.analysis import token_weights
from smart_batching.planners import plan_batches


def _by_loop(plan, targets) -> list[float]:
    """The definition, batch by batch: a token of batch b weighs 1 / (targets of b); a segment of a split
    example carries its tokens' share of the example's targets."""
    lengths = plan.lengths
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))  # quarters by rank
    quarter_of = {e: 4 * r // len(lengths) for r, e in enumerate(order)}
    mass, tokens = np.zeros(4), np.zeros(4)
    for b in range(len(plan)):
        lo, hi = plan.segment_range(b)
        seg = [(int(plan.example_ids[i]), int(plan.seg_lengths[i])) for i in range(lo, hi)]
        t = [targets[e] * n / lengths[e] for e, n in seg]
        step = max(sum(t), 1.0)
        for (e, _), te in zip(seg, t, strict=True):
            q = quarter_of[e]
            mass[q] += te / step
            tokens[q] += te
    return list((mass / mass.sum()) / (tokens / tokens.sum()))


@pytest.mark.parametrize(
    ("strategy", "options"),
    [
        ("random", {"batch_size": 8}),
        ("group_by_length", {"batch_size": 8}),
        ("token_budget", {"max_tokens": 2048}),
        ("packed", {"capacity": 700, "overlong": "split"}),  # some examples split over rows
    ],
)
def test_token_weights_match_the_loop(strategy, options):
    rng = np.random.default_rng(0)
    lengths = rng.integers(24, 900, size=400)
    targets = lengths - 20  # a 20-token prompt each
    plan = plan_batches(lengths, strategy, seed=3, **options)
    assert token_weights(plan, targets) == pytest.approx(_by_loop(plan, targets), rel=1e-9)


def test_steps_of_like_lengths_weigh_short_examples_more_than_rows_of_mixed_lengths():
    """A 40-token prompt on every example: a row of short examples holds fewer targets, so its tokens weigh
    more. The tightest packing (`auto`) puts like lengths together; the default mixes them."""
    lengths = np.random.default_rng(1).integers(48, 600, size=3000)
    targets = lengths - 40
    weights = {
        algorithm: token_weights(
            plan_batches(lengths, "packed", capacity=2048, algorithm=algorithm, seed=0), targets
        )
        for algorithm in ("auto", "spread_fit")
    }
    assert weights["auto"][0] > 1.05  # the shortest quarter's tokens over their share
    assert max(abs(w - 1) for w in weights["spread_fit"]) < max(abs(w - 1) for w in weights["auto"]) / 3
    grouped = token_weights(plan_batches(lengths, "group_by_length", batch_size=8, seed=0), targets)
    assert grouped[0] > 1.5 > 0.8 > grouped[3]


def test_ties_do_not_empty_a_quarter():
    # Half the examples at one length (truncated, say): quantile edges would coincide; ranks do not.
    lengths = np.array([64] * 8 + [10, 20, 30, 40, 50, 60, 62, 63])
    weights = token_weights(plan_batches(lengths, "random", batch_size=4, seed=0), lengths - 5)
    assert all(np.isfinite(weights))


def test_token_weights_refuse_targets_of_another_shape():
    plan = plan_batches(np.array([5, 6, 7]), "random", batch_size=2, seed=0)
    with pytest.raises(ValueError, match="targets has shape"):
        token_weights(plan, np.array([1, 2]))
