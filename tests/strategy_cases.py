"""Test parametrisations driven by the strategy registry: every registered strategy, with the option
sets its spec gives for tests (:meth:`~smart_batching.planners.PlannerSpec.example_options`). A
strategy registered before a test module is collected is in its cases; no list names the strategies."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from smart_batching.planners import PlannerSpec, make_spec, register, spec_class, strategy_names, unregister


def cases(
    longest: int, where: Callable[[PlannerSpec], bool] | None = None, *, first_only: bool = False
) -> list[Any]:
    """``pytest.param(name, options, id="name[label]")`` for every registered strategy and each of its
    example option sets (for data of at most ``longest`` tokens per example); ``where`` keeps the specs
    it accepts; ``first_only`` takes each strategy's first set."""
    out = []
    for name in strategy_names():
        examples = spec_class(name).example_options(longest)
        for label, options in list(examples.items())[: 1 if first_only else None]:
            if where is None or where(make_spec(name, **options)):
                out.append(pytest.param(name, dict(options), id=f"{name}[{label}]" if label else name))
    return out


def names(where: Callable[[type[PlannerSpec]], bool] | None = None) -> list[str]:
    """Every registered strategy (whose spec class ``where`` accepts)."""
    return [n for n in strategy_names() if where is None or where(spec_class(n))]


@contextmanager
def registered(spec_cls: type[PlannerSpec], planner: Callable) -> Iterator[str]:
    """``spec_cls`` registered for the duration of the block."""
    register(spec_cls, planner)
    try:
        yield spec_cls.name
    finally:
        unregister(spec_cls.name)
