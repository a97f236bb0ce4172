"""A toy trainer kind, outside the package: what a new kind needs (the sub-package's mixin over the shared
core, a ``TrainerKind``, one ``register``), in one screen.

``ToyTrainer`` is a ``transformers.Trainer`` subclass of its own, so its kind is registered before the
generic ``Trainer`` kind, which would claim it too. Its units are examples that are never cut (no
``'truncate'`` or ``'split'``), its budgets are numbers (no ``'auto'``), and it refuses ``oom_backoff``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from transformers import Trainer

from smart_batching.errors import ConfigError
from smart_batching.hf.adapter import Accepts, TrainerKind, refuse_overlong, split_options
from smart_batching.hf.data import dataset_lengths
from smart_batching.hf.trainer import SmartBatchingMixin
from smart_batching.planners import DEFAULT_STRATEGY

WHOLE = Accepts(unit="example", auto_budget=False, overlong=("error", "drop"))


class ToyTrainer(Trainer):
    """A trainer of its own kind (a plain ``Trainer`` otherwise)."""


class ToySmartBatchingMixin(SmartBatchingMixin):
    sb_accepts: ClassVar[Accepts] = WHOLE

    def setup_smart_batching(self, strategy: Any = DEFAULT_STRATEGY, **options: Any) -> None:
        given = dict(options.get("strategy_options") or {})
        if "auto" in (given.get("max_tokens"), given.get("capacity")):
            raise ConfigError(f"max_tokens='auto' is not available for a ToyTrainer: {WHOLE.budget_advice()}")
        if given.get("overlong", "error") not in WHOLE.overlong:
            raise ConfigError("a ToyTrainer never cuts an example: set overlong='error' or 'drop'")
        super().setup_smart_batching(strategy, **options)

    def make_train_sampler(self) -> Any:
        refuse_overlong(dataset_lengths(self.train_dataset), self.smart_batching.spec, self.sb_accepts)
        return super().make_train_sampler()


_MIXED: dict[type, type] = {}


def with_toy(cls: type) -> type:
    if issubclass(cls, ToySmartBatchingMixin):
        return cls
    return _MIXED.setdefault(cls, type(f"SmartBatching{cls.__name__}", (ToySmartBatchingMixin, cls), {}))


def apply_toy(trainer: Any, strategy: Any = DEFAULT_STRATEGY, **options: Any) -> Any:
    setup = split_options(SmartBatchingMixin.setup_smart_batching, options)
    trainer.__class__ = with_toy(type(trainer))
    trainer.setup_smart_batching(strategy, **setup)
    return trainer


def _is_toy(trainer: Any) -> bool:
    return issubclass(trainer, ToyTrainer) if isinstance(trainer, type) else isinstance(trainer, ToyTrainer)


TOY = TrainerKind(
    name="ToyTrainer",
    description="a toy: examples as units, never cut",
    recognises=_is_toy,
    apply=apply_toy,
    with_class=with_toy,
    refusals={"oom_backoff": "the toy trains whole steps; remove it"},
    accepts=WHOLE,
)
