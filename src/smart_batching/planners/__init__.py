"""Batch planners: one module per strategy (its spec and its planner), registered by name.

A planner maps ``(lengths, spec, rng)`` to the batches of one epoch, as the plan's one value
(:class:`~smart_batching.plan.Segments` and :class:`~smart_batching.plan.Batches`, its shuffle of whole
batches left pending); :func:`plan_batches` seeds the rng from ``(seed, epoch)``, puts the costliest
batch first where the spec asks for it, lays the plan out once and wraps it in a
:class:`~smart_batching.plan.BatchPlan`. Everything else the library needs to know of a strategy it
asks the spec (:mod:`._spec`: what every strategy has; :mod:`._abilities`: what it may add): no module
outside ``planners/`` decides by a strategy's name.

=================  ==========================================================================
name               what it does
=================  ==========================================================================
``random``         shuffle, fixed batch size, pad to the longest in each batch (baseline)
``max_length``     shuffle, fixed batch size, pad every row to one length (baseline)
``group_by_length`` fixed batch size, similar lengths together (HF megabatches or full sort)
``token_budget``   variable batch size under a padded-token budget
``packed``         several examples per fixed-capacity row, rows of mixed lengths
=================  ==========================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

import numpy as np

from smart_batching.errors import ConfigError
from smart_batching.plan import BatchPlan, as_lengths, lead_with_costliest
from smart_batching.planners._common import PlanParts, lay_out
from smart_batching.planners._spec import (
    OVERLONG_POLICIES,
    Cut,
    Knobs,
    MicroBatchLimits,
    PlannerSpec,
    Room,
    Tuning,
    UnitLimits,
)
from smart_batching.planners.group_by_length import GroupByLengthSpec, plan_group_by_length
from smart_batching.planners.max_length import MaxLengthSpec, plan_max_length
from smart_batching.planners.packed import PackedSpec, plan_packed
from smart_batching.planners.random import RandomSpec, plan_random
from smart_batching.planners.token_budget import TokenBudgetSpec, plan_token_budget

Planner = Callable[[np.ndarray, Any, np.random.Generator], PlanParts]

REGISTRY: dict[str, tuple[type[PlannerSpec], Planner]] = {}


def register(spec_cls: type[PlannerSpec], planner: Planner) -> None:
    """Register a strategy under ``spec_cls.name`` (a new one, or replacing one of that name)."""
    if not issubclass(spec_cls, PlannerSpec) or not spec_cls.name:
        raise ConfigError(f"{spec_cls!r} must be a PlannerSpec subclass with a name")
    REGISTRY[spec_cls.name] = (spec_cls, planner)


def unregister(name: str) -> None:
    """Remove a registered strategy (tests that register a toy one)."""
    REGISTRY.pop(name, None)


for _spec, _fn in (
    (RandomSpec, plan_random),
    (MaxLengthSpec, plan_max_length),
    (GroupByLengthSpec, plan_group_by_length),
    (TokenBudgetSpec, plan_token_budget),
    (PackedSpec, plan_packed),
):
    register(_spec, _fn)

STRATEGIES = tuple(REGISTRY)
"""The built-in strategies; :func:`strategy_names` also lists those registered later."""

DEFAULT_STRATEGY = "token_budget"
"""The library's default (samplers, the Trainer): padded batches under a token budget, which any model
can train on."""

BASELINE_STRATEGY = "random"
"""What speed-ups are measured against: shuffled batches with dynamic padding, a plain DataLoader."""

FASTEST_STRATEGY = "packed"
"""The command line's default for training: no padding at all, but the model needs packed attention."""


def strategy_names() -> tuple[str, ...]:
    """Every registered strategy, built-in ones first."""
    return tuple(REGISTRY)


def spec_class(strategy: str | PlannerSpec) -> type[PlannerSpec]:
    """The spec class of a registered name (or of a spec).

    Raises:
        ConfigError: unknown strategy.
    """
    if isinstance(strategy, PlannerSpec):
        return type(strategy)
    if strategy not in REGISTRY:
        raise ConfigError(f"unknown strategy {strategy!r}; choose one of: {', '.join(REGISTRY)}")
    return REGISTRY[strategy][0]


def _option_value(text: str) -> Any:
    """``"512"`` -> 512, ``"None"`` -> None, ``"true"``/``"false"`` -> bool, anything else as it is."""
    lowered = text.strip().lower()
    if lowered in ("none", "true", "false"):
        return {"none": None, "true": True, "false": False}[lowered]
    try:
        return int(text)
    except ValueError:
        return text.strip()


