"""Balanced distributed plans: every rank gets an equal share of work at every optimizer step.

A micro-batch is what one rank runs in one forward/backward pass; ``accum_steps`` of them make its part
of an optimizer step.

An optimizer step on ``world_size`` ranks with ``accum_steps`` gradient-accumulation micro-batches
consumes ``G = world_size * accum_steps`` micro-batches. The slowest rank sets the pace of every
all-reduce, so the micro-batches of one step are chosen together:

1. Cost each micro-batch of the base plan (any strategy): real tokens by default, ``"attention"`` for
   Σ length² (long sequences), or ``"slots"`` for padded tokens.
2. Sort micro-batches by cost and deal consecutive runs of ``G`` (similar costs) to a step, snake-wise
   over ranks inside the step (vectorised over steps). With ``mix_steps`` a step instead takes one run of
   ``world_size`` similar micro-batches from each of ``accum_steps`` cost strata, so its micro-batch
   rounds span the length range while its ranks still carry equal costs.
3. The ragged tail (``B mod G`` cheapest micro-batches and the step before them, more if they hold
   too few examples) is pooled and dealt again, costliest example first, into whole steps: nothing is
   dropped and no work is added. Only with fewer examples than slots does a step get an empty slot,
   which the sampler turns into a zero-loss micro-batch so collectives never hang.
4. Steps still uneven are evened out: the step's examples are dealt again (costliest first to the
   least-loaded rank that can take them), then single examples are moved or swapped between its
   heaviest and lightest rank, always within the strategy's limits (capacity, token budget, batch size
   plus one eighth). Only those steps loop in Python.
5. Steps still more than 1 % uneven (a tail of examples near the capacity, one per micro-batch; a long
   example that fills a token budget alone) are pooled with donor steps (their neighbours in cost order
   and the steps with the most examples to spare) and formed again, compiled
   (:func:`~smart_batching.distributed._mix.mix_uneven`); those still uneven are dissolved together
   with their neighbours and the finest steps and formed again so that every rank of a step reaches the
   same cost (:func:`~smart_batching.distributed._reform.reform_uneven`): still every example once, no empty
   micro-batch, the same step count on every rank: as many steps as before, or (``max_extra_steps``) a
   few more where long examples that fill a token budget alone leave their steps light (LIMA, token
   budget 8192: a few more steps on 2 ranks).
6. The order of steps is shuffled (seeded): every rank computes the same plan with no communication.
7. The costliest step first, where the strategy's single-process plan has the rule
   (:meth:`~smart_batching.planners.PlannerSpec.leads_with_costliest`: ``group_by_length`` always,
   like HF; ``token_budget`` and ``packed`` with ``costliest_first``): the step holding the costliest
   micro-batch on any rank (the largest footprint; for ``group_by_length`` the longest example) is
   swapped with step 0, and that micro-batch with micro-batch 0 of its rank, so a budget that does
   not fit fails at the first step. Whole steps move, so every step's balance stays exactly as it
   was; in randomness it costs one step position per epoch.

Cost: the vectorised deal is O(B log B) over B micro-batches; the loops over one step's segments (the
tail's deal, re-dealing, re-forming) pick the cheapest rank through heaps (compiled where they deal a
whole step), so they grow as segments x log(world_size), not segments x world_size.
``benchmarks/distributed_balance.py`` measures the balance against HF ``group_by_length`` and
round-robin packing, and (``--scale``) the planning time at world sizes 8 to 4,096.

When it cannot be even: a step whose costliest example costs more than the mean rank cost of that
step (``max/mean ≥ world_size · c_max / Σ c``), e.g. one example longer than all the others together,
or fewer examples than micro-batches in a step (an empty slot, as above). On 8 ranks with a token
budget under twice LIMA's longest examples, steps of such lone examples stay up to 5 % uneven.

Topology is an explicit value, :class:`~smart_batching.distributed.World`, read from
``torch.distributed`` in one place (:mod:`.world`); everything here is a pure function of (plan,
world size, accum_steps, cost, seed).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from smart_batching.distributed._balance import (
    BALANCE_TOLERANCE,
    argsort_descending,
    balance_step,
    gather_segments,
    halve_units,
    lpt_pieces,
    rank_costs,
    repartition_step,
    tail_pool,
)
from smart_batching.distributed._mix import MIX_KEEP_TOLERANCE, mix_uneven
from smart_batching.distributed._reform import REFORM_TOLERANCE, Reformer, reform_uneven, unit_max_costs
from smart_batching.errors import ConfigError
from smart_batching.plan import (
    Batches,
    BatchPlan,
    BatchShapes,
    block_positions,
    costliest_batch,
    micro_batch_widths,
    offsets_of,
)
from smart_batching.planners._spec import MicroBatchLimits

COSTS = ("tokens", "attention", "slots")


def micro_batch_costs(plan: BatchPlan, cost: str = "tokens") -> np.ndarray:
    """Cost of each batch of ``plan`` run as one micro-batch: (num_batches,) int64."""
    if cost == "tokens":
        return plan.tokens_per_batch.astype(np.int64)
    if cost == "slots":
        return plan.slots_per_batch.astype(np.int64)
    if cost == "attention":
        sq = plan.seg_lengths.astype(np.int64) ** 2
        csum = np.concatenate([[0], np.cumsum(sq)])
        bounds = plan.batch_bounds
        return csum[bounds[1:]] - csum[bounds[:-1]]
    raise ConfigError(f"cost= must be one of {', '.join(COSTS)}; got {cost!r}")


unit_costs = micro_batch_costs
"""The former name of :func:`micro_batch_costs`."""


def _segment_costs(plan: BatchPlan, cost: str) -> np.ndarray:
    if cost == "attention":
        return plan.seg_lengths.astype(np.int64) ** 2
    if cost == "slots":
        # A padded row costs the batch width; a packed segment its share of the row.
        seg_batch = np.repeat(np.arange(len(plan)), plan.segments_per_batch)
        return plan.batch_width[seg_batch].astype(np.int64) if plan.capacity is None else plan.seg_lengths
    return plan.seg_lengths.astype(np.int64)


@dataclass(frozen=True, eq=False)
class DistributedPlan:
    """A base plan dealt to ranks, step-major.

    Micro-batch ``m`` is ``segment_order[micro_batch_start[m]:micro_batch_end[m]]``: positions in the
    flat segment arrays of ``base`` (after splitting and balancing; the phases of :func:`distribute`
    append re-formed micro-batches to one order, so the ranges are not consecutive, see
    :attr:`micro_batches` for them as one :class:`~smart_batching.plan.Batches` value).
    ``assignment[s, r, a]`` is the micro-batch that rank ``r`` runs as micro-batch ``a`` of step ``s``,
    or -1 for an empty slot.
    """

    base: BatchPlan
    world_size: int
    accum_steps: int
    cost: str
    segment_order: np.ndarray  # positions into base's flat segment arrays; micro-batches are ranges of it
    micro_batch_start: np.ndarray  # (num_micro_batches,) into segment_order
    micro_batch_end: np.ndarray  # (num_micro_batches,)
    assignment: np.ndarray  # (num_steps, world_size, accum_steps) int64
    micro_batch_cost: np.ndarray  # (num_micro_batches,) int64

    @property
    def num_steps(self) -> int:
        return self.assignment.shape[0]

    @property
    def num_empty_slots(self) -> int:
        return int(np.count_nonzero(self.assignment < 0))

    def micro_batch_segments(self, m: int) -> np.ndarray:
        """Positions in ``base``'s flat segment arrays of micro-batch ``m``."""
        return self.segment_order[self.micro_batch_start[m] : self.micro_batch_end[m]]

    def segment_steps(self) -> np.ndarray:
        """``(base.num_segments,)`` the optimizer step that trains each segment of ``base`` (every
        segment is in exactly one micro-batch; -1 for none). Vectorised over the filled slots."""
        flat = self.assignment.reshape(-1)
        slots = np.flatnonzero(flat >= 0)
        ids = flat[slots]
        sizes = self.micro_batch_end[ids] - self.micro_batch_start[ids]
        starts = np.repeat(self.micro_batch_start[ids] - np.cumsum(sizes) + sizes, sizes)
        positions = self.segment_order[starts + np.arange(int(sizes.sum()))]
        out = np.full(self.base.num_segments, -1, dtype=np.int64)
        out[positions] = np.repeat(slots // (self.world_size * self.accum_steps), sizes)
        return out

    def micro_batch_examples(self, m: int) -> np.ndarray:
        return self.base.example_ids[self.micro_batch_segments(m)]

    def rank_micro_batches(self, rank: int) -> np.ndarray:
        """Micro-batches rank ``rank`` runs, in order: (num_steps * accum_steps,), -1 for an empty slot."""
        return self.assignment[:, rank, :].reshape(-1)

    @cached_property
    def micro_batches(self) -> Batches:
        """Every micro-batch as the one batch value over ``base``'s segments: batch ``m`` is micro-batch
        ``m`` (``order`` positions of ``base``), one segment per row padded to its longest (or the
        strategy's fixed width); where rows hold several examples the collator flattens a micro-batch
        into one row of at most the strategy's capacity × rows."""
        sizes = self.micro_batch_end - self.micro_batch_start
        ranges = np.stack([self.micro_batch_start, self.micro_batch_end]).T.reshape(-1)
        # Chunks 0, 2, 4, ... of the interleaved bounds are the micro-batches (odd ones: the gaps).
        order = self.segment_order[block_positions(ranges, np.arange(0, 2 * sizes.shape[0], 2))]
        offsets = offsets_of(sizes)
        width = micro_batch_widths(self.base, order, offsets)
        if self.base.spec.packs_rows and self.base.spec.micro_batch_limits().capacity is not None:
            # One row per micro-batch, holding its segments (the collator flattens them).
            return Batches(np.arange(sizes.shape[0] + 1, dtype=np.int64), width, offsets, order)
        return Batches(offsets, width, order=order)

    @cached_property
    def rank_cost(self) -> np.ndarray:
        """(num_steps, world_size) cost each rank carries at each step."""
        costs = np.where(self.assignment >= 0, self.micro_batch_cost[np.maximum(self.assignment, 0)], 0)
        return costs.sum(axis=2)

    @cached_property
    def step_imbalance(self) -> np.ndarray:
        """(num_steps,) max rank cost / mean rank cost (1.0 is perfect)."""
        rc = self.rank_cost.astype(np.float64)
        mean = rc.mean(axis=1)
        return np.divide(rc.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)

    @property
    def max_step_imbalance(self) -> float:
        return float(self.step_imbalance.max()) if self.num_steps else 1.0

    def idle_fraction(self) -> float:
        """Share of rank-time spent waiting for the slowest rank, if time is proportional to cost."""
        rc = self.rank_cost.astype(np.float64)
        busy = rc.sum()
        total = (rc.max(axis=1) * self.world_size).sum()
        return float(1.0 - busy / total) if total else 0.0

    # The former names ("unit" now means an example or document only; bench/ and benchmarks/ read them).
    unit_segments = micro_batch_segments
    unit_examples = micro_batch_examples
    rank_units = rank_micro_batches

    @property
    def unit_start(self) -> np.ndarray:
        return self.micro_batch_start

    @property
    def unit_end(self) -> np.ndarray:
        return self.micro_batch_end

    @property
    def unit_cost(self) -> np.ndarray:
        return self.micro_batch_cost


def distribute(
    plan: BatchPlan,
    world_size: int,
    *,
    accum_steps: int = 1,
    cost: str = "tokens",
    seed: int = 0,
    balance_rounds: int = 64,
    max_extra_steps: int | None = None,
    mix_steps: bool = False,
) -> DistributedPlan:
    """Deal a plan's micro-batches to ranks so every rank carries the same cost at every step.

    Args:
        plan: the base plan of one epoch (any strategy).
        world_size: number of ranks.
        accum_steps: gradient-accumulation micro-batches per rank per optimizer step.
        cost: ``"tokens"`` (real tokens), ``"attention"`` (Σ length², for long sequences) or ``"slots"``
            (padded tokens).
        seed: seeds the order of steps (combined with the plan's epoch).
        balance_rounds: most segment moves or swaps per uneven step (0 disables balancing).
        max_extra_steps: most optimizer steps the balancer may add when the uneven steps cannot be
            evened out in as many steps (long examples that fill a token budget alone leave their
            steps light, so the other steps cannot hold the rest); None: as many as it takes, 0: never
            more than ``ceil(num_batches / G)`` steps.
        mix_steps: with ``accum_steps > 1``, draw the micro-batches of each optimizer step across the
            cost range instead of taking ``G`` similar ones (:func:`_mix_strata`): micro-batch round
            ``j`` of every step comes from cost stratum ``j``, so a step of a length-grouped plan holds
            short and long examples alike and its tokens vary less from step to step (what a token
            weighs in the update follows them); every micro-batch, and so the padding, is the plan's,
            and every rank still gets one micro-batch of each stratum (the same cost).

    Returns:
        The distributed plan; each rank reads its micro-batches with :meth:`DistributedPlan.rank_micro_batches`.

    Phases (each a function below, with a drawn example): :func:`_cost_micro_batches` (every micro-batch of
    the plan, with its cost), :func:`_deal_tail` (micro-batches by cost in whole steps of
    ``G = world_size × accum_steps``; the ragged tail dealt again), :func:`_snake_deal` (each step's
    slots to ranks), :func:`_balance_uneven` and :func:`_reform_uneven` (steps still uneven, see
    :mod:`._tuning` for the thresholds), :func:`_shuffle_steps`, :func:`_costliest_first`.
    """
    if world_size < 1 or accum_steps < 1:
        raise ConfigError(f"world_size= and accum_steps= must be ≥ 1, got {world_size} and {accum_steps}")
    if cost not in COSTS:
        raise ConfigError(f"cost= must be one of {', '.join(COSTS)}; got {cost!r}")
    group = world_size * accum_steps
    seg_cost = _segment_costs(plan, cost)
    limits = plan.spec.micro_batch_limits()
    mbs = _cost_micro_batches(plan, seg_cost)
    by_cost = _deal_tail(mbs, group, seg_cost, plan.seg_lengths, limits)
    if mix_steps:
        by_cost = _mix_strata(by_cost, world_size, accum_steps, seed, plan.epoch)
    assignment = _snake_deal(by_cost, world_size, accum_steps)
    if world_size > 1 and mbs.start.shape[0] and balance_rounds:
        _balance_uneven(assignment, mbs, seg_cost, plan.seg_lengths, limits, balance_rounds)
        reformer = Reformer(seg_cost, plan.seg_lengths, limits, world_size, accum_steps, cost, balance_rounds)
        assignment = _reform_uneven(assignment, mbs, seg_cost, reformer, max_extra_steps)
    assignment = _shuffle_steps(assignment, seed, plan.epoch)
    if plan.spec.leads_with_costliest():
        assignment = _costliest_first(assignment, mbs, plan)
    return DistributedPlan(
        plan, world_size, accum_steps, cost, mbs.order, mbs.start, mbs.end, assignment, mbs.costs
    )


# --------------------------------------------------------------------------------------------------
# The phases of distribute(), in order
# --------------------------------------------------------------------------------------------------


@dataclass
class _MicroBatches:
    """The micro-batches being dealt, as ranges of one flat segment order: phases that re-form
    micro-batches append their new segment arrays (one concatenation per phase, not per micro-batch)
    and point the ranges there."""

    order: np.ndarray  # positions into the base plan's segments; micro-batch m is order[start[m]:end[m]]
    start: np.ndarray  # (num_micro_batches,)
    end: np.ndarray  # (num_micro_batches,)
    costs: np.ndarray  # (num_micro_batches,)

    def segments(self, u: int) -> np.ndarray:
        return self.order[self.start[u] : self.end[u]]

    def add(self, segments: np.ndarray, sizes: np.ndarray, seg_cost: np.ndarray) -> np.ndarray:
        """Append new micro-batches, the next ``sizes[k]`` of ``segments`` each; returns their ids."""
        starts = self.order.shape[0] + np.cumsum(sizes) - sizes
        first = self.start.shape[0]
        costs = np.zeros(sizes.shape[0], dtype=np.int64)
        if segments.size:
            nonempty = sizes > 0
            costs[nonempty] = np.add.reduceat(seg_cost[segments], (starts - self.order.shape[0])[nonempty])
        self.start = np.concatenate([self.start, starts])
        self.end = np.concatenate([self.end, starts + sizes])
        self.costs = np.concatenate([self.costs, costs])
        self.order = np.concatenate([self.order, segments.astype(np.int64, copy=False)])
        return np.arange(first, first + sizes.shape[0])


def _cost_micro_batches(plan: BatchPlan, seg_cost: np.ndarray) -> _MicroBatches:
    """Phase 1: every batch of the base plan is a micro-batch, costed as the sum of its segments::

    batches   [a b] [c] [d e f]     ->  micro-batches 0, 1, 2 over order = [a b c d e f]
    costs      5+3   9   2+2+1          costs = [8, 9, 5]
    """
    offsets = plan.row_offsets[plan.batch_offsets].astype(np.int64)
    order = np.arange(plan.num_segments, dtype=np.int64)
    costs = np.add.reduceat(seg_cost, offsets[:-1]) if len(offsets) > 1 else np.zeros(0, np.int64)
    return _MicroBatches(order, offsets[:-1].copy(), offsets[1:].copy(), costs)


def _deal_tail(
    mbs: _MicroBatches, group: int, seg_cost: np.ndarray, seg_len: np.ndarray, limits: MicroBatchLimits
) -> np.ndarray:
    """Phase 2: micro-batches by cost, costliest first, in whole steps of ``G`` slots. The ragged tail
    (the ``B mod G`` cheapest micro-batches and the step before them, more while they hold too few
    segments) is pooled and dealt again, costliest segment first, into a multiple of ``G`` new
    micro-batches: nothing dropped, no work added. Returns the micro-batch ids in slot order (-1: an
    empty slot)::

        G = 4, by cost         u7 u2 u5 u0 | u3 u1 u6 u4 | u8 u9         (B = 10, tail m = 2)
        pooled and re-dealt                 [u3 u1 u6 u4 u8 u9] -> n0..n7 (8 pieces, 2 whole steps)
        slot order             u7 u2 u5 u0 | n0 n1 n2 n3 | n4 n5 n6 n7
    """
    by_cost = argsort_descending(mbs.costs)  # (num_micro_batches,) costliest first, stable
    tail = tail_pool(by_cost, mbs.end - mbs.start, group)  # (t,) the cheapest first
    if not tail.size:
        return by_cost
    tail = tail[::-1]  # costliest first, as the micro-batches of the tail were dealt
    pool = gather_segments(mbs.order, mbs.start, mbs.end, tail)
    # As many pieces as keep the costliest segment from dominating a piece, and the count of micro-batches a
    # multiple of G: a multiple of G themselves, plus what donor micro-batches (tail_pool) add to the tail.
    extra = (tail.shape[0] - by_cost.shape[0]) % group
    biggest = int(seg_cost[pool].max(initial=1)) or 1
    fit = min(pool.shape[0], int(seg_cost[pool].sum()) // biggest)
    num_pieces = max(group, ((fit - extra) // group) * group) + extra
    num_pieces = min(num_pieces, -(-(tail.shape[0] - extra) // group) * group + extra)
    dealt = lpt_pieces(pool, seg_cost, seg_len, num_pieces, limits)
    if dealt is None or not dealt[1].min():
        # Indivisible or over-limit: cut the costliest splittable micro-batches of the pool in two instead.
        dealt = halve_units(pool, mbs.end[tail] - mbs.start[tail], seg_cost, group, extra)
    in_tail = np.zeros(by_cost.shape[0], dtype=bool)
    in_tail[tail] = True
    keep = by_cost[~in_tail[by_cost]]
    new_ids = mbs.add(*dealt, seg_cost)
    rank = np.argsort(-mbs.costs[new_ids], kind="stable")
    # An empty piece (fewer segments than slots) is an empty slot: -1.
    return np.concatenate([keep, np.where(dealt[1][rank] > 0, new_ids[rank], -1)])


def _mix_strata(by_cost: np.ndarray, world_size: int, accum_steps: int, seed: int, epoch: int) -> np.ndarray:
    """Phase 2b (``mix_steps``): the slots, costliest first, cut into ``accum_steps`` cost strata of
    whole runs of ``world_size`` (one micro-batch round: similar costs, one per rank); step ``s`` takes
    one run of every stratum, drawn at random without replacement (seeded by ``(seed, epoch,
    world_size, accum_steps)``), stratum ``j`` as its round ``j``. Vectorised::

        2 steps x 2 rounds x 1 rank, by cost   u0 u1 | u2 u3       (strata: costly, cheap)
        slot order                             u1 u2 | u0 u3       (each step: one of each)

    Empty slots (-1, the cheapest) stay in the last stratum, at most one run per step."""
    group = world_size * accum_steps
    num_steps = -(-by_cost.shape[0] // group)
    if accum_steps == 1 or num_steps < 2:
        return by_cost
    slots = np.full(num_steps * group, -1, dtype=np.int64)
    slots[: by_cost.shape[0]] = by_cost
    runs = slots.reshape(accum_steps, num_steps, world_size)  # runs[j]: stratum j, costliest first
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch), world_size, accum_steps, 1]))
    draw = rng.permuted(np.broadcast_to(np.arange(num_steps), (accum_steps, num_steps)), axis=1)
    mixed = np.take_along_axis(runs, draw[:, :, None], axis=1)  # (accum_steps, num_steps, world_size)
    return mixed.transpose(1, 0, 2).reshape(-1)  # step-major: step s is round 0, round 1, ...


def _snake_deal(by_cost: np.ndarray, world_size: int, accum_steps: int) -> np.ndarray:
    """Phase 3: consecutive runs of ``G`` slots make a step, dealt snake-wise over ranks inside it
    (vectorised over steps). Returns ``assignment`` ``(num_steps, world_size, accum_steps)``::

        2 ranks x 2 micro-batches, one step's slots by cost   u0 u1 u2 u3
        rank 0: [u0, u3]    rank 1: [u1, u2]                   (0 1 | 1 0: costliest meets cheapest)
    """
    group = world_size * accum_steps
    num_slots = -(-by_cost.shape[0] // group) * group
    num_steps = num_slots // group
    slots = np.full(num_slots, -1, dtype=np.int64)
    slots[: by_cost.shape[0]] = by_cost
    slots = slots.reshape(num_steps, group)
    j = np.arange(group)
    rnd, k = j // world_size, j % world_size
    rank_of = np.where(rnd % 2 == 0, k, world_size - 1 - k)
    assignment = np.full((num_steps, world_size, accum_steps), -1, dtype=np.int64)
    assignment[:, rank_of, rnd] = slots
    return assignment


def _rank_costs(assignment: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """``(num_steps, world_size)`` cost of each rank in each step."""
    return rank_costs(assignment, costs)


def _balance_uneven(
    assignment: np.ndarray,
    mbs: _MicroBatches,
    seg_cost: np.ndarray,
    seg_len: np.ndarray,
    limits: MicroBatchLimits,
    balance_rounds: int,
) -> None:
    """Phase 4, in place: steps more than :data:`~._tuning.BALANCE_TOLERANCE` uneven get their
    segments dealt again (costliest first to the least-loaded rank that can take them), then single
    segments moved or swapped between the heaviest and lightest rank, within the strategy's limits.
    Only those steps loop in Python::

        rank costs   [120, 80]   ->  move a 20-token segment   ->  [100, 100]
    """
    rc = _rank_costs(assignment, mbs.costs)
    uneven = np.flatnonzero(rc.max(axis=1) > BALANCE_TOLERANCE * np.maximum(rc.mean(axis=1), 1))
    pieces: list[np.ndarray] = [mbs.order]
    appended = mbs.order.shape[0]
    for s in uneven.tolist():
        step = assignment[s]
        members = {int(u): list(mbs.segments(u)) for u in step.ravel() if u >= 0}
        changed = repartition_step(step, members, seg_cost, seg_len, limits)
        changed |= balance_step(step, members, seg_cost, seg_len, limits, balance_rounds)
        if changed:
            for u, segs in members.items():
                arr = np.asarray(segs, dtype=np.int64)
                mbs.start[u], mbs.end[u] = appended, appended + arr.shape[0]
                appended += arr.shape[0]
                mbs.costs[u] = int(seg_cost[arr].sum()) if arr.size else 0
                pieces.append(arr)
    if len(pieces) > 1:
        mbs.order = np.concatenate(pieces)


def _reform_uneven(
    assignment: np.ndarray,
    mbs: _MicroBatches,
    seg_cost: np.ndarray,
    reformer: Reformer,
    max_extra_steps: int | None,
) -> np.ndarray:
    """Phase 5: steps still more than :data:`~._tuning.REFORM_TOLERANCE` uneven (a tail of coarse
    examples, one long example in a token budget) are formed again with donor steps, in place
    (:func:`~._mix.mix_uneven`); those still uneven are dissolved with their neighbours in cost order
    and formed again, every rank to the same cost (:func:`~._reform.reform_uneven`). Returns the new
    assignment (the kept steps, then the formed ones)::

        steps   s4 [300, 100]  s5 [160, 150]   ->  dissolved together  ->  [205, 205] [200, 200]
    """
    rc = _rank_costs(assignment, mbs.costs)
    if not (rc.max(axis=1) > REFORM_TOLERANCE * rc.mean(axis=1)).any():
        return assignment
    assignment, imbalance = _mix_uneven(assignment, rc, mbs, seg_cost, reformer, MIX_KEEP_TOLERANCE)
    uneven = np.flatnonzero(imbalance > REFORM_TOLERANCE)
    if not uneven.size:
        return assignment
    # The mixer once more over its own result, keeping whatever evens a step out further (compiled: a
    # fraction of a second). Where that brings every step within tolerance with no slot left empty,
    # the Python re-forming below (seconds on a few thousand segments) has nothing left to do.
    saved = (mbs.order, mbs.start, mbs.end, mbs.costs)
    rc = _rank_costs(assignment, mbs.costs)
    again, again_imbalance = _mix_uneven(assignment.copy(), rc, mbs, seg_cost, reformer, np.inf)
    if not (again_imbalance > REFORM_TOLERANCE).any() and not (again < 0).any():
        return again
    mixed_again = (mbs.order, mbs.start, mbs.end, mbs.costs)
    mbs.order, mbs.start, mbs.end, mbs.costs = saved
    found = reform_uneven(
        assignment, mbs.segments, uneven, reformer, imbalance, max_extra_steps,
        unit_max_costs(seg_cost, mbs.order, mbs.start, mbs.end),
    )  # fmt: skip
    if found is None:  # the mixer's most even is the second pass above: the same input, kept
        mbs.order, mbs.start, mbs.end, mbs.costs = mixed_again
        return again
    dissolved, new_steps = found
    loads = [mb.segs for step in new_steps for load in step for mb in load]
    ids = mbs.add(
        np.array([s for mb in loads for s in mb], dtype=np.int64),
        np.array([len(mb) for mb in loads]),
        seg_cost,
    )
    kept = np.ones(assignment.shape[0], dtype=bool)
    kept[dissolved] = False
    assignment = np.concatenate([assignment[kept], ids.reshape(len(new_steps), *assignment.shape[1:])])
    rc = _rank_costs(assignment, mbs.costs)
    if (rc.max(axis=1) > REFORM_TOLERANCE * rc.mean(axis=1)).any():  # the mixer's most even, at last
        assignment, _ = _mix_uneven(assignment, rc, mbs, seg_cost, reformer, np.inf)
    return assignment


def _mix_uneven(
    assignment: np.ndarray,
    rc: np.ndarray,
    mbs: _MicroBatches,
    seg_cost: np.ndarray,
    reformer: Reformer,
    partial: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`~._mix.mix_uneven` on ``mbs``; the steps in cost order again (formed steps take their
    donors' places) and their imbalance."""
    assignment, rc, segments, sizes = mix_uneven(
        assignment,
        rc,
        mbs.order,
        mbs.start,
        mbs.end,
        seg_cost,
        reformer.seg_len,
        reformer.limits,
        partial,
    )
    if sizes.size:
        mbs.add(segments, sizes, seg_cost)
        by_cost = np.argsort(-rc.sum(axis=1), kind="stable")
        assignment, rc = assignment[by_cost], rc[by_cost]
    return assignment, rc.max(axis=1) / np.maximum(rc.mean(axis=1), 1e-9)


def _shuffle_steps(assignment: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """Phase 6: the order of steps, shuffled by ``(seed, epoch, world_size, accum_steps)``: every rank
    computes the same permutation with no communication."""
    num_steps, world_size, accum_steps = assignment.shape
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch), world_size, accum_steps]))
    return assignment[rng.permutation(num_steps)]


def _costliest_first(assignment: np.ndarray, mbs: _MicroBatches, plan: BatchPlan) -> np.ndarray:
    """Phase 7, in place: the step holding the costliest micro-batch (as the spec ranks them,
    :meth:`~smart_batching.planners.PlannerSpec.costliest_keys`: the largest footprint, ties to the
    longest segment; ``group_by_length`` the longest segment; then the first slot) is swapped with
    step 0, and that micro-batch with micro-batch 0 of its rank. A permutation of whole steps (and of
    micro-batches inside one rank's step): every rank's cost at every step is unchanged.
    O(num_slots + num_segments), vectorised::

        steps      s0 s1 s2 s3        costliest micro-batch: rank 1, micro-batch 1 of s2
        ->         s2 s1 s0 s3        rank 1 of the new s0 runs it as micro-batch 0
    """
    flat = assignment.reshape(-1)  # (num_slots,) step-major
    slots = np.flatnonzero(flat >= 0)
    if slots.size == 0:
        return assignment
    ids = flat[slots]  # (num_filled,) micro-batches in slot order
    # The dealt micro-batches in id order, their segments gathered one after another: each micro-batch is then the
    # next range of them (one reduceat per key, near-sequential reads), its keys read back by slot.
    dealt = np.zeros(mbs.start.shape[0], dtype=bool)
    dealt[ids] = True
    used = np.flatnonzero(dealt)  # (num_used,)
    sizes = mbs.end[used] - mbs.start[used]
    ends = np.cumsum(sizes)
    spec = plan.spec
    fixed = spec.fixed_width(int(plan.lengths.max(initial=0)))
    width = None if fixed is None else np.full(used.shape[0], fixed, dtype=np.int64)
    lengths = plan.seg_lengths[gather_segments(mbs.order, mbs.start, mbs.end, used)]
    # One segment per row where rows are padded (packed rows are measured by their tokens).
    key, tie_break = (
        np.asarray(k) for k in spec.costliest_keys(BatchShapes(sizes, width, lengths, ends - sizes, ends))
    )
    top = costliest_batch(key, tie_break)  # a micro-batch ranked first; ties go to the first slot holding one
    ranked_first = np.zeros(mbs.start.shape[0], dtype=bool)
    ranked_first[used[(key == key[top]) & (tie_break == tie_break[top])]] = True
    best = int(np.argmax(ranked_first[ids]))
    step, rank, micro = np.unravel_index(int(slots[best]), assignment.shape)
    assignment[[0, step]] = assignment[[step, 0]]
    assignment[0, rank, [0, micro]] = assignment[0, rank, [micro, 0]]
    return assignment
