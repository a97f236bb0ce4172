"""The ``GRPOTrainer`` kind: TRL's ``GRPOTrainer`` and ``RLOOTrainer`` (and their subclasses), whose units
are the completions they generate, grouped by prompt (both score them with the same
``_get_per_token_logps_and_entropies``, the one method this kind replaces).

::

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=prompts)
    apply_smart_batching(trainer, "packed")        # each prompt once per group of completions

===============  ==========================================================================================
module           what it holds
===============  ==========================================================================================
``trainer``      :class:`GRPOSmartBatchingMixin`: the planned forward of the training pass
``rows``         completions read from TRL's padded batch, laid out with their prompt once per row group
``ranks``        every rank an equal share of each optimizer step's completions (``balance_ranks``)
``upstream``     ``GRPOConfig``'s options (:data:`~smart_batching.hf.grpo.upstream.GRPO_OPTIONS`), what the
                 kind accepts and refuses
===============  ==========================================================================================

:data:`GRPO` declares the kind for the registry (:mod:`smart_batching.hf.kinds`).
"""

from __future__ import annotations

from smart_batching import compat
from smart_batching.hf.adapter import TrainerKind
from smart_batching.hf.grpo.trainer import (
    GRPOSmartBatchingMixin,
    GRPOSmartBatchingState,
    apply_grpo_smart_batching,
    with_grpo_smart_batching,
)
from smart_batching.hf.grpo.upstream import COMPLETIONS, REFUSALS

GRPO = TrainerKind(
    name="GRPOTrainer",
    description=(
        "TRL's GRPOTrainer and RLOOTrainer and their subclasses: generated completions, grouped by prompt, "
        "are the units"
    ),
    recognises=compat.is_trl_grpo_trainer,
    apply=apply_grpo_smart_batching,
    with_class=with_grpo_smart_batching,
    refusals=REFUSALS,
    accepts=COMPLETIONS,
)

__all__ = [
    "GRPO",
    "GRPOSmartBatchingMixin",
    "GRPOSmartBatchingState",
    "apply_grpo_smart_batching",
    "with_grpo_smart_batching",
]