def split_strategies(text: str) -> list[str]:
    """A comma-separated list of row names, commas inside ``[...]`` kept:
    ``"random,token_budget[window=512,max_tokens=4096]"`` -> ``["random", "token_budget[window=512,max_tokens=4096]"]``."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            names.append(text[start:i])
            start = i + 1
    names.append(text[start:])
    return [name.strip() for name in names if name.strip()]


def parse_strategy(name: str) -> tuple[str, dict[str, Any]]:
    """Split a row name into the strategy and its options: ``group_by_length[sorted]`` into
    ``("group_by_length", {"mode": "sorted"})`` (the strategy's ``variant_option``), and
    ``token_budget[window=512,max_tokens=4096]`` into ``("token_budget", {"window": 512, "max_tokens": 4096})``.

    Raises:
        ConfigError: unknown strategy, or a bare variant on a strategy that has none. Unknown option
            names are refused when the spec is made (:func:`make_spec`).
    """
    base, variant = name, None
    if name.endswith("]") and "[" in name:
        base, variant = name[:-1].split("[", 1)
    if base not in REGISTRY:
        raise ConfigError(f"strategies=: unknown strategy {name!r}; choose from {', '.join(REGISTRY)}")
    if variant is None:
        return base, {}
    if "=" in variant:
        pairs = [part.split("=", 1) for part in variant.split(",")]
        if any(len(pair) != 2 or not pair[0].strip() for pair in pairs):
            raise ConfigError(f"strategies=: write options as {base}[name=value,name=value] (got {name!r})")
        return base, {key.strip(): _option_value(value) for key, value in pairs}
    field = REGISTRY[base][0].variant_option
    if field is None:
        raise ConfigError(
            f"strategies=: {base!r} takes no [variant]; write options as {base}[name=value] (got {name!r})"
        )
    return base, {field: variant}


def option_limit(option: str) -> int | None:
    """The largest value every registered strategy that limits ``option`` accepts (e.g. ``"capacity"``:
    the packed planner's 262,143); None when no strategy limits it. Defaults derived from data use it."""
    limits = [cls.option_limits[option] for cls, _ in REGISTRY.values() if option in cls.option_limits]
    return min(limits) if limits else None


def analysis_rows() -> tuple[str, ...]:
    """The rows ``analyze`` shows by default: each strategy, then its ``name[variant]`` rows."""
    return tuple(
        row
        for name, (cls, _) in REGISTRY.items()
        for row in (name, *(f"{name}[{v}]" for v in cls.analysis_variants))
    )


def make_spec(strategy: str | PlannerSpec, **options: Any) -> PlannerSpec:
    """A spec from a registered name and keyword options (or a spec returned as is).

    Raises:
        ConfigError: unknown strategy, or an option the strategy does not take.
    """
    if isinstance(strategy, PlannerSpec):
        if options:
            raise ConfigError("pass options either in the spec or as keywords, not both")
        return strategy
    if strategy not in REGISTRY:
        raise ConfigError(f"unknown strategy {strategy!r}; choose one of: {', '.join(REGISTRY)}")
    spec_cls = REGISTRY[strategy][0]
    known = {f.name for f in fields(spec_cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(
            f"strategy {strategy!r} takes no option {', '.join(unknown)}; its options are: {', '.join(sorted(known))}"
        )
    return spec_cls(**options)


def plan_batches(
    lengths: Any,
    spec: str | PlannerSpec,
    *,
    seed: int = 0,
    epoch: int = 0,
    **options: Any,
) -> BatchPlan:
    """Plan one epoch of batches.

    Args:
        lengths: (num_examples,) token lengths (any integer array-like).
        spec: a spec from :mod:`smart_batching.planners` or a registered strategy name.
        seed: base seed; the plan is a pure function of ``(lengths, spec, seed, epoch)``.
        epoch: epoch number; each epoch gets a different plan.
        **options: the spec's fields when ``spec`` is a name, e.g. ``capacity=4096``.

    Returns:
        The plan; ``plan.stats()`` gives efficiency, padding and over-limit counts.
    """
    spec = make_spec(spec, **options)
    lengths = as_lengths(lengths)
    for name, value in (("seed", seed), ("epoch", epoch)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ConfigError(f"{name}= must be a non-negative integer, got {value!r}")
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch)]))
    parts = REGISTRY[spec.name][1](lengths, spec, rng)
    batches = parts.batches
    if spec.leads_with_costliest():  # the batch that fills memory most goes first
        batches = lead_with_costliest(spec, batches, parts.segments.length)
    segments, batches = lay_out(parts.segments, batches, protect=lengths, spare=parts.spare)
    return BatchPlan(
        segments=segments,
        batches=batches,
        strategy=spec.name,
        spec=spec,
        seed=int(seed),
        epoch=int(epoch),
        num_examples=int(lengths.shape[0]),
        overlong=parts.overlong,
        lengths=lengths,
        capacity=parts.capacity,
        lower_bound_rows=parts.lower_bound_rows,
    )


__all__ = [
    "BASELINE_STRATEGY",
    "DEFAULT_STRATEGY",
    "FASTEST_STRATEGY",
    "OVERLONG_POLICIES",
    "REGISTRY",
    "STRATEGIES",
    "Cut",
    "Knobs",
    "MicroBatchLimits",
    "PlanParts",
    "Room",
    "Tuning",
    "UnitLimits",
    "analysis_rows",
    "option_limit",
    "parse_strategy",
    "spec_class",
    "strategy_names",
    "unregister",
    "GroupByLengthSpec",
    "MaxLengthSpec",
    "PackedSpec",
    "PlannerSpec",
    "RandomSpec",
    "TokenBudgetSpec",
    "make_spec",
    "plan_batches",
    "register",
]
