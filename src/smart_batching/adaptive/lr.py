"""The learning rate of a step whose size the schedule changed: ``lr_scaling="sqrt" | "linear" | None``.

With ``lr_scaling``, optimizer step ``s`` of size ``B_s`` (tokens or examples, as the schedule counts)
trains at ``lr(s) * (B_s / B_0) ** p``, where ``lr(s)`` is what the Trainer's learning-rate scheduler
gives (warm-up, decay), ``B_0`` the schedule's first size (the size ``learning_rate`` was chosen for) and

* ``p = 1/2`` (``"sqrt"``): the square-root rule for Adam-type optimizers, as OLMo-core's
  ``BatchSizeSchedulerCallback`` applies it (base learning rate times ``sqrt(new / current)`` at each
  change of the global batch size; Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive
  Gradient Algorithms", derive it);
* ``p = 1`` (``"linear"``): the linear scaling rule for SGD of Goyal et al. 2017, "Accurate, Large
  Minibatch SGD: Training ImageNet in 1 Hour" (learning rate proportional to the batch size);
* ``None`` (the default): the scheduler's learning rate unchanged, as Megatron-LM's ramp and GPT-3's
  (Brown et al. 2020) keep it.

``B_s`` is the schedule's size at the step (its target), not the tokens the step happened to realise,
so the factor is smooth and the same on every rank. The factor multiplies the scheduler's value and
never compounds: it is applied inside the scheduler's ``lr_lambda``, a pure function of the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from smart_batching.errors import ConfigError

LR_SCALINGS = ("sqrt", "linear")
_POWER = {"sqrt": 0.5, "linear": 1.0}


def check_lr_scaling(value: Any) -> str | None:
    """``value`` if it is one of :data:`LR_SCALINGS` or None.

    Raises:
        ConfigError: anything else, naming the choices.
    """
    if value is None or value in LR_SCALINGS:
        return value
    raise ConfigError(f"lr_scaling={value!r} must be one of {', '.join(map(repr, LR_SCALINGS))} or None")


def lr_factors(step_sizes: Any, lr_scaling: str | None, reference: int) -> np.ndarray:
    """Learning-rate factor of each step: ``(size / reference) ** p`` (see the module docstring).

    Args:
        step_sizes: (num_steps,) the schedule's size at each optimizer step.
        lr_scaling: ``"sqrt"``, ``"linear"`` or None (all ones).
        reference: The size the configured learning rate is for (the schedule's first size).

    Returns:
        (num_steps,) float64 factors.
    """
    sizes = np.asarray(step_sizes, dtype=np.float64)
    if check_lr_scaling(lr_scaling) is None:
        return np.ones_like(sizes)
    if reference < 1:
        raise ConfigError(f"lr_scaling: the reference size must be positive, got {reference}")
    return (sizes / float(reference)) ** _POWER[lr_scaling]


def scale_lr_lambdas(scheduler: Any, factor: Callable[[int], float]) -> None:
    """Multiply the learning rate of a ``torch.optim.lr_scheduler.LambdaLR`` by ``factor(step)``.

    Every scheduler ``transformers.get_scheduler`` makes (except ``reduce_lr_on_plateau``) is a
    ``LambdaLR``: its learning rate at step ``s`` is ``base_lr * lr_lambda(s)``, recomputed from the base
    each step, so wrapping ``lr_lambda`` scales step ``s`` exactly once. The scheduler's state dict is
    unchanged (wrapped lambdas are plain functions, which ``LambdaLR.state_dict`` leaves out).

    Raises:
        ConfigError: the scheduler is not a ``LambdaLR`` (its learning rate is not a function of the step).
    """
    from torch.optim.lr_scheduler import LambdaLR

    if not isinstance(scheduler, LambdaLR):
        raise ConfigError(
            f"lr_scaling needs a learning-rate scheduler whose rate is a function of the step (a LambdaLR, as "
            f"every lr_scheduler_type but 'reduce_lr_on_plateau' makes); got {type(scheduler).__name__}. Use "
            "another lr_scheduler_type, or lr_scaling=None"
        )

    def scaled(inner: Callable[[int], float]) -> Callable[[int], float]:
        def lr_lambda(step: int) -> float:
            return inner(step) * factor(step)

        return lr_lambda

    scheduler.lr_lambdas = [scaled(fn) for fn in scheduler.lr_lambdas]
    # The rate of the step about to run was set from the unscaled lambdas when the scheduler was built.
    for group, base, fn in zip(
        scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


__all__ = ["LR_SCALINGS", "check_lr_scaling", "lr_factors", "scale_lr_lambdas"]
