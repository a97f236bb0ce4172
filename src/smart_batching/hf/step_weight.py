"""``loss_normalization="epoch"``: every target token weighs alike in an optimizer step's update, also
when gradient clipping binds.

The Trainer's loss of a step is the sum of its token losses over ``n``, the step's own target tokens
(``num_items_in_batch``), and the gradient ``g = (1/n) sum_t grad l_t`` is clipped to
``max_grad_norm = c``. Where clipping binds (``|g| > c``, as at every step of a fine-tune whose
gradient norms sit far above 1.0), the update is ``c * g / |g|``: one step's worth whatever the step
holds, so a token of a step with few targets weighs more than one of a step with many. Length-grouped
steps (``group_by_length``, best-fit-decreasing ``packed`` rows) make ``n`` follow the length stratum,
and the strata are weighed unevenly.

With ``"epoch"`` the loss is normalised by ``M``, the plan's mean target tokens per optimizer step (a
constant for the run), and the clipping threshold of each step is ``c * n / M``::

    g' = (1/M) sum_t grad l_t = (n/M) g          clip at c' = c n/M

    |g| <= c (not binding):  update g' = (1/M) sum_t grad l_t        every token weighs 1/M
    |g| >  c (binding):      update c' g'/|g'| = (n/M) * c g/|g|     n/M times the default update

so whether a step clips is decided exactly as before (``|g'| > c'`` iff ``|g| > c``), and a clipped
step moves the model in proportion to the tokens it holds: its per-token weight is
``c / (M |mean_t grad l_t|)``, with no ``1/n`` left in it (the factor ``1/|mean grad|`` is what
clipping does to every batch, random ones too). The value of ``M`` only sets the overall scale (any
constant weighs every token alike); the mean makes the average step as large as the default's.

The implementation is that same update in the form the Trainer already computes: the loss stays the
step mean (``num_items_in_batch``: the logged loss and the gradient norm mean what they always did),
HF's clipping runs unchanged (``Trainer._clip_grad_norm`` -> ``accelerator.clip_grad_norm_``), and the
clipped gradients are multiplied by ``n / M`` before the optimizer step (the event the Trainer fires
after clipping, :data:`smart_batching.compat.CLIPPED_GRADIENTS_EVENT`): ``min(1, c/|g|) g * n/M``, the
same as the two lines above. An SGD step then moves the parameters by exactly that; AdamW's step divides by its running
second moment, so there the steps enter its first moment in proportion to their tokens (a clipped step
of few tokens no longer counts as much as one of many) rather than moving the weights in proportion.

Holds on one process and on several (``n`` is the step's target tokens over every rank, so
``average_tokens_across_devices`` must be on, the default; ``M`` is the plan's targets over every rank
per optimizer step). Refused with a streamed ``train_dataset`` (no plan to take the mean of in
advance), a ``batch_schedule`` (steps of deliberately different sizes) and DeepSpeed (it owns the
gradients).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from smart_batching import compat
from smart_batching.data.lengths import dataset_target_counts
from smart_batching.errors import ConfigError
from smart_batching.hf.data import _is_iterable, checked_lengths

LOSS_NORMALIZATIONS = ("step", "epoch")
"""``loss_normalization`` values: ``"step"`` (HF's ``num_items_in_batch``, the default) and ``"epoch"``."""


def check_loss_normalization(value: str) -> str:
    if value not in LOSS_NORMALIZATIONS:
        raise ConfigError(f"loss_normalization={value!r} must be one of {', '.join(LOSS_NORMALIZATIONS)}")
    return value


def target_token_counts(dataset: Any, lengths: np.ndarray) -> np.ndarray:
    """(num_rows,) target tokens of every row of a ``datasets.Dataset``, as the loss counts them (the
    first token of a row is never a target: nothing predicts it).

    :func:`smart_batching.data.lengths.dataset_target_counts` (the planner's rule): a ``labels`` list
    column (labels other than -100), one label per row (classification: 1), else ``completion_mask`` /
    ``assistant_masks`` and ``prompt_length``, else every token after the first.

    Raises:
        ConfigError: ``dataset`` is not a ``datasets.Dataset`` (nothing to read the targets from in bulk).
    """
    columns = getattr(dataset, "column_names", None) or []
    if not (columns and hasattr(dataset, "data") and "input_ids" in columns):
        raise ConfigError(
            "loss_normalization='epoch' reads the target tokens of every example from a datasets.Dataset "
            "with input_ids; pass one, or keep loss_normalization='step'"
        )
    return dataset_target_counts(dataset, lengths)


def mean_step_targets(counts: np.ndarray, micro_batches: int, accumulation_steps: int) -> float:
    """``M``: the plan's target tokens per optimizer step (all ranks' targets over the steps of one
    epoch of ``micro_batches`` per rank, ``accumulation_steps`` to a step)."""
    steps = max(1, math.ceil(micro_batches / max(1, accumulation_steps)))
    return max(1.0, float(np.sum(counts)) / steps)


class EpochNormalization(TrainerCallback):
    """Multiplies the clipped gradients of each optimizer step by ``n / M`` (module docstring):
    ``step_targets`` is set per step by the trainer from its ``num_items_in_batch``."""

    def __init__(self, mean_targets: float | None = None) -> None:
        self.mean_targets = mean_targets
        self.step_targets: float | None = None
        self.factors: list[float] = []
        """Every step's ``n / M``, in order."""

    def scale_clipped(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """The handler of :data:`~smart_batching.compat.CLIPPED_GRADIENTS_EVENT`: the step's clipped
        gradients times ``n / M``."""
        if self.step_targets is None or self.mean_targets is None:
            raise ConfigError(
                "loss_normalization='epoch' needs the step's target tokens (num_items_in_batch), and this "
                "trainer's loss gave none (a compute_loss_func of the caller's or a label smoother): keep "
                "loss_normalization='step'"
            )
        factor = self.step_targets / self.mean_targets
        with torch.no_grad():
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, factor)
        self.factors.append(factor)
        self.step_targets = None


setattr(EpochNormalization, compat.CLIPPED_GRADIENTS_EVENT, EpochNormalization.scale_clipped)


class StepWeightMixin:
    """Trainer overrides for ``loss_normalization`` (state: ``self.smart_batching.epoch_normalization``)."""

    def _setup_step_weight(self, loss_normalization: str) -> None:
        state = self.smart_batching
        state.loss_normalization = check_loss_normalization(loss_normalization)
        while any(isinstance(c, EpochNormalization) for c in self.callback_handler.callbacks):
            self.remove_callback(EpochNormalization)  # set up again: the earlier one goes
        if loss_normalization == "step":
            return
        if self.train_dataset is not None and _is_iterable(self.train_dataset):
            raise ConfigError(
                "loss_normalization='epoch' needs the whole plan in advance, and a streamed train_dataset "
                "has none: keep loss_normalization='step' or pass a map-style dataset"
            )
        if state.batch_schedule is not None:
            raise ConfigError(
                "loss_normalization='epoch' and batch_schedule= together: a schedule makes steps of "
                "different sizes on purpose; keep loss_normalization='step' or drop batch_schedule"
            )
        if compat.trainer_uses_deepspeed(self):
            raise ConfigError("loss_normalization='epoch' scales gradients that DeepSpeed owns: keep 'step'")
        if self.args.world_size > 1 and not self.args.average_tokens_across_devices:
            raise ConfigError(
                "loss_normalization='epoch' on several processes needs the step's targets over every rank: "
                "set TrainingArguments(average_tokens_across_devices=True)"
            )
        state.epoch_normalization = EpochNormalization()
        self.add_callback(state.epoch_normalization)

    def _plan_step_weight(self, sampler: Any) -> None:
        """Set ``M`` from the first epoch's plan (called when the train sampler is made)."""
        state = self.smart_batching
        norm = state.epoch_normalization
        if norm is None or norm.mean_targets is not None:
            return
        lengths = checked_lengths(self.train_dataset, state.lengths, state.length_column)
        counts = target_token_counts(self.train_dataset, lengths)
        norm.mean_targets = mean_step_targets(counts, len(sampler), self.args.gradient_accumulation_steps)

    def get_batch_samples(
        self, epoch_iterator: Any, num_batches: int, device: torch.device
    ) -> tuple[list, Any]:
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        norm = self.smart_batching.epoch_normalization
        if norm is not None and batch_samples:
            norm.step_targets = None if num_items is None else float(num_items)
        return batch_samples, num_items
