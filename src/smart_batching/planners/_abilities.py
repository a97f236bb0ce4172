"""The optional abilities of a strategy, each with a default that fits a padded strategy with one
example per row: a new strategy overrides only what differs (:class:`~smart_batching.planners.PlannerSpec`
inherits them all, so every spec answers every question the library asks).

==========================  ===================================================================
ability                     what the library asks, and the default
==========================  ===================================================================
:class:`StreamingRounds`    ``plan_round(lens, rng, room, tuning) -> Cut`` over a stream's buffer
                            (default: none, the strategy cannot stream); ``check_streamable()``
:class:`StepBalance`        ``micro_batch_limits() -> MicroBatchLimits``: what a micro-batch may
                            hold after balancing across ranks (default: ``batch_size`` + 1/8)
:class:`CostliestFirst`     ``leads_with_costliest()`` (default: a ``costliest_first`` option),
                            ``costliest_keys(shapes)`` and ``footprint(shapes)`` (token slots, or
                            real tokens where rows are packed)
:class:`ToolHints`          what ``analyze``, the CLI, ``bench``, the HF Trainer and the contract
                            tests read: ``budget_option``, ``variant_option``,
                            ``analysis_variants``, ``option_limits``, ``hf_sampling``,
                            ``hf_sampling_options``, ``example_options(longest)``
==========================  ===================================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np

from smart_batching.errors import ConfigError
from smart_batching.plan import Batches, BatchShapes

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Knobs:
    """The settings callers (CLI, analysis, bench) speak in; each strategy takes those it uses.

    None means not given: the strategy keeps its own default for that option.

    Attributes:
        batch_size: examples per batch (fixed-size strategies).
        max_tokens: padded tokens per batch (token budgets).
        capacity: tokens per packed row.
        max_length: most tokens per example (longer ones follow ``overlong``).
        overlong: ``"error"``, ``"truncate"``, ``"split"`` or ``"drop"``.
        longest: longest example of the data, for strategies that pad to one width.
    """

    batch_size: int | None = None
    max_tokens: int | None = None
    capacity: int | None = None
    max_length: int | None = None
    overlong: str | None = None
    longest: int | None = None

    def given(self, **mapping: str) -> dict[str, Any]:
        """``{option: knob value}`` for the knobs that were given (``option=knob name``)."""
        return {opt: getattr(self, knob) for opt, knob in mapping.items() if getattr(self, knob) is not None}


class Room(NamedTuple):
    """What may stay in a stream's buffer after a round."""

    segments: int
    tokens: int


class Tuning(NamedTuple):
    """Knobs of rounds that pack rows (see :class:`~smart_batching.streaming.StreamingBatcher`)."""

    min_row_fill: float
    reserve: float


class Cut(NamedTuple):
    """A round's decision over a stream's buffer (:meth:`StreamingRounds.plan_round`).

    Attributes:
        batches: the batches to emit now; their ``order`` holds positions of the buffer.
        keep: positions that stay in the buffer, ascending.
        drop: positions left out (``drop_last`` at the end of the stream).
    """

    batches: Batches
    keep: np.ndarray = _EMPTY
    drop: np.ndarray = _EMPTY


