"""Adaptive batch size: the token budget, the size of each optimizer step, and what to do when a
micro-batch does not fit.

* :mod:`.autotune`: the largest token budget that fits device memory (``max_tokens="auto"``).
* :mod:`.schedule`: :class:`BatchSchedule` (``"linear:16384->131072@20%"``, ``"0:16k 5M:64k 20M:128k"``)
  and :func:`cut_steps`, which cuts a stream of examples into steps that follow it.
* :mod:`.lr`: ``lr_scaling="sqrt" | "linear"``: the learning rate of a step of another size.
* :mod:`.backoff`: :class:`~.backoff.OomBackoff`: split a micro-batch that ran out of memory into
  smaller ones covering the same examples, within the same optimizer step, and keep the lower budget.

Importing this package loads no torch; the functions that need it import it when called.
"""

from __future__ import annotations

from smart_batching.adaptive.autotune import (
    DEFAULT_CANDIDATES,
    accumulation_steps_for,
    costliest_batch_shape,
    find_max_tokens,
)
from smart_batching.adaptive.schedule import BatchSchedule, SchedulePoint, cut_steps, parse_count

__all__ = [
    "DEFAULT_CANDIDATES",
    "BatchSchedule",
    "SchedulePoint",
    "accumulation_steps_for",
    "costliest_batch_shape",
    "cut_steps",
    "find_max_tokens",
    "parse_count",
]
