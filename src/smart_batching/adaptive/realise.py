"""A batch schedule realised on a plan: the epoch's micro-batches regrouped into optimizer steps whose
size follows the schedule, on one process or balanced over ranks.

The strategy's plan (any strategy) bounds each micro-batch by its budget (``max_tokens``, ``capacity``,
``batch_size``): what memory allows. A step of the schedule takes the plan's micro-batches in order
and cuts the one that crosses its target at an example boundary (:func:`~.schedule.cut_steps`), so it
is within half an example of its size; the rest of that micro-batch opens the next step::

    plan (budget 4 examples)   [a b c d] [e f g h] [i j k l] [m n o p] ...
    schedule (examples)        2, 3, 6, 8, ...
    steps                      [a b] | [c d] [e] | [f g h] [i j k] | [l] [m n o p] [q r s] | ...

Early, small steps run one micro-batch smaller than the budget; later, large steps run as many
micro-batches of the budget as their size needs: the budget per micro-batch grows where memory allows,
then the number of micro-batches. Every piece of a micro-batch is a subset of a planned one, so the
strategy's limits hold.

On ``world_size`` ranks the plan is first dealt into balanced rounds of one micro-batch per rank
(:func:`~smart_batching.distributed.distribute` with one accumulation step); every rank's stream is
then cut at its share of each step (the schedule's sizes and thresholds over ``world_size``), so
every rank's share of a step is within half an example of the same target: balanced at every step.
The ranks' step counts are made equal (the last step takes what is left), and so are the
micro-batch counts of each step (a rank with fewer splits its largest micro-batch), so collectives
never wait. All of it is a pure function of (plan, schedule, world size, seen): every rank computes
the same, with no communication.

Cost: one ``searchsorted`` per step and rank, O(num_steps x world_size x log n), plus the balancer's
deal on several ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from smart_batching.adaptive.schedule import BatchSchedule, SchedulePoint, cut_steps
from smart_batching.errors import ConfigError
from smart_batching.plan import Batches, block_positions, micro_batch_widths, offsets_of

BALANCE_ROUNDS = 0
"""Moves the balancer may make per round of one micro-batch per rank. 0: its vectorised deal of
micro-batches of similar cost to a round, no per-round evening out. Steps are evened out by cutting
every rank's stream at the same fraction of each round; evening out every round as well would take
92 s instead of 0.4 s for 200k examples on 8 ranks (token budget 8192) and lower the largest step
imbalance only from 1.11 to 1.09 (the rest is the example at each cut)."""


@dataclass(frozen=True, eq=False)
class SteppedPlan:
    """One epoch of optimizer steps realising a schedule (see the module docstring).

    Each rank's micro-batches are one :class:`~smart_batching.plan.Batches` value over ``base``'s
    segment table (``rank_batches[r]``: batch ``m`` is micro-batch ``m`` of rank ``r``, its ``order``
    the positions in ``base``), the value the planners and the distributed plan speak. Rank ``r`` runs,
    at step ``s``, micro-batches ``step_offsets[s] .. step_offsets[s+1]-1`` of its own (the same count
    on every rank).

    Attributes:
        base: The strategy's plan of the epoch.
        schedule: The resolved schedule (no shares left).
        world_size: Ranks.
        seen_before: Units (tokens or examples) consumed before this epoch, all ranks together.
        weights: (num_segments,) each segment's weight: its tokens, or 1 for examples.
        step_offsets: (num_steps + 1,) micro-batch index (per rank) where each step starts.
        rank_batches: Per rank, its micro-batches in run order.
    """

    base: Any
    schedule: BatchSchedule
    world_size: int
    seen_before: int
    weights: np.ndarray
    step_offsets: np.ndarray
    rank_batches: tuple[Batches, ...]

    @property
    def rank_order(self) -> tuple[np.ndarray, ...]:
        """Per rank: positions in ``base``'s segment arrays, in run order."""
        return tuple(b.order for b in self.rank_batches)

    @property
    def rank_micro(self) -> tuple[np.ndarray, ...]:
        """Per rank: ``(num_micro_batches + 1,)`` offsets of its micro-batches into :attr:`rank_order`."""
        return tuple(b.batch_offsets for b in self.rank_batches)

    @property
    def num_steps(self) -> int:
        return int(self.step_offsets.shape[0] - 1)

    @property
    def micro_per_step(self) -> np.ndarray:
        """(num_steps,) micro-batches each rank runs at each step."""
        return np.diff(self.step_offsets)

    @property
    def num_empty(self) -> int:
        """Empty micro-batches (a rank with fewer examples than micro-batches at a step), all ranks."""
        return int(sum(np.count_nonzero(np.diff(m) == 0) for m in self.rank_micro))

    def micro_segments(self, rank: int, m: int) -> np.ndarray:
        """Segment positions (in ``base``) of micro-batch ``m`` of ``rank``."""
        off = self.rank_micro[rank]
        return self.rank_order[rank][off[m] : off[m + 1]]

    def step_segments(self, step: int, rank: int = 0) -> list[np.ndarray]:
        """Segment positions of each micro-batch ``rank`` runs at ``step``."""
        lo, hi = int(self.step_offsets[step]), int(self.step_offsets[step + 1])
        return [self.micro_segments(rank, m) for m in range(lo, hi)]

    def _per_rank_step(self, values: np.ndarray) -> np.ndarray:
        out = np.zeros((self.num_steps, self.world_size), dtype=np.int64)
        for r in range(self.world_size):
            csum = offsets_of(values[self.rank_order[r]])
            bounds = self.rank_micro[r][self.step_offsets]
            out[:, r] = csum[bounds[1:]] - csum[bounds[:-1]]
        return out

    @cached_property
    def rank_step_weight(self) -> np.ndarray:
        """(num_steps, world_size) weight (the schedule's unit) each rank carries at each step."""
        return self._per_rank_step(self.weights)

    @cached_property
    def rank_step_tokens(self) -> np.ndarray:
        """(num_steps, world_size) real tokens each rank carries at each step (what its compute follows)."""
        return self._per_rank_step(np.asarray(self.base.seg_lengths, dtype=np.int64))

    @property
    def step_weight(self) -> np.ndarray:
        """(num_steps,) realised size of each step, all ranks together."""
        return self.rank_step_weight.sum(axis=1)

    @property
    def step_tokens(self) -> np.ndarray:
        """(num_steps,) real tokens of each step, all ranks together."""
        return self.rank_step_tokens.sum(axis=1)

    @cached_property
    def step_targets(self) -> np.ndarray:
        """(num_steps,) the schedule's size at each step (at what was seen before it)."""
        seen = self.seen_before + np.concatenate([[0], np.cumsum(self.step_weight)[:-1]])
        return np.asarray(self.schedule.size_at(seen), dtype=np.int64)

    @property
    def max_step_imbalance(self) -> float:
        """Largest max/mean rank tokens over the steps (1.0: every step perfectly even)."""
        w = self.rank_step_tokens.astype(np.float64)
        mean = w.mean(axis=1)
        return float(
            np.max(np.divide(w.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0), initial=1.0)
        )

    def summary(self) -> dict[str, Any]:
        """The realised schedule in a few numbers (for ``analyze`` and the bench)."""
        w = self.step_weight
        return {
            "batch_schedule": str(self.schedule),
            "schedule_unit": self.schedule.unit,
            "num_steps": self.num_steps,
            "first_step_size": int(w[0]) if w.size else 0,
            "last_step_size": int(w[-2] if w.size > 1 else w[0]) if w.size else 0,
            "max_abs_step_error": int(np.abs(w - self.step_targets)[:-1].max(initial=0)),
            "micro_batches_per_step": {"min": int(self.micro_per_step.min()) if self.num_steps else 0,
                                       "max": int(self.micro_per_step.max()) if self.num_steps else 0},
            "empty_micro_batches": self.num_empty,
            "max_step_imbalance": self.max_step_imbalance,
        }  # fmt: skip


