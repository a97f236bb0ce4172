"""A torch batch sampler over batch plans, with a resumable cursor.

:class:`SmartBatchSampler` yields, epoch after epoch, the batches of :func:`~smart_batching.planners.plan_batches`
as lists of dataset keys. Pass it to a ``DataLoader`` as ``batch_sampler=``::

    sampler = SmartBatchSampler(lengths, "token_budget", max_tokens=8192, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=PaddingCollator(pad_token_id))

Keys are example indices, unless the plan cuts examples (``overlong="truncate"`` or ``"split"``): then
every key is a :class:`Segment` ``(example, start, length)`` and the dataset must be wrapped in
:class:`SegmentDataset`, which adds ``segment_start``/``segment_length`` to each feature so the collators
slice the example as planned::

    plan segment      example 7, tokens [4096, 6000)
    sampler key       Segment(example=7, start=4096, length=1904)
    SegmentDataset    {**dataset[7], "segment_start": 4096, "segment_length": 1904}
    collator          input_ids[4096:6000]

The sampler's state is a cursor, not a snapshot: ``{version, fingerprint, epoch, batches_yielded}``
plus the parts of the fingerprint, so that loading it can say what changed. The plan is recomputed
from ``(lengths, spec, seed, epoch)`` on load, which costs one planner call (milliseconds for 100k
examples). ``torchdata.stateful_dataloader.StatefulDataLoader`` saves and restores this cursor itself:
it calls ``state_dict()``/``load_state_dict()`` on a batch sampler that has them, at the batch the
loader last returned, not at the batch its workers prefetched.

Epochs: every full pass advances the epoch by one; ``set_epoch(e)`` jumps to the start of epoch ``e``
(and is a no-op when ``e`` is already the current epoch, so a restored cursor survives the
``set_epoch`` call that HF Trainer and accelerate make at the start of each epoch).

The sampler has no ``batch_size`` attribute on purpose: accelerate's ``BatchSamplerShard`` treats a
batch sampler with a ``batch_size`` as fixed-size and silently drops every round that holds a smaller
batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset, Sampler

from smart_batching.errors import ConfigError
from smart_batching.plan import BatchPlan, Segment, as_lengths
from smart_batching.planners import make_spec, plan_batches
from smart_batching.units import PlanUnits, plan_units

STATE_VERSION = 1


class SegmentDataset(Dataset):
    """Wrap a map-style dataset so that :class:`Segment` keys fetch the planned window of an example.

    An integer key returns ``dataset[key]`` unchanged. A :class:`Segment` key returns a copy of
    ``dataset[key.example]`` with ``segment_start`` and ``segment_length`` (tokens) added, which
    :class:`~smart_batching.collate.PaddingCollator` and :class:`~smart_batching.collate.PackingCollator`
    use to slice every per-token field. The wrapper holds no plan, so it never goes stale across
    epochs and is cheap to send to ``DataLoader`` workers.

    Args:
        dataset: A map-style dataset of mappings (e.g. a ``datasets.Dataset``); batched fetches go
            through its ``__getitems__`` when it has one.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: int | Segment) -> Any:
        if isinstance(key, Segment):
            return _with_window(self.dataset[key.example], key)
        return self.dataset[key]

    def __getitems__(self, keys: Sequence[int | Segment]) -> list[Any]:
        ids = [k.example if isinstance(k, Segment) else int(k) for k in keys]
        getitems = getattr(self.dataset, "__getitems__", None)
        rows = getitems(ids) if getitems is not None else [self.dataset[i] for i in ids]
        return [
            _with_window(row, k) if isinstance(k, Segment) else row for row, k in zip(rows, keys, strict=True)
        ]


def _with_window(row: Mapping[str, Any], seg: Segment) -> dict[str, Any]:
    out = dict(row)
    out["segment_start"] = seg.start
    out["segment_length"] = seg.length
    return out


