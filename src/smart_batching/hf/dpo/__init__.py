"""The ``DPOTrainer`` kind: TRL's ``DPOTrainer`` (and its subclasses), whose units are preference pairs.

::

    trainer = DPOTrainer(model=model, ref_model=ref_model, args=DPOConfig(...), train_dataset=pairs,
                         processing_class=tokenizer)
    apply_smart_batching(trainer, "packed")        # one line: planned, packed, prompt-shared rows

===============  ==========================================================================================
module           what it holds
===============  ==========================================================================================
``trainer``      :class:`DPOSmartBatchingMixin`: the pairs' plan, rows, log-probabilities and step loss
``collate``      pair token counts and :class:`~smart_batching.hf.dpo.collate.PairCollator` (rows, TRL's view)
``model``        the hooks on the policy and reference (:class:`~smart_batching.hf.dpo.model.PairForward`)
``upstream``     ``DPOConfig``'s options (:data:`~smart_batching.hf.dpo.upstream.DPO_OPTIONS`), what the
                 kind accepts and refuses
``loop``         pairs for a loop of your own: :func:`preference_dataloader`, :func:`prepare_pair_model`,
                 :func:`pair_log_probs`
===============  ==========================================================================================

:data:`DPO` declares the kind for the registry (:mod:`smart_batching.hf.kinds`).
"""

from __future__ import annotations

from smart_batching import compat
from smart_batching.hf.adapter import TrainerKind
from smart_batching.hf.dpo.loop import pair_log_probs, preference_dataloader, prepare_pair_model
from smart_batching.hf.dpo.trainer import (
    DPOSmartBatchingMixin,
    DPOSmartBatchingState,
    apply_dpo_smart_batching,
    with_dpo_smart_batching,
)
from smart_batching.hf.dpo.upstream import PAIRS, REFUSALS

DPO = TrainerKind(
    name="DPOTrainer",
    description="TRL's DPOTrainer and its subclasses: preference pairs are the units",
    recognises=compat.is_trl_dpo_trainer,
    apply=apply_dpo_smart_batching,
    with_class=with_dpo_smart_batching,
    refusals=REFUSALS,
    accepts=PAIRS,
)

__all__ = [
    "DPO",
    "DPOSmartBatchingMixin",
    "DPOSmartBatchingState",
    "apply_dpo_smart_batching",
    "pair_log_probs",
    "preference_dataloader",
    "prepare_pair_model",
    "with_dpo_smart_batching",
]
