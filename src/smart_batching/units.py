"""Planning units: what the planner plans, when that is not simply "every example of the dataset".

A dataset row is usually one unit. Two things change that, both decided here, before planning:

* **Empty and fully masked examples are skipped**, as HF and TRL train around them (TRL drops the
  fully masked rows before training): an example with no tokens, or with no target token after its
  first (nothing predicts a first token: :func:`target_tokens`, :func:`targets_per_unit`), gives no
  loss and would only cost a batch slot (or, in a pack, raise in the collator hours into the epoch). They are found from the lengths and the labels at planning time, left out of the
  plan, counted, and named in one warning (:class:`EmptyExamplesWarning`) with their dataset rows.
  ``empty_examples="error"`` refuses them instead (:class:`~smart_batching.errors.DataError`).
* **Rows that are already packed** (TRL's ``packing=True`` writes a ``seq_lengths`` column; packed
  data may carry ``position_ids`` that restart at each document) are split into their documents, and
  the documents are the units. Packing them again as whole rows would let the documents of one row
  attend to each other; planning the documents keeps TRL's boundaries and gives our fill::

      row 0   input_ids  a a a b b | seq_lengths [3, 2]   ->  unit 0 = row 0, tokens [0, 3)
                                                             unit 1 = row 0, tokens [3, 5)
      row 1   input_ids  c c c c   | seq_lengths [4]      ->  unit 2 = row 1, tokens [0, 4)

:class:`PlanUnits` maps the planner's unit index to a dataset key; samplers use it to turn a plan's
batches back into dataset rows (or :class:`~smart_batching.plan.Segment` windows of rows). Everything
is vectorised: a few NumPy passes over the lengths, no Python work per example.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from smart_batching.errors import ConfigError, DataError
from smart_batching.plan import Segment, as_lengths

IGNORE_INDEX = -100
"""The labels' ignore index (a label not trained on, as PyTorch's ``cross_entropy``, HF and TRL use it).
Its one home, torch-free: the collators, the losses, the null batches and every reader of the labels
import it from here."""

EMPTY_POLICIES = ("skip", "error")
"""What to do with empty and fully masked examples: leave them out of the plan (counted and warned
about once), or raise :class:`~smart_batching.errors.DataError`."""

_NAMED_ROWS = 5  # dataset rows a warning or error names


class EmptyExamplesWarning(UserWarning):
    """Some examples have no tokens or no target token; they were left out of the plan."""


@dataclass(frozen=True)
class SkippedCounts:
    """Examples left out of a plan before planning.

    Attributes:
        num_empty: units with no tokens.
        num_masked: units with tokens but no target token (every label ``-100``, an all-zero
            ``completion_mask`` / ``assistant_masks``, or a ``prompt_length`` covering them).
        first_rows: the dataset rows of the first few skipped units, in dataset order.
    """

    num_empty: int = 0
    num_masked: int = 0
    first_rows: tuple[int, ...] = ()

    @property
    def num_skipped(self) -> int:
        return self.num_empty + self.num_masked

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_empty": self.num_empty,
            "num_masked": self.num_masked,
            "first_rows": list(self.first_rows),
        }


@dataclass(frozen=True, eq=False)
class PlanUnits:
    """The units a sampler plans, and the dataset key of each.

    Attributes:
        lengths: (num_units,) tokens of each unit: what the planner sees.
        example: (num_units,) dataset row of each unit.
        start: (num_units,) first token of the unit in its row, or None when every unit is a whole row.
        num_rows: rows of the dataset (units come from these).
        skipped: what was left out before planning.
    """

    lengths: np.ndarray
    example: np.ndarray
    start: np.ndarray | None = None
    num_rows: int = 0
    skipped: SkippedCounts = field(default_factory=SkippedCounts)

    @property
    def num_units(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def identity(self) -> bool:
        """Every row is one unit, in order: plan indices are dataset rows."""
        return self.start is None and self.num_units == self.num_rows

    @property
    def splits_rows(self) -> bool:
        """Units are windows of rows (documents of packed rows): keys must be :class:`Segment`."""
        return self.start is not None

    def keys(
        self, ids: np.ndarray, seg_starts: np.ndarray, seg_lengths: np.ndarray, *, segments: bool
    ) -> list[Any]:
        """Dataset keys of planned units ``ids`` (with the planner's window of each).

        Args:
            ids: (k,) unit indices from a plan.
            seg_starts, seg_lengths: (k,) the window of each unit the plan uses (tokens).
            segments: the plan cut units (truncate/split): return windows even for whole-row units.
        """
        rows = ids if self.identity else self.example[ids]
        if not (segments or self.splits_rows):
            return rows.tolist()
        starts = seg_starts if self.start is None else self.start[ids] + seg_starts
        return [
            Segment(e, s, n)
            for e, s, n in zip(rows.tolist(), starts.tolist(), seg_lengths.tolist(), strict=True)
        ]


def plan_units(
    lengths: Any,
    *,
    masked: np.ndarray | None = None,
    documents: tuple[np.ndarray, np.ndarray] | None = None,
    empty_examples: str = "skip",
    warn: bool = True,
) -> PlanUnits:
    """The units to plan for a dataset with these row ``lengths``.

    Args:
        lengths: (num_rows,) tokens of each dataset row.
        masked: (num_units,) bool, True where a unit has tokens but no target token; None: every unit
            with tokens is trained on. Units are documents when ``documents`` is given, else rows.
        documents: ``(doc_lengths, docs_per_row)`` for rows that hold several documents (packed
            rows): (num_docs,) tokens of each document in dataset order and (num_rows,) documents in
            each row; the documents of a row must add up to its length.
        empty_examples: ``"skip"`` (leave them out, one :class:`EmptyExamplesWarning`) or ``"error"``.
        warn: issue the warning (False where the caller reports the counts itself).

    Raises:
        ConfigError: unknown ``empty_examples`` or documents that do not add up to their rows.
        DataError: ``empty_examples="error"`` and there are empty or fully masked examples.
    """
    if empty_examples not in EMPTY_POLICIES:
        raise ConfigError(f"empty_examples={empty_examples!r} must be one of {', '.join(EMPTY_POLICIES)}")
    row_lengths = as_lengths(lengths)
    num_rows = int(row_lengths.shape[0])
    if documents is None:
        unit_lengths, rows, start = row_lengths, np.arange(num_rows, dtype=np.int64), None
    else:
        unit_lengths, rows, start = _split_documents(row_lengths, *documents)
    if masked is not None:
        masked = np.asarray(masked, dtype=bool)
        if masked.shape != unit_lengths.shape:
            raise ConfigError(
                f"the target mask has {masked.shape[0]} entries but there are {unit_lengths.shape[0]} units"
            )
    empty = unit_lengths == 0  # (num_units,)
    no_target = empty.copy() if masked is None else empty | masked
    # Packed rows without any document are empty rows with no unit to stand for them.
    docless = np.zeros(0, np.int64) if documents is None else np.flatnonzero(np.asarray(documents[1]) == 0)
    if not no_target.any() and not docless.size:
        return PlanUnits(unit_lengths, rows, start, num_rows)
    bad = np.flatnonzero(no_target)  # (num_skipped,)
    num_empty = int(np.count_nonzero(empty)) + int(docless.shape[0])
    named = np.union1d(rows[bad[: 4 * _NAMED_ROWS]], docless[:_NAMED_ROWS])
    skipped = SkippedCounts(
        num_empty=num_empty,
        num_masked=int(bad.shape[0] + docless.shape[0]) - num_empty,
        first_rows=tuple(int(r) for r in named[:_NAMED_ROWS]),
    )
    what = describe_skipped(skipped)
    if empty_examples == "error":
        raise DataError(
            f"{what}: they give no loss. Drop them from the dataset, or set empty_examples='skip' to leave "
            "them out of the plan"
        )
    if warn:
        warnings.warn(
            f"{what}; they give no loss and are left out of the plan (set empty_examples='error' to refuse them)",
            EmptyExamplesWarning,
            stacklevel=3,
        )
    keep = np.flatnonzero(~no_target)
    return PlanUnits(
        unit_lengths[keep], rows[keep], None if start is None else start[keep], num_rows, skipped
    )


MASK_COLUMNS = ("completion_mask", "assistant_masks")
"""Per-token mask columns (TRL's) whose non-zero tokens are the targets, where no ``labels`` are given."""


def target_tokens(
    offsets: np.ndarray,
    *,
    labels: np.ndarray | None = None,
    masks: tuple[np.ndarray, ...] = (),
    prompt_length: np.ndarray | None = None,
) -> np.ndarray:
    """(total,) True at every token a column marks as a target, over rows laid end to end.

    The one rule every reader of the target columns follows (the planner's skip of fully masked
    examples, the loss normalisation's target counts, the streaming batcher): ``labels`` other than
    ``-100`` where labels are given; else the tokens where every mask (``completion_mask``,
    ``assistant_masks``) is non-zero and, with ``prompt_length``, past the row's prompt. Whether a unit's
    first token counts is :func:`targets_per_unit`'s business.

    Args:
        offsets: (num_rows + 1,) int64 row offsets into the flat token arrays.
        labels: (total,) flat labels, or None.
        masks: flat (total,) masks, each non-zero at a target token.
        prompt_length: (num_rows,) tokens of each row's prompt, or None.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    total = int(offsets[-1])
    if labels is not None:
        return np.asarray(labels) != IGNORE_INDEX
    target = np.ones(total, dtype=bool)
    for mask in masks:
        target &= np.asarray(mask) != 0
    if prompt_length is not None:
        row_lengths = np.diff(offsets)
        position = np.arange(total, dtype=np.int64) - np.repeat(offsets[:-1], row_lengths)  # (total,)
        target &= position >= np.repeat(np.asarray(prompt_length, dtype=np.int64), row_lengths)
    return target


def targets_per_unit(target: np.ndarray, unit_lengths: np.ndarray) -> np.ndarray:
    """(num_units,) target tokens of each unit of ``unit_lengths`` consecutive tokens of ``target``, as
    the loss counts them: a unit's first token is never one (nothing in the unit predicts it; the
    collators mask a packed document's first label)."""
    unit_lengths = np.asarray(unit_lengths, dtype=np.int64)
    ends = np.cumsum(unit_lengths)  # (num_units,)
    starts = ends - unit_lengths
    counted = target.astype(bool).copy()
    counted[starts[unit_lengths > 0]] = False
    cumulative = np.concatenate([[0], np.cumsum(counted, dtype=np.int64)])  # (total + 1,)
    return cumulative[ends] - cumulative[starts]


def no_target_token(example: Any) -> bool:
    """One tokenized example (a mapping) has tokens but no target token, by :func:`target_tokens`'s rule
    and :func:`targets_per_unit`'s count (its first token is never a target). Scalar labels
    (classification), and label lists that do not match ``input_ids``, are always a target."""
    ids = example.get("input_ids")
    if ids is None or not len(ids):
        return False
    n = len(ids)
    offsets = np.array([0, n], dtype=np.int64)
    labels = example.get("labels")
    if labels is not None:
        arr = np.asarray(labels)
        if arr.ndim != 1 or arr.shape[0] != n:
            return False
        target = target_tokens(offsets, labels=arr)
    else:
        masks = tuple(np.asarray(example[c]) for c in MASK_COLUMNS if example.get(c) is not None)
        prompt = example.get("prompt_length")
        if any(m.shape[0] != n for m in masks) or not (masks or prompt is not None):
            return False  # masks that do not match (the collator names them), or no column marks targets
        prompt_length = None if prompt is None else np.array([int(prompt)])
        target = target_tokens(offsets, masks=masks, prompt_length=prompt_length)
    return int(targets_per_unit(target, offsets[1:])[0]) == 0


def describe_skipped(skipped: SkippedCounts, where: str = "dataset row") -> str:
    """One phrase for a warning or error: counts by kind and the first rows."""
    parts = []
    if skipped.num_empty:
        parts.append(f"{skipped.num_empty} empty example(s) (no tokens)")
    if skipped.num_masked:
        parts.append(f"{skipped.num_masked} fully masked example(s) (no target token)")
    rows = ", ".join(str(r) for r in skipped.first_rows)
    more = ", ..." if skipped.num_skipped > len(skipped.first_rows) else ""
    return f"{' and '.join(parts)}, first at {where}s {rows}{more}"


def _split_documents(
    row_lengths: np.ndarray, doc_lengths: np.ndarray, docs_per_row: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    doc_lengths = as_lengths(doc_lengths, name="seq_lengths")
    docs_per_row = np.asarray(docs_per_row, dtype=np.int64)
    if docs_per_row.shape != row_lengths.shape or int(docs_per_row.sum()) != doc_lengths.shape[0]:
        raise ConfigError(
            f"documents per row ({docs_per_row.shape[0]} rows, {int(docs_per_row.sum())} documents) do not "
            f"match the dataset ({row_lengths.shape[0]} rows, {doc_lengths.shape[0]} document lengths)"
        )
    rows = np.repeat(np.arange(row_lengths.shape[0], dtype=np.int64), docs_per_row)  # (num_docs,)
    before = np.cumsum(doc_lengths) - doc_lengths  # (num_docs,) tokens before each document, dataset-wide
    row_first = np.cumsum(docs_per_row) - docs_per_row  # (num_rows,) first document of each row
    starts = before - before[row_first[rows]]  # (num_docs,) restart at each row
    sums = np.bincount(rows, weights=doc_lengths, minlength=row_lengths.shape[0]).astype(np.int64)
    wrong = np.flatnonzero(sums != row_lengths)
    if wrong.size:
        r = int(wrong[0])
        raise ConfigError(
            f"row {r} has {int(row_lengths[r])} tokens but its seq_lengths add up to {int(sums[r])} "
            f"({wrong.size} row(s) disagree): the packed rows' document lengths must cover their input_ids"
        )
    return doc_lengths, rows, starts


__all__ = [
    "EMPTY_POLICIES",
    "EmptyExamplesWarning",
    "PlanUnits",
    "SkippedCounts",
    "describe_skipped",
    "no_target_token",
    "plan_units",
    "target_tokens",
    "targets_per_unit",
]
