"""What a strategy is: a spec class, a planner registered with it, and the optional abilities the
rest of the library may ask of it. Code outside ``planners/`` never compares a strategy's name or
tests a spec class; it asks the spec.

Required of every strategy (a toy is one short module, ``tests/toy_strategy.py``):

==========================  =======================================================================
what                        how
==========================  =======================================================================
a frozen spec dataclass     ``class MySpec(PlannerSpec)``: its options as keyword-only fields,
                            validated in ``__post_init__`` (messages name the field to change)
``name``, ``description``   the registry name, one line for the CLI and reports
``options_from(knobs)``     its options from the shared settings (:class:`Knobs`)
the planner                 ``plan_mine(lengths, spec, rng) -> PlanParts``, registered with the spec
==========================  =======================================================================

Facts with defaults (override where they differ): ``packs_rows`` (False), ``token_limit()`` (the
``max_length`` option), ``fixed_width(longest)`` (None: each batch padded to its longest). Derived,
not overridden: ``collator()``, ``option_docs()``, ``can_stream()``. Optional abilities, each with a
default (:mod:`._abilities`): streaming rounds (``plan_round``), step-balance limits
(``micro_batch_limits``), costliest-first (``leads_with_costliest``, ``costliest_keys``), and hints
for the tools (``budget_option``, ``variant_option``, ``analysis_variants``, ``option_limits``,
``hf_sampling``, ``example_options``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np

from smart_batching.errors import ConfigError
from smart_batching.planners._abilities import (
    CostliestFirst,
    Cut,
    Knobs,
    MicroBatchLimits,
    Room,
    StepBalance,
    StreamingRounds,
    ToolHints,
    Tuning,
)

OVERLONG_POLICIES = ("error", "truncate", "split", "drop")

UnitLimits = MicroBatchLimits
"""The former name of :class:`MicroBatchLimits` ("unit" now means an example or document only,
:mod:`smart_batching.units`); kept for ``distributed/_balance.py`` and ``_reform.py``."""

__all__ = [
    "OVERLONG_POLICIES",
    "CostliestFirst",
    "Cut",
    "Knobs",
    "MicroBatchLimits",
    "PlannerSpec",
    "Room",
    "StepBalance",
    "StreamingRounds",
    "ToolHints",
    "Tuning",
    "UnitLimits",
]


@dataclass(frozen=True, kw_only=True)
class PlannerSpec(StreamingRounds, StepBalance, CostliestFirst, ToolHints):
    """Base of the per-strategy specs. Subclasses are frozen, keyword-only dataclasses, validated on
    creation, that set :attr:`name` and :attr:`description` and override :meth:`options_from`; the
    other answers have defaults that fit a padded strategy with one example per row (see the module
    docstring and :mod:`._abilities`)."""

    name: ClassVar[str] = ""
    """The registry name (required)."""
    description: ClassVar[str] = ""
    """One line for the CLI's help and reports (required)."""
    packs_rows: ClassVar[bool] = False
    """Rows hold several examples: the packing collator and packed attention."""

    # -- validation helpers ------------------------------------------------------------------------

    def _check_positive(self, field_name: str, value: int | None, *, allow_none: bool = False) -> None:
        if value is None and allow_none:
            return
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ConfigError(
                f"{type(self).__name__}: {field_name}= must be a positive integer, got {value!r}"
            )

    def _check_bool(self, field_name: str, value: Any) -> None:
        if not isinstance(value, (bool, np.bool_)):
            raise ConfigError(f"{type(self).__name__}: {field_name}= must be True or False, got {value!r}")

    def _check_overlong(self, value: str) -> None:
        if value not in OVERLONG_POLICIES:
            raise ConfigError(
                f"{type(self).__name__}: overlong= must be one of {', '.join(OVERLONG_POLICIES)}; got {value!r}"
            )

    # -- what the rest of the library asks ---------------------------------------------------------

    @classmethod
    def options_from(cls, knobs: Knobs) -> dict[str, Any]:
        """This strategy's options from the shared knobs (those it has no use for are ignored)."""
        return {}

    @classmethod
    def collator(cls, *, pad_token_id: int = 0, **options: Any) -> Callable:
        """The collator for this strategy's batches: packing when rows hold several examples, else
        right padding (``options`` go to the collator, e.g. ``pad_to_multiple_of=8``)."""
        from smart_batching.collate import PackingCollator, PaddingCollator

        if cls.packs_rows:
            return PackingCollator(**options)
        return PaddingCollator(pad_token_id, **options)

    @classmethod
    def option_docs(cls) -> dict[str, str]:
        """``{option: its one-line doc}``, from the ``Attributes:`` section of the spec's docstring."""
        doc = inspect.getdoc(cls) or ""
        names = {f.name for f in fields(cls)}
        out: dict[str, str] = {}
        current = None
        for line in doc.split("Attributes:", 1)[-1].splitlines():
            m = re.match(r"\s{4}(\w+): (.*)", line)
            if m and m.group(1) in names:
                current = m.group(1)
                out[current] = m.group(2).strip()
            elif current and line.startswith(" " * 8):
                out[current] += " " + line.strip()
            elif line.strip():
                current = None
        return out

    def fixed_width(self, longest: int) -> int | None:
        """Padded tokens of every row when the strategy pads all rows to one width (``longest``: the
        data's longest example); None: each batch is padded to its own longest."""
        return None

    def token_limit(self) -> tuple[int | None, str]:
        """Most tokens one segment may hold, and the name of the setting that says so."""
        return getattr(self, "max_length", None), "max_length"
