"""Adaptive batch size: a schedule of tokens (or examples) per optimizer step, the learning-rate
coupling that goes with it, and out-of-memory back-off that keeps the step.

* :mod:`.schedule`: :class:`BatchSchedule` (``"linear:16384->131072@20%"``, ``"0:16k 5M:64k 20M:128k"``)
  and :func:`cut_steps`, which cuts a stream of examples into steps that follow it.
* :mod:`.lr`: ``lr_scaling="sqrt" | "linear"``: the learning rate of a step of another size.
* :mod:`.backoff`: :class:`OomBackoff`: split a micro-batch that ran out of memory into smaller ones
  covering the same examples, within the same optimizer step, and keep the lower budget.

Importing this package costs NumPy only (torch is imported by the functions that use it).
"""

from __future__ import annotations

from smart_batching.adaptive.schedule import BatchSchedule, SchedulePoint, cut_steps, parse_count

__all__ = ["BatchSchedule", "SchedulePoint", "cut_steps", "parse_count"]
