"""Data for the HF integration: token lengths from Arrow offsets, the columns the collators read, the
collator of a strategy, and a planned DataLoader for plain PyTorch / accelerate loops."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from smart_batching.data.lengths import dataset_target_tokens, lengths_from_dataset, list_column
from smart_batching.fallbacks import warn_fallback
from smart_batching.plan import as_lengths
from smart_batching.planners import DEFAULT_STRATEGY, make_spec, spec_class
from smart_batching.sampler import SegmentDataset, SmartBatchSampler
from smart_batching.units import MASK_COLUMNS as TARGET_MASK_COLUMNS
from smart_batching.units import PlanUnits, plan_units, targets_per_unit

# Columns the collators read; everything else (text, messages, ...) is left out of the fetch.
MODEL_INPUT_COLUMNS = (
    "input_ids",
    "labels",
    "completion_mask",
    "assistant_masks",
    "prompt_length",
    "token_type_ids",
    "seq_lengths",
    "position_ids",
)

MASK_COLUMNS = ("prompt_length", *TARGET_MASK_COLUMNS)
"""Columns that say which tokens are targets: a collator that never sees them trains on every token."""


def warn_dropped_mask_columns(dataset: Any, given: Any) -> list[str]:
    """Warn once (``trainer.mask_columns``) where the columns marking the prompt (:data:`MASK_COLUMNS`)
    are in ``dataset`` but not in ``given``, the dataset handed to the caller's own ``data_collator``
    after HF's ``remove_unused_columns`` rule (it keeps only the model's forward arguments): a collator
    that reads them to mask the prompt would then silently train on every token. Returns the dropped
    columns (none where the collator sees them, e.g. TRL's trainers, which keep their own)."""
    before, after = getattr(dataset, "column_names", None), getattr(given, "column_names", None)
    if before is None or after is None:
        return []
    dropped = [c for c in MASK_COLUMNS if c in before and c not in after]
    if dropped:
        warn_fallback(
            "trainer.mask_columns",
            f"remove_unused_columns=True drops the train dataset's {', '.join(dropped)} column before your "
            "data_collator sees it (HF's rule keeps only the model's forward arguments), so a collator that "
            "reads it to mask the prompt trains on every token. Pass TrainingArguments("
            "remove_unused_columns=False) if your collator reads it, or leave data_collator unset (smart "
            "batching's collators get the columns they read).",
            stacklevel=4,
        )
    return dropped


def dataset_lengths(
    dataset: Any, *, length_column: str | None = "length", input_column: str = "input_ids"
) -> np.ndarray:
    """Token length of every example, in dataset order: ``(num_examples,)`` int64.

    A ``datasets.Dataset`` is read column-wise by :func:`smart_batching.data.lengths.lengths_from_dataset`:
    its ``length_column`` when it has one, else the list lengths of ``input_column`` from the Arrow
    offsets (no Python work per row; a ``select``/``shuffle`` index mapping is honoured). Any other
    map-style dataset is read row by row (slow on big data: pass ``lengths=`` instead).

    Raises:
        DataError: the column is missing or holds no token counts.
    """
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets ships with the hf extra
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        columns = dataset.column_names
        column = length_column if length_column and length_column in columns else input_column
        return lengths_from_dataset(dataset, column)
    n = len(dataset)
    return np.fromiter((len(dataset[i][input_column]) for i in range(n)), dtype=np.int64, count=n)


def checked_lengths(dataset: Any, lengths: Any, length_column: str | None) -> np.ndarray:
    """The lengths to plan ``dataset`` with: ``lengths`` when given, else its ``length_column``, else
    its ``input_ids``; given or column lengths are checked against the data.

    Raises:
        ConfigError: ``lengths`` has another count than the dataset has examples, or lengths (given or
            from the column) disagree with the ``input_ids`` they stand for: planning on them would train
            on the wrong examples or overfill rows, silently.
    """
    from smart_batching.errors import ConfigError
    from smart_batching.plan import as_lengths

    columns = getattr(dataset, "column_names", None) or []
    source = "lengths="
    if lengths is None:
        lengths = dataset_lengths(dataset, length_column=length_column)
        if not (length_column and length_column in columns):
            return lengths  # read from input_ids themselves
        source = f"the {length_column!r} column"
    lengths = as_lengths(lengths, name=source)
    if lengths.shape[0] != len(dataset):
        raise ConfigError(
            f"{source} has {lengths.shape[0]} lengths but train_dataset has {len(dataset)} examples: give one "
            "token count per example, in dataset order (or leave lengths= out to read them from input_ids)"
        )
    if "input_ids" in columns:
        actual = dataset_lengths(dataset, length_column=None)
        wrong = np.flatnonzero(actual != lengths)
        if wrong.size:
            i = int(wrong[0])
            raise ConfigError(
                f"{source} disagrees with input_ids for {wrong.size} example(s): example {i} has "
                f"{int(actual[i])} tokens, {source} says {int(lengths[i])}. Fix or drop the lengths (leave "
                "lengths= out, or length_column=None, to read them from input_ids)"
            )
    return lengths


def dataset_units(dataset: Any, lengths: np.ndarray, *, empty_examples: str = "skip") -> PlanUnits:
    """The units to plan for ``dataset``: its rows, less the empty and fully masked ones, with packed
    rows split into their documents (:mod:`smart_batching.units`).

    Read column-wise from a ``datasets.Dataset`` (Arrow buffers, no Python work per row):

    * documents: a ``seq_lengths`` column (TRL ``packing=True``), else ``position_ids`` restarts;
    * targets: a ``labels`` column, else ``completion_mask`` / ``assistant_masks`` and ``prompt_length``
      (:func:`smart_batching.data.lengths.dataset_target_tokens`); a unit with no target after its first
      token (every label ``-100``: TRL's rule; a document's first label the collator masks) is fully masked.

    Another map-style dataset is planned by rows, empty ones (length 0) left out.

    Args:
        dataset: The training dataset.
        lengths: (num_rows,) its token lengths (:func:`checked_lengths`).
        empty_examples: ``"skip"`` or ``"error"`` (see :func:`~smart_batching.units.plan_units`).
    """
    columns = getattr(dataset, "column_names", None) or []
    if not (columns and hasattr(dataset, "data") and "input_ids" in columns):
        return plan_units(lengths, empty_examples=empty_examples)
    documents = None
    if "seq_lengths" in columns:
        doc_lengths, doc_offsets = list_column(dataset, "seq_lengths")
        documents = (doc_lengths.astype(np.int64), np.diff(doc_offsets))
    elif "position_ids" in columns:
        positions, offsets = list_column(dataset, "position_ids")
        documents = _documents_from_positions(positions.astype(np.int64), offsets)
    unit_lengths = np.asarray(lengths, dtype=np.int64) if documents is None else documents[0]
    masked = _fully_masked(dataset, lengths, unit_lengths)
    return plan_units(lengths, masked=masked, documents=documents, empty_examples=empty_examples)


def _documents_from_positions(positions: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Documents of packed rows from ``position_ids``: a document starts at each row start and wherever
    the position does not continue the previous token's (TRL's and flash attention's rule)."""
    total = positions.shape[0]
    starts = np.zeros(total, dtype=bool)  # (total,)
    starts[1:] = positions[1:] != positions[:-1] + 1
    starts[offsets[:-1][offsets[:-1] < total]] = True
    where = np.flatnonzero(starts)  # (num_docs,)
    doc_lengths = np.diff(np.append(where, total))
    docs_per_row = np.diff(np.searchsorted(where, offsets))  # (num_rows,)
    return doc_lengths, docs_per_row


def _fully_masked(dataset: Any, lengths: np.ndarray, unit_lengths: np.ndarray) -> np.ndarray | None:
    """(num_units,) True where a unit has tokens but no target token the loss counts (its first token
    never is: :func:`~smart_batching.units.targets_per_unit`); None when no column says."""
    read = dataset_target_tokens(dataset, lengths)
    if read is None or read[0].shape[0] != int(unit_lengths.sum()):
        return None  # nothing marks targets, or labels that do not match input_ids: the collator reports it
    return (unit_lengths > 0) & (targets_per_unit(read[0], unit_lengths) == 0)


def model_input_dataset(dataset: Any) -> Any:
    """``dataset`` restricted to the columns the collators read (``datasets.Dataset`` only)."""
    names = getattr(dataset, "column_names", None)
    if names is None or not hasattr(dataset, "select_columns"):
        return dataset
    keep = [c for c in names if c in MODEL_INPUT_COLUMNS]
    return dataset if len(keep) == len(names) else dataset.select_columns(keep)


def default_pad_token_id(processing_class: Any = None, model: Any = None) -> int:
    """The tokenizer's pad token, else its EOS, else the model config's, else 0.

    Padding positions are masked out of attention and loss, so the id only has to be a valid token.
    """
    tok = getattr(processing_class, "tokenizer", processing_class)
    config = getattr(model, "config", None)
    for source in (tok, config):
        for attr in ("pad_token_id", "eos_token_id"):
            value = getattr(source, attr, None)
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if isinstance(value, int):
                return value
    return 0


def make_collator(strategy: Any, *, pad_token_id: int = 0, **options: Any) -> Callable:
    """The collator a strategy needs (its spec's :meth:`~smart_batching.planners.PlannerSpec.collator`):
    packing where rows hold several examples, padding (right side) otherwise.

    Args:
        strategy: A strategy name or spec.
        pad_token_id: Written into padding positions (padded strategies only).
        **options: Passed to the collator (e.g. ``pad_to_multiple_of=8``).
    """
    return spec_class(strategy).collator(pad_token_id=pad_token_id, **options)


def smart_dataloader(
    dataset: Any,
    strategy: Any = DEFAULT_STRATEGY,
    *,
    lengths: Any = None,
    seed: int = 0,
    collate_fn: Callable | None = None,
    pad_token_id: int = 0,
    loader_cls: type = DataLoader,
    empty_examples: str = "skip",
    **options: Any,
) -> DataLoader:
    """A DataLoader over planned batches, for plain PyTorch / accelerate loops.

    Args:
        dataset: A map-style dataset of tokenized examples (``input_ids`` and optional ``labels``...).
        strategy: A strategy name or spec.
        lengths: Token lengths; None reads them with :func:`dataset_lengths`.
        seed: Planner seed.
        collate_fn: None picks :func:`make_collator` for the strategy.
        pad_token_id: For the padding collator.
        loader_cls: ``DataLoader`` or ``torchdata.stateful_dataloader.StatefulDataLoader``.
        empty_examples: Examples with no tokens or no target token (:func:`dataset_units`): ``"skip"``
            (left out of the plan, one warning naming their rows) or ``"error"``.
        **options: Strategy options (``max_tokens=``, ``capacity=``...) and DataLoader keywords
            (``num_workers=``, ``pin_memory=``...): names a spec field are planner options.

    Returns:
        The DataLoader; ``loader.batch_sampler`` is the :class:`SmartBatchSampler`.
    """
    spec_fields = _spec_fields(strategy)
    plan_options = {k: v for k, v in options.items() if k in spec_fields}
    loader_options = {k: v for k, v in options.items() if k not in spec_fields}
    if lengths is None:
        lengths = dataset_lengths(dataset)
    units = dataset_units(dataset, as_lengths(lengths), empty_examples=empty_examples)
    sampler = SmartBatchSampler(lengths, strategy, seed=seed, units=units, **plan_options)
    data = model_input_dataset(dataset)
    if sampler.yields_segments:
        data = SegmentDataset(data)
    if collate_fn is None:
        collate_fn = make_collator(sampler.strategy, pad_token_id=pad_token_id)
    return loader_cls(data, batch_sampler=sampler, collate_fn=collate_fn, **loader_options)


def _spec_fields(strategy: Any) -> set[str]:
    from dataclasses import fields

    from smart_batching.planners import REGISTRY, PlannerSpec

    if isinstance(strategy, PlannerSpec):
        return set()
    if strategy not in REGISTRY:
        make_spec(strategy)  # raises the unknown-strategy error
    return {f.name for f in fields(REGISTRY[strategy][0])}


def _is_iterable(dataset: Any) -> bool:
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    try:
        import datasets

        return isinstance(dataset, datasets.IterableDataset)
    except ImportError:  # pragma: no cover - datasets is in the hf extra
        return False
