"""One optimizer step's micro-batches as one DataLoader item.

With a batch schedule the number of micro-batches changes from step to step, while the Trainer's loop
takes a fixed ``gradient_accumulation_steps`` items per step. So each item is a whole step:
the sampler yields a step's micro-batches as a list of key lists, :class:`StepDataset` fetches them in
one call, and :class:`StepCollator` collates each micro-batch with the strategy's collator into a
:class:`MicroBatches` (a list, which accelerate moves to the device like any list of batches). The
Trainer integration runs its micro-batches one after the other within the optimizer step::

    sampler item      [[3, 9], [4], [1, 7, 8]]            one step, three micro-batches
    StepDataset       [[f3, f9], [f4], [f1, f7, f8]]       features
    StepCollator      MicroBatches([batch, batch, batch])

The sampler is :class:`~smart_batching.adaptive.sampler.StepBatchSampler`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class MicroBatches(list):
    """The collated micro-batches of one optimizer step, in the order they run."""


class StepDataset:
    """Wrap a map-style dataset so that a key that is a list of key lists fetches them all at once.

    Args:
        dataset: A map-style dataset (batched fetches go through its ``__getitems__`` when it has one).
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Any) -> Any:
        return self.dataset[key]

    def __getitems__(self, groups: Sequence[Sequence[Any]]) -> list[list[Any]]:
        flat = [k for group in groups for k in group]
        getitems = getattr(self.dataset, "__getitems__", None)
        rows = getitems(flat) if getitems is not None else [self.dataset[k] for k in flat]
        out, at = [], 0
        for group in groups:
            out.append(list(rows[at : at + len(group)]))
            at += len(group)
        return out


class StepCollator:
    """Collate each micro-batch of a step with ``inner`` (the strategy's collator); an empty one (a rank
    with fewer examples than the step's micro-batches) is None."""

    def __init__(self, inner: Callable[[Sequence[Any]], Any]) -> None:
        self.inner = inner

    def __call__(self, groups: Sequence[Sequence[Any]]) -> MicroBatches:
        return MicroBatches(self.inner(group) if len(group) else None for group in groups)


__all__ = ["MicroBatches", "StepCollator", "StepDataset"]
