"""Collators: turn the examples of one planned batch into model inputs.

Collators never re-decide what the planner decided: :class:`PaddingCollator` pads the rows it is
given, :class:`PackingCollator` packs all the examples it is given into one row. Both are vectorised
(NumPy scatter into a preallocated array), with Python work per example, never per token.

Features are mappings with:

* ``input_ids``: token ids (list, NumPy array or 1-D tensor).
* ``labels`` (optional): per-token targets, used as they are (``-100`` excluded from the loss), as HF
  and TRL use a ``labels`` column. Without it labels are a copy of ``input_ids`` (causal LM) with the
  prompt masked by the next three fields.
* ``completion_mask`` / ``assistant_masks`` (optional, no ``labels``): 1 on tokens to train on; 0 tokens
  get ``-100`` (TRL's columns: TRL folds them into ``labels`` during dataset preparation and then
  drops them, so with ``labels`` present a leftover mask column is not applied).
* ``prompt_length`` (optional, no ``labels``): number of leading prompt tokens whose labels become ``-100``.
* ``token_type_ids`` (optional, BERT-like models): carried along, padded with 0.
* ``seq_lengths`` or ``position_ids`` (optional): the feature is a row that already holds several
  documents (TRL ``packing=True`` writes ``seq_lengths``; ``position_ids`` restart at each document).
  :class:`PackingCollator` keeps the documents apart (positions restart, no attention across them, the
  first label of each is ``-100``); :class:`PaddingCollator` refuses such a row, since padding it would
  let its documents attend to each other. The samplers plan the documents of packed rows as units of
  their own (:mod:`smart_batching.units`), so each feature they hand over is one document.
* ``segment_start`` / ``segment_length`` (optional): use only tokens
  ``[segment_start, segment_start + segment_length)`` of the example (all per-token fields are
  sliced alike, ``prompt_length`` is shifted). Planners emit these for overlong examples they
  truncate or split; each piece is an independent sequence (its positions restart at 0 and it does
  not see the earlier piece).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from smart_batching.errors import ConfigError, DataError
from smart_batching.units import IGNORE_INDEX, MASK_COLUMNS

_PER_TOKEN = ("input_ids", "labels", "completion_mask", "assistant_masks", "token_type_ids", "position_ids")
DOCUMENTS = "seq_lengths"
"""Key of an example's document lengths, from :func:`_examples` (a row that holds several documents)."""


