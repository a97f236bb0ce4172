"""Every rank an equal share of each GRPO optimizer step: the completions TRL dealt to the ranks for one
step, dealt again by tokens.

TRL's ``GRPOTrainer`` (and ``RLOOTrainer``) generates a batch on each rank, shuffles it and splits it into
``steps_per_generation`` micro-batches; ``gradient_accumulation_steps`` consecutive ones make one optimizer
step, and every rank waits for the slowest at the step's gradient all-reduce. Completion lengths range from
a few tokens to ``max_completion_length``, so the rank that drew the long ones sets every rank's pace.

:func:`balance_window` gathers the micro-batches of one optimizer step from every rank and deals the
completions again (:func:`deal_equal_counts`), to the ranks and then within each rank to its
micro-batches: each micro-batch keeps TRL's number of completions, and the ranks get near-equal tokens
(prompt + completion; TRL's deal is kept where it is already as even). A completion travels with all
TRL computed for it (advantage, old-policy and reference log-probabilities, masks).

What stays: the optimizer step holds exactly TRL's completions, and where the loss sums per completion over
micro-batches of equal counts (:func:`partition_dependence` is None: every ``loss_type`` of TRL 1.16 but
``bnpo``, RLOO's sequence loss, no entropy bonus, ``top_entropy_quantile`` 1) the gradient is TRL's up to
floating-point summation order. What changes: the metrics TRL averages per micro-batch (``kl``,
``entropy``, the clip ratios) are averaged over differently formed micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from smart_batching.errors import ConfigError

PARTITION_FREE_LOSSES = ("grpo", "sapo", "dr_grpo", "dapo", "cispo", "vespo", "luspo")
"""TRL 1.16 loss types whose gradient does not depend on which micro-batch of an optimizer step holds a
completion, given equal counts per micro-batch: a mean over completions (``grpo``, ``sapo``, ``luspo``), a
sum over a fixed count (``dr_grpo``) or over the generation batch's tokens (``dapo``, ``cispo``,
``vespo``). ``bnpo`` divides each micro-batch by its own tokens."""

PROMPT_KEYS = ("prompt_ids", "prompt_mask")
"""TRL's left-padded tensors (the prompt); every other ``(rows, width)`` tensor as wide as
``completion_ids`` is right-padded (the completion)."""


def partition_dependence(trainer: Any) -> str | None:
    """Why moving completions between the micro-batches and ranks of an optimizer step would change
    ``trainer``'s gradient (None: it would not), in words that name the setting."""
    args = trainer.args
    loss_type = getattr(trainer, "loss_type", None)  # RLOOTrainer has none: a mean over completions
    if loss_type is not None and loss_type not in PARTITION_FREE_LOSSES:
        if loss_type == "bnpo":
            return "loss_type='bnpo' divides each micro-batch's loss by that micro-batch's own tokens"
        return f"loss_type={loss_type!r} is not known to sum per completion"
    if getattr(trainer, "_entropy_bonus_enabled", False):
        return "the entropy bonus (entropy_coef / adaptive entropy) is a mean over each micro-batch's tokens"
    if float(getattr(trainer, "top_entropy_quantile", 1.0)) < 1.0:
        return "top_entropy_quantile < 1 masks tokens by a quantile of each micro-batch's entropies"
    spg, accum = int(args.steps_per_generation), int(args.gradient_accumulation_steps)
    if spg % accum:
        return (
            f"steps_per_generation={spg} is not a multiple of gradient_accumulation_steps={accum}: an "
            "optimizer step's micro-batches come from two generation batches"
        )
    return None


def deal_equal_counts(costs: np.ndarray, num_bins: int) -> np.ndarray:
    """The bin of each of ``costs.size`` items (a multiple of ``num_bins``), every bin the same count.

    Costliest first, in rounds of ``num_bins`` items: each round's items go, costliest first, to the
    bins from lightest to heaviest. Every bin takes one item a round, and the heaviest and lightest bins
    end at most the costliest item apart. One ``argsort`` over the bins per round (rounds = items per bin).

    Raises:
        ValueError: ``costs.size`` is not a multiple of ``num_bins``.
    """
    costs = np.asarray(costs, dtype=np.int64)
    n = costs.size
    if num_bins < 1 or n % num_bins:
        raise ValueError(f"{n} items cannot be dealt into {num_bins} bins of equal count")
    order = np.argsort(-costs, kind="stable")
    load = np.zeros(num_bins, dtype=np.int64)
    bin_of = np.empty(n, dtype=np.int64)
    for start in range(0, n, num_bins):
        items = order[start : start + num_bins]  # costliest first
        bins = np.argsort(load, kind="stable")  # lightest first
        bin_of[items] = bins
        load[bins] += costs[items]
    return bin_of


def deal_to_ranks(cost: np.ndarray, world: int) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """The rank of each of a step's completions (``cost``: prompt + completion tokens, in TRL's order:
    rank 0's first, equal counts), dealt by :func:`deal_equal_counts`.

    Returns:
        ``(rank_of, before, after)``: the rank of each completion, or None where TRL's deal has no
        heavier rank than that (it is kept, and ``after`` is ``before``); every rank's tokens as TRL dealt
        them and as they end, ``(world,)`` int64.
    """
    cost = np.asarray(cost, dtype=np.int64)
    rank_of = deal_equal_counts(cost, world)
    before = cost.reshape(world, -1).sum(1)
    after = np.bincount(rank_of, weights=cost, minlength=world).astype(np.int64)
    if after.max() >= before.max():
        return None, before, before
    return rank_of, before, after


