"""Preference pairs as planning units: their token counts and costs (read from Arrow offsets), and the
collator of packed rows, with or without one shared prompt per pair.

TRL's ``DPOTrainer`` prepares each pair as ``prompt_ids``, ``chosen_ids`` and ``rejected_ids`` and its
collator (``DataCollatorForPreference``) pads ``prompt + chosen`` and ``prompt + rejected``, each
truncated to ``max_length``, into a ``(2 * pairs, width)`` batch: chosen rows first, then rejected rows.
A pair is one unit of the plan (chosen and rejected never land in different micro-batches); what it
costs depends on the layout (:meth:`PairLengths.costs`).

:class:`PairCollator` puts the pairs of a batch end to end in one padding-free row. In the
``"shared"`` layout (prompt sharing) each pair is laid out as prompt, chosen, rejected, the rejected
tokens continuing the prompt's positions (:mod:`smart_batching.attention.prefix_sharing` draws the
mask); in the ``"unshared"`` layout each pair is its two sequences, two packed segments::

    pair (prompt p0 p1, chosen c0 c1, rejected r0)

    "shared"   input_ids  p0 p1 c0 c1 r0        shared_prefix_lengths [[2, 2, 1]]
               positions  0  1  2  3  2
    "unshared" input_ids  p0 p1 c0 c1 p0 p1 r0  cu_seq_lens_q [0, 4, 7]
               positions  0  1  2  3  0  1  2

Beside the row, the batch carries TRL's own padded view (``input_ids``, ``attention_mask``,
``completion_mask``, ``(2 * pairs, width)``, exactly what ``DataCollatorForPreference`` returns): TRL's
loss and metrics read it unchanged. Only the row is run through the model; ``source`` says which row
position's hidden state predicts each target token of the padded view (the hooks of
:mod:`smart_batching.hf.dpo.model` put the log-probabilities back in place).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from smart_batching.errors import ConfigError, DataError

PACKED_PAIRS = "packed_pairs"
"""Batch key of the packed row (a dict of tensors) that the model hooks run instead of the padded view."""

LAYOUTS = ("padded", "unshared", "shared")
TRUNCATION_MODES = ("keep_start", "keep_end")


@dataclass(frozen=True)
class PairLengths:
    """Token counts of pairs after TRL's truncation, each ``(num_pairs,)`` int64.

    Attributes:
        prompt: prompt tokens before truncation.
        chosen: tokens of the truncated ``prompt + chosen`` sequence.
        rejected: tokens of the truncated ``prompt + rejected`` sequence.
        shared: leading tokens both truncated sequences hold in common (the same prompt tokens at the
            same positions): the prompt under ``keep_start``; under ``keep_end``, what is left of it when
            both sequences lost as many tokens, else 0.
    """

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray
    shared: np.ndarray

    def costs(self, layout: str) -> np.ndarray:
        """Tokens a pair occupies, ``(num_pairs,)`` int64: the lengths the planners plan with.

        ``"padded"``: ``2 * max(chosen, rejected)`` (two rows, as wide as the longer sequence);
        ``"unshared"``: ``chosen + rejected`` (both sequences in a row, the prompt twice); ``"shared"``:
        ``chosen + rejected - shared`` (the prompt once).
        """
        if layout == "padded":
            return 2 * np.maximum(self.chosen, self.rejected)
        if layout == "unshared":
            return self.chosen + self.rejected
        if layout == "shared":
            return self.chosen + self.rejected - self.shared
        raise ConfigError(f"layout={layout!r} must be one of {', '.join(LAYOUTS)}")


def pair_lengths(
    prompt: Any, chosen: Any, rejected: Any, *, max_length: int | None, truncation_mode: str = "keep_start"
) -> PairLengths:
    """:class:`PairLengths` from prompt, chosen and rejected token counts, truncated as TRL's
    ``DataCollatorForPreference`` truncates (each sequence on its own), vectorised.

    >>> lengths = pair_lengths([3, 5], [4, 1], [2, 6], max_length=8)
    >>> lengths.chosen.tolist(), lengths.rejected.tolist(), lengths.shared.tolist()
    ([7, 6], [5, 8], [3, 5])
    >>> lengths.costs("shared").tolist()
    [9, 9]
    """
    p, c, r = (np.asarray(x, dtype=np.int64) for x in (prompt, chosen, rejected))
    if truncation_mode not in TRUNCATION_MODES:
        raise ConfigError(f"truncation_mode={truncation_mode!r} must be one of {', '.join(TRUNCATION_MODES)}")
    full_c, full_r = p + c, p + r
    if max_length is None:
        return PairLengths(p, full_c, full_r, p.copy())
    lc, lr = np.minimum(full_c, max_length), np.minimum(full_r, max_length)
    if truncation_mode == "keep_start":
        shared = np.minimum(p, np.minimum(lc, lr))
    else:  # keep_end drops leading tokens: the prompts line up only where both lost as many
        cut_c, cut_r = full_c - lc, full_r - lr
        shared = np.where(cut_c == cut_r, np.maximum(p - cut_c, 0), 0)
        shared = np.minimum(shared, np.minimum(lc, lr))
    return PairLengths(p, lc, lr, shared)


def dataset_pair_lengths(
    dataset: Any, *, max_length: int | None, truncation_mode: str = "keep_start", columns: Sequence[str]
) -> PairLengths:
    """:func:`pair_lengths` of a prepared preference dataset, from its Arrow list offsets (no Python work
    per row).

    Args:
        dataset: A ``datasets.Dataset`` with the token-id columns ``columns`` (prompt, chosen, rejected).
        columns: The three column names (TRL's: :data:`smart_batching.compat.TRL_DPO_TOKEN_COLUMNS`).

    Raises:
        DataError: a column is missing.
    """
    from smart_batching.data.lengths import lengths_from_dataset

    names = getattr(dataset, "column_names", None) or []
    missing = [c for c in columns if c not in names]
    if missing:
        raise DataError(
            f"the preference dataset has no {missing} column(s) (columns: {names}); smart batching plans the "
            "pairs TRL's DPOTrainer prepared (prompt_ids, chosen_ids, rejected_ids)"
        )
    counts = [lengths_from_dataset(dataset, c) for c in columns]
    return pair_lengths(*counts, max_length=max_length, truncation_mode=truncation_mode)


def _ids(example: Mapping[str, Any], name: str, index: int) -> np.ndarray:
    value = example.get(name)
    if value is None:
        raise DataError(f"pair {index} has no {name!r} (keys: {sorted(example)})")
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return np.asarray(value, dtype=np.int64).reshape(-1)


class PairCollator:
    """Collate the pairs of one planned batch: TRL's padded view, and for the packed layouts the
    padding-free row the model runs instead.

    Args:
        pad_token_id: Written into the padding of the padded view (as TRL's collator does).
        layout: ``"shared"`` (one row, one prompt per pair shared by both completions), ``"unshared"`` (one
            row, each pair as its two sequences) or ``"padded"`` (TRL's padded batch only).
        max_length: Truncate each ``prompt + completion`` sequence to this many tokens (TRL's
            ``DPOConfig.max_length``); None keeps all.
        truncation_mode: ``"keep_start"`` or ``"keep_end"``, as TRL.
        pad_to_multiple_of: Round the padded view's width up to a multiple of this (``"padded"`` only).
        columns: The prompt, chosen and rejected token-id keys, then the precomputed reference
            log-probability keys (TRL's names).

    Returns (from ``__call__``):
        ``input_ids``, ``attention_mask``, ``completion_mask`` (``(2 * pairs, width)``: what TRL's
        ``DataCollatorForPreference`` returns), ``ref_chosen_logps`` / ``ref_rejected_logps``
        (``(pairs,)``) when the pairs carry them, and for the packed layouts :data:`PACKED_PAIRS`:
        ``input_ids`` and ``position_ids`` (``(1, tokens)``), ``source`` (``(targets,)``: the row
        position whose hidden state predicts each target of the padded view, in row-major order of
        ``completion_mask[:, 1:]``), and the attention layout: ``shared_prefix_lengths`` (``(pairs, 3)``
        int32: shared prompt, chosen and rejected tokens) for ``"shared"``, ``cu_seq_lens_q`` /
        ``cu_seq_lens_k`` and ``max_length_q`` / ``max_length_k`` for ``"unshared"``.
    """

    def __init__(
        self,
        *,
        pad_token_id: int,
        layout: str = "shared",
        max_length: int | None = None,
        truncation_mode: str = "keep_start",
        pad_to_multiple_of: int | None = None,
        columns: Sequence[str] = (
            "prompt_ids",
            "chosen_ids",
            "rejected_ids",
            "ref_chosen_logps",
            "ref_rejected_logps",
        ),
    ) -> None:
        if layout not in LAYOUTS:
            raise ConfigError(f"layout={layout!r} must be one of {', '.join(LAYOUTS)}")
        if max_length is not None and max_length < 1:
            raise ConfigError(f"max_length={max_length} must be a positive number of tokens or None")
        if truncation_mode not in TRUNCATION_MODES:
            raise ConfigError(
                f"truncation_mode={truncation_mode!r} must be one of {', '.join(TRUNCATION_MODES)}"
            )
        if pad_to_multiple_of is not None and (layout != "padded" or pad_to_multiple_of < 1):
            raise ConfigError(
                f"pad_to_multiple_of={pad_to_multiple_of}: only layout='padded' pads, to a positive multiple"
            )
        self.pad_token_id = int(pad_token_id)
        self.layout = layout
        self.max_length = max_length
        self.truncation_mode = truncation_mode
        self.pad_to_multiple_of = pad_to_multiple_of
        self.columns = tuple(columns)

    def _cut(self, seq: np.ndarray) -> np.ndarray:
        if self.max_length is None:
            return seq
        return seq[: self.max_length] if self.truncation_mode == "keep_start" else seq[-self.max_length :]

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not examples:
            raise DataError("cannot collate an empty batch (0 pairs)")
        prompt_key, chosen_key, rejected_key, ref_chosen, ref_rejected = self.columns
        prompts = [_ids(e, prompt_key, i) for i, e in enumerate(examples)]
        chosen = [_ids(e, chosen_key, i) for i, e in enumerate(examples)]
        rejected = [_ids(e, rejected_key, i) for i, e in enumerate(examples)]
        lengths = pair_lengths(
            [p.size for p in prompts], [c.size for c in chosen], [r.size for r in rejected],
            max_length=self.max_length, truncation_mode=self.truncation_mode,
        )  # fmt: skip
        n = len(examples)
        shared = lengths.shared if self.layout == "shared" else np.zeros(n, dtype=np.int64)
        # Both sequences of every pair, truncated as TRL's collator truncates them: chosen, then rejected
        seqs, masks = [], []
        for completions in (chosen, rejected):
            for prompt, completion in zip(prompts, completions, strict=True):
                seqs.append(self._cut(np.concatenate([prompt, completion])))
                masks.append(
                    self._cut(np.repeat(np.array([0, 1], dtype=np.int64), [prompt.size, completion.size]))
                )
        seq_len = np.array([s.size for s in seqs], dtype=np.int64)  # (2n,)
        lc, lr = seq_len[:n], seq_len[n:]  # (n,) each: lengths.chosen, lengths.rejected
        width = int(seq_len.max())
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        rows = np.repeat(np.arange(2 * n), seq_len)  # (tokens of the view,)
        cols = np.arange(int(seq_len.sum())) - np.repeat(np.cumsum(seq_len) - seq_len, seq_len)
        ids = np.full((2 * n, width), self.pad_token_id, dtype=np.int64)
        attention = np.zeros((2 * n, width), dtype=np.int64)
        completion = np.zeros((2 * n, width), dtype=np.int64)
        ids[rows, cols] = np.concatenate(seqs)
        attention[rows, cols] = 1
        completion[rows, cols] = np.concatenate(masks)
        out: dict[str, Any] = {
            "input_ids": torch.from_numpy(ids),
            "attention_mask": torch.from_numpy(attention),
            "completion_mask": torch.from_numpy(completion),
        }
        for key in (ref_chosen, ref_rejected):
            if key in examples[0]:
                out[key] = torch.tensor([e[key] for e in examples])
        if self.layout == "padded":
            return out

        # The row: each pair's chosen sequence, then its rejected sequence past the shared tokens.
        row_len = lc + lr - shared  # (n,)
        base = np.concatenate(([0], np.cumsum(row_len)[:-1]))  # (n,) first row position of each pair
        row_ids = np.concatenate([piece for i in range(n) for piece in (seqs[i], seqs[n + i][shared[i] :])])
        positions = np.concatenate(
            [piece for i in range(n) for piece in (np.arange(lc[i]), np.arange(shared[i], lr[i]))]
        )
        # Row position of every token of every sequence, laid out as the padded view: (2n, width)
        pair = rows % n
        past_shared = (rows >= n) & (cols >= shared[pair])
        grid = np.zeros((2 * n, width), dtype=np.int64)
        grid[rows, cols] = base[pair] + cols + np.where(past_shared, lc[pair] - shared[pair], 0)
        source = grid[:, :-1][completion[:, 1:] == 1]  # (targets,) row-major, as TRL's labels[:, 1:]

        packed: dict[str, Any] = {
            "input_ids": torch.from_numpy(row_ids)[None],
            "position_ids": torch.from_numpy(positions)[None],
            "source": torch.from_numpy(source),
        }
        if self.layout == "shared":
            layout = np.stack([shared, lc - shared, lr - shared], axis=1).astype(np.int32)  # (n, 3)
            packed["shared_prefix_lengths"] = torch.from_numpy(layout)
        else:
            cu = np.zeros(2 * n + 1, dtype=np.int32)
            cu[1:] = np.cumsum(np.stack([lc, lr], axis=1).reshape(-1))  # chosen, rejected, next pair...
            packed["cu_seq_lens_q"] = packed["cu_seq_lens_k"] = torch.from_numpy(cu)
            packed["max_length_q"] = packed["max_length_k"] = int(seq_len.max())
        out[PACKED_PAIRS] = packed
        return out


__all__ = [
    "LAYOUTS",
    "PACKED_PAIRS",
    "PairCollator",
    "PairLengths",
    "dataset_pair_lengths",
    "pair_lengths",
]
