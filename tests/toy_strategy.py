"""A toy strategy, outside the package: what a new strategy needs (a spec, a planner, one ``register``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from smart_batching.planners import Knobs, PlannerSpec
from smart_batching.planners._common import apply_overlong, fixed_offsets, padded_parts
from smart_batching.planners._rounds import fixed_size_round


@dataclass(frozen=True, kw_only=True)
class LongestFirstSpec(PlannerSpec):
    """Shuffled fixed-size batches, the batch with the longest examples first (a toy).

    Attributes:
        batch_size: examples per batch.
        max_length: most tokens per example; None means no limit.
        overlong: what happens to longer ones.
    """

    name: ClassVar[str] = "toy_longest_first"
    description: ClassVar[str] = "shuffled fixed-size batches, longest batch first (a toy)"
    batch_size: int = 4
    max_length: int | None = None
    overlong: str = "error"

    @classmethod
    def options_from(cls, knobs: Knobs) -> dict[str, Any]:
        return knobs.given(batch_size="batch_size", max_length="max_length", overlong="overlong")

    def plan_round(self, lens, rng, room, tuning):
        order = rng.permutation(lens.shape[0])
        return fixed_size_round(
            lens, order, rng, room, batch_size=self.batch_size, drop_last=False, shuffle_batches=False
        )


def plan_longest_first(lengths: np.ndarray, spec: LongestFirstSpec, rng: np.random.Generator):
    segments, counts = apply_overlong(lengths, spec.max_length, spec.overlong, "max_length")
    order = rng.permutation(segments.num_segments)
    offsets = fixed_offsets(order.shape[0], spec.batch_size, drop_last=False)
    parts = padded_parts(segments, counts, order, offsets)
    # Batches by their longest example, descending: left for plan_batches to lay out.
    return parts._replace(
        batches=parts.batches._replace(batch_order=np.argsort(-parts.batches.width, kind="stable"))
    )
