"""A batch schedule on a stream: the stream's planned micro-batches grouped into optimizer steps.

A stream has no plan of the whole epoch, so steps are formed as its micro-batches arrive
(:class:`~smart_batching.streaming.StreamingBatchDataset` with ``collate_fn=None`` yields them as lists
of features): a step takes micro-batches until its size is reached and cuts the one that crosses it at
the example boundary closest to the target; the rest of that micro-batch opens the next step. Each
micro-batch is then collated with the strategy's collator::

    stream micro-batches   [a b c d] [e f g h] [i j k l] ...
    step sizes             3, 6, ...
    items                  MicroBatches([a b c]) | MicroBatches([d], [e f g h], [i]) | ...

On several ranks each rank groups its own shard at its share of every step (the schedule's sizes and
thresholds over ``world_size``), so the ranks' shares of a step are within about one example of each
other; the number of micro-batches of a step can differ between ranks, which the Trainer evens out
with empty micro-batches (one all-reduce per step, :class:`StreamMicroBatches`). What was seen counts
from the start of the run across passes; a stream has no epoch total, so its schedule takes counts
(``5M``), not shares (``20%``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from smart_batching.adaptive.realise import per_rank
from smart_batching.adaptive.schedule import BatchSchedule
from smart_batching.adaptive.steps import MicroBatches
from smart_batching.errors import ConfigError


class StreamMicroBatches(MicroBatches):
    """The micro-batches of one step of a stream: other ranks may have more (see the module docstring)."""


def _weight(feature: Any, unit: str) -> int:
    if unit == "examples":
        return 1
    if isinstance(feature, Mapping):
        if feature.get("segment_length") is not None:
            return int(feature["segment_length"])
        return len(feature["input_ids"])
    raise ConfigError("batch_schedule on a stream counts tokens from the examples' input_ids")


class StepStream(IterableDataset):
    """Group a rank's stream of micro-batches (lists of features) into steps (see the module docstring).

    Args:
        batches: This rank's micro-batches, each a list of features, in order.
        schedule: A :class:`~.schedule.BatchSchedule` with its unit and no shares.
        collate_fn: The strategy's collator, applied to each micro-batch.
        world_size: Ranks sharing the stream; each groups its share of every step.

    Attributes:
        seen: Units this rank consumed since the run started (times ``world_size``: the schedule's argument).
        pass_start: ``seen`` when the current pass started (saved with a checkpoint to resume mid-pass).
    """

    def __init__(
        self,
        batches: Iterable[list[Any]],
        schedule: BatchSchedule,
        collate_fn: Callable,
        *,
        world_size: int = 1,
    ) -> None:
        if schedule.unit is None:
            raise ConfigError("batch_schedule: the schedule needs its unit to group a stream")
        if not schedule.is_resolved:
            raise ConfigError(
                f"batch_schedule {schedule}: a streamed dataset has no epoch total to take a share of; give the "
                "thresholds as counts (e.g. 5M) instead of shares (20%)"
            )
        self.batches = batches
        self.schedule = schedule
        self.share = per_rank(schedule, world_size)
        self.world_size = int(world_size)
        self.collate_fn = collate_fn
        self.seen = 0
        self.pass_start = 0

    def set_epoch(self, epoch: int) -> None:
        for target in (self.batches, getattr(self.batches, "dataset", None)):
            if hasattr(target, "set_epoch"):
                target.set_epoch(epoch)
                return

    def resume(self, pass_start: int) -> None:
        """Start the next pass at ``pass_start`` seen (from a checkpoint; the steps of the pass before the
        cursor are regenerated, and skipped, by the Trainer)."""
        self.seen = int(pass_start)

    def _target(self) -> int:
        return int(self.share.size_at(self.seen))

    def __iter__(self) -> Iterator[StreamMicroBatches]:
        unit = self.schedule.unit
        self.pass_start = self.seen
        step: list[list[Any]] = []
        weight = 0  # of the step being formed, this rank
        for feats in self.batches:
            feats = list(feats)
            w = np.array([_weight(f, unit) for f in feats], dtype=np.int64)
            while feats:
                need = self._target() - weight
                csum = np.cumsum(w)
                if csum[-1] < need:
                    step.append(feats)
                    weight += int(csum[-1])
                    break
                # The end closest to the target: after k examples (k >= 1 when the step is empty).
                k = int(np.searchsorted(csum, need, side="left"))  # csum[k] >= need
                below = csum[k - 1] if k > 0 else 0
                take = k if need - below <= csum[k] - need else k + 1
                take = max(take, 0 if step else 1)
                if take:
                    step.append(feats[:take])
                    weight += int(csum[take - 1])
                yield self._emit(step, weight)
                step, weight = [], 0
                feats, w = feats[take:], w[take:]
        if step:
            yield self._emit(step, weight)

    def _emit(self, step: list[list[Any]], weight: int) -> StreamMicroBatches:
        self.seen += weight * self.world_size
        return StreamMicroBatches(self.collate_fn(group) for group in step)


def null_micro_batches(last: MicroBatches) -> StreamMicroBatches:
    """A step that trains nothing, for a rank whose stream ended (every label ``-100``)."""
    from smart_batching.distributed.even_steps import null_batch

    return StreamMicroBatches(null_batch(mb) for mb in last if mb is not None)


__all__ = ["StepStream", "StreamMicroBatches", "null_micro_batches"]
