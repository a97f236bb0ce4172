"""The ``Trainer`` kind: transformers' ``Trainer`` and its subclasses (TRL's ``SFTTrainer``, your own), whose
units are examples (or the documents of TRL's packed rows).

Its adapter is :class:`~smart_batching.hf.trainer.SmartBatchingMixin` mixed into the trainer's class:
the trainer's own overrides (``SFTTrainer.compute_loss``) stay in force. :data:`TRAINER` declares it for
the registry (:mod:`smart_batching.hf.kinds`); it is matched last, after the kinds of TRL's trainers that
subclass ``Trainer``.
"""

from __future__ import annotations

from typing import Any

from smart_batching import compat
from smart_batching.hf.adapter import TrainerKind, mixed_class, split_options
from smart_batching.hf.trainer import SmartBatchingMixin
from smart_batching.planners import DEFAULT_STRATEGY


def with_trainer_smart_batching(trainer_cls: type) -> type:
    """A subclass of ``trainer_cls`` (a ``Trainer``, e.g. TRL's ``SFTTrainer``) with the smart-batching
    overrides; the class itself when it has them already."""
    return mixed_class(SmartBatchingMixin, trainer_cls)


def apply_trainer_smart_batching(trainer: Any, strategy: Any = DEFAULT_STRATEGY, **options: Any) -> Any:
    """Switch a ``Trainer`` to planned batches in place: its class is swapped for
    :func:`with_trainer_smart_batching` of it, options of
    :meth:`~smart_batching.hf.trainer.SmartBatchingMixin.setup_smart_batching` go there, the rest are the
    strategy's fields."""
    setup = split_options(SmartBatchingMixin.setup_smart_batching, options)
    trainer.__class__ = with_trainer_smart_batching(type(trainer))
    trainer.setup_smart_batching(strategy, **setup)
    return trainer


def _recognises(trainer: Any) -> bool:
    # TRL's online trainers subclass Trainer but train on completions they generate: GRPOTrainer has its
    # own kind (matched first); the others are refused by name rather than planned as examples.
    return compat.is_hf_trainer(trainer) and compat.trl_online_trainer_name(trainer) is None


TRAINER = TrainerKind(
    name="Trainer",
    description=(
        "transformers.Trainer and its subclasses (TRL's SFTTrainer, yours; not TRL's online trainers, which "
        "generate their own completions): examples are the units"
    ),
    recognises=_recognises,
    apply=apply_trainer_smart_batching,
    with_class=with_trainer_smart_batching,
    accepts=SmartBatchingMixin.sb_accepts,
)

__all__ = ["TRAINER", "apply_trainer_smart_batching", "with_trainer_smart_batching"]
