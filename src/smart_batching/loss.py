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

from smart_batching import compat
from smart_batching.units import IGNORE_INDEX


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


def kept_targets(labels: torch.Tensor, positions: torch.Tensor, *, shift_labels: bool = True) -> torch.Tensor:
    """``(rows, len(positions))`` the targets the logits at ``positions`` are scored against."""
    return _targets(labels, shift_labels)[:, positions.to(labels.device)]


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
    targets = kept_targets(labels, positions, shift_labels=shift_labels)
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return _CrossEntropySum.apply(flat, targets.reshape(-1).to(logits.device), ignore_index)


# Logits computed at a time by the fused LM head loss, never fewer than 64 tokens' worth. On CPU 2**23
# float32 logits (32 MiB, as much again for their exponentials; 170 tokens of a 49,152 vocabulary): of
# 2**20 to 2**25 the fastest on one core (AMD EPYC, 2,000 tokens: 2.97 s fp32, 1.47 s bf16; 2**20 took
# 3.9 s and 2.4 s). On accelerators 2**25 (128 MiB), fewer and larger products and kernel launches.
_CHUNK_LOGITS = 1 << 23
_CHUNK_LOGITS_ACCELERATOR = 1 << 25
_MIN_CHUNK_TOKENS = 64


class _LinearCrossEntropySum(torch.autograd.Function):
    """``sum_i CE(hidden_i @ weight.T + bias, targets_i)`` without the ``(tokens, vocab)`` logits.

    The logits are made ``chunk`` tokens at a time, in ``matmul_dtype``; the softmax runs in float32;
    the gradients of ``hidden``, ``weight`` and ``bias`` are formed in the same pass (``(p - onehot)``
    against the chunk's operands; the weight's summed in float32), so the backward pass only scales
    them by the incoming gradient: three matrix products per chunk, as the unfused forward and backward
    take, none of them recomputed. Optionally (``metrics``) also the entropy sum and the number of
    tokens whose target is the argmax (the first one on ties), without gradient.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        matmul_dtype: torch.dtype,
        metrics: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        device = hidden.device
        num, vocab = hidden.shape[0], weight.shape[0]
        want_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        zero = torch.zeros((), device=device, dtype=torch.float32)
        loss, entropy, correct = zero.clone(), zero.clone(), zero.clone()
        grad_hidden = torch.empty_like(hidden) if want_grad else None
        grad_weight = torch.zeros(weight.shape, device=device, dtype=torch.float32) if want_grad else None
        grad_bias = (
            torch.zeros(vocab, device=device, dtype=torch.float32) if want_grad and bias is not None else None
        )
        logits = _CHUNK_LOGITS if device.type == "cpu" else _CHUNK_LOGITS_ACCELERATOR
        chunk = max(_MIN_CHUNK_TOKENS, logits // max(vocab, 1))
        # Our own products run in matmul_dtype whatever autocast would pick for them.
        with torch.autocast(device.type, enabled=False):
            w = weight.to(matmul_dtype)
            b = None if bias is None else bias.to(matmul_dtype)
            for start in range(0, num, chunk):
                h = hidden[start : start + chunk].to(matmul_dtype)
                t = targets[start : start + chunk, None]
                z = (torch.mm(h, w.t()) if b is None else torch.addmm(b, h, w.t())).float()  # (n, vocab)
                z -= z.amax(dim=1, keepdim=True)
                p = torch.exp(z)
                total = p.sum(dim=1)
                log_total = total.log()
                picked = z.gather(1, t).squeeze(1)  # the target's logit less the row's largest
                loss += (log_total - picked).sum()
                p /= total[:, None]  # probabilities
                if metrics:
                    entropy += (log_total - torch.linalg.vecdot(p, z)).sum()
                    # The target is the argmax where its logit is the largest and no earlier one ties it;
                    # only those rows are searched.
                    top = picked.eq(0).nonzero().squeeze(1)
                    if top.numel():
                        correct += (z[top].argmax(dim=1) == t[top, 0]).sum()
                if want_grad:
                    p.scatter_add_(1, t, torch.full_like(t, -1.0, dtype=p.dtype))  # p - onehot
                    g = p.to(matmul_dtype)
                    grad_hidden[start : start + chunk] = torch.mm(g, w)
                    if matmul_dtype == torch.float32:
                        grad_weight.addmm_(g.t(), h)
                    else:  # summed in float32, not rounded to matmul_dtype chunk after chunk
                        grad_weight += torch.mm(g.t(), h).float()
                    if grad_bias is not None:
                        grad_bias += p.sum(dim=0)
        ctx.grads = (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
        )
        ctx.mark_non_differentiable(entropy, correct)
        return loss, entropy, correct

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple:
        scale = grad.float()
        out = tuple(None if g is None else (g * scale.to(g.dtype)) for g in ctx.grads)
        return (*out[:2], out[2], None, None, None)


def linear_token_loss_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    matmul_dtype: torch.dtype | None = None,
    ignore_index: int = IGNORE_INDEX,
    metrics: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The LM head and :func:`token_loss_sum` in one pass, without the ``(tokens, vocab)`` logits.

    The loss of the logits ``hidden @ weight.T + bias`` against ``targets`` (no shift: ``targets[i]``
    is what ``hidden[i]`` predicts), summed over the tokens whose target is not ``ignore_index``.
    Only those tokens go through the head. The logits are computed a few thousand at a time in
    ``matmul_dtype`` and never held whole; the softmax is float32.

    Args:
        hidden: ``(..., hidden_size)`` hidden states.
        weight: ``(vocab, hidden_size)``, the LM head's weight.
        bias: ``(vocab,)`` or None.
        targets: ``hidden.shape[:-1]`` token ids.
        matmul_dtype: The dtype of the three matrix products (logits, input and weight gradients);
            None: autocast's dtype where autocast is on, else ``weight.dtype``
            (see :func:`smart_batching.compat.matmul_dtype` for one that is fast on this device).
        ignore_index: Target value that is not scored.
        metrics: Also return the entropy sum and the number of tokens predicted right (argmax).

    Returns:
        ``(loss_sum, entropy_sum, num_correct, num_scored)``: float32 scalars, the last three without
        gradient (``entropy_sum`` and ``num_correct`` are 0 unless ``metrics``).
    """
    flat = hidden.reshape(-1, hidden.shape[-1])
    wanted = targets.reshape(-1).to(flat.device)
    rows = wanted.ne(ignore_index).nonzero().squeeze(1)
    if matmul_dtype is None:
        matmul_dtype = compat.autocast_dtype(flat.device.type, weight.dtype)
    loss, entropy, correct = _LinearCrossEntropySum.apply(
        flat[rows], weight, bias, wanted[rows], matmul_dtype, metrics
    )
    return loss, entropy, correct, torch.as_tensor(rows.numel(), device=flat.device, dtype=torch.float32)


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
    "kept_targets",
    "kept_token_loss_sum",
    "linear_token_loss_sum",
    "target_positions",
    "token_loss_sum",
]
