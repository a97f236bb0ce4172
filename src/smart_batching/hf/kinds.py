"""The trainer kinds, registered in matching order, and the entry points that look a trainer's kind up:
:func:`apply_smart_batching` and :func:`with_smart_batching`.

=================  ======================================================================================
kind               adapter
=================  ======================================================================================
``DPOTrainer``     :mod:`smart_batching.hf.dpo`: TRL's ``DPOTrainer``, preference pairs as units
``GRPOTrainer``    :mod:`smart_batching.hf.grpo`: TRL's ``GRPOTrainer`` and ``RLOOTrainer``, generated
                   completions grouped by prompt as units
``Trainer``        :mod:`smart_batching.hf.sft`: transformers' ``Trainer`` and its subclasses (TRL's
                   ``SFTTrainer``, yours), examples as units
=================  ======================================================================================

A trainer takes the first kind that recognises it. TRL's trainers subclass ``transformers.Trainer``, so
their kinds come before ``Trainer``, which matches any ``Trainer`` and comes last. Anything else is refused
by name with the kinds there are. Adding a kind is one sub-package of :mod:`smart_batching.hf` that
declares a :class:`~smart_batching.hf.adapter.TrainerKind`, and one entry in the loop below
(CONTRIBUTING.md, "Add a trainer kind").
"""

from __future__ import annotations

from typing import Any

from smart_batching import compat
from smart_batching.errors import ConfigError
from smart_batching.hf.adapter import TrainerKind
from smart_batching.hf.dpo import DPO
from smart_batching.hf.grpo import GRPO
from smart_batching.hf.sft import TRAINER
from smart_batching.planners import DEFAULT_STRATEGY

KINDS: dict[str, TrainerKind] = {}
"""``{name: kind}`` in matching order."""


def register(kind: TrainerKind, *, before: str | None = None) -> None:
    """Register ``kind`` (a new one, or replacing one of that name), matched before the kind named
    ``before`` (None: after every kind registered so far).

    Raises:
        ConfigError: ``kind`` is not a named :class:`~smart_batching.hf.adapter.TrainerKind`, or ``before``
            names no registered kind.
    """
    if not isinstance(kind, TrainerKind) or not kind.name:
        raise ConfigError(f"{kind!r} must be a TrainerKind with a name")
    order = [k for k in KINDS.values() if k.name != kind.name]
    names = [k.name for k in order]
    if before is not None and before not in names:
        raise ConfigError(f"register(before={before!r}): no such trainer kind; the kinds: {', '.join(names)}")
    order.insert(names.index(before) if before is not None else len(order), kind)
    KINDS.clear()
    KINDS.update((k.name, k) for k in order)


def unregister(name: str) -> None:
    """Remove a registered kind (tests that register a toy one)."""
    KINDS.pop(name, None)


# Most specific first: TRL's trainers subclass transformers.Trainer, the generic kind matches any of them.
for _kind in (DPO, GRPO, TRAINER):
    register(_kind)


def kind_names() -> tuple[str, ...]:
    """Every registered kind, in matching order."""
    return tuple(KINDS)


def kind_of(trainer: Any) -> TrainerKind:
    """The first registered kind that recognises ``trainer`` (an instance or a class).

    Raises:
        ConfigError: no kind recognises it; the message lists the kinds there are.
    """
    for kind in KINDS.values():
        if kind.recognises(trainer):
            return kind
    cls = trainer if isinstance(trainer, type) else type(trainer)
    kinds = "; ".join(f"{k.name} ({k.description})" for k in KINDS.values())
    online = compat.trl_online_trainer_name(cls)
    why = (
        f" TRL's {online} trains on completions it generates during training, which no registered kind "
        "plans yet: leave its batches to TRL."
        if online
        else ""
    )
    raise ConfigError(
        f"{cls.__module__}.{cls.__qualname__} is not a trainer kind smart batching supports.{why} "
        f"The kinds: {kinds}"
    )


def with_smart_batching(trainer_cls: type) -> type:
    """A subclass of ``trainer_cls`` (e.g. TRL's ``SFTTrainer`` or ``DPOTrainer``) with its kind's
    smart-batching overrides; the class itself when it has them already.

    Raises:
        ConfigError: ``trainer_cls`` is of no registered kind.
    """
    return kind_of(trainer_cls).with_class(trainer_cls)


def apply_smart_batching(trainer: Any, strategy: Any = DEFAULT_STRATEGY, **options: Any) -> Any:
    """Switch an existing trainer to planned batches, in place.

    The trainer's class is swapped for :func:`with_smart_batching` of it, so its own overrides (e.g.
    ``SFTTrainer.compute_loss``) stay in force. Call it before ``trainer.train()``.

    Args:
        trainer: A ``transformers.Trainer`` (or subclass) instance; TRL's ``DPOTrainer`` plans preference
            pairs (:mod:`smart_batching.hf.dpo`).
        strategy: A strategy name or spec.
        **options: ``strategy_options=``, ``lengths=``, ``seed=``, ... as in
            :meth:`~smart_batching.hf.trainer.SmartBatchingMixin.setup_smart_batching` (for a
            ``DPOTrainer``: :meth:`~smart_batching.hf.dpo.DPOSmartBatchingMixin.setup_smart_batching`), or
            the strategy's own fields directly (``max_tokens=16384``).

    Returns:
        The same trainer.

    Raises:
        ConfigError: a trainer of no registered kind, or an option its kind refuses (named, with what to do
            instead).
    """
    kind = kind_of(trainer)
    kind.refuse(options)
    return kind.apply(trainer, strategy, **options)


__all__ = [
    "KINDS",
    "apply_smart_batching",
    "kind_names",
    "kind_of",
    "register",
    "unregister",
    "with_smart_batching",
]
