"""A batch sampler whose items are whole optimizer steps that follow a batch schedule.

:class:`StepBatchSampler` yields, for each optimizer step, this rank's micro-batches as a list of key
lists (:func:`~.realise.realise` decides them from the strategy's plan of the epoch). Pair it with
:class:`~.steps.StepDataset` and :class:`~.steps.StepCollator`::

    inner = SmartBatchSampler(lengths, "token_budget", max_tokens=8192, seed=0)
    sampler = StepBatchSampler(inner, "linear:16384->131072@20%", world=World(rank, world_size))
    loader = DataLoader(StepDataset(dataset), batch_sampler=sampler, collate_fn=StepCollator(collator))
    for micro_batches in loader:          # one optimizer step
        for batch in micro_batches:       # None: an empty micro-batch (a rank short of examples)
            ...

What training has seen, the schedule's argument, runs across epochs: epoch ``e`` starts at ``e`` times
the first epoch's total (exact when no example is dropped); shares of the epoch (``20%``) are of the
first epoch's total. The cursor is ``{epoch, batches_yielded}`` in steps, like the inner sampler's, and
the schedule and world size are saved with it (resuming with other ones is refused).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from torch.utils.data import Sampler

from smart_batching.adaptive.realise import SteppedPlan, realise, segment_weights
from smart_batching.adaptive.schedule import BatchSchedule, schedule_unit
from smart_batching.errors import ConfigError
from smart_batching.sampler import iterate_epoch


class StepBatchSampler(Sampler[list[list[Any]]]):
    """Yield this rank's micro-batches of each optimizer step (see the module docstring).

    Args:
        inner: The strategy's sampler (:class:`~smart_batching.sampler.SmartBatchSampler`): its plans,
            seed and keys.
        schedule: A :class:`~.schedule.BatchSchedule` or its text; its unit defaults to the strategy's.
        world: This process's place (``rank``, ``world_size``); None: one process.
        cost: What is balanced across ranks (``"tokens"``, ``"attention"``, ``"slots"``).
    """

    def __init__(self, inner: Any, schedule: Any, *, world: Any = None, cost: str = "tokens") -> None:
        self.inner = inner
        self.schedule = BatchSchedule.parse(schedule, unit=schedule_unit(inner.spec))
        self.rank = 0 if world is None else int(world.rank)
        self.world_size = 1 if world is None else int(world.world_size)
        self.cost = cost
        self._epoch = inner.epoch
        self._batches_yielded = 0
        self._generation = 0
        self._plans: dict[int, SteppedPlan] = {}
        self._total: int | None = None

    # -- plans -----------------------------------------------------------------------------------------

    @property
    def spec(self) -> Any:
        return self.inner.spec

    @property
    def yields_segments(self) -> bool:
        return self.inner.yields_segments

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def batches_yielded(self) -> int:
        """Steps of the current epoch handed out so far."""
        return self._batches_yielded

    @property
    def plan(self) -> Any:
        """The strategy's plan of the current epoch."""
        return self.inner.plan_for_epoch(self._epoch)

    def epoch_total(self) -> int:
        """The first epoch's total weight (tokens or examples): what one epoch adds to ``seen``."""
        if self._total is None:
            self._total = int(segment_weights(self.inner.plan_for_epoch(0), self.schedule.unit).sum())
        return self._total

    def resolved_schedule(self) -> BatchSchedule:
        return self.schedule.resolve(self.epoch_total())

    def stepped_plan(self, epoch: int | None = None) -> SteppedPlan:
        """The steps of ``epoch`` (the current one by default), as every rank computes them."""
        epoch = self._epoch if epoch is None else int(epoch)
        if epoch not in self._plans:
            if len(self._plans) > 2:  # the current epoch, and the ones the Trainer asks about ahead
                self._plans.pop(next(iter(self._plans)))
            self._plans[epoch] = realise(
                self.inner.plan_for_epoch(epoch),
                self.resolved_schedule(),
                world_size=self.world_size,
                seen_before=epoch * self.epoch_total(),
                seed=self.inner.seed,
                cost=self.cost,
            )
        return self._plans[epoch]

    def step_keys(self, sp: SteppedPlan, step: int) -> list[list[Any]]:
        """Dataset keys of each micro-batch this rank runs at ``step``."""
        return [self.inner.keys_of(sp.base, segs) for segs in sp.step_segments(step, self.rank)]

    # -- torch sampler protocol ------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.stepped_plan().num_steps

    def __iter__(self) -> Iterator[list[list[Any]]]:
        self._generation += 1
        return self._iterate(self._batches_yielded, self._generation)

    def _iterate(self, start: int, generation: int) -> Iterator[list[list[Any]]]:
        sp = self.stepped_plan()
        yield from iterate_epoch(self, sp.num_steps, lambda s: self.step_keys(sp, s), start, generation)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` at its first step; a no-op when it is already the current epoch."""
        if int(epoch) != self._epoch:
            self._epoch = int(epoch)
            self._batches_yielded = 0
            self._generation += 1

    # -- state -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The inner sampler's cursor fields, counted in steps, with the schedule and world size."""
        state = self.inner.state_dict()
        state.update(
            epoch=self._epoch,
            batches_yielded=self._batches_yielded,
            batch_schedule=str(self.schedule),
            schedule_unit=self.schedule.unit,
            world_size=self.world_size,
        )
        return state

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Refuse a cursor of another dataset, strategy, seed, schedule or world size.

        Raises:
            ConfigError: naming what changed.
        """
        saved = state.get("batch_schedule")
        if saved != str(self.schedule) or state.get("schedule_unit") != self.schedule.unit:
            raise ConfigError(
                f"cannot resume: the checkpoint's steps follow batch_schedule={saved!r} "
                f"({state.get('schedule_unit')}), this run's {str(self.schedule)!r} ({self.schedule.unit}); "
                "resume with the same batch_schedule"
            )
        if int(state.get("world_size", 1)) != self.world_size:
            raise ConfigError(
                f"cannot resume: the checkpoint's steps were dealt to {state.get('world_size')} ranks, this run "
                f"has {self.world_size}; resume on the same number of processes"
            )
        self.inner.check_state_dict({**state, "batches_yielded": 0})
        steps = self.stepped_plan(int(state["epoch"])).num_steps
        if int(state["batches_yielded"]) > steps:
            raise ConfigError(
                f"sampler state says {state['batches_yielded']} steps of epoch {state['epoch']} were yielded, "
                f"but that epoch has {steps}"
            )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.check_state_dict(state)
        self._epoch = int(state["epoch"])
        self._batches_yielded = int(state["batches_yielded"])
        self._generation += 1

    def __repr__(self) -> str:
        return (
            f"StepBatchSampler({self.spec!r}, batch_schedule={str(self.schedule)!r}, rank={self.rank}, "
            f"world_size={self.world_size}, epoch={self._epoch}, batches_yielded={self._batches_yielded})"
        )


__all__ = ["StepBatchSampler"]