@dataclass(frozen=True)
class MicroBatchLimits:
    """What a micro-batch may hold after balancing across ranks (:meth:`StepBalance.micro_batch_limits`).

    Attributes:
        capacity: packed strategies: tokens per row (None: rows are padded).
        rows_per_micro_batch: packed strategies: rows per micro-batch.
        max_tokens: token budgets: most rows × longest.
        max_rows: most segments per micro-batch (fixed sizes: a little slack allowed); None: no limit.
        batch_size: fixed-size strategies: the planned size, without the slack.
    """

    capacity: int | None
    rows_per_micro_batch: int
    max_tokens: int | None
    max_rows: int | None
    batch_size: int | None = None

    @property
    def rows_per_unit(self) -> int:
        """The former name of :attr:`rows_per_micro_batch` (``distributed/_balance.py`` reads it)."""
        return self.rows_per_micro_batch

    @classmethod
    def of(cls, plan: Any) -> MicroBatchLimits:
        """The limits of ``plan``'s strategy."""
        return plan.spec.micro_batch_limits()

    def fits(self, lengths: np.ndarray, *, planned: bool = False) -> bool:
        """Whether a micro-batch of segments with these token lengths respects the limits;
        ``planned`` holds fixed-size batches to the planned size (no slack)."""
        return self.admits(lengths.size, int(lengths.sum()), int(lengths.max(initial=0)), planned=planned)

    def admits(self, rows: int, tokens: int, longest: int, *, planned: bool = False) -> bool:
        """:meth:`fits` for a micro-batch of ``rows`` segments, ``tokens`` in all, the longest ``longest``."""
        if self.capacity is not None:
            return tokens <= self.capacity * self.rows_per_micro_batch
        max_rows = self.batch_size if planned and self.batch_size is not None else self.max_rows
        if max_rows is not None and rows > max_rows:
            return False
        return self.max_tokens is None or rows * longest <= self.max_tokens

    def headroom(self, rows: int, tokens: int, longest: int, cost_of_length: Callable[[int], int]) -> float:
        """Most cost a micro-batch could still take in segments no longer than its longest one."""
        if rows == 0:
            return math.inf
        if self.capacity is not None:
            return cost_of_length(self.capacity * self.rows_per_micro_batch - tokens)
        most = math.inf if self.max_rows is None else self.max_rows
        if self.max_tokens is not None:
            most = min(most, self.max_tokens // max(longest, 1))
        return math.inf if most == math.inf else max(0, most - rows) * cost_of_length(longest)


class StreamingRounds:
    """Planning a stream's bounded buffer, a round at a time (:mod:`smart_batching.streaming`)."""

    def plan_round(
        self, lens: np.ndarray, rng: np.random.Generator, room: Room | None, tuning: Tuning
    ) -> Cut:
        """One online planning round over a stream's buffer (:mod:`smart_batching.planners._rounds` has
        the pieces).

        Args:
            lens: ``(m,)`` token lengths of the buffered segments.
            rng: this round's generator.
            room: what may stay in the buffer; None at the end of the stream (emit everything).
            tuning: knobs of strategies that pack rows.
        """
        raise ConfigError(f"strategy {self.name!r} cannot stream: it defines no plan_round")

    @classmethod
    def can_stream(cls) -> bool:
        """Whether the streaming planner can plan this strategy over a bounded buffer."""
        return cls.plan_round is not StreamingRounds.plan_round

    def check_streamable(self) -> None:
        """Raise :class:`ConfigError` when these settings cannot be planned online (the strategy can).

        The default refuses a ``window=`` (the randomness knob of the length-aware strategies): a stream
        is planned a buffer at a time, which is a window already. Overrides call ``super()`` first."""
        if getattr(self, "window", None) is not None:
            raise ConfigError(
                f"{type(self).__name__}: window= draws windows over a whole dataset, but a stream is planned a "
                "buffer at a time, which is a window already: leave window=None and set the buffer's size "
                "(buffer_size=) instead"
            )


class StepBalance:
    """What balancing across ranks may put in one micro-batch (:func:`~smart_batching.distributed.distribute`)."""

    def micro_batch_limits(self) -> MicroBatchLimits:
        """What a micro-batch may hold after balancing across ranks. Default: a fixed batch size,
        with a little slack (an eighth) for the balancer's moves."""
        bs = getattr(self, "batch_size", None)
        return MicroBatchLimits(None, 1, None, None if bs is None else bs + max(1, bs // 8), bs)

    def mixes_steps_by_default(self) -> bool:
        """Whether ``mix_steps="auto"`` (the Trainer's default) draws an optimizer step's micro-batches
        from as many length strata of the plan where a step has several: for a strategy whose batches
        are each one length stratum, so that a step of consecutive batches is one too and, with gradient
        clipping binding, its tokens weigh by the stratum. Default False: a strategy turns it on where
        the time-to-quality study measured it helping (benchmarks/RESULTS.md, "mix_steps at ten seeds")."""
        return False


class CostliestFirst:
    """The batch that fills memory most goes first, so a budget that does not fit fails at step 1."""

    def leads_with_costliest(self) -> bool:
        """Whether the batch with the largest :meth:`footprint` goes first (step 0 of every epoch; on
        several processes the optimizer step holding it, see :func:`~smart_batching.distributed.distribute`),
        so that a budget that does not fit fails at the first step and not hours later.

        Default: the spec's ``costliest_first`` option, False for a spec without one. A new strategy
        gets the rule by declaring ``costliest_first: bool = True``; the swap itself is done outside the
        planner (:func:`~smart_batching.plan.lead_with_costliest`), ranking batches by
        :meth:`costliest_keys`. Its cost in randomness: one batch per epoch moved to the front by a
        swap with batch 0; the rest keeps its order.
        """
        return bool(getattr(self, "costliest_first", False))

    def footprint(self, shapes: BatchShapes) -> np.ndarray:
        """Memory footprint of batches in token positions, ``(num_batches,)``: what a step holds in
        activations. Rows padded to a width cost ``rows × width`` (token slots); rows that hold several
        examples are flattened into one padding-free sequence by the packing collator and cost their
        real ``tokens``."""
        return shapes.tokens if self.packs_rows else shapes.rows * shapes.width

    def costliest_keys(self, shapes: BatchShapes) -> tuple[np.ndarray, np.ndarray]:
        """How batches rank for :meth:`leads_with_costliest`: ``(key, tie-break)``, each
        ``(num_batches,)``; the largest key wins, ties go to the largest tie-break, then to the first
        batch. Default: the :meth:`footprint`, ties to the longest segment (attention cost)."""
        return self.footprint(shapes), shapes.longest


class ToolHints:
    """What the tools around the planners read: ``analyze``, the CLI, ``bench``, the HF Trainer, the
    contract tests."""

    budget_option: ClassVar[str | None] = None
    """The option ``max_tokens="auto"`` searches (``max_tokens``, ``capacity``); None: none."""
    variant_option: ClassVar[str | None] = None
    """The option a bare ``name[variant]`` row sets (``group_by_length[megabatch]``: ``mode``)."""
    analysis_variants: ClassVar[tuple[str, ...]] = ()
    """The ``name[variant]`` rows ``analyze`` shows by default."""
    option_limits: ClassVar[dict[str, int]] = {}
    """The largest value of options that have one (``packed``: ``capacity`` 262,143)."""
    hf_sampling: ClassVar[str | None] = None
    """The ``TrainingArguments.train_sampling_strategy`` whose semantics this strategy keeps (a trainer
    set to it is honoured by this strategy and refused with any other); None: none."""
    hf_sampling_options: ClassVar[dict[str, Any]] = {}
    """Options that give HF's semantics when a trainer asks for :attr:`hf_sampling` (where the
    strategy's own defaults differ); options the caller sets win."""

    @classmethod
    def example_options(cls, longest: int) -> dict[str, dict[str, Any]]:
        """Option sets the contract tests run this strategy with (``tests/strategy_cases.py``), by a
        short label, for data whose examples hold at most ``longest`` tokens: each should plan such
        data with no overlong example (the tests add overlong policies themselves). Cover the options
        that change how batches are formed (modes, windows, ``drop_last``, several rows per batch).

        Default: the options the shared knobs give (:meth:`options_from`): batches of 4, budgets and
        capacities of ``2 * longest`` tokens, ``max_length=longest``."""
        knobs = Knobs(
            batch_size=4, max_tokens=2 * longest, capacity=2 * longest, max_length=longest, longest=longest
        )
        return {"": cls.options_from(knobs)}
