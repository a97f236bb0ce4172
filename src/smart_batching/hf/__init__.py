"""HF ``Trainer`` and accelerate glue: train with planned batches in one line.

::

    from smart_batching.hf import SmartBatchingTrainer

    trainer = SmartBatchingTrainer(
        model=model, args=args, train_dataset=tokenized,     # a datasets.Dataset with input_ids
        strategy="packed", strategy_options={"capacity": 4096},
    )
    trainer.train()

or, for a trainer that already exists (TRL's ``SFTTrainer`` or ``DPOTrainer``, your own subclass)::

    apply_smart_batching(trainer, "token_budget", max_tokens=16384)

``apply_smart_batching`` and ``with_smart_batching`` look the trainer's kind up (:mod:`.kinds`): each kind
is adapted by one sub-package (:mod:`.sft` for ``Trainer`` and ``SFTTrainer``, :mod:`.dpo` for
``DPOTrainer``) over the shared core below them (:mod:`.trainer`, :mod:`.data`, :mod:`.loss`, ...).

What it changes, and why:

* **The train DataLoader.** A :class:`~smart_batching.sampler.SmartBatchSampler` over the dataset's token
  lengths (read from Arrow list offsets, never row by row) is the ``batch_sampler``; the collator is
  :class:`~smart_batching.collate.PackingCollator` for ``packed`` and
  :class:`~smart_batching.collate.PaddingCollator` otherwise (unless you pass ``data_collator``). The
  DataLoader is built here, not by ``Trainer._get_dataloader``, and then handed to
  ``accelerator.prepare``. With one process accelerate keeps the batch sampler as is; with several it
  deals whole batches round-robin through ``BatchSamplerShard``, which drops nothing because the
  sampler has no ``batch_size`` (with a ``batch_size`` it would skip every round holding a smaller batch).
* **Packed attention.** For ``packed`` the model is switched to
  :func:`~smart_batching.attention.enable_packed_attention` (unless it already runs flash attention),
  and a model that would still let packed examples attend to each other is refused with
  :class:`~smart_batching.errors.ConfigError` before training starts. A guard checks every forward.
* **Loss.** transformers 5 already divides a summed token loss by ``num_items_in_batch`` (target tokens of
  the whole optimizer step) for models whose ``forward`` takes ``**kwargs``. For other models a
  :class:`~smart_batching.loss.TokenLoss` is installed as ``compute_loss_func`` and the token count is
  taken with the same label shift, so variable-size micro-batches are weighed by their tokens.
* **The LM head and precision.** For a causal LM the head runs only at the target positions, fused
  with the token loss where it is a plain ``Linear`` (:mod:`smart_batching.hf.lm_head`; no logits
  kept), its products in the dtype the device multiplies fast: under bf16 autocast (TRL's default)
  bf16 on CUDA and on CPUs with bf16 instructions, float32 on other CPUs (packed attention too).
  ``trainer.smart_batching.precision`` records the run's dtype, autocast, checkpointing and the CPU's
  bf16 support; bf16 on a CPU that runs it slowly is warned about once (:mod:`smart_batching.hf.precision`).
* **Resume.** Positioning is left to ``Trainer`` (it skips the batches already trained with
  ``skip_first_batches``; the plan is a pure function of ``(lengths, strategy, seed, epoch)``, so the
  remaining batches are the same). Each checkpoint also holds ``smart_batching_sampler.json``, the sampler
  cursor of the batches actually consumed; on resume it is checked against the dataset, strategy and
  seed (a changed one raises ``ConfigError`` naming it) and against where ``Trainer`` is about to
  resume (which disagrees if, e.g., ``gradient_accumulation_steps`` changed). Relying on both for
  positioning would skip the batches twice.

This module imports transformers; ``smart_batching`` itself does not import it.
"""

from __future__ import annotations

from smart_batching.errors import require

require("transformers", "hf")

from smart_batching.hf.data import (  # noqa: E402
    MODEL_INPUT_COLUMNS,
    dataset_lengths,
    default_pad_token_id,
    make_collator,
    model_input_dataset,
    smart_dataloader,
)
from smart_batching.hf.kinds import apply_smart_batching, with_smart_batching  # noqa: E402
from smart_batching.hf.packed_model import prepare_packed_model  # noqa: E402
from smart_batching.hf.resume import SAMPLER_STATE_NAME, read_sampler_state  # noqa: E402
from smart_batching.hf.trainer import SmartBatchingMixin, SmartBatchingTrainer  # noqa: E402

__all__ = [
    "MODEL_INPUT_COLUMNS",
    "SAMPLER_STATE_NAME",
    "SmartBatchingMixin",
    "SmartBatchingTrainer",
    "apply_smart_batching",
    "dataset_lengths",
    "default_pad_token_id",
    "make_collator",
    "model_input_dataset",
    "prepare_packed_model",
    "read_sampler_state",
    "smart_dataloader",
    "with_smart_batching",
]