def segment_weights(plan: Any, unit: str) -> np.ndarray:
    """Weight of each segment of ``plan``: its tokens (``"tokens"``), or 1 (``"examples"``)."""
    if unit == "examples":
        return np.ones(plan.num_segments, dtype=np.int64)
    return np.asarray(plan.seg_lengths, dtype=np.int64)


def micro_batches(plan: Any, order: np.ndarray, offsets: np.ndarray) -> Batches:
    """Micro-batches ``order[offsets[m]:offsets[m+1]]`` of ``plan``'s segments as the one batch value:
    one segment per row, padded to its longest (the strategy's fixed width, or, where rows hold several
    examples, its capacity times rows: the collator flattens such a micro-batch into one row)."""
    return Batches(offsets, micro_batch_widths(plan, order, offsets), None, order)


def per_rank(schedule: BatchSchedule, world_size: int) -> BatchSchedule:
    """One rank's share of a resolved schedule: sizes and thresholds over ``world_size``."""
    if world_size == 1:
        return schedule
    points = tuple(
        SchedulePoint(max(1, int(round(p.size / world_size))), int(p.at) // world_size)
        for p in schedule.points
    )
    return BatchSchedule(schedule.kind, points, schedule.unit)


def realise(
    plan: Any,
    schedule: BatchSchedule,
    *,
    world_size: int = 1,
    seen_before: int = 0,
    seed: int = 0,
    cost: str = "tokens",
) -> SteppedPlan:
    """Regroup ``plan``'s micro-batches into steps that follow ``schedule`` (module docstring).

    Args:
        plan: The strategy's plan of one epoch.
        schedule: A schedule with its unit set; shares of the epoch are resolved against the epoch's
            total weight here.
        world_size: Ranks; each gets an equal share of every step.
        seen_before: Units consumed before this epoch (all ranks).
        seed: Seeds the balancer's order of rounds on several ranks.
        cost: What the balancer evens out on several ranks (``"tokens"``, ``"attention"``, ``"slots"``).

    Raises:
        ConfigError: a schedule without a unit; a step too small to give every rank an example.
    """
    if schedule.unit is None:
        raise ConfigError("batch_schedule: the schedule needs its unit (tokens or examples) to be realised")
    weights = segment_weights(plan, schedule.unit)
    if not schedule.is_resolved:
        schedule = schedule.resolve(int(weights.sum()))
    if world_size == 1:  # the plan's own order and micro-batches, cut where the schedule says
        orders = [np.arange(plan.num_segments, dtype=np.int64)]
        bounds = [np.asarray(plan.batch_bounds, dtype=np.int64)]
        cuts = [cut_steps(weights, schedule, seen=seen_before)]
    else:
        orders, bounds = _rank_streams(plan, world_size, seed, cost)
        cuts = _cut_rounds(orders, bounds, weights, schedule, seen_before)
    micro, step_offsets = _equal_micro_counts(orders, bounds, cuts, weights)
    batches = tuple(micro_batches(plan, o, m) for o, m in zip(orders, micro, strict=True))
    return SteppedPlan(plan, schedule, world_size, int(seen_before), weights, step_offsets, batches)


def _rank_streams(
    plan: Any, world_size: int, seed: int, cost: str
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each rank's micro-batches in order, from the balancer's rounds of one micro-batch per rank:
    (segment positions, micro-batch bounds into them) per rank."""
    from smart_batching.distributed import distribute

    d = distribute(plan, world_size, accum_steps=1, cost=cost, seed=seed, balance_rounds=BALANCE_ROUNDS)
    if d.num_empty_slots:
        raise ConfigError(
            f"batch_schedule: the plan has too few micro-batches for {world_size} ranks (a round would leave a "
            "rank without one); lower the number of processes or the budget per micro-batch"
        )
    orders, bounds = [], []
    # Chunks 0, 2, 4, ... of the interleaved bounds are the micro-batches (as DistributedPlan.micro_batches).
    ranges = np.stack([d.micro_batch_start, d.micro_batch_end]).T.reshape(-1)
    sizes = d.micro_batch_end - d.micro_batch_start
    for r in range(world_size):
        mbs = d.rank_micro_batches(r)
        orders.append(d.segment_order[block_positions(ranges, 2 * mbs)])
        bounds.append(offsets_of(sizes[mbs]))
    return orders, bounds


def _cut_rounds(
    orders: list[np.ndarray],
    bounds: list[np.ndarray],
    weights: np.ndarray,
    schedule: BatchSchedule,
    seen: int,
) -> list[np.ndarray]:
    """Step cuts of every rank's stream, all at the same point of the balancer's rounds.

    Round ``u`` holds micro-batch ``u`` of every rank, of about equal weight. A step ends where the
    rounds' cumulative weight (all ranks) reaches its target: inside round ``u`` at fraction ``f``, every
    rank cuts its micro-batch of that round at the example boundary closest to ``f`` of its weight (at
    least one example per rank and step). All ranks consume the same rounds, so their shares stay level
    step after step (no drift), and every rank has as many steps. Python per step; vectorised over ranks
    (every rank's cumulative weights are read from one array).
    """
    world_size = len(orders)
    sizes = np.array([o.shape[0] for o in orders], dtype=np.int64)
    csums = [offsets_of(weights[o]) for o in orders]
    rank_w = np.stack(
        [c[b[1:]] - c[b[:-1]] for c, b in zip(csums, bounds, strict=True)], axis=1
    )  # (rounds, W)
    round_w = rank_w.sum(axis=1)
    cum_rounds = offsets_of(round_w)  # (rounds + 1,)
    # All ranks' cumulative weights in one rising array: rank r's values are offset by r * span.
    span = int(max(c[-1] for c in csums)) + 1
    flat = np.concatenate([c + r * span for r, c in enumerate(csums)])
    first = offsets_of(sizes + 1)[:-1]  # where rank r's csum starts in flat
    starts = np.stack([b for b in bounds], axis=1)  # (rounds + 1, W) segment index of each round
    ranks = np.arange(world_size)

    def at(idx: np.ndarray) -> np.ndarray:
        """(W,) ``csums[r][idx[r]]`` of every rank, read from ``flat`` at once."""
        return flat[first + idx] - ranks * span

    x, y = schedule._xy()
    pos = np.zeros(world_size, dtype=np.int64)
    ends: list[np.ndarray] = []  # (W,) each step's cut of every rank
    done = 0
    while np.any(pos < sizes):
        seen_now = seen + done
        goal = done + (int(y[-1]) if seen_now >= x[-1] else int(schedule.size_at(seen_now)))
        if goal >= cum_rounds[-1]:
            end = sizes.copy()
        else:
            u = int(np.searchsorted(cum_rounds, goal, side="right")) - 1
            f = (goal - cum_rounds[u]) / max(int(round_w[u]), 1)
            local = at(starts[u]).astype(np.float64) + f * rank_w[u]  # each rank's goal, in its own weight
            j = np.searchsorted(flat, local + ranks * span, side="left") - first  # first end at/after it
            j = np.minimum(j, sizes)
            prev = np.maximum(j - 1, 0)
            here, before = at(j).astype(np.float64), at(prev).astype(np.float64)
            end = np.where(local - before <= here - local, prev, j)
            end = np.clip(end, pos + 1, sizes)
        ends.append(end)
        pos = end
        done = int(at(pos).sum())
    cuts = np.zeros((len(ends) + 1, world_size), dtype=np.int64)  # (num_steps + 1, W), 0 first
    if ends:
        cuts[1:] = np.stack(ends)
    return [np.ascontiguousarray(cuts[:, r]) for r in range(world_size)]


def _equal_micro_counts(
    orders: list[np.ndarray], bounds: list[np.ndarray], cuts: list[np.ndarray], weights: np.ndarray
) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """Micro-batch bounds per rank such that every rank runs as many micro-batches at each step: the
    rank's plan bounds and step cuts, and, where a rank has fewer than another at a step, its heaviest
    micro-batch there halved (by weight, at an example boundary) until it has as many; a rank with
    fewer examples than that gets empty micro-batches (the Trainer runs a two-token pass with no loss
    for them, so every rank runs as many passes). Vectorised over steps; Python only for the steps
    whose counts differ, per micro-batch added."""
    world_size = len(orders)
    micro = [np.union1d(bounds[r], cuts[r]).astype(np.int64) for r in range(world_size)]
    offs = [np.searchsorted(micro[r], cuts[r]) for r in range(world_size)]
    counts = np.stack([np.diff(o) for o in offs])  # (world_size, num_steps)
    k = counts.max(axis=0)
    for r in range(world_size):
        short = np.flatnonzero(counts[r] < k)
        if not short.size:
            continue
        csum = offsets_of(weights[orders[r]])
        added = []
        for s in short.tolist():
            edges = micro[r][offs[r][s] : offs[r][s + 1] + 1]
            while edges.shape[0] - 1 < k[s]:
                sizes = np.diff(edges)
                splittable = np.flatnonzero(sizes > 1)
                if not splittable.size:  # fewer examples than micro-batches: an empty one (a null pass)
                    edges = np.append(edges, edges[-1])
                    added.append(int(edges[-1]))
                    continue
                heavy = splittable[np.argmax((csum[edges[1:]] - csum[edges[:-1]])[splittable])]
                lo, hi = int(edges[heavy]), int(edges[heavy + 1])
                mid = min(max(int(np.searchsorted(csum, (csum[lo] + csum[hi]) / 2)), lo + 1), hi - 1)
                edges = np.insert(edges, heavy + 1, mid)
                added.append(mid)
        micro[r] = np.sort(np.concatenate([micro[r], np.asarray(added, dtype=np.int64)]))  # keeps repeats
    step_offsets = np.concatenate([[0], np.cumsum(k)]).astype(np.int64)
    return tuple(micro), step_offsets


__all__ = ["SteppedPlan", "micro_batches", "per_rank", "realise", "segment_weights"]