def balance_window(
    batches: list[dict[str, Any]],
    gather: Callable[[torch.Tensor], torch.Tensor],
    rank: int,
    world: int,
    pad_token_id: int,
) -> tuple[list[dict[str, Any]], np.ndarray, np.ndarray]:
    """The micro-batches of one optimizer step on this rank, after dealing every rank's completions again.

    Args:
        batches: this rank's micro-batches of the step (TRL's dicts, equal row counts and widths).
        gather: every rank's tensor, concatenated along dim 0 in rank order (``accelerator.gather``); all
            ranks call this function together.
        rank: this rank; world: the number of ranks.
        pad_token_id: the id left-padding the prompts.

    The step's completions are dealt to the ranks (:func:`deal_equal_counts`: equal counts, the ranks end
    at most the costliest completion apart), then each rank's share to its micro-batches the same way.
    Where TRL's deal has no heavier rank than that, it is kept as it is.

    Returns:
        ``(batches, before, after)``: the rank's micro-batches (new ones trimmed to their own widths, or
        ``batches`` where TRL's deal is kept), and every rank's tokens (prompt + completion) in the step
        before and after, ``(world,)`` int64.

    Raises:
        ConfigError: a value in TRL's batch whose layout is not known (named), or ranks with different row
            counts.
    """
    accum = len(batches)
    first = batches[0]
    for key, value in first.items():
        if value is not None and not isinstance(value, torch.Tensor):
            raise ConfigError(
                f"GRPO batch entry {key!r} is a {type(value).__name__}, which smart batching cannot deal "
                "between ranks: set balance_ranks=False"
            )
    rows = int(first["prompt_ids"].shape[0]) * accum
    row_keys = [k for k, v in first.items() if v is not None and v.dim() >= 1]
    local = {k: torch.cat([b[k] for b in batches]) if accum > 1 else first[k] for k in row_keys}
    device = local["prompt_ids"].device
    # Every rank's row count and the width of each 2-D entry (sorted keys: the same on every rank).
    keys = sorted(row_keys)
    shape = [rows] + [int(local[k].shape[1]) if local[k].dim() == 2 else 0 for k in keys]
    widths = gather(torch.tensor([shape], dtype=torch.long, device=device)).cpu().numpy()  # (world, 1 + keys)
    if (widths[:, 0] != rows).any():
        raise ConfigError(
            f"ranks hold {widths[:, 0].tolist()} completions for one optimizer step; balance_ranks needs "
            "TRL's equal counts: set balance_ranks=False"
        )
    width_of = {k: widths[:, 1 + i] for i, k in enumerate(keys)}
    completion_width = width_of["completion_ids"]
    padded: dict[str, torch.Tensor] = {}
    for k in keys:
        value = local[k]
        if value.dim() > 2 or value.shape[0] != rows:
            raise ConfigError(
                f"GRPO batch entry {k!r} of shape {tuple(value.shape)} has no known layout: set balance_ranks=False"
            )
        if value.dim() == 2:
            w = width_of[k]
            if k not in PROMPT_KEYS and (w != w[0]).any() and not (w == completion_width).all():
                raise ConfigError(
                    f"GRPO batch entry {k!r} differs in width between ranks and is neither a prompt nor a "
                    "completion tensor: set balance_ranks=False"
                )
            extra = int(w.max()) - value.shape[1]
            if extra:
                pad = value.new_full((rows, extra), pad_token_id if k == "prompt_ids" else 0)
                value = torch.cat([pad, value] if k in PROMPT_KEYS else [value, pad], dim=1)
        padded[k] = _gather(gather, value)
    prompt_len = padded["prompt_mask"].sum(1).cpu().numpy().astype(np.int64)
    completion_len = padded["completion_mask"].sum(1).cpu().numpy().astype(np.int64)
    cost = prompt_len + completion_len  # (world * rows,)
    rank_of, before, after = deal_to_ranks(cost, world)
    if rank_of is None:  # TRL's deal is as even already: nothing moves
        return batches, before, after
    mine = np.flatnonzero(rank_of == rank)
    slot_of = deal_equal_counts(cost[mine], accum)  # the rank's share into its micro-batches, evenly
    trimmed = [k for k in keys if padded[k].dim() == 2 and (width_of[k] == completion_width).all()]
    out = []
    for slot in range(accum):
        members = mine[slot_of == slot]
        index = torch.from_numpy(members).to(device)
        p = max(int(prompt_len[members].max()), 1)
        c = max(int(completion_len[members].max()), 1)
        batch: dict[str, Any] = {}
        for k, v in first.items():
            if v is None or v.dim() == 0:  # absent, or one value for the whole batch (num_items_in_batch)
                batch[k] = v
                continue
            picked = padded[k].index_select(0, index)
            if k in PROMPT_KEYS:
                picked = picked[:, picked.shape[1] - p :]
            elif k in trimmed:
                picked = picked[:, :c]
            batch[k] = picked.contiguous()
        out.append(batch)
    return out, before, after


def _gather(gather: Callable[[torch.Tensor], torch.Tensor], value: torch.Tensor) -> torch.Tensor:
    if value.dtype == torch.bool:  # not every backend gathers bool
        return gather(value.to(torch.uint8)).bool()
    return gather(value.contiguous())


__all__ = [
    "PARTITION_FREE_LOSSES",
    "balance_window",
    "deal_equal_counts",
    "deal_to_ranks",
    "partition_dependence",
]
