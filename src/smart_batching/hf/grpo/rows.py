"""GRPO completions as planning units: read from TRL's padded batch, laid out with their prompt once in
padding-free rows, and the map back to TRL's ``(completions, logits_to_keep)`` layout.

TRL's ``GRPOTrainer`` scores completions from a batch of ``prompt_ids`` (left-padded) followed by
``completion_ids`` (right-padded): ``input_ids`` and ``attention_mask`` of ``(B, prompt_width + C)``, and
per-token outputs of ``(B, C)`` where ``C`` is ``logits_to_keep`` (0 past each completion's end). Here a
*group* is one prompt and the completions of it that the batch holds (rows with the same prompt tokens).
A group lies in a row as the prompt's first ``p - 1`` tokens once, then one branch per completion: the
prompt's last token followed by the completion. Each branch attends to the prefix and to itself, at the
positions it has alone (:mod:`smart_batching.attention.prefix_sharing`), and each position of a branch
predicts exactly one token, so TRL's fused LM head takes the row's ``shift_labels`` as they are::

    prompt p0 p1 p2, completions a0 a1 and b0 (one group)

    input_ids             p0 p1 | p2 a0 a1 | p2 b0
    position_ids          0  1  | 2  3  4  | 2  3
    shift_labels          -  -  | a0 a1 -  | b0 -
    shared_prefix_lengths [[2, 3, 2]]

Without prompt sharing every completion is a group of its own (``[[2, 3], [2, 2]]``: the prompt twice).
The last prompt token is repeated per branch (one token per completion) so that no position predicts two
tokens; the prefix keeps the rest of the prompt once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from smart_batching.errors import DataError, OverlongError
from smart_batching.units import IGNORE_INDEX


@dataclass(frozen=True)
class Completions:
    """The completions of one TRL batch, read from its padded tensors.

    Attributes:
        prompts: each completion's prompt tokens, ``B`` int64 arrays.
        completions: each completion's tokens (TRL's ``completion_mask``), ``B`` int64 arrays.
        group: ``(B,)`` int64, the group (distinct prompt) of each completion, numbered in first-seen order.
        width: ``C``, TRL's ``logits_to_keep``.
    """

    prompts: list[np.ndarray]
    completions: list[np.ndarray]
    group: np.ndarray
    width: int

    @classmethod
    def from_padded(
        cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int
    ) -> Completions:
        """Read ``B`` completions from TRL's ``(B, prompt_width + logits_to_keep)`` batch.

        Raises:
            DataError: a completion without prompt tokens (nothing predicts its first token).
        """
        ids, mask = input_ids.cpu().numpy(), attention_mask.cpu().numpy().astype(bool)
        split = ids.shape[1] - int(logits_to_keep)
        prompts = [row[:split][m[:split]] for row, m in zip(ids, mask, strict=True)]
        completions = [row[split:][m[split:]] for row, m in zip(ids, mask, strict=True)]
        if any(p.size == 0 for p in prompts):
            raise DataError("a GRPO completion has no prompt tokens: nothing predicts its first token")
        seen: dict[bytes, int] = {}
        group = np.array([seen.setdefault(p.tobytes(), len(seen)) for p in prompts], dtype=np.int64)
        return cls(prompts, completions, group, int(logits_to_keep))

    def units(self, shared: bool) -> list[np.ndarray]:
        """The units rows are planned with: each group's completions (``shared``) or each completion
        alone."""
        if shared:
            return [np.flatnonzero(self.group == g) for g in range(int(self.group.max()) + 1)]
        return [np.array([b]) for b in range(len(self.prompts))]

    def costs(self, units: list[np.ndarray]) -> np.ndarray:
        """Row tokens of each unit, ``(units,)`` int64: its prompt once, then each completion after the
        prompt's last token."""
        return np.array(
            [self.prompts[u[0]].size - 1 + sum(1 + self.completions[b].size for b in u) for u in units],
            dtype=np.int64,
        )

    def split_units(
        self, units: list[np.ndarray], capacity: int | None, setting: str = "capacity"
    ) -> list[np.ndarray]:
        """Cut groups that cost more than ``capacity`` row tokens into several (the prompt in each).

        Raises:
            OverlongError: one completion with its prompt is longer than ``capacity``.
        """
        if capacity is None:
            return units
        out = []
        for unit in units:
            prefix = self.prompts[unit[0]].size - 1
            piece, cost = [], prefix
            for b in unit:
                need = 1 + self.completions[b].size
                if prefix + need > capacity:
                    raise OverlongError(
                        f"a completion with its prompt holds {prefix + need} tokens, more than {setting}="
                        f"{capacity}. Raise {setting}= (a completion is never cut: TRL's loss scores all of it)"
                    )
                if piece and cost + need > capacity:
                    out.append(np.array(piece))
                    piece, cost = [], prefix
                piece.append(b)
                cost += need
            out.append(np.array(piece))
        return out

    def row(self, units: list[np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
        """One padding-free row of ``units`` (each a list of completions of one prompt).

        Returns:
            ``input_ids``, ``position_ids``, ``shift_labels`` (``(1, tokens)``; -100 where nothing is
            predicted), ``shared_prefix_lengths`` (``(units, 1 + most completions)`` int32; a unit with
            fewer completions has empty branches after its own), ``source``
            (``(targets,)``: the row position whose output is each target) and ``target`` (``(targets,)``:
            its flat index ``b * width + k`` in TRL's ``(B, width)`` layout).
        """
        ids, positions, labels, lengths, source, target = [], [], [], [], [], []
        offset = 0
        for unit in units:
            prompt = self.prompts[unit[0]]
            p = prompt.size
            ids.append(prompt[:-1])
            positions.append(np.arange(p - 1))
            labels.append(np.full(p - 1, IGNORE_INDEX))
            offset += p - 1
            group = [p - 1]
            for b in unit:
                completion = self.completions[b]
                c = completion.size
                ids.append(np.concatenate([prompt[-1:], completion]))
                positions.append(np.arange(p - 1, p + c))
                labels.append(np.concatenate([completion, [IGNORE_INDEX]]))
                source.append(offset + np.arange(c))
                target.append(int(b) * self.width + np.arange(c))
                offset += 1 + c
                group.append(1 + c)
            lengths.append(group)

        def cat(pieces: list[np.ndarray]) -> torch.Tensor:
            return torch.from_numpy(np.concatenate(pieces).astype(np.int64)).to(device)

        return {
            "input_ids": cat(ids)[None],
            "position_ids": cat(positions)[None],
            "shift_labels": cat(labels)[None],
            "shared_prefix_lengths": _ragged(lengths).to(device),
            "source": cat(source),
            "target": cat(target),
        }


def _ragged(lengths: list[list[int]]) -> torch.Tensor:
    """``[prefix, branch, ...]`` groups of different branch counts as one int32 table: shorter groups are
    filled with empty branches (0 tokens), which the shared-prefix plan skips."""
    most = max(len(g) for g in lengths)
    table = np.zeros((len(lengths), most), dtype=np.int32)
    for i, g in enumerate(lengths):
        table[i, : len(g)] = g
    return torch.from_numpy(table)


def chunk_rows(batch_size: int | None, num: int) -> list[np.ndarray]:
    """TRL's chunks of a call (``batch_size`` completions each; None: one chunk)."""
    step = batch_size or num
    return [np.arange(s, min(s + step, num)) for s in range(0, num, step)]


__all__ = ["Completions", "chunk_rows"]
