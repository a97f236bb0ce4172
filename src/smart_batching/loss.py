"""Token-normalised losses for variable-size batches.

With a token budget or packing, micro-batches hold different numbers of target tokens. The loss of one
optimizer step must then be ``sum of token losses / target tokens in the whole step`` (all
gradient-accumulation micro-batches, all ranks), not the mean of per-micro-batch means, which weighs a
token of a short micro-batch more than one of a long micro-batch::

    micro-batch   target tokens   token-loss sum
    1             10              20.0
    2             90              90.0
    mean of means       (20/10 + 90/90) / 2 = 1.5
    token mean          (20 + 90) / (10 + 90) = 1.1      <- what one big batch would give

HF ``Trainer`` (transformers >= 4.46) already does this for models whose ``forward`` takes loss kwargs
(``**kwargs``): it counts ``num_items_in_batch`` over the accumulated micro-batches and the model divides
its summed loss by it. :class:`TokenLoss` gives the same for any model that returns ``logits``, as a
``compute_loss_func``.

"Target tokens" follow the causal-LM convention when ``shift_labels=True``: position ``i`` predicts
``labels[i + 1]``, so the first label of every row is never a target and only labels other than the
ignore index (``-100``) count.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100


def _targets(labels: torch.Tensor, shift_labels: bool) -> torch.Tensor:
    return labels[..., 1:] if shift_labels else labels


def count_target_tokens(
    labels: torch.Tensor | Iterable[torch.Tensor],
    *,
    shift_labels: bool = True,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Number of tokens that contribute to the loss (an int64 scalar tensor).

    Args:
        labels: ``(rows, tokens)`` labels, or an iterable of them (the micro-batches of one step).
        shift_labels: Causal LM convention: drop the first label of each row, which nothing predicts.
        ignore_index: Label value that is not a target.
    """
    if isinstance(labels, torch.Tensor):
        return _targets(labels, shift_labels).ne(ignore_index).sum()
    total = torch.zeros((), dtype=torch.int64)
    for lab in labels:
        total = total.to(lab.device) + _targets(lab, shift_labels).ne(ignore_index).sum()
    return total


def token_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, *, shift_labels: bool = True, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Sum over target tokens of the cross-entropy of ``logits`` against ``labels`` (fp32 scalar).

    Args:
        logits: ``(rows, tokens, vocab)``.
        labels: ``(rows, tokens)``; ``ignore_index`` marks tokens that are not targets (padding, prompt,
            the first token of each packed example).
        shift_labels: Causal LM: the logits at position ``i`` are scored against ``labels[i + 1]``.
        ignore_index: Label value that is not a target.
    """
    if shift_labels:
        logits = logits[..., :-1, :]
        labels = labels[..., 1:]
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1).to(logits.device),
        ignore_index=ignore_index,
        reduction="sum",
    )


def target_positions(
    labels: torch.Tensor, *, shift_labels: bool = True, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Sequence positions whose logits are scored in at least one row (a 1-D int64 tensor).

    Position ``t`` is kept when some row has a target at ``labels[:, t + 1]`` (``shift_labels``) or at
    ``labels[:, t]``. A causal LM computes its LM head only there with ``logits_to_keep=`` this tensor
    (prompt, padding and example-boundary positions are skipped). Never empty: with no target at all
    position 0 is kept, so the LM head still takes part in the backward pass (DDP expects every
    parameter to get a gradient).

    Args:
        labels: ``(rows, tokens)``.
        shift_labels: Causal LM convention (see :func:`token_loss_sum`).
        ignore_index: Label value that is not a target.
    """
    keep = _targets(labels, shift_labels).ne(ignore_index).any(dim=0).nonzero().flatten()
    if keep.numel() == 0:
        keep = torch.zeros(1, dtype=torch.long, device=labels.device)
    return keep


class _CrossEntropySum(torch.autograd.Function):
    """``F.cross_entropy(logits, targets, reduction="sum")`` with one softmax pass: the probabilities are
    kept from the forward pass and the backward pass is ``(p - onehot) × grad`` in place of a second
    exponential pass and a zero-filled (rows, vocab) buffer; about 1.5x faster for a large vocabulary.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        valid = targets.ne(ignore_index)
        safe = torch.where(valid, targets, 0)[:, None]
        p = torch.softmax(logits, dim=-1)
        picked = p.gather(1, safe).squeeze(1)
        token = -picked.log()
        # -log p underflows for a probability near 0 (a confident wrong answer): exact there by logsumexp.
        low = picked.lt(_TINY) & valid
        if bool(low.any()):
            rows = low.nonzero().squeeze(1)
            token[rows] = torch.logsumexp(logits[rows], -1) - logits[rows, safe[rows, 0]]
        ctx.save_for_backward(p, safe, valid)
        return (token * valid).sum()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        p, safe, valid = ctx.saved_tensors
        scale = (grad * valid).to(p.dtype)[:, None]
        g = p * scale
        g.scatter_add_(1, safe, -scale)
        return g, None, None


_TINY = torch.finfo(torch.float32).tiny * 2**10


def kept_token_loss_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    positions: torch.Tensor,
    *,
    shift_labels: bool = True,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """:func:`token_loss_sum` of logits computed only at ``positions`` (from :func:`target_positions`).

    Args:
        logits: ``(rows, len(positions), vocab)``, the model's logits at ``positions``.
        labels: ``(rows, tokens)``, the full labels.
        positions: the sequence positions the logits belong to.
        shift_labels: Causal LM: the logit at position ``t`` is scored against ``labels[:, t + 1]``.
        ignore_index: Label value that is not a target.
    """
    targets = _targets(labels, shift_labels)[:, positions.to(labels.device)]
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return _CrossEntropySum.apply(flat, targets.reshape(-1).to(logits.device), ignore_index)


class TokenLoss:
    """``sum of token losses / num_items_in_batch``: a ``compute_loss_func`` for HF ``Trainer``.

    ``Trainer`` passes ``num_items_in_batch``, the target tokens of the whole optimizer step (all
    accumulation micro-batches, summed over ranks when ``average_tokens_across_devices``). Without it
    (``None``) the loss is the token mean of this micro-batch.

    Args:
        shift_labels: Causal LM convention (see :func:`token_loss_sum`).
        ignore_index: Label value that is not a target.
    """

    def __init__(self, *, shift_labels: bool = True, ignore_index: int = IGNORE_INDEX) -> None:
        self.shift_labels = shift_labels
        self.ignore_index = ignore_index

    def __call__(
        self, outputs: Any, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        logits = outputs["logits"] if isinstance(outputs, dict) else getattr(outputs, "logits", None)
        if logits is None:
            logits = outputs[0]
        total = token_loss_sum(logits, labels, shift_labels=self.shift_labels, ignore_index=self.ignore_index)
        if num_items_in_batch is None:
            num_items_in_batch = count_target_tokens(
                labels, shift_labels=self.shift_labels, ignore_index=self.ignore_index
            )
        denom = torch.as_tensor(num_items_in_batch, device=total.device, dtype=total.dtype)
        return total / denom.clamp(min=1)

    def __repr__(self) -> str:
        return f"TokenLoss(shift_labels={self.shift_labels}, ignore_index={self.ignore_index})"


__all__ = [
    "IGNORE_INDEX",
    "TokenLoss",
    "count_target_tokens",
    "kept_token_loss_sum",
    "target_positions",
    "token_loss_sum",
]
