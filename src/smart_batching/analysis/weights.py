"""What a plan does to the weight of a token: :func:`token_weights`.

A step's loss is the mean over its own target tokens (HF's ``num_items_in_batch``), and where gradient
clipping binds at every step (norms 15 to 30 against 1.0 in the project's fine-tunes) every step moves
the model by one clipped update whatever it holds: either way a target token weighs about one over its
step's target tokens. A plan whose steps are length strata (``group_by_length``, the tightest packing)
then gives the tokens of short examples more weight than their share; random batches, and rows of mixed
lengths (``packed``'s default), keep every length quarter near its share. ``benchmarks/step_weights.py``
prints it per strategy over seeds; the bench records it per run (``token_weights``).
"""

from __future__ import annotations

import numpy as np

from smart_batching.plan import BatchPlan


def token_weights(plan: BatchPlan, targets: np.ndarray, steps: np.ndarray | None = None) -> list[float]:
    """The weight of a target token per length quarter of the examples (shortest first), over its share,
    with one batch of the plan per optimizer step unless ``steps`` says otherwise. The quarters are by
    rank (equal counts; equal lengths in index order), so ties cannot empty one.

    Args:
        plan: a :class:`~smart_batching.plan.BatchPlan` (its ``lengths`` give the quarters).
        targets: (num_examples,) target tokens of each whole example (its loss-bearing tokens); a segment
            of a split example carries its share of them, in proportion to its tokens.
        steps: (num_segments,) the optimizer step of each segment of the plan, where steps hold several
            batches (gradient accumulation, ranks:
            :meth:`~smart_batching.distributed.DistributedPlan.segment_steps`); None: batch ``k`` is step ``k``.

    Returns:
        Four floats: each quarter's share of the epoch's weight (a token in step ``k`` weighs
        ``1 / targets of step k``) over its share of the target tokens; 1.0 everywhere is uniform per
        token, as one mean over the whole epoch weighs them. A quarter without targets gives nan.
    """
    lengths = np.asarray(plan.lengths, dtype=np.int64)
    targets = np.asarray(targets, dtype=np.float64)
    if targets.shape != lengths.shape:
        raise ValueError(
            f"token_weights: targets has shape {targets.shape}, the plan's lengths {lengths.shape}"
        )
    ids = plan.example_ids
    if ids.shape[0] == 0:
        return [float("nan")] * 4
    if steps is None:
        bounds = plan.batch_bounds
        step = np.repeat(np.arange(bounds.shape[0] - 1), np.diff(bounds))  # (num_segments,) step of each
    else:
        step = np.asarray(steps, dtype=np.int64)
        if step.shape != ids.shape or (step.size and step.min() < 0):
            raise ValueError(
                f"token_weights: steps must give a step >= 0 to each of the {ids.shape[0]} segments"
            )
    seg_targets = targets[ids] * plan.seg_lengths / np.maximum(lengths[ids], 1)
    per_step = np.bincount(step, weights=seg_targets)  # (num_steps,)
    mass = seg_targets / np.maximum(per_step[step], 1.0)  # (num_segments,) weight x targets
    rank = np.empty(lengths.shape[0], dtype=np.int64)
    rank[np.argsort(lengths, kind="stable")] = np.arange(lengths.shape[0])
    quarter = (4 * rank // lengths.shape[0])[ids]  # (num_segments,) 0..3: quarters by rank (ties by index)
    mass_q = np.bincount(quarter, weights=mass, minlength=4)
    targets_q = np.bincount(quarter, weights=seg_targets, minlength=4)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = (mass_q / mass.sum()) / (targets_q / seg_targets.sum())
    return [float(v) for v in share]


__all__ = ["token_weights"]
