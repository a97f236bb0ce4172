"""The loss of a step in the Trainer: summed token losses over the target tokens of the whole step
(accumulation micro-batches and ranks), for models with and without loss kwargs, and the LM head
computed only at the target positions where that is exact."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from transformers import Trainer

from smart_batching import compat
from smart_batching.fallbacks import warn_fallback
from smart_batching.hf.lm_head import FusedHead
from smart_batching.hf.precision import dtype_name
from smart_batching.loss import (
    IGNORE_INDEX,
    count_target_tokens,
    kept_targets,
    kept_token_loss_sum,
    target_positions,
)

logger = logging.getLogger("smart_batching.hf")


class TokenLossMixin:
    """Trainer overrides for the loss; state (``self.smart_batching``: ``token_loss``, ``target_logits_only``) is set by
    :meth:`~smart_batching.hf.SmartBatchingMixin.setup_smart_batching`."""

    def get_batch_samples(
        self, epoch_iterator: Any, num_batches: int, device: torch.device
    ) -> tuple[list, Any]:
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.smart_batching.token_loss is not None and batch_samples and "labels" in batch_samples[0]:
            # Count with the same shift TokenLoss uses (Trainer's own count follows the model's loss_type).
            n = count_target_tokens(
                [b["labels"] for b in batch_samples], shift_labels=self.smart_batching.token_loss.shift_labels
            ).to(device)
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                n = self.accelerator.gather(n).sum()
            num_items = n
        return batch_samples, num_items

    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """``Trainer.compute_loss``, with the LM head computed only where the loss looks (training only).

        The loss is the same sum of token cross-entropies over ``num_items_in_batch`` that the model
        (or :class:`~smart_batching.loss.TokenLoss`) computes from full logits; see ``target_logits_only``
        in :meth:`setup_smart_batching` for when this path is taken. Where the LM head is a plain
        ``Linear`` (:func:`smart_batching.compat.plain_lm_head`) it runs fused with the loss
        (:mod:`smart_batching.hf.lm_head`): no logits are kept, and its products run in the dtype the
        device multiplies fast (float32 under bf16 autocast on a CPU without bf16 instructions).
        """
        if not (
            num_items_in_batch is not None
            and "labels" in inputs
            and getattr(model, "training", False)
            and self._target_logits_apply(model)
        ):
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        shifted = inputs.pop("shift_labels", None)  # labels already shifted by the collator
        targets, shift = (labels, True) if shifted is None else (shifted, False)
        keep = target_positions(targets, shift_labels=shift)
        fused = None if return_outputs else self._fused_head(model)
        total = None
        if fused is not None:
            kept = kept_targets(targets, keep, shift_labels=shift)
            with FusedHead(fused, kept, metrics=self.smart_batching.trl_metrics) as head:
                outputs = model(**inputs, logits_to_keep=keep)
            result = head.loss(outputs)
            if result is None:
                self._fused_head_failed(head.reason)
            else:
                total, entropy, correct, scored = result
                precision = self.smart_batching.precision
                if "lm_head_matmul" not in precision:
                    precision["lm_head_matmul"] = dtype_name(head.matmul_dtype)
                if self.smart_batching.trl_metrics:
                    compat.log_trl_sft_metrics(self, inputs, entropy, correct, scored)
        if total is None:
            outputs = model(**inputs, logits_to_keep=keep)
            logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
            total = kept_token_loss_sum(logits, targets, keep, shift_labels=shift)
            if self.smart_batching.trl_metrics:
                self._log_trl_metrics(logits, targets, keep, shift, inputs)
        loss = total / torch.as_tensor(num_items_in_batch, device=total.device, dtype=total.dtype)
        if self.args.average_tokens_across_devices:
            # As Trainer.compute_loss: num_items_in_batch counts every rank's tokens, DDP averages gradients.
            loss_scale = self.accelerator.num_processes // self.get_tp_size()
            loss = loss * (loss_scale if self.args.n_gpu <= 1 else self.args.n_gpu)
        return (loss, outputs) if return_outputs else loss

    def _fused_head(self, model: Any) -> torch.nn.Linear | None:
        """The LM head to fuse with the loss (:mod:`smart_batching.hf.lm_head`), or None to compute the
        logits at the target positions and the loss from them (decided once per trainer)."""
        state = self.smart_batching
        if state.fused_head is False:
            return None
        head, reason = compat.plain_lm_head(self.accelerator.unwrap_model(model))
        if state.fused_head is None:
            state.fused_head = head is not None
            if reason is not None:
                logger.info("smart batching: the LM head is not fused with the loss: %s", reason)
        return head

    def _fused_head_failed(self, reason: str | None) -> None:
        """The forward did not return the fused loss as its logits: from now on the logits are computed,
        at the target positions. Said once; the step is recomputed."""
        self.smart_batching.fused_head = False
        warn_fallback(
            "trainer.fused_lm_head",
            f"the LM head is not fused with the loss because {reason}: the logits at the target positions "
            "are computed and kept for the loss (the same loss and gradients, more memory). Nothing to change.",
            stacklevel=3,
        )

    def _log_trl_metrics(
        self, logits: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor, shift: bool, inputs: Mapping
    ) -> None:
        """``SFTTrainer``'s entropy and token accuracy, from the logits at the target positions (the
        positions TRL's fused LM head scores), so they are the values TRL would log."""
        with torch.no_grad():
            scored = kept_targets(targets, keep, shift_labels=shift)
            flat = logits.reshape(-1, logits.shape[-1]).float()
            wanted = scored.reshape(-1).to(flat.device)
            valid = wanted.ne(IGNORE_INDEX)
            flat, wanted = flat[valid], wanted[valid]
            logp = torch.log_softmax(flat, dim=-1)
            entropy = -(logp.exp() * logp).sum()
            correct = (flat.argmax(dim=-1) == wanted).sum()
        compat.log_trl_sft_metrics(self, inputs, entropy, correct, valid.sum())

    def _target_logits_apply(self, model: Any) -> bool:
        """Whether the target-only-logits loss is exact for this trainer and model (decided once).

        Where ``target_logits_only`` (the default) cannot be kept for a causal LM, the full-logits loss
        runs instead (same loss, slower), with one :class:`~smart_batching.fallbacks.FallbackWarning`
        naming the reason."""
        if self.smart_batching.target_logits is None:
            reason = self._target_logits_blocker(model)
            self.smart_batching.target_logits = reason is None
            self.smart_batching.trl_metrics = reason is None and self._loss_override() is not None
            if reason is None:
                logger.info("smart batching: the LM head runs only at target positions (target_logits_only)")
            elif self._loss_override() is not None and compat.has_trl_fused_lm_head(
                self.accelerator.unwrap_model(model)
            ):
                # Not a slower path: TRL's fused LM head already scores target positions only.
                logger.info("smart batching: TRL's fused LM head runs the LM head only at target positions")
            elif self.smart_batching.target_logits_only and reason != _NOT_CAUSAL:
                warn_fallback(
                    "trainer.target_logits",
                    f"the LM head runs at every position (full logits), not only at target positions, "
                    f"because {reason}; the loss is the same, training is slower. Pass "
                    "target_logits_only=False to choose this path (and silence this warning).",
                    stacklevel=2,
                )
        return self.smart_batching.target_logits

    def _loss_override(self) -> type | None:
        """The subclass whose ``compute_loss`` runs instead of ``Trainer``'s (e.g. ``SFTTrainer``), or None."""
        mro = type(self).__mro__
        after = mro[mro.index(TokenLossMixin) + 1 :]
        first = next((c for c in after if "compute_loss" in vars(c)), None)
        return None if first is Trainer else first

    def _target_logits_blocker(self, model: Any) -> str | None:
        """Why target-only logits are not exact here; None if they are."""
        if not self.smart_batching.target_logits_only:
            return "target_logits_only=False"
        if not _detect_shift_labels(self):
            return _NOT_CAUSAL
        if self.label_smoother is not None:
            return "a label smoother reads every position's logits (label_smoothing_factor > 0)"
        token_loss = self.compute_loss_func is None and self.model_accepts_loss_kwargs
        ours = (
            self.smart_batching.token_loss is not None
            and self.compute_loss_func is self.smart_batching.token_loss
        )
        if not (token_loss or ours):
            return "a compute_loss_func of the caller's reads the full logits"
        if ours and not self.smart_batching.token_loss.shift_labels:
            return "shift_labels=False: the loss does not shift labels as a causal LM does"
        # A subclass's compute_loss (e.g. TRL's SFTTrainer, with its own metrics) wins.
        first = self._loss_override()
        if first is not None and not compat.trl_sft_loss_is_plain_nll(self):
            return f"{first.__name__}.compute_loss overrides the loss and may read the full logits"
        # Past here a loss override is TRL's SFTTrainer with its plain NLL: the same loss is computed
        # here, and its metrics are logged as it logs them (see _target_logits_apply).
        unwrapped = self.accelerator.unwrap_model(model)
        if getattr(getattr(unwrapped, "config", None), "output_router_logits", False):
            return "the model adds a router auxiliary loss (output_router_logits=True)"
        if compat.sequence_parallel_enabled(self.accelerator):
            return "sequence parallelism splits each sequence across ranks"
        if not compat.forward_accepts(unwrapped, "logits_to_keep"):
            return f"{type(unwrapped).__name__}.forward takes no logits_to_keep"
        return None


_NOT_CAUSAL = "the model is not a causal LM"


def _detect_shift_labels(trainer: Any) -> bool:
    if getattr(trainer, "_loss_shifts_labels", False):
        return True
    model = trainer.accelerator.unwrap_model(trainer.model)
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    causal = compat.causal_lm_class_names()
    # Subclasses of a causal LM (a wrapper with a narrower forward) shift like their parent.
    return any(c.__name__ in causal or c.__name__.endswith("ForCausalLM") for c in type(model).__mro__)
