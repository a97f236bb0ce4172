"""The online planner: :class:`StreamingBatcher` and its :class:`StreamingStats`."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from smart_batching.errors import ConfigError, DataError, OverlongError, SmartBatchingError
from smart_batching.plan import Segment, Segments, lead_with_costliest
from smart_batching.planners import Room, Tuning, make_spec, spec_class, strategy_names
from smart_batching.planners._common import apply_overlong
from smart_batching.planners._rounds import fits
from smart_batching.streaming._buffer import (
    _INF,
    _READ_LENGTHS,
    DEFAULT_MIN_ROW_FILL,
    DEFAULT_RESERVE,
    NO_SEGMENTS,
    STATE_VERSION,
    Emission,
    segments_from_state,
    segments_to_state,
)
from smart_batching.streaming._reader import _is_opener, _Reader
from smart_batching.streaming._stats import _COUNTERS, StreamingStats, _non_negative, _positive_or_none
from smart_batching.units import (
    EMPTY_POLICIES,
    EmptyExamplesWarning,
    SkippedCounts,
    describe_skipped,
    no_target_token,
)

# --- The batcher -------------------------------------------------------------------------------------


_STATE_KEYS = (
    "config",
    "epoch",
    "num_consumed",
    "num_rounds",
    "flushed",
    "done",
    "buffer",
    "ready",
    "counters",
)


class StreamingBatcher:
    """Plan batches over a stream with a bounded buffer; iterate it to get them.

    Example::

        ds = load_dataset("json", data_files=..., split="train", streaming=True).map(tokenize)
        batcher = StreamingBatcher(ds, "packed", capacity=4096, buffer_size=10_000)
        for features in batcher:           # list of example dicts: one packed row per batch
            batch = PackingCollator()(features)

    The costliest batch first (``group_by_length``; ``token_budget`` and ``packed`` with
    ``costliest_first``, the default): the stream is never in view as a whole, so the batch with the
    largest footprint of the *first round* (the first buffer) goes first in each epoch, a swap with
    that round's batch 0. That is enough to fail at step 1 on a budget that cannot fit the data's
    typical longest examples; a rarer, longer one further down the stream still comes when it comes.

    Args:
        source: The stream: an iterable of tokenized examples (mappings with ``input_ids``), of integer
            token lengths, or of 1-D integer arrays of lengths (chunks: the fast path, no Python work
            per example); or a callable ``open(start) -> iterable`` yielding the stream from example
            ``start`` on. It must yield the same items each time it is opened for resuming.
            Examples cost Python work each (reading, ``len``); lengths in arrays cost none.
        spec_or_name: A planner spec (``PackedSpec``, ``TokenBudgetSpec``, ``GroupByLengthSpec``,
            ``RandomSpec``, ``MaxLengthSpec`` with ``max_length``) or its name.
        buffer_size: Most segments (examples, or pieces of split ones) the buffer holds; None means no
            count bound (then ``buffer_tokens`` is needed). One example bigger than the whole bound is
            admitted alone.
        buffer_tokens: Most tokens the buffer holds; None means no token bound.
        seed: Base seed; batches are a pure function of (stream, spec, buffer bounds, seed, epoch).
        epoch: Epoch to start at; :meth:`set_epoch` moves to another one.
        length_fn: Tokens of one example; None means ``len(example["input_ids"])``. With it, every
            item is an example, whatever its type.
        min_row_fill: ``packed`` only: a row is emitted before the stream ends once it holds at least
            this fraction of ``capacity``; None means 0.999.
        reserve: ``packed`` only: a round also keeps back the full rows it packed last (they hold the
            shortest examples, the best gap fillers for the next round) up to this fraction of the
            buffer's examples; None means 0.1. It matters most for short streams, whose last rounds
            pack what is left; each kept example is planned again, so a larger reserve costs more
            rounds (``benchmarks/streaming.py`` measures both).
        progress: Show a tqdm bar with examples read and the running efficiency.
        empty_examples: Examples with no tokens, or (examples only) with no target token (every label
            ``-100``, an all-zero ``completion_mask`` / ``assistant_masks``): ``"skip"`` leaves them out as
            they come, counted in :attr:`stats` (``num_empty``, ``num_masked``) and named in one
            :class:`~smart_batching.units.EmptyExamplesWarning`; ``"error"`` raises
            :class:`~smart_batching.errors.DataError` at the first.
        **options: The spec's fields when ``spec_or_name`` is a name, e.g. ``capacity=4096``.

    Yields:
        One batch at a time: the examples of the batch (row after row) when the source yields
        examples, with ``segment_start``/``segment_length`` added to examples the overlong policy cut
        (the collators in :mod:`smart_batching.collate` slice by them); stream positions (ints) when
        it yields lengths, with :class:`~smart_batching.plan.Segment` keys in place of the
        examples the overlong policy truncated or split (``SegmentDataset`` takes both).
    """

    def __init__(
        self,
        source: Any,
        spec_or_name: Any,
        *,
        buffer_size: int | None = 10_000,
        buffer_tokens: int | None = None,
        seed: int = 0,
        epoch: int = 0,
        length_fn: Callable[[Any], int] | None = None,
        min_row_fill: float | None = None,
        reserve: float | None = None,
        progress: bool = False,
        empty_examples: str = "skip",
        **options: Any,
    ) -> None:
        self.spec = make_spec(spec_or_name, **options)
        if empty_examples not in EMPTY_POLICIES:
            raise ConfigError(f"empty_examples={empty_examples!r} must be one of {', '.join(EMPTY_POLICIES)}")
        self.empty_examples = empty_examples
        if not self.spec.can_stream():
            raise ConfigError(f"strategy {self.spec.name!r} cannot stream: it defines no plan_round")
        self.buffer_size = _positive_or_none("buffer_size", buffer_size)
        self.buffer_tokens = _positive_or_none("buffer_tokens", buffer_tokens)
        if self.buffer_size is None and self.buffer_tokens is None:
            raise ConfigError(
                "give buffer_size= (examples) or buffer_tokens= (tokens): the buffer must be bounded"
            )
        batch_size = getattr(self.spec, "batch_size", None)
        if batch_size is not None and self.buffer_size is not None and self.buffer_size < batch_size:
            raise ConfigError(
                f"buffer_size={self.buffer_size} is smaller than batch_size={batch_size}: raise buffer_size="
            )
        self.spec.check_streamable()
        for name, value in (("min_row_fill", min_row_fill), ("reserve", reserve)):
            if value is not None and not self.spec.packs_rows:
                packing = " or ".join(n for n in strategy_names() if spec_class(n).packs_rows)
                raise ConfigError(
                    f"{name}= applies to {packing} only, not to {self.spec.name!r}; leave it out"
                )
        self.min_row_fill = DEFAULT_MIN_ROW_FILL if min_row_fill is None else float(min_row_fill)
        if not 0.0 <= self.min_row_fill <= 1.0:
            raise ConfigError(f"min_row_fill= must be a fraction in [0, 1], got {min_row_fill!r}")
        self.reserve = DEFAULT_RESERVE if reserve is None else float(reserve)
        if not 0.0 <= self.reserve <= 0.5:
            raise ConfigError(f"reserve= must be a fraction in [0, 0.5] of the buffer, got {reserve!r}")
        self.source = source
        self.seed = _non_negative("seed", seed)
        self.length_fn = length_fn
        self.progress = progress
        self._limit, self._setting = self.spec.token_limit()
        self._policy: str = self.spec.overlong
        self._generation = 0
        self._reset(_non_negative("epoch", epoch))

    # -- state ----------------------------------------------------------------------------------------

    def _reset(self, epoch: int) -> None:
        self._epoch = epoch
        self._consumed = 0  # examples taken from the source into the buffer
        self._rounds = 0
        self._flushed = False  # the stream ended and the last round emitted everything
        self._done = False  # an iterator ran to the end of this epoch: the next one starts the next epoch
        self._buffer = NO_SEGMENTS
        self._buffered_tokens = 0
        self._ready: Emission | None = None  # the last round's batches ...
        self._ready_next = 0  # ... from this one on not yet yielded
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._examples: dict[int, list[Any]] = {}  # stream position -> [example, segments not yet yielded]
        self._reader: _Reader | None = None
        self._pending: tuple[np.ndarray, list[Any] | None] | None = None  # read but not yet taken

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def num_consumed(self) -> int:
        """Examples taken from the source so far in this epoch."""
        return self._consumed

    @property
    def stats(self) -> StreamingStats:
        c = self._counters
        slots = c["token_slots"]
        eff = c["real_tokens"] / slots if slots else 1.0
        return StreamingStats(
            strategy=self.spec.name,
            efficiency=eff,
            padding_ratio=1.0 - eff,
            num_rounds=self._rounds,
            num_buffered=self._buffer.num_segments,
            **c,
        )

    def _config(self) -> dict[str, Any]:
        return {
            "strategy": self.spec.name,
            "spec": repr(self.spec),
            "seed": self.seed,
            "buffer_size": self.buffer_size,
            "buffer_tokens": self.buffer_tokens,
            "min_row_fill": self.min_row_fill,
            "reserve": self.reserve,
        }

    def state_dict(self) -> dict[str, Any]:
        """The cursor after the last batch yielded: JSON-serialisable ints, lists and strings.

        ``{version, config, epoch, num_consumed, num_rounds, flushed, done, buffer, ready, counters}``: the
        settings it was made with, the examples consumed from the source, the buffered segments and
        the emitted segments not yet yielded, as stream positions (see the module docstring).
        """
        em = self._ready
        ready = em.rest(self._ready_next) if em is not None and self._ready_next < em.num_batches else None
        return {
            "version": STATE_VERSION,
            "config": self._config(),
            "epoch": self._epoch,
            "num_consumed": self._consumed,
            "num_rounds": self._rounds,
            "flushed": self._flushed,
            "done": self._done,
            "buffer": segments_to_state(self._buffer),
            "ready": ready,
            "counters": dict(self._counters),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next iteration re-opens the source at the saved position.

        Raises:
            ConfigError: the state was saved with other settings (the message names them).
        """
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ConfigError(f"not a StreamingBatcher state of version {STATE_VERSION}")
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing or not isinstance(state["config"], Mapping):
            raise ConfigError(
                f"a garbled StreamingBatcher state: missing {', '.join(missing) or 'a config mapping'}; "
                "resume from an intact checkpoint, or start the stream without load_state_dict()"
            )
        try:
            self._load(state)
        except SmartBatchingError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"a garbled StreamingBatcher state ({type(exc).__name__}: {exc}); resume from an intact "
                "checkpoint, or start the stream without load_state_dict()"
            ) from exc

    def _load(self, state: Mapping[str, Any]) -> None:
        ours = self._config()
        changed = [
            f"{k}={state['config'].get(k)!r} (now {v!r})"
            for k, v in ours.items()
            if state["config"].get(k) != v
        ]
        if changed:
            raise ConfigError(
                "cannot resume the streaming batcher: the state was saved with "
                + ", ".join(changed)
                + ". Create the batcher with the saved settings."
            )
        self._reset(_non_negative("epoch", state["epoch"]))
        self._consumed = _non_negative("num_consumed", state["num_consumed"])
        self._rounds = _non_negative("num_rounds", state["num_rounds"])
        self._flushed = bool(state["flushed"])
        self._done = bool(state["done"])
        self._buffer = segments_from_state(state["buffer"])
        self._buffered_tokens = int(self._buffer.length.sum())
        if state["ready"] is not None:
            self._ready = Emission.from_state(state["ready"])
        # Counters added later (num_empty, num_masked) read as 0 from older states.
        self._counters.update({k: int(state["counters"].get(k, 0)) for k in _COUNTERS})
        self._generation += 1

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from the stream's beginning; a no-op when it is already the current epoch.

        At the start of each epoch the source's own ``set_epoch`` (HF ``IterableDataset``) is called too.
        """
        epoch = _non_negative("epoch", epoch)
        if epoch != self._epoch:
            self._reset(epoch)
            self._generation += 1

    # -- iteration ------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[list[Any]]:
        self._generation += 1
        if self._done:
            self._reset(self._epoch + 1)
        return self._iterate(self._generation)

    def _iterate(self, generation: int) -> Iterator[list[Any]]:
        if self._reader is None:
            self._open()
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(desc=f"streaming {self.spec.name}", unit="ex", initial=self._consumed)
        try:
            while True:
                em = self._ready
                if em is not None and self._ready_next < em.num_batches:
                    make = self._batch_maker(em)
                    for b in range(self._ready_next, em.num_batches):
                        if generation != self._generation:
                            return
                        self._ready_next = b + 1  # a state taken while the batch is in use counts it
                        yield make(b)
                if generation != self._generation:
                    return
                if self._flushed:
                    self._done = True
                    return
                self._round(self._fill())
                if bar is not None:
                    bar.update(self._consumed - bar.n)
                    bar.set_postfix(efficiency=f"{self.stats.efficiency:.2%}", refresh=False)
        finally:
            if bar is not None:
                bar.close()

    def _open(self) -> None:
        """Open the source at the cursor, re-reading the examples still buffered or queued."""
        if not _is_opener(self.source) and hasattr(self.source, "set_epoch"):
            self.source.set_epoch(self._epoch)
        held = (
            Segments.concat(
                [self._buffer, self._ready.segs.take(slice(self._ready.bounds[self._ready_next], None))]
            )
            if (self._ready is not None)
            else self._buffer
        )
        want, first = np.unique(held.example, return_index=True)  # (num_held,) ascending positions
        want_lengths = held.example_length[first]
        refs = np.bincount(np.searchsorted(want, held.example), minlength=want.shape[0])
        start = int(want[0]) if want.size else self._consumed
        reader = _Reader(self.source, self.length_fn, start)
        self._reader = reader
        self._pending = None
        self._examples = {}
        got = 0
        while reader.pos < self._consumed:
            chunk = reader.read(self._consumed - reader.pos)
            if chunk is None:
                raise DataError(
                    f"the source ended after {reader.pos} examples, but the state was saved after "
                    f"{self._consumed}: it changed, or it cannot be re-read from its start (pass a re-iterable "
                    "source or an open(start) callable)"
                )
            lengths, examples = chunk
            p0 = reader.pos - lengths.shape[0]
            lo, hi = np.searchsorted(want, [p0, reader.pos])
            rel = want[lo:hi] - p0
            if not np.array_equal(lengths[rel], want_lengths[lo:hi]):
                bad = int(rel[np.flatnonzero(lengths[rel] != want_lengths[lo:hi])[0]])
                raise DataError(
                    f"the source changed since the state was saved: the example at stream position {p0 + bad} "
                    f"has {int(lengths[bad])} tokens, the state says {int(want_lengths[lo + np.searchsorted(rel, bad)])}"
                )
            if examples is not None:
                for j, r in zip(range(lo, hi), rel.tolist(), strict=True):
                    self._examples[int(want[j])] = [examples[r], int(refs[j])]
            got += hi - lo
        if got != want.shape[0]:
            raise DataError(
                f"re-read {got} of the {want.shape[0]} buffered examples: the state does not fit this source"
            )

    def _costs(self, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(segments, tokens) each example needs in the buffer under the overlong policy."""
        pieces = np.ones(lens.shape[0], dtype=np.int64)
        limit = self._limit
        if limit is None:
            return pieces, lens
        over = lens > limit
        if not over.any():
            return pieces, lens
        tokens = lens.copy()
        if self._policy == "drop":
            pieces[over] = 0
            tokens[over] = 0
        elif self._policy == "truncate":
            tokens[over] = limit
        elif self._policy == "split":
            pieces[over] = -(-lens[over] // limit)
        return pieces, tokens

    def _fill(self) -> tuple[int, int] | None:
        """Take examples into the buffer until the next one does not fit.

        Returns:
            ``(segments, tokens)`` the next example needs, or None when the stream has ended.
        """
        assert self._reader is not None
        bound_count = self.buffer_size or _INF
        bound_tokens = self.buffer_tokens or _INF
        parts = [self._buffer]
        count = self._buffer.num_segments
        need = None
        while True:
            if self._pending is None:
                self._pending = self._reader.read(
                    max(bound_count - count, 1) if self.buffer_size else _READ_LENGTHS
                )
                if self._pending is None:
                    break
            lens, examples = self._pending
            pieces, tokens = self._costs(lens)
            k = fits(pieces, tokens, Room(bound_count - count, bound_tokens - self._buffered_tokens))
            if k == 0 and count == 0:
                k = 1  # an example bigger than the whole bound enters alone
            if k:
                new = self._ingest(lens[:k], None if examples is None else examples[:k])
                parts.append(new)
                count += new.num_segments
                self._buffered_tokens += int(new.length.sum())
            if k < lens.shape[0]:
                self._pending = (lens[k:], None if examples is None else examples[k:])
                need = (int(pieces[k]), int(tokens[k]))
                break
            self._pending = None
        self._buffer = Segments.concat(parts)
        c = self._counters
        c["max_buffered"] = max(c["max_buffered"], count)
        c["max_buffered_tokens"] = max(c["max_buffered_tokens"], self._buffered_tokens)
        return need

    def _ingest(self, lens: np.ndarray, examples: list[Any] | None) -> Segments:
        """Apply the overlong policy to examples leaving the source; returns their segments."""
        p0 = self._consumed
        limit = self._limit
        if self._policy == "error" and limit is not None and lens.size and int(lens.max()) > limit:
            bad = int(np.flatnonzero(lens > limit)[0])
            raise OverlongError(
                f"the example at stream position {p0 + bad} has {int(lens[bad])} tokens, more than "
                f"{self._setting}={limit}. Raise {self._setting}=, or choose overlong='truncate', 'split' or 'drop'."
            )
        segs, o = apply_overlong(lens, limit, self._policy, self._setting)
        skip = self._no_target(lens, examples, p0)  # (k,) bool or None
        if skip is not None:
            segs = segs.take(~skip[segs.example])
        c = self._counters
        c["num_examples"] += lens.shape[0]
        c["num_over_limit"] += o.num_over_limit
        c["num_truncated"] += o.num_truncated
        c["truncated_tokens"] += o.truncated_tokens
        c["num_split"] += o.num_split
        c["num_dropped"] += o.num_dropped
        c["dropped_tokens"] += o.dropped_tokens
        self._consumed += lens.shape[0]
        if examples is not None:
            refs = np.bincount(segs.example, minlength=lens.shape[0])
            for i in np.flatnonzero(refs).tolist():
                self._examples[p0 + i] = [examples[i], int(refs[i])]
        return Segments(segs.example + p0, segs.start, segs.length, lens[segs.example])

    def _no_target(self, lens: np.ndarray, examples: list[Any] | None, p0: int) -> np.ndarray | None:
        """(k,) True for examples with no tokens or no target token; counted, warned about once, or refused."""
        empty = lens == 0
        masked = np.zeros_like(empty)
        if examples is not None:
            for i, ex in enumerate(examples):
                if not empty[i] and isinstance(ex, Mapping) and no_target_token(ex):
                    masked[i] = True
        if not (empty.any() or masked.any()):
            return None
        c = self._counters
        first = not (c["num_empty"] or c["num_masked"])
        skipped = SkippedCounts(
            num_empty=int(empty.sum()),
            num_masked=int(masked.sum()),
            first_rows=tuple(int(p0 + i) for i in np.flatnonzero(empty | masked)[:5]),
        )
        c["num_empty"] += skipped.num_empty
        c["num_masked"] += skipped.num_masked
        what = describe_skipped(skipped, where="stream position")
        if self.empty_examples == "error":
            raise DataError(f"{what}: they give no loss. Drop them, or set empty_examples='skip'")
        if first:
            warnings.warn(
                f"{what}; they give no loss and are left out as they come (counted in stats.num_empty / "
                "num_masked; set empty_examples='error' to refuse them)",
                EmptyExamplesWarning,
                stacklevel=5,
            )
        return empty | masked

    def _round(self, need: tuple[int, int] | None) -> None:
        """Plan the buffer; emit what is good enough (everything when ``need`` is None: the stream ended)."""
        buf = self._buffer
        room = None
        if need is not None:
            bc, bt = self.buffer_size or _INF, self.buffer_tokens or _INF
            room = Room(max(0, min(bc // 2, bc - need[0])), max(0, min(bt // 2, bt - need[1])))
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, self._epoch, self._rounds]))
        tuning = Tuning(self.min_row_fill, self.reserve)
        cut = self.spec.plan_round(buf.length, rng, room, tuning)
        batches = cut.batches
        if self._rounds == 0 and self.spec.leads_with_costliest():
            # The first round's costliest batch first: the whole stream is never in view, and the
            # first buffer is a fair sample of it, enough to fail at step 1 on a budget that cannot fit.
            batches = lead_with_costliest(self.spec, batches, buf.length)
        self._rounds += 1
        order, laid = batches.laid_out()
        em = Emission(buf if order is None else buf.take(order), laid)
        self._buffer = buf.take(cut.keep)
        self._buffered_tokens = int(self._buffer.length.sum())
        c = self._counters
        if cut.drop.size:
            dropped = buf.take(cut.drop)
            ids = np.unique(dropped.example)
            c["num_dropped"] += ids.shape[0]
            c["dropped_tokens"] += int(dropped.length.sum())
            for pos in ids.tolist():
                self._examples.pop(pos, None)
        c["num_segments"] += em.segs.num_segments
        c["num_batches"] += em.num_batches
        c["num_rows"] += em.num_rows
        c["real_tokens"] += int(em.segs.length.sum())
        c["token_slots"] += int((np.diff(laid.batch_offsets) * laid.width).sum())
        self._ready, self._ready_next = em, 0
        self._flushed = need is None

    def _batch_maker(self, em: Emission) -> Callable[[int], list[Any]]:
        """A function from batch number to what iteration yields for it (see the class docstring)."""
        bounds, ids = em.bounds, em.ids
        if self._reader is not None and self._reader.kind == "examples":
            starts, seg_lengths = em.segs.start.tolist(), em.segs.length.tolist()
            cut = (em.segs.length != em.segs.example_length).tolist()
            store = self._examples

            def examples(b: int) -> list[Any]:
                out = []
                for j in range(bounds[b], bounds[b + 1]):
                    pos = ids[j]
                    entry = store[pos]
                    entry[1] -= 1
                    if entry[1] == 0:
                        del store[pos]
                    ex = entry[0]
                    if cut[j]:
                        if not isinstance(ex, Mapping):
                            raise DataError(
                                f"the example at stream position {pos} was cut by overlong="
                                f"{self._policy!r}, but it is a {type(ex).__name__}, not a mapping that "
                                "can carry segment_start/segment_length; use overlong='drop' or 'error'"
                            )
                        ex = {**ex, "segment_start": starts[j], "segment_length": seg_lengths[j]}
                    out.append(ex)
                return out

            return examples
        cut = np.flatnonzero(em.segs.length != em.segs.example_length)
        if cut.size:
            # Keys of the segments the overlong policy cut; whole examples stay plain positions.
            ids = list(ids)
            segs = em.segs
            for j, e, s, n in zip(
                cut.tolist(),
                segs.example[cut].tolist(),
                segs.start[cut].tolist(),
                segs.length[cut].tolist(),
                strict=True,
            ):
                ids[j] = Segment(e, s, n)
        return lambda b: ids[bounds[b] : bounds[b + 1]]

    def __repr__(self) -> str:
        return (
            f"StreamingBatcher({self.spec!r}, buffer_size={self.buffer_size}, buffer_tokens={self.buffer_tokens}, "
            f"seed={self.seed}, epoch={self._epoch}, num_consumed={self._consumed})"
        )
