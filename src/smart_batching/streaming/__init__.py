"""Smart batching for streamed datasets: an online planner over a bounded buffer.

A streamed dataset (``datasets.load_dataset(..., streaming=True)``, a generator) has no length array up
front, so the map-style planners cannot see it whole. :class:`StreamingBatcher` reads it into a bounded
buffer and, whenever the next example does not fit, plans the buffer with the same specs and compiled
kernels as :func:`~smart_batching.planners.plan_batches` (a *round*), emits the batches that are good
enough and keeps the rest to combine with new arrivals::

    source ──► buffer: ≤ buffer_size segments, ≤ buffer_tokens tokens ──► round: plan the buffer
                  ▲                                                          │
                  └────────── kept: what could still get better ◄────────────┤
                                                                             ▼
                                                         emitted batches, in plan order

What a round keeps (at the end of the stream everything left is planned and emitted):

===================  ===========================================================================
``packed``           the examples of rows filled below ``min_row_fill`` x capacity (emptiest first),
                     and the full rows packed last (short examples, to fill the next round's gaps)
                     up to ``reserve`` x the buffer
``token_budget``     the batch of the longest examples, while one more example would still fit it
``group_by_length``  the last incomplete batch (fewer than ``batch_size`` examples)
``random``           the last incomplete batch
``max_length``       the last incomplete batch (needs ``max_length=``)
===================  ===========================================================================

Kept examples hold at most half the bound (the fullest of the rows that could stay are emitted
otherwise), so every round admits at least half a buffer of new examples: planning is O(buffer) per
half buffer, O(n) over the stream, and memory is O(buffer) whatever the stream's length. Each example
is used exactly once: in one batch, or (``overlong="drop"``, ``drop_last``) counted as dropped.
Overlong examples follow the spec's policy as they enter the buffer; a split example's pieces are
separate segments (the buffer bound counts segments).

Rounds are deterministic: round ``k`` of epoch ``e`` draws from ``SeedSequence([seed, e, k])``.

Resuming. :meth:`StreamingBatcher.state_dict` stores a cursor, not the examples: the number of examples
consumed from the source, the round counter, and the buffered and emitted-but-unyielded segments as
(stream position, start, length) triples. :meth:`~StreamingBatcher.load_state_dict` re-opens the
source and skips to the saved position, re-reading the examples still buffered on the way (their
lengths are checked against the state, which catches a changed source). So the source must yield the
same examples in the same order each time it is iterated (a list, a ``datasets`` dataset or
``IterableDataset``), or be a callable ``open(start) -> iterable`` that yields the stream from
position ``start`` on (seekable sources: resuming then reads only from the oldest buffered example).
Storing positions instead of examples keeps the state a few ints per buffered segment and JSON- and
``torch.load(weights_only=True)``-safe; the price is re-reading the consumed prefix on resume.

``benchmarks/streaming.py`` compares the stream's fill with the global plan's and with TRL's BFD over
map batches, on GSM8K, LIMA, SGD and SST-2, and measures its throughput.

Modules: ``_buffer`` (the buffered segments, the emitted batches and their state dicts), ``_reader``
(reading the source in chunks), ``_stats`` (:class:`StreamingStats`), ``batcher``
(:class:`StreamingBatcher`: rounds, resuming), ``dataset`` (:class:`StreamingBatchDataset`, sharded over
ranks and DataLoader workers). What a round keeps and emits is each strategy's
(``PlannerSpec.plan_round``, with the pieces in :mod:`smart_batching.planners._rounds`).
"""

from smart_batching.streaming._buffer import STATE_VERSION
from smart_batching.streaming.batcher import StreamingBatcher, StreamingStats
from smart_batching.streaming.dataset import StreamingBatchDataset

__all__ = ["STATE_VERSION", "StreamingBatchDataset", "StreamingBatcher", "StreamingStats"]
