"""How random a strategy's batches are: the other side of the padding trade, measured before training.

Grouping by length saves padding by putting similar examples together, and the price is randomness:
batches that run long to short (HF megabatches), or the same examples meeting in the same batch every
epoch (a global sort, deterministic packing). Gradient noise and ordering effects follow from both,
and a training run is an expensive way to find out. :func:`batch_randomness` compares two consecutive
epochs of one strategy (same spec and seed, epochs ``e`` and ``e + 1``) and reports:

* ``order_corr``: does the length of one batch predict the next one (order along the epoch)?
* ``pair_repeat``: do examples that share a group this epoch share one again the next (membership)?
* ``pair_repeat_random``: what ``pair_repeat`` would be by chance, given the group sizes.

A group is what an example shares with others: its row when the strategy packs rows
(``spec.packs_rows``), else its batch. Everything is vectorised, O(n) in the segments (plus a sort
when an overlong policy split examples). :func:`~smart_batching.analysis.analyze` and the bench report
these next to efficiency.
"""

from __future__ import annotations

import math

import numpy as np

from smart_batching.errors import DataError
from smart_batching.plan import BatchPlan


def _group_offsets(plan: BatchPlan) -> np.ndarray:
    """Segment offsets of the plan's groups: rows when the strategy packs rows, else batches."""
    if getattr(plan.spec, "packs_rows", False):
        return plan.row_offsets
    return plan.row_offsets[plan.batch_offsets]


def _segment_groups(plan: BatchPlan) -> np.ndarray:
    """Group id of every segment: (num_segments,) int64."""
    offsets = _group_offsets(plan)
    num_groups = offsets.shape[0] - 1
    return np.repeat(np.arange(num_groups, dtype=np.int64), np.diff(offsets))


def _example_groups(plan: BatchPlan) -> np.ndarray:
    """Group id of every example's first segment, -1 for examples not in the plan: (num_examples,)."""
    groups = _segment_groups(plan)  # (num_segments,)
    ids = plan.example_ids
    out = np.full(plan.num_examples, -1, dtype=np.int64)
    if plan.overlong.num_split == 0:  # each example at most once: no first segment to find
        out[ids] = groups
    else:
        uniq, first = np.unique(ids, return_index=True)  # first: position of each example's first segment
        out[uniq] = groups[first]
    return out


def _order_corr(plan: BatchPlan) -> float:
    """Lag-1 Pearson correlation of the mean segment length of consecutive batches."""
    segs = plan.segments_per_batch
    keep = segs > 0
    means = plan.tokens_per_batch[keep] / segs[keep]  # (num_nonempty_batches,) tokens per segment
    if means.shape[0] < 3:
        return float("nan")
    x, y = means[:-1] - means[:-1].mean(), means[1:] - means[1:].mean()
    denom = np.sqrt(np.dot(x, x) * np.dot(y, y))
    # Relative floor: a constant sequence leaves rounding noise in x and y, not a correlation.
    if denom <= 1e-12 * max(float(np.dot(means, means)), 1.0):
        return float("nan")
    return float(np.dot(x, y) / denom)


def batch_randomness(plan: BatchPlan, next_plan: BatchPlan) -> dict[str, float]:
    """Measure the randomness of a strategy's batches over two consecutive epochs.

    Args:
        plan: epoch ``e`` of a strategy.
        next_plan: epoch ``e + 1`` of the same strategy, spec and seed on the same lengths.

    Returns:
        ``order_corr``: lag-1 Pearson correlation, along ``plan``, of the mean segment length of
        batch ``t`` and batch ``t + 1``. 0: the length of a batch says nothing about the next one
        (shuffled batches); near 1: lengths drift smoothly, e.g. HF megabatches running long to short;
        negative: long and short batches alternate. NaN with fewer than 3 non-empty batches or when
        every batch has the same mean length.

        ``pair_repeat``: the fraction of neighbouring pairs of ``plan`` (members ``m`` and ``m + 1``
        of one group, distinct examples; O(n) pairs) whose two examples share a group again in
        ``next_plan``. 0: no pair meets again; 1: the same groups every epoch (a deterministic sort or
        packing). Compare it with ``pair_repeat_random``: near it means membership is as random as
        the group sizes allow. An example split into several segments counts in the group of its
        first segment; a pair with an example missing from ``next_plan`` (dropped) counts as apart.
        NaN when ``plan`` has no such pair (one example per group).

        ``pair_repeat_random``: the value ``pair_repeat`` would have if ``next_plan``'s groups were
        filled at random with the same sizes: ``sum_g k_g (k_g - 1) / (N (N - 1))``, ``k_g`` the
        examples whose first segment is in group ``g`` of ``next_plan`` and ``N`` their total. About
        ``batch size / num_examples`` for fixed-size batches; NaN with fewer than 2 examples.

    Raises:
        DataError: the plans are over different numbers of examples.
    """
    if plan.num_examples != next_plan.num_examples:
        raise DataError(
            f"batch_randomness compares two epochs of one dataset; the plans have {plan.num_examples} and "
            f"{next_plan.num_examples} examples: plan both from the same lengths"
        )
    groups = _segment_groups(plan)  # (num_segments,)
    ids = plan.example_ids
    # Neighbours: consecutive segments of one group that are different examples.
    pair = (groups[1:] == groups[:-1]) & (ids[1:] != ids[:-1])  # (num_segments - 1,)
    where = _example_groups(next_plan)  # (num_examples,)
    later = where[ids]  # (num_segments,) group in next_plan of each segment's example
    again = np.count_nonzero(pair & (later[1:] == later[:-1]) & (later[1:] >= 0))
    num_pairs = np.count_nonzero(pair)
    pair_repeat = again / num_pairs if num_pairs else float("nan")

    sizes = np.bincount(where[where >= 0])  # (num_groups_used,) examples per group of next_plan
    total = int(sizes.sum())
    together = float(np.dot(sizes, sizes - 1))  # ordered pairs that share a group
    pair_repeat_random = together / (total * (total - 1)) if total > 1 else float("nan")
    return {
        "order_corr": _order_corr(plan),
        "pair_repeat": float(pair_repeat),
        "pair_repeat_random": float(pair_repeat_random),
    }


def randomness_record(plan: BatchPlan, next_plan: BatchPlan) -> dict[str, float | None]:
    """:func:`batch_randomness` with None where a value is undefined (JSON has no NaN): the fields
    ``analyze`` and bench records carry."""
    return {k: v if math.isfinite(v) else None for k, v in batch_randomness(plan, next_plan).items()}


def _pct(fraction: float) -> str:
    """A percentage with two significant digits below 10 % (random baselines are often well below 1 %)."""
    p = 100 * fraction
    return f"{p:.0f}%" if p >= 9.5 else f"{p:.1f}%" if p >= 0.95 else f"{p:.2f}%"


def pairs_cell(pair_repeat: float | None, pair_repeat_random: float | None, missing: str = "n/a") -> str:
    """The ``pairs again`` table cell: ``41% (r 2.2%)``, the share that meets again and the random
    baseline; ``missing`` where either is undefined."""
    if pair_repeat is None or pair_repeat_random is None:
        return missing
    return f"{_pct(pair_repeat)} (r {_pct(pair_repeat_random)})"


__all__ = ["batch_randomness", "pairs_cell", "randomness_record"]
