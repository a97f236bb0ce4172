"""The LM head fused with the token loss, inside the model's own forward.

For one forward, the model's LM head (``lm_head``, a plain ``torch.nn.Linear``) is replaced by
:func:`~smart_batching.loss.linear_token_loss_sum` over the positions ``logits_to_keep`` selects: the
forward returns that loss sum where it would return the logits. The head still runs inside the model's
forward, so DDP, FSDP and accelerate's autocast wrapper see an ordinary forward, and no
``(tokens, vocab)`` logits are made::

    model(**batch, logits_to_keep=keep)
      backbone -> hidden (rows, seq, H) -> hidden[:, keep] (rows, K, H)
      lm_head(hidden[:, keep])            # replaced for this call:
        = sum of CE(hidden[:, keep] @ W.T, targets)   (float32 scalar, in chunks, no logits kept)
      -> outputs.logits is that scalar

Its matrix products run in the dtype the device runs fast
(:func:`smart_batching.compat.matmul_dtype`): under bf16 autocast that is bf16 on CUDA and on CPUs with
bf16 instructions, and float32 on CPUs without them, where a bf16 product takes ATen's reference GEMM.
A model that transforms the head's output before returning it (rescaling, softcapping) returns
something else than the scalar; :meth:`FusedHead.loss` then says so (None, with the ``reason``) and
the caller computes the logits instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from smart_batching import compat
from smart_batching.loss import IGNORE_INDEX, linear_token_loss_sum


class FusedHead:
    """Context manager: ``head`` computes the token loss of ``targets`` instead of logits, for one call.

    Args:
        head: The model's LM head (a ``torch.nn.Linear``, from :func:`smart_batching.compat.plain_lm_head`).
        targets: ``(rows, K)`` target ids at the kept positions (``-100``: not scored).
        metrics: Also compute the entropy sum and the number of argmax hits (TRL's logged metrics).
    """

    def __init__(self, head: torch.nn.Linear, targets: torch.Tensor, *, metrics: bool = False) -> None:
        self.head = head
        self.targets = targets
        self.metrics = metrics
        self.calls = 0
        self.matmul_dtype: torch.dtype | None = None
        self.result: tuple[torch.Tensor, ...] | None = None
        self.reason: str | None = None

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        head = self.head
        if self.calls > 1:
            self.reason = "the forward calls its LM head more than once"
        elif hidden.shape[:-1] != self.targets.shape:
            self.reason = "the forward does not apply its LM head to the logits_to_keep positions only"
        elif type(head.weight.data) is not torch.Tensor:
            self.reason = f"the LM head's weight is a {type(head.weight.data).__name__} (tensor parallelism)"
        if self.reason is not None:
            # Not the one plain call over the kept positions we prepared for: the real head, no fused loss.
            self.result = None
            return torch.nn.functional.linear(hidden, head.weight, head.bias)
        device = hidden.device.type
        self.matmul_dtype = compat.matmul_dtype(device, compat.autocast_dtype(device, head.weight.dtype))
        self.result = linear_token_loss_sum(
            hidden,
            head.weight,
            head.bias,
            self.targets,
            matmul_dtype=self.matmul_dtype,
            ignore_index=IGNORE_INDEX,
            metrics=self.metrics,
        )
        return self.result[0]

    def __enter__(self) -> FusedHead:
        self.head.forward = self._forward  # an instance attribute: nn.Module.__call__ runs it, hooks included
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.head.forward

    def loss(self, outputs: Any) -> tuple[torch.Tensor, ...] | None:
        """``(loss_sum, entropy_sum, num_correct, num_scored)`` if the forward returned the fused loss as
        its logits unchanged, else None (the model transformed the head's output or called it again)."""
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        if self.result is not None and logits is not self.result[0]:
            self.reason = "the forward transforms its LM head's output"
        if self.reason is not None:
            return None
        return self.result
