"""``max_length``: "Longest Sequence" padding: shuffled fixed-size batches, every row padded to one length.

The other common baseline (``padding="max_length"`` in a tokenizer call). The padded width is
``max_length`` when given, else the longest example of the dataset. O(n).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from smart_batching.errors import ConfigError
from smart_batching.planners._common import PlanParts, permutation
from smart_batching.planners._rounds import fixed_size_round
from smart_batching.planners._spec import Cut, Knobs, PlannerSpec, Room, Tuning
from smart_batching.planners.random import plan_random


@dataclass(frozen=True, kw_only=True)
class MaxLengthSpec(PlannerSpec):
    """Shuffled fixed-size batches, every row padded to the same length.

    Attributes:
        batch_size: examples per batch.
        max_length: padded length in tokens; None means the longest example of the dataset.
        drop_last: leave out the last incomplete batch (its examples are counted as dropped).
        overlong: ``"error"``, ``"truncate"``, ``"split"`` or ``"drop"`` for examples over ``max_length``.
    """

    name: ClassVar[str] = "max_length"
    description: ClassVar[str] = "shuffle, fixed batch size, pad every row to one length (baseline)"
    batch_size: int = 8
    max_length: int | None = None
    drop_last: bool = False
    overlong: str = "error"

    def __post_init__(self) -> None:
        self._check_positive("batch_size", self.batch_size)
        self._check_positive("max_length", self.max_length, allow_none=True)
        self._check_overlong(self.overlong)

    @classmethod
    def options_from(cls, knobs: Knobs) -> dict[str, Any]:
        # Pad to the longest example, or to the limit when some are longer (then they follow `overlong`).
        widths = [w for w in (knobs.max_length, knobs.longest) if w is not None]
        options = knobs.given(batch_size="batch_size", overlong="overlong")
        if widths:
            options["max_length"] = max(1, min(widths))
        return options

    @classmethod
    def example_options(cls, longest: int) -> dict[str, dict[str, Any]]:
        return {"": {"batch_size": 8, "max_length": longest}, "longest": {"batch_size": 3}}

    def fixed_width(self, longest: int) -> int | None:
        return self.max_length if self.max_length is not None else longest

    def check_streamable(self) -> None:
        if self.max_length is None:
            raise ConfigError(
                "max_length streaming needs max_length=: a stream's longest example is unknown until its end"
            )

    def plan_round(
        self, lens: np.ndarray, rng: np.random.Generator, room: Room | None, tuning: Tuning
    ) -> Cut:
        order = permutation(lens.shape[0], rng)
        return fixed_size_round(
            lens, order, rng, room, batch_size=self.batch_size, drop_last=self.drop_last,
            shuffle_batches=False, width=self.max_length,
        )  # fmt: skip


def plan_max_length(lengths: np.ndarray, spec: MaxLengthSpec, rng: np.random.Generator) -> PlanParts:
    # The same shuffled batches as ``random``; only the padded width differs.
    parts = plan_random(lengths, spec, rng)  # type: ignore[arg-type]  (same fields)
    # Without max_length no example is cut: the width is the longest of them all (dropped ones too).
    width = spec.max_length if spec.max_length is not None else int(lengths.max()) if lengths.size else 0
    batches = parts.batches
    return parts._replace(batches=batches._replace(width=np.full(batches.num_batches, width, dtype=np.int64)))