def iterate_epoch(
    owner: Any, num_batches: int, keys_at: Callable[[int], Any], start: int, generation: int
) -> Iterator[Any]:
    """The rest of an epoch from batch ``start``: ``keys_at(b)`` for each batch, moving ``owner``'s cursor
    (``_batches_yielded``, then ``_epoch`` at the end) only while ``generation`` is its newest
    (``_generation``: bumped by ``iter``, ``set_epoch`` and ``load_state_dict``, so an abandoned
    iterator moves nothing). The samplers' one cursor loop (this module's, the distributed and the
    step samplers')."""
    for b in range(start, num_batches):
        keys = keys_at(b)
        if generation == owner._generation:
            # Move the cursor before handing the batch out: a state_dict taken while the batch is in
            # use counts it as yielded (what StatefulDataLoader expects).
            owner._batches_yielded = b + 1
        yield keys
    if generation == owner._generation:
        owner._epoch += 1
        owner._batches_yielded = 0


class SmartBatchSampler(Sampler[list[int]]):
    """Yield the batches of a plan, one epoch after another, as lists of dataset keys.

    Args:
        lengths: (num_examples,) token lengths of the dataset, in dataset order.
        spec_or_name: A planner spec (e.g. ``PackedSpec(capacity=4096)``) or a strategy name.
        seed: Base seed; epoch ``e`` uses the plan of ``(lengths, spec, seed, e)``.
        epoch: The epoch to start at.
        units: What to plan when it is not every row (:func:`~smart_batching.units.plan_units`: fully
            masked examples left out, packed rows split into their documents); None plans every row
            with tokens.
        empty_examples: Examples with no tokens (``lengths`` 0): ``"skip"`` leaves them out of the plan
            with one :class:`~smart_batching.units.EmptyExamplesWarning` naming their rows, ``"error"``
            raises :class:`~smart_batching.errors.DataError`. Ignored when ``units`` is given.
        **options: The spec's fields when ``spec_or_name`` is a name, e.g. ``max_tokens=8192``.

    Attributes:
        yields_segments: True when the plan cuts examples (truncate/split) or plans windows of rows
            (documents of packed rows); keys are then :class:`Segment` and the dataset must be wrapped
            in :class:`SegmentDataset`.
        units: The planned units (:class:`~smart_batching.units.PlanUnits`); ``units.skipped`` counts
            the examples left out. Plans index units, which are dataset rows unless rows were skipped
            or split.

    ``len(sampler)`` is the number of batches of the current epoch (all of them, also after a resume
    mid-epoch). Iterating starts at the cursor; see the module docstring for the epoch rules.
    """

    def __init__(
        self,
        lengths: Any,
        spec_or_name: Any,
        *,
        seed: int = 0,
        epoch: int = 0,
        units: PlanUnits | None = None,
        empty_examples: str = "skip",
        **options: Any,
    ) -> None:
        self.spec = make_spec(spec_or_name, **options)
        if units is None:
            units = plan_units(lengths, empty_examples=empty_examples)
        elif units.num_rows != as_lengths(lengths).shape[0]:
            raise ConfigError(
                f"units= were made for {units.num_rows} rows but lengths= has {as_lengths(lengths).shape[0]}"
            )
        self.units = units
        self.lengths = units.lengths  # what the planner plans: (num_units,)
        self.seed = _non_negative("seed", seed)
        self._epoch = _non_negative("epoch", epoch)
        self._batches_yielded = 0
        self._generation = 0  # bumped by iter/set_epoch/load: only the newest iterator moves the cursor
        self._plan: BatchPlan | None = None
        plan = self._current_plan()
        self.fingerprint = plan.fingerprint
        self.lengths_fingerprint = plan.lengths_fingerprint
        self.yields_segments = bool(
            plan.overlong.num_truncated or plan.overlong.num_split or units.splits_rows
        )

    # -- plans ------------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    @property
    def batches_yielded(self) -> int:
        """Batches of the current epoch handed out so far (by the newest iterator)."""
        return self._batches_yielded

    @property
    def num_examples(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def strategy(self) -> str:
        return self.spec.name

    @property
    def plan(self) -> BatchPlan:
        """The plan of the current epoch."""
        return self._current_plan()

    def plan_for_epoch(self, epoch: int) -> BatchPlan:
        """The plan of any epoch (recomputed unless it is the cached one)."""
        if self._plan is not None and self._plan.epoch == epoch:
            return self._plan
        return plan_batches(self.lengths, self.spec, seed=self.seed, epoch=epoch)

    def _current_plan(self) -> BatchPlan:
        if self._plan is None or self._plan.epoch != self._epoch:
            self._plan = plan_batches(self.lengths, self.spec, seed=self.seed, epoch=self._epoch)
        return self._plan

    def batch_keys(self, plan: BatchPlan, b: int) -> list[Any]:
        """Dataset keys of batch ``b`` of ``plan``: ints, or :class:`Segment` when ``yields_segments``."""
        lo, hi = plan.segment_range(b)
        return self.keys_of(plan, np.arange(lo, hi))

    def keys_of(self, plan: BatchPlan, segs: np.ndarray) -> list[Any]:
        """Dataset keys of segments ``segs`` (positions in ``plan``), mapped through :attr:`units`."""
        ids = plan.example_ids[segs]
        if self.units.identity and not self.yields_segments:
            return ids.tolist()
        return self.units.keys(
            ids, plan.seg_starts[segs], plan.seg_lengths[segs], segments=self.yields_segments
        )

    # -- torch sampler protocol -----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._current_plan())

    def __iter__(self) -> Iterator[list[Any]]:
        self._generation += 1
        return self._iterate(self._current_plan(), self._batches_yielded, self._generation)

    def _iterate(self, plan: BatchPlan, start: int, generation: int) -> Iterator[list[Any]]:
        yield from iterate_epoch(self, len(plan), lambda b: self.batch_keys(plan, b), start, generation)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` at its first batch; a no-op when it is already the current epoch."""
        epoch = _non_negative("epoch", epoch)
        if epoch != self._epoch:
            self._epoch = epoch
            self._batches_yielded = 0
            self._generation += 1

    # -- state --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The cursor: ``{version, fingerprint, epoch, batches_yielded}`` plus what the fingerprint covers.

        All values are JSON-serialisable (ints and strings).
        """
        return {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint,
            "epoch": self._epoch,
            "batches_yielded": self._batches_yielded,
            "num_examples": self.num_examples,
            "lengths_fingerprint": self.lengths_fingerprint,
            "strategy": self.spec.name,
            "spec": repr(self.spec),
            "seed": self.seed,
        }

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Refuse a cursor saved for other data, another strategy or seed, or past the end of its epoch.

        Raises:
            ConfigError: the message names what changed.
        """
        check_state_fields(state, STATE_FIELDS, "SmartBatchSampler")
        version = state["version"]
        if version != STATE_VERSION:
            raise ConfigError(
                f"sampler state version {version!r} is not supported (this version reads {STATE_VERSION})"
            )
        changes = []
        saved_n, saved_lfp = state.get("num_examples"), state.get("lengths_fingerprint")
        if saved_lfp is not None and saved_lfp != self.lengths_fingerprint:
            changes.append(
                f"the dataset changed (saved: {saved_n} examples, lengths digest {saved_lfp}; now: "
                f"{self.num_examples} examples, lengths digest {self.lengths_fingerprint})"
            )
        if state.get("strategy") is not None and state["strategy"] != self.spec.name:
            changes.append(f"the strategy changed (saved {state['strategy']!r}, now {self.spec.name!r})")
        elif state.get("spec") is not None and state["spec"] != repr(self.spec):
            changes.append(f"the strategy options changed (saved {state['spec']}, now {self.spec!r})")
        if state.get("seed") is not None and int(state["seed"]) != self.seed:
            changes.append(f"the seed changed (saved seed={state['seed']}, now seed={self.seed})")
        if not changes and state["fingerprint"] != self.fingerprint:
            changes.append(
                f"the plan fingerprint changed (saved {state['fingerprint']}, now {self.fingerprint}): the "
                "lengths, strategy, its options, the seed or the planner version differ"
            )
        if changes:
            raise ConfigError(
                "cannot resume the batch sampler: "
                + "; ".join(changes)
                + ". Resume with the same dataset, strategy, options and seed, or start without load_state_dict()."
            )
        epoch = _non_negative("epoch", state.get("epoch"))
        done = _non_negative("batches_yielded", state.get("batches_yielded"))
        num_batches = len(self.plan_for_epoch(epoch))
        if done > num_batches:
            raise ConfigError(
                f"sampler state says {done} batches of epoch {epoch} were yielded, but that epoch has {num_batches}"
            )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Recompute the plan of the saved epoch and put the cursor after its saved batch.

        Raises:
            ConfigError: the state belongs to other data, another strategy or seed (see :meth:`check_state_dict`).
        """
        self.check_state_dict(state)
        self._epoch = int(state["epoch"])
        self._batches_yielded = int(state["batches_yielded"])
        self._generation += 1
        self._current_plan()

    def __repr__(self) -> str:
        return (
            f"SmartBatchSampler({self.spec!r}, num_examples={self.num_examples}, seed={self.seed}, "
            f"epoch={self._epoch}, batches_yielded={self._batches_yielded})"
        )


# Field -> (kind, required) of a sampler state: "count" is an int >= 0, "positive" an int >= 1, "text" a
# str; "?" accepts None too.
STATE_FIELDS: dict[str, tuple[str, bool]] = {
    "version": ("count", True),
    "fingerprint": ("text", True),
    "epoch": ("count", True),
    "batches_yielded": ("count", True),
    "num_examples": ("count?", False),
    "lengths_fingerprint": ("text?", False),
    "strategy": ("text?", False),
    "spec": ("text?", False),
    "seed": ("count?", False),
}
_KINDS = {"count": "a non-negative integer", "positive": "a positive integer", "text": "a string"}


def check_state_fields(state: Any, fields: Mapping[str, tuple[str, bool]], owner: str) -> None:
    """Refuse a state that is not a mapping, lacks a required field or holds a field of the wrong type,
    with a :class:`ConfigError` that names the field (rather than the ``ValueError`` or ``KeyError`` of
    reading it).

    Args:
        state: what :meth:`load_state_dict` was given.
        fields: name -> ``(kind, required)``; kinds ``"count"`` (int >= 0), ``"positive"`` (int >= 1),
            ``"text"`` (str), each with a ``"?"`` suffix where None is allowed too.
        owner: the class the state is for, in the message.
    """
    if not isinstance(state, Mapping):
        raise ConfigError(f"not a {owner} state (a dict from state_dict()): {state!r}")
    for name, (kind, required) in fields.items():
        if name not in state:
            if required:
                raise ConfigError(
                    f"cannot resume the {owner}: its state has no {name!r} field (it has "
                    f"{', '.join(map(repr, state)) or 'none'}); pass the dict state_dict() returned"
                )
            continue
        value = state[name]
        base = kind.rstrip("?")
        if value is None and kind.endswith("?"):
            continue
        if base == "text":
            ok = isinstance(value, str)
        else:
            ok = not isinstance(value, bool) and isinstance(value, (int, np.integer))
            ok = ok and value >= (1 if base == "positive" else 0)
        if not ok:
            what = _KINDS[base] + (" or None" if kind.endswith("?") else "")
            raise ConfigError(f"cannot resume the {owner}: its state's {name}= must be {what}, got {value!r}")


def _non_negative(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ConfigError(f"{name}= must be a non-negative integer, got {value!r}")
    return int(value)


__all__ = ["STATE_VERSION", "Segment", "SegmentDataset", "SmartBatchSampler", "check_state_fields"]
