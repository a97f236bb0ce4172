"""A batch sampler for one rank of a balanced distributed plan.

Every rank builds the same :class:`~smart_batching.distributed.DistributedPlan` from the same lengths,
strategy and seed (no communication) and iterates its own micro-batches, ``accum_steps`` per optimizer
step, the same number on every rank::

    world = World.detect()                       # or World(rank, world_size) by hand
    sampler = DistributedSmartBatchSampler(lengths, "packed", capacity=4096, world=world, accum_steps=4)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=PackingCollator())

Do not let accelerate re-shard these batches (``prepare_data_loader`` would deal them round-robin
again): build the DataLoader per rank and leave it unprepared, or pass ``dispatch_batches=False`` and
``split_batches=False``. ``split_batches=True`` is unsupported: it would cut our micro-batches, which
are already what one rank runs at once, into pieces.

An empty slot (only when the tail could not be split: fewer examples than ranks) yields an empty
list; the training loop should run a zero-loss step so collectives stay in lock-step.

Resuming: the cursor also records ``world_size`` and ``accum_steps``. Loading it on another world size
is refused, unless ``load_state_dict(state, replan=True)``: then the examples the saved run consumed in
the current epoch (every rank, every finished step) are left out, and the rest of the epoch is planned
and balanced again for the new world.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from smart_batching.distributed import DistributedPlan, World, distribute
from smart_batching.errors import ConfigError
from smart_batching.plan import BatchPlan
from smart_batching.planners import plan_batches
from smart_batching.sampler import STATE_FIELDS as BASE_STATE_FIELDS
from smart_batching.sampler import SmartBatchSampler, check_state_fields, iterate_epoch

# The base cursor's fields and the world it was saved on (see smart_batching.sampler.STATE_FIELDS).
STATE_FIELDS = {
    **BASE_STATE_FIELDS,
    "world_size": ("positive", False),
    "accum_steps": ("positive", False),
    "cost": ("text", False),
    "max_extra_steps": ("count?", False),
    "replanned_examples": ("count", False),
    "mix_steps": ("count", False),
}


class DistributedSmartBatchSampler(SmartBatchSampler):
    """Yield this rank's micro-batches of a balanced distributed plan.

    Args:
        lengths: (num_examples,) token lengths, in dataset order, identical on every rank.
        spec_or_name: a planner spec or strategy name (any strategy).
        world: this process's place; None reads it once with :meth:`World.detect`.
        accum_steps: gradient-accumulation micro-batches per optimizer step.
        cost: what is balanced: ``"tokens"``, ``"attention"`` (Σ length²) or ``"slots"``.
        max_extra_steps: optimizer steps the balancer may add where the steps cannot be evened out in
            as many (see :func:`~smart_batching.distributed.distribute`); None: as many as it takes.
            The default 0 keeps at most ``ceil(num_batches / world_size)`` micro-batches per rank,
            the length the Trainer integration sizes an epoch on.
        mix_steps: draw each optimizer step's ``accum_steps`` micro-batch rounds from as many cost
            strata (see :func:`~smart_batching.distributed.distribute`); the micro-batches are the plan's.
        seed, epoch, **options: as :class:`~smart_batching.sampler.SmartBatchSampler`.
    """

    def __init__(
        self,
        lengths: Any,
        spec_or_name: Any,
        *,
        world: World | None = None,
        accum_steps: int = 1,
        cost: str = "tokens",
        max_extra_steps: int | None = 0,
        mix_steps: bool = False,
        seed: int = 0,
        epoch: int = 0,
        **options: Any,
    ) -> None:
        self.world = world if world is not None else World.detect()
        self.mix_steps = bool(mix_steps)
        self.max_extra_steps = max_extra_steps
        self.accum_steps = int(accum_steps)
        self.cost = cost
        self._dist: DistributedPlan | None = None
        self._dist_key: tuple | None = None
        self._subset: np.ndarray | None = None  # examples left in the current epoch after a replan
        self._subset_epoch: int | None = None
        super().__init__(lengths, spec_or_name, seed=seed, epoch=epoch, **options)

    # -- plans --------------------------------------------------------------------------------------

    def distributed_plan(self, epoch: int | None = None) -> DistributedPlan:
        """The balanced plan of ``epoch`` (the current one by default), as every rank computes it."""
        epoch = self._epoch if epoch is None else epoch
        subset = self._subset if self._subset_epoch == epoch else None
        key = (epoch, self.world.world_size, self.accum_steps, None if subset is None else subset.shape[0])
        if self._dist is None or self._dist_key != key:
            if subset is None:
                base = self.plan_for_epoch(epoch)
            else:
                base = _subset_plan(self.lengths, subset, self.spec, self.seed, epoch)
            self._dist = distribute(
                base,
                self.world.world_size,
                accum_steps=self.accum_steps,
                cost=self.cost,
                seed=self.seed,
                max_extra_steps=self.max_extra_steps,
                mix_steps=self.mix_steps,
            )
            self._dist_key = key
        return self._dist

    def _micro_batch_keys(self, d: DistributedPlan, m: int) -> list[Any]:
        if m < 0:
            return []
        return self.keys_of(d.base, d.micro_batch_segments(m))

    # -- torch sampler protocol -----------------------------------------------------------------

    def __len__(self) -> int:
        return self.distributed_plan().num_steps * self.accum_steps

    def __iter__(self) -> Iterator[list[Any]]:
        self._generation += 1
        return self._iterate_rank(self._batches_yielded, self._generation)

    def _iterate_rank(self, start: int, generation: int) -> Iterator[list[Any]]:
        d = self.distributed_plan()
        micro_batches = d.rank_micro_batches(self.world.rank)
        yield from iterate_epoch(
            self,
            micro_batches.shape[0],
            lambda b: self._micro_batch_keys(d, int(micro_batches[b])),
            start,
            generation,
        )

    # -- state --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            world_size=self.world.world_size,
            accum_steps=self.accum_steps,
            cost=self.cost,
            max_extra_steps=self.max_extra_steps,
            mix_steps=int(self.mix_steps),
        )
        if self._subset is not None and self._subset_epoch == self._epoch:
            state["replanned_examples"] = int(self._subset.shape[0])
        return state

    def load_state_dict(self, state: Mapping[str, Any], *, replan: bool = False) -> None:
        """Resume at the saved cursor.

        Args:
            state: from :meth:`state_dict` (of any rank: the cursor is the same on all ranks).
            replan: when the world size or accumulation changed, re-plan the rest of the epoch from the
                examples not yet consumed instead of refusing.

        Raises:
            ConfigError: a field is missing or garbled, the dataset, strategy, seed or cost changed, or
                the world changed and ``replan`` is off.
        """
        check_state_fields(state, STATE_FIELDS, type(self).__name__)
        if state.get("cost", self.cost) != self.cost:
            raise ConfigError(
                f"cannot resume the batch sampler: it was saved with cost={state['cost']!r}, now "
                f"{self.cost!r} (the plans differ); pass the same"
            )
        if state.get("max_extra_steps", self.max_extra_steps) != self.max_extra_steps:
            raise ConfigError(
                f"cannot resume the batch sampler: it was saved with max_extra_steps="
                f"{state['max_extra_steps']!r}, now {self.max_extra_steps!r} (the plans differ); pass the same"
            )
        saved_mix = bool(state.get("mix_steps", 0))  # a state saved before mix_steps existed: off
        if saved_mix != self.mix_steps:
            raise ConfigError(
                f"cannot resume the batch sampler: it was saved with mix_steps={saved_mix}, "
                f"now {self.mix_steps} (the plans differ); pass the same"
            )
        saved_world = int(state.get("world_size", 1))
        saved_accum = int(state.get("accum_steps", 1))
        if "replanned_examples" in state:
            raise ConfigError(
                "cannot resume a cursor that was itself saved after a replan; restart the epoch"
            )
        same = saved_world == self.world.world_size and saved_accum == self.accum_steps
        if same:
            super().load_state_dict(state)
            return
        if not replan:
            raise ConfigError(
                f"cannot resume the batch sampler: it was saved with world_size={saved_world}, "
                f"accum_steps={saved_accum}, now world_size={self.world.world_size}, "
                f"accum_steps={self.accum_steps}. Resume on the same world, or pass replan=True to re-plan "
                "the rest of the epoch from the examples not yet consumed."
            )
        self.check_state_dict(
            {**state, "batches_yielded": 0}
        )  # data, strategy and seed must match; the count is checked below
        epoch = int(state["epoch"])
        done_steps = int(state["batches_yielded"]) // saved_accum
        old = distribute(
            self.plan_for_epoch(epoch),
            saved_world,
            accum_steps=saved_accum,
            cost=self.cost,
            seed=self.seed,
            max_extra_steps=self.max_extra_steps,
            mix_steps=self.mix_steps,
        )
        if done_steps > old.num_steps:
            raise ConfigError(
                f"sampler state says {state['batches_yielded']} micro-batches of epoch {epoch} were yielded, "
                f"but that epoch has {old.num_steps * saved_accum} per rank on world_size={saved_world}"
            )
        consumed_micro_batches = old.assignment[:done_steps].reshape(-1)
        consumed = [old.micro_batch_examples(int(m)) for m in consumed_micro_batches if m >= 0]
        used = np.zeros(self.num_examples, dtype=bool)
        if consumed:
            used[np.concatenate(consumed)] = True
        self._epoch = epoch
        self._subset = np.flatnonzero(~used)
        self._subset_epoch = epoch
        self._batches_yielded = 0
        self._generation += 1
        self._dist = None

    def __repr__(self) -> str:
        return (
            f"DistributedSmartBatchSampler({self.spec!r}, rank={self.world.rank}, world_size={self.world.world_size}, "
            f"accum_steps={self.accum_steps}, mix_steps={self.mix_steps}, epoch={self._epoch}, batches_yielded={self._batches_yielded})"
        )


def _subset_plan(lengths: np.ndarray, subset: np.ndarray, spec: Any, seed: int, epoch: int) -> BatchPlan:
    """A plan over ``subset`` of the examples, with example ids mapped back to the full dataset."""
    sub = plan_batches(lengths[subset], spec, seed=seed, epoch=epoch)
    return dataclasses.replace(
        sub,
        segments=sub.segments._replace(example=subset[sub.example_ids]),
        num_examples=int(lengths.shape[0]),
        lengths=lengths,
    )


__all__ = ["DistributedSmartBatchSampler"]
