"""Equal step counts for per-rank batch streams: ranks advance in lockstep until every stream ends.

Streamed data cannot be planned globally up front: each rank plans its own shard
(:class:`~smart_batching.streaming.StreamingBatchDataset`), and the shards give different numbers of
batches. A rank that stops early would leave the others waiting forever in their next gradient
all-reduce. :class:`EvenSteps` wraps a rank's batch stream and agrees with the other ranks, at every
batch, whether anyone still has data (one all-reduce of one integer)::

    rank 0: b0 b1 b2 b3 b4
    rank 1: b0 b1 b2 N  N      N = a null batch: the shape of the rank's last batch, every label -100

Every real batch is yielded exactly once, every rank yields the same number of batches, and a null
batch adds nothing to the loss or the gradients (its target tokens count zero in a loss normalised
by real tokens, as :class:`~smart_batching.hf.SmartBatchingTrainer` does). A null batch costs one
forward and backward on a rank that would otherwise sit idle in the all-reduce, so the wall time of
the step does not change. ``num_null_batches`` counts them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import IterableDataset

from smart_batching.errors import ConfigError
from smart_batching.units import IGNORE_INDEX


def null_batch(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``batch`` with every label (``labels``, ``shift_labels``) set to ``-100``: no target token."""
    keys = [k for k in ("labels", "shift_labels") if k in batch]
    if not keys:
        raise ConfigError(
            "streamed training on several processes pads the ranks whose stream ended with null batches, which "
            "needs a 'labels' tensor in every batch (a collator that returns labels, such as PaddingCollator or "
            "PackingCollator)"
        )
    out = dict(batch)
    for k in keys:
        out[k] = torch.full_like(batch[k], IGNORE_INDEX)
    return out


def _agree(has_batch: bool, had_any: bool, device: torch.device | None) -> tuple[bool, int]:
    """(does any rank still have a batch, how many ranks never had one): one all-reduce."""
    import torch.distributed as dist

    flags = torch.tensor([int(has_batch), int(not had_any)], dtype=torch.int64, device=device)
    dist.all_reduce(flags)
    return bool(flags[0].item()), int(flags[1].item())


def _collective_device() -> torch.device | None:
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


class EvenSteps(IterableDataset):
    """Iterate ``batches`` in lockstep with the other ranks of the default process group.

    Use it in the main process (``DataLoader(EvenSteps(loader), batch_size=None, num_workers=0)``;
    ``loader`` may have workers of its own), and on every rank: the agreement is a collective call.
    On one process (or without ``torch.distributed``) no collective runs.

    Args:
        batches: This rank's batches (a DataLoader over a
            :class:`~smart_batching.streaming.StreamingBatchDataset`, for example). ``set_epoch`` is
            forwarded to it, or to its ``dataset``.
        multiple: The count of batches is padded with null batches to a multiple of this, so that the
            last optimizer step of a pass gets all its ``gradient_accumulation_steps`` micro-batches
            (a stream's length is unknown, so the Trainer cannot shorten the last step itself).
        make_null: Turns this rank's last batch into one that trains nothing; :func:`null_batch` by default.
    """

    def __init__(
        self, batches: Iterable[Any], *, multiple: int = 1, make_null: Callable[[Any], Any] = null_batch
    ) -> None:
        if int(multiple) < 1:
            raise ConfigError(f"multiple= must be >= 1, got {multiple}")
        self.batches = batches
        self.multiple = int(multiple)
        self.make_null = make_null
        self.num_null_batches = 0

    def set_epoch(self, epoch: int) -> None:
        for target in (self.batches, getattr(self.batches, "dataset", None)):
            if hasattr(target, "set_epoch"):
                target.set_epoch(epoch)
                return

    def __iter__(self) -> Iterator[Any]:
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        device = _collective_device() if distributed else None
        it: Iterator[Any] | None = iter(self.batches)
        last = None
        count = 0
        while True:
            batch = None
            if it is not None:
                try:
                    batch = next(it)
                except StopIteration:
                    it = None
            if batch is not None:
                last = batch
            if distributed:
                anyone, starved = _agree(batch is not None, last is not None, device)
                if anyone and starved:  # every rank raises here, together: nobody waits in a collective
                    raise ConfigError(
                        f"{starved} of the {dist.get_world_size()} processes got no example from the stream "
                        "while others did: the stream has fewer examples (or shards) than processes; use "
                        "fewer processes or more data"
                    )
            else:
                anyone = batch is not None
            if not anyone:
                break
            count += 1
            yield batch if batch is not None else self._null(last)
        # Every rank has the same count here: pad the last accumulation step without talking.
        while count % self.multiple:
            count += 1
            yield self._null(last)

    def _null(self, last: Any) -> Any:
        self.num_null_batches += 1
        return self.make_null(last)


__all__ = ["EvenSteps", "null_batch"]
