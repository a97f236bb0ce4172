"""The torch ``IterableDataset`` of planned batches, sharded over ranks and DataLoader workers."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from smart_batching.distributed import World
from smart_batching.errors import ConfigError
from smart_batching.plan import Segment
from smart_batching.planners import make_spec
from smart_batching.streaming._buffer import _END
from smart_batching.streaming._reader import _is_opener
from smart_batching.streaming._stats import _non_negative
from smart_batching.streaming.batcher import StreamingBatcher

# --- Sharding and the torch dataset ------------------------------------------------------------------


def _strided(it: Iterator[Any], step: int, offset: int) -> Iterator[Any]:
    """Items ``offset, offset + step, ...`` of a stream; chunks of lengths are strided element-wise."""
    first = next(it, _END)
    if first is _END:
        return
    it = itertools.chain([first], it)
    if isinstance(first, np.ndarray):
        skip = offset
        for chunk in it:
            chunk = np.asarray(chunk)
            if skip < chunk.shape[0]:
                yield chunk[skip::step]
            skip = (skip - chunk.shape[0]) % step
        return
    yield from itertools.islice(it, offset, None, step)


class _Strided:
    """A re-iterable (or re-openable) round-robin shard of a source."""

    def __init__(self, source: Any, step: int, offset: int) -> None:
        self.source, self.step, self.offset = source, step, offset

    def __iter__(self) -> Iterator[Any]:
        return _strided(iter(self.source), self.step, self.offset)

    def open(self, start: int) -> Iterator[Any]:
        return _strided(iter(self.source(start * self.step + self.offset)), self.step, 0)


def _is_hf_iterable(obj: Any) -> bool:
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(obj, datasets.IterableDataset)


def _to_global(batch: list[Any], step: int, offset: int) -> list[Any]:
    return [
        Segment(x.example * step + offset, x.start, x.length) if isinstance(x, Segment) else x * step + offset
        for x in batch
    ]


class StreamingBatchDataset(IterableDataset):
    """A torch ``IterableDataset`` of planned batches over a stream, sharded over ranks and workers.

    Use it with ``batch_size=None`` (each item already is a batch)::

        ds = StreamingBatchDataset(hf_stream, "packed", capacity=4096, collate_fn=PackingCollator())
        loader = DataLoader(ds, batch_size=None, num_workers=2)

    Every DataLoader worker of every rank plans its own disjoint shard of the stream with its own
    :class:`StreamingBatcher`, so each example is used exactly once overall:

    * a ``datasets.IterableDataset`` is split across ranks with ``datasets.distributed.split_dataset_by_node``
      (by shards when ``num_shards`` is a multiple of ``world_size``, else by examples); ``datasets``
      then deals its shards to the DataLoader workers itself (workers beyond ``num_shards`` get none);
    * any other source is dealt round-robin: shard ``rank * num_workers + worker`` of
      ``world_size * num_workers`` takes every that-many-th example (each shard reads the whole stream
      and keeps its share; chunks of lengths are strided element-wise). Stream positions in the
      batches of a lengths source are global. So do not pass a source that already splits itself
      by worker or rank (another ``IterableDataset`` that reads ``get_worker_info``): its examples
      would be dealt twice and most of them lost.

    Ranks may get different numbers of batches (their shards differ): wrap each rank's loader in
    :class:`~smart_batching.distributed.even_steps.EvenSteps` to step in lockstep (the Trainer integration does).

    Args:
        source, spec_or_name, buffer_size, buffer_tokens, seed, length_fn, min_row_fill, reserve, progress,
        **options: As :class:`StreamingBatcher` (per worker: the bounds apply to each worker).
        rank: This process's rank; None (with ``world_size=None``) reads it from ``torch.distributed``
            via :meth:`~smart_batching.distributed.World.detect`. Create the dataset after
            ``init_process_group``.
        world_size: Number of ranks; see ``rank``.
        collate_fn: Applied to each batch in the worker (e.g. :class:`~smart_batching.collate.PackingCollator`);
            None yields the batch as a list.
    """

    def __init__(
        self,
        source: Any,
        spec_or_name: Any,
        *,
        buffer_size: int | None = 10_000,
        buffer_tokens: int | None = None,
        seed: int = 0,
        length_fn: Callable[[Any], int] | None = None,
        min_row_fill: float | None = None,
        reserve: float | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        progress: bool = False,
        empty_examples: str = "skip",
        **options: Any,
    ) -> None:
        self.spec = make_spec(spec_or_name, **options)
        if rank is None and world_size is None:
            self.world = World.detect()
        elif rank is None or world_size is None:
            raise ConfigError(
                "pass both rank= and world_size=, or neither (to read them from torch.distributed)"
            )
        else:
            self.world = World(int(rank), int(world_size))
        self.source = source
        self.collate_fn = collate_fn
        self._kwargs: dict[str, Any] = {
            "buffer_size": buffer_size,
            "buffer_tokens": buffer_tokens,
            "seed": seed,
            "length_fn": length_fn,
            "min_row_fill": min_row_fill,
            "reserve": reserve,
            "progress": progress,
            "empty_examples": empty_examples,
        }
        StreamingBatcher([], self.spec, **self._kwargs)  # validate the settings here, not in a worker
        self._epoch = 0
        self._batcher: StreamingBatcher | None = None
        self._shard_key: tuple[int, int, int, int] | None = None
        self._resume: Mapping[str, Any] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Plan epoch ``epoch`` on the next iteration (HF Trainer calls this at each epoch start)."""
        self._epoch = _non_negative("epoch", epoch)

    def _shard(self, worker: int, num_workers: int) -> tuple[Any, int, int]:
        """This worker's source and how its positions map to the stream's: ``global = local * step + offset``."""
        rank, world_size = self.world.rank, self.world.world_size
        if _is_hf_iterable(self.source):
            if world_size == 1:
                return self.source, 1, 0
            from datasets.distributed import split_dataset_by_node

            return split_dataset_by_node(self.source, rank=rank, world_size=world_size), 1, 0
        step, offset = world_size * num_workers, rank * num_workers + worker
        if step == 1:
            return self.source, 1, 0
        strided = _Strided(self.source, step, offset)
        return (strided.open if _is_opener(self.source) else strided), step, offset

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        source, step, offset = self._shard(worker, num_workers)
        batcher = StreamingBatcher(source, self.spec, epoch=self._epoch, **self._kwargs)
        key = (self.world.rank, self.world.world_size, worker, num_workers)
        if self._resume is not None:
            saved = tuple(self._resume["shard"])
            if saved != key:
                raise ConfigError(
                    f"cannot resume: the state was saved by (rank, world_size, worker, num_workers)={saved}, "
                    f"this is {key}; resume with the same number of ranks and DataLoader workers"
                )
            batcher.load_state_dict(self._resume["batcher"])
            self._resume = None
        self._batcher, self._shard_key = batcher, key
        if batcher._done:  # this worker had finished the epoch: the next one starts at set_epoch
            return
        for batch in batcher:
            if step != 1 and batch and not isinstance(batch[0], Mapping):
                batch = _to_global(batch, step, offset)
            yield batch if self.collate_fn is None else self.collate_fn(batch)

    def state_dict(self) -> dict[str, Any]:
        """This worker's cursor (``torchdata``'s ``StatefulDataLoader`` collects one per worker)."""
        if self._batcher is None:
            return {"epoch": self._epoch, "shard": None, "batcher": None}
        return {"epoch": self._epoch, "shard": list(self._shard_key), "batcher": self._batcher.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` on the next iteration."""
        self._epoch = _non_negative("epoch", state["epoch"])
        self._resume = state if state.get("batcher") is not None else None