def _as_1d(value: Any, name: str, index: int) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise DataError(f"feature {index}: {name} must be 1-D (one value per token), got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iub":
        raise DataError(f"feature {index}: {name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _example(
    feature: Mapping[str, Any], index: int, max_length: int | None, label_pad_token_id: int
) -> dict[str, np.ndarray]:
    """Slice, truncate and prompt-mask one feature; returns int64 arrays of equal length, plus
    ``seq_lengths`` (document lengths) when the feature is a row of several documents."""
    if "input_ids" not in feature:
        raise DataError(f"feature {index} has no 'input_ids' (keys: {sorted(feature)})")
    fields = {k: _as_1d(feature[k], k, index) for k in _PER_TOKEN if feature.get(k) is not None}
    n = fields["input_ids"].size
    for name, arr in fields.items():
        if arr.size != n:
            raise DataError(f"feature {index}: {name} has {arr.size} values but input_ids has {n}")
    prompt_length = int(feature.get("prompt_length") or 0)
    docs = _documents(feature, fields.pop("position_ids", None), n, index)  # (num_docs,) or None

    start = feature.get("segment_start")
    seg_len = feature.get("segment_length")
    if start is not None or seg_len is not None:
        start = int(start or 0)
        stop = n if seg_len is None else start + int(seg_len)
        if not 0 <= start <= stop <= n:
            raise DataError(
                f"feature {index}: segment_start={start}, segment_length={seg_len} fall outside its {n} tokens"
            )
        if docs is not None:
            ends = np.cumsum(docs)
            doc = int(np.searchsorted(ends, start, side="right"))
            if stop > start and (doc >= docs.size or stop > ends[doc]):
                raise DataError(
                    f"feature {index}: the window [{start}, {stop}) crosses a document boundary of its packed "
                    f"row (seq_lengths {docs.tolist()}); plan the row's documents as units (smart_batching.units)"
                )
            docs = None  # the window is (part of) one document
        fields = {k: v[start:stop] for k, v in fields.items()}
        prompt_length = max(prompt_length - start, 0)
    if max_length is not None:
        if docs is not None and int(docs.sum()) > max_length:
            ends = np.minimum(np.cumsum(docs), max_length)
            docs = np.diff(ends, prepend=0)
            docs = docs[docs > 0]
        fields = {k: v[:max_length] for k, v in fields.items()}

    masks = [fields.pop(m) for m in MASK_COLUMNS if m in fields]
    if "labels" in fields:
        labels = fields["labels"].copy()  # as given: HF and TRL use a labels column as is
    else:
        labels = fields["input_ids"].copy()
        if prompt_length:
            labels[:prompt_length] = label_pad_token_id
        for mask in masks:
            labels[mask == 0] = label_pad_token_id
    fields["labels"] = labels
    if docs is not None and docs.size > 1:
        fields[DOCUMENTS] = docs
    return fields


def _documents(
    feature: Mapping[str, Any], position_ids: np.ndarray | None, n: int, index: int
) -> np.ndarray | None:
    """Document lengths of a packed row from ``seq_lengths`` or ``position_ids`` restarts; None for one."""
    seq_lengths = feature.get(DOCUMENTS)
    if seq_lengths is not None:
        docs = _as_1d(seq_lengths, DOCUMENTS, index)
        if int(docs.sum()) != n or (docs.size and int(docs.min()) < 0):
            raise DataError(f"feature {index}: seq_lengths {docs.tolist()} do not add up to its {n} tokens")
        return docs[docs > 0]
    if position_ids is None or n == 0:
        return None
    # A document starts where the positions do not continue the previous token's (TRL, flash attention).
    starts = np.flatnonzero(np.diff(position_ids, prepend=position_ids[0] - 2) != 1)  # (num_docs,)
    return np.diff(np.append(starts, n))


def _examples(
    features: Sequence[Mapping[str, Any]], max_length: int | None, label_pad_token_id: int
) -> list[dict[str, np.ndarray]]:
    if len(features) == 0:
        raise DataError("cannot collate an empty batch (0 features)")
    examples = [_example(f, i, max_length, label_pad_token_id) for i, f in enumerate(features)]
    keys = {frozenset(e) - {DOCUMENTS} for e in examples}
    if len(keys) > 1:
        raise DataError(
            f"features disagree on their fields ({sorted(sorted(k) for k in keys)}); "
            "give every feature the same keys"
        )
    return examples


def _check_max_length(max_length: int | None) -> None:
    if max_length is not None and max_length < 1:
        raise ConfigError(f"max_length={max_length} must be a positive number of tokens or None")


class PaddingCollator:
    """Pad a batch of examples into a ``(num_rows, width)`` rectangle.

    ``width`` is the longest example (after truncation), rounded up to ``pad_to_multiple_of``::

        padding_side="right"          padding_side="left"
        input_ids       a a a P       P a a a
                        b b b b       b b b b
        attention_mask  1 1 1 0       0 1 1 1
        labels          - a a -       - - a a      (-: label_pad_token_id; prompt tokens too)

    Args:
        pad_token_id: Token id written into padding positions of ``input_ids``.
        pad_to_multiple_of: Round the width up to a multiple of this (tensor-core friendly shapes);
            ``None`` pads to the longest example only.
        padding_side: ``"right"`` (training) or ``"left"`` (batched generation).
        label_pad_token_id: Label on padding and prompt tokens (ignored by the loss).
        max_length: Truncate each example to its first ``max_length`` tokens; ``None`` keeps all. The
            rounded width may exceed it.
        return_position_ids: Also return ``position_ids`` counting real tokens from 0 (0 on padding).

    Returns (from ``__call__``):
        ``input_ids``, ``attention_mask``, ``labels`` (and ``position_ids``, ``token_type_ids`` when
        asked for / present): int64 tensors of shape ``(num_rows, width)``.
    """

    def __init__(
        self,
        pad_token_id: int,
        *,
        pad_to_multiple_of: int | None = None,
        padding_side: str = "right",
        label_pad_token_id: int = IGNORE_INDEX,
        max_length: int | None = None,
        return_position_ids: bool = False,
    ) -> None:
        if padding_side not in ("right", "left"):
            raise ConfigError(f"padding_side={padding_side!r} must be 'right' or 'left'")
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ConfigError(f"pad_to_multiple_of={pad_to_multiple_of} must be a positive integer or None")
        if pad_token_id is None:
            raise ConfigError("pad_token_id=None: pass the tokenizer's pad_token_id (or eos_token_id)")
        _check_max_length(max_length)
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.padding_side = padding_side
        self.label_pad_token_id = int(label_pad_token_id)
        self.max_length = max_length
        self.return_position_ids = return_position_ids

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        examples = _examples(features, self.max_length, self.label_pad_token_id)
        packed = [i for i, e in enumerate(examples) if DOCUMENTS in e]
        if packed:
            e = examples[packed[0]]
            raise DataError(
                f"feature {packed[0]} is a packed row of {e[DOCUMENTS].size} documents (seq_lengths "
                f"{e[DOCUMENTS].tolist()}): padding it would let them attend to each other. Plan its documents "
                "as units (SmartBatchSampler(units=smart_batching.units.plan_units(..., documents=...)); the "
                "Trainer integration does) or collate it with PackingCollator"
            )
        lengths = np.array([e["input_ids"].size for e in examples], dtype=np.int64)
        num_rows = lengths.size
        width = int(lengths.max())
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of

        # Scatter coordinates of every real token: rows, cols: (total,)
        total = int(lengths.sum())
        offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        rows = np.repeat(np.arange(num_rows), lengths)
        cols = np.arange(total) - np.repeat(offsets, lengths)
        if self.padding_side == "left":
            cols += np.repeat(width - lengths, lengths)

        fill = {"input_ids": self.pad_token_id, "labels": self.label_pad_token_id, "token_type_ids": 0}
        out: dict[str, torch.Tensor] = {}
        for name in examples[0]:
            grid = np.full((num_rows, width), fill[name], dtype=np.int64)
            grid[rows, cols] = np.concatenate([e[name] for e in examples])
            out[name] = torch.from_numpy(grid)
        mask = np.zeros((num_rows, width), dtype=np.int64)
        mask[rows, cols] = 1
        out["attention_mask"] = torch.from_numpy(mask)
        if self.return_position_ids:
            pos = np.zeros((num_rows, width), dtype=np.int64)
            pos[rows, cols] = cols - (width - lengths[rows] if self.padding_side == "left" else 0)
            out["position_ids"] = torch.from_numpy(pos)
        order = ("input_ids", "attention_mask", "labels", "position_ids", "token_type_ids")
        return {k: out[k] for k in order if k in out}


class PackingCollator:
    """Pack all examples of a batch into one row, padding-free (no ``attention_mask``).

    The batch it receives is the pack: the planner chose its members and their order. Three examples
    ``a`` (3 tokens), ``b`` (2) and ``c`` (4) become one row of 9 tokens::

        input_ids      a0 a1 a2 b0 b1 c0 c1 c2 c3          shape (1, 9)
        labels         -  a1 a2 -  b1 -  c1 c2 c3          first label of each example is -100
        position_ids   0  1  2  0  1  0  1  2  3           restart at every example
        seq_idx        0  0  0  1  1  2  2  2  2           int32
        cu_seq_lens_q  [0, 3, 5, 9]                        int32, (num_examples + 1,)
        max_length_q   4

        block-causal mask it implies (row: query, column: key; x attends)
              a0 a1 a2 b0 b1 c0 c1 c2 c3
          a0  x
          a1  x  x
          a2  x  x  x
          b0           x
          b1           x  x
          c0                 x
          c1                 x  x
          c2                 x  x  x
          c3                 x  x  x  x

    The first label of every example is ``label_pad_token_id`` so that the last token of one example
    is never trained to predict the first token of the next (causal LM losses shift labels by one).
    Run the model with :func:`smart_batching.attention.enable_packed_attention` (or
    ``flash_attention_2``) so that attention follows ``cu_seq_lens_q``; ``sdpa``/``eager`` would need
    ``position_ids`` with no ``attention_mask`` and ``use_cache=False`` and build the dense mask above.

    Args:
        label_pad_token_id: Label for the first token of each example and for prompt tokens.
        max_length: Truncate each example to its first ``max_length`` tokens; ``None`` keeps all. Pack
            capacity is the planner's business: the row is as long as the examples given.
        return_flash_kwargs: Return ``cu_seq_lens_q``/``cu_seq_lens_k`` and ``max_length_q``/``max_length_k``.
        return_seq_idx: Return ``seq_idx`` (example index of each token, for Mamba-style kernels).

    Returns (from ``__call__``):
        ``input_ids``, ``labels``, ``position_ids`` (int64, ``(1, total)``), ``token_type_ids`` when the
        features have them, plus the flash kwargs and ``seq_idx`` as configured.
    """

    def __init__(
        self,
        *,
        label_pad_token_id: int = IGNORE_INDEX,
        max_length: int | None = None,
        return_flash_kwargs: bool = True,
        return_seq_idx: bool = True,
    ) -> None:
        _check_max_length(max_length)
        self.label_pad_token_id = int(label_pad_token_id)
        self.max_length = max_length
        self.return_flash_kwargs = return_flash_kwargs
        self.return_seq_idx = return_seq_idx

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor | int]:
        examples = _examples(features, self.max_length, self.label_pad_token_id)
        empty = [i for i, e in enumerate(examples) if e["input_ids"].size == 0]
        if empty:
            raise DataError(
                f"feature {empty[0]} has no tokens (after slicing/truncation): drop empty examples before "
                "packing (SmartBatchSampler and the Trainer integration leave them out of the plan)"
            )
        # Documents, not features, are the sequences: a packed row contributes each of its documents.
        lengths = np.concatenate(
            [e.pop(DOCUMENTS) if DOCUMENTS in e else np.array([e["input_ids"].size]) for e in examples]
        ).astype(np.int64)  # (num_docs,)
        total = int(lengths.sum())
        cu = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
        starts = cu[:-1]

        out: dict[str, torch.Tensor | int] = {}
        for name in examples[0]:
            flat = np.concatenate([e[name] for e in examples])
            if name == "labels":
                flat[starts] = self.label_pad_token_id
            out[name] = torch.from_numpy(flat)[None]
        # position_ids: (total,), restarting at 0 at each example start
        out["position_ids"] = torch.from_numpy(np.arange(total) - np.repeat(starts, lengths))[None]
        if self.return_flash_kwargs:
            cu_t = torch.from_numpy(cu.astype(np.int32))
            max_len = int(lengths.max())
            out["cu_seq_lens_q"] = cu_t
            out["cu_seq_lens_k"] = cu_t
            out["max_length_q"] = max_len
            out["max_length_k"] = max_len
        if self.return_seq_idx:
            seq_idx = np.repeat(np.arange(lengths.size, dtype=np.int32), lengths)  # (total,)
            out["seq_idx"] = torch.from_numpy(seq_idx)[None]
        order = (
            "input_ids",
            "labels",
            "position_ids",
            "token_type_ids",
            "cu_seq_lens_q",
            "cu_seq_lens_k",
            "max_length_q",
            "max_length_k",
            "seq_idx",
        )
        return {k: out[k] for k in order if k in out}
